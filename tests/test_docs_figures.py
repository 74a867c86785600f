"""Figures in the docs' prose are read from where they come from.

A figure a page states in prose (a ratio, a size, a time, a share, a
small error) goes stale silently when the run or the program it describes
changes. Here each is recomputed from the table it summarises (the H200
run and the full CPU run of docs/benchmarks.md, which tests/test_readme.py
reads too; a guide's own dated table), from the arithmetic of the sizes it
states, or read from the bound or tolerance a test holds the code to. A
section that gives a date is the record of that day's run, and its tables
stay as measured; any other section holds no measured figure but those in
``READ``, each with what reads it, so a figure added there fails until a
test reads it. Nothing here compiles.
"""

from __future__ import annotations

import ast
import doctest
import pathlib
import re

import jax.numpy as jnp
import numpy as np
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
STATE_CARRYING = "the same state by hand (`benchmarks/state_carrying.py`)"
# A measured figure: a ratio, a size, a time, a share, a small error.
MEASURED = re.compile(
  r"\d+(?:\.\d+)?x\b"
  r"|\d+(?:\.\d+)?\s?(?:KiB|MiB|GiB|KB|MB|GB|ms|µs)\b"
  r"|\d+(?:\.\d+)?%"
  r"|\d(?:\.\d+)?e-\d+"
  r"|\d[\d,]*(?:\.\d+)?\s(?:B|bytes?)\b"
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
  reference = windows[STATE_CARRYING]
  over_reference = [
    figure(windows[row][column]) / figure(reference[column])
    for row in HOST_ROWS
    for column in reference
    if column != "window (ms)"
  ]
  assert (
    f"from 16.8M parameters its window takes {span(host_large, 2)}"
    f" MultiSteps', and below that {span(host_small, 1)}"
  ) in text
  assert f"the hand-written two programs take {span(by_hand, 2)} there" in text
  assert (
    f"the host-scheduled windows took {span(over_reference, 2)} its time"
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


# A section (from one heading to the next) that gives a date is the record
# of a run or a compile made that day, with what it measured; the benchmark
# page is all records. Every other section holds no measured figure but
# those listed in READ, each with what reads it; a figure added there fails
# until a test reads it.
RECORD_PAGES = {"docs/benchmarks.md"}
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def undated_figures(text: str) -> list[str]:
  """The measured figures of ``text``'s sections that give no date."""
  sections = re.split(r"(?m)^(?=#{1,6} )", prose(text))
  return sorted(
    {
      found
      for part in sections
      if not DATE.search(part)
      for found in MEASURED.findall(part)
    }
  )


VERDICT = "test_the_bfloat16_verdict_is_its_table"
TOLERANCE = "test_tolerances_quoted_are_the_tests"
ARITHMETIC = "test_the_host_memory_worked_numbers_are_their_arithmetic"
INSTALL = "a download's size, not a measurement of ga_optax"
READ = {
  "docs/how-to/host-schedule.md": {
    "1.01x": "test_the_host_schedule_page_states_the_tested_bounds",
    "1.05x": "test_the_host_schedule_page_states_the_tested_bounds",
  },
  "docs/how-to/gpu.md": {"400 MB": INSTALL, "4.7 GB": INSTALL},
  "docs/compiled-window.md": {
    "0.55x": "the block's last line, run by test_docs_snippets.py in CI",
    "400 MB": INSTALL,
    "4.7 GB": INSTALL,
  },
  "docs/how-to/tpu.md": {
    "140 MB": INSTALL,
    "16 GiB": "a v5e chip's HBM, the compile target's description",
    "32 MiB": "the block's print (# 32 True), run by test_docs_snippets.py",
    "90%": "the budget the benchmark is given, an input",
  },
  "docs/how-to/batch-size.md": {
    "94%": "test_the_goodput_example_uses_the_full_runs_costs",
    "25.38 ms": "test_the_goodput_example_uses_the_full_runs_costs",
    "42.08 ms": "test_the_goodput_example_uses_the_full_runs_costs",
    "16.7 ms": "test_the_goodput_example_uses_the_full_runs_costs",
    "17.10 ms": "test_the_goodput_example_uses_the_full_runs_costs",
  },
  "docs/how-to/sharded-optimizer-state.md": {
    f"{size} GB": "test_the_worked_example_of_sharded_state_is_its_arithmetic"
    for size in ("1", "3.5", "4", "7", "8", "9", "16", "56")
  }
  | {
    f"{size} bytes": "test_the_compiled_steps_state_bytes_are_its_arithmetic"
    for size in ("1,412", "5,632", "704")
  },
  "docs/how-to/host-memory.md": {
    "8 bytes": ARITHMETIC,
    **{
      figure_: ARITHMETIC
      for figure_ in ("1.8%", "14 GB", "25%", "28 GB", "29%", "410%", "56 GB")
    },
    "64 GB": "a PCIe 5 x16 link's rate, an input of the arithmetic",
    "900 GB": "NVLink-C2C's rate, an input of the arithmetic",
    "40%": "400 TFLOP/s of an H100's dense bfloat16 peak, an input",
    "10%": "the overhead asked for, an input",
  },
  "docs/how-to/mixed-precision.md": {
    **{figure_: VERDICT for figure_ in ("0.15%", "2%", "4.6%", "7.1%", "90%")},
    "0.4%": "bfloat16's rounding, 2**-8, a property of the format",
    **{f"{size} bytes": VERDICT for size in (2, 14, 16)},
    "6e-8": "float16's smallest subnormal, a property of the format",
    "1e-8": "optax.adam's default eps",
    "3e-4": "the run's final learning rate, an input",
    "1e-3": "test_precision.py: test_float16_adam_divides_by_zero_as_the_warning_says",
    "5e-3": "test_precision.py: test_float16_adam_divides_by_zero_as_the_warning_says",
    "1e-5": TOLERANCE,
    "1e-6": TOLERANCE,
  },
  "docs/examples.md": {"1e-5": TOLERANCE},
  "docs/not-equivalent.md": {"1e-5": TOLERANCE, "2e-5": TOLERANCE},
  "docs/how-to/privacy.md": {"1e-5": "delta, an input of the accounting"},
  "docs/how-to/data-parallel.md": {
    **{
      figure_: "test_the_collectives_table_is_the_pages_prints_and_sums"
      for figure_ in (
        "2,436 bytes",
        "2,436 B",
        "2,440 B",
        "2,444 B",
        "2,468 B",
        "9,760 B",
        "8 B",
      )
    },
    "8 bytes": "the page's print ([8]), checked by test_distributed.py",
    "2,048 bytes": "the page's print ([8, 2048]), checked by test_distributed.py",
  },
  "docs/how-to/testing.md": {
    "64 bytes": "the page's print (('all-reduce', 64)), its 16 float32s",
  },
}


def guarded_pages() -> list[str]:
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
  names = [path.relative_to(ROOT).as_posix() for path in pages]
  assert set(names) >= RECORD_PAGES | set(READ)
  return [name for name in names if name not in RECORD_PAGES]


@pytest.mark.parametrize("name", guarded_pages())
def test_pages_hold_no_measured_figure_that_no_test_reads(name):
  text = page(name)
  if name == "README.md":
    # Its table is tests/test_readme.py's.
    text = "\n".join(
      line for line in text.splitlines() if not line.startswith("|")
    )
  listed = READ.get(name, {})
  assert set(undated_figures(text)) <= set(listed)
  # And nothing is listed that the page no longer holds.
  assert set(listed) <= set(measured_figures(text))


def test_a_measured_figure_is_seen():
  assert measured_figures(
    "took 0.47x, 64.3 MiB, 0.466 ms, 8.4%, 3e-4 and 2,436 bytes; 8 B"
  ) == ["0.47x", "64.3 MiB", "0.466 ms", "8.4%", "3e-4", "2,436 bytes", "8 B"]
  assert (
    measured_figures("`0.47x` in code, [a](x.md#0.5x), k = 4, a 7B model") == []
  )


# The batch-size guide's goodput worked example: the two CPU costs are the
# benchmark page's full run, and what the guide derives from them is
# recomputed.


def full_run_mlp() -> dict[str, dict[str, str]]:
  heading = "#### mlp: MLP 4x2048x2048"
  start = BENCHMARKS.index(heading)
  end = BENCHMARKS.index("\n#### ", start + len(heading))
  (table,) = tables(BENCHMARKS[start:end])
  return by_row(table)


def test_the_goodput_example_uses_the_full_runs_costs():
  text = page("docs/how-to/batch-size.md")
  flat = " ".join(text.split())
  rows = full_run_mlp()
  micro = rows["ga_optax.accumulate"]["micro-step ms"]
  closing = rows["ga_optax.accumulate"]["window-closing ms"]
  optimizer = rows["optimizer only"]["micro-step ms"]
  t, c = float(micro), float(closing) - float(micro)
  assert (
    f"an `accumulate` micro-step took {micro} ms and a closing one {closing} ms"
    in flat
  )
  assert f"so closing adds {c:.1f} ms" in flat
  assert (
    f'("optimizer only": {optimizer} ms), and `c / t = {c / t:.2f}`' in flat
  )
  # The page's code runs on the same two figures, in seconds.
  assert f"micro_step_seconds = {t / 1000:.5f}" in text
  assert f"closing_seconds = {float(closing) / 1000:.5f} - {t / 1000:.5f}" in (
    text
  )
  # (c / t) (B_simple / m) at B_simple = 16 and 1000, m = 8.
  assert (
    f"With `B_simple` at 16 samples, `(c / t) (B_simple / m) = {c / t * 16 / 8:.1f}`"
    in flat
  )
  peak = c / t * 1000 / 8
  assert (
    f"At 1000 samples the peak is at `sqrt({peak:.0f}) = {peak**0.5:.1f}`"
  ) in flat
  # The best power of two is within sqrt(2) of the peak: 2 sqrt(2) / 3.
  assert f"at least {100 * 2 * 2**0.5 / 3:.0f}% of the peak's goodput" in flat


def test_the_batch_size_loop_verdict_is_its_table():
  text = page("docs/how-to/batch-size.md")
  flat = " ".join(text.split())
  (table,) = [
    t for t in tables(text) if t[0][0] == "run" and "optimizer steps" in t[0]
  ]
  rows = by_row(table)
  loss = "held-out loss after 384 micro-batches"
  adaptive = rows["adaptive k (2, then 4, then 8)"]
  four, eight = rows["fixed k = 4"], rows["fixed k = 8"]
  fewer = 1 - float(adaptive["optimizer steps"]) / float(
    four["optimizer steps"]
  )
  assert (
    f"ended a little higher ({float(adaptive[loss]):.2f} against"
    f" {float(four[loss]):.2f}) in {100 * fewer:.0f}% fewer steps"
  ) in flat
  assert (
    f"it ended lower ({float(adaptive[loss]):.2f} against"
    f" {float(eight[loss]):.2f}) on the same items, in more steps"
    f" ({adaptive['optimizer steps']} against {eight['optimizer steps']})"
  ) in flat


# The sharded-state guide's worked example is arithmetic on its stated
# sizes, recomputed here; so are its bytes of the compiled step's state.


def gb(value: float) -> str:
  return f"{value / 1e9:g} GB"


def test_the_worked_example_of_sharded_state_is_its_arithmetic():
  text = page("docs/how-to/sharded-optimizer-state.md")
  parameters_, element_bytes, devices, every_k = 10**9, 4, 8, 8
  assert "### Worked example: 1B parameters on 8 devices" in text
  assert (
    "float32 parameters and accumulator, Adam (float32 moments), D = 8, k = 8"
  ) in text
  params = parameters_ * element_bytes
  moments = 2 * params
  all_reduce = 2 * (devices - 1) / devices * params
  scatter = gather = (devices - 1) / devices * params
  total = params + params + moments
  sharded_total = params + params + moments / devices
  (table,) = [t for t in tables(text) if "Adam moments" in t[0]]
  assert table[1:] == [
    [
      "1. replicated",
      gb(params),
      gb(params),
      gb(moments),
      gb(total),
      f"{every_k} x {gb(all_reduce)} = {gb(every_k * all_reduce)}",
    ],
    [
      "2. unreduced accumulation",
      gb(params),
      gb(params),
      gb(moments),
      gb(total),
      gb(all_reduce),
    ],
    [
      "3. sharded optimizer state",
      gb(params),
      gb(params),
      f"**{gb(moments / devices)}**",
      f"**{gb(sharded_total)}**",
      f"{gb(scatter)} + {gb(gather)} = {gb(scatter + gather)}",
    ],
  ]
  flat = " ".join(text.split())
  assert f"The {gb(total - sharded_total)} saved per device" in flat
  assert f"Adam on {parameters_ // devices // 10**6}M elements" in flat


def test_the_compiled_steps_state_bytes_are_its_arithmetic():
  flat = " ".join(page("docs/how-to/sharded-optimizer-state.md").split())
  # The two-layer model's parameters, float32, as the page sums them.
  leaves = (256, 256, 4096, 1024)
  params = sum(leaves)
  sums = " + ".join(f"{leaf:,}" for leaf in leaves)
  assert f"{len(leaves)} reduce-scatters of {sums} = {params:,} bytes" in flat
  assert f"({params:,} bytes of float32 parameters," in flat
  # Adam's two moments, and its int32 count replicated on every device.
  whole, sharded = 2 * params + 4, 2 * params // 8 + 4
  assert f"{len(leaves)} all-gathers of {params // 8:,} bytes in all" in flat
  assert (
    f"Adam's state takes {sharded:,} bytes per device there instead of"
    f" {whole:,}"
  ) in flat


# The host-memory guide's worked numbers are arithmetic on the sizes and
# rates it states, recomputed here.


def two_figures(value: float) -> str:
  """``value`` to two significant figures, as the page writes it."""
  rounded = float(f"{value:.2g}")
  return f"{rounded:g}" if rounded < 10 else f"{rounded:.0f}"


def test_the_host_memory_worked_numbers_are_their_arithmetic():
  text = page("docs/how-to/host-memory.md")
  flat = " ".join(text.split())
  parameters_, flop_rate = 7e9, 400e12
  links = {
    "PCIe 5 x16, about 64 GB/s": 64e9,
    "NVLink-C2C, about 900 GB/s": 900e9,
  }
  pcie, nvlink = links.values()
  assert "Worked numbers for a 7B-parameter model" in flat
  assert "a micro-step at an achieved 400 TFLOP/s" in flat
  (transfers,) = [t for t in tables(text) if t[0][0] == "accumulator"]
  assert transfers[0][2:] == list(links)
  expected = []
  for name, element_bytes in (("bfloat16", 2), ("float32", 4)):
    held = element_bytes * parameters_
    moved = 2 * held
    expected.append(
      [
        f"{name} ({held / 1e9:.0f} GB)",
        f"{moved / 1e9:.0f} GB",
        *(f"{two_figures(moved / rate)} s" for rate in (pcie, nvlink)),
      ]
    )
  assert transfers[1:] == expected
  (shares,) = [t for t in tables(text) if t[0][0] == "micro-step"]
  float32_moved = 2 * 4 * parameters_
  expected = []
  for micro_batches, length in ((1, 2048), (8, 4096)):
    compute = 6 * parameters_ * micro_batches * length / flop_rate
    expected.append(
      [
        f"{micro_batches} x {length:,} tokens",
        f"{two_figures(compute)} s",
        *(
          f"+{two_figures(100 * float32_moved / rate / compute)}%"
          for rate in (pcie, nvlink)
        ),
      ]
    )
  assert shares[1:] == expected
  # Where transfers take as long as compute, for a float32 accumulator.
  even = [4 * flop_rate / (3 * rate) for rate in (pcie, nvlink)]
  assert (
    f"about {float(f'{even[0]:.2g}'):,.0f} tokens per micro-step for a float32"
    f" accumulator over PCIe 5, {float(f'{even[1]:.2g}'):.0f} over NVLink-C2C"
  ) in flat
  state = 8 * parameters_
  assert (
    f"8 bytes per parameter in float32, {state / 1e9:.0f} GB for 7B" in flat
  )
  assert (
    f"{2 * state / pcie:g} s over PCIe 5,"  # exactly 1.75
    f" {two_figures(2 * state / nvlink)} s over NVLink-C2C"
  ) in flat


# The TPU guide's first table: its figures are what the page's own block
# prints (to the digit printed, which the docs test checks in CI), and
# MultiSteps' is the largest of each column, as the block prints too.


def test_the_tpu_peak_table_is_what_the_page_prints():
  text = page("docs/how-to/tpu.md")
  (table,) = [
    t
    for t in tables(text)
    if t[0][:2] == ["step", "peak, x params (jax 0.10.2)"]
  ]
  rows = by_row(table)
  printed = {
    "`accumulate`, the device decides": ('peak["accumulate"]', "7.8"),
    "`accumulate`, micro-step (`closing=False`)": (
      'peak["micro-step, closing=False"]',
      "5.2",
    ),
    "`accumulate`, closing step (`closing=True`)": (
      'peak["closing step, closing=True"]',
      "7.6",
    ),
  }
  for row, (expression, claim) in printed.items():
    assert f"print(round({expression}, 1))  # {claim}" in text
    for column, cell in rows[row].items():
      if column != "step":
        assert f"{float(cell):.1f}" == claim, (row, column, cell)
  assert 'max(peak.values()) == peak["optax.MultiSteps"])  # True' in text
  for column in table[0][1:]:
    values = {name: float(cells[column]) for name, cells in rows.items()}
    assert max(values, key=values.get) == "`optax.MultiSteps`", column


# The narrow accumulators' unit-gradient means (docs/not-equivalent.md's
# table and the warning's docstring), recomputed in NumPy: k ones summed one
# at a time in the accumulator's dtype, the mean rounded to it.


def unit_mean(dtype, every_k: int) -> str:
  total = dtype(0)
  for _ in range(every_k):
    total = dtype(total + dtype(1))
  return f"{float(dtype(np.float32(total) / every_k)):.3g}"


def test_the_unit_gradient_means_are_numpys():
  text = page("docs/not-equivalent.md")
  (table,) = [t for t in tables(text) if t[0][0] == "k"]
  columns = {
    "bfloat16, unit: mean": jnp.bfloat16,
    "float16, unit: mean": np.float16,
  }
  for row in by_row(table).values():
    for column, dtype in columns.items():
      assert row[column] == unit_mean(dtype, int(row["k"])), row
  from ga_optax._src.mixed_precision import precision

  doc = " ".join(precision.warn_if_accumulator_too_narrow.__doc__.split())
  bf16 = [unit_mean(jnp.bfloat16, k) for k in (257, 300, 512)]
  assert (
    f"{bf16[0]} at k = 257, {bf16[1]} at 300, {bf16[2]} at 512 in bfloat16;"
    f" {unit_mean(np.float16, 4096)} at 4096 in float16"
  ) in doc


# The compiled-window page's 0.6 table (compiler figures of a dated
# compile, per jax): its derived columns, and the ratios its prose draws
# from it, are recomputed from its bytes.


def per_jax(cell: str) -> list[float]:
  return [float(part) for part in cell.split(" / ")]


def test_the_compiled_windows_derived_figures_are_its_bytes():
  text = page("docs/compiled-window.md")
  flat = " ".join(text.split())
  start = text.index("### 0.6: the add before any branch")
  (table,) = [
    t
    for t in tables(text[start : text.index("\n## ", start)])
    if t[0][0] == "step"
  ]
  rows = by_row(table)
  # Sums of figures written to a tenth agree to the tenths they dropped.
  tenths = pytest.approx
  theirs = per_jax(rows[MULTISTEPS]["window of 4"])
  assert theirs == tenths(
    [4 * moved for moved in per_jax(rows[MULTISTEPS]["micro-step"])], abs=0.2
  )
  windows = [
    "`accumulate`, `closing=`",
    "`accumulate_and_apply`, `closing=`",
    "`accumulate_and_apply`, device",
    "`accumulate`, device",
  ]
  for name in windows:
    row = rows[name]
    moved = [
      3 * micro + closing
      for micro, closing in zip(
        per_jax(row["micro-step"]), per_jax(row["closing step"]), strict=True
      )
    ]
    window = per_jax(row["window of 4"])
    assert window == tenths(moved, abs=0.2), name
    assert row["/ MultiSteps'"] == " / ".join(
      f"{mine / total:.3f}" for mine, total in zip(window, theirs, strict=True)
    ), name
  plain = per_jax(rows["plain Adam"]["micro-step"])
  closing = per_jax(rows["`accumulate`, device"]["closing step"])
  assert (
    "closing step is "
    + " / ".join(
      f"{mine / step:.2f}x" for mine, step in zip(closing, plain, strict=True)
    )
    + " a plain Adam step"
  ) in flat
  micro = per_jax(rows["`accumulate`, device"]["micro-step"])[0]
  assert f"moves 160.3 MiB, {160.3 / micro:.2f}x the micro-step without" in (
    flat
  )


# Docstrings that quote a figure: from the dated run it names, or from
# arithmetic.


def test_docstring_figures_are_their_sources():
  from ga_optax._src.batch_size import advice
  from ga_optax._src.recipes import gpu_recipe

  recipe = " ".join((gpu_recipe.__doc__ or "").split())
  run = " ".join(section(BENCHMARKS, GPU_SECTION).split())
  drift = re.search(r"with only `WHILE` added .*? but (\S+) away", run)
  assert drift, "the H200 run no longer records the WHILE-only drift"
  assert (
    f"with only WHILE captured the parameters drifted from XLA's defaults' by"
    f" {float(drift.group(1)):.0e}".replace("e-0", "e-")
  ) in recipe
  goodput = " ".join((advice.goodput_k.__doc__ or "").split())
  share = 2 * 2**0.5 / 3  # the goodput at a factor sqrt(2) from the peak
  assert f"``2 sqrt(2) / 3`` ({100 * share:.0f}%) of the peak's" in goodput


# The bfloat16 recipe's verdict: what it draws from the dated table of the
# language-model run, recomputed from that table.


def test_the_bfloat16_verdict_is_its_table():
  text = page("docs/how-to/mixed-precision.md")
  flat = " ".join(text.split())
  (table,) = [
    t for t in tables(text) if "params unchanged by the last update" in t[0]
  ]
  rows = {name.strip("`"): cells for name, cells in by_row(table).items()}
  held_out = {name: float(row["held-out loss"]) for name, row in rows.items()}
  drift = {
    name: float(row["drift after 150 windows"].split()[0])
    for name, row in rows.items()
  }
  unchanged = {
    name: float(row["params unchanged by the last update"].rstrip("%"))
    for name, row in rows.items()
  }
  bf16 = ["bf16-recipe", "bf16-default-moments", "all-bf16"]
  gaps = [held_out[name] - held_out["float32"] for name in bf16]
  assert (
    f"end {min(gaps):.3f} to {max(gaps):.3f} above float32 in held-out loss,"
    f" about {100 * max(gaps) / held_out['float32']:.0f}%"
  ) in flat
  assert (
    f"drift about {100 * sum(drift[n] for n in bf16) / len(bf16):.1f}% away"
  ) in flat
  assert (
    f"left {min(unchanged[n] for n in bf16):.0f}% of their params exactly as"
    f" they were, against {unchanged['float32']:.1f}% in float32"
  ) in flat
  master = held_out["float32-master"] - held_out["float32"]
  assert (
    f"end within {master:.4f} of float32, with a drift of"
    f" {100 * drift['float32-master']:.2f}%"
  ) in flat
  size = {name: int(row["bytes per param"]) for name, row in rows.items()}
  accumulator = size["bf16-default-moments"] - size["all-bf16"]
  assert f"costs {accumulator} bytes per parameter over a bfloat16" in flat
  extra = size["float32-master"] - size["bf16-recipe"]
  assert f"If {extra} more bytes per parameter fit" in flat
  assert (
    f"cost {size['float32-master']} bytes per parameter against the"
    f" recipe's {size['bf16-recipe']}"
  ) in flat
  assert (
    f"at {size['bf16-recipe']} bytes against {size['all-bf16']} for"
    " all-bfloat16"
  ) in flat
  moments = size["bf16-recipe"] - size["bf16-default-moments"]
  assert f"for {moments} more bytes per parameter" in flat
  recipe, default = held_out["bf16-recipe"], held_out["bf16-default-moments"]
  share = (default - recipe) / (default - held_out["float32"])
  assert round(share, 1) == 0.1
  assert (
    f"recover about a tenth of the gap: {recipe:.4f} against {default:.4f}"
  ) in flat


# Tolerances the pages quote are the ones the tests apply.


def test_tolerances_quoted_are_the_tests():
  quoted = {
    "docs/examples.md": ("within 1e-5 of", "tests/test_examples.py", "1e-5"),
    "docs/not-equivalent.md": (
      "relative tolerance of 2e-5",
      "tests/test_equivalence.py",
      "rtol=2e-5",
    ),
  }
  for name, (phrase, test_file, written) in quoted.items():
    assert phrase in " ".join(page(name).split()), name
    assert written in page(test_file), test_file
  batchnorm = " ".join(page("docs/not-equivalent.md").split())
  assert "one large-batch step (tested to 1e-5)" in batchnorm
  assert "rtol=1e-5" in page("tests/test_batchnorm.py")
  fp8 = " ".join(page("docs/how-to/mixed-precision.md").split())
  assert "the float8 state equal to 1e-6 relative, the gradients to 1e-5" in fp8
  assert "float8 state equal to 1e-6, params to 1e-6" in fp8
  fp8_test = page("tests/test_fp8.py")
  for written in ("rtol=1e-6", "atol=1e-6", "atol=1e-5"):
    assert written in fp8_test, written


# Docstring examples that doctest skips are never checked: they show no
# figure (what they print is a bool, an empty list or nothing).


def skipped_examples() -> list[tuple[str, str, str]]:
  found = []
  parser = doctest.DocTestParser()
  for path in sorted((ROOT / "ga_optax").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if not isinstance(
        node,
        (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef),
      ):
        continue
      docstring = ast.get_docstring(node, clean=True)
      for example in parser.get_examples(docstring or ""):
        if example.options.get(doctest.SKIP):
          name = path.relative_to(ROOT).as_posix()
          found.append((name, example.source, example.want))
  return found


def test_skipped_docstring_examples_show_no_figure():
  examples = skipped_examples()
  assert examples  # the audits' examples, which need a compiler
  shown = [(name, want) for name, _, want in examples if re.search(r"\d", want)]
  assert not shown, shown


# The data-parallel guide's collectives table: the row its audit block
# prints is what that block prints (test_distributed.py checks the print),
# and the other rows are the same model's bytes.


def test_the_collectives_table_is_the_pages_prints_and_sums():
  text = page("docs/how-to/data-parallel.md")
  flat = " ".join(text.split())
  parameters_ = 609
  grads = 4 * parameters_
  assert f"({parameters_} float32 parameters, {grads:,} bytes)" in flat
  assert "print([size for _, size in micro_step.collectives])  # [8]" in text
  assert f"closing.collectives))  # [8, {grads}]" in text
  (table,) = [t for t in tables(text) if t[0][0] == "workflow"]
  rows = by_row(table)
  scalars = 8  # the loss and the weight, float32
  every_k = 4
  train_step = (
    "Explicit, `unreduced_value_and_grad` + `accumulate(unreduced_axes=)`"
    " (`train_step`)"
  )
  assert rows[train_step]["per call"].startswith(
    f"1 all-reduce, {scalars} B (loss, weight)"
  )
  assert rows[train_step]["when a window closes"].startswith(
    f"+ 1 all-reduce, {grads:,} B (accumulator)"
  )
  assert rows[train_step]["per window"] == (
    f"{every_k} + 1, {every_k * scalars + grads:,} B"
  )
  in_step = f"1 all-reduce, {grads + scalars:,} B"
  per_call = f"1 all-reduce, {grads + 4:,} B"  # the gradients and the loss
  for name, row in rows.items():
    if "microbatched_value_and_grad" in name:
      assert row["per call"].startswith(in_step), name
      assert row["per window"] == f"1, {grads + scalars:,} B", name
    elif "`jax.grad` + `accumulate`" in name:
      assert row["per call"].startswith(per_call), name
      assert row["per window"] == f"{every_k}, {every_k * (grads + 4):,} B"
  shard_map = rows["`shard_map`, `accumulate(axis_name=)`"]
  assert shard_map["when a window closes"].startswith(per_call)
  assert shard_map["per window"] == f"1, {grads + 4:,} B"


# The docstrings of ga_optax hold no measured figure but these.
DOCSTRING_READ = {
  "1e-3": "a learning rate, an input of the examples",
  "1e-2": "test_precision.py: test_float16_adam_divides_by_zero_as_the_warning_says",
  "9.2e-4": "test_precision.py: test_float16_adam_divides_by_zero_as_the_warning_says",
  "5e-3": "test_precision.py, and test_docstring_figures_are_their_sources",
  "6e-8": "float16's smallest subnormal, a property of the format",
  "6e-08": "float16's smallest subnormal, a property of the format",
  "1e-8": "optax.adam's default eps",
  "1e-9": "an input of a doctest that runs",
  "1e-5": "a doctest's tolerance (it runs), and privacy's delta, an input",
  "94%": "test_docstring_figures_are_their_sources",
  "400 MB": INSTALL,
  "4.7 GB": INSTALL,
  "140 MB": INSTALL,
}


def test_docstrings_hold_no_measured_figure_that_no_test_reads():
  found: dict[str, set[str]] = {}
  for path in sorted((ROOT / "ga_optax").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(
        node,
        (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef),
      ):
        for figure_ in measured_figures(ast.get_docstring(node) or ""):
          found.setdefault(figure_, set()).add(path.name)
  unread = {
    key: names for key, names in found.items() if key not in DOCSTRING_READ
  }
  assert not unread, unread
  assert set(DOCSTRING_READ) <= set(found)
