"""examples/elastic.py at its smallest: one trajectory on every device count.

The example needs 8 simulated CPU devices, fixed when jax is imported, so it
runs in a fresh process that calls its ``main`` and prints the results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "elastic.py"

# Far above the float32 rounding of a few dozen Adam steps, far below what
# one update moves the parameters and the loss by.
SAME_TRAJECTORY = 1e-5

DRIVER = """
import json, runpy, sys
main = runpy.run_path(sys.argv[1])["main"]
print("RESULTS " + json.dumps(main(sys.argv[2:])))
"""


def run_example(*args: str) -> tuple[dict[str, dict[str, float]], str]:
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(
    filter(
      None,
      [env.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"],
    )
  )
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(ROOT), env.get("PYTHONPATH", "")])
  )
  result = subprocess.run(
    [sys.executable, "-c", DRIVER, str(EXAMPLE), *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
  printed, _, results = result.stdout.rpartition("RESULTS ")
  return json.loads(results), printed


def test_every_device_count_and_the_move_follow_one_trajectory(tmp_path):
  results, printed = run_example(
    *("--epochs", "1", "--hidden", "16", "--no-progress"),
    *("--output-dir", str(tmp_path)),
  )

  assert list(results) == [
    "1 device",
    "2 devices",
    "4 devices",
    "8 devices",
    "8 -> 2 devices",
  ]
  reference = results["1 device"]
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
