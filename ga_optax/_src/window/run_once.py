"""A branch that XLA:GPU compiles without copies: a loop of at most one trip.

On the device's schedule a micro-step decides whether it closes the window.
``lax.cond`` is the obvious way to say so, and XLA:GPU compiles it badly:
its copy insertion (without region analysis, the GPU default) copies every
buffer a branch hands back untouched into the conditional's result, so each
micro-step copied the whole optimizer state, and the caller's donation
could not reuse the buffers either (docs/compiled-window.md has the
figures). A ``lax.while_loop`` of zero or one trip updates its carried
buffers in place: the same choice compiles to a micro-step with no copy at
all, and nothing in XLA turns a loop into selects that would run both
branches.

Each loop carries only what its body writes, and reads everything else as a
loop invariant, so buffers the rest of the step owns are never copied. Inside a
loop body JAX (0.10) leaves the carried and invariant values without the
shardings their types give them on an Explicit mesh, and the partitioner
then guesses: it reduced a partial sum typed ``unreduced`` a second time,
and gathered a sharded optimizer state before the loop. The body pins each
value to its type first.

On the CPU the branch is a ``lax.cond`` instead: XLA:CPU's copy insertion
sees that a branch which hands its operands back needs no copy, and it
splits the elementwise work of a conditional's branch over the cores, but
not that of a loop body. :mod:`ga_optax._src.window.window_form` makes that
choice, in one place for the whole window.

A loop has no reverse-mode derivative, the conditional has one, and both
compute the same function: the branch's derivative rule
(``jax.custom_jvp``) is the conditional's, so ``jax.grad`` through a window
works under ``jax.jit`` in either form, while a step that is not
differentiated keeps its loops.

Either way the branch is named (``jax.named_scope``): the compiled
program's audits (:mod:`ga_optax._src.audits.compiled_paths`) find it by its
name and know which side a micro-step takes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core
from jax.sharding import AxisType

from ga_optax._src.placements import residency
from ga_optax._src.window import window_form

Carry = TypeVar("Carry")


def run_once_if(
  predicate: jax.Array,
  body: Callable[[Carry], Carry],
  carry: Carry,
  *,
  name: str,
) -> Carry:
  """``body(carry)`` where ``predicate`` holds, else ``carry`` untouched.

  Args:
    predicate: a boolean scalar.
    body: maps ``carry`` to a tree of the same structure, shapes and dtypes.
    carry: what ``body`` reads and writes in place.
    name: the loop's scope, one of :data:`ga_optax._src.scopes.SIDES`.

  Returns:
    ``body(carry)`` or ``carry``.
  """
  converted, invariants = _closure_converted(body, carry)
  with jax.named_scope(name):
    return _run_once(converted, jnp.asarray(predicate), carry, invariants)


def emptied_if(
  predicate: jax.Array,
  emptied: Callable[[Carry], Carry],
  carry: Carry,
  *,
  name: str,
) -> Carry:
  """``emptied(carry)`` where ``predicate`` holds: zeros over a buffer read on.

  For the accumulator after its buffer has carried the updates out: the
  caller reads them after this call, and the zeros must come after that
  read. In the loops form this is :func:`run_once_if`, a loop that a
  micro-step skips. In the conditional form it is a select,
  ``where(predicate, emptied(carry), carry)``, the same numbers: XLA:CPU
  orders a conditional's forwarding branch after no read it cannot see
  (the caller's ``apply_updates``), so it copied the whole accumulator in
  the branch every micro-step and kept its sum in temporary buffers; an
  elementwise select has no branch to copy, and XLA writes it in place
  after the read.

  Args:
    predicate: a boolean scalar.
    emptied: maps ``carry`` to zeros of its structure, shapes and dtypes,
      made without reading it.
    carry: the buffers to zero.
    name: the scope of the loop, one of :data:`ga_optax._src.scopes.SIDES`.

  Returns:
    ``emptied(carry)`` or ``carry``.
  """

  def as_loops(taken: jax.Array, carried: Carry) -> Carry:
    return run_once_if(taken, emptied, carried, name=name)

  return window_form.choose(
    jnp.asarray(predicate),
    carry,
    loops=as_loops,
    conditional=functools.partial(_zeros_where, emptied),
  )


def emptied_in_branch(emptied: Callable[[Carry], Carry], carry: Carry) -> Carry:
  """What a branch that closes the window hands back of a buffer it empties.

  In the loops form, ``emptied(carry)``: XLA:GPU writes the zeros in the
  pass that last reads the buffer. In the conditional form, ``carry`` as it
  came, for :func:`emptied_after_branch` to zero once the conditional has
  run. Zeros made inside a branch read nothing, so XLA:CPU wrote them into
  a buffer of their own and copied into it what the other branch hands
  back: ``accumulate_and_apply``'s step held every layer's sum apart (twice
  a plain Adam step's temporaries) and copied the accumulator on every
  close.

  Args:
    emptied: maps ``carry`` to zeros of its structure, shapes and dtypes,
      made without reading it.
    carry: the buffers the branch empties.

  Returns:
    ``emptied(carry)``, or ``carry`` in the conditional form.
  """

  def as_conditional(carried: Carry) -> Carry:
    return carried

  return window_form.choose(carry, loops=emptied, conditional=as_conditional)


def emptied_after_branch(
  predicate: jax.Array, emptied: Callable[[Carry], Carry], carry: Carry
) -> Carry:
  """The other half of :func:`emptied_in_branch`, after the conditional.

  In the loops form the branch emptied ``carry``, handed back as it is. In
  the conditional form, ``where(predicate, emptied(carry), carry)``, which
  XLA:CPU writes in place after the conditional.

  Args:
    predicate: whether the branch ran (the window closed).
    emptied: as for :func:`emptied_in_branch`.
    carry: what the branch handed back.

  Returns:
    ``carry``, or in the conditional form zeros where ``predicate`` holds.
  """

  def as_loops(taken: jax.Array, carried: Carry) -> Carry:
    del taken
    return carried

  return window_form.choose(
    jnp.asarray(predicate),
    carry,
    loops=as_loops,
    conditional=functools.partial(_zeros_where, emptied),
  )


def read_before_step(sums: Carry, reads: Any) -> tuple[Carry, Any]:
  """``(sums, reads)``, the reads ordered before anything that uses ``sums``.

  For the closing side, where the parts read the window's sums before the
  wrapped optimizer steps on them (:meth:`WindowPart.read`), and the
  optimizer's output may then be written over the sums' buffer. XLA:CPU
  could not order a read it saw beside the optimizer's step before the
  step's write: it copied every layer's sum in the closing branch, which
  held a temporary buffer of four layers that every call then mapped
  afresh. In the conditional form the sums reach the optimizer through a
  select on a predicate made from the reads, one that always holds but
  that XLA cannot prove, so the optimizer's reads wait for the parts'. An
  optimization barrier did the same under jax 0.12 but not under jax
  0.10.2, whose XLA expands barriers before it inserts copies. The loops
  take neither: their programs for GPUs and TPUs copied nothing there.

  Args:
    sums: the window's sums, as the optimizer will read them.
    reads: what the parts read of them; nothing to order where it has no
      leaves.

  Returns:
    ``(sums, reads)``, unchanged in value.
  """
  if not jax.tree.leaves(reads):
    return sums, reads

  def as_loops(summed: Carry, read: Any) -> tuple[Carry, Any]:
    return summed, read

  def as_conditional(summed: Carry, read: Any) -> tuple[Carry, Any]:
    # True for every value, NaN included.
    read_done = functools.reduce(
      jnp.logical_and,
      [(leaf == leaf) | (leaf != leaf) for leaf in jax.tree.leaves(read)],
    )
    after_read = jax.tree.map(
      lambda total: jnp.where(read_done, total, jnp.zeros((), total.dtype)),
      summed,
    )
    return after_read, read

  return window_form.choose(
    sums, reads, loops=as_loops, conditional=as_conditional
  )


def _zeros_where(
  emptied: Callable[[Carry], Carry], taken: jax.Array, carried: Carry
) -> Carry:
  """``where(taken, emptied(carried), carried)``, leaf by leaf."""
  return jax.tree.map(
    lambda zero, leaf: jnp.where(taken, zero, leaf), emptied(carried), carried
  )


def _closure_converted(
  body: Callable[[Carry], Carry], carry: Carry
) -> tuple[Callable[..., Carry], list[Any]]:
  """``body`` as a function of ``(carry, *invariants)``.

  Every value the body closes over becomes an explicit invariant, so that a
  loop's body can pin their types and derivatives can flow through them.
  ``jax.closure_convert`` hoists only the floating ones: an integer or
  boolean closed over by a branch nested in another (a window's count, its
  acceptance) would stay a constant of a finished trace, which the
  derivative rule could not stage.
  """
  closed, out_shape = jax.make_jaxpr(body, return_shape=True)(carry)
  out_tree = jax.tree.structure(out_shape)

  def converted(carried: Carry, *invariants: Any) -> Carry:
    function = jax_core.jaxpr_as_fun(
      jax_core.ClosedJaxpr(closed.jaxpr, invariants)
    )
    return jax.tree.unflatten(out_tree, function(*jax.tree.leaves(carried)))

  return converted, list(closed.consts)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _run_once(
  body: Callable[..., Carry],
  predicate: jax.Array,
  carry: Carry,
  invariants: Sequence[Any],
) -> Carry:
  """The branch in the form :mod:`ga_optax._src.window.window_form` chooses."""
  return window_form.choose(
    predicate,
    carry,
    invariants,
    loops=functools.partial(_as_loop, body),
    conditional=functools.partial(_as_conditional, body),
  )


@_run_once.defjvp
def _run_once_jvp(
  body: Callable[..., Carry], primals: Any, tangents: Any
) -> tuple[Carry, Carry]:
  # A while loop has no transpose, so reverse mode cannot go through the
  # loops; the conditional computes the same function and has one. A step
  # that is not differentiated still runs the loops.
  primals_out, tangents_out = jax.jvp(
    functools.partial(_as_conditional_on_device, body), primals, tangents
  )
  return primals_out, jax.tree.map(_in_memory_of, tangents_out, primals_out)


def _as_conditional_on_device(
  body: Callable[..., Carry],
  predicate: jax.Array,
  carry: Carry,
  invariants: Sequence[Any],
) -> Carry:
  """The conditional, its operands and results in device memory.

  Transposing a conditional makes zeros for the cotangents a branch does
  not write, and JAX makes them in device memory whatever the operand's
  memory kind: a state kept in host memory got a cotangent of the wrong
  type. So the conditional's operands and results are moved to device
  memory around it, and each to the memory kind ``body`` was traced with
  inside its branch. Only the derivative rule takes this form; the primal
  keeps its state where it lives.
  """
  carry_kinds = _kinds(carry)
  invariant_kinds = _kinds(list(invariants))

  def body_on_device(carried: Carry, *read: Any) -> Carry:
    results = body(
      _in_kinds(carried, carry_kinds), *_in_kinds(list(read), invariant_kinds)
    )
    return residency.to_device(results)

  on_device = _as_conditional(
    body_on_device,
    predicate,
    residency.to_device(carry),
    residency.to_device(list(invariants)),
  )
  return _in_kinds(on_device, carry_kinds)


def _kinds(tree: Any) -> Any:
  return jax.tree.map(residency.kind_of, tree)


def _in_kinds(tree: Any, kinds: Any) -> Any:
  return jax.tree.map(residency.put, tree, kinds)


def _in_memory_of(tangent: jax.Array, primal: jax.Array) -> jax.Array:
  """``tangent`` in the memory space of ``primal``'s type.

  The tangent of an integer (a counter kept in host memory with the
  optimizer's state) is float0 zeros, which ``jax.jvp`` makes in device
  memory; ``jax.custom_jvp`` wants them typed like the integer.
  """
  space = jax.typeof(primal).memory_space
  if jax.typeof(tangent).memory_space == space:
    return tangent
  return jax.device_put(np.zeros(jnp.shape(primal), jax.dtypes.float0), space)


def _as_loop(
  body: Callable[..., Carry],
  predicate: jax.Array,
  carry: Carry,
  invariants: Sequence[Any],
) -> Carry:
  def once(state: tuple[jax.Array, Carry, Any]) -> tuple[jax.Array, Carry, Any]:
    _, carried, read = state
    carried, read = pin_types(carried), pin_types(read)
    return jnp.zeros((), jnp.bool_), body(carried, *read), read

  return jax.lax.while_loop(
    lambda state: state[0], once, (predicate, carry, tuple(invariants))
  )[1]


def _as_conditional(
  body: Callable[..., Carry],
  predicate: jax.Array,
  carry: Carry,
  invariants: Sequence[Any],
) -> Carry:
  order = _backward_order(carry)
  structure = jax.tree.structure(carry)

  def listed(tree: Carry) -> list[Any]:
    leaves = jax.tree.leaves(tree)
    return [leaves[index] for index in order]

  def restored(listed_leaves: list[Any]) -> Carry:
    leaves: list[Any] = [None] * len(order)
    for index, leaf in zip(order, listed_leaves, strict=True):
      leaves[index] = leaf
    return jax.tree.unflatten(structure, leaves)

  return restored(
    jax.lax.cond(
      predicate,
      lambda carried, read: listed(body(restored(carried), *read)),
      lambda carried, read: carried,
      listed(carry),
      tuple(invariants),
    )
  )


def _backward_order(tree: Any) -> list[int]:
  """The positions of ``tree``'s leaves, the last layer's first, scalars last.

  The order in which the window's conditional lists its operands, for
  XLA:CPU's buffer assignment: it takes buffers of one size in the order a
  post-order walk of the program meets them, and the walk meets the
  window's sums in the order the conditional lists them. Backpropagation
  makes the last layer's gradient first. Listed first leaf first, the
  gradients made after it took its accumulator's buffer, free once read,
  and its sum sat in temporaries of its own: as many as a plain Adam
  step's (tests/test_cpu_program.py). A model's layers are listed, or
  named and numbered, in the order they run: their leaves by their paths,
  the numbers in them read as numbers (``Dense_2`` before ``Dense_10``),
  backwards. The scalars come after every array: one made from every
  layer's gradient (the noise scale's sum of squares), listed first, led
  the walk to every gradient before the first sum, and that sum again sat
  in a temporary.
  """
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return sorted(
    range(len(flat)),
    key=lambda index: (
      jnp.ndim(flat[index][1]) > 0,
      _numbers_as_numbers(jax.tree_util.keystr(flat[index][0])),
    ),
    reverse=True,
  )


def _numbers_as_numbers(name: str) -> list[str | int]:
  """``name`` as a key under which ``"w2"`` comes before ``"w10"``: its text
  and its runs of digits in turn (``re.split`` keeps the runs at the odd
  positions), the runs as numbers."""
  parts = re.split(r"(\d+)", name)
  return [int(part) if index % 2 else part for index, part in enumerate(parts)]


def pin_types(tree: Any) -> Any:
  """``tree`` with each value whose type carries a sharding pinned to it.

  A no-op for JAX's types (the value is resharded to the sharding it has),
  but the lowered program then states that sharding where the value is
  used, which the partitioner needs inside a loop body: left to itself it
  took partial sums typed ``unreduced`` for whole values, and gathered a
  sharded optimizer state whole before the loop.
  """

  def pin(leaf: Any) -> Any:
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
      return leaf
    return jax.reshard(leaf, sharding.spec)  # type: ignore[union-attr]

  return jax.tree.map(pin, tree)
