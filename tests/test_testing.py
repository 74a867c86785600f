"""The public equivalence helpers of ga_optax.testing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ga_optax import testing


def loss_fn(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


PARAMS = {"w": jnp.zeros(3), "b": jnp.zeros(())}
BATCHES = [
  {"x": jax.random.normal(key, (12, 3)), "y": jnp.arange(12.0) / 12}
  for key in jax.random.split(jax.random.key(0), 3)
]


def test_max_relative_difference_is_per_leaf_and_relative():
  expected = {"a": jnp.array([100.0, 0.0]), "b": jnp.array([1.0])}
  actual = {"a": jnp.array([101.0, 0.0]), "b": jnp.array([1.02])}
  assert testing.max_relative_difference(actual, expected) == pytest.approx(
    0.02
  )
  assert testing.max_relative_difference(expected, expected) == 0.0


def test_max_relative_difference_rejects_other_trees():
  with pytest.raises(ValueError, match="same tree structure"):
    testing.max_relative_difference({"a": jnp.ones(1)}, [jnp.ones(1)])


@pytest.mark.parametrize("use_jit", [True, False])
def test_compare_returns_both_runs(use_jit):
  result = testing.compare_with_large_batch(
    loss_fn, optax.sgd(0.1), PARAMS, BATCHES, 3, use_jit=use_jit
  )
  assert result.max_relative_difference < 1e-6
  # The large-batch run is what three plain SGD steps give.
  params = PARAMS
  for batch in BATCHES:
    grads = jax.grad(loss_fn)(params, batch)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  for name in params:
    np.testing.assert_allclose(
      result.large_batch_params[name], params[name], rtol=1e-6
    )


def test_assert_raises_when_the_runs_differ():
  # Equal weights for micro-batches of 1 and 11 samples are not the large
  # batch's mean.
  with pytest.raises(AssertionError, match="max relative difference"):
    testing.assert_equivalent_to_large_batch(
      loss_fn, optax.sgd(0.1), PARAMS, BATCHES, [1, 11], weight_fn=lambda b: 1
    )


def test_sum_reduction_uses_unit_weights():
  def sum_loss(params, batch):
    return jnp.sum((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

  testing.assert_equivalent_to_large_batch(
    sum_loss, optax.sgd(0.01), PARAMS, BATCHES, [5, 7], reduction="sum"
  )


@pytest.mark.parametrize("sizes", [5, 0, [4, 4], [6, 0, 6], [13, -1]])
def test_bad_microbatch_sizes(sizes):
  with pytest.raises(ValueError, match="microbatch_sizes"):
    testing.compare_with_large_batch(
      loss_fn, optax.sgd(0.1), PARAMS, BATCHES, sizes
    )


def test_no_batches():
  with pytest.raises(ValueError, match="batches must hold at least one"):
    testing.compare_with_large_batch(loss_fn, optax.sgd(0.1), PARAMS, [], 2)


def test_batches_with_unequal_leading_sizes():
  batch = {"x": jnp.ones((4, 3)), "y": jnp.ones(5)}
  with pytest.raises(ValueError, match="share one leading"):
    testing.compare_with_large_batch(
      loss_fn, optax.sgd(0.1), PARAMS, [batch], 2
    )
