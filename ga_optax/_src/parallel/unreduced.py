"""Under a plain ``jax.jit``: an accumulator ``unreduced`` over mesh axes.

JAX's default multi-device workflow (``jax.make_mesh``, ``jax.set_mesh``, a
batch sharded over Explicit axes) types a per-device partial sum as
``unreduced`` over the batch's axes. Gradients of that type (from
:func:`ga_optax.unreduced_value_and_grad`) go into an accumulator of the
same type with no collective; the call that closes the window reduces it
once, inside its branch of the conditional. Where the reduced window lands
and how the optimizer steps on it is the optimizer state's placement:
whole on every device (:class:`WholeState`), or sharded over mesh axes
(ZeRO-1, :class:`ga_optax._src.parallel.zero.ShardedState`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from ga_optax._src.parallel import axes as axes_lib


class StatePlacement(Protocol):
  """Where the wrapped optimizer's state lives, and how it steps there."""

  def check_mesh(self) -> None:
    """Raises unless the placement's axes are Explicit axes of the mesh."""
    ...

  def place(
    self, inner: optax.GradientTransformation, inner_state: Any, params: Any
  ) -> Any:
    """``inner_state`` placed as ``init`` keeps it."""
    ...

  def reduce(self, accumulator: Any, params: Any) -> Any:
    """The window's unreduced sum, reduced where the optimizer reads it."""
    ...

  def update(
    self,
    inner: optax.GradientTransformationExtraArgs,
    grads: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
  ) -> tuple[Any, Any]:
    """``inner.update`` where the state lives; updates like the params."""
    ...


class WholeState:
  """The optimizer state as ``inner.init`` makes it: whole where the params are."""

  def check_mesh(self) -> None:
    """Nothing to check."""

  def place(
    self, inner: optax.GradientTransformation, inner_state: Any, params: Any
  ) -> Any:
    del inner, params
    return inner_state

  def reduce(self, accumulator: Any, params: Any) -> Any:
    """The all-reduce onto the params' sharding."""
    return axes_lib.reduce_unreduced(accumulator, params)

  def update(
    self,
    inner: optax.GradientTransformationExtraArgs,
    grads: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
  ) -> tuple[Any, Any]:
    return inner.update(grads, inner_state, params, **extra_args)


@dataclasses.dataclass(frozen=True)
class Unreduced:
  """Partial sums typed ``unreduced`` over mesh axes, reduced on closing.

  Attributes:
    unreduced_axes: the Explicit mesh axes the batch is sharded over.
    state: where the wrapped optimizer's state lives.
  """

  unreduced_axes: axes_lib.Axes
  state: StatePlacement
  # The micro-step's weight is the global one (the batch's, not a device's).
  weights_are_global = True

  def check_init(self) -> None:
    axes_lib.check_explicit(self.unreduced_axes, "unreduced_axes")
    self.state.check_mesh()

  def check_update(self, grads: Any, weight: Any) -> None:
    """Checks the mesh (the gradients' types are checked with the tree)."""
    del grads, weight
    self.check_init()

  def init_accumulator(self, zeros: Any) -> Any:
    return axes_lib.cast_to_unreduced(zeros, self.unreduced_axes)

  def place_state(
    self, inner: optax.GradientTransformation, inner_state: Any, params: Any
  ) -> Any:
    return self.state.place(inner, inner_state, params)

  def all_finite(self, grads: Any) -> jax.Array:
    """Whether the partial sums are finite on every device.

    Unreduced partial sums cannot be inspected elementwise; the sum of all
    their elements is reduced instead (a 4-byte all-reduce), which is
    non-finite whenever any element on any device is (or the elements sum
    beyond the float range).
    """
    totals = [
      jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(grads)
    ]
    if not totals:
      return jnp.asarray(True)
    # Added pairwise: a Python sum() would start from the int 0, and JAX
    # refuses to add a plain number to an unreduced array.
    total = functools.reduce(jnp.add, totals)
    return jnp.isfinite(jax.reshard(total, PartitionSpec()))

  def factor(self, scalar: Any) -> Any:
    return axes_lib.as_reduced(scalar, self.unreduced_axes)

  def carriers(self, accumulator: Any, grads: Any) -> dict[str, Any]:
    # Both are unreduced; the updates are not: no buffer can carry them.
    del accumulator, grads
    return {}

  def reduce(
    self, accumulator: Any, weight_sum: jax.Array, params: Any
  ) -> tuple[Any, jax.Array]:
    return self.state.reduce(accumulator, params), weight_sum

  def inner_update(
    self,
    inner: optax.GradientTransformationExtraArgs,
    grads: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
  ) -> tuple[Any, Any]:
    return self.state.update(inner, grads, inner_state, params, extra_args)
