"""The GPU run book runs anywhere: its smoke mode on the CPU, labelled as such.

One ``--quick`` run of ``benchmarks/gpu_report.py`` in this process feeds
every check: the files it writes, the fields of its JSON, the
conditional counts of its matrix against their emulated counts, and the
label that keeps a CPU figure from passing for a GPU figure. Timings are
only checked to be there, never compared.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import platform
import sys
from pathlib import Path
from types import ModuleType

import jax
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


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


def test_quick_run_writes_a_cpu_labelled_report(tmp_path):
  # One test, not one per check: under pytest-xdist, tests of one module
  # may land on two workers, and each would pay for its own run.
  returned = load_gpu_report().main(["--quick", "--output-dir", str(tmp_path)])
  assert returned is not None
  assert (tmp_path / "gpu_report.md").is_file()
  report = json.loads((tmp_path / "gpu_report.json").read_text())
  assert set(report) >= {
    "environment",
    "conditionals",
    "step_time",
    "in_step",
    "memory",
  }
  markdown = (tmp_path / "gpu_report.md").read_text()
  check_a_cpu_run_says_it_is_no_gpu_run(report, markdown)
  check_records_device_versions_flags_machine_and_date(report)
  check_every_conditional_of_the_matrix_survives_as_emulated(report)
  check_the_controls_are_flagged(report)
  check_step_time_has_ratios_to_plain_adam_and_multi_steps(report)
  check_in_step_windows_compute_the_full_batch_gradient(report)
  check_memory_over_k_and_the_largest_batches_that_fit(report)
  host_name = platform.node()
  if len(host_name) >= 8:  # a short name could occur anywhere by chance
    assert host_name not in json.dumps(report) + markdown


def check_a_cpu_run_says_it_is_no_gpu_run(report, markdown):
  assert jax.devices()[0].platform == "cpu"
  environment = report["environment"]
  assert environment["backend"] == "cpu"
  assert environment["gpu"] is False
  assert "no GPU" in environment["label"]
  assert "none of these figures is a GPU figure" in environment["label"]
  assert environment["label"] in markdown.splitlines()[2]
  for heading in (
    "## Conditionals of the window, compiled for cpu",
    "## Step time on cpu",
    "## In-step window on cpu",
    "## Memory on cpu",
  ):
    assert heading in markdown.splitlines()


def check_records_device_versions_flags_machine_and_date(report):
  environment = report["environment"]
  assert environment["device"]["kind"] == jax.devices()[0].device_kind
  assert environment["versions"]["jax"] == jax.__version__
  assert environment["versions"]["jaxlib"]
  assert "xla_flags" in environment
  assert "environment_variables" in environment
  assert environment["date"][:2] == "20"
  assert environment["machine"]["cpu_count"] >= 1


def check_every_conditional_of_the_matrix_survives_as_emulated(report):
  matrix = report["conditionals"]["matrix"]
  assert len(matrix) == 12  # the CPU offers "pinned_host": nothing skipped
  for name, record in matrix.items():
    assert record["compiled"] >= 1, name
    assert record["compiled"] == record["emulated"], (name, record)
    assert record["confined"], (name, record)


def check_the_controls_are_flagged(report):
  controls = report["conditionals"]["controls"]
  multi_steps = controls["optax.MultiSteps(adam): no conditional"]
  assert multi_steps["compiled"] == 0
  assert not multi_steps["confined"]
  assert sum(multi_steps["characteristic_outside"].values()) > 0
  for name in (
    "lax.cond(closes, adam step, zeros)",
    "lax.cond(closes, sgd momentum step, zeros)",
  ):
    assert controls[name]["compiled"] == 1, name
    assert controls[name]["emulated"] == 0, name


def check_step_time_has_ratios_to_plain_adam_and_multi_steps(report):
  for record in report["step_time"].values():
    assert set(record["ratios"]) == {
      "plain Adam step",
      "optax.MultiSteps",
      "ga_optax.accumulate",
      "ga_optax.accumulate_and_apply",
    }
    for ratios in record["ratios"].values():
      for value in ratios.values():
        assert math.isfinite(value) and value > 0


def check_in_step_windows_compute_the_full_batch_gradient(report):
  for record in report["in_step"].values():
    assert record["optax_microbatching"] == "measured"
    assert set(record["windows"]) == {
      "ga_optax.microbatched_value_and_grad",
      "hand-written lax.scan",
      "optax.microbatching.microbatch",
    }
    for window in record["windows"].values():
      difference = window["max_relative_difference_to_full_batch"]
      assert math.isfinite(difference) and difference < 1e-5
      assert math.isfinite(window["median_ms"])


def check_memory_over_k_and_the_largest_batches_that_fit(report):
  memory = report["memory"]
  assert "no memory_stats()" in memory["peaks"]
  assert "nominal" in memory["budget_source"]
  ks = memory["model"]["ks"]
  assert [row["every_k"] for row in memory["by_k"]] == ks
  assert ks[0] == 1 and ks[-1] == 32
  for row in memory["by_k"]:
    for kind in ("plain", "accumulate", "accumulate_host", "window"):
      assert row[kind]["device_bytes"] > 0, (row["every_k"], kind)
      assert "peak_bytes_in_use" not in row[kind]
    # The accumulate micro-step holds an accumulator the plain step lacks.
    assert row["accumulate"]["device_bytes"] > row["plain"]["device_bytes"]
  budget = memory["budget_bytes"]
  for name, found in memory["largest"].items():
    assert found["bytes"] <= budget < found["next_bytes"], name
    assert found["next_rows"] > found["rows"] > 0, name


@pytest.mark.parametrize(
  "bytes_at",
  [
    lambda rows: 1_000 + 37 * rows,  # straight
    lambda rows: 1_000 + 37 * rows + 4_096 * (rows // 512),  # in steps
    lambda rows: 1_000 + rows * rows // 64,  # curved
  ],
  ids=["straight", "steps", "curved"],
)
@pytest.mark.parametrize("budget", [1_000 + 37 * 8, 50_000, 10_000_000])
def test_largest_fitting_finds_the_last_size_that_fits(bytes_at, budget):
  found = load_gpu_report().largest_fitting(
    bytes_at, budget, unit=8, max_rows=2**22, first_rows=256
  )
  rows = found["rows"]
  assert bytes_at(rows) <= budget < bytes_at(rows + 8)
  assert found["next_rows"] == rows + 8
  assert found["compilations"] <= 24


def test_largest_fitting_reports_when_nothing_fits():
  found = load_gpu_report().largest_fitting(
    lambda rows: 100 * rows, 10, unit=8, max_rows=64, first_rows=32
  )
  assert found["rows"] is None
  assert found["next_rows"] == 8 and found["next_bytes"] > 10
