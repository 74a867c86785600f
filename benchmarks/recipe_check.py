"""Does the GPU recipe compute what XLA's defaults compute, on this device?

Runs 12 donated calls of ``accumulate(adam, 4)`` on the 4 x 1024² MLP under
XLA's default options and under command-buffer variants: the recipe
(``gpu_compiler_options()``), the recipe without donation, XLA's
default kinds plus ``WHILE`` alone, and plus ``CONDITIONAL`` alone. For each
it prints the calls on which a window closed (``emitted``) and how far the
params end from the defaults' run. On a CPU every variant is the defaults'
program (XLA:CPU ignores the options); on two H200s (jax 0.11.2, 2026-11-28
and 2026-12-04) the recipe closed windows on the wrong calls
(docs/benchmarks.md).

Usage::

  python benchmarks/recipe_check.py
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ga_optax
from benchmarks import workloads as workloads_lib
from ga_optax._src.recipes.gpu_recipe import gpu_compiler_options

CALLS = 12
XLA_DEFAULT_KINDS = (
  "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
)


def variants() -> dict[str, tuple[dict[str, str] | None, bool]]:
  """Name -> (compiler options, whether params and state are donated)."""
  recipe = gpu_compiler_options()
  return {
    "XLA's defaults": (None, True),
    "recipe": (recipe, True),
    "recipe, no donation": (recipe, False),
    "defaults + WHILE": (
      {"xla_gpu_enable_command_buffer": XLA_DEFAULT_KINDS + ",WHILE"},
      True,
    ),
    "defaults + CONDITIONAL": (
      {"xla_gpu_enable_command_buffer": XLA_DEFAULT_KINDS + ",CONDITIONAL"},
      True,
    ),
  }


def run(options: dict[str, str] | None, donate: bool) -> tuple[list[int], Any]:
  workload = workloads_lib.mlp(1024, 4, 8, 4)
  tx = ga_optax.accumulate(optax.adam(1e-3), workload.every_k)

  def step(params, state, batch):
    grads = jax.grad(workload.loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  jitted = jax.jit(
    step, donate_argnums=(0, 1) if donate else (), compiler_options=options
  )
  params = jax.tree.map(jnp.array, workload.params)
  state = tx.init(params)
  emitted = []
  for call in range(CALLS):
    batch = workload.microbatches[call % len(workload.microbatches)]
    params, state = jitted(params, state, batch)
    emitted.append(int(bool(state.emitted)))
  return emitted, jax.tree.map(np.asarray, params)


def main() -> None:
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print("| variant | windows closed on calls | max abs difference |")
  print("|---|---|---:|")
  reference = None
  for name, (options, donate) in variants().items():
    emitted, params = run(options, donate)
    if reference is None:
      reference = params
    difference = max(
      float(np.max(np.abs(mine - theirs)))
      for mine, theirs in zip(
        jax.tree.leaves(params), jax.tree.leaves(reference), strict=True
      )
    )
    closed = [call + 1 for call, flag in enumerate(emitted) if flag]
    print(f"| {name} | {closed} | {difference:.3g} |")


if __name__ == "__main__":
  main()
