"""A run saved with orbax after any micro-step resumes bit-identically.

The run (``checkpoint_run.py``) is saved after every micro-step, with both
``ocp.StandardCheckpointer`` and ``ocp.CheckpointManager``; one fresh Python
process restores all positions into a target built with ``jax.eval_shape``
from ``tx.init``, finishes the run, and compares it with the uninterrupted
run, which this process saved.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import checkpoint_run
import chex
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

import ga_optax

RUN_SCRIPT = pathlib.Path(checkpoint_run.__file__)


def _subprocess_env() -> dict[str, str]:
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
  chex.assert_trees_all_equal(finished, reference)
  # Resuming from the wrong position must not match: the check has teeth.
  wrong = checkpoint_run.run(params, state, 7, checkpoint_run.NUM_MICRO_STEPS)
  with pytest.raises(AssertionError):
    chex.assert_trees_all_equal(wrong, reference)


def test_data_parallel_checkpoints_resume_only_from_window_boundaries(
  tmp_path: pathlib.Path,
):
  # Documented in docs/how-to/checkpointing.md: with axis_name the open
  # window's partial sums differ per device, and orbax saves one replica.
  env = _subprocess_env()
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
  )
  env["JAX_PLATFORMS"] = "cpu"
  completed = subprocess.run(
    [sys.executable, str(RUN_SCRIPT), "data-parallel", str(tmp_path)],
    capture_output=True,
    text=True,
    env=env,
    check=False,
  )
  assert completed.returncode == 0, completed.stderr[-4000:]
  equal = json.loads(completed.stdout.strip().splitlines()[-1])
  assert equal == {"boundary": True, "mid_window": False}
