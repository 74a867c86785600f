"""Equinox models through both paths, against the large batch.

An Equinox model holds non-array leaves (activation functions, flags). The
in-step path takes the model itself and differentiates its inexact array
leaves, as ``eqx.filter_value_and_grad`` does; the accumulation path takes
``eqx.filter(model, eqx.is_array)``, as optax's optimizers do, and
``validation.check_array_leaves`` names a model given unfiltered. Every
comparison uses plain SGD and windows of unequal weight, so that a wrong
gradient or a wrong scale cannot pass.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src import validation

TOLERANCE = {"rtol": 2e-5, "atol": 2e-6}
LEARNING_RATE = 0.1


def _model() -> eqx.nn.MLP:
  return eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))


def _batch(size: int = 16, seed: int = 1) -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(seed), 2)
  return {
    "x": jax.random.normal(keys[0], (size, 3)),
    "y": jax.random.normal(keys[1], (size, 2)),
  }


def _loss(model, batch):
  return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)


def _assert_close(actual: Any, expected: Any) -> None:
  """Same tree (None at the same leaves), finite, and close."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  chex.assert_tree_all_finite(eqx.filter(actual, eqx.is_array))
  chex.assert_tree_all_finite(eqx.filter(expected, eqx.is_array))
  chex.assert_trees_all_close(
    eqx.filter(actual, eqx.is_array),
    eqx.filter(expected, eqx.is_array),
    **TOLERANCE,
  )


# In-step micro-batching takes the model itself.


@pytest.mark.parametrize("call", ["eager", "filter_jit"])
def test_microbatched_equals_filter_value_and_grad(call):
  value_and_grad = ga_optax.microbatched_value_and_grad(_loss, 4)
  if call == "filter_jit":
    value_and_grad = eqx.filter_jit(value_and_grad)
  value, grads = value_and_grad(_model(), _batch())
  expected_value, expected_grads = eqx.filter_value_and_grad(_loss)(
    _model(), _batch()
  )
  # The model's structure, None at the activation functions.
  assert grads.activation is None and grads.final_activation is None
  _assert_close((value, grads), (expected_value, expected_grads))


class Counted(eqx.Module):
  """Float weights beside an integer array, a Python float and a function."""

  weight: jax.Array
  count: jax.Array
  offset: float
  activation: Any

  def __call__(self, x):
    return self.activation(x @ self.weight) + self.offset


def _counted() -> Counted:
  return Counted(
    weight=jnp.linspace(-1.0, 1.0, 6).reshape(3, 2),
    count=jnp.array(3, jnp.int32),
    offset=0.5,
    activation=jnp.tanh,
  )


def test_only_inexact_arrays_are_differentiated():
  value, grads = ga_optax.microbatched_value_and_grad(_loss, 2)(
    _counted(), _batch()
  )
  expected = eqx.filter_value_and_grad(_loss)(_counted(), _batch())
  assert grads.count is None and grads.offset is None
  assert grads.activation is None
  _assert_close((value, grads), expected)


def test_plain_pytrees_keep_their_structure():
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2), "layers": [jnp.ones(2)]}

  def loss(params, batch):
    out = batch["x"] @ params["w"] + params["b"] + params["layers"][0]
    return jnp.mean((out - batch["y"]) ** 2)

  actual = ga_optax.microbatched_value_and_grad(loss, 4)(params, _batch())
  expected = jax.value_and_grad(loss)(params, _batch())
  _assert_close(actual, expected)


@pytest.mark.devices(8)
@pytest.mark.parametrize("path", ["microbatched", "unreduced"])
def test_an_equinox_model_on_eight_devices(path):
  batch = _batch(size=32)
  expected = eqx.filter_value_and_grad(_loss)(_model(), batch)
  if path == "microbatched":
    value_and_grad = ga_optax.microbatched_value_and_grad(_loss, 2)
  else:
    value_and_grad = ga_optax.unreduced_value_and_grad(_loss)

  @eqx.filter_jit
  def step(model, batch):
    value, grads = value_and_grad(model, batch)
    return value, jax.tree.map(lambda grad: jax.reshard(grad, P()), grads)

  with jax.set_mesh(jax.make_mesh((8,), ("data",))):
    sharded = jax.device_put(batch, P("data"))
    actual = step(_model(), sharded)
  _assert_close(actual, expected)


# Accumulation across calls takes eqx.filter(model, eqx.is_array).


def _windows() -> list[list[dict[str, jax.Array]]]:
  """Two windows of two micro-batches of unequal sizes."""
  data = _batch(size=40, seed=3)
  bounds = [(0, 4), (4, 16), (16, 30), (30, 40)]
  micro = [jax.tree.map(lambda x, a=a, b=b: x[a:b], data) for a, b in bounds]
  return [micro[:2], micro[2:]]


@functools.cache
def _large_batch_sgd() -> eqx.nn.MLP:
  """Plain SGD on each window's rows at once, from the same model."""
  model = _model()
  for window in _windows():
    batch = jax.tree.map(lambda *parts: jnp.concatenate(parts), *window)
    grads = eqx.filter_jit(eqx.filter_grad(_loss))(model, batch)
    model = eqx.apply_updates(
      model, jax.tree.map(lambda grad: -LEARNING_RATE * grad, grads)
    )
  return model


def _rows(microbatch) -> int:
  return microbatch["x"].shape[0]


@pytest.mark.smoke
@pytest.mark.parametrize("host_scheduled", [False, True])
@pytest.mark.parametrize("grads_from", ["filter_grad", "microbatched"])
def test_accumulate_with_a_filtered_model(grads_from, host_scheduled):
  tx = ga_optax.accumulate(optax.sgd(LEARNING_RATE), 2)
  model = _model()
  state = tx.init(eqx.filter(model, eqx.is_array))
  if grads_from == "filter_grad":
    grad_fn = eqx.filter_grad(_loss)
  else:
    value_and_grad = ga_optax.microbatched_value_and_grad(_loss, 2)

    def grad_fn(model, batch):
      return value_and_grad(model, batch)[1]

  # filter_jit keeps a Python bool static: one program per side.
  @eqx.filter_jit
  def micro_step(model, state, microbatch, closing):
    grads = grad_fn(model, microbatch)
    params = eqx.filter(model, eqx.is_array)
    updates, state = tx.update(
      grads, state, params, weight=_rows(microbatch), closing=closing
    )
    return eqx.apply_updates(model, updates), state

  for window in _windows():
    for index, microbatch in enumerate(window):
      # The host's schedule: the window's last micro-batch closes it.
      closing = index == len(window) - 1 if host_scheduled else None
      model, state = micro_step(model, state, microbatch, closing)
  assert int(ga_optax.applied_updates(state)) == 2
  _assert_close(model, _large_batch_sgd())


def test_accumulate_and_apply_with_a_partitioned_model():
  fused = ga_optax.accumulate_and_apply(optax.sgd(LEARNING_RATE), 2)
  params, static = eqx.partition(_model(), eqx.is_array)
  state = fused.init(params)

  @eqx.filter_jit
  def micro_step(params, state, microbatch):
    grads = eqx.filter_grad(_loss)(eqx.combine(params, static), microbatch)
    return fused.apply(params, grads, state, weight=_rows(microbatch))

  for window in _windows():
    for microbatch in window:
      params, state = micro_step(params, state, microbatch)
  _assert_close(eqx.combine(params, static), _large_batch_sgd())


def test_grads_that_do_not_match_the_filtered_params_are_named():
  # eqx.is_array keeps the integer counter, eqx.filter_grad gives it None.
  tx = ga_optax.accumulate(optax.sgd(LEARNING_RATE), 2)
  state = tx.init(eqx.filter(_counted(), eqx.is_array))
  grads = eqx.filter_grad(_loss)(_counted(), _batch())
  with pytest.raises(ValueError, match="tree structure"):
    tx.update(grads, state, eqx.filter(_counted(), eqx.is_array))
  # Filtered by eqx.is_inexact_array, the trees match.
  params = eqx.filter(_counted(), eqx.is_inexact_array)
  updates, _ = tx.update(grads, tx.init(params), params)
  assert jax.tree.structure(updates) == jax.tree.structure(grads)


# check_array_leaves: what init calls on the params.


def test_check_array_leaves_names_the_leaf_and_shows_the_idiom():
  with pytest.raises(TypeError) as raised:
    validation.check_array_leaves(_model(), "params")
  message = str(raised.value)
  assert "params leaf .activation" in message
  assert "eqx.filter(model, eqx.is_array)" in message
  with pytest.raises(TypeError, match=r"params leaf \['mode'\] is a str"):
    validation.check_array_leaves({"w": jnp.ones(2), "mode": "train"}, "params")


@pytest.mark.parametrize(
  "tree",
  [
    eqx.filter(_model(), eqx.is_array),
    {"w": jnp.ones(2), "n": np.float32(1.0), "scale": 0.5, "step": 3},
    {"w": jax.ShapeDtypeStruct((2,), jnp.float32), "none": None},
    {"key": jax.random.key(0), "ints": np.arange(3)},
  ],
  ids=["filtered_model", "numbers", "abstract", "keys_and_ints"],
)
def test_check_array_leaves_passes_arrays_and_numbers(tree):
  validation.check_array_leaves(tree, "params")
  jax.eval_shape(lambda tree: validation.check_array_leaves(tree, "p"), tree)


# BatchNorm state in an eqx.nn.State, merged into the large batch's.


class _Net(eqx.Module):
  linear: eqx.nn.Linear
  norm: eqx.nn.BatchNorm

  def __init__(self, key):
    self.linear = eqx.nn.Linear(3, 4, key=key)
    self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="ema", momentum=0.9)

  def __call__(self, x, state):
    hidden, state = self.norm(self.linear(x), state)
    return jnp.sum(jnp.tanh(hidden)), state


def _bn_loss(net, batch, state):
  outputs, state = jax.vmap(
    net, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
  )(batch["x"], state)
  return jnp.mean((outputs - batch["y"][:, 0]) ** 2), state


def _merge(stacked, state, norm):
  """The docs page's merge: the large batch's running statistics."""
  means, variances = stacked.get(norm.ema_state_index)
  statistics = {"mean": means, "var": variances}
  first_call = state.get(norm.ema_first_time_index)
  merged = jax.tree.map(
    lambda first, later: jnp.where(first_call, first, later),
    ga_optax.combine_batch_stats(statistics, momentum=0.0),
    ga_optax.combine_batch_stats(statistics, momentum=norm.momentum),
  )
  state = state.set(norm.ema_state_index, (merged["mean"], merged["var"]))
  return state.set(norm.ema_first_time_index, jnp.array(False))


def test_batch_norm_state_is_stacked_and_merges_into_the_large_batch():
  net, state = eqx.nn.make_with_state(_Net)(jax.random.key(2))
  value_and_grad = eqx.filter_jit(
    ga_optax.microbatched_value_and_grad(_bn_loss, 4, has_aux=True)
  )
  # Twice: the first call stores the batch's statistics, the second the
  # moving average.
  for seed in (4, 5):
    batch = _batch(size=32, seed=seed)
    (_, stacked), grads = value_and_grad(net, batch, state)
    means, _ = stacked.get(net.norm.ema_state_index)
    assert means.shape == (4, 4)
    # Each micro-batch normalised with its own statistics.
    per_micro = [
      eqx.filter_grad(_bn_loss, has_aux=True)(
        net, jax.tree.map(lambda x, i=i: x[i::4], batch), state
      )[0]
      for i in range(4)
    ]
    expected_grads = jax.tree.map(lambda *g: sum(g) / 4, *per_micro)
    _assert_close(grads, expected_grads)
    _, large_batch_state = _bn_loss(net, batch, state)
    # (State.set retires the state it is called on: merge last.)
    state = _merge(stacked, state, net.norm)
    chex.assert_trees_all_close(
      state.get(net.norm.ema_state_index),
      large_batch_state.get(net.norm.ema_state_index),
      **TOLERANCE,
    )
