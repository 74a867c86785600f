"""accumulate(axis_name=...) inside jax.shard_map and jax.pmap, on 8 devices.

Each device accumulates its own micro-batches and the devices reduce once,
where the window closes. Every run is held to the one-device large batch of
tests/helpers.py (plain SGD, per-device token weights, windows of
unequal weight, one closed by a flush), and the compiled step of each run to
where its collectives are.

Last, with shard_map's default check_vma=True on a small linear model:
``microbatched_value_and_grad(axis_name=...)`` against the whole batch's
gradient, ``accumulate(axis_name=...)`` on 1 and 8 devices against plain SGD
on each window's mean gradient, and ``consolidate`` and ``split_total``
refusing such a shard_map.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
  SGD,
  assert_finite_and_close,
  assert_strictly_close,
  init_params,
  large_batch_reference,
  linear_batch,
  linear_loss,
  linear_params,
  make_windows,
  micro_steps,
  one_device_mesh,
  put,
  token_mean_loss,
  token_sum_loss,
  tokens,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src import audits

DEVICES = 8
ROWS = 2  # per device and micro-step
K = 3
# The second window is closed by a flush after 2 micro-steps.
LENGTHS = (3, 2, 3)


def data_mesh(devices: int = DEVICES) -> Mesh:
  return Mesh(np.array(jax.devices()[:devices]), ("data",))


def tree_bytes(tree: Any) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def local_token_step(tx: optax.GradientTransformationExtraArgs):
  """One micro-step on a device's rows, weighted by its real tokens."""

  def step(params, state, batch, flush):
    grads = jax.grad(token_mean_loss)(params, batch)
    updates, state = tx.update(
      grads, state, params, weight=tokens(batch), flush=flush
    )
    return optax.apply_updates(params, updates), state

  return step


def summed_token_step(tx: optax.GradientTransformationExtraArgs):
  """The same micro-step where autodiff sums the gradient (check_vma=True).

  The weight must be the same on every device: the micro-batch's tokens on
  all of them. Autodiff sums the devices' gradients, and the window divides
  by the devices times the weights, so each device's loss is its token sum
  over the micro-batch's mean tokens per device.
  """

  def step(params, state, batch, flush):
    weight = jax.lax.psum(tokens(batch), "data")
    per_device = weight / jax.lax.axis_size("data")
    grads = jax.grad(lambda p: token_sum_loss(p, batch) / per_device)(params)
    updates, state = tx.update(grads, state, params, weight=weight, flush=flush)
    return optax.apply_updates(params, updates), state

  return step


def shard_step(step, mesh: Mesh, check_vma: bool):
  return jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P()),
      out_specs=(P(), P()),
      check_vma=check_vma,
    )
  )


def run_windows(step, params, state, windows, mesh):
  """Runs every micro-step; checks that exactly the windows' last emit."""
  batch_sharding = NamedSharding(mesh, P("data"))
  closing = np.cumsum([len(window) for window in windows]) - 1
  for index, (batch, flush) in enumerate(micro_steps(windows, K)):
    params, state = step(
      params, state, jax.device_put(batch, batch_sharding), jnp.bool_(flush)
    )
    assert bool(ga_optax.emitted(state)) == (index in closing), index
  return params, state


OPTIMIZERS = {
  "sgd": SGD,
  # A schedule and a decoupled weight decay: the inner optimizer steps once
  # per window, flush included.
  "adamw_schedule": optax.adamw(
    optax.linear_schedule(0.05, 0.01, len(LENGTHS)), weight_decay=1e-2
  ),
}


@pytest.mark.smoke
@pytest.mark.parametrize("skip_nonfinite", [False, True])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_shard_map_matches_the_large_batch(optimizer, skip_nonfinite):
  """check_vma=False: per-device partial sums, one all-reduce per window."""
  inner = OPTIMIZERS[optimizer]
  windows = make_windows(LENGTHS, DEVICES, ROWS, seed=1)
  tx = ga_optax.accumulate(
    inner, K, axis_name="data", skip_nonfinite=skip_nonfinite
  )
  mesh = data_mesh()
  params = init_params()
  run = list(micro_steps(windows, K))
  if skip_nonfinite:
    # A micro-step with a NaN on one device is dropped on every device.
    poisoned = {**run[1][0], "x": run[1][0]["x"].copy()}
    poisoned["x"][-1, 0] = np.nan
    run.insert(1, (poisoned, False))
  step = shard_step(local_token_step(tx), mesh, check_vma=False)
  step = step.lower(params, tx.init(params), *run[0]).compile()

  found = audits.window_collectives(step.as_text())
  # skip_nonfinite adds one scalar vote per micro-step, and nothing else.
  votes = [("all-reduce", 4)] if skip_nonfinite else []
  assert [(c.opcode, c.operand_bytes) for c in found.every_micro_step] == (
    votes
  ), found
  # The weight sum and the accumulator, once each, in the closing branch:
  # the weight first, since it says whether the window steps.
  assert sorted((c.opcode, c.operand_bytes) for c in found.window_closing) == [
    ("all-reduce", 4),
    ("all-reduce", tree_bytes(params)),
  ], found

  state = tx.init(params)
  batch_sharding = NamedSharding(mesh, P("data"))
  for batch, flush in run:
    params, state = step(
      params, state, jax.device_put(batch, batch_sharding), jnp.bool_(flush)
    )
  assert int(ga_optax.applied_updates(state)) == len(LENGTHS)
  assert int(state.num_skipped) == int(skip_nonfinite)
  assert_finite_and_close(
    params, large_batch_reference(inner, init_params(), windows)
  )


def test_shard_map_with_check_vma_matches_the_large_batch():
  """check_vma=True: gradients come summed; the window sums only weights."""
  windows = make_windows(LENGTHS, DEVICES, ROWS, seed=2)
  tx = ga_optax.accumulate(SGD, K, axis_name="data")
  mesh = data_mesh()
  params = init_params()
  step = shard_step(summed_token_step(tx), mesh, check_vma=True)
  first = next(micro_steps(windows, K))
  compiled = step.lower(params, tx.init(params), *first).compile()

  found = audits.window_collectives(compiled.as_text())
  # Autodiff's all-reduce of the gradient on every micro-step (and the
  # weight's); at the close only the scalar weight sum.
  assert sum(c.operand_bytes for c in found.every_micro_step) >= tree_bytes(
    params
  ), found
  assert [(c.opcode, c.operand_bytes) for c in found.window_closing] == [
    ("all-reduce", 4)
  ], found

  final, state = run_windows(compiled, params, tx.init(params), windows, mesh)
  assert int(ga_optax.applied_updates(state)) == len(LENGTHS)
  assert_finite_and_close(
    final, large_batch_reference(SGD, init_params(), windows)
  )


def test_check_vma_refuses_gradients_that_vary():
  tx = ga_optax.accumulate(SGD, K, axis_name="data")
  mesh = data_mesh()
  batch, flush = next(micro_steps(make_windows((1,), DEVICES, ROWS), K))

  def varying_step(params, state, batch, flush):
    local = jax.lax.pcast(params, "data", to="varying")
    grads = jax.grad(token_mean_loss)(local, batch)
    return tx.update(grads, state, params, flush=flush)

  with pytest.raises(ValueError, match="check_vma=False"):
    shard_step(varying_step, mesh, check_vma=True)(
      init_params(), tx.init(init_params()), batch, flush
    )


def test_pmap_matches_the_large_batch():
  """The same under pmap: one copy of params and state per device."""
  windows = make_windows(LENGTHS, DEVICES, ROWS, seed=3)
  tx = ga_optax.accumulate(SGD, K, axis_name="batch")
  step = jax.pmap(
    local_token_step(tx), axis_name="batch", in_axes=(0, 0, 0, None)
  )
  params, state = jax.tree.map(
    lambda leaf: np.broadcast_to(leaf, (DEVICES, *np.shape(leaf))),
    (init_params(), tx.init(init_params())),
  )

  def per_device(batch):
    return jax.tree.map(
      lambda leaf: leaf.reshape(DEVICES, ROWS, *leaf.shape[1:]), batch
    )

  first = per_device(windows[0][0])
  text = step.lower(params, state, first, False).compile().as_text()
  found = audits.window_collectives(text)
  assert found.every_micro_step == [], found
  assert sum(c.operand_bytes for c in found.window_closing) == (
    tree_bytes(init_params()) + 4
  ), found

  for batch, flush in micro_steps(windows, K):
    params, state = step(params, state, per_device(batch), jnp.bool_(flush))
  copies = [jax.tree.map(lambda leaf, d=d: leaf[d], params) for d in range(8)]
  for copy in copies[1:]:
    assert_finite_and_close(copy, copies[0], rtol=0, atol=0)
  assert_finite_and_close(
    copies[0], large_batch_reference(SGD, init_params(), windows)
  )


def test_the_audit_sees_a_reduction_on_every_micro_step():
  """A naive step that averages gradients before accumulating them."""
  tx = ga_optax.accumulate(SGD, K)
  mesh = data_mesh()
  params = init_params()
  batch, flush = next(micro_steps(make_windows((1,), DEVICES, ROWS), K))

  def naive_step(params, state, batch, flush):
    grads = jax.lax.pmean(jax.grad(token_mean_loss)(params, batch), "data")
    updates, state = tx.update(grads, state, params, flush=flush)
    return optax.apply_updates(params, updates), state

  step = shard_step(naive_step, mesh, check_vma=False)
  found = audits.window_collectives(
    step.lower(params, tx.init(params), batch, flush).compile().as_text()
  )
  assert found.window_closing == [] and found.closing_branch is None, found
  assert sum(c.operand_bytes for c in found.every_micro_step) == tree_bytes(
    params
  ), found


@pytest.mark.parametrize("check_vma", [False, True])
def test_microbatched_value_and_grad_reduces_after_the_scan(check_vma):
  """microbatched_value_and_grad(axis_name=...): the global token mean."""
  num_microbatches, rows = 4, 4
  (window,) = make_windows((1,), DEVICES, num_microbatches * rows, seed=4)
  (batch,) = window
  params = init_params()
  value_and_grad = ga_optax.microbatched_value_and_grad(
    token_mean_loss, num_microbatches, weight_fn=tokens, axis_name="data"
  )
  compute = jax.jit(
    jax.shard_map(
      value_and_grad,
      mesh=data_mesh(),
      in_specs=(P(), P("data")),
      out_specs=(P(), P()),
      check_vma=check_vma,
    )
  ).lower(params, batch)
  compiled = compute.compile()
  module = audits.parse_hlo(compiled.as_text())
  assert any(
    instruction.opcode == "while"
    for instructions in module.computations.values()
    for instruction in instructions
  ), "expected the scan over micro-batches to compile to a while"
  assert audits.loop_collectives(module) == []
  # Each device multiplies its own rows of each micro-batch.
  dots = audits.dot_shapes(module)
  assert all(lhs.startswith(f"f32[{rows},") for lhs, _ in dots), dots
  everywhere = audits.collectives_in_hlo(
    module, audits.reachable(module, module.entry)
  )
  # After the scan: the gradient, value and weight sums, once.
  assert sum(c.operand_bytes for c in everywhere) == (tree_bytes(params) + 8), (
    everywhere
  )

  expected = jax.value_and_grad(token_mean_loss)(params, batch)
  assert_finite_and_close(compiled(params, batch), expected)


def on_each_device(function, mesh: Mesh):
  """``function(state)`` run on every device of ``mesh``, in shard_map."""
  return jax.jit(
    jax.shard_map(
      function, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False
    )
  )


def test_consolidated_on_8_devices_resumes_on_2():
  """A mid-window state, consolidated, goes on on another device count."""
  windows = make_windows(LENGTHS, DEVICES, ROWS, seed=5)
  run = list(micro_steps(windows, K))
  saved_after = 4  # one micro-step into the flushed window
  tx = ga_optax.accumulate(SGD, K, axis_name="data")
  eight, two = data_mesh(), data_mesh(2)
  params, state = init_params(), tx.init(init_params())
  step = shard_step(local_token_step(tx), eight, check_vma=False)
  for batch, flush in run[:saved_after]:
    batch = jax.device_put(batch, NamedSharding(eight, P("data")))
    params, state = step(params, state, batch, jnp.bool_(flush))
  consolidate = functools.partial(
    ga_optax.planning.consolidate, axis_name="data"
  )
  state = on_each_device(consolidate, eight)(state)
  # What a checkpoint holds: host arrays, placed anew on 2 devices.
  params, state = jax.device_get((params, state))
  split_total = functools.partial(
    ga_optax.planning.split_total, axis_name="data"
  )
  state = on_each_device(split_total, two)(state)
  step = shard_step(local_token_step(tx), two, check_vma=False)
  for batch, flush in run[saved_after:]:
    batch = jax.device_put(batch, NamedSharding(two, P("data")))
    params, state = step(params, state, batch, jnp.bool_(flush))
  assert int(ga_optax.applied_updates(state)) == len(LENGTHS)
  assert_finite_and_close(
    params, large_batch_reference(SGD, init_params(), windows)
  )


# A linear model (tests/helpers.py) in NUM_MICROBATCHES micro-batches,
# in shard_map on a mesh of this machine's one device.
NUM_MICROBATCHES = 4


@pytest.mark.parametrize("check_vma", [True, False])
def test_microbatched_axis_name_inside_shard_map(check_vma):
  mesh = one_device_mesh()
  params, batch = (
    put(linear_params(), mesh, P()),
    put(linear_batch(), mesh, P("data")),
  )
  value_and_grad = ga_optax.microbatched_value_and_grad(
    linear_loss, NUM_MICROBATCHES, axis_name="data"
  )
  sharded = jax.jit(
    jax.shard_map(
      value_and_grad,
      mesh=mesh,
      in_specs=(P(), P("data")),
      out_specs=(P(), P()),
      check_vma=check_vma,
    )
  )
  expected = jax.value_and_grad(linear_loss)(linear_params(), linear_batch())
  assert_strictly_close(sharded(params, batch), expected)
  without_shard_map = ga_optax.microbatched_value_and_grad(
    linear_loss, NUM_MICROBATCHES
  )(linear_params(), linear_batch())
  assert_strictly_close(sharded(params, batch), without_shard_map)


# Windows of micro-batches of unequal size (weight = rows), the second closed
# by a flush: a wrong gradient scale moves plain SGD somewhere else.
_WINDOW_ROWS = ((8, 16), (24,), (16, 8))


@pytest.mark.parametrize(
  "num_devices", [1, pytest.param(8, marks=pytest.mark.devices(8))]
)
def test_accumulate_axis_name_inside_shard_map_with_check_vma(num_devices):
  # With check_vma=True the gradients of unvarying params arrive summed over
  # the devices by autodiff; the window must sum only the weights.
  mesh = jax.make_mesh(
    (num_devices,), ("data",), devices=jax.devices()[:num_devices]
  )
  optimizer = optax.sgd(0.5)
  tx = ga_optax.accumulate(optimizer, 2, axis_name="data")

  def step(params, state, x, y, flush):
    grads = jax.grad(linear_loss)(params, {"x": x, "y": y})
    # Each device's rows: the same number on every device.
    updates, state = tx.update(
      grads, state, params, weight=x.shape[0], flush=flush
    )
    return optax.apply_updates(params, updates), state

  sharded_step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P("data"), P()),
      out_specs=(P(), P()),
      check_vma=True,
    )
  )
  params = put(linear_params(), mesh, P())
  state = put(tx.init(linear_params()), mesh, P())
  expected, expected_state = (
    linear_params(),
    optimizer.init(linear_params()),
  )
  rng = np.random.default_rng(7)
  for window in _WINDOW_ROWS:
    batches = [
      {
        "x": jnp.asarray(rng.standard_normal((rows, 3)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((rows, 2)), jnp.float32),
      }
      for rows in window
    ]
    for index, batch in enumerate(batches):
      closes = index == len(window) - 1
      params, state = sharded_step(
        params,
        state,
        *put((batch["x"], batch["y"]), mesh, P("data")),
        jnp.bool_(closes and len(window) < 2),
      )
      assert bool(ga_optax.emitted(state)) == closes
    # The reference: the gradient of the window's mean loss, bare SGD.
    whole = jax.tree.map(lambda *rows: jnp.concatenate(rows), *batches)
    updates, expected_state = optimizer.update(
      jax.grad(linear_loss)(expected, whole), expected_state
    )
    expected = optax.apply_updates(expected, updates)
  assert_strictly_close(params, expected)
  assert int(ga_optax.applied_updates(state)) == len(_WINDOW_ROWS)


@pytest.mark.parametrize(
  "combine", [ga_optax.planning.consolidate, ga_optax.planning.split_total]
)
def test_partial_sum_helpers_refuse_a_shard_map_that_checks_variance(combine):
  # With check_vma=True the window holds gradients already summed over the
  # devices: combining them as partial sums would scale them wrongly.
  tx = ga_optax.accumulate(optax.sgd(0.1), 2, axis_name="data")
  params = jnp.zeros(3)

  def step(state):
    return combine(state, axis_name="data")

  mapped = jax.shard_map(
    step, mesh=one_device_mesh(), in_specs=P(), out_specs=P()
  )
  with pytest.raises(ValueError, match="check_vma=False"):
    jax.jit(mapped)(tx.init(params))
