"""Bad configuration and bad input raise errors that name the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import ga_optax

PARAMS = {"w": jnp.ones((2, 3)), "b": jnp.zeros(2)}


@pytest.mark.parametrize(
  ("every_k", "error", "message"),
  [
    (0, ValueError, "every_k must be a positive int"),
    (-2, ValueError, "every_k must be a positive int"),
    (2.5, TypeError, "every_k must be a positive int"),
    (4.0, TypeError, "every_k must be a positive int"),
    ("4", TypeError, "every_k must be a positive int"),
    (True, TypeError, "every_k must be a positive int"),
    ({}, ValueError, "every_k .*empty dict"),
    ({1: 4, 3: 2}, ValueError, "every_k dict must contain key 0"),
    ({0: 4, 2: 0}, ValueError, r"every_k\[2\] must be a positive int"),
    ({0: 4, 2: -1}, ValueError, r"every_k\[2\] must be a positive int"),
    ({0: 4, -1: 2}, ValueError, "every_k dict keys must be non-negative"),
    ({0: 4, 2: 1.5}, TypeError, r"every_k\[2\] must be a positive int"),
    (lambda step: 2.5, TypeError, "every_k as a callable"),
    (lambda step: jnp.ones(2, jnp.int32), TypeError, "every_k as a callable"),
  ],
)
def test_bad_every_k(every_k, error, message):
  with pytest.raises(error, match=message):
    ga_optax.accumulate(optax.sgd(0.1), every_k)


@pytest.mark.parametrize("reduction", ["average", "MEAN", None, 1])
def test_bad_reduction(reduction):
  with pytest.raises(ValueError, match="reduction must be one of"):
    ga_optax.accumulate(optax.sgd(0.1), 2, reduction=reduction)


@pytest.mark.parametrize(
  "dtype", [jnp.int32, jnp.bool_, "int8", "not a dtype", None]
)
def test_bad_accumulator_dtype(dtype):
  with pytest.raises(TypeError, match="accumulator_dtype must be a floating"):
    ga_optax.accumulate(optax.sgd(0.1), 2, accumulator_dtype=dtype)


@pytest.mark.parametrize(
  "optimizer", [optax.sgd, "adam", None, (lambda p: p, lambda u, s: (u, s))]
)
def test_bad_optimizer(optimizer):
  with pytest.raises(TypeError, match="optimizer must be an optax"):
    ga_optax.accumulate(optimizer, 2)


def test_bad_skip_nonfinite():
  with pytest.raises(TypeError, match="skip_nonfinite must be a bool"):
    ga_optax.accumulate(optax.sgd(0.1), 2, skip_nonfinite="yes")


def test_bad_axis_name():
  with pytest.raises(TypeError, match="axis_name must be None"):
    ga_optax.accumulate(optax.sgd(0.1), 2, axis_name=3)


@pytest.mark.parametrize("use_jit", [False, True])
def test_grads_with_another_tree(use_jit):
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  update = jax.jit(tx.update) if use_jit else tx.update
  with pytest.raises(ValueError, match="grads must have the tree structure"):
    update({"w": jnp.ones((2, 3))}, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize("use_jit", [False, True])
def test_grads_with_another_leaf_shape(use_jit):
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  update = jax.jit(tx.update) if use_jit else tx.update
  grads = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  with pytest.raises(
    ValueError, match=r"grads leaf \['w'\] has shape \(3, 2\)"
  ):
    update(grads, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize(
  ("weight", "error", "message"),
  [
    (-1.0, ValueError, "weight must be finite and >= 0"),
    (jnp.asarray(-3), ValueError, "weight must be finite and >= 0"),
    (float("nan"), ValueError, "weight must be finite and >= 0"),
    (float("inf"), ValueError, "weight must be finite and >= 0"),
    (jnp.ones(2), ValueError, "weight must be a scalar"),
    (True, TypeError, "weight must be a real number"),
    ("3", TypeError, "weight must be a real scalar"),
    (jnp.asarray(1 + 2j), TypeError, "weight must have a real numeric dtype"),
  ],
)
def test_bad_weight(weight, error, message):
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  with pytest.raises(error, match=message):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS, weight=weight)


def test_non_scalar_traced_weight():
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  update = jax.jit(
    lambda state, weight: tx.update(PARAMS, state, PARAMS, weight=weight)
  )
  with pytest.raises(ValueError, match="weight must be a scalar"):
    update(tx.init(PARAMS), jnp.ones(3))


@pytest.mark.parametrize("flush", [1, "yes", jnp.ones(2, bool), jnp.asarray(1)])
def test_bad_flush(flush):
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  with pytest.raises(TypeError, match="flush must be a Python bool"):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS, flush=flush)
