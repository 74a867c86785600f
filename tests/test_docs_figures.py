"""Figures in the docs' prose are read from where they come from.

A figure a page states in prose (a ratio, a size, a time) goes stale
silently when the run or the program it describes changes. Here each is
recomputed from the table it summarises (the H200 run of
docs/benchmarks.md, which tests/test_readme.py reads too), or read from the
bound a test holds the code to (``benchmarks/compiled_steps.py``'s
targets, which tests/test_gpu_program.py asserts). The pages listed in
``GUARDED`` hold no other measured figure in their prose: one added there
fails until a test reads it. Nothing here compiles.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from test_readme import BENCHMARKS, GPU_SECTION, by_row, figure, section, tables

from benchmarks import compiled_steps

ROOT = pathlib.Path(__file__).resolve().parent.parent
MULTISTEPS = "`optax.MultiSteps(adam)`"
HOST_ROWS = (
  "`accumulate`, `closing=` (host)",
  "`accumulate_and_apply`, `closing=` (host)",
)
DEVICE_ROWS = (
  "`accumulate`, device, XLA's defaults",
  "`accumulate_and_apply`, device, XLA's defaults",
)
BY_HAND = "the same work by hand (`benchmarks/host_scheduled.py`)"
# A measured figure: a ratio, a size, a time, a share, a small error.
MEASURED = re.compile(
  r"\d+(?:\.\d+)?x\b"
  r"|\d+(?:\.\d+)?\s?(?:KiB|MiB|GiB|KB|MB|GB|ms|µs)\b"
  r"|\d+(?:\.\d+)?%"
  r"|\d(?:\.\d+)?e-\d+"
)


def page(name: str) -> str:
  return (ROOT / name).read_text()


def prose(text: str) -> str:
  """``text`` without its code blocks, inline code and link targets."""
  text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.DOTALL | re.M)
  text = re.sub(r"`[^`]*`", "", text)
  return re.sub(r"\]\([^)]*\)", "]", text)


def measured_figures(text: str) -> list[str]:
  return MEASURED.findall(prose(text))


def window_table() -> dict[str, dict[str, str]]:
  found = [
    t
    for t in tables(section(BENCHMARKS, GPU_SECTION))
    if t[0][0] == "window (ms)"
  ]
  assert len(found) == 1, found
  return by_row(found[0])


def parameters(column: str) -> float:
  """Millions of parameters a column header names (``"4.2M"`` -> 4.2)."""
  match = re.search(r"(\d+(?:\.\d+)?)M\b", column)
  assert match, column
  return float(match.group(1))


def ratios(rows, keep) -> list[float]:
  """Each row's time over MultiSteps' in the columns whose size ``keep``s."""
  windows = window_table()
  theirs = windows[MULTISTEPS]
  found = []
  for row in rows:
    for column, cell in windows[row].items():
      if column == "window (ms)" or not keep(column):
        continue
      ratio = figure(cell) / figure(theirs[column])
      # The cell's own ratio, where it gives one, is its figures'.
      written = re.search(r"\((\d+\.\d+)x\)", cell)
      if written:
        assert written.group(1) == f"{ratio:.2f}", (row, column, cell)
      found.append(ratio)
  assert found, rows
  return found


def span(values: list[float], digits: int) -> str:
  return f"{min(values):.{digits}f}x to {max(values):.{digits}f}x"


def test_the_h200_prose_is_its_window_table():
  text = " ".join(section(BENCHMARKS, GPU_SECTION).split())
  host_large = ratios(HOST_ROWS, lambda column: parameters(column) >= 16.8)
  host_small = ratios(HOST_ROWS, lambda column: parameters(column) < 16.8)
  device_small = ratios(DEVICE_ROWS, lambda column: parameters(column) < 134)
  by_hand = ratios([BY_HAND], lambda column: parameters(column) < 16.8)
  windows = window_table()
  ours_over_hand = [
    figure(windows[HOST_ROWS[0]][column]) - figure(windows[BY_HAND][column])
    for column in windows[BY_HAND]
    if column != "window (ms)" and parameters(column) < 16.8
  ]
  assert (
    f"from 16.8M parameters its window takes {span(host_large, 2)}"
    f" MultiSteps', and below that {span(host_small, 1)}"
  ) in text
  assert f"the hand-written two programs take {span(by_hand, 2)} there" in text
  assert (
    f"{min(ours_over_hand):.2f} to {max(ours_over_hand):.2f} ms per window"
    " is still ga_optax's own"
  ) in text
  assert f"{span(device_small, 1)} MultiSteps' window below 134M" in text


def test_the_h200_program_prose_is_its_table():
  text = " ".join(section(BENCHMARKS, GPU_SECTION).split())
  programs = [
    t for t in tables(section(BENCHMARKS, GPU_SECTION)) if t[0][0] == "program"
  ]
  assert len(programs) == 1
  rows = by_row(programs[0])
  floor = rows["floor: gradient + add"]["micro-step MiB"]
  for name in HOST_ROWS:
    assert rows[name]["micro-step MiB"] == floor, name
  assert "The host-scheduled micro-step moves exactly the floor" in text
  device = figure(rows["`accumulate`, device"]["micro-step MiB"])
  theirs = figure(rows[MULTISTEPS]["micro-step MiB"])
  assert f"micro-step moves {device / theirs:.3f}x MultiSteps'" in text
  assert rows["`accumulate_and_apply`, device"]["micro-step MiB"] == floor
  assert "`accumulate_and_apply`'s the floor" in text


def test_the_gpu_page_quotes_the_h200_run():
  text = " ".join(page("docs/how-to/gpu.md").split())
  host = ratios(HOST_ROWS, lambda column: parameters(column) >= 16.8)
  device = ratios(DEVICE_ROWS, lambda column: parameters(column) < 134)
  assert f"a window of 4 took {span(host, 2)} `optax.MultiSteps`' time" in text
  assert "from 16.8M parameters on" in text
  assert (
    f"the device-scheduled windows took {span(device, 2)}"
    " `optax.MultiSteps`' time below 134M parameters"
  ) in text


def target(figure_name: str) -> float:
  (found,) = [
    bound
    for name, _, _, bound, _ in compiled_steps.TARGETS
    if name == figure_name
  ]
  return found


def test_the_host_schedule_page_states_the_tested_bounds():
  text = " ".join(page("docs/how-to/host-schedule.md").split())
  micro = target("accumulate(adam), closing=False / floor (gradient + add)")
  closing = target("accumulate(adam), closing=True / the same work by hand")
  assert f"holds its bytes moved within {micro:.2f}x the floor's" in text
  assert (
    f"holds its bytes within {closing:.2f}x the same work written by hand"
  ) in text


# Pages whose prose holds no measured figure but those read above (or, for
# the install's sizes, no measurement of ga_optax), each figure with the
# test that reads it.
GUARDED = {
  "README.md": {},  # tests/test_readme.py reads its one table
  "docs/how-to/host-schedule.md": {
    "1.01x": "test_the_host_schedule_page_states_the_tested_bounds",
    "1.05x": "test_the_host_schedule_page_states_the_tested_bounds",
  },
  "docs/how-to/gpu.md": {
    "0.47x": "test_the_gpu_page_quotes_the_h200_run",
    "0.72x": "test_the_gpu_page_quotes_the_h200_run",
    "1.46x": "test_the_gpu_page_quotes_the_h200_run",
    "2.26x": "test_the_gpu_page_quotes_the_h200_run",
    "400 MB": "the CUDA plugin's download, not a measurement",
    "4.7 GB": "jax[cuda13]'s download, not a measurement",
  },
}


@pytest.mark.parametrize("name", sorted(GUARDED))
def test_guarded_pages_hold_no_other_measured_figure(name):
  text = page(name)
  if name == "README.md":
    # Its table is tests/test_readme.py's.
    text = "\n".join(
      line for line in text.splitlines() if not line.startswith("|")
    )
  assert sorted(set(measured_figures(text))) == sorted(GUARDED[name]), name


def test_a_measured_figure_is_seen():
  assert measured_figures("took 0.47x, 64.3 MiB, 0.466 ms, 8.4% and 3e-4") == [
    "0.47x",
    "64.3 MiB",
    "0.466 ms",
    "8.4%",
    "3e-4",
  ]
  assert measured_figures("`0.47x` in code, [a](x.md#0.5x), k = 4") == []
