"""Writes the checkpoints of ga_optax 0.5 that the checkpointing page carries over.

0.4 and 0.5 kept one layout of the state (with ``every_k``, the noise scale
in the field ``noise_scale``, float8's window in ``fp8_window``); 0.5 is the
last commit before 0.6's window. Run with its package first on the path
(its sources, from that commit, unpacked into DIR)::

  git archive 31f001e^ ga_optax | tar -x -C DIR
  PYTHONPATH=DIR JAX_PLATFORMS=cpu python tests/data/make_checkpoints_0_5.py

The run is the 0.2.0 one (``make_checkpoints_0_2.py``):
``accumulate(adam(1e-2), 3, noise_scale_decay=0.9)`` on a linear model, one
micro-batch of 4 rows per call, drawn from ``default_rng(0)``, the state
saved after 8 calls (the third window open with 2 micro-steps) and after 9
(at a window boundary, where 0.5's accumulator still held the last
window's sums).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import ga_optax

HERE = pathlib.Path(__file__).resolve().parent / "checkpoint-0.5"
SAVED_AFTER = {"mid-window": 8, "boundary": 9}


def loss_fn(params, x):
  return jnp.mean((x @ params["w"] + params["b"]) ** 2)


def main() -> None:
  fields = ga_optax.AccumulateState._fields
  assert "fp8_window" in fields and "every_k" in fields, fields
  tx = ga_optax.accumulate(optax.adam(1e-2), 3, noise_scale_decay=0.9)

  @jax.jit
  def step(params, state, x):
    grads = jax.grad(loss_fn)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for name, calls in SAVED_AFTER.items():
    rng = np.random.default_rng(0)
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    state = tx.init(params)
    for _ in range(calls):
      params, state = step(params, state, rng.normal(size=(4, 3)))
    with ocp.CheckpointManager(HERE / name) as manager:
      manager.save(0, args=ocp.args.StandardSave((params, state)))
      manager.wait_until_finished()


if __name__ == "__main__":
  main()
