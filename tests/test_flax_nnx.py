"""Flax NNX train steps: ``nnx.Optimizer`` with accumulation, and in-step
micro-batching of an NNX model, both matching large-batch training."""

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
from flax import nnx

import ga_optax


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
  gradient is rounding noise that Adam would scale up to full steps. Few
  parameter leaves keep compilation (and the test) fast.
  """

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(helpers.VOCAB, 16, rngs=rngs)
    self.position = nnx.Param(
      0.02 * jax.random.normal(rngs.params(), (helpers.SEQ_LEN, 16))
    )
    self.norm = nnx.LayerNorm(16, use_bias=False, use_scale=False, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
      2, 16, use_bias=False, decode=False, rngs=rngs
    )
    self.up = nnx.Linear(16, 32, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(32, 16, use_bias=False, rngs=rngs)
    self.head = nnx.Linear(16, helpers.VOCAB, rngs=rngs)

  def __call__(self, tokens, mask):
    x = self.embed(tokens) + self.position[...]
    attention_mask = nnx.combine_masks(
      nnx.make_causal_mask(tokens), nnx.make_attention_mask(mask, mask)
    )
    x = x + self.attention(self.norm(x), mask=attention_mask)
    x = x + self.down(nnx.gelu(self.up(self.norm(x))))
    return self.head(self.norm(x))


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


Case = tuple[
  Callable[[], nnx.Module], Callable[..., Any], Callable[..., Any], Any
]


def _case(name: str) -> Case:
  if name == "mlp":
    data = helpers.classification_data((5,), key=1)
    return (
      (lambda: Mlp(nnx.Rngs(0))),
      _classification_loss,
      helpers.samples,
      data,
    )
  if name == "cnn":
    data = helpers.classification_data((8, 8, 1), key=2)
    return (
      (lambda: Cnn(nnx.Rngs(0))),
      _classification_loss,
      helpers.samples,
      data,
    )
  return (
    (lambda: TinyLm(nnx.Rngs(0))),
    _lm_loss,
    helpers.lm_tokens,
    helpers.lm_data(),
  )


def _train_large_batch(make_model, loss_fn, data):
  model = make_model()
  optimizer = nnx.Optimizer(model, helpers.flax_optimizer(), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    grads = nnx.grad(loss_fn)(model, batch)
    optimizer.update(model, grads)

  for batch in helpers.flax_windows(data):
    step(model, optimizer, batch)
  return model


def _train_per_call(make_model, loss_fn, weight_fn, data):
  model = make_model()
  optimizer = nnx.Optimizer(
    model,
    ga_optax.accumulate(helpers.flax_optimizer(), helpers.MICRO_BATCHES),
    wrt=nnx.Param,
  )

  @nnx.jit
  def step(model, optimizer, microbatch):
    grads = nnx.grad(loss_fn)(model, microbatch)
    optimizer.update(model, grads, weight=weight_fn(microbatch))
    return ga_optax.emitted(optimizer.opt_state)

  emitted = []
  for batch in helpers.flax_windows(data):
    for microbatch in helpers.flax_microbatches(batch):
      emitted.append(bool(step(model, optimizer, microbatch)))
  return model, optimizer, emitted


def _train_host_scheduled(make_model, loss_fn, weight_fn, data):
  """The loop says which micro-batch closes each window (``closing=``)."""
  model = make_model()
  optimizer = nnx.Optimizer(
    model,
    ga_optax.accumulate(helpers.flax_optimizer(), helpers.MICRO_BATCHES),
    wrt=nnx.Param,
  )

  @functools.partial(nnx.jit, static_argnames="closing")
  def step(model, optimizer, microbatch, closing):
    grads = nnx.grad(loss_fn)(model, microbatch)
    optimizer.update(
      model, grads, weight=weight_fn(microbatch), closing=closing
    )

  for batch in helpers.flax_windows(data):
    microbatches = list(helpers.flax_microbatches(batch))
    for index, microbatch in enumerate(microbatches):
      step(model, optimizer, microbatch, index == len(microbatches) - 1)
  return model


def _train_in_step(make_model, loss_fn, weight_fn, data):
  model = make_model()
  optimizer = nnx.Optimizer(model, helpers.flax_optimizer(), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def params_loss(params, microbatch, rest):
      # copy=True: the merged model's Variables belong to this trace.
      return loss_fn(nnx.merge(graphdef, params, rest, copy=True), microbatch)

    value_and_grad = ga_optax.microbatched_value_and_grad(
      params_loss, helpers.MICRO_BATCHES, weight_fn=weight_fn
    )
    loss, grads = value_and_grad(params, batch, rest)
    optimizer.update(model, grads)
    return loss

  for batch in helpers.flax_windows(data):
    step(model, optimizer, batch)
  return model


@pytest.mark.parametrize(
  "name", [pytest.param("mlp", marks=pytest.mark.smoke), "cnn", "lm"]
)
def test_accumulation_matches_large_batch_training(name):
  make_model, loss_fn, weight_fn, data = _case(name)
  start = nnx.state(make_model(), nnx.Param)
  large = nnx.state(_train_large_batch(make_model, loss_fn, data), nnx.Param)
  per_call, optimizer, emitted = _train_per_call(
    make_model, loss_fn, weight_fn, data
  )
  in_step = _train_in_step(make_model, loss_fn, weight_fn, data)
  host = _train_host_scheduled(make_model, loss_fn, weight_fn, data)
  chex.assert_tree_all_finite(large)
  chex.assert_trees_all_close(nnx.state(per_call, nnx.Param), large, atol=2e-5)
  chex.assert_trees_all_close(nnx.state(host, nnx.Param), large, atol=2e-5)
  chex.assert_trees_all_close(nnx.state(in_step, nnx.Param), large, atol=2e-5)
  moved = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), large, start)
  assert max(jax.tree.leaves(moved)) > 1e-3
  # emitted and the counters read through the NNX optimizer's wrapped state;
  # the optimizer's own step counts update calls (micro-steps).
  assert (
    emitted
    == ([False] * (helpers.MICRO_BATCHES - 1) + [True]) * helpers.NUM_WINDOWS
  )
  assert int(optimizer.step[...]) == helpers.NUM_WINDOWS * helpers.MICRO_BATCHES
  assert (
    int(ga_optax.applied_updates(optimizer.opt_state)) == helpers.NUM_WINDOWS
  )
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


def _square_norm(tree: Any) -> float:
  return float(sum(np.sum(np.square(leaf)) for leaf in jax.tree.leaves(tree)))


def test_readers_return_plain_arrays_from_an_nnx_optimizer():
  # NNX wraps every optimizer-state leaf in a Variable; a reader that hands
  # one back breaks f"{value:d}" and anything else expecting an array.
  every_k = 2
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model,
    ga_optax.accumulate(
      optax.sgd(0.1), every_k, skip_nonfinite=True, noise_scale_decay=0.0
    ),
    wrt=nnx.Param,
  )

  def loss_fn(model, x):
    return jnp.mean(model(x) ** 2)

  rng = np.random.default_rng(0)
  last_window = []
  # Two windows, with a non-finite micro-step between them that is dropped.
  for call in range(5):
    grads = nnx.grad(loss_fn)(model, jnp.asarray(rng.normal(size=(4, 3))))
    if call == 2:
      grads = jax.tree.map(lambda grad: grad * jnp.nan, grads)
    elif call > 2:
      last_window.append(jax.tree.map(np.asarray, nnx.to_pure_dict(grads)))
    optimizer.update(model, grads)

  estimate = ga_optax.noise_scale(optimizer.opt_state)
  readings = {
    "applied_updates": ga_optax.applied_updates(optimizer.opt_state),
    "emitted": ga_optax.emitted(optimizer.opt_state),
    "num_skipped": ga_optax.num_skipped(optimizer.opt_state),
    **{
      f"noise_scale.{name}": value for name, value in estimate._asdict().items()
    },
  }
  for name, value in readings.items():
    assert isinstance(value, jax.Array), (name, type(value))
    assert not isinstance(value, nnx.Variable), (name, type(value))
    assert np.isfinite(value), name
  assert f"{readings['applied_updates']:d}" == "2"
  assert f"{readings['num_skipped']:d}" == "1"
  assert f"{estimate.windows:d}" == "2"
  assert bool(readings["emitted"])

  # With decay 0 the reading is the last window's estimate (unit weights):
  # trace_sigma = (sum |g_i|^2 - K |G|^2) / (K - 1), grad_sq = |G|^2 - it / K.
  mean = jax.tree.map(lambda *grads: sum(grads) / every_k, *last_window)
  trace_sigma = (
    sum(_square_norm(grads) for grads in last_window)
    - every_k * _square_norm(mean)
  ) / (every_k - 1)
  grad_sq = _square_norm(mean) - trace_sigma / every_k
  np.testing.assert_allclose(
    float(estimate.trace_sigma), trace_sigma, rtol=1e-5
  )
  np.testing.assert_allclose(float(estimate.grad_sq), grad_sq, rtol=1e-4)
