"""Micro-batch weights: zero-weight windows, traced negatives, every dtype.

Negative weights have one rule in both paths, ``accumulate``'s ``weight=``
and ``microbatched_value_and_grad``'s ``weight_fn``: a concrete one is
refused, a traced one subtracts its micro-batch, and weights that sum to 0
or less give zeros.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import ga_optax

GRADS = [
  {"w": jnp.asarray([1.0, -2.0, 0.5]), "b": jnp.asarray(3.0)},
  {"w": jnp.asarray([4.0, 0.25, -1.0]), "b": jnp.asarray(-2.0)},
  {"w": jnp.asarray([-3.0, 1.0, 2.0]), "b": jnp.asarray(0.5)},
]
PARAMS = {"w": jnp.zeros(3), "b": jnp.zeros(())}


def _window(tx, weights, use_jit: bool, grads=GRADS, flush_last=False):
  def update(grads, state, weight, flush):
    return tx.update(grads, state, PARAMS, weight=weight, flush=flush)

  if use_jit:
    update = jax.jit(update)
  state = tx.init(PARAMS)
  for index, (g, weight) in enumerate(zip(grads, weights, strict=True)):
    flush = flush_last and index == len(weights) - 1
    updates, state = update(g, state, weight, flush)
  return updates, state


@pytest.mark.parametrize(
  ("reduction", "use_jit"),
  [("mean", True), ("sum", True), ("mean", False)],
  ids=["jit-mean", "jit-sum", "eager-mean"],
)
def test_window_of_zero_weight_emits_zeros_without_a_step(reduction, use_jit):
  tx = ga_optax.accumulate(optax.adam(0.1), 3, reduction=reduction)
  updates, state = _window(tx, [0, 0.0, jnp.int32(0)], use_jit)
  chex.assert_trees_all_equal(updates, optax.tree.zeros_like(PARAMS))
  chex.assert_trees_all_equal(state.inner_state, tx.init(PARAMS).inner_state)
  assert not bool(ga_optax.emitted(state))
  assert int(state.update_step) == 0
  assert int(state.micro_step) == 0


def test_flushing_a_zero_weight_partial_window_emits_zeros_without_a_step():
  tx = ga_optax.accumulate(optax.adam(0.1), 3)
  updates, state = _window(tx, [0, 0], True, GRADS[:2], flush_last=True)
  chex.assert_trees_all_equal(updates, optax.tree.zeros_like(PARAMS))
  chex.assert_trees_all_equal(state.inner_state, tx.init(PARAMS).inner_state)
  assert int(state.update_step) == 0


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_zero_weight_micro_step_adds_nothing_even_when_its_gradient_is_nan(
  use_jit,
):
  # An all-padding micro-batch: its mean loss is 0 / 0, its weight 0 tokens.
  tx = ga_optax.accumulate(optax.sgd(1.0), 3)
  nan_grads = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), GRADS[1])
  updates, state = _window(
    tx, [2, 0, 3], use_jit, [GRADS[0], nan_grads, GRADS[2]]
  )
  expected = jax.tree.map(lambda a, c: -(2 * a + 3 * c) / 5, GRADS[0], GRADS[2])
  chex.assert_trees_all_close(updates, expected, rtol=1e-6)
  assert int(state.update_step) == 1


def test_traced_negative_weight_is_used_as_given():
  # Documented: a traced weight cannot be checked, so it enters the sums as
  # given; only a window whose weights sum to <= 0 is withheld.
  tx = ga_optax.accumulate(optax.sgd(1.0), 2)
  updates, state = _window(
    tx, [jnp.float32(3.0), jnp.float32(-1.0)], True, GRADS[:2]
  )
  expected = jax.tree.map(lambda a, b: -(3 * a - b) / 2, GRADS[0], GRADS[1])
  chex.assert_trees_all_close(updates, expected, rtol=1e-6)
  assert bool(ga_optax.emitted(state))

  for weights in ([2.0, -2.0], [1.0, -3.0]):
    updates, state = _window(
      tx, [jnp.float32(w) for w in weights], True, GRADS[:2]
    )
    chex.assert_trees_all_equal(updates, optax.tree.zeros_like(PARAMS))
    assert not bool(ga_optax.emitted(state))
    chex.assert_tree_all_finite(updates)


def test_concrete_negative_weight_is_refused():
  tx = ga_optax.accumulate(optax.sgd(1.0), 2)
  with pytest.raises(ValueError, match="weight must be finite and >= 0"):
    tx.update(GRADS[0], tx.init(PARAMS), PARAMS, weight=jnp.int8(-1))


WEIGHT_KINDS: list[tuple[str, Any]] = [
  ("python-int", lambda value: int(value)),
  ("python-float", lambda value: float(value)),
  ("numpy-int8", np.int8),
  ("numpy-float64", np.float64),
  ("int8", lambda value: jnp.asarray(value, jnp.int8)),
  ("int32", lambda value: jnp.asarray(value, jnp.int32)),
  ("uint8", lambda value: jnp.asarray(value, jnp.uint8)),
  ("float16", lambda value: jnp.asarray(value, jnp.float16)),
  ("bfloat16", lambda value: jnp.asarray(value, jnp.bfloat16)),
  ("numpy-bfloat16", lambda value: np.asarray(value, ml_dtypes.bfloat16)),
  ("float32", lambda value: jnp.asarray(value, jnp.float32)),
]


# Every kind traced under jit; a few also concrete, eagerly (eager calls of
# tx.update are slow, so not all of them).
EAGER_KINDS = ("python-int", "uint8", "bfloat16")


@pytest.mark.parametrize(
  ("make_weight", "use_jit"),
  [(kind, True) for _, kind in WEIGHT_KINDS]
  + [(kind, False) for name, kind in WEIGHT_KINDS if name in EAGER_KINDS],
  ids=[f"jit-{name}" for name, _ in WEIGHT_KINDS]
  + [f"eager-{name}" for name, _ in WEIGHT_KINDS if name in EAGER_KINDS],
)
def test_weights_of_every_numeric_dtype(make_weight, use_jit):
  # Integers every dtype holds exactly, uint8's 120 included.
  raw_weights = [3, 120, 5]
  tx = ga_optax.accumulate(optax.sgd(1.0), 3)
  updates, state = _window(
    tx, [make_weight(value) for value in raw_weights], use_jit
  )
  expected = jax.tree.map(
    lambda *gs: (
      -sum(
        w * np.asarray(g, np.float64)
        for w, g in zip(raw_weights, gs, strict=True)
      )
      / sum(raw_weights)
    ),
    *GRADS,
  )
  chex.assert_trees_all_close(updates, expected, rtol=1e-6)
  chex.assert_trees_all_equal_dtypes(updates, PARAMS)
  assert state.weight_sum.dtype == jnp.float32
  assert float(state.weight_sum) == 0.0


# One rule in both paths, against NumPy's gradients of each micro-batch.

MICRO_BATCHES = 3
ROWS = 2  # per micro-batch


def _micro_batches(weights: list[float], nan_at: int | None) -> list[Any]:
  rng = np.random.default_rng(11)
  batches = []
  for index, weight in enumerate(weights):
    y = rng.normal(size=ROWS).astype(np.float32)
    if index == nan_at:
      y[:] = np.nan  # a 0 / 0 mean loss: its gradient is NaN
    batches.append(
      {
        "x": rng.normal(size=(ROWS, 3)).astype(np.float32),
        "y": y,
        "w": np.full(ROWS, weight, np.float32),
      }
    )
  return batches


def _mean_loss(params: Any, batch: Any) -> jax.Array:
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _numpy_gradient(params: Any, batch: Any) -> np.ndarray:
  """The gradient of ``_mean_loss`` in NumPy, flattened as (w, b)."""
  error = batch["x"] @ np.asarray(params["w"]) + float(params["b"]) - batch["y"]
  return np.concatenate(
    [2 * batch["x"].T @ error / len(error), [2 * error.mean()]]
  )


def _through_accumulate(params: Any, batches: list[Any]) -> np.ndarray:
  tx = ga_optax.accumulate(optax.sgd(1.0), len(batches))
  step = jax.jit(
    lambda grads, state, weight: tx.update(grads, state, params, weight=weight)
  )
  state = tx.init(params)
  for batch in batches:
    grads = jax.grad(_mean_loss)(params, batch)
    updates, state = step(grads, state, jnp.float32(batch["w"][0]))
  return -np.concatenate([np.ravel(updates["w"]), np.ravel(updates["b"])])


def _through_microbatched(params: Any, batches: list[Any]) -> np.ndarray:
  # Micro-batch i holds rows i, i + k, ...: interleave the micro-batches.
  batch = jax.tree.map(
    lambda *leaves: np.stack(leaves, axis=1).reshape(-1, *leaves[0].shape[1:]),
    *batches,
  )
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _mean_loss, len(batches), weight_fn=lambda batch: batch["w"][0]
  )
  _, grads = jax.jit(value_and_grad)(params, batch)
  return np.concatenate([np.ravel(grads["w"]), np.ravel(grads["b"])])


PATHS = {
  "accumulate": _through_accumulate,
  "microbatched_value_and_grad": _through_microbatched,
}


@pytest.mark.parametrize(
  ("weights", "nan_at"),
  [
    ([1.0, -1.0, 3.0], None),  # the negative one subtracts
    ([2.0, 0.0, 3.0], 1),  # weight 0 adds nothing, even a NaN gradient
    ([-2.0, 0.0, 5.0], 1),
    ([1.0, -3.0, 1.0], None),  # weights summing to below 0: zeros
    ([2.0, -2.0, 0.0], 2),  # to 0: zeros
  ],
  ids=["negative", "zero_nan", "negative_and_zero", "sum_below_0", "sum_0"],
)
@pytest.mark.parametrize("path", list(PATHS))
def test_zero_and_traced_negative_weights_mean_the_same_in_both_paths(
  path, weights, nan_at
):
  params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.asarray(0.05)}
  batches = _micro_batches(weights, nan_at)
  got = PATHS[path](params, batches)
  total = sum(weights)
  expected = np.zeros(4)
  if total > 0:
    expected = (
      sum(
        w * _numpy_gradient(params, batch)
        for w, batch in zip(weights, batches, strict=True)
        if w != 0
      )
      / total
    )
  assert np.all(np.isfinite(got)), got
  np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-6)


def test_a_concrete_negative_weight_is_refused_in_both_paths():
  params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
  batches = _micro_batches([1.0, 1.0, 1.0], None)
  tx = ga_optax.accumulate(optax.sgd(1.0), 2)
  with pytest.raises(ValueError, match="weight must be finite and >= 0"):
    tx.update(params, tx.init(params), params, weight=-1.0)
  batch = jax.tree.map(lambda *leaves: np.concatenate(leaves), *batches)
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _mean_loss, MICRO_BATCHES, weight_fn=lambda batch: -1.0
  )
  with pytest.raises(
    ValueError, match="weight_fn's weight must be finite and >= 0"
  ):
    value_and_grad(params, batch)


# Forward mode: jax.jacfwd through a window whose middle micro-batch is all
# padding (a NaN gradient) at weight 0. The weight rule's derivative selects
# at weight 0: the dropped micro-batch's term (NaN) enters neither the
# derivative with respect to the weights nor the one with respect to the
# params, as it enters no sum.


def _numpy_mean_and_derivatives(
  params: Any, batches: list[Any], weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """The weighted mean gradient's derivatives, the NaN micro-batch left out.

  With respect to weight j: ``(g_j - mean) / W``; with respect to the params
  (w, b): ``sum_i w_i H_i / W``, each ``H_i`` the mean squared error's
  Hessian ``2 [X 1]^T [X 1] / rows``.
  """
  total = weights.sum()
  gradients, hessians = [], []
  for weight, batch in zip(weights, batches, strict=True):
    design = np.concatenate([batch["x"], np.ones((ROWS, 1))], axis=1)
    if weight == 0:
      gradients.append(np.zeros(4))
      hessians.append(np.zeros((4, 4)))
      continue
    gradients.append(_numpy_gradient(params, batch))
    hessians.append(2 * design.T @ design / ROWS)
  mean = sum(w * g for w, g in zip(weights, gradients, strict=True)) / total
  by_weight = np.stack([(g - mean) / total for g in gradients], axis=1)
  by_params = sum(w * h for w, h in zip(weights, hessians, strict=True)) / total
  return by_weight, by_params


def test_forward_mode_through_a_dropped_nan_micro_batch_is_finite():
  batches = _micro_batches([2.0, 0.0, 3.0], nan_at=1)
  # Its rows are NaN too: its gradient's derivative is NaN, as a 0 / 0
  # mean's is.
  batches[1]["x"][:] = np.nan
  weights = np.asarray([2.0, 0.0, 3.0], np.float32)
  params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.asarray(0.2)}
  tx = ga_optax.accumulate(optax.sgd(1.0), len(batches))

  def mean_gradient(weights: jax.Array, params: Any) -> jax.Array:
    state = tx.init(params)
    for index, batch in enumerate(batches):
      grads = jax.grad(_mean_loss)(params, batch)
      updates, state = tx.update(grads, state, params, weight=weights[index])
    return -jnp.concatenate([jnp.ravel(updates["w"]), jnp.ravel(updates["b"])])

  by_weight, by_params = jax.jit(jax.jacfwd(mean_gradient, argnums=(0, 1)))(
    jnp.asarray(weights), params
  )
  by_params = np.concatenate(
    [np.asarray(by_params["w"]), np.asarray(by_params["b"])[:, None]], axis=1
  )
  expected_by_weight, expected_by_params = _numpy_mean_and_derivatives(
    params, batches, weights
  )
  assert np.all(np.isfinite(by_weight)) and np.all(np.isfinite(by_params))
  np.testing.assert_allclose(
    by_weight, expected_by_weight, rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(
    by_params, expected_by_params, rtol=1e-5, atol=1e-6
  )


# A window whose traced weights sum to below 0 closes without a step, and
# leaves the next window nothing: neither its weight sum nor its gradient
# sums (which are not zero: g_1 - 3 g_2).

CARRIED_GRADS = np.asarray(
  [[1.0, -2.0, 0.5], [0.25, 1.0, -1.5], [3.0, 0.5, 2.0], [-1.0, 4.0, 0.5]],
  np.float32,
)
CARRIED_WEIGHTS = np.asarray([1.0, -3.0, 2.0, 1.0], np.float32)


@pytest.mark.parametrize("schedule", ["device", "host"])
def test_a_window_without_weight_leaves_nothing_to_the_next(schedule):
  tx = ga_optax.accumulate(optax.sgd(0.5), 2)
  params = jnp.zeros(3)

  @jax.jit
  def two_windows(weights: jax.Array) -> list[jax.Array]:
    state, emitted = tx.init(params), []
    for index, grads in enumerate(CARRIED_GRADS):
      options = {"closing": index % 2 == 1} if schedule == "host" else {}
      updates, state = tx.update(
        jnp.asarray(grads), state, params, weight=weights[index], **options
      )
      emitted.append(updates)
    return emitted

  emitted = np.asarray(two_windows(jnp.asarray(CARRIED_WEIGHTS)))
  # NumPy: the first window (total -2) does not step; the second is the
  # weighted mean of its own two gradients.
  second = CARRIED_WEIGHTS[2:] @ CARRIED_GRADS[2:] / CARRIED_WEIGHTS[2:].sum()
  expected = np.stack([np.zeros(3), np.zeros(3), np.zeros(3), -0.5 * second])
  assert np.all(np.isfinite(emitted))
  np.testing.assert_allclose(emitted, expected, rtol=1e-6, atol=1e-7)
