"""Where a batch's entries lie, and its split into strided micro-batches.

``in_axes`` says it, with ``jax.vmap``'s meaning: an int or None for each
leaf of the batch, given as a pytree prefix of it. A leaf with an int axis
holds the batch's entries along that axis and is split into micro-batches
along it; a None leaf (a mask or a table shared by the whole batch, a PRNG
key) is passed whole to every micro-batch. The pieces:

* :func:`layout_of` reads ``in_axes`` against a batch, with errors that
  name ``in_axes`` and the leaf;
* :func:`split_microbatches`, the strided split (micro-batch ``i`` holds
  entries ``i::k`` along each leaf's axis), which keeps a sharded axis
  sharded: each device keeps its own entries;
* :func:`sharded_axes` and :func:`map_over_batch_axes`, a ``jax.shard_map``
  over the mesh axes the batch is sharded over, under a plain ``jax.jit``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec

from ga_optax._src import validation
from ga_optax._src.placements import axes as axes_lib

Axes = axes_lib.Axes


class _Axis:
  """One leaf of ``in_axes``, boxed: None would vanish from a pytree."""

  __slots__ = ("value",)

  def __init__(self, value: Any) -> None:
    self.value = value


class BatchLayout(NamedTuple):
  """Which axis of each leaf of a batch its entries lie along.

  Attributes:
    treedef: the batch's tree structure.
    axes: one per leaf, in leaf order: the non-negative axis it is split
      along, or None for a leaf passed whole to every micro-batch.
    paths: one per leaf, its path in the batch, for error messages.
    size: the batch's number of entries, the size of every split leaf along
      its axis.
  """

  treedef: Any
  axes: tuple[int | None, ...]
  paths: tuple[str, ...]
  size: int

  @property
  def split_axes(self) -> tuple[int, ...]:
    """The axes of the leaves that are split, in leaf order."""
    return tuple(axis for axis in self.axes if axis is not None)

  def parts(self, batch: Any) -> tuple[list[Any], list[Any]]:
    """``(split, whole)``: the batch's leaves that are split, and the rest."""
    leaves = self.treedef.flatten_up_to(batch)
    split = [
      leaf for leaf, a in zip(leaves, self.axes, strict=True) if a is not None
    ]
    whole = [
      leaf for leaf, a in zip(leaves, self.axes, strict=True) if a is None
    ]
    return split, whole

  def rebuild(self, split: Sequence[Any], whole: Sequence[Any]) -> Any:
    """The batch (or one micro-batch) from its two kinds of leaves."""
    split_leaves, whole_leaves = iter(split), iter(whole)
    leaves = [
      next(whole_leaves) if axis is None else next(split_leaves)
      for axis in self.axes
    ]
    return self.treedef.unflatten(leaves)


def check_in_axes(in_axes: Any) -> Any:
  """Checks that every leaf of ``in_axes`` is an int or None; returns it.

  Raises:
    TypeError: a leaf is neither (a bool or a float included).
  """
  boxed = jax.tree.map(_Axis, in_axes, is_leaf=lambda node: node is None)
  for path, box in jax.tree_util.tree_flatten_with_path(boxed)[0]:
    if box.value is not None and not validation.is_int(box.value):
      raise TypeError(
        "in_axes must give an int axis or None for each leaf of batch (a"
        " pytree prefix of batch, as in jax.vmap), got"
        f" {box.value!r} at in_axes{jax.tree_util.keystr(path)}."
      )
  return in_axes


def layout_of(batch: Any, in_axes: Any) -> BatchLayout:
  """Reads ``in_axes`` against ``batch``: each leaf's axis, and the size.

  Raises:
    ValueError: ``in_axes`` is not a pytree prefix of ``batch``, an axis is
      out of range for its leaf, no leaf is split, or the split leaves
      disagree on the batch size.
  """
  boxed = jax.tree.map(_Axis, in_axes, is_leaf=lambda node: node is None)
  try:
    per_leaf = jax.tree.map(
      lambda box, subtree: jax.tree.map(lambda _: box, subtree),
      boxed,
      batch,
    )
  except ValueError as error:
    raise ValueError(
      "in_axes must be a pytree prefix of batch (as in jax.vmap): an int or"
      " None for the whole batch, or a tree like batch's with an int or None"
      f" in place of each leaf or subtree. Got in_axes={in_axes!r} for a"
      f" batch of structure {jax.tree.structure(batch)}: {error}"
    ) from None
  leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(batch)
  boxes = jax.tree.leaves(per_leaf)
  axes, paths, sizes = [], [], {}
  for (path, leaf), box in zip(leaves_with_paths, boxes, strict=True):
    name = jax.tree_util.keystr(path)
    axis = None if box.value is None else _leaf_axis(leaf, box.value, name)
    if axis is not None:
      sizes[name] = np.shape(leaf)[axis]
    axes.append(axis)
    paths.append(name)
  if not sizes:
    raise ValueError(
      "in_axes splits no leaf of batch, so there are no entries to split"
      f" into micro-batches (in_axes={in_axes!r}). Give the axis of the"
      " batch's entries for at least one leaf."
    )
  if len(set(sizes.values())) > 1:
    raise ValueError(
      "every leaf of batch that in_axes splits must have the same batch size"
      " along its axis, got sizes "
      + ", ".join(f"{path}: {size}" for path, size in sizes.items())
      + f" (in_axes={in_axes!r}). Pass"
      " in_axes=None for a leaf shared by the whole batch."
    )
  return BatchLayout(treedef, tuple(axes), tuple(paths), sizes.popitem()[1])


def _leaf_axis(leaf: Any, axis: int, name: str) -> int:
  """``axis`` of ``leaf`` made non-negative, or a ValueError naming both."""
  shape = np.shape(leaf)
  if not -len(shape) <= axis < len(shape):
    hint = (
      " A scalar has no batch axis: give it in_axes None (or pass per-call"
      " constants as extra positional arguments)."
      if not shape
      else ""
    )
    raise ValueError(
      f"in_axes gives axis {axis} for batch leaf {name}, which has shape"
      f" {shape}: the axis is out of range.{hint}"
    )
  return axis % len(shape)


def check_divisible(
  layout: BatchLayout,
  num_microbatches: int,
  devices: int = 1,
  where: str = "",
) -> None:
  """Raises unless the batch splits evenly over devices and micro-batches.

  Args:
    layout: the batch's layout; its size is the whole batch's.
    num_microbatches: micro-batches per device.
    devices: devices the batch is split over (under a plain ``jax.jit``).
    where: for a batch that is already one device's share (inside
      ``jax.shard_map`` or ``pmap``), the words that say so.
  """
  size = layout.size
  share = size // devices
  if not size % devices and not share % num_microbatches:
    return
  split = [
    f"{path} axis {axis}"
    for path, axis in zip(layout.paths, layout.axes, strict=True)
    if axis is not None
  ]
  if len(split) > 3:
    split[3:] = [f"{len(split) - 3} more"]
  holds = (
    f"batch has {size} entries along its batch axes"
    f" (in_axes: {', '.join(split)})"
  )
  if where:
    holds = f"{where}, each device's {holds}"
  if size % devices:
    raise ValueError(
      f"{holds}, which the {devices} devices it is sharded over cannot"
      " share evenly; the batch size must be divisible by the device count."
    )
  if devices > 1:
    raise ValueError(
      f"{holds}, {share} on each of the {devices} devices it is sharded"
      f" over, which num_microbatches ({num_microbatches}) must divide: each"
      f" device splits its {share} entries into {num_microbatches}"
      " micro-batches of equal size."
    )
  raise ValueError(
    f"{holds}, which num_microbatches ({num_microbatches}) must divide."
  )


def split_microbatches(
  leaves: Sequence[Any], axes: Sequence[int], num_microbatches: int
) -> list[jax.Array]:
  """Each leaf split along its axis into ``num_microbatches``, stacked first.

  Micro-batch ``i`` holds entries ``i, i + k, i + 2k, ...`` along the axis
  (a column-major reshape): a leaf whose axis is split evenly over devices
  thus gives micro-batches split the same way, each device keeping its own
  entries, so the split moves no data. The order does not change a mean over
  the whole batch; it does decide which entries micro-batch ``i`` (and the
  ``rng`` folded with ``i``) sees. A leaf of shape ``(..., B, ...)`` becomes
  ``(k, ..., B // k, ...)``; the caller has checked that ``k`` divides ``B``.
  """

  def split(leaf: Any, axis: int) -> jax.Array:
    shape = jnp.shape(leaf)
    entries = shape[axis] // num_microbatches
    strided = jnp.reshape(
      leaf, (*shape[:axis], entries, num_microbatches, *shape[axis + 1 :])
    )
    return jnp.moveaxis(strided, axis + 1, 0)

  return [split(leaf, axis) for leaf, axis in zip(leaves, axes, strict=True)]


def sharded_axes(layout: BatchLayout, split: Sequence[Any]) -> Axes:
  """The mesh axes the batch axis of the split leaves is sharded over.

  Read from the leaves' types, so it is known under Explicit axes only (the
  types of Auto-sharded arrays carry no sharding). Leaves whose batch axis
  is not sharded are ignored: :func:`map_over_batch_axes` reshards them
  onto the batch's axes on the way in.

  Raises:
    ValueError: two leaves are sharded over different axes.
  """
  found: dict[Axes, str] = {}
  paths = [
    path
    for path, axis in zip(layout.paths, layout.axes, strict=True)
    if axis is not None
  ]
  for path, leaf, axis in zip(paths, split, layout.split_axes, strict=True):
    spec = axes_lib.spec_of(leaf)
    entry = spec[axis] if axis < len(spec.partitions) else None
    axes = axes_lib.spec_entry_axes(entry)
    if axes:
      found.setdefault(axes, path)
  if len(found) > 1:
    raise ValueError(
      "every leaf of batch must be sharded over the same mesh axes along"
      f" its batch axis (in_axes); got {found} (axes: first leaf with them)."
      " Reshard the batch so that they agree."
    )
  return next(iter(found), ())


def batch_spec(leaf: Any, axis: int, axes: Axes) -> PartitionSpec:
  """``leaf``'s spec with ``axes`` on dimension ``axis`` and nowhere else."""
  entries = list(axes_lib.without_axes(axes_lib.spec_of(leaf), axes).partitions)
  entries += [None] * (np.ndim(leaf) - len(entries))
  entries[axis] = axes
  return PartitionSpec(*entries)


def split_arrays(tree: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
  """The array leaves of ``tree`` and a function that puts them back.

  Non-array leaves (Python numbers, strings, an Equinox model's functions)
  stay in the closure: a ``shard_map`` takes arrays only, and closing over
  an array that is sharded over Explicit axes is not supported.
  """
  leaves, treedef = jax.tree.flatten(tree)
  is_array = [validation.is_array(leaf) for leaf in leaves]
  arrays = [leaf for leaf, array in zip(leaves, is_array, strict=True) if array]

  def rebuild(new_arrays: Sequence[Any]) -> Any:
    fed = iter(new_arrays)
    merged = [
      next(fed) if array else leaf
      for leaf, array in zip(leaves, is_array, strict=True)
    ]
    return jax.tree.unflatten(treedef, merged)

  return arrays, rebuild


def map_over_batch_axes(
  per_device: Callable[..., Any],
  axes: Axes,
  replicated: Any,
  split: Sequence[Any],
  split_axes: Sequence[int],
  out_specs: Any,
) -> Any:
  """Runs ``per_device(replicated, split)`` on each device's share of the batch.

  A ``jax.shard_map`` manual over ``axes`` only: other mesh axes (a model or
  FSDP axis the parameters are sharded over) stay as they are. Each leaf of
  ``split`` enters split over ``axes`` along its own batch axis; under
  Explicit axes a leaf that is not sharded so (a mask made in the step, a
  replicated batch) is resharded first, which for a replicated leaf is a
  local slice. ``replicated`` (a pytree whose array leaves are the
  parameters, the batch's whole leaves and per-call constants) enters whole
  along ``axes``: under Explicit axes a leaf sharded over one of them is
  gathered first, once per call (FSDP).

  The map does not check varying axes (``check_vma=False``): the user's loss
  runs as JAX runs it, on one device's share (a ``lax.scan`` whose carry
  starts from constants keeps its type), and the gradients of the
  replicated parameters are each device's own partial sums, with no
  collective in the backward pass.

  Args:
    per_device: the per-device function.
    axes: the mesh axes the batch is sharded over.
    replicated: a pytree of arrays needed whole on every device.
    split: arrays split along their batch axis over ``axes``.
    split_axes: each leaf of ``split``'s batch axis.
    out_specs: a prefix tree of the outputs' full partition specs, over
      ``axes`` and the other mesh axes.

  Returns:
    What ``per_device`` returns, sharded as ``out_specs`` says.

  Raises:
    ValueError: the user's functions close over a value traced in the step
      while ``axes`` are Explicit, which ``jax.shard_map`` cannot take in.
  """
  types = axes_lib.mesh_axis_types()
  if any(types[axis] == AxisType.Explicit for axis in axes):
    replicated = jax.tree.map(
      lambda leaf: (
        jax.reshard(leaf, axes_lib.without_axes(axes_lib.spec_of(leaf), axes))
        if set(axes) & axes_lib.sharded_axes(axes_lib.spec_of(leaf))
        else leaf
      ),
      replicated,
    )
    split = [
      _onto_batch_axes(leaf, axis, axes)
      for leaf, axis in zip(split, split_axes, strict=True)
    ]
  manual_specs = jax.tree.map(
    lambda spec: axes_lib.without_axes(spec, set(types) - set(axes)),
    out_specs,
    is_leaf=lambda node: isinstance(node, PartitionSpec),
  )
  mapped = jax.shard_map(
    per_device,
    in_specs=(
      PartitionSpec(),
      [PartitionSpec(*[None] * axis, axes) for axis in split_axes],
    ),
    out_specs=manual_specs,
    axis_names=set(axes),
    check_vma=False,
  )
  other_explicit = tuple(
    axis
    for axis, axis_type in types.items()
    if axis not in axes and axis_type == AxisType.Explicit
  )
  if other_explicit:
    # In jax 0.10 a shard_map manual over some axes gathers operands that
    # are sharded over other Explicit axes at its boundary (and slices them
    # again after). Seen as Auto inside, they stay sharded, and the
    # outputs come back with their full specs.
    mapped = jax.sharding.auto_axes(
      mapped, axes=other_explicit, out_sharding=out_specs
    )
  try:
    return mapped(replicated, list(split))
  except NotImplementedError as error:
    if "Closing over inputs to shard_map" not in str(error):
      raise
    raise ValueError(CLOSED_OVER_TRACER) from error


# JAX's shard_map takes in no value closed over from the enclosing trace on
# Explicit axes (a loss that reads a learning rate or a temperature computed
# in the jitted step); its error names the shard_map, which the user never
# wrote.
CLOSED_OVER_TRACER = (
  "fun (or weight_fn) closes over a value traced in the step (a temperature"
  " or weights computed inside the jitted function, say), and the batch is"
  " sharded over Explicit mesh axes, where each device's micro-batches run"
  " in a jax.shard_map that cannot take such a value in. Pass it as an"
  " argument instead: g(params, batch, value) calls fun(params,"
  " micro_batch, value) (arguments after the batch are passed unchanged);"
  " a weight_fn may read per-row weights from the batch."
)


def _onto_batch_axes(leaf: Any, axis: int, axes: Axes) -> Any:
  """``leaf`` resharded so that ``axes`` split its batch axis, if needed."""
  spec = batch_spec(leaf, axis, axes)
  current = axes_lib.spec_of(leaf)
  padded = [
    *current.partitions,
    *[None] * (np.ndim(leaf) - len(current.partitions)),
  ]
  if [axes_lib.spec_entry_axes(entry) for entry in padded] == [
    axes_lib.spec_entry_axes(entry) for entry in spec
  ]:
    return leaf
  return jax.reshard(leaf, spec)
