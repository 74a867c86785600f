"""Argument checks that turn bad input into errors that name the argument.

Everything here runs at construction or at trace time, so a mistake surfaces
as a ``TypeError``/``ValueError`` on the first call rather than as a deep JAX
trace error or, worse, a silently wrong accumulation.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

REDUCTIONS = ("mean", "sum")

# What tracing raises when Python needs the value of a traced number: an
# `if` on it, int(x) or range(x), np.asarray(x).
NEEDS_A_CONCRETE_VALUE = (
  jax.errors.ConcretizationTypeError,
  jax.errors.TracerIntegerConversionError,
  jax.errors.TracerArrayConversionError,
)


def is_int(value: Any) -> bool:
  """A Python or NumPy integer; bool is an int subclass but always a mistake."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive_int(value: Any, name: str) -> int:
  """Returns ``value`` as an int, or raises naming ``name``."""
  if not is_int(value):
    raise TypeError(
      f"{name} must be a positive int, got {value!r} of type"
      f" {type(value).__name__}."
    )
  if int(value) < 1:
    raise ValueError(f"{name} must be a positive int (>= 1), got {value!r}.")
  return int(value)


# Window lengths and update steps are compared with the state's int32
# counters.
MAX_COUNT = int(np.iinfo(np.int32).max)
COUNTERS = (
  f"at most 2**31 - 1 = {MAX_COUNT}, the largest value of the state's int32"
  " counters (micro_step, update_step, every_k)"
)


def check_count(value: Any, name: str) -> int:
  """``value`` as an int: a positive int that the state's int32 counters hold.

  Raises:
    TypeError: not an int.
    ValueError: below 1 or above 2**31 - 1.
  """
  count = check_positive_int(value, name)
  if count > MAX_COUNT:
    raise ValueError(f"{name} must be {COUNTERS}, got {count}.")
  return count


def check_optimizer(optimizer: Any) -> optax.GradientTransformationExtraArgs:
  """Returns ``optimizer`` as one that accepts (and may ignore) extra args."""
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(
      "optimizer must be an optax.GradientTransformation (for example"
      f" optax.adamw(1e-3)), got {type(optimizer).__name__}."
    )
  return optax.with_extra_args_support(optimizer)


def check_reduction(reduction: Any) -> str:
  if reduction not in REDUCTIONS:
    raise ValueError(
      f"reduction must be one of {REDUCTIONS}, got {reduction!r}."
    )
  return reduction


def check_accumulator_dtype(accumulator_dtype: Any) -> jnp.dtype:
  try:
    # jnp.dtype(None) is the default float dtype; None here is a mistake.
    if accumulator_dtype is None:
      raise TypeError
    dtype = jnp.dtype(accumulator_dtype)
  except TypeError as error:
    raise TypeError(
      "accumulator_dtype must be a floating dtype such as jnp.float32, got"
      f" {accumulator_dtype!r}."
    ) from error
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
      "accumulator_dtype must be a floating dtype such as jnp.float32, got"
      f" {dtype}: an integer or boolean accumulator cannot hold gradients."
    )
  return dtype


def check_grads_match(
  grads: Any, accumulator: Any, unreduced_axes: tuple[str, ...] = ()
) -> None:
  """Checks ``grads`` against the accumulator: tree, shapes, dtypes, sharding.

  Floating gradients go into any accumulator; complex ones need a complex
  accumulator (made by ``init`` for complex params). With
  ``unreduced_axes``, every gradient leaf must be ``unreduced`` over exactly
  those mesh axes; without, none may be.
  """
  grads_tree: Any = jax.tree.structure(grads)
  accumulator_tree = jax.tree.structure(accumulator)
  if grads_tree != accumulator_tree:
    raise ValueError(
      "grads must have the tree structure of the params given to"
      f" tx.init; expected {accumulator_tree}, got {grads_tree}."
    )
  grads_with_paths = jax.tree_util.tree_flatten_with_path(grads)[0]
  for (path, grad), slot in zip(
    grads_with_paths, jax.tree.leaves(accumulator), strict=True
  ):
    name = f"grads leaf {jax.tree_util.keystr(path)}"
    _check_grad_dtype(name, grad, slot)
    if jnp.shape(grad) != jnp.shape(slot):
      raise ValueError(
        f"{name} has shape {jnp.shape(grad)}, but the accumulator (from"
        f" tx.init) has shape {jnp.shape(slot)}."
      )
    _check_unreduced(name, grad, unreduced_axes)


def _check_grad_dtype(name: str, grad: Any, slot: Any) -> None:
  # Integer or boolean gradients would be cast silently (the mean truncated
  # to an integer); a Python scalar has no dtype to keep.
  dtype = getattr(grad, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
    raise TypeError(
      f"{name} must be a floating-point array, got {type(grad).__name__}"
      + (f" of dtype {dtype}." if dtype is not None else ".")
    )
  if jnp.issubdtype(dtype, jnp.complexfloating) and not jnp.issubdtype(
    slot.dtype, jnp.complexfloating
  ):
    raise TypeError(
      f"{name} is complex ({dtype}), but its param was real when tx.init"
      " made the accumulator; the imaginary part would be dropped. Pass the"
      " complex params to tx.init."
    )


def _check_unreduced(
  name: str, grad: Any, unreduced_axes: tuple[str, ...]
) -> None:
  spec = getattr(getattr(jax.typeof(grad), "sharding", None), "spec", None)
  found = frozenset(getattr(spec, "unreduced", ()))
  if found == frozenset(unreduced_axes):
    return
  if not unreduced_axes:
    raise ValueError(
      f"{name} is unreduced over {sorted(found)}, but this accumulation"
      " was made without unreduced_axes; pass"
      f" unreduced_axes={tuple(sorted(found))!r} to accumulate (the window's"
      " one all-reduce then sums them), or reduce the gradients first."
    )
  if not found:
    raise ValueError(
      f"{name} is not unreduced, but this accumulation was made with"
      f" unreduced_axes={unreduced_axes!r}: compute the gradients with"
      " ga_optax.unreduced_value_and_grad (or cast the params to reduced"
      " over those axes), or drop unreduced_axes for reduced gradients."
    )
  raise ValueError(
    f"{name} is unreduced over {sorted(found)}, but this accumulation was"
    f" made with unreduced_axes={unreduced_axes!r}; the two must name the"
    " same mesh axes."
  )


def check_flush(flush: Any) -> Any:
  if isinstance(flush, bool):
    return flush
  if (
    hasattr(flush, "dtype")
    and jnp.shape(flush) == ()
    and jnp.dtype(flush.dtype) == jnp.bool_
  ):
    return flush
  raise TypeError(
    f"flush must be a Python bool or a boolean scalar array, got {flush!r}."
  )


def misspelt(name: str, keywords: Sequence[str]) -> str | None:
  """The one of ``keywords`` that ``name`` misspells, or None.

  Python's own rule for its "Did you mean" suggestions: the keyword nearest
  ``name`` whose edit cost is within a third of the letters involved (a
  letter added, dropped or changed costs 2, a change of case 1).
  """
  nearest, nearest_cost = None, None
  for keyword in keywords:
    if keyword == name:
      continue
    cost = _edit_cost(name, keyword)
    if cost <= (len(name) + len(keyword) + 3) * 2 // 6 and (
      nearest_cost is None or cost < nearest_cost
    ):
      nearest, nearest_cost = keyword, cost
  return nearest


def _edit_cost(word: str, other: str) -> int:
  """Levenshtein's distance, each edit 2 and a change of case 1."""
  above = [2 * j for j in range(len(other) + 1)]
  for i, letter in enumerate(word, 1):
    row = [2 * i]
    for j, other_letter in enumerate(other, 1):
      change = (
        0
        if letter == other_letter
        else 1
        if letter.lower() == other_letter.lower()
        else 2
      )
      row.append(min(above[j] + 2, row[j - 1] + 2, above[j - 1] + change))
    above = row
  return above[-1]


def is_array(leaf: Any) -> bool:
  """A JAX or NumPy array (or NumPy scalar): what Equinox calls an array."""
  return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def is_inexact_array(leaf: Any) -> bool:
  """A floating or complex array: a leaf that gradients are taken of."""
  return is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact)


def check_array_leaves(tree: Any, name: str) -> None:
  """Raises unless every leaf of ``tree`` is an array or a number.

  Optax builds state with ``jnp.zeros_like`` of each leaf, so a parameter
  tree that holds a function, a string or a module's static field (an
  Equinox model as it is) fails deep inside with "Cannot determine dtype".
  Equinox users already filter the model first; the error says so. Abstract
  arrays (``jax.ShapeDtypeStruct``, tracers) and Python numbers pass.

  Raises:
    TypeError: a leaf is neither an array nor a number; the message names
      the leaf and shows ``eqx.filter(model, eqx.is_array)``.
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if is_array(leaf) or isinstance(
      leaf, (jax.ShapeDtypeStruct, numbers.Number)
    ):
      continue
    raise TypeError(
      f"{name} leaf {jax.tree_util.keystr(path)} is a"
      f" {type(leaf).__name__} ({leaf!r:.60}), not an array: {name} must"
      " hold arrays only. For an Equinox model, pass its arrays, with None"
      " in place of the rest: tx.init(eqx.filter(model, eqx.is_array)), and"
      " the same filtered tree as params to tx.update."
    )


Found = TypeVar("Found")


def find_one(state: Any, kind: type[Found], made_by: str) -> Found:
  """The one node of type ``kind`` inside an optimizer state.

  Args:
    state: any optimizer state: an ``optax.chain``'s, a Flax
      ``TrainState``, an NNX ``Optimizer``'s ``opt_state``.
    kind: the state type to find.
    made_by: the transformation whose state it is, for the error.

  Raises:
    ValueError: ``state`` holds no such node, or several.
  """
  found = [
    node
    for node in jax.tree.leaves(
      state, is_leaf=lambda node: isinstance(node, kind)
    )
    if isinstance(node, kind)
  ]
  if len(found) != 1:
    raise ValueError(
      f"state must hold exactly one {kind.__name__} (the state of"
      f" {made_by}), found {len(found)}."
    )
  return found[0]
