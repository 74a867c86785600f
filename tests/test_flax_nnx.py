"""Flax NNX train steps: ``nnx.Optimizer`` with accumulation, and in-step
micro-batching of an NNX model, both matching large-batch training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import ga_optax

NUM_WINDOWS = 3
MICRO_BATCHES = 4
MICRO_BATCH_SIZE = 2
BATCH_SIZE = MICRO_BATCHES * MICRO_BATCH_SIZE
VOCAB = 11
SEQ_LEN = 7


class Mlp(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(5, 8, rngs=rngs)
    self.out = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))


class Cnn(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
    self.out = nnx.Linear(4 * 4 * 4, 3, rngs=rngs)

  def __call__(self, x):
    x = nnx.avg_pool(nnx.relu(self.conv(x)), (2, 2), strides=(2, 2))
    return self.out(x.reshape(x.shape[0], -1))


class TinyLm(nnx.Module):
  """One pre-norm Transformer block with causal, padding-aware attention.

  Attention has no biases: the key bias cannot change a softmax, so its
  gradient is rounding noise that Adam would scale up to full steps.
  """

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, 16, rngs=rngs)
    self.position = nnx.Param(
      0.02 * jax.random.normal(rngs.params(), (SEQ_LEN, 16))
    )
    self.norms = nnx.List([nnx.LayerNorm(16, rngs=rngs) for _ in range(3)])
    self.attention = nnx.MultiHeadAttention(
      2, 16, use_bias=False, decode=False, rngs=rngs
    )
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.down = nnx.Linear(32, 16, rngs=rngs)
    self.head = nnx.Linear(16, VOCAB, rngs=rngs)

  def __call__(self, tokens, mask):
    x = self.embed(tokens) + self.position[...]
    attention_mask = nnx.combine_masks(
      nnx.make_causal_mask(tokens), nnx.make_attention_mask(mask, mask)
    )
    x = x + self.attention(self.norms[0](x), mask=attention_mask)
    x = x + self.down(nnx.gelu(self.up(self.norms[1](x))))
    return self.head(self.norms[2](x))


def _classification_data(shape: tuple[int, ...], key: int):
  keys = jax.random.split(jax.random.PRNGKey(key), 2)
  size = NUM_WINDOWS * BATCH_SIZE
  return {
    "x": jax.random.normal(keys[0], (size, *shape)),
    "label": jax.random.randint(keys[1], (size,), 0, 3),
  }


def _lm_data():
  size = NUM_WINDOWS * BATCH_SIZE
  tokens = jax.random.randint(jax.random.PRNGKey(3), (size, SEQ_LEN), 1, VOCAB)
  lengths = 2 + np.arange(size) * 5 % (SEQ_LEN - 1)
  mask = (np.arange(SEQ_LEN)[None, :] < lengths[:, None]).astype(np.float32)
  return {"tokens": tokens * mask.astype(np.int32), "mask": jnp.asarray(mask)}


def _classification_loss(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch["label"]
  ).mean()


def _lm_loss(model, batch):
  logits = model(batch["tokens"], batch["mask"])
  per_token = optax.softmax_cross_entropy_with_integer_labels(
    logits[:, :-1], batch["tokens"][:, 1:]
  )
  target_mask = batch["mask"][:, 1:]
  return jnp.sum(per_token * target_mask) / jnp.maximum(jnp.sum(target_mask), 1)


def _lm_tokens(batch):
  return jnp.sum(batch["mask"][:, 1:])


def _samples(batch):
  return jnp.asarray(jax.tree.leaves(batch)[0].shape[0], jnp.float32)


Case = tuple[
  Callable[[], nnx.Module], Callable[..., Any], Callable[..., Any], Any
]


def _case(name: str) -> Case:
  if name == "mlp":
    data = _classification_data((5,), key=1)
    return (lambda: Mlp(nnx.Rngs(0))), _classification_loss, _samples, data
  if name == "cnn":
    data = _classification_data((8, 8, 1), key=2)
    return (lambda: Cnn(nnx.Rngs(0))), _classification_loss, _samples, data
  return (lambda: TinyLm(nnx.Rngs(0))), _lm_loss, _lm_tokens, _lm_data()


def _optimizer() -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


def _windows(data: Any) -> list[Any]:
  return [
    jax.tree.map(lambda x, w=w: x[w * BATCH_SIZE : (w + 1) * BATCH_SIZE], data)
    for w in range(NUM_WINDOWS)
  ]


def _microbatches(batch: Any) -> list[Any]:
  return [
    jax.tree.map(
      lambda x, i=i: x[i * MICRO_BATCH_SIZE : (i + 1) * MICRO_BATCH_SIZE],
      batch,
    )
    for i in range(MICRO_BATCHES)
  ]


def _train_large_batch(make_model, loss_fn, data):
  model = make_model()
  optimizer = nnx.Optimizer(model, _optimizer(), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    grads = nnx.grad(loss_fn)(model, batch)
    optimizer.update(model, grads)

  for batch in _windows(data):
    step(model, optimizer, batch)
  return model


def _train_per_call(make_model, loss_fn, weight_fn, data):
  model = make_model()
  optimizer = nnx.Optimizer(
    model, ga_optax.accumulate(_optimizer(), MICRO_BATCHES), wrt=nnx.Param
  )

  @nnx.jit
  def step(model, optimizer, microbatch):
    grads = nnx.grad(loss_fn)(model, microbatch)
    optimizer.update(model, grads, weight=weight_fn(microbatch))
    return ga_optax.emitted(optimizer.opt_state)

  emitted = []
  for batch in _windows(data):
    for microbatch in _microbatches(batch):
      emitted.append(bool(step(model, optimizer, microbatch)))
  return model, optimizer, emitted


def _train_in_step(make_model, loss_fn, weight_fn, data):
  model = make_model()
  optimizer = nnx.Optimizer(model, _optimizer(), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def params_loss(params, microbatch, rest):
      # copy=True: the merged model's Variables belong to this trace.
      return loss_fn(nnx.merge(graphdef, params, rest, copy=True), microbatch)

    value_and_grad = ga_optax.microbatched_value_and_grad(
      params_loss, MICRO_BATCHES, weight_fn=weight_fn
    )
    loss, grads = value_and_grad(params, batch, rest)
    optimizer.update(model, grads)
    return loss

  for batch in _windows(data):
    step(model, optimizer, batch)
  return model


@pytest.mark.parametrize("name", ["mlp", "cnn", "lm"])
def test_accumulation_matches_large_batch_training(name):
  make_model, loss_fn, weight_fn, data = _case(name)
  start = nnx.state(make_model(), nnx.Param)
  large = nnx.state(_train_large_batch(make_model, loss_fn, data), nnx.Param)
  per_call, optimizer, emitted = _train_per_call(
    make_model, loss_fn, weight_fn, data
  )
  in_step = _train_in_step(make_model, loss_fn, weight_fn, data)
  chex.assert_trees_all_close(nnx.state(per_call, nnx.Param), large, atol=2e-5)
  chex.assert_trees_all_close(nnx.state(in_step, nnx.Param), large, atol=2e-5)
  moved = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), large, start)
  assert max(jax.tree.leaves(moved)) > 1e-3
  # emitted and the counters read through the NNX optimizer's wrapped state;
  # the optimizer's own step counts update calls (micro-steps).
  assert emitted == ([False] * (MICRO_BATCHES - 1) + [True]) * NUM_WINDOWS
  assert int(optimizer.step[...]) == NUM_WINDOWS * MICRO_BATCHES
  assert int(ga_optax.applied_updates(optimizer.opt_state)) == NUM_WINDOWS
  assert isinstance(ga_optax.emitted(optimizer.opt_state), jax.Array)


def test_dropout_gets_a_key_per_microbatch():
  class DropoutNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.linear = nnx.Linear(4, 16, rngs=rngs)
      self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.dropout(self.linear(x)).sum(-1)

  model = DropoutNet(nnx.Rngs(params=0, dropout=1))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, microbatch, rest, *, rng):
    model = nnx.merge(graphdef, params, rest, copy=True)
    nnx.reseed(model, dropout=rng)
    outputs = model(microbatch["x"])
    return jnp.mean(outputs**2), outputs

  value_and_grad = jax.jit(
    ga_optax.microbatched_value_and_grad(loss_fn, 2, has_aux=True)
  )
  batch = {"x": jnp.ones((4, 4))}  # Identical micro-batches.
  key = jax.random.PRNGKey(42)
  (_, outputs), grads = value_and_grad(params, batch, rest, rng=key)
  assert not np.allclose(outputs[0], outputs[1])
  (_, outputs_again), grads_again = value_and_grad(params, batch, rest, rng=key)
  chex.assert_trees_all_equal((outputs, grads), (outputs_again, grads_again))
