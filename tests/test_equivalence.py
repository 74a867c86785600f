"""The headline guarantee: k accumulated micro-steps equal one large-batch step.

Every test trains the same small MLP twice from the same parameters, once on
large batches and once on their micro-batches through ga_optax.accumulate,
over several windows, and compares the parameters.
"""

from __future__ import annotations

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ga_optax
from ga_optax.testing import assert_equivalent_to_large_batch

BATCH_SIZE = 24
NUM_WINDOWS = 5
FEATURES = 5


def init_params(seed: int = 0) -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(seed), 2)
  return {
    "hidden": jax.random.normal(keys[0], (FEATURES, 8)) / np.sqrt(FEATURES),
    "bias": jnp.zeros(8),
    "out": jax.random.normal(keys[1], (8,)) / np.sqrt(8),
  }


def make_batches(num_batches: int, batch_size: int = BATCH_SIZE, seed: int = 1):
  rng = np.random.default_rng(seed)
  return [
    {
      "x": jnp.asarray(rng.normal(size=(batch_size, FEATURES)), jnp.float32),
      "y": jnp.asarray(rng.normal(size=(batch_size,)), jnp.float32),
      "w": jnp.asarray(rng.uniform(0.2, 3.0, size=(batch_size,)), jnp.float32),
    }
    for _ in range(num_batches)
  ]


def per_example_loss(params, batch):
  hidden = jnp.tanh(batch["x"] @ params["hidden"] + params["bias"])
  return (hidden @ params["out"] - batch["y"]) ** 2


def mean_loss(params, batch):
  return jnp.mean(per_example_loss(params, batch))


def sum_loss(params, batch):
  return jnp.sum(per_example_loss(params, batch))


def weighted_mean_loss(params, batch):
  # The floor keeps an empty micro-batch at zero loss and zero gradient.
  total_weight = jnp.maximum(jnp.sum(batch["w"]), 1e-12)
  return jnp.sum(batch["w"] * per_example_loss(params, batch)) / total_weight


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 2e-2, 2, NUM_WINDOWS)
OPTIMIZERS = {
  # Plain SGD moves the parameters in proportion to the gradient: a wrong
  # scale (a sum for a mean, a window normalised by the wrong weight) shows.
  # Adam, Adafactor, Lion and clipping followed by a step all but ignore a
  # constant factor, so each claim below has a plain SGD case too.
  "sgd": optax.sgd(5e-2),
  "sgd_momentum": optax.sgd(5e-2, momentum=0.9),
  "adam_schedule": optax.adam(SCHEDULE),
  "adamw_schedule": optax.adamw(SCHEDULE, weight_decay=0.1),
  "adafactor": optax.adafactor(1e-2),
  "rmsprop": optax.rmsprop(1e-2, momentum=0.5),
  "lion": optax.lion(1e-3),
  "clip_adamw": optax.chain(
    optax.clip_by_global_norm(0.5), optax.adamw(SCHEDULE, weight_decay=0.1)
  ),
}


@pytest.mark.parametrize(
  "k", [1, 2, 3, pytest.param(4, marks=pytest.mark.smoke), 8]
)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_uniform_micro_batches_match_the_large_batch(name, k):
  result = assert_equivalent_to_large_batch(
    mean_loss,
    OPTIMIZERS[name],
    init_params(),
    make_batches(NUM_WINDOWS),
    k,
    rtol=2e-5,
  )
  chex.assert_tree_all_finite(result.large_batch_params)
  chex.assert_tree_all_finite(result.accumulated_params)
  # The comparison is not vacuous: training moved the parameters.
  assert (
    ga_optax.testing.max_relative_difference(
      result.large_batch_params, init_params()
    )
    > 1e-3
  )


@pytest.mark.parametrize(
  ("name", "use_jit", "num_windows"),
  [
    ("sgd_momentum", True, NUM_WINDOWS),
    ("adam_schedule", True, NUM_WINDOWS),
    ("clip_adamw", True, NUM_WINDOWS),
    # Eager dispatch is slow; two windows already exercise every path.
    ("clip_adamw", False, 2),
  ],
)
def test_variable_size_micro_batches_weighted_by_size(
  name, use_jit, num_windows
):
  result = assert_equivalent_to_large_batch(
    mean_loss,
    OPTIMIZERS[name],
    init_params(),
    make_batches(num_windows),
    [3, 9, 1, 11],
    rtol=2e-5,
    use_jit=use_jit,
  )
  # The helper counts a NaN in both runs as equal.
  chex.assert_tree_all_finite(result.accumulated_params)


def test_unweighted_variable_sizes_are_not_the_large_batch():
  """The default weight of 1 is wrong for unequal sizes: the check sees it."""
  result = ga_optax.testing.compare_with_large_batch(
    mean_loss,
    OPTIMIZERS["sgd_momentum"],
    init_params(),
    make_batches(NUM_WINDOWS),
    [3, 9, 1, 11],
    weight_fn=lambda microbatch: 1,
  )
  assert result.max_relative_difference > 1e-3


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw_schedule"])
def test_sum_reduction_with_sum_losses(name):
  result = assert_equivalent_to_large_batch(
    sum_loss,
    optax.chain(optax.scale(1 / BATCH_SIZE), OPTIMIZERS[name]),
    init_params(),
    make_batches(NUM_WINDOWS),
    [5, 7, 12],
    reduction="sum",
    rtol=2e-5,
  )
  chex.assert_tree_all_finite(result.accumulated_params)


def split(batch, sizes):
  ends = np.cumsum(sizes)
  return [
    jax.tree.map(lambda leaf, start=end - size, end=end: leaf[start:end], batch)
    for size, end in zip(sizes, ends, strict=True)
  ]


def assert_close_and_finite(actual, expected):
  """chex counts NaN equal to NaN: both runs must be finite first."""
  chex.assert_tree_all_finite(actual)
  chex.assert_tree_all_finite(expected)
  chex.assert_trees_all_close(actual, expected, rtol=2e-5, atol=1e-6)


def large_batch_run(optimizer, loss_fn, batches, params=None):
  """The independent reference: ``jax.grad`` of each window's whole batch.

  One step of the bare ``optimizer`` per batch, on the gradient of
  ``loss_fn`` over all the batch's rows; no ga_optax code is involved.
  """
  params = init_params() if params is None else params
  state = optimizer.init(params)

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for batch in batches:
    params, state = step(params, state, batch)
  return params


@functools.cache
def accumulated_step(optimizer_name, every_k, skip_nonfinite=False):
  tx = ga_optax.accumulate(
    OPTIMIZERS[optimizer_name], every_k, skip_nonfinite=skip_nonfinite
  )

  @jax.jit
  def step(params, state, batch, weight, flush):
    grads = jax.grad(weighted_mean_loss)(params, batch)
    updates, state = tx.update(grads, state, params, weight=weight, flush=flush)
    return optax.apply_updates(params, updates), state

  return tx, step


@pytest.mark.smoke
@pytest.mark.parametrize(
  "name", ["sgd", "adamw_schedule", "clip_adamw", "lion"]
)
def test_partial_last_window_closed_by_flush(name):
  # Three full windows of k = 4 micro-batches of 6, then a partial window of
  # two micro-batches: the large-batch run sees a last batch of 12.
  data = make_batches(1, batch_size=4 * 6 * 3 + 12)[0]
  micro_batches = split(data, [6] * 14)
  tx, step = accumulated_step(name, 4)
  params, state = init_params(), tx.init(init_params())
  for index, micro_batch in enumerate(micro_batches):
    params, state = step(
      params,
      state,
      micro_batch,
      jnp.sum(micro_batch["w"]),
      jnp.asarray(index == len(micro_batches) - 1),
    )
  assert int(state.update_step) == 4
  expected = large_batch_run(
    OPTIMIZERS[name], weighted_mean_loss, split(data, [24, 24, 24, 12])
  )
  assert_close_and_finite(params, expected)


@pytest.mark.parametrize("name", ["sgd", "adam_schedule"])
def test_piecewise_constant_schedule_of_k(name):
  # {0: 4, 2: 2}: the first two windows hold 4 micro-batches, later ones 2.
  data = make_batches(1, batch_size=4 * 3 * 2 + 2 * 3 * 3)[0]
  micro_batches = split(data, [3] * 14)
  tx = ga_optax.accumulate(OPTIMIZERS[name], {0: 4, 2: 2})

  @jax.jit
  def schedule_step(params, state, batch, weight):
    grads = jax.grad(weighted_mean_loss)(params, batch)
    updates, state = tx.update(grads, state, params, weight=weight)
    return optax.apply_updates(params, updates), state

  params, state = init_params(), tx.init(init_params())
  for micro_batch in micro_batches:
    params, state = schedule_step(
      params, state, micro_batch, jnp.sum(micro_batch["w"])
    )
  assert int(state.update_step) == 5
  expected = large_batch_run(
    OPTIMIZERS[name], weighted_mean_loss, split(data, [12, 12, 6, 6, 6])
  )
  assert_close_and_finite(params, expected)


@pytest.mark.parametrize("name", ["sgd", "adam_schedule", "rmsprop"])
def test_non_finite_micro_steps_are_skipped(name):
  data = make_batches(1, batch_size=4 * 6 * 3)[0]
  micro_batches = split(data, [6] * 12)
  poisoned = jax.tree.map(
    lambda leaf: leaf.at[0].set(jnp.nan), micro_batches[0]
  )
  # NaN micro-batches land inside windows and on would-be closing positions.
  stream = list(micro_batches)
  for position in (1, 5, 7, 13):
    stream.insert(position, poisoned)
  tx, step = accumulated_step(name, 4, skip_nonfinite=True)
  params, state = init_params(), tx.init(init_params())
  for micro_batch in stream:
    params, state = step(
      params,
      state,
      micro_batch,
      jnp.nansum(micro_batch["w"]),
      jnp.asarray(False),
    )
  assert int(state.num_skipped) == 4
  assert int(state.update_step) == 3
  expected = large_batch_run(
    OPTIMIZERS[name], weighted_mean_loss, split(data, [24, 24, 24])
  )
  assert_close_and_finite(params, expected)


HYPOTHESIS_BATCH = 12


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(
  name=st.sampled_from(["sgd_momentum", "adam_schedule"]),
  k=st.integers(1, 5),
  data=st.data(),
)
def test_any_partition_and_weights_match_the_large_batch(name, k, data):
  """Hypothesis: per-sample weights and an arbitrary split of each batch.

  Micro-batch ``i`` of a window keeps the batch's shape and masks out the
  samples assigned elsewhere, so one compiled step serves every partition;
  its weight is the sum of the per-sample weights it holds.
  """
  num_windows = 3
  batches = make_batches(num_windows, batch_size=HYPOTHESIS_BATCH, seed=k)
  sample_weights = st.lists(
    st.floats(0.1, 5.0), min_size=HYPOTHESIS_BATCH, max_size=HYPOTHESIS_BATCH
  )
  assignments = st.lists(
    st.integers(0, k - 1), min_size=HYPOTHESIS_BATCH, max_size=HYPOTHESIS_BATCH
  )
  tx, step = accumulated_step(name, k)
  params, state = init_params(), tx.init(init_params())
  weighted_batches = []
  for batch in batches:
    batch = dict(batch, w=jnp.asarray(data.draw(sample_weights), jnp.float32))
    owner = np.asarray(data.draw(assignments))
    weighted_batches.append(batch)
    for micro in range(k):
      micro_batch = dict(batch, w=jnp.where(owner == micro, batch["w"], 0.0))
      params, state = step(
        params,
        state,
        micro_batch,
        jnp.sum(micro_batch["w"]),
        jnp.asarray(False),
      )
  assert int(state.update_step) == num_windows
  expected = large_batch_run(
    OPTIMIZERS[name], weighted_mean_loss, weighted_batches
  )
  assert_close_and_finite(params, expected)
