"""What a call returns: updates for the caller to apply, or new params.

``accumulate`` is a ``GradientTransformation``: every call returns updates,
zeros until a window closes. ``accumulate_and_apply`` returns the params,
changed only when a window closes. Either way the closing side of the window
writes its output into a buffer of the updates' (or params') type that it
carries, in place (see docs/compiled-window.md): each strategy here says
which buffer, what the closing side writes into it, and what the caller
sees.
"""

from __future__ import annotations

import enum
from typing import Any

import jax
import jax.numpy as jnp
import optax


class Carrier(enum.Enum):
  """The buffer the closing side writes its output into.

  ``ACCUMULATOR``: the window's sum, read by the optimizer by then;
  ``GRADS``: the micro-step's gradients, dead once added; ``PARAMS``: the
  params; ``ZEROS``: zeros made for the output, where no buffer fits.
  """

  ACCUMULATOR = enum.auto()
  GRADS = enum.auto()
  PARAMS = enum.auto()
  ZEROS = enum.auto()


class EmitUpdates:
  """``accumulate``: updates, zeros until the window closes.

  The closing side writes the updates into the first buffer of the updates'
  shapes whose dtypes hold them exactly: the accumulator, whose sum the
  optimizer has read by then, or the micro-step's gradients, dead once
  added. A select after the window makes zeros of it on micro-steps that do
  not close the window, and XLA fuses that select into the caller's
  ``apply_updates``. With no such buffer the closing side writes into zeros
  made for it.
  """

  entry = "accumulate"  # the function whose output this is
  call = "update"  # the function that makes the output

  def carrier(self, updates_like: Any, carriers: dict[Carrier, Any]) -> Carrier:
    """The first of ``carriers`` that holds the updates exactly, or zeros."""
    for carrier, operand in carriers.items():
      if _fits_exactly(updates_like, operand):
        return carrier
    return Carrier.ZEROS

  def closing_output(self, updates: Any, params: Any, carrier: Any) -> Any:
    """The updates, in the carrier's dtypes (exact, by :meth:`carrier`)."""
    del params
    return jax.tree.map(
      lambda update, slot: update.astype(slot.dtype), updates, carrier
    )

  def emit(
    self, output: Any, stepped: jax.Array, updates_like: Any, carrier: Carrier
  ) -> Any:
    """Zeros where the window stayed open; the updates where it closed."""
    if carrier is Carrier.ZEROS:
      return output
    return jax.tree.map(
      lambda carried, like: jnp.where(
        stepped, carried.astype(like.dtype), jnp.zeros((), like.dtype)
      ),
      output,
      updates_like,
    )


class ApplyToParams:
  """``accumulate_and_apply``: the params, stepped when the window closes.

  The closing side writes the new params over the params, in place when
  they are donated to ``jit``: a micro-step that does not close the window
  neither reads nor writes them.
  """

  entry = "accumulate_and_apply"  # the function whose output this is
  call = "apply"  # the function that makes the output

  def carrier(self, updates_like: Any, carriers: dict[Carrier, Any]) -> Carrier:
    del updates_like, carriers
    return Carrier.PARAMS

  def closing_output(self, updates: Any, params: Any, carrier: Any) -> Any:
    del carrier
    return optax.apply_updates(params, updates)

  def emit(
    self, output: Any, stepped: jax.Array, updates_like: Any, carrier: Carrier
  ) -> Any:
    del stepped, updates_like, carrier
    return output


def _fits_exactly(updates_like: Any, operand: Any) -> bool:
  """Whether every updates leaf round-trips exactly through its twin's slot."""
  updates_tree: Any = jax.tree.structure(updates_like)
  if updates_tree != jax.tree.structure(operand):
    return False
  return all(
    update.shape == slot.shape
    and jnp.promote_types(update.dtype, slot.dtype) == slot.dtype
    for update, slot in zip(
      jax.tree.leaves(updates_like), jax.tree.leaves(operand), strict=True
    )
  )
