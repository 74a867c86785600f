"""One device, or gradients already whole everywhere: nothing to reduce."""

from __future__ import annotations

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


class Local(parts.OnThisDevice):
  """The window of one device: every method hands its input back.

  Also right under ``jit`` on several devices when the gradients are
  already reduced (replicated), and inside a ``jax.shard_map`` whose
  gradients are the same on every device.
  """

  unreduced_axes: axes_lib.Axes = ()

  def check_init(self) -> None:
    """Nothing to check: any mesh, or none, will do."""

  def check_update(self, grads: Any, weight: Any) -> None:
    """Nothing to check beyond the gradients' tree and types."""
    del grads, weight

  def init_accumulator(self, zeros: Any) -> Any:
    return zeros

  def place_state(
    self, inner: optax.GradientTransformation, inner_state: Any, params: Any
  ) -> Any:
    del inner, params
    return inner_state

  def all_finite(self, grads: Any) -> jax.Array:
    return all_finite(grads)

  def factor(self, scalar: Any) -> Any:
    return scalar

  @property
  def carries_updates(self) -> bool:
    return True

  def window_weight(self, weight_sum: jax.Array) -> jax.Array:
    return weight_sum

  def reduce(self, accumulator: Any, params: Any) -> Any:
    del params
    return accumulator

  def emptied(self, accumulator: Any) -> Any:
    return jax.tree.map(zeroed, accumulator)

  def own_gradients(self, grads: Any, weight: Any) -> parts.OwnGradients:
    # Each call's gradient is one micro-gradient.
    return parts.Whole(grads, weight)

  def inner_update(
    self,
    inner: optax.GradientTransformationExtraArgs,
    grads: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
  ) -> tuple[Any, Any]:
    return inner.update(grads, inner_state, params, **extra_args)


def zeroed(leaf: jax.Array) -> jax.Array:
  """Zeros made from ``leaf``, to be written over it in place.

  A broadcast 0 would be one constant that XLA shares among the leaves of
  one shape and then copies into each leaf's buffer; zeros computed from the
  leaf are written where it is read. A leaf that is not finite (a window
  that overflowed) gives zeros too.
  """
  return jnp.where(jnp.isfinite(leaf), leaf * 0, jnp.zeros_like(leaf))
