"""Two processes on this machine, one data-parallel run over gloo.

Each process of tests/multihost_worker.py owns two CPU devices; they meet at a
coordinator on the loopback interface and reduce each window's accumulator
over JAX's CPU collectives, the step written with ``jax.shard_map`` or as a
plain ``jax.jit`` on a mesh over both processes' devices. Both must end with
the parameters of one process taking one large-batch step per window, which
this process computes without ga_optax (plain SGD over token-weighted windows
of unequal weight, one closed by a flush).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import chex
import helpers
import multihost_worker as worker
import numpy as np
import pytest

import ga_optax

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "multihost_worker.py"
TIMEOUT_SECONDS = 180


def free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


def run_processes(mode: str, tmp_path: Path) -> list[dict[str, np.ndarray]]:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={worker.DEVICES_PER_PROCESS}"
  )
  env["JAX_PLATFORMS"] = "cpu"
  # The workers import the ga_optax this process imported.
  package_root = str(Path(ga_optax.__file__).resolve().parent.parent)
  env["PYTHONPATH"] = os.pathsep.join(
    filter(None, [package_root, env.get("PYTHONPATH", "")])
  )
  port = free_port()
  outputs = [tmp_path / f"process_{i}.npz" for i in range(worker.NUM_PROCESSES)]
  processes = [
    subprocess.Popen(
      [sys.executable, str(WORKER), mode, str(i), str(port), str(output)],
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


@pytest.mark.parametrize("mode", worker.MODES)
def test_two_processes_match_a_single_process_large_batch(mode, tmp_path):
  results = run_processes(mode, tmp_path)
  windows = helpers.make_windows(
    worker.LENGTHS, worker.DEVICES, worker.ROWS, seed=worker.SEED
  )
  expected = helpers.large_batch_reference(
    helpers.SGD, helpers.init_params(), windows
  )
  for result in results:
    assert int(result.pop("num_devices")) == worker.DEVICES
    assert int(result.pop("update_step")) == len(worker.LENGTHS)
    helpers.assert_finite_and_close(result, expected)
  # Both processes ran the same reduction: bit-identical parameters.
  chex.assert_trees_all_equal(*results)
