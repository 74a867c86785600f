"""What the counters count, and that they saturate instead of wrapping.

``micro_step`` counts the open window's micro-steps, ``update_step`` the
updates the inner optimizer applied (not calls), ``num_skipped`` the
micro-steps dropped as non-finite. They are int32: a state that has reached
the maximum (built with ``state._replace``) must keep counting windows
correctly, never go negative, and keep ``every_k`` schedules on their last
piece.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ga_optax

INT32_MAX = np.iinfo(np.int32).max


def _at(value: int) -> jax.Array:
  return jnp.asarray(value, jnp.int32)


@pytest.fixture
def params() -> dict[str, jax.Array]:
  return {"w": jnp.arange(3, dtype=jnp.float32)}


def _feed(tx, state, params, num_calls: int, grads=None):
  update = jax.jit(tx.update)
  grads = {"w": jnp.ones(3)} if grads is None else grads
  emitted = []
  for _ in range(num_calls):
    _, state = update(grads, state, params)
    emitted.append(bool(ga_optax.emitted(state)))
  return state, emitted


def test_each_counter_counts_what_it_names(params):
  # k = 3; call 2 is non-finite (skipped); calls 3 to 5 weigh nothing, so
  # their window closes without a step; then a window of weight, flushed
  # after two of its micro-steps.
  tx = ga_optax.accumulate(optax.adam(0.1), 3, skip_nonfinite=True)
  update = jax.jit(tx.update)
  finite, nonfinite = {"w": jnp.ones(3)}, {"w": jnp.full(3, jnp.nan)}
  calls = [
    (finite, 1.0, False),
    (finite, 1.0, False),
    (nonfinite, 1.0, False),
    (finite, 1.0, False),
    (finite, 0.0, False),
    (finite, 0.0, False),
    (finite, 0.0, False),
    (finite, 2.0, False),
    (finite, 2.0, True),
  ]
  state = tx.init(params)
  counts = []
  for grads, weight, flush in calls:
    _, state = update(grads, state, params, weight=weight, flush=flush)
    counts.append(
      (int(state.micro_step), int(state.update_step), int(state.num_skipped))
    )
  assert counts == [
    (1, 0, 0),
    (2, 0, 0),
    (2, 0, 1),
    (0, 1, 1),
    (1, 1, 1),
    (2, 1, 1),
    (0, 1, 1),
    (1, 1, 1),
    (0, 2, 1),
  ]
  # The inner optimizer agrees: it stepped as often as update_step says.
  assert int(state.inner_state[0].count) == int(state.update_step) == 2
  assert int(ga_optax.applied_updates(state)) == 2


@pytest.mark.parametrize(
  "every_k",
  [3, {0: 5, 10: 3}, lambda step: jnp.where(step < 10, 5, 3)],
  ids=["int", "dict", "callable"],
)
def test_update_step_saturates_and_the_schedule_stays_on_its_last_piece(
  params, every_k
):
  tx = ga_optax.accumulate(optax.sgd(0.1), every_k)
  # A state as the run leaves it there: the open window's k is the
  # schedule's at that count (k is decided when the previous window closes).
  state = tx.init(params)._replace(
    update_step=_at(INT32_MAX - 1), every_k=_at(3)
  )
  state, emitted = _feed(tx, state, params, 9)
  # k = 3 everywhere past update 10: windows keep closing every 3 calls.
  assert emitted == [False, False, True] * 3
  assert state.update_step.dtype == jnp.int32
  assert int(state.update_step) == INT32_MAX
  assert int(state.micro_step) == 0
  assert int(ga_optax.current_k(state)) == 3


def test_num_skipped_saturates(params):
  tx = ga_optax.accumulate(optax.sgd(0.1), 2, skip_nonfinite=True)
  state = tx.init(params)._replace(num_skipped=_at(INT32_MAX - 1))
  state, emitted = _feed(tx, state, params, 3, {"w": jnp.full(3, jnp.nan)})
  assert emitted == [False] * 3
  assert state.num_skipped.dtype == jnp.int32
  assert int(state.num_skipped) == INT32_MAX
  state, emitted = _feed(tx, state, params, 2)
  assert emitted == [False, True]
  assert int(state.num_skipped) == INT32_MAX


def test_a_full_micro_step_counter_still_closes_the_window(params):
  # The largest k an int32 schedule can give; the window closes on the call
  # that reaches it, and the counter does not wrap on the way.
  tx = ga_optax.accumulate(
    optax.sgd(1.0), lambda step: jnp.asarray(INT32_MAX, jnp.int32)
  )
  state = tx.init(params)._replace(
    micro_step=_at(INT32_MAX - 2),
    accumulator={"w": jnp.full(3, 2.0)},
    weight_sum=jnp.asarray(2.0, jnp.float32),
  )
  update = jax.jit(tx.update)
  updates, state = update({"w": jnp.ones(3)}, state, params)
  assert not bool(ga_optax.emitted(state))
  assert int(state.micro_step) == INT32_MAX - 1
  updates, state = update({"w": jnp.full(3, 4.0)}, state, params)
  assert bool(ga_optax.emitted(state))
  assert int(state.micro_step) == 0
  chex.assert_trees_all_close(updates, {"w": jnp.full(3, -7.0 / 4.0)})


def test_a_saturated_micro_step_with_a_smaller_k_closes_at_once(params):
  # A state restored with a larger count than the schedule's k (for example
  # after k was lowered between runs) closes on the next call, never wraps.
  tx = ga_optax.accumulate(optax.sgd(1.0), 4)
  state = tx.init(params)._replace(
    micro_step=_at(INT32_MAX), update_step=_at(INT32_MAX)
  )
  state, emitted = _feed(tx, state, params, 5)
  assert emitted == [True, False, False, False, True]
  assert int(state.update_step) == INT32_MAX
  assert int(state.micro_step) == 0


def test_counters_are_int32_and_never_negative_over_a_long_run(params):
  tx = ga_optax.accumulate(optax.sgd(0.1), {0: 2, 3: 1}, skip_nonfinite=True)
  state = tx.init(params)._replace(
    update_step=_at(INT32_MAX - 3), num_skipped=_at(INT32_MAX - 1)
  )

  def body(state, grads):
    _, state = tx.update(grads, state, params)
    return state, (state.micro_step, state.update_step, state.num_skipped)

  finite = jnp.ones((40, 3))
  grads = {"w": finite.at[::7].set(jnp.inf)}
  state, (micro, updates, skipped) = jax.lax.scan(body, state, grads)
  for counter in (micro, updates, skipped):
    assert counter.dtype == jnp.int32
    assert int(counter.min()) >= 0
  assert int(updates[-1]) == INT32_MAX
  assert int(skipped[-1]) == INT32_MAX
  assert np.all(np.diff(np.asarray(updates)) >= 0)
