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

The markdown tables are printed last; the JSON record (machine, device, jax
version, date, raw timings) goes to ``--output``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import platform
import re
import sys
import time
from typing import Any

# Runs as a script from any directory: the repository root holds the package
# and the `benchmarks` helpers.
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import ga_optax  # noqa: E402
from benchmarks import contenders as contenders_lib  # noqa: E402
from benchmarks import workloads as workloads_lib  # noqa: E402

MIB = 2**20
_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "f64": 8,
  "s64": 8,
  "u64": 8,
}
_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(")

# (figure, numerator, denominator, how, target); `how` picks the measure.
FIGURES = [
  (
    "accumulate micro-step / floor (gradient + accumulate + zero updates)",
    ("ga_optax.accumulate", "micro_ms"),
    ("floor: + write and apply zero updates", "micro_ms"),
    "<=",
    1.25,
  ),
  (
    "MultiSteps micro-step / accumulate micro-step",
    ("optax.MultiSteps", "micro_ms"),
    ("ga_optax.accumulate", "micro_ms"),
    ">=",
    1.7,
  ),
  (
    "accumulate window-closing step / plain Adam step",
    ("ga_optax.accumulate", "closing_ms"),
    ("plain Adam step", "micro_ms"),
    "<=",
    1.25,
  ),
  (
    "accumulate compiled temp bytes / plain Adam step's",
    ("ga_optax.accumulate", "temp_bytes"),
    ("plain Adam step", "temp_bytes"),
    "<=",
    1.10,
  ),
  (
    "micro-batched window / (k gradients + one optimizer step)",
    ("ga_optax.microbatched_value_and_grad", "window_ms"),
    ("k gradients + optimizer", "window_ms"),
    "<=",
    1.15,
  ),
  (
    "fused micro-step / floor (gradient + accumulate)",
    ("ga_optax.accumulate_and_apply", "micro_ms"),
    ("floor: gradient + accumulate", "micro_ms"),
    "<=",
    1.15,
  ),
  (
    "fused window-closing step / plain Adam step",
    ("ga_optax.accumulate_and_apply", "closing_ms"),
    ("plain Adam step", "micro_ms"),
    "<=",
    1.25,
  ),
  (
    "fused compiled temp bytes / plain Adam step's",
    ("ga_optax.accumulate_and_apply", "temp_bytes"),
    ("plain Adam step", "temp_bytes"),
    "<=",
    1.10,
  ),
  (
    "accumulate micro-step with the noise scale / without",
    ("ga_optax.accumulate + noise scale", "micro_ms"),
    ("ga_optax.accumulate", "micro_ms"),
    "<=",
    1.15,
  ),
  (
    "accumulate window-closing step with the noise scale / without",
    ("ga_optax.accumulate + noise scale", "closing_ms"),
    ("ga_optax.accumulate", "closing_ms"),
    "info",
    None,
  ),
  (
    "accumulate compiled temp bytes with the noise scale / without",
    ("ga_optax.accumulate + noise scale", "temp_bytes"),
    ("ga_optax.accumulate", "temp_bytes"),
    "info",
    None,
  ),
  (
    "MultiSteps micro-step / floor (gradient + accumulate + zero updates)",
    ("optax.MultiSteps", "micro_ms"),
    ("floor: + write and apply zero updates", "micro_ms"),
    "info",
    None,
  ),
  (
    "MultiSteps window-closing step / plain Adam step",
    ("optax.MultiSteps", "closing_ms"),
    ("plain Adam step", "micro_ms"),
    "info",
    None,
  ),
  (
    "MultiSteps compiled temp bytes / plain Adam step's",
    ("optax.MultiSteps", "temp_bytes"),
    ("plain Adam step", "temp_bytes"),
    "info",
    None,
  ),
]


def _hlo_copies(hlo_text: str, min_bytes: int = MIB) -> tuple[int, int]:
  """Count and total bytes of ``copy`` instructions of at least min_bytes."""
  count = total = 0
  for dtype, dims in _COPY.findall(hlo_text):
    size = _DTYPE_BYTES.get(dtype, 4) * int(
      np.prod([int(d) for d in dims.split(",") if d] or [1])
    )
    if size >= min_bytes:
      count += 1
      total += size
  return count, total


def _fresh(tree: Any) -> Any:
  """A copy with its own buffers (donation consumes the ones passed in)."""
  return jax.tree.map(jnp.copy, tree)


def _feeds(contender, workload, fixed_grads) -> list[Any]:
  """The arguments of the calls of one window."""
  if contender.feed == "micro":
    return list(workload.microbatches)
  if contender.feed == "window":
    return [workload.window_batch]
  return [fixed_grads] * workload.every_k


def _memory(contender, params, state, batch) -> dict[str, Any]:
  compiled = contender.step.lower(params, state, batch).compile()
  analysis = compiled.memory_analysis()
  text = compiled.as_text()
  copies, copied_bytes = _hlo_copies(text)
  return {
    "temp_bytes": int(analysis.temp_size_in_bytes),
    "argument_bytes": int(analysis.argument_size_in_bytes),
    "output_bytes": int(analysis.output_size_in_bytes),
    "alias_bytes": int(analysis.alias_size_in_bytes),
    "large_copies": copies,
    "large_copy_bytes": copied_bytes,
    "conditionals": text.count(" conditional("),
  }


def _measure_workload(workload, repeats: int, warmup: int) -> dict[str, Any]:
  contenders = contenders_lib.build(workload)
  fixed_grads = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p), workload.params)
  carries, feeds, results = {}, {}, {}
  for contender in contenders:
    params = _fresh(workload.params)
    # Its own buffers too: donation refuses one buffer passed for two
    # leaves, as an init that shares a zero between leaves returns.
    state = _fresh(contender.init(params))
    feeds[contender.name] = _feeds(contender, workload, fixed_grads)
    print(f"  compiling {contender.name}", file=sys.stderr, flush=True)
    results[contender.name] = {
      "description": contender.description,
      "feed": contender.feed,
      "closes_windows": contender.closes_windows,
      "memory": _memory(contender, params, state, feeds[contender.name][0]),
      "rounds_ms": [],
    }
    carries[contender.name] = (params, state)

  def run_window(contender) -> list[float]:
    params, state = carries[contender.name]
    times = []
    for batch in feeds[contender.name]:
      start = time.perf_counter()
      params, state = contender.step(params, state, batch)
      jax.block_until_ready((params, state))
      times.append((time.perf_counter() - start) * 1e3)
    carries[contender.name] = (params, state)
    return times

  gc.collect()
  gc.disable()
  try:
    for round_index in range(warmup + repeats):
      # Rotating the order spreads slow spells over all contenders.
      shift = round_index % len(contenders)
      for contender in contenders[shift:] + contenders[:shift]:
        times = run_window(contender)
        if round_index >= warmup:
          results[contender.name]["rounds_ms"].append(times)
      print(
        f"  round {round_index + 1}/{warmup + repeats}",
        file=sys.stderr,
        flush=True,
      )
  finally:
    gc.enable()

  for contender in contenders:
    result = results[contender.name]
    rounds = np.asarray(result["rounds_ms"])
    if contender.closes_windows:
      result["micro_ms"] = float(np.median(rounds[:, :-1]))
      result["closing_ms"] = float(np.median(rounds[:, -1]))
    else:
      result["micro_ms"] = result["closing_ms"] = float(np.median(rounds))
    result["window_ms"] = float(np.median(rounds.sum(axis=1)))
    result["temp_bytes"] = result["memory"]["temp_bytes"]
  if "gradient only" in results and "optimizer only" in results:
    results["k gradients + optimizer"] = {
      "description": "derived: k x gradient only + optimizer only",
      "window_ms": workload.every_k * results["gradient only"]["micro_ms"]
      + results["optimizer only"]["micro_ms"],
    }
  return {
    "description": workload.description,
    "config": workload.config,
    "num_params": workload.num_params,
    "contenders": results,
  }


def _figures(workload_name: str, record: dict[str, Any]) -> list[dict]:
  rows = []
  results = record["contenders"]
  for name, (top, top_key), (bottom, bottom_key), how, target in FIGURES:
    if top not in results or bottom not in results:
      continue
    value = results[top][top_key] / results[bottom][bottom_key]
    met = None
    if how == "<=":
      met = value <= target
    elif how == ">=":
      met = value >= target
    rows.append(
      {
        "workload": workload_name,
        "figure": name,
        "value": value,
        "target": None if target is None else f"{how} {target}",
        "met": met,
      }
    )
  return rows


def _environment(command: str) -> dict[str, Any]:
  device = jax.devices()[0]
  return {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": {
      "platform": platform.platform(),
      "processor": platform.processor() or platform.machine(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
    },
    "device": {
      "platform": device.platform,
      "kind": device.device_kind,
      "count": jax.device_count(),
    },
    "versions": {
      "jax": jax.__version__,
      "jaxlib": getattr(jax.lib, "__version__", None)
      or getattr(sys.modules.get("jaxlib"), "__version__", None),
      "optax": optax.__version__,
      "ga_optax": ga_optax.__version__,
    },
    "command": command,
  }


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
    "--output",
    type=pathlib.Path,
    default=REPO_ROOT / "benchmarks" / "results" / "latest.json",
    help="where to write the JSON record",
  )
  args = parser.parse_args(argv)
  repeats = args.repeats or (3 if args.quick else 15)
  if repeats < 1 or args.warmup < 0:
    parser.error("--repeats must be >= 1 and --warmup >= 0")
  command = "python benchmarks/run.py " + " ".join(
    sys.argv[1:] if argv is None else argv
  )
  environment = _environment(command.strip())
  selected = args.workload or ["mlp", "transformer"]
  workloads, figures = {}, []
  for workload in workloads_lib.reference_workloads(args.quick):
    if workload.name not in selected:
      continue
    print(f"{workload.name}: {workload.description}", file=sys.stderr)
    record = _measure_workload(workload, repeats, args.warmup)
    workloads[workload.name] = record
    figures += _figures(workload.name, record)

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
