"""Warnings for precision lost without an error.

The accumulator's warning, for windows of more micro-steps than its dtype
sums exactly (from two bits below where its sums stop growing), for
``accumulate``'s k and for ``microbatched_value_and_grad``'s
``num_microbatches``; and the warning for an optimizer state of less range
than float32 (a float16 state, where Adam's squared gradients flush to zero);
each from the user's own call.
"""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ga_optax
from ga_optax._src.mixed_precision import precision

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def caught_warnings(check, *args, **kwargs) -> list[warnings.WarningMessage]:
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    check(*args, **kwargs)
  return caught


@pytest.mark.parametrize(
  ("accumulator_dtype", "every_k", "warns"),
  [
    (jnp.bfloat16, 63, False),
    (jnp.bfloat16, 64, True),
    (jnp.bfloat16, 300, True),
    (jnp.float16, 511, False),
    (jnp.float16, 512, True),
    (jnp.float16, 4096, True),
    (jnp.float32, 2**22 - 1, False),
    (jnp.float32, 2**22, True),
    (jnp.float64, 2**31 - 1, False),
    (jnp.bfloat16, {0: 8, 100: 63}, False),
    (jnp.bfloat16, {0: 8, 100: 64}, True),
    (jnp.bfloat16, lambda update_step: jnp.asarray(10**6), False),
  ],
)
def test_warns_from_two_bits_below_where_sums_stop_growing(
  accumulator_dtype, every_k, warns
):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    precision.warn_if_accumulator_too_narrow(accumulator_dtype, every_k)
  assert len(caught) == int(warns)
  if warns:
    assert caught[0].category is UserWarning
    message = str(caught[0].message)
    assert message.startswith(
      f"accumulator_dtype {jnp.dtype(accumulator_dtype).name} keeps"
    )
    limit = precision.smallest_imprecise_k(accumulator_dtype)
    assert f"Keep k below {limit}" in message


def test_warning_points_at_the_callers_caller():
  def make_accumulation():
    precision.warn_if_accumulator_too_narrow(jnp.bfloat16, 300)

  with pytest.warns(UserWarning, match="bfloat16") as record:
    line = inspect.currentframe().f_lineno + 1
    make_accumulation()
  assert record[0].filename == __file__
  assert record[0].lineno == line


@pytest.mark.parametrize(
  ("accumulator_dtype", "limit"),
  [(jnp.bfloat16, 64), (jnp.float16, 512), (jnp.float32, 2**22)],
)
def test_the_limit_is_where_a_quarter_gradient_adds_nothing(
  accumulator_dtype, limit
):
  # What the warning says, in the dtype's own arithmetic: a sum of `limit`
  # unit gradients no longer changes when a quarter of one is added (half
  # of that sum still does), and a sum of 4 * limit no longer changes when
  # a whole one is added.
  def plus(total, term):
    return jnp.asarray(total, accumulator_dtype) + jnp.asarray(
      term, accumulator_dtype
    )

  assert precision.smallest_imprecise_k(accumulator_dtype) == limit
  assert plus(limit, 0.25) == limit
  assert plus(limit // 2, 0.25) != limit // 2
  assert plus(4 * limit, 1) == 4 * limit
  assert plus(4 * limit - 1, 1) == 4 * limit


def test_bfloat16_sum_of_300_unit_gradients():
  # The measurement the docstring quotes: the window's sum stops at 256.
  with pytest.warns(UserWarning, match="stops growing after 256"):
    tx = ga_optax.accumulate(
      optax.sgd(1.0), 300, accumulator_dtype=jnp.bfloat16
    )
  params = jnp.zeros(2)

  @jax.jit
  def window(state):
    def micro_step(state, _):
      updates, state = tx.update(jnp.ones(2), state, params)
      return state, updates

    return jax.lax.scan(micro_step, state, length=300)[1][-1]

  # 256 / 300, rounded to bfloat16 (it leaves through the accumulator).
  np.testing.assert_array_equal(window(tx.init(params)), -0.8515625)


@pytest.mark.parametrize(
  "make", [ga_optax.accumulate, ga_optax.accumulate_and_apply]
)
def test_accumulate_warns_at_the_users_line(make):
  with pytest.warns(UserWarning, match="bfloat16 keeps 8") as record:
    line = inspect.currentframe().f_lineno + 1
    make(optax.sgd(1.0), 300, accumulator_dtype=jnp.bfloat16)
  assert (record[0].filename, record[0].lineno) == (__file__, line)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    make(optax.sgd(1.0), 63, accumulator_dtype=jnp.bfloat16)
    make(optax.sgd(1.0), 10**6)


def test_the_accumulator_warning_names_the_window_argument():
  (caught,) = caught_warnings(
    precision.warn_if_accumulator_too_narrow,
    BF16,
    300,
    window_argument="num_microbatches",
  )
  message = str(caught.message)
  assert "too few for windows of num_microbatches = 300 micro-steps" in message
  assert "Keep num_microbatches below 64" in message
  # accumulate's message is unchanged.
  (caught,) = caught_warnings(
    precision.warn_if_accumulator_too_narrow, BF16, 300
  )
  assert "windows of k = 300 micro-steps" in str(caught.message)


def sum_of_unit_gradients(num_microbatches: int) -> jax.Array:
  """The gradient of a mean over ``num_microbatches`` rows, all slopes 1."""
  value_and_grad = ga_optax.microbatched_value_and_grad(
    lambda w, rows: jnp.mean(rows * w),
    num_microbatches,
    accumulator_dtype=BF16,
  )
  _, grad = value_and_grad(
    jnp.ones((), BF16), jnp.ones((num_microbatches,), BF16)
  )
  return grad


def test_microbatched_bfloat16_sums_stop_growing_at_256():
  # Why the scan needs the warning: its bfloat16 sum of 300 unit gradients
  # stops at 256, so the mean comes out 256 / 300 (rounded to bfloat16).
  np.testing.assert_array_equal(sum_of_unit_gradients(300), 0.8515625)
  np.testing.assert_array_equal(sum_of_unit_gradients(256), 1.0)


def test_microbatched_value_and_grad_warns_for_a_narrow_accumulator():
  with pytest.warns(UserWarning, match="num_microbatches = 300"):
    ga_optax.microbatched_value_and_grad(
      lambda w, rows: jnp.mean(rows * w), 300, accumulator_dtype=BF16
    )


def float32_state(
  optimizer: optax.GradientTransformation,
) -> optax.GradientTransformation:
  """The bfloat16 recipe's wrapper: the state made from float32 params."""
  return optax.GradientTransformation(
    lambda params: optimizer.init(optax.tree.cast(params, F32)),
    optimizer.update,
  )


PARAMS_SHAPES = {"w": (3, 4), "b": (4,)}


def params_of(dtype) -> dict[str, jax.Array]:
  return {
    name: jnp.zeros(shape, dtype) for name, shape in PARAMS_SHAPES.items()
  }


@pytest.mark.parametrize(
  ("optimizer", "param_dtype", "narrow"),
  [
    (optax.adam(1e-3), F16, ["float16"]),
    # mu_dtype covers Adam's first moment only: nu stays float16.
    (optax.adam(1e-3, mu_dtype=F32), F16, ["float16"]),
    (optax.adamw(1e-3), jnp.float8_e4m3fn, ["float8_e4m3fn"]),
    (float32_state(optax.adam(1e-3)), F16, []),
    # bfloat16 keeps float32's exponent range.
    (optax.adam(1e-3), BF16, []),
    (optax.adam(1e-3), F32, []),
    # No state but a step count: nothing to warn about.
    (optax.sgd(1e-3), F16, []),
  ],
  ids=[
    "adam-f16",
    "adam-mu-f32-f16",
    "adamw-f8",
    "float32-state-f16",
    "adam-bf16",
    "adam-f32",
    "sgd-f16",
  ],
)
def test_warns_for_a_state_of_less_range_than_float32(
  optimizer, param_dtype, narrow
):
  state = optimizer.init(params_of(param_dtype))
  caught = caught_warnings(precision.warn_if_state_range_too_narrow, state)
  assert len(caught) == int(bool(narrow))
  if narrow:
    assert caught[0].category is UserWarning
    message = str(caught[0].message)
    assert message.startswith(
      f"optimizer's state holds {narrow[0]} arrays, whose range ends at"
    )
    assert "Keep the optimizer's state in float32" in message


def test_the_state_check_reads_dtypes_only():
  # Abstract and traced states are checked as concrete ones are.
  optimizer = optax.adam(1e-3)
  abstract = jax.eval_shape(optimizer.init, params_of(F16))
  (caught,) = caught_warnings(
    precision.warn_if_state_range_too_narrow, abstract, argument="tx"
  )
  assert str(caught.message).startswith("tx's state holds float16 arrays")

  @jax.jit
  def init(params):
    state = optimizer.init(params)
    precision.warn_if_state_range_too_narrow(state)
    return state

  with pytest.warns(UserWarning, match="holds float16 arrays"):
    init(params_of(F16))
  # Two narrow dtypes in one state, both named.
  mixed = {"a": jnp.zeros(2, F16), "b": jnp.zeros(2, jnp.float8_e5m2)}
  (caught,) = caught_warnings(precision.warn_if_state_range_too_narrow, mixed)
  assert "holds float16 and float8_e5m2 arrays" in str(caught.message)
  # Integer leaves (quantised moments, counts) are not floats of less range.
  caught = caught_warnings(
    precision.warn_if_state_range_too_narrow, {"q": jnp.zeros(2, jnp.int8)}
  )
  assert caught == []


def test_the_state_warning_points_at_the_callers_caller():
  state = optax.adam(1e-3).init(params_of(F16))

  def make_accumulation():
    precision.warn_if_state_range_too_narrow(state)

  with pytest.warns(UserWarning, match="float16") as record:
    line = inspect.currentframe().f_lineno + 1
    make_accumulation()
  assert (record[0].filename, record[0].lineno) == (__file__, line)


def test_float16_adam_divides_by_zero_as_the_warning_says():
  # The measurement the docstring and the message quote: optax.adam(1e-3)
  # on float16 params, one step.
  params = jnp.zeros(4, F16)
  optimizer = optax.adam(1e-3)
  grads = jnp.asarray([1e-2, 5e-3, -1e-3, 0.0], F16)
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  np.testing.assert_allclose(updates[0], -9.2e-4, rtol=5e-3)
  assert updates[1] == -jnp.inf
  assert updates[2] == jnp.inf
  assert jnp.isnan(updates[3])
  # The same step in float32 is the learning rate, times the sign.
  updates, _ = optimizer.update(
    grads.astype(F32), optimizer.init(params.astype(F32)), params
  )
  np.testing.assert_allclose(updates[:3], [-1e-3, -1e-3, 1e-3], rtol=1e-4)


def test_accumulate_warns_for_a_float16_optimizer_state():
  with pytest.warns(UserWarning, match="optimizer's state holds float16"):
    ga_optax.accumulate(optax.adam(1e-3), 4).init(params_of(F16))


@pytest.mark.parametrize(
  "make", [ga_optax.accumulate, ga_optax.accumulate_and_apply]
)
def test_an_adaptive_k_is_judged_by_its_largest_k(make):
  # k starts at 2, far below bfloat16's 64, but may grow to 128.
  caught = caught_warnings(
    make,
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(2, max_k=128),
    noise_scale_decay=0.9,
    accumulator_dtype=BF16,
  )
  (warning,) = [w for w in caught if "accumulator_dtype" in str(w.message)]
  assert "windows of k = 128 micro-steps" in str(warning.message)
  assert not caught_warnings(
    make,
    optax.sgd(1.0),
    ga_optax.batch_size.adaptive_k(2, max_k=32),
    noise_scale_decay=0.9,
    accumulator_dtype=BF16,
  )


@pytest.mark.parametrize(
  ("dtype", "k", "advice"),
  [
    (BF16, 300, "accumulate in jnp.float32 (the default, which keeps 24"),
    (F16, 600, "accumulate in jnp.float32 (the default, which keeps 24"),
    (F32, 2**23, "accumulate in jnp.float64 (53 bits; it needs jax.config"),
  ],
)
def test_the_accumulator_warning_advises_a_wider_dtype_than_its_own(
  dtype, k, advice
):
  (caught,) = caught_warnings(
    precision.warn_if_accumulator_too_narrow, dtype, k
  )
  message = str(caught.message)
  assert advice in message
  if dtype == F32:
    assert "jnp.float32" not in message
