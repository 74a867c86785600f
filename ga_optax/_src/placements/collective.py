"""Inside ``jax.shard_map`` or ``pmap``: one collective when a window closes.

Each device adds its own micro-batches' gradients into its own accumulator,
with no collective; the call that closes the window sums accumulators and
weights over the named axes, once. Inside a ``shard_map`` with
``check_vma=True``, gradients of parameters that do not vary over the axes
arrive already summed over them by autodiff (on every micro-step: that
``shard_map`` cannot keep per-device partial sums in a state it checks to be
the same on every device); the window then adds them as they are and sums
only the weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ga_optax._src.algebra import parts
from ga_optax._src.placements import axes as axes_lib
from ga_optax._src.placements import local


@dataclasses.dataclass(frozen=True)
class Collective(local.DeviceSums):
  """Device-local windows over ``axes``, summed by a collective on closing.

  Attributes:
    axes: the manual axes (``axis_name``) of the enclosing ``shard_map`` or
      ``pmap``.
  """

  axes: axes_lib.Axes

  def check_update(self, grads: Any, weight: Any) -> None:
    """Checks that the axes are bound here and how the gradients vary.

    ``init`` needs no bound axis (it may run outside ``shard_map``); each
    micro-step does.

    Raises:
      ValueError: the axes are mesh axes of a plain ``jit``, or, inside a
        ``shard_map`` with ``check_vma=True``, gradients or weights vary
        over them.
    """
    misplaced = axes_lib.mesh_axes(self.axes)
    if misplaced:
      raise ValueError(
        f"axis_name {self.axes!r} names mesh axes {misplaced!r} that no"
        " enclosing jax.shard_map is manual over: it is for steps inside"
        " shard_map or pmap. Under a plain jax.jit with a sharded batch,"
        " pass unreduced_axes=... and gradients from"
        " ga_optax.unreduced_value_and_grad instead."
      )
    if not axes_lib.tracks_variance(self.axes):
      return
    names = set(self.axes)
    for name, tree in (("grads", grads), ("weight", weight)):
      if any(names & axes_lib.varying_axes(x) for x in jax.tree.leaves(tree)):
        raise ValueError(
          f"{name} vary over axis_name {self.axes!r} inside a"
          " jax.shard_map with check_vma=True: a per-device accumulator"
          " cannot live in a state that shard_map checks to be the same on"
          " every device. Run the step in jax.shard_map(...,"
          " check_vma=False) to accumulate on each device and reduce once"
          " per window, or pass gradients of unvarying params (autodiff"
          " then sums them over the devices on every micro-step)."
        )

  def all_finite(self, grads: Any) -> jax.Array:
    # Every device must drop the same micro-steps.
    finite = local.all_finite(grads).astype("int32")
    return jax.lax.pmin(finite, self.axes) > 0

  def own_gradients(self, grads: Any, weight: Any) -> parts.OwnGradients:
    """Each device's gradient and weight, or the micro-step's where summed.

    With ``check_vma=True`` the gradient arrives summed over the D devices
    and the window divides by D times the weights: the micro-gradient is the
    gradient over D, the same on every device.
    """
    if axes_lib.tracks_variance(self.axes):
      devices = jax.lax.axis_size(self.axes)
      grads = jax.tree.map(lambda grad: grad / devices, grads)
    return parts.Whole(grads, weight)

  def combine(self, value: Any, combine: parts.Combine) -> Any:
    if axes_lib.tracks_variance(self.axes):
      # Each device's value is already the window's.
      return value
    return parts.across_axes(value, combine, self.axes)

  def window_weight(self, weight_sum: jax.Array) -> jax.Array:
    # Each device knows only its own weights until the closing reduction.
    return jax.lax.psum(weight_sum, self.axes)

  def reduce(self, accumulator: Any, params: Any) -> Any:
    del params
    if axes_lib.tracks_variance(self.axes):
      # Each gradient is already the sum over the devices.
      return accumulator
    return jax.lax.psum(accumulator, self.axes)
