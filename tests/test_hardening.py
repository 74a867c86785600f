"""Guards against configurations that lose precision without an error."""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ga_optax
from ga_optax._src.window import precision


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
