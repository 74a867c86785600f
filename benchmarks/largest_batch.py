"""The largest batch whose step fits a device's memory, with and without
accumulation.

Compiles (never runs) the train step of the reference MLP for growing batch
sizes and reads the device bytes of each executable: the largest single
batch of a plain Adam step, and the largest micro-batch of
``accumulate(adam)`` (``ga_optax.planning.micro_step_bytes``), whose window
of ``EFFECTIVE_K`` micro-batches is the batch one update then takes. The budget
is a share of ``memory_stats()["bytes_limit"]``, or given.

Usage::

  python benchmarks/largest_batch.py                        # 4 x 2048^2
  python benchmarks/largest_batch.py --quick --memory-budget-mib 4

The GPU run book (``benchmarks/gpu_report.py``) runs it as a section.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import batch_fit  # noqa: E402


def main(argv: list[str] | None = None) -> batch_fit.Record:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a small MLP")
  parser.add_argument("--memory-budget-mib", type=float)
  # Headroom for the runtime's own buffers and fragmentation.
  parser.add_argument("--memory-fraction", type=float, default=0.9)
  args = parser.parse_args(argv)
  record = batch_fit.measure(
    *batch_fit.budget(args.memory_budget_mib, args.memory_fraction, args.quick),
    args.quick,
  )
  print(batch_fit.caption(record))
  print(json.dumps(record["largest"], indent=1))
  return record


if __name__ == "__main__":
  main()
