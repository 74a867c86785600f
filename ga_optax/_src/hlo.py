"""Reading the text of a compiled HLO module: what runs where, on what shapes.

``jax.jit(f).lower(...).compile().as_text()`` is the program XLA will run,
after sharding propagation and SPMD partitioning: its collectives are the
cross-device traffic, and its array shapes are per device. :func:`parse_hlo`
turns that text into computations and instructions; the functions after it
answer the questions a data-parallel step raises: which collectives run, in
which computation (every call, once per loop iteration, only when a window
closes), and on how many rows each device multiplies.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

# Opcodes that move data between devices. Asynchronous collectives appear as a
# ``-start``/``-done`` pair; only the ``-start`` half is counted.
COLLECTIVE_OPCODES = frozenset(
  {
    "all-reduce",
    "all-reduce-start",
    "reduce-scatter",
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
_SINGLE_CALLEE = re.compile(
  r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
  r"=%?([\w.\-]+)"
)
_CALLEE_LIST = re.compile(
  r"\b(?:branch_computations|called_computations)=\{([^}]*)\}"
)
_LAYOUT = re.compile(r"\{[^{}]*\}")
# Instructions that multiply a batch of rows by weights.
_CONTRACTION_OPCODES = frozenset({"dot", "convolution"})


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
  """

  name: str
  opcode: str
  shape: str
  operands: tuple[str, ...]
  callees: tuple[str, ...]
  trip_count: int | None = None


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
  for listed in _CALLEE_LIST.findall(attributes):
    callees.extend(callee.strip().lstrip("%") for callee in listed.split(","))
  trip_count = _TRIP_COUNT.search(attributes)
  return HloInstruction(
    name.lstrip("%"),
    opcode,
    shape,
    operands,
    tuple(callees),
    int(trip_count.group(1)) if trip_count else None,
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
    >>> from ga_optax.testing import parse_hlo
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
    into_branches: whether to enter the branches of conditionals; without,
      only what runs whenever ``root`` runs is reached.

  Returns:
    The names of the computations reached, ``root`` included.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from ga_optax.testing import parse_hlo, reachable
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
      if into_branches or instruction.opcode != "conditional":
        frontier.extend(instruction.callees)
  return seen


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
    >>> from ga_optax.testing import collectives_in_hlo, parse_hlo
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


class WindowCollectives(NamedTuple):
  """Where the collectives of a compiled accumulation step run.

  Attributes:
    every_micro_step: collectives that run on every call: those outside the
      window-closing branch.
    window_closing: collectives that run only when a window closes.
    closing_branch: name of the conditional branch that holds
      ``window_closing``, or None when no conditional branch holds any.
  """

  every_micro_step: list[Collective]
  window_closing: list[Collective]
  closing_branch: str | None


def window_collectives(hlo_text: str) -> WindowCollectives:
  """Splits the collectives of a compiled step by whether a window closes.

  ``accumulate`` closes a window in the true branch of a ``lax.cond``, which
  compiles to the last branch of an HLO ``conditional``. This finds the
  conditional branches (outside any other branch) that hold collectives,
  checks that there is exactly one and that it is the last branch of its
  conditional, and reports the collectives inside and outside it.

  Args:
    hlo_text: ``jax.jit(step).lower(*args).compile().as_text()``.

  Returns:
    A :class:`WindowCollectives`.

  Raises:
    ValueError: collectives sit in several conditional branches, or in a
      branch that is not the last one of its conditional.

  Example:
    >>> import jax, jax.numpy as jnp, optax, ga_optax
    >>> from ga_optax.testing import window_collectives
    >>> tx = ga_optax.accumulate(optax.sgd(0.1), 4)
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> params = jnp.zeros(3)
    >>> compiled = jax.jit(step).lower(params, tx.init(params), params).compile()
    >>> found = window_collectives(compiled.as_text())
    >>> found.every_micro_step, found.window_closing  # nothing on one device
    ([], [])
  """
  module = parse_hlo(hlo_text)
  branch_roles: dict[str, bool] = {}
  pending, visited = [module.entry], set()
  # Walks the call graph without entering branches: the outermost
  # conditionals are the candidates for the window's one.
  while pending:
    computation = pending.pop()
    if computation in visited:
      continue
    visited.add(computation)
    for instruction in module.computations.get(computation, ()):
      if instruction.opcode == "conditional":
        last = len(instruction.callees) - 1
        for index, branch in enumerate(instruction.callees):
          branch_roles[branch] = index == last
      else:
        pending.extend(instruction.callees)
  with_collectives = [
    branch
    for branch in branch_roles
    if collectives_in_hlo(module, reachable(module, branch))
  ]
  if not with_collectives:
    everything = collectives_in_hlo(module, reachable(module, module.entry))
    return WindowCollectives(everything, [], None)
  if len(with_collectives) > 1 or not branch_roles[with_collectives[0]]:
    raise ValueError(
      "expected collectives in at most one conditional branch, the last"
      " one of its conditional (the true branch of the lax.cond that closes"
      f" the window); found them in {with_collectives}."
    )
  closing = with_collectives[0]
  return WindowCollectives(
    every_micro_step=collectives_in_hlo(
      module, reachable(module, module.entry, excluded={closing})
    ),
    window_closing=collectives_in_hlo(module, reachable(module, closing)),
    closing_branch=closing,
  )


def _as_module(hlo_text_or_module: str | HloModule) -> HloModule:
  if isinstance(hlo_text_or_module, HloModule):
    return hlo_text_or_module
  if isinstance(hlo_text_or_module, str):
    return parse_hlo(hlo_text_or_module)
  raise TypeError(
    "expected the text of a compiled HLO module"
    " (jax.jit(f).lower(...).compile().as_text()) or an HloModule from"
    f" parse_hlo, got {type(hlo_text_or_module).__name__}; for a compiled"
    " object, pass its .as_text()."
  )


def loop_collectives(hlo_text_or_module: str | HloModule) -> list[Collective]:
  """The collectives that run on every iteration of a loop.

  A ``lax.scan`` or ``lax.fori_loop`` compiles to an HLO ``while``; this
  returns the collectives in the computations reachable from the body or the
  condition of any ``while`` in the module, without entering the branches
  of conditionals: a collective in a branch runs only on the iterations
  that take it (the closing branch of a window run as a scan over
  ``tx.update``, say), which :func:`window_collectives` finds. A loop over
  micro-batches that reduces gradients only after it ends has none.

  Args:
    hlo_text_or_module: ``jax.jit(f).lower(*args).compile().as_text()``, or
      that text parsed by :func:`parse_hlo`.

  Returns:
    One :class:`Collective` per collective instruction inside a loop, in the
    order the module prints them; a collective in nested loops counts once.

  Raises:
    TypeError: the argument is neither text nor an :class:`HloModule`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from ga_optax.testing import loop_collectives
    >>> def predict(w, xs):  # a lax.scan compiles to an HLO while loop
    ...   step = lambda total, x: (total + jnp.tanh(x @ w).sum(), None)
    ...   return jax.lax.scan(step, 0.0, xs)[0]
    >>> w, xs = jnp.ones((16, 32)), jnp.ones((4, 8, 16))
    >>> text = jax.jit(predict).lower(w, xs).compile().as_text()
    >>> loop_collectives(text)  # on a mesh: what each iteration exchanges
    []
  """
  module = _as_module(hlo_text_or_module)
  loop_roots = [
    callee
    for instructions in module.computations.values()
    for instruction in instructions
    if instruction.opcode == "while"
    for callee in instruction.callees
  ]
  in_loops = set().union(
    *(reachable(module, root, into_branches=False) for root in loop_roots)
  )
  return collectives_in_hlo(
    module, [name for name in module.computations if name in in_loops]
  )


def dot_shapes(hlo_text_or_module: str | HloModule) -> list[tuple[str, str]]:
  """The operand shapes of every ``dot`` and ``convolution`` of a module.

  Shapes in compiled text are per device, so the rows of a matrix product's
  left operand say how many examples each device multiplies at a time: for a
  batch of ``B`` rows split into ``k`` micro-batches on ``D`` devices,
  ``B / (k * D)``. A product that sees more rows has gathered the batch.

  The shapes are those the compiled instruction sees. A GPU compiler may
  reshape operands on the way (splitting the contracted axis of a product
  into a batch of smaller ones keeps the rows but changes the other axes),
  and products it hands to a library (cuBLAS, cuDNN) are ``custom-call``
  instructions, which this does not list; CPU compiles keep them as
  ``dot`` and ``convolution``.

  Args:
    hlo_text_or_module: ``jax.jit(f).lower(*args).compile().as_text()``, or
      that text parsed by :func:`parse_hlo`.

  Returns:
    For each ``dot`` and ``convolution`` instruction, in every computation
    (fusions and loop bodies included) in the order the module prints them,
    the shapes of its two operands without layout, for example
    ``("f32[8,16]", "f32[16,32]")``.

  Raises:
    TypeError: the argument is neither text nor an :class:`HloModule`.
    ValueError: an operand is not defined in the computation that uses it
      (the text is not a whole module).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from ga_optax.testing import dot_shapes
    >>> def predict(w, xs):  # one micro-batch of 8 rows per iteration
    ...   step = lambda total, x: (total + jnp.tanh(x @ w).sum(), None)
    ...   return jax.lax.scan(step, 0.0, xs)[0]
    >>> w, xs = jnp.ones((16, 32)), jnp.ones((4, 8, 16))
    >>> dot_shapes(jax.jit(predict).lower(w, xs).compile().as_text())
    [('f32[8,16]', 'f32[16,32]')]
  """
  module = _as_module(hlo_text_or_module)
  found = []
  for computation, instructions in module.computations.items():
    shapes = {
      instruction.name: instruction.shape for instruction in instructions
    }
    for instruction in instructions:
      if instruction.opcode not in _CONTRACTION_OPCODES:
        continue
      lhs, rhs = instruction.operands[:2]
      for operand in (lhs, rhs):
        if operand not in shapes:
          raise ValueError(
            f"operand %{operand} of %{instruction.name} is not defined in"
            f" computation {computation}; pass the text of a whole compiled"
            " module (jax.jit(f).lower(...).compile().as_text())."
          )
      found.append((_LAYOUT.sub("", shapes[lhs]), _LAYOUT.sub("", shapes[rhs])))
  return found
