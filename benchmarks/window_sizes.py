"""A window's time as the model grows, and what its two forms cost.

ga_optax compiles each side of a window as a loop of at most one trip on a
GPU, which XLA:GPU compiles without copies, and as an add followed by a
conditional on the CPU (``ga_optax/_src/window/window_form.py`` chooses). Both forms make
the device's runtime read a predicate before it goes on; ``optax.MultiSteps``
has no control flow and runs the optimizer on every call instead. Which
costs more depends on the model's size: the bytes the optimizer moves grow
with it, the wait for a predicate does not.

For MLPs of growing size (micro-batch 8, Adam, k = 4) this times whole
windows of k donated, jitted calls on the device at hand: plain Adam (k
steps), ``optax.MultiSteps``, ``accumulate`` and ``accumulate_and_apply``,
each of the last two also in the CPU's form (``GA_OPTAX_WINDOW_FORM`` set
to ``conditional`` while tracing, so a GPU runs that form). Beside
each time: the bytes moved and copied on the micro-step path of the compiled
program (``audits.path_audit``). Times are medians of rounds.

Usage::

  python benchmarks/window_sizes.py                  # 4 sizes, up to 8 x 4096^2
  python benchmarks/window_sizes.py --quick          # 2 x 256^2 only

Prints a table and writes JSON (``--output``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402

from benchmarks import compiled_steps  # noqa: E402
from benchmarks import workloads as workloads_lib  # noqa: E402

SIZES = workloads_lib.MLP_SIZES
EVERY_K = 4
CONDITIONAL_FORM = " (conditional form)"
# The variable that pins the window's form while a step is traced.
WINDOW_FORM = "GA_OPTAX_WINDOW_FORM"


@contextlib.contextmanager
def conditional_form() -> Iterator[None]:
  """Traces ga_optax's window in the form it takes on the CPU, anywhere.

  ga_optax reads ``GA_OPTAX_WINDOW_FORM`` when it traces a step: set to
  ``conditional``, a program compiled for a GPU holds the CPU's form. The
  variable's earlier value is restored on the way out.
  """
  before = os.environ.get(WINDOW_FORM)
  os.environ[WINDOW_FORM] = "conditional"
  try:
    yield
  finally:
    if before is None:
      del os.environ[WINDOW_FORM]
    else:
      os.environ[WINDOW_FORM] = before


def fresh(step: Callable[..., Any]) -> Callable[..., Any]:
  """``step`` as a new function: jax keeps one trace per function, and a
  second jit of the same one would reuse the other form's trace."""
  return lambda *args: step(*args)


# benchmarks/compiled.py's steps that run one micro-batch per call.
STEPS = (
  "plain Adam",
  "optax.MultiSteps",
  "ga_optax.accumulate",
  "ga_optax.accumulate_and_apply",
)


def contenders(
  workload: workloads_lib.Workload,
) -> dict[str, tuple[Callable[..., Any], Any]]:
  """Each contender as ``(step, state)``; a step maps (params, state, batch)."""
  steps = compiled_steps.steps(workload)
  return {name: steps[name][:2] for name in STEPS}


def window_ms(
  compiled: Any, workload: workloads_lib.Workload, state: Any, rounds: int
) -> float:
  """Median time of one window (k calls), each round timing several."""
  params, state = jax.tree.map(lambda x: x.copy(), (workload.params, state))
  batches = workload.microbatches

  def windows(count: int) -> None:
    nonlocal params, state
    for _ in range(count):
      for batch in batches:
        params, state = compiled(params, state, batch)
    jax.block_until_ready((params, state))

  windows(3)
  start = time.perf_counter()
  windows(1)
  # Rounds of about 20 ms each, so that timer and dispatch noise stay small.
  per_round = max(1, int(0.02 / max(time.perf_counter() - start, 1e-6)))
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    windows(per_round)
    times.append((time.perf_counter() - start) / per_round * 1e3)
  return statistics.median(times)


def measure(width: int, depth: int, rounds: int) -> list[dict[str, Any]]:
  workload = workloads_lib.mlp(width, depth, 8, EVERY_K)
  rows = []
  for name, (step, state) in contenders(workload).items():
    forms = [""] + ([CONDITIONAL_FORM] if name.startswith("ga_optax") else [])
    for form in forms:
      with conditional_form() if form else contextlib.nullcontext():
        compiled = (
          jax.jit(fresh(step), donate_argnums=(0, 1))
          .lower(workload.params, state, workload.microbatches[0])
          .compile()
        )
      audit = compiled_steps.audit(compiled)["micro_step"]
      rows.append(
        {
          "mlp": f"{depth} x {width}^2",
          "params_mib": round(workload.num_params * 4 / 2**20, 1),
          "step": name + form,
          "window_ms": window_ms(compiled, workload, state, rounds),
          "micro_step_moved_mib": audit["moved_mib"],
          "micro_step_copied_mib": audit["copied_mib"],
        }
      )
  baseline = {
    row["mlp"]: row["window_ms"]
    for row in rows
    if row["step"] == "optax.MultiSteps"
  }
  for row in rows:
    row["over_multi_steps"] = row["window_ms"] / baseline[row["mlp"]]
  return rows


def table(rows: list[dict[str, Any]]) -> str:
  lines = [
    "| MLP | params MiB | step | window ms | / MultiSteps"
    " | micro-step MiB moved | copied |",
    "|---|---:|---|---:|---:|---:|---:|",
  ]
  for row in rows:
    lines.append(
      f"| {row['mlp']} | {row['params_mib']} | {row['step']}"
      f" | {row['window_ms']:.3f} | {row['over_multi_steps']:.2f}"
      f" | {row['micro_step_moved_mib']:.1f}"
      f" | {row['micro_step_copied_mib']:.1f} |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="one small size")
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument(
    "--output",
    type=pathlib.Path,
    default=REPO_ROOT / "benchmarks" / "results" / "window_sizes.json",
  )
  args = parser.parse_args(argv)
  rows = [
    row
    for width, depth in (SIZES[:1] if args.quick else SIZES)
    for row in measure(width, depth, args.rounds)
  ]
  device = jax.devices()[0]
  print(f"{device.platform}: {device.device_kind}, jax {jax.__version__}\n")
  print(table(rows))
  args.output.parent.mkdir(parents=True, exist_ok=True)
  args.output.write_text(
    json.dumps(
      {
        "device": device.device_kind,
        "platform": device.platform,
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "rows": rows,
      },
      indent=2,
    )
  )
  return rows


if __name__ == "__main__":
  main()
