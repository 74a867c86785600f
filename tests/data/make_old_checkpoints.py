"""Writes the checkpoints of earlier releases that the checkpointing page carries over.

Run with the release's package first on the path (its sources, from the
commit that cut it, unpacked into DIR), naming the release::

  git archive f811142 ga_optax | tar -x -C DIR      # 0.2.0
  git archive 31f001e^ ga_optax | tar -x -C DIR     # 0.5, before 0.6's window
  PYTHONPATH=DIR JAX_PLATFORMS=cpu python tests/data/make_old_checkpoints.py 0.5

The run, the same for every release: ``accumulate(adam(1e-2), 3,
noise_scale_decay=0.9)`` on a linear model, one micro-batch of 4 rows per
call, drawn from ``default_rng(0)``. The state is saved after 8 calls (two
windows closed, the third open with 2 micro-steps) and after 9 (at a window
boundary, where those releases' accumulator still held the last window's
sums), into ``checkpoint-<release>``.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import ga_optax

HERE = pathlib.Path(__file__).resolve().parent
SAVED_AFTER = {"mid-window": 8, "boundary": 9}
# How each release's package is told apart from another's: 0.3 to 0.5 kept
# 0.2.0's version string, and 0.4 and 0.5 kept one layout of the state
# (with every_k, the noise scale whole in noise_scale, float8's window in
# fp8_window).
IS_RELEASE = {
  "0.2.0": lambda: (
    ga_optax.__version__ == "0.2.0"
    and "every_k" not in ga_optax.AccumulateState._fields
  ),
  "0.5": lambda: (
    {"every_k", "fp8_window"} <= set(ga_optax.AccumulateState._fields)
  ),
}


def loss_fn(params, x):
  return jnp.mean((x @ params["w"] + params["b"]) ** 2)


def main(release: str) -> None:
  assert IS_RELEASE[release](), (release, ga_optax.__file__)
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
    checkpoints = HERE / f"checkpoint-{release}" / name
    with ocp.CheckpointManager(checkpoints) as manager:
      manager.save(0, args=ocp.args.StandardSave((params, state)))
      manager.wait_until_finished()


if __name__ == "__main__":
  main(sys.argv[1])
