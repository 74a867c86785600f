"""accumulate under jit, without it, inside lax.scan, under vmap and pmap.

Each transformation is checked against plain unbatched runs of the same
micro-steps. Under ``vmap`` the window-closing ``lax.cond`` has a batched
predicate: a window side runs for every model while any model needs it,
selecting per model, so a micro-step pays for an optimizer step whenever one
model's window closes, but the results must still be those of the separate
runs, even when the models' windows are out of phase.

Those runs are ga_optax too, so the last tests anchor the transformations to
an independent large-batch run: ``jax.grad`` of each window's whole batch
and the bare optimizer, with plain SGD (a wrong gradient scale shows) and
windows of unequal weight, under ``jit``, ``lax.scan``, ``vmap`` and
``pmap`` with ``axis_name``.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import without_stale_accumulator

import ga_optax
from ga_optax.testing import max_relative_difference

NUM_MODELS = 3
NUM_MICRO_STEPS = 8


def _params(model: int) -> dict[str, jax.Array]:
  key = jax.random.fold_in(jax.random.key(3), model)
  return {
    "w": jax.random.normal(key, (2, 3), jnp.float32),
    "b": jnp.full((3,), float(model), jnp.bfloat16),
  }


def _micro_step(model: int, index: int) -> tuple[Any, jax.Array, jax.Array]:
  """Grads, weight and flush of one model's micro-step."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(4), model), index)
  key_w, key_b = jax.random.split(key)
  grads = {
    "w": jax.random.normal(key_w, (2, 3), jnp.float32),
    "b": jax.random.normal(key_b, (3,), jnp.bfloat16),
  }
  # Model 1 meets a non-finite micro-step and model 2 a flush, so their
  # windows drift out of phase with model 0's.
  if model == 1 and index == 2:
    grads["w"] = grads["w"].at[0, 0].set(jnp.nan)
  flush = model == 2 and index == 4
  return grads, jnp.float32(1 + (model + index) % 3), jnp.bool_(flush)


@functools.cache
def _optimizer() -> optax.GradientTransformationExtraArgs:
  return ga_optax.accumulate(
    optax.adam(0.05), {0: 3, 1: 2}, skip_nonfinite=True
  )


def _step(tx, params, state, grads, weight, flush):
  updates, state = tx.update(grads, state, params, weight=weight, flush=flush)
  return optax.apply_updates(params, updates), state, updates


@functools.cache
def _jitted_step(tx):
  # One compilation for all models: the optimizer object is the cache key.
  return jax.jit(functools.partial(_step, tx))


@functools.cache
def _single_run(model: int, use_jit: bool = True):
  """One model's run, unbatched; returns params, state and every update."""
  tx = _optimizer()
  step = functools.partial(_step, tx)
  if use_jit:
    step = _jitted_step(tx)
  params = _params(model)
  state = tx.init(params)
  all_updates = []
  for index in range(NUM_MICRO_STEPS):
    params, state, updates = step(params, state, *_micro_step(model, index))
    all_updates.append(updates)
  return params, state, all_updates


def _stack(trees: list[Any]) -> Any:
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _unstack(tree: Any, size: int) -> list[Any]:
  return [jax.tree.map(lambda leaf, i=i: leaf[i], tree) for i in range(size)]


def _assert_runs_close(actual, expected):
  # Compiled differently (batched, eager, scanned), the float32 arithmetic
  # may round differently. So may bfloat16 arithmetic inside a loop body,
  # which XLA keeps in float32 (the window's loop form, what GPUs run):
  # bfloat16 leaves are held to a few of their own steps, over a whole run.
  chex.assert_trees_all_equal_dtypes(actual, expected)
  actual = without_stale_accumulator(actual)
  expected = without_stale_accumulator(expected)
  for got, want in zip(
    jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True
  ):
    if jnp.result_type(got) == jnp.bfloat16:
      rtol = 4 * float(jnp.finfo(jnp.bfloat16).eps)
    else:
      rtol = 1e-5
    chex.assert_trees_all_close(got, want, rtol=rtol, atol=1e-6)


def test_the_runs_do_drift_out_of_phase():
  micro_steps = [
    int(_single_run(model)[1].micro_step) for model in range(NUM_MODELS)
  ]
  skipped = [
    int(_single_run(model)[1].num_skipped) for model in range(NUM_MODELS)
  ]
  assert len(set(micro_steps)) > 1
  assert skipped == [0, 1, 0]


def test_without_jit_matches_jit():
  _assert_runs_close(_single_run(2, use_jit=False), _single_run(2))


def test_inside_lax_scan_matches_the_python_loop():
  tx = _optimizer()
  params = _params(1)
  steps = [_micro_step(1, index) for index in range(NUM_MICRO_STEPS)]

  def body(carry, micro_step):
    params, state = carry
    params, state, updates = _step(tx, params, state, *micro_step)
    return (params, state), updates

  (params, state), updates = jax.jit(
    lambda params, steps: jax.lax.scan(body, (params, tx.init(params)), steps)
  )(params, _stack(steps))
  expected = _single_run(1)
  _assert_runs_close(
    (params, state, _unstack(updates, NUM_MICRO_STEPS)), expected
  )


def test_vmap_over_models_matches_separate_runs():
  tx = _optimizer()
  batched_step = jax.jit(jax.vmap(lambda *args: _step(tx, *args)))
  params = _stack([_params(model) for model in range(NUM_MODELS)])
  state = jax.vmap(tx.init)(params)
  all_updates = []
  for index in range(NUM_MICRO_STEPS):
    micro_steps = [_micro_step(model, index) for model in range(NUM_MODELS)]
    params, state, updates = batched_step(
      params, state, *map(_stack, zip(*micro_steps, strict=True))
    )
    all_updates.append(updates)
  for model in range(NUM_MODELS):
    actual = (
      _unstack(params, NUM_MODELS)[model],
      _unstack(state, NUM_MODELS)[model],
      [_unstack(u, NUM_MODELS)[model] for u in all_updates],
    )
    _assert_runs_close(actual, _single_run(model))


def _pmap_run(num_devices: int) -> None:
  """Data parallel over ``num_devices`` with pmap, against one device.

  Device d's micro-step i is micro-step (d, i) of model 0's stream (with
  model d's weights); the windows close on the global sum, so the reference
  is one unbatched run that adds every device's micro-step in turn and is
  flushed where the data-parallel window closes. Raises AssertionError on
  any difference.
  """
  assert jax.local_device_count() >= num_devices, jax.devices()
  tx = ga_optax.accumulate(
    optax.adam(0.05), 3, skip_nonfinite=True, axis_name="data"
  )
  params = _params(0)
  inputs = [
    [_micro_step(device, index) for device in range(num_devices)]
    for index in range(NUM_MICRO_STEPS)
  ]
  step = jax.pmap(
    lambda *args: _step(tx, *args),
    axis_name="data",
    in_axes=(0, 0, 0, 0, None),
    devices=jax.local_devices()[:num_devices],
  )
  replicated = _stack([params] * num_devices)
  state = _stack([tx.init(params)] * num_devices)
  for per_device in inputs:
    grads, weights, _ = zip(*per_device, strict=True)
    replicated, state, _ = step(
      replicated, state, _stack(list(grads)), jnp.stack(weights), False
    )
  # Every device holds the same parameters and counters.
  for device in range(1, num_devices):
    chex.assert_trees_all_equal(
      _unstack(replicated, num_devices)[device],
      _unstack(replicated, num_devices)[0],
    )

  reference = ga_optax.accumulate(optax.adam(0.05), 10**6, skip_nonfinite=True)
  reference_step = jax.jit(lambda *args: _step(reference, *args))
  ref_params, ref_state = params, reference.init(params)
  accepted = 0
  for per_device in inputs:
    # The finiteness check is global: one bad device drops the micro-step
    # on every device.
    leaves = jax.tree.leaves([grads for grads, _, _ in per_device])
    if not all(bool(jnp.isfinite(leaf).all()) for leaf in leaves):
      continue
    accepted += 1
    for device, (grads, weight, _) in enumerate(per_device):
      closes = accepted % 3 == 0 and device == num_devices - 1
      ref_params, ref_state, _ = reference_step(
        ref_params, ref_state, grads, weight, jnp.bool_(closes)
      )
  final_state = _unstack(state, num_devices)[0]
  _assert_runs_close(_unstack(replicated, num_devices)[0], ref_params)
  _assert_runs_close(final_state.inner_state, ref_state.inner_state)
  assert int(final_state.update_step) == int(ref_state.update_step) == 2
  assert int(final_state.num_skipped) == (1 if num_devices > 1 else 0)
  # The open window holds this device's own partial sum only.
  assert int(final_state.micro_step) == accepted % 3


def test_pmap_over_one_device_matches_the_unbatched_run():
  _pmap_run(1)


def test_pmap_over_two_devices_matches_the_unbatched_run():
  _pmap_run(2)


# The anchor: plain SGD against jax.grad of each window's whole batch.

ANCHOR_K = 3
ANCHOR_ROWS = 4
ANCHOR_OPTIMIZER = optax.sgd(0.1)


def _anchor_params(model: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(model)
  return {
    "w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
    "b": jnp.zeros((2,), jnp.float32),
  }


def _anchor_calls(model: int) -> list[tuple[Any, jax.Array]]:
  """One model's micro-batches (rows masked to 1..4 real ones) and flushes.

  Model 1 flushes a window of one micro-batch: its windows fall out of
  phase with model 0's, and they all hold unequal numbers of real rows.
  """
  rng = np.random.default_rng(20 + model)
  calls = []
  for index in range(NUM_MICRO_STEPS):
    real_rows = int(rng.integers(1, ANCHOR_ROWS + 1))
    batch = {
      "x": jnp.asarray(rng.normal(size=(ANCHOR_ROWS, 3)), jnp.float32),
      "y": jnp.asarray(rng.normal(size=(ANCHOR_ROWS, 2)), jnp.float32),
      "mask": jnp.asarray(np.arange(ANCHOR_ROWS) < real_rows, jnp.float32),
    }
    calls.append((batch, jnp.bool_(model == 1 and index == 3)))
  return calls


def _masked_mean_loss(params, batch):
  errors = ((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2).sum(-1)
  return jnp.sum(batch["mask"] * errors) / jnp.maximum(
    jnp.sum(batch["mask"]), 1
  )


def _anchor_step(tx, params, state, batch, flush):
  grads = jax.grad(_masked_mean_loss)(params, batch)
  weight = jnp.sum(batch["mask"])
  updates, state = tx.update(grads, state, params, weight=weight, flush=flush)
  return optax.apply_updates(params, updates), state


def _large_batch_run(params: Any, windows: list[list[Any]]) -> Any:
  """The bare optimizer once per window, on the gradient of all its rows."""
  state = ANCHOR_OPTIMIZER.init(params)
  for window in windows:
    batch = jax.tree.map(lambda *parts: jnp.concatenate(parts), *window)
    grads = jax.grad(_masked_mean_loss)(params, batch)
    updates, state = ANCHOR_OPTIMIZER.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def _closed_windows(calls: list[tuple[Any, jax.Array]]) -> list[list[Any]]:
  """The windows that close (full, or flushed) over ``calls``."""
  windows, open_window = [], []
  for batch, flush in calls:
    open_window.append(batch)
    if len(open_window) == ANCHOR_K or bool(flush):
      windows.append(open_window)
      open_window = []
  return windows


def _assert_matches_large_batch(params: Any, model: int) -> None:
  windows = _closed_windows(_anchor_calls(model))
  expected = _large_batch_run(_anchor_params(model), windows)
  chex.assert_tree_all_finite((params, expected))
  chex.assert_trees_all_close(params, expected, rtol=1e-5, atol=1e-6)
  moved = max_relative_difference(expected, _anchor_params(model))
  assert moved > 0.05, moved


@pytest.mark.parametrize("transformation", ["jit", "scan", "vmap"])
def test_accumulate_matches_the_large_batch(transformation):
  tx = ga_optax.accumulate(ANCHOR_OPTIMIZER, ANCHOR_K)
  step = functools.partial(_anchor_step, tx)
  models = [0, 1]
  if transformation == "jit":
    for model in models:
      params = _anchor_params(model)
      state = tx.init(params)
      for batch, flush in _anchor_calls(model):
        params, state = jax.jit(step)(params, state, batch, flush)
      _assert_matches_large_batch(params, model)
    return
  if transformation == "scan":
    for model in models:
      params = _anchor_params(model)
      calls = jax.tree.map(
        lambda *leaves: jnp.stack(leaves), *_anchor_calls(model)
      )

      def body(carry, call):
        return step(*carry, *call), None

      (params, _), _ = jax.jit(
        lambda params, calls: jax.lax.scan(
          body, (params, tx.init(params)), calls
        )
      )(params, calls)
      _assert_matches_large_batch(params, model)
    return
  # vmap: the two models side by side, their windows out of phase.
  batched = jax.jit(jax.vmap(step))
  params = _stack([_anchor_params(model) for model in models])
  state = jax.vmap(tx.init)(params)
  per_model = [_anchor_calls(model) for model in models]
  for calls in zip(*per_model, strict=True):
    params, state = batched(
      params, state, *map(_stack, zip(*calls, strict=True))
    )
  for model in models:
    _assert_matches_large_batch(_unstack(params, len(models))[model], model)


def test_pmap_over_two_devices_matches_the_large_batch():
  """axis_name under pmap: the global token-weighted mean, not the sum.

  Each device holds its own micro-batches (model d's stream); a window
  closes on the global count, and its large batch is every device's rows.
  """
  num_devices = 2
  tx = ga_optax.accumulate(ANCHOR_OPTIMIZER, ANCHOR_K, axis_name="data")
  step = jax.pmap(
    functools.partial(_anchor_step, tx),
    axis_name="data",
    in_axes=(None, None, 0, None),
    out_axes=(None, None),
    devices=jax.local_devices()[:num_devices],
  )
  params = _anchor_params(0)
  state = tx.init(params)
  streams = [
    [batch for batch, _ in _anchor_calls(device)]
    for device in range(num_devices)
  ]
  windows: list[list[Any]] = []
  for index, per_device in enumerate(zip(*streams, strict=True)):
    params, state = step(params, state, _stack(list(per_device)), False)
    if index % ANCHOR_K == 0:
      windows.append([])
    windows[-1].extend(per_device)
  closed = windows[: NUM_MICRO_STEPS // ANCHOR_K]
  expected = _large_batch_run(_anchor_params(0), closed)
  assert int(state.update_step) == len(closed)
  chex.assert_tree_all_finite((params, expected))
  chex.assert_trees_all_close(params, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply"])
def test_lookahead_steps_once_per_window_on_the_large_batch(fused):
  """optax.lookahead's gradients are shaped like its fast params."""
  sync_period, k = 2, 3
  lookahead = optax.lookahead(optax.sgd(0.5), sync_period, 0.5)
  rng = np.random.default_rng(5)
  grads = [
    {"w": rng.normal(size=(2, 3)).astype(np.float32)} for _ in range(4 * k)
  ]
  weights = [float(w) for w in rng.integers(1, 5, size=4 * k)]
  start = optax.LookaheadParams.init_synced({"w": jnp.ones((2, 3))})

  # The large batch: lookahead on each window's weighted mean gradient.
  expected, state = start, lookahead.init(start)
  for window in range(4):
    rows = slice(window * k, (window + 1) * k)
    window_weights = np.asarray(weights[rows], np.float32)
    mean = {
      "w": np.tensordot(window_weights, [g["w"] for g in grads[rows]], 1)
      / window_weights.sum()
    }
    updates, state = lookahead.update(mean, state, expected)
    expected = optax.apply_updates(expected, updates)

  make = ga_optax.accumulate_and_apply if fused else ga_optax.accumulate
  tx = make(lookahead, k)
  params, tx_state = start, tx.init(start)
  for grad, weight in zip(grads, weights, strict=True):
    if fused:
      params, tx_state = tx.apply(params, grad, tx_state, weight=weight)
    else:
      updates, tx_state = tx.update(grad, tx_state, params, weight=weight)
      params = optax.apply_updates(params, updates)
  chex.assert_tree_all_finite(params)
  chex.assert_trees_all_close(params, expected, rtol=1e-6, atol=1e-6)
  assert int(ga_optax.applied_updates(tx_state)) == 4
