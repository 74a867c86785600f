"""Flax Linen train steps: accumulation per call and micro-batching in-step.

For an MLP, a small CNN and a small Transformer LM on padded sequences,
several windows of gradient accumulation must end where large-batch training
ends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import chex
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state

import ga_optax


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(8)(x))
    return nn.Dense(3)(x)


class Cnn(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


class TinyLm(nn.Module):
  """One pre-norm Transformer block with causal, padding-aware attention.

  Attention has no biases: the key bias cannot change a softmax, so its
  gradient is rounding noise that Adam would scale up to full steps. Few
  parameter leaves keep compilation (and the test) fast.
  """

  @nn.compact
  def __call__(self, tokens, mask):
    norm = functools.partial(nn.LayerNorm, use_bias=False, use_scale=False)
    x = nn.Embed(helpers.VOCAB, 16)(tokens)
    x = x + self.param(
      "position", nn.initializers.normal(0.02), (helpers.SEQ_LEN, 16)
    )
    attention_mask = nn.combine_masks(
      nn.make_causal_mask(tokens), nn.make_attention_mask(mask, mask)
    )
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, use_bias=False)(
      norm()(x), mask=attention_mask
    )
    hidden = nn.gelu(nn.Dense(32, use_bias=False)(norm()(x)))
    x = x + nn.Dense(16, use_bias=False)(hidden)
    return nn.Dense(helpers.VOCAB)(norm()(x))


def _classification_loss(model: nn.Module):
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["label"]
    ).mean()

  return loss_fn


def _lm_loss(model: nn.Module):
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["tokens"], batch["mask"])
    per_token = optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], batch["tokens"][:, 1:]
    )
    target_mask = batch["mask"][:, 1:]
    # Normalised by this batch's own real tokens: the large-batch loss.
    return jnp.sum(per_token * target_mask) / jnp.maximum(
      jnp.sum(target_mask), 1.0
    )

  return loss_fn


Case = tuple[nn.Module, Callable[..., Any], Callable[..., Any], Any, Any]


def _case(name: str) -> Case:
  if name == "mlp":
    model: nn.Module = Mlp()
    data = helpers.classification_data((5,), key=1)
    return (
      model,
      _classification_loss(model),
      helpers.samples,
      data,
      data["x"][:1],
    )
  if name == "cnn":
    model = Cnn()
    data = helpers.classification_data((8, 8, 1), key=2)
    return (
      model,
      _classification_loss(model),
      helpers.samples,
      data,
      data["x"][:1],
    )
  model = TinyLm()
  data = helpers.lm_data()
  example = (data["tokens"][:1], data["mask"][:1])
  return model, _lm_loss(model), helpers.lm_tokens, data, example


def _init(model: nn.Module, example: Any) -> Any:
  example = example if isinstance(example, tuple) else (example,)
  return jax.jit(model.init)(jax.random.PRNGKey(0), *example)["params"]


def _fresh(params: Any) -> Any:
  # The train steps donate their state: each run needs its own copy.
  return jax.tree.map(jnp.copy, params)


def _train_large_batch(loss_fn, params, data):
  state = train_state.TrainState.create(
    apply_fn=None, params=_fresh(params), tx=helpers.flax_optimizer()
  )

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, batch):
    grads = jax.grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads)

  for batch in helpers.flax_windows(data):
    state = step(state, batch)
  return state


def _train_per_call(loss_fn, weight_fn, params, data):
  state = train_state.TrainState.create(
    apply_fn=None,
    params=_fresh(params),
    tx=ga_optax.accumulate(helpers.flax_optimizer(), helpers.MICRO_BATCHES),
  )

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, microbatch):
    grads = jax.grad(loss_fn)(state.params, microbatch)
    return ga_optax.apply_gradients(state, grads, weight=weight_fn(microbatch))

  for batch in helpers.flax_windows(data):
    for microbatch in helpers.flax_microbatches(batch):
      state = step(state, microbatch)
  return state


def _train_host_scheduled(loss_fn, weight_fn, params, data):
  """The loop says which micro-batch closes each window (``closing=``)."""
  state = train_state.TrainState.create(
    apply_fn=None,
    params=_fresh(params),
    tx=ga_optax.accumulate(helpers.flax_optimizer(), helpers.MICRO_BATCHES),
  )

  @functools.partial(jax.jit, donate_argnums=0, static_argnames="closing")
  def step(state, microbatch, closing):
    grads = jax.grad(loss_fn)(state.params, microbatch)
    return ga_optax.apply_gradients(
      state, grads, weight=weight_fn(microbatch), closing=closing
    )

  for batch in helpers.flax_windows(data):
    microbatches = list(helpers.flax_microbatches(batch))
    for index, microbatch in enumerate(microbatches):
      state = step(state, microbatch, closing=index == len(microbatches) - 1)
  return state


def _train_in_step(loss_fn, weight_fn, params, data):
  state = train_state.TrainState.create(
    apply_fn=None, params=_fresh(params), tx=helpers.flax_optimizer()
  )
  value_and_grad = ga_optax.microbatched_value_and_grad(
    loss_fn, helpers.MICRO_BATCHES, weight_fn=weight_fn
  )

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, batch):
    _, grads = value_and_grad(state.params, batch)
    return state.apply_gradients(grads=grads)

  for batch in helpers.flax_windows(data):
    state = step(state, batch)
  return state


@pytest.mark.parametrize(
  "name", [pytest.param("mlp", marks=pytest.mark.smoke), "cnn", "lm"]
)
def test_accumulation_matches_large_batch_training(name):
  model, loss_fn, weight_fn, data, example = _case(name)
  params = _init(model, example)
  large = _train_large_batch(loss_fn, params, data)
  per_call = _train_per_call(loss_fn, weight_fn, params, data)
  in_step = _train_in_step(loss_fn, weight_fn, params, data)
  host = _train_host_scheduled(loss_fn, weight_fn, params, data)
  chex.assert_tree_all_finite(large.params)
  chex.assert_trees_all_close(per_call.params, large.params, atol=2e-5)
  chex.assert_trees_all_close(host.params, large.params, atol=2e-5)
  chex.assert_trees_all_close(in_step.params, large.params, atol=2e-5)
  # The runs must have moved: equal parameters are not trivially the start.
  moved = jax.tree.map(
    lambda a, b: jnp.max(jnp.abs(a - b)), large.params, params
  )
  assert max(jax.tree.leaves(moved)) > 1e-3


def test_step_counts_calls_and_applied_updates_count_windows():
  model, loss_fn, weight_fn, data, example = _case("mlp")
  state = _train_per_call(loss_fn, weight_fn, _init(model, example), data)
  assert int(state.step) == helpers.NUM_WINDOWS * helpers.MICRO_BATCHES
  assert int(ga_optax.applied_updates(state)) == helpers.NUM_WINDOWS
  assert int(ga_optax.applied_updates(state.opt_state)) == helpers.NUM_WINDOWS
  assert bool(ga_optax.emitted(state.opt_state))


def test_apply_gradients_flush_closes_a_partial_window():
  model, loss_fn, _, data, example = _case("mlp")
  params = _init(model, example)
  state = train_state.TrainState.create(
    apply_fn=None,
    params=_fresh(params),
    tx=ga_optax.accumulate(optax.sgd(0.1), helpers.MICRO_BATCHES),
  )

  @jax.jit
  def step(state, microbatch, flush):
    grads = jax.grad(loss_fn)(state.params, microbatch)
    return ga_optax.apply_gradients(state, grads, flush=flush)

  microbatches = helpers.flax_microbatches(helpers.flax_windows(data)[0])[:2]
  for index, microbatch in enumerate(microbatches):
    state = step(state, microbatch, jnp.asarray(index == 1))
  partial_batch = jax.tree.map(lambda *x: jnp.concatenate(x), *microbatches)
  expected = jax.tree.map(
    lambda p, g: p - 0.1 * g, params, jax.grad(loss_fn)(params, partial_batch)
  )
  chex.assert_trees_all_close(state.params, expected, atol=1e-6)
  assert int(ga_optax.applied_updates(state)) == 1


def test_apply_gradients_rejects_a_state_without_fields():
  with pytest.raises(TypeError, match="TrainState"):
    ga_optax.apply_gradients({"params": {}}, {})


def test_dropout_keys_differ_per_microbatch_and_reproduce():
  class DropoutNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
      x = nn.Dense(16)(x)
      return nn.Dropout(0.5, deterministic=not train)(x).sum(-1)

  model = DropoutNet()
  params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 4)), train=False)[
    "params"
  ]

  def loss_fn(params, batch, *, rng):
    outputs = model.apply(
      {"params": params}, batch["x"], train=True, rngs={"dropout": rng}
    )
    return jnp.mean(outputs**2), outputs

  value_and_grad = jax.jit(
    ga_optax.microbatched_value_and_grad(loss_fn, 2, has_aux=True)
  )
  batch = {"x": jnp.ones((4, 4))}  # Identical micro-batches.
  key = jax.random.PRNGKey(42)
  (_, outputs), grads = value_and_grad(params, batch, rng=key)
  assert not np.allclose(outputs[0], outputs[1])
  (_, outputs_again), grads_again = value_and_grad(params, batch, rng=key)
  chex.assert_trees_all_equal((outputs, grads), (outputs_again, grads_again))
