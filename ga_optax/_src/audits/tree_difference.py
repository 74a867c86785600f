"""How far apart two pytrees of parameters are, NaNs and infinities included.

The measure behind every equivalence claim of :mod:`ga_optax.testing`: per
leaf, the largest difference relative to the expected leaf's scale, in
float64 on the host. A NaN or infinity that only one side holds is never
within a tolerance, and a leaf that only float rounding moves can be left
out by its path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

PathFilter = Callable[[str], bool]


def max_relative_difference(
  actual: Any, expected: Any, *, exclude: PathFilter | None = None
) -> float:
  """The largest per-leaf relative difference between two pytrees.

  Each leaf contributes ``max|actual - expected| / max|expected|`` (with the
  denominator kept away from zero), computed in float64 on the host.

  Non-finite values are compared exactly: a position where both trees hold
  NaN, or both hold an infinity of the same sign, counts as equal and is left
  out of the difference. Any other NaN or infinity, on either side, makes the
  leaf's difference (and so the result) ``inf``: a NaN in trained parameters
  is never within a tolerance.

  No tolerance can judge a leaf that only float rounding moves, such as an
  attention block's key bias under Adam (see
  :func:`compare_with_large_batch`): ``exclude`` leaves it out.

  Args:
    actual: a pytree of arrays.
    expected: a pytree of arrays with the same structure and shapes.
    exclude: ``exclude(path) -> bool``, true for the leaves to leave out of
      the difference; ``path`` is the leaf's :func:`jax.tree_util.keystr`.
      An excluded leaf still counts as ``inf`` when its non-finite values
      differ. By default every leaf is compared.

  Returns:
    A Python float; 0.0 for identical trees, ``inf`` when the trees' non-finite
    values differ.

  Raises:
    ValueError: the trees differ in structure, or a leaf in shape; or
      ``exclude`` matches no leaf, or every leaf.
    TypeError: ``exclude`` is not callable.

  Example:
    >>> import jax.numpy as jnp
    >>> from ga_optax.testing import max_relative_difference
    >>> difference = max_relative_difference(
    ...     {"w": jnp.array([1.0, 2.5])}, {"w": jnp.array([1.0, 2.0])}
    ... )
    >>> difference
    0.25
    >>> max_relative_difference(
    ...     {"w": jnp.array([jnp.nan, 1.0])}, {"w": jnp.array([1.0, 1.0])}
    ... )
    inf
    >>> max_relative_difference(
    ...     {"b": jnp.array([1e-9]), "w": jnp.array([1.0])},
    ...     {"b": jnp.array([-1e-9]), "w": jnp.array([1.0])},
    ...     exclude=lambda path: path == "['b']",
    ... )
    0.0
  """
  leaves = paired_leaves(actual, expected)
  excluded = excluded_paths([path for path, _, _ in leaves], exclude)
  return max(
    (leaf_difference(leaf, excluded) for leaf in leaves),
    default=0.0,
  )


def excluded_paths(
  paths: Sequence[str], exclude: PathFilter | None
) -> tuple[str, ...]:
  """The paths ``exclude`` picks, checked to pick some but not all."""
  if exclude is None:
    return ()
  if not callable(exclude):
    raise TypeError(
      "exclude must be a function of a leaf's path (a string such as"
      " \"['attn']['key']['bias'].value\") that returns True for the leaves"
      " to leave out, for example lambda path: path.endswith(\"['key']"
      f"['bias'].value\"), got {exclude!r} of type {type(exclude).__name__}."
    )
  excluded = tuple(path for path in paths if exclude(path))
  # A filter that matches nothing is a mistake (a renamed layer, a path
  # written without NNX's ".value"); one that matches everything would let
  # any defect pass.
  if not excluded:
    raise ValueError(
      f"exclude matched no leaf; the leaves' paths are {list(paths)}."
    )
  if len(excluded) == len(paths):
    raise ValueError(
      "exclude matched every leaf, which leaves nothing to compare; it"
      " should pick only leaves that float rounding alone moves, got"
      f" {list(excluded)}."
    )
  return excluded


def leaf_difference(
  leaf: tuple[str, np.ndarray, np.ndarray], excluded: Sequence[str]
) -> float:
  path, actual, expected = leaf
  difference = relative_difference(actual, expected)
  # An excluded leaf's size is not judged, but a NaN or infinity that only
  # one run holds is never float noise.
  if path in excluded and np.isfinite(difference):
    return 0.0
  return difference


def paired_leaves(
  actual: Any, expected: Any
) -> list[tuple[str, np.ndarray, np.ndarray]]:
  """Each leaf's path and its values in both trees, as float64 arrays."""
  actual_tree: Any = jax.tree.structure(actual)
  expected_tree: Any = jax.tree.structure(expected)
  if actual_tree != expected_tree:
    raise ValueError(
      "actual and expected must have the same tree structure, got"
      f" {actual_tree} and {expected_tree}."
    )
  pairs = []
  for (path, actual_leaf), expected_leaf in zip(
    jax.tree_util.tree_flatten_with_path(actual)[0],
    jax.tree.leaves(expected),
    strict=True,
  ):
    actual_values = np.asarray(actual_leaf, dtype=np.float64)
    expected_values = np.asarray(expected_leaf, dtype=np.float64)
    if actual_values.shape != expected_values.shape:
      raise ValueError(
        "actual and expected must have the same shape at every leaf; leaf"
        f" {jax.tree_util.keystr(path)} has shape {actual_values.shape} in"
        f" actual and {expected_values.shape} in expected."
      )
    pairs.append((jax.tree_util.keystr(path), actual_values, expected_values))
  return pairs


def relative_difference(actual: np.ndarray, expected: np.ndarray) -> float:
  # Equal NaNs and equal signed infinities are the same value for a test, as
  # in np.array_equal(..., equal_nan=True); they take no part in the scale.
  same_non_finite = (np.isnan(actual) & np.isnan(expected)) | (
    np.isinf(actual) & (actual == expected)
  )
  actual, expected = actual[~same_non_finite], expected[~same_non_finite]
  if not (np.all(np.isfinite(actual)) and np.all(np.isfinite(expected))):
    return float("inf")
  if actual.size == 0:
    return 0.0
  scale = max(float(np.max(np.abs(expected))), np.finfo(float).tiny)
  return float(np.max(np.abs(actual - expected))) / scale


def non_finite_counts(values: np.ndarray) -> str:
  return (
    f"{int(np.sum(np.isnan(values)))} NaN and"
    f" {int(np.sum(np.isinf(values)))} infinite"
  )
