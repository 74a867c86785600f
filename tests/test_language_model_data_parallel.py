"""A language model under plain-jit data parallel: an embedding, padded tokens.

Two things a new user met, on 8 simulated devices with Explicit axes.

* ``jax.grad`` of a model with an embedding on a batch sharded over
  ``"data"`` raises JAX's ``ShardingTypeError``: the table's gather by
  sharded token ids has no output sharding JAX can choose. ga_optax's
  plain-jit paths run each device's share inside a map over the batch axes,
  so the same loss, unchanged, works there.
* Token weights under ``accumulate(..., unreduced_axes=...)`` need the
  micro-step's token count at two levels, the devices within a micro-step
  and the micro-steps of a window. Counted in ``weight_fn`` and again in the
  step, it was all-reduced twice on every micro-step;
  ``unreduced_value_and_grad(..., return_weight=True)`` returns the count it
  already summed with the loss, so one scalar all-reduce remains.

Every result is held to the one-device large batch, which never runs
ga_optax: ``jax.value_and_grad`` of the token mean over a window's rows on a
mesh of one device, and a step of plain SGD.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_finite_and_close
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src import audits

DEVICES = 8
ROWS = 2  # per device and micro-step
VOCAB, WIDTH, LENGTH = 24, 8, 7
PAD = 0
K = 3
# Windows of 3 micro-steps, then a window of 2 closed by a flush.
WINDOW_LENGTHS = (3, 2)
LEARNING_RATE = 0.5

Batch = dict[str, np.ndarray]

pytestmark = pytest.mark.devices(DEVICES)


def init_params() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {
    "embed": rng.normal(size=(VOCAB, WIDTH)).astype(np.float32),
    "out": (rng.normal(size=(WIDTH, VOCAB)) / 3).astype(np.float32),
    "bias": np.zeros(VOCAB, np.float32),
  }


def count_tokens(batch: Any) -> jax.Array:
  """The real (not padding) target tokens of a batch: its weight."""
  return jnp.sum(batch["tokens"][:, 1:] != PAD)


def token_mean_loss(params: Any, batch: Any) -> jax.Array:
  """Next-token cross-entropy, the mean over real targets (0 if none)."""
  inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
  logits = params["embed"][inputs] @ params["out"] + params["bias"]
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  real = targets != PAD
  return jnp.sum(losses * real) / jnp.maximum(jnp.sum(real), 1)


def make_windows() -> list[list[Batch]]:
  """Micro-batches of padded sequences, unequal in tokens everywhere.

  Lengths differ from row to row, so devices, micro-steps and windows hold
  different numbers of real tokens; the first device's rows of the first
  micro-batch are padding only (weight 0 there).
  """
  rng = np.random.default_rng(1)
  rows = DEVICES * ROWS
  windows = []
  for length in WINDOW_LENGTHS:
    window = []
    for _ in range(length):
      tokens = rng.integers(1, VOCAB, size=(rows, LENGTH)).astype(np.int32)
      real = rng.integers(1, LENGTH + 1, size=rows)
      tokens[np.arange(LENGTH) >= real[:, None]] = PAD
      window.append({"tokens": tokens})
    windows.append(window)
  windows[0][0]["tokens"][:ROWS] = PAD
  return windows


def whole(window: Sequence[Batch]) -> Batch:
  return {"tokens": np.concatenate([batch["tokens"] for batch in window])}


def one_device(fn: Any, *args: Any) -> Any:
  """``jax.jit(fn)(*args)`` on a mesh of the first device alone."""
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    return jax.device_get(jax.jit(fn)(*jax.device_get(args)))


def large_batch_sgd(windows: Sequence[Sequence[Batch]]) -> Any:
  """Per window, one SGD step on its token mean's gradient, on one device."""
  params = init_params()
  for window in windows:
    grads = one_device(jax.grad(token_mean_loss), params, whole(window))
    params = jax.tree.map(
      lambda param, grad: param - LEARNING_RATE * grad, params, grads
    )
  return params


def data_mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((DEVICES,), ("data",))  # Explicit axes


def test_plain_grad_of_an_embedding_on_a_sharded_batch_raises():
  """The premise the data-parallel page states, on today's JAX."""
  batch = whole(make_windows()[0])
  with jax.set_mesh(data_mesh()):
    params = jax.device_put(init_params(), P())
    sharded = jax.device_put(batch, P("data"))
    with pytest.raises(Exception) as caught:
      jax.jit(jax.grad(token_mean_loss))(params, sharded)
  assert type(caught.value).__name__ == "ShardingTypeError", caught.value
  assert "out_sharding" in str(caught.value)


@pytest.mark.parametrize("path", ["microbatched", "unreduced"])
def test_gradients_of_an_embedding_model_match_one_device(path):
  """Both plain-jit paths take the embedding model as it is written."""
  batch = whole(make_windows()[0])  # 48 rows, 6 per device
  expected = one_device(
    jax.value_and_grad(token_mean_loss), init_params(), batch
  )
  with jax.set_mesh(data_mesh()):
    params = jax.device_put(init_params(), P())
    sharded = jax.device_put(batch, P("data"))
    if path == "microbatched":
      value_and_grad = jax.jit(
        ga_optax.microbatched_value_and_grad(
          token_mean_loss, K, weight_fn=count_tokens
        )
      )
    else:
      per_device = ga_optax.unreduced_value_and_grad(
        token_mean_loss, weight_fn=count_tokens
      )

      @jax.jit
      def value_and_grad(params, batch):
        loss, grads = per_device(params, batch)
        # The devices' partial sums, summed: the gradient they stand for.
        return loss, jax.tree.map(lambda g: jax.reshard(g, P()), grads)

    actual = value_and_grad(params, sharded)
  assert_finite_and_close(actual, expected)


def test_accumulating_with_the_returned_weight_matches_one_device():
  """One count, one scalar all-reduce per micro-step, the large batch's step."""
  windows = make_windows()
  tx = ga_optax.accumulate(optax.sgd(LEARNING_RATE), K, unreduced_axes="data")
  value_and_grad = ga_optax.unreduced_value_and_grad(
    token_mean_loss, weight_fn=count_tokens, return_weight=True
  )

  @jax.jit
  def step(params, state, batch, flush):
    loss, grads, weight = value_and_grad(params, batch)
    updates, state = tx.update(grads, state, params, weight=weight, flush=flush)
    return optax.apply_updates(params, updates), state, loss

  with jax.set_mesh(data_mesh()), warnings.catch_warnings():
    # A weighted step whose devices were weighed alike warns; not this one.
    warnings.simplefilter("error")
    params = jax.device_put(init_params(), P())
    state = tx.init(params)
    first = jax.device_put(windows[0][0], P("data"))
    compiled = step.lower(params, state, first, jnp.bool_(False)).compile()
    for window in windows:
      for index, batch in enumerate(window):
        flush = len(window) < K and index == len(window) - 1
        batch = jax.device_put(batch, P("data"))
        params, state, _ = compiled(params, state, batch, jnp.bool_(flush))
  assert int(ga_optax.applied_updates(state)) == len(windows)
  assert_finite_and_close(params, large_batch_sgd(windows))

  found = audits.window_collectives(compiled.as_text())
  # The loss and the weight, summed in one all-reduce; nothing else.
  assert [(c.opcode, c.operand_bytes) for c in found.every_micro_step] == [
    ("all-reduce", 8)
  ], found
  parameter_bytes = sum(leaf.nbytes for leaf in init_params().values())
  assert [(c.opcode, c.operand_bytes) for c in found.window_closing] == [
    ("all-reduce", parameter_bytes)
  ], found


@pytest.mark.parametrize("has_aux", [False, True])
def test_the_returned_weight_is_the_count_over_every_device(has_aux):
  batch = make_windows()[0][0]

  def loss(params, batch):
    value = token_mean_loss(params, batch)
    return (value, count_tokens(batch)) if has_aux else value

  value_and_grad = ga_optax.unreduced_value_and_grad(
    loss, has_aux=has_aux, weight_fn=count_tokens, return_weight=True
  )
  with jax.set_mesh(data_mesh()):
    params = jax.device_put(init_params(), P())
    output, grads, weight = jax.jit(value_and_grad)(
      params, jax.device_put(batch, P("data"))
    )
    assert "{U:data}" in str(jax.typeof(grads["embed"]))
  # Counted by hand: no device's rows left out, none counted twice.
  real = int(np.sum(batch["tokens"][:, 1:] != PAD))
  assert float(weight) == real
  if has_aux:
    _, per_device = output
    assert list(np.asarray(per_device)) == [
      int(np.sum(rows[:, 1:] != PAD))
      for rows in np.split(batch["tokens"], DEVICES)
    ]


def test_return_weight_needs_a_weight_fn():
  with pytest.raises(ValueError, match="weight_fn"):
    ga_optax.unreduced_value_and_grad(token_mean_loss, return_weight=True)
  with pytest.raises(TypeError, match="return_weight"):
    ga_optax.unreduced_value_and_grad(
      token_mean_loss, weight_fn=count_tokens, return_weight=1
    )
