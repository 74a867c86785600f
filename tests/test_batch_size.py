"""Tests of suggested_k, warmup_schedule and goodput_k.

Each is checked against a reference written another way: suggested_k
against the power of two nearest the ratio by log distance, found by
search; warmup_schedule against k as the running maximum of what each
reading alone supports, and against the loop the docs used to show;
goodput_k against NumPy's exhaustive evaluation of the goodput, and
against the goodput's closed-form peak.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import ga_optax

NAN, INF = float("nan"), float("inf")


def noise_scale_of(b_simple: float) -> ga_optax.NoiseScale:
  # float64: 1e300 stays finite.
  return ga_optax.NoiseScale(
    b_simple=np.float64(b_simple),
    grad_sq=np.float64(1.0),
    trace_sigma=np.float64(b_simple),
    windows=np.int32(10),
  )


# suggested_k


def nearest_power_of_two(ratio: float, max_k: int) -> int:
  """The power of two in [1, max_k] nearest ratio in log distance."""
  candidates = [2**exponent for exponent in range(max_k.bit_length())]
  return min(candidates, key=lambda k: abs(math.log(ratio) - math.log(k)))


@pytest.mark.parametrize(
  ("ratio", "expected"),
  [(7.9, 8), (5.5, 4), (1.0, 1), (1.4, 1), (1.5, 2), (11.0, 8), (12.0, 16)],
)
def test_suggested_k_rounds_on_a_log_scale(ratio, expected):
  # 7.9 is nearer 8 than 4 (the old snippet floored it to 4); 5.5 is below
  # the geometric midpoint 4 * sqrt(2) = 5.66 of 4 and 8.
  assert ga_optax.batch_size.suggested_k(ratio * 16, 16, max_k=64) == expected


def test_suggested_k_boundary_is_k_times_sqrt_two():
  boundary = 4 * math.sqrt(2)
  assert ga_optax.batch_size.suggested_k(boundary * 0.999, 1, max_k=64) == 4
  assert ga_optax.batch_size.suggested_k(boundary * 1.001, 1, max_k=64) == 8


@pytest.mark.parametrize("k", [1, 4, 2**20])
def test_suggested_k_tie_at_k_sqrt_two_rounds_up(k):
  # The documented tie: log2 of the ratio is n + 0.5, which Python's round
  # sends to the even n (4 sqrt 2 would give 4, not 8).
  for items in (1, 16, 2.5):
    assert ga_optax.batch_size.suggested_k(
      k * math.sqrt(2) * items, items, max_k=2**30
    ) == (2 * k)


@pytest.mark.parametrize(
  "function",
  [
    lambda b: ga_optax.batch_size.suggested_k(b, 16, max_k=32),
    lambda b: ga_optax.batch_size.warmup_schedule([(3, b)], 16, 1, 8),
    lambda b: ga_optax.batch_size.goodput_k(
      b,
      items_per_micro_step=8,
      micro_step_seconds=0.1,
      closing_seconds=1.0,
      base_batch=8,
      max_k=64,
    ),
  ],
  ids=["suggested_k", "warmup_schedule", "goodput_k"],
)
@pytest.mark.parametrize("b_simple", [-5.0, -INF, -1e-30])
def test_a_negative_b_simple_is_refused(function, b_simple):
  # Negative could be a tr(Sigma) below 0 (no noise) or a |G|^2 below 0
  # (larger than any batch): opposite answers. noise_scale never gives one.
  with pytest.raises(ValueError, match="B_simple must not be negative"):
    function(b_simple)
  with pytest.raises(ValueError, match="B_simple must not be negative"):
    function(noise_scale_of(b_simple))


@settings(max_examples=300, deadline=None)
@given(
  log_ratio=st.floats(-12, 40),
  max_exponent=st.integers(0, 30),
  items=st.sampled_from([1, 3, 16, 1000.5]),
)
def test_suggested_k_is_the_nearest_power_of_two(
  log_ratio, max_exponent, items
):
  ratio = 2.0**log_ratio
  # Exactly between two powers the two rules may round apart.
  assume(abs(log_ratio - math.floor(log_ratio) - 0.5) > 1e-9)
  max_k = 2**max_exponent
  assert ga_optax.batch_size.suggested_k(ratio * items, items, max_k) == (
    nearest_power_of_two(ratio, max_k)
  )


@pytest.mark.parametrize(
  ("b_simple", "expected"),
  [
    (NAN, 1),  # nothing measured: no reason to accumulate
    (INF, 32),  # |G|^2 averaged to 0 or below: larger than any batch
    (0.0, 1),  # tr(Sigma) averaged to 0 or below: no measurable noise
    (1e-300, 1),
    (1e300, 32),
  ],
)
def test_suggested_k_at_the_edges(b_simple, expected):
  assert ga_optax.batch_size.suggested_k(b_simple, 16, max_k=32) == expected
  assert (
    ga_optax.batch_size.suggested_k(noise_scale_of(b_simple), 16, 32)
    == expected
  )


def test_suggested_k_takes_a_noise_scale_or_any_real_scalar():
  b_simple = 126.4
  for value in (
    noise_scale_of(b_simple),
    b_simple,
    np.float32(b_simple),
    np.float64(b_simple),
    jnp.float32(b_simple),
    np.asarray(b_simple),
    126,
  ):
    assert ga_optax.batch_size.suggested_k(value, 16, max_k=64) == 8, value


def test_suggested_k_reads_the_state():
  tx = ga_optax.accumulate(optax.sgd(0.0), 2, noise_scale_decay=0.0)
  params = jnp.zeros(2)
  state = tx.init(params)
  # One window of g = (1, 1) and (3, 1), weight 1 each: W = 2, G = (2, 1),
  # tr(Sigma) = (|g_1|^2 + |g_2|^2 - W |G|^2) / (K - 1) = (2 + 10 - 10) / 1
  # = 2 and |G|^2 estimate = 5 - 2 / W = 4: B_simple = 0.5 micro-batches,
  # 8 micro-steps of 1/16 of a micro-batch.
  for grad in ([1.0, 1.0], [3.0, 1.0]):
    _, state = tx.update(jnp.array(grad), state, params)
  estimate = ga_optax.noise_scale(state)
  assert float(estimate.b_simple) == 0.5
  assert ga_optax.batch_size.suggested_k(estimate, 1 / 16, max_k=64) == 8


@pytest.mark.parametrize(
  ("kwargs", "error", "pattern"),
  [
    ({"noise_scale": "big"}, TypeError, "noise_scale must be a"),
    ({"noise_scale": True}, TypeError, "noise_scale must be a"),
    ({"noise_scale": 1 + 2j}, TypeError, "noise_scale must be a"),
    ({"noise_scale": jnp.ones(2)}, TypeError, r"noise_scale .*shape \(2,\)"),
    ({"noise_scale": jnp.bool_(True)}, TypeError, "noise_scale must be a"),
    ({"items_per_micro_step": 0}, ValueError, "items_per_micro_step .*got 0"),
    ({"items_per_micro_step": -2.0}, ValueError, "items_per_micro_step"),
    ({"items_per_micro_step": INF}, ValueError, "items_per_micro_step"),
    ({"items_per_micro_step": NAN}, ValueError, "items_per_micro_step"),
    ({"items_per_micro_step": "16"}, TypeError, "items_per_micro_step"),
    ({"items_per_micro_step": True}, TypeError, "items_per_micro_step"),
    ({"max_k": 48}, ValueError, "max_k must be a power of two.*32 and 64"),
    ({"max_k": 0}, ValueError, "max_k must be a positive int"),
    ({"max_k": 8.0}, TypeError, "max_k must be a positive int"),
    ({"max_k": True}, TypeError, "max_k must be a positive int"),
    ({"max_k": 2**31}, ValueError, r"max_k must be at most 2\*\*30"),
  ],
)
def test_suggested_k_bad_input_names_the_argument(kwargs, error, pattern):
  arguments = {"noise_scale": 100.0, "items_per_micro_step": 16, "max_k": 64}
  with pytest.raises(error, match=pattern):
    ga_optax.batch_size.suggested_k(**(arguments | kwargs))


def test_suggested_k_refuses_a_traced_value():
  @jax.jit
  def inside(b_simple):
    return ga_optax.batch_size.suggested_k(b_simple, 16, 64)

  with pytest.raises(TypeError, match=r"noise_scale .*traced inside jax\.jit"):
    inside(100.0)


# warmup_schedule


def reference_schedule(readings, items, first_k, max_k):
  """k at each update step: the largest first_k * 2**n that some reading so
  far reaches as a doubled batch, as a piecewise-constant dict."""

  def supported(b_simple: float) -> int:
    if math.isnan(b_simple):
      return first_k
    if b_simple == INF:
      return max_k
    k = first_k
    # The k a reading supports: its doubled batch is at most B_simple.
    while 2 * k <= max_k and 2 * k * items <= b_simple:
      k *= 2
    return k

  last = max((step for step, _ in readings), default=0)
  k_at = {}
  for step in range(last + 2):
    k_at[step] = max(
      [first_k] + [supported(b) for s, b in readings if s <= step]
    )
  schedule = {0: k_at[0]}
  schedule.update(
    {step: k for step, k in k_at.items() if step and k != k_at[step - 1]}
  )
  return schedule


def old_docs_snippet(readings, items_per_micro_step, first_k, max_k):
  """The loop the batch-size page showed before the library had one."""
  schedule, k = {0: first_k}, first_k
  for update_step, b_simple in readings:
    while k < max_k and b_simple >= 2 * k * items_per_micro_step:
      k *= 2
      schedule[update_step] = k
  return schedule


def test_warmup_from_a_linearly_growing_noise_scale():
  # B_simple = 10 + 3 u at update u, micro-steps of 16: k = 2 doubles at
  # 2 * 2 * 16 = 64 (u = 18), 4 at 128 (u >= 39.3: 40), 8 at 256 (u = 82),
  # and stops at max_k = 16.
  readings = [(u, 10.0 + 3.0 * u) for u in range(1, 200)]
  schedule = ga_optax.batch_size.warmup_schedule(
    readings, 16, first_k=2, max_k=16
  )
  assert schedule == {0: 2, 18: 4, 40: 8, 82: 16}
  assert list(schedule) == sorted(schedule)


def test_one_reading_can_double_k_several_times():
  # 300 / 16 = 18.75 micro-steps: 2 -> 4 -> 8 -> 16 (32 would need 512).
  schedule = ga_optax.batch_size.warmup_schedule(
    [(5, 300.0)], 16, first_k=2, max_k=64
  )
  assert schedule == {0: 2, 5: 16}


def test_warmup_readings_that_carry_no_information_or_say_large():
  readings = [(1, NAN), (2, 40.0), (3, NAN), (4, INF), (5, 10.0)]
  assert ga_optax.batch_size.warmup_schedule(readings, 16, 1, 8) == {
    0: 1,
    2: 2,
    4: 8,
  }
  assert ga_optax.batch_size.warmup_schedule([(3, 0.0)], 16, 1, 8) == {0: 1}
  assert ga_optax.batch_size.warmup_schedule([(3, NAN)], 16, 1, 8) == {0: 1}
  assert ga_optax.batch_size.warmup_schedule([], 16, 4, 4) == {0: 4}


def test_warmup_readings_in_any_order_and_at_step_zero():
  readings = [(9, 200.0), (0, 40.0), (4, 70.0), (4, 10.0)]
  assert ga_optax.batch_size.warmup_schedule(readings, 16, 1, 16) == {
    0: 2,
    4: 4,
    9: 8,
  }
  assert ga_optax.batch_size.warmup_schedule(
    readings, 16, 1, 16
  ) == ga_optax.batch_size.warmup_schedule(sorted(readings), 16, 1, 16)


def test_warmup_takes_what_the_state_gives():
  readings = [
    (jnp.int32(3), noise_scale_of(70.0)),
    (np.int64(6), jnp.float32(130.0)),
  ]
  assert ga_optax.batch_size.warmup_schedule(readings, 16, 2, 8) == {
    0: 2,
    3: 4,
    6: 8,
  }


b_simple_values = st.one_of(
  st.floats(0, 2000),
  st.sampled_from([NAN, INF, 0.0]),
)


@settings(max_examples=300, deadline=None)
@given(
  readings=st.lists(st.tuples(st.integers(0, 60), b_simple_values)),
  items=st.sampled_from([1, 4, 16, 2.5]),
  first_k=st.integers(1, 5),
  doublings=st.integers(0, 6),
)
def test_warmup_matches_the_running_maximum(
  readings, items, first_k, doublings
):
  max_k = first_k * 2**doublings
  schedule = ga_optax.batch_size.warmup_schedule(
    readings, items, first_k, max_k
  )
  assert schedule == reference_schedule(readings, items, first_k, max_k)
  assert list(schedule) == sorted(schedule)


@settings(max_examples=200, deadline=None)
@given(
  values=st.lists(st.one_of(st.floats(0, 2000), st.just(NAN)), max_size=40),
  first_k=st.integers(1, 5),
  doublings=st.integers(0, 6),
)
def test_warmup_matches_the_old_docs_snippet(values, first_k, doublings):
  # The old loop is right when the readings are in order, non-negative
  # and max_k is first_k * 2**n.
  readings = list(enumerate(values, start=1))
  max_k = first_k * 2**doublings
  assert ga_optax.batch_size.warmup_schedule(
    readings, 16, first_k, max_k
  ) == old_docs_snippet(readings, 16, first_k, max_k)


def test_a_warmup_schedule_is_an_every_k():
  # k = 2 for the first 2 updates, then 4.
  schedule = ga_optax.batch_size.warmup_schedule(
    [(2, 70.0)], 16, first_k=2, max_k=4
  )
  assert schedule == {0: 2, 2: 4}
  tx = ga_optax.accumulate(optax.sgd(1.0), every_k=schedule)
  params = jnp.zeros(3)
  state = tx.init(params)
  rng = np.random.default_rng(0)
  grads = rng.normal(size=(12, 3)).astype(np.float32)
  # Windows of 2, 2, 4, 4 micro-steps: they close after 2, 4, 8 and 12.
  window_ends = [2, 4, 8, 12]
  window_starts = [0, *window_ends[:-1]]
  for micro_step, grad in enumerate(grads, start=1):
    updates, state = tx.update(jnp.asarray(grad), state, params)
    assert bool(ga_optax.emitted(state)) == (micro_step in window_ends)
    if micro_step in window_ends:
      start = window_starts[window_ends.index(micro_step)]
      expected = -grads[start:micro_step].mean(axis=0)
      np.testing.assert_allclose(updates, expected, rtol=1e-6, atol=1e-7)
    else:
      np.testing.assert_array_equal(updates, np.zeros(3))
  assert int(ga_optax.applied_updates(state)) == 4


@pytest.mark.parametrize(
  ("args", "error", "pattern"),
  [
    (([(1,)], 16, 2, 8), TypeError, re.escape("readings[0] must be a pair")),
    ((7, 16, 2, 8), TypeError, "readings must be an iterable"),
    (
      ([(1, 5.0), (2.0, 3.0)], 16, 2, 8),
      TypeError,
      re.escape("readings[1]'s update_step must be an int"),
    ),
    (
      ([(True, 5.0)], 16, 2, 8),
      TypeError,
      re.escape("readings[0]'s update_step"),
    ),
    (
      ([(-1, 5.0)], 16, 2, 8),
      ValueError,
      re.escape("readings[0]'s update_step must be in [0, 2**31 - 1]"),
    ),
    (
      ([(1, "high")], 16, 2, 8),
      TypeError,
      re.escape("readings[0]'s B_simple must be a"),
    ),
    (([], 0, 2, 8), ValueError, "items_per_micro_step"),
    (([], 16, 0, 8), ValueError, "first_k must be a positive int"),
    (([], 16, 2.0, 8), TypeError, "first_k must be a positive int"),
    (([], 16, 4, 2), ValueError, "max_k must be at least first_k=4"),
    (
      ([], 16, 3, 20),
      ValueError,
      "max_k must be first_k=3 times a power of two.*got 20, between 12 and 24",
    ),
    (([], 16, 1, 2**31), ValueError, r"max_k must be at most 2\*\*31 - 1"),
  ],
)
def test_warmup_bad_input_names_the_argument(args, error, pattern):
  with pytest.raises(error, match=pattern):
    ga_optax.batch_size.warmup_schedule(*args)


# goodput_k


def numpy_goodput(b_simple, items, micro_step, closing, base, ks):
  """Pollux's goodput of each k, evaluated one k at a time in NumPy."""
  ks = np.asarray(ks, np.float64)
  throughput = ks * items / (ks * micro_step + closing)
  if b_simple == INF:
    efficiency = np.ones_like(ks)
  else:
    efficiency = (b_simple + base) / (b_simple + ks * items)
  return throughput * efficiency


def powers_of_two(max_k):
  return [2**exponent for exponent in range(max_k.bit_length())]


goodput_cases = st.fixed_dictionaries(
  {
    "b_simple": st.floats(0, 1e6),
    "items": st.floats(0.5, 4096),
    "micro_step": st.floats(1e-4, 10),
    "closing": st.floats(0, 100),
    "base": st.floats(1, 4096),
    "max_exponent": st.integers(0, 16),
  }
)


def goodput_k_of(case):
  return ga_optax.batch_size.goodput_k(
    case["b_simple"],
    items_per_micro_step=case["items"],
    micro_step_seconds=case["micro_step"],
    closing_seconds=case["closing"],
    base_batch=case["base"],
    max_k=2 ** case["max_exponent"],
  )


@settings(max_examples=300, deadline=None)
@given(case=goodput_cases)
def test_goodput_k_is_the_exhaustive_best_power_of_two(case):
  ks = powers_of_two(2 ** case["max_exponent"])
  goodput = numpy_goodput(
    case["b_simple"],
    case["items"],
    case["micro_step"],
    case["closing"],
    case["base"],
    ks,
  )
  chosen = goodput_k_of(case)
  assert chosen in ks
  assert goodput[ks.index(chosen)] >= goodput.max() * (1 - 1e-12)


@settings(max_examples=200, deadline=None)
@given(case=goodput_cases)
def test_goodput_k_brackets_the_closed_form_peak(case):
  # goodput(k) is k / ((k t + c)(B + k m)) times a constant: its derivative
  # vanishes at k^2 = c B / (t m), and it rises before and falls after.
  max_k = 2 ** case["max_exponent"]
  peak = math.sqrt(
    case["closing"] / case["micro_step"] * case["b_simple"] / case["items"]
  )
  if peak <= 1:
    assert goodput_k_of(case) == 1
    return
  below = 2 ** math.floor(math.log2(min(peak, max_k)))
  assert goodput_k_of(case) in {below, min(2 * below, max_k)}


def doubling_rule(closing_share, micro_steps_in_b_simple, max_k):
  """The k where doubling stops paying: k -> 2k raises the goodput exactly
  when (c / t)(B / m) > 2 k^2 (from goodput(2k) > goodput(k), with goodput
  proportional to k / ((k t + c)(B + k m)))."""
  k = 1
  while 2 * k <= max_k and closing_share * micro_steps_in_b_simple > 2 * k * k:
    k *= 2
  return k


def test_doubling_pays_exactly_when_the_closing_share_passes_two_k_squared():
  # With t = m = 1, B = 100: going from k to 2k pays when c * 100 > 2 k^2.
  # c B = 32.32 > 2 * 4**2 = 32: 4 -> 8 pays, 8 -> 16 (128) does not.
  for c_times_b, expected in [(32.32, 8), (31.68, 4), (8.08, 4), (7.92, 2)]:
    assert doubling_rule(c_times_b / 100, 100, 1024) == expected
    k = ga_optax.batch_size.goodput_k(
      100.0,
      items_per_micro_step=1,
      micro_step_seconds=1.0,
      closing_seconds=c_times_b / 100,
      base_batch=1,
      max_k=1024,
    )
    assert k == expected, c_times_b


@settings(max_examples=300, deadline=None)
@given(case=goodput_cases)
def test_goodput_k_follows_the_doubling_rule(case):
  share_times_ratio = (
    case["closing"] / case["micro_step"] * case["b_simple"] / case["items"]
  )
  # Where the rule's product is within rounding of 2 k^2, both k are right.
  assume(
    all(
      abs(share_times_ratio - 2 * 4**exponent) > 1e-9 * (1 + share_times_ratio)
      for exponent in range(17)
    )
  )
  expected = doubling_rule(
    case["closing"] / case["micro_step"],
    case["b_simple"] / case["items"],
    2 ** case["max_exponent"],
  )
  assert goodput_k_of(case) == expected


@settings(max_examples=200, deadline=None)
@given(case=goodput_cases, other_base=st.floats(1, 4096))
def test_base_batch_does_not_move_the_choice(case, other_base):
  # Efficiency's numerator B + base_batch is the same for every k.
  ks = powers_of_two(2 ** case["max_exponent"])
  goodput = numpy_goodput(
    case["b_simple"], case["items"], case["micro_step"], case["closing"], 1, ks
  )
  best = sorted(goodput)[-2:]
  # Near-ties may fall either way under rounding.
  assume(len(best) < 2 or best[1] > best[0] * (1 + 1e-9))
  assert goodput_k_of(case) == goodput_k_of(case | {"base": other_base})


@settings(max_examples=100, deadline=None)
@given(case=goodput_cases.filter(lambda case: case["max_exponent"] <= 10))
def test_powers_of_two_keep_94_percent_of_the_best_integer(case):
  # The best power of two is within sqrt(2) of the peak, where the goodput
  # is at least 2 r / (r^2 + 1) = 2 sqrt(2) / 3 of the peak's.
  max_k = 2 ** case["max_exponent"]
  every_k = list(range(1, max_k + 1))
  goodput = numpy_goodput(
    case["b_simple"],
    case["items"],
    case["micro_step"],
    case["closing"],
    case["base"],
    every_k,
  )
  chosen = goodput[goodput_k_of(case) - 1]
  assert chosen >= 2 * math.sqrt(2) / 3 * goodput.max() * (1 - 1e-12)


@pytest.mark.parametrize(
  ("b_simple", "closing", "expected"),
  [
    (NAN, 1.0, 1),  # nothing measured yet
    (0.0, 1.0, 1),  # no noise: efficiency falls as fast as throughput rises
    (INF, 1.0, 64),  # efficiency 1 everywhere; throughput rises with k
    (INF, 0.0, 1),  # nothing to gain: all k tie, the smaller wins
  ],
)
def test_goodput_k_at_the_edges(b_simple, closing, expected):
  for value in (b_simple, noise_scale_of(b_simple)):
    k = ga_optax.batch_size.goodput_k(
      value,
      items_per_micro_step=8,
      micro_step_seconds=0.1,
      closing_seconds=closing,
      base_batch=8,
      max_k=64,
    )
    assert k == expected


def test_goodput_k_docs_figures():
  # The batch-size page's CPU figures: micro-step 25.38 ms, closing step
  # 42.08 ms, micro-steps of 8 samples.
  micro_step, closing = 0.02538, 0.04208 - 0.02538
  for b_simple in (16.0, 64.0, 1000.0, 4000.0):
    k = ga_optax.batch_size.goodput_k(
      b_simple,
      items_per_micro_step=8,
      micro_step_seconds=micro_step,
      closing_seconds=closing,
      base_batch=8,
      max_k=64,
    )
    assert k == doubling_rule(closing / micro_step, b_simple / 8, 64)


@pytest.mark.parametrize(
  ("kwargs", "error", "pattern"),
  [
    ({"noise_scale": None}, TypeError, "noise_scale must be a"),
    ({"items_per_micro_step": 0}, ValueError, "items_per_micro_step"),
    ({"micro_step_seconds": 0.0}, ValueError, "micro_step_seconds .*positive"),
    ({"micro_step_seconds": INF}, ValueError, "micro_step_seconds"),
    ({"closing_seconds": -0.1}, ValueError, "closing_seconds .*non-negative"),
    ({"closing_seconds": "1"}, TypeError, "closing_seconds"),
    ({"base_batch": 0}, ValueError, "base_batch .*positive"),
    ({"base_batch": NAN}, ValueError, "base_batch"),
    ({"max_k": 12}, ValueError, "max_k must be a power of two.*8 and 16"),
    ({"max_k": 2.0}, TypeError, "max_k must be a positive int"),
  ],
)
def test_goodput_k_bad_input_names_the_argument(kwargs, error, pattern):
  arguments = {
    "noise_scale": 100.0,
    "items_per_micro_step": 8,
    "micro_step_seconds": 0.1,
    "closing_seconds": 0.1,
    "base_batch": 8,
    "max_k": 64,
  }
  arguments |= kwargs
  noise_scale = arguments.pop("noise_scale")
  with pytest.raises(error, match=pattern):
    ga_optax.batch_size.goodput_k(noise_scale, **arguments)
