"""benchmarks/host_scheduled.py: the host-scheduled window is the large batch.

Each window of k host-chosen calls must equal one step of the bare optimizer
on the gradient of the concatenated batch (``jax.grad`` of its mean loss),
window after window, with equal and unequal micro-batches and weights. The
compiled programs must hold no control flow and move no more than the floor
(a gradient added into a donated accumulator), on XLA:GPU for a compile-only
H100. No timing is asserted.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from gpu_compiler import compiled_for_gpu

from benchmarks import compiled_steps, host_scheduled
from benchmarks import workloads as workloads_lib
from ga_optax import testing

MIB = 2**20
WIDTH = 16
WINDOWS = 3


def loss_fn(params, batch):
  hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  prediction = hidden @ params["w2"]
  return jnp.mean(jnp.sum((prediction - batch["y"]) ** 2, axis=-1))


def initial_params():
  keys = jax.random.split(jax.random.PRNGKey(0), 2)
  return {
    "w1": jax.random.normal(keys[0], (WIDTH, WIDTH)) / np.sqrt(WIDTH),
    "b1": jnp.zeros((WIDTH,)),
    "w2": jax.random.normal(keys[1], (WIDTH, 4)) / np.sqrt(WIDTH),
  }


def window_batches(window_index, sizes):
  """The micro-batches of one window, ``sizes[i]`` rows each."""
  key = jax.random.fold_in(jax.random.PRNGKey(1), window_index)
  batches = []
  for index, size in enumerate(sizes):
    x_key, y_key = jax.random.split(jax.random.fold_in(key, index))
    batches.append(
      {
        "x": jax.random.normal(x_key, (size, WIDTH)),
        "y": jax.random.normal(y_key, (size, 4)),
      }
    )
  return batches


def large_batch_run(optimizer, sizes):
  """The reference: one bare optimizer step per concatenated window."""
  params = initial_params()
  opt_state = optimizer.init(params)
  for window_index in range(WINDOWS):
    batches = window_batches(window_index, sizes)
    large = jax.tree.map(lambda *rows: jnp.concatenate(rows), *batches)
    grads = jax.grad(loss_fn)(params, large)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params, opt_state


def host_scheduled_run(optimizer, sizes, weighted):
  window = host_scheduled.host_scheduled_window(loss_fn, optimizer, len(sizes))
  # Own buffers: the window donates them.
  params = jax.tree.map(jnp.copy, initial_params())
  opt_state = window.init(params)
  all_losses = []
  for window_index in range(WINDOWS):
    batches = window_batches(window_index, sizes)
    weights = [float(size) for size in sizes] if weighted else None
    params, opt_state, losses = host_scheduled.run_window(
      window, params, opt_state, batches, weights
    )
    all_losses += losses
  return params, opt_state, all_losses


OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-2),
  "sgd_momentum": lambda: optax.sgd(1e-1, momentum=0.9),
}


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
  ("sizes", "weighted"),
  [
    ((8, 8, 8, 8), False),  # equal micro-batches: the plain mean
    ((5, 11, 2, 6), True),  # unequal ones, each weighted by its rows
    ((3, 9), True),  # a first micro-step, then the closing one
    ((12,), False),  # k = 1: every call closes, the sums never kept
  ],
  ids=["equal", "weighted", "k2", "k1"],
)
def test_each_window_is_one_large_batch_step(optimizer_name, sizes, weighted):
  optimizer = OPTIMIZERS[optimizer_name]()
  params, opt_state, losses = host_scheduled_run(optimizer, sizes, weighted)
  expected_params, expected_state = large_batch_run(optimizer, sizes)
  for tree in (params, opt_state, losses):
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(tree))
  chex.assert_trees_all_close(params, expected_params, rtol=2e-5, atol=1e-6)
  chex.assert_trees_all_close(opt_state, expected_state, rtol=2e-5, atol=1e-6)
  # The params did move: an update lost would not pass for a rounding.
  moved = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), params,
                       initial_params())  # fmt: skip
  assert min(jax.tree.leaves(moved)) > 1e-3


def test_unweighted_mean_is_not_the_weighted_one():
  # The control for the weights: with unequal micro-batches the plain mean
  # of the micro-batch means is not the large batch's gradient.
  optimizer = optax.sgd(1e-1)
  sizes = (5, 11, 2, 6)
  params, _, _ = host_scheduled_run(optimizer, sizes, weighted=False)
  expected, _ = large_batch_run(optimizer, sizes)
  difference = testing.max_relative_difference(params, expected)
  assert difference > 1e-3


def test_the_micro_step_returns_the_micro_batch_loss_and_its_sums():
  window = host_scheduled.host_scheduled_window(loss_fn, optax.sgd(0.1), 3)
  params = initial_params()
  first, second = window_batches(0, (4, 6))[:2]
  sums, loss = window.micro_step(params, None, first, 4.0)
  np.testing.assert_allclose(loss, loss_fn(params, first), rtol=1e-6)
  sums, _ = window.micro_step(params, sums, second, 6.0)
  expected = jax.tree.map(
    lambda a, b: 4.0 * a + 6.0 * b,
    jax.grad(loss_fn)(params, first),
    jax.grad(loss_fn)(params, second),
  )
  chex.assert_trees_all_close(sums.gradients, expected, rtol=1e-5, atol=1e-6)
  assert float(sums.weight) == 10.0


def test_a_host_count_that_disagrees_with_the_sums_is_refused():
  window = host_scheduled.host_scheduled_window(loss_fn, optax.sgd(0.1), 3)
  params = initial_params()
  opt_state = window.init(params)
  batch = window_batches(0, (4,))[0]
  with pytest.raises(ValueError, match="disagree"):
    host_scheduled.scheduled_step(window, 1, params, opt_state, None, batch)
  sums, _ = window.micro_step(params, None, batch, None)
  with pytest.raises(ValueError, match="disagree"):
    host_scheduled.scheduled_step(window, 0, params, opt_state, sums, batch)
  with pytest.raises(ValueError, match="micro_step_index"):
    host_scheduled.scheduled_step(window, 3, params, opt_state, sums, batch)
  with pytest.raises(ValueError, match="every_k"):
    host_scheduled.host_scheduled_window(loss_fn, optax.sgd(0.1), 0)
  with pytest.raises(ValueError, match="micro-batches"):
    host_scheduled.run_window(window, params, opt_state, [batch])


def test_compiled_for_an_h100_it_moves_the_floor_and_holds_no_loop():
  """The 4 x 1024^2 MLP, Adam, k = 4, donated, as benchmarks/compiled.py
  compiles it: the micro-step at most 1.05x the floor's bytes, the closing
  step at most 1.35x a plain Adam step's, neither with control flow."""
  workload = workloads_lib.mlp(1024, 4, 8, 4)
  steps = compiled_steps.steps(workload)
  moved, copied = {}, {}
  for name in (
    compiled_steps.FLOOR,
    compiled_steps.HOST_FIRST_STEP,
    compiled_steps.HOST_MICRO_STEP,
    compiled_steps.HOST_CLOSING_STEP,
    "plain Adam",
    "ga_optax.accumulate",
  ):
    step, state, batch = steps[name]
    program = compiled_for_gpu(
      step, workload.params, state, batch, donate_argnums=(0, 1)
    )
    audit = compiled_steps.audit(program)["micro_step"]
    moved[name] = audit["moved_mib"]
    copied[name] = audit["copies_of_1_mib_or_more"]
    if name.startswith("host-scheduled"):
      text = program.as_text()
      assert " while(" not in text and " conditional(" not in text, name
  floor = moved[compiled_steps.FLOOR]
  assert floor <= moved[compiled_steps.HOST_MICRO_STEP] <= 1.05 * floor, moved
  assert moved[compiled_steps.HOST_FIRST_STEP] < floor, moved
  closing = moved[compiled_steps.HOST_CLOSING_STEP]
  assert closing <= 1.35 * moved["plain Adam"], moved
  # A micro-step copies nothing of 1 MiB or more (its weight sum, a scalar,
  # may be copied); the closing step no more than Adam does.
  assert copied[compiled_steps.HOST_FIRST_STEP] == 0, copied
  assert copied[compiled_steps.HOST_MICRO_STEP] == 0, copied
  assert copied[compiled_steps.HOST_CLOSING_STEP] <= copied["plain Adam"]
  # The control: ga_optax.accumulate's micro-step is far above the floor
  # (2.24x on this MLP), which a floor that lost its work would hide.
  assert moved["ga_optax.accumulate"] > 1.5 * floor, moved
