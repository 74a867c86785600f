"""The run book's window times: every form of a window, side by side.

On the device at hand, for MLPs of 0.13M, 4.2M, 16.8M and 134M parameters
(micro-batch 8, Adam, k = 4) and the reference Transformer, this times the
windows of ``contenders.window_contenders``: plain Adam (k steps),
``optax.MultiSteps``, ``accumulate`` and ``accumulate_and_apply`` in their
default form and under ``gpu_compiler_options()`` (the GPU recipe,
where this ga_optax has it), both on the host's schedule (``closing=``),
the same work written by hand (``benchmarks/state_carrying.py``, carrying a
transformation's state, once more with as many more scalars as ga_optax's
state holds, and ``benchmarks/host_scheduled.py``) and the
one-``lax.cond`` window
(``benchmarks/cond_window.py``).

Each round runs, for every contender in an order that rotates from round to
round (a slow spell then falls on all alike):

* one window of k calls, each call waited for and timed: the per-call
  medians, the window's last call (the closing one) apart from the others,
  and how long a micro-step's call took to return (the host's dispatch,
  which bounds a small model's window);
* a few windows queued back to back and waited for once, about 20 ms of
  them: the time of a window as a training loop sees it.

Medians over rounds; ratios to the host-scheduled micro-step (the floor
written as a program), to ``optax.MultiSteps``' window and to the
state-carrying reference's window (``benchmarks/state_carrying.py``). Every
contender's params are checked finite at the end. Times, on whatever device
runs it: a CPU's say nothing about a GPU's.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import ga_optax
from benchmarks import contenders as contenders_lib
from benchmarks import workloads as workloads_lib

# Queued windows per round: enough that timer and launch noise stay small.
ROUND_SECONDS = 0.02
Record = dict[str, Any]


def gpu_options() -> dict[str, str] | None:
  """The GPU recipe's compiler options, or None where ga_optax lacks it."""
  recipe: Callable[[], dict[str, str]] | None = getattr(
    ga_optax, "gpu_compiler_options", None
  )
  return None if recipe is None else recipe()


def workloads(quick: bool) -> list[workloads_lib.Workload]:
  if quick:
    return [workloads_lib.mlp(256, 2, 8, 4)]
  mlps = [
    workloads_lib.mlp(width, depth, 8, 4)
    for width, depth in workloads_lib.MLP_SIZES
  ]
  return [*mlps, workloads_lib.reference_workloads(quick=False)[1]]


def fresh(tree: Any) -> Any:
  """A copy with its own buffers: the calls donate theirs."""
  return jax.tree.map(jnp.copy, tree)


def over_micro_steps(per_call: np.ndarray) -> float:
  """The median of rounds x calls figures over the micro-steps: every call
  but a window's last (the closing one), or the one call of a window of 1."""
  return float(
    np.median(per_call[:, :-1] if per_call.shape[1] > 1 else per_call)
  )


class Runner:
  """One contender's params and state, carried from window to window."""

  def __init__(
    self,
    contender: contenders_lib.WindowContender,
    workload: workloads_lib.Workload,
  ):
    self.contender = contender
    self.batches = workload.microbatches
    params = fresh(workload.params)
    self.carry = (params, fresh(contender.init(params)))
    self.calls_ms: list[list[float]] = []
    self.dispatch_us: list[list[float]] = []
    self.windows_ms: list[float] = []
    self.windows_per_round = 1

  def window(self, timed: bool) -> tuple[list[float], list[float]]:
    """Runs one window; with ``timed``, waits for and times every call: the
    milliseconds until each is done, and the microseconds until it returned
    (its dispatch on the host)."""
    done_ms, returned_us = [], []
    for call, batch in zip(self.contender.calls, self.batches, strict=True):
      start = time.perf_counter()
      self.carry = call(*self.carry, batch)
      if timed:
        returned_us.append((time.perf_counter() - start) * 1e6)
        jax.block_until_ready(self.carry)
        done_ms.append((time.perf_counter() - start) * 1e3)
    return done_ms, returned_us

  def queued_windows(self, count: int) -> float:
    """Milliseconds per window of ``count`` windows waited for once."""
    start = time.perf_counter()
    for _ in range(count):
      self.window(timed=False)
    jax.block_until_ready(self.carry)
    return (time.perf_counter() - start) / count * 1e3

  def warm_up(self) -> float:
    """Compiles every program; sets how many windows a round queues."""
    start = time.perf_counter()
    self.window(timed=True)
    compile_s = time.perf_counter() - start
    window_s = self.queued_windows(1) / 1e3
    self.windows_per_round = max(1, math.ceil(ROUND_SECONDS / window_s))
    return compile_s

  def round(self) -> None:
    done_ms, returned_us = self.window(timed=True)
    self.calls_ms.append(done_ms)
    self.dispatch_us.append(returned_us)
    self.windows_ms.append(self.queued_windows(self.windows_per_round))

  def result(self) -> Record:
    calls, dispatch = np.asarray(self.calls_ms), np.asarray(self.dispatch_us)
    return {
      "contender": self.contender.name,
      "micro_ms": over_micro_steps(calls),
      "closing_ms": float(np.median(calls[:, -1])),
      "window_ms": statistics.median(self.windows_ms),
      "micro_dispatch_us": over_micro_steps(dispatch),
      "windows_per_round": self.windows_per_round,
      "finite": all(
        bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(self.carry)
      ),
    }


def warm_up(runners: list[Runner]) -> tuple[list[Runner], Record, Record]:
  """Compiles every contender's programs: those that compiled, the seconds
  each first window took, and the errors of those that did not."""
  ready, first_window_s, failed = [], {}, {}
  for runner in runners:
    name = runner.contender.name
    print(f"  warming up {name}", file=sys.stderr, flush=True)
    try:
      first_window_s[name] = runner.warm_up()
    except Exception as error:  # one contender must not cost the others
      failed[name] = f"{type(error).__name__}: {error}"[:2000]
    else:
      ready.append(runner)
  return ready, first_window_s, failed


def over(value: float, reference: float | None) -> float | None:
  return None if reference is None else value / reference


def measure_workload(workload: workloads_lib.Workload, repeats: int) -> Record:
  """Every contender's medians on one workload, with the ratios."""
  options = gpu_options()
  runners, first_window_s, failed = warm_up(
    [
      Runner(contender, workload)
      for contender in contenders_lib.window_contenders(workload, options)
    ]
  )
  for round_index in range(repeats):
    shift = round_index % len(runners)
    for runner in runners[shift:] + runners[:shift]:
      runner.round()
  rows = [runner.result() for runner in runners]
  found = {row["contender"]: row for row in rows}
  floor = found.get(contenders_lib.HOST_SCHEDULED, {}).get("micro_ms")
  multi_steps = found.get("optax.MultiSteps", {}).get("window_ms")
  reference = found.get(contenders_lib.STATE_CARRYING, {}).get("window_ms")
  for row in rows:
    row["micro_over_host_scheduled"] = over(row["micro_ms"], floor)
    row["window_over_multi_steps"] = over(row["window_ms"], multi_steps)
    row["window_over_state_carrying"] = over(row["window_ms"], reference)
  caption = f"{workload.description}, {workload.num_params:,} params"
  if options is None:
    caption += "; no GPU recipe in this ga_optax"
  if failed:
    caption += f"; failed: {', '.join(failed)}"
  return {
    "caption": caption,
    "description": workload.description,
    "num_params": workload.num_params,
    "gpu_recipe": options,
    "first_window_s": first_window_s,
    "failed": failed,
    "rows": rows,
  }


def measure(quick: bool, repeats: int) -> Record:
  """Each workload's record, by name and size."""
  records = {}
  for workload in workloads(quick):
    name = f"{workload.name} {workload.num_params / 1e6:.2f}M"
    print(f"window_time: {name}", file=sys.stderr, flush=True)
    records[name] = measure_workload(workload, repeats)
  return records
