"""Tests of ga_optax.accumulate_and_apply, the fused path.

Its claim is an equivalence: ``fused.apply(params, grads, state)`` gives the
params and state of ``accumulate`` + ``optax.apply_updates``, call after call,
whatever the weights, flushes and non-finite micro-steps. Both paths could be
wrong the same way, so one test anchors the fused path to an independent
large-batch run: ``jax.grad`` of each window's whole batch and the bare
optimizer, with plain SGD (which a wrong gradient scale cannot slip past) and
windows of unequal weight. Every comparison checks finiteness first: chex
counts NaN equal to NaN.
"""

from __future__ import annotations

import functools
import pathlib

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ga_optax
from ga_optax.testing import max_relative_difference

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
OPTIMIZERS = {
  "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "adam_schedule": lambda: optax.adam(optax.linear_schedule(1e-2, 1e-3, 5)),
  "clip_adamw": lambda: optax.chain(
    optax.clip_by_global_norm(0.5), optax.adamw(1e-2)
  ),
}


def _params() -> dict[str, jax.Array]:
  return {"w": jnp.ones((3, 4)), "b": jnp.zeros((4,))}


def _grads(seed: int, nonfinite: bool = False) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  grads = {
    "w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
  }
  if nonfinite:
    grads["w"] = grads["w"].at[0, 0].set(jnp.nan)
  return grads


def _comparable(params_and_state):
  """Both paths' results, with the accumulator of an empty window zeroed.

  Once a window closes the accumulator's contents are unspecified (the
  transformation path carries its updates there), so only an open window's
  accumulator is compared.
  """
  params, state = params_and_state
  open_window = state.micro_step > 0
  accumulator = jax.tree.map(
    lambda total: jnp.where(open_window, total, 0), state.accumulator
  )
  return params, state._replace(accumulator=accumulator)


@functools.cache
def _both_paths(optimizer_name, every_k, use_jit, skip_nonfinite=False):
  """Both paths' init and step, built (and compiled) once per configuration.

  Hypothesis draws the same configurations again and again: cached, their
  steps compile once instead of once per example.
  """
  options = {"skip_nonfinite": skip_nonfinite}
  tx = ga_optax.accumulate(OPTIMIZERS[optimizer_name](), every_k, **options)
  fused = ga_optax.accumulate_and_apply(
    OPTIMIZERS[optimizer_name](), every_k, **options
  )

  def reference_step(params, state, grads, weight, flush):
    updates, state = tx.update(grads, state, params, weight=weight, flush=flush)
    return optax.apply_updates(params, updates), state

  def fused_step(params, state, grads, weight, flush):
    return fused.apply(params, grads, state, weight=weight, flush=flush)

  if use_jit:
    reference_step = jax.jit(reference_step)
    fused_step = jax.jit(fused_step)
  return tx, reference_step, fused, fused_step


def _run_both(optimizer_name, every_k, calls, use_jit, **kwargs):
  """Runs ``calls`` (grads, weight, flush) through both paths."""
  tx, reference_step, fused, fused_step = _both_paths(
    optimizer_name, every_k, use_jit, **kwargs
  )
  reference = (_params(), tx.init(_params()))
  actual = (_params(), fused.init(_params()))
  for grads, weight, flush in calls:
    weight = jnp.asarray(weight, jnp.float32)
    flush = jnp.asarray(flush)
    reference = reference_step(*reference, grads, weight, flush)
    actual = fused_step(*actual, grads, weight, flush)
    chex.assert_tree_all_finite(_comparable(reference))
    chex.assert_tree_all_finite(_comparable(actual))
    # The params are of order 1: a few of their ulps (1.2e-7 each) apart,
    # where the two paths' fusions round a difference of such numbers
    # otherwise.
    chex.assert_trees_all_close(
      _comparable(actual), _comparable(reference), rtol=1e-6, atol=5e-7
    )
  return actual, reference


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "nojit"])
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(
  every_k=st.integers(1, 3),
  plan=st.lists(
    st.tuples(st.sampled_from([0.0, 0.5, 1.0, 3.0]), st.booleans()),
    min_size=1,
    max_size=7,
  ),
)
def test_matches_accumulate_then_apply_updates(
  use_jit, optimizer_name, every_k, plan
):
  # A last flushed call of weight 1 closes a window that holds weight:
  # every example steps the optimizer at least once.
  plan = [*plan, (1.0, True)]
  calls = [
    (_grads(seed), weight, flush) for seed, (weight, flush) in enumerate(plan)
  ]
  actual, _ = _run_both(optimizer_name, every_k, calls, use_jit)
  chex.assert_type(actual[1].micro_step, jnp.int32)
  assert int(actual[1].update_step) >= 1
  assert bool(ga_optax.emitted(actual[1]))
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), actual[0], _params())
  assert any(jax.tree.leaves(moved)), "the example never moved the params"


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "nojit"])
def test_skip_nonfinite_matches_accumulate(use_jit):
  calls = [
    (_grads(seed, nonfinite=seed in (1, 4)), 1.0, False) for seed in range(7)
  ]
  actual, _ = _run_both("clip_adamw", 2, calls, use_jit, skip_nonfinite=True)
  assert int(actual[1].num_skipped) == 2
  assert int(actual[1].update_step) == 2


# The anchor: micro-batches of one fixed shape, their rows masked, so that
# one compiled step serves every size; a micro-batch's weight is its number
# of real rows.
ROWS = 6
# Three full windows of k = 3 and a flushed partial one: the windows hold 8,
# 13, 12 and 5 real rows.
WINDOW_SIZES = [[2, 5, 1], [4, 3, 6], [6, 6, 0], [3, 2]]


def _masked_loss(params, batch):
  errors = (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2
  rows = batch["mask"]
  return jnp.sum(rows * errors.sum(-1)) / jnp.maximum(jnp.sum(rows), 1.0)


def _micro_batch(seed: int, size: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(100 + seed)
  return {
    "x": jnp.asarray(rng.normal(size=(ROWS, 3)), jnp.float32),
    "y": jnp.asarray(rng.normal(size=(ROWS, 4)), jnp.float32),
    "mask": jnp.asarray(np.arange(ROWS) < size, jnp.float32),
  }


def test_weighted_windows_match_the_large_batch():
  """The fused path against jax.grad of each window's batch and bare SGD."""
  optimizer = optax.sgd(0.1)
  fused = ga_optax.accumulate_and_apply(optimizer, 3)

  @jax.jit
  def micro_step(params, state, batch, flush):
    grads = jax.grad(_masked_loss)(params, batch)
    return fused.apply(
      params, grads, state, weight=jnp.sum(batch["mask"]), flush=flush
    )

  @jax.jit
  def large_batch_step(params, opt_state, batch):
    grads = jax.grad(_masked_loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, state = _params(), fused.init(_params())
  expected, opt_state = _params(), optimizer.init(_params())
  seed = 0
  for window_index, sizes in enumerate(WINDOW_SIZES):
    window = []
    for index, size in enumerate(sizes):
      micro_batch = _micro_batch(seed, size)
      seed += 1
      window.append(micro_batch)
      flush = window_index == len(WINDOW_SIZES) - 1 and index == len(sizes) - 1
      params, state = micro_step(params, state, micro_batch, jnp.asarray(flush))
    # The large batch: every micro-batch's rows, the masked ones included.
    large_batch = jax.tree.map(lambda *parts: jnp.concatenate(parts), *window)
    expected, opt_state = large_batch_step(expected, opt_state, large_batch)
    chex.assert_tree_all_finite((params, expected))
    chex.assert_trees_all_close(params, expected, rtol=1e-5, atol=1e-6)
  assert int(state.update_step) == len(WINDOW_SIZES)
  assert max_relative_difference(expected, _params()) > 0.1


def test_micro_step_leaves_params_bit_identical():
  fused = ga_optax.accumulate_and_apply(optax.adam(1e-2), 3)
  params = _params()
  state = fused.init(params)
  new_params, state = jax.jit(fused.apply)(params, _grads(0), state)
  chex.assert_trees_all_equal(new_params, params)
  assert not bool(ga_optax.emitted(state))


def test_donated_params_and_state_step_in_place():
  fused = ga_optax.accumulate_and_apply(optax.adam(1e-2), 2)
  step = jax.jit(fused.apply, donate_argnums=(0, 2))
  params, state = _params(), fused.init(_params())
  tx = ga_optax.accumulate(optax.adam(1e-2), 2)
  expected_params, expected_state = _params(), tx.init(_params())
  for seed in range(4):
    params, state = step(params, _grads(seed), state)
    updates, expected_state = tx.update(
      _grads(seed), expected_state, expected_params
    )
    expected_params = optax.apply_updates(expected_params, updates)
  chex.assert_trees_all_close(
    _comparable((params, state)),
    _comparable((expected_params, expected_state)),
    rtol=1e-6,
  )


def test_state_is_that_of_accumulate():
  fused = ga_optax.accumulate_and_apply(optax.adam(1e-2), 4)
  tx = ga_optax.accumulate(optax.adam(1e-2), 4)
  state = fused.init(_params())
  assert isinstance(state, ga_optax.AccumulateState)
  chex.assert_trees_all_equal(state, tx.init(_params()))
  # A state saved by one path continues in the other.
  _, state = tx.update(_grads(0), state, _params())
  params, state = fused.apply(_params(), _grads(1), state)
  assert int(state.micro_step) == 2
  chex.assert_trees_all_equal(params, _params())


@pytest.mark.parametrize("first", ["accumulate", "accumulate_and_apply"])
def test_a_state_closed_by_one_path_continues_in_the_other(first):
  # A window's closing call leaves its accumulator stale (accumulate writes
  # its updates there): the next window, in either path, must not add to it.
  optimizer = optax.sgd(1.0)
  paths = {
    "accumulate": ga_optax.accumulate(optimizer, 2),
    "accumulate_and_apply": ga_optax.accumulate_and_apply(optimizer, 2),
  }
  second = next(name for name in paths if name != first)

  def run(name, params, state, grads):
    tx = paths[name]
    if name == "accumulate":
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    return tx.apply(params, grads, state)

  params, state = _params(), paths[first].init(_params())
  expected = _params()
  for name, seeds in ((first, (0, 1)), (second, (2, 3))):
    for seed in seeds:
      params, state = run(name, params, state, _grads(seed))
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *map(_grads, seeds))
    expected = jax.tree.map(lambda p, g: p - g, expected, mean)
  chex.assert_tree_all_finite(params)
  chex.assert_trees_all_close(params, expected, rtol=1e-6, atol=1e-6)


def test_extra_args_reach_the_optimizer():
  optimizer = optax.chain(
    optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=0, factor=0.5)
  )
  fused = ga_optax.accumulate_and_apply(optimizer, 1)
  tx = ga_optax.accumulate(optimizer, 1)
  params, state = _params(), fused.init(_params())
  expected_params, expected_state = _params(), tx.init(_params())
  for seed, value in enumerate([1.0, 2.0, 3.0]):
    params, state = fused.apply(params, _grads(seed), state, value=value)
    updates, expected_state = tx.update(
      _grads(seed), expected_state, expected_params, value=value
    )
    expected_params = optax.apply_updates(expected_params, updates)
  chex.assert_trees_all_close(params, expected_params, rtol=1e-6)


def test_bad_arguments_raise_like_accumulate():
  with pytest.raises(ValueError, match="every_k"):
    ga_optax.accumulate_and_apply(optax.sgd(0.1), 0)
  with pytest.raises(ValueError, match="reduction"):
    ga_optax.accumulate_and_apply(optax.sgd(0.1), 2, reduction="max")
  with pytest.raises(TypeError, match="optimizer"):
    ga_optax.accumulate_and_apply(lambda g: g, 2)
  fused = ga_optax.accumulate_and_apply(optax.sgd(0.1), 2)
  state = fused.init(_params())
  with pytest.raises(ValueError, match="grads"):
    fused.apply(_params(), {"w": jnp.ones((3, 4))}, state)
  with pytest.raises(ValueError, match="weight"):
    fused.apply(_params(), _grads(0), state, weight=-1.0)
