"""Behaviour of ga_optax.accumulate, one micro-step at a time."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized

import ga_optax

PARAMS = {"w": jnp.arange(6.0).reshape(2, 3) / 10, "b": jnp.array([0.5, -0.5])}


def gradient(step: int) -> dict[str, jax.Array]:
  """A different, deterministic gradient for each micro-step."""
  keys = jax.random.split(jax.random.key(step), 2)
  return {
    "w": jax.random.normal(keys[0], (2, 3)),
    "b": jax.random.normal(keys[1], (2,)),
  }


def counting_optimizer() -> optax.GradientTransformationExtraArgs:
  """SGD that counts its own update calls and records its extra args."""

  def init_fn(params):
    del params
    return {"calls": jnp.zeros((), jnp.int32), "scale": jnp.zeros(())}

  def update_fn(updates, state, params=None, *, scale=1.0, **extra_args):
    del params, extra_args
    new_updates = jax.tree.map(lambda g: -scale * g, updates)
    return new_updates, {"calls": state["calls"] + 1, "scale": scale * 1.0}

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class AccumulateTest(parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_zero_updates_until_the_window_closes(self):
    tx = ga_optax.accumulate(optax.sgd(1.0), 3)
    update = self.variant(tx.update)
    state = tx.init(PARAMS)
    for step in range(2):
      updates, state = update(gradient(step), state, PARAMS)
      chex.assert_trees_all_equal(updates, optax.tree.zeros_like(PARAMS))
      self.assertFalse(ga_optax.emitted(state))
      self.assertEqual(int(state.micro_step), step + 1)
    updates, state = update(gradient(2), state, PARAMS)
    self.assertTrue(ga_optax.emitted(state))
    mean = jax.tree.map(
      lambda *gs: sum(gs) / 3, *[gradient(step) for step in range(3)]
    )
    chex.assert_trees_all_close(updates, optax.tree.scale(-1.0, mean))
    self.assertEqual(int(state.micro_step), 0)
    self.assertEqual(int(state.update_step), 1)
    # The next window starts from scratch, whatever the buffer held.
    _, state = update(gradient(3), state, PARAMS)
    chex.assert_trees_all_close(state.accumulator, gradient(3))

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(
    fused=(False, True),
    host_scheduled=(False, True),
    window=("steps", "without weight", "overflowed"),
  )
  def test_every_close_leaves_the_accumulator_at_zero(
    self, fused, host_scheduled, window
  ):
    """A window adds to what the accumulator holds: every close empties it.

    A close that steps, one that holds no weight and one whose sums
    overflowed, in both outputs and both schedules.
    """
    overflow = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), PARAMS)
    (first, first_weight), (last, last_weight) = {
      "steps": [(gradient(0), 1.0), (gradient(1), 2.0)],
      "without weight": [(gradient(0), 0.0), (gradient(1), 0.0)],
      "overflowed": [(gradient(0), 1.0), (overflow, 1.0)],
    }[window]
    if fused:
      tx = ga_optax.accumulate_and_apply(optax.sgd(0.1), 2)
      step = tx.apply
    else:
      tx = ga_optax.accumulate(optax.sgd(0.1), 2)

      def step(params, grads, state, **options):
        return tx.update(grads, state, params, **options)

    def call(grads, state, weight, closes):
      closing = closes if host_scheduled else None
      run = self.variant(functools.partial(step, closing=closing))
      return run(PARAMS, grads, state, weight=weight)[1]

    state = call(first, tx.init(PARAMS), first_weight, closes=False)
    state = call(last, state, last_weight, closes=True)
    self.assertEqual(int(state.micro_step), 0)
    chex.assert_trees_all_equal(
      state.accumulator, optax.tree.zeros_like(PARAMS)
    )
    # The next window holds its own gradient alone.
    state = call(gradient(2), state, 1.0, closes=False)
    chex.assert_trees_all_close(state.accumulator, gradient(2))

  @chex.variants(with_jit=True, without_jit=True)
  def test_inner_optimizer_runs_once_per_window(self):
    tx = ga_optax.accumulate(counting_optimizer(), 4)
    update = self.variant(tx.update)
    state = tx.init(PARAMS)
    calls = []
    for step in range(10):
      _, state = update(gradient(step), state, PARAMS)
      calls.append(int(state.inner_state["calls"]))
    self.assertEqual(calls, [0, 0, 0, 1, 1, 1, 1, 2, 2, 2])

  @chex.variants(with_jit=True, without_jit=True)
  def test_k_equal_one_is_the_bare_optimizer(self):
    inner = optax.adamw(optax.linear_schedule(1e-2, 1e-3, 5), weight_decay=0.1)
    tx = ga_optax.accumulate(inner, 1)
    update = self.variant(tx.update)
    inner_update = self.variant(inner.update)
    state, inner_state = tx.init(PARAMS), inner.init(PARAMS)
    params = inner_params = PARAMS
    for step in range(5):
      updates, state = update(gradient(step), state, params)
      inner_updates, inner_state = inner_update(
        gradient(step), inner_state, inner_params
      )
      # Eagerly, the bare optimizer runs op by op while the wrapped one runs
      # compiled inside lax.cond, so fusion may round the last bit apart.
      chex.assert_trees_all_close(updates, inner_updates, rtol=1e-6, atol=0)
      params = optax.apply_updates(params, updates)
      inner_params = optax.apply_updates(inner_params, inner_updates)
    chex.assert_trees_all_close(state.inner_state, inner_state, rtol=1e-6)

  def test_k_equal_one_under_jit_is_the_bare_optimizer(self):
    # Equal up to float32 rounding, not bit for bit: the window's last add
    # (an exact x * 1 + 0 here) is fused with the optimizer's arithmetic,
    # and the compiler may contract that fusion's multiply-adds otherwise
    # than the bare optimizer's (1 ulp apart, seen on the CPU).
    inner = optax.adam(1e-2)
    tx = ga_optax.accumulate(inner, 1)

    @jax.jit
    def both_steps(grads, state, inner_state):
      return tx.update(grads, state, PARAMS), inner.update(
        grads, inner_state, PARAMS
      )

    state, inner_state = tx.init(PARAMS), inner.init(PARAMS)
    for step in range(3):
      (updates, state), (inner_updates, inner_state) = both_steps(
        gradient(step), state, inner_state
      )
      chex.assert_tree_all_finite(updates)
      chex.assert_trees_all_close(updates, inner_updates, rtol=1e-6, atol=0)
    chex.assert_trees_all_close(
      state.inner_state, inner_state, rtol=1e-6, atol=0
    )

  def test_k_equal_one_with_any_weight_is_the_bare_optimizer(self):
    # A window of one micro-step is its gradient, whatever it weighs: plain
    # SGD shows a weight left in the mean (Adam would all but hide it).
    inner = optax.sgd(0.1)
    tx = ga_optax.accumulate(inner, 1)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    for step, weight in enumerate([3.0, 0.5, 7.0]):
      updates, state = update(gradient(step), state, PARAMS, weight=weight)
      expected, _ = inner.update(gradient(step), inner.init(PARAMS), PARAMS)
      chex.assert_tree_all_finite(updates)
      chex.assert_trees_all_close(updates, expected, rtol=1e-6)
    self.assertEqual(int(state.update_step), 3)

  def test_jit_with_donated_state(self):
    tx = ga_optax.accumulate(optax.adam(1e-2), 2)
    step = jax.jit(tx.update, donate_argnums=1)
    state = tx.init(PARAMS)
    eager_state = tx.init(PARAMS)
    for micro_step in range(6):
      updates, state = step(gradient(micro_step), state, PARAMS)
      eager_updates, eager_state = tx.update(
        gradient(micro_step), eager_state, PARAMS
      )
      chex.assert_trees_all_close(updates, eager_updates, rtol=1e-6)
    chex.assert_trees_all_close(state, eager_state, rtol=1e-6)

  def test_extra_args_reach_the_inner_optimizer_when_the_window_closes(self):
    tx = ga_optax.accumulate(counting_optimizer(), 2)
    state = tx.init(PARAMS)
    _, state = tx.update(gradient(0), state, PARAMS, scale=3.0)
    self.assertEqual(float(state.inner_state["scale"]), 0.0)
    updates, state = tx.update(gradient(1), state, PARAMS, scale=3.0)
    self.assertEqual(float(state.inner_state["scale"]), 3.0)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, gradient(0), gradient(1))
    chex.assert_trees_all_close(updates, optax.tree.scale(-3.0, mean))

  def test_reduce_on_plateau_sees_the_value_extra_arg(self):
    inner = optax.chain(
      optax.sgd(1.0),
      optax.contrib.reduce_on_plateau(patience=0, factor=0.5),
    )
    tx = ga_optax.accumulate(inner, 2)
    state = tx.init(PARAMS)
    for step in range(6):
      _, state = tx.update(
        gradient(step), state, PARAMS, value=jnp.asarray(1.0)
      )
    # The same three window means, stepped by the bare optimizer.
    inner_state = inner.init(PARAMS)
    for window in range(3):
      mean = jax.tree.map(
        lambda a, b: (a + b) / 2, gradient(2 * window), gradient(2 * window + 1)
      )
      _, inner_state = inner.update(
        mean, inner_state, PARAMS, value=jnp.asarray(1.0)
      )
    chex.assert_trees_all_close(state.inner_state, inner_state)
    self.assertLess(float(state.inner_state[1].scale), 1.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_inside_optax_chain_on_either_side(self):
    grads = [gradient(step) for step in range(4)]
    outer_first = optax.chain(
      optax.scale(2.0), ga_optax.accumulate(optax.sgd(0.1), 2)
    )
    outer_last = optax.chain(
      ga_optax.accumulate(optax.sgd(0.1), 2), optax.scale(2.0)
    )
    for tx in (outer_first, outer_last):
      update = self.variant(tx.update)
      state = tx.init(PARAMS)
      emitted_updates = []
      for grad in grads:
        updates, state = update(grad, state, PARAMS, weight=1.0)
        if ga_optax.emitted(state):
          emitted_updates.append(updates)
      self.assertLen(emitted_updates, 2)
      for window, updates in enumerate(emitted_updates):
        mean = jax.tree.map(
          lambda a, b: (a + b) / 2, *grads[2 * window : 2 * window + 2]
        )
        chex.assert_trees_all_close(updates, optax.tree.scale(-0.2, mean))

  @chex.variants(with_jit=True, without_jit=True)
  def test_weighted_mean_and_sum(self):
    weights = [1.0, 3.0, 4.0]
    grads = [gradient(step) for step in range(3)]
    weighted_sum = jax.tree.map(
      lambda *gs: sum(w * g for w, g in zip(weights, gs, strict=True)), *grads
    )
    for reduction, expected in (
      ("mean", optax.tree.scale(1 / sum(weights), weighted_sum)),
      ("sum", weighted_sum),
    ):
      tx = ga_optax.accumulate(optax.sgd(-1.0), 3, reduction=reduction)
      update = self.variant(tx.update)
      state = tx.init(PARAMS)
      for grad, weight in zip(grads, weights, strict=True):
        updates, state = update(grad, state, PARAMS, weight=weight)
      chex.assert_trees_all_close(updates, expected, rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_flush_closes_a_partial_window_normalised_by_what_it_holds(self):
    tx = ga_optax.accumulate(optax.sgd(-1.0), 4)
    update = self.variant(tx.update)
    state = tx.init(PARAMS)
    _, state = update(gradient(0), state, PARAMS, weight=2.0)
    updates, state = update(
      gradient(1), state, PARAMS, weight=6.0, flush=jnp.asarray(True)
    )
    expected = jax.tree.map(
      lambda a, b: (2 * a + 6 * b) / 8, gradient(0), gradient(1)
    )
    chex.assert_trees_all_close(updates, expected, rtol=1e-6)
    self.assertTrue(ga_optax.emitted(state))
    self.assertEqual(int(state.micro_step), 0)
    self.assertEqual(float(state.weight_sum), 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_flushing_an_empty_window_emits_zeros_without_a_step(self):
    tx = ga_optax.accumulate(counting_optimizer(), 2)
    update = self.variant(tx.update)
    state = tx.init(PARAMS)
    _, state = update(gradient(0), state, PARAMS)
    _, state = update(gradient(1), state, PARAMS)
    self.assertEqual(int(state.update_step), 1)
    # A zero-weight flush call adds nothing: the window it closes is empty.
    updates, state = update(gradient(2), state, PARAMS, weight=0, flush=True)
    chex.assert_trees_all_equal(updates, optax.tree.zeros_like(PARAMS))
    self.assertFalse(ga_optax.emitted(state))
    self.assertEqual(int(state.update_step), 1)
    self.assertEqual(int(state.inner_state["calls"]), 1)

  def test_accumulator_dtype_float32_for_bfloat16_gradients(self):
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
    tx = ga_optax.accumulate(optax.sgd(-1.0), 8)
    state = tx.init(params)
    chex.assert_trees_all_equal_dtypes(
      state.accumulator, jax.tree.map(lambda p: p.astype(jnp.float32), params)
    )
    # 1 + 7 * 2**-9 is exact in float32 but rounds to 1 in bfloat16.
    tiny = jnp.asarray(2.0**-9, jnp.bfloat16)
    grads = [optax.tree.ones_like(params)] + [
      jax.tree.map(lambda p: jnp.full_like(p, tiny), params)
    ] * 7
    for grad in grads:
      updates, state = tx.update(grad, state, params)
    chex.assert_trees_all_equal_dtypes(updates, params)
    expected = (1 + 7 * 2.0**-9) / 8
    chex.assert_trees_all_close(
      jax.tree.map(lambda u: u.astype(jnp.float32), updates),
      jax.tree.map(lambda p: jnp.full(p.shape, expected), params),
      rtol=2**-8,
    )

  def test_every_k_callable_and_dict_are_counted_in_applied_updates(self):
    for every_k in (
      {0: 3, 1: 1, 3: 2},
      lambda n: jnp.where(n < 1, 3, 1 + (n >= 3)),
    ):
      tx = ga_optax.accumulate(optax.sgd(1.0), every_k)
      state = tx.init(PARAMS)
      closing = []
      for step in range(10):
        _, state = tx.update(gradient(step), state, PARAMS)
        closing.append(bool(ga_optax.emitted(state)))
      # k = 3 for update 0, k = 1 for updates 1 and 2, then k = 2.
      self.assertEqual(
        closing,
        [False, False, True, True, True, False, True, False, True, False],
      )

  def test_traced_weight_and_flush(self):
    tx = ga_optax.accumulate(optax.sgd(-1.0), 5)

    @jax.jit
    def step(grads, state, weight, flush):
      return tx.update(grads, state, PARAMS, weight=weight, flush=flush)

    state = tx.init(PARAMS)
    _, state = step(gradient(0), state, jnp.asarray(1, jnp.int32), False)
    updates, state = step(gradient(1), state, jnp.asarray(3, jnp.int32), True)
    expected = jax.tree.map(
      lambda a, b: (a + 3 * b) / 4, gradient(0), gradient(1)
    )
    chex.assert_trees_all_close(updates, expected, rtol=1e-6)

  def test_state_fields_and_dtypes(self):
    state = ga_optax.accumulate(optax.adam(1e-3), 4).init(PARAMS)
    self.assertIsInstance(state, ga_optax.AccumulateState)
    self.assertEqual(state.micro_step.dtype, jnp.int32)
    self.assertEqual(state.update_step.dtype, jnp.int32)
    self.assertEqual(state.num_skipped.dtype, jnp.int32)
    self.assertEqual(state.emitted.dtype, jnp.bool_)
    self.assertEqual(state.weight_sum.dtype, jnp.float32)
    chex.assert_trees_all_equal_shapes(state.accumulator, PARAMS)

  def test_skip_nonfinite_drops_the_micro_step_whole(self):
    tx = ga_optax.accumulate(counting_optimizer(), 2, skip_nonfinite=True)
    state = tx.init(PARAMS)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), gradient(9))
    _, state = tx.update(gradient(0), state, PARAMS)
    _, state = tx.update(bad, state, PARAMS, weight=5.0)
    self.assertFalse(ga_optax.emitted(state))
    self.assertEqual(int(state.num_skipped), 1)
    self.assertEqual(int(state.micro_step), 1)
    updates, state = tx.update(gradient(1), state, PARAMS)
    self.assertTrue(ga_optax.emitted(state))
    mean = jax.tree.map(lambda a, b: (a + b) / 2, gradient(0), gradient(1))
    chex.assert_trees_all_close(updates, optax.tree.scale(-1.0, mean))

  def test_emitted_needs_exactly_one_accumulate_state(self):
    with pytest.raises(ValueError, match="exactly one AccumulateState"):
      ga_optax.emitted(optax.adam(1e-3).init(PARAMS))
    state = ga_optax.accumulate(optax.sgd(1.0), 2).init(PARAMS)
    with pytest.raises(ValueError, match="found 2"):
      ga_optax.emitted((state, state))


def test_updates_have_the_inner_updates_dtype_on_every_micro_step():
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  tx = ga_optax.accumulate(optax.adam(1e-2), 2)
  state = tx.init(params)
  for _ in range(2):
    updates, state = tx.update(params, state, params)
    assert updates["w"].dtype == jnp.bfloat16
  np.testing.assert_array_less(np.asarray(updates["w"], np.float32), 0.0)


# A scalar parameter's accumulator is cleared at every close as a
# parameter-sized one is (its zeros are made apart from the others').

SCALAR_GRADS = [
  {"w": np.asarray([1.0, -2.0], np.float32), "s": np.float32(step + 1.5)}
  for step in range(4)
]


@pytest.mark.parametrize("schedule", ["device", "host"])
def test_a_scalar_parameters_accumulator_is_cleared_at_each_close(schedule):
  tx = ga_optax.accumulate(optax.sgd(0.5), 2)
  params = {"w": jnp.zeros(2), "s": jnp.zeros(())}

  @jax.jit
  def two_windows(params):
    state = tx.init(params)
    for index, grads in enumerate(SCALAR_GRADS):
      options = {"closing": index % 2 == 1} if schedule == "host" else {}
      updates, state = tx.update(grads, state, params, **options)
      params = optax.apply_updates(params, updates)
    return params

  final = two_windows(params)
  # NumPy: SGD on each window's mean gradient, from zeros.
  expected = {"w": np.zeros(2), "s": 0.0}
  for window in (SCALAR_GRADS[:2], SCALAR_GRADS[2:]):
    for name in expected:
      expected[name] = expected[name] - 0.5 * np.mean(
        [grads[name] for grads in window], axis=0
      )
  assert expected["s"] == -0.5 * (2.0 + 4.0)
  chex.assert_tree_all_finite(final)
  np.testing.assert_allclose(final["w"], expected["w"], rtol=1e-6)
  np.testing.assert_allclose(final["s"], expected["s"], rtol=1e-6)
