"""When the accumulator is cleared: at the close, or on the next first micro-step.

``ga_optax.accumulate`` clears its accumulator when a window closes, so every
micro-step is a plain add into it, which XLA:GPU writes where the matrix
product making the gradient ends. Clearing it later instead, on the next
window's first micro-step (a select of zero before the add, as a counter of
0 says), lets the closing call hand the updates out in the accumulator's
buffer and leave them there. This script compiles (never runs) both, written
out here for the deferred one, beside ``optax.MultiSteps``, for a
compile-only TPU chip (peak memory, parameter-sized duplicates on the
micro-step) and a compile-only H100 (bytes a micro-step moves, against the
floor: the gradient and an add). Compiler figures, never times.

Usage::

  JAX_PLATFORMS=cpu python benchmarks/clearing.py    # TPU 4 x 4096², H100 4 x 1024²
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
# Both compilers run on a machine without a TPU or a GPU.
if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import ga_optax  # noqa: E402
from benchmarks.tpu_memory import mlp, train_step  # noqa: E402
from ga_optax._src import audits, scopes  # noqa: E402
from ga_optax._src.recipes.gpu_recipe import gpu_compiler_options  # noqa: E402
from ga_optax._src.window import run_once  # noqa: E402

MIB = 2**20
DEFERRED = "cleared on the next first micro-step (by hand)"
ACCUMULATE = "ga_optax.accumulate (cleared at the close)"
MULTI_STEPS = "optax.MultiSteps"


def deferred_clearing_step(
  loss_fn: Callable[[Any, Any], jax.Array],
  optimizer: optax.GradientTransformation,
  k: int,
) -> Callable[..., Any]:
  """A train step whose accumulator keeps the last updates until the next add.

  Its state is ``(micro_step, accumulator, optimizer_state)``
  (:func:`deferred_clearing_state`). The window's closing side is a loop of
  at most one trip, as ga_optax's, named by the same scope, so the audits
  read it as they read the window.
  """

  def step(params, state, batch):
    micro_step, accumulator, inner_state = state
    grads = jax.grad(loss_fn)(params, batch)
    first = micro_step == 0
    with jax.named_scope(scopes.KEEP_OPEN):
      accumulator = jax.tree.map(
        lambda total, grad: jnp.where(first, 0.0, total) + grad,
        accumulator,
        grads,
      )
    micro_step = micro_step + 1
    closes = micro_step >= k

    def close(carry):
      sums, inner_state = carry
      mean = jax.tree.map(lambda total: total / k, sums)
      return optimizer.update(mean, inner_state, params)

    accumulator, inner_state = run_once.run_once_if(
      closes, close, (accumulator, inner_state), name=scopes.CLOSE_WINDOW
    )
    updates = jax.tree.map(
      lambda carried: jnp.where(closes, carried, 0.0), accumulator
    )
    state = (jnp.where(closes, 0, micro_step), accumulator, inner_state)
    return optax.apply_updates(params, updates), state

  return step


def deferred_clearing_state(
  optimizer: optax.GradientTransformation, params: Any
) -> Any:
  """The abstract state of :func:`deferred_clearing_step`."""
  return (
    jax.ShapeDtypeStruct((), jnp.int32),
    jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), params
    ),
    jax.eval_shape(optimizer.init, params),
  )


def steps(loss_fn: Any, params: Any, k: int) -> dict[str, tuple[Any, Any]]:
  """Each contender's step and abstract state, Adam inside."""
  adam = optax.adam(1e-3)
  accumulate = ga_optax.accumulate(adam, k)
  multi_steps = optax.MultiSteps(adam, k)
  return {
    DEFERRED: (
      deferred_clearing_step(loss_fn, adam, k),
      deferred_clearing_state(adam, params),
    ),
    ACCUMULATE: (
      train_step(loss_fn, accumulate),
      jax.eval_shape(accumulate.init, params),
    ),
    MULTI_STEPS: (
      train_step(loss_fn, multi_steps),
      jax.eval_shape(multi_steps.init, params),
    ),
  }


def on_a_tpu(width: int, depth: int, micro_batch: int, k: int) -> dict:
  """Peak memory (x params) and large micro-step duplicates on a v5e chip."""
  params, loss_fn = mlp(width, depth)
  batch = {"x": jax.ShapeDtypeStruct((micro_batch, width), jnp.float32)}
  param_bytes = depth * width * width * 4
  figures = {}
  for name, (step, state) in steps(loss_fn, params, k).items():
    program = audits.compile_for_tpu(
      step, params, state, batch, donate_argnums=(0, 1)
    )
    audit = audits.path_audit(program, "micro_step", require_window=False)
    figures[name] = {
      "peak_x_params": program.memory_analysis().peak_memory_in_bytes
      / param_bytes,
      "duplicates_of_a_mib_or_more": sum(
        copy.bytes >= MIB for copy in audit.duplicates
      ),
    }
  return figures


def on_an_h100(width: int, depth: int, micro_batch: int, k: int) -> dict:
  """Micro-step bytes over the floor's, under ``gpu_compiler_options()``."""
  params, loss_fn = mlp(width, depth)
  batch = {"x": jax.ShapeDtypeStruct((micro_batch, width), jnp.float32)}
  options = gpu_compiler_options()

  def floor(params, accumulator, batch):
    grads = jax.grad(loss_fn)(params, batch)
    return params, jax.tree.map(jnp.add, accumulator, grads)

  def moved(step: Any, state: Any) -> int:
    program = audits.compile_for_gpu(
      step,
      params,
      state,
      batch,
      donate_argnums=(0, 1),
      compiler_options=options,
    )
    audit = audits.path_audit(program, "micro_step", require_window=False)
    return audit.bytes_moved

  floor_bytes = moved(floor, params)
  return {
    name: {"micro_step_x_floor": moved(step, state) / floor_bytes}
    for name, (step, state) in steps(loss_fn, params, k).items()
  }


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tpu-width", type=int, default=4096)
  parser.add_argument("--gpu-width", type=int, default=1024)
  parser.add_argument("--depth", type=int, default=4)
  parser.add_argument("--micro-batch", type=int, default=64)
  parser.add_argument("--every-k", type=int, default=4)
  parser.add_argument(
    "--output",
    type=pathlib.Path,
    default=REPO_ROOT / "benchmarks" / "results" / "clearing.json",
  )
  args = parser.parse_args(argv)
  shape = (args.depth, args.micro_batch, args.every_k)
  tpu = on_a_tpu(args.tpu_width, *shape)
  h100 = on_an_h100(args.gpu_width, *shape)
  print(
    f"Compile-only, jax {jax.__version__}, tanh MLP, Adam, k ="
    f" {args.every_k}, micro-batch {args.micro_batch}, donated. v5e chip at"
    f" {args.depth} x {args.tpu_width}²; H100 at {args.depth} x"
    f" {args.gpu_width}², gpu_compiler_options()"
  )
  print(f"{'step':48} {'TPU peak':>9} {'TPU dups':>9} {'H100 micro':>11}")
  for name in tpu:
    print(
      f"{name:48} {tpu[name]['peak_x_params']:8.2f}x"
      f" {tpu[name]['duplicates_of_a_mib_or_more']:9d}"
      f" {h100[name]['micro_step_x_floor']:10.3f}x"
    )
  record = {
    "jax": jax.__version__,
    "depth": args.depth,
    "micro_batch": args.micro_batch,
    "every_k": args.every_k,
    "tpu": {"target": "v5e", "width": args.tpu_width, "steps": tpu},
    "h100": {"width": args.gpu_width, "steps": h100},
  }
  args.output.parent.mkdir(parents=True, exist_ok=True)
  args.output.write_text(json.dumps(record, indent=1))
  return record


if __name__ == "__main__":
  main()
