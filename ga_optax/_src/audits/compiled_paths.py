"""What a compiled step does on each path: bytes moved, copies, collectives.

An accumulation step has two paths through its program: the micro-step that
keeps the window open, and the call that closes it. Each side of ga_optax's
window is a loop of at most one trip named by its scope
(:mod:`ga_optax._src.scopes`); a path runs one of them once and the
other not at all. :func:`path_audit` walks a compiled program's text along one
path and reports what it executes there:

* bytes moved, the compiler-level cost model of a memory-bound step: each
  executed instruction reads each operand once and writes its result once;
  a fusion counts as one instruction, a loop body counts once per trip (the
  trip count XLA knows, as for a ``lax.scan``, or the window side's 0 or
  1), a conditional counts the branch the path takes (the first branch on a
  micro-step, the last when a window closes: ``lax.cond``'s false and true
  branches), and parameters, constants, tuples, bitcasts and the like move
  nothing. An asynchronous ``copy-start`` or ``slice-start`` moves what it
  copies or slices, not the tuple it returns, and a TPU's view of its
  prefetched slices as one buffer (``ConcatBitcast``) moves nothing. A loop
  of unknown trip count outside the window counts once.
* copies: ``copy`` instructions and asynchronous ``copy-start`` ones,
  each marked when it moves a buffer between memory spaces (to or from host
  memory; a TPU's prefetch into its on-chip memory and back) rather than
  duplicating it in its own: a donated state should never need the latter;
* collectives, with the bytes each sends;
* closing work done outside the closing side: instructions compiled from
  the closing side (its scope is in their ``op_name``) that the compiler
  moved out of its loop, and that a micro-step would then run too.

These are compiler figures: deterministic, and the same on any machine that
compiles for the same target, but not times. For XLA:GPU, compile with
:func:`compile_for_gpu`.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from ga_optax._src import scopes
from ga_optax._src.audits.hlo import (
  COLLECTIVE_OPCODES,
  Collective,
  HloInstruction,
  HloModule,
  memory_spaces,
  parse_hlo,
  shape_bytes,
  tuple_elements,
  window_side,
)

Path = Literal["micro_step", "closing"]
PATHS: tuple[Path, ...] = ("micro_step", "closing")

# Instructions that name or regroup buffers without moving their bytes.
_NO_TRAFFIC = frozenset(
  {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "opt-barrier",
    "after-all",
    "add-dependency",
    "partition-id",
    "replica-id",
    "domain",
  }
)
# Instructions whose callees are part of the path (not fused or reducers).
_CONTROL_FLOW = frozenset({"while", "conditional", "call", "async-start"})
_COPY_OPCODES = frozenset({"copy", "copy-start"})
# Custom calls that name buffers already in place as one (a TPU's slices).
_VIEWS = frozenset({"ConcatBitcast"})
# Bytes an instruction on scalars moves at most (a few 8-byte operands).
_SCALAR_TRAFFIC = 64


class Copy(NamedTuple):
  """A ``copy`` (or asynchronous ``copy-start``) on a path of a program.

  Attributes:
    computation: the computation that holds it.
    name: the instruction's name.
    bytes: the bytes it writes.
    between_memory_spaces: whether it moves a buffer from one memory space
      to another (host memory, a TPU's on-chip memory) instead of
      duplicating it where it is.
  """

  computation: str
  name: str
  bytes: int
  between_memory_spaces: bool = False


class PathAudit(NamedTuple):
  """What one path of a compiled step executes.

  Attributes:
    path: ``"micro_step"`` or ``"closing"``.
    bytes_moved: bytes read and written by the instructions the path runs,
      loop bodies counted once per trip.
    copies: the ``copy`` instructions the path runs.
    collectives: the collectives the path runs (each listed once, however
      many trips its loop makes).
    misplaced_closing_work: instructions compiled from the window's closing
      side that run on this path outside it (their names), scalar ones
      left out; on the micro-step path, work every micro-step pays for a
      window that does not close.
  """

  path: Path
  bytes_moved: int
  copies: list[Copy]
  collectives: list[Collective]
  misplaced_closing_work: list[str]

  def copied_bytes(self, at_least: int = 0) -> int:
    """The bytes of the copies of ``at_least`` bytes or more."""
    return sum(copy.bytes for copy in self.copies if copy.bytes >= at_least)

  @property
  def duplicates(self) -> list[Copy]:
    """The copies that duplicate a buffer in its own memory space.

    What a donated state should never need. A TPU program moves buffers
    into its on-chip memory and back as a matter of course (its ``copy``
    and ``copy-start`` instructions into ``S(1)``); those are left out.
    """
    return [copy for copy in self.copies if not copy.between_memory_spaces]


def side_runs(side: str, path: Path) -> bool:
  """Whether a branch of the window, named by its scope, runs on ``path``.

  The closing branches run when a window closes; the branch that empties a
  window closed without weight runs on neither path (a micro-step keeps the
  window open, and a closing step that steps the optimizer has weight).
  """
  if side == scopes.EMPTY_WINDOW:
    return False
  return (side == scopes.CLOSE_WINDOW) == (path == "closing")


def trips_on_path(instruction: HloInstruction, path: Path) -> int:
  """The trips a loop makes on ``path``: a window side's 0 or 1, else XLA's.

  A loop of unknown trip count outside the window counts once.
  """
  side = window_side(instruction)
  if side is not None:
    return int(side_runs(side, path))
  return instruction.trip_count if instruction.trip_count is not None else 1


def branches_taken(instruction: HloInstruction, path: Path) -> list[str]:
  """The computations a control-flow instruction runs on ``path``.

  All its callees, but for a conditional: the branch the path takes.
  """
  if instruction.opcode != "conditional":
    return list(instruction.callees)
  side = window_side(instruction)
  # A side of the window compiled as a conditional: its true branch is the
  # side's body, taken on the path that runs the side.
  runs = path == "closing" if side is None else side_runs(side, path)
  return [instruction.callees[-1 if runs else 0]]


def _from_closing_side(module: HloModule, instruction: HloInstruction) -> bool:
  """Whether an instruction holds work compiled from the closing side.

  A fusion is named by its root; the closing side's work may be fused
  under a root from elsewhere (a select that keeps its result), so the
  fused instructions are read too.
  """
  if scopes.CLOSE_WINDOW in instruction.op_name.split("/"):
    return True
  if instruction.opcode != "fusion":
    return False
  return any(
    _from_closing_side(module, fused)
    for callee in instruction.callees
    for fused in module.computations.get(callee, ())
  )


def as_module(program: Any) -> HloModule:
  """A parsed module from compiled text, a compiled object or a module.

  Raises:
    TypeError: ``program`` is none of these.
  """
  if isinstance(program, HloModule):
    return program
  if isinstance(program, str):
    return parse_hlo(program)
  as_text = getattr(program, "as_text", None)
  if callable(as_text) and hasattr(program, "memory_analysis"):
    return parse_hlo(as_text())
  raise TypeError(
    "expected a compiled program (jax.jit(f).lower(...).compile()), its"
    " .as_text(), or an HloModule from parse_hlo; got"
    f" {type(program).__name__}."
  )


def path_audit(
  program: Any, path: Path, *, require_window: bool = True
) -> PathAudit:
  """Walks ``program`` along one path and reports what it executes there.

  Args:
    program: a compiled program (``jax.jit(step).lower(...).compile()``, or
      :func:`compile_for_gpu`'s result), its text, or a
      module from :func:`parse_hlo`.
    path: ``"micro_step"`` (the window stays open) or ``"closing"``.
    require_window: refuse a program that holds no ga_optax window. A step
      without one (``optax.MultiSteps``, a plain optimizer step) has no
      paths to tell apart: both are the whole program, and its
      ``misplaced_closing_work`` is empty even where the optimizer runs on
      every call. Pass False to audit such a step as the baseline a
      window's paths are compared with.

  Returns:
    A :class:`PathAudit`.

  Raises:
    TypeError: ``program`` is not a compiled program, its text or a module.
    ValueError: ``path`` is not one of the two, or ``program`` holds no
      ga_optax window and ``require_window`` is True.

  Example:
    >>> import jax, jax.numpy as jnp, optax, ga_optax
    >>> from ga_optax._src.audits import path_audit
    >>> tx = ga_optax.accumulate(optax.adam(1e-3), 4)
    >>> params = {"w": jnp.ones((256, 256))}
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
    ...     params, tx.init(params), params).compile()
    >>> micro, closing = (
    ...     path_audit(compiled, p) for p in ("micro_step", "closing"))
    >>> micro.bytes_moved < closing.bytes_moved  # Adam runs only when closing
    True
    >>> micro.misplaced_closing_work
    []
  """
  if path not in PATHS:
    raise ValueError(f"path must be one of {PATHS}, got {path!r}.")
  module = as_module(program)
  if require_window:
    _refuse_without_a_window(module)
  total = 0
  copies: list[Copy] = []
  collectives: list[Collective] = []
  misplaced: list[str] = []

  def walk(computation: str, trips: int, in_closing_side: bool) -> None:
    nonlocal total
    instructions = module.computations.get(computation, [])
    shapes = {
      instruction.name: instruction.shape for instruction in instructions
    }
    for instruction in instructions:
      opcode = instruction.opcode
      if opcode in _CONTROL_FLOW:
        runs = trips_on_path(instruction, path) if opcode == "while" else 1
        closing_side = window_side(instruction) == scopes.CLOSE_WINDOW
        for callee in branches_taken(instruction, path):
          walk(callee, trips * runs, in_closing_side or closing_side)
        continue
      if opcode in _NO_TRAFFIC or opcode.endswith("-done") or not trips:
        continue
      read, written = _traffic(instruction, shapes)
      moved = read + written
      total += trips * moved
      if opcode in _COPY_OPCODES:
        copies.append(
          Copy(
            computation,
            instruction.name,
            written,
            _between_memory_spaces(instruction, shapes),
          )
        )
      if opcode in COLLECTIVE_OPCODES:
        collectives.append(
          Collective(computation, instruction.name, opcode, read)
        )
      # Scalars (the side's own predicate, say) are not work worth moving.
      if (
        not in_closing_side
        and moved > _SCALAR_TRAFFIC
        and _from_closing_side(module, instruction)
      ):
        misplaced.append(instruction.name)

  walk(module.entry, 1, False)
  return PathAudit(path, total, copies, collectives, misplaced)


def _traffic(
  instruction: HloInstruction, shapes: dict[str, str]
) -> tuple[int, int]:
  """The bytes ``instruction`` reads and writes, once.

  Each operand read and the result written, except where the result is not
  what the instruction writes:

  * a ``copy-start`` (the destination, the source, a context) reads and
    writes its operand;
  * a ``slice-start`` (the source, the slice, a context) reads and writes
    the slice, not the whole buffer it is cut from;
  * a ``ConcatBitcast`` custom call, which views the slices that sit side
    by side as one buffer, moves nothing.
  """
  if instruction.opcode == "custom-call" and instruction.target in _VIEWS:
    return 0, 0
  read = sum(
    shape_bytes(shapes.get(operand, "")) for operand in instruction.operands
  )
  if instruction.opcode == "copy-start":
    return read, read
  if instruction.opcode == "slice-start":
    cut = shape_bytes(tuple_elements(instruction.shape)[1])
    return cut, cut
  return read, shape_bytes(instruction.shape)


def _between_memory_spaces(
  instruction: HloInstruction, shapes: dict[str, str]
) -> bool:
  """Whether a copy writes its buffer into another memory space.

  A ``copy-start``'s result is a tuple of the destination, the source and a
  context; a ``copy``'s source is its operand.
  """
  if instruction.opcode == "copy-start":
    spaces = memory_spaces(instruction.shape)
    return len(spaces) >= 2 and spaces[0] != spaces[1]
  source = memory_spaces(shapes.get(instruction.operands[0], ""))
  destination = memory_spaces(instruction.shape)
  return bool(source) and bool(destination) and source != destination


def _refuse_without_a_window(module: HloModule) -> None:
  """Raises where ``module`` holds no ga_optax window: it has no paths."""
  if not _holds_a_window(module):
    raise ValueError(
      "program holds no ga_optax window (no instruction compiled under"
      f" {scopes.KEEP_OPEN!r} or {scopes.CLOSE_WINDOW!r}), so it has no"
      " micro-step and closing paths: every call runs the whole program,"
      " optimizer included. Audit the step built on ga_optax.accumulate (or"
      " accumulate_and_apply) instead; to compare it with a step without a"
      " window (optax.MultiSteps, a plain optimizer step), audit that step"
      " with path_audit(program, path, require_window=False), which reads"
      " the whole program as what every call runs."
    )


def _holds_a_window(module: HloModule) -> bool:
  """Whether any instruction was compiled from a side of a window.

  The sides' loops, or what the compiler made of them: their work hoisted
  out, or selects where their conditional was.
  """
  sides = set(scopes.SIDES)
  return any(
    not sides.isdisjoint(instruction.op_name.split("/"))
    for instructions in module.computations.values()
    for instruction in instructions
  )


def window_sides(program: Any) -> dict[str, int]:
  """How many loops (on the CPU, conditionals) of each window side it holds.

  Returns:
    ``{"keep_open": n, "close_window": m, "empty_window": e}``. A step built
    on one ``accumulate`` adds its gradient outside any branch (n = 0) and
    holds one closing loop (m >= 1: the branch that steps the optimizer, and
    the one that zeroes the accumulator after its buffer carried the updates
    out, are closing loops too; on the CPU that zeroing is a select, in no
    branch) and one that empties a window closed without weight. A
    host-scheduled step holds none.
  """
  module = as_module(program)
  found = dict.fromkeys(scopes.SIDES, 0)
  for instructions in module.computations.values():
    for instruction in instructions:
      side = window_side(instruction)
      if side is not None:
        found[side] += 1
  return {
    "keep_open": found[scopes.KEEP_OPEN],
    "close_window": found[scopes.CLOSE_WINDOW],
    "empty_window": found[scopes.EMPTY_WINDOW],
  }
