"""A run saved with orbax after any micro-step resumes bit-identically.

The run (``checkpoint_run.py``) is saved after every micro-step, with both
``ocp.StandardCheckpointer`` and ``ocp.CheckpointManager``; one fresh Python
process restores all positions into a target built with ``jax.eval_shape``
from ``tx.init``, finishes the run, and compares it with the uninterrupted
run, which this process saved. A data-parallel run on 2 of this process's
devices resumes from a window boundary, and not from the middle of one.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import checkpoint_run
import chex
import helpers
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax

RUN_SCRIPT = pathlib.Path(checkpoint_run.__file__)


def _subprocess_env() -> dict[str, str]:
  # The fresh process compiles the CPU's programs as this one does (it
  # inherits the level, tests/compile_level.py): the resumed run must
  # match this one's bits.
  env = dict(os.environ)
  repository = str(pathlib.Path(ga_optax.__file__).parent.parent)
  env["PYTHONPATH"] = os.pathsep.join(
    filter(None, [repository, env.get("PYTHONPATH")])
  )
  return env


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory):
  """Saves the run after every micro-step; returns the root and final state."""
  root = tmp_path_factory.mktemp("checkpoints")
  params = checkpoint_run.initial_params()
  state = checkpoint_run.make_optimizer().init(params)
  checkpointer = ocp.StandardCheckpointer()
  manager = ocp.CheckpointManager(
    root / "manager",
    options=ocp.CheckpointManagerOptions(max_to_keep=None),
  )
  states = []
  for position in range(checkpoint_run.NUM_MICRO_STEPS):
    checkpointer.save(root / "standard" / str(position), (params, state))
    manager.save(position, args=ocp.args.StandardSave((params, state)))
    states.append(state)
    params, state = checkpoint_run.run(params, state, position, position + 1)
  checkpointer.save(root / "reference", (params, state))
  checkpointer.wait_until_finished()
  manager.wait_until_finished()
  manager.close()
  checkpointer.close()
  return root, states, (params, state)


def test_the_run_crosses_every_kind_of_position(saved_run):
  _, states, (_, final_state) = saved_run
  micro_steps = [int(state.micro_step) for state in states]
  # Saved states right after a close, mid-window, after a skipped micro-step
  # (position 5 follows micro-step 4) and right after a flush (position 8).
  assert micro_steps == [0, 1, 2, 0, 1, 1, 2, 0, 0, 1, 0, 1]
  assert int(states[5].num_skipped) == 1
  assert int(states[4].num_skipped) == 0
  assert bool(states[8].emitted)
  assert int(states[8].update_step) == 3
  assert int(final_state.update_step) == 5
  assert int(final_state.num_skipped) == 1


def test_restored_state_keeps_dtypes(saved_run):
  root, states, _ = saved_run
  target = checkpoint_run.abstract_target()
  with ocp.StandardCheckpointer() as checkpointer:
    params, state = checkpointer.restore(root / "standard" / "5", target)
  assert isinstance(state, ga_optax.AccumulateState)
  assert params["w"].dtype == jnp.bfloat16
  assert state.accumulator["w"].dtype == jnp.float32
  assert state.micro_step.dtype == jnp.int32
  assert state.emitted.dtype == jnp.bool_
  chex.assert_tree_all_finite(state)
  chex.assert_trees_all_equal(state, states[5])
  chex.assert_trees_all_equal_dtypes(state, states[5])


def test_every_position_resumes_bit_identically_in_a_new_process(saved_run):
  root, _, _ = saved_run
  env = _subprocess_env()
  completed = subprocess.run(
    [sys.executable, str(RUN_SCRIPT), str(root)],
    capture_output=True,
    text=True,
    env=env,
    check=False,
  )
  assert completed.returncode == 0, completed.stderr
  resumed = json.loads(completed.stdout.strip().splitlines()[-1])
  every_position = list(range(checkpoint_run.NUM_MICRO_STEPS))
  assert resumed == {"standard": every_position, "manager": every_position}


def test_resuming_in_this_process_matches_too(saved_run):
  """Guards the subprocess test: a wrong restore here would fail loudly."""
  root, _, reference = saved_run
  target = checkpoint_run.abstract_target()
  with ocp.StandardCheckpointer() as checkpointer:
    params, state = checkpointer.restore(root / "standard" / "8", target)
  finished = checkpoint_run.run(
    params, state, 8, checkpoint_run.NUM_MICRO_STEPS
  )
  chex.assert_tree_all_finite(finished)
  chex.assert_trees_all_equal(finished, reference)
  # Resuming from the wrong position must not match: the check has teeth.
  wrong = checkpoint_run.run(params, state, 7, checkpoint_run.NUM_MICRO_STEPS)
  with pytest.raises(AssertionError):
    chex.assert_trees_all_equal(wrong, reference)


@pytest.mark.devices(8)
def test_data_parallel_checkpoints_resume_only_from_window_boundaries(
  tmp_path: pathlib.Path,
):
  """Saved at a boundary, a 2-device run resumes exactly; mid-window, not.

  Documented in docs/how-to/checkpointing.md: with axis_name the open
  window's partial sums differ per device, and orbax saves one replica.
  Plain SGD over token-weighted windows of unequal weight (one closed by a
  flush), against the large batch computed without ga_optax.
  """
  every_k, devices = 3, 2
  windows = helpers.make_windows((3, 2, 3), devices, 2, seed=30)
  run = list(helpers.micro_steps(windows, every_k))
  mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
  tx = ga_optax.accumulate(helpers.SGD, every_k, axis_name="data")

  def device_step(params, state, batch, flush):
    grads = jax.grad(helpers.token_mean_loss)(params, batch)
    updates, state = tx.update(
      grads, state, params, weight=helpers.tokens(batch), flush=flush
    )
    return optax.apply_updates(params, updates), state

  step = jax.jit(
    jax.shard_map(
      device_step,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P()),
      out_specs=(P(), P()),
      check_vma=False,
    )
  )
  data = NamedSharding(mesh, P("data"))

  def resume(params, state, start):
    for batch, flush in run[start:]:
      batch = jax.device_put(batch, data)
      params, state = step(params, state, batch, jnp.bool_(flush))
    return params, state

  # After the first window (a boundary) and one micro-step later.
  positions = {"boundary": 3, "mid_window": 4}
  params = helpers.init_params()
  state = tx.init(params)
  target = jax.eval_shape(lambda: (params, state))
  with ocp.StandardCheckpointer() as checkpointer:
    # One uninterrupted run, saved on its way.
    current = (params, state)
    for index, (batch, flush) in enumerate(run):
      for name, position in positions.items():
        if index == position:
          checkpointer.save(tmp_path / name, current)
      batch = jax.device_put(batch, data)
      current = step(*current, batch, jnp.bool_(flush))
    checkpointer.wait_until_finished()
    resumed = {
      name: resume(*checkpointer.restore(tmp_path / name, target), position)
      for name, position in positions.items()
    }
  expected = helpers.large_batch_reference(
    helpers.SGD, helpers.init_params(), windows
  )
  helpers.assert_finite_and_close(current[0], expected)
  chex.assert_tree_all_finite(current)
  chex.assert_trees_all_equal(resumed["boundary"], current)
  # Mid-window, the other device's partial sum was lost: the run ends
  # elsewhere (finite, so the difference is not NaN against NaN).
  chex.assert_tree_all_finite(resumed["mid_window"][0])
  with pytest.raises(AssertionError):
    helpers.assert_finite_and_close(resumed["mid_window"][0], expected)
