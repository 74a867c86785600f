"""examples/batch_size_loop.py, run in-process at a tiny size.

The claim checked is the loop's, not the verdict's (which needs the full
run): every fixed-k run takes one step per k micro-batches, the adaptive run
starts at the small k, only doubles, stays within the large k, and steps
once per window it closed; every loss is finite.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def test_the_loop_runs_at_a_tiny_size(tmp_path):
  spec = importlib.util.spec_from_file_location(
    "example_batch_size_loop", EXAMPLES_DIR / "batch_size_loop.py"
  )
  assert spec is not None and spec.loader is not None
  example = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = example
  spec.loader.exec_module(example)
  micro_batches = 48
  record = example.main(
    [
      "--micro-batches", str(micro_batches), "--micro-batch-size", "4",
      "--max-len", "24", "--dim", "16", "--num-heads", "2",
      "--num-layers", "1", "--eval-every", "8", "--small-k", "2",
      "--large-k", "8", "--output-dir", str(tmp_path), "--no-progress",
    ]
  )  # fmt: skip
  assert set(record["runs"]) == {
    "fixed k = 2",
    "fixed k = 4",
    "fixed k = 8",
    "adaptive k",
  }
  for name, trace in record["traces"].items():
    assert all(math.isfinite(value) for value in trace["held_out_loss"])
    assert trace["items"][-1] == micro_batches
    if name.startswith("fixed"):
      k = int(name.split("=")[1])
      assert trace["steps"] == [items // k for items in trace["items"]]
  adaptive = record["traces"]["adaptive k"]
  assert adaptive["k"][0] in (2, 4)
  assert all(k in (2, 4, 8) for k in adaptive["k"])
  assert adaptive["k"] == sorted(adaptive["k"])
  # One step per closed window: between 1/8 and 1/2 of the micro-batches.
  assert micro_batches // 8 <= adaptive["steps"][-1] <= micro_batches // 2
  assert (tmp_path / "batch_size_loop.png").stat().st_size > 0
  written = json.loads((tmp_path / "batch_size_loop.json").read_text())
  assert written["runs"] == record["runs"]
