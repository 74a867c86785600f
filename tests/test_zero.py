"""The wrapped optimizer's state sharded over mesh axes (ZeRO stage 1).

On 8 devices, ``accumulate(..., unreduced_axes="data",
inner_state_axes=...)`` under a plain ``jax.jit`` on an Explicit mesh: the
numbers against the one-device large batch of tests/helpers.py (token
weights, windows of unequal weight, one closed by a flush; plain SGD among
the optimizers), the state's shards, the compiled HLO's collectives and
orbax checkpoints. Then the arguments' errors and a one-device mesh.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from absl.testing import parameterized
from helpers import (
  SGD,
  assert_finite_and_close,
  init_params,
  large_batch_reference,
  make_windows,
  micro_steps,
)
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from mesh_layouts import (
  LAYOUTS,
  REPLICATED,
  assert_specs,
  data_mesh,
  per_device_bytes,
  put,
  run_steps,
  unreduced_step,
)

import ga_optax
from ga_optax._src.audits import window_collectives

K, DEVICES, ROWS = 3, 8, 2
# The second window is closed by a flush after 2 micro-steps.
LENGTHS = (3, 2, 3)
WINDOWS = make_windows(LENGTHS, DEVICES, ROWS, seed=100)
RUN = list(micro_steps(WINDOWS, K))
# A mid-window checkpoint: one micro-step into the flushed window.
MIDDLE = 4
CLIP_ADAMW = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))


def assert_state_split(inner_state: Any, devices: int) -> None:
  """Each leaf with a dimension holds 1/devices of its elements per device."""
  for leaf in jax.tree.leaves(inner_state):
    if leaf.ndim > 0:
      shard = leaf.addressable_shards[0].data
      assert shard.size * devices == leaf.size, (leaf.shape, shard.shape)


def zero_run(
  inner: optax.GradientTransformation,
  layout_name: str,
  inner_state_axes: Any = "data",
  fused: bool = False,
) -> tuple[Any, Any, Any]:
  """The params and state after RUN, and the compiled step."""
  make = ga_optax.accumulate_and_apply if fused else ga_optax.accumulate
  tx = make(inner, K, unreduced_axes="data", inner_state_axes=inner_state_axes)
  layout = LAYOUTS[layout_name]
  mesh = layout.mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    params = put(init_params(), mesh, layout.param_specs)
    state = jax.jit(tx.init)(params)
    first = jax.device_put(RUN[0][0], P("data"))
    step = unreduced_step(tx, fused)
    step = step.lower(params, state, first, jnp.bool_(False)).compile()
    final, state = run_steps(step, params, state, RUN)
    assert_specs(final, layout.param_specs)
  assert int(ga_optax.applied_updates(state)) == len(LENGTHS)
  return final, state, step


def assert_one_all_reduce_of_traffic(step: Any, params: Any) -> None:
  """Per window: each leaf reduce-scattered and gathered once, no more."""
  found = window_collectives(step.as_text())
  # Per micro-step: the loss's and the weights' scalar sums only.
  assert all(c.operand_bytes <= 8 for c in found.every_micro_step), found
  closing = [c for c in found.window_closing if c.operand_bytes > 16]
  scattered = [c for c in closing if c.opcode == "reduce-scatter"]
  gathered = [c for c in closing if c.opcode == "all-gather"]
  # Each parameter's partial sum is reduce-scattered once and its update
  # gathered once: one all-reduce's traffic, in two halves. Beside them,
  # only scalars (a global norm's).
  param_bytes = per_device_bytes(params)
  assert len(scattered) == len(gathered) == len(jax.tree.leaves(params))
  assert len(closing) == len(scattered) + len(gathered), found
  assert sum(c.operand_bytes for c in scattered) == param_bytes, found
  assert sum(c.operand_bytes for c in gathered) * DEVICES == param_bytes, found


@pytest.mark.devices(8)
@pytest.mark.parametrize(
  "inner, fused",
  [(SGD, False), (SGD, True)],
  ids=["sgd-update", "sgd-apply"],
)
def test_plain_sgd_matches_the_large_batch(inner, fused):
  final, _, step = zero_run(inner, "data", fused=fused)
  assert_finite_and_close(
    final, large_batch_reference(inner, init_params(), WINDOWS)
  )
  assert_one_all_reduce_of_traffic(step, final)


@pytest.mark.devices(8)
@pytest.mark.parametrize(
  "inner",
  [
    optax.adam(optax.linear_schedule(1e-2, 1e-3, len(LENGTHS))),
    optax.adamw(1e-2, weight_decay=0.1),
  ],
  ids=["adam_schedule", "adamw"],
)
def test_stateful_optimizers_match_the_large_batch(inner):
  final, state, _ = zero_run(inner, "data")
  assert_finite_and_close(
    final, large_batch_reference(inner, init_params(), WINDOWS)
  )
  assert_state_split(state.inner_state, DEVICES)


@pytest.mark.devices(8)
def test_model_sharded_params_keep_their_spec():
  """The data axis shards the state along another dimension."""
  inner = optax.lion(1e-3, weight_decay=0.1)
  final, state, _ = zero_run(inner, "data x model")
  assert_finite_and_close(
    final, large_batch_reference(inner, init_params(), WINDOWS)
  )
  assert_specs(
    state.inner_state[0].mu,
    {"w": P("data", "model"), "b": P("model"), "scale": P("model"),
     "w2": P("model", "data")},
  )  # fmt: skip


@pytest.mark.devices(8)
def test_a_spec_tree_places_each_leaf():
  """Each parameter's gradient and momentum take its spec."""
  inner = optax.sgd(0.3, momentum=0.5)
  override = {"w": P(None, "data"), "b": P(), "scale": P("data"), "w2": P()}
  final, state, _ = zero_run(inner, "data", inner_state_axes=override)
  assert_finite_and_close(
    final, large_batch_reference(inner, init_params(), WINDOWS)
  )
  assert_specs(state.inner_state[0].trace, override)


@pytest.mark.devices(8)
def test_clip_adamw_fused_shards_and_checkpoints(tmp_path):
  """A global norm over shards, fused: shards, HLO and checkpoints.

  One run of ``accumulate_and_apply`` with a mid-window orbax save; the
  saved state resumes bit-identically on the same mesh, and, consolidated,
  on 2 devices.
  """
  expected = large_batch_reference(CLIP_ADAMW, init_params(), WINDOWS)
  tx = ga_optax.accumulate_and_apply(
    CLIP_ADAMW, K, unreduced_axes="data", inner_state_axes="data"
  )
  mesh = LAYOUTS["data"].mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    params = put(init_params(), mesh, REPLICATED)
    state = tx.init(params)
    first = jax.device_put(RUN[0][0], P("data"))
    step = unreduced_step(tx, fused=True)
    step = step.lower(params, state, first, jnp.bool_(False)).compile()
    middle, state = run_steps(step, params, state, RUN[:MIDDLE])
    stacked = ga_optax.planning.stack_partial_sums(state)
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "stacked", (middle, stacked))
      checkpointer.save(
        tmp_path / "total", (middle, ga_optax.planning.consolidate(state))
      )
    final, state = run_steps(step, middle, state, RUN[MIDDLE:])
    assert_finite_and_close(final, expected)

    # 1/D of each moment per device, params whole.
    assert_specs(final, REPLICATED)
    for leaf in jax.tree.leaves(final):
      assert leaf.addressable_shards[0].data.shape == leaf.shape
    adam_state = state.inner_state[1][0]
    assert adam_state.count.addressable_shards[0].data.shape == ()
    assert_state_split(state.inner_state, DEVICES)
    param_bytes = per_device_bytes(final)
    # mu and nu, 1/8 each, and a replicated int32 count.
    assert per_device_bytes(state.inner_state) == 2 * param_bytes // DEVICES + 4
    assert_one_all_reduce_of_traffic(step, final)

    with ocp.StandardCheckpointer() as checkpointer:
      restored = checkpointer.restore(tmp_path / "stacked", (middle, stacked))
    resumed = ga_optax.planning.unstack_partial_sums(
      restored[1], jax.eval_shape(tx.init, params)
    )
    assert_state_split(resumed.inner_state, DEVICES)
    resumed_final, resumed_state = run_steps(
      step, restored[0], resumed, RUN[MIDDLE:]
    )
    # Unreduced leaves reach the host stacked, one partial sum per device.
    resumed_stacked = ga_optax.planning.stack_partial_sums(resumed_state)
    chex.assert_tree_all_finite(resumed_stacked)
    chex.assert_trees_all_equal(
      (resumed_final, resumed_stacked),
      (final, ga_optax.planning.stack_partial_sums(state)),
    )

  # Another device count: the state that init makes there (its rule applied
  # on that mesh) is orbax's restore target, so the saved state lands
  # sharded over the new devices.
  devices = 2
  small = data_mesh(devices)
  with jax.set_mesh(small):
    params = put(init_params(), small, REPLICATED)
    like = tx.init(params)
    with ocp.StandardCheckpointer() as checkpointer:
      middle, total = checkpointer.restore(
        tmp_path / "total", (params, ga_optax.planning.consolidate(like))
      )
    resumed = ga_optax.planning.split_total(total, like)
    assert_state_split(resumed.inner_state, devices)
    final, _ = run_steps(
      unreduced_step(tx, fused=True), middle, resumed, RUN[MIDDLE:]
    )
  assert_finite_and_close(final, expected)


@pytest.mark.devices(8)
def test_the_rule_on_odd_shapes_and_a_spec_that_does_not_fit():
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
    with pytest.raises(ValueError, match=r"inner_state_axes.*\['odd'\]"):
      tx.init(params)


PARAMS = {"w": jnp.arange(8.0).reshape(2, 4) / 10, "b": jnp.array([0.5, -0.5])}


def one_device_mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))


def loss_fn(params, batch):
  prediction = jnp.tanh(batch["x"] @ params["w"].T + params["b"])
  return jnp.mean((prediction - batch["y"]) ** 2)


def batch(seed: int) -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(seed))
  return {
    "x": jax.random.normal(keys[0], (4, 4)),
    "y": jax.random.normal(keys[1], (4, 2)),
  }


class OneDeviceMeshTest(parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
    (
      "clip_adamw",
      optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2)),
    ),
    # Its row and column statistics are split along different dimensions.
    ("adafactor", optax.adafactor(1e-2, min_dim_size_to_factor=2)),
  )
  def test_equal_to_the_replicated_state(self, inner):
    value_and_grad = jax.jit(ga_optax.unreduced_value_and_grad(loss_fn))
    with jax.set_mesh(one_device_mesh()):
      results = []
      for inner_state_axes in (None, "data"):
        tx = ga_optax.accumulate(
          inner, 2, unreduced_axes="data", inner_state_axes=inner_state_axes
        )
        update = self.variant(tx.update)
        params, state = PARAMS, tx.init(PARAMS)
        for seed in range(6):
          _, grads = value_and_grad(
            params, jax.device_put(batch(seed), P("data"))
          )
          updates, state = update(grads, state, params)
          params = optax.apply_updates(params, updates)
        results.append((params, state.inner_state))
    chex.assert_tree_all_finite(results)
    chex.assert_trees_all_close(*results, rtol=1e-6, atol=1e-7)
    for leaf in jax.tree.leaves(results[1][1]):
      assert leaf.ndim == 0 or leaf.sharding.spec[0] == "data", leaf.sharding


@pytest.mark.parametrize(
  "make", [ga_optax.accumulate, ga_optax.accumulate_and_apply]
)
def test_inner_state_axes_needs_unreduced_axes(make):
  with pytest.raises(ValueError, match=r"inner_state_axes.*unreduced_axes"):
    make(optax.adam(1e-3), 4, inner_state_axes="data")
  with pytest.raises(ValueError, match=r"inner_state_axes.*unreduced_axes"):
    make(optax.adam(1e-3), 4, axis_name="data", inner_state_axes="data")


@pytest.mark.parametrize("wrong", [3, ["data", 1], [P(), "data"], {}])
def test_inner_state_axes_of_a_wrong_type(wrong):
  with pytest.raises(TypeError, match="inner_state_axes"):
    ga_optax.accumulate(
      optax.adam(1e-3), 4, unreduced_axes="data", inner_state_axes=wrong
    )


def test_inner_state_axes_must_be_explicit_axes_of_the_mesh():
  tx = ga_optax.accumulate(
    optax.adam(1e-3), 4, unreduced_axes="data", inner_state_axes="model"
  )
  with (
    jax.set_mesh(one_device_mesh()),
    pytest.raises(ValueError, match=r"inner_state_axes.*'model'"),
  ):
    tx.init(PARAMS)


def test_a_spec_tree_needs_the_params_structure():
  tx = ga_optax.accumulate(
    optax.adam(1e-3), 4, unreduced_axes="data", inner_state_axes={"w": P()}
  )
  with (
    jax.set_mesh(one_device_mesh()),
    pytest.raises(ValueError, match=r"inner_state_axes.*tree structure"),
  ):
    tx.init(PARAMS)


def test_update_needs_the_params():
  tx = ga_optax.accumulate(
    optax.sgd(1e-3), 1, unreduced_axes="data", inner_state_axes="data"
  )
  value_and_grad = jax.jit(ga_optax.unreduced_value_and_grad(loss_fn))
  with jax.set_mesh(one_device_mesh()):
    _, grads = value_and_grad(PARAMS, jax.device_put(batch(0), P("data")))
    with pytest.raises(ValueError, match="inner_state_axes needs the params"):
      tx.update(grads, tx.init(PARAMS))
