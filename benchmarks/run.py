"""Side-by-side cost of gradient accumulation: time and compiled memory.

Runs every contender of ``benchmarks/contenders.py`` on each workload of
``benchmarks/workloads.py`` in one process, interleaved round by round (the
order rotates each round) so that a noisy neighbour slows all contenders
alike, and reports medians and their ratios. Calls that close a window are
timed apart from the other micro-steps. Compiled memory comes from XLA's own
analysis of each executable, so it is exact and deterministic.

Usage::

  python benchmarks/run.py                 # full sizes, 15 rounds
  python benchmarks/run.py --quick         # small sizes, 3 rounds (smoke)
  python benchmarks/run.py --workload mlp --repeats 30 --output out.json
  python benchmarks/run.py --workload mlp --mlp-size 1024 4 \
      --contender host-scheduled --contender state-carrying

The markdown tables are printed last; the JSON record (machine, device, jax
version, date, raw timings) goes to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

# Runs as a script from any directory: the repository root holds the package
# and the `benchmarks` helpers.
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import environment as environment_lib  # noqa: E402
from benchmarks import timing  # noqa: E402
from benchmarks import workloads as workloads_lib  # noqa: E402

MIB = 2**20


def _markdown(environment, workloads, figures) -> str:
  device = environment["device"]
  lines = [
    f"Date: {environment['date']} · device: {device['platform']}"
    f" ({device['kind']}, {device['count']} device(s)) · CPU cores:"
    f" {environment['machine']['cpu_count']} · jax"
    f" {environment['versions']['jax']} · optax"
    f" {environment['versions']['optax']}",
    "",
    f"Command: `{environment['command']}`",
    "",
  ]
  for name, record in workloads.items():
    lines += [
      f"### {name}: {record['description']}",
      "",
      f"{record['num_params']:,} parameters. Medians over interleaved"
      " rounds; memory from the compiled executable.",
      "",
      "| contender | micro-step ms | window-closing ms | window ms |"
      " temp MiB | argument MiB | output MiB | alias MiB | copies >= 1 MiB |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for contender, result in record["contenders"].items():
      if "memory" not in result:
        lines.append(
          f"| {contender} | | | {result['window_ms']:.2f} | | | | | |"
        )
        continue
      memory = result["memory"]
      closing = (
        f"{result['closing_ms']:.2f}" if result["closes_windows"] else "—"
      )
      micro = f"{result['micro_ms']:.2f}" if result["feed"] != "window" else "—"
      lines.append(
        f"| {contender} | {micro} | {closing} | {result['window_ms']:.2f} |"
        f" {memory['temp_bytes'] / MIB:.1f} |"
        f" {memory['argument_bytes'] / MIB:.1f} |"
        f" {memory['output_bytes'] / MIB:.1f} |"
        f" {memory['alias_bytes'] / MIB:.1f} | {memory['large_copies']} |"
      )
    lines.append("")
  lines += [
    "### Figures",
    "",
    "| workload | figure | value | target | met |",
    "|---|---|---:|---|---|",
  ]
  for row in figures:
    met = {True: "yes", False: "**no**", None: ""}[row["met"]]
    lines.append(
      f"| {row['workload']} | {row['figure']} | {row['value']:.2f} |"
      f" {row['target'] or ''} | {met} |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="small sizes and 3 rounds (smoke)"
  )
  parser.add_argument(
    "--repeats", type=int, default=None, help="measured rounds (default 15)"
  )
  parser.add_argument(
    "--warmup", type=int, default=1, help="unmeasured rounds first"
  )
  parser.add_argument(
    "--workload",
    action="append",
    choices=["mlp", "transformer"],
    help="workload to run (repeatable; default: both)",
  )
  parser.add_argument(
    "--mlp-size",
    nargs=2,
    type=int,
    metavar=("WIDTH", "DEPTH"),
    help="the MLP's width and depth (default 2048 4; with --quick 512 4)",
  )
  parser.add_argument(
    "--contender",
    action="append",
    help="time only the contenders whose name holds this text (repeatable)",
  )
  parser.add_argument(
    "--output",
    type=pathlib.Path,
    default=REPO_ROOT / "benchmarks" / "results" / "latest.json",
    help="where to write the JSON record",
  )
  args = parser.parse_args(argv)
  repeats = args.repeats or (3 if args.quick else 15)
  if repeats < 1 or args.warmup < 0:
    parser.error("--repeats must be >= 1 and --warmup >= 0")
  if args.mlp_size is not None and min(args.mlp_size) < 1:
    parser.error("--mlp-size takes a positive width and depth")
  command = "python benchmarks/run.py " + " ".join(
    sys.argv[1:] if argv is None else argv
  )
  environment = environment_lib.environment(command.strip())
  selected = args.workload or ["mlp", "transformer"]
  workloads, figures = {}, []
  for workload in workloads_lib.reference_workloads(args.quick):
    if workload.name not in selected:
      continue
    if workload.name == "mlp" and args.mlp_size is not None:
      width, depth = args.mlp_size
      workload = workloads_lib.mlp(width, depth, 8, workload.every_k)
    print(f"{workload.name}: {workload.description}", file=sys.stderr)
    record = timing.measure_workload(
      workload, repeats, args.warmup, args.contender
    )
    workloads[workload.name] = record
    figures += timing.figures(workload.name, record)

  args.output.parent.mkdir(parents=True, exist_ok=True)
  args.output.write_text(
    json.dumps(
      {
        **environment,
        "repeats": repeats,
        "warmup": args.warmup,
        "workloads": workloads,
        "figures": figures,
      },
      indent=1,
    )
  )
  print(f"JSON written to {args.output}", file=sys.stderr)
  print(_markdown(environment, workloads, figures))


if __name__ == "__main__":
  main()
