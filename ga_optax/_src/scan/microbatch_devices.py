"""Where the in-step scan runs: a device, a caller's map, or each device's rows.

On several devices the scan runs per device, on each device's own entries,
and the sums are reduced once after it: inside a ``jax.shard_map`` (or
``pmap``) the caller wrote, over the ``axis_name`` axes
(:func:`local_or_manual`), or inside one written here over the mesh axes a
batch is sharded over under a plain ``jax.jit`` (:func:`per_device_sums`).

The mode is worked out here, not asked of the window's placement strategies
(:mod:`ga_optax._src.placements`), because the two answer other questions at
other times. A strategy is chosen once, from the arguments of
``accumulate``, and says how a window that outlives many calls keeps and
reduces gradients it is handed. The in-step path makes its own gradients
within one call, and its mode follows from that call's batch: the mesh axes
in the batch's type, or ``axis_name``, which here names mesh axes under a
plain ``jax.jit`` as well as manual axes (``accumulate`` refuses mesh axes
there). Its reductions differ too. Each device's sums are partial and are
always summed (in a caller's ``shard_map`` the parameters are cast to
varying to keep them so), where the ``Collective`` strategy takes the
gradients of a ``check_vma=True`` map as summed by autodiff already; and
under a plain ``jax.jit`` the path sums them with a collective inside the
map it writes, or hands them out ``unreduced`` for the window to sum, where
the ``Unreduced`` strategy reshards an accumulator that is unreduced
already. What the two share, the vocabulary of mesh axes and specs and the
device count, lives in :mod:`ga_optax._src.placements.axes`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType, PartitionSpec

from ga_optax._src.algebra import parts
from ga_optax._src.placements import axes as axes_lib
from ga_optax._src.scan import batch_layout
from ga_optax._src.scan.microbatch_scan import (
  Inputs,
  Microbatching,
  Sums,
  Weighting,
)


class Result(NamedTuple):
  """One call's results, over every micro-batch on every device.

  Attributes:
    value: the weighted mean of the loss.
    grads: the weighted mean gradient (partial sums unreduced over the batch
      axes, when asked for).
    aux: the auxiliary outputs, stacked per micro-batch (and device).
    weight: the batch's total weight, the same on every device.
    reports: what each part of the sums reported when they closed
      (:meth:`Weighting.close`), the same on every device.
  """

  value: jax.Array
  grads: Any
  aux: Any
  weight: jax.Array
  reports: tuple[Any, ...]

  def report(self, kind: type[parts.Report]) -> parts.Report:
    """The one report of type ``kind`` (see :func:`parts.report_of`)."""
    return parts.report_of(self.reports, kind)


class ReducedAfterScan:
  """The devices' sums reduced once after the scan, inside the map."""

  def grad_spec(self, axes: axes_lib.Axes, spec: PartitionSpec) -> Any:
    """The spec of a gradient leaving the map: the parameter's own."""
    del axes
    return PartitionSpec(*spec.partitions)

  def per_device(
    self, weighting: Weighting, sums: Sums, diff: Any, axes: axes_lib.Axes
  ) -> Result:
    """One device's result, from its own sums."""
    sums = sums.reduced(axes, weighting.carried(diff))
    value, grads, reports = weighting.close(sums, diff)
    return Result(value, grads, None, sums.weight, reports)

  def outside(self, grads: Any, diff: Any, axes: axes_lib.Axes) -> Any:
    """The gradients as the caller gets them."""
    if _explicit(axes):
      # A parameter sharded over a batch axis (FSDP) was gathered for the
      # scan; its gradient goes back to the parameter's own sharding.
      return axes_lib.reshard_tree(grads, jax.tree.map(axes_lib.spec_of, diff))
    return grads


class LeftUnreduced:
  """The gradients left ``unreduced`` over the batch axes, for the window.

  They leave scaled by the global weight but not summed over devices, for
  ``accumulate(..., unreduced_axes=axes)`` to sum once per window.
  """

  def grad_spec(self, axes: axes_lib.Axes, spec: PartitionSpec) -> Any:
    # One partial sum per device, stacked along a new leading axis: a
    # shard_map may not return unreduced values while other axes stay
    # outside it, so they are summed into unreduced ones after it.
    return PartitionSpec(axes, *spec.partitions)

  def per_device(
    self, weighting: Weighting, sums: Sums, diff: Any, axes: axes_lib.Axes
  ) -> Result:
    if any(part.combine != "sum" for part in weighting.carried(diff)):
      raise ValueError(
        "unreduced_value_and_grad cannot leave Flax float8 state"
        " (_overwrite_with_gradient) unreduced: it is combined by a max, not"
        " summed. Use ga_optax.microbatched_value_and_grad, whose gradients"
        " are reduced once after its scan."
      )
    # The value's and the weight's sums share one scalar all-reduce.
    value_sum, weight_sum = jax.lax.psum((sums.value, sums.weight), axes)
    value, grads, _ = weighting.close(
      sums._replace(value=value_sum, weight=weight_sum, parts=()), diff
    )
    stacked = jax.tree.map(lambda grad: grad[None], grads)
    return Result(value, stacked, None, weight_sum, ())

  def outside(self, grads: Any, diff: Any, axes: axes_lib.Axes) -> Any:
    return axes_lib.sum_to_unreduced(grads, diff, axes)


Reduction = ReducedAfterScan | LeftUnreduced


def per_device_sums(
  microbatching: Microbatching,
  axes: axes_lib.Axes,
  inputs: Inputs,
  reduction: Reduction,
) -> Result:
  """Micro-batching of a batch sharded over mesh ``axes``, under plain jit.

  Each device scans its own entries; the map over the devices does not
  check varying axes, so each micro-batch's gradient stays a device-local
  partial sum and the user's loss runs as JAX runs it. ``reduction`` says
  how the sums leave the map.

  Returns:
    The :class:`Result`; aux leaves are stacked per sub-batch, device
    major: entry ``d * k + i`` is micro-batch ``i`` on device ``d``.
  """
  devices = axes_lib.device_count(axes)
  batch_layout.check_divisible(
    inputs.layout, microbatching.num_microbatches, devices
  )
  local_layout = inputs.layout._replace(size=inputs.layout.size // devices)
  arrays, rebuild = batch_layout.split_arrays(inputs.shared())
  diff = inputs.trainable.diff

  def per_device(arrays: list[Any], split: list[Any]) -> Any:
    local = inputs.with_shared(rebuild(arrays), split)
    local = local._replace(layout=local_layout)
    if local.rng is not None:
      # Devices hold different entries: they must not share dropout masks.
      local = local._replace(
        rng=jax.random.fold_in(local.rng, jax.lax.axis_index(axes))
      )
    sums, aux = microbatching.sums(local, device_axes=axes)
    result = reduction.per_device(
      microbatching.weighting, sums, local.trainable.diff, axes
    )
    return result._replace(aux=aux)

  # Gradients keep each parameter's spec over other mesh axes.
  grad_specs = jax.tree.map(
    lambda param: reduction.grad_spec(
      axes, axes_lib.without_axes(axes_lib.spec_of(param), axes)
    ),
    diff,
  )
  result = batch_layout.map_over_batch_axes(
    per_device,
    axes,
    arrays,
    inputs.split,
    inputs.layout.split_axes,
    # value, grads, aux (per device), weight, reports.
    out_specs=Result._make(
      (
        PartitionSpec(),
        grad_specs,
        PartitionSpec(axes),
        PartitionSpec(),
        PartitionSpec(),
      )
    ),
  )
  return result._replace(grads=reduction.outside(result.grads, diff, axes))


def _explicit(axes: axes_lib.Axes) -> bool:
  types = axes_lib.mesh_axis_types()
  return all(types[axis] == AxisType.Explicit for axis in axes)


def data_parallel_axes(
  inputs: Inputs, axis_name: Any
) -> tuple[axes_lib.Axes, axes_lib.Axes]:
  """``(mesh_axes, manual_axes)``: where the batch is split, and how.

  ``mesh_axes``: the axes of a batch sharded under plain ``jit``, from
  ``axis_name`` or, under Explicit axes, from the batch's type.
  ``manual_axes``: axes the caller's ``shard_map`` (or ``pmap``) is manual
  over, to be summed over with a collective.
  """
  sharded_over = batch_layout.sharded_axes(inputs.layout, inputs.split)
  if axis_name is None:
    types = axes_lib.mesh_axis_types()
    missing = [axis for axis in sharded_over if axis not in types]
    if missing:
      raise ValueError(
        f"batch is sharded over mesh axes {sharded_over!r}, but no mesh"
        f" with {missing!r} is set: call the function under"
        " jax.set_mesh(mesh) (or `with jax.set_mesh(mesh):`), so that each"
        " device can work on its own entries."
      )
    return sharded_over, ()
  named = axes_lib.as_axes(axis_name, "axis_name")
  in_mesh = axes_lib.mesh_axes(named)
  if not in_mesh:
    for axis in named:
      try:
        jax.lax.axis_size(axis)
      except NameError:
        raise ValueError(
          f"axis_name {axis!r} is neither an axis of the current mesh nor"
          " bound by an enclosing jax.shard_map or pmap. Under a plain"
          " jax.jit, set the mesh the batch is sharded on with"
          " jax.set_mesh(mesh)."
        ) from None
    return (), named
  if in_mesh != named:
    raise ValueError(
      f"axis_name {named!r} mixes mesh axes {in_mesh!r} with axes this code"
      " is already manual over (inside shard_map or pmap); name one kind."
    )
  if sharded_over and sharded_over != named:
    raise ValueError(
      f"axis_name is {named!r}, but batch is sharded over {sharded_over!r}"
      " along its batch axis (in_axes); pass axis_name=None to use the"
      " batch's own axes, or reshard the batch."
    )
  return named, ()


def local_or_manual(
  microbatching: Microbatching, manual_axes: axes_lib.Axes, inputs: Inputs
) -> Result:
  """One device's batch, or the caller's ``shard_map`` over ``manual_axes``."""
  batch_layout.check_divisible(
    inputs.layout,
    microbatching.num_microbatches,
    where=(
      f"inside the jax.shard_map (or pmap) over axis_name {manual_axes!r}"
      if manual_axes
      else ""
    ),
  )
  # Inside a shard_map that checks varying axes, varying parameters give
  # device-local gradients: no collective in the backward pass of each
  # micro-batch, one sum after the scan. (pmap and vmap axes do not track
  # variance.)
  varying_axes = axes_lib.shard_map_axes(manual_axes)
  trainable = inputs.trainable
  trainable = trainable._replace(
    diff=axes_lib.cast_to_varying(trainable.diff, varying_axes)
  )
  inputs = inputs._replace(trainable=trainable)
  if manual_axes and inputs.rng is not None:
    inputs = inputs._replace(
      rng=jax.random.fold_in(inputs.rng, jax.lax.axis_index(manual_axes))
    )
  sums, aux = microbatching.sums(
    inputs, varying_axes=varying_axes, device_axes=manual_axes
  )
  weighting = microbatching.weighting
  if manual_axes:
    sums = sums.reduced(manual_axes, weighting.carried(trainable.diff))
  value, grads, reports = weighting.close(sums, trainable.diff)
  return Result(value, grads, aux, sums.weight, reports)


def unreduced_batch_axes(inputs: Inputs, unreduced_axes: Any) -> axes_lib.Axes:
  """The Explicit mesh axes to leave the gradients unreduced over."""
  sharded_over = batch_layout.sharded_axes(inputs.layout, inputs.split)
  axes = (
    sharded_over
    if unreduced_axes is None
    else axes_lib.as_axes(unreduced_axes, "unreduced_axes")
  )
  if not axes:
    raise ValueError(
      "unreduced_axes is None and batch is not sharded along its batch axis"
      " (in_axes); put the batch with jax.device_put(batch, P('data'))"
      " under a mesh with Explicit axes (jax.make_mesh + jax.set_mesh), or"
      " name the axes."
    )
  types = axes_lib.mesh_axis_types()
  not_explicit = [axis for axis in axes if types.get(axis) != AxisType.Explicit]
  if not_explicit:
    raise ValueError(
      f"unreduced_axes {axes!r} must be Explicit axes of the current mesh;"
      f" {not_explicit!r} are not (mesh axes: {types}). Create the mesh with"
      " jax.make_mesh(..., axis_types=(AxisType.Explicit, ...)) and set it"
      " with jax.set_mesh."
    )
  if sharded_over and sharded_over != axes:
    raise ValueError(
      f"unreduced_axes is {axes!r}, but batch is sharded over"
      f" {sharded_over!r} along its batch axis (in_axes)."
    )
  return axes
