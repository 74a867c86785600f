"""BatchNorm in the micro-batched path: running statistics once per batch."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import ga_optax

BATCH = 16


class LinenNet(nn.Module):
  momentum: float

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(6)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=self.momentum)(x)
    x = nn.relu(x)
    x = nn.Dense(4)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=self.momentum)(x)
    return nn.Dense(1)(x)[:, 0]


def _data():
  keys = jax.random.split(jax.random.PRNGKey(0), 2)
  # Micro-batches of different locations, so the between-micro-batch term
  # of the variance matters.
  shift = jnp.repeat(jnp.arange(4.0), BATCH // 4)[:, None]
  x = jax.random.normal(keys[0], (BATCH, 3)) + shift
  return {"x": x, "y": jax.random.normal(keys[1], (BATCH,))}


def _linen_setup(momentum: float):
  model = LinenNet(momentum)
  variables = model.init(jax.random.PRNGKey(1), _data()["x"], train=False)
  # Start from running statistics that are not the initial ones.
  batch_stats = jax.tree.map(
    lambda s: s + 0.5 * jnp.arange(s.shape[-1]), variables["batch_stats"]
  )
  return model, variables["params"], batch_stats


def _linen_loss(model):
  def loss_fn(params, batch, batch_stats):
    predictions, updates = model.apply(
      {"params": params, "batch_stats": batch_stats},
      batch["x"],
      train=True,
      mutable=["batch_stats"],
    )
    loss = jnp.mean((predictions - batch["y"]) ** 2)
    return loss, updates["batch_stats"]

  return loss_fn


@pytest.mark.parametrize("momentum", [0.9, 0.99])
@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_linen_running_stats_match_one_large_batch(momentum, num_microbatches):
  model, params, batch_stats = _linen_setup(momentum)
  loss_fn = _linen_loss(model)
  data = _data()
  (_, stacked), _ = jax.jit(
    ga_optax.microbatched_value_and_grad(
      loss_fn, num_microbatches, has_aux=True
    )
  )(params, data, batch_stats)
  merged = ga_optax.combine_batch_stats(stacked, momentum)
  # The first layer sees the same inputs either way, so its statistics must
  # match one large batch. Deeper layers see inputs normalised per
  # micro-batch, which no merge can undo (docs/not-equivalent.md).
  (_, large_batch_stats) = loss_fn(params, data, batch_stats)
  first = "BatchNorm_0"
  chex.assert_trees_all_close(
    merged[first], large_batch_stats[first], rtol=1e-5, atol=1e-6
  )
  chex.assert_trees_all_equal_shapes_and_dtypes(merged, batch_stats)


def test_averaging_variances_alone_misses_the_between_term():
  model, params, batch_stats = _linen_setup(0.9)
  loss_fn = _linen_loss(model)
  data = _data()
  (_, stacked), _ = ga_optax.microbatched_value_and_grad(
    loss_fn, 4, has_aux=True
  )(params, data, batch_stats)
  naive_var = jnp.mean(stacked["BatchNorm_0"]["var"], axis=0)
  large_batch_var = loss_fn(params, data, batch_stats)[1]["BatchNorm_0"]["var"]
  assert not np.allclose(naive_var, large_batch_var, rtol=1e-3)


def test_one_microbatch_is_the_large_batch_update():
  model, params, batch_stats = _linen_setup(0.9)
  loss_fn = _linen_loss(model)
  (_, stacked), grads = ga_optax.microbatched_value_and_grad(
    loss_fn, 1, has_aux=True
  )(params, _data(), batch_stats)
  expected_stats = loss_fn(params, _data(), batch_stats)[1]
  chex.assert_trees_all_close(
    ga_optax.combine_batch_stats(stacked, 0.9), expected_stats, rtol=1e-6
  )
  chex.assert_trees_all_close(
    grads,
    jax.grad(lambda p: loss_fn(p, _data(), batch_stats)[0])(params),
    rtol=1e-5,
    atol=1e-6,
  )


def test_gradients_use_per_microbatch_statistics():
  # Documented non-equivalence: each micro-batch normalises with its own
  # statistics, so the gradient is not the large batch's.
  model, params, batch_stats = _linen_setup(0.9)
  loss_fn = _linen_loss(model)
  _, grads = ga_optax.microbatched_value_and_grad(loss_fn, 4, has_aux=True)(
    params, _data(), batch_stats
  )
  large = jax.grad(lambda p: loss_fn(p, _data(), batch_stats)[0])(params)
  kernel = ("Dense_0", "kernel")
  assert not np.allclose(
    grads[kernel[0]][kernel[1]], large[kernel[0]][kernel[1]], rtol=1e-3
  )


class NnxNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(3, 5, rngs=rngs)
    self.norm = nnx.BatchNorm(5, momentum=0.9, rngs=rngs)
    self.head = nnx.Linear(5, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.norm(self.linear(x))))[:, 0]


def test_nnx_running_stats_match_one_large_batch():
  model = NnxNet(nnx.Rngs(0))
  model.train()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  data = _data()

  def loss_fn(params, batch, rest):
    model = nnx.merge(graphdef, params, rest, copy=True)
    loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    return loss, nnx.state(model, nnx.BatchStat)

  (_, stacked), _ = jax.jit(
    ga_optax.microbatched_value_and_grad(loss_fn, 4, has_aux=True)
  )(params, data, rest)
  merged = ga_optax.combine_batch_stats(stacked, momentum=0.9)
  _, expected = loss_fn(params, data, rest)
  chex.assert_trees_all_close(
    jax.tree.leaves(merged), jax.tree.leaves(expected), rtol=1e-5, atol=1e-6
  )
  nnx.update(model, merged)
  chex.assert_trees_all_close(
    model.norm.var[...], expected["norm"]["var"][...], rtol=1e-5
  )


@pytest.mark.parametrize(
  ("momentum", "error"),
  [(1.0, ValueError), (-0.1, ValueError), ("0.9", TypeError)],
)
def test_bad_momentum_is_named(momentum, error):
  stacked = {"mean": jnp.zeros((2, 3)), "var": jnp.ones((2, 3))}
  with pytest.raises(error, match="momentum"):
    ga_optax.combine_batch_stats(stacked, momentum)


@pytest.mark.parametrize(
  "stacked",
  [
    {"mean": jnp.zeros((2, 3)), "scale": jnp.ones((2, 3))},
    {"var": jnp.ones((2, 3))},
    {"mean": jnp.zeros((2, 3)), "var": jnp.ones((2, 4))},
    {"mean": jnp.zeros(()), "var": jnp.ones(())},
  ],
)
def test_bad_stats_are_named(stacked):
  with pytest.raises(ValueError, match="stacked_stats"):
    ga_optax.combine_batch_stats(stacked, 0.9)
