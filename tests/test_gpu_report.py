"""The GPU run book runs anywhere: its smoke mode on the CPU, labelled as such.

One ``--quick`` run of ``benchmarks/gpu_report.py`` in this process feeds
most checks: the files each section writes, the fields of its JSON, the
label that keeps a CPU figure from passing for a GPU figure, and the
compiler figures of the H100 section (or, without the CUDA plugin, the
reason it was skipped). A second, smaller run plants a failure in one
section and shows that it is recorded and that the next section still runs.
Timings are only checked to be there, never compared: on a shared CPU they
say nothing.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import json
import math
import platform
import sys
from pathlib import Path
from types import ModuleType

import chex
import jax
import numpy as np
import optax
import pytest

import ga_optax
from benchmarks import (
  batch_fit,
  compiled_steps,
  cond_window,
  contenders,
  window_time,
  workloads,
)
from ga_optax._src.window import window_form

REPO_ROOT = Path(__file__).resolve().parent.parent
SECTIONS = [
  "environment",
  "compiled_h100",
  "window_time",
  "cond_window",
  "summation_orders",
  "compiled_here",
  "step_time",
  "in_step",
  "host_memory",
  "largest_batch",
  "peak_memory",
]
COMPILED_STEPS = {
  "plain Adam",
  "optax.MultiSteps",
  "ga_optax.accumulate",
  "ga_optax.accumulate + noise scale",
  "ga_optax.accumulate_and_apply",
  "ga_optax.microbatched_value_and_grad",
  "hand-written lax.scan",
  compiled_steps.FLOOR,
  compiled_steps.BY_HAND_CLOSING,
  compiled_steps.ACCUMULATE_HOST_MICRO,
  compiled_steps.ACCUMULATE_HOST_CLOSING,
  compiled_steps.FUSED_HOST_MICRO,
  compiled_steps.FUSED_HOST_CLOSING,
  compiled_steps.HOST_FIRST_STEP,
  compiled_steps.HOST_MICRO_STEP,
  compiled_steps.HOST_CLOSING_STEP,
}
# ga_optax's host-scheduled closing steps: on the CPU each guards its step.
HOST_CLOSING = {
  compiled_steps.ACCUMULATE_HOST_CLOSING,
  compiled_steps.FUSED_HOST_CLOSING,
}
# The steps built on accumulate: each holds both sides of the window.
WINDOWS = {
  "ga_optax.accumulate",
  "ga_optax.accumulate + noise scale",
  "ga_optax.accumulate_and_apply",
}


@functools.cache
def load_gpu_report() -> ModuleType:
  spec = importlib.util.spec_from_file_location(
    "gpu_report", REPO_ROOT / "benchmarks" / "gpu_report.py"
  )
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def is_time(value) -> bool:
  return isinstance(value, float) and math.isfinite(value) and value > 0


def test_quick_run_writes_a_cpu_labelled_report(tmp_path):
  # One test, not one per check: under pytest-xdist, tests of one module
  # may land on two workers, and each would pay for its own run.
  returned = load_gpu_report().main(["--quick", "--output-dir", str(tmp_path)])
  report = json.loads((tmp_path / "gpu_report.json").read_text())
  assert list(report) == list(returned) == SECTIONS
  for name in SECTIONS:
    written = json.loads((tmp_path / f"{name}.json").read_text())
    assert written == report[name], name
    assert (tmp_path / f"{name}.md").read_text().startswith(f"## {name} (")
    assert report[name]["elapsed_s"] >= 0
  markdown = (tmp_path / "gpu_report.md").read_text()
  check_a_cpu_run_says_it_is_no_gpu_run(report, markdown)
  check_records_device_versions_variables_machine_and_date(report)
  check_the_h100_compiled_program_or_why_it_is_missing(report["compiled_h100"])
  check_this_backends_compiled_program_beside_the_h100s(report)
  check_every_form_of_the_window_is_timed(report["window_time"])
  check_the_cond_window_beside_accumulate(report["cond_window"])
  check_two_summation_orders_of_the_large_batch(report["summation_orders"])
  check_step_time_has_ratios_to_plain_adam_and_multi_steps(report)
  check_in_step_window_against_the_hand_written_scan(report)
  check_host_memory_and_no_peaks_without_memory_stats(report)
  check_largest_batches_fit_the_budget(report)
  host_name = platform.node()
  if len(host_name) >= 8:  # a short name could occur anywhere by chance
    assert host_name not in json.dumps(report) + markdown


def check_a_cpu_run_says_it_is_no_gpu_run(report, markdown):
  assert jax.devices()[0].platform == "cpu"
  environment = report["environment"]["results"]
  assert environment["backend"] == "cpu"
  assert environment["gpu"] is False
  assert "no GPU" in environment["label"]
  assert "none of these figures is a GPU figure" in environment["label"]
  assert environment["label"] in markdown.splitlines()[2]
  for name, section in report.items():
    expected = "compile-only H100" if name == "compiled_h100" else "cpu: "
    assert expected in section["backend"], name
    assert f"## {name} ({section['backend']})" in markdown.splitlines()


def check_records_device_versions_variables_machine_and_date(report):
  environment = report["environment"]["results"]
  assert environment["device"]["kind"] == jax.devices()[0].device_kind
  assert environment["device"]["memory_stats"] is None
  assert environment["versions"]["jax"] == jax.__version__
  assert environment["versions"]["jaxlib"]
  assert environment["environment_variables"]["JAX_PLATFORMS"] == "cpu"
  assert environment["date"][:2] == "20"
  assert environment["machine"]["cpu_count"] >= 1
  assert environment["quick"] is True


def check_the_h100_compiled_program_or_why_it_is_missing(section):
  if section["status"] == "skipped":
    # Where the CUDA plugin is missing the reason says how to install it.
    assert "CUDA plugin" in section["reason"]
    return
  assert section["status"] == "ok", section.get("traceback")
  check_compiled_program(section["results"], guard=0)


def check_compiled_program(results, guard):
  """The window's closing branches are there, in either form, and the
  gradient is added outside them; a host-scheduled closing step holds
  ``guard`` of them (the CPU's guard of a window without weight)."""
  paths = results["paths"]
  assert set(paths) == COMPILED_STEPS
  for name, path in paths.items():
    for side in ("micro_step", "closing"):
      assert path[side]["moved_mib"] > 0, (name, side)
      assert path[side]["copied_mib"] >= 0, (name, side)
    sides = path["window_sides"]
    if name in WINDOWS:
      assert sides["close_window"] >= 1, name
      assert sides["keep_open"] == 0, name
    elif name in HOST_CLOSING:
      assert sides == {
        "keep_open": 0,
        "close_window": guard,
        "empty_window": 0,
      }, name
    else:
      assert sides == {"keep_open": 0, "close_window": 0, "empty_window": 0}, (
        name
      )
  assert len(results["ratios"]) == len(compiled_steps.TARGETS)
  for row in results["ratios"]:
    assert math.isfinite(row["ratio"]) and row["ratio"] > 0, row
    assert row["met"] == (row["ratio"] <= row["target"]), row


def check_this_backends_compiled_program_beside_the_h100s(report):
  here = report["compiled_here"]
  assert here["status"] == "ok", here.get("traceback")
  cpu_guard = window_form.form_for("cpu") == window_form.CONDITIONAL
  check_compiled_program(here["results"], guard=int(cpu_guard))
  missing = {"ratios": [{}] * len(compiled_steps.TARGETS)}
  h100 = report["compiled_h100"].get("results", missing)
  ratios = zip(here["results"]["ratios"], h100["ratios"], strict=True)
  for row, theirs in ratios:
    assert row.get("h100_ratio") == theirs.get("ratio"), row


def check_every_form_of_the_window_is_timed(section):
  assert section["status"] == "ok", section.get("traceback")
  recipe = hasattr(ga_optax, "gpu_compiler_options")
  forms = [", GPU recipe"] if recipe else []
  expected = [
    "plain Adam",
    "optax.MultiSteps",
    *(
      f"ga_optax.{path}{form}"
      for form in ["", *forms]
      for path in ("accumulate", "accumulate_and_apply")
    ),
    "ga_optax.accumulate, host-scheduled",
    "ga_optax.accumulate_and_apply, host-scheduled",
    "state-carrying reference (by hand)",
    "state-carrying reference, 4 more scalars",
    "host-scheduled window",
    "conditional window (one lax.cond)",
  ]
  (record,) = section["results"].values()  # quick: the smallest MLP only
  assert (record["gpu_recipe"] is not None) == recipe
  assert [row["contender"] for row in record["rows"]] == expected
  for row in record["rows"]:
    assert row["finite"] is True, row
    for key in ("micro_ms", "closing_ms", "window_ms", "micro_dispatch_us"):
      assert is_time(row[key]), (key, row)
    assert row["windows_per_round"] >= 1
  host, multi_steps = record["rows"][-2], record["rows"][1]
  assert host["micro_over_host_scheduled"] == 1.0
  assert multi_steps["window_over_multi_steps"] == 1.0
  assert record["rows"][-4]["window_over_state_carrying"] == 1.0


def check_the_cond_window_beside_accumulate(section):
  assert section["status"] == "ok", section.get("traceback")
  rows = {
    (row["window"], row["compiled for"]): row
    for row in section["results"]["rows"]
  }
  cpu = jax.devices()[0].device_kind
  windows = (cond_window.COND_WINDOW, "ga_optax.accumulate")
  assert set(rows) == {
    (w, on) for w in windows for on in ("H100 (compile-only)", cpu)
  }
  # On the CPU the one-conditional window is one conditional (accumulate's takes the form
  # the platform or GA_OPTAX_WINDOW_FORM chooses).
  for window in windows:
    here = rows[window, cpu]
    assert here["micro_step_moved_mib"] > 0 and here["closing_moved_mib"] > 0
  assert rows[cond_window.COND_WINDOW, cpu]["conditionals"] == 1
  assert rows[cond_window.COND_WINDOW, cpu]["loops"] == 0
  h100 = rows[cond_window.COND_WINDOW, "H100 (compile-only)"]
  if h100.get("unavailable"):
    assert "CUDA plugin" in h100["unavailable"]
    return
  # XLA:GPU keeps that window's conditional (its open branch only forwards) and
  # compiles accumulate's closing branches as loops: the closing side, the
  # step inside it, and the zeroing of the updates' buffer.
  assert (h100["conditionals"], h100["loops"]) == (1, 0), h100
  loops = rows["ga_optax.accumulate", "H100 (compile-only)"]
  assert (loops["conditionals"], loops["loops"]) == (0, 3), loops
  # Under XLA's defaults the host drives accumulate's two outermost loops:
  # a micro-step skips each, one wait each.
  assert loops["waits_micro_step"] == 2, loops
  assert h100["waits_micro_step"] in (0, 1), h100


def check_two_summation_orders_of_the_large_batch(section):
  assert section["status"] == "ok", section.get("traceback")
  results = section["results"]
  assert [run["run"] for run in results["runs"]] == [
    "large batch",
    "large batch, rows permuted",
    "ga_optax.accumulate",
  ]
  assert all(run["params_finite"] for run in results["runs"])
  distances = [row["max_relative_difference"] for row in results["distances"]]
  assert len(distances) == 3
  # On the CPU, at full precision, every pair is float32 rounding apart.
  assert all(0 <= distance < 1e-4 for distance in distances), distances


def check_step_time_has_ratios_to_plain_adam_and_multi_steps(report):
  assert report["step_time"]["status"] == "ok"
  for record in report["step_time"]["results"].values():
    assert [row["contender"] for row in record["ratios"]] == [
      "plain Adam step",
      "optax.MultiSteps",
      "ga_optax.accumulate",
      "ga_optax.accumulate_and_apply",
    ]
    for row in record["ratios"]:
      assert set(row) == {
        "contender",
        "micro_ms",
        "closing_ms",
        "micro_ms_over_plain_adam",
        "closing_ms_over_plain_adam",
        "micro_ms_over_multi_steps",
        "closing_ms_over_multi_steps",
      }
      assert all(is_time(row[key]) for key in row if key != "contender")
    assert record["figures"]


def check_in_step_window_against_the_hand_written_scan(report):
  assert report["in_step"]["status"] == "ok"
  for rows in report["in_step"]["results"].values():
    assert [row["window"] for row in rows] == [
      "ga_optax.microbatched_value_and_grad",
      "hand-written lax.scan",
    ]
    assert all(is_time(row["median_ms"]) for row in rows)
    assert all(is_time(row["over_scan"]) for row in rows)


def check_host_memory_and_no_peaks_without_memory_stats(report):
  host = report["host_memory"]
  assert host["status"] == "ok", host.get("traceback")
  record = host["results"]["reference"]
  assert set(record["configs"]) == {
    "plain Adam step",
    "state on device",
    "accumulator on host",
    "accumulator and Adam state on host",
  }
  for row in record["figures"]:
    assert row["offloaded_bytes"] > 0, row
  peak = report["peak_memory"]
  assert peak["status"] == "skipped"
  assert "memory_stats()" in peak["reason"]


def check_largest_batches_fit_the_budget(report):
  section = report["largest_batch"]
  assert section["status"] == "ok", section.get("traceback")
  results = section["results"]
  budget = results["budget_bytes"]
  assert "nominal" in results["budget_source"]
  single, accumulate = results["largest"]
  for found in (single, accumulate):
    assert found["rows"] > 0 and found["bytes"] <= budget, found
    assert found["next_bytes"] > budget, found
  assert single["batch"] == single["rows"]
  assert accumulate["batch"] == 32 * accumulate["rows"]


def test_a_failing_section_is_recorded_and_the_next_still_runs(
  tmp_path, monkeypatch
):
  gpu_report = load_gpu_report()

  def planted(*args, **kwargs):
    raise RuntimeError("planted failure")

  monkeypatch.setattr(gpu_report, "step_time_section", planted)
  only = ["--section", "step_time", "--section", "in_step"]
  report = gpu_report.main(["--quick", "--output-dir", str(tmp_path), *only])
  assert list(report) == ["environment", "step_time", "in_step"]
  failed = json.loads((tmp_path / "step_time.json").read_text())
  assert failed["status"] == "failed"
  assert failed["error"] == "RuntimeError: planted failure"
  assert "planted" in failed["traceback"]
  assert "**Failed**" in (tmp_path / "step_time.md").read_text()
  assert report["in_step"]["status"] == "ok"
  combined = json.loads((tmp_path / "gpu_report.json").read_text())
  assert combined["step_time"]["status"] == "failed"
  assert combined["in_step"]["status"] == "ok"


@pytest.mark.parametrize(
  ("bytes_at", "most_calls"),
  [
    # A step's bytes grow about linearly with its rows: a few compilations.
    (lambda rows: 1_000 + 37 * rows, 6),  # straight
    (lambda rows: 1_000 + 37 * rows + 4_096 * (rows // 512), 8),  # in steps
    (lambda rows: 1_000 + rows * rows // 64, 2 * 22),  # curved
  ],
  ids=["straight", "steps", "curved"],
)
@pytest.mark.parametrize("budget", [1_000 + 37 * 8, 50_000, 10_000_000])
def test_largest_fitting_brackets_the_budget_to_one_percent(
  bytes_at, most_calls, budget
):
  calls = []

  def counted(rows):
    calls.append(rows)
    return bytes_at(rows)

  found = batch_fit.largest_fitting(counted, budget, max_rows=2**22)
  rows, next_rows = found["rows"], found["next_rows"]
  assert found["bytes"] == bytes_at(rows) <= budget
  assert found["next_bytes"] == bytes_at(next_rows) > budget
  assert 0 < next_rows - rows <= max(1, rows // 128)
  assert len(calls) == len(set(calls)) <= most_calls


def test_largest_fitting_reports_when_nothing_or_everything_fits():
  largest_fitting = batch_fit.largest_fitting
  nothing = largest_fitting(lambda rows: 100 * rows, 10, max_rows=64)
  assert nothing["rows"] is None
  assert nothing["next_rows"] == 1 and nothing["next_bytes"] == 100
  everything = largest_fitting(lambda rows: rows, 10**6, max_rows=64)
  assert everything["rows"] == 64 and everything["next_rows"] is None
  # Everything fits when the largest size does, found without walking to it.
  calls = []
  found = largest_fitting(
    lambda rows: calls.append(rows) or 1_000 + 37 * rows, 10**9, 2**22
  )
  assert found["rows"] == 2**22 and found["next_rows"] is None
  assert len(calls) <= 4


def test_sections_after_the_time_budget_are_skipped(tmp_path):
  only = ["--section", "in_step", "--budget-s", "0"]
  report = load_gpu_report().main(
    ["--quick", "--output-dir", str(tmp_path), *only]
  )
  assert report["environment"]["status"] == "ok"
  assert report["in_step"]["status"] == "skipped"
  assert "--budget-s" in report["in_step"]["reason"]


def test_the_cond_window_is_the_large_batch():
  """The one-conditional window the run book times is exact: one Adam step per window
  on the window's mean gradient, window after window."""
  workload = workloads.mlp(64, 2, 8, 4)
  adam = optax.adam(1e-2)
  init, step = cond_window.cond_window(workload.loss_fn, adam, 4)
  step = jax.jit(step)
  params, state = workload.params, init(workload.params)
  expected, expected_state = workload.params, adam.init(workload.params)
  for _ in range(3):
    for batch in workload.microbatches:
      params, state = step(params, state, batch)
    grads = jax.grad(workload.loss_fn)(expected, workload.window_batch)
    updates, expected_state = adam.update(grads, expected_state, expected)
    expected = optax.apply_updates(expected, updates)
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))
  chex.assert_trees_all_close(params, expected, rtol=2e-5, atol=1e-6)
  chex.assert_trees_all_close(
    state.inner_state, expected_state, rtol=2e-5, atol=1e-6
  )
  assert int(state.micro_step) == 0


def test_a_window_that_fails_is_recorded_and_the_others_are_timed(
  monkeypatch,
):
  build = contenders.window_contenders

  def with_a_broken_one(workload, options):
    def broken(*args):
      raise RuntimeError("planted failure")

    found = build(workload, options)
    planted = dataclasses.replace(
      found[0], name="broken", calls=(broken,) * workload.every_k
    )
    return [planted, *found]

  monkeypatch.setattr(contenders, "window_contenders", with_a_broken_one)
  record = window_time.measure_workload(workloads.mlp(64, 2, 8, 4), 1)
  assert record["failed"] == {"broken": "RuntimeError: planted failure"}
  assert record["caption"].endswith("; failed: broken")
  names = [row["contender"] for row in record["rows"]]
  assert names[:2] == ["plain Adam", "optax.MultiSteps"]
  assert "broken" not in names
  assert all(is_time(row["window_ms"]) for row in record["rows"])


def test_benchmarks_import_the_checkout_after_putting_it_on_the_path():
  # On a lent GPU the run book runs from a checkout where ga_optax is not
  # installed: an import of the package or of the benchmarks' helpers above
  # the line that puts the checkout on sys.path fails there, and nowhere it
  # is installed.
  scripts = [
    path
    for path in sorted((REPO_ROOT / "benchmarks").glob("*.py"))
    if "sys.path.insert" in path.read_text()
  ]
  assert any(path.name == "gpu_report.py" for path in scripts)
  for path in scripts:
    tree = ast.parse(path.read_text())
    (insert,) = [
      node.lineno
      for node in ast.walk(tree)
      if isinstance(node, ast.Call)
      and ast.unparse(node.func) == "sys.path.insert"
    ]
    early = [
      ast.unparse(node)
      for node in tree.body
      if isinstance(node, (ast.Import, ast.ImportFrom))
      and node.lineno < insert
      and any(
        name.split(".")[0] in ("ga_optax", "benchmarks")
        for name in (
          [node.module or ""]
          if isinstance(node, ast.ImportFrom)
          else [alias.name for alias in node.names]
        )
      )
    ]
    assert not early, (path.name, early)
