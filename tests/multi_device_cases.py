"""Multi-device checks of ga_optax, run in a process of their own.

A test process has already imported jax with one CPU device, so
tests/test_distributed.py runs each case here with ``sys.executable`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` in the environment:
``python tests/multi_device_cases.py CASE``. A case raises on failure, so the
exit status is the verdict and the traceback is the explanation.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax import testing

# Float32 tolerance: a sum over devices and micro-steps adds in another order
# than one sum over the large batch.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def init_params(seed: int = 0) -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(seed), 2)
  return {
    "hidden": jax.random.normal(keys[0], (5, 8)) / 2,
    "out": jax.random.normal(keys[1], (8, 2)) / 3,
    "bias": jnp.zeros(2),
  }


def per_example_loss(params, x, y):
  prediction = jnp.tanh(x @ params["hidden"]) @ params["out"] + params["bias"]
  return jnp.sum((prediction - y) ** 2, axis=-1)


def mean_loss(params, x, y):
  return jnp.mean(per_example_loss(params, x, y))


def make_data(num_samples: int, seed: int = 1) -> tuple[jax.Array, jax.Array]:
  keys = jax.random.split(jax.random.key(seed), 2)
  x = jax.random.normal(keys[0], (num_samples, 5))
  y = jax.random.normal(keys[1], (num_samples, 2))
  return x, y


def large_batch_run(optimizer, params, x_windows, y_windows):
  """One optimizer step per window on the window's whole batch, one device."""

  @jax.jit
  def step(params, opt_state, x, y):
    grads = jax.grad(mean_loss)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = optimizer.init(params)
  for x, y in zip(x_windows, y_windows, strict=True):
    params, opt_state = step(params, opt_state, x, y)
  return params


def device_local_step(tx, loss_fn=mean_loss):
  """The reference usage: one micro-step, per device, inside shard_map."""

  def step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params, weight=x.shape[0])
    return optax.apply_updates(params, updates), state

  return step


def shard_step(step: Callable, mesh: Mesh) -> Callable:
  return jax.shard_map(
    step,
    mesh=mesh,
    in_specs=(P(), P(), P("data"), P("data")),
    out_specs=(P(), P()),
    check_vma=False,
  )


def microbatches_of(x_window, num_devices, microbatch, num_micro_steps):
  """Micro-step ``s`` gives device ``d`` rows ``[(d*k + s)*m, +m)``.

  Any assignment of a window's rows to (device, micro-step) is equivalent;
  this one checks that nothing depends on devices seeing contiguous rows.
  """
  per_device = x_window.reshape(num_devices, num_micro_steps, microbatch, -1)
  return [
    per_device[:, step].reshape(num_devices * microbatch, -1)
    for step in range(num_micro_steps)
  ]


def check_shard_map_matches_large_batch() -> None:
  """3 devices x micro-batch 3 x 2 micro-steps: each update uses all 18."""
  num_devices, microbatch, num_micro_steps, num_windows = 3, 3, 2, 3
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",))
  window = num_devices * microbatch * num_micro_steps
  x, y = make_data(num_windows * window)
  x_windows, y_windows = (
    x.reshape(num_windows, window, -1),
    y.reshape(num_windows, window, -1),
  )
  optimizers = {
    "adamw_schedule": optax.adamw(
      optax.linear_schedule(0.05, 0.01, 3), weight_decay=1e-2
    ),
    "clip_momentum": optax.chain(
      optax.clip_by_global_norm(0.5), optax.sgd(0.1, momentum=0.9)
    ),
  }
  for name, optimizer in optimizers.items():
    expected = large_batch_run(optimizer, init_params(), x_windows, y_windows)
    tx = ga_optax.accumulate(optimizer, num_micro_steps, axis_name="data")
    # Under jit only: shard_map outside jit dispatches op by op (seconds per
    # step even at this size).
    step = jax.jit(shard_step(device_local_step(tx), mesh))
    params = init_params()
    state = tx.init(params)
    for x_window, y_window in zip(x_windows, y_windows, strict=True):
      micro_steps = zip(
        microbatches_of(x_window, num_devices, microbatch, num_micro_steps),
        microbatches_of(y_window, num_devices, microbatch, num_micro_steps),
        strict=True,
      )
      for micro_step, (x_micro, y_micro) in enumerate(micro_steps):
        params, state = step(params, state, x_micro, y_micro)
        closes = micro_step == num_micro_steps - 1
        assert bool(ga_optax.emitted(state)) == closes, (name, micro_step)
    chex.assert_trees_all_close(params, expected, **TOLERANCE)
    assert int(state.update_step) == num_windows, name
  print("3 devices x 3 x 2 = 18 samples per update: matches the large batch")


def masked_mean_loss(params, tokens, targets):
  """Mean loss over real tokens; a row's padding has target NaN."""
  real = ~jnp.isnan(targets[..., 0])
  clean_targets = jnp.where(real[..., None], targets, 0.0)
  losses = per_example_loss(params, tokens, clean_targets)
  # A micro-batch with no real token has loss 0 and weight 0, not 0 / 0.
  return jnp.sum(jnp.where(real, losses, 0.0)) / jnp.maximum(real.sum(), 1)


def check_per_device_weights_give_global_token_mean() -> None:
  """Devices see different real-token counts; the update is the token mean."""
  num_devices, microbatch, num_micro_steps, num_windows = 4, 6, 3, 2
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",))
  window = num_devices * microbatch * num_micro_steps
  tokens, targets = make_data(num_windows * window, seed=2)
  rng = np.random.default_rng(0)
  real = rng.random(num_windows * window) < 0.6
  # One device's micro-batch holds padding only: weight 0 on that device.
  real[:microbatch] = False
  targets = jnp.where(jnp.asarray(real)[:, None], targets, jnp.nan)
  tokens_windows = tokens.reshape(num_windows, window, -1)
  targets_windows = targets.reshape(num_windows, window, -1)
  optimizer = optax.adam(0.05)

  @jax.jit
  def large_batch_step(params, opt_state, tokens, targets):
    grads = jax.grad(masked_mean_loss)(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  expected, opt_state = init_params(), optimizer.init(init_params())
  for tokens_window, targets_window in zip(
    tokens_windows, targets_windows, strict=True
  ):
    expected, opt_state = large_batch_step(
      expected, opt_state, tokens_window, targets_window
    )

  tx = ga_optax.accumulate(optimizer, num_micro_steps, axis_name="data")

  def step(params, state, tokens, targets):
    grads = jax.grad(masked_mean_loss)(params, tokens, targets)
    num_real = jnp.sum(~jnp.isnan(targets[..., 0]))
    updates, state = tx.update(grads, state, params, weight=num_real)
    return optax.apply_updates(params, updates), state

  step = jax.jit(shard_step(step, mesh))
  params, state = init_params(), tx.init(init_params())
  for tokens_window, targets_window in zip(
    tokens_windows, targets_windows, strict=True
  ):
    for tokens_micro, targets_micro in zip(
      microbatches_of(tokens_window, num_devices, microbatch, num_micro_steps),
      microbatches_of(targets_window, num_devices, microbatch, num_micro_steps),
      strict=True,
    ):
      params, state = step(params, state, tokens_micro, targets_micro)
  chex.assert_trees_all_close(params, expected, **TOLERANCE)
  print("per-device token counts: matches the large batch's token mean")


def check_pmap_matches_large_batch() -> None:
  """The same guarantee under pmap with a named axis."""
  num_devices, microbatch, num_micro_steps, num_windows = 8, 2, 2, 2
  window = num_devices * microbatch * num_micro_steps
  x, y = make_data(num_windows * window, seed=3)
  x_windows = x.reshape(num_windows, window, -1)
  y_windows = y.reshape(num_windows, window, -1)
  optimizer = optax.adam(0.05)
  expected = large_batch_run(optimizer, init_params(), x_windows, y_windows)

  tx = ga_optax.accumulate(optimizer, num_micro_steps, axis_name="batch")
  step = jax.pmap(device_local_step(tx), axis_name="batch")
  # pmap keeps one copy of params and state per device: between closing
  # steps each device's accumulator holds its own partial sum.
  params, state = jax.tree.map(
    lambda leaf: jnp.broadcast_to(leaf, (num_devices, *leaf.shape)),
    (init_params(), tx.init(init_params())),
  )
  for x_window, y_window in zip(x_windows, y_windows, strict=True):
    for x_micro, y_micro in zip(
      microbatches_of(x_window, num_devices, microbatch, num_micro_steps),
      microbatches_of(y_window, num_devices, microbatch, num_micro_steps),
      strict=True,
    ):
      params, state = step(
        params,
        state,
        x_micro.reshape(num_devices, microbatch, -1),
        y_micro.reshape(num_devices, microbatch, -1),
      )
  per_device = [
    jax.tree.map(lambda leaf, d=d: leaf[d], params) for d in range(num_devices)
  ]
  chex.assert_trees_all_equal(*per_device)
  params = per_device[0]
  chex.assert_trees_all_close(params, expected, **TOLERANCE)
  print("pmap: matches the large batch")


def tree_bytes(tree) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def check_hlo_collectives_only_where_window_closes() -> None:
  """The compiled step reduces once, in the closing branch, and nowhere else."""
  num_devices = 8
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",))
  x, y = make_data(num_devices * 2)
  params = init_params()
  accumulator_bytes = tree_bytes(params) + 4  # and the f32 weight sum

  tx = ga_optax.accumulate(optax.adam(1e-2), 4, axis_name="data")
  step = jax.jit(shard_step(device_local_step(tx), mesh))
  text = step.lower(params, tx.init(params), x, y).compile().as_text()
  found = testing.window_collectives(text)
  assert found.every_micro_step == [], found
  assert [c.opcode for c in found.window_closing] == ["all-reduce"], found
  assert found.window_closing[0].operand_bytes == accumulator_bytes, found

  # pmap compiles the same program per device: the same audit holds.
  pmapped = jax.pmap(
    device_local_step(tx), axis_name="data", in_axes=(None, None, 0, 0)
  )
  text = (
    pmapped.lower(
      params,
      tx.init(params),
      x.reshape(num_devices, 2, -1),
      y.reshape(num_devices, 2, -1),
    )
    .compile()
    .as_text()
  )
  found = testing.window_collectives(text)
  assert found.every_micro_step == [], found
  assert sum(c.operand_bytes for c in found.window_closing) == accumulator_bytes

  # skip_nonfinite adds exactly one scalar vote per micro-step.
  tx = ga_optax.accumulate(
    optax.adam(1e-2), 4, axis_name="data", skip_nonfinite=True
  )
  step = jax.jit(shard_step(device_local_step(tx), mesh))
  text = step.lower(params, tx.init(params), x, y).compile().as_text()
  found = testing.window_collectives(text)
  assert [(c.opcode, c.operand_bytes) for c in found.every_micro_step] == [
    ("all-reduce", 4)
  ], found
  assert sum(c.operand_bytes for c in found.window_closing) == accumulator_bytes

  # The audit sees a reduction on every micro-step when there is one: a
  # naive loop that averages gradients before accumulating them.
  tx = ga_optax.accumulate(optax.adam(1e-2), 4)

  def naive_step(params, state, x, y):
    grads = jax.lax.pmean(jax.grad(mean_loss)(params, x, y), "data")
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(shard_step(naive_step, mesh))
  text = step.lower(params, tx.init(params), x, y).compile().as_text()
  found = testing.window_collectives(text)
  assert found.window_closing == [] and found.closing_branch is None, found
  assert sum(c.operand_bytes for c in found.every_micro_step) == tree_bytes(
    params
  ), found
  print("HLO: one all-reduce, in the closing branch, of the accumulator")


def check_microbatched_reduces_after_the_scan() -> None:
  """microbatched_value_and_grad(axis_name=...): no collective in the loop."""
  num_devices, num_microbatches = 8, 4
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",))
  x, y = make_data(num_devices * num_microbatches * 2, seed=4)
  params = init_params()
  value_and_grad = ga_optax.microbatched_value_and_grad(
    lambda params, batch: mean_loss(params, *batch),
    num_microbatches,
    axis_name="data",
  )
  compute = jax.jit(
    jax.shard_map(
      lambda params, x, y: value_and_grad(params, (x, y)),
      mesh=mesh,
      in_specs=(P(), P("data"), P("data")),
      out_specs=(P(), P()),
      check_vma=False,
    )
  )
  loss, grads = compute(params, x, y)
  expected_loss, expected_grads = jax.value_and_grad(mean_loss)(params, x, y)
  chex.assert_trees_all_close(loss, expected_loss, **TOLERANCE)
  chex.assert_trees_all_close(grads, expected_grads, **TOLERANCE)

  module = testing.parse_hlo(compute.lower(params, x, y).compile().as_text())
  assert any(
    instruction.opcode == "while"
    for instructions in module.computations.values()
    for instruction in instructions
  ), "expected the scan over micro-batches to compile to a while"
  in_loops = testing.loop_collectives(module)
  assert in_loops == [], in_loops
  # Each device multiplies its own rows of each micro-batch: 64 / (4 * 8).
  dots = testing.dot_shapes(module)
  assert ("f32[2,5]", "f32[5,8]") in dots, dots
  assert all(lhs.startswith("f32[2,") for lhs, _ in dots), dots
  everywhere = testing.collectives_in_hlo(
    module, testing.reachable(module, module.entry)
  )
  # One all-reduce after the scan: gradient sum, value sum and weight sum.
  assert [c.opcode for c in everywhere] == ["all-reduce"], everywhere
  assert everywhere[0].operand_bytes == tree_bytes(params) + 8, everywhere
  print("microbatched: reductions after the scan only:", everywhere)


def assert_same_shardings(actual, expected) -> None:
  for path_and_leaf, expected_leaf in zip(
    jax.tree_util.tree_flatten_with_path(actual)[0],
    jax.tree.leaves(expected),
    strict=True,
  ):
    path, leaf = path_and_leaf
    assert leaf.sharding.is_equivalent_to(expected_leaf.sharding, leaf.ndim), (
      f"{jax.tree_util.keystr(path)}: {leaf.sharding} is not"
      f" {expected_leaf.sharding}"
    )


def check_sharded_params_and_state() -> None:
  """FSDP-style: params and state sharded over a data x model mesh."""
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  params = {
    "hidden": jax.random.normal(jax.random.key(0), (8, 16)) / 3,
    "out": jax.random.normal(jax.random.key(1), (16, 4)) / 4,
  }
  specs = {"hidden": P("data", "model"), "out": P("model", "data")}
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
  params = jax.device_put(params, shardings)
  batch_sharding = NamedSharding(mesh, P("data"))

  def loss_fn(params, x, y):
    prediction = jnp.tanh(x @ params["hidden"]) @ params["out"]
    return jnp.mean((prediction - y) ** 2)

  optimizer = optax.adam(0.05)
  tx = ga_optax.accumulate(optimizer, 2)
  # Eager init makes zeros with each parameter's sharding; jax.jit(tx.init)
  # without out_shardings would put them on one device.
  state = tx.init(params)
  assert_same_shardings(state.accumulator, params)
  # Under jit, optax.tree_map_params gives the state's shardings: the
  # params' for params-shaped leaves, replicated for counters.
  state_shardings = optax.tree_map_params(
    tx,
    lambda _, param: param.sharding,
    jax.eval_shape(tx.init, params),
    params,
    transform_non_params=lambda _: NamedSharding(mesh, P()),
  )
  jitted_state = jax.jit(tx.init, out_shardings=state_shardings)(params)
  assert_same_shardings(jitted_state.accumulator, params)
  assert_same_shardings(jitted_state.inner_state[0].mu, params)

  def step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def plain_step(params, opt_state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  x, y = make_data(3 * 2 * 16, seed=5)
  x = jnp.concatenate([x, x[:, :3]], axis=1)  # 8 features
  y = jnp.concatenate([y, y], axis=1)  # 4 outputs
  step = jax.jit(step, donate_argnums=(0, 1))
  compiled = step.lower(params, state, x[:16], y[:16]).compile()

  # The accumulator and the optimizer state leave with the params' sharding.
  state_out = compiled.output_shardings[1]
  for leaf_sharding, spec in zip(
    jax.tree.leaves(state_out.accumulator), jax.tree.leaves(specs), strict=True
  ):
    assert leaf_sharding.spec == spec, (leaf_sharding, spec)
  # Nothing moves between devices when the window closes (the optimizer
  # works on its shards), and accumulating gathers nothing the plain step
  # does not: XLA's per-micro-step gradient reduction is all there is.
  found = testing.window_collectives(compiled.as_text())
  assert found.window_closing == [], found
  plain_compiled = (
    jax.jit(plain_step)
    .lower(params, optimizer.init(params), x[:16], y[:16])
    .compile()
  )
  plain = testing.collectives_in_hlo(
    testing.parse_hlo(plain_compiled.as_text())
  )
  gathered = sorted(
    c.operand_bytes for c in found.every_micro_step if "gather" in c.opcode
  )
  plain_gathered = sorted(
    c.operand_bytes for c in plain if "gather" in c.opcode
  )
  assert gathered == plain_gathered, (gathered, plain_gathered)
  shard_bytes = {
    name: leaf.addressable_shards[0].data.nbytes
    for name, leaf in state.accumulator.items()
  }

  reference = jax.device_get(params)
  opt_state = optimizer.init(reference)
  for window in range(3):
    rows = slice(window * 32, (window + 1) * 32)
    reference, opt_state = jax.jit(plain_step)(
      reference, opt_state, x[rows], y[rows]
    )
    for half in (0, 16):
      micro = slice(window * 32 + half, window * 32 + half + 16)
      params, state = step(
        params,
        state,
        jax.device_put(x[micro], batch_sharding),
        jax.device_put(y[micro], batch_sharding),
      )
  assert_same_shardings(state.accumulator, params)
  for name, leaf in state.accumulator.items():
    assert leaf.addressable_shards[0].data.nbytes == shard_bytes[name]
    assert shard_bytes[name] * 8 == leaf.nbytes
  chex.assert_trees_all_close(jax.device_get(params), reference, **TOLERANCE)
  print("sharded: accumulator keeps the params' sharding; matches")


CASES = {
  "shard_map": check_shard_map_matches_large_batch,
  "token_weights": check_per_device_weights_give_global_token_mean,
  "pmap": check_pmap_matches_large_batch,
  "hlo_accumulate": check_hlo_collectives_only_where_window_closes,
  "hlo_microbatched": check_microbatched_reduces_after_the_scan,
  "sharded_state": check_sharded_params_and_state,
}


if __name__ == "__main__":
  if jax.device_count() < 8:
    raise SystemExit(
      "needs 8 devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8"
      f" before starting; found {jax.device_count()}."
    )
  for case in sys.argv[1:]:
    CASES[case]()
