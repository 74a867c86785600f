"""The dtypes that sums of gradients, weights and values are kept in."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def sum_dtype(leaf_dtype: Any, accumulator_dtype: Any) -> jnp.dtype:
  """The dtype a sum of ``leaf_dtype`` gradients is kept in.

  ``accumulator_dtype`` (a floating dtype) for real leaves; for complex ones
  the complex dtype of the same precision, so that the imaginary part is
  kept (complex64 for a float32 or narrower accumulator).
  """
  if jnp.issubdtype(leaf_dtype, jnp.complexfloating):
    return jnp.promote_types(accumulator_dtype, jnp.complex64)
  return jnp.dtype(accumulator_dtype)


def weight_dtype(accumulator_dtype: Any) -> jnp.dtype:
  """The dtype of weight and value sums: at least float32.

  Weights count items (tokens, samples); in bfloat16 their sum would stop
  growing exactly at 256.
  """
  return jnp.promote_types(accumulator_dtype, jnp.float32)
