"""Compiling once for calls made outside ``jit``.

An un-jitted call of a function that builds a ``lax.cond`` or ``lax.scan``
from fresh closures compiles a new program every time: JAX caches compiled
control flow by the identity of the branch and body functions. The wrapper
here jit-compiles the whole function instead, once per input shapes and
dtypes and static arguments, so that a notebook or a debugging loop pays
for compilation once. Inside a caller's ``jit`` (any argument traced) the
function runs as written, so the caller's program is unchanged.

Arguments are split as ``jax.jit`` splits them: arrays, NumPy scalars and
Python numbers are the compiled program's inputs (Python numbers weakly
typed), so a ``value=float(loss)`` that changes on every call does not
recompile. Everything else is static: strings, functions, a module's static
part, and Python bools, which callers pass as flags (``flush=False``,
``train=True``) that code branches on in Python. So are the Python numbers
of the gradients or parameters a wrapped function tells from arrays itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import jax

from ga_optax._src import validation

F = TypeVar("F", bound=Callable[..., Any])


def is_traced(tree: Any) -> bool:
  """Whether any leaf of ``tree`` is a tracer (we are in a transformation)."""
  return any(
    isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree)
  )


def is_python_number(leaf: Any) -> bool:
  """A Python int, float or complex: weakly typed under ``jax.jit``.

  A bool is not one here: it is a flag.
  """
  return isinstance(leaf, (int, float, complex)) and not isinstance(leaf, bool)


class _Static(tuple):
  """The static leaves of the arguments and where they go: a jit key."""


def _split(
  leaves: Sequence[Any], treedef: Any, numbers_static: Sequence[bool]
) -> tuple[list[Any], _Static]:
  """The compiled program's inputs, and the static rest as a jit key."""
  is_input = tuple(
    validation.is_array(leaf) or (is_python_number(leaf) and not static)
    for leaf, static in zip(leaves, numbers_static, strict=True)
  )
  inputs = [leaf for leaf, fed in zip(leaves, is_input, strict=True) if fed]
  others = tuple(
    leaf for leaf, fed in zip(leaves, is_input, strict=True) if not fed
  )
  return inputs, _Static((treedef, is_input, others))


def _in_positions(
  args: Sequence[Any], argnums: Collection[int], num_leaves: int
) -> list[bool]:
  """For each leaf of ``(args, kwargs)``: whether it is in ``args[argnums]``."""
  marks = []
  for index, arg in enumerate(args):
    marks += [index in argnums] * len(jax.tree.leaves(arg))
  return marks + [False] * (num_leaves - len(marks))


def compiled_when_eager(
  fun: F, *, numbers_static_in: Collection[int] = (0,)
) -> F:
  """``fun``, run through one cached ``jax.jit`` when no argument is traced.

  Array leaves of the arguments, NumPy scalars and Python numbers are the
  compiled program's inputs, as under ``jax.jit``; every other leaf (a
  bool, a string, a module's static part) is static, so Python control flow
  on it keeps working. A function that branches in Python on a number
  (which ``jax.jit`` would reject) gets its numbers static instead, and is
  compiled once per value: the first call finds out, later calls with the
  same argument structure go straight there. Arguments with unhashable
  static leaves run ``fun`` as written.

  Args:
    fun: the function to compile.
    numbers_static_in: positions of the arguments whose Python numbers stay
      static, for a function that tells them from arrays itself. By default
      the first: the ``grads`` of ``update``, which refuses a Python number
      (it has no dtype to keep), and the ``params`` of
      ``microbatched_value_and_grad``, which (like Equinox's filters)
      differentiates arrays only.

  Returns:
    ``fun``, compiled when called eagerly.
  """

  @functools.partial(jax.jit, static_argnums=1)
  def compiled(inputs: list[Any], static: _Static) -> Any:
    treedef, is_input, others = static
    fed_inputs, fed_others = iter(inputs), iter(others)
    leaves = [next(fed_inputs) if fed else next(fed_others) for fed in is_input]
    args, kwargs = jax.tree.unflatten(treedef, leaves)
    return fun(*args, **kwargs)

  # Argument structures whose numbers `fun` needs as Python values.
  needs_concrete_numbers: set[Any] = set()

  @functools.wraps(fun)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    if is_traced((args, kwargs)):
      return fun(*args, **kwargs)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    numbers_static = _in_positions(args, numbers_static_in, len(leaves))
    inputs, static = _split(leaves, treedef, numbers_static)
    try:
      hash(static)
    except TypeError:
      return fun(*args, **kwargs)
    if treedef not in needs_concrete_numbers:
      try:
        return compiled(inputs, static)
      except validation.NEEDS_A_CONCRETE_VALUE:
        if not any(
          is_python_number(leaf) and not static
          for leaf, static in zip(leaves, numbers_static, strict=True)
        ):
          raise
        needs_concrete_numbers.add(treedef)
    return compiled(*_split(leaves, treedef, [True] * len(leaves)))

  return wrapper  # type: ignore[return-value]
