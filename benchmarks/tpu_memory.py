"""Peak memory on a TPU chip, and the micro-batch the planner finds for it.

Compiles (never runs) one train step of a deep tanh MLP for a compile-only
TPU chip (``audits.compile_for_tpu``: ``libtpu`` is needed, a TPU
is not), params and state donated, and reads each program's peak memory
(``memory_analysis().peak_memory_in_bytes``): plain Adam, ``optax.MultiSteps``
``ga_optax.accumulate``, the device deciding and the host (``closing=False``
and ``closing=True``), and ``ga_optax.accumulate_and_apply``, the device
deciding; and the bytes a micro-step moves (the path audit), against the
floor: the host's micro-step, the gradient added into the accumulator. Then
``ga_optax.planning.plan_microbatch``,
compiling for the same chip (``device=``), finds the largest micro-batch of
``accumulate(adam)`` whose micro-step fits a share of the chip's memory, and
the k that reaches the global batch. These are compiler figures, never
times.

Usage::

  JAX_PLATFORMS=cpu python benchmarks/tpu_memory.py     # 24 x 4096², v5e
  JAX_PLATFORMS=cpu python benchmarks/tpu_memory.py --depth 2 --width 256
  JAX_PLATFORMS=cpu python benchmarks/tpu_memory.py --depth 4 --width 1024 \
    --micro-batch 8    # the micro-step's bytes where the state fits on-chip
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
# libtpu compiles on a machine without a TPU; JAX must not look for one.
if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import ga_optax  # noqa: E402
from ga_optax._src import audits  # noqa: E402

GIB = 2**30
# Each generation's high-bandwidth memory per chip, as published; the
# compile-only chips do not report it.
HBM_BYTES = {"v5e": 16 * GIB, "v6e": 32 * GIB, "v5p": 95 * GIB, "v4": 32 * GIB}


def mlp(width: int, depth: int) -> tuple[dict[str, Any], Any]:
  """Abstract params of a ``depth`` x ``width``² tanh MLP, and its loss."""
  params = {
    f"w{i}": jax.ShapeDtypeStruct((width, width), jnp.float32)
    for i in range(depth)
  }

  def loss_fn(params, batch):
    x = batch["x"]
    for i in range(depth):
      x = jnp.tanh(x @ params[f"w{i}"])
    return jnp.mean(x**2)

  return params, loss_fn


def train_step(loss_fn: Any, tx: Any, **options: Any) -> Any:
  """A step of ``tx`` on ``loss_fn``'s gradient, its updates applied."""

  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, **options)
    return optax.apply_updates(params, updates), state

  return step


# The floor of a micro-step's bytes: the gradient added into the accumulator.
FLOOR = "accumulate, closing=False"
# The steps whose bytes are a micro-step's: all but closing=True's program,
# which closes the window.
MICRO_STEPS = (
  "plain Adam",
  "optax.MultiSteps",
  "accumulate, the device decides",
  FLOOR,
  "accumulate_and_apply, the device",
)


def compiled_figures(
  width: int, depth: int, micro_batch: int, k: int, target: str
) -> tuple[dict[str, int], dict[str, int]]:
  """Each contender's peak memory, and the bytes its micro-step moves
  (:data:`MICRO_STEPS`), from its program compiled once."""
  params, loss_fn = mlp(width, depth)
  batch = {"x": jax.ShapeDtypeStruct((micro_batch, width), jnp.float32)}
  adam = optax.adam(1e-3)

  def fused_step(tx):
    def step(params, state, batch):
      return tx.apply(params, jax.grad(loss_fn)(params, batch), state)

    return step

  accumulate = ga_optax.accumulate(adam, k)
  fused = ga_optax.accumulate_and_apply(adam, k)
  multi_steps = optax.MultiSteps(adam, k)
  contenders = {
    "plain Adam": (train_step(loss_fn, adam), adam),
    "optax.MultiSteps": (train_step(loss_fn, multi_steps), multi_steps),
    "accumulate, the device decides": (
      train_step(loss_fn, accumulate),
      accumulate,
    ),
    "accumulate, closing=False": (
      train_step(loss_fn, accumulate, closing=False),
      accumulate,
    ),
    "accumulate, closing=True": (
      train_step(loss_fn, accumulate, closing=True),
      accumulate,
    ),
    "accumulate_and_apply, the device": (fused_step(fused), fused),
  }
  peaks, moved = {}, {}
  for name, (step, tx) in contenders.items():
    program = audits.compile_for_tpu(
      step,
      params,
      jax.eval_shape(tx.init, params),
      batch,
      target=target,
      donate_argnums=(0, 1),
    )
    peaks[name] = int(program.memory_analysis().peak_memory_in_bytes)
    if name in MICRO_STEPS:
      moved[name] = audits.path_audit(
        program, "micro_step", require_window=False
      ).bytes_moved
  return peaks, moved


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=4096)
  parser.add_argument("--depth", type=int, default=24)
  parser.add_argument("--micro-batch", type=int, default=64)
  parser.add_argument("--every-k", type=int, default=4)
  parser.add_argument("--target", default="v5e", choices=sorted(HBM_BYTES))
  parser.add_argument("--global-batch", type=int, default=32768)
  # Headroom for the runtime's own buffers and fragmentation.
  parser.add_argument("--memory-fraction", type=float, default=0.9)
  parser.add_argument(
    "--output",
    type=pathlib.Path,
    default=REPO_ROOT / "benchmarks" / "results" / "tpu_memory.json",
  )
  args = parser.parse_args(argv)

  params, loss_fn = mlp(args.width, args.depth)
  param_bytes = sum(leaf.size * 4 for leaf in jax.tree.leaves(params))
  figures, moved = compiled_figures(
    args.width, args.depth, args.micro_batch, args.every_k, args.target
  )
  multi_steps = figures["optax.MultiSteps"]
  print(
    f"Peak memory on one {args.target} chip (compile-only, jax"
    f" {jax.__version__}): {args.depth} x {args.width}² tanh MLP,"
    f" {param_bytes / GIB:.2f} GiB of fp32 params, Adam, k ="
    f" {args.every_k}, micro-batch {args.micro_batch}, donated"
  )
  print(f"{'step':34} {'GiB':>7} {'x params':>9} {'x MultiSteps':>13}")
  for name, peak in figures.items():
    print(
      f"{name:34} {peak / GIB:7.2f} {peak / param_bytes:9.2f}"
      f" {peak / multi_steps:13.2f}"
    )

  print(f"\n{'a micro-step of':34} {'MiB moved':>10} {'x the floor':>12}")
  for name, bytes_moved in moved.items():
    print(
      f"{name:34} {bytes_moved / 2**20:10.1f}"
      f" {bytes_moved / moved[FLOOR]:12.2f}"
    )

  budget = int(HBM_BYTES[args.target] * args.memory_fraction)
  (chip,) = audits.tpu_devices(target=args.target)
  plan = ga_optax.planning.plan_microbatch(
    loss_fn,
    params,
    {"x": jax.ShapeDtypeStruct((1, args.width), jnp.float32)},
    budget,
    global_batch_size=args.global_batch,
    optimizer=optax.adam(1e-3),
    device=chip,
  )
  print(
    f"plan_microbatch(device={args.target} chip), budget"
    f" {budget / GIB:.1f} GiB ({args.memory_fraction:.0%} of"
    f" {HBM_BYTES[args.target] / GIB:.0f} GiB): micro-batch"
    f" {plan.micro_batch_size} x k = {plan.num_microbatches}, its micro-step"
    f" {plan.compiled_bytes / GIB:.2f} GiB; the next size"
    f" {plan.next_size}: "
    + (
      "none"
      if plan.next_size_bytes is None
      else f"{plan.next_size_bytes / GIB:.2f} GiB"
    )
  )
  record = {
    "jax": jax.__version__,
    "target": args.target,
    "width": args.width,
    "depth": args.depth,
    "micro_batch": args.micro_batch,
    "every_k": args.every_k,
    "param_bytes": param_bytes,
    "peak_bytes": figures,
    "micro_step_bytes_moved": moved,
    "plan": plan._asdict(),
  }
  args.output.parent.mkdir(parents=True, exist_ok=True)
  args.output.write_text(json.dumps(record, indent=1))
  return record


if __name__ == "__main__":
  main()
