"""Accumulation under a plain ``jax.jit`` on a mesh of 8 devices.

JAX's own multi-device workflow: ``jax.make_mesh`` (Explicit axes) or a mesh
of Auto axes, ``jax.set_mesh``, a batch put with ``P("data")`` and a plain
``jax.jit`` step. Every run is held to the one-device large batch of
tests/helpers.py (plain SGD, token weights, windows of unequal weight,
one closed by a flush), every micro-batched gradient to ``jax.value_and_grad``
of the token mean, and the compiled steps to where their collectives run and
how many rows each device computes.
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
from helpers import (
  IN,
  OUT,
  SGD,
  assert_finite_and_close,
  forward,
  init_params,
  large_batch_reference,
  make_windows,
  micro_steps,
  token_mean_loss,
  tokens,
  whole,
)
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_layouts import (
  LAYOUTS,
  REPLICATED,
  Layout,
  assert_specs,
  data_mesh,
  per_device_bytes,
  put,
  run_steps,
  unreduced_step,
)

import ga_optax
from ga_optax._src import audits

DEVICES = 8
K = 3
# The second window is closed by a flush after 2 micro-steps.
LENGTHS = (3, 2, 3)
ROWS = 2  # per device and micro-step, on the 8 devices


def check_audit(text: str, layout: Layout, params: Any, rows: int) -> None:
  """The HLO facts of a micro-batched step."""
  module = audits.parse_hlo(text)
  everywhere = audits.collectives_in_hlo(module)
  in_loops = audits.loop_collectives(module)
  # Every device computes its own rows of every micro-batch.
  first_layer = [
    lhs for lhs, _ in audits.dot_shapes(module) if lhs.endswith(f",{IN}]")
  ]
  assert first_layer and set(first_layer) == {f"f32[{rows},{IN}]"}, first_layer
  # No parameter-sized collective per micro-batch (a model axis adds small
  # ones for its activations), and no gather of the batch anywhere.
  if "model" in layout.axes:
    moved = sum(c.operand_bytes for c in in_loops)
    assert moved < per_device_bytes(params) / 2, in_loops
  else:
    assert in_loops == [], in_loops
  gathers = [c for c in everywhere if c.opcode == "all-gather"]
  if "fsdp" in layout.axes:
    # FSDP: w's shard is gathered once per call, not per micro-batch.
    w_shard = params["w"].addressable_shards[0].data.nbytes
    assert [c.operand_bytes for c in gathers] == [w_shard], gathers
  else:
    assert gathers == [], gathers
  # After the loop: the gradients (with the value and weight sums) summed
  # over the batch axes once.
  smallest = min(
    leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(params)
  )
  after = [
    c
    for c in everywhere
    if c not in in_loops
    and c.opcode == "all-reduce"
    and c.operand_bytes >= smallest
  ]
  assert len(after) == 1, after
  assert after[0].operand_bytes >= per_device_bytes(params), after


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_microbatched_equals_the_token_mean(axis_type, layout):
  """Numbers, shardings and HLO of micro-batching on each layout."""
  num_microbatches, rows_per_device = 4, 16
  layout = LAYOUTS[layout]
  (window,) = make_windows((1,), DEVICES, rows_per_device, seed=1)
  batch = window[0]
  params = init_params()
  expected = jax.value_and_grad(token_mean_loss)(params, batch)
  mesh = layout.mesh(axis_type)
  with jax.set_mesh(mesh):
    sharded_params = put(params, mesh, layout.param_specs)
    sharded_batch = jax.device_put(
      batch, NamedSharding(mesh, layout.batch_spec)
    )
    # Explicit axes say where the batch is; Auto axes are named.
    axis_name = None
    if axis_type == AxisType.Auto:
      axis_name = layout.batch_spec[0]
    step = jax.jit(
      ga_optax.microbatched_value_and_grad(
        token_mean_loss, num_microbatches, weight_fn=tokens, axis_name=axis_name
      )
    ).lower(sharded_params, sharded_batch)
    compiled = step.compile()
    value, grads = compiled(sharded_params, sharded_batch)
    if axis_type == AxisType.Explicit:
      assert_specs(grads, layout.param_specs)
    rows = (
      DEVICES * rows_per_device // (num_microbatches * layout.data_parallel)
    )
    check_audit(compiled.as_text(), layout, sharded_params, rows)
  assert_finite_and_close((value, grads), expected)


@pytest.mark.devices(DEVICES)
def test_microbatched_options():
  """has_aux, weight_fn, rng and remat on a sharded batch (Explicit)."""
  batch_size, k = 64, 4
  params = init_params()
  (window,) = make_windows((1,), DEVICES, batch_size // DEVICES, seed=2)
  batch = window[0]

  def masked_loss(params, batch, rng=None):
    error = ((forward(params, batch["x"]) - batch["y"]) ** 2).mean(-1)
    if rng is not None:
      keep = jax.random.bernoulli(rng, 0.9, error.shape)
      error = jnp.where(keep, error / 0.9, 0.0)
    loss = (error * batch["mask"]).sum() / jnp.maximum(tokens(batch), 1)
    return loss, {"rows": tokens(batch)}

  mesh = LAYOUTS["data"].mesh(AxisType.Explicit)
  expected_loss, expected_grads = jax.value_and_grad(
    lambda p: masked_loss(p, batch)[0]
  )(params)
  with jax.set_mesh(mesh):
    sharded_batch = jax.device_put(batch, P("data"))
    for remat in (False, True):
      step = jax.jit(
        ga_optax.microbatched_value_and_grad(
          masked_loss, k, has_aux=True, weight_fn=tokens, remat=remat
        )
      )
      (value, aux), grads = step(params, sharded_batch)
      assert_finite_and_close((value, grads), (expected_loss, expected_grads))
      # One entry per device and micro-batch, device major, over "data".
      assert aux["rows"].shape == (DEVICES * k,), aux["rows"].shape
      assert aux["rows"].sharding.spec[0] == "data", aux["rows"].sharding
      device_rows = batch["mask"].reshape(DEVICES, -1)
      per_micro = device_rows.reshape(DEVICES, -1, k).sum(1).reshape(-1)
      np.testing.assert_array_equal(np.asarray(aux["rows"]), per_micro)

    # rng: each device and micro-batch draws its own mask, reproducibly.
    step = jax.jit(
      ga_optax.microbatched_value_and_grad(
        masked_loss, k, has_aux=True, weight_fn=tokens
      )
    )
    first = step(params, sharded_batch, rng=jax.random.key(3))
    again = step(params, sharded_batch, rng=jax.random.key(3))
    other = step(params, sharded_batch, rng=jax.random.key(4))
    chex.assert_tree_all_finite(first)
    chex.assert_trees_all_equal(first, again)
    assert not np.array_equal(first[1]["w"], other[1]["w"])


def masked_squared_error(predictions: jax.Array, batch: Any) -> jax.Array:
  """The squared error's mean over the batch's real rows."""
  errors = jnp.mean((predictions - batch["y"]) ** 2, axis=-1)
  return jnp.sum(errors * batch["mask"]) / jnp.maximum(tokens(batch), 1.0)


def nnx_mlp(hidden: int) -> Any:
  """A Flax NNX Linear -> LayerNorm -> tanh -> Linear: biases and a scale."""
  from flax import nnx

  class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.linear = nnx.Linear(IN, hidden, rngs=rngs)
      self.norm = nnx.LayerNorm(hidden, rngs=rngs)
      self.out = nnx.Linear(hidden, OUT, rngs=rngs)

    def __call__(self, x):
      return self.out(jnp.tanh(self.norm(self.linear(x))))

  return Mlp(nnx.Rngs(0))


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize("library", ["nnx", "linen"])
def test_flax_models(library):
  """Flax nnx Linear + LayerNorm and Linen Dense, Explicit data axis."""
  from flax import linen, nnx

  k, hidden = 4, 32
  (window,) = make_windows((1,), DEVICES, 8, seed=5)
  batch = window[0]

  if library == "nnx":
    graphdef, params = nnx.split(nnx_mlp(hidden))

    def loss(state, batch):
      predictions = nnx.merge(graphdef, state)(batch["x"])
      return masked_squared_error(predictions, batch)

  else:

    class LinenModel(linen.Module):
      @linen.compact
      def __call__(self, x):
        x = linen.LayerNorm()(linen.Dense(hidden)(x))
        return linen.Dense(OUT)(jnp.tanh(x))

    model = LinenModel()
    params = model.init(jax.random.key(1), batch["x"][:1])

    def loss(variables, batch):
      return masked_squared_error(model.apply(variables, batch["x"]), batch)

  expected = jax.value_and_grad(loss)(params, batch)
  with jax.set_mesh(LAYOUTS["data"].mesh(AxisType.Explicit)):
    sharded_batch = jax.device_put(batch, P("data"))
    step = jax.jit(
      ga_optax.microbatched_value_and_grad(loss, k, weight_fn=tokens)
    )
    compiled = step.lower(params, sharded_batch).compile()
    result = compiled(params, sharded_batch)
    module = audits.parse_hlo(compiled.as_text())
  assert audits.loop_collectives(module) == []
  reductions = audits.collectives_in_hlo(module)
  assert [c.opcode for c in reductions] == ["all-reduce"], reductions
  assert_finite_and_close(result, expected)


@pytest.mark.devices(DEVICES)
def test_nnx_optimizer_holds_an_unreduced_accumulator():
  """nnx.Optimizer around accumulate(unreduced_axes=...): the large batch."""
  from flax import nnx

  graphdef, initial = nnx.split(nnx_mlp(16))

  def loss(params, batch):
    predictions = nnx.merge(graphdef, params)(batch["x"])
    return masked_squared_error(predictions, batch)

  windows = make_windows(LENGTHS, DEVICES, ROWS, seed=12)
  # One device, one SGD step per window on the window's token mean.
  expected = jax.device_get(initial)
  sgd_state = SGD.init(expected)
  window_grad = jax.jit(jax.grad(loss))
  for window in windows:
    grads = window_grad(expected, whole(window))
    updates, sgd_state = SGD.update(grads, sgd_state, expected)
    expected = optax.apply_updates(expected, updates)

  grad_fn = ga_optax.unreduced_value_and_grad(loss, weight_fn=tokens)
  with jax.set_mesh(data_mesh(DEVICES)):
    model = nnx_mlp(16)  # made under the mesh: replicated
    optimizer = nnx.Optimizer(
      model, ga_optax.accumulate(SGD, K, unreduced_axes="data"), wrt=nnx.Param
    )

    @nnx.jit
    def train_step(model, optimizer, batch, flush):
      _, params = nnx.split(model)
      _, grads = grad_fn(params, batch)  # unreduced over "data"
      optimizer.update(model, grads, weight=tokens(batch), flush=flush)

    for batch, flush in micro_steps(windows, K):
      batch = jax.device_put(batch, P("data"))
      train_step(model, optimizer, batch, jnp.bool_(flush))
  assert int(ga_optax.applied_updates(optimizer.opt_state)) == len(LENGTHS)
  assert_finite_and_close(nnx.state(model, nnx.Param), expected)


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply"])
@pytest.mark.parametrize("layout", ["data", "data x model"])
def test_accumulate_unreduced_matches_the_large_batch(layout, fused):
  """accumulate(unreduced_axes=...): exact, one all-reduce per window."""
  layout = LAYOUTS[layout]
  windows = make_windows(LENGTHS, DEVICES, ROWS, seed=10)
  make = ga_optax.accumulate_and_apply if fused else ga_optax.accumulate
  tx = make(SGD, K, unreduced_axes="data")
  mesh = layout.mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    params = put(init_params(), mesh, layout.param_specs)
    state = jax.jit(tx.init)(params)
    for leaf in jax.tree.leaves(state.accumulator):
      assert "{U:data}" in str(jax.typeof(leaf)), jax.typeof(leaf)
    first = jax.device_put(windows[0][0], P("data"))
    step = unreduced_step(tx, fused)
    compiled = step.lower(params, state, first, jnp.bool_(False)).compile()
    final, state = run_steps(compiled, params, state, micro_steps(windows, K))
    # Params keep their sharding.
    assert_specs(final, layout.param_specs)
  assert int(ga_optax.applied_updates(state)) == len(LENGTHS)
  assert_finite_and_close(
    final, large_batch_reference(SGD, init_params(), windows)
  )

  found = audits.window_collectives(compiled.as_text())
  # Per micro-step: the loss value's and the weights' scalar sums, and on a
  # model axis the model's own activation sums; nothing parameter-sized.
  if "model" in layout.axes:
    moved = sum(c.operand_bytes for c in found.every_micro_step)
    assert moved < per_device_bytes(final) / 2, found
  else:
    assert all(c.operand_bytes <= 8 for c in found.every_micro_step), found
  closing = [c for c in found.window_closing if c.operand_bytes > 8]
  assert [c.opcode for c in closing] == ["all-reduce"], found
  assert closing[0].operand_bytes == per_device_bytes(final), found


@pytest.mark.devices(DEVICES)
def test_accumulate_unreduced_keeps_the_state_sharded_like_the_params():
  """A stateful inner optimizer's state takes the params' model sharding."""
  inner = optax.sgd(0.3, momentum=0.5)
  layout = LAYOUTS["data x model"]
  windows = make_windows(LENGTHS, DEVICES, ROWS, seed=11)
  tx = ga_optax.accumulate(inner, K, unreduced_axes="data")
  mesh = layout.mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    params = put(init_params(), mesh, layout.param_specs)
    final, state = run_steps(
      unreduced_step(tx, fused=False),
      params,
      jax.jit(tx.init)(params),
      micro_steps(windows, K),
    )
    assert_specs(state.inner_state[0].trace, layout.param_specs)
  assert_finite_and_close(
    final, large_batch_reference(inner, init_params(), windows)
  )


def test_auto_axes_accumulate_keeps_the_params_sharding():
  """FSDP-style on Auto axes: params and state sharded, no unreduced_axes."""
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  specs = {
    "w": P("data", "model"),
    "b": P("model"),
    "scale": P("model"),
    "w2": P("model", "data"),
  }
  params = put(init_params(), mesh, specs)
  batch_sharding = NamedSharding(mesh, P("data"))
  windows = make_windows(LENGTHS, DEVICES, ROWS, seed=12)
  tx = ga_optax.accumulate(SGD, K)
  # Eager init makes zeros with each parameter's sharding.
  state = tx.init(params)
  assert_specs(state.accumulator, specs)

  def step(params, state, batch, flush):
    grads = jax.grad(token_mean_loss)(params, batch)
    updates, state = tx.update(
      grads, state, params, weight=tokens(batch), flush=flush
    )
    return optax.apply_updates(params, updates), state

  def plain_step(params, batch):
    grads = jax.grad(token_mean_loss)(params, batch)
    updates, _ = SGD.update(grads, SGD.init(params), params)
    return optax.apply_updates(params, updates)

  first = jax.device_put(windows[0][0], batch_sharding)
  compiled = (
    jax.jit(step, donate_argnums=(0, 1))
    .lower(params, state, first, jnp.bool_(False))
    .compile()
  )
  # The accumulator leaves with the params' sharding.
  for leaf_sharding, spec in zip(
    jax.tree.leaves(compiled.output_shardings[1].accumulator),
    jax.tree.leaves(specs),
    strict=True,
  ):
    assert leaf_sharding.spec == spec, (leaf_sharding, spec)
  # Nothing moves between devices when the window closes (the optimizer
  # works on its shards), and accumulating gathers nothing the plain step
  # does not: XLA's per-micro-step gradient reduction is all there is.
  found = audits.window_collectives(compiled.as_text())
  assert found.window_closing == [], found
  plain = audits.collectives_in_hlo(
    audits.parse_hlo(
      jax.jit(plain_step).lower(params, first).compile().as_text()
    )
  )
  gathered = sorted(
    c.operand_bytes for c in found.every_micro_step if "gather" in c.opcode
  )
  plain_gathered = sorted(
    c.operand_bytes for c in plain if "gather" in c.opcode
  )
  assert gathered == plain_gathered, (gathered, plain_gathered)

  for batch, flush in micro_steps(windows, K):
    batch = jax.device_put(batch, batch_sharding)
    params, state = compiled(params, state, batch, jnp.bool_(flush))
  assert_specs(state.accumulator, specs)
  assert_specs(params, specs)
  assert_finite_and_close(
    params, large_batch_reference(SGD, init_params(), windows)
  )


@pytest.mark.devices(DEVICES)
def test_mismatched_sharding_types_are_named_errors():
  """Never a ShardingTypeError: a ValueError naming the argument."""
  params = init_params()
  (window,) = make_windows((1,), DEVICES, ROWS, seed=40)
  batch = window[0]
  explicit = LAYOUTS["data"].mesh(AxisType.Explicit)
  auto = LAYOUTS["data"].mesh(AxisType.Auto)
  tx = ga_optax.accumulate(SGD, K, unreduced_axes="data")
  with jax.set_mesh(explicit):
    sharded = jax.device_put(batch, P("data"))
    state = tx.init(params)
    replicated = jax.jit(jax.grad(token_mean_loss))(params, sharded)
    with pytest.raises(ValueError, match="unreduced_axes"):
      jax.jit(tx.update)(replicated, state)
    with pytest.raises(ValueError, match="unreduced_axes"):
      ga_optax.accumulate(SGD, K, unreduced_axes="model").init(params)
    # axis_name is for steps inside shard_map: init may run outside it,
    # a micro-step under a plain jit may not.
    shard_map_tx = ga_optax.accumulate(SGD, K, axis_name="data")
    outside = shard_map_tx.init(params)
    with pytest.raises(ValueError, match="axis_name"):
      jax.jit(shard_map_tx.update)(replicated, outside)
  with jax.set_mesh(auto):
    with pytest.raises(ValueError, match="Explicit"):
      tx.init(params)
    with pytest.raises(ValueError, match="Explicit"):
      ga_optax.unreduced_value_and_grad(token_mean_loss, unreduced_axes="data")(
        params, jax.device_put(batch, NamedSharding(auto, P("data")))
      )


@pytest.mark.devices(DEVICES)
def test_mid_window_checkpoints_resume_here_and_on_2_devices(tmp_path):
  """Mid-window states saved with orbax, resumed here and on 2 devices."""
  windows = make_windows(LENGTHS, DEVICES, ROWS, seed=20)
  run = list(micro_steps(windows, K))
  saved_after = 4  # one micro-step into the flushed window
  expected = large_batch_reference(SGD, init_params(), windows)
  tx = ga_optax.accumulate(SGD, K, unreduced_axes="data")
  layout = LAYOUTS["data x model"]
  mesh = layout.mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    start = put(init_params(), mesh, layout.param_specs)
    step = unreduced_step(tx, fused=False)
    unstopped, _ = run_steps(step, start, tx.init(start), run)
    middle, state = run_steps(step, start, tx.init(start), run[:saved_after])
    stacked = ga_optax.planning.stack_partial_sums(state)
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "stacked", (middle, stacked))
      checkpointer.save(
        tmp_path / "total", (middle, ga_optax.planning.consolidate(state))
      )
      restored = checkpointer.restore(tmp_path / "stacked", (middle, stacked))
    resumed = ga_optax.planning.unstack_partial_sums(
      restored[1], jax.eval_shape(tx.init, start)
    )
    final, _ = run_steps(step, restored[0], resumed, run[saved_after:])
    saved_on_8 = jax.device_get(stacked)
  assert_finite_and_close(unstopped, expected)
  chex.assert_trees_all_equal(final, unstopped)

  # Consolidated, or the 8 devices' partial sums folded: on 2 devices.
  with jax.set_mesh(data_mesh(2)):
    start = put(init_params(), data_mesh(2), REPLICATED)
    like = tx.init(start)
    step = unreduced_step(tx, fused=False)
    with ocp.StandardCheckpointer() as checkpointer:
      middle, total = checkpointer.restore(
        tmp_path / "total", (start, ga_optax.planning.consolidate(like))
      )
    for state in (
      ga_optax.planning.split_total(total, like),
      ga_optax.planning.unstack_partial_sums(
        jax.device_put(saved_on_8, P()), like
      ),
    ):
      final, _ = run_steps(step, middle, state, run[saved_after:])
      assert_finite_and_close(final, expected)


@pytest.mark.devices(DEVICES)
def test_a_window_boundary_resumes_on_other_devices_with_another_k():
  """Saved on 8 devices with k=1, resumed on 2 with k=4."""
  global_batch = 64
  # One global batch per window, each with its own number of real tokens.
  windows = make_windows((1, 1, 1, 1), DEVICES, global_batch // DEVICES, 50)
  expected = large_batch_reference(SGD, init_params(), windows)

  def train(num_devices, params, state, windows):
    plan = ga_optax.planning.elastic_plan(global_batch, num_devices, (8,))
    tx = ga_optax.accumulate(SGD, plan.num_microbatches, unreduced_axes="data")
    rows = plan.micro_batch_size * num_devices
    mesh = data_mesh(num_devices)
    with jax.set_mesh(mesh):
      params = put(params, mesh, REPLICATED)
      like = tx.init(params)
      # The accumulator is unreduced even at a boundary: it goes through
      # consolidate and split_total like any saved state.
      state = (
        like if state is None else ga_optax.planning.split_total(state, like)
      )
      step = unreduced_step(tx, fused=False)
      for window in windows:
        batch = whole(window)
        micro = [
          (jax.tree.map(lambda leaf, i=i: leaf[i : i + rows], batch), False)
          for i in range(0, global_batch, rows)
        ]
        params, state = run_steps(step, params, state, micro)
      assert int(state.micro_step) == 0
      # What a checkpoint holds: host arrays.
      return jax.device_get((params, ga_optax.planning.consolidate(state)))

  middle, state = train(DEVICES, init_params(), None, windows[:2])
  final, _ = train(2, middle, state, windows[2:])
  assert_finite_and_close(final, expected)
