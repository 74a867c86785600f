"""Times and compiled memory of the contenders, measured side by side.

:func:`measure_workload` runs every contender of ``benchmarks/contenders.py``
on one workload, interleaved round by round (the order rotates each round)
so that a noisy neighbour slows all contenders alike, and takes medians;
calls that close a window are timed apart from the other micro-steps.
Compiled memory comes from XLA's own analysis of each executable.
:func:`figures` turns one workload's medians into the ratios of
:data:`FIGURES` and checks each against its target.
"""

from __future__ import annotations

import gc
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import contenders as contenders_lib

MIB = 2**20

_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "f64": 8,
  "s64": 8,
  "u64": 8,
}


_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(")


# (figure, numerator, denominator, how, target); `how` picks the measure.
# The first four are the device's schedule (``closing=None``, the default)
# on the CPU, held to the contract's targets for it (shared/DESIGN.md,
# section 5, "CPU times"): the 0.6 window measured 1.19x, 1.97x, 1.45x and
# 1.99x on a quiet machine.
FIGURES = [
  (
    "accumulate micro-step / floor (gradient + accumulate + zero updates)",
    ("ga_optax.accumulate", "micro_ms"),
    ("floor: + write and apply zero updates", "micro_ms"),
    "<=",
    0.75,
  ),
  (
    "MultiSteps micro-step / accumulate micro-step",
    ("optax.MultiSteps", "micro_ms"),
    ("ga_optax.accumulate", "micro_ms"),
    ">=",
    3.0,
  ),
  (
    "accumulate window-closing step / plain Adam step",
    ("ga_optax.accumulate", "closing_ms"),
    ("plain Adam step", "micro_ms"),
    "<=",
    1.1,
  ),
  (
    "accumulate compiled temp bytes / plain Adam step's",
    ("ga_optax.accumulate", "temp_bytes"),
    ("plain Adam step", "temp_bytes"),
    "<=",
    0.6,
  ),
  (
    "micro-batched window / (k gradients + one optimizer step)",
    ("ga_optax.microbatched_value_and_grad", "window_ms"),
    ("k gradients + optimizer", "window_ms"),
    "<=",
    1.15,
  ),
  (
    "fused micro-step / floor (gradient + accumulate)",
    ("ga_optax.accumulate_and_apply", "micro_ms"),
    ("floor: gradient + accumulate", "micro_ms"),
    "<=",
    1.15,
  ),
  (
    "fused window-closing step / plain Adam step",
    ("ga_optax.accumulate_and_apply", "closing_ms"),
    ("plain Adam step", "micro_ms"),
    "<=",
    1.25,
  ),
  (
    "fused compiled temp bytes / plain Adam step's",
    ("ga_optax.accumulate_and_apply", "temp_bytes"),
    ("plain Adam step", "temp_bytes"),
    "<=",
    1.10,
  ),
  (
    "accumulate micro-step with the noise scale / without",
    ("ga_optax.accumulate + noise scale", "micro_ms"),
    ("ga_optax.accumulate", "micro_ms"),
    "<=",
    1.15,
  ),
  (
    "accumulate window-closing step with the noise scale / without",
    ("ga_optax.accumulate + noise scale", "closing_ms"),
    ("ga_optax.accumulate", "closing_ms"),
    "info",
    None,
  ),
  (
    "accumulate compiled temp bytes with the noise scale / without",
    ("ga_optax.accumulate + noise scale", "temp_bytes"),
    ("ga_optax.accumulate", "temp_bytes"),
    "info",
    None,
  ),
  (
    "host-scheduled accumulate window / state-carrying reference's",
    (contenders_lib.ACCUMULATE_HOST, "window_ms"),
    (contenders_lib.STATE_CARRYING, "window_ms"),
    "<=",
    1.05,
  ),
  (
    "host-scheduled accumulate_and_apply window / state-carrying reference's",
    (contenders_lib.FUSED_HOST, "window_ms"),
    (contenders_lib.STATE_CARRYING, "window_ms"),
    "<=",
    1.05,
  ),
  (
    "MultiSteps micro-step / floor (gradient + accumulate + zero updates)",
    ("optax.MultiSteps", "micro_ms"),
    ("floor: + write and apply zero updates", "micro_ms"),
    "info",
    None,
  ),
  (
    "MultiSteps window-closing step / plain Adam step",
    ("optax.MultiSteps", "closing_ms"),
    ("plain Adam step", "micro_ms"),
    "info",
    None,
  ),
  (
    "MultiSteps compiled temp bytes / plain Adam step's",
    ("optax.MultiSteps", "temp_bytes"),
    ("plain Adam step", "temp_bytes"),
    "info",
    None,
  ),
]


def _hlo_copies(hlo_text: str, min_bytes: int = MIB) -> tuple[int, int]:
  """Count and total bytes of ``copy`` instructions of at least min_bytes."""
  count = total = 0
  for dtype, dims in _COPY.findall(hlo_text):
    size = _DTYPE_BYTES.get(dtype, 4) * int(
      np.prod([int(d) for d in dims.split(",") if d] or [1])
    )
    if size >= min_bytes:
      count += 1
      total += size
  return count, total


def _fresh(tree: Any) -> Any:
  """A copy with its own buffers (donation consumes the ones passed in)."""
  return jax.tree.map(jnp.copy, tree)


def _feeds(contender, workload, fixed_grads) -> list[Any]:
  """The arguments of the calls of one window."""
  if contender.feed == "micro":
    return list(workload.microbatches)
  if contender.feed == "window":
    return [workload.window_batch]
  return [fixed_grads] * workload.every_k


def _memory(contender, params, state, batch) -> dict[str, Any]:
  step = contender.closing_step or contender.step
  compiled = step.lower(params, state, batch).compile()
  analysis = compiled.memory_analysis()
  text = compiled.as_text()
  copies, copied_bytes = _hlo_copies(text)
  return {
    "temp_bytes": int(analysis.temp_size_in_bytes),
    "argument_bytes": int(analysis.argument_size_in_bytes),
    "output_bytes": int(analysis.output_size_in_bytes),
    "alias_bytes": int(analysis.alias_size_in_bytes),
    "large_copies": copies,
    "large_copy_bytes": copied_bytes,
    "conditionals": text.count(" conditional("),
  }


def measure_workload(
  workload, repeats: int, warmup: int, only: list[str] | None = None
) -> dict[str, Any]:
  """Every contender's medians and compiled memory on ``workload``; with
  ``only``, those whose name holds one of its texts."""
  contenders = [
    contender
    for contender in contenders_lib.build(workload)
    if only is None or any(text in contender.name for text in only)
  ]
  fixed_grads = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p), workload.params)
  carries, feeds, results = {}, {}, {}
  for contender in contenders:
    params = _fresh(workload.params)
    # Its own buffers too: donation refuses one buffer passed for two
    # leaves, as an init that shares a zero between leaves returns.
    state = _fresh(contender.init(params))
    feeds[contender.name] = _feeds(contender, workload, fixed_grads)
    print(f"  compiling {contender.name}", file=sys.stderr, flush=True)
    results[contender.name] = {
      "description": contender.description,
      "feed": contender.feed,
      "closes_windows": contender.closes_windows,
      "memory": _memory(contender, params, state, feeds[contender.name][0]),
      "rounds_ms": [],
    }
    carries[contender.name] = (params, state)

  def run_window(contender) -> list[float]:
    params, state = carries[contender.name]
    times = []
    batches = feeds[contender.name]
    for index, batch in enumerate(batches):
      # The host's schedule: the host picks the last call's program.
      step = contender.step
      if contender.closing_step is not None and index == len(batches) - 1:
        step = contender.closing_step
      start = time.perf_counter()
      params, state = step(params, state, batch)
      jax.block_until_ready((params, state))
      times.append((time.perf_counter() - start) * 1e3)
    carries[contender.name] = (params, state)
    return times

  gc.collect()
  gc.disable()
  try:
    for round_index in range(warmup + repeats):
      # Rotating the order spreads slow spells over all contenders.
      shift = round_index % len(contenders)
      for contender in contenders[shift:] + contenders[:shift]:
        times = run_window(contender)
        if round_index >= warmup:
          results[contender.name]["rounds_ms"].append(times)
      print(
        f"  round {round_index + 1}/{warmup + repeats}",
        file=sys.stderr,
        flush=True,
      )
  finally:
    gc.enable()

  for contender in contenders:
    result = results[contender.name]
    rounds = np.asarray(result["rounds_ms"])
    if contender.closes_windows:
      result["micro_ms"] = float(np.median(rounds[:, :-1]))
      result["closing_ms"] = float(np.median(rounds[:, -1]))
    else:
      result["micro_ms"] = result["closing_ms"] = float(np.median(rounds))
    result["window_ms"] = float(np.median(rounds.sum(axis=1)))
    result["temp_bytes"] = result["memory"]["temp_bytes"]
  if "gradient only" in results and "optimizer only" in results:
    results["k gradients + optimizer"] = {
      "description": "derived: k x gradient only + optimizer only",
      "window_ms": workload.every_k * results["gradient only"]["micro_ms"]
      + results["optimizer only"]["micro_ms"],
    }
  return {
    "description": workload.description,
    "config": workload.config,
    "num_params": workload.num_params,
    "contenders": results,
  }


def figures(workload_name: str, record: dict[str, Any]) -> list[dict]:
  """The ratios of :data:`FIGURES` in one workload's record, and whether
  each meets its target."""
  rows = []
  results = record["contenders"]
  for name, (top, top_key), (bottom, bottom_key), how, target in FIGURES:
    if top not in results or bottom not in results:
      continue
    value = results[top][top_key] / results[bottom][bottom_key]
    met = None
    if how == "<=":
      met = value <= target
    elif how == ">=":
      met = value >= target
    rows.append(
      {
        "workload": workload_name,
        "figure": name,
        "value": value,
        "target": None if target is None else f"{how} {target}",
        "met": met,
      }
    )
  return rows
