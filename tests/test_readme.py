"""The README's figures are the benchmark page's, and it holds no others.

The README's one table compares ``accumulate`` with ``closing=`` against
``optax.MultiSteps`` on the GPU run that docs/benchmarks.md records: every
figure of it is read here from that page's tables (the window times and the
program the GPU compiled for itself), and every ratio is recomputed. A
figure anywhere else in the README's prose fails the test: dated figures
live on the benchmark page.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "docs/benchmarks.md").read_text()

# The section of docs/benchmarks.md that the README's table comes from, and
# the anchor the README links to (mkdocs' slug of that heading).
GPU_SECTION = "## 0.6.4 on one H200 (2026-12-04)"
GPU_ANCHOR = "docs/benchmarks.md#064-on-one-h200-2026-12-04"
OURS = "`accumulate`, `closing=` (host)"
MULTISTEPS = "`optax.MultiSteps(adam)`"
CALLS_PER_WINDOW = 4
FIGURE = re.compile(r"\d+(?:\.\d+)?")


def section(text: str, heading: str) -> str:
  start = text.index(heading)
  end = text.find("\n## ", start + len(heading))
  return text[start : end if end >= 0 else len(text)]


def tables(text: str) -> list[list[list[str]]]:
  """The markdown tables of ``text``, each a list of rows of cells (the
  header row first, the separator row left out)."""
  found: list[list[list[str]]] = []
  current: list[list[str]] = []
  for line in [*text.splitlines(), ""]:
    if line.startswith("|"):
      cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
      if not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
        current.append(cells)
    elif current:
      found.append(current)
      current = []
  return found


def by_row(table: list[list[str]]) -> dict[str, dict[str, str]]:
  """``{row label: {column header: cell}}``."""
  header = table[0]
  return {row[0]: dict(zip(header, row, strict=True)) for row in table[1:]}


def figure(cell: str) -> float:
  """The first figure of a cell (``0.301 (1.15x)`` -> 0.301)."""
  match = FIGURE.search(cell)
  assert match, cell
  return float(match.group())


def gpu_tables() -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
  """The window times and the GPU's own program, from the benchmark page."""
  found = tables(section(BENCHMARKS, GPU_SECTION))
  windows = [t for t in found if t[0][0] == "window (ms)"]
  programs = [t for t in found if t[0][0] == "program"]
  assert len(windows) == 1 and len(programs) == 1, found
  return by_row(windows[0]), by_row(programs[0])


def window_column(windows: dict[str, dict[str, str]], label: str) -> str:
  """The window table's column of the model size a README label names."""
  size = re.search(r"(\d+(?:\.\d+)?M) parameters", label)
  assert size, label
  columns = [
    column
    for column in windows[MULTISTEPS]
    if re.search(rf"(?:^|\s){re.escape(size.group(1))}(?:\s|$)", column)
  ]
  assert len(columns) == 1, (label, columns)
  return columns[0]


def expected_rows() -> dict[str, tuple[str, str]]:
  """The README's rows as they must read: label -> (MultiSteps, ours)."""
  windows, programs = gpu_tables()
  ours, theirs = programs[OURS], programs[MULTISTEPS]
  # A window: micro-steps on every call but the last, which closes it.
  bytes_ours = (CALLS_PER_WINDOW - 1) * figure(ours["micro-step MiB"]) + figure(
    ours["closing step MiB"]
  )
  bytes_theirs = (CALLS_PER_WINDOW - 1) * figure(
    theirs["micro-step MiB"]
  ) + figure(theirs["closing step MiB"])
  peak_theirs = max(
    figure(theirs["micro-step peak MiB"]),
    figure(theirs["closing step peak MiB"]),
  )
  # The program table's model is the 16.8M-parameter MLP.
  assert "`compiled_here`, 4 x 2048² MLP, 16.8M parameters" in BENCHMARKS
  rows = {
    "MiB moved per window, 16.8M parameters": (
      f"{bytes_theirs:.1f}",
      f"{bytes_ours:.1f} ({bytes_ours / bytes_theirs:.2f}x)",
    ),
    "peak memory MiB, 16.8M parameters": (
      f"{peak_theirs:.1f}",
      f"{figure(ours['closing step peak MiB']):.1f}"
      f" ({figure(ours['micro-step peak MiB']):.1f} on a micro-step)",
    ),
  }
  for size in ("0.13M", "16.8M", "134M"):
    label = f"ms per window, {size} parameters"
    column = window_column(windows, label)
    mine, theirs_ms = windows[OURS][column], windows[MULTISTEPS][column]
    ratio = figure(mine) / figure(theirs_ms)
    rows[label] = (theirs_ms, f"{figure(mine):.3f} ({ratio:.2f}x)")
    # The page's own ratio agrees with its figures.
    assert mine == rows[label][1], (column, mine)
  return rows


def readme_table() -> list[list[str]]:
  found = tables(README)
  assert len(found) == 1, found
  return found[0]


def test_the_readme_table_is_the_benchmark_pages():
  table = readme_table()
  header = table[0]
  assert header == [
    "one H200, Adam, 4 calls per window",
    "`optax.MultiSteps`",
    "`accumulate`, `closing=`",
  ], header
  # The run the header names.
  assert "H200" in GPU_SECTION
  assert f"{CALLS_PER_WINDOW} calls per window" in section(
    BENCHMARKS, GPU_SECTION
  )
  assert "Adam" in section(BENCHMARKS, GPU_SECTION)
  rows = {row[0]: tuple(row[1:]) for row in table[1:]}
  assert rows == expected_rows()


def test_the_readme_links_the_run_its_table_comes_from():
  assert f"({GPU_ANCHOR})" in README
  heading = GPU_SECTION.removeprefix("## ")
  # mkdocs' slug: lowercase, punctuation dropped, spaces to hyphens.
  slug = re.sub(r"[^\w\s-]", "", heading.lower()).strip()
  assert GPU_ANCHOR.endswith("#" + re.sub(r"\s+", "-", slug))


def _prose(text: str) -> str:
  """The README without its code blocks, its table and its link targets."""
  text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
  text = "\n".join(
    line for line in text.splitlines() if not line.startswith("|")
  )
  return re.sub(r"\]\([^)]*\)", "]", text)


def test_no_other_figure_in_the_readme():
  prose = _prose(README)
  # Figures inside inline code are commands and names, not measurements.
  outside_code = re.sub(r"`[^`]*`", "", prose)
  assert not re.findall(r"\d", outside_code), [
    line for line in outside_code.splitlines() if re.search(r"\d", line)
  ]


def test_the_readme_sends_gpu_users_to_the_hosts_schedule():
  assert "gpu_compiler_options" not in README
  assert 'static_argnames="closing"' in README
  assert "closing=" in README


def test_the_readme_is_short():
  assert len(README.splitlines()) <= 95
