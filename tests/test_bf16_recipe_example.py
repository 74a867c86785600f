"""examples/bf16_recipe.py, run in-process at a tiny size.

The measured verdict needs the full run; checked here is what the table's
columns claim: each run keeps its params, accumulator and moments in the
dtypes it is named for (read from the bytes its state holds), the float32
run is the reference the drift is measured from, and every figure written to
``--output`` is the one returned.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def example() -> ModuleType:
  spec = importlib.util.spec_from_file_location(
    "example_bf16_recipe", EXAMPLES_DIR / "bf16_recipe.py"
  )
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def test_options_give_way_to_presets_and_name_the_reference(example, capsys):
  args = example.parse_args(["--preset", "gpu", "--steps", "7"])
  assert args.steps == 7
  assert args.dim == example.PRESETS["gpu"]["dim"]
  assert args.runs == list(example.RUNS)
  with pytest.raises(SystemExit):
    example.parse_args(["--runs", "bf16-recipe", "all-bf16"])
  assert "--runs must include float32" in capsys.readouterr().err


def test_the_recipe_comparison_runs_at_a_tiny_size(example, tmp_path, capsys):
  output = tmp_path / "figures" / "bf16_recipe.json"
  results = example.main(
    [
      "--steps", "4", "--batch-size", "4", "--every-k", "2",
      "--max-len", "24", "--dim", "16", "--num-heads", "2",
      "--num-layers", "1", "--eval-every", "2",
      # Two of the five runs: each compiles its own window step.
      "--runs", "bf16-recipe", "float32",
      "--output-dir", str(tmp_path), "--output", str(output),
      "--no-progress",
    ]
  )  # fmt: skip

  runs = results["runs"]
  # In the table's order, whatever the order asked for.
  assert list(runs) == ["float32", "bf16-recipe"]
  # Params + accumulator + Adam's mu and nu, 4 bytes for each float32 and 2
  # for each bfloat16: the recipe's moments did stay float32 (a bfloat16 nu
  # would make it 12).
  assert {name: row["bytes_per_param"] for name, row in runs.items()} == {
    "float32": 16,
    "bf16-recipe": 2 + 4 + 4 + 4,
  }
  assert results["eval_windows"] == [0, 2, 4]
  for name, row in runs.items():
    assert row["params_finite"], name
    assert len(row["train_loss"]) == len(row["drift"]) == 4, name
    assert len(row["held_out_loss"]) == 3, name
    assert all(math.isfinite(value) for value in row["train_loss"]), name
  reference = runs["float32"]
  assert reference["drift"] == [0.0] * 4
  assert reference["held_out_loss"][0] - reference["held_out_loss"][-1] > 0.1
  # bfloat16 params start a bfloat16 rounding away from the float32 ones.
  recipe = runs["bf16-recipe"]
  assert 1e-4 < recipe["drift"][0] < recipe["final_drift"] < 0.1
  # Updates rounded away: bfloat16 params left as they were by the last one.
  assert (
    reference["unchanged_by_last_update"]
    < 0.1
    < recipe["unchanged_by_last_update"]
  )
  assert json.loads(output.read_text()) == results
  assert (tmp_path / "bf16_recipe.png").stat().st_size > 0
  printed = capsys.readouterr().out
  assert "bf16-recipe              bf16    bf16    f32     f32    14.0" in (
    printed
  )
  assert f"plot: {(tmp_path / 'bf16_recipe.png').resolve()}" in printed
