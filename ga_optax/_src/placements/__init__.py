"""How a window spread over devices is kept and reduced: one strategy each.

A window's micro-steps may run on several devices at once, each adding its
own gradients. Where the partial sums live and how the window's one
reduction runs is a :class:`Placement` strategy, chosen once from the
arguments of :func:`ga_optax.accumulate` by :func:`resolve`:

* :class:`~ga_optax._src.placements.local.Local`: one device, or gradients
  already whole on every device; nothing to reduce.
* :class:`~ga_optax._src.placements.collective.Collective`: inside
  ``jax.shard_map`` or ``pmap`` (``axis_name``): each device keeps its own
  sum; the closing call sums them with a collective over the named axes.
* :class:`~ga_optax._src.placements.unreduced.Unreduced`: under a plain
  ``jax.jit`` (``unreduced_axes``): the accumulator is typed ``unreduced``
  over mesh axes; the closing call reduces it, onto the params' sharding or,
  with ``inner_state_axes`` (ZeRO-1, :mod:`~ga_optax._src.placements.zero`),
  onto the optimizer state's shards.

The window calls every method unconditionally; a strategy with nothing to
do returns its input. A part of the window algebra
(:mod:`ga_optax._src.algebra.parts`) reads what a device's micro-gradients
are through :meth:`Placement.own_gradients` and is combined over the devices
through :meth:`Placement.combine`: a strategy never learns which part it
holds.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import optax

from ga_optax._src.algebra import parts
from ga_optax._src.placements import axes as axes_lib
from ga_optax._src.placements import zero
from ga_optax._src.placements.collective import Collective
from ga_optax._src.placements.local import Local
from ga_optax._src.placements.unreduced import Unreduced, WholeState


class Placement(Protocol):
  """How a window spread over devices is kept, checked and reduced."""

  def window_weight(self, weight_sum: jax.Array) -> jax.Array:
    """The window's weight over every device (closing only)."""
    ...

  @property
  def unreduced_axes(self) -> axes_lib.Axes:
    """The mesh axes gradients and the accumulator are unreduced over."""
    ...

  def check_init(self) -> None:
    """Raises unless the mesh this strategy needs is the one set now."""
    ...

  def check_update(self, grads: Any, weight: Any) -> None:
    """Raises for gradients or weights this strategy cannot accumulate."""
    ...

  def init_accumulator(self, zeros: Any) -> Any:
    """The accumulator made from ``zeros`` shaped like the params."""
    ...

  def place_state(
    self, inner: optax.GradientTransformation, inner_state: Any, params: Any
  ) -> Any:
    """The wrapped optimizer's state, placed on the devices."""
    ...

  def all_finite(self, grads: Any) -> jax.Array:
    """Whether every gradient on every device is finite, agreed by all."""
    ...

  def factor(self, scalar: Any) -> Any:
    """``scalar`` typed so that it may multiply the accumulator."""
    ...

  @property
  def carries_updates(self) -> bool:
    """Whether the accumulator and gradients, as held, may carry the updates.

    They may where they have the updates' sharding: the closing side then
    writes the updates into one of them, in place.
    """
    ...

  def reduce(self, accumulator: Any, params: Any) -> Any:
    """The window's sum over every device (closing only)."""
    ...

  def emptied(self, accumulator: Any) -> Any:
    """Zeros of the accumulator's type, to be written over it in place."""
    ...

  def own_gradients(self, grads: Any, weight: Any) -> parts.OwnGradients:
    """One micro-step's micro-gradients, as each device holds them.

    A device's own gradient and weight where each device has its own; the
    micro-step's gradient where they are already summed.
    """
    ...

  def zero_total(self) -> jax.Array:
    """A scalar 0, typed as :meth:`own_gradients`' totals are."""
    ...

  def combine(self, value: Any, combine: parts.Combine) -> Any:
    """A part's ``value`` as each device holds it, made the window's."""
    ...

  def inner_update(
    self,
    inner: optax.GradientTransformationExtraArgs,
    grads: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
  ) -> tuple[Any, Any]:
    """The wrapped optimizer's update on the reduced gradient."""
    ...


def resolve(
  axis_name: Any, unreduced_axes: Any, inner_state_axes: Any
) -> Placement:
  """The strategy the three multi-device arguments of ``accumulate`` ask for.

  Raises:
    TypeError: an argument is not an axis name, a tuple of names (or, for
      ``inner_state_axes``, a tree of partition specs).
    ValueError: ``axis_name`` with ``unreduced_axes``, or
      ``inner_state_axes`` without ``unreduced_axes``.
  """
  if axis_name is not None and not isinstance(axis_name, (str, tuple)):
    raise TypeError(
      "axis_name must be None, a mesh axis name (str) or a tuple of names,"
      f" got {axis_name!r}."
    )
  unreduced = (
    axes_lib.as_axes(unreduced_axes, "unreduced_axes")
    if unreduced_axes not in (None, (), [])
    else ()
  )
  if axis_name is not None and unreduced:
    raise ValueError(
      "pass axis_name (inside jax.shard_map or pmap) or unreduced_axes"
      f" (under a plain jax.jit), not both; got axis_name={axis_name!r} and"
      f" unreduced_axes={unreduced!r}."
    )
  if inner_state_axes is not None and not unreduced:
    raise ValueError(
      "inner_state_axes shards the optimizer state over mesh axes at the"
      " window's reduce-scatter, which needs an accumulator unreduced over"
      " the batch's axes: pass unreduced_axes too (for example"
      " unreduced_axes='data', inner_state_axes='data') and gradients from"
      " ga_optax.unreduced_value_and_grad; got inner_state_axes="
      f"{inner_state_axes!r} without unreduced_axes."
    )
  if unreduced:
    state = (
      WholeState()
      if inner_state_axes is None
      else zero.ShardedState.of(inner_state_axes)
    )
    return Unreduced(unreduced, state)
  if axis_name is not None:
    return Collective(axes_lib.as_axes(axis_name, "axis_name"))
  return Local()
