"""Device memory and micro-step time with the accumulator in host memory.

For each workload, compiles and runs the same jitted, donated train step
``step(params, state, batch) -> (params, state)`` four ways:

* plain Adam step: no accumulation (the micro-batch run alone);
* state on device: ``ga_optax.accumulate(adam, k)``;
* accumulator on host: ``accumulator_memory_kind="pinned_host"``;
* accumulator and Adam state on host: also ``inner_state_memory_kind``.

Device bytes are read from XLA's analysis of each executable
(``ga_optax._src.planning.device_memory.device_bytes``: arguments, outputs that do not
reuse an argument's buffer and temporaries, in device memory only) and
compared with the bytes of the state that was moved to the host. Step times
are medians over interleaved rounds, as in ``benchmarks/run.py``. With
``--peak`` each configuration also runs in a fresh process that reports the
device's peak bytes in use (``device.memory_stats()``, GPUs and TPUs only).

Usage::

  python benchmarks/host_memory.py               # both workloads, 10 rounds
  python benchmarks/host_memory.py --quick       # small sizes, 2 rounds (smoke)
  python benchmarks/host_memory.py --peak --output gpu.json   # on a GPU

The markdown tables are printed last; the JSON record goes to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import environment as environment_lib  # noqa: E402
from benchmarks import host_offload  # noqa: E402

MIB = 2**20


def _markdown(environment, workloads, figures) -> str:
  device = environment["device"]
  lines = [
    f"Date: {environment['date']} · device: {device['platform']}"
    f" ({device['kind']}) · jax {environment['versions']['jax']}",
    "",
    f"Command: `{environment['command']}`",
    "",
  ]
  for name, record in workloads.items():
    lines += [
      f"### {name}: {record['description']}",
      "",
      f"{record['num_params']:,} parameters. Device MiB from the compiled"
      " executable (arguments + unaliased outputs + temporaries in device"
      " memory); medians over interleaved rounds.",
      "",
      "| configuration | device MiB | offloaded MiB | temp MiB |"
      " peak MiB | micro-step ms | window-closing ms |",
      "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for config_name, result in record["configs"].items():
      memory = result["memory"]
      peak = result.get("peak_bytes_in_use")
      lines.append(
        f"| {config_name} | {memory['device_bytes'] / MIB:.1f} |"
        f" {result['offloaded_bytes'] / MIB:.1f} |"
        f" {memory['temp_size_in_bytes'] / MIB:.1f} |"
        f" {'' if peak is None else f'{peak / MIB:.1f}'} |"
        f" {result['micro_ms']:.2f} | {result['closing_ms']:.2f} |"
      )
    lines.append("")
  lines += [
    "### Device bytes saved against state offloaded, and time",
    "",
    "| workload | configuration | saved / offloaded | within 5% |"
    " micro-step host / device | window-closing host / device |",
    "|---|---|---:|---|---:|---:|",
  ]
  for row in figures:
    lines.append(
      f"| {row['workload']} | {row['config']} |"
      f" {row['saved_over_offloaded']:.3f} |"
      f" {'yes' if row['within_5_percent'] else '**no**'} |"
      f" {row['micro_ms_ratio']:.2f} | {row['closing_ms_ratio']:.2f} |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument(
    "--peak",
    action="store_true",
    help="also measure each configuration's peak device memory",
  )
  parser.add_argument(
    "--workload",
    action="append",
    choices=["reference", "larger", "activation-heavy"],
    help="workload to run (repeatable; default: all three)",
  )
  parser.add_argument("--peak-of", help=argparse.SUPPRESS)
  parser.add_argument(
    "--output",
    type=pathlib.Path,
    default=REPO_ROOT / "benchmarks" / "results" / "host_memory.json",
  )
  args = parser.parse_args(argv)
  if args.peak_of:
    workload_name, config_index = args.peak_of.split(",")
    host_offload.peak_here(workload_name, int(config_index), args.quick)
    return
  repeats = args.repeats or (2 if args.quick else 10)
  if repeats < 1 or args.warmup < 0:
    parser.error("--repeats must be >= 1 and --warmup >= 0")
  command = "python benchmarks/host_memory.py " + " ".join(
    sys.argv[1:] if argv is None else argv
  )
  environment = environment_lib.environment(command.strip())
  workloads, figures = {}, []
  for name, workload in host_offload.workloads(args.quick).items():
    if args.workload and name not in args.workload:
      continue
    print(f"{name}: {workload.description}", file=sys.stderr)
    record = host_offload.measure(workload, repeats, args.warmup)
    if args.peak:
      for config_index, config in enumerate(host_offload.CONFIGS):
        peak = host_offload.peak_of(name, config_index, args.quick)
        record["configs"][config.name].update(peak)
    workloads[name] = record
    figures += [
      {"workload": name, **row} for row in host_offload.figures(record)
    ]
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
