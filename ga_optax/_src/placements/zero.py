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
all-reduce, for optimizers that work elementwise (Adam, Lion, SGD, RMSProp,
Adafactor's factored statistics); the state's memory and the optimizer's
arithmetic are divided by the number of devices. An optimizer that needs
whole matrices (``optax.contrib.muon``'s orthogonalisation, say) gathers
them inside its step, which costs more traffic than the all-reduce.

Placement rule: a leaf is sharded over the axes (those it is not already
sharded over) along its first dimension that no mesh axis shards yet and
whose size their device count divides; a leaf with no such dimension (a
count, a bias of odd size) stays as it is. The gradient and the params take
the rule's spec of their parameter during the update, so a moment (shaped
and sharded like its parameter) meets them slice for slice. A spec tree
shaped like the params overrides the rule for each parameter and for the
state leaves shaped like it; other state leaves follow the rule.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from ga_optax._src.placements import axes as axes_lib


def _is_spec(node: Any) -> bool:
  return isinstance(node, PartitionSpec)


@dataclasses.dataclass(frozen=True)
class Shards:
  """Which spec each parameter and state leaf takes: by the rule or by specs.

  Only specs are decided here; :class:`ShardedState` moves the data.

  Attributes:
    axes: the mesh axes to shard over (with ``specs``: every axis they name).
    specs: None for the placement rule; else a tree of partition specs
      shaped like the params, one per parameter, for the gradient, the
      params and every state leaf shaped like its parameter.
  """

  axes: axes_lib.Axes
  specs: Any = None

  @classmethod
  def of(cls, inner_state_axes: Any) -> Shards:
    """The shards the ``inner_state_axes`` argument asks for.

    Raises:
      TypeError: neither axis names nor a tree of partition specs.
    """
    if isinstance(inner_state_axes, str) or (
      isinstance(inner_state_axes, (tuple, list))
      and not isinstance(inner_state_axes, PartitionSpec)
      and inner_state_axes
      and all(isinstance(axis, str) for axis in inner_state_axes)
    ):
      return cls(axes_lib.as_axes(inner_state_axes, "inner_state_axes"))
    specs = jax.tree.leaves(inner_state_axes, is_leaf=_is_spec)
    if not specs or not all(_is_spec(spec) for spec in specs):
      raise TypeError(
        "inner_state_axes must be a mesh axis name, a tuple of names, or a"
        " tree of jax.sharding.PartitionSpec shaped like the params (one spec"
        f" per parameter); got {inner_state_axes!r}."
      )
    named = {axis for spec in specs for axis in axes_lib.sharded_axes(spec)}
    return cls(tuple(sorted(named)), inner_state_axes)

  def rule_spec(self, leaf: Any) -> PartitionSpec:
    """The placement rule: ``leaf``'s spec with the axes on one more dimension.

    The axes ``leaf`` is not already sharded over go on its first dimension
    that no mesh axis shards and whose size their device count divides; the
    spec is unchanged when there is none.
    """
    spec = axes_lib.spec_of(leaf)
    shape = getattr(leaf, "shape", ())
    partitions = list(spec.partitions)
    partitions += [None] * (len(shape) - len(partitions))
    used = axes_lib.sharded_axes(spec)
    free = tuple(axis for axis in self.axes if axis not in used)
    devices = axes_lib.device_count(free)
    for dim, (size, entry) in enumerate(zip(shape, partitions, strict=True)):
      if free and entry is None and size > 0 and size % devices == 0:
        partitions[dim] = free[0] if len(free) == 1 else free
        break
    return PartitionSpec(
      *partitions, unreduced=spec.unreduced, reduced=spec.reduced
    )

  def update_specs(self, params: Any) -> Any:
    """The spec each parameter's gradient, value and moments take to update.

    Raises:
      ValueError: the override's tree does not match the params, or one of
        its specs does not fit its parameter.
    """
    if self.specs is None:
      return jax.tree.map(self.rule_spec, params)
    given: Any = jax.tree.structure(self.specs, is_leaf=_is_spec)
    expected = jax.tree.structure(params)
    if given != expected:
      raise ValueError(
        "inner_state_axes, given as partition specs, must have the tree"
        f" structure of the params; expected {expected}, got {given}."
      )
    for (path, param), spec in zip(
      jax.tree_util.tree_flatten_with_path(params)[0],
      jax.tree.leaves(self.specs, is_leaf=_is_spec),
      strict=True,
    ):
      shape = tuple(getattr(param, "shape", ()))
      if not _fits(spec, shape):
        raise ValueError(
          f"inner_state_axes spec {spec} for params leaf"
          f" {jax.tree_util.keystr(path)} of shape {shape} does not fit it:"
          " each dimension must be divisible by the devices of the axes"
          " that shard it."
        )
    return self.specs

  def state_specs(
    self, inner_state: Any, params: Any
  ) -> list[PartitionSpec | None]:
    """The spec of each leaf of ``inner_state``, in leaf order.

    None for a leaf that is not an array. With specs, a state leaf that
    mirrors a parameter (its path ends with the parameter's path, as Adam's
    moments' do, and it has the parameter's shape) takes the parameter's
    spec; any other leaf (a count, Adafactor's factored statistics) follows
    the rule.
    """
    mirrored = (
      {}
      if self.specs is None
      else {
        _path_keys(path): (tuple(jnp.shape(param)), spec)
        for (path, param), spec in zip(
          jax.tree_util.tree_flatten_with_path(params)[0],
          jax.tree.leaves(self.update_specs(params), is_leaf=_is_spec),
          strict=True,
        )
      }
    )

    def leaf_spec(path: Any, leaf: Any) -> PartitionSpec | None:
      if not isinstance(leaf, jax.Array):
        return None
      keys = _path_keys(path)
      for start in range(len(keys)):
        shape, spec = mirrored.get(keys[start:], ((), None))
        if spec is not None and shape == leaf.shape:
          return spec
      return self.rule_spec(leaf)

    return [
      leaf_spec(path, leaf)
      for path, leaf in jax.tree_util.tree_flatten_with_path(inner_state)[0]
    ]


@dataclasses.dataclass(frozen=True)
class ShardedState:
  """The optimizer state on its shards: placed, reduced onto, stepped there.

  Attributes:
    shards: which spec each parameter and state leaf takes.
  """

  shards: Shards

  @classmethod
  def of(cls, inner_state_axes: Any) -> ShardedState:
    """The placement the ``inner_state_axes`` argument asks for.

    Raises:
      TypeError: neither axis names nor a tree of partition specs.
    """
    return cls(Shards.of(inner_state_axes))

  def check_mesh(self) -> None:
    axes_lib.check_explicit(self.shards.axes, "inner_state_axes")

  def place(
    self, inner: optax.GradientTransformation, inner_state: Any, params: Any
  ) -> Any:
    """``inner_state`` sharded as :meth:`Shards.state_specs` says."""
    del inner
    leaves, treedef = jax.tree.flatten(inner_state)
    specs = self.shards.state_specs(inner_state, params)
    return jax.tree.unflatten(
      treedef,
      [
        leaf if spec is None else jax.reshard(leaf, spec)
        for leaf, spec in zip(leaves, specs, strict=True)
      ],
    )

  def reduce(self, accumulator: Any, params: Any) -> Any:
    """The window's unreduced sum, reduce-scattered onto the state's slices."""
    specs = self.shards.update_specs(_required(params))
    return jax.tree.map(_reduce_scatter, accumulator, specs)

  def update(
    self,
    inner: optax.GradientTransformationExtraArgs,
    grads: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
  ) -> tuple[Any, Any]:
    """``inner.update`` on the state's slices; updates like the params.

    The gradient and the params are resharded onto the state's sharding (a
    local slice where they are whole), the optimizer steps on the slices,
    and the updates are gathered back to each parameter's spec. The new
    state keeps the sharding of the old one.
    """
    specs = self.shards.update_specs(_required(params))
    # Under Auto axes the compiler reconciles leaves that the rule shards
    # along different dimensions (Adafactor's row and column statistics meet
    # a gradient sliced along one of them); Explicit types would refuse them.
    step, constants = _constants_as_arguments(
      inner.update, grads, inner_state, params, extra_args
    )
    on_slices = jax.sharding.auto_axes(
      step,
      axes=self.shards.axes,
      out_sharding=(specs, jax.tree.map(axes_lib.spec_of, inner_state)),
    )
    updates, new_state = on_slices(
      constants,
      axes_lib.reshard_tree(grads, specs),
      inner_state,
      axes_lib.reshard_tree(params, specs),
      extra_args,
    )
    # Gathered once the step is done: the slices, not whole updates, are
    # the step's temporaries.
    return (
      axes_lib.reshard_tree(updates, jax.tree.map(axes_lib.plain_spec, params)),
      new_state,
    )


def _constants_as_arguments(
  update: Any, grads: Any, inner_state: Any, params: Any, extra_args: Any
) -> tuple[Any, list[Any]]:
  """``update`` as a function of its constants and arguments, and the constants.

  An optimizer may close over arrays made under ``jax.set_mesh`` (a learning
  rate given as ``jnp.float32(0.1)``, a schedule's boundaries), typed with
  the mesh's Explicit axes; inside ``auto_axes`` those axes are Auto, and
  JAX refuses to mix the two. Traced once on the arguments' shapes alone,
  with no mesh, the constants come out of the trace, to be passed in as
  arguments and converted like the others.
  """
  shapes = jax.tree.map(
    lambda leaf: jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf)),
    (grads, inner_state, params, extra_args),
  )

  def step(grads: Any, inner_state: Any, params: Any, extra_args: Any) -> Any:
    return update(grads, inner_state, params, **extra_args)

  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    traced, out_shapes = jax.make_jaxpr(step, return_shape=True)(*shapes)

  def with_constants(constants: list[Any], *args: Any) -> Any:
    run = jax.extend.core.jaxpr_as_fun(
      jax.extend.core.ClosedJaxpr(traced.jaxpr, constants)
    )
    outputs = run(*jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(out_shapes), outputs)

  return with_constants, list(traced.consts)


def _path_keys(path: Any) -> tuple[str, ...]:
  """A tree path as a tuple of printed keys, to compare its suffixes."""
  return tuple(jax.tree_util.keystr((key,)) for key in path)


def _fits(spec: PartitionSpec, shape: tuple[int, ...]) -> bool:
  """Whether each dimension of ``shape`` divides over its spec entry's axes."""
  return len(spec.partitions) <= len(shape) and all(
    size % axes_lib.device_count(axes_lib.spec_entry_axes(entry)) == 0
    for size, entry in zip(shape, spec.partitions, strict=False)
  )


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _reduce_scatter(leaf: jax.Array, target: PartitionSpec) -> jax.Array:
  """An unreduced leaf summed over its devices, landing sharded as ``target``.

  One reduce-scatter per leaf (:func:`_scattered_in_map`). Its derivative is
  the same sum written as a reshard: JAX transposes the map that makes the
  reduce-scatter wrongly (a meta-gradient through a ZeRO-1 window came out
  at a fraction of the large batch's), and transposes the reshard right,
  into a gather of the cotangent. A step that is not differentiated keeps
  the reduce-scatter.
  """
  return _scattered_in_map(leaf, target)


@_reduce_scatter.defjvp
def _reduce_scatter_jvp(
  target: PartitionSpec, primals: tuple[jax.Array], tangents: tuple[jax.Array]
) -> tuple[jax.Array, jax.Array]:
  (leaf,), (leaf_dot,) = primals, tangents
  return _reduce_scatter(leaf, target), jax.reshard(leaf_dot, target)


def _scattered_in_map(leaf: jax.Array, target: PartitionSpec) -> jax.Array:
  """:func:`_reduce_scatter`, as collectives in a fully manual map.

  Each dimension ``target`` shards over axes the leaf is unreduced over
  (after the axes it is sharded over already) is reduce-scattered over them;
  the leaf's remaining unreduced axes are all-reduced. Whatever else
  ``target`` asks for (an axis the leaf is neither sharded nor unreduced
  over) is a local reshard afterwards.
  """
  spec = axes_lib.spec_of(leaf)
  target = _full_length(target, leaf.ndim)
  pending = set(spec.unreduced)
  scatters, landed = [], []
  for dim, (entry, wanted) in enumerate(
    zip(
      _full_length(spec, leaf.ndim).partitions, target.partitions, strict=True
    )
  ):
    have = axes_lib.spec_entry_axes(entry)
    want = axes_lib.spec_entry_axes(wanted)
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
  if axes_lib.spec_of(reduced) == target:
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
