"""Where state lives between calls: a JAX memory kind, or wherever JAX puts it.

An array's sharding carries a memory kind: ``"device"`` (the accelerator's
own memory, the default) or a host memory such as ``"pinned_host"``. State
kept in host memory costs no device memory between micro-steps; a jitted
step brings it to the device where it is computed on and sends it back.
Inside ``jit`` JAX (0.10) types an array's memory as ``jax.memory.Space``:
``Device`` or ``Host``, the latter being ``"pinned_host"``, so those two are
the kinds state can be kept in from one jitted call to the next.

:class:`Residency` is that choice for one part of the state, made once from
the arguments; ``Residency(None, ...)`` keeps nothing anywhere in particular
and every method of it does nothing, so the window calls it unconditionally.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The memory kinds a jitted program can type its values with, and the space
# that names each inside jit.
SPACES = {
  "device": jax.memory.Space.Device,
  "pinned_host": jax.memory.Space.Host,
}


def offered_kinds() -> tuple[str, ...]:
  """The memory kinds the first device offers."""
  device = jax.devices()[0]
  return tuple(memory.kind for memory in device.addressable_memories())


def check_memory_kind(kind: Any, name: str) -> str | None:
  """Returns ``kind`` (None, or a memory kind state can live in), or raises.

  Raises:
    TypeError: ``kind`` is neither None nor a string.
    ValueError: the device does not offer ``kind``, or offers it but a
      jitted program cannot keep values in it.
  """
  if kind is None:
    return None
  if not isinstance(kind, str):
    raise TypeError(
      f"{name} must be None or a memory kind such as 'pinned_host' (a str),"
      f" got {kind!r} of type {type(kind).__name__}."
    )
  offered = offered_kinds()
  if kind not in offered:
    raise ValueError(
      f"{name}={kind!r} is not a memory kind of this device"
      f" ({jax.devices()[0]}); it offers {offered!r}."
    )
  if kind not in SPACES:
    usable = tuple(k for k in offered if k in SPACES)
    raise ValueError(
      f"{name}={kind!r} is offered by this device, but a jitted program can"
      f" only keep values in {usable!r} (jax.memory.Space): state put in"
      f" {kind!r} would come back in device memory. Use 'pinned_host'."
    )
  return kind


@dataclasses.dataclass(frozen=True)
class Residency:
  """Where one part of the state is kept between calls.

  Attributes:
    kind: the memory kind (``"pinned_host"``, say), or None to leave the
      arrays wherever JAX puts them.
    field: the state field it governs, for error messages.
    argument: the argument that chose it, for error messages.
    refused_in_reverse_mode: the placement under which a step that is
      differentiated cannot keep the arrays in ``kind`` (``"jax.shard_map
      (axis_name)"``, say), or None where it can.
    refused_under_a_mesh: whether such a step is refused, too, where a
      mesh is set (``jax.set_mesh``) on a JAX that cannot differentiate it
      there (:data:`MESH_DIFFERENTIATES_HOST_STATE`).
  """

  kind: str | None
  field: str
  argument: str
  refused_in_reverse_mode: str | None = None
  refused_under_a_mesh: bool = False

  @property
  def home(self) -> str:
    """The memory kind ``update`` leaves the arrays in."""
    return self.kind or "device"

  def keep(self, tree: Any, *, unplaced: Any = None) -> Any:
    """``tree`` in this residency's memory kind (as it is for None).

    ``unplaced``: where arrays not committed to devices go (a scalar made by
    ``jnp.zeros``, say); None keeps them on their default device.

    Raises:
      ValueError: a step that keeps the arrays out of device memory under
        :attr:`refused_in_reverse_mode` is differentiated (raised while
        ``jax.grad`` traces it, where ``tree`` depends on what is
        differentiated).
    """
    refused = self.refused_in_reverse_mode
    if refused is None and self.refused_under_a_mesh and _mesh_is_set():
      refused = f"jax.set_mesh on JAX {jax.__version__}"
    if self.kind is not None and refused is not None:
      refusal = self._reverse_mode_refusal(refused)
      tree = jax.tree.map(
        lambda leaf: (
          _not_differentiated(leaf, refusal)
          if isinstance(leaf, jax.core.Tracer)
          else leaf
        ),
        tree,
      )
    return put(tree, self.kind, unplaced=unplaced)

  def _reverse_mode_refusal(self, refused: str) -> str:
    return (
      f"jax.grad through a step that keeps {self.field} out of device memory"
      f" ({self.argument}={self.kind!r}) under {refused}"
      " is not supported: JAX (0.10) gives the cotangent of such a state"
      " another memory kind or sharding than its type. Leave"
      f" {self.argument}=None (device memory) for a step that is"
      f" differentiated; a step that is not may keep it in {self.kind!r}."
    )

  def check_kept(self, tree: Any) -> None:
    """Raises unless every array leaf of ``tree`` is in :attr:`home`.

    A state that enters a jitted step in one memory kind and leaves it in
    another cannot be donated: JAX (0.10) pairs donated buffers with results
    by shape and dtype alone when it does not know the results' memory
    kinds, and the CPU runtime aborts the process on a pair of two memory
    kinds. Inside ``jit`` a donated argument cannot be told from another
    one, so the state must come in where the step will leave it.

    Raises:
      ValueError: a leaf is in another memory kind.
    """
    elsewhere = [
      (jax.tree_util.keystr(path), kind_of(leaf))
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
      if hasattr(leaf, "shape") and kind_of(leaf) != self.home
    ]
    if not elsewhere:
      return
    path, found = elsewhere[0]
    raise ValueError(
      f"state.{self.field}{path} is in {found!r} memory ({len(elsewhere)}"
      f" leaves of {self.field} are elsewhere), but this transformation"
      f" keeps {self.field} in {self.home!r} ({self.argument}={self.kind!r}),"
      " and a state donated to a jitted step in another memory kind than"
      " the step returns it in would crash the process. Pass the state that"
      " this transformation's init made (or that update returned); to"
      " restore a checkpoint, restore it onto that state"
      " (jax.tree.map(ocp.utils.to_shape_dtype_struct, tx.init(params))"
      " with orbax), whose shardings carry the memory kinds."
    )


# JAX before 0.12 transposes the accumulator's moves under jax.set_mesh
# (one device or many) to a cotangent in host memory where the value's type
# is in device memory: "Expected cotangent type float32[3] but got
# float32<host>[3]". The optimizer's state, moved the same way, is not hit.
MESH_DIFFERENTIATES_HOST_STATE = jax.__version_info__ >= (0, 12)


def _mesh_is_set() -> bool:
  """Whether a mesh is set (``jax.set_mesh``) where the step is traced."""
  return not jax.sharding.get_abstract_mesh().empty


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _not_differentiated(value: jax.Array, refusal: str) -> jax.Array:
  """``value``, refusing with ``refusal`` where its derivative is taken.

  The identity, which leaves no trace in a compiled program; its derivative
  rule runs only where ``value`` depends on what is differentiated.
  """
  del refusal
  return value


@_not_differentiated.defjvp
def _not_differentiated_jvp(refusal: str, primals: Any, tangents: Any) -> Any:
  del primals, tangents
  raise ValueError(refusal)


def put(tree: Any, kind: str | None, *, unplaced: Any = None) -> Any:
  """``tree`` with every array leaf in memory ``kind``, shardings kept.

  Inside ``jit`` the move is part of the program (a ``jax.device_put`` to a
  ``jax.memory.Space``); outside it each array moves now, to its own
  sharding in the other memory kind. Leaves already in ``kind`` are left
  alone, so that a program holds no move that does nothing. None leaves the
  tree as it is.
  """
  if kind is None:
    return tree
  return jax.tree.map(lambda leaf: _put_leaf(leaf, kind, unplaced), tree)


def to_device(tree: Any) -> Any:
  """``tree`` with the leaves kept in another memory kind brought to the device.

  To compute on: JAX adds or selects arrays only within one memory kind.
  A tree already in device memory is returned as it is.
  """
  return put(tree, "device")


def to_device_after(tree: Any, after: Any) -> Any:
  """``tree`` brought to device memory leaf by leaf, each after its twin.

  Each leaf kept in another memory kind moves once its twin in ``after`` (a
  tree of the same structure, the gradient say) has been computed: left
  free, XLA starts such copies at the very beginning of the program to hide
  their latency, and the copies then take device memory through the whole
  forward and backward pass, when activations peak.
  """

  def fetch(leaf: Any, twin: Any) -> Any:
    if kind_of(leaf) == "device":
      return leaf
    leaf, _ = jax.lax.optimization_barrier((leaf, twin))
    return _moved(leaf, "device")

  return jax.tree.map(fetch, tree, after)


def where(predicate: jax.Array, new: Any, old: Any) -> Any:
  """``jnp.where(predicate, new, old)``, in the memory kind of ``old``."""
  if kind_of(old) == "device":
    return jnp.where(predicate, new, old)
  return _where_kept(predicate, new, old)


@jax.custom_jvp
def _where_kept(predicate: jax.Array, new: jax.Array, old: jax.Array) -> Any:
  """The select of a value kept in another memory kind than the device's.

  JAX (0.10) types an elementwise operation on scalars in device memory
  whatever its operands' memory (its rule reads only the operands with
  dimensions): a step count kept in host memory came back on the device,
  for the next call to refuse. Such a scalar is selected on the device and
  sent back; an array is selected where it lives.
  """
  if jnp.ndim(old):
    return jnp.where(predicate, new, old)
  selected = jnp.where(predicate, to_device(new), to_device(old))
  return put(selected, kind_of(old))


@functools.partial(_where_kept.defjvp, symbolic_zeros=True)
def _where_kept_jvp(
  primals: tuple[jax.Array, ...], tangents: tuple[Any, ...]
) -> tuple[jax.Array, Any]:
  # The tangents are selected on the device and sent back. JAX makes the
  # zeros of a tangent in device memory whatever its value's kind (see
  # _moved), and a select of those and a tangent in host memory did not
  # trace.
  predicate, new, old = primals
  _, new_tangent, old_tangent = tangents
  selected = _where_kept(predicate, new, old)
  if all(_is_zero(tangent) for tangent in (new_tangent, old_tangent)):
    return selected, jax.custom_derivatives.SymbolicZero(
      jax.typeof(selected).to_tangent_aval()
    )
  tangent = jnp.where(
    predicate, _on_device(new_tangent), _on_device(old_tangent)
  )
  return selected, put(tangent, kind_of(old))


def _is_zero(tangent: Any) -> bool:
  return isinstance(tangent, jax.custom_derivatives.SymbolicZero) or (
    tangent.dtype == jax.dtypes.float0
  )


def _on_device(tangent: Any) -> jax.Array:
  if isinstance(tangent, jax.custom_derivatives.SymbolicZero):
    return jnp.zeros(tangent.shape, tangent.dtype)
  return to_device(tangent)


def kind_of(leaf: Any) -> str:
  """The memory kind of ``leaf``'s type: where ``jit`` takes it to be.

  Read from the type rather than the sharding: an array restored onto a
  ``SingleDeviceSharding`` in host memory (by orbax, say) has the host kind
  in its sharding but not in its type, and ``jit`` treats it as a device
  array.
  """
  space = getattr(jax.typeof(leaf), "memory_space", SPACES["device"])
  return "pinned_host" if space == SPACES["pinned_host"] else "device"


def like_kinds(tree: Any, like: Any) -> Any:
  """``tree`` with each leaf in the memory kind of its twin in ``like``."""
  return jax.tree.map(
    lambda leaf, twin: (
      put(leaf, kind_of(twin)) if hasattr(twin, "shape") else leaf
    ),
    tree,
    like,
  )


def replicated_over(tree: Any) -> jax.sharding.Sharding | None:
  """A sharding replicated over the devices of ``tree``'s first placed array.

  None when ``tree`` holds no array committed to devices (tracers, or arrays
  on the default device), or its first is placed by a sharding without a
  mesh over several devices.
  """
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array):
      continue
    if not leaf.committed:
      continue
    sharding = _named(leaf.sharding)
    if not isinstance(sharding, jax.sharding.NamedSharding):
      return None
    return jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec()
    )
  return None


def abstract_in(tree: Any, kind: str | None, device: Any = None) -> Any:
  """Shapes and dtypes of ``tree`` on ``device``, in memory ``kind``.

  For compiling a step ahead of time on abstract state kept in ``kind``:
  on ``device`` (a compile-only TPU chip, say), or else on the first
  device. With neither a kind nor a device, ``tree`` is left as it is.
  """
  if kind is None and device is None:
    return tree
  sharding = _named(
    jax.sharding.SingleDeviceSharding(
      jax.devices()[0] if device is None else device, memory_kind=kind
    )
  )
  return jax.tree.map(
    lambda leaf: jax.ShapeDtypeStruct(
      leaf.shape, leaf.dtype, sharding=sharding
    ),
    tree,
  )


def _named(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """``sharding``, as a NamedSharding when it places arrays on one device.

  JAX (0.10) keeps an array's memory kind in its type only under a
  NamedSharding: an array restored onto a ``SingleDeviceSharding`` in host
  memory would be typed as a device array.
  """
  if isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  if len(sharding.device_set) != 1:
    return sharding
  mesh = jax.sharding.Mesh(np.array(list(sharding.device_set)), ("device",))
  return jax.sharding.NamedSharding(
    mesh, jax.sharding.PartitionSpec(), memory_kind=sharding.memory_kind
  )


def _put_leaf(leaf: Any, kind: str, unplaced: Any) -> Any:
  if isinstance(leaf, jax.core.Tracer):
    if kind_of(leaf) == kind:
      return leaf
    return _moved(leaf, kind)
  if not isinstance(leaf, jax.Array):
    return leaf
  if unplaced is not None and not leaf.committed:
    sharding = unplaced
  elif kind_of(leaf) == kind and leaf.sharding.memory_kind == kind:
    return leaf
  else:
    sharding = _named(leaf.sharding)
  return jax.device_put(leaf, sharding.with_memory_kind(kind))


def _moved(traced: jax.Array, kind: str) -> jax.Array:
  """A traced value moved to memory ``kind`` inside ``jit``.

  A move into host memory names where the value comes from: JAX transposes
  a move that does not to one that sends the cotangent to the destination
  again (a device array's cotangent into host memory), and ``jax.grad``
  through a step that keeps state in host memory then fails on the
  cotangent's type. A move to the device names no source: JAX then sends
  the cotangent to the memory of the tangent that was moved, which need not
  be the value's. JAX makes the zeros of a tangent in device memory
  whatever its value's kind (of state kept in host memory that does not
  yet depend on what is differentiated, or that a closed window left at
  zero), and a move named from the host sent their cotangent there.
  """
  if kind == "device":
    return jax.device_put(traced, SPACES[kind])
  return jax.device_put(traced, SPACES[kind], src=SPACES[kind_of(traced)])
