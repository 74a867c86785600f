"""The questions a data-parallel step raises, answered from its HLO text.

Which collectives run on every call and which only when a window closes
(:func:`window_collectives`), which run once per micro-batch inside a loop
(:func:`loop_collectives`), and on how many rows each device multiplies
(:func:`dot_shapes`). Built on the parsing of :mod:`ga_optax._src.audits.hlo`.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from ga_optax._src import scopes
from ga_optax._src.audits.hlo import (
  Collective,
  HloModule,
  collectives_in_hlo,
  parse_hlo,
  reachable,
  window_side,
)

_LAYOUT = re.compile(r"\{[^{}]*\}")
# Instructions that multiply a batch of rows by weights.
_CONTRACTION_OPCODES = frozenset({"dot", "convolution"})


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

  ``accumulate`` closes a window in a loop of at most one trip named by its
  scope (``ga_optax_close_window``); a window written by hand with
  ``lax.cond`` closes it in the true branch, the last branch of an HLO
  ``conditional`` (XLA:GPU prints it as ``true_computation``). This finds
  the window's closing loop, or else the conditional branches (outside any
  other branch) that hold collectives, checks that there is exactly one and
  that it is the last branch of its conditional, and reports the
  collectives inside and outside it.

  Args:
    hlo_text: ``jax.jit(step).lower(*args).compile().as_text()``.

  Returns:
    A :class:`WindowCollectives`.

  Raises:
    ValueError: collectives sit in several conditional branches, or in a
      branch that is not the last one of its conditional.

  Example:
    >>> import jax, jax.numpy as jnp, optax, ga_optax
    >>> from ga_optax._src.audits import window_collectives
    >>> tx = ga_optax.accumulate(optax.sgd(0.1), 4)
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> params = jnp.zeros(3)
    >>> compiled = jax.jit(step).lower(
    ...     params, tx.init(params), params).compile()
    >>> found = window_collectives(compiled.as_text())
    >>> found.every_micro_step, found.window_closing  # nothing on one device
    ([], [])
  """
  module = parse_hlo(hlo_text)
  closing_bodies = [
    instruction.callees[-1]
    for instructions in module.computations.values()
    for instruction in instructions
    if window_side(instruction) == scopes.CLOSE_WINDOW
  ]
  if closing_bodies:
    # The outermost one: a window whose weight is known only after its
    # reduction closes in a second loop inside the first.
    closing = next(
      body
      for body in closing_bodies
      if not any(
        body in reachable(module, other) - {other}
        for other in closing_bodies
        if other != body
      )
    )
    window_closing = collectives_in_hlo(
      module,
      set().union(*(reachable(module, body) for body in closing_bodies)),
    )
    return WindowCollectives(
      every_micro_step=collectives_in_hlo(
        module,
        reachable(module, module.entry, excluded=set(closing_bodies)),
      ),
      window_closing=window_closing,
      closing_branch=closing if window_closing else None,
    )
  return _conditional_window_collectives(module)


def _conditional_window_collectives(module: HloModule) -> WindowCollectives:
  """:func:`window_collectives` for a window closed by a ``lax.cond``."""
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
  condition of any ``while`` in the module (but the window's own loops of
  at most one trip, which are branches), without entering the branches
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
    >>> from ga_optax._src.audits import loop_collectives
    >>> def predict(w, xs):  # a lax.scan compiles to an HLO while loop
    ...   step = lambda total, x: (total + jnp.tanh(x @ w).sum(), None)
    ...   return jax.lax.scan(step, 0.0, xs)[0]
    >>> w, xs = jnp.ones((16, 32)), jnp.ones((4, 8, 16))
    >>> text = jax.jit(predict).lower(w, xs).compile().as_text()
    >>> loop_collectives(text)  # on a mesh: what each iteration exchanges
    []
  """
  module = _as_module(hlo_text_or_module)
  # A window's side is a loop of at most one trip: a branch, not a loop.
  loop_roots = [
    callee
    for instructions in module.computations.values()
    for instruction in instructions
    if instruction.opcode == "while" and window_side(instruction) is None
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
    >>> from ga_optax._src.audits import dot_shapes
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
