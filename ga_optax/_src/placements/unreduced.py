"""Under a plain ``jax.jit``: an accumulator ``unreduced`` over mesh axes.

JAX's default multi-device workflow (``jax.make_mesh``, ``jax.set_mesh``, a
batch sharded over Explicit axes) types a per-device partial sum as
``unreduced`` over the batch's axes. Gradients of that type (from
:func:`ga_optax.unreduced_value_and_grad`) go into an accumulator of the
same type with no collective; the call that closes the window reduces it
once, on the side of the window that closes it. Where the reduced window lands
and how the optimizer steps on it is the optimizer state's placement:
whole on every device (:class:`WholeState`), or sharded over mesh axes
(ZeRO-1, :class:`ga_optax._src.placements.zero.ShardedState`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, PartitionSpec

from ga_optax._src.algebra import parts, weights
from ga_optax._src.placements import axes as axes_lib


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
  """Optimizer state as ``inner.init`` makes it: whole where the params are."""

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

  def check_init(self) -> None:
    axes_lib.check_explicit(self.unreduced_axes, "unreduced_axes")
    self.state.check_mesh()

  def check_update(self, grads: Any, weight: Any) -> None:
    """Checks the mesh (the gradients' types are checked with the tree).

    Warns when this micro-step has a weight of its own while its gradients
    were combined over the devices with equal weights in the same traced
    step: the window then weighs micro-steps by their tokens but the
    devices within each alike, which is inexact for padded tokens.
    """
    self.check_init()
    trace = _trace_of(grads)
    weighted = not (isinstance(weight, (int, float)) and weight == 1)
    if weighted and trace is not None and trace in _DEVICES_WEIGHED_ALIKE:
      warnings.warn(
        "accumulate(unreduced_axes=...) got a weight for this micro-step,"
        " but its gradients come from ga_optax.unreduced_value_and_grad"
        " without weight_fn, which weighs every device's rows alike. That"
        " is exact only when every device holds as many items (a mean over"
        " rows); for a mean over each device's real tokens, pass the same"
        " count as weight_fn=... there too (see docs/how-to/"
        "token-weighting.md, On several devices).",
        UserWarning,
        stacklevel=2,
      )

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

  @property
  def carries_updates(self) -> bool:
    # Both are unreduced; the updates are not: no buffer can carry them.
    return False

  def window_weight(self, weight_sum: jax.Array) -> jax.Array:
    # The micro-step's weight is the global one (the batch's, not a device's).
    return weight_sum

  def reduce(self, accumulator: Any, params: Any) -> Any:
    return self.state.reduce(accumulator, params)

  def emptied(self, accumulator: Any) -> Any:
    # A partial sum cannot be read elementwise; its zeros keep its type.
    return jax.tree.map(jnp.zeros_like, accumulator)

  def inner_update(
    self,
    inner: optax.GradientTransformationExtraArgs,
    grads: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
  ) -> tuple[Any, Any]:
    return self.state.update(inner, grads, inner_state, params, extra_args)

  def own_gradients(self, grads: Any, weight: Any) -> parts.OwnGradients:
    return PartialSums(grads, weight, self.unreduced_axes)

  def zero_total(self) -> jax.Array:
    # Summed from one zero per device, as a weighted total is, not cast
    # from a constant: XLA merges equal constants, and jax 0.12 then gives
    # the cast's sharding to every plain zero scalar returned beside it (the
    # weight sum, the noise averages), as GSPMDSharding({unreduced}), which
    # the next step cannot take as an argument.
    axes = _explicit_axes()
    shares = jax.reshard(
      jnp.zeros((axes_lib.device_count(axes),), jnp.float32),
      PartitionSpec(axes),
    )
    return jnp.einsum(
      "d->", shares, out_sharding=PartitionSpec(unreduced=frozenset(axes))
    )

  def combine(self, value: Any, combine: parts.Combine) -> Any:
    def whole(leaf: jax.Array) -> jax.Array:
      if not axes_lib.spec_of(leaf).unreduced:
        return leaf  # every device holds the window's already
      if combine != "sum":
        raise ValueError("values unreduced over mesh axes can only be summed")
      return jax.reshard(leaf, PartitionSpec())

    return jax.tree.map(whole, value)


@dataclasses.dataclass(frozen=True)
class PartialSums:
  """A micro-step's gradient as each device's partial sum of it.

  A device's partial sum ``p_d`` of a micro-step of global weight N is
  taken as its micro-gradient ``g_d = D p_d``, of weight ``N / D``: exact
  when the devices' rows weigh the same. A total over them stays on each
  device, as a scalar unreduced over the mesh axes like the accumulator's
  partial sums.

  Attributes:
    grads: the micro-step's gradient, unreduced over ``unreduced_axes``.
    global_weight: N, the micro-step's weight over every device.
    unreduced_axes: the mesh axes the gradient is unreduced over.
  """

  grads: Any
  global_weight: Any
  unreduced_axes: axes_lib.Axes

  @property
  def count(self) -> int:
    return axes_lib.device_count(self.unreduced_axes)

  @property
  def weight(self) -> jax.Array:
    return jnp.asarray(self.global_weight, jnp.float32) / self.count

  def weighted_total(self, leaf_fn: Any) -> jax.Array:
    axes = _explicit_axes()
    devices = self.count
    leaves = jax.tree.leaves(self.grads)
    specs = tuple(axes_lib.spec_of(leaf) for leaf in leaves)

    def per_device(weight: jax.Array, *blocks: jax.Array) -> jax.Array:
      total = jnp.zeros((), jnp.float32)
      for block, spec in zip(blocks, specs, strict=True):
        # A leaf whole on several devices of an axis is counted once.
        spread = axes_lib.sharded_axes(spec) | set(spec.unreduced)
        copies = axes_lib.device_count(a for a in axes if a not in spread)
        total = total + leaf_fn(block * devices) / copies
      share = jnp.where(weights.counts(weight), weight * total, 0.0)
      return share[None]

    shares = jax.shard_map(
      per_device,
      in_specs=(PartitionSpec(), *specs),
      out_specs=PartitionSpec(axes),
      check_vma=False,
    )(self.weight, *leaves)
    return jnp.einsum(
      "d->", shares, out_sharding=PartitionSpec(unreduced=frozenset(axes))
    )


# The traced steps in which unreduced_value_and_grad weighed devices alike.
_DEVICES_WEIGHED_ALIKE: weakref.WeakSet[Any] = weakref.WeakSet()


def _trace_of(tree: Any) -> Any:
  """The trace the first traced leaf of ``tree`` belongs to, or None."""
  for leaf in jax.tree.leaves(tree):
    trace = getattr(leaf, "_trace", None)
    if trace is not None:
      return trace
  return None


def mark_devices_weighed_alike(grads: Any) -> None:
  """Records that ``grads`` weigh every device's rows alike (no weight_fn)."""
  trace = _trace_of(grads)
  if trace is not None:
    _DEVICES_WEIGHED_ALIKE.add(trace)


def _explicit_axes() -> axes_lib.Axes:
  """Every Explicit axis of the mesh: those a partial sum can vary over."""
  return tuple(
    axis
    for axis, kind in axes_lib.mesh_axis_types().items()
    if kind == AxisType.Explicit
  )
