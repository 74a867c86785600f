"""Plain-jit accumulation on a mesh of 8 simulated CPU devices.

The checks live in tests/mesh_cases.py (numbers against one device's large
batch, and where the compiled HLO runs its collectives); each group runs in
a fresh process, because the device count is fixed when jax starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_distributed import run_on_8_devices

CASES = Path(__file__).resolve().parent / "mesh_cases.py"


@pytest.mark.parametrize(
  "groups",
  [
    # Grouped so that each process pays jax's start-up once for several
    # checks; each group prints one line per check it passed.
    ("microbatched_explicit", "flax"),
    ("microbatched_auto", "microbatched_options"),
    ("accumulate_unreduced", "errors", "check_vma"),
    ("checkpoints", "shard_map_consolidate", "boundary_resume"),
  ],
  ids=lambda groups: "+".join(groups),
)
def test_mesh_case(groups):
  output = run_on_8_devices(str(CASES), *groups, timeout=600)
  assert output.strip(), "the checks printed nothing"
