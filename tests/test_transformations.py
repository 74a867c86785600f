"""accumulate under jit, without it, inside lax.scan, under vmap and pmap.

Each transformation is checked against plain unbatched runs of the same
micro-steps. Under ``vmap`` the window-closing ``lax.cond`` has a batched
predicate and becomes a select: both branches run, so every micro-step pays
for an optimizer step, but the results must still be those of the separate
runs, even when the models' windows are out of phase.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import optax

import ga_optax

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
  # may round differently; bfloat16 leaves keep their own precision.
  chex.assert_trees_all_equal_dtypes(actual, expected)
  chex.assert_trees_all_close(actual, expected, rtol=1e-5, atol=1e-6)


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
