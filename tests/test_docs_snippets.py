"""Every Python block of the README and the docs runs as written.

A page's ```python blocks run in order as one script, in a fresh namespace,
as a reader pasting them one after the other would run them; a block inside
a list item (indented fence) counts too. A block preceded by a line
``<!-- not run: <reason> -->`` is left out, and the reason must be given.

Pages run in this process, one namespace each, except those that need 8
devices, which run in a subprocess on 8 simulated CPU devices (a fresh
interpreter also keeps their global mesh away from the other pages).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Pages whose blocks other tests run, as a reader would (not twice: the
# suite must stay fast).
RUN_ELSEWHERE = {
  # On 8 simulated devices, checking what each block prints.
  "docs/how-to/data-parallel.md": "tests/test_distributed.py",
  "docs/how-to/elastic.md": "tests/test_elastic.py",
  "docs/how-to/microbatching.md": "tests/test_microbatch.py",
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

FENCE = re.compile(
  r"(?P<before>^[^\n]*\n)?^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)"
  r"^(?P=indent)```[ \t]*$",
  re.DOTALL | re.MULTILINE,
)
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")


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


def test_pages_left_to_other_tests_are_run_there():
  pages = set(_pages())
  for page, test_file in {**RUN_ELSEWHERE, **NOT_RUN_PAGES}.items():
    assert page in pages, f"{page} has no Python blocks any more"
    assert (ROOT / test_file).is_file(), test_file
  for page, test_file in RUN_ELSEWHERE.items():
    name = page.rsplit("/", 1)[-1]
    assert name in (ROOT / test_file).read_text(), (
      f"{test_file} no longer runs {page}"
    )


@pytest.mark.parametrize(
  "page",
  [
    page
    for page in _pages()
    if page not in RUN_ELSEWHERE and page not in NOT_RUN_PAGES
  ],
)
def test_page_runs(page, tmp_path, monkeypatch):
  assert blocks(page), f"{page}: every Python block is marked not run"
  # Pages may write files (checkpoints, plots): into a scratch directory.
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  source = script(page)
  if page in EIGHT_DEVICE_PAGES:
    _run_on_8_devices(page, source, tmp_path)
  else:
    exec(compile(source, str(ROOT / page), "exec"), {"__name__": "__main__"})


def _run_on_8_devices(page: str, source: str, tmp_path: pathlib.Path) -> None:
  path = tmp_path / "page.py"
  path.write_text(source)
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(
    [env.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(ROOT), env.get("PYTHONPATH", "")])
  )
  result = subprocess.run(
    [sys.executable, str(path)],
    env=env,
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, f"{page}:\n{result.stdout}\n{result.stderr}"
