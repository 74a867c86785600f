"""Counters the state keeps: int32, saturating rather than wrapping."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def increment_if(count: jax.Array, condition: jax.Array) -> jax.Array:
  """Adds one where ``condition`` holds, saturating at the int32 maximum."""
  limit = jnp.iinfo(count.dtype).max
  return jnp.where(condition & (count < limit), count + 1, count)
