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

from ga_optax._src import distributed

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
  assert output.split() == ["3", "1", "P('data',", "'model')"], output


def test_data_parallel_example_runs_tiny():
  output = run_on_8_devices(
    str(ROOT / "examples" / "data_parallel.py"),
    "--epochs=1",
    "--microbatch=4",
    "--accumulation-steps=2",
    "--hidden=16",
  )
  assert "| deferred" in output, output


# The audit itself, on hand-written HLO in the layout XLA prints.
MODULE_TEXT = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%keep_open (param: (f32[4,3], f32[])) -> (f32[4,3], f32[]) {
  %param = (f32[4,3]{1,0}, f32[]) parameter(0)
  ROOT %copy = (f32[4,3]{1,0}, f32[]) copy(%param)
}

%close (param.1: (f32[4,3], f32[])) -> (f32[4,3], f32[]) {
  %param.1 = (f32[4,3]{1,0}, f32[]) parameter(0)
  %gte.0 = f32[4,3]{1,0} get-tuple-element(%param.1), index=0
  %gte.1 = f32[] get-tuple-element(%param.1), index=1
  %all-reduce = (f32[4,3]{1,0}, f32[]) all-reduce(%gte.0, /*index=1*/%gte.1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %result = (f32[4,3]{1,0}, f32[]) copy(%all-reduce)
}

ENTRY %main (p0: pred[], p1: (f32[4,3], f32[]), p2: bf16[16]) -> (f32[4,3], f32[]) {
  %p0 = pred[] parameter(0)
  %p1 = (f32[4,3]{1,0}, f32[]) parameter(1)
  %p2 = bf16[16]{0} parameter(2)
  %EVERY_STEP
  ROOT %conditional = (f32[4,3]{1,0}, f32[]) conditional(%p0, %p1, %p1), branch_computations={%keep_open, %close}
}
"""


def module_text(every_step: str = "") -> str:
  return MODULE_TEXT.replace("%EVERY_STEP", every_step)


def test_window_collectives_finds_the_closing_branch():
  found = distributed.window_collectives(module_text())
  assert found.every_micro_step == []
  assert found.closing_branch == "close"
  assert found.window_closing == [
    distributed.Collective("close", "all-reduce", "all-reduce", 4 * 12 + 4)
  ]


def test_window_collectives_sees_collectives_on_every_step():
  found = distributed.window_collectives(
    module_text(
      "%all-gather = bf16[128]{0} all-gather(%p2), dimensions={0},"
      " replica_groups={{0,1,2,3,4,5,6,7}}"
    )
  )
  assert found.every_micro_step == [
    distributed.Collective("main", "all-gather", "all-gather", 2 * 16)
  ]
  assert len(found.window_closing) == 1


def test_window_collectives_rejects_collectives_in_the_open_branch():
  text = module_text().replace(
    "branch_computations={%keep_open, %close}",
    "branch_computations={%close, %keep_open}",
  )
  with pytest.raises(ValueError, match="last one of its conditional"):
    distributed.window_collectives(text)


def test_parse_hlo_rejects_text_without_an_entry():
  with pytest.raises(ValueError, match="hlo_text must be the text"):
    distributed.parse_hlo("f32[] add(%a, %b)")


@pytest.mark.parametrize(
  ("shape", "expected"),
  [
    ("f32[4,3]{1,0}", 48),
    ("(f32[4,3]{1,0}, /*index=1*/bf16[2], pred[])", 48 + 4 + 1),
    ("s32[]", 4),
    ("token[]", 0),
  ],
)
def test_shape_bytes(shape, expected):
  assert distributed.shape_bytes(shape) == expected
