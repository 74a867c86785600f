"""Writes the checkpoints of ga_optax 0.2.0 that the checkpointing page carries over.

Run with 0.2.0's package first on the path (its sources, from the commit
that cut it, unpacked into DIR)::

  git archive f811142 ga_optax | tar -x -C DIR
  PYTHONPATH=DIR JAX_PLATFORMS=cpu python tests/data/make_checkpoints_0_2.py

The run: ``accumulate(adam(1e-2), 3, noise_scale_decay=0.9)`` on a linear
model, one micro-batch of 4 rows per call, drawn from
``default_rng(0)``. The state is saved after 8 calls (two windows closed,
the third open with 2 micro-steps) and after 9 (at a window boundary).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import ga_optax

HERE = pathlib.Path(__file__).resolve().parent / "checkpoint-0.2.0"
SAVED_AFTER = {"mid-window": 8, "boundary": 9}


def loss_fn(params, x):
  return jnp.mean((x @ params["w"] + params["b"]) ** 2)


def main() -> None:
  assert ga_optax.__version__ == "0.2.0", ga_optax.__version__
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
