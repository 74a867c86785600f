"""Gradients in another dtype than the params, on every path.

Mixed precision meets gradient accumulation both ways: float32 gradients of
bfloat16 params (float32 master gradients), bfloat16 gradients of float32
params (a bfloat16 backward pass), float16, and any mix leaf by leaf. For
each direction and each optimizer the contract is the same:

* the updates have the dtypes the wrapped optimizer gives for those
  gradients, on the micro-steps (zeros) as on the window-closing call;
* the state keeps its shapes, dtypes and weak types from call to call,
  across window closes too, so a jitted step compiles once and the state
  donates and checkpoints;
* the numbers are the wrapped optimizer's, applied once per window to the
  window's weighted mean gradient (formed in float32, then cast to the
  gradients' dtype), with its state kept in its own dtypes.

Every comparison can fail: the windows hold unequal total weights and plain
SGD runs beside the scale-free optimizers (Adam, Lion and clipping hide a
wrong gradient scale), each window's step is compared with a tolerance below
the step itself (so a step not taken fails), and the "formed in float32"
claim has windows whose sum a bfloat16 or float16 accumulator cannot hold.

Complex params, last: both window paths accumulate them in their own dtype
and step like Adam on the window's mean gradient, and micro-batching keeps
the imaginary parts of their gradients.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import chex
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ga_optax

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16

EVERY_K = 2
NUM_WINDOWS = 2
# The windows weigh 4 and 8, unequal (a mean normalised by the wrong weight
# shows) and powers of two, so the mean's 1/4 and 1/8 are exact: the
# accumulated mean and the reference's are the same float32 numbers before
# the cast to the grads' dtype, and the comparison measures the optimizer.
WEIGHTS = (1.0, 3.0, 2.0, 6.0)

SHAPES = {"w": (3, 4), "b": (4,)}

# direction: (param dtype per leaf, gradient dtype per leaf)
DIRECTIONS = {
  "f32-grads-of-bf16-params": ({"w": BF16, "b": BF16}, {"w": F32, "b": F32}),
  "bf16-grads-of-f32-params": ({"w": F32, "b": F32}, {"w": BF16, "b": BF16}),
  "f32-grads-of-f16-params": ({"w": F16, "b": F16}, {"w": F32, "b": F32}),
  # Wider and narrower at once: f32 into bf16, and f16 into f32.
  "per-leaf-mix": ({"w": BF16, "b": F32}, {"w": F32, "b": F16}),
}

OPTIMIZERS = {
  # Plain SGD: its step is proportional to the gradient, so a wrong scale
  # shows; the others below all but ignore a constant factor.
  "sgd": lambda: optax.sgd(1e-2),
  # The schedule moves on every applied update, so a stray inner step shows.
  "adam-schedule": lambda: optax.adam(
    optax.exponential_decay(1e-2, transition_steps=1, decay_rate=0.5)
  ),
  "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
  "sgd-momentum": lambda: optax.sgd(1e-2, momentum=0.9),
  # Lion's step is the learning rate per element: 1e-2 keeps it above a
  # bfloat16 parameter's rounding (see _params).
  "lion": lambda: optax.lion(1e-2, weight_decay=0.1),
  "clip-adamw": lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1)
  ),
}

PATHS = ("accumulate", "accumulate_and_apply")


def _eager_cases() -> list[Any]:
  """Every direction on both paths, and every optimizer at least once.

  Direction ``d`` on path ``p`` takes optimizer ``2 * d + p`` (modulo the
  number of optimizers other than plain SGD, which runs beside each of them:
  see test_eagerly). Each eager run compiles its own program (see
  test_eager.py), so the eager runs are this sample of the matrix, not all
  of it.
  """
  optimizers = [name for name in OPTIMIZERS if name != "sgd"]
  return [
    pytest.param(direction, optimizers[(2 * d + p) % len(optimizers)], path)
    for d, direction in enumerate(DIRECTIONS)
    for p, path in enumerate(PATHS)
  ]


def _tolerance(*dtype_trees: Any) -> float:
  """Relative tolerance for results that passed through these dtypes."""
  dtypes = {jnp.dtype(d) for tree in dtype_trees for d in jax.tree.leaves(tree)}
  if jnp.dtype(BF16) in dtypes:
    return 2e-2
  if jnp.dtype(F16) in dtypes:
    return 4e-3
  return 1e-5


def _leaves_like(dtypes: dict[str, Any], seed: int, scale: float) -> Any:
  # NumPy draws: jax.random would compile a program per shape and dtype.
  rng = np.random.default_rng(seed)
  return {
    name: jnp.asarray(scale * rng.standard_normal(SHAPES[name]), dtypes[name])
    for name in sorted(SHAPES)
  }


def _params(direction: str) -> Any:
  # Small params: a bfloat16 parameter below 0.25 rounds to steps of at most
  # 2**-9, five times below the smallest step an optimizer here takes, so a
  # step the accumulation fails to take cannot hide in the rounding.
  return _leaves_like(DIRECTIONS[direction][0], seed=0, scale=0.1)


def _grads_seq(direction: str) -> list[Any]:
  return [
    _leaves_like(DIRECTIONS[direction][1], seed=1 + call, scale=0.5)
    for call in range(EVERY_K * NUM_WINDOWS)
  ]


def _assert_close(actual: Any, expected: Any, rtol: float) -> None:
  """Same tree, dtypes and finite values within ``rtol``.

  chex compares NaN equal to NaN; finiteness is asserted first so that two
  NaN results never pass as equal.
  """
  chex.assert_trees_all_equal_shapes_and_dtypes(actual, expected)
  chex.assert_tree_all_finite(actual)
  chex.assert_tree_all_finite(expected)
  as_f32 = functools.partial(jax.tree.map, lambda leaf: leaf.astype(F32))
  # Updates are of the order of the learning rates (1e-3 .. 1e-2).
  chex.assert_trees_all_close(
    as_f32(actual), as_f32(expected), rtol=rtol, atol=rtol * 1e-2
  )


def _assert_step_close(
  before: Any,
  after: Any,
  expected_before: Any,
  expected_after: Any,
  rtol: float,
) -> None:
  """The params moved by the reference's step, within a tolerance below it.

  Compared in float32, leaf by leaf: ``|step - expected step| <= rtol *
  max|expected step| + ulp``, where ``ulp`` is the spacing of the params'
  dtype at their largest magnitude (one rounding of the updated params).
  The expected step must be at least twice that tolerance, so that params
  that did not move (an update never applied) fail.
  """
  as_f32 = functools.partial(jax.tree.map, lambda leaf: leaf.astype(F32))
  step = jax.tree.map(jnp.subtract, as_f32(after), as_f32(before))
  expected_step = jax.tree.map(
    jnp.subtract, as_f32(expected_after), as_f32(expected_before)
  )
  for path, got, want, param in zip(
    jax.tree_util.tree_leaves_with_path(step),
    jax.tree.leaves(step),
    jax.tree.leaves(expected_step),
    jax.tree.leaves(before),
    strict=True,
  ):
    chex.assert_tree_all_finite((got, want))
    largest = float(jnp.max(jnp.abs(want)))
    ulp = float(jnp.spacing(jnp.max(jnp.abs(param))))
    tolerance = rtol * largest + ulp
    assert largest > 2 * tolerance, (
      f"{path[0]}: the reference's step {largest:.3g} is within the"
      f" tolerance {tolerance:.3g}: a missing step would pass"
    )
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance)


def _avals(tree: Any) -> Any:
  """Shape, dtype and weak type of every leaf: what a jit cache keys on."""
  return jax.tree.map(jax.typeof, tree)


def _reference(inner, params, grads_seq):
  """The wrapped optimizer once per window, on the window's weighted mean.

  Returns the updates of each window and the params after each window. The
  inner state is cast back to its own dtypes after each step, as the
  accumulation keeps it.
  """
  state = inner.init(params)
  window_updates, window_params = [], []
  for window in range(NUM_WINDOWS):
    calls = range(window * EVERY_K, (window + 1) * EVERY_K)
    weight_sum = sum(WEIGHTS[call] for call in calls)

    def mean(*grads, calls=calls, weight_sum=weight_sum):
      total = sum(
        WEIGHTS[call] * grad.astype(F32)
        for call, grad in zip(calls, grads, strict=True)
      )
      return (total / weight_sum).astype(grads[0].dtype)

    mean_grads = jax.tree.map(mean, *[grads_seq[call] for call in calls])
    updates, new_state = inner.update(mean_grads, state, params)
    state = jax.tree.map(
      lambda new, old: jnp.asarray(new).astype(old.dtype), new_state, state
    )
    params = optax.apply_updates(params, updates)
    window_updates.append(updates)
    window_params.append(params)
  return window_updates, window_params


class Run(NamedTuple):
  """One optimizer's run: its first state, and per call what came out."""

  initial_state: Any
  outputs: list[Any]  # updates (accumulate) or new params (fused)
  states: list[Any]


def _runs(
  direction: str, path: str, optimizers: tuple[str, ...], use_jit: bool
) -> dict[str, Run]:
  """Runs the optimizers side by side, each on its own params and state.

  Under jit they share one step, so one program serves all of them: it
  compiles in about half the time of one program per optimizer.
  """
  transformations = {}
  for name in optimizers:
    inner = OPTIMIZERS[name]()
    if path == "accumulate":
      tx = ga_optax.accumulate(inner, EVERY_K)
      transformations[name] = (tx.init, tx.update)
    else:
      fused = ga_optax.accumulate_and_apply(inner, EVERY_K)
      transformations[name] = (
        fused.init,
        lambda grads, state, params, fused=fused, **kwargs: fused.apply(
          params, grads, state, **kwargs
        ),
      )

  def step(grads, states, params, weight):
    results = {
      name: call(grads, states[name], params[name], weight=weight)
      for name, (_, call) in transformations.items()
    }
    return (
      {name: output for name, (output, _) in results.items()},
      {name: state for name, (_, state) in results.items()},
    )

  if use_jit:
    step = jax.jit(step)
  params = {name: _params(direction) for name in optimizers}
  states = {
    name: init(params[name]) for name, (init, _) in transformations.items()
  }
  runs = {name: Run(states[name], [], []) for name in optimizers}
  for index, grads in enumerate(_grads_seq(direction)):
    outputs, states = step(grads, states, params, WEIGHTS[index])
    for name, run in runs.items():
      run.outputs.append(outputs[name])
      run.states.append(states[name])
      params[name] = (
        optax.apply_updates(params[name], outputs[name])
        if path == "accumulate"
        else outputs[name]
      )
  return runs


def _check_run(direction: str, optimizer: str, path: str, run: Run) -> None:
  """Checks one optimizer's run against its contract (module docstring)."""
  params = _params(direction)
  grads_seq = _grads_seq(direction)
  inner = OPTIMIZERS[optimizer]()
  expected_updates, expected_params = _reference(inner, params, grads_seq)
  rtol = _tolerance(*DIRECTIONS[direction])
  updates_like = jax.eval_shape(
    lambda: inner.update(grads_seq[0], inner.init(params), params)[0]
  )

  state_avals = _avals(run.initial_state)
  for index, (output, state) in enumerate(
    zip(run.outputs, run.states, strict=True)
  ):
    assert _avals(state) == state_avals, f"call {index}"
    window, position = divmod(index, EVERY_K)
    closes = position == EVERY_K - 1
    assert bool(ga_optax.emitted(state)) == closes
    before = params
    if path == "accumulate":
      if closes:
        _assert_close(output, expected_updates[window], rtol)
      else:
        chex.assert_trees_all_equal_shapes_and_dtypes(output, updates_like)
        chex.assert_trees_all_equal(output, optax.tree.zeros_like(output))
      params = optax.apply_updates(params, output)
    else:
      chex.assert_trees_all_equal_shapes_and_dtypes(output, params)
      params = output
    if closes:
      _assert_close(params, expected_params[window], rtol)
      expected_before = (
        expected_params[window - 1] if window else _params(direction)
      )
      _assert_step_close(
        before, params, expected_before, expected_params[window], rtol
      )
  assert int(ga_optax.applied_updates(run.states[-1])) == NUM_WINDOWS


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_under_jit_every_optimizer(direction, path):
  # One test for the five optimizers: they share one compiled step, which
  # pytest-xdist could not share between workers if they were five tests.
  runs = _runs(direction, path, tuple(OPTIMIZERS), use_jit=True)
  for optimizer, run in runs.items():
    try:
      _check_run(direction, optimizer, path, run)
    except AssertionError as error:
      raise AssertionError(f"optimizer {optimizer}: {error}") from error


@pytest.mark.parametrize(("direction", "optimizer", "path"), _eager_cases())
def test_eagerly(direction, optimizer, path):
  # Plain SGD beside each sampled optimizer: every eager case would see a
  # wrong gradient scale.
  runs = _runs(direction, path, (optimizer, "sgd"), use_jit=False)
  for name, run in runs.items():
    try:
      _check_run(direction, name, path, run)
    except AssertionError as error:
      raise AssertionError(f"optimizer {name}: {error}") from error


# Micro-batched gradients of low-precision params.

NUM_MICROBATCHES = 4
BATCH_SIZE = 16


def _mean_loss(params, batch):
  prediction = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((prediction - batch["y"]) ** 2)


def _batch() -> dict[str, jax.Array]:
  rng = np.random.default_rng(7)
  return {
    "x": jnp.asarray(rng.standard_normal((BATCH_SIZE, SHAPES["w"][0])), F32),
    "y": jnp.asarray(rng.standard_normal((BATCH_SIZE, SHAPES["w"][1])), F32),
  }


@functools.cache
def _microbatched():
  # One function for all cases: its eager programs are cached by dtypes.
  return ga_optax.microbatched_value_and_grad(_mean_loss, NUM_MICROBATCHES)


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize(
  "param_dtypes",
  [{"w": BF16, "b": BF16}, {"w": F16, "b": F16}, {"w": BF16, "b": F32}],
  ids=["bf16", "f16", "bf16-and-f32"],
)
def test_microbatched_gradients_of_low_precision_params(param_dtypes, use_jit):
  params = _leaves_like(param_dtypes, seed=0, scale=1.0)
  batch = _batch()
  value_and_grad = _microbatched()
  if use_jit:
    value_and_grad = jax.jit(value_and_grad)
  value, grads = value_and_grad(params, batch)

  # Each micro-batch's gradient in the params' dtypes, summed in float32 and
  # rounded to those dtypes once. Micro-batch i is rows i, i + k, ...
  per_microbatch = [
    jax.value_and_grad(_mean_loss)(
      params, jax.tree.map(lambda x, i=i: x[i::NUM_MICROBATCHES], batch)
    )
    for i in range(NUM_MICROBATCHES)
  ]
  expected_value = np.mean([np.float32(v) for v, _ in per_microbatch])
  expected_grads = jax.tree.map(
    lambda *grads: (
      sum(grad.astype(F32) for grad in grads) / NUM_MICROBATCHES
    ).astype(grads[0].dtype),
    *[grads for _, grads in per_microbatch],
  )
  assert value.dtype == F32
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)
  rtol = _tolerance(param_dtypes)
  _assert_close(grads, expected_grads, rtol)
  _assert_close(value, jnp.asarray(expected_value), rtol)

  # And the large batch's float32 gradient, within the params' precision.
  params_f32 = jax.tree.map(lambda leaf: leaf.astype(F32), params)
  full_value, full_grads = jax.value_and_grad(_mean_loss)(params_f32, batch)
  _assert_close(
    jax.tree.map(lambda leaf: leaf.astype(F32), grads), full_grads, 2 * rtol
  )
  _assert_close(value, full_value, 2 * rtol)


# The window's sum is formed in float32, whatever the gradients' dtype.

# One large gradient and 31 small ones: each small one is half a spacing of
# the large one in the gradients' dtype, so a sum kept in that dtype rounds
# every one of them away (to even), while float32 holds them all. The mean
# is then off by 12% in bfloat16 and 1.5% in float16, a different number in
# that dtype: the comparisons are exact.
SUM_WINDOW = 32
LARGE = {BF16: 256.0, F16: 2048.0}


def _sum_window_grads(dtype: Any) -> list[jax.Array]:
  return [
    jnp.full((3,), LARGE[dtype] if i == 0 else 1.0, dtype)
    for i in range(SUM_WINDOW)
  ]


def _sum_window_mean(dtype: Any) -> jax.Array:
  """The window's mean, exact in float64, rounded once to ``dtype``."""
  exact = np.full((3,), (LARGE[dtype] + SUM_WINDOW - 1) / SUM_WINDOW)
  rounded_away = np.full((3,), LARGE[dtype] / SUM_WINDOW)
  # What a sum kept in ``dtype`` would give is another number in ``dtype``.
  assert not np.array_equal(exact.astype(dtype), rounded_away.astype(dtype))
  return jnp.asarray(exact.astype(dtype))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_the_window_sum_of_low_precision_gradients_is_kept_in_float32(
  dtype, path
):
  params = {"w": jnp.zeros(3, F32)}
  if path == "accumulate":
    tx = ga_optax.accumulate(optax.sgd(1.0), SUM_WINDOW)

    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    init = tx.init
  else:
    fused = ga_optax.accumulate_and_apply(optax.sgd(1.0), SUM_WINDOW)

    def step(params, state, grads):
      return fused.apply(params, grads, state)

    init = fused.init
  step = jax.jit(step)
  state = init(params)
  for grads in _sum_window_grads(dtype):
    params, state = step(params, state, {"w": grads})
  assert int(ga_optax.applied_updates(state)) == 1
  # SGD at learning rate 1 moves the params by minus the mean, as the inner
  # optimizer received it: formed in float32, then cast to the gradients'
  # dtype once.
  expected = -_sum_window_mean(dtype).astype(F32)
  chex.assert_trees_all_equal(params, {"w": expected})


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_microbatched_gradients_of_low_precision_params_are_summed_in_float32(
  dtype,
):
  # The gradient of a micro-batch of one row g with respect to a parameter
  # of the row's dtype is g itself, in that dtype.
  def loss(params, batch):
    return jnp.mean(batch["g"] @ params["w"])

  rows = jnp.stack(_sum_window_grads(dtype)).astype(F32)
  params = {"w": jnp.zeros(3, dtype)}
  value_and_grad = ga_optax.microbatched_value_and_grad(loss, SUM_WINDOW)
  _, grads = jax.jit(value_and_grad)(params, {"g": rows})
  chex.assert_trees_all_equal(grads, {"w": _sum_window_mean(dtype)})


# A bfloat16 accumulator under float32 params and gradients: the window is
# summed in bfloat16, and the updates are still the float32 optimizer's. The
# gradients are multiples of 1/8 of at most 15/8 and the weights those of
# WEIGHTS (windows of 4 and 8): every weighted term and partial sum is a
# multiple of 1/8 of at most 8 * 15/8, 120 eighths, exact in bfloat16's 8
# significant bits (256), and dividing by a power of two is exact. The mean
# is thus exact in bfloat16, and the only rounding left is the optimizer's
# float32 one: a learning rate of 0.1, which bfloat16 cannot hold, makes
# updates that a bfloat16 buffer would round.
NARROW_LEARNING_RATE = 0.1
EIGHTHS = 15


def _eighths(seed: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  return {
    name: jnp.asarray(rng.integers(-EIGHTHS, EIGHTHS + 1, shape) / 8, F32)
    for name, shape in sorted(SHAPES.items())
  }


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
def test_a_bfloat16_accumulator_gives_float32_exact_updates(use_jit):
  params = {name: jnp.zeros(shape, F32) for name, shape in SHAPES.items()}
  tx = ga_optax.accumulate(
    optax.sgd(NARROW_LEARNING_RATE), EVERY_K, accumulator_dtype=BF16
  )
  update = jax.jit(tx.update) if use_jit else tx.update
  state = tx.init(params)
  assert {leaf.dtype for leaf in jax.tree.leaves(state.accumulator)} == {
    jnp.dtype(BF16)
  }
  grads_seq = [_eighths(seed) for seed in range(EVERY_K * NUM_WINDOWS)]
  for window in range(NUM_WINDOWS):
    calls = range(window * EVERY_K, (window + 1) * EVERY_K)
    for call in calls:
      updates, state = update(
        grads_seq[call], state, params, weight=WEIGHTS[call]
      )
      chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
    # The window's weighted mean in float64, then the float32 step of SGD.
    weight_sum = sum(WEIGHTS[call] for call in calls)
    expected = {
      name: np.float32(-NARROW_LEARNING_RATE)
      * (
        sum(WEIGHTS[call] * np.float64(grads_seq[call][name]) for call in calls)
        / weight_sum
      ).astype(np.float32)
      for name in SHAPES
    }
    for name, want in expected.items():
      # The check can fail: a bfloat16 buffer would round these updates.
      assert not np.array_equal(want.astype(BF16).astype(np.float32), want)
      got = np.asarray(updates[name])
      assert np.all(np.isfinite(got))
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
  assert int(ga_optax.applied_updates(state)) == NUM_WINDOWS


# Complex parameters.


def _complex(shape: tuple[int, ...], seed: int) -> jax.Array:
  rng = np.random.default_rng(seed)
  return jnp.asarray(
    rng.standard_normal(shape) + 1j * rng.standard_normal(shape), jnp.complex64
  )


def _complex_loss(w, batch):
  return jnp.mean(jnp.abs(batch["x"] @ w - batch["y"]) ** 2)


def _complex_batch(seed: int) -> dict[str, jax.Array]:
  return {"x": _complex((4, 3), seed), "y": _complex((4, 2), seed + 1)}


@pytest.mark.parametrize("path", ["accumulate", "accumulate_and_apply"])
def test_complex_params_accumulate_like_adam_on_the_window_mean(path):
  every_k, num_windows = 2, 2
  inner = optax.adam(0.1)
  if path == "accumulate":
    tx = ga_optax.accumulate(inner, every_k)
    init = tx.init

    def step(params, state, batch):
      grads = jax.grad(_complex_loss)(params, batch)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
  else:
    fused = ga_optax.accumulate_and_apply(inner, every_k)
    init = fused.init

    def step(params, state, batch):
      grads = jax.grad(_complex_loss)(params, batch)
      return fused.apply(params, grads, state)

  step = jax.jit(step)
  params = expected = _complex((3, 2), seed=0)
  state, expected_state = init(params), inner.init(expected)
  assert state.accumulator.dtype == jnp.complex64
  for window in range(num_windows):
    batches = [_complex_batch(100 * window + 2 * i) for i in range(every_k)]
    for batch in batches:
      params, state = step(params, state, batch)
    mean_grads = sum(
      jax.grad(_complex_loss)(expected, batch) for batch in batches
    ) / len(batches)
    updates, expected_state = inner.update(mean_grads, expected_state, expected)
    expected = optax.apply_updates(expected, updates)
    helpers.assert_strictly_close(params, expected)
  # The imaginary parts moved too: they were not dropped along the way.
  assert float(jnp.max(jnp.abs(params.imag - _complex((3, 2), 0).imag))) > 0.1


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
def test_complex_params_microbatched_equal_value_and_grad(use_jit):
  params = _complex((3, 2), seed=0)
  batch = {"x": _complex((BATCH_SIZE, 3), 1), "y": _complex((BATCH_SIZE, 2), 2)}
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _complex_loss, NUM_MICROBATCHES
  )
  if use_jit:
    value_and_grad = jax.jit(value_and_grad)
  value, grads = value_and_grad(params, batch)
  expected_value, expected_grads = jax.value_and_grad(_complex_loss)(
    params, batch
  )
  assert grads.dtype == jnp.complex64
  assert float(jnp.max(jnp.abs(expected_grads.imag))) > 0.1
  helpers.assert_strictly_close(grads, expected_grads)
  helpers.assert_strictly_close(value, expected_value)
