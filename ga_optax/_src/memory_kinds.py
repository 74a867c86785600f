"""Placing state in a JAX memory kind (host offload), and counting device bytes.

An array's sharding carries a memory kind: ``"device"`` (the accelerator's
own memory, the default) or a host memory such as ``"pinned_host"``. State
kept in host memory costs no device memory between micro-steps; a jitted
step brings it to the device where it is computed on and sends it back.
Inside ``jit`` JAX (0.10) types an array's memory as ``jax.memory.Space``:
``Device`` or ``Host``, the latter being ``"pinned_host"``, so those two are
the kinds state can be kept in from one jitted call to the next.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

# The memory kinds a jitted program can type its values with, and the space
# that names each inside jit.
SPACES = {
  "device": jax.memory.Space.Device,
  "pinned_host": jax.memory.Space.Host,
}

_HLO_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "c64": 8,
  "f64": 8,
  "s64": 8,
  "u64": 8,
  "c128": 16,
}
# One array in an HLO layout, e.g. ``f32[4,2]{1,0:S(5)}`` or ``s32[]``.
_HLO_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](?:\{([^}]*)\})?")
# ``{output index}: (parameter, {}, may-alias)``; ``{}`` for a lone output.
_HLO_ALIAS = re.compile(r"\{(\d*)\}: \((\d+), \{\}, (?:may|must)-alias\)")
# XLA's number for host memory in a layout, ``S(5)``.
_HOST_MEMORY_SPACE = "S(5)"


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


def put(
  tree: Any, kind: str | None, *, unplaced: jax.sharding.Sharding | None = None
) -> Any:
  """``tree`` with every array leaf in memory ``kind``, shardings kept.

  Inside ``jit`` the move is part of the program (a ``jax.device_put`` to a
  ``jax.memory.Space``); outside it each array moves now, to its own
  sharding in the other memory kind. Leaves already in ``kind`` are left
  alone, so that a program holds no move that does nothing. None leaves the
  tree as it is.

  Args:
    tree: a pytree of arrays (or tracers).
    kind: the memory kind, or None.
    unplaced: where arrays that are not committed to devices go (a scalar
      made by ``jnp.zeros``, say), for example replicated over the params'
      devices; None keeps them on their default device.
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
    return jax.device_put(leaf, SPACES["device"])

  return jax.tree.map(fetch, tree, after)


def kind_of(leaf: Any) -> str:
  """The memory kind of ``leaf``'s type: where ``jit`` takes it to be.

  Read from the type rather than the sharding: an array restored onto a
  ``SingleDeviceSharding`` in host memory (by orbax, say) has the host kind
  in its sharding but not in its type, and ``jit`` treats it as a device
  array.
  """
  space = getattr(jax.typeof(leaf), "memory_space", SPACES["device"])
  return "pinned_host" if space == SPACES["pinned_host"] else "device"


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


def abstract_in(tree: Any, kind: str | None) -> Any:
  """Shapes and dtypes of ``tree`` on the first device, in memory ``kind``.

  For compiling a step ahead of time on abstract state kept in ``kind``;
  None leaves ``tree`` as it is.
  """
  if kind is None:
    return tree
  sharding = _named(
    jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
  )
  return jax.tree.map(
    lambda leaf: jax.ShapeDtypeStruct(
      leaf.shape, leaf.dtype, sharding=sharding
    ),
    tree,
  )


def check_kept_in(tree: Any, kind: str, field: str, argument: str) -> None:
  """Raises unless every array leaf of ``tree`` is in memory ``kind``.

  A state that enters a jitted step in one memory kind and leaves it in
  another cannot be donated: JAX (0.10) pairs donated buffers with results
  by shape and dtype alone when it does not know the results' memory kinds,
  and the CPU runtime aborts the process on a pair of two memory kinds.
  Inside ``jit`` a donated argument cannot be told from another one, so the
  state must come in where the step will leave it.

  Raises:
    ValueError: a leaf is in another memory kind.
  """
  elsewhere = [
    (jax.tree_util.keystr(path), kind_of(leaf))
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    if hasattr(leaf, "shape") and kind_of(leaf) != kind
  ]
  if not elsewhere:
    return
  path, found = elsewhere[0]
  given = None if kind == "device" else kind
  raise ValueError(
    f"state.{field}{path} is in {found!r} memory ({len(elsewhere)} leaves"
    f" of {field} are elsewhere), but this transformation keeps {field} in"
    f" {kind!r}"
    f" ({argument}={given!r}), and a state donated to a jitted step in"
    " another memory kind than the step returns it in would crash the"
    " process. Pass the state that this transformation's init made (or that"
    " update returned); to restore a checkpoint, restore it onto that state"
    " (jax.tree.map(ocp.utils.to_shape_dtype_struct, tx.init(params)) with"
    " orbax), whose shardings carry the memory kinds."
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


def _put_leaf(
  leaf: Any, kind: str, unplaced: jax.sharding.Sharding | None
) -> Any:
  if isinstance(leaf, jax.core.Tracer):
    if kind_of(leaf) == kind:
      return leaf
    return jax.device_put(leaf, SPACES[kind])
  if not isinstance(leaf, jax.Array):
    return leaf
  if unplaced is not None and not leaf.committed:
    sharding = unplaced
  elif kind_of(leaf) == kind and leaf.sharding.memory_kind == kind:
    return leaf
  else:
    sharding = _named(leaf.sharding)
  return jax.device_put(leaf, sharding.with_memory_kind(kind))


def device_bytes(compiled: Any) -> int:
  """Device-memory bytes a compiled program needs: what stays on the device.

  Arguments, plus outputs that do not reuse an argument's buffer, plus
  temporaries, counting only buffers in device memory. Backends that report
  host memory apart (``host_*`` fields of ``compiled.memory_analysis()``,
  as GPUs do) are read as they are; the CPU backend counts every buffer as
  device memory, so the arguments and outputs its program layout puts in
  host memory are subtracted here.

  Raises:
    RuntimeError: the backend gives no memory analysis.
  """
  analysis = compiled.memory_analysis()
  if analysis is None:
    raise RuntimeError(
      f"The {jax.default_backend()} backend gives no compiled memory"
      " analysis, so the bytes a program needs cannot be read."
    )
  total = int(
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
    + analysis.temp_size_in_bytes
  )
  reported_apart = (
    analysis.host_argument_size_in_bytes
    + analysis.host_output_size_in_bytes
    + analysis.host_temp_size_in_bytes
  )
  if reported_apart:
    return total
  return total - _host_buffer_bytes(compiled.as_text())


def _host_buffer_bytes(hlo_text: str) -> int:
  """Host-memory bytes of a program's parameters and unaliased outputs.

  Read from the entry computation's layout, where an array in host memory
  carries ``S(5)``, and from its input-output aliases.
  """
  header = hlo_text.split("\n", 1)[0]
  layout = _braced(header, "entry_computation_layout=")
  if "->" not in layout:
    return 0
  inputs, results = layout.split("->", 1)
  parameters = _HLO_ARRAY.findall(inputs)
  outputs = _HLO_ARRAY.findall(results)
  aliased_outputs = {
    int(output or 0)
    for output, _ in _HLO_ALIAS.findall(_braced(header, "input_output_alias="))
  }
  host = sum(_bytes(array) for array in parameters if _on_host(array))
  host += sum(
    _bytes(array)
    for index, array in enumerate(outputs)
    if _on_host(array) and index not in aliased_outputs
  )
  return host


def _braced(text: str, key: str) -> str:
  """What follows ``key`` in ``text`` between its braces (nested ones kept)."""
  start = text.find(key + "{")
  if start < 0:
    return ""
  start += len(key) + 1
  depth = 1
  for end in range(start, len(text)):
    depth += {"{": 1, "}": -1}.get(text[end], 0)
    if depth == 0:
      return text[start:end]
  return ""


def _on_host(array: tuple[str, str, str]) -> bool:
  return _HOST_MEMORY_SPACE in array[2]


def _bytes(array: tuple[str, str, str]) -> int:
  dtype, dims, _ = array
  size = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
  return _HLO_DTYPE_BYTES.get(dtype, 4) * size
