"""Data-parallel accumulation on 8 simulated CPU devices.

The checks live in tests/multi_device_cases.py and run in a fresh process
each, because this process imported jax with a single device and the device
count is fixed at import.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CASES = Path(__file__).resolve().parent / "multi_device_cases.py"


def run_on_8_devices(*args: str, timeout: float = 300) -> str:
  """Runs a Python script on 8 simulated CPU devices; returns its stdout."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(
    filter(
      None,
      [
        env.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=8",
      ],
    )
  )
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(ROOT), env.get("PYTHONPATH", "")])
  )
  result = subprocess.run(
    [sys.executable, *args],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )
  assert result.returncode == 0, (
    f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
  )
  return result.stdout


@pytest.mark.parametrize(
  "case",
  [
    "shard_map",
    "token_weights",
    "pmap",
    "hlo_accumulate",
    "sharded_state",
  ],
)
def test_multi_device_case(case):
  run_on_8_devices(str(CASES), case)


def test_microbatched_value_and_grad_reduces_after_the_scan():
  run_on_8_devices(str(CASES), "hlo_microbatched")


def test_data_parallel_how_to_runs(tmp_path):
  """The page's code blocks, run in order as one script, as a reader would."""
  page = (ROOT / "docs" / "how-to" / "data-parallel.md").read_text()
  script = tmp_path / "data_parallel_page.py"
  script.write_text("\n".join(re.findall(r"```python\n(.*?)```", page, re.S)))
  output = run_on_8_devices(str(script))
  assert output.split() == [
    "float32[64@data,16]",  # the batch, sharded over "data"
    "True",  # microbatched loss == large-batch loss
    "float32[16,32]{U:data}",  # the unreduced accumulator
    "1",  # one window closed
    "True",  # accumulated == large-batch parameters
    "float32[16,32@model]{U:data}",  # on the ("data", "model") mesh
    "True",  # Auto axes == large batch
    "True",  # shard_map, in one step == large batch
    "1",  # shard_map, across steps: one window closed
    "True",  # shard_map, across steps == large batch
    "[8]",  # bytes all-reduced on every call
    "[2436]",  # bytes all-reduced when the window closes
  ], output
