"""Float8 state across a window: what Flax's fp8 ops keep beside the params.

Flax's fp8 dot products keep amax histories and scales in the
``_overwrite_with_gradient`` collection, whose "gradient" is its new value.
Such state never reaches the optimizer and is never summed: during a window
it stays at its window-start value, so that every micro-batch quantises as
the large batch would, and the window keeps the combination of the
micro-batches' new values, which becomes the state when the window closes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

# Flax's name for the collection (flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT),
# spelled here so that Flax stays an optional dependency.
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def split_variables(variables: Any) -> tuple[Any, Any]:
  """``(params, fp8_state)`` of Flax variables; ``(variables, None)`` else.

  Variables that hold the float8 collection are split as Flax's
  ``TrainState`` splits them: the optimizer sees their ``"params"``.
  """
  if isinstance(variables, Mapping) and OVERWRITE_WITH_GRADIENT in variables:
    return variables["params"], variables[OVERWRITE_WITH_GRADIENT]
  return variables, None


def init_window(fp8_state: Any) -> Any:
  """The window's running combination before its first micro-batch."""
  if fp8_state is None:
    return None
  return jax.tree.map(jnp.zeros_like, fp8_state)
