"""What XLA:GPU compiles a window into: bytes moved and copies, per path.

Compiles each contender's step for compile-only H100s with the real XLA:GPU
compiler (``audits.compile_for_gpu``: no GPU needed, JAX's CUDA
plugin is), params and state donated, under XLA's default flags, and reads
each path of the compiled program with ``audits.path_audit``:
the bytes it moves (every executed instruction reads its operands and writes
its result once), the copies it makes, and the temporaries of
``memory_analysis()``. These are compiler figures, deterministic for a
given jax release, never times: a lent GPU times the same programs
(``benchmarks/gpu_report.py``).

Usage::

  JAX_PLATFORMS=cpu python benchmarks/compiled.py            # 4 x 2048^2
  JAX_PLATFORMS=cpu python benchmarks/compiled.py --width 1024 --output o.json

Beside ga_optax's steps it compiles the floor (a gradient added into a
donated accumulator) and the host-scheduled window's programs
(``benchmarks/host_scheduled.py``), which have no control flow. Prints a
table of paths (with the host waits of each, ``audits.host_waits``,
under XLA's default options), one of the targets' ratios and one of whole
windows (bytes per micro-step, closing step and window of k calls, beside
the floor, plain Adam and ``optax.MultiSteps``), and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
# The CUDA plugin does not start on a machine without a GPU; the compiler
# in it works all the same. Only as a script: loaded as a module, it leaves
# the platforms of the process that loads it alone.
if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import optax  # noqa: E402

from benchmarks import workloads as workloads_lib  # noqa: E402
from benchmarks.compiled_steps import (  # noqa: E402
  audit,
  ratios,
  steps,
  tables,
  windows,
  windows_table,
)
from ga_optax._src import audits  # noqa: E402


def measure(workload: workloads_lib.Workload) -> dict[str, Any]:
  """Each contender's paths: bytes moved, copies, temporaries, and the host
  waits of each path under XLA's default options."""
  records = {}
  for name, (step, state, batch) in steps(workload).items():
    # host_waits compiles as compile_for_gpu does, and reads the thunks.
    waits = audits.host_waits(
      step, workload.params, state, batch, donate_argnums=(0, 1)
    )
    records[name] = audit(waits.program)
    records[name]["host_waits"] = [waits.micro_step, waits.closing]
  return records


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--depth", type=int, default=4)
  parser.add_argument("--micro-batch", type=int, default=8)
  parser.add_argument("--every-k", type=int, default=4)
  parser.add_argument(
    "--output",
    type=pathlib.Path,
    default=REPO_ROOT / "benchmarks" / "results" / "compiled.json",
  )
  args = parser.parse_args(argv)
  workload = workloads_lib.mlp(
    args.width, args.depth, args.micro_batch, args.every_k
  )
  records = measure(workload)
  rows = ratios(records)
  window_rows = windows(records, workload.every_k)
  print(tables(records, rows))
  print()
  print(windows_table(window_rows))
  args.output.parent.mkdir(parents=True, exist_ok=True)
  args.output.write_text(
    json.dumps(
      {
        "what": "XLA:GPU compiler figures for compile-only H100s (no GPU)",
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "workload": workload.config,
        "paths": records,
        "ratios": rows,
        "windows": window_rows,
      },
      indent=2,
    )
  )


if __name__ == "__main__":
  main()
