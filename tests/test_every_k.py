"""Window-length schedules: int, callable and {update_step: k} dict.

adaptive_k, the fourth kind, has tests/test_adaptive.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ga_optax
from ga_optax._src.batch_size.every_k import as_window_length


def as_schedule(every_k):
  """The ``update_step -> k`` function of a scheduled ``every_k``."""
  return as_window_length(every_k).schedule


@pytest.mark.parametrize("use_jit", [False, True])
def test_dict_is_piecewise_constant_in_applied_updates(use_jit):
  schedule = as_schedule({0: 8, 4: 2, 10: 1})
  schedule = jax.jit(schedule) if use_jit else schedule
  ks = [int(schedule(jnp.asarray(step, jnp.int32))) for step in range(13)]
  assert ks == [8] * 4 + [2] * 6 + [1] * 3


def test_dict_order_does_not_matter():
  schedule = as_schedule({10: 1, 0: 8, 4: 2})
  assert [int(schedule(jnp.asarray(s))) for s in (0, 4, 10)] == [8, 2, 1]


def test_int_is_constant_and_int32():
  k = as_schedule(3)(jnp.asarray(123, jnp.int32))
  assert k.dtype == jnp.int32
  assert int(k) == 3


def test_callable_result_is_cast_to_int32():
  schedule = as_schedule(lambda step: jnp.minimum(step + 1, 4).astype(jnp.int8))
  ks = [schedule(jnp.asarray(step, jnp.int32)) for step in range(6)]
  assert all(k.dtype == jnp.int32 for k in ks)
  assert [int(k) for k in ks] == [1, 2, 3, 4, 4, 4]


def test_schedule_at_the_int32_limit():
  schedule = as_schedule({0: 4, 2**31 - 1: 2})
  assert int(schedule(jnp.asarray(2**31 - 1, jnp.int32))) == 2
  assert int(schedule(jnp.asarray(2**31 - 2, jnp.int32))) == 4


TOO_LARGE = 2**31


@pytest.mark.parametrize(
  ("every_k", "name"),
  [
    (TOO_LARGE, r"every_k must"),
    ({0: TOO_LARGE}, r"every_k\[0\] must"),
    ({0: 2, 8: TOO_LARGE}, r"every_k\[8\] must"),
    ({0: 2, TOO_LARGE: 4}, r"every_k dict keys must"),
  ],
)
@pytest.mark.parametrize(
  "make", [ga_optax.accumulate, ga_optax.accumulate_and_apply]
)
def test_k_and_keys_beyond_the_int32_counters(make, every_k, name):
  with pytest.raises(ValueError, match=name + r" be at most 2\*\*31 - 1"):
    make(optax.sgd(1.0), every_k)


def test_largest_k_the_counters_hold():
  schedule = as_schedule({0: 2**31 - 1, 2**31 - 1: 2**31 - 1})
  assert int(schedule(jnp.asarray(0, jnp.int32))) == 2**31 - 1
  assert int(as_schedule(2**31 - 1)(jnp.asarray(0, jnp.int32))) == 2**31 - 1


@pytest.mark.parametrize(
  "every_k",
  [
    lambda update_step: 2 if update_step < 10 else 4,
    lambda update_step: [2, 2, 4][int(update_step)],
    lambda update_step: range(2, 5)[update_step],
  ],
  ids=["if", "int", "index"],
)
def test_a_callable_with_python_control_flow_is_refused_with_the_fixes(
  every_k,
):
  # The callable gets a traced int32 scalar: Python needs its value, and
  # the error must say which argument and how to write it instead.
  with pytest.raises(TypeError) as raised:
    ga_optax.accumulate(optax.sgd(0.1), every_k)
  message = str(raised.value)
  assert message.startswith("every_k")
  assert "{0: 2, 10: 4}" in message
  assert "jnp.where" in message


def test_the_fixes_the_error_names_give_the_intended_schedule():
  by_dict = as_schedule({0: 2, 10: 4})
  by_where = as_schedule(lambda update_step: jnp.where(update_step < 10, 2, 4))
  for update_step in (0, 9, 10, 11):
    expected = 2 if update_step < 10 else 4
    assert int(by_dict(jnp.int32(update_step))) == expected
    assert int(by_where(jnp.int32(update_step))) == expected


# A callable's k below 1 acts as 1 everywhere: the window, lr_scaling's ratio
# (whose first k is the schedule's at 0) and current_k.

BELOW_ONE = {
  "starts_at_zero": lambda update_step: update_step // 2,
  "starts_at_minus_one": lambda update_step: update_step - 1,
  "falls_to_zero": lambda update_step: jnp.maximum(2 - update_step, -3),
}


def numpy_run(schedule, gradients, lr_scaling):
  """Windows of max(k, 1) micro-steps; SGD(1): minus the mean, times the
  ratio of the window's k to the first window's."""
  first_k = max(int(schedule(0)), 1)
  index, update_step, ks, updates = 0, 0, [], []
  while True:
    k = max(int(schedule(update_step)), 1)
    if index + k > len(gradients):
      return ks, updates
    ratio = {None: 1.0, "sqrt": np.sqrt(k / first_k), "linear": k / first_k}
    updates.append(
      -np.mean(gradients[index : index + k], axis=0) * ratio[lr_scaling]
    )
    ks.append(k)
    index += k
    update_step += 1


@pytest.mark.parametrize("lr_scaling", [None, "sqrt", "linear"])
@pytest.mark.parametrize("schedule", list(BELOW_ONE), ids=list(BELOW_ONE))
def test_a_callable_k_below_one_acts_as_one_everywhere(schedule, lr_scaling):
  every_k = BELOW_ONE[schedule]
  rng = np.random.default_rng(0)
  gradients = [
    rng.uniform(0.5, 1.5, size=3).astype(np.float32) for _ in range(12)
  ]
  tx = ga_optax.accumulate(optax.sgd(1.0), every_k, lr_scaling=lr_scaling)
  params = jnp.zeros(3)
  state = tx.init(params)
  step = jax.jit(tx.update)
  ks, updates = [], []
  for gradient in gradients:
    k = int(ga_optax.current_k(state))
    assert k >= 1, k
    update, state = step(jnp.asarray(gradient), state, params)
    assert bool(jnp.all(jnp.isfinite(update))), update
    if bool(ga_optax.emitted(state)):
      ks.append(k)
      updates.append(np.asarray(update))
  expected_ks, expected_updates = numpy_run(every_k, gradients, lr_scaling)
  assert ks == expected_ks[: len(ks)]
  assert len(ks) >= len(expected_ks)
  for update, expected in zip(updates, expected_updates, strict=False):
    np.testing.assert_allclose(update, expected, rtol=1e-6)
  # Every update moves against the (positive) gradient, never along it.
  assert all(np.all(update < 0) for update in updates)


# current_k is the k the schedule gives for the applied updates so far: the
# window that closes stores the next window's k, not its own.


@pytest.mark.parametrize(
  "every_k",
  [{0: 2, 1: 3, 2: 1, 3: 4}, lambda update_step: update_step % 3 + 1],
  ids=["dict", "callable"],
)
@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_current_k_is_the_next_windows_k_after_each_close(every_k, use_jit):
  tx = ga_optax.accumulate(optax.sgd(1.0), every_k)
  schedule = as_schedule(every_k)
  params = jnp.zeros(2)
  state = tx.init(params)
  step = jax.jit(tx.update) if use_jit else tx.update
  closed = 0
  for _ in range(14):
    _, state = step(jnp.ones(2), state, params)
    applied = int(ga_optax.applied_updates(state))
    assert int(ga_optax.current_k(state)) == int(schedule(jnp.int32(applied)))
    closed += bool(ga_optax.emitted(state))
  assert closed == applied >= 5
