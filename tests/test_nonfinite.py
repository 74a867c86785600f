"""Non-finite gradients: skipped per micro-step, or propagated like optax.

With ``skip_nonfinite=True`` a micro-step whose gradients hold NaN or Inf
must leave no trace but ``num_skipped``: the run equals the run in which that
micro-step never happened. With it off, NaN flows exactly as it would through
the bare optimizer. A whole window can be dropped by chaining
``optax.apply_if_finite`` inside the wrapped optimizer; its counters then
move once per window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import without_stale_accumulator

import ga_optax

JIT_OR_NOT = pytest.mark.parametrize(
  "use_jit", [False, True], ids=["eager", "jit"]
)


def _params() -> dict[str, jax.Array]:
  return {
    "w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3),
    "b": jnp.asarray([0.5, -0.25], jnp.bfloat16),
  }


def _grads(index: int, poison: float | None = None, leaf: str = "w") -> Any:
  """Micro-step ``index``'s gradient; ``poison`` goes into one element."""
  key_w, key_b = jax.random.split(jax.random.fold_in(jax.random.key(7), index))
  grads = {
    "w": jax.random.normal(key_w, (2, 3), jnp.float32),
    "b": jax.random.normal(key_b, (2,), jnp.bfloat16),
  }
  if poison is not None:
    grads[leaf] = grads[leaf].at[(0,) * grads[leaf].ndim].set(poison)
  return grads


def _update_fn(
  tx: optax.GradientTransformationExtraArgs, use_jit: bool
) -> Callable[..., Any]:
  def update(grads, state, params, weight, flush):
    return tx.update(grads, state, params, weight=weight, flush=flush)

  if use_jit:
    return jax.jit(update)
  return update


def _run(tx, stream, use_jit: bool):
  """Runs ``stream`` (grads, weight, flush) items; returns updates and state."""
  update = _update_fn(tx, use_jit)
  params = _params()
  state = tx.init(params)
  all_updates = []
  for grads, weight, flush in stream:
    updates, state = update(grads, state, params, weight, flush)
    all_updates.append(updates)
    params = optax.apply_updates(params, updates)
  return all_updates, state, params


# Eager calls of tx.update compile their lax.cond each time: keep them few.
@pytest.mark.parametrize(
  ("use_jit", "poison", "leaf", "inner"),
  [
    (True, np.nan, "w", optax.adam(0.1)),
    (True, np.inf, "b", optax.adam(0.1)),
    (True, -np.inf, "w", optax.adam(0.1)),
    (False, np.nan, "b", optax.sgd(0.1)),
  ],
  ids=["jit-nan-w", "jit-inf-b", "jit-neginf-w", "eager-nan-b"],
)
def test_skipped_micro_step_leaves_no_trace_but_the_count(
  use_jit, poison, leaf, inner
):
  tx = ga_optax.accumulate(inner, 3, skip_nonfinite=True)
  # Two windows and an open one; the non-finite micro-steps sit at the start
  # of the first window, in the middle of the second and after it.
  poisoned_at = {0, 4, 8}
  stream, clean_stream = [], []
  for index in range(9):
    weight = jnp.float32(index % 4 + 1)
    if index in poisoned_at:
      stream.append((_grads(index, poison, leaf), weight, jnp.bool_(False)))
    else:
      item = (_grads(index), weight, jnp.bool_(False))
      stream.append(item)
      clean_stream.append(item)
  updates, state, params = _run(tx, stream, use_jit)
  clean_updates, clean_state, clean_params = _run(tx, clean_stream, use_jit)

  assert int(state.num_skipped) == len(poisoned_at)
  assert int(clean_state.num_skipped) == 0
  assert int(state.update_step) == int(clean_state.update_step) == 2
  # The last micro-step of the poisoned run is skipped, so it did not emit.
  assert not bool(state.emitted) and bool(clean_state.emitted)
  chex.assert_trees_all_equal(
    without_stale_accumulator(
      state._replace(num_skipped=clean_state.num_skipped, emitted=True)
    ),
    without_stale_accumulator(clean_state),
  )
  chex.assert_trees_all_equal(params, clean_params)
  kept = [u for i, u in enumerate(updates) if i not in poisoned_at]
  chex.assert_trees_all_equal(kept, clean_updates)
  for index in poisoned_at:
    chex.assert_trees_all_equal(
      updates[index], optax.tree.zeros_like(updates[index])
    )
  chex.assert_tree_all_finite((updates, state, params))


@JIT_OR_NOT
def test_skipped_micro_step_keeps_the_window_and_its_weight(use_jit):
  tx = ga_optax.accumulate(optax.sgd(1.0), 4, skip_nonfinite=True)
  update = _update_fn(tx, use_jit)
  params = _params()
  state = tx.init(params)
  _, state = update(_grads(0), state, params, jnp.float32(2.0), False)
  before = state
  updates, state = update(
    _grads(1, np.nan), state, params, jnp.float32(5.0), False
  )
  chex.assert_trees_all_equal(
    state._replace(num_skipped=before.num_skipped), before
  )
  assert int(state.num_skipped) == 1
  assert not bool(ga_optax.emitted(state))
  chex.assert_trees_all_equal(updates, optax.tree.zeros_like(_grads(0)))


@JIT_OR_NOT
def test_nonfinite_micro_step_with_flush_closes_what_the_window_holds(use_jit):
  tx = ga_optax.accumulate(optax.sgd(1.0), 4, skip_nonfinite=True)
  update = _update_fn(tx, use_jit)
  params = _params()
  state = tx.init(params)
  _, state = update(_grads(0), state, params, jnp.float32(3.0), False)
  updates, state = update(
    _grads(1, np.inf), state, params, jnp.float32(1.0), True
  )
  expected = jax.tree.map(lambda g: -g, _grads(0))
  chex.assert_trees_all_close(updates, expected)
  assert bool(ga_optax.emitted(state))
  assert int(state.micro_step) == 0
  assert int(state.num_skipped) == 1


@JIT_OR_NOT
def test_window_of_only_skipped_micro_steps_flushes_to_zeros_without_a_step(
  use_jit,
):
  tx = ga_optax.accumulate(optax.adam(0.1), 2, skip_nonfinite=True)
  update = _update_fn(tx, use_jit)
  params = _params()
  state = tx.init(params)
  _, state = update(_grads(0, np.nan), state, params, jnp.float32(1.0), False)
  updates, state = update(
    _grads(1, np.nan), state, params, jnp.float32(1.0), True
  )
  chex.assert_trees_all_equal(updates, optax.tree.zeros_like(_grads(0)))
  chex.assert_trees_all_equal(state.inner_state, tx.init(params).inner_state)
  assert not bool(ga_optax.emitted(state))
  assert int(state.update_step) == 0
  assert int(state.num_skipped) == 2


def assert_close_in_each_dtype(actual, expected, rtol, atol=0.0):
  """Close within ``rtol``, or a few units in the last place of a leaf's
  dtype where that is coarser.

  The two sides are compiled differently, and XLA keeps bfloat16 values in
  float32 where it fuses them: on an H100 one side rounded a bfloat16 update
  once more than the other (-0.09229 against -0.09277, one bfloat16 step),
  and XLA:CPU does the same inside a loop body, which is where the window's
  loop form runs the optimizer (``0.1 * g + 0.9 * mu`` for bfloat16 0.1108
  and -0.8867 is 0.010864 in a ``while`` body, 0.010742 outside it). Adam
  divides by the square root of such moments, so an update may move by two
  steps.
  """
  chex.assert_trees_all_equal_structs(actual, expected)
  for got, want in zip(
    jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True
  ):
    dtype = jnp.result_type(got)
    ulp = (
      float(jnp.finfo(dtype).eps) if jnp.issubdtype(dtype, jnp.inexact) else 0.0
    )
    # A float32 leaf is held to rtol; a bfloat16 one to two of its steps.
    ulp *= 2
    chex.assert_trees_all_close(got, want, rtol=max(rtol, ulp), atol=atol)


@pytest.mark.parametrize(
  ("use_jit", "poison"),
  # Eagerly, NaN propagation is covered by the k = 1 test below.
  [(True, np.nan), (True, np.inf)],
  ids=["jit-nan", "jit-inf"],
)
def test_without_skipping_nonfinite_propagates_like_the_bare_optimizer(
  use_jit, poison
):
  inner = optax.adam(0.1)
  tx = ga_optax.accumulate(inner, 3)
  update = _update_fn(tx, use_jit)
  params = _params()
  state = tx.init(params)
  bare_state = inner.init(params)
  windows = [
    [_grads(0), _grads(1), _grads(2)],
    [_grads(3), _grads(4, poison), _grads(5)],
    [_grads(6), _grads(7), _grads(8)],
  ]
  for window in windows:
    for grads in window:
      updates, state = update(grads, state, params, jnp.float32(1.0), False)
    # The bare optimizer's step on the mean gradient of the window, with the
    # accumulator's arithmetic (float32 sum, then the mean cast back).
    mean = jax.tree.map(
      lambda *gs: (sum(g.astype(jnp.float32) for g in gs) / len(gs)).astype(
        gs[0].dtype
      ),
      *window,
    )
    bare_updates, bare_state = inner.update(mean, bare_state, params)
    assert_close_in_each_dtype(updates, bare_updates, rtol=1e-6)
    assert_close_in_each_dtype(state.inner_state, bare_state, rtol=1e-6)
  # NaN reached the optimizer and stays in its moments, as it would in optax;
  # the accumulator itself starts every window afresh.
  assert not np.isfinite(np.asarray(state.inner_state[0].mu["w"])).all()
  _, state = update(_grads(9), state, params, jnp.float32(1.0), False)
  chex.assert_trees_all_equal(
    state.accumulator,
    jax.tree.map(lambda g: g.astype(jnp.float32), _grads(9)),
  )
  assert int(state.num_skipped) == 0


def test_without_skipping_k_one_is_the_bare_optimizer_on_nonfinite_grads():
  inner = optax.adam(0.1)
  tx = ga_optax.accumulate(inner, 1)
  params = _params()
  state, bare_state = tx.init(params), inner.init(params)
  for index, poison in enumerate([None, np.nan, None]):
    grads = _grads(index, poison)
    updates, state = tx.update(grads, state, params)
    bare_updates, bare_state = inner.update(grads, bare_state, params)
    # Close, not equal: the inner step is compiled inside lax.cond here and
    # runs op by op in the bare optimizer. NaN must sit in the same places.
    assert_close_in_each_dtype(updates, bare_updates, rtol=1e-5, atol=1e-7)
    assert_close_in_each_dtype(
      state.inner_state, bare_state, rtol=1e-5, atol=1e-7
    )
    chex.assert_trees_all_equal(
      jax.tree.map(jnp.isnan, updates), jax.tree.map(jnp.isnan, bare_updates)
    )


def _guarded_run(skip_nonfinite: bool, accumulator_dtype: Any, windows):
  inner = optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=5)
  tx = ga_optax.accumulate(
    inner,
    2,
    skip_nonfinite=skip_nonfinite,
    accumulator_dtype=accumulator_dtype,
  )
  update = jax.jit(tx.update)
  params = {"w": jnp.zeros(3, jnp.float32)}
  state = tx.init(params)
  history = []
  for window in windows:
    for grads in window:
      updates, state = update({"w": grads}, state, params)
    history.append((updates, state.inner_state))
  return history


def test_apply_if_finite_inside_drops_whole_windows_and_counts_once_each():
  finite = jnp.ones(3, jnp.float32)
  poisoned = jnp.asarray([1.0, np.nan, 1.0], jnp.float32)
  windows = [
    [finite, finite],
    [finite, poisoned],
    [poisoned, poisoned],
    [2 * finite, finite],
  ]
  history = _guarded_run(False, jnp.float32, windows)
  totals = [int(inner.total_notfinite) for _, inner in history]
  consecutive = [int(inner.notfinite_count) for _, inner in history]
  last_finite = [bool(inner.last_finite) for _, inner in history]
  # One count per bad window, although each bad window saw two micro-steps.
  assert totals == [0, 1, 2, 2]
  assert consecutive == [0, 1, 2, 0]
  assert last_finite == [True, False, False, True]
  updates = [updates["w"] for updates, _ in history]
  chex.assert_trees_all_equal(updates[1], jnp.zeros(3))
  chex.assert_trees_all_equal(updates[2], jnp.zeros(3))
  chex.assert_trees_all_close(updates[3], jnp.full(3, -1.5))


def test_apply_if_finite_catches_a_window_that_overflows_the_accumulator():
  # Each micro-step is finite, so skip_nonfinite keeps it; their float16 sum
  # overflows. Only the window-level guard can catch that.
  large = jnp.full(3, 40000.0, jnp.float32)
  history = _guarded_run(True, jnp.float16, [[large, large], [large, -large]])
  (overflowed, overflowed_inner), (fine, fine_inner) = history
  chex.assert_trees_all_equal(overflowed["w"], jnp.zeros(3))
  assert int(overflowed_inner.total_notfinite) == 1
  chex.assert_trees_all_equal(fine["w"], jnp.zeros(3))
  assert bool(fine_inner.last_finite)
  assert int(fine_inner.total_notfinite) == 1
