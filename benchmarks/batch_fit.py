"""The largest batch whose step fits a memory budget, with and without
accumulation.

:func:`measure` compiles (never runs) the train step of the reference MLP
for growing batch sizes and reads the device bytes of each executable: the
largest single batch of a plain Adam step, and the largest micro-batch of
``accumulate(adam)`` (``ga_optax.planning.micro_step_bytes``), whose window
of :data:`EFFECTIVE_K` micro-batches is the batch one update then takes.
:func:`budget` is a share of ``memory_stats()["bytes_limit"]``, or given;
:func:`largest_fitting` searches the rows. ``benchmarks/largest_batch.py``
and ``benchmarks/gpu_report.py`` use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

import ga_optax
from benchmarks import host_offload
from benchmarks import workloads as workloads_lib
from ga_optax._src.planning import device_memory

MIB = 2**20
# A micro-step's memory does not grow with k: any k fits, and the effective
# batch is quoted at this one.
EFFECTIVE_K = 32
Record = dict[str, Any]


def largest_fitting(
  bytes_at: Callable[[int], int], budget: int, max_rows: int
) -> Record:
  """Nearly the most rows whose bytes fit ``budget``, for bytes that grow
  with the rows, in few measurements (on a GPU each is a compilation of
  seconds): each probe aims where the line through the two measurements
  nearest the budget meets it, a little past it on the side not yet seen,
  and halves the bracket instead when the aim is outside it or has stopped
  narrowing it. Stops when the next size measured, which does not fit, is
  within 1% of the largest that fits."""
  measured: dict[int, int] = {}

  def fits(rows: int) -> bool:
    if rows not in measured:
      measured[rows] = bytes_at(rows)
    return measured[rows] <= budget

  def aim() -> float | None:
    nearest = sorted(measured, key=lambda rows: abs(measured[rows] - budget))
    if len(nearest) < 2:
      return None
    first, second = sorted(nearest[:2])
    rise = measured[second] - measured[first]
    if rise <= 0:
      return None
    return first + (budget - measured[first]) * (second - first) / rise

  low, high, probe, slow = 0, max_rows + 1, 1, 0
  while True:
    width = high - low
    if fits(probe):
      low = probe
    else:
      high = probe
    beyond = high > max_rows  # nothing measured has failed to fit yet
    if high - low <= max(1, low // 128) and not (beyond and low < max_rows):
      break
    slow = slow + 1 if 2 * (high - low) > width else 0
    target = aim()
    if target is None:
      guess = 2 * probe if probe == low else (low + high) // 2
    else:
      # Just past the aim, on the side of the budget the last probe missed.
      guess = (
        int(target * (1 + 1 / 512)) + 1
        if probe == low
        else int(target * (1 - 1 / 512))
      )
    if beyond and guess >= max_rows:
      guess = max_rows
    elif slow >= 2 or not low < guess < high:
      guess, slow = (low + high) // 2, 0
    probe = guess
  return {
    "rows": low or None,
    "bytes": measured.get(low),
    "next_rows": high if high in measured else None,
    "next_bytes": measured.get(high),
  }


def budget(
  memory_budget_mib: float | None, memory_fraction: float, quick: bool
) -> tuple[int, str]:
  """The bytes a step may use, and where that figure comes from."""
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  if memory_budget_mib is not None:
    return int(memory_budget_mib * MIB), "--memory-budget-mib"
  if limit:
    return (
      int(limit * memory_fraction),
      f"{memory_fraction} x memory_stats()['bytes_limit']",
    )
  nominal = 4 if quick else 1024
  return nominal * MIB, f"nominal {nominal} MiB: no memory limit reported"


def measure(budget_bytes: int, source: str, quick: bool) -> Record:
  """The largest single batch, and accumulate micro-batch, that fit."""
  workload = workloads_lib.mlp(*((128, 2) if quick else (2048, 4)), 8, 4)
  params, example = workload.params, workload.microbatches[0]
  step, init = host_offload.step_and_init(host_offload.CONFIGS[0], workload)
  state, adam = init(params), optax.adam(host_offload.LEARNING_RATE)

  def single_batch_bytes(rows: int) -> int:
    batch = jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct((rows, *leaf.shape[1:]), leaf.dtype),
      example,
    )
    compiled = step.lower(params, state, batch).compile()
    return device_memory.device_bytes(compiled)

  def micro_step_bytes(rows: int) -> int:
    return ga_optax.planning.micro_step_bytes(
      workload.loss_fn, params, example, rows, optimizer=adam
    )

  max_rows = 2**16 if quick else 2**22
  single = largest_fitting(single_batch_bytes, budget_bytes, max_rows)
  micro = largest_fitting(micro_step_bytes, budget_bytes, max_rows)
  effective = (micro["rows"] or 0) * EFFECTIVE_K
  return {
    "workload": workload.description,
    "budget_bytes": budget_bytes,
    "budget_source": source,
    "largest": [
      {"step": "plain Adam step", **single, "batch": single["rows"]},
      {"step": "accumulate(adam)", **micro, "batch": effective},
    ],
    "effective_over_single": effective / (single["rows"] or 1),
  }


def caption(record: Record) -> str:
  return (
    f"{record['workload']}; budget {record['budget_bytes'] / MIB:.3f} MiB"
    f" ({record['budget_source']}). batch: the rows one update takes;"
    f" accumulate's, k = {EFFECTIVE_K} micro-batches, is"
    f" {record['effective_over_single']:.3g}x the largest single batch."
  )
