"""Every Python block of the README and the docs runs, and prints what it says.

A page's ```python blocks run in order as one script, in a fresh namespace,
as a reader pasting them one after the other would run them; a block inside
a list item (indented fence) counts too. A block preceded by a line
``<!-- not run: <reason> -->`` is left out, and the reason must be given.

What a page shows is checked too: a line ``print(...)  # value`` claims that
the call prints ``value``, and the test compares what it did print with the
comment (see :func:`check_claim` for how a comment is read, and which
comments are prose rather than a value).

Pages run in this process, one namespace each, except those that need 8
devices, which run in a subprocess on 8 simulated CPU devices (a fresh
interpreter also keeps their global mesh away from the other pages).
"""

from __future__ import annotations

import ast
import builtins
import collections
import decimal
import functools
import importlib
import importlib.metadata
import inspect
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from typing import Any, NamedTuple

import jax
import pytest
from helpers import cpu_process_environment

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Pages that another test runs, as a reader would, checking every value the
# page prints (not twice: the suite must stay fast): the page, and the test
# (module, function) whose own code names the page and checks its output.
RUN_ELSEWHERE = {
  "docs/how-to/data-parallel.md": (
    "test_distributed",
    "test_data_parallel_how_to_runs",
  ),
}

# Pages whose blocks cannot run in one process, and where what they show is
# tested instead.
NOT_RUN_PAGES = {
  # jax.distributed.initialize joins several processes; the page's recipe
  # runs as two processes of tests/multihost_worker.py.
  "docs/how-to/multi-host.md": "tests/test_multihost.py",
}

# Pages whose blocks build a mesh of 8 devices.
EIGHT_DEVICE_PAGES = {"docs/how-to/testing.md"}

# Pages whose blocks compile with XLA:GPU (audits.compile_for_gpu):
# they need JAX's CUDA plugin, which CI installs; elsewhere they are skipped.
GPU_COMPILER_PAGES = {"docs/compiled-window.md", "docs/how-to/gpu.md"}

# Pages whose blocks compile for a TPU (audits.compile_for_tpu):
# they need libtpu, which CI installs; elsewhere they are skipped.
TPU_COMPILER_PAGES = {"docs/how-to/tpu.md"}

# Claims that are wrong today, (page, line) -> why. Each is expected to
# disagree with what the line prints; one that agrees again fails the test,
# so that its entry is removed.
WRONG_TODAY: dict[tuple[str, int], str] = {}

# Pages that fail as a reader would run them, page -> why; expected to fail
# (strictly: a page that runs again fails the test, to remove its entry).
BROKEN_TODAY: dict[str, str] = {}

# Public submodules that `import ga_optax` does not import. Other tests of
# this process have imported them; a reader's fresh interpreter has not, so
# they are hidden while a page runs (a page must import what it uses).
NOT_IMPORTED_WITH_THE_PACKAGE = ("testing",)

FENCE = re.compile(
  r"(?P<before>^[^\n]*\n)?^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)"
  r"^(?P=indent)```[ \t]*$",
  re.DOTALL | re.MULTILINE,
)
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")
# A print call on one line, and the comment after it.
PRINT_LINE = re.compile(
  r"^(?P<indent>\s*)(?P<call>print\(.*\))(?:\s+#\s*(?P<comment>.*?))?\s*$"
)
# A comment alone on its line, with its indentation.
COMMENT_LINE = re.compile(r"^(?P<indent>\s*)#\s*(?P<comment>.*?)\s*$")


def _pages() -> list[str]:
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
  return [
    page.relative_to(ROOT).as_posix()
    for page in pages
    if "```python" in page.read_text()
  ]


def blocks(page: str) -> list[tuple[int, str]]:
  """The page's Python blocks to run, as ``(line number, code)``."""
  return blocks_in((ROOT / page).read_text(), page)


def blocks_in(text: str, name: str) -> list[tuple[int, str]]:
  found, not_run = [], 0
  for match in FENCE.finditer(text):
    marker = NOT_RUN.match(match.group("before") or "")
    if marker:
      assert marker.group("reason"), f"{name}: say why a block is not run"
      not_run += 1
      continue
    line = text.count("\n", 0, match.start("code")) + 1
    found.append((line, textwrap.dedent(match.group("code"))))
  # A fence the pattern missed would be a block silently never run.
  assert len(found) + not_run == text.count("```python"), name
  return found


def script(page: str) -> str:
  """The page's blocks as one script whose line numbers are the page's."""
  lines: list[str] = []
  for line, code in blocks(page):
    lines += [""] * (line - 1 - len(lines))
    lines += code.splitlines()
  return "\n".join(lines) + "\n"


# What a page claims it prints.


class Claim(NamedTuple):
  """A line ``print(...)  # comment`` of a page's script, or a line
  ``print(...)`` with the comment on the lines right below it."""

  line: int
  comment: str


def claims_in(source: str) -> list[Claim]:
  """The one-line print calls of ``source`` that carry a comment.

  The comment is on the call's line, or, for a call without one, on the
  comment lines right below it at the call's indentation (joined): a
  claim too long for the call's line is a claim all the same.
  """
  lines = source.splitlines()
  found = []
  for number, text in enumerate(lines, start=1):
    match = PRINT_LINE.match(text)
    if not match:
      continue
    try:
      ast.parse(match.group("call"), mode="eval")
    except SyntaxError:
      continue  # A '#' inside the call's strings, or a call over lines.
    comment = match.group("comment")
    if comment is None:
      below = []
      for following in lines[number:]:
        line_comment = COMMENT_LINE.match(following)
        if not line_comment or line_comment["indent"] != match["indent"]:
          break
        below.append(line_comment["comment"])
      comment = " ".join(below) or None
    if comment is not None:
      found.append(Claim(number, comment))
  return found


# A lowercase word of letters, hyphens and apostrophes: English, not a value.
PROSE_WORD = re.compile(r"^[a-z]+(?:['-][a-z]+)*[,:;]?$")
# A value written as an expression of names: an operator between spaces
# ("16 / D"), or a lowercase name called on arguments ("schedule(1)").
FORMULA = re.compile(r" [-+*/] |(?:^|[^\w.])[a-z_]\w*\(")
INTEGER = re.compile(r"^[-+]?\d+$")
NUMBER = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")


def _is_prose(text: str) -> bool:
  words = text.split()
  return (
    not words or bool(PROSE_WORD.match(words[0])) or bool(FORMULA.search(text))
  )


def claimed_value(comment: str) -> str | None:
  """The value a comment claims, or None when the comment is prose.

  The claim is the comment up to its first ``": "``; what follows explains
  it (``# 2: one AdamW step per 8 micro-batches`` claims ``2``). The claim
  is prose, and nothing is checked, when it starts with a lowercase English
  word (``# the wrapped optimizer's state``), or when it writes the value
  as an expression of names rather than the value itself (an operator
  between spaces, ``# (16 / D, 64)``, or a lowercase name called on
  arguments, ``# schedule(1)``). Prose followed by ``": value"`` claims
  that value (``# updates applied so far: 1`` claims ``1``).
  """
  claim = comment.split(": ", 1)[0]
  if not _is_prose(claim):
    return claim
  tail = comment.rsplit(": ", 1)[-1] if ": " in comment else ""
  if tail and not _is_prose(tail):
    return tail
  return None


def _token(text: str) -> str:
  """A token as compared: without trailing list punctuation."""
  return text.rstrip(",:;")


def _tokens_agree(printed: str, claimed: str) -> bool:
  """One printed token against the claim's, as the claim is written.

  An integer claim must be met exactly; a decimal claim within half a unit
  of its last digit written (``5e-08`` accepts 4.5e-08 to 5.5e-08, ``11.0``
  accepts 10.95 to 11.05); anything else (``True``, ``float32[16,64]``,
  ``pinned_host``) must be printed as written.
  """
  if INTEGER.match(claimed):
    return NUMBER.match(printed) is not None and float(printed) == int(claimed)
  if NUMBER.match(claimed):
    if not NUMBER.match(printed):
      return False
    exponent = decimal.Decimal(claimed).as_tuple().exponent
    assert isinstance(exponent, int)
    half_unit = 0.5 * 10.0**exponent
    return abs(float(printed) - float(claimed)) <= half_unit * (1 + 1e-9)
  return printed == claimed


def check_claim(comment: str, outputs: list[str]) -> str | None:
  """Why ``outputs`` (one string per call) disagree with ``comment``.

  None when they agree, or when the comment is prose (see
  :func:`claimed_value`). The printed words of every call, in order, must
  begin the claim word for word: a line run in a loop claims the values of
  its calls in turn (``# False, False, False, True``), a line printing
  several values claims them all (``# 5 0``), and words of the claim past
  the printed ones explain it (``# 6 updates, 3 of them after the move``).
  """
  value = claimed_value(comment)
  if value is None:
    return None
  if not outputs:
    return f"claims {value!r} but never printed"
  printed = [_token(word) for output in outputs for word in output.split()]
  claimed = [_token(word) for word in value.split()]
  if len(claimed) < len(printed) or not all(
    _tokens_agree(got, want)
    for got, want in zip(printed, claimed[: len(printed)], strict=True)
  ):
    return f"claims {value!r} but printed {' | '.join(outputs)!r}"
  return None


class PrintRecorder:
  """A ``print`` for a page's namespace: prints, and records by page line."""

  def __init__(self, filename: str) -> None:
    self.filename = filename
    self.outputs: dict[int, list[str]] = collections.defaultdict(list)

  def __call__(self, *args: Any, **kwargs: Any) -> None:
    builtins.print(*args, **kwargs)
    if kwargs.get("file") not in (None, sys.stdout):
      return
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename != self.filename:
      frame = frame.f_back
    if frame is not None:
      text = io.StringIO()
      builtins.print(*args, sep=kwargs.get("sep", " "), end="", file=text)
      self.outputs[frame.f_lineno].append(text.getvalue())


def run_page(page: str) -> dict[int, list[str]]:
  """Runs the page's script here; returns what each line printed."""
  filename = str(ROOT / page)
  recorder = PrintRecorder(filename)
  namespace = {"__name__": "__main__", "print": recorder}
  exec(compile(script(page), filename, "exec"), namespace)
  return dict(recorder.outputs)


def wrong_claims(page: str, outputs: dict[int, list[str]]) -> dict[int, str]:
  """The page's claims that disagree with what it printed, by line."""
  return {
    claim.line: problem
    for claim in claims_in(script(page))
    if (problem := check_claim(claim.comment, outputs.get(claim.line, [])))
  }


# The tests.


def test_blocks_in_list_items_and_blocks_not_run():
  text = textwrap.dedent("""\
    Text.

    ```python
    a = 1
    ```

    1. In a list item:

        ```python
        if a:
          b = 2
        ```

    <!-- not run: needs a GPU -->
    ```python
    raise SystemExit
    ```
    """)
  assert blocks_in(text, "page") == [(4, "a = 1\n"), (10, "if a:\n  b = 2\n")]
  with pytest.raises(AssertionError, match="say why"):
    blocks_in("<!-- not run: -->\n```python\npass\n```\n", "page")


@pytest.mark.parametrize(
  ("comment", "outputs", "agrees"),
  [
    ("2: one AdamW step per 8 micro-batches", ["2"], True),
    ("2: one AdamW step per 8 micro-batches", ["16"], False),
    ("False, False, False, True", ["False", "False", "False", "True"], True),
    ("False, False, False, True", ["False", "True", "False", "True"], False),
    ("5 0", ["5 0"], True),
    ("5 0", ["5 1"], False),
    ("6 updates, 3 of them after the move", ["6"], True),
    ("5e-08 here: float32 rounding", ["5.4e-08"], True),
    ("5e-08 here: float32 rounding", ["4.4e-08"], False),
    ("11.0 12", ["11.04 12"], True),
    ("11.0 12", ["11.1 12"], False),
    ("2", ["2.0"], True),
    ("2", ["2.5"], False),
    ("(3,): one per micro-batch", ["(3,)"], True),
    ("float32[16@data,64]", ["float32[16@data,64]"], True),
    ("float32[16@data,64]", ["float32[16,64]"], False),
    ("True", ["False"], False),
    ("True", [], False),
    ("3", ["3 4"], False),
    ("updates applied so far: 1", ["1"], True),
    ("updates applied so far: 1", ["4"], False),
    # Prose: nothing is claimed, whatever was printed.
    ("the wrapped optimizer's state", ["anything"], True),
    ("micro-steps in the open window (0: just closed)", ["7"], True),
    ("(16 / D, 64)", ["(2, 64)"], True),
    ("schedule(1)", ["0.001"], True),
  ],
)
def test_a_claim_is_read_as_written(comment, outputs, agrees):
  assert (check_claim(comment, outputs) is None) == agrees


def test_claims_are_one_line_print_calls_with_a_comment():
  source = textwrap.dedent("""\
    print(1)  # 1
    print("a # b")
    x = 2  # 2
    print(x)
      print(int(x))  # 2: indented, in a loop
    print(x + 1)
    # 3 on the line below,
    # and on the next
      # not this one: indented deeper
    print(x)

    # not this one either: a line between
    """)
  assert claims_in(source) == [
    Claim(1, "1"),
    Claim(5, "2: indented, in a loop"),
    Claim(6, "3 on the line below, and on the next"),
  ]


def test_pages_left_to_other_tests_are_run_there():
  pages = set(_pages())
  for page, test_file in NOT_RUN_PAGES.items():
    assert page in pages, f"{page} has no Python blocks any more"
    assert (ROOT / test_file).is_file(), test_file
    # What a page not run claims is checked nowhere: it must claim nothing.
    assert not [
      claim
      for _, code in blocks(page)
      for claim in claims_in(code)
      if claimed_value(claim.comment) is not None
    ], f"{page} claims printed values that no test checks"
  for page, (module_name, test_name) in RUN_ELSEWHERE.items():
    assert page in pages, f"{page} has no Python blocks any more"
    module = importlib.import_module(module_name)
    test = getattr(module, test_name, None)
    assert callable(test), f"{module_name}.{test_name} is gone; it ran {page}"
    # The test itself reads the page: the page's path is a name its code
    # uses (a comment or another test of the file does not count) ...
    used = [getattr(module, name, None) for name in test.__code__.co_names]
    assert (ROOT / page).resolve() in {
      pathlib.Path(value).resolve()
      for value in used
      if isinstance(value, (str, pathlib.Path))
    }, f"{module_name}.{test_name} no longer reads {page}"
    # ... and it captures what the page prints, to check it.
    assert "capsys" in inspect.signature(test).parameters, (
      f"{module_name}.{test_name} no longer checks what {page} prints"
    )


def test_wrong_claims_name_real_lines():
  for (page, line), reason in WRONG_TODAY.items():
    assert reason, f"{page}:{line}: say why the claim is wrong"
    lines = [claim.line for claim in claims_in(script(page))]
    assert line in lines, f"{page}:{line} is no print line with a claim"


@pytest.mark.parametrize(
  "page",
  [
    pytest.param(
      page,
      marks=[pytest.mark.xfail(strict=True, reason=BROKEN_TODAY[page])]
      if page in BROKEN_TODAY
      else [],
    )
    for page in _pages()
    if page not in RUN_ELSEWHERE and page not in NOT_RUN_PAGES
  ],
)
def test_page_runs(page, tmp_path, monkeypatch):
  assert blocks(page), f"{page}: every Python block is marked not run"
  if page in GPU_COMPILER_PAGES and not os.environ.get("CI"):
    from ga_optax._src.audits import GpuCompilerUnavailable, gpu_devices

    try:
      gpu_devices()
    except GpuCompilerUnavailable as error:
      pytest.skip(f"{page} compiles with XLA:GPU: {error}")
  if page in TPU_COMPILER_PAGES and not os.environ.get("CI"):
    from ga_optax._src.audits import TpuCompilerUnavailable, tpu_devices

    try:
      tpu_devices()
    except TpuCompilerUnavailable as error:
      pytest.skip(f"{page} compiles for a TPU: {error}")
  # Pages may write files (checkpoints, plots): into a scratch directory.
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  package = importlib.import_module("ga_optax")
  for name in NOT_IMPORTED_WITH_THE_PACKAGE:
    monkeypatch.delattr(package, name, raising=False)
    monkeypatch.delitem(sys.modules, f"ga_optax.{name}", raising=False)
  if page in EIGHT_DEVICE_PAGES:
    outputs = _run_on_8_devices(page, tmp_path)
  else:
    outputs = run_page(page)
  wrong = wrong_claims(page, outputs)
  expected_wrong = {
    line for (wrong_page, line) in WRONG_TODAY if wrong_page == page
  }
  unexpected = {
    f"{page}:{line}": problem
    for line, problem in wrong.items()
    if line not in expected_wrong
  }
  assert not unexpected, unexpected
  fixed = sorted(expected_wrong - set(wrong))
  assert not fixed, f"{page}: lines {fixed} print what they claim now"


def _run_on_8_devices(
  page: str, tmp_path: pathlib.Path
) -> dict[int, list[str]]:
  """Runs the page in a fresh process on 8 devices; what each line printed."""
  record = tmp_path / "printed.json"
  runner = (
    "import json, sys\n"
    f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
    "import compile_level\n"
    "compile_level.from_environment()\n"
    "import test_docs_snippets as pages\n"
    f"outputs = pages.run_page({page!r})\n"
    f"open({str(record)!r}, 'w').write(json.dumps(outputs))\n"
  )
  result = subprocess.run(
    [sys.executable, "-c", runner],
    env=cpu_process_environment(8, ROOT),
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  if result.returncode != 0:
    raise AssertionError(f"{page}:\n{result.stdout}\n{result.stderr}")
  return {
    int(line): calls for line, calls in json.loads(record.read_text()).items()
  }


def test_the_hidden_submodules_are_not_imported_with_the_package():
  imported = subprocess.run(
    [
      sys.executable,
      "-c",
      "import sys, ga_optax; print(sorted(sys.modules))",
    ],
    env={**os.environ, "PYTHONPATH": str(ROOT)},
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  for name in NOT_IMPORTED_WITH_THE_PACKAGE:
    assert f"'ga_optax.{name}'" not in imported, name


# What a reader installs is what the pages use.

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _normalized(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _distribution(requirement: str) -> str:
  """``"jax[cuda13]>=0.10"`` -> ``"jax"``."""
  match = re.match(r"[A-Za-z0-9_.-]+", requirement)
  assert match, requirement
  return _normalized(match.group(0))


def _distributions(*extras: str) -> set[str]:
  """The project's own requirements: ``""`` for the dependencies."""
  requirements = [
    requirement
    for extra in extras
    for requirement in (
      PYPROJECT["dependencies"]
      if extra == ""
      else PYPROJECT["optional-dependencies"][extra]
    )
  ]
  return {
    _distribution(requirement)
    for requirement in requirements
    if not requirement.startswith("ga_optax")
  }


def _installed_with(distributions: set[str]) -> set[str]:
  """``distributions`` and what they require, as installed here."""
  found, pending = set(), list(distributions)
  while pending:
    name = pending.pop()
    if name in found:
      continue
    try:
      requirements = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
      continue  # Required on other platforms only (a marker).
    found.add(name)
    for requirement in requirements:
      if "extra ==" not in requirement:
        pending.append(_distribution(requirement))
  return found


def _imported_modules(source: str) -> set[str]:
  modules = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      modules |= {alias.name.split(".")[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      modules.add(node.module.split(".")[0])
  return modules


@functools.cache
def _demo_install() -> tuple[set[str], dict[str, list[str]]]:
  """What ``pip install ".[examples]"`` installs, and which distribution
  provides each importable module (read once: each reading scans every
  installed distribution's metadata)."""
  installed = _installed_with(_distributions("", "examples"))
  return installed, importlib.metadata.packages_distributions()


@pytest.mark.parametrize("page", _pages())
def test_pages_import_only_what_the_demo_install_brings(page):
  # A reader of the docs has run the demo's install, pip install
  # ".[examples]"; the test extra (chex, pytest...) is the project's own.
  installed, providers = _demo_install()
  missing = {
    module
    for module in _imported_modules(script(page))
    if module != "ga_optax"
    and module not in sys.stdlib_module_names
    and not {_normalized(name) for name in providers.get(module, [])}
    & installed
  }
  assert not missing, (
    f"{page} imports {sorted(missing)}, which pip install '.[examples]'"
    " does not install"
  )


def test_getting_started_says_what_each_install_brings():
  text = (ROOT / "docs/getting-started.md").read_text()
  comments = dict(
    re.findall(r"^pip install (\S+)\s+# (.*)$", text, flags=re.MULTILINE)
  )
  test_only = _distributions("test") - _installed_with(
    _distributions("", "examples")
  )
  for target, extras in ((".", ("",)), ('".[examples]"', ("examples",))):
    named = set(re.findall(r"[a-z][a-z0-9-]*", comments[target]))
    assert _distributions(*extras) <= named, (target, comments[target])
    assert not named & test_only, (target, comments[target])


# The README's two opening commands each stand alone.

VENV_COMMAND = re.compile(
  r"^python3 -m venv (?P<venv>\S+) && \. (?P<activated>\S+)/bin/activate"
  r' && pip install (?:-e )?(?P<target>"[^"]+")',
  re.MULTILINE,
)


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_demo_and_the_test_commands_make_their_own_environments(page):
  commands = VENV_COMMAND.findall((ROOT / page).read_text())
  assert [target for _, _, target in commands] == [
    '".[examples]"',
    '".[test]"',
  ], commands
  venvs = [venv for venv, _, _ in commands]
  for venv, activated, _ in commands:
    assert activated == venv, (page, venv, activated)
  # Run one after the other in a checkout, the second must not reuse (or
  # pollute) the first's environment.
  assert len(set(venvs)) == 2, venvs
  ignored = (ROOT / ".gitignore").read_text().splitlines()
  for venv in venvs:
    assert f"{venv}/" in ignored, venv


# The release a user installs: what pip gives, and what the CHANGELOG says.

# hatchling's regex version source, which pyproject.toml's
# [tool.hatch.version] uses: the first assignment to __version__ in the file.
HATCH_VERSION = re.compile(
  r"^(?:__version__|VERSION) *= *(['\"])v?(?P<version>.+?)\1",
  re.MULTILINE | re.IGNORECASE,
)
RELEASE_HEADING = re.compile(
  r"^(?P<version>\d+\.\d+\.\d+)(?: \((?P<date>\d{4}-\d{2}-\d{2})\))?$"
)


def test_the_changelog_sections_are_releases_the_newest_is_the_version():
  import ga_optax

  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  version_file = ROOT / pyproject["tool"]["hatch"]["version"]["path"]
  built = HATCH_VERSION.search(version_file.read_text())
  assert built is not None, version_file
  assert built["version"] == ga_optax.__version__
  headings = re.findall(
    r"^## (.*)$", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE
  )
  releases = [RELEASE_HEADING.match(heading) for heading in headings]
  assert all(releases), headings  # no "Unreleased", no milestone
  versions = [
    tuple(int(part) for part in release["version"].split("."))
    for release in releases
    if release
  ]
  assert versions == sorted(versions, reverse=True), headings
  newest = releases[0]
  assert newest is not None and newest["date"], headings[0]
  assert newest["version"] == ga_optax.__version__, headings[0]


# Links to the pages that explain what a reader will meet.

ROUNDING_EXPLAINED = (
  "not-equivalent.md#floating-point",
  "testing.md#leaves-only-rounding-moves-attention-key-biases",
)


def _heading_anchors(page: str) -> set[str]:
  """The anchors mkdocs gives a page's headings (toc's default slugify)."""
  anchors = set()
  for heading in re.findall(
    r"^#+ (.*)$", (ROOT / page).read_text(), re.MULTILINE
  ):
    words = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    anchors.add(re.sub(r"[-\s]+", "-", words))
  return anchors


@pytest.mark.parametrize(
  "page", ["docs/how-to/nnx.md", "docs/how-to/token-weighting.md"]
)
def test_pages_link_the_explanation_of_adam_amplifying_rounding(page):
  text = (ROOT / page).read_text()
  for target in ROUNDING_EXPLAINED:
    assert f"]({target})" in text or f"](../{target})" in text, (page, target)
    path, anchor = target.split("#")
    linked = (
      "docs/" + path if path == "not-equivalent.md" else "docs/how-to/" + path
    )
    assert anchor in _heading_anchors(linked), (linked, anchor)


# The Linen TrainState path of the migration guide.


def test_migration_moves_a_linen_train_state(monkeypatch, tmp_path):
  from flax.training import train_state

  import ga_optax

  monkeypatch.chdir(tmp_path)
  page = "docs/migration.md"
  source = script(page)
  namespace: dict[str, Any] = {"__name__": "__main__", "print": lambda *_: None}
  exec(compile(source, str(ROOT / page), "exec"), namespace)
  states = [
    value
    for value in namespace.values()
    if isinstance(value, train_state.TrainState)
  ]
  # A TrainState driven by MultiSteps, and one moved over to accumulate.
  moved = [
    state
    for state in states
    if any(
      isinstance(node, ga_optax.AccumulateState)
      for node in jax.tree.leaves(
        state.opt_state,
        is_leaf=lambda node: isinstance(node, ga_optax.AccumulateState),
      )
    )
  ]
  assert moved and len(moved) < len(states), [type(s.opt_state) for s in states]
  assert "ga_optax.apply_gradients(" in source


# Every page that shows a training loop shows the host's schedule for GPUs,
# with the reason, and links the run that measured it.

TRAINING_LOOP_PAGES = [
  "docs/getting-started.md",
  "docs/migration.md",
  "docs/how-to/linen.md",
  "docs/how-to/nnx.md",
  "docs/how-to/equinox.md",
  "docs/how-to/optax-chain.md",
  "docs/how-to/host-schedule.md",
  "docs/how-to/batch-size.md",
  "docs/how-to/flush.md",
  "docs/how-to/schedules.md",
  "docs/how-to/nonfinite.md",
  "docs/how-to/fused.md",
  "docs/how-to/host-memory.md",
  "docs/how-to/elastic.md",
  "docs/how-to/sharded-optimizer-state.md",
]
GPU_RUN = "benchmarks.md#064-on-one-h200-2026-12-04"


@pytest.mark.parametrize("page", TRAINING_LOOP_PAGES)
def test_training_loops_show_the_hosts_schedule_for_gpus(page):
  text = (ROOT / page).read_text()
  code = "\n".join(code for _, code in blocks(page))
  assert "closing=" in code, page
  assert "gpu_compiler_options" not in text, page
  assert "On a GPU" in text and GPU_RUN in text, page
  # The run the pages link to is where the link says.
  assert (
    "## 0.6.4 on one H200 (2026-12-04)"
    in (ROOT / "docs/benchmarks.md").read_text()
  )
