"""What XLA:GPU does to a program's conditionals, emulated on any backend.

JAX lowers ``lax.cond`` to a conditional indexed by ``convert(pred)`` to
int32. On a GPU (XLA from 2025-12, jax 0.11 and later) the algebraic
simplifier rewrites that index to the ``pred`` itself, and the conditional
simplifier then replaces any two-branch ``pred`` conditional whose branches
hold only cheap ops (elementwise ops, constants, broadcasts, reductions,
reshapes, slices, tuples) by ``select`` s, which run both branches. It
spares a conditional when one branch only forwards its operands, when a
branch holds an expensive op (a dot, a loop, a ``lax.optimization_barrier``),
or when the conditional has side effects or channel collectives.

The CPU compiler runs the same conditional simplifier but not the index
rewrite. So a program lowered here, with its ``convert(pred)`` conditionals
rewritten to ``pred`` form (the branches swapped: index 1 is the true
branch) and compiled on this backend, keeps exactly the conditionals a GPU
would keep. The rewrite is done on the lowered StableHLO, where
``stablehlo.case`` becomes ``stablehlo.if``; sharding constraints between
the ``convert`` and the conditional are looked through, so the emulation
errs on the strict side for sharded programs.

It needs JAX internals (the lowering object behind ``jax.stages.Lowered``,
and JAX's MLIR context); a JAX release that moves them raises
:class:`EmulationUnavailable` instead of a wrong count.
"""

from __future__ import annotations

import copy
import re
from typing import Any, NamedTuple

import jax
import jax.extend

from ga_optax._src.audits import hlo


class EmulationUnavailable(RuntimeError):
  """This JAX release lacks an internal API the GPU emulation needs."""


class ConditionalAudit(NamedTuple):
  """Conditionals of one lowered program, as compiled here and as on a GPU.

  Attributes:
    compiled: conditionals in the program as this backend compiles it.
    as_on_gpu: conditionals left once XLA:GPU's index rewrite is applied
      before compiling. Fewer than ``compiled`` means a GPU runs both
      branches of the others, as ``select`` s.
    rewritten: conditionals whose index was a ``convert`` of a predicate
      (every ``lax.cond``), the ones the GPU rewrites.
  """

  compiled: int
  as_on_gpu: int
  rewritten: int


_NAME = r"%[\w#.\-]+"
# ``%idx = stablehlo.convert %pred : (tensor<i1>) -> tensor<i32>``
_CONVERT = re.compile(
  rf"({_NAME}) = stablehlo\.convert ({_NAME}) : \(tensor<i1>\) -> tensor<i32>"
)
# A sharding constraint passes its operand through, as far as the index goes.
_CONSTRAINT = re.compile(rf"({_NAME}) = sdy\.sharding_constraint ({_NAME}) ")
_CASE = re.compile(rf'"stablehlo\.case"\(({_NAME})\) \(')
_CASE_TYPE = ") : (tensor<i32>)"


def _closing_brace(text: str, start: int) -> int:
  """The index just past the brace that closes the one at ``start``."""
  depth, index, quoted = 0, start, False
  while index < len(text):
    char = text[index]
    if quoted:
      if char == "\\":
        index += 1
      elif char == '"':
        quoted = False
    elif char == '"':
      quoted = True
    elif char == "{":
      depth += 1
    elif char == "}":
      depth -= 1
      if depth == 0:
        return index + 1
    index += 1
  raise ValueError(f"unbalanced braces in StableHLO from offset {start}")


def _predicates(text: str) -> dict[str, str]:
  """Maps each int32 value that is ``convert(pred)`` to its predicate."""
  predicates = {index: pred for index, pred in _CONVERT.findall(text)}
  for constrained, operand in _CONSTRAINT.findall(text):
    if operand in predicates:
      predicates[constrained] = predicates[operand]
  return predicates


def rewrite_to_predicates(stablehlo_text: str) -> tuple[str, int]:
  """``stablehlo_text`` with every two-branch ``case(convert(pred))`` an ``if``.

  Returns:
    The rewritten text and how many conditionals were rewritten, nested
    ones included.
  """
  predicates = _predicates(stablehlo_text)

  def rewrite(text: str) -> tuple[str, int]:
    pieces, done, count = [], 0, 0
    for match in _CASE.finditer(text):
      if match.start() < done or match[1] not in predicates:
        continue
      first_start = match.end()
      first_end = _closing_brace(text, first_start)
      if not text.startswith(", {", first_end):
        continue  # more than two branches: a switch, left alone
      second_start = first_end + 2
      second_end = _closing_brace(text, second_start)
      if not text.startswith(_CASE_TYPE, second_end):
        continue
      false_branch, inner_false = rewrite(text[first_start:first_end])
      true_branch, inner_true = rewrite(text[second_start:second_end])
      pieces += [
        text[done : match.start()],
        f'"stablehlo.if"({predicates[match[1]]}) (',
        f"{true_branch}, {false_branch}) : (tensor<i1>)",
      ]
      done = second_end + len(_CASE_TYPE)
      count += 1 + inner_false + inner_true
    return "".join(pieces) + text[done:], count

  return rewrite(stablehlo_text)


def _compile_text(lowered: jax.stages.Lowered, stablehlo_text: str) -> str:
  """``lowered``'s program with its StableHLO replaced, compiled: HLO text."""
  try:
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    # The lowering behind ``lowered``, compiled again with its StableHLO
    # replaced: it keeps the device assignment and compile options.
    lowering: Any = copy.copy(lowered._lowering)
    lowering._hlo  # noqa: B018 - fails early where the attribute moved
    with mlir.make_ir_context():
      lowering._hlo = ir.Module.parse(stablehlo_text)
      lowering._executable = None
      executable = lowering.compile()
    modules = executable.xla_extension_executable().hlo_modules()
  except (ImportError, AttributeError) as error:
    raise EmulationUnavailable(
      f"jax {jax.__version__} moved an internal API that the XLA:GPU"
      f" conditional emulation needs ({error}); the audit cannot run."
    ) from error
  return "\n".join(module.to_string() for module in modules)


def count_conditionals(hlo_text: str) -> int:
  """The ``conditional`` instructions of an HLO module's text."""
  module = hlo.parse_hlo(hlo_text)
  return sum(
    instruction.opcode == "conditional"
    for instructions in module.computations.values()
    for instruction in instructions
  )


def gpu_conditional_audit(lowered: jax.stages.Lowered) -> ConditionalAudit:
  """Counts ``lowered``'s conditionals compiled here and as XLA:GPU would.

  An emulation of XLA:GPU that runs on any backend, the CPU included: the
  program's ``lax.cond`` s are given the predicate index XLA:GPU gives them
  and the program is compiled by this backend, whose conditional simplifier
  is the GPU's. A conditional that survives here survives on a GPU; one
  that does not becomes ``select`` s there, and both of its branches run.
  Keep a conditional by giving it one branch that only forwards its
  operands (make what that branch would return outside the ``lax.cond``),
  or an expensive op such as ``lax.optimization_barrier`` in a branch.

  Args:
    lowered: a lowered program, ``jax.jit(step).lower(*args)``.

  Returns:
    A :class:`ConditionalAudit`: conditionals compiled here, compiled as on
    a GPU, and rewritten by the emulation.

  Raises:
    TypeError: ``lowered`` is not a ``jax.stages.Lowered``.
    EmulationUnavailable: this JAX release lacks an internal API it needs.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from ga_optax.testing import gpu_conditional_audit
    >>> adam = optax.adam(1e-3)
    >>> params = {"w": jnp.ones(8)}
    >>> def step(closes, grads, state):  # a window's conditional, by hand
    ...   return jax.lax.cond(
    ...       closes,
    ...       lambda grads, state: adam.update(grads, state),
    ...       lambda grads, state: (jax.tree.map(jnp.zeros_like, grads), state),
    ...       grads, state)
    >>> lowered = jax.jit(step).lower(True, params, adam.init(params))
    >>> gpu_conditional_audit(lowered)  # selects on a GPU
    ConditionalAudit(compiled=1, as_on_gpu=0, rewritten=1)
  """
  if not isinstance(lowered, jax.stages.Lowered):
    raise TypeError(
      "lowered must be a jax.stages.Lowered, for example"
      f" jax.jit(step).lower(*args); got {type(lowered).__name__}."
    )
  text = lowered.as_text()
  rewritten_text, rewritten = rewrite_to_predicates(text)
  return ConditionalAudit(
    compiled=count_conditionals(lowered.compile().as_text() or ""),
    as_on_gpu=count_conditionals(_compile_text(lowered, rewritten_text)),
    rewritten=rewritten,
  )


def forwarding_branches(jaxpr: Any) -> list[bool]:
  """For each ``cond`` in a jaxpr, nested ones too: has it a forwarding branch?

  A branch forwards when each of its outputs is one of its inputs, with no
  equation computing anything: XLA:GPU keeps such a conditional a
  conditional. ``jaxpr`` is a ``jax.make_jaxpr`` result.
  """
  found: list[bool] = []

  def visit(inner: Any) -> None:
    for equation in inner.eqns:
      if equation.primitive.name == "cond":
        found.append(
          any(
            all(out in branch.jaxpr.invars for out in branch.jaxpr.outvars)
            for branch in equation.params["branches"]
          )
        )
      for sub in jax.extend.core.jaxprs_in_params(equation.params):
        visit(sub)

  visit(getattr(jaxpr, "jaxpr", jaxpr))
  return found
