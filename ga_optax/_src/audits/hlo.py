"""Reading the text of a compiled HLO module: its computations and collectives.

``jax.jit(f).lower(...).compile().as_text()`` is the program XLA will run,
after sharding propagation and SPMD partitioning: its collectives are the
cross-device traffic, and its array shapes are per device. :func:`parse_hlo`
turns that text into computations and instructions, :func:`reachable` follows
the calls from one computation, and :func:`collectives_in_hlo` lists the
collectives of a set of computations; :mod:`ga_optax._src.audits.hlo_audits`
asks a data-parallel step's questions with them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

from ga_optax._src import scopes

# Opcodes that move data between devices. Asynchronous collectives appear as a
# ``-start``/``-done`` pair; only the ``-start`` half is counted.
COLLECTIVE_OPCODES = frozenset(
  {
    "all-reduce",
    "all-reduce-start",
    "reduce-scatter",
    "reduce-scatter-start",
    "all-gather",
    "all-gather-start",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-permute-start",
    "collective-broadcast",
  }
)

_BYTES_PER_ELEMENT = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1,
    "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
    "f32": 4, "s32": 4, "u32": 4,
    "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16,
}  # fmt: skip

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_SINGLE_CALLEE = re.compile(r"\b(?:calls|to_apply|condition|body)=%?([\w.\-]+)")
# XLA:GPU prints a two-way conditional with a ``pred`` index this way; its
# branches are listed here in index order, false first, as
# ``branch_computations`` lists them.
_PRED_BRANCHES = re.compile(
  r"\btrue_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)"
)
_OP_NAME = re.compile(r'\bop_name="((?:[^"\\]|\\.)*)"')
_CUSTOM_CALL_TARGET = re.compile(r'\bcustom_call_target="([^"]*)"')
_CALLEE_LIST = re.compile(
  r"\b(?:branch_computations|called_computations)=\{([^}]*)\}"
)


class HloInstruction(NamedTuple):
  """One instruction of a compiled HLO module.

  Attributes:
    name: the instruction's name, without the leading ``%``.
    opcode: the HLO opcode, for example ``all-reduce`` or ``conditional``.
    shape: the result shape as printed, for example ``f32[4,3]{1,0}``.
    operands: names of the operand instructions, in order.
    callees: computations it calls (fusions, branches, loop bodies,
      reducers), in the order printed.
    trip_count: for a ``while`` whose trip count XLA knows (a ``lax.scan``),
      that count; otherwise None.
    op_name: the JAX operation it was compiled from, with its name scopes
      (``jit(step)/ga_optax_close_window/while``, say), from its metadata;
      empty where the compiler gave none.
    target: a ``custom-call``'s target (``ConcatBitcast``, say); empty for
      every other instruction.
  """

  name: str
  opcode: str
  shape: str
  operands: tuple[str, ...]
  callees: tuple[str, ...]
  trip_count: int | None = None
  op_name: str = ""
  target: str = ""


class HloModule(NamedTuple):
  """The computations of a compiled HLO module, parsed from its text.

  Attributes:
    entry: name of the entry computation.
    computations: maps each computation's name to its instructions.
  """

  entry: str
  computations: dict[str, list[HloInstruction]]


class Collective(NamedTuple):
  """A cross-device collective found by :func:`collectives_in_hlo`.

  Attributes:
    computation: the computation that holds it.
    name: the instruction's name.
    opcode: for example ``all-reduce``.
    operand_bytes: bytes of its operands on one device.
  """

  computation: str
  name: str
  opcode: str
  operand_bytes: int


# An array shape with its layout, ``f32[8,128]{1,0:T(8,128)S(1)}``: the
# memory space is the layout's ``S(n)``, 0 (the device's main memory) when
# absent.
_ARRAY_WITH_LAYOUT = re.compile(r"\b[a-z][a-z0-9]*\[[0-9,]*\](\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")


def memory_spaces(shape: str) -> list[int]:
  """The memory space of each array of an HLO shape string, in order.

  0 is the device's main memory (HBM); a TPU program also places buffers in
  its on-chip memory (``S(1)``), and a GPU program in host memory
  (``S(5)``).
  """
  spaces = []
  for match in _ARRAY_WITH_LAYOUT.finditer(shape):
    space = _MEMORY_SPACE.search(match.group(1) or "")
    spaces.append(int(space.group(1)) if space else 0)
  return spaces


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string; a tuple shape counts all its arrays."""
  total = 0
  for dtype, dims in _ARRAY_SHAPE.findall(shape):
    if dtype not in _BYTES_PER_ELEMENT:
      continue
    elements = 1
    for dim in filter(None, dims.split(",")):
      elements *= int(dim)
    total += elements * _BYTES_PER_ELEMENT[dtype]
  return total


def tuple_elements(shape: str) -> list[str]:
  """The elements of an HLO tuple shape string, each a shape string.

  Raises:
    ValueError: ``shape`` is not a tuple.
  """
  shape = shape.strip()
  if not (shape.startswith("(") and shape.endswith(")")):
    raise ValueError(f"not a tuple shape: {shape!r}")
  return _split_top_level(shape[1:-1])


def _split_top_level(text: str) -> list[str]:
  """Splits on commas that are not nested in brackets or braces."""
  parts, depth, start = [], 0, 0
  for index, char in enumerate(text):
    if char in "([{":
      depth += 1
    elif char in ")]}":
      depth -= 1
    elif char == "," and depth == 0:
      parts.append(text[start:index])
      start = index + 1
  parts.append(text[start:])
  return [part.strip() for part in parts if part.strip()]


def _closing_paren(text: str, open_index: int) -> int:
  depth = 0
  for index in range(open_index, len(text)):
    if text[index] == "(":
      depth += 1
    elif text[index] == ")":
      depth -= 1
      if depth == 0:
        return index
  raise ValueError(f"unbalanced parentheses in HLO line: {text!r}")


def _parse_instruction(line: str) -> HloInstruction | None:
  # Long operand and tuple lists carry /*index=5*/ markers.
  line = _COMMENT.sub("", line).strip()
  if line.startswith("ROOT "):
    line = line[len("ROOT ") :]
  if " = " not in line or not line.startswith("%"):
    return None
  name, rest = line.split(" = ", 1)
  if rest.startswith("("):
    shape_end = _closing_paren(rest, 0) + 1
  else:
    shape_end = rest.index(" ")
  shape, rest = rest[:shape_end], rest[shape_end:].lstrip()
  opcode_end = rest.index("(")
  opcode = rest[:opcode_end]
  operands_end = _closing_paren(rest, opcode_end)
  operands = tuple(
    part.split()[-1].lstrip("%")
    for part in _split_top_level(rest[opcode_end + 1 : operands_end])
  )
  attributes = rest[operands_end + 1 :]
  callees = list(_SINGLE_CALLEE.findall(attributes))
  for true_branch, false_branch in _PRED_BRANCHES.findall(attributes):
    callees.extend([false_branch, true_branch])
  for listed in _CALLEE_LIST.findall(attributes):
    callees.extend(callee.strip().lstrip("%") for callee in listed.split(","))
  trip_count = _TRIP_COUNT.search(attributes)
  op_name = _OP_NAME.search(attributes)
  target = _CUSTOM_CALL_TARGET.search(attributes)
  return HloInstruction(
    name.lstrip("%"),
    opcode,
    shape,
    operands,
    tuple(callees),
    int(trip_count.group(1)) if trip_count else None,
    op_name.group(1) if op_name else "",
    target.group(1) if target else "",
  )


def parse_hlo(hlo_text: str) -> HloModule:
  """Parses the text of a compiled HLO module into its computations.

  Args:
    hlo_text: ``jax.jit(f).lower(*args).compile().as_text()``.

  Returns:
    An :class:`HloModule`.

  Raises:
    ValueError: the text holds no entry computation.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from ga_optax._src.audits import parse_hlo
    >>> def predict(w, xs):  # a lax.scan compiles to an HLO while loop
    ...   step = lambda total, x: (total + jnp.tanh(x @ w).sum(), None)
    ...   return jax.lax.scan(step, 0.0, xs)[0]
    >>> w, xs = jnp.ones((16, 32)), jnp.ones((4, 8, 16))
    >>> module = parse_hlo(jax.jit(predict).lower(w, xs).compile().as_text())
    >>> loops = [
    ...   instruction
    ...   for instructions in module.computations.values()
    ...   for instruction in instructions
    ...   if instruction.opcode == "while"
    ... ]
    >>> len(loops), loops[0].trip_count  # one loop, of 4 iterations
    (1, 4)
  """
  computations: dict[str, list[HloInstruction]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
    elif line.startswith("}"):
      current = None
    elif current is not None:
      instruction = _parse_instruction(line)
      if instruction is not None:
        computations[current].append(instruction)
  if entry is None:
    raise ValueError(
      "hlo_text must be the text of a compiled HLO module (with an ENTRY"
      " computation), as returned by jax.jit(f).lower(...).compile()"
      ".as_text()."
    )
  return HloModule(entry, computations)


def reachable(
  module: HloModule,
  root: str,
  excluded: Iterable[str] = (),
  *,
  into_branches: bool = True,
) -> set[str]:
  """Computations reachable from ``root`` without entering ``excluded``.

  A computation reaches those its instructions call: fusions, reducers,
  loop bodies and conditions, conditional branches.

  Args:
    module: a parsed module, from :func:`parse_hlo`.
    root: name of the computation to start from, for example
      ``module.entry``.
    excluded: names of computations not to enter, nor what only they call.
    into_branches: whether to enter the branches of conditionals and the
      two sides of a window (loops of at most one trip); without, only what
      runs whenever ``root`` runs is reached.

  Returns:
    The names of the computations reached, ``root`` included.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from ga_optax._src.audits import parse_hlo, reachable
    >>> def step(params, closes):
    ...   return jax.lax.cond(closes, lambda p: 2 * p, lambda p: p, params)
    >>> text = jax.jit(step).lower(jnp.ones(3), True).compile().as_text()
    >>> module = parse_hlo(text)
    >>> reachable(module, module.entry) == set(module.computations)
    True
  """
  excluded = set(excluded)
  seen, frontier = set(), [root]
  while frontier:
    computation = frontier.pop()
    if computation in seen or computation in excluded:
      continue
    seen.add(computation)
    for instruction in module.computations.get(computation, ()):
      branch = (
        instruction.opcode == "conditional"
        or window_side(instruction) is not None
      )
      if into_branches or not branch:
        frontier.extend(instruction.callees)
  return seen


_SIDE_OPS = {"while": "while", "conditional": "cond"}
# Scopes JAX adds around the ops of a call it inlines (jax 0.12 evaluates a
# closed-over jaxpr under ``eval_jaxpr``): they name no op of their own.
_CALL_SCOPES = frozenset({"eval_jaxpr"})


def window_side(instruction: HloInstruction) -> str | None:
  """Which side of a window an instruction is, from its scope; None if neither.

  Each side of ga_optax's window is a loop of at most one trip (a
  conditional on the CPU), a branch rather than a loop, named by a scope of
  :mod:`ga_optax._src.scopes`: its ``op_name`` ends in that scope and
  the op, possibly through the platform choice (``cond/branch_N_fun``) and
  scopes JAX adds around a call (``eval_jaxpr``). Loops and conditionals
  inside a side's body are not sides.
  """
  op = _SIDE_OPS.get(instruction.opcode)
  if op is None:
    return None
  names = instruction.op_name.split("/")
  found = [index for index, scope in enumerate(names) if scope in scopes.SIDES]
  if not found:
    return None
  after = [
    scope for scope in names[found[-1] + 1 :] if scope not in _CALL_SCOPES
  ]
  through_choice = (
    len(after) == 3 and after[0] == "cond" and after[1].startswith("branch_")
  )
  if after == [op] or (through_choice and after[-1] == op):
    return names[found[-1]]
  return None


def collectives_in_hlo(
  module: HloModule, computations: Iterable[str] | None = None
) -> list[Collective]:
  """The cross-device collectives of ``computations`` (default: all of them).

  Args:
    module: a parsed module, from :func:`parse_hlo`.
    computations: names of the computations to look in, for example the
      result of :func:`reachable`.

  Returns:
    One :class:`Collective` per collective instruction, with the bytes of
    its operands (for an all-reduce, the bytes it reduces per device).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from ga_optax._src.audits import collectives_in_hlo, parse_hlo
    >>> text = jax.jit(jnp.sum).lower(jnp.ones(8)).compile().as_text()
    >>> collectives_in_hlo(parse_hlo(text))  # one device moves nothing
    []
  """
  names = module.computations if computations is None else computations
  found = []
  for computation in names:
    instructions = module.computations.get(computation, [])
    shapes = {
      instruction.name: instruction.shape for instruction in instructions
    }
    for instruction in instructions:
      if instruction.opcode in COLLECTIVE_OPCODES:
        operand_bytes = sum(
          shape_bytes(shapes.get(operand, ""))
          for operand in instruction.operands
        )
        found.append(
          Collective(
            computation, instruction.name, instruction.opcode, operand_bytes
          )
        )
  return found
