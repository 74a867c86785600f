"""One process of a multi-process data-parallel run, on this machine.

tests/test_multihost.py starts ``NUM_PROCESSES`` of these, each with two CPU
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=2``) and a
coordinator on 127.0.0.1::

  python tests/multihost_worker.py MODE PROCESS_ID PORT OUTPUT.npz

Every process feeds only its own devices' rows of each micro-batch (the
token-weighted windows of tests/helpers.py, one closed by a flush),
accumulates without a collective, and all processes reduce once per window
over gloo (JAX's CPU collectives). ``MODE`` is the way the step is written:

* ``shard_map``: ``accumulate(..., axis_name="data")`` inside
  ``jax.shard_map`` over every process's devices;
* ``plain_jit``: a mesh of Explicit axes over every process's devices set
  with ``jax.set_mesh``, ``unreduced_value_and_grad`` and
  ``accumulate(..., unreduced_axes="data")`` under a plain ``jax.jit``.

Each writes the parameters it ends with to ``OUTPUT.npz``. Failures raise
(never ``assert``, which ``python -O`` would drop).
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np
import optax

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
DEVICES = NUM_PROCESSES * DEVICES_PER_PROCESS
ROWS = 3  # per device and micro-step
EVERY_K = 3
# The second window is closed by a flush after 2 micro-steps.
LENGTHS = (3, 2, 3)
SEED = 7
MODES = ("shard_map", "plain_jit")


def local_rows(batch: dict[str, np.ndarray], process_id: int) -> Any:
  """This process's devices' rows: global device d holds rows d*ROWS..."""
  per_process = DEVICES_PER_PROCESS * ROWS
  rows = slice(process_id * per_process, (process_id + 1) * per_process)
  return {name: leaf[rows] for name, leaf in batch.items()}


def shard_map_step(tx: Any, mesh: Any) -> Any:
  from helpers import token_mean_loss, tokens
  from jax.sharding import PartitionSpec as P

  def device_step(params, state, batch, flush):
    grads = jax.grad(token_mean_loss)(params, batch)
    updates, state = tx.update(
      grads, state, params, weight=tokens(batch), flush=flush
    )
    return optax.apply_updates(params, updates), state

  return jax.jit(
    jax.shard_map(
      device_step,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P()),
      out_specs=(P(), P()),
      check_vma=False,
    )
  )


def plain_jit_step(tx: Any) -> Any:
  from helpers import token_mean_loss, tokens

  import ga_optax

  value_and_grad = ga_optax.unreduced_value_and_grad(
    token_mean_loss, weight_fn=tokens, return_weight=True
  )

  def step(params, state, batch, flush):
    # weight: the micro-batch's tokens on every process's devices.
    _, grads, weight = value_and_grad(params, batch)
    updates, state = tx.update(grads, state, params, weight=weight, flush=flush)
    return optax.apply_updates(params, updates), state

  return jax.jit(step)


def main(mode: str, process_id: int, port: int, output: str) -> None:
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=NUM_PROCESSES,
    process_id=process_id,
    initialization_timeout=60,
  )
  # Local imports: nothing may touch devices before initialize.
  from contextlib import nullcontext

  from helpers import SGD, init_params, make_windows, micro_steps
  from jax.sharding import AxisType, Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import ga_optax

  if jax.device_count() != DEVICES:
    raise RuntimeError(f"{jax.device_count()} devices, not {DEVICES}")
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("data",))
    tx = ga_optax.accumulate(SGD, EVERY_K, axis_name="data")
    step = shard_map_step(tx, mesh)
    context = nullcontext()
  else:
    mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Explicit,))
    tx = ga_optax.accumulate(SGD, EVERY_K, unreduced_axes="data")
    step = plain_jit_step(tx)
    context = jax.set_mesh(mesh)
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

  with context:
    params = global_replicated(init_params())
    if mode == "shard_map":
      state = global_replicated(tx.init(init_params()))
    else:
      # The accumulator is created unreduced over "data", on the mesh.
      state = jax.jit(tx.init)(params)
    windows = make_windows(LENGTHS, DEVICES, ROWS, seed=SEED)
    for batch, flush in micro_steps(windows, EVERY_K):
      local = local_rows(batch, process_id)
      params, state = step(
        params,
        state,
        jax.tree.map(
          lambda leaf: jax.make_array_from_process_local_data(
            batch_sharding, leaf
          ),
          local,
        ),
        global_replicated(np.bool_(flush)),
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
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
