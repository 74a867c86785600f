"""One device, or gradients already whole everywhere: nothing to reduce.

:class:`DeviceSums` is what every window whose devices each keep their own
sums does alike; :class:`Local` is its one-device case.
"""

from __future__ import annotations

import abc
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ga_optax._src.algebra import parts
from ga_optax._src.placements import axes as axes_lib


def all_finite(tree: Any) -> jax.Array:
  """Whether every element of every leaf of ``tree`` is finite."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.asarray(True)
  return jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]).all()


class DeviceSums(abc.ABC):
  """A window whose every device adds into its own accumulator.

  What one device (:class:`Local`) and the devices of a ``shard_map``
  (:class:`~ga_optax._src.placements.collective.Collective`) do alike is
  written here once; what differs (the checks of a call, the agreement on
  finite gradients, the micro-gradients, how the devices' values become the
  window's) is abstract, and each of the two classes writes it once, with
  no method of this class overridden.
  """

  unreduced_axes: axes_lib.Axes = ()

  def check_init(self) -> None:
    """Nothing to check: any mesh, or none, will do."""
    return None

  def init_accumulator(self, zeros: Any) -> Any:
    return zeros

  def place_state(
    self, inner: optax.GradientTransformation, inner_state: Any, params: Any
  ) -> Any:
    del inner, params
    return inner_state

  def factor(self, scalar: Any) -> Any:
    return scalar

  @property
  def carries_updates(self) -> bool:
    return True

  def emptied(self, accumulator: Any) -> Any:
    leaves, treedef = jax.tree.flatten(accumulator)
    return jax.tree.unflatten(
      treedef, [zeroed(leaf, index) for index, leaf in enumerate(leaves)]
    )

  def zero_total(self) -> jax.Array:
    return jnp.zeros((), jnp.float32)

  def inner_update(
    self,
    inner: optax.GradientTransformationExtraArgs,
    grads: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
  ) -> tuple[Any, Any]:
    return inner.update(grads, inner_state, params, **extra_args)

  @abc.abstractmethod
  def check_update(self, grads: Any, weight: Any) -> None:
    """Raises for gradients or weights this strategy cannot accumulate."""

  @abc.abstractmethod
  def all_finite(self, grads: Any) -> jax.Array:
    """Whether every gradient on every device is finite, agreed by all."""

  @abc.abstractmethod
  def own_gradients(self, grads: Any, weight: Any) -> parts.OwnGradients:
    """One micro-step's micro-gradients, as each device holds them."""

  @abc.abstractmethod
  def combine(self, value: Any, combine: parts.Combine) -> Any:
    """A part's ``value`` as each device holds it, made the window's."""

  @abc.abstractmethod
  def window_weight(self, weight_sum: jax.Array) -> jax.Array:
    """The window's weight over every device (closing only)."""

  @abc.abstractmethod
  def reduce(self, accumulator: Any, params: Any) -> Any:
    """The window's sum over every device (closing only)."""


class Local(DeviceSums):
  """The window of one device: every method hands its input back.

  Also right under ``jit`` on several devices when the gradients are
  already reduced (replicated), and inside a ``jax.shard_map`` whose
  gradients are the same on every device.
  """

  def check_update(self, grads: Any, weight: Any) -> None:
    """Nothing to check beyond the gradients' tree and types."""
    del grads, weight

  def all_finite(self, grads: Any) -> jax.Array:
    return all_finite(grads)

  def own_gradients(self, grads: Any, weight: Any) -> parts.OwnGradients:
    # Each call's gradient is one micro-gradient.
    return parts.Whole(grads, weight)

  def combine(self, value: Any, combine: parts.Combine) -> Any:
    del combine  # one device holds the window's values
    return value

  def window_weight(self, weight_sum: jax.Array) -> jax.Array:
    return weight_sum

  def reduce(self, accumulator: Any, params: Any) -> Any:
    del params
    return accumulator


def zeroed(leaf: jax.Array, index: int) -> jax.Array:
  """Zeros to be written over ``leaf``, the ``index``-th leaf, in place.

  Made without reading anything, and as a computation of their own: a
  broadcast 0 would be one constant that XLA shares among the leaves of one
  shape and then copies into each leaf's buffer (a read and a write of
  each), and zeros computed from the leaf (``leaf * 0``) read it. ``(iota +
  index + 1) * 0`` differs from leaf to leaf as XLA sees it (it does not
  fold a float times 0, which may be NaN), so each leaf's zeros are written
  straight into its buffer: on the H100-compiled step of ``accumulate``,
  the closing side's zeroing after ``apply_updates`` has read the updates
  out of the accumulator moves half what it did.
  """
  if not leaf.ndim:  # a scalar: nothing worth sharing or copying
    return jnp.zeros_like(leaf)
  iota = jax.lax.broadcasted_iota(
    jnp.float32, leaf.shape, 0, out_sharding=jax.typeof(leaf).sharding
  )
  return ((iota + (index + 1)) * 0).astype(leaf.dtype)
