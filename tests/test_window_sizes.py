"""benchmarks/window_sizes.py: its rows, and the form it says it times.

Times are only checked to be there: on a shared CPU they say nothing. What
is checked exactly is the program each row times: the conditional form
really is the window without its loops, on the H100's program too.
"""

from __future__ import annotations

import json
import math

from gpu_compiler import compiled_for_gpu

from benchmarks import window_sizes
from benchmarks import workloads as workloads_lib
from ga_optax._src import audits

STEPS = [
  "plain Adam",
  "optax.MultiSteps",
  "ga_optax.accumulate",
  "ga_optax.accumulate (conditional form)",
  "ga_optax.accumulate_and_apply",
  "ga_optax.accumulate_and_apply (conditional form)",
]


def test_quick_run_times_every_step_and_writes_json(tmp_path, capsys):
  output = tmp_path / "sizes.json"
  rows = window_sizes.main(
    ["--quick", "--rounds", "2", "--output", str(output)]
  )
  assert [row["step"] for row in rows] == STEPS
  for row in rows:
    assert math.isfinite(row["window_ms"]) and row["window_ms"] > 0, row
    assert row["micro_step_moved_mib"] > 0, row
  multi_steps = rows[STEPS.index("optax.MultiSteps")]
  assert multi_steps["over_multi_steps"] == 1.0
  assert json.loads(output.read_text())["rows"] == rows
  assert "| 2 x 256^2 | 0.5 | ga_optax.accumulate |" in capsys.readouterr().out


def test_the_conditional_form_holds_no_loop_on_the_h100():
  workload = workloads_lib.mlp(256, 2, 8, window_sizes.EVERY_K)
  step, state = window_sizes.contenders(workload)["ga_optax.accumulate"]
  args = (workload.params, state, workload.microbatches[0])

  def audit() -> tuple[dict[str, int], list[str]]:
    program = compiled_for_gpu(
      window_sizes.fresh(step), *args, donate_argnums=(0, 1)
    )
    micro_step = audits.path_audit(program, "micro_step")
    return audits.window_sides(program), micro_step.misplaced_closing_work

  loops = {"keep_open": 0, "close_window": 3, "empty_window": 0}
  assert audit() == (loops, [])
  with window_sizes.conditional_form():
    # XLA:GPU turns that form's conditionals of cheap ops into selects:
    # closing work then runs on every micro-step, as in optax.MultiSteps.
    sides, misplaced = audit()
    assert sides["close_window"] < loops["close_window"], sides
    assert misplaced != []
  # The platform choice is restored on the way out.
  assert audit() == (loops, [])
