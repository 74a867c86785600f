"""The batch size, closed loop: adaptive_k and lr_scaling against NumPy.

The reference is the contract written in NumPy: windows of k micro-gradients,
the per-window noise estimates, their debiased moving averages, and the rule
that moves k when a full window closes, once the warm-up's windows are
measured. For fixed micro-gradients and
weights the k of every window and every emitted update (SGD with learning
rate 1: minus the window's weighted mean, times the learning-rate scale)
must equal it, on one device and on 8 (inside ``shard_map``, each device's
gradient a micro-gradient of its own weight; under plain ``jit`` with
``unreduced_axes``, alone and with ZeRO-1, through ``update`` and
``apply``, with the state in device or host memory; every device deciding
the same k). A run saved with orbax mid-window, or just after k changed,
resumes bit-identically; bad configurations are refused by name.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

import ga_optax

DECAY = 0.5
DEVICES = 8
RESOLUTION = 2.0**-10


def flat(tree) -> np.ndarray:
  return np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(tree)])


def reference_run(micro_gradients, weights, rule, *, decay, lr_scaling=None):
  """The contract in NumPy: each window's k, its update, and the next k.

  ``micro_gradients`` is a list of flat arrays, or of lists of flat arrays
  (one per device: each a micro-gradient of its own weight).
  """
  k, first_k = rule["initial_k"], rule["initial_k"]
  grad_sq = trace_sigma = debias = 0.0
  measured_windows = 0
  window: list[tuple[np.ndarray, float]] = []
  steps = 0
  ks, updates = [], []
  for gradient, weight in zip(micro_gradients, weights, strict=True):
    per_device = gradient if isinstance(gradient, list) else [gradient]
    device_weights = weight if isinstance(weight, list) else [weight]
    window += list(zip(per_device, device_weights, strict=True))
    steps += 1
    if steps < k:
      continue
    total = sum(w for _, w in window)
    mean = sum(w * g for g, w in window) / total
    count = len([w for _, w in window if w > 0])
    if count >= 2:
      squares = sum(w * float(g @ g) for g, w in window)
      spread = squares - total * float(mean @ mean)
      # Within float32's rounding of the sums: no measurable noise.
      spread = spread if spread > RESOLUTION * squares else 0.0
      window_trace = spread / (count - 1)
      window_grad_sq = float(mean @ mean) - window_trace / total
      grad_sq = decay * grad_sq + (1 - decay) * window_grad_sq
      trace_sigma = decay * trace_sigma + (1 - decay) * window_trace
      debias = decay * debias + (1 - decay)
      measured_windows += 1
    scale = {None: 1.0, "sqrt": math.sqrt(k / first_k), "linear": k / first_k}
    ks.append(k)
    updates.append(-mean * scale[lr_scaling])
    b_simple = read_b_simple(grad_sq, trace_sigma, debias)
    factor, threshold = rule["factor"], rule["threshold"]
    warmed_up = measured_windows >= rule["warmup_windows"]
    if (
      count < 2
      or (
        warmed_up
        and (b_simple == math.inf or b_simple >= threshold * factor * total)
      )
    ) and k * factor <= rule["max_k"]:
      k *= factor
    elif (
      warmed_up
      and rule.get("min_k")
      and b_simple < total / (threshold * factor)
      and k % factor == 0
      and k // factor >= rule["min_k"]
      and count // factor >= 2
    ):
      k //= factor
    window, steps = [], 0
  return ks, updates


def read_b_simple(grad_sq: float, trace_sigma: float, debias: float) -> float:
  """|G|^2 <= 0: larger than any batch; tr(Sigma) <= 0: no noise; NaN: none."""
  if not debias:
    return math.nan
  if grad_sq <= 0:
    return math.inf
  return trace_sigma / grad_sq if trace_sigma > 0 else 0.0


# The warm-up adaptive_k has when none is asked for.
DEFAULT_WARMUP = ga_optax.batch_size.adaptive_k(2, max_k=2).warmup_windows
RULE = {
  "initial_k": 2,
  "max_k": 8,
  "min_k": 1,
  "factor": 2,
  "threshold": 1.0,
  "warmup_windows": DEFAULT_WARMUP,
}


def phased_gradients(rng, count, shape=(4,)):
  """Noise that swamps the gradient, then a gradient that swamps the noise.

  First, micro-gradients of alternating sign around a small mean (B_simple
  far above any batch, or negative: k must grow); then nearly equal ones
  (B_simple near 0: k must shrink back).
  """
  gradients = []
  for index in range(count):
    if index < count // 2:
      center = 3.0 * (-1.0) ** index
      spread = 0.3
    else:
      center, spread = 5.0, 0.01
    gradients.append(
      (center + spread * rng.normal(size=shape)).astype(np.float32)
    )
  return gradients


def run_accumulate(tx, gradients, weights, *, fused=False):
  params = {"w": jnp.zeros(gradients[0].shape)}
  state = tx.init(params)
  ks, updates = [], []
  step = jax.jit(tx.apply if fused else tx.update)
  for gradient, weight in zip(gradients, weights, strict=True):
    k = int(ga_optax.current_k(state))
    if fused:
      new_params, state = step(params, {"w": gradient}, state, weight=weight)
      update = flat(new_params) - flat(params)
      params = new_params
    else:
      emitted, state = step({"w": gradient}, state, params, weight=weight)
      update = flat(emitted)
    assert np.all(np.isfinite(update))
    if bool(ga_optax.emitted(state)):
      ks.append(k)
      updates.append(update)
  return ks, updates, state


@pytest.mark.parametrize("lr_scaling", [None, "sqrt", "linear"])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply"])
def test_k_and_updates_follow_the_reference(lr_scaling, fused):
  rng = np.random.default_rng(0)
  gradients = phased_gradients(rng, 96)
  weights = [float(w) for w in rng.integers(1, 5, size=96)]
  make = ga_optax.accumulate_and_apply if fused else ga_optax.accumulate
  tx = make(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(2, max_k=8, min_k=1),
    noise_scale_decay=DECAY,
    lr_scaling=lr_scaling,
  )
  ks, updates, _ = run_accumulate(tx, gradients, weights, fused=fused)
  expected_ks, expected_updates = reference_run(
    gradients, weights, RULE, decay=DECAY, lr_scaling=lr_scaling
  )
  assert ks == expected_ks
  # The run is worth checking: k grew to max_k and came back down, to 2:
  # on one device a window of 1 would measure nothing.
  assert max(ks) == 8 and ks[-1] == 2, ks
  for update, expected in zip(updates, expected_updates, strict=True):
    np.testing.assert_allclose(update, expected, rtol=2e-5, atol=1e-6)


def test_lr_scaling_follows_a_dict_schedule_too():
  # sqrt(k / k0) with k0 the first window's k, for any every_k.
  rng = np.random.default_rng(1)
  gradients = [rng.normal(size=3).astype(np.float32) for _ in range(2 + 8)]
  tx = ga_optax.accumulate(optax.sgd(1.0), {0: 2, 1: 8}, lr_scaling="sqrt")
  ks, updates, _ = run_accumulate(tx, gradients, [1.0] * 10)
  assert ks == [2, 8]
  np.testing.assert_allclose(updates[0], -np.mean(gradients[:2], axis=0))
  np.testing.assert_allclose(
    updates[1], -2.0 * np.mean(gradients[2:], axis=0), rtol=1e-6
  )


@pytest.mark.parametrize("lr_scaling", ["sqrt", "linear"])
@pytest.mark.parametrize(
  ("every_k", "window_ks"),
  [
    (ga_optax.batch_size.adaptive_k(2, max_k=8), [2]),
    ({0: 2, 1: 8}, [2, 8]),
  ],
  ids=["adaptive_first_window", "dict_second_window"],
)
def test_a_flushed_window_is_scaled_for_its_k(every_k, window_ks, lr_scaling):
  """The last window is flushed after one micro-step: its update is scaled
  for its k, not for the one micro-step it held (docs/how-to/batch-size.md,
  "Ending a budget"). The reference is Adam itself at the scaled learning
  rate, on each window's mean."""
  learning_rate = 1e-2
  rng = np.random.default_rng(10)
  # Every window full but the last, which holds one micro-step.
  windows = [
    [rng.normal(size=3).astype(np.float32) for _ in range(micro_steps)]
    for micro_steps in [*window_ks[:-1], 1]
  ]
  tx = ga_optax.accumulate(
    optax.adam(learning_rate),
    every_k,
    noise_scale_decay=DECAY,
    lr_scaling=lr_scaling,
  )
  params = {"w": jnp.zeros(3)}
  state = tx.init(params)
  step = jax.jit(tx.update, static_argnames="flush")
  updates = []
  for window_index, window in enumerate(windows):
    for gradient in window:
      flush = window_index == len(windows) - 1
      emitted, state = step({"w": gradient}, state, params, flush=flush)
    assert bool(ga_optax.emitted(state))
    updates.append(flat(emitted))

  reference_state = optax.adam(learning_rate).init(np.zeros(3, np.float32))
  for k, window, update in zip(window_ks, windows, updates, strict=True):
    ratio = k / window_ks[0]
    scale = math.sqrt(ratio) if lr_scaling == "sqrt" else ratio
    # Adam's moments do not depend on its learning rate: one state serves
    # each window's optimizer.
    expected, reference_state = optax.adam(learning_rate * scale).update(
      np.mean(window, axis=0), reference_state
    )
    np.testing.assert_allclose(update, expected, rtol=1e-5, atol=1e-8)


def test_a_flushed_window_does_not_move_k():
  rng = np.random.default_rng(2)
  # No warm-up: the first window's reading decides.
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(2, max_k=8, warmup_windows=1),
    noise_scale_decay=0.0,
  )
  params = {"w": jnp.zeros(4)}
  state = tx.init(params)
  # Pure noise: a full window here would double k.
  for index in range(3):
    gradient = {"w": (3.0 * rng.normal(size=4)).astype(np.float32)}
    _, state = tx.update(gradient, state, params, flush=index == 2)
    if index == 1:
      assert int(ga_optax.current_k(state)) == 4
  assert bool(ga_optax.emitted(state))
  assert int(ga_optax.current_k(state)) == 4


def test_skipped_micro_steps_do_not_count():
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(2, max_k=8, warmup_windows=1),
    noise_scale_decay=0.0,
    skip_nonfinite=True,
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  for gradient in ([1.0, -1.0], [jnp.nan, 0.0], [-1.0, 1.0]):
    _, state = tx.update({"w": jnp.array(gradient)}, state, params)
  # Two kept micro-steps, pure noise: k doubled once, the NaN not counted.
  assert int(ga_optax.num_skipped(state)) == 1
  assert int(ga_optax.applied_updates(state)) == 1
  assert int(ga_optax.current_k(state)) == 4


def run_current_ks(tx, gradients):
  """The k of the open window after each micro-step of ``gradients``."""
  params = {"w": jnp.zeros(gradients[0].shape)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  ks = []
  for gradient in gradients:
    update, state = step({"w": jnp.asarray(gradient)}, state, params)
    assert np.all(np.isfinite(flat(update)))
    ks.append(int(ga_optax.current_k(state)))
  return ks, state


def test_min_k_one_keeps_measuring_on_one_device():
  # Nearly equal gradients (k shrinks), then pure noise (k must follow it
  # up). A window of one micro-gradient measures nothing: had k reached 1,
  # the reading would have stayed where the quiet phase left it.
  rng = np.random.default_rng(7)
  quiet = [(5.0 + 0.01 * rng.normal(size=4)).astype(np.float32)] * 40
  noisy = [(3.0 * rng.normal(size=4)).astype(np.float32) for _ in range(200)]
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(4, max_k=16, min_k=1),
    noise_scale_decay=DECAY,
  )
  ks, _ = run_current_ks(tx, quiet + noisy)
  assert min(ks) == 2, ks
  assert ks[39] == 2 and ks[-1] == 16, ks


def test_a_window_that_measures_nothing_grows_k():
  # k = 1 on one device: the first window holds one micro-gradient.
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(1, max_k=4),
    noise_scale_decay=0.0,
  )
  ks, state = run_current_ks(tx, [np.ones(2, np.float32)] * 3)
  # The window of 2 measured equal gradients: no noise, k stays.
  assert ks == [2, 2, 2]
  assert int(ga_optax.noise_scale(state).windows) == 1


@pytest.mark.parametrize("min_k", [None, 1], ids=["grow_only", "min_k_1"])
def test_noise_free_gradients_never_grow_k(min_k):
  # Micro-gradients that differ by 1e-5 per entry around a mean of squared
  # norm about 8800: the float32 sums cancel to rounding of either sign,
  # which is no measurable noise (B_simple = 0), never "larger than any
  # batch". Every reader agrees.
  rng = np.random.default_rng(8)
  mean = rng.uniform(0.9, 1.15, size=8192).astype(np.float32)
  gradients = [
    mean
    + np.float32(1e-5) * rng.choice([-1.0, 1.0], size=8192).astype(np.float32)
    for _ in range(60)
  ]
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(4, max_k=32, min_k=min_k),
    noise_scale_decay=0.9,
  )
  ks, state = run_current_ks(tx, gradients)
  assert max(ks) == 4, ks
  estimate = ga_optax.noise_scale(state)
  assert int(estimate.windows) > 5
  assert float(estimate.trace_sigma) == 0.0
  assert float(estimate.b_simple) == 0.0
  assert float(estimate.grad_sq) > 8000
  assert ga_optax.batch_size.suggested_k(estimate, 1, max_k=32) == 1
  assert ga_optax.batch_size.warmup_schedule([(3, estimate)], 1, 4, 32) == {
    0: 4
  }
  assert (
    ga_optax.batch_size.goodput_k(
      estimate,
      items_per_micro_step=1,
      micro_step_seconds=1.0,
      closing_seconds=10.0,
      base_batch=1,
      max_k=32,
    )
    == 1
  )


# The rule's edges: a B_simple exactly at the growth threshold, and k that
# factor does not divide.


def test_k_grows_at_exactly_the_threshold():
  # Micro-gradients 4 and 2, weight 1: trace_sigma = 2, grad_sq = 9 - 1 = 8,
  # B_simple = 1/4, all exact. W = 2, factor 2: the threshold 1/16 puts the
  # growth point at exactly 1/4.
  gradients = [np.array([4.0], np.float32), np.array([2.0], np.float32)]
  for threshold, grown in [(1 / 16, 4), (1 / 16 * (1 + 2.0**-20), 2)]:
    tx = ga_optax.accumulate(
      optax.sgd(1.0),
      ga_optax.batch_size.adaptive_k(
        2, max_k=4, threshold=threshold, warmup_windows=1
      ),
      noise_scale_decay=0.0,
    )
    ks, state = run_current_ks(tx, gradients)
    assert float(ga_optax.noise_scale(state).b_simple) == 0.25
    assert ks[-1] == grown, threshold


# A window of 4 micro-gradients 2, 0, 2, 0 of weight 1: mean 1, tr(Sigma)
# 4/3, |G|^2 = 1 - (4/3) / 4 = 2/3, B_simple 2, against W = 4. Repeated,
# every window reads the same.
TWO_FOR_FOUR = [np.array([value], np.float32) for value in (2.0, 0.0, 2.0, 0.0)]


def test_b_simple_is_weighed_against_the_windows_weight_not_k():
  # Windows of 2 micro-gradients 3 + e and 3 - e, each of weight 4, with
  # e^2 = 4.5: tr(Sigma) = 8 e^2 = 36, |G|^2 = 9 - 4.5, B_simple 8. Against
  # W = 8, k grows from 16 (and shrinks below 4): it stays. Against k = 2
  # it would grow from 4.
  spread = math.sqrt(4.5)
  window = [np.array([3.0 + sign * spread], np.float32) for sign in (1, -1)]
  gradients = window * (DEFAULT_WARMUP + 2)
  weights = [4.0] * len(gradients)
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(2, max_k=8, min_k=2),
    noise_scale_decay=DECAY,
  )
  ks, _, state = run_accumulate(tx, gradients, weights)
  rule = {**RULE, "min_k": 2}
  expected_ks, _ = reference_run(gradients, weights, rule, decay=DECAY)
  assert ks == expected_ks
  assert set(ks) == {2}, ks
  b_simple = float(ga_optax.noise_scale(state).b_simple)
  window_weight = 8.0
  assert window_weight / 2 <= b_simple < 2 * window_weight, b_simple


def run_two_for_four(threshold: float) -> tuple[list[int], Any, Any, Any]:
  """Windows of ``TWO_FOR_FOUR`` (B_simple 2, W 4) from k = 4, min_k 2.

  Returns ``(ks, updates, state, expected)``: the run's k per window, its
  updates and final state, and the NumPy rule's ``(ks, updates)``.
  """
  rule = {
    "initial_k": 4,
    "max_k": 8,
    "min_k": 2,
    "factor": 2,
    "threshold": threshold,
    "warmup_windows": DEFAULT_WARMUP,
  }
  gradients = TWO_FOR_FOUR * (DEFAULT_WARMUP + 2)
  weights = [1.0] * len(gradients)
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(4, max_k=8, min_k=2, threshold=threshold),
    noise_scale_decay=DECAY,
  )
  ks, updates, state = run_accumulate(tx, gradients, weights)
  expected = reference_run(gradients, weights, rule, decay=DECAY)
  return ks, updates, state, expected


def test_k_shrinks_only_below_the_batch_over_threshold_times_factor():
  # threshold 2, factor 2: k shrinks below W / 4 = 1 and grows from
  # 4 W = 16; B_simple 2 keeps k.
  ks, _, state, (expected_ks, _) = run_two_for_four(threshold=2.0)
  assert ks == expected_ks
  assert set(ks) == {4}, ks
  b_simple = float(ga_optax.noise_scale(state).b_simple)
  window_weight = 4.0
  assert window_weight / 4 <= b_simple < 4 * window_weight, b_simple


def test_a_reading_that_meets_both_rules_grows_k():
  # threshold 1/8, factor 2: k grows from W / 4 = 1 and shrinks below
  # 4 W = 16, so B_simple 2 meets both; growth is tried first. After the
  # warm-up's windows of 4, the next holds 8.
  ks, updates, _, (expected_ks, expected_updates) = run_two_for_four(
    threshold=0.125
  )
  assert ks == expected_ks
  assert ks == [4] * DEFAULT_WARMUP + [8], ks
  for update, expected in zip(updates, expected_updates, strict=True):
    np.testing.assert_allclose(update, expected, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize(
  ("initial_k", "factor"), [(5, 2), (7, 3)], ids=["5_by_2", "7_by_3"]
)
def test_a_k_that_factor_does_not_divide_does_not_shrink(initial_k, factor):
  # Nearly equal gradients ask k to shrink; k / factor is not an int, and
  # floor division would shrink k to 2.
  rng = np.random.default_rng(9)
  gradients = [
    (5.0 + 0.01 * rng.normal(size=4)).astype(np.float32)
    for _ in range(4 * initial_k)
  ]
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(
      initial_k, max_k=initial_k * factor, min_k=1, factor=factor
    ),
    noise_scale_decay=DECAY,
  )
  ks, state = run_current_ks(tx, gradients)
  assert int(ga_optax.applied_updates(state)) == 4
  assert float(ga_optax.noise_scale(state).b_simple) < 1.0
  assert set(ks) == {initial_k}, ks


def test_factor_and_max_k_at_the_int32_limit_do_not_wrap():
  # k * factor would be 2**31: formed, it wraps to -2**31.
  noise = [np.array(g, np.float32) for g in ([1.0, -1.0], [-1.0, 1.0])] * 3
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(2, max_k=2, factor=2**30, warmup_windows=1),
    noise_scale_decay=0.0,
  )
  ks, _ = run_current_ks(tx, noise)
  assert set(ks) == {2}, ks
  with pytest.warns(UserWarning, match="too few for windows of k = 1073741824"):
    tx = ga_optax.accumulate(
      optax.sgd(1.0),
      ga_optax.batch_size.adaptive_k(1, max_k=2**30, factor=2**30),
      noise_scale_decay=0.0,
    )
  ks, _ = run_current_ks(tx, noise)
  assert set(ks) == {2**30}, ks


# The warm-up: the averages' first windows move nothing.


def noise_gradients(rng, count):
  """Micro-gradients of alternating sign: every even window's mean is
  near 0, its |G|^2 estimate below 0, its B_simple infinite."""
  return [
    (3.0 * (-1.0) ** index + 0.3 * rng.normal(size=4)).astype(np.float32)
    for index in range(count)
  ]


@pytest.mark.parametrize("warmup_windows", [1, 3, None], ids=str)
def test_no_decision_before_the_warm_up_ends(warmup_windows):
  windows = DEFAULT_WARMUP if warmup_windows is None else warmup_windows
  rule = {**RULE, "max_k": 16, "min_k": None, "warmup_windows": windows}
  # The warm-up's windows of 2, then windows of 4, 8 and 16.
  gradients = noise_gradients(np.random.default_rng(11), 2 * windows + 28)
  weights = [1.0] * len(gradients)
  options = {} if warmup_windows is None else {"warmup_windows": windows}
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(2, max_k=16, **options),
    noise_scale_decay=DECAY,
  )
  ks, updates, state = run_accumulate(tx, gradients, weights)
  expected_ks, expected_updates = reference_run(
    gradients, weights, rule, decay=DECAY
  )
  assert ks == expected_ks
  # Every reading asks for growth: the warm-up's windows keep k, the
  # window that ends it doubles k, and so does each one after.
  assert ks == [2] * windows + [4, 8, 16], ks
  assert int(ga_optax.noise_scale(state).windows) == windows + 3
  for update, expected in zip(updates, expected_updates, strict=True):
    np.testing.assert_allclose(update, expected, rtol=2e-5, atol=1e-6)


def test_k_does_not_shrink_during_the_warm_up():
  # Nearly equal micro-gradients: every reading asks k to shrink.
  rng = np.random.default_rng(12)
  gradients = [
    (5.0 + 0.01 * rng.normal(size=4)).astype(np.float32) for _ in range(40)
  ]
  weights = [1.0] * len(gradients)
  rule = {**RULE, "initial_k": 8, "max_k": 8, "min_k": 2, "warmup_windows": 3}
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(8, max_k=8, min_k=2, warmup_windows=3),
    noise_scale_decay=DECAY,
  )
  ks, _, _ = run_accumulate(tx, gradients, weights)
  expected_ks, _ = reference_run(gradients, weights, rule, decay=DECAY)
  assert ks == expected_ks
  assert ks[:4] == [8, 8, 8, 4], ks


def test_a_window_that_measures_nothing_grows_k_during_the_warm_up():
  # k = 1 on one device: the first window measures nothing, so it counts
  # nothing toward the warm-up and grows k; the warm-up's 3 windows of 2
  # follow.
  gradients = noise_gradients(np.random.default_rng(13), 1 + 2 * 3 + 4)
  weights = [1.0] * len(gradients)
  rule = {
    **RULE,
    "initial_k": 1,
    "max_k": 4,
    "min_k": None,
    "warmup_windows": 3,
  }
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(1, max_k=4, warmup_windows=3),
    noise_scale_decay=DECAY,
  )
  ks, _, _ = run_accumulate(tx, gradients, weights)
  expected_ks, _ = reference_run(gradients, weights, rule, decay=DECAY)
  assert ks == expected_ks
  assert ks == [1, 2, 2, 2, 4], ks


# Eight devices inside shard_map: each device's gradient is a micro-gradient
# of its own weight, and every device decides the same k.


@pytest.mark.devices(DEVICES)
def test_every_device_decides_the_same_k_inside_shard_map():
  mesh = jax.make_mesh((DEVICES,), ("data",))
  rng = np.random.default_rng(3)
  steps = 24
  per_device = [phased_gradients(rng, DEVICES) for _ in range(steps)]
  per_device = [
    [g * (1.0 if step < steps // 2 else 0.2) for g in grads]
    for step, grads in enumerate(per_device)
  ]
  weights = [
    [float(w) for w in rng.integers(1, 4, size=DEVICES)] for _ in range(steps)
  ]
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(2, max_k=8, min_k=1),
    noise_scale_decay=DECAY,
    axis_name="data",
  )

  def local_step(params, state, gradient, weight):
    updates, state = tx.update(
      {"w": gradient[0]}, state, params, weight=weight[0]
    )
    return updates, state

  step = jax.jit(
    jax.shard_map(
      local_step,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P(), P()),
      check_vma=False,
    )
  )
  params = {"w": jnp.zeros(4)}
  state = tx.init(params)
  ks, updates = [], []
  with jax.set_mesh(mesh):
    for gradients, device_weights in zip(per_device, weights, strict=True):
      k = int(ga_optax.current_k(state))
      emitted, state = step(
        params,
        state,
        jax.device_put(np.stack(gradients), P("data")),
        jax.device_put(np.asarray(device_weights, np.float32), P("data")),
      )
      decided = {int(shard.data) for shard in state.every_k.addressable_shards}
      assert len(decided) == 1, decided
      if bool(ga_optax.emitted(state)):
        ks.append(k)
        updates.append(flat(emitted))
  expected_ks, expected_updates = reference_run(
    per_device, weights, RULE, decay=DECAY
  )
  assert ks == expected_ks
  assert len(set(ks)) > 1, ks
  for update, expected in zip(updates, expected_updates, strict=True):
    np.testing.assert_allclose(update, expected, rtol=2e-5, atol=1e-6)


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize("host", [False, True], ids=["device", "host_memory"])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply"])
@pytest.mark.parametrize("zero", [False, True], ids=["unreduced", "zero1"])
def test_every_device_decides_the_same_k_under_plain_jit(zero, fused, host):
  """unreduced_axes (and ZeRO-1): each device's partial sum, times D, is a
  micro-gradient of the batch's D-th part; k is one replicated value. The
  loop meets the other modes here: both paths, the state in host memory."""
  mesh = jax.make_mesh(
    (DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,)
  )
  rows_per_device, steps = 2, 24
  rng = np.random.default_rng(6)
  batches = [
    np.stack(phased_gradients(rng, DEVICES * rows_per_device))
    * (1.0 if step < steps // 2 else 0.2)
    for step in range(steps)
  ]

  def loss(params, batch):
    # The gradient is the mean of the rows: each row a chosen gradient.
    return jnp.mean(batch["g"] @ params["w"])

  value_and_grad = ga_optax.unreduced_value_and_grad(
    loss, weight_fn=lambda batch: jnp.float32(batch["g"].shape[0])
  )
  make = ga_optax.accumulate_and_apply if fused else ga_optax.accumulate
  kind = "pinned_host" if host else None
  tx = make(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(2, max_k=8, min_k=1),
    noise_scale_decay=DECAY,
    unreduced_axes="data",
    inner_state_axes="data" if zero else None,
    accumulator_memory_kind=kind,
    inner_state_memory_kind=kind,
  )

  @jax.jit
  def step(params, state, batch):
    _, grads = value_and_grad(params, batch)
    weight = batch["g"].shape[0]
    if fused:
      new_params, state = tx.apply(params, grads, state, weight=weight)
      return jax.tree.map(jnp.subtract, new_params, params), state
    return tx.update(grads, state, params, weight=weight)

  ks, updates = [], []
  with jax.set_mesh(mesh):
    params = jax.device_put({"w": jnp.zeros(4)}, P())
    state = tx.init(params)
    for batch in batches:
      k = int(ga_optax.current_k(state))
      emitted, state = step(
        params, state, jax.device_put({"g": batch}, P("data"))
      )
      assert state.every_k.sharding.is_fully_replicated
      if bool(ga_optax.emitted(state)):
        ks.append(k)
        updates.append(flat(emitted))
  per_device = [
    [
      batch[d * rows_per_device : (d + 1) * rows_per_device].mean(axis=0)
      for d in range(DEVICES)
    ]
    for batch in batches
  ]
  weights = [[float(rows_per_device)] * DEVICES for _ in batches]
  expected_ks, expected_updates = reference_run(
    per_device, weights, RULE, decay=DECAY
  )
  assert ks == expected_ks
  assert len(set(ks)) > 1, ks
  for update, expected in zip(updates, expected_updates, strict=True):
    np.testing.assert_allclose(update, expected, rtol=2e-5, atol=1e-6)


# Checkpoints: k is state.


@pytest.mark.parametrize("stop_after", [5, 6], ids=["mid_window", "at_change"])
def test_a_saved_run_resumes_bit_identically(tmp_path, stop_after):
  rng = np.random.default_rng(4)
  gradients = phased_gradients(rng, 40)
  tx = ga_optax.accumulate(
    optax.adam(1e-2),
    ga_optax.batch_size.adaptive_k(2, max_k=8, min_k=1, warmup_windows=1),
    noise_scale_decay=DECAY,
    lr_scaling="sqrt",
  )
  step = jax.jit(tx.update)
  params = {"w": jnp.zeros(4)}

  def run(state, params, gradients):
    for gradient in gradients:
      updates, state = step({"w": gradient}, state, params)
      params = optax.apply_updates(params, updates)
    return state, params

  unstopped = run(tx.init(params), params, gradients)
  saved = run(tx.init(params), params, gradients[:stop_after])
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "run", saved)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(
      tmp_path / "run",
      jax.tree.map(ocp.utils.to_shape_dtype_struct, (tx.init(params), params)),
    )
  resumed = run(*restored, gradients[stop_after:])
  # The windows so far: 2 and 4 micro-steps (noise doubled k at the first
  # close), so the save after 6 is right after a change and the one after 5
  # is in the middle of a window.
  assert int(ga_optax.current_k(saved[0])) != 2
  for got, want in zip(
    jax.tree.leaves(resumed), jax.tree.leaves(unstopped), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_consolidating_partial_sums_keeps_k():
  tx = ga_optax.accumulate(
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(2, max_k=8),
    noise_scale_decay=0.0,
    axis_name="data",
  )
  state = tx.init({"w": jnp.zeros(3)})._replace(every_k=jnp.int32(4))
  assert int(ga_optax.current_k(ga_optax.planning.consolidate(state))) == 4


# Bad configurations, refused by name.


@pytest.mark.parametrize(
  ("make", "error", "match"),
  [
    (lambda: ga_optax.batch_size.adaptive_k(4, max_k=2), ValueError, "max_k"),
    (
      lambda: ga_optax.batch_size.adaptive_k(4, max_k=6),
      ValueError,
      r"max_k must be initial_k=4 times a power of factor=2 .* Pass max_k=4",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(3, max_k=12, factor=3),
      ValueError,
      r"between 9 and 27",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(2, max_k=2**40),
      ValueError,
      r"max_k must be at most 2\*\*31 - 1",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(2**31, max_k=2**31),
      ValueError,
      r"initial_k must be at most 2\*\*31 - 1",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(2, max_k=2**32, min_k=2**31),
      ValueError,
      r"max_k must be at most 2\*\*31 - 1",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(2, max_k=2, min_k=2**31),
      ValueError,
      r"min_k must be at most 2\*\*31 - 1",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(2, max_k=2, factor=2**31),
      ValueError,
      r"factor must be at most 2\*\*31 - 1",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(4, max_k=8, factor=1),
      ValueError,
      "factor",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(4, max_k=8, factor=2.0),
      TypeError,
      "factor",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(4, max_k=8, min_k=8),
      ValueError,
      "min_k",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(0, max_k=8),
      ValueError,
      "initial_k",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(4, max_k=8, threshold=0.0),
      ValueError,
      "threshold",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(4, max_k=8, warmup_windows=0),
      ValueError,
      r"warmup_windows must be a positive int \(>= 1\), got 0",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(4, max_k=8, warmup_windows=2.0),
      TypeError,
      "warmup_windows must be a positive int, got 2.0",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(4, max_k=8, warmup_windows=True),
      TypeError,
      "warmup_windows",
    ),
    (
      lambda: ga_optax.batch_size.adaptive_k(4, max_k=8, warmup_windows=2**31),
      ValueError,
      r"warmup_windows must be at most 2\*\*31 - 1",
    ),
    (
      lambda: ga_optax.accumulate(
        optax.sgd(1.0), ga_optax.batch_size.adaptive_k(2, max_k=8)
      ),
      ValueError,
      "noise_scale_decay",
    ),
    (
      lambda: ga_optax.accumulate(optax.sgd(1.0), 2, lr_scaling="cubic"),
      ValueError,
      "lr_scaling",
    ),
    (
      lambda: ga_optax.accumulate_and_apply(
        optax.sgd(1.0), 2, lr_scaling="Sqrt"
      ),
      ValueError,
      "lr_scaling",
    ),
  ],
)
def test_bad_configurations_are_refused_by_name(make, error, match):
  with pytest.raises(error, match=match):
    make()
