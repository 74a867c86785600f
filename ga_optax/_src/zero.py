"""The wrapped optimizer's state sharded over mesh axes (ZeRO stage 1).

With ``accumulate(..., unreduced_axes=..., inner_state_axes=...)`` every
device keeps its own partial sum of the window's gradient, as without
``inner_state_axes``, but only a slice of the wrapped optimizer's state. The
window's one collective changes shape, not size: where an all-reduce handed
every device the whole gradient, a reduce-scatter hands each device the
slice of the gradient that its slice of the state needs. The optimizer runs
on those slices (a global norm over them gets its own scalar reduction),
and its updates are gathered back to each parameter's own sharding. Per
window that is one reduce-scatter and one all-gather, the bytes of one
all-reduce; the state's memory and the optimizer's arithmetic are divided
by the number of devices.

Placement rule: a leaf is sharded over the axes (those it is not already
sharded over) along its first dimension that no mesh axis shards yet and
whose size their device count divides; a leaf with no such dimension (a
count, a bias of odd size) stays as it is. The gradient and the params take
the rule's spec of their parameter during the update, so a moment (shaped
and sharded like its parameter) meets them slice for slice. A spec tree
shaped like the params overrides the rule.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import PartitionSpec

from ga_optax._src import sharding


class StatePlacement(NamedTuple):
  """How :func:`ga_optax.accumulate` shards the wrapped optimizer's state.

  Attributes:
    axes: the mesh axes to shard over (with ``specs``: every axis they name).
    specs: None for the placement rule; else a tree of partition specs
      shaped like the params, one per parameter, for the gradient, the
      params and every state leaf that mirrors a parameter.
  """

  axes: sharding.Axes
  specs: Any


def check_inner_state_axes(
  inner_state_axes: Any, unreduced_axes: sharding.Axes
) -> StatePlacement | None:
  """Checks the ``inner_state_axes`` argument; None when it is not given.

  Raises:
    ValueError: given without ``unreduced_axes``.
    TypeError: neither axis names nor a tree of partition specs.
  """
  if inner_state_axes is None:
    return None
  if not unreduced_axes:
    raise ValueError(
      "inner_state_axes shards the optimizer state over mesh axes at the"
      " window's reduce-scatter, which needs an accumulator unreduced over"
      " the batch's axes: pass unreduced_axes too (for example"
      " unreduced_axes='data', inner_state_axes='data') and gradients from"
      f" ga_optax.unreduced_value_and_grad; got inner_state_axes="
      f"{inner_state_axes!r} without unreduced_axes."
    )
  if isinstance(inner_state_axes, str) or (
    isinstance(inner_state_axes, (tuple, list))
    and not isinstance(inner_state_axes, PartitionSpec)
    and inner_state_axes
    and all(isinstance(axis, str) for axis in inner_state_axes)
  ):
    return StatePlacement(
      sharding.as_axes(inner_state_axes, "inner_state_axes"), None
    )
  specs = jax.tree.leaves(inner_state_axes, is_leaf=_is_spec)
  if not specs or not all(_is_spec(spec) for spec in specs):
    raise TypeError(
      "inner_state_axes must be a mesh axis name, a tuple of names, or a"
      " tree of jax.sharding.PartitionSpec shaped like the params (one spec"
      f" per parameter); got {inner_state_axes!r}."
    )
  axes = sorted(
    {
      axis
      for spec in specs
      for entry in spec.partitions
      for axis in sharding.spec_entry_axes(entry)
    }
  )
  return StatePlacement(tuple(axes), inner_state_axes)


def check_mesh(placement: StatePlacement | None) -> None:
  """Raises unless the placement's axes are Explicit axes of the mesh."""
  if placement is not None:
    sharding.check_explicit(placement.axes, "inner_state_axes")


def sharded_spec(leaf: Any, axes: sharding.Axes) -> PartitionSpec:
  """The placement rule: ``leaf``'s spec with ``axes`` on one more dimension.

  The axes ``leaf`` is not already sharded over go on its first dimension
  that no mesh axis shards and whose size their device count divides; the
  spec is unchanged when there is none.
  """
  spec = sharding.spec_of(leaf)
  shape = getattr(leaf, "shape", ())
  partitions = list(spec.partitions)
  partitions += [None] * (len(shape) - len(partitions))
  used = {
    axis for entry in partitions for axis in sharding.spec_entry_axes(entry)
  }
  free = tuple(axis for axis in axes if axis not in used)
  mesh = jax.sharding.get_abstract_mesh()
  devices = math.prod(mesh.shape[axis] for axis in free)
  for dim, (size, entry) in enumerate(zip(shape, partitions, strict=True)):
    if free and entry is None and size > 0 and size % devices == 0:
      partitions[dim] = free[0] if len(free) == 1 else free
      break
  return PartitionSpec(
    *partitions, unreduced=spec.unreduced, reduced=spec.reduced
  )


def update_specs(params: Any, placement: StatePlacement) -> Any:
  """The spec each parameter's gradient, value and moments take to update.

  Raises:
    ValueError: the override's tree does not match the params, or one of
      its specs does not fit its parameter.
  """
  if placement.specs is None:
    return jax.tree.map(
      lambda param: sharded_spec(param, placement.axes), params
    )
  given: Any = jax.tree.structure(placement.specs, is_leaf=_is_spec)
  expected = jax.tree.structure(params)
  if given != expected:
    raise ValueError(
      "inner_state_axes, given as partition specs, must have the tree"
      f" structure of the params; expected {expected}, got {given}."
    )
  mesh = jax.sharding.get_abstract_mesh()
  for (path, param), spec in zip(
    jax.tree_util.tree_flatten_with_path(params)[0],
    jax.tree.leaves(placement.specs, is_leaf=_is_spec),
    strict=True,
  ):
    shape = tuple(getattr(param, "shape", ()))
    fits = len(spec.partitions) <= len(shape) and all(
      size % math.prod(mesh.shape[a] for a in sharding.spec_entry_axes(entry))
      == 0
      for size, entry in zip(shape, spec.partitions, strict=False)
    )
    if not fits:
      raise ValueError(
        f"inner_state_axes spec {spec} for params leaf"
        f" {jax.tree_util.keystr(path)} of shape {shape} does not fit it:"
        " each dimension must be divisible by the devices of the axes that"
        " shard it."
      )
  return placement.specs


def place(
  inner: optax.GradientTransformation,
  inner_state: Any,
  params: Any,
  placement: StatePlacement | None,
) -> Any:
  """``inner_state`` sharded by the placement (what ``init`` keeps)."""
  if placement is None:
    return inner_state
  if placement.specs is None:
    return jax.tree.map(
      lambda leaf: (
        jax.reshard(leaf, sharded_spec(leaf, placement.axes))
        if isinstance(leaf, jax.Array)
        else leaf
      ),
      inner_state,
    )
  # Which state leaves mirror which parameter, as optax knows it.
  return optax.tree_map_params(
    inner,
    lambda leaf, spec: (
      jax.reshard(leaf, spec) if isinstance(leaf, jax.Array) else leaf
    ),
    inner_state,
    update_specs(params, placement),
  )


def reduce(
  accumulator: Any, params: Any, placement: StatePlacement | None
) -> Any:
  """The window's unreduced sum, reduced onto the state's sharding.

  Without a placement, the all-reduce onto the params' sharding.
  """
  if placement is None:
    return sharding.reduce_unreduced(accumulator, params)
  specs = update_specs(_required(params), placement)
  return jax.tree.map(_reduce_scatter, accumulator, specs)


def update(
  inner: optax.GradientTransformationExtraArgs,
  placement: StatePlacement | None,
  grads: Any,
  inner_state: Any,
  params: Any,
  **extra_args: Any,
) -> tuple[Any, Any]:
  """``inner.update`` on the state's slices; updates like the params.

  The gradient and the params are resharded onto the state's sharding (a
  local slice where they are whole), the optimizer steps on the slices,
  and the updates are gathered back to each parameter's spec. The new
  state keeps the sharding of the old one.
  """
  if placement is None:
    return inner.update(grads, inner_state, params, **extra_args)
  specs = update_specs(_required(params), placement)

  def step(grads: Any, inner_state: Any, params: Any, extra_args: Any) -> Any:
    return inner.update(grads, inner_state, params, **extra_args)

  # Under Auto axes the compiler reconciles leaves that the rule shards
  # along different dimensions (Adafactor's row and column statistics meet
  # a gradient sliced along one of them); Explicit types would refuse them.
  on_slices = jax.sharding.auto_axes(
    step,
    axes=placement.axes,
    out_sharding=(specs, jax.tree.map(sharding.spec_of, inner_state)),
  )
  updates, new_state = on_slices(
    sharding.reshard_tree(grads, specs),
    inner_state,
    sharding.reshard_tree(params, specs),
    extra_args,
  )
  # Gathered once the step is done: the slices, not whole updates, are
  # the step's temporaries.
  return (
    sharding.reshard_tree(updates, jax.tree.map(_plain_spec, params)),
    new_state,
  )


def _plain_spec(leaf: Any) -> PartitionSpec:
  """``leaf``'s partitions, without unreduced or reduced axes."""
  return PartitionSpec(*sharding.spec_of(leaf).partitions)


def _reduce_scatter(leaf: jax.Array, target: PartitionSpec) -> jax.Array:
  """An unreduced leaf summed over its devices, landing sharded as ``target``.

  Each dimension ``target`` shards over axes the leaf is unreduced over
  (after the axes it is sharded over already) is reduce-scattered over them;
  the leaf's remaining unreduced axes are all-reduced. Whatever else
  ``target`` asks for (an axis the leaf is neither sharded nor unreduced
  over) is a local reshard afterwards.
  """
  spec = sharding.spec_of(leaf)
  target = _full_length(target, leaf.ndim)
  pending = set(spec.unreduced)
  scatters, landed = [], []
  for dim, (entry, wanted) in enumerate(
    zip(
      _full_length(spec, leaf.ndim).partitions, target.partitions, strict=True
    )
  ):
    have = sharding.spec_entry_axes(entry)
    want = sharding.spec_entry_axes(wanted)
    added = want[len(have) :]
    if want[: len(have)] == have and added and set(added) <= pending:
      scatters.append((dim, added))
      pending -= set(added)
      landed.append(wanted)
    else:
      landed.append(entry)
  remaining = tuple(sorted(pending))

  def per_device(block: jax.Array) -> jax.Array:
    for dim, axes in scatters:
      block = jax.lax.psum_scatter(
        block, axes, scatter_dimension=dim, tiled=True
      )
    return jax.lax.psum(block, remaining) if remaining else block

  # A fully manual map with the type checks off reads each device's block
  # as its partial sum, so psum_scatter compiles to a reduce-scatter; a
  # reshard of the unreduced array would all-reduce it and keep a slice.
  reduced = jax.shard_map(
    per_device,
    in_specs=spec,
    out_specs=PartitionSpec(*landed),
    check_vma=False,
  )(leaf)
  if sharding.spec_of(reduced) == target:
    return reduced
  return jax.reshard(reduced, target)


def _full_length(spec: PartitionSpec, ndim: int) -> PartitionSpec:
  """``spec``'s partitions padded with None to ``ndim`` entries."""
  partitions = spec.partitions
  return PartitionSpec(*partitions, *[None] * (ndim - len(partitions)))


def _required(params: Any) -> Any:
  if params is None:
    raise ValueError(
      "inner_state_axes needs the params in update (tx.update(grads, state,"
      " params)): the updates are gathered back to each parameter's"
      " sharding, and the params are sliced like the optimizer state."
    )
  return params


def _is_spec(node: Any) -> bool:
  return isinstance(node, PartitionSpec)
