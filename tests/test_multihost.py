"""Two processes on this machine, one data-parallel run over gloo.

Each process of tests/multihost_worker.py owns two CPU devices; they meet at a
coordinator on the loopback interface and reduce each window's accumulator
over JAX's CPU collectives. Both must end with the parameters of a single
process taking one large-batch step per window.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import chex
import jax
import multihost_worker as worker
import numpy as np
import optax
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "multihost_worker.py"
TIMEOUT_SECONDS = 180


def free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


def single_process_large_batch() -> dict[str, np.ndarray]:
  @jax.jit
  def step(params, opt_state, x, y):
    grads = jax.grad(worker.loss_fn)(params, x, y)
    updates, opt_state = worker.OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = worker.initial_params()
  opt_state = worker.OPTIMIZER.init(params)
  for x, y in zip(*worker.windows(), strict=True):
    params, opt_state = step(params, opt_state, x, y)
  return jax.device_get(params)


def run_processes(tmp_path: Path) -> list[dict[str, np.ndarray]]:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={worker.DEVICES_PER_PROCESS}"
  )
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(ROOT), env.get("PYTHONPATH", "")])
  )
  port = free_port()
  outputs = [tmp_path / f"process_{i}.npz" for i in range(worker.NUM_PROCESSES)]
  processes = [
    subprocess.Popen(
      [sys.executable, str(WORKER), str(i), str(port), str(output)],
      env=env,
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i, output in enumerate(outputs)
  ]
  logs = []
  try:
    for process in processes:
      logs.append(process.communicate(timeout=TIMEOUT_SECONDS)[0])
  except subprocess.TimeoutExpired:
    for process in processes:
      process.kill()
    pytest.fail(f"the processes did not finish in {TIMEOUT_SECONDS} s")
  for i, (process, log) in enumerate(zip(processes, logs, strict=True)):
    assert process.returncode == 0, f"process {i} failed:\n{log}"
  return [dict(np.load(output)) for output in outputs]


def test_two_processes_match_a_single_process_large_batch(tmp_path):
  results = run_processes(tmp_path)
  expected = single_process_large_batch()
  for result in results:
    assert int(result.pop("num_devices")) == (
      worker.NUM_PROCESSES * worker.DEVICES_PER_PROCESS
    )
    assert int(result.pop("update_step")) == worker.NUM_WINDOWS
    chex.assert_trees_all_close(result, expected, rtol=1e-5, atol=1e-6)
  # Both processes ran the same reduction: bit-identical parameters.
  chex.assert_trees_all_equal(*results)
