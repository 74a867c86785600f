"""Compiling once for calls made outside ``jit``.

An un-jitted call of a function that builds a ``lax.cond`` or ``lax.scan``
from fresh closures compiles a new program every time: JAX caches compiled
control flow by the identity of the branch and body functions. The wrapper
here jit-compiles the whole function instead, once per input shapes, dtypes
and static (non-array) arguments, so that a notebook or a debugging loop
pays for compilation once. Inside a caller's ``jit`` (any argument traced)
the function runs as written, so the caller's program is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

F = TypeVar("F", bound=Callable[..., Any])


def is_traced(tree: Any) -> bool:
  """Whether any leaf of ``tree`` is a tracer (we are inside a transformation)."""
  return any(
    isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree)
  )


class _Static(tuple):
  """The non-array leaves of the arguments and where they go: a jit key."""


def compiled_when_eager(fun: F) -> F:
  """``fun``, run through one cached ``jax.jit`` when no argument is traced.

  Array leaves of the arguments are the compiled program's inputs; every
  other leaf (a Python number, a string, a module's static part) is static,
  so Python control flow on it keeps working. Arguments with unhashable
  non-array leaves run ``fun`` as written.
  """

  @functools.partial(jax.jit, static_argnums=1)
  def compiled(arrays: list[Any], static: _Static) -> Any:
    treedef, is_array, others = static
    fed_arrays, fed_others = iter(arrays), iter(others)
    leaves = [
      next(fed_arrays) if array else next(fed_others) for array in is_array
    ]
    args, kwargs = jax.tree.unflatten(treedef, leaves)
    return fun(*args, **kwargs)

  @functools.wraps(fun)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    if is_traced((args, kwargs)):
      return fun(*args, **kwargs)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_array = tuple(
      isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves
    )
    others = tuple(
      leaf for leaf, array in zip(leaves, is_array, strict=True) if not array
    )
    static = _Static((treedef, is_array, others))
    try:
      hash(static)
    except TypeError:
      return fun(*args, **kwargs)
    arrays = [
      leaf for leaf, array in zip(leaves, is_array, strict=True) if array
    ]
    return compiled(arrays, static)

  return wrapper  # type: ignore[return-value]
