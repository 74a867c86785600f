"""The one cross-device reduction of a window.

Micro-steps accumulate device-locally; only when a window closes are the
accumulator and the weight sum summed over the data-parallel axis. Keeping
this in one place makes "one collective per window" easy to audit with
:func:`ga_optax.testing.window_collectives`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax

Tree = TypeVar("Tree")


def sum_across_devices(tree: Tree, axis_name: Any) -> Tree:
  """Sums every leaf of ``tree`` over ``axis_name``; identity when it is None."""
  if axis_name is None:
    return tree
  return jax.lax.psum(tree, axis_name)
