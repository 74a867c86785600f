"""Writes the checkpoints of 0.2.0 that the checkpointing page carries over.

Run with 0.2.0's package first on the path (its sources, from the commit
that cut it, unpacked into DIR)::

  git archive f811142 ga_optax | tar -x -C DIR
  PYTHONPATH=DIR JAX_PLATFORMS=cpu python tests/data/make_old_checkpoints.py

The runs: ``accumulate(adam(1e-2), 3)`` on a linear model, with and without
``noise_scale_decay=0.9``, one micro-batch of 4 rows per call, drawn from
``default_rng(0)``. The state is saved after 8 calls (two windows closed,
the third open with 2 micro-steps) and after 9 (at a window boundary, where
0.2.0's accumulator still held the last window's sums), into
``checkpoint-0.2.0``: with the noise scale mid-window and at the boundary,
without it at the boundary.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import ga_optax

HERE = pathlib.Path(__file__).resolve().parent
# Each checkpoint: (its directory, noise_scale_decay, calls before saving).
SAVED = (
  ("mid-window", 0.9, 8),
  ("boundary", 0.9, 9),
  ("boundary-without-noise-scale", None, 9),
)


def is_release_0_2_0() -> bool:
  # Later development states kept 0.2.0's version string; 0.2.0's state
  # alone had no every_k.
  return (
    ga_optax.__version__ == "0.2.0"
    and "every_k" not in ga_optax.AccumulateState._fields
  )


def loss_fn(params, x):
  return jnp.mean((x @ params["w"] + params["b"]) ** 2)


def main() -> None:
  assert is_release_0_2_0(), ga_optax.__file__
  for name, decay, calls in SAVED:
    tx = ga_optax.accumulate(optax.adam(1e-2), 3, noise_scale_decay=decay)

    @jax.jit
    def step(params, state, x, tx=tx):
      grads = jax.grad(loss_fn)(params, x)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(0)
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    state = tx.init(params)
    for _ in range(calls):
      params, state = step(params, state, rng.normal(size=(4, 3)))
    checkpoints = HERE / "checkpoint-0.2.0" / name
    with ocp.CheckpointManager(checkpoints) as manager:
      manager.save(0, args=ocp.args.StandardSave((params, state)))
      manager.wait_until_finished()


if __name__ == "__main__":
  main()
