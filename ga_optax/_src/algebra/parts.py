"""The parts of a window: what it sums beside its weighted gradients.

A window (across calls, :mod:`ga_optax._src.window`) and a batch (within a
call, :mod:`ga_optax._src.scan`) both hold ``sum_i w_i g_i`` and
``sum_i w_i``. A feature that needs more of each micro-batch is a
:class:`Part`: its own value with a zero, an add for one micro-batch, how
the devices' values combine (a sum or a max) and a close, where the window's
value becomes what the feature reports. Both drivers carry a part's value
unchanged in type, add it where they add the gradient, combine it where they
reduce the gradient, and close it once. The noise scale's terms
(:mod:`ga_optax._src.algebra.noise_scale`) and a float8 model's amax
(:mod:`ga_optax._src.algebra.fp8`) are parts; a new feature is one more.

A part never learns where the window lives. What a device's own
micro-gradient is, and how a value held per device becomes the window's, is
the placement's to say (:mod:`ga_optax._src.placements`): the part reads it
through :class:`OwnGradients`, and a value it combines by a sum goes through
the placement's ``combine``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from ga_optax._src.algebra import weights

# How the devices' values of a part become the window's.
Combine = Literal["sum", "max"]


class OwnGradients(Protocol):
  """A micro-step's micro-gradients, as the device that holds them sees them.

  One device's gradient is one micro-gradient; where each device holds a
  partial sum of a batch's gradient, each is taken as a micro-gradient of
  the batch's part on that device. Which it is, the placement says.
  """

  @property
  def weight(self) -> jax.Array:
    """The weight of each micro-gradient (0 where the micro-step is dropped)."""
    ...

  @property
  def count(self) -> int:
    """How many micro-gradients the micro-step makes over every device."""
    ...

  def weighted_total(self, leaf_fn: Any) -> jax.Array:
    """``sum_i w_i sum_leaves leaf_fn(leaf)`` over micro-gradients that count.

    Only micro-gradients of positive weight count (``weights.counts``). As
    this device holds it: its placement's ``combine`` turns it into the
    total over every device.
    """
    ...


def leaf_total(tree: Any, leaf_fn: Any) -> jax.Array:
  """``sum over the leaves of tree of leaf_fn(leaf)``; 0 for no leaf."""
  terms = [leaf_fn(leaf) for leaf in jax.tree.leaves(tree)]
  return sum(terms[1:], terms[0]) if terms else jnp.zeros((), jnp.float32)


@dataclasses.dataclass(frozen=True)
class Whole:
  """A gradient that is one micro-gradient, whole on this device."""

  grads: Any
  weight: jax.Array

  @property
  def count(self) -> int:
    return 1

  def weighted_total(self, leaf_fn: Any) -> jax.Array:
    total = leaf_total(self.grads, leaf_fn)
    weight = jnp.asarray(self.weight, jnp.float32)
    return jnp.where(weights.counts(weight), weight * total, 0.0)


class Held(Protocol):
  """Where a part's values are held: what a placement tells a part."""

  def zero_total(self) -> jax.Array:
    """A scalar 0, typed as ``OwnGradients.weighted_total`` gives it."""
    ...

  def combine(self, value: Any, combine: Combine) -> Any:
    """``value`` as each device holds it, made the window's (closing only)."""
    ...


class OnThisDevice:
  """Values held whole on one device: nothing to combine."""

  def zero_total(self) -> jax.Array:
    return jnp.zeros((), jnp.float32)

  def combine(self, value: Any, combine: Combine) -> Any:
    del combine
    return value


class MicroBatch(NamedTuple):
  """One micro-batch, as a part adds it.

  Attributes:
    grads: its gradient; for a model with float8 state, with the state's new
      values among the variables.
    weight: its weight, 0 where it does not count (a dropped micro-step).
    kept: whether it counts at all (False for a dropped micro-step, whose
      gradient may not be finite).
    own: its micro-gradients, as the device that holds them sees them.
  """

  grads: Any
  weight: jax.Array
  kept: jax.Array
  own: OwnGradients

  @classmethod
  def of(
    cls,
    grads: Any,
    weight: Any,
    kept: Any,
    own: Callable[[jax.Array], OwnGradients],
  ) -> MicroBatch:
    """A micro-batch; ``own(weight)`` says what its micro-gradients are.

    A dropped micro-batch weighs nothing (its gradient may not be finite).
    """
    weight = jnp.where(kept, jnp.asarray(weight, jnp.float32), 0.0)
    return cls(grads, weight, jnp.asarray(kept), own(weight))

  @classmethod
  def whole(
    cls, grads: Any, weight: Any, kept: Any = True, micro_gradient: Any = None
  ) -> MicroBatch:
    """A micro-batch whose gradient is whole on this device.

    ``micro_gradient``: its micro-gradient, where that is not all of
    ``grads`` (a float8 model's new state is not a gradient); ``grads``
    by default.
    """
    own = grads if micro_gradient is None else micro_gradient
    return cls.of(grads, weight, kept, lambda w: Whole(own, w))

  @property
  def counts(self) -> jax.Array:
    """Whether it makes micro-gradients (see ``weights.counts``)."""
    return self.kept & weights.counts(self.weight)


class Closing(NamedTuple):
  """What a part's close may read of the window that closes.

  Attributes:
    mean_grads: the window's mean gradient, over every device.
    weight: the window's weight, over every device.
  """

  mean_grads: Any
  weight: jax.Array


class Part(Protocol):
  """A feature's sum over a window's micro-batches."""

  @property
  def combine(self) -> Combine:
    """How the devices' values become the window's: a sum or a max."""
    ...

  def zero(self) -> Any:
    """The value of a window with no micro-batch yet."""
    ...

  def add(self, value: Any, micro_batch: MicroBatch) -> Any:
    """``value`` with one micro-batch added."""
    ...

  def close(self, value: Any, closing: Closing) -> Any:
    """What the window's value reports.

    A driver hands over the value combined over every device, or, where a
    placement holds it per device (:class:`Held`), as this device holds it
    for the part to combine.
    """
    ...


def across_axes(value: Any, combine: Combine, axes: Any) -> Any:
  """``value`` combined over the devices of named ``axes``, on each of them."""
  if combine == "sum":
    return jax.lax.psum(value, axes)
  return jax.lax.pmax(value, axes)
