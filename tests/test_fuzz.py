"""Property-based tests: random pytrees, k, partitions and weights.

Each example draws a parameter tree (nested dicts, lists and tuples, None
leaves, empty subtrees, scalar and empty leaves, in float16, bfloat16 and
float32) beside a non-empty float32 leaf that every example has, a window
length k, and a large batch of per-item gradients split into micro-batches
of random sizes, an empty one included (its mean is NaN and its weight 0).
The accumulated run must equal the inner optimizer stepped once per window
on the large batch's gradient, within each dtype's rounding of the numbers
involved, and every update must have the dtype and shape of the gradients.

Tolerances scale with each leaf's own numbers (the reference's magnitude and
that of the gradients summed into it), never with a constant: an update of
zeros, or of the wrong scale, fails. A last property holds the window's sum
to float32 precision for bfloat16 and float16 gradients, which a sum kept in
their own dtype misses.

``GA_OPTAX_FUZZ_EXAMPLES`` scales the number of examples (default: a small
number that keeps this module fast). The default search is derandomised so
that CI runs the same examples every time; a scaled-up run draws at random.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import strategies as st

import ga_optax

EXAMPLES = int(os.environ.get("GA_OPTAX_FUZZ_EXAMPLES", "0")) or None
LEARNING_RATE = 0.5


def _settings(default_examples: int) -> hypothesis.settings:
  return hypothesis.settings(
    max_examples=EXAMPLES or default_examples,
    deadline=None,
    # CI runs the same examples every time; a scaled-up run explores.
    derandomize=EXAMPLES is None,
    database=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
  )


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """Shape and dtype of one parameter; not a pytree node, so a leaf."""

  shape: tuple[int, ...]
  dtype: str


LEAVES = st.builds(
  LeafSpec,
  shape=st.sampled_from([(), (1,), (3,), (2, 2), (0,), (2, 1, 2)]),
  dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
)
# Every example has this leaf: float32, not empty, so that each one checks
# numbers whatever the random tree beside it holds.
ANCHOR_LEAF = st.builds(
  LeafSpec,
  shape=st.sampled_from([(1,), (3,), (2, 2), (2, 1, 2)]),
  dtype=st.just("float32"),
)


def _nonempty_leaf(dtype: str) -> st.SearchStrategy[LeafSpec]:
  return st.builds(
    LeafSpec, shape=st.sampled_from([(3,), (2, 2)]), dtype=st.just(dtype)
  )


TREES = st.recursive(
  st.one_of(LEAVES, st.none()),
  lambda children: st.one_of(
    st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
    st.lists(children, max_size=3),
    st.lists(children, max_size=3).map(tuple),
  ),
  max_leaves=6,
)


@dataclasses.dataclass(frozen=True)
class Plan:
  """One example: the tree, k, and the micro-batch sizes of each window."""

  spec: Any
  every_k: int
  windows: tuple[tuple[int, ...], ...]
  flush_last: bool
  reduction: str
  weight_dtype: str
  seed: int


@st.composite
def plans(draw: st.DrawFn, low_precision_leaves: bool = False) -> Plan:
  """An example; ``low_precision_leaves`` adds non-empty bf16 and f16 ones."""
  every_k = draw(st.integers(1, 4))
  sizes = st.integers(0, 3)
  windows = [
    tuple(draw(st.lists(sizes, min_size=every_k, max_size=every_k)))
    for _ in range(draw(st.integers(1, 2)))
  ]
  flush_last = every_k > 1 and draw(st.booleans())
  if flush_last:
    length = draw(st.integers(1, every_k - 1))
    windows.append(
      tuple(draw(st.lists(sizes, min_size=length, max_size=length)))
    )
  # A window without items would not step the optimizer; the equivalence
  # claim is about windows that hold data (zero windows are tested apart).
  windows = [window if sum(window) else (1, *window[1:]) for window in windows]
  spec = {"anchor": draw(ANCHOR_LEAF), "tree": draw(TREES)}
  if low_precision_leaves:
    spec["bf16"] = draw(_nonempty_leaf("bfloat16"))
    spec["f16"] = draw(_nonempty_leaf("float16"))
  return Plan(
    spec=spec,
    every_k=every_k,
    windows=tuple(windows),
    flush_last=flush_last,
    reduction=draw(st.sampled_from(["mean", "sum"])),
    weight_dtype=draw(
      st.sampled_from(["int32", "uint8", "float32", "bfloat16"])
    ),
    seed=draw(st.integers(0, 2**31 - 1)),
  )


def _is_leaf(node: Any) -> bool:
  return isinstance(node, LeafSpec)


def _items(plan: Plan, positive: bool) -> list[list[Any]]:
  """Per-item float64 gradients: items[window][micro-batch] -> a tree."""
  rng = np.random.default_rng(plan.seed)

  def draw(spec: LeafSpec, size: int) -> np.ndarray:
    shape = (size, *spec.shape)
    if positive:
      return rng.uniform(0.5, 2.0, shape)
    return rng.normal(size=shape)

  return [
    [
      jax.tree.map(
        lambda spec, s=size: draw(spec, s), plan.spec, is_leaf=_is_leaf
      )
      for size in window
    ]
    for window in plan.windows
  ]


def _reduce(items: list[Any], reduction: str, dtype_of: Any) -> Any:
  """Mean (or sum) over the items of several micro-batches, in float64."""
  stacked = jax.tree.map(lambda *parts: np.concatenate(parts), *items)

  def reduce(values: np.ndarray, dtype: str) -> jax.Array:
    # An empty micro-batch's mean is NaN, as in a model: expected here.
    with warnings.catch_warnings(), np.errstate(invalid="ignore"):
      warnings.simplefilter("ignore", RuntimeWarning)
      total = values.mean(0) if reduction == "mean" else values.sum(0)
    return jnp.asarray(total.astype(np.float32), dtype)

  return jax.tree.map(reduce, stacked, dtype_of, is_leaf=_is_leaf)


def _dtypes(plan: Plan) -> Any:
  return jax.tree.map(lambda spec: spec.dtype, plan.spec, is_leaf=_is_leaf)


def _magnitude(values: Any) -> float:
  """The largest absolute value of an array; 0 for an empty one."""
  values = np.abs(np.asarray(values, np.float64))
  return float(values.max()) if values.size else 0.0


def _assert_close_per_dtype(
  actual: Any, expected: Any, scales: Any = None
) -> None:
  """Equal within 16 roundings of each leaf's dtype, at that leaf's scale.

  A leaf's scale is the largest magnitude of its reference, or of
  ``scales`` (a tree of floats like ``expected``: the magnitude of what was
  summed into it) where that is larger. Integer leaves are compared exactly.
  The tolerance is relative to the leaf's own numbers, so a leaf of zeros
  (or of the wrong scale) cannot pass for a reference that is not.
  """
  chex.assert_trees_all_equal_structs(actual, expected)
  wanted = jax.tree.leaves(expected)
  scales = [0.0] * len(wanted) if scales is None else jax.tree.leaves(scales)
  for got, want, scale in zip(
    jax.tree.leaves(actual), wanted, scales, strict=True
  ):
    assert got.dtype == want.dtype and got.shape == want.shape
    if not jnp.issubdtype(got.dtype, jnp.floating):
      np.testing.assert_array_equal(got, want)
      continue
    assert np.all(np.isfinite(np.asarray(want, np.float64))), want
    eps = float(jnp.finfo(got.dtype).eps)
    np.testing.assert_allclose(
      np.asarray(got, np.float64),
      np.asarray(want, np.float64),
      rtol=0,
      atol=16 * eps * max(_magnitude(want), scale),
    )


def _summed_magnitude(
  window: tuple[int, ...], window_items: list[Any], reduction: str
) -> Any:
  """Per leaf, the largest ``sum(w_i |g_i|)`` (over ``W`` for a mean).

  ``g_i`` is micro-batch i's mean gradient and ``w_i`` its size: the scale
  of the numbers whose rounding the window's result carries.
  """

  def leaf_scale(*parts: np.ndarray) -> float:
    total = sum(
      np.abs(part.sum(0))
      for part, size in zip(parts, window, strict=True)
      if size
    )
    if reduction == "mean":
      total = total / sum(window)
    return _magnitude(total)

  return jax.tree.map(leaf_scale, *window_items)


def _check_equivalence(
  plan: Plan, inner: optax.GradientTransformation, positive: bool
) -> None:
  params = jax.tree.map(
    lambda spec: jnp.zeros(spec.shape, spec.dtype), plan.spec, is_leaf=_is_leaf
  )
  tx = ga_optax.accumulate(inner, plan.every_k, reduction=plan.reduction)
  update = jax.jit(
    lambda grads, state, weight, flush: tx.update(
      grads, state, params, weight=weight, flush=flush
    )
  )
  dtypes = _dtypes(plan)
  state = tx.init(params)
  reference_state = inner.init(params)
  for window_index, (window, window_items) in enumerate(
    zip(plan.windows, _items(plan, positive), strict=True)
  ):
    for index, (size, items) in enumerate(
      zip(window, window_items, strict=True)
    ):
      # Each micro-batch's gradient is the mean over its items (NaN when it
      # has none), computed as a model would, in the parameters' dtypes.
      grads = _reduce([items], "mean", dtypes)
      weight = jnp.asarray(size, plan.weight_dtype)
      flush = plan.flush_last and window_index == len(plan.windows) - 1
      flush = flush and index == len(window) - 1
      updates, state = update(grads, state, weight, jnp.asarray(flush))
      chex.assert_trees_all_equal_shapes_and_dtypes(updates, grads)
      closes = index == len(window) - 1
      assert bool(ga_optax.emitted(state)) == closes
      if not closes:
        chex.assert_trees_all_equal(updates, optax.tree.zeros_like(grads))
    large_batch_grads = _reduce(window_items, plan.reduction, dtypes)
    expected, reference_state = inner.update(
      large_batch_grads, reference_state, params
    )
    summed = _summed_magnitude(window, window_items, plan.reduction)
    scales = jax.tree.map(lambda scale: LEARNING_RATE * scale, summed)
    _assert_close_per_dtype(updates, expected, scales)
    # The float32 leaf's tolerance is far below its update: an update of
    # zeros could not pass.
    anchor = np.asarray(expected["anchor"], np.float64)
    assert _magnitude(anchor) > 1e3 * float(jnp.finfo(jnp.float32).eps) * max(
      _magnitude(anchor), scales["anchor"]
    ), (anchor, scales["anchor"])
  _assert_close_per_dtype(state.inner_state, reference_state)
  assert int(state.update_step) == len(plan.windows)
  assert int(state.micro_step) == 0


@_settings(default_examples=25)
@hypothesis.given(plans())
def test_sgd_equals_the_large_batch_step(plan):
  _check_equivalence(plan, optax.sgd(LEARNING_RATE), positive=False)


@_settings(default_examples=15)
@hypothesis.given(plans())
def test_adam_equals_the_large_batch_step(plan):
  # Adam divides by the gradient's magnitude, which amplifies rounding where
  # a mean cancels to nearly zero; positive items keep it well conditioned.
  _check_equivalence(plan, optax.adam(LEARNING_RATE), positive=True)


def _ulp(values: np.ndarray, dtype: Any) -> np.ndarray:
  """The spacing of ``dtype`` at each of ``values`` (float64 in and out)."""
  finfo = jnp.finfo(dtype)
  magnitude = np.maximum(np.abs(values), float(finfo.tiny))
  return float(finfo.eps) * 2.0 ** np.floor(np.log2(magnitude))


@_settings(default_examples=10)
@hypothesis.given(plans(low_precision_leaves=True))
def test_low_precision_gradients_are_summed_in_float32(plan):
  """bfloat16 and float16 gradients are summed at float32 precision.

  The reference is the window's weighted mean (or sum) of the very
  gradients fed in, formed exactly (float64) and rounded once to their
  dtype; SGD at a learning rate of 0.5 moves by exactly half of it. Float32
  holds a few bfloat16 or float16 values times small weights exactly, so
  the accumulated update may differ from it by one rounding of its dtype at
  most, while a sum kept in bfloat16 or float16 rounds at every micro-step
  and misses by more. (Float32 leaves are left to the properties above:
  their float32 sums round.)
  """
  params = jax.tree.map(
    lambda spec: jnp.zeros(spec.shape, spec.dtype), plan.spec, is_leaf=_is_leaf
  )
  tx = ga_optax.accumulate(
    optax.sgd(LEARNING_RATE), plan.every_k, reduction=plan.reduction
  )
  update = jax.jit(
    lambda grads, state, weight, flush: tx.update(
      grads, state, params, weight=weight, flush=flush
    )
  )
  dtypes = _dtypes(plan)
  state = tx.init(params)
  checked = 0
  for window_index, (window, window_items) in enumerate(
    zip(plan.windows, _items(plan, positive=False), strict=True)
  ):
    fed = []
    for index, (size, items) in enumerate(
      zip(window, window_items, strict=True)
    ):
      grads = _reduce([items], "mean", dtypes)
      fed.append(grads)
      last = window_index == len(plan.windows) - 1 and index == len(window) - 1
      updates, state = update(
        grads,
        state,
        jnp.asarray(size, plan.weight_dtype),
        jnp.asarray(plan.flush_last and last),
      )

    def exact(*grads: jax.Array, window: tuple[int, ...] = window) -> Any:
      total = sum(
        size * np.asarray(grad, np.float64)
        for size, grad in zip(window, grads, strict=True)
        if size
      )
      return total / sum(window) if plan.reduction == "mean" else total

    for got, *grads in zip(
      jax.tree.leaves(updates), *map(jax.tree.leaves, fed), strict=True
    ):
      if got.dtype not in (jnp.bfloat16, jnp.float16) or not got.size:
        continue
      want = -LEARNING_RATE * np.asarray(
        jnp.asarray(exact(*grads).astype(np.float32), got.dtype), np.float64
      )
      difference = np.abs(np.asarray(got, np.float64) - want)
      assert np.all(difference <= _ulp(want, got.dtype)), (got, want)
      checked += 1
  assert checked >= 2 * len(plan.windows)


@_settings(default_examples=10)
@hypothesis.given(plans(), st.data())
def test_skipped_nonfinite_micro_steps_leave_no_trace(plan, data):
  params = jax.tree.map(
    lambda spec: jnp.zeros(spec.shape, spec.dtype), plan.spec, is_leaf=_is_leaf
  )
  poisonable = [
    index for index, leaf in enumerate(jax.tree.leaves(params)) if leaf.size > 0
  ]
  hypothesis.assume(poisonable)
  tx = ga_optax.accumulate(
    optax.adam(LEARNING_RATE), plan.every_k, skip_nonfinite=True
  )
  update = jax.jit(
    lambda grads, state, weight: tx.update(grads, state, params, weight=weight)
  )
  dtypes = _dtypes(plan)
  clean = [
    (_reduce([items], "mean", dtypes), jnp.asarray(size, plan.weight_dtype))
    for window, window_items in zip(
      plan.windows, _items(plan, positive=False), strict=True
    )
    for size, items in zip(window, window_items, strict=True)
  ]
  poisoned = list(clean)
  num_poisoned = data.draw(st.integers(1, 3))
  treedef = jax.tree.structure(clean[0][0])
  for _ in range(num_poisoned):
    position = data.draw(st.integers(0, len(poisoned)))
    leaf_index = data.draw(st.sampled_from(poisonable))
    value = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    leaves = [jnp.ones_like(leaf) for leaf in jax.tree.leaves(clean[0][0])]
    leaves[leaf_index] = jnp.full_like(leaves[leaf_index], value)
    poisoned.insert(
      position,
      (jax.tree.unflatten(treedef, leaves), jnp.asarray(1, plan.weight_dtype)),
    )

  def run(stream):
    state = tx.init(params)
    emitted_updates = []
    for grads, weight in stream:
      updates, state = update(grads, state, weight)
      chex.assert_trees_all_equal_shapes_and_dtypes(updates, grads)
      if bool(ga_optax.emitted(state)):
        emitted_updates.append(updates)
    return emitted_updates, state

  clean_updates, clean_state = run(clean)
  poisoned_updates, poisoned_state = run(poisoned)
  # Empty micro-batches (NaN mean) are skipped in both streams alike.
  assert int(poisoned_state.num_skipped) == (
    int(clean_state.num_skipped) + num_poisoned
  )
  chex.assert_trees_all_equal(poisoned_updates, clean_updates)
  chex.assert_trees_all_equal(
    poisoned_state._replace(num_skipped=clean_state.num_skipped, emitted=True),
    clean_state._replace(emitted=True),
  )
