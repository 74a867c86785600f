"""One process of a multi-process data-parallel run, on this machine.

tests/test_multihost.py starts ``NUM_PROCESSES`` of these, each with
``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (two CPU devices per
process) and a coordinator on 127.0.0.1::

  python tests/multihost_worker.py PROCESS_ID PORT OUTPUT.npz

Each process feeds only its own devices' micro-batches, accumulates device-
locally, and all processes reduce once per window over gloo (JAX's CPU
collectives). Each writes the parameters it ends with to ``OUTPUT.npz``.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
MICROBATCH = 3  # per device
NUM_MICRO_STEPS = 2
NUM_WINDOWS = 3
WINDOW = NUM_PROCESSES * DEVICES_PER_PROCESS * MICROBATCH * NUM_MICRO_STEPS
OPTIMIZER = optax.adam(0.05)


def initial_params() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {
    "hidden": rng.normal(size=(4, 6)).astype(np.float32) / 2,
    "out": rng.normal(size=(6, 1)).astype(np.float32) / 2,
  }


def windows() -> tuple[np.ndarray, np.ndarray]:
  """Inputs and targets, shaped (NUM_WINDOWS, WINDOW, features)."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(NUM_WINDOWS, WINDOW, 4)).astype(np.float32)
  y = rng.normal(size=(NUM_WINDOWS, WINDOW, 1)).astype(np.float32)
  return x, y


def loss_fn(params, x, y):
  prediction = jnp.tanh(x @ params["hidden"]) @ params["out"]
  return jnp.mean((prediction - y) ** 2)


def micro_step_rows(micro_step: int, device: int) -> slice:
  """Rows of a window that global ``device`` sees at ``micro_step``."""
  start = (device * NUM_MICRO_STEPS + micro_step) * MICROBATCH
  return slice(start, start + MICROBATCH)


def main(process_id: int, port: int, output: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=NUM_PROCESSES,
    process_id=process_id,
    initialization_timeout=60,
  )
  # Local imports: ga_optax must not touch devices before initialize.
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import ga_optax

  mesh = Mesh(np.array(jax.devices()), ("data",))
  tx = ga_optax.accumulate(OPTIMIZER, NUM_MICRO_STEPS, axis_name="data")

  def device_step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params, weight=x.shape[0])
    return optax.apply_updates(params, updates), state

  step = jax.jit(
    jax.shard_map(
      device_step,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P(), P()),
      check_vma=False,
    )
  )
  replicated = NamedSharding(mesh, P())
  batch_sharding = NamedSharding(mesh, P("data"))

  def global_replicated(tree):
    # Every process passes the same host values; each keeps its own copies.
    return jax.tree.map(
      lambda leaf: jax.make_array_from_process_local_data(
        replicated, np.asarray(leaf)
      ),
      tree,
    )

  params = global_replicated(initial_params())
  state = global_replicated(tx.init(initial_params()))
  # Global device d lives in process d // DEVICES_PER_PROCESS.
  local_devices = [
    process_id * DEVICES_PER_PROCESS + local
    for local in range(DEVICES_PER_PROCESS)
  ]
  x_windows, y_windows = windows()
  for x_window, y_window in zip(x_windows, y_windows, strict=True):
    for micro_step in range(NUM_MICRO_STEPS):
      rows = [micro_step_rows(micro_step, device) for device in local_devices]
      x_local = np.concatenate([x_window[r] for r in rows])
      y_local = np.concatenate([y_window[r] for r in rows])
      params, state = step(
        params,
        state,
        jax.make_array_from_process_local_data(batch_sharding, x_local),
        jax.make_array_from_process_local_data(batch_sharding, y_local),
      )
  local_params = jax.tree.map(
    lambda leaf: np.asarray(leaf.addressable_data(0)), params
  )
  np.savez(
    output,
    update_step=np.asarray(state.update_step.addressable_data(0)),
    num_devices=jax.device_count(),
    **local_params,
  )
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
