"""The steps the compiler benchmarks compile, and how their programs are read.

:func:`steps` builds each contender's train step as ``(step, state,
batch)``, params and state donated: plain Adam, ``optax.MultiSteps``,
ga_optax's windows, a hand-written ``lax.scan`` window, the floor (a
gradient added into a donated accumulator) and the host-scheduled window's
programs (``benchmarks/host_scheduled.py``). :func:`audit` reads a compiled
program's paths with ``audits.path_audit``: the bytes each moves,
its copies and the temporaries of ``memory_analysis()``. :func:`ratios`
checks the bytes against :data:`TARGETS`, :func:`windows` sums them over a
window of k calls, and :func:`tables` and :func:`windows_table` print both.
``benchmarks/compiled.py``, ``benchmarks/window_sizes.py``,
``benchmarks/cond_window.py`` and ``benchmarks/gpu_report.py`` use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import ga_optax
from benchmarks import host_scheduled as host_scheduled_lib
from benchmarks import workloads as workloads_lib
from ga_optax._src import audits

MIB = 2**20
# The least a micro-step can do, and the host-scheduled window's programs
# (benchmarks/host_scheduled.py): steps without control flow, so each has
# one path, which both of ``audit``'s paths read.
FLOOR = "floor: gradient + add"
HOST_FIRST_STEP = "host-scheduled: first micro-step"
HOST_MICRO_STEP = "host-scheduled: micro-step"
HOST_CLOSING_STEP = "host-scheduled: closing step"
# The closing step's work written by hand: gradient, add, scale, Adam, apply,
# a cleared accumulator; what a host-scheduled closing call is held to.
BY_HAND_CLOSING = "by hand: closing step"
# ga_optax's own windows when the host chooses the side (closing=).
ACCUMULATE_HOST_MICRO = "ga_optax.accumulate, closing=False"
ACCUMULATE_HOST_CLOSING = "ga_optax.accumulate, closing=True"
FUSED_HOST_MICRO = "ga_optax.accumulate_and_apply, closing=False"
FUSED_HOST_CLOSING = "ga_optax.accumulate_and_apply, closing=True"

# (figure, numerator, denominator, target, goal): bytes moved per path.
TARGETS = [
  (
    "accumulate(adam) micro-step / optax.MultiSteps micro-step",
    ("ga_optax.accumulate", "micro_step"),
    ("optax.MultiSteps", "micro_step"),
    0.55,
    None,
  ),
  (
    "accumulate_and_apply(adam) micro-step / floor (gradient + add)",
    ("ga_optax.accumulate_and_apply", "micro_step"),
    (FLOOR, "micro_step"),
    1.05,
    None,
  ),
  (
    "accumulate(adam) closing step / plain Adam step",
    ("ga_optax.accumulate", "closing"),
    ("plain Adam", "micro_step"),
    1.35,
    1.15,
  ),
  (
    "accumulate_and_apply(adam) closing step / plain Adam step",
    ("ga_optax.accumulate_and_apply", "closing"),
    ("plain Adam", "micro_step"),
    1.35,
    1.15,
  ),
  (
    "noise-scale micro-step / micro-step without",
    ("ga_optax.accumulate + noise scale", "micro_step"),
    ("ga_optax.accumulate", "micro_step"),
    1.15,
    None,
  ),
  (
    "microbatched_value_and_grad window / hand-written lax.scan window",
    ("ga_optax.microbatched_value_and_grad", "micro_step"),
    ("hand-written lax.scan", "micro_step"),
    1.02,
    None,
  ),
  (
    "accumulate(adam), closing=False / floor (gradient + add)",
    (ACCUMULATE_HOST_MICRO, "micro_step"),
    (FLOOR, "micro_step"),
    1.01,
    None,
  ),
  (
    "accumulate_and_apply(adam), closing=False / floor (gradient + add)",
    (FUSED_HOST_MICRO, "micro_step"),
    (FLOOR, "micro_step"),
    1.01,
    None,
  ),
  (
    "accumulate(adam), closing=True / the same work by hand",
    (ACCUMULATE_HOST_CLOSING, "closing"),
    (BY_HAND_CLOSING, "closing"),
    1.05,
    None,
  ),
  (
    "accumulate_and_apply(adam), closing=True / the same work by hand",
    (FUSED_HOST_CLOSING, "closing"),
    (BY_HAND_CLOSING, "closing"),
    1.05,
    None,
  ),
]
# Peak memory (memory_analysis()): each step at most MultiSteps'.
PEAK_HELD_TO_MULTI_STEPS = (
  "ga_optax.accumulate",
  "ga_optax.accumulate_and_apply",
  ACCUMULATE_HOST_MICRO,
  ACCUMULATE_HOST_CLOSING,
  FUSED_HOST_MICRO,
  FUSED_HOST_CLOSING,
)


def hand_written_scan(
  loss_fn: Callable[..., Any], num_microbatches: int
) -> Callable[..., Any]:
  """Mean value and gradient over contiguous micro-batches, one ``lax.scan``:
  what a user writes by hand."""
  value_and_grad = jax.value_and_grad(loss_fn)

  def window(params, batch):
    microbatches = jax.tree.map(
      lambda leaf: leaf.reshape(num_microbatches, -1, *leaf.shape[1:]), batch
    )

    def add(sums, microbatch):
      return jax.tree.map(
        jnp.add, sums, value_and_grad(params, microbatch)
      ), None

    zeros = (jnp.zeros((), jnp.float32), optax.tree.zeros_like(params))
    sums, _ = jax.lax.scan(add, zeros, microbatches)
    return jax.tree.map(lambda total: total / num_microbatches, sums)

  return window


def steps(
  workload: workloads_lib.Workload,
) -> dict[str, tuple[Callable[..., Any], Any, Any]]:
  """Each contender as ``(step, state, batch)``, params and state donated."""
  loss_fn, k = workload.loss_fn, workload.every_k
  adam = optax.adam(1e-3)

  def transformation(tx, **options):
    def step(params, state, batch):
      updates, state = tx.update(
        jax.grad(loss_fn)(params, batch), state, params, **options
      )
      return optax.apply_updates(params, updates), state

    return step, tx.init(workload.params), workload.microbatches[0]

  fused_tx = ga_optax.accumulate_and_apply(adam, k)
  accumulate = ga_optax.accumulate(adam, k)

  def fused(**options):
    def step(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      return fused_tx.apply(params, grads, state, **options)

    return step, fused_tx.init(workload.params), workload.microbatches[0]

  def in_step(window):
    def step(params, state, batch):
      _, grads = window(params, batch)
      updates, state = adam.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    return step, adam.init(workload.params), workload.window_batch

  return {
    "plain Adam": transformation(adam),
    "optax.MultiSteps": transformation(optax.MultiSteps(adam, k)),
    "ga_optax.accumulate": transformation(accumulate),
    "ga_optax.accumulate + noise scale": transformation(
      ga_optax.accumulate(adam, k, noise_scale_decay=0.9)
    ),
    "ga_optax.accumulate_and_apply": fused(),
    ACCUMULATE_HOST_MICRO: transformation(accumulate, closing=False),
    ACCUMULATE_HOST_CLOSING: transformation(accumulate, closing=True),
    FUSED_HOST_MICRO: fused(closing=False),
    FUSED_HOST_CLOSING: fused(closing=True),
    "ga_optax.microbatched_value_and_grad": in_step(
      ga_optax.microbatched_value_and_grad(loss_fn, k)
    ),
    "hand-written lax.scan": in_step(hand_written_scan(loss_fn, k)),
    **host_scheduled_steps(workload, adam),
  }


def host_scheduled_steps(
  workload: workloads_lib.Workload, optimizer: optax.GradientTransformation
) -> dict[str, tuple[Callable[..., Any], Any, Any]]:
  """The floor and the host-scheduled window's programs, as ``steps`` gives
  them: ``step(params, state, batch)``, params and state donated.

  A micro-step's program donates only its sums; here the params are donated
  too and handed back untouched, which XLA aliases without moving a byte.
  """
  loss_fn, params = workload.loss_fn, workload.params
  micro_step = host_scheduled_lib.micro_step_fn(loss_fn)
  closing_step = host_scheduled_lib.closing_step_fn(loss_fn, optimizer)

  def floor(params, accumulator, batch):
    grads = jax.grad(loss_fn)(params, batch)
    return params, jax.tree.map(jnp.add, accumulator, grads)

  def first(params, sums, batch):
    del sums  # None: the first micro-step writes the sums
    return params, *micro_step(params, None, batch, None)

  def micro(params, sums, batch):
    return params, *micro_step(params, sums, batch, None)

  def closing(params, opt_state, sums_and_batch):
    # The sums ride with the batch: the closing step does not donate them.
    sums, batch = sums_and_batch
    return closing_step(params, opt_state, sums, batch, None)

  def by_hand_closing(params, state, batch):
    """Gradient, add, scale, optimizer, apply; the accumulator cleared."""
    (accumulator, weight), opt_state = state
    grads = jax.grad(loss_fn)(params, batch)
    scale = 1.0 / (weight + 1.0)
    mean = jax.tree.map(
      lambda total, grad: (total + grad) * scale, accumulator, grads
    )
    updates, opt_state = optimizer.update(mean, opt_state, params)
    cleared = (optax.tree.zeros_like(accumulator), jnp.zeros_like(weight))
    return optax.apply_updates(params, updates), (cleared, opt_state)

  sums = host_scheduled_lib.WindowSums(
    optax.tree.zeros_like(params), jnp.ones((), jnp.float32)
  )
  batch = workload.microbatches[0]
  return {
    FLOOR: (floor, optax.tree.zeros_like(params), batch),
    BY_HAND_CLOSING: (
      by_hand_closing,
      (tuple(sums), optimizer.init(params)),
      batch,
    ),
    HOST_FIRST_STEP: (first, None, batch),
    HOST_MICRO_STEP: (micro, sums, batch),
    HOST_CLOSING_STEP: (closing, optimizer.init(params), (sums, batch)),
  }


def audit_path(program: Any, path: str) -> audits.PathAudit:
  """``audits.path_audit`` of any step: a step without a ga_optax window
  (plain Adam, MultiSteps, the floor) is read whole, as every call runs it.
  """
  return audits.path_audit(program, path, require_window=False)


def audit(program: Any) -> dict[str, Any]:
  """One compiled step's paths: bytes moved, copies, temporaries.

  Reads any compiled program: ``benchmarks/compiled.py``'s H100 ones, or one
  compiled for the device at hand (``benchmarks/gpu_report.py`` compares the
  two).
  """
  memory = program.memory_analysis()
  record: dict[str, Any] = {
    "temp_mib": memory.temp_size_in_bytes / MIB,
    "peak_mib": memory.peak_memory_in_bytes / MIB,
  }
  for path in ("micro_step", "closing"):
    path_audit = audit_path(program, path)
    record[path] = {
      "moved_mib": path_audit.bytes_moved / MIB,
      "copied_mib": path_audit.copied_bytes() / MIB,
      "copies_of_1_mib_or_more": sum(
        copy.bytes >= MIB for copy in path_audit.copies
      ),
      "misplaced_closing_work": len(path_audit.misplaced_closing_work),
    }
  return record


def ratios(records: dict[str, Any]) -> list[dict[str, Any]]:
  rows = []
  for figure, (top, top_path), (bottom, bottom_path), target, goal in TARGETS:
    value = (
      records[top][top_path]["moved_mib"]
      / records[bottom][bottom_path]["moved_mib"]
    )
    rows.append(
      {
        "figure": figure,
        "ratio": value,
        "target": target,
        "goal": goal,
        "met": value <= target,
      }
    )
  return rows


def windows(records: dict[str, Any], every_k: int) -> list[dict[str, Any]]:
  """Bytes moved per micro-step, closing step and whole window of ``every_k``
  calls, beside the floor, a plain Adam step and ``optax.MultiSteps``.

  Plain Adam's window is ``every_k`` optimizer steps: the work a window
  saves. The host-scheduled window is its first micro-step, ``every_k - 2``
  others and its closing step.
  """

  def moved(name: str, path: str = "micro_step") -> float:
    return records[name][path]["moved_mib"]

  calls = {
    "plain Adam": (moved("plain Adam"), moved("plain Adam")),
    "optax.MultiSteps": (moved("optax.MultiSteps"),) * 2,
    "ga_optax.accumulate": (
      moved("ga_optax.accumulate"),
      moved("ga_optax.accumulate", "closing"),
    ),
    "ga_optax.accumulate_and_apply": (
      moved("ga_optax.accumulate_and_apply"),
      moved("ga_optax.accumulate_and_apply", "closing"),
    ),
    "ga_optax.accumulate, closing=": (
      moved(ACCUMULATE_HOST_MICRO),
      moved(ACCUMULATE_HOST_CLOSING, "closing"),
    ),
    "ga_optax.accumulate_and_apply, closing=": (
      moved(FUSED_HOST_MICRO),
      moved(FUSED_HOST_CLOSING, "closing"),
    ),
    "host-scheduled window": (
      moved(HOST_MICRO_STEP),
      moved(HOST_CLOSING_STEP, "closing"),
    ),
  }
  window = {
    name: (every_k - 1) * micro + closing
    for name, (micro, closing) in calls.items()
  }
  window["host-scheduled window"] = (
    moved(HOST_CLOSING_STEP, "closing")
    + min(every_k - 1, 1) * moved(HOST_FIRST_STEP)
    + max(every_k - 2, 0) * moved(HOST_MICRO_STEP)
  )
  return [
    {
      "step": name,
      "micro_step_mib": micro,
      "micro_step_over_floor": micro / moved(FLOOR),
      "closing_mib": closing,
      "closing_over_plain_adam": closing / moved("plain Adam"),
      "window_mib": window[name],
      "window_over_multi_steps": window[name] / window["optax.MultiSteps"],
    }
    for name, (micro, closing) in calls.items()
  ]


def windows_table(
  rows: list[dict[str, Any]], compiled_for: str = "H100"
) -> str:
  lines = [
    f"| window ({compiled_for}-compiled, MiB moved) | micro-step | / floor |"
    " closing step | / plain Adam | window | / MultiSteps |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for row in rows:
    lines.append(
      f"| {row['step']} | {row['micro_step_mib']:.1f}"
      f" | {row['micro_step_over_floor']:.3f} | {row['closing_mib']:.1f}"
      f" | {row['closing_over_plain_adam']:.3f} | {row['window_mib']:.1f}"
      f" | {row['window_over_multi_steps']:.3f} |"
    )
  return "\n".join(lines)


def tables(
  records: dict[str, Any],
  rows: list[dict[str, Any]],
  compiled_for: str = "H100",
) -> str:
  lines = [
    f"| step ({compiled_for}-compiled) | micro-step MiB moved | copies MiB |"
    " closing MiB moved | copies MiB | temp MiB | peak MiB | host waits |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for name, record in records.items():
    micro, closing = record["micro_step"], record["closing"]
    # Per path, where measured (micro-step / closing).
    waits = "/".join(str(count) for count in record.get("host_waits", ()))
    lines.append(
      f"| {name} | {micro['moved_mib']:.1f} | {micro['copied_mib']:.0f} |"
      f" {closing['moved_mib']:.1f} | {closing['copied_mib']:.0f} |"
      f" {record['temp_mib']:.0f} | {record['peak_mib']:.1f} | {waits} |"
    )
  lines += [
    "",
    "| figure (bytes moved) | ratio | target | met |",
    "|---|---:|---:|---|",
  ]
  for row in rows:
    goal = f" (goal {row['goal']})" if row["goal"] else ""
    lines.append(
      f"| {row['figure']} | {row['ratio']:.3f} | <= {row['target']}{goal} |"
      f" {'yes' if row['met'] else 'NO'} |"
    )
  return "\n".join(lines)
