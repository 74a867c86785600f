"""Regression tests for defects found by using ga_optax as a new user would.

Each test reproduces one defect of 0.1.0 in a few lines, the way it was met:

* ``microbatched_value_and_grad(axis_name=...)`` inside ``jax.shard_map``
  with its default ``check_vma=True`` failed: the scan's carry started
  invariant and came back varying over the axis;
* a ``weight_fn`` returning a boolean was accepted silently, and a negative
  weight gave a plausible wrong number (the micro-batch dropped from the
  sums but kept in the weight sum);
* complex params: ``accumulate`` built a float32 accumulator and then
  refused the complex gradients, and ``microbatched_value_and_grad``
  dropped their imaginary part.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax

NUM_MICROBATCHES = 4
BATCH_SIZE = 16


def _assert_close(actual: Any, expected: Any) -> None:
  """Equal trees, shapes and dtypes, finite values within float32 rounding.

  chex compares NaN equal to NaN; finiteness is asserted first so that two
  NaN results never pass as equal.
  """
  chex.assert_trees_all_equal_shapes_and_dtypes(actual, expected)
  chex.assert_tree_all_finite(actual)
  chex.assert_tree_all_finite(expected)
  chex.assert_trees_all_close(actual, expected, rtol=1e-5, atol=1e-6)


def _real(shape: tuple[int, ...], seed: int) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def _mean_loss(params, batch):
  prediction = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((prediction - batch["y"]) ** 2)


def _params() -> dict[str, jax.Array]:
  return {"w": _real((3, 2), seed=0), "b": _real((2,), seed=1)}


def _batch(seed: int = 2) -> dict[str, jax.Array]:
  return {
    "x": _real((BATCH_SIZE, 3), seed),
    "y": _real((BATCH_SIZE, 2), seed + 1),
  }


# shard_map with check_vma=True, on a mesh of this machine's one device.


def _mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((1,), ("data",))


def _put(tree: Any, mesh: jax.sharding.Mesh, spec: P) -> Any:
  # jax.make_mesh makes Explicit axes: shard_map's inputs must already be
  # laid out as its in_specs say.
  return jax.device_put(tree, NamedSharding(mesh, spec))


@pytest.mark.parametrize("check_vma", [True, False])
def test_microbatched_axis_name_inside_shard_map(check_vma):
  mesh = _mesh()
  params, batch = _put(_params(), mesh, P()), _put(_batch(), mesh, P("data"))
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _mean_loss, NUM_MICROBATCHES, axis_name="data"
  )
  sharded = jax.jit(
    jax.shard_map(
      value_and_grad,
      mesh=mesh,
      in_specs=(P(), P("data")),
      out_specs=(P(), P()),
      check_vma=check_vma,
    )
  )
  expected = jax.value_and_grad(_mean_loss)(_params(), _batch())
  _assert_close(sharded(params, batch), expected)
  without_shard_map = ga_optax.microbatched_value_and_grad(
    _mean_loss, NUM_MICROBATCHES
  )(_params(), _batch())
  _assert_close(sharded(params, batch), without_shard_map)


# Windows of micro-batches of unequal size (weight = rows), the second closed
# by a flush: a wrong gradient scale moves plain SGD somewhere else.
_WINDOW_ROWS = ((8, 16), (24,), (16, 8))


@pytest.mark.parametrize("num_devices", [1, 8])
def test_accumulate_axis_name_inside_shard_map_with_check_vma(num_devices):
  # With check_vma=True the gradients of unvarying params arrive summed over
  # the devices by autodiff; the window must sum only the weights.
  mesh = jax.make_mesh(
    (num_devices,), ("data",), devices=jax.devices()[:num_devices]
  )
  optimizer = optax.sgd(0.5)
  tx = ga_optax.accumulate(optimizer, 2, axis_name="data")

  def step(params, state, x, y, flush):
    grads = jax.grad(_mean_loss)(params, {"x": x, "y": y})
    # Each device's rows: the same number on every device.
    updates, state = tx.update(
      grads, state, params, weight=x.shape[0], flush=flush
    )
    return optax.apply_updates(params, updates), state

  sharded_step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P("data"), P()),
      out_specs=(P(), P()),
      check_vma=True,
    )
  )
  params = _put(_params(), mesh, P())
  state = _put(tx.init(_params()), mesh, P())
  expected, expected_state = _params(), optimizer.init(_params())
  rng = np.random.default_rng(7)
  for window in _WINDOW_ROWS:
    batches = [
      {
        "x": jnp.asarray(rng.standard_normal((rows, 3)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((rows, 2)), jnp.float32),
      }
      for rows in window
    ]
    for index, batch in enumerate(batches):
      closes = index == len(window) - 1
      params, state = sharded_step(
        params,
        state,
        *_put((batch["x"], batch["y"]), mesh, P("data")),
        jnp.bool_(closes and len(window) < 2),
      )
      assert bool(ga_optax.emitted(state)) == closes
    # The reference: the gradient of the window's mean loss, bare SGD.
    whole = jax.tree.map(lambda *rows: jnp.concatenate(rows), *batches)
    updates, expected_state = optimizer.update(
      jax.grad(_mean_loss)(expected, whole), expected_state
    )
    expected = optax.apply_updates(expected, updates)
  _assert_close(params, expected)
  assert int(ga_optax.applied_updates(state)) == len(_WINDOW_ROWS)


def test_explicitly_sharded_batch_without_set_mesh():
  mesh = _mesh()
  batch = _put(_batch(), mesh, P("data"))
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _elementwise_loss, NUM_MICROBATCHES
  )
  params = _params()["b"]
  try:
    result = value_and_grad(params, batch)
  except ValueError as error:
    # Refusing is fine too, if the message says what to do.
    assert "set_mesh" in str(error)
  else:
    _assert_close(result, jax.value_and_grad(_elementwise_loss)(params, batch))


def _elementwise_loss(scale, batch):
  # No contraction over the sharded batch axis in the forward or backward
  # pass, so that plain JAX differentiates it on an Explicit mesh unset.
  return jnp.mean((batch["y"] * scale - batch["x"][:, :2]) ** 2)


# Weights from weight_fn.


def _weighted_batch(weights: list[Any]) -> dict[str, jax.Array]:
  """A batch whose micro-batch ``i`` carries weight ``weights[i]``.

  Micro-batch ``i`` holds rows ``i, i + k, ...``, so row ``r`` gets the
  weight of micro-batch ``r % k``.
  """
  rows = BATCH_SIZE // NUM_MICROBATCHES
  batch = _batch()
  batch["weight"] = jnp.asarray(np.tile(np.asarray(weights), rows))
  return batch


def _first_row_weight(microbatch):
  return microbatch["weight"][0]


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
def test_weight_fn_returning_a_bool_is_a_type_error(use_jit):
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _mean_loss, NUM_MICROBATCHES, weight_fn=_first_row_weight
  )
  if use_jit:
    value_and_grad = jax.jit(value_and_grad)
  batch = _weighted_batch([True, False, True, True])
  with pytest.raises(TypeError, match="weight_fn must return a real number"):
    # eval_shape traces without running: the error comes at trace time.
    jax.eval_shape(value_and_grad, _params(), batch)
  with pytest.raises(TypeError, match="weight_fn must return a real number"):
    value_and_grad(_params(), batch)


def test_nonnegative_weights_still_give_the_weighted_mean():
  # A weight of 0 drops its micro-batch and no more (negative weights:
  # tests/test_weights.py, one rule for both paths).
  weights = [3.0, 0.0, 2.0, 1.0]
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _mean_loss, NUM_MICROBATCHES, weight_fn=_first_row_weight
  )
  batch = _weighted_batch(weights)
  per_microbatch = [
    jax.value_and_grad(_mean_loss)(
      _params(), jax.tree.map(lambda x, i=i: x[i::NUM_MICROBATCHES], batch)
    )
    for i in range(NUM_MICROBATCHES)
  ]
  expected = jax.tree.map(
    lambda *terms: (
      sum(w * t for w, t in zip(weights, terms, strict=True)) / sum(weights)
    ),
    *per_microbatch,
  )
  _assert_close(value_and_grad(_params(), batch), expected)


# Complex parameters.


def _complex(shape: tuple[int, ...], seed: int) -> jax.Array:
  rng = np.random.default_rng(seed)
  return jnp.asarray(
    rng.standard_normal(shape) + 1j * rng.standard_normal(shape), jnp.complex64
  )


def _complex_loss(w, batch):
  return jnp.mean(jnp.abs(batch["x"] @ w - batch["y"]) ** 2)


def _complex_batch(seed: int) -> dict[str, jax.Array]:
  return {"x": _complex((4, 3), seed), "y": _complex((4, 2), seed + 1)}


@pytest.mark.parametrize("path", ["accumulate", "accumulate_and_apply"])
def test_complex_params_accumulate_like_adam_on_the_window_mean(path):
  every_k, num_windows = 2, 2
  inner = optax.adam(0.1)
  if path == "accumulate":
    tx = ga_optax.accumulate(inner, every_k)
    init = tx.init

    def step(params, state, batch):
      grads = jax.grad(_complex_loss)(params, batch)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
  else:
    fused = ga_optax.accumulate_and_apply(inner, every_k)
    init = fused.init

    def step(params, state, batch):
      grads = jax.grad(_complex_loss)(params, batch)
      return fused.apply(params, grads, state)

  step = jax.jit(step)
  params = expected = _complex((3, 2), seed=0)
  state, expected_state = init(params), inner.init(expected)
  assert state.accumulator.dtype == jnp.complex64
  for window in range(num_windows):
    batches = [_complex_batch(100 * window + 2 * i) for i in range(every_k)]
    for batch in batches:
      params, state = step(params, state, batch)
    mean_grads = sum(
      jax.grad(_complex_loss)(expected, batch) for batch in batches
    ) / len(batches)
    updates, expected_state = inner.update(mean_grads, expected_state, expected)
    expected = optax.apply_updates(expected, updates)
    _assert_close(params, expected)
  # The imaginary parts moved too: they were not dropped along the way.
  assert float(jnp.max(jnp.abs(params.imag - _complex((3, 2), 0).imag))) > 0.1


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
def test_complex_params_microbatched_equal_value_and_grad(use_jit):
  params = _complex((3, 2), seed=0)
  batch = {"x": _complex((BATCH_SIZE, 3), 1), "y": _complex((BATCH_SIZE, 2), 2)}
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _complex_loss, NUM_MICROBATCHES
  )
  if use_jit:
    value_and_grad = jax.jit(value_and_grad)
  value, grads = value_and_grad(params, batch)
  expected_value, expected_grads = jax.value_and_grad(_complex_loss)(
    params, batch
  )
  assert grads.dtype == jnp.complex64
  assert float(jnp.max(jnp.abs(expected_grads.imag))) > 0.1
  _assert_close(grads, expected_grads)
  _assert_close(value, expected_value)


@pytest.mark.parametrize(
  "combine", [ga_optax.consolidate, ga_optax.split_total]
)
def test_partial_sum_helpers_refuse_a_shard_map_that_checks_variance(combine):
  # With check_vma=True the window holds gradients already summed over the
  # devices: combining them as partial sums would scale them wrongly.
  tx = ga_optax.accumulate(optax.sgd(0.1), 2, axis_name="data")
  params = jnp.zeros(3)

  def step(state):
    return combine(state, axis_name="data")

  mapped = jax.shard_map(step, mesh=_mesh(), in_specs=P(), out_specs=P())
  with pytest.raises(ValueError, match="check_vma=False"):
    jax.jit(mapped)(tx.init(params))
