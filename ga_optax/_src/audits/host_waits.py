"""How often a step compiled for a GPU makes the host wait for the device.

XLA:GPU runs a program as a sequence of thunks: kernels, copies, library
calls, collectives, and control flow. Most of them the host only queues.
A loop or a conditional outside a command buffer (a CUDA graph) is the
exception: the host itself decides each step of it, so before every trip
of a loop it copies the loop's predicate to the host and waits for the
stream to finish, and before a conditional it does the same with the
branch index. A loop of ``n`` trips waits ``n + 1`` times (a loop whose
trip count XLA knows, a ``lax.scan``, none: the host counts the trips
itself), a conditional once. While the host waits it queues nothing, and
the device idles after the wait. Inside a command buffer the same loop or
conditional is a node of the graph that the device evaluates: no wait.

:func:`host_waits` compiles a step for compile-only GPUs (as
:func:`compile_for_gpu` does), reads the thunk sequence
XLA:GPU built for it, and counts the waits on each path of the window (as
:func:`path_audit` defines the paths: each side of the
window is a loop of at most one trip, which a micro-step runs on one side
and the closing call on the other). A loop outside a command buffer makes
the host wait twice when it runs (its trip, then its end) and once when it
does not.

These are compiler figures, read off the program a GPU with a CUDA 13
driver would run; how long a wait takes needs a GPU to say.
"""

from __future__ import annotations

import pathlib
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from ga_optax._src.audits.compiled_paths import (
  PATHS,
  Path,
  as_module,
  branches_taken,
  trips_on_path,
)
from ga_optax._src.audits.gpu_compile import compile_for_gpu
from ga_optax._src.audits.hlo import HloInstruction, HloModule

# The thunk kinds the host drives itself when they are not inside a
# command buffer, and the control flow of the HLO they are compiled from.
_HOST_DRIVEN = {"kWhile": "while", "kConditional": "conditional"}
_COMMAND_BUFFER = "kCommandBuffer"
_CONTROL_FLOW = frozenset({"while", "conditional", "call", "async-start"})

# A thunk as XLA prints it in a thunk sequence: ``003: kWhile  [prev=...``,
# indented by its nesting (in a command buffer, a loop's body, a branch).
_THUNK_LINE = re.compile(r"^( *)(\d+): (k\w+)")
_METADATA = re.compile(r"thunk_metadata\s*\{(.*?)\n\}", re.DOTALL)
_ANNOTATION = re.compile(r'profile_annotation:\s*"([^"]*)"')
_THUNK_ID = re.compile(r"thunk_id:\s*(\d+)")
_CAMEL_WORD = re.compile(r"(?<!^)(?=[A-Z])")


class HostWaits(NamedTuple):
  """The host waits of a compiled step, per path of its window.

  Attributes:
    micro_step: waits on a call that keeps the window open.
    closing: waits on a call that closes it.
    top_level: the kinds of the program's top-level thunks, in order
      (``"command_buffer"``, ``"while"``, ``"copy"``, ``"custom_kernel"``,
      ...): ``("command_buffer",)`` when one CUDA graph holds everything.
    on_host: the HLO loops and conditionals the host drives (outside any
      command buffer), by instruction name, in the order the sequence
      lists them.
    program: the compiled program that was read, for the other audits
      (:func:`path_audit`).
  """

  micro_step: int
  closing: int
  top_level: tuple[str, ...]
  on_host: tuple[str, ...]
  program: jax.stages.Compiled


class _Thunk(NamedTuple):
  thunk_id: int
  kind: str
  depth: int
  in_command_buffer: bool


def host_waits(
  fun: Callable[..., Any],
  *args: Any,
  num_devices: int = 1,
  target: str = "h100",
  donate_argnums: int | Sequence[int] = (),
  compiler_options: Mapping[str, Any] | None = None,
) -> HostWaits:
  """Compiles ``fun(*args)`` for GPUs and counts the host waits of each path.

  The step is compiled as :func:`compile_for_gpu` compiles
  it (same arguments; the H100 target reports a CUDA 13 driver, as a real
  one does, which XLA:GPU asks before it captures loops in command
  buffers), and the thunk sequence XLA:GPU built is read: each loop and
  conditional outside a command buffer makes the host wait, ``trips + 1``
  times for a loop whose trip count XLA does not know, once for a
  conditional. A step without a ga_optax window (``optax.MultiSteps``, a
  plain optimizer step) has the same waits on both paths.

  Args:
    fun: the step, as one would pass it to ``jax.jit``.
    *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
    num_devices: the GPUs of the host to compile for.
    target: ``"h100"``, or the text of a ``GpuTargetConfigProto``.
    donate_argnums: the arguments donated, as for ``jax.jit``.
    compiler_options: XLA options, as for ``jax.jit``: say
      the private recipe ``gpu_compiler_options()``; None compiles under XLA's
      defaults.

  Returns:
    A :class:`HostWaits`. A loop of the window runs 0 or 1 times, as
    :func:`path_audit` counts it; any other loop of
    unknown trip count, once; a conditional outside the window takes its
    first branch on a micro-step, its last when the window closes.

  Raises:
    TypeError: ``fun`` is not callable, or ``compiler_options`` is not a
      mapping.
    ValueError: ``compiler_options`` sets ``xla_dump_to`` (this function
      dumps the program to a place of its own).
    GpuCompilerUnavailable: JAX's CUDA plugin cannot be used here.
    RuntimeError: XLA wrote no thunk sequence (a persistent compilation
      cache that already held the program, say).

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> from ga_optax._src import audits
    >>> tx = ga_optax.accumulate(optax.adam(1e-3), 4)
    >>> params = {"w": jnp.ones((1024, 1024))}
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> args = (params, tx.init(params), params)
    >>> waits = audits.host_waits(  # doctest: +SKIP
    ...     step, *args, donate_argnums=(0, 1))
    >>> waits.micro_step < waits.closing  # doctest: +SKIP
    True
  """
  if not callable(fun):
    raise TypeError(
      f"fun must be the step to compile (a callable), got {type(fun).__name__}."
    )
  if compiler_options is None:
    compiler_options = {}
  if not isinstance(compiler_options, Mapping):
    raise TypeError(
      "compiler_options must be a mapping of XLA option names to values, as"
      " for jax.jit (say gpu_compiler_options()), got"
      f" {type(compiler_options).__name__}."
    )
  if "xla_dump_to" in compiler_options:
    raise ValueError(
      "compiler_options must not set xla_dump_to: host_waits dumps the"
      " program to a temporary directory of its own and reads it there."
    )
  with tempfile.TemporaryDirectory(prefix="ga_optax_thunks_") as dump:
    program = compile_for_gpu(
      fun,
      *args,
      num_devices=num_devices,
      target=target,
      donate_argnums=donate_argnums,
      compiler_options={**compiler_options, "xla_dump_to": dump},
    )
    sequence, metadata = _read_dump(pathlib.Path(dump))
  return count_host_waits(program, sequence, metadata)


def count_host_waits(
  program: Any, thunk_sequence: str, thunk_metadata: str
) -> HostWaits:
  """The host waits of a program, from the thunk sequence XLA:GPU dumped.

  :func:`host_waits` compiles and calls this; it is the part to call on a
  dump of one's own (``--xla_dump_to``: the files
  ``*.thunk_sequence_after_thunk_passes.txt``, or ``*.thunk_sequence.txt``
  where the thunk passes changed nothing, and ``*.thunk_metadata.txt``).

  Args:
    program: the compiled program (or its text) the dump is of.
    thunk_sequence: the text of the thunk sequence.
    thunk_metadata: the text of the thunk metadata, which names the HLO
      instruction each thunk runs.

  Returns:
    A :class:`HostWaits` (its ``program`` is ``program`` as given).

  Raises:
    TypeError: ``program`` is not a compiled program or its text.
    ValueError: ``thunk_sequence`` holds no thunk, or names a loop or
      conditional that ``program`` does not hold.
  """
  module = as_module(program)
  thunks = _parse_thunks(thunk_sequence)
  if not thunks:
    raise ValueError(
      "thunk_sequence holds no thunk: pass the text of a file XLA:GPU dumped"
      " as *.thunk_sequence_after_thunk_passes.txt (or *.thunk_sequence.txt)."
    )
  names = _annotations(thunk_metadata)
  instructions = {
    instruction.name: instruction
    for computation in module.computations.values()
    for instruction in computation
  }
  on_host = []
  for thunk in thunks:
    if thunk.kind not in _HOST_DRIVEN or thunk.in_command_buffer:
      continue
    name = names.get(thunk.thunk_id)
    if name not in instructions:
      raise ValueError(
        f"thunk {thunk.thunk_id} ({thunk.kind}) runs {name!r}, which program"
        " does not hold: pass the compiled program the dump is of."
      )
    on_host.append(instructions[name])
  waits = {}
  for path in PATHS:
    runs = _runs(module, path)
    waits[path] = sum(
      _waits(instruction, path) * runs.get(instruction.name, 0)
      for instruction in on_host
    )
  return HostWaits(
    micro_step=waits["micro_step"],
    closing=waits["closing"],
    top_level=tuple(
      _snake_case(thunk.kind) for thunk in thunks if thunk.depth == 0
    ),
    on_host=tuple(instruction.name for instruction in on_host),
    program=program,
  )


def _read_dump(dump: pathlib.Path) -> tuple[str, str]:
  """The thunk sequence and metadata of the one module dumped in ``dump``."""
  metadata = sorted(dump.glob("*.thunk_metadata.txt"))
  if len(metadata) != 1:
    raise RuntimeError(
      "expected XLA:GPU to dump the thunks of one module, found"
      f" {len(metadata)} thunk metadata files: a persistent compilation cache"
      " that already held the program skips the compiler (disable it for this"
      " call), and a JAX too old to dump thunk sequences cannot be audited."
    )
  module = metadata[0].name.removesuffix(".thunk_metadata.txt")
  # The passes (command buffers among them) rewrite the sequence XLA first
  # built; where they changed nothing only the first is written.
  for suffix in ("thunk_sequence_after_thunk_passes.txt", "thunk_sequence.txt"):
    sequence = dump / f"{module}.{suffix}"
    if sequence.exists():
      return sequence.read_text(), metadata[0].read_text()
  raise RuntimeError(f"XLA:GPU dumped no thunk sequence for {module}.")


def _parse_thunks(text: str) -> list[_Thunk]:
  """The thunks of a printed sequence, with their depth and enclosure."""
  thunks: list[_Thunk] = []
  # The enclosing thunks of the current line: (indent, kind).
  enclosing: list[tuple[int, str]] = []
  for line in text.splitlines():
    match = _THUNK_LINE.match(line)
    if match is None:
      continue
    indent, thunk_id, kind = len(match[1]), int(match[2]), match[3]
    while enclosing and enclosing[-1][0] >= indent:
      enclosing.pop()
    thunks.append(
      _Thunk(
        thunk_id,
        kind,
        depth=len(enclosing),
        in_command_buffer=any(k == _COMMAND_BUFFER for _, k in enclosing),
      )
    )
    enclosing.append((indent, kind))
  return thunks


def _annotations(text: str) -> dict[int, str]:
  """Each thunk's id mapped to the HLO instruction it runs."""
  names = {}
  for block in _METADATA.findall(text):
    annotation, thunk_id = _ANNOTATION.search(block), _THUNK_ID.search(block)
    if annotation and thunk_id:
      names[int(thunk_id[1])] = annotation[1]
  return names


def _runs(module: HloModule, path: Path) -> dict[str, int]:
  """How many times each control-flow instruction runs on ``path``."""
  runs: dict[str, int] = {}

  def walk(computation: str, times: int) -> None:
    for instruction in module.computations.get(computation, ()):
      if instruction.opcode not in _CONTROL_FLOW:
        continue
      runs[instruction.name] = runs.get(instruction.name, 0) + times
      trips = (
        trips_on_path(instruction, path) if instruction.opcode == "while" else 1
      )
      for callee in branches_taken(instruction, path):
        walk(callee, times * trips)

  walk(module.entry, 1)
  return runs


def _waits(instruction: HloInstruction, path: Path) -> int:
  """The waits of one run of a loop or conditional the host drives."""
  if instruction.opcode != "while":
    return 1  # a conditional reads its branch index
  if instruction.trip_count is not None:
    # XLA:GPU runs a loop of known trip count without reading a predicate.
    return 0
  return trips_on_path(instruction, path) + 1


def _snake_case(kind: str) -> str:
  return _CAMEL_WORD.sub("_", kind.removeprefix("k")).lower()
