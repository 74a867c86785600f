"""The XLA options under which a GPU runs the window without a host wait.

Each branch of the device-scheduled window is a loop of at most one trip
(:mod:`ga_optax._src.window.run_once`). XLA:GPU runs a loop outside a
command buffer (a CUDA graph) from the host: before each trip it copies the
predicate to the host and waits for the device, and while it waits it
queues nothing. Inside a command buffer the loop is a conditional node that
the device evaluates itself. XLA's default command-buffer kinds leave loops
out; :func:`gpu_compiler_options` adds them, and the collectives the closing
side may hold.

On a real GPU those captured loops gave wrong numbers (an NVIDIA H200, jax
and jaxlib 0.11.2, 2026-11-28: windows closed on the wrong call, and with
only WHILE captured the parameters drifted from XLA's defaults' by 5e-3).
A training loop written in Python has no loop to
capture: ``update(..., closing=...)``.

That is why it is private: nothing public may give wrong numbers. It stays
for ``benchmarks/recipe_check.py``, which checks it again on a GPU, and the
tests that read what it asks XLA:GPU for.
"""

from __future__ import annotations

import jaxlib

# XLA's default command-buffer kinds, which a plain list replaces and so
# must repeat (the ``+WHILE`` form of ``XLA_FLAGS`` is refused as a
# compiler option). jaxlib 0.10 and 0.12 were read off their compiled
# programs' configurations; jaxlib 0.12 adds collective kernels (one-shot
# all-reduce kernels), a kind older versions refuse as unknown.
_XLA_DEFAULT_KINDS = (
  "FUSION",
  "CUBLAS",
  "CUBLASLT",
  "CUSTOM_CALL",
  "CUDNN",
  "DYNAMIC_SLICE_FUSION",
  "CONDITIONAL",
)
_COLLECTIVE_KERNELS_SINCE = (0, 12)
# What the window needs on top: its loops, and the collectives of a window
# reduced across GPUs (its all-reduce or reduce-scatter sits in the closing
# loop, which one uncaptured thunk would leave on the host).
_WINDOW_KINDS = ("WHILE",)
_COLLECTIVES = ("COLLECTIVES",)


def _jaxlib_version() -> tuple[int, ...]:
  return tuple(int(part) for part in jaxlib.__version__.split(".")[:2])


def gpu_compiler_options(*, collectives: bool = True) -> dict[str, str]:
  """XLA options under which a GPU runs the window without a host wait.

  .. warning::
     On an NVIDIA H200 with jax 0.11.2 these options gave **wrong numbers**:
     XLA:GPU's loops captured in CUDA graphs closed windows on the wrong
     call (docs/benchmarks.md, "0.6 on one H200"). Pass
     ``closing=`` from a Python loop instead (a program without control flow
     needs no options), or keep XLA's defaults, which were exact there.
     Use these only where a check on your GPU and jax, such as
     :func:`ga_optax.testing.compare_with_large_batch` with the options,
     passes.

  Pass them to ``jax.jit(step, compiler_options=...)``. They let XLA:GPU
  capture the window's loops (and the collectives of a window reduced
  across GPUs) in its command buffers, the CUDA graphs it replays: the
  device then decides which side of the window runs, and the host queues
  a whole step without waiting for it. Under XLA's defaults the host
  waits before each of the window's loops (2 times on an ``accumulate``
  micro-step; docs/how-to/gpu.md). The option
  replaces XLA's list of command-buffer kinds, so the list repeats XLA's
  defaults of the installed jaxlib.

  Only XLA:GPU reads them; XLA:CPU accepts and ignores them, so one step
  can be written for both (on other backends, pass them only where
  ``jax.default_backend() == "gpu"``). On ROCm, on a CUDA driver older than
  12.3, or while a profiler makes XLA run command buffers op by op, the
  loops run from the host as they do by default.

  Args:
    collectives: also capture collectives (NCCL's all-reduce,
      reduce-scatter, all-gather). On several GPUs the window's reduction
      sits in the closing loop, which stays on the host (2 waits when a
      window closes, 1 on a micro-step) unless its collectives are
      captured too. On one GPU there are none and it changes nothing.
      True by default because the window's promise needs it; pass False
      to keep NCCL out of CUDA graphs (on a cluster where that is not
      supported, say), at the cost of those waits.

  Returns:
    ``{"xla_gpu_enable_command_buffer": "FUSION,...,WHILE,COLLECTIVES"}``.

  Raises:
    TypeError: ``collectives`` is not a bool.

  Example:
    >>> import jax, jax.numpy as jnp, optax, ga_optax
    >>> from ga_optax._src.recipes.gpu_recipe import gpu_compiler_options
    >>> tx = ga_optax.accumulate(optax.adam(1e-3), 4)
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> train_step = jax.jit(
    ...     step, donate_argnums=(0, 1),
    ...     compiler_options=gpu_compiler_options())
    >>> params = {"w": jnp.ones((4, 4))}
    >>> grads = {"w": jnp.full((4, 4), 0.5)}
    >>> params, state = train_step(params, tx.init(params), grads)
    >>> options = gpu_compiler_options()
    >>> "WHILE" in options["xla_gpu_enable_command_buffer"]
    True
  """
  if not isinstance(collectives, bool):
    raise TypeError(f"collectives must be True or False, got {collectives!r}.")
  kinds = list(_XLA_DEFAULT_KINDS)
  if _jaxlib_version() >= _COLLECTIVE_KERNELS_SINCE:
    kinds.append("COLLECTIVES_KERNEL")
  kinds.extend(_WINDOW_KINDS)
  if collectives:
    kinds.extend(_COLLECTIVES)
  return {"xla_gpu_enable_command_buffer": ",".join(kinds)}
