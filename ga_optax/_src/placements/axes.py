"""Mesh axes and partition specs: the vocabulary of every multi-device mode.

Which axes a name refers to (mesh axes under a plain ``jax.jit``, manual axes
inside ``jax.shard_map``), the partition spec in a value's type, and trees
cast to or reduced from ``unreduced`` over mesh axes: each defined once here,
used by the strategies beside this module and by in-step micro-batching.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

Axes = tuple[str, ...]


def as_axes(axes: Any, name: str) -> Axes:
  """Normalises a mesh axis name or a sequence of names to a tuple.

  Raises:
    TypeError: ``axes`` is neither a string nor a sequence of strings.
    ValueError: it names an axis twice.
  """
  if isinstance(axes, str):
    return (axes,)
  if isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes):
    if len(set(axes)) != len(axes):
      raise ValueError(f"{name} names an axis twice: {tuple(axes)!r}.")
    return tuple(axes)
  raise TypeError(
    f"{name} must be a mesh axis name (str) or a tuple of names, got {axes!r}."
  )


def mesh_axis_types() -> dict[str, AxisType]:
  """Axis types of the mesh set with ``jax.set_mesh`` (or the tracing one)."""
  mesh = jax.sharding.get_abstract_mesh()
  return dict(zip(mesh.axis_names, mesh.axis_types, strict=True))


def device_count(axes: Iterable[str]) -> int:
  """Devices along the mesh ``axes`` of the current mesh (1 for none)."""
  shape = jax.sharding.get_abstract_mesh().shape
  return math.prod(shape[axis] for axis in axes)


def mesh_axes(axes: Axes) -> Axes:
  """The axes of ``axes`` that are mesh axes this code is not manual over.

  Those are the axes a batch can be sharded over under a plain ``jax.jit``.
  An axis that is manual (inside ``jax.shard_map``), or bound by ``pmap`` or
  ``vmap``, is reduced with collectives instead.
  """
  types = mesh_axis_types()
  return tuple(
    axis for axis in axes if axis in types and types[axis] != AxisType.Manual
  )


def shard_map_axes(axes: Axes) -> Axes:
  """The axes of ``axes`` that an enclosing ``jax.shard_map`` is manual over.

  Unlike axes bound by ``pmap`` or ``vmap``, they track whether values vary
  over them, so parameters must be cast to varying to get local gradients.
  """
  types = mesh_axis_types()
  return tuple(axis for axis in axes if types.get(axis) == AxisType.Manual)


def check_explicit(axes: Axes, name: str) -> None:
  """Raises unless every axis of ``axes`` is an Explicit axis of the mesh.

  Raises:
    ValueError: naming ``name`` and the current mesh's axes.
  """
  types = mesh_axis_types()
  wrong = [axis for axis in axes if types.get(axis) != AxisType.Explicit]
  if wrong:
    raise ValueError(
      f"{name} {axes!r} must be Explicit axes of the mesh set with"
      f" jax.set_mesh; {wrong!r} are not (the current mesh's axes:"
      f" { {axis: str(kind) for axis, kind in types.items()} }). Make the"
      " mesh with jax.make_mesh (Explicit axes by default) and set it with"
      " jax.set_mesh(mesh) around init and the train step."
    )


def spec_entry_axes(entry: Any) -> Axes:
  """The mesh axes of one entry of a partition spec."""
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_of(leaf: Any) -> PartitionSpec:
  """The partition spec in ``leaf``'s type: empty under Auto axes."""
  sharding = getattr(jax.typeof(leaf), "sharding", None)
  spec = getattr(sharding, "spec", None)
  return spec if isinstance(spec, PartitionSpec) else PartitionSpec()


def plain_spec(leaf: Any) -> PartitionSpec:
  """``leaf``'s partitions, without unreduced or reduced axes."""
  return PartitionSpec(*spec_of(leaf).partitions)


def sharded_axes(spec: PartitionSpec) -> set[str]:
  """The mesh axes any dimension of ``spec`` is sharded over."""
  return {axis for entry in spec.partitions for axis in spec_entry_axes(entry)}


def unreduced_axes_of(leaf: Any) -> frozenset[str]:
  """The mesh axes ``leaf`` is unreduced over, from its type."""
  return frozenset(spec_of(leaf).unreduced)


def without_axes(spec: PartitionSpec, axes: Iterable[str]) -> PartitionSpec:
  """``spec`` with ``axes`` removed from its partitions (and from unreduced).

  Used for a parameter sharded over a batch axis (FSDP): the per-device
  computation needs it whole along that axis.
  """
  axes = set(axes)

  def keep(entry: Any) -> Any:
    kept = tuple(a for a in spec_entry_axes(entry) if a not in axes)
    if not kept:
      return None
    return kept[0] if len(kept) == 1 else kept

  return PartitionSpec(
    *(keep(entry) for entry in spec.partitions),
    unreduced=frozenset(spec.unreduced) - axes,
    reduced=frozenset(spec.reduced) - axes,
  )


def with_unreduced(spec: PartitionSpec, axes: Iterable[str]) -> PartitionSpec:
  """``spec`` with its partitions kept and ``axes`` marked unreduced."""
  return PartitionSpec(
    *spec.partitions,
    unreduced=frozenset(spec.unreduced) | frozenset(axes),
    reduced=frozenset(spec.reduced),
  )


def reshard_tree(tree: Any, specs: Any) -> Any:
  """``jax.reshard`` of every leaf to its spec; leaves already there pass."""
  return jax.tree.map(
    lambda leaf, spec: (
      leaf if spec_of(leaf) == spec else jax.reshard(leaf, spec)
    ),
    tree,
    specs,
  )


def cast_to_unreduced(tree: Any, axes: Axes) -> Any:
  """``tree`` (zeros) as ``unreduced`` over ``axes``, other sharding kept.

  A leaf sharded over one of ``axes`` (FSDP) becomes whole along it: the
  gradients of a per-device computation are whole.
  """
  return jax.tree.map(
    lambda leaf: jax.reshard(
      leaf, with_unreduced(without_axes(spec_of(leaf), axes), axes)
    ),
    tree,
  )


def sum_to_unreduced(stacked: Any, like: Any, axes: Axes) -> Any:
  """Per-device partial sums stacked over ``axes`` as one unreduced tree.

  ``stacked`` leaves have a leading axis of one entry per device, sharded
  over ``axes``. Summing that axis with an ``unreduced`` output sharding
  keeps each device's entry where it is: no data moves, and the result has
  the spec of its twin in ``like`` (with ``axes`` dropped from it) plus
  ``unreduced`` over ``axes``.
  """

  def unstack(leaf: jax.Array, twin: Any) -> jax.Array:
    spec = with_unreduced(without_axes(spec_of(twin), axes), axes)
    return jnp.einsum("d...->...", leaf, out_sharding=spec)

  return jax.tree.map(unstack, stacked, like)


def reduce_unreduced(tree: Any, like: Any) -> Any:
  """Sums an unreduced ``tree`` over its devices: the deferred all-reduce.

  Each leaf lands with the partitions of its twin in ``like`` (the params),
  or, when ``like`` is None, with its own.
  """
  specs = jax.tree.map(plain_spec, tree if like is None else like)
  return jax.tree.map(jax.reshard, tree, specs)


def as_reduced(scalar: Any, axes: Axes) -> Any:
  """A replicated scalar, typed ``reduced`` over ``axes`` (free).

  Multiplying an unreduced array needs a factor reduced over the same axes.
  """
  if not axes or (isinstance(scalar, (int, float)) and scalar == 1):
    return scalar
  return jax.reshard(
    jnp.asarray(scalar), PartitionSpec(reduced=frozenset(axes))
  )


def varying_axes(leaf: Any) -> frozenset[str]:
  """The manual axes ``leaf`` varies over (empty with ``check_vma=False``)."""
  # jax 0.10 and 0.11 keep them in the aval's manual-axis type; printed as
  # {V:axis} by jax.typeof.
  manual_axis_type = getattr(jax.typeof(leaf), "mat", None)
  return frozenset(getattr(manual_axis_type, "varying", ()))


def tracks_variance(axes: Axes) -> bool:
  """Whether values carry their variance over ``axes`` in their types.

  True inside a ``jax.shard_map`` with ``check_vma=True`` (the default)
  that is manual over ``axes``; False with ``check_vma=False`` and under
  ``pmap``. When True, a gradient of a parameter that does not vary over
  the axes has already been summed over them by autodiff.
  """
  manual = shard_map_axes(axes)
  return bool(manual) and bool(varying_axes(jax.lax.axis_index(manual)))


def cast_to_varying(tree: Any, axes: Axes) -> Any:
  """Marks every leaf as varying over ``axes`` (free: no data moves).

  A parameter that is varying inside a ``shard_map`` gets a varying
  gradient: each device's partial sum, with no ``psum`` in the backward pass.
  Leaves that already vary over some of the axes are cast over the rest.
  """

  def cast(leaf: Any) -> Any:
    missing = tuple(a for a in axes if a not in varying_axes(leaf))
    return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

  return jax.tree.map(cast, tree)
