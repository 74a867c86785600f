"""Compiling a step with the real XLA:GPU compiler, on a machine without a GPU.

JAX's CUDA plugin can compile for a GPU it does not have: a topology made
from a GPU description (``jax.experimental.topologies.get_topology_desc``
with a ``GpuTargetConfigProto``) gives compile-only devices, and a step
lowered on abstract arrays placed on them compiles through the whole GPU
pipeline: fusion, the GPU's own conditional and copy passes, collectives
as the GPU runs them. ``as_text()`` and ``memory_analysis()`` then read the
program a GPU would run; ``cost_analysis()`` and memory kinds are not
available on such devices.

It needs JAX's CUDA plugin, not a GPU: the plugin alone, of the installed
jax's version, is about 400 MB (``pip install --no-deps
"jax-cuda13-plugin==$V" "jax-cuda13-pjrt==$V"``; the CUDA libraries of
``jax[cuda13]``, about 4.7 GB, are only needed to run on a GPU). On a
machine with no GPU, JAX must also be started with ``JAX_PLATFORMS=cpu``, or
the plugin fails to initialise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.experimental import topologies

from ga_optax._src.audits import compile_only

# The device description XLA:GPU compiles for: an H100 SXM (compute
# capability 9.0, 132 SMs, 80 GB of HBM3 at 3.35 TB/s), as its CUDA driver
# reports it, and the CUDA runtime the plugin is built for. The driver's
# version matters: without one a compile-only device reports 0.0.0, and
# XLA:GPU then keeps loops, conditionals and library calls (cuBLAS, cuDNN,
# custom calls) out of command buffers, which a real H100 with a CUDA 13
# driver captures; the program compiled here would not be the one it runs.
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84978434048
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  driver_version: "13.0.0"
}
platform_name: "CUDA"
runtime_version { major: 13 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

TARGETS = {"h100": H100}


class GpuCompilerUnavailable(RuntimeError):
  """The CUDA plugin, which holds XLA:GPU, cannot be used here."""


def gpu_devices(num_devices: int = 1, *, target: str = "h100") -> list[Any]:
  """Compile-only GPU devices: ``num_devices`` GPUs of one host.

  Args:
    num_devices: how many GPUs the host has (1 to 8, say).
    target: ``"h100"``, or the text of a ``GpuTargetConfigProto`` for
      another GPU.

  Returns:
    The devices, to build a ``jax.sharding.Mesh`` on or to place abstract
    arrays on; they compile programs and cannot run them.

  Raises:
    TypeError, ValueError: a bad ``num_devices`` or ``target``.
    GpuCompilerUnavailable: the CUDA plugin is not installed, or could not
      start (set ``JAX_PLATFORMS=cpu`` on a machine without a GPU).
  """
  if isinstance(num_devices, bool) or not isinstance(num_devices, int):
    raise TypeError(f"num_devices must be an int, got {num_devices!r}.")
  if num_devices < 1:
    raise ValueError(f"num_devices must be at least 1, got {num_devices}.")
  if not isinstance(target, str):
    raise TypeError(
      "target must be 'h100' or the text of a GpuTargetConfigProto, got"
      f" {type(target).__name__}."
    )
  config = TARGETS.get(target, target)
  if "gpu_device_info" not in config:
    raise ValueError(
      f"target must be one of {sorted(TARGETS)} or the text of a"
      f" GpuTargetConfigProto (with a gpu_device_info), got {target!r}."
    )
  try:
    topology = topologies.get_topology_desc(
      platform="cuda", target_config=config, topology=f"1x1x{num_devices}"
    )
  except (NotImplementedError, RuntimeError, ValueError) as error:
    raise GpuCompilerUnavailable(
      "XLA:GPU is not available: install JAX's CUDA plugin of the installed"
      f" jax, alone (about 400 MB, no GPU needed): pip install --no-deps"
      f' "jax-cuda13-plugin=={jax.__version__}"'
      f' "jax-cuda13-pjrt=={jax.__version__}"; and, on a machine without a'
      " GPU, start JAX with JAX_PLATFORMS=cpu."
      f" ({type(error).__name__}: {error})"
    ) from error
  return list(topology.devices)


def compile_for_gpu(
  fun: Callable[..., Any],
  *args: Any,
  num_devices: int = 1,
  target: str = "h100",
  donate_argnums: int | Sequence[int] = (),
  compiler_options: Mapping[str, Any] | None = None,
) -> jax.stages.Compiled:
  """Compiles ``fun(*args)`` with XLA:GPU, for GPUs this machine need not have.

  Each array leaf of ``args`` (an array, or a ``jax.ShapeDtypeStruct``)
  becomes an abstract array of its shape and dtype on the GPUs. On one GPU
  it is placed on it; on several, a leaf placed by a ``NamedSharding`` keeps
  its partition spec on a mesh of the GPUs with the same axis names, sizes
  and types (build ``args`` on a CPU mesh of ``num_devices`` devices, say
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8``), and any other
  leaf is replicated. That mesh is also set around the compilation, so a
  ``jax.shard_map`` that takes its mesh from the context, and a step typed
  for Explicit axes, compile as they would on the GPUs. Python scalars and
  other non-array leaves are passed as they are.

  Args:
    fun: the step, as one would pass it to ``jax.jit``.
    *args: its arguments.
    num_devices: the GPUs of the host to compile for.
    target: ``"h100"``, or the text of a ``GpuTargetConfigProto``.
    donate_argnums: the arguments donated, as for ``jax.jit`` (donate the
      params and the optimizer state, as a training loop does: what the
      program copies depends on it).
    compiler_options: XLA options for this compilation, as for
      ``jax.jit(..., compiler_options=...)``: say
      :func:`ga_optax._src.recipes.gpu_recipe.gpu_compiler_options`, to compile the step as a GPU
      training loop would run it under that recipe.

  Returns:
    The compiled program: ``as_text()`` and ``memory_analysis()`` work, and
    the audits of :mod:`ga_optax.testing` read it.

  Raises:
    GpuCompilerUnavailable: the CUDA plugin cannot be used here.
    TypeError: ``compiler_options`` is not a mapping.
    ValueError: the arguments are placed on meshes of different axes, or of
      another device count than ``num_devices``.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> from ga_optax._src import audits
    >>> tx = ga_optax.accumulate(optax.adam(1e-3), 4)
    >>> params = {"w": jnp.ones((1024, 1024))}
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> compiled = audits.compile_for_gpu(  # doctest: +SKIP
    ...     step, params, tx.init(params), params, donate_argnums=(0, 1))
    >>> audits.path_audit(compiled, "micro_step").copies  # doctest: +SKIP
    []
  """
  compile_only.check_compiler_options(compiler_options)
  devices = gpu_devices(num_devices, target=target)
  return compile_only.compile_on(
    devices, fun, args, donate_argnums, compiler_options, target
  )
