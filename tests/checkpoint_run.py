"""A small training run that is checkpointed mid-window and resumed.

Shared by ``test_checkpoint.py`` (which runs it once, saving after every
micro-step) and by the fresh process it starts (``python checkpoint_run.py
ROOT``), which restores every saved position into an abstract target built
from ``tx.init``, finishes the run and compares it with the run never stopped.
The run has bfloat16 parameters with a float32 accumulator, a schedule of k,
a non-finite micro-step that is skipped and a flush of a partial window.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import chex
import jax
import jax.numpy as jnp
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
      chex.assert_trees_all_equal_dtypes(finished, reference)
      chex.assert_trees_all_equal(finished, reference)
      resumed[name].append(position)
  manager.close()
  checkpointer.close()
  return resumed


def data_parallel_resume(root: pathlib.Path) -> dict[str, bool]:
  """Saves a 2-device ``axis_name`` run at a boundary and mid-window.

  Needs two devices (``--xla_force_host_platform_device_count=2``).

  Returns:
    For each save position, whether the resumed run equals the
    uninterrupted one bit for bit.
  """
  mesh = jax.make_mesh((2,), ("data",))
  tx = ga_optax.accumulate(optax.adam(1e-2), 3, axis_name="data")

  def step(params, state, inputs, targets):
    grads = jax.grad(loss_fn)(params, inputs, targets)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  sharded_step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(
        jax.sharding.PartitionSpec(),
        jax.sharding.PartitionSpec(),
        jax.sharding.PartitionSpec("data"),
        jax.sharding.PartitionSpec("data"),
      ),
      out_specs=(jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec()),
      check_vma=False,
    )
  )
  # Micro-step 4 of micro_batch is the non-finite one: use the others.
  batches = [
    tuple(jax.device_put(array, data) for array in micro_batch(index)[:2])
    for index in (0, 1, 2, 3, 5, 6)
  ]
  params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2), "scale": jnp.ones(())}
  state = tx.init(params)
  target = jax.eval_shape(lambda: (params, tx.init(params)))
  saved = {}
  with ocp.StandardCheckpointer() as checkpointer:
    for position, batch in enumerate(batches):
      if position in (3, 4):
        name = "boundary" if position == 3 else "mid_window"
        checkpointer.save(root / name, (params, state))
        saved[name] = position
      params, state = sharded_step(params, state, *batch)
    checkpointer.wait_until_finished()
    equal = {}
    for name, position in saved.items():
      resumed = checkpointer.restore(root / name, target)
      for batch in batches[position:]:
        resumed = sharded_step(*resumed, *batch)
      equal[name] = all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(
          jax.tree.leaves(resumed),
          jax.tree.leaves((params, state)),
          strict=True,
        )
      )
  return equal


if __name__ == "__main__":
  if sys.argv[1] == "data-parallel":
    print(json.dumps(data_parallel_resume(pathlib.Path(sys.argv[2]))))
  else:
    print(json.dumps(restore_and_finish(pathlib.Path(sys.argv[1]))))
