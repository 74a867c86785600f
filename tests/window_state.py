"""What a run's state depends on, for tests that compare two runs' states.

Between windows the accumulator's buffer holds whatever the closing call
left there (its updates, say), and the next window's first micro-step
clears it: no number of a run depends on it, and two runs that agree may
leave different things there.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

import ga_optax


def without_stale_accumulator(tree: Any) -> Any:
  """``tree`` with the accumulator of every closed window zeroed."""

  def clear(node: Any) -> Any:
    if isinstance(node, ga_optax.AccumulateState) and int(node.micro_step) == 0:
      return node._replace(accumulator=optax.tree.zeros_like(node.accumulator))
    return node

  return jax.tree.map(
    clear, tree, is_leaf=lambda node: isinstance(node, ga_optax.AccumulateState)
  )
