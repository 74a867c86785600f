"""A small training run that is checkpointed mid-window and resumed.

Shared by ``test_checkpoint.py`` (which runs it once, saving after every
micro-step) and by the fresh process it starts (``python checkpoint_run.py
ROOT``), which restores every saved position into an abstract target built
from ``tx.init``, finishes the run and compares it with the run never stopped,
raising ``AssertionError`` at the first difference.

The run has bfloat16 parameters with a float32 accumulator, a schedule of k,
a non-finite micro-step that is skipped and a flush of a partial window.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import compile_level
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import ga_optax

NUM_MICRO_STEPS = 12
# With every_k={0: 3, 2: 2} the windows are: micro-steps 0-2; 3-6, where 4 is
# non-finite and skipped; 7 alone, closed by a flush; 8-9; 10-11.
NONFINITE_MICRO_STEP = 4
FLUSH_MICRO_STEP = 7
CHECKPOINTERS = ("standard", "manager")


def make_optimizer() -> optax.GradientTransformationExtraArgs:
  return ga_optax.accumulate(
    optax.adam(1e-2),
    {0: 3, 2: 2},
    accumulator_dtype=jnp.float32,
    skip_nonfinite=True,
  )


def initial_params() -> dict[str, jax.Array]:
  key_w, key_b = jax.random.split(jax.random.key(0))
  return {
    "w": jax.random.normal(key_w, (3, 2), jnp.bfloat16),
    "b": jax.random.normal(key_b, (2,), jnp.bfloat16),
    "scale": jnp.ones((), jnp.float32),
  }


def micro_batch(index: int) -> tuple[jax.Array, jax.Array, float, bool]:
  """Inputs, targets, weight and flush of micro-step ``index``."""
  key_x, key_y = jax.random.split(jax.random.fold_in(jax.random.key(1), index))
  inputs = jax.random.normal(key_x, (4, 3), jnp.float32)
  if index == NONFINITE_MICRO_STEP:
    inputs = inputs.at[0, 0].set(jnp.nan)
  targets = jax.random.normal(key_y, (4, 2), jnp.float32)
  return inputs, targets, float(index % 3 + 1), index == FLUSH_MICRO_STEP


def loss_fn(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
  hidden = inputs @ params["w"].astype(jnp.float32) + params["b"]
  return jnp.mean((jnp.tanh(hidden) * params["scale"] - targets) ** 2)


@jax.jit
def train_step(
  params: Any,
  state: Any,
  inputs: jax.Array,
  targets: jax.Array,
  weight: jax.Array,
  flush: jax.Array,
) -> tuple[Any, Any]:
  grads = jax.grad(loss_fn)(params, inputs, targets)
  updates, state = make_optimizer().update(
    grads, state, params, weight=weight, flush=flush
  )
  return optax.apply_updates(params, updates), state


def run(params: Any, state: Any, start: int, stop: int) -> tuple[Any, Any]:
  """Runs micro-steps ``start`` .. ``stop - 1``."""
  for index in range(start, stop):
    inputs, targets, weight, flush = micro_batch(index)
    params, state = train_step(
      params, state, inputs, targets, jnp.float32(weight), jnp.bool_(flush)
    )
  return params, state


def abstract_target() -> Any:
  """The (params, state) target to restore into, built without allocating."""
  return jax.eval_shape(
    lambda: (initial_params(), make_optimizer().init(initial_params()))
  )


def check_bit_identical(finished: Any, reference: Any, name: str) -> None:
  """Raises unless the two runs hold the same dtypes and bits, all finite.

  Explicit raises, not ``assert``: this runs as a script, where
  ``python -O`` would drop assertions.
  """
  for (path, leaf), expected in zip(
    jax.tree_util.tree_flatten_with_path(finished)[0],
    jax.tree.leaves(reference),
    strict=True,
  ):
    where = f"{name}{jax.tree_util.keystr(path)}"
    leaf, expected = np.asarray(leaf), np.asarray(expected)
    if leaf.dtype != expected.dtype:
      raise AssertionError(f"{where}: dtype {leaf.dtype}, not {expected.dtype}")
    if jnp.issubdtype(leaf.dtype, jnp.inexact) and not np.all(
      np.isfinite(leaf.astype(np.float32))
    ):
      # NaN would compare equal to NaN below.
      raise AssertionError(f"{where}: not finite: {leaf}")
    if not np.array_equal(leaf, expected):
      raise AssertionError(f"{where}: {leaf} differs from {expected}")


def restore_and_finish(root: pathlib.Path) -> dict[str, list[int]]:
  """Restores every saved position, finishes the run, compares it.

  Returns:
    For each checkpointer, the positions that resumed bit-identically.
  """
  target = abstract_target()
  checkpointer = ocp.StandardCheckpointer()
  reference = checkpointer.restore(root / "reference", target)
  manager = ocp.CheckpointManager(root / "manager")
  resumed: dict[str, list[int]] = {name: [] for name in CHECKPOINTERS}
  for position in manager.all_steps():
    restored = {
      "standard": checkpointer.restore(
        root / "standard" / str(position), target
      ),
      "manager": manager.restore(
        position, args=ocp.args.StandardRestore(target)
      ),
    }
    for name, (params, state) in restored.items():
      finished = run(params, state, position, NUM_MICRO_STEPS)
      check_bit_identical(finished, reference, f"{name} {position}")
      resumed[name].append(position)
  manager.close()
  checkpointer.close()
  return resumed


if __name__ == "__main__":
  compile_level.from_environment()
  print(json.dumps(restore_and_finish(pathlib.Path(sys.argv[1]))))
