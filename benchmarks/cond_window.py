"""An earlier form of the window: one ``lax.cond`` per micro-step, to compare.

That form added each micro-batch's gradient into the accumulator outside any
branch, then chose with one ``lax.cond`` between stepping the optimizer and
handing its operands back untouched: a branch that only forwards operands,
which keeps XLA:GPU from turning the conditional into selects. On a GPU the
host waits once for the conditional's predicate (a form of two loops waited
three times), but jax 0.10.2's XLA:GPU copied Adam's moments on every
micro-step to make the forwarding branch's buffers its own; a later XLA may
not.

:func:`cond_window` rebuilds that structure for Adam (or any optimizer) with
a fixed k and weight 1, small enough to read whole; it is exact (the
window's mean gradient, one optimizer step per window). The run book times
it beside today's forms (``benchmarks/window_time.py``) and, with
:func:`figures`, counts its conditionals, copies and host waits beside
``accumulate``'s, under the jax of the machine at hand: as XLA:GPU compiles
for a compile-only H100, and as the device at hand compiles for itself.
"""

from __future__ import annotations

import pathlib
import tempfile
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import ga_optax
from benchmarks import compiled_steps
from benchmarks import workloads as workloads_lib
from ga_optax._src import audits
from ga_optax._src.recipes import gpu_recipe

MIB = 2**20
COND_WINDOW = "conditional window (one lax.cond)"
Record = dict[str, Any]


class CondWindowState(NamedTuple):
  """The one-conditional window's state.

  Attributes:
    micro_step: micro-steps taken in the open window (int32).
    accumulator: the window's gradient sum; after a closing call it holds
      that call's updates, which the next micro-step overwrites.
    inner_state: the wrapped optimizer's state.
  """

  micro_step: jax.Array
  accumulator: optax.Updates
  inner_state: optax.OptState


def cond_window(
  loss_fn: Callable[[Any, Any], jax.Array],
  optimizer: optax.GradientTransformation,
  every_k: int,
) -> tuple[Callable[[Any], CondWindowState], Callable[..., Any]]:
  """``(init, step)`` of a train step windowed with one ``lax.cond``.

  Args:
    loss_fn: ``(params, batch) -> scalar``, the mean loss over a batch.
    optimizer: the optimizer that steps once per window.
    every_k: micro-steps per window.

  Returns:
    ``init(params) -> state`` and ``step(params, state, batch) -> (params,
    state)``, to jit with params and state donated.
  """

  def init(params: optax.Params) -> CondWindowState:
    return CondWindowState(
      jnp.zeros((), jnp.int32),
      optax.tree.zeros_like(params),
      optimizer.init(params),
    )

  def step(
    params: optax.Params, state: CondWindowState, batch: Any
  ) -> tuple[optax.Params, CondWindowState]:
    grads = jax.grad(loss_fn)(params, batch)
    micro_step = state.micro_step + 1
    closes = micro_step >= every_k
    restarts = state.micro_step == 0
    # The mean is taken in the add, outside the branch, as that form did: the
    # closing branch then only runs the optimizer.
    scale = jnp.where(closes, 1.0 / every_k, 1.0)
    accumulator = jax.tree.map(
      # A select, not a multiply: a stale buffer may hold anything.
      lambda total, grad: (jnp.where(restarts, 0.0, total) + grad) * scale,
      state.accumulator,
      grads,
    )

    def close(params, accumulator, inner_state, not_stepped):
      del not_stepped
      updates, inner_state = optimizer.update(accumulator, inner_state, params)
      return updates, inner_state, jnp.asarray(True)

    def keep_open(params, accumulator, inner_state, not_stepped):
      # Operands handed back untouched: the flag is the predicate itself,
      # since a constant made here would make the branch no longer forward.
      del params
      return accumulator, inner_state, not_stepped

    output, inner_state, stepped = jax.lax.cond(
      closes, close, keep_open, params, accumulator, state.inner_state, closes
    )
    updates = jax.tree.map(
      lambda update: jnp.where(stepped, update, 0.0), output
    )
    new_state = CondWindowState(
      jnp.where(closes, 0, micro_step), output, inner_state
    )
    return optax.apply_updates(params, updates), new_state

  return init, step


def _steps(
  workload: workloads_lib.Workload,
) -> dict[str, tuple[Callable[..., Any], Any]]:
  """The one-conditional window and ``accumulate``'s default form, as ``(step, state)``."""
  adam = optax.adam(1e-3)
  init, step = cond_window(workload.loss_fn, adam, workload.every_k)
  accumulate = ga_optax.accumulate(adam, workload.every_k)

  def accumulate_step(params, state, batch):
    grads = jax.grad(workload.loss_fn)(params, batch)
    updates, state = accumulate.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return {
    COND_WINDOW: (step, init(workload.params)),
    "ga_optax.accumulate": (accumulate_step, accumulate.init(workload.params)),
  }


def _paths(program: Any) -> Record:
  """Control flow left, bytes moved and copies per path."""
  text = program.as_text()
  record: Record = {
    "conditionals": text.count(" conditional("),
    "loops": text.count(" while("),
  }
  for path in ("micro_step", "closing"):
    audit = compiled_steps.audit_path(program, path)
    record[f"{path}_moved_mib"] = audit.bytes_moved / MIB
    record[f"{path}_copied_mib"] = audit.copied_bytes() / MIB
  return record


def _h100(step: Callable[..., Any], args: tuple[Any, ...]) -> Record:
  """Compiled for a compile-only H100: paths, and host waits under XLA's
  defaults and under the GPU recipe, where this ga_optax counts them."""
  host_waits = getattr(audits, "host_waits", None)
  recipe = gpu_recipe.gpu_compiler_options
  if host_waits is None:
    program = audits.compile_for_gpu(step, *args, donate_argnums=(0, 1))
    return {**_paths(program), "host_waits": "not in this ga_optax"}
  waits = host_waits(step, *args, donate_argnums=(0, 1))
  record = {**_paths(waits.program), "top_level_thunks": waits.top_level}
  record.update(waits_micro_step=waits.micro_step, waits_closing=waits.closing)
  if recipe is not None:
    under = host_waits(
      step, *args, donate_argnums=(0, 1), compiler_options=recipe()
    )
    record.update(
      recipe_waits_micro_step=under.micro_step,
      recipe_waits_closing=under.closing,
    )
  return record


def _here(step: Callable[..., Any], args: tuple[Any, ...]) -> Record:
  """As the device at hand compiles it; on a GPU, with its host waits read
  off the thunk sequence XLA dumped for this very program."""
  count = getattr(audits, "count_host_waits", None)
  if jax.default_backend() != "gpu" or count is None:
    program = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
    return _paths(program)
  with tempfile.TemporaryDirectory(prefix="cond_window_") as dump:
    program = (
      jax.jit(
        step, donate_argnums=(0, 1), compiler_options={"xla_dump_to": dump}
      )
      .lower(*args)
      .compile()
    )
    files = pathlib.Path(dump)
    sequence = sorted(files.glob("*.thunk_sequence_after_thunk_passes.txt"))
    sequence = sequence or sorted(files.glob("*.thunk_sequence.txt"))
    metadata = sorted(files.glob("*.thunk_metadata.txt"))
    if not sequence or not metadata:
      return {**_paths(program), "host_waits": "XLA dumped no thunk sequence"}
    waits = count(program, sequence[-1].read_text(), metadata[-1].read_text())
  return {
    **_paths(program),
    "top_level_thunks": waits.top_level,
    "waits_micro_step": waits.micro_step,
    "waits_closing": waits.closing,
  }


def figures(quick: bool) -> Record:
  """The one-conditional window beside ``accumulate``: H100-compiled, and compiled here.

  The H100's figures need JAX's CUDA plugin; where it is missing, their
  place holds the reason.
  """
  workload = workloads_lib.mlp(*((256, 2) if quick else (2048, 4)), 8, 4)
  device = jax.devices()[0]
  rows = []
  for name, (step, state) in _steps(workload).items():
    args = (workload.params, state, workload.microbatches[0])
    try:
      h100 = _h100(step, args)
    except audits.GpuCompilerUnavailable as error:
      h100 = {"unavailable": str(error)}
    rows.append({"window": name, "compiled for": "H100 (compile-only)", **h100})
    rows.append(
      {"window": name, "compiled for": device.device_kind, **_here(step, args)}
    )
  # One table: each row holds every column, blank where it has no figure.
  keys = list(dict.fromkeys(key for row in rows for key in row))
  rows = [{key: row.get(key, "") for key in keys} for row in rows]
  return {
    "workload": workload.description,
    "jax": jax.__version__,
    "rows": rows,
  }
