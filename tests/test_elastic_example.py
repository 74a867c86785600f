"""One global batch on 1, 2, 4 and 8 devices: one training trajectory.

examples/elastic.py runs at its smallest in this process (every test process
sees 8 simulated CPU devices). Its own comparisons are between ga_optax runs,
with AdamW; the second test holds the same recipe
(``ga_optax.planning.elastic_plan`` per device count,
``accumulate(axis_name="data")`` in ``jax.shard_map``, a move from 8 to 2
devices through an orbax checkpoint at a window boundary)
to the large batch computed without ga_optax, with plain SGD and
token-weighted windows of unequal weight.
"""

from __future__ import annotations

import os
import runpy
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from helpers import (
  SGD,
  assert_finite_and_close,
  init_params,
  large_batch_reference,
  make_windows,
  token_mean_loss,
  tokens,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "elastic.py"

# Far above the float32 rounding of a few dozen Adam steps, far below what
# one update moves the parameters and the loss by.
SAME_TRAJECTORY = 1e-5


def test_every_device_count_and_the_move_follow_one_trajectory(
  tmp_path, capsys, monkeypatch
):
  # The example adds the device-count flag to XLA_FLAGS when it is missing;
  # this process has its devices already, and its environment stays as is.
  monkeypatch.setenv(
    "XLA_FLAGS",
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8",
  )
  main = runpy.run_path(str(EXAMPLE))["main"]
  results = main(
    [
      *("--epochs", "1", "--hidden", "16", "--no-progress"),
      *("--output-dir", str(tmp_path)),
    ]
  )
  printed = capsys.readouterr().out

  assert list(results) == [
    "1 device",
    "2 devices",
    "4 devices",
    "8 devices",
    "8 -> 2 devices",
  ]
  reference = results["1 device"]
  for row in results.values():
    assert all(np.isfinite(value) for value in row.values()), row
  # Training moves the loss by far more than the tolerance...
  assert reference["first_loss"] - reference["final_loss"] > 0.3
  # ...and every device count, and the run moved from 8 to 2 devices at a
  # window boundary, stays on the one-device trajectory.
  for name, row in results.items():
    assert row["max_loss_difference"] < SAME_TRAJECTORY, name
    assert row["max_param_difference"] < SAME_TRAJECTORY, name
    assert abs(row["final_loss"] - reference["final_loss"]) < SAME_TRAJECTORY
  moved = results["8 -> 2 devices"]
  assert moved["max_param_difference_to_unmoved"] < SAME_TRAJECTORY

  assert "| 8 -> 2 devices | 8 x 1, then 8 x 4 | 23 |" in printed
  assert "| 1 device | 8 x 8 | 23 |" in printed
  assert (tmp_path / "elastic_losses.png").stat().st_size > 0
  assert (tmp_path / "checkpoints" / "window_11").is_dir()


GLOBAL_BATCH = 32
MICRO_BATCH_SIZES = (2, 4)


def train(
  num_devices: int, params: Any, state: Any, windows: list[Any]
) -> tuple[Any, Any]:
  """The example's recipe with plain SGD: the plan's micro-batches and k."""
  plan = ga_optax.planning.elastic_plan(
    GLOBAL_BATCH, num_devices, MICRO_BATCH_SIZES
  )
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",))
  tx = ga_optax.accumulate(SGD, plan.num_microbatches, axis_name="data")

  def device_step(params, state, batch):
    grads = jax.grad(token_mean_loss)(params, batch)
    updates, state = tx.update(grads, state, params, weight=tokens(batch))
    return optax.apply_updates(params, updates), state

  step = jax.jit(
    jax.shard_map(
      device_step,
      mesh=mesh,
      in_specs=(P(), P(), P("data")),
      out_specs=(P(), P()),
      check_vma=False,
    )
  )
  if state is None:
    state = tx.init(params)
  shape = (num_devices, plan.num_microbatches, plan.micro_batch_size)
  for (batch,) in windows:
    # Micro-step s hands device i the rows batch[i, s], as the example does.
    split = {
      name: leaf.reshape(*shape, *leaf.shape[1:])
      for name, leaf in batch.items()
    }
    for micro_step in range(plan.num_microbatches):
      micro = {
        name: leaf[:, micro_step].reshape(-1, *leaf.shape[3:])
        for name, leaf in split.items()
      }
      params, state = step(
        params, state, jax.device_put(micro, NamedSharding(mesh, P("data")))
      )
    if not bool(ga_optax.emitted(state)):
      raise AssertionError(f"{num_devices} devices: the window did not close")
  return params, state


def test_the_recipe_with_plain_sgd_follows_the_large_batch(tmp_path):
  # One global batch per window, each with its own number of real tokens.
  windows = make_windows((1, 1, 1, 1), 8, GLOBAL_BATCH // 8, seed=60)
  expected = large_batch_reference(SGD, init_params(), windows)
  for num_devices in (1, 2, 4, 8):
    final, _ = train(num_devices, init_params(), None, windows)
    assert_finite_and_close(final, expected)

  # The move: 8 devices, a checkpoint at a window boundary, then 2 devices
  # with the 2-device plan's k. The state's structure does not depend on k.
  params, state = train(8, init_params(), None, windows[:2])
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "boundary", (params, state))
    target = jax.eval_shape(lambda: (params, state))
    restored = checkpointer.restore(tmp_path / "boundary", target)
  restored = jax.tree.map(jnp.asarray, jax.device_get(restored))
  final, _ = train(2, *restored, windows[2:])
  assert_finite_and_close(final, expected)
