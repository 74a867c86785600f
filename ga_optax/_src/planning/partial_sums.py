"""A window's per-device partial sums, in forms a checkpoint can hold.

Between the closes of a window spread over several devices, each device
holds its own partial sum of the gradients: under a plain ``jax.jit`` an
accumulator ``unreduced`` over the batch axes (``accumulate(...,
unreduced_axes=...)``), inside ``jax.shard_map`` a per-device accumulator
(``accumulate(..., axis_name=...)``). Neither can be saved as it is: orbax
cannot write unreduced arrays, and a ``shard_map`` that returns the state
replicated keeps one device's partial sum and drops the others'. Two ways
out:

* :func:`stack_partial_sums` / :func:`unstack_partial_sums`: each device's
  partial sum as one entry of an ordinary array sharded over the axes. The
  window resumes bit-identically on the same devices.
* :func:`consolidate` / :func:`split_total`: the partial sums summed into
  their total (one all-reduce), the same on every device, valid on any
  device count; on resuming, the total goes to the first device and the
  others start from zero. No sample is lost; the sums' rounding order
  changes, so the resumed window matches to float tolerance, not bit for
  bit.

These helpers read the data-parallel mode from what they are given, not
from the window's placement strategies (:mod:`ga_optax._src.placements`): a
strategy lives in the transformation that ``accumulate`` built, while a
checkpoint helper receives only the state, often restored in another
process that never built it. Under a plain ``jax.jit`` the state's own
types say the mode, leaf by leaf (a leaf ``unreduced`` over mesh axes is a
partial sum, whichever accumulation or noise-scale sum it belongs to);
inside ``jax.shard_map`` nothing in the state tells a per-device sum from a
replicated one, so the caller names ``axis_name``, as for ``accumulate``.
Nor are the operations the strategies': a strategy reduces a window once,
onto the optimizer's placement (a ZeRO-1 state's shards, say), where these
keep the partial sums apart (stack) or sum them into a total that stays an
accumulator (consolidate) and split it back; what they share with the
strategies, the spec vocabulary and the device count, comes from
:mod:`ga_optax._src.placements.axes`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ga_optax._src.algebra.noise_scale import WindowNoise
from ga_optax._src.placements import axes as axes_lib
from ga_optax._src.placements import residency
from ga_optax._src.window.state import AccumulateState


def _is_unreduced(leaf: Any) -> bool:
  return bool(axes_lib.unreduced_axes_of(leaf))


def _stacked_spec(spec: PartitionSpec, axes: tuple[str, ...]) -> PartitionSpec:
  return PartitionSpec(axes, *spec.partitions)


def stack_partial_sums(tree: Any) -> Any:
  """Every unreduced leaf as its devices' partial sums, stacked.

  A leaf ``unreduced`` over mesh axes (an accumulator of
  ``accumulate(..., unreduced_axes=...)`` mid-window) becomes an ordinary
  array with a new leading axis of one entry per device, sharded over those
  axes: no data moves, and orbax can save it. Other leaves pass unchanged.
  Call it under the mesh the state lives on (``jax.set_mesh``), eagerly or
  under ``jax.jit``; :func:`unstack_partial_sums` is the inverse.

  Example:
    >>> import jax, jax.numpy as jnp, optax, ga_optax
    >>> with jax.set_mesh(jax.make_mesh((1,), ("data",))):
    ...   tx = ga_optax.accumulate(optax.sgd(0.1), 4, unreduced_axes="data")
    ...   state = tx.init(jnp.zeros(3))
    ...   saved = ga_optax.planning.stack_partial_sums(state)
    >>> saved.accumulator.shape, state.accumulator.shape
    ((1, 3), (3,))
  """

  def stack(leaf: Any) -> Any:
    if not _is_unreduced(leaf):
      return leaf
    spec = axes_lib.spec_of(leaf)
    axes = tuple(sorted(spec.unreduced))
    plain = PartitionSpec(*spec.partitions)
    # Each device's block is its partial sum; with the type checks off a
    # fully manual map may read it as such and give it a leading axis.
    stacked = jax.shard_map(
      lambda block: block[None],
      in_specs=spec,
      out_specs=_stacked_spec(plain, axes),
      check_vma=False,
    )(residency.to_device(leaf))
    return residency.like_kinds(stacked, leaf)

  return jax.tree.map(stack, tree)


def unstack_partial_sums(tree: Any, like: Any) -> Any:
  """The inverse of :func:`stack_partial_sums`.

  Every leaf whose twin in ``like`` is unreduced over mesh axes is a stack
  of partial sums, one entry per device it was saved from, and becomes
  unreduced again. Saved from as many devices as the axes have here, each
  device gets its own partial sum back: bit-identical. Saved from another
  number S, entry ``i`` is added onto device ``i % D`` of the D here: the
  total is unchanged and no partial sum is lost.

  Args:
    tree: a restored state (or any tree) with the structure of ``like``.
    like: the state this run would start from, for example
      ``tx.init(params)`` or ``jax.eval_shape(tx.init, params)`` under the
      current mesh: its unreduced leaves say which leaves to convert, and
      how they are sharded.

  Raises:
    ValueError: a leaf to convert is not its twin's shape with a leading
      axis added.
  """

  def unstack(leaf: Any, twin: Any) -> Any:
    if not _is_unreduced(twin):
      return leaf
    if jnp.shape(leaf)[1:] != tuple(twin.shape) or jnp.ndim(leaf) == 0:
      raise ValueError(
        f"tree leaf of shape {jnp.shape(leaf)} is not a stack of partial"
        f" sums of its twin in like, shape {tuple(twin.shape)}: expected"
        f" (S, *{tuple(twin.shape)}) for S devices."
      )
    return _placed_unreduced(jnp.asarray(leaf, twin.dtype), twin)

  return jax.tree.map(unstack, tree, like)


def consolidate(tree: Any, axis_name: Any = None) -> Any:
  """A window's partial sums summed into their total, on every device.

  The state this returns holds, mid-window, the same on every device, so it
  can be saved as it is and resumed on any number of devices with
  :func:`split_total`. It costs the all-reduce the window's close would
  have run; do not keep training on it without :func:`split_total`, which
  would count the total once per device.

  Args:
    tree: a state, or a tree holding one.
    axis_name: None under a plain ``jax.jit``: every leaf unreduced over
      mesh axes (``accumulate(..., unreduced_axes=...)``) is summed over
      them. Inside ``jax.shard_map`` or ``pmap``: the ``axis_name`` given
      to ``accumulate``; the accumulator and weight sum of every
      ``AccumulateState`` in ``tree`` are summed over it.
  """
  if axis_name is None:
    return jax.tree.map(
      lambda leaf: (
        residency.like_kinds(
          jax.reshard(residency.to_device(leaf), axes_lib.plain_spec(leaf)),
          leaf,
        )
        if _is_unreduced(leaf)
        else leaf
      ),
      tree,
    )
  axes = _untracked_axes(axis_name, "consolidate")

  def total(state: AccumulateState) -> Any:
    accumulator, sums = jax.lax.psum(
      (residency.to_device(state.accumulator), _window_sums(state)), axes
    )
    return _with_window_sums(
      state._replace(
        accumulator=residency.like_kinds(accumulator, state.accumulator)
      ),
      sums,
    )

  return _map_states(total, tree)


def split_total(tree: Any, like: Any = None, axis_name: Any = None) -> Any:
  """The inverse of :func:`consolidate`: the total on the first device.

  Each device's partial sums start again from the consolidated total: the
  first device along the axes holds it, the others zero, so their sum is
  the total on any number of devices.

  Args:
    tree: a consolidated state (restored from a checkpoint, on any mesh).
    like: under a plain ``jax.jit``, the state this run would start from
      (``tx.init(params)`` or its ``jax.eval_shape``): leaves whose twin is
      unreduced become unreduced again.
    axis_name: inside ``jax.shard_map`` or ``pmap``, the ``axis_name``
      given to ``accumulate``; ``like`` is then not needed.

  Raises:
    ValueError: neither or both of ``like`` and ``axis_name`` are given.
  """
  if (like is None) == (axis_name is None):
    raise ValueError(
      "split_total needs like (under a plain jax.jit) or axis_name (inside"
      " jax.shard_map or pmap), exactly one of them."
    )
  if like is not None:
    return jax.tree.map(
      lambda leaf, twin: (
        _placed_unreduced(jnp.asarray(leaf, twin.dtype)[None], twin)
        if _is_unreduced(twin)
        else leaf
      ),
      tree,
      like,
    )
  axes = _untracked_axes(axis_name, "split_total")
  first = jax.lax.axis_index(axes) == 0

  def keep_on_first(state: AccumulateState) -> Any:
    accumulator, sums = jax.tree.map(
      lambda leaf: jnp.where(first, leaf, jnp.zeros_like(leaf)),
      (residency.to_device(state.accumulator), _window_sums(state)),
    )
    return _with_window_sums(
      state._replace(
        accumulator=residency.like_kinds(accumulator, state.accumulator)
      ),
      sums,
    )

  return _map_states(keep_on_first, tree)


def _window_sums(state: AccumulateState) -> Any:
  """The open window's scalar sums kept per device: weights, noise terms."""
  noise_terms = tuple(
    part.terms for part in state.parts if isinstance(part, WindowNoise)
  )
  return (state.weight_sum, noise_terms)


def _with_window_sums(state: AccumulateState, sums: Any) -> AccumulateState:
  """``state`` with the sums of :func:`_window_sums` replaced."""
  weight_sum, noise_terms = sums
  terms = iter(noise_terms)
  return state._replace(
    weight_sum=weight_sum,
    parts=tuple(
      part._replace(terms=next(terms))
      if isinstance(part, WindowNoise)
      else part
      for part in state.parts
    ),
  )


def _untracked_axes(axis_name: Any, caller: str) -> axes_lib.Axes:
  """``axis_name`` as a tuple, inside a ``shard_map`` with ``check_vma=False``.

  With ``check_vma=True`` the window holds gradients autodiff has already
  summed over the devices, the same on every device: there are no partial
  sums to combine, and a total from one device count would be scaled
  wrongly on another.
  """
  axes = axes_lib.as_axes(axis_name, "axis_name")
  if axes_lib.tracks_variance(axes):
    raise ValueError(
      f"{caller} combines per-device partial sums, which a jax.shard_map"
      " with check_vma=True does not keep (its gradients arrive summed over"
      f" {axes!r}); run the step with check_vma=False."
    )
  return axes


def _placed_unreduced(stacked: jax.Array, twin: Any) -> jax.Array:
  """Stacked partial sums (S entries) as a leaf unreduced like ``twin``.

  Computed in device memory; the result is in ``twin``'s memory kind.
  """
  stacked = residency.to_device(stacked)
  spec = axes_lib.spec_of(twin)
  axes = tuple(sorted(spec.unreduced))
  num_devices = axes_lib.device_count(axes)
  saved = stacked.shape[0]
  if saved != num_devices:
    padding = -saved % num_devices
    stacked = jnp.concatenate(
      [stacked, jnp.zeros((padding, *stacked.shape[1:]), stacked.dtype)]
    )
    stacked = stacked.reshape(-1, num_devices, *stacked.shape[1:]).sum(0)
  stacked = jax.reshard(
    stacked, _stacked_spec(PartitionSpec(*spec.partitions), axes)
  )
  return residency.like_kinds(
    axes_lib.sum_to_unreduced(stacked, twin, axes), twin
  )


def _map_states(fn: Any, tree: Any) -> Any:
  """``fn`` applied to every ``AccumulateState`` node of ``tree``."""

  def is_state(node: Any) -> bool:
    return isinstance(node, AccumulateState)

  return jax.tree.map(
    lambda node: fn(node) if is_state(node) else node, tree, is_leaf=is_state
  )
