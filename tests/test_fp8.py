"""Float8 state across a window: Flax's fp8 ops under accumulation.

A Linen MLP of fp8 dense layers keeps amax histories and scales in the
``_overwrite_with_gradient`` collection. The references are Flax's own
large-batch ``TrainState.apply_gradients`` on the concatenated batch, and
``jax.grad`` of each micro-batch from the window-start variables with the
combination rule written out in NumPy; never ga_optax itself.

What is exact (see docs/how-to/mixed-precision.md): with each micro-batch's
loss its share of the window's loss (``sum / W``) and ``reduction="sum"``,
every backward tensor equals the large batch's rows, and the params and the
whole float8 state equal the large batch's to float32 rounding. With the
micro-batch's *mean* loss, the forward histories, the scales and the last
layer's output-gradient history are the large batch's, but the deeper
output-gradient histories and the gradients follow the micro-batches' own
backward passes, which quantise an output gradient ``W / w_i`` times the
large batch's with the large batch's scale.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state
from gpu_compiler import compiled_for_gpu

import ga_optax
from ga_optax._src import audits
from ga_optax._src.algebra import fp8
from ga_optax._src.window.state import find_state

pytestmark = pytest.mark.filterwarnings(
  "ignore:The Fp8DotGeneralOp is deprecated:DeprecationWarning"
)

FP8 = fp8.OVERWRITE_WITH_GRADIENT
HISTORY = 4
FEATURES, OUTPUTS = 8, 4
OPS = {
  "Fp8DotGeneralOp": nn.Fp8DotGeneralOp,  # the op the issue measured
  "Fp8DirectDotGeneralOp": nn.Fp8DirectDotGeneralOp,  # fp8 GEMMs on GPUs
}


class Mlp(nn.Module):
  """Three fp8 dense layers: two deeper ones and the last."""

  op: Any = nn.Fp8DirectDotGeneralOp
  width: int = 32

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(
      nn.Dense,
      dot_general_cls=functools.partial(self.op, amax_history_length=HISTORY),
    )
    x = nn.gelu(dense(self.width)(x))
    x = nn.gelu(dense(self.width)(x))
    return dense(OUTPUTS)(x)


def row_losses(model: Mlp, variables: Any, batch: dict[str, Any]) -> Any:
  error = model.apply(variables, batch["x"]) - batch["y"]
  return jnp.mean(error**2, axis=-1)


def mean_loss(model: Mlp, variables: Any, batch: dict[str, Any]) -> Any:
  """The batch's mean loss over its real rows (``mask`` 1)."""
  mask = batch["mask"]
  return jnp.sum(row_losses(model, variables, batch) * mask) / jnp.sum(mask)


def share_loss(
  model: Mlp, variables: Any, batch: dict[str, Any], total: Any
) -> Any:
  """The micro-batch's share of its window's mean loss: ``sum / W``."""
  return jnp.sum(row_losses(model, variables, batch) * batch["mask"]) / total


def make_batch(rng: np.random.Generator, rows: int) -> dict[str, Any]:
  return {
    "x": jnp.asarray(rng.normal(size=(rows, FEATURES)), jnp.float32),
    "y": jnp.asarray(rng.normal(size=(rows, OUTPUTS)), jnp.float32),
    "mask": jnp.ones((rows,), jnp.float32),
  }


def rows(batch: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
  return jax.tree.map(lambda leaf: leaf[start:stop], batch)


def concatenated(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
  return jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *batches)


def split(batch: dict[str, Any], sizes: Sequence[int]) -> list[dict[str, Any]]:
  bounds = np.cumsum([0, *sizes])
  return [rows(batch, a, b) for a, b in itertools.pairwise(bounds)]


@functools.cache
def warm_variables(op_name: str) -> Any:
  """Variables after three large-batch steps: histories and scales set.

  From a fresh state the histories are zeros and every scale is 1; a
  trained state has delayed scales, which is where micro-batches and the
  large batch part ways.
  """
  model = Mlp(OPS[op_name])
  rng = np.random.default_rng(1)
  variables = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))
  state = train_state.TrainState.create(
    apply_fn=model.apply, params=variables, tx=optax.sgd(0.1)
  )
  for _ in range(3):
    grads = jax.grad(functools.partial(mean_loss, model))(
      state.params, make_batch(rng, 16)
    )
    state = state.apply_gradients(grads=grads)
  return state.params


@functools.cache
def reference_grad(model: Mlp) -> Callable[..., Any]:
  """``jax.grad`` of the mean loss, jitted once per model."""
  return jax.jit(jax.grad(functools.partial(mean_loss, model)))


@functools.cache
def large_batch_step(model: Mlp) -> Callable[..., Any]:
  """Flax's own step on the whole batch: the reference."""

  @jax.jit
  def step(state, batch):
    grads = jax.grad(functools.partial(mean_loss, model))(state.params, batch)
    return state.apply_gradients(grads=grads)

  return step


def accumulating_state(variables: Any, tx: Any) -> Any:
  """The recipe: a TrainState whose optimizer state has the fp8 window."""
  return train_state.TrainState.create(
    apply_fn=None, params=variables, tx=tx
  ).replace(opt_state=tx.init(variables))


@functools.cache
def micro_step(model: Mlp, loss: Callable[..., Any]) -> Callable[..., Any]:
  @jax.jit
  def step(state, batch, weight, flush=False, *args):
    grads = jax.grad(functools.partial(loss, model))(state.params, batch, *args)
    return ga_optax.apply_gradients(state, grads, weight=weight, flush=flush)

  return step


def combination_rule(
  micro_states: Sequence[Any], factors: Sequence[float], divisor: float
) -> Any:
  """The large batch's new fp8 state from the micro-batches', in NumPy.

  Forward histories: elementwise max; output-gradient histories: index 0
  the max of ``factor * amax`` over ``divisor``, the rest shared; scales:
  shared.
  """

  def leaf(path, *values):
    name = path[-1].key
    values = [np.asarray(value) for value in values]
    if name == "output_grad_amax_history":
      combined = values[-1].copy()
      combined[0] = (
        max(f * v[0] for f, v in zip(factors, values, strict=True)) / divisor
      )
      return combined
    if name.endswith("amax_history"):
      return np.max(values, axis=0)
    return values[-1]

  return jax.tree_util.tree_map_with_path(leaf, *micro_states)


def weighted_mean(trees: Sequence[Any], weights: Sequence[float]) -> Any:
  return jax.tree.map(
    lambda *leaves: (
      sum(w * leaf for w, leaf in zip(weights, leaves, strict=True))
      / sum(weights)
    ),
    *trees,
  )


def leaves_named(tree: Any, pattern: str) -> dict[str, Any]:
  return {
    jax.tree_util.keystr(path): np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    if re.search(pattern, jax.tree_util.keystr(path))
  }


def assert_close(actual: Any, expected: Any, **tolerance: float) -> None:
  chex.assert_trees_all_close(actual, expected, **tolerance)
  for leaf in jax.tree.leaves(actual):
    assert np.all(np.isfinite(leaf))


def relative_differences(actual: Any, expected: Any) -> dict[str, float]:
  return {
    jax.tree_util.keystr(path): float(
      np.max(np.abs(np.asarray(a) - np.asarray(b)))
      / max(float(np.max(np.abs(b))), 1e-30)
    )
    for (path, a), b in zip(
      jax.tree_util.tree_flatten_with_path(actual)[0],
      jax.tree.leaves(expected),
      strict=True,
    )
  }


# The share recipe: params and the whole float8 state, to float32 rounding.


@pytest.mark.parametrize("op_name", sorted(OPS))
def test_share_of_the_window_loss_is_the_large_batch(op_name):
  # Windows of 6 + 10 rows from a trained state, with Adam: each
  # micro-batch's loss is its share of the window's mean loss, the window
  # sums, and every backward tensor is the large batch's, row for row, up
  # to the rounding of the matrix products (below).
  model = Mlp(OPS[op_name])
  variables = warm_variables(op_name)
  rng = np.random.default_rng(2)
  large = train_state.TrainState.create(
    apply_fn=model.apply, params=variables, tx=optax.adam(1e-2)
  )
  state = accumulating_state(
    variables, ga_optax.accumulate(optax.adam(1e-2), 2, reduction="sum")
  )
  large_step, step = large_batch_step(model), micro_step(model, share_loss)
  for _ in range(4):
    # Each window starts from the variables the last one left on both
    # sides, so each comparison bounds one window's rounding, not four.
    large = large.replace(params=state.params)
    batch = make_batch(rng, 16)
    first, second = split(batch, (6, 10))
    window_start = state.params[FP8]
    state = step(state, first, 1.0, False, 16.0)
    # Mid-window the float8 state is the window start's, bit for bit.
    assert_close(state.params[FP8], window_start, rtol=0, atol=0)
    state = step(state, second, 1.0, False, 16.0)
    large = large_step(large, batch)
    assert bool(ga_optax.emitted(state.opt_state))
    # Equal to float32 rounding, not bit for bit: the closed state is a max
    # over rows the window computes in products of 6 and 10 rows and the
    # large batch in products of 16, and XLA does not round a row alike in
    # both (on jax 0.12 the CPU's float32 (6, 32) @ (32, 4) product differs
    # in the last bit from the same rows of the (16, 32) one). A max of
    # values within a few ulps is within as many: measured 0 or 1 ulp
    # (0.08274935930967331 against 0.08274935185909271 on jax 0.12), and
    # rtol 1e-6 is 8 ulps. The params: within 3e-8.
    assert_close(state.params[FP8], large.params[FP8], rtol=1e-6, atol=0)
    assert_close(state.params["params"], large.params["params"], atol=1e-6)


def test_the_host_schedule_carries_the_float8_state_as_the_device_does():
  # The share recipe with the host choosing each call's side (closing=):
  # the first micro-batch keeps the window open, the second closes it (a
  # window of 3 that the host closes after 2, so the counter alone would
  # not). The float8 state stays the window start's mid-window and becomes
  # the large batch's at the close, as do the params.
  model = Mlp(OPS["Fp8DirectDotGeneralOp"])
  variables = warm_variables("Fp8DirectDotGeneralOp")
  rng = np.random.default_rng(5)
  large = train_state.TrainState.create(
    apply_fn=model.apply, params=variables, tx=optax.adam(1e-2)
  )
  state = accumulating_state(
    variables, ga_optax.accumulate(optax.adam(1e-2), 3, reduction="sum")
  )

  @functools.partial(jax.jit, static_argnames="closing")
  def step(state, batch, closing):
    grads = jax.grad(functools.partial(share_loss, model))(
      state.params, batch, 16.0
    )
    return ga_optax.apply_gradients(state, grads, closing=closing)

  large_step = large_batch_step(model)
  for _ in range(3):
    large = large.replace(params=state.params)
    batch = make_batch(rng, 16)
    first, second = split(batch, (6, 10))
    window_start = state.params[FP8]
    state = step(state, first, closing=False)
    assert not bool(ga_optax.emitted(state.opt_state))
    assert_close(state.params[FP8], window_start, rtol=0, atol=0)
    state = step(state, second, closing=True)
    assert bool(ga_optax.emitted(state.opt_state))
    large = large_step(large, batch)
    # Within float32 rounding, as in the device's schedule (above).
    assert_close(state.params[FP8], large.params[FP8], rtol=1e-6, atol=0)
    assert_close(state.params["params"], large.params["params"], atol=1e-6)
  assert int(ga_optax.applied_updates(state.opt_state)) == 3


@pytest.mark.devices(8)
def test_share_windows_across_devices_in_shard_map():
  # Windows of 2 x 16 rows, 2 rows a device on 8 devices, inside shard_map:
  # with axis_name the fp8 state a window leaves combines every device's
  # rows, as the large batch's; without it each device keeps its own.
  model = Mlp()
  variables = warm_variables("Fp8DirectDotGeneralOp")
  mesh = jax.make_mesh((8,), ("data",))
  P = jax.sharding.PartitionSpec
  tx = ga_optax.accumulate(
    optax.adam(1e-2), 2, reduction="sum", axis_name="data"
  )
  each_device_alone = ga_optax.accumulate(optax.adam(1e-2), 2, reduction="sum")

  def sharded_step(tx):
    def step(state, batch):
      grads = jax.grad(functools.partial(share_loss, model))(
        state.params, batch, 32.0
      )
      return ga_optax.apply_gradients(state.replace(tx=tx), grads)

    return jax.jit(
      jax.shard_map(
        step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
        check_vma=False,
      )
    )  # fmt: skip

  combined, apart = sharded_step(tx), sharded_step(each_device_alone)
  large = train_state.TrainState.create(
    apply_fn=model.apply, params=variables, tx=optax.adam(1e-2)
  )
  state = accumulating_state(variables, tx)
  rng = np.random.default_rng(15)
  for _ in range(3):
    batch = make_batch(rng, 32)
    first, second = jax.device_put(
      split(batch, (16, 16)), jax.sharding.NamedSharding(mesh, P("data"))
    )
    alone = apart(combined(state, first), second)
    state = combined(combined(state, first), second)
    large = large_batch_step(model)(large, batch)
    assert bool(ga_optax.emitted(state.opt_state))
    assert_close(state.params[FP8], large.params[FP8], rtol=1e-6, atol=0)
    assert_close(state.params["params"], large.params["params"], atol=1e-6)
    # Device 0's own rows only: its input amaxes fall short of the batch's.
    own = leaves_named(alone.params[FP8], r"input_amax_history")
    whole = leaves_named(large.params[FP8], r"input_amax_history")
    assert any(float(own[k][0]) < float(whole[k][0]) for k in whole)


@pytest.mark.devices(8)
def test_mean_windows_across_devices_in_shard_map():
  # The mean recipe on 8 devices: 2 micro-batches of 16 rows, 2 rows a
  # device each, each device's loss the mean over its 2 rows (weight 2).
  # The closing state follows the rule over all 16 pieces, W = 32 in all.
  model = Mlp()
  variables = warm_variables("Fp8DirectDotGeneralOp")
  mesh = jax.make_mesh((8,), ("data",))
  P = jax.sharding.PartitionSpec
  tx = ga_optax.accumulate(optax.sgd(0.1), 2, axis_name="data")

  def step(state, batch):
    grads = jax.grad(functools.partial(mean_loss, model))(state.params, batch)
    return ga_optax.apply_gradients(state, grads, weight=2.0)

  sharded_step = jax.jit(
    jax.shard_map(
      step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
      check_vma=False,
    )
  )  # fmt: skip
  microbatches = split(make_batch(np.random.default_rng(16), 32), (16, 16))
  state = accumulating_state(variables, tx)
  for microbatch in microbatches:
    state = sharded_step(
      state,
      jax.device_put(microbatch, jax.sharding.NamedSharding(mesh, P("data"))),
    )
  assert bool(ga_optax.emitted(state.opt_state))
  pieces = [split(microbatch, [2] * 8) for microbatch in microbatches]
  grads = [
    reference_grad(model)(variables, piece)
    for device_pieces in pieces
    for piece in device_pieces
  ]
  expected_fp8 = combination_rule([g[FP8] for g in grads], [2] * 16, 32)
  assert_close(state.params[FP8], expected_fp8, rtol=1e-6, atol=0)
  mean_grad = weighted_mean([g["params"] for g in grads], [2] * 16)
  expected_params = optax.apply_updates(
    variables["params"], jax.tree.map(lambda g: -0.1 * g, mean_grad)
  )
  assert_close(state.params["params"], expected_params, atol=1e-6)


@pytest.mark.parametrize("path", ["update", "accumulate_and_apply"])
def test_fp8_state_given_as_gradients_is_refused_with_the_recipe(path):
  model = Mlp()
  variables = warm_variables("Fp8DirectDotGeneralOp")
  grads = reference_grad(model)(
    variables, make_batch(np.random.default_rng(17), 8)
  )
  if path == "update":
    tx = ga_optax.accumulate(optax.sgd(0.1), 2)
    call = functools.partial(tx.update, grads, tx.init(variables), variables)
  else:
    fused = ga_optax.accumulate_and_apply(optax.sgd(0.1), 2)
    call = functools.partial(
      fused.apply, variables, grads, fused.init(variables)
    )
  with pytest.raises(ValueError, match=r"never summed.*apply_gradients"):
    call()


def test_accumulate_gives_the_fp8_window_its_reduction():
  tx = ga_optax.accumulate(optax.sgd(0.1), 2, reduction="sum")
  state = find_state(tx.init(warm_variables("Fp8DirectDotGeneralOp")))
  (window,) = [
    part for part in state.parts if isinstance(part, fp8.Fp8InWindow)
  ]
  assert window.running.reduction == "sum"


# The mean recipe (the contract's weighted mean of mean losses).


@pytest.mark.parametrize(
  "op_name, sizes",
  [("Fp8DotGeneralOp", (8, 8)), ("Fp8DirectDotGeneralOp", (6, 10))],
  ids=["Fp8DotGeneralOp-8+8", "Fp8DirectDotGeneralOp-6+10"],
)
def test_mean_loss_window_against_the_large_batch(op_name, sizes):
  model = Mlp(OPS[op_name])
  variables = warm_variables(op_name)
  batch = make_batch(np.random.default_rng(3), 16)
  microbatches = split(batch, sizes)
  tx = ga_optax.accumulate(optax.sgd(0.1), len(sizes))
  state = accumulating_state(variables, tx)
  step = micro_step(model, mean_loss)
  for microbatch, size in zip(microbatches, sizes, strict=True):
    state = step(state, microbatch, float(size))
  large = large_batch_step(model)(
    train_state.TrainState.create(
      apply_fn=model.apply, params=variables, tx=optax.sgd(0.1)
    ),
    batch,
  )

  # The large batch's forward histories and scales, and the last layer's
  # output-gradient history (measured: equal; 1e-7 relative for 6 + 10).
  exact = r"(input_amax|kernel_amax|scale|Dense_2.*output_grad_amax)"
  assert_close(
    leaves_named(state.params[FP8], exact),
    leaves_named(large.params[FP8], exact),
    rtol=1e-6,
    atol=0,
  )

  # Everything follows the micro-batches' own passes from the window start.
  grads = [
    reference_grad(model)(variables, microbatch) for microbatch in microbatches
  ]
  expected_fp8 = combination_rule(
    [grad[FP8] for grad in grads], sizes, sum(sizes)
  )
  assert_close(state.params[FP8], expected_fp8, rtol=1e-6, atol=0)
  mean_grad = weighted_mean([grad["params"] for grad in grads], sizes)
  expected_params = optax.apply_updates(
    variables["params"], jax.tree.map(lambda g: -0.1 * g, mean_grad)
  )
  assert_close(state.params["params"], expected_params, atol=1e-6)

  # What is not exact: each micro-batch's output gradient is W / w_i times
  # the large batch's, quantised to float8 (e5m2) with the scale the large
  # batch's history set, so it saturates. Measured: the deeper layers'
  # output-gradient amax 1.3% to 17% off, the params' step 14% to 47%.
  deeper = r"Dense_[01].*output_grad_amax"
  off = relative_differences(
    leaves_named(state.params[FP8], deeper),
    leaves_named(large.params[FP8], deeper),
  )
  assert min(off.values()) > 0.005, off
  steps = jax.tree.map(
    jnp.subtract, state.params["params"], variables["params"]
  )
  large_steps = jax.tree.map(
    jnp.subtract, large.params["params"], variables["params"]
  )
  assert max(relative_differences(steps, large_steps).values()) > 0.1


def test_fresh_state_window_is_the_large_batch():
  # From init (empty histories, scales 1) nothing saturates: one window of
  # 8 + 8 is the large batch's step, fp8 state and params.
  model = Mlp()
  variables = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))
  batch = make_batch(np.random.default_rng(4), 16)
  state = accumulating_state(variables, ga_optax.accumulate(optax.sgd(0.1), 2))
  step = micro_step(model, mean_loss)
  for microbatch in split(batch, (8, 8)):
    state = step(state, microbatch, 8.0)
  large = large_batch_step(model)(
    train_state.TrainState.create(
      apply_fn=model.apply, params=variables, tx=optax.sgd(0.1)
    ),
    batch,
  )
  # Measured: the fp8 state equal but the deeper layers' output-gradient
  # amax (3e-5 relative: each micro-batch's output gradient is twice the
  # large batch's, and e5m2 rounds its smallest entries, subnormal at scale
  # 1, differently); the params 3e-6 apart.
  deeper = r"Dense_[01].*output_grad_amax"
  exact = r"(input_amax|kernel_amax|scale|Dense_2.*output_grad_amax)"
  assert_close(
    leaves_named(state.params[FP8], exact),
    leaves_named(large.params[FP8], exact),
    rtol=1e-6,
    atol=0,
  )
  assert_close(
    leaves_named(state.params[FP8], deeper),
    leaves_named(large.params[FP8], deeper),
    rtol=1e-4,
    atol=0,
  )
  assert_close(state.params["params"], large.params["params"], atol=1e-5)


def test_flax_train_state_overwrites_the_fp8_state_every_micro_step():
  # Today's failure mode: Flax's TrainState.apply_gradients with an
  # accumulate tx writes each micro-batch's new state over the old one, so
  # the second micro-batch quantises with the first one's scales and the
  # window ends with histories rolled twice. ga_optax.apply_gradients
  # keeps the window-start state and closes as the large batch.
  model = Mlp()
  variables = warm_variables("Fp8DirectDotGeneralOp")
  batch = make_batch(np.random.default_rng(5), 16)
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  flax_state = train_state.TrainState.create(
    apply_fn=model.apply, params=variables, tx=tx
  )
  ours = accumulating_state(variables, tx)
  loss = functools.partial(mean_loss, model)

  @jax.jit
  def flax_step(state, microbatch):
    return state.apply_gradients(grads=jax.grad(loss)(state.params, microbatch))

  step = micro_step(model, mean_loss)
  first, second = split(batch, (8, 8))
  flax_state, ours = flax_step(flax_state, first), step(ours, first, 8.0)
  moved = relative_differences(flax_state.params[FP8], variables[FP8])
  assert max(moved.values()) > 0.1, moved
  chex.assert_trees_all_equal(ours.params[FP8], variables[FP8])

  flax_state, ours = flax_step(flax_state, second), step(ours, second, 8.0)
  large = large_batch_step(model)(
    train_state.TrainState.create(
      apply_fn=model.apply, params=variables, tx=optax.sgd(0.1)
    ),
    batch,
  )
  forward = r"(input_amax|kernel_amax|scale)"
  flax_off = relative_differences(
    leaves_named(flax_state.params[FP8], forward),
    leaves_named(large.params[FP8], forward),
  )
  assert max(flax_off.values()) > 0.1, flax_off
  assert_close(
    leaves_named(ours.params[FP8], forward),
    leaves_named(large.params[FP8], forward),
    rtol=1e-6,
    atol=0,
  )


def test_windows_with_flush_skip_and_weights():
  # Every window against jax.grad of its micro-batches from its own start:
  # a NaN micro-batch dropped by skip_nonfinite, unequal weights, a flushed
  # partial window, and a flush that closes an empty window.
  model = Mlp()
  variables = warm_variables("Fp8DirectDotGeneralOp")
  rng = np.random.default_rng(6)
  tx = ga_optax.accumulate(optax.adam(1e-2), 3, skip_nonfinite=True)
  state = accumulating_state(variables, tx)
  reference_state = optax.adam(1e-2).init(variables["params"])
  step = micro_step(model, mean_loss)

  def padded(real_rows):
    # One shape for every micro-batch (one compilation); the mask says
    # which rows are real, and the weight counts them.
    batch = make_batch(rng, 6)
    batch["mask"] = (jnp.arange(6) < real_rows).astype(jnp.float32)
    return batch, float(real_rows)

  poisoned, _ = padded(4)
  poisoned["x"] = poisoned["x"].at[0, 0].set(jnp.nan)
  windows = [
    # (micro-batch, weight, flush): full after 3 kept micro-steps.
    [
      (*padded(4), False),
      (poisoned, 4.0, False),
      (*padded(6), False),
      (*padded(2), False),
    ],
    # Flushed after 2 micro-steps of unequal weight.
    [(*padded(5), False), (*padded(3), True)],
  ]
  for window in windows:
    start = state.params
    kept, grads = [], []
    for index, (microbatch, weight, flush) in enumerate(window):
      state = step(state, microbatch, weight, flush)
      if microbatch is not poisoned:
        kept.append(weight)
        grads.append(reference_grad(model)(start, microbatch))
      if index < len(window) - 1:
        assert not bool(ga_optax.emitted(state.opt_state))
        chex.assert_trees_all_equal(state.params, start)
    assert bool(ga_optax.emitted(state.opt_state))
    expected_fp8 = combination_rule([g[FP8] for g in grads], kept, sum(kept))
    assert_close(state.params[FP8], expected_fp8, rtol=1e-6, atol=0)
    mean_grad = weighted_mean([g["params"] for g in grads], kept)
    updates, reference_state = optax.adam(1e-2).update(
      mean_grad, reference_state
    )
    assert_close(
      state.params["params"],
      optax.apply_updates(start["params"], updates),
      atol=1e-6,
    )
  assert int(ga_optax.num_skipped(state.opt_state)) == 1

  # A flush of a window that holds nothing (its one micro-step dropped)
  # applies nothing and leaves the float8 state as it was.
  before = state.params
  state = step(state, poisoned, 4.0, True)
  assert not bool(ga_optax.emitted(state.opt_state))
  chex.assert_trees_all_equal(state.params, before)


def test_weight_zero_micro_batch_counts_its_forward_amax_only():
  # A micro-batch of padding only (weight 0, a 0 / 0 mean loss): the large
  # batch quantises its rows too, so its forward amaxes count; its output
  # gradient is NaN and does not.
  model = Mlp()
  variables = warm_variables("Fp8DirectDotGeneralOp")
  rng = np.random.default_rng(7)
  padding = make_batch(rng, 8)
  padding["x"] = padding["x"] * 10.0  # the largest inputs of the window
  padding["mask"] = jnp.zeros((8,), jnp.float32)
  real = make_batch(rng, 8)
  state = accumulating_state(variables, ga_optax.accumulate(optax.sgd(0.1), 2))
  step = micro_step(model, mean_loss)
  state = step(step(state, padding, 0.0), real, 8.0)
  large = large_batch_step(model)(
    train_state.TrainState.create(
      apply_fn=model.apply, params=variables, tx=optax.sgd(0.1)
    ),
    concatenated([padding, real]),
  )
  assert_close(state.params[FP8], large.params[FP8], rtol=1e-6, atol=0)
  assert_close(state.params["params"], large.params["params"], atol=1e-6)


# The recipe's errors.


def test_missing_window_names_the_recipe():
  model = Mlp()
  variables = warm_variables("Fp8DirectDotGeneralOp")
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  state = train_state.TrainState.create(
    apply_fn=model.apply, params=variables, tx=tx
  )
  grads = jax.grad(functools.partial(mean_loss, model))(
    variables, make_batch(np.random.default_rng(8), 4)
  )
  with pytest.raises(ValueError, match=r"opt_state=tx\.init\(variables\)"):
    ga_optax.apply_gradients(state, grads)
  params_only = train_state.TrainState.create(
    apply_fn=model.apply, params=variables["params"], tx=tx
  )
  with pytest.raises(ValueError, match=r"state\.params does not"):
    ga_optax.apply_gradients(params_only, grads)
  other = accumulating_state(
    {
      "params": variables["params"],
      FP8: {"Dense_0": variables[FP8]["Dense_0"]},
    },
    tx,
  )
  with pytest.raises(ValueError, match="must have the tree"):
    ga_optax.apply_gradients(other, grads)


def test_params_only_grads_leave_the_fp8_state():
  # Differentiating the params alone is a step that keeps the fp8 state.
  model = Mlp()
  variables = warm_variables("Fp8DirectDotGeneralOp")
  state = accumulating_state(variables, ga_optax.accumulate(optax.sgd(0.1), 1))
  grads = jax.grad(
    lambda params: mean_loss(
      model,
      {**variables, "params": params},
      make_batch(np.random.default_rng(9), 4),
    )
  )(variables["params"])
  state = ga_optax.apply_gradients(state, grads)
  chex.assert_trees_all_equal(state.params[FP8], variables[FP8])
  assert int(ga_optax.applied_updates(state)) == 1


# The combination, as the in-step scan calls it.


def test_combine_and_close_by_hand():
  start = {
    "input_amax_history": jnp.array([0.0, 7.0, 1.0]),
    "output_grad_amax_history": jnp.array([0.0, 7.0, 1.0]),
    "input_scale": jnp.array([0.5]),
  }

  def latest(forward_amax, grad_amax, scale=0.25):
    # Index 0 is the micro-batch's amax; the rest, the rolled old history.
    return {
      "input_amax_history": jnp.array([forward_amax, 1.0, 0.0]),
      "output_grad_amax_history": jnp.array([grad_amax, 1.0, 0.0]),
      "input_scale": jnp.array([scale]),
    }

  window = fp8.init_window(start)
  window = fp8.combine(window, latest(3.0, 3.0), 2.0)
  # Dropped as non-finite: nothing counts.
  window = fp8.combine(window, latest(jnp.nan, jnp.nan), 9.0, contributes=False)
  # Padding only (weight 0, a 0 / 0 loss): its forward amax counts.
  window = fp8.combine(window, latest(4.0, jnp.nan), 0.0)
  window = fp8.combine(window, latest(1.0, 1.0), 8.0)
  closed = fp8.close(window, start, 10.0)
  np.testing.assert_array_equal(closed["input_amax_history"], [4.0, 1.0, 0.0])
  np.testing.assert_allclose(
    closed["output_grad_amax_history"], [max(2 * 3.0, 8 * 1.0) / 10, 1.0, 0.0]
  )
  np.testing.assert_array_equal(closed["input_scale"], [0.25])

  # A window that sums: each micro-batch's output gradient is already the
  # large batch's rows; no division.
  summed = fp8.init_window(start, reduction="sum")
  summed = fp8.combine(summed, latest(3.0, 3.0), 1.0)
  summed = fp8.combine(summed, latest(5.0, 2.0), 1.0)
  closed = fp8.close(summed, start, 16.0)
  np.testing.assert_array_equal(closed["input_amax_history"], [5, 1, 0])
  np.testing.assert_array_equal(closed["output_grad_amax_history"], [3, 1, 0])

  # A stale window restarts; an empty one leaves the state as it was.
  restarted = fp8.combine(summed, latest(2.0, 2.0), 1.0, restart=True)
  np.testing.assert_array_equal(restarted.combined["input_amax_history"][0], 2)
  chex.assert_trees_all_equal(fp8.close(summed, start, 0.0), start)


def test_bad_fp8_state_and_reduction():
  with pytest.raises(ValueError, match="none of Flax's fp8 names"):
    fp8.init_window({"counter": jnp.zeros(())})
  with pytest.raises(ValueError, match="history axis"):
    fp8.init_window({"input_amax_history": jnp.zeros(())})
  with pytest.raises(ValueError, match="reduction"):
    fp8.init_window({"input_scale": jnp.ones(1)}, reduction="max")
  window = fp8.init_window({"input_scale": jnp.ones(1)})
  with pytest.raises(ValueError, match="latest must have the tree"):
    fp8.combine(window, {"kernel_scale": jnp.ones(1)}, 1.0)


# The H100 program.


def fp8_gemms(hlo_text: str) -> list[tuple[str, str]]:
  """The operand dtypes of each GEMM on float8 operands in compiled text.

  XLA:GPU prints a GEMM as a ``dot`` inside a Triton GEMM fusion (``kind=
  kCustom`` with a ``__triton_gemm``/``__triton_nested_gemm_fusion``
  backend), or as a cuBLASLt custom-call (``__cublas$lt$matmul$f8``); the
  dtypes are those of the dot's (or custom-call's) operands.
  """
  module = audits.parse_hlo(hlo_text)
  gemm_callers = re.findall(
    r"fusion\([^\n]*calls=%?([\w.\-]+)[^\n]*__triton[\w]*gemm", hlo_text
  )
  found = []
  for name, instructions in module.computations.items():
    shapes = {
      instruction.name: instruction.shape for instruction in instructions
    }
    for instruction in instructions:
      is_gemm = (instruction.opcode == "dot" and name in gemm_callers) or (
        instruction.opcode == "custom-call"
        and re.search(
          rf"%{re.escape(instruction.name)} = .*__cublas\$lt\$matmul\$f8",
          hlo_text,
        )
      )
      dtypes = tuple(
        shapes.get(operand, "").split("[")[0]
        for operand in instruction.operands[:2]
      )
      if is_gemm and all(dtype.startswith("f8") for dtype in dtypes):
        found.append(dtypes)
  return found


def test_h100_program_of_the_fp8_step_holds_fp8_gemms():
  model = Mlp(nn.Fp8DirectDotGeneralOp, width=256)
  x = jnp.zeros((64, 128), jnp.float32)
  batch = {"x": x, "y": jnp.zeros((64, OUTPUTS)), "mask": jnp.ones((64,))}
  variables = model.init(jax.random.key(0), x)
  state = accumulating_state(
    variables, ga_optax.accumulate(optax.adam(1e-3), 4)
  )

  def step(state, batch):
    grads = jax.grad(functools.partial(mean_loss, model))(state.params, batch)
    return ga_optax.apply_gradients(state, grads, weight=64)

  compiled = compiled_for_gpu(step, state, batch, donate_argnums=(0,))
  gemms = fp8_gemms(compiled.as_text())
  # Forward: input x kernel, e4m3 x e4m3, in each of the 3 layers. Backward:
  # the output gradient (e5m2) times the kernel for the 2 upper layers'
  # inputs, and the input times it for the 3 kernels.
  assert gemms.count(("f8e4m3fn", "f8e4m3fn")) == 3, gemms
  assert len([g for g in gemms if "f8e5m2" in g]) == 5, gemms


# The in-step path: microbatched_value_and_grad. It knows the batch's weight
# before its scan, and differentiates each micro-batch's share of the
# batch's loss: the whole fp8 state is the large batch's, also with trained
# scales.


def in_step_window(model: Mlp, num_microbatches: int) -> Callable[..., Any]:
  return ga_optax.microbatched_value_and_grad(
    lambda variables, batch: mean_loss(model, variables, batch),
    num_microbatches,
    weight_fn=lambda batch: jnp.sum(batch["mask"]),
  )


def assert_in_step_like_the_large_batch(grads: Any, expected: Any) -> None:
  assert np.all(np.isfinite(flat_leaves(grads)))
  assert_close(grads[FP8], expected[FP8], rtol=1e-6, atol=0)
  assert_close(grads["params"], expected["params"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("op_name", list(OPS))
def test_microbatched_value_and_grad_combines_the_fp8_state(op_name):
  model = Mlp(OPS[op_name])
  variables = warm_variables(op_name)
  batch = make_batch(np.random.default_rng(12), 16)
  batch["mask"] = batch["mask"].at[13:].set(0.0)
  _, grads = jax.jit(in_step_window(model, 4))(variables, batch)
  expected = reference_grad(model)(variables, batch)
  assert_in_step_like_the_large_batch(grads, expected)
  # The fp8 state is read once and combined, not averaged: averaging the
  # micro-batches' new histories would divide each amax by 4.
  history = leaves_named(grads[FP8], r"Dense_0.*input_amax_history")
  assert all(float(leaf[0]) > 0 for leaf in history.values())


@pytest.mark.devices(8)
def test_microbatched_value_and_grad_combines_fp8_state_across_devices():
  model = Mlp()
  variables = warm_variables("Fp8DirectDotGeneralOp")
  batch = make_batch(np.random.default_rng(13), 32)
  mesh = jax.make_mesh((8,), ("data",))
  P = jax.sharding.PartitionSpec
  window = in_step_window(model, 2)
  expected = reference_grad(model)(variables, batch)
  sharded = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))
  # Under plain jit on the mesh, and inside shard_map with axis_name.
  with jax.set_mesh(mesh):
    _, plain = jax.jit(window)(variables, sharded)
  mapped = jax.jit(
    jax.shard_map(
      lambda variables, batch: ga_optax.microbatched_value_and_grad(
        lambda v, b: mean_loss(model, v, b),
        2,
        weight_fn=lambda b: jnp.sum(b["mask"]),
        axis_name="data",
      )(variables, batch)[1],
      mesh=mesh,
      in_specs=(P(), P("data")),
      out_specs=P(),
      check_vma=False,
    )
  )(variables, sharded)
  for grads in (plain, mapped):
    assert_in_step_like_the_large_batch(grads, expected)


@pytest.mark.devices(8)
def test_unreduced_value_and_grad_refuses_fp8_state():
  model = Mlp()
  variables = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))
  batch = make_batch(np.random.default_rng(14), 16)
  mesh = jax.make_mesh(
    (8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,)
  )
  value_and_grad = ga_optax.unreduced_value_and_grad(
    lambda v, b: mean_loss(model, v, b)
  )
  with jax.set_mesh(mesh):
    sharded = jax.device_put(batch, jax.sharding.PartitionSpec("data"))
    with pytest.raises(ValueError, match="float8 state"):
      jax.jit(value_and_grad)(variables, sharded)


def flat_leaves(tree: Any) -> np.ndarray:
  return np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(tree)])
