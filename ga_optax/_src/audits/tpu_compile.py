"""Compiling a step with the real TPU compiler, on a machine without a TPU.

``libtpu`` (``pip install "jax[tpu]==$V"`` for the installed jax ``$V``,
about 140 MB) holds the TPU compiler. It describes a TPU slice by its
topology (``jax.experimental.topologies.get_topology_desc(platform="tpu")``)
and gives compile-only chips of it: a step lowered on abstract arrays placed
on them compiles through the whole TPU pipeline, memory-space assignment
into the chip's on-chip memory included. ``as_text()``, ``memory_analysis()``
and ``cost_analysis()`` then read the program a TPU would run; the program
runs nowhere here.

The generations and the slices of each that compile here, counted in the
devices JAX lists: ``"v5e"``, ``"v6e"`` and ``"v5p"`` (1, 4 or 8 chips) and
``"v4"`` (2 or 8 devices: JAX lists each of a v4 chip's two cores).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.experimental import topologies

from ga_optax._src.audits import compile_only

# Each generation's slices by the devices JAX lists for them, as their
# topologies are named.
_SLICES = {
  "v5e": {1: "v5e:1x1", 4: "v5e:2x2", 8: "v5e:2x4"},
  "v6e": {1: "v6e:1x1", 4: "v6e:2x2", 8: "v6e:2x4"},
  "v5p": {1: "v5p:1x1x1", 4: "v5p:2x2x1", 8: "v5p:2x2x2"},
  "v4": {2: "v4:1x1x1", 8: "v4:2x2x1"},
}
TARGETS = tuple(_SLICES)


class TpuCompilerUnavailable(RuntimeError):
  """``libtpu``, which holds the TPU compiler, cannot be used here."""


def tpu_devices(num_devices: int = 1, *, target: str = "v5e") -> list[Any]:
  """Compile-only TPU devices: a slice of one host.

  Args:
    num_devices: the devices of the slice: 1, 4 or 8 chips (v5e, v6e and
      v5p), 2 or 8 devices (v4, two per chip).
    target: the TPU generation, one of :data:`TARGETS`.

  Returns:
    The chips, to build a ``jax.sharding.Mesh`` on or to place abstract
    arrays on; they compile programs and cannot run them.

  Raises:
    TypeError, ValueError: a bad ``num_devices`` or ``target``.
    TpuCompilerUnavailable: ``libtpu`` is not installed or does not start.
  """
  if isinstance(num_devices, bool) or not isinstance(num_devices, int):
    raise TypeError(f"num_devices must be an int, got {num_devices!r}.")
  if not isinstance(target, str):
    raise TypeError(
      f"target must be one of {TARGETS}, got {type(target).__name__}."
    )
  if target not in _SLICES:
    raise ValueError(f"target must be one of {TARGETS}, got {target!r}.")
  if num_devices not in _SLICES[target]:
    raise ValueError(
      f"num_devices must be one of {sorted(_SLICES[target])} for a"
      f" {target} slice (the devices JAX lists), got {num_devices}."
    )
  # A compile-only client needs a host list; a one-chip slice says it is
  # one chip per host (libtpu refuses a 1x1 layout without the bounds).
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  # libtpu locks a TPU's chips to one process; compile-only chips hold
  # none, so several processes (test workers, a benchmark) may compile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  name = _SLICES[target][num_devices]
  one_chip = set(name.split(":")[1].split("x")) == {"1"}
  bounds = {"chips_per_host_bounds": (1, 1, 1)} if one_chip else {}
  try:
    topology = topologies.get_topology_desc(
      platform="tpu", topology_name=name, **bounds
    )
  except (NotImplementedError, RuntimeError, ValueError) as error:
    if importlib.util.find_spec("libtpu") is not None:
      raise TpuCompilerUnavailable(
        f"libtpu is installed but did not describe the {target} slice of"
        f" {num_devices} devices (topology {name!r}"
        f"{', one chip per host' if one_chip else ''}):"
        f" {type(error).__name__}: {error}"
      ) from error
    raise TpuCompilerUnavailable(
      "The TPU compiler is not available: install libtpu for the installed"
      f' jax (pip install "jax[tpu]=={jax.__version__}"; no TPU needed) and'
      " start JAX with JAX_PLATFORMS=cpu on a machine without a TPU."
      f" ({type(error).__name__}: {error})"
    ) from error
  return list(topology.devices)


def compile_for_tpu(
  fun: Callable[..., Any],
  *args: Any,
  num_devices: int = 1,
  target: str = "v5e",
  donate_argnums: int | Sequence[int] = (),
  compiler_options: Mapping[str, Any] | None = None,
) -> jax.stages.Compiled:
  """Compiles ``fun(*args)`` for TPU chips this machine need not have.

  The TPU counterpart of :func:`compile_for_gpu`, with the
  same placement of ``args``: each array leaf (an array, or a
  ``jax.ShapeDtypeStruct``) becomes an abstract array on the chips, on a
  mesh like the one it is placed on.

  Args:
    fun: the step, as one would pass it to ``jax.jit``.
    *args: its arguments.
    num_devices: the devices of the slice (see :func:`tpu_devices`).
    target: the TPU generation: ``"v5e"`` (the default), ``"v6e"``,
      ``"v5p"`` or ``"v4"``.
    donate_argnums: the arguments donated, as for ``jax.jit``.
    compiler_options: XLA options for this compilation, as for
      ``jax.jit(..., compiler_options=...)``.

  Returns:
    The compiled program, for the audits of :mod:`ga_optax.testing`. A TPU
    program moves buffers into the chip's on-chip memory and back: read
    copies with :attr:`PathAudit.duplicates`.

  Raises:
    TpuCompilerUnavailable: ``libtpu`` cannot be used here.
    TypeError: ``compiler_options`` is not a mapping.
    ValueError: a bad slice, or arguments placed on meshes of different
      axes or of another device count than ``num_devices``.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> from ga_optax._src import audits
    >>> tx = ga_optax.accumulate(optax.adam(1e-3), 4)
    >>> params = {"w": jnp.ones((1024, 1024))}
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> compiled = audits.compile_for_tpu(  # doctest: +SKIP
    ...     step, params, tx.init(params), params, donate_argnums=(0, 1))
    >>> audit = audits.path_audit(compiled, "micro_step")  # doctest: +SKIP
    >>> duplicated = [copy.bytes for copy in audit.duplicates]  # doctest: +SKIP
  """
  compile_only.check_compiler_options(compiler_options)
  devices = tpu_devices(num_devices, target=target)
  return compile_only.compile_on(
    devices, fun, args, donate_argnums, compiler_options, target
  )
