"""One entry point for the compiled-program audits: a step in, a report out.

:func:`audit` compiles a step for a named compile-only target (an H100, 8
H100s, a v5e chip, 4 v5e chips, or this machine's CPU), reads the program
with the private audits of this package (:mod:`compiled_paths`,
:mod:`host_waits`) and answers in an :class:`AuditReport` whose fields say
what a user asks of a step: the control flow left in it, how often a GPU's
host waits for it, the buffers it duplicates, its collectives and bytes on
each path, and its peak memory.

A step has one path per kind of call. A device-scheduled step (``closing``
left to the window's counter) is one program that holds both sides of the
window: its paths are ``"micro_step"`` and ``"closing"``. A host-scheduled
step is two programs, one per value of ``closing``, each without the
window's branches: :func:`audit` with ``closing=False`` or ``True`` compiles
one of them, whose one path is the call it is.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from ga_optax._src.audits import compiled_paths, tpu_compile
from ga_optax._src.audits.hlo import HloModule
from ga_optax._src.audits.host_waits import HostWaits, host_waits

# Each named target: the compiler, and the devices it compiles for.
TARGETS: dict[str, tuple[str, int]] = {
  "cpu": ("cpu", 1),
  "h100": ("gpu", 1),
  "8xh100": ("gpu", 8),
  "v5e": ("tpu", 1),
  "4xv5e": ("tpu", 4),
}
_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class PathReport:
  """What one kind of call of a compiled step executes.

  Attributes:
    path: ``"micro_step"`` (a call that keeps the window open),
      ``"closing"`` (a call that closes it) or ``"every_call"`` (a step
      without a ga_optax window: every call runs the whole program).
    bytes_moved: bytes its instructions read and write, loop bodies counted
      once per trip: the cost of a memory-bound step.
    duplicated_bytes: bytes of the copies that duplicate a buffer in its
      own memory space (a donated state needs none); moves into a TPU's
      on-chip memory and back are left out.
    duplicates: how many such copies it runs.
    collectives: its collectives, each as ``(opcode, bytes per device)``.
    host_waits: how often a GPU's host waits for the device on this call
      (a loop or conditional outside a CUDA graph); None off a GPU target.
    misplaced_closing_work: instructions compiled from the window's closing
      side that this call runs outside it (a micro-step paying for a
      window that does not close); a closing call's own work is not
      misplaced.
  """

  path: str
  bytes_moved: int
  duplicated_bytes: int
  duplicates: int
  collectives: tuple[tuple[str, int], ...]
  host_waits: int | None
  misplaced_closing_work: int

  @property
  def collective_bytes(self) -> int:
    """The bytes per device its collectives send, summed."""
    return sum(size for _, size in self.collectives)


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """What a compiled step does, for :func:`ga_optax.testing.audit`.

  Attributes:
    target: the named target it was compiled for (``"h100"``, ...).
    schedule: ``"device"`` (one program holds both sides of the window),
      ``"host"`` (``closing=`` chose one side when compiling), or ``"none"``
      (no ga_optax window: ``optax.MultiSteps``, a plain step).
    control_flow: loops and conditionals left in the program (a
      ``lax.scan`` over micro-batches among them).
    window_branches: the window's own branches among them: none on the
      host's schedule.
    paths: one :class:`PathReport` per kind of call the program serves.
    peak_memory: the bytes the program needs at its peak on one device
      (arguments, outputs and temporaries, donated buffers counted once).
    baseline: the report of the step given as ``baseline=``, compiled for
      the same target; None without one.
  """

  target: str
  schedule: str
  control_flow: int
  window_branches: int
  paths: tuple[PathReport, ...]
  peak_memory: int
  baseline: AuditReport | None = None

  def path(self, name: str) -> PathReport:
    """The report of the path ``name`` (``"micro_step"``, ``"closing"``...).

    Raises:
      KeyError: the program serves no such path (a host-scheduled program
        serves one).
    """
    for report in self.paths:
      if report.path == name:
        return report
    raise KeyError(
      f"path {name!r}: this {self.schedule}-scheduled program serves"
      f" {[report.path for report in self.paths]}."
    )

  def table(self) -> str:
    """The report as a Markdown table, one row per path, MiB for bytes."""
    rows = [
      "| program | path | MiB moved | duplicated MiB | collectives"
      " | host waits | misplaced closing work | peak MiB |",
      "|---|---|---|---|---|---|---|---|",
    ]
    reports = [("step", self)]
    if self.baseline is not None:
      reports.append(("baseline", self.baseline))
    for program, report in reports:
      for path in report.paths:
        waits = "-" if path.host_waits is None else str(path.host_waits)
        rows.append(
          f"| {program} | {path.path} | {path.bytes_moved / _MIB:.1f}"
          f" | {path.duplicated_bytes / _MIB:.1f} | {len(path.collectives)}"
          f" | {waits} | {path.misplaced_closing_work}"
          f" | {report.peak_memory / _MIB:.1f} |"
        )
    return "\n".join(rows)

  def __str__(self) -> str:
    return (
      f"{self.schedule}-scheduled step on {self.target}: control flow"
      f" {self.control_flow} (window branches {self.window_branches})\n"
      + self.table()
    )


def audit(
  step: Callable[..., Any],
  *args: Any,
  target: str,
  donate_argnums: int | Sequence[int] = (),
  closing: bool | None = None,
  baseline: tuple[Callable[..., Any], Sequence[Any]] | None = None,
) -> AuditReport:
  """Compiles ``step(*args)`` for ``target`` and reports what it does.

  Nothing runs: the step is compiled, for devices this machine need not
  have, and its program read.

  Args:
    step: the training step, as one would pass it to ``jax.jit``.
    *args: its arguments (arrays or ``jax.ShapeDtypeStruct``). Leaves
      placed by a ``NamedSharding`` keep their partition spec on a mesh of
      the target's devices; others are replicated.
    target: ``"h100"`` or ``"8xh100"`` (XLA:GPU; needs JAX's CUDA plugin),
      ``"v5e"`` or ``"4xv5e"`` (the TPU compiler; needs ``libtpu``), or
      ``"cpu"`` (this machine's CPU).
    donate_argnums: the arguments donated, as for ``jax.jit`` (the params
      and the optimizer state, as a training loop donates them).
    closing: None for a step whose window closes on the device's count (a
      device-scheduled step: both paths are read off one program). True or
      False for a host-scheduled step: ``step`` is compiled as
      ``step(*args, closing=closing)`` and its one path is ``"closing"``
      or ``"micro_step"``.
    baseline: ``(other_step, other_args)`` compiled for the same target
      and reported beside, say the same step on ``optax.MultiSteps``.

  Returns:
    An :class:`AuditReport`.

  Raises:
    TypeError: ``step`` is not callable, ``closing`` is not None or a
      bool, or ``baseline`` is not a pair of a step and its arguments.
    ValueError: ``target`` is not one of the named targets.
    RuntimeError: the target's compiler is not installed here.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> from ga_optax.testing import audit
    >>> tx = ga_optax.accumulate(optax.adam(1e-3), 4)
    >>> params = {"w": jnp.ones((256, 256))}
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> report = audit(step, params, tx.init(params), params, target="cpu",
    ...     donate_argnums=(0, 1))
    >>> report.schedule, tuple(path.path for path in report.paths)
    ('device', ('micro_step', 'closing'))
    >>> micro, closing = report.paths
    >>> micro.bytes_moved < closing.bytes_moved  # Adam runs only when closing
    True
  """
  if not callable(step):
    raise TypeError(
      f"step must be the step to compile (a callable), got {type(step).__name__}."
    )
  if target not in TARGETS:
    raise ValueError(
      f"target must be one of {sorted(TARGETS)}, got {target!r}."
    )
  if closing is not None and not isinstance(closing, bool):
    raise TypeError(
      "closing must be None (the device's schedule) or a Python bool (the"
      f" host's schedule, one program per value), got {closing!r}."
    )
  if baseline is not None and not (
    isinstance(baseline, tuple)
    and len(baseline) == 2
    and callable(baseline[0])
    and isinstance(baseline[1], (tuple, list))
  ):
    raise TypeError(
      "baseline must be a pair (step, args) of another step and the"
      f" sequence of its arguments, got {type(baseline).__name__}."
    )
  if closing is not None:
    step = functools.partial(step, closing=closing)
  report = _audit_program(step, args, target, donate_argnums, closing)
  if baseline is None:
    return report
  other_step, other_args = baseline
  return dataclasses.replace(
    report,
    baseline=_audit_program(
      other_step, tuple(other_args), target, donate_argnums, None
    ),
  )


def _audit_program(
  step: Callable[..., Any],
  args: tuple[Any, ...],
  target: str,
  donate_argnums: int | Sequence[int],
  closing: bool | None,
) -> AuditReport:
  program, waits = _compiled(step, args, target, donate_argnums)
  module = compiled_paths.as_module(program)
  sides = compiled_paths.window_sides(module)
  window_branches = sum(sides.values())
  if closing is not None:
    schedule = "host"
    names: tuple[str, ...] = ("closing" if closing else "micro_step",)
  elif window_branches:
    schedule, names = "device", compiled_paths.PATHS
  else:
    schedule, names = "none", ("every_call",)
  memory = program.memory_analysis()
  return AuditReport(
    target=target,
    schedule=schedule,
    control_flow=_control_flow(module),
    window_branches=window_branches,
    paths=tuple(_path_report(module, name, waits) for name in names),
    peak_memory=_peak_memory(memory),
  )


def _compiled(
  step: Callable[..., Any],
  args: tuple[Any, ...],
  target: str,
  donate_argnums: int | Sequence[int],
) -> tuple[Any, HostWaits | None]:
  """``step`` compiled for ``target``, with its host waits on a GPU."""
  compiler, num_devices = TARGETS[target]
  if compiler == "gpu":
    waits = host_waits(
      step,
      *args,
      num_devices=num_devices,
      donate_argnums=donate_argnums,
    )
    return waits.program, waits
  if compiler == "tpu":
    program = tpu_compile.compile_for_tpu(
      step, *args, num_devices=num_devices, donate_argnums=donate_argnums
    )
    return program, None
  return _compile_here(step, args, donate_argnums), None


def _path_report(module: Any, name: str, waits: HostWaits | None) -> PathReport:
  """What the calls of path ``name`` run in ``module``."""
  # A program without the window's branches runs all of it on its one
  # call: read along either path, the same instructions run.
  found = compiled_paths.path_audit(
    module,
    "closing" if name == "closing" else "micro_step",
    require_window=False,
  )
  duplicates = found.duplicates
  return PathReport(
    path=name,
    bytes_moved=found.bytes_moved,
    duplicated_bytes=sum(copy.bytes for copy in duplicates),
    duplicates=len(duplicates),
    collectives=tuple(
      (collective.opcode, collective.operand_bytes)
      for collective in found.collectives
    ),
    host_waits=_waits_on(waits, name),
    # Closing work a closing call runs is where it belongs, wherever the
    # compiler put it; on a call that keeps the window open (a micro-step,
    # or a host-scheduled closing=False program, which has no closing side
    # at all), it is paid for nothing.
    misplaced_closing_work=(
      0 if name == "closing" else len(found.misplaced_closing_work)
    ),
  )


def _compile_here(
  step: Callable[..., Any],
  args: tuple[Any, ...],
  donate_argnums: int | Sequence[int],
) -> Any:
  """Compiles for this machine's CPU, under the mesh ``args`` are placed on.

  The mesh is set around the compilation, as on the compile-only targets,
  so that a step typed for Explicit axes compiles as it would run.
  """
  jitted = jax.jit(step, donate_argnums=donate_argnums)
  meshes = {
    leaf.sharding.mesh
    for leaf in jax.tree.leaves(args)
    if isinstance(getattr(leaf, "sharding", None), NamedSharding)
  }
  if len(meshes) != 1:
    return jitted.lower(*args).compile()
  with jax.set_mesh(meshes.pop()):
    return jitted.lower(*args).compile()


def _waits_on(waits: HostWaits | None, path: str) -> int | None:
  if waits is None:
    return None
  return waits.closing if path == "closing" else waits.micro_step


def _control_flow(module: HloModule) -> int:
  return sum(
    instruction.opcode in ("while", "conditional")
    for instructions in module.computations.values()
    for instruction in instructions
  )


def _peak_memory(memory: Any) -> int:
  peak = getattr(memory, "peak_memory_in_bytes", None)
  if peak:
    return int(peak)
  # Where the compiler reports no peak (XLA:CPU), the live buffers at once:
  # arguments, outputs and temporaries, a donated buffer counted once.
  return int(
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    + memory.temp_size_in_bytes
    - memory.alias_size_in_bytes
  )
