"""Regressions where two features meet, on 8 simulated devices.

Each test here failed before the window's modes became strategies: a
crash where ``skip_nonfinite`` met ``unreduced_axes``, partial-sum helpers
that dropped the accumulator's memory kind, ``inner_state_axes`` spec trees
that only Adam-like states fitted, optimizers closing over arrays made under
the mesh, and a loop audit that counted a window's closing collective once
per micro-step; and a step that weighed micro-steps by their tokens while
the devices within them weighed alike, silently inexact, now warns.
tests/test_combinations.py holds every combination to the large batch;
these pin the specific failures down.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
  assert_finite_and_close,
  init_params,
  make_windows,
  token_mean_loss,
  token_sum_loss,
  tokens,
  whole,
)
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src import audits
from ga_optax._src.placements import residency

DEVICES = 8
pytestmark = pytest.mark.devices(DEVICES)


def mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((DEVICES,), ("data",))


def unreduced_window(tx, windows, params, *, close=True):
  """Runs ``windows`` through ``tx`` under plain jit; returns params, state.

  Each window's last micro-step flushes it, but with ``close=False`` the
  last window's: it is left open, holding its partial sums.
  """
  value_and_grad = ga_optax.unreduced_value_and_grad(
    token_mean_loss, weight_fn=tokens
  )

  @jax.jit
  def step(params, state, batch, flush):
    _, grads = value_and_grad(params, batch)
    updates, state = tx.update(
      grads, state, params, weight=tokens(batch), flush=flush
    )
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  for number, window in enumerate(windows):
    last = len(window) - 1 if close or number < len(windows) - 1 else None
    for index, batch in enumerate(window):
      batch = jax.device_put(batch, P("data"))
      flush = jnp.asarray(index == last)
      params, state = step(params, state, batch, flush)
  return params, state


def test_skip_nonfinite_with_unreduced_axes_drops_the_bad_micro_step():
  windows = make_windows((3,), DEVICES, 2)
  bad = {name: array.copy() for name, array in windows[0][1].items()}
  bad["x"][np.flatnonzero(bad["mask"])[0], 0] = np.inf
  with_bad = [[windows[0][0], bad, windows[0][2]]]
  with jax.set_mesh(mesh()):
    params = jax.device_put(init_params(), P())
    tx = ga_optax.accumulate(
      optax.sgd(0.3), 3, unreduced_axes="data", skip_nonfinite=True
    )
    skipped, state = unreduced_window(tx, with_bad, params)
    clean = ga_optax.accumulate(optax.sgd(0.3), 3, unreduced_axes="data")
    expected, _ = unreduced_window(
      clean, [[windows[0][0], windows[0][2]]], params
    )
  assert int(ga_optax.num_skipped(state)) == 1
  assert_finite_and_close(skipped, expected)


@pytest.mark.parametrize("helper", ["stack", "consolidate"])
def test_partial_sums_keep_the_accumulator_in_host_memory(helper):
  windows = make_windows((2,), DEVICES, 2)
  with jax.set_mesh(mesh()):
    params = jax.device_put(init_params(), P())
    tx = ga_optax.accumulate(
      optax.sgd(0.3),
      2,
      unreduced_axes="data",
      accumulator_memory_kind="pinned_host",
    )
    like = tx.init(params)
    _, state = unreduced_window(tx, [windows[0][:1]], params, close=False)
    if helper == "stack":
      resumed = ga_optax.planning.unstack_partial_sums(
        ga_optax.planning.stack_partial_sums(state), like
      )
    else:
      resumed = ga_optax.planning.split_total(
        ga_optax.planning.consolidate(state), like
      )
  for leaf in jax.tree.leaves(resumed.accumulator):
    assert residency.kind_of(leaf) == "pinned_host"
    assert leaf.sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("helper", ["stack", "consolidate"])
def test_the_saved_partial_sums_stay_in_host_memory(helper):
  # The form a checkpoint saves, not only the state resumed from it: the
  # inverse helpers put the accumulator back where init keeps it anyway.
  windows = make_windows((2,), DEVICES, 2)
  first = windows[0][0]
  save = {
    "stack": ga_optax.planning.stack_partial_sums,
    "consolidate": ga_optax.planning.consolidate,
  }[helper]
  with jax.set_mesh(mesh()):
    params = jax.device_put(init_params(), P())
    tx = ga_optax.accumulate(
      optax.sgd(0.3),
      2,
      unreduced_axes="data",
      accumulator_memory_kind="pinned_host",
    )
    _, state = unreduced_window(tx, [[first]], params, close=False)
    saved = {"jit": jax.jit(save)(state), "eager": save(state)}
  # One micro-step of weight N holds N times its mean gradient: the
  # gradient of the token sum over its rows, whatever device holds them.
  expected = jax.grad(token_sum_loss)(init_params(), first)
  for mode, tree in saved.items():
    for leaf in jax.tree.leaves(tree.accumulator):
      assert residency.kind_of(leaf) == "pinned_host", mode
      assert leaf.sharding.memory_kind == "pinned_host", mode
    total = jax.device_get(tree.accumulator)
    if helper == "stack":
      assert all(leaf.shape[0] == DEVICES for leaf in jax.tree.leaves(total))
      total = jax.tree.map(lambda stacked: stacked.sum(0), total)
    assert_finite_and_close(total, expected)


def test_consolidate_inside_shard_map_keeps_host_memory():
  params = init_params()
  tx = ga_optax.accumulate(
    optax.sgd(0.3), 2, axis_name="data", accumulator_memory_kind="pinned_host"
  )

  def round_trip(state):
    consolidated = ga_optax.planning.consolidate(state, axis_name="data")
    return ga_optax.planning.split_total(consolidated, axis_name="data")

  in_map = jax.jit(
    jax.shard_map(
      round_trip, mesh=mesh(), in_specs=P(), out_specs=P(), check_vma=False
    )
  )
  with jax.set_mesh(mesh()):
    state = tx.init(jax.device_put(params, P()))
  for leaf in jax.tree.leaves(in_map(state).accumulator):
    assert residency.kind_of(leaf) == "pinned_host"


SPEC_TREE = {
  "w": P(None, "data"),
  "b": P(),
  "scale": P("data"),
  "w2": P("data", None),
}
OPTIMIZERS = {
  "adafactor": lambda: optax.adafactor(0.05),
  "masked": lambda: optax.masked(
    optax.adam(0.05), {"w": True, "b": False, "scale": True, "w2": True}
  ),
  "multi_transform": lambda: optax.multi_transform(
    {"adam": optax.adam(0.05), "sgd": optax.sgd(0.05)},
    {"w": "adam", "b": "sgd", "scale": "sgd", "w2": "adam"},
  ),
  "muon": lambda: optax.contrib.muon(0.05),
  "sm3": lambda: optax.sm3(0.05),
  # Arrays made under the mesh, typed with its Explicit axes.
  "adam_of_an_array": lambda: optax.adam(jnp.float32(0.05)),
  "schedule_of_arrays": lambda: optax.sgd(
    optax.piecewise_constant_schedule(jnp.float32(0.3), {1: jnp.float32(0.5)})
  ),
}


@pytest.mark.parametrize("placement", ["rule", "specs"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_state_steps_as_the_whole_state_does(name, placement):
  """ZeRO-1 with any optimizer, placed by the rule or a spec tree."""
  windows = make_windows((2, 3), DEVICES, 2)
  inner_state_axes = "data" if placement == "rule" else SPEC_TREE
  with jax.set_mesh(mesh()):
    params = jax.device_put(init_params(), P())
    sharded = ga_optax.accumulate(
      OPTIMIZERS[name](),
      3,
      unreduced_axes="data",
      inner_state_axes=inner_state_axes,
    )
    whole_state = ga_optax.accumulate(
      OPTIMIZERS[name](), 3, unreduced_axes="data"
    )
    actual, state = unreduced_window(sharded, windows, params)
    expected, _ = unreduced_window(whole_state, windows, params)
  assert int(ga_optax.applied_updates(state)) == 2
  assert_finite_and_close(actual, expected, rtol=2e-5, atol=2e-5)
  moved = jax.tree.map(
    lambda a, b: float(jnp.max(jnp.abs(a - b))), actual, init_params()
  )
  assert max(jax.tree.leaves(moved)) > 1e-3, moved


def test_a_spec_tree_places_each_moment_with_its_own_parameter():
  """Same-shaped parameters with different specs: each moment follows its own."""
  params = {"a": jnp.ones((16, 16)), "b": jnp.ones((16, 16))}
  specs = {"a": P("data", None), "b": P(None, "data")}
  with jax.set_mesh(mesh()):
    params = jax.device_put(params, P())
    tx = ga_optax.accumulate(
      optax.adam(0.1), 2, unreduced_axes="data", inner_state_axes=specs
    )
    state = tx.init(params)
  moments = state.inner_state[0]
  for name, spec in specs.items():
    for moment in (moments.mu[name], moments.nu[name]):
      assert moment.sharding.spec == spec, (name, moment.sharding.spec)


def test_loop_collectives_leave_out_a_closing_branch_inside_the_loop():
  """A window run as one lax.scan over tx.update reduces once, not k times."""
  k = 4
  tx = ga_optax.accumulate(optax.sgd(0.1), k, axis_name="data")
  params = {"w": jnp.ones((8, 8))}

  def window(params, state, grads):
    def micro_step(carry, grad):
      params, state = carry
      updates, state = tx.update(grad, state, params)
      return (optax.apply_updates(params, updates), state), None

    return jax.lax.scan(micro_step, (params, state), grads)[0]

  step = jax.shard_map(
    window,
    mesh=mesh(),
    in_specs=(P(), P(), P(None, "data")),
    out_specs=(P(), P()),
    check_vma=False,
  )
  with jax.set_mesh(mesh()):
    grads = jax.device_put(
      {"w": jnp.ones((k, 8 * DEVICES, 8))}, P(None, "data")
    )
    lowered = jax.jit(step).lower(params, tx.init(params), grads)
  text = lowered.compile().as_text()
  assert audits.loop_collectives(text) == []
  closing = audits.window_collectives(text).window_closing
  # The window's weight (a scalar, which says whether it steps) and its sum.
  assert sorted((c.opcode, c.operand_bytes) for c in closing) == [
    ("all-reduce", 4),
    ("all-reduce", 8 * 8 * 4),
  ], closing


def test_muon_with_whole_matrices_reduces_like_one_all_reduce():
  """Sharded by the rule, Muon gathers its matrices; kept whole, it does not."""
  params = init_params()
  whole_matrices = {"w": P(), "b": P("data"), "scale": P("data"), "w2": P()}

  def closing_bytes(inner_state_axes) -> tuple[int, int]:
    with jax.set_mesh(mesh()):
      placed = jax.device_put(params, P())
      tx = ga_optax.accumulate(
        optax.contrib.muon(0.05),
        1,
        unreduced_axes="data",
        inner_state_axes=inner_state_axes,
      )
      value_and_grad = ga_optax.unreduced_value_and_grad(token_mean_loss)

      def step(params, state, batch):
        _, grads = value_and_grad(params, batch)
        return tx.update(grads, state, params)

      batch = jax.device_put(
        whole(make_windows((1,), DEVICES, 2)[0]), P("data")
      )
      text = (
        jax.jit(step).lower(placed, tx.init(placed), batch).compile().as_text()
      )
    closing = audits.window_collectives(text).window_closing
    gathered = sum(c.operand_bytes for c in closing if c.opcode == "all-gather")
    return gathered, sum(c.operand_bytes for c in closing)

  parameter_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
  by_rule, _ = closing_bytes("data")
  kept_whole, total = closing_bytes(whole_matrices)
  assert by_rule > parameter_bytes  # the limit the docs state
  assert total <= 1.1 * parameter_bytes, (total, parameter_bytes)
  assert kept_whole < by_rule


@pytest.mark.parametrize("weight_fn", [None, tokens], ids=["alike", "counted"])
@pytest.mark.parametrize("weighted_update", [True, False])
def test_token_weights_without_per_device_counts_warn(
  weight_fn, weighted_update
):
  """A weighted micro-step whose devices were weighed alike is inexact: warn."""
  windows = make_windows((2,), DEVICES, 2)
  with jax.set_mesh(mesh()):
    params = jax.device_put(init_params(), P())
    tx = ga_optax.accumulate(optax.sgd(0.3), 2, unreduced_axes="data")
    value_and_grad = ga_optax.unreduced_value_and_grad(
      token_mean_loss, weight_fn=weight_fn
    )

    def step(params, state, batch):
      _, grads = value_and_grad(params, batch)
      weight = tokens(batch) if weighted_update else 1
      return tx.update(grads, state, params, weight=weight)

    batch = jax.device_put(windows[0][0], P("data"))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      jax.jit(step).lower(params, tx.init(params), batch)
  alike = [w for w in caught if "weight_fn" in str(w.message)]
  assert bool(alike) == (weight_fn is None and weighted_update), caught
