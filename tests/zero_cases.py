"""The wrapped optimizer's state sharded over the data axis, on 8 devices.

``accumulate(..., unreduced_axes="data", inner_state_axes="data")`` under a
plain ``jax.jit`` on an Explicit mesh of 8 simulated CPU devices: the numbers
against one device's large batch, the state's shards, the compiled HLO's
collectives and orbax checkpoints. Run by tests/test_zero.py in one process
(``python tests/zero_cases.py``), because the device count is fixed when jax
starts.
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from mesh_cases import (
  LAYOUTS,
  REPLICATED,
  TOLERANCE,
  accumulation_step,
  assert_specs,
  init_params,
  make_batch,
  mean_loss,
  per_device_bytes,
  put,
  run_steps,
)

import ga_optax
from ga_optax.testing import window_collectives

K, WINDOWS, DEVICES = 4, 3, 8
# A mid-window checkpoint: two micro-steps into the second window.
MIDDLE = K + 2
CLIP_ADAMW = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))


BATCHES = [make_batch(64, seed=100 + i) for i in range(K * WINDOWS)]
LARGE_BATCHES = [
  jax.tree.map(lambda *rows: jnp.concatenate(rows), *BATCHES[i : i + K])
  for i in range(0, len(BATCHES), K)
]
large_batch_grad = jax.jit(jax.grad(mean_loss))


@functools.cache
def expected_params(inner: optax.GradientTransformation) -> Any:
  """One device, one large-batch step of ``inner`` per window of BATCHES."""
  params = init_params()
  state, update = inner.init(params), jax.jit(inner.update)
  for batch in LARGE_BATCHES:
    updates, state = update(large_batch_grad(params, batch), state, params)
    params = optax.apply_updates(params, updates)
  return params


def sharded_moments(inner_state: Any) -> list[jax.Array]:
  """The state's leaves with a dimension (all but counts)."""
  return [leaf for leaf in jax.tree.leaves(inner_state) if leaf.ndim > 0]


def assert_state_split(inner_state: Any, devices: int) -> None:
  """Each sharded leaf holds 1/devices of its elements on a device."""
  for leaf in sharded_moments(inner_state):
    shard = leaf.addressable_shards[0].data
    assert shard.size * devices == leaf.size, (leaf.shape, shard.shape)


def zero_run(
  inner: optax.GradientTransformation,
  layout_name: str,
  inner_state_axes: Any = "data",
) -> tuple[Any, Any]:
  """The params and state after BATCHES, from params laid out as named."""
  tx = ga_optax.accumulate(
    inner, K, unreduced_axes="data", inner_state_axes=inner_state_axes
  )
  layout = LAYOUTS[layout_name]
  mesh = layout.mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    params = put(init_params(), mesh, layout.param_specs)
    step = accumulation_step(tx, fused=False)
    final, state = run_steps(step, params, jax.jit(tx.init)(params), BATCHES)
  chex.assert_tree_all_finite(final)
  assert int(state.update_step) == WINDOWS, state.update_step
  assert_specs(final, layout.param_specs)
  return final, state


def check_optimizers() -> None:
  """Equal to one large-batch step per window, for each optimizer."""
  for name, inner in (
    ("adam, schedule", optax.adam(optax.linear_schedule(1e-2, 1e-3, WINDOWS))),
    ("adamw", optax.adamw(1e-2, weight_decay=0.1)),
  ):
    final, state = zero_run(inner, "data")
    chex.assert_trees_all_close(final, expected_params(inner), **TOLERANCE)
    assert_state_split(state.inner_state, DEVICES)
    print(f"exact: {name}")

  # Model-sharded params keep their spec; the data axis shards the state
  # along another dimension, where one is free and divisible.
  inner = optax.lion(1e-3, weight_decay=0.1)
  final, state = zero_run(inner, "data x model")
  chex.assert_trees_all_close(final, expected_params(inner), **TOLERANCE)
  assert_specs(
    state.inner_state[0].mu,
    {"w": P("data", "model"), "b": P("model"), "scale": P("model"),
     "w2": P("model", "data")},
  )  # fmt: skip
  print("exact: lion, params sharded over a model axis")

  # A spec tree instead of the rule: each parameter's gradient and
  # momentum take its spec.
  inner = optax.sgd(1e-2, momentum=0.9)
  override = {"w": P(None, "data"), "b": P(), "scale": P("data"), "w2": P()}
  final, state = zero_run(inner, "data", inner_state_axes=override)
  chex.assert_trees_all_close(final, expected_params(inner), **TOLERANCE)
  assert_specs(state.inner_state[0].trace, override)
  print("exact: sgd with momentum, state sharded by a spec tree")


def check_clip_adamw_run() -> None:
  """A global norm over shards, fused: numbers, shards, HLO, checkpoints.

  One run of ``accumulate_and_apply`` with a mid-window orbax save; the
  saved state resumes bit-identically on the same mesh, and, consolidated,
  on 2 devices.
  """
  expected = expected_params(CLIP_ADAMW)
  tx = ga_optax.accumulate_and_apply(
    CLIP_ADAMW, K, unreduced_axes="data", inner_state_axes="data"
  )
  directory = tempfile.mkdtemp()
  mesh = LAYOUTS["data"].mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    params = put(init_params(), mesh, REPLICATED)
    step = accumulation_step(tx, fused=True)
    middle, state = run_steps(step, params, tx.init(params), BATCHES[:MIDDLE])
    stacked = ga_optax.stack_partial_sums(state)
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(f"{directory}/stacked", (middle, stacked))
      checkpointer.save(
        f"{directory}/total", (middle, ga_optax.consolidate(state))
      )
    final, state = run_steps(step, middle, state, BATCHES[MIDDLE:])
    chex.assert_tree_all_finite(final)
    chex.assert_trees_all_close(final, expected, **TOLERANCE)
    check_evidence(step, final, state, BATCHES[0])

    with ocp.StandardCheckpointer() as checkpointer:
      restored = checkpointer.restore(f"{directory}/stacked", (middle, stacked))
    resumed = ga_optax.unstack_partial_sums(
      restored[1], jax.eval_shape(tx.init, params)
    )
    assert_state_split(resumed.inner_state, DEVICES)
    resumed_final, resumed_state = run_steps(
      step, restored[0], resumed, BATCHES[MIDDLE:]
    )
    chex.assert_trees_all_equal(
      (resumed_final, ga_optax.stack_partial_sums(resumed_state)),
      (final, ga_optax.stack_partial_sums(state)),
    )
  print("checkpoint: resumed bit-identically on the same mesh")

  # Another device count: the state that init makes there (its rule applied
  # on that mesh) is orbax's restore target, so the saved state lands
  # sharded over the new devices.
  devices = 2
  small = jax.make_mesh(
    (devices,),
    ("data",),
    axis_types=(AxisType.Explicit,),
    devices=jax.devices()[:devices],
  )
  with jax.set_mesh(small):
    params = put(init_params(), small, REPLICATED)
    like = tx.init(params)
    with ocp.StandardCheckpointer() as checkpointer:
      middle, total = checkpointer.restore(
        f"{directory}/total", (params, ga_optax.consolidate(like))
      )
    resumed = ga_optax.split_total(total, like)
    assert_state_split(resumed.inner_state, devices)
    final, _ = run_steps(
      accumulation_step(tx, fused=True), middle, resumed, BATCHES[MIDDLE:]
    )
    chex.assert_tree_all_finite(final)
    chex.assert_trees_all_close(final, expected, **TOLERANCE)
  print("checkpoint: consolidated on 8 devices, resumed on 2")


def check_evidence(step: Any, params: Any, state: Any, batch: Any) -> None:
  """1/D of each moment per device, params whole, collectives per window."""
  assert_specs(params, REPLICATED)
  for leaf in jax.tree.leaves(params):
    assert leaf.addressable_shards[0].data.shape == leaf.shape
  adam_state = state.inner_state[1][0]
  assert adam_state.count.addressable_shards[0].data.shape == ()
  assert_state_split(state.inner_state, DEVICES)
  param_bytes = per_device_bytes(params)
  # mu and nu, 1/8 each, and a replicated int32 count.
  assert per_device_bytes(state.inner_state) == 2 * param_bytes // DEVICES + 4

  compiled = step.lower(params, state, jax.device_put(batch, P("data")))
  found = window_collectives(compiled.compile().as_text())
  # Per micro-step: the loss's scalar sum only.
  assert all(c.operand_bytes <= 8 for c in found.every_micro_step), found
  closing = [c for c in found.window_closing if c.operand_bytes > 16]
  scattered = [c for c in closing if c.opcode == "reduce-scatter"]
  gathered = [c for c in closing if c.opcode == "all-gather"]
  # Each parameter's partial sum is reduce-scattered once and its update
  # gathered once: one all-reduce's traffic, in two halves. Beside them,
  # only the global norm's scalars.
  assert len(scattered) == len(gathered) == len(jax.tree.leaves(params))
  assert len(closing) == len(scattered) + len(gathered), found
  assert sum(c.operand_bytes for c in scattered) == param_bytes, found
  assert sum(c.operand_bytes for c in gathered) * DEVICES == param_bytes, found
  print(
    f"evidence: {param_bytes} bytes of params, state"
    f" {per_device_bytes(state.inner_state)} bytes per device; per"
    f" micro-step {found.every_micro_step}; closing {found.window_closing}"
  )


def check_placement() -> None:
  """The rule on shapes the devices do not all divide, and a bad override."""
  mesh = LAYOUTS["data"].mesh(AxisType.Explicit)
  params = {
    "odd": np.ones((3, 5), np.float32),
    "second": np.ones((3, 16), np.float32),
    "scalar": np.ones((), np.float32),
    "w": np.ones((16, 8), np.float32),
  }
  with jax.set_mesh(mesh):
    tx = ga_optax.accumulate(
      optax.adam(1e-2), K, unreduced_axes="data", inner_state_axes="data"
    )
    state = tx.init(params)
    for moments in (state.inner_state[0].mu, state.inner_state[0].nu):
      assert_specs(
        moments,
        {"odd": P(), "second": P(None, "data"), "scalar": P(),
         "w": P("data", None)},
      )  # fmt: skip
    assert_specs(state.inner_state[0].count, P())
    override = {"odd": P("data"), "second": P(), "scalar": P(), "w": P()}
    tx = ga_optax.accumulate(
      optax.adam(1e-2), K, unreduced_axes="data", inner_state_axes=override
    )
    try:
      tx.init(params)
    except ValueError as error:
      assert "inner_state_axes" in str(error) and "['odd']" in str(error)
    else:
      raise AssertionError("a spec that does not divide its leaf passed")
  print("placement: the rule on odd shapes; a spec that does not fit")


if __name__ == "__main__":
  check_placement()
  check_optimizers()
  check_clip_adamw_run()
