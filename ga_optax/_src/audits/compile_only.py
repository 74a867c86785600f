"""Compiling a step for devices this machine does not have.

A compiler plugin (JAX's CUDA plugin, ``libtpu``) gives compile-only
devices of a topology it describes. A step lowered on abstract arrays placed
on them compiles through the target's whole pipeline; its text and
``memory_analysis()`` are the program those devices would run.
:mod:`ga_optax._src.audits.gpu_compile` and
:mod:`ga_optax._src.audits.tpu_compile` make the devices; this module
places a step's arguments on them and compiles it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import (
  Mesh,
  NamedSharding,
  PartitionSpec,
  SingleDeviceSharding,
)


def check_compiler_options(compiler_options: Any) -> None:
  """Raises TypeError unless ``compiler_options`` is None or a mapping."""
  if compiler_options is not None and not isinstance(compiler_options, Mapping):
    raise TypeError(
      "compiler_options must be a mapping of XLA option names to values, as"
      " for jax.jit (say gpu_compiler_options()), got"
      f" {type(compiler_options).__name__}."
    )


def compile_on(
  devices: list[Any],
  fun: Callable[..., Any],
  args: tuple[Any, ...],
  donate_argnums: int | Sequence[int],
  compiler_options: Mapping[str, Any] | None,
  target: str,
) -> jax.stages.Compiled:
  """Compiles ``fun(*args)`` for ``devices``, placing ``args`` on them.

  On one device each array leaf is placed on it; on several, a leaf placed
  by a ``NamedSharding`` keeps its partition spec on a mesh of ``devices``
  with the same axis names, sizes and types, any other leaf is replicated,
  and that mesh is set around the compilation. ``target`` names the
  devices' kind (the text of its configuration, say): a program compiled
  for the same target, device count, lowered text and options is the one
  compiled before (_COMPILED).

  Raises:
    TypeError: ``compiler_options`` is not a mapping.
    ValueError: the arguments are placed on meshes of different axes, or of
      another device count than ``devices``.
  """
  check_compiler_options(compiler_options)
  mesh = _mesh_like(args, devices)

  def abstract(leaf: Any) -> Any:
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      return leaf
    sharding = (
      SingleDeviceSharding(devices[0])
      if mesh is None
      else NamedSharding(mesh, _spec_of(leaf))
    )
    return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)

  abstract_args = jax.tree.map(abstract, args)
  options = None if compiler_options is None else dict(compiler_options)
  jitted = jax.jit(fun, donate_argnums=donate_argnums, compiler_options=options)
  with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
    lowered = jitted.trace(*abstract_args).lower()
    key = (
      target,
      len(devices),
      lowered.as_text(),
      tuple(sorted((options or {}).items())),
    )
    if key not in _COMPILED:
      if len(_COMPILED) == _KEPT:
        del _COMPILED[next(iter(_COMPILED))]
      _COMPILED[key] = lowered.compile()
    return _COMPILED[key]


# The programs compiled last, by target, device count, lowered text and
# options. JAX keeps no compiled program of a compile-only device between
# two functions, nor on disk (it could not load one back without the
# device); an audit, a test suite or a run book that reads one program
# from two steps written alike would compile it twice, for seconds each.
# A compiled program is only read (its text, its memory analysis), so the
# same object serves both. The oldest is dropped past _KEPT programs.
_KEPT = 64
_COMPILED: dict[tuple[Any, ...], jax.stages.Compiled] = {}


def _spec_of(leaf: Any) -> PartitionSpec:
  sharding = getattr(leaf, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return sharding.spec
  return PartitionSpec()


def _mesh_like(args: Any, devices: list[Any]) -> Mesh | None:
  """A mesh of ``devices`` like the one ``args`` are placed on, or None.

  None on one device. With several, every ``NamedSharding`` among the
  arguments must be on a mesh of the same axes; with none, the devices
  form one axis, ``"data"``.
  """
  if len(devices) == 1:
    return None
  meshes = {
    (leaf.sharding.mesh.axis_names, leaf.sharding.mesh.axis_sizes,
     leaf.sharding.mesh.axis_types)
    for leaf in jax.tree.leaves(args)
    if isinstance(getattr(leaf, "sharding", None), NamedSharding)
  }  # fmt: skip
  if len(meshes) > 1:
    raise ValueError(
      "the arguments are placed on meshes of different axes"
      f" ({sorted(str(mesh[:2]) for mesh in meshes)}); place them all on one"
      " mesh."
    )
  if not meshes:
    return Mesh(np.asarray(devices), ("data",))
  names, sizes, types = meshes.pop()
  if math.prod(sizes) != len(devices):
    raise ValueError(
      f"the arguments are placed on a mesh of {math.prod(sizes)} devices"
      f" {dict(zip(names, sizes, strict=True))}, but num_devices is"
      f" {len(devices)}; pass num_devices={math.prod(sizes)}."
    )
  return jax.make_mesh(sizes, names, axis_types=types, devices=devices)
