"""The data-parallel how-to page, run on 8 devices as a reader would run it.

The page's code blocks run in order as one script, in this process (every
test process sees 8 simulated CPU devices), and what each ``print`` shows
is checked. The numbers of each multi-device path against the large batch
are tested in tests/test_shard_map.py and tests/test_plain_jit_mesh.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs/how-to/data-parallel.md"


@pytest.mark.devices(8)
def test_data_parallel_how_to_runs(capsys):
  source = "\n".join(re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S))
  # The page sets its mesh with a global jax.set_mesh; the enclosing
  # context puts back this process's own (none) when the page is done.
  with jax.set_mesh(jax.make_mesh((8,), ("data",))):
    exec(compile(source, str(PAGE), "exec"), {"__name__": "__main__"})
  output = capsys.readouterr().out
  assert output.split() == [
    "float32[64@data,16]",  # the batch, sharded over "data"
    "True",  # microbatched loss == large-batch loss
    "float32[16,32]{U:data}",  # the unreduced accumulator
    "1",  # one window closed
    "True",  # accumulated == large-batch parameters
    "ShardingTypeError",  # jax.grad of an embedding on a sharded batch
    "True",  # microbatched embedding gradients == one device's
    "True",  # token-weighted accumulation == one device's SGD step
    "[8]",  # its bytes all-reduced on every call: loss and weight
    "[8,",  # and on the closing call, with the window's gradients
    "2048]",
    "float32[16,32@model]{U:data}",  # on the ("data", "model") mesh
    "True",  # Auto axes == large batch
    "True",  # shard_map, in one step == large batch
    "1",  # shard_map, across steps: one window closed
    "True",  # shard_map, across steps == large batch
    "[8]",  # bytes all-reduced on every call
    "[8,",  # and on the closing call, with the window's reduction
    "2436]",
  ], output
  assert jax.sharding.get_abstract_mesh().empty
