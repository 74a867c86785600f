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
import dataclasses
import gc
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any, NamedTuple

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import ga_optax  # noqa: E402
from benchmarks import run as run_lib  # noqa: E402
from benchmarks import workloads as workloads_lib  # noqa: E402
from ga_optax._src.planning import device_memory  # noqa: E402

MIB = 2**20
LEARNING_RATE = 1e-4


class Config(NamedTuple):
  """One way to run the step: where the state lives, or no accumulation."""

  name: str
  accumulates: bool
  accumulator_memory_kind: str | None
  inner_state_memory_kind: str | None


CONFIGS = [
  Config("plain Adam step", False, None, None),
  Config("state on device", True, None, None),
  Config("accumulator on host", True, "pinned_host", None),
  Config(
    "accumulator and Adam state on host", True, "pinned_host", "pinned_host"
  ),
]


def _workloads(quick: bool) -> dict[str, workloads_lib.Workload]:
  """The reference MLP, one with six times its parameters, and the
  reference at a micro-batch whose activations outweigh the state."""
  if quick:
    return {
      "reference": workloads_lib.mlp(256, 4, microbatch=8, every_k=4),
      "larger": workloads_lib.mlp(512, 6, microbatch=8, every_k=4),
      "activation-heavy": workloads_lib.mlp(256, 4, microbatch=512, every_k=4),
    }
  return {
    "reference": workloads_lib.mlp(2048, 4, microbatch=8, every_k=4),
    "larger": workloads_lib.mlp(4096, 6, microbatch=8, every_k=4),
    "activation-heavy": workloads_lib.mlp(2048, 4, microbatch=2048, every_k=4),
  }


def _step_and_init(config: Config, workload: workloads_lib.Workload):
  """The jitted, donated step of ``config`` and its state's init."""
  adam = optax.adam(LEARNING_RATE)
  tx = adam
  if config.accumulates:
    tx = ga_optax.accumulate(
      adam,
      workload.every_k,
      accumulator_memory_kind=config.accumulator_memory_kind,
      inner_state_memory_kind=config.inner_state_memory_kind,
    )

  def step(params, state, batch):
    grads = jax.grad(workload.loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1)), tx.init


def _tree_bytes(tree: Any) -> int:
  return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def _offloaded_bytes(config: Config, state: Any) -> int:
  """Bytes of the state this configuration keeps in host memory."""
  if not config.accumulates:
    return 0
  moved = 0
  if config.accumulator_memory_kind == "pinned_host":
    moved += _tree_bytes(state.accumulator)
  if config.inner_state_memory_kind == "pinned_host":
    moved += _tree_bytes(state.inner_state)
  return moved


def _memory(compiled: Any) -> dict[str, int]:
  analysis = compiled.memory_analysis()
  fields = {
    name: int(getattr(analysis, name))
    for name in (
      "argument_size_in_bytes",
      "output_size_in_bytes",
      "alias_size_in_bytes",
      "temp_size_in_bytes",
      "host_argument_size_in_bytes",
      "host_output_size_in_bytes",
      "host_alias_size_in_bytes",
      "host_temp_size_in_bytes",
    )
  }
  return {"device_bytes": device_memory.device_bytes(compiled), **fields}


def _measure(workload, repeats: int, warmup: int) -> dict[str, Any]:
  fresh = lambda: jax.tree.map(jnp.copy, workload.params)  # noqa: E731
  steps, carries, results = {}, {}, {}
  for config in CONFIGS:
    step, init = _step_and_init(config, workload)
    params = fresh()
    state = init(params)
    print(f"  compiling {config.name}", file=sys.stderr, flush=True)
    compiled = step.lower(params, state, workload.microbatches[0]).compile()
    steps[config.name] = step
    carries[config.name] = (params, state)
    results[config.name] = {
      "memory": _memory(compiled),
      "offloaded_bytes": _offloaded_bytes(config, state),
      "state_kinds": sorted(
        {str(leaf.sharding.memory_kind) for leaf in jax.tree.leaves(state)}
      ),
      "rounds_ms": [],
    }

  def run_window(config: Config) -> list[float]:
    params, state = carries[config.name]
    times = []
    for batch in workload.microbatches:
      start = time.perf_counter()
      params, state = steps[config.name](params, state, batch)
      jax.block_until_ready((params, state))
      times.append((time.perf_counter() - start) * 1e3)
    carries[config.name] = (params, state)
    return times

  gc.collect()
  gc.disable()
  try:
    for round_index in range(warmup + repeats):
      shift = round_index % len(CONFIGS)
      for config in CONFIGS[shift:] + CONFIGS[:shift]:
        times = run_window(config)
        if round_index >= warmup:
          results[config.name]["rounds_ms"].append(times)
  finally:
    gc.enable()

  for config in CONFIGS:
    result = results[config.name]
    rounds = np.asarray(result["rounds_ms"])
    if config.accumulates:
      result["micro_ms"] = float(np.median(rounds[:, :-1]))
      result["closing_ms"] = float(np.median(rounds[:, -1]))
    else:
      result["micro_ms"] = result["closing_ms"] = float(np.median(rounds))
  return {
    "description": workload.description,
    "config": workload.config,
    "num_params": workload.num_params,
    "configs": results,
  }


def _figures(record: dict[str, Any]) -> list[dict[str, Any]]:
  """Per host configuration: the device bytes saved against those offloaded."""
  results = record["configs"]
  on_device = results["state on device"]
  rows = []
  for config in CONFIGS[2:]:
    result = results[config.name]
    saved = (
      on_device["memory"]["device_bytes"] - result["memory"]["device_bytes"]
    )
    offloaded = result["offloaded_bytes"]
    rows.append(
      {
        "config": config.name,
        "offloaded_bytes": offloaded,
        "saved_bytes": saved,
        "saved_over_offloaded": saved / offloaded,
        "within_5_percent": abs(saved / offloaded - 1) <= 0.05,
        "micro_ms_ratio": result["micro_ms"] / on_device["micro_ms"],
        "closing_ms_ratio": result["closing_ms"] / on_device["closing_ms"],
      }
    )
  return rows


def _peak_of(workload_name: str, config_index: int, quick: bool) -> dict:
  """Runs one configuration in this script's own fresh process: its peak."""
  command = [
    sys.executable,
    __file__,
    "--peak-of",
    f"{workload_name},{config_index}",
  ] + (["--quick"] if quick else [])
  # Without autotuning, whose trial buffers would make the compilation's
  # peak the process's.
  env = {
    **os.environ,
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
    + " --xla_gpu_autotune_level=0",
  }
  output = subprocess.run(
    command, capture_output=True, text=True, check=True, env=env
  ).stdout
  return json.loads(output.strip().splitlines()[-1])


def _peak_here(workload_name: str, config_index: int, quick: bool) -> None:
  """Prints the device's peak bytes in use over two windows, as JSON."""
  workload = _workloads(quick)[workload_name]
  config = CONFIGS[config_index]
  step, init = _step_and_init(config, workload)
  # One copy of the params alive, as in training.
  params = jax.tree.map(jnp.copy, workload.params)
  workload = dataclasses.replace(workload, params=None)
  gc.collect()
  state = init(params)
  for _ in range(2):
    for batch in workload.microbatches:
      params, state = step(params, state, batch)
  jax.block_until_ready((params, state))
  stats = jax.devices()[0].memory_stats() or {}
  print(json.dumps({"peak_bytes_in_use": stats.get("peak_bytes_in_use")}))


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
    _peak_here(workload_name, int(config_index), args.quick)
    return
  repeats = args.repeats or (2 if args.quick else 10)
  if repeats < 1 or args.warmup < 0:
    parser.error("--repeats must be >= 1 and --warmup >= 0")
  command = "python benchmarks/host_memory.py " + " ".join(
    sys.argv[1:] if argv is None else argv
  )
  environment = run_lib._environment(command.strip())
  workloads, figures = {}, []
  for name, workload in _workloads(args.quick).items():
    if args.workload and name not in args.workload:
      continue
    print(f"{name}: {workload.description}", file=sys.stderr)
    record = _measure(workload, repeats, args.warmup)
    if args.peak:
      for config_index, config in enumerate(CONFIGS):
        peak = _peak_of(name, config_index, args.quick)
        record["configs"][config.name].update(peak)
    workloads[name] = record
    figures += [{"workload": name, **row} for row in _figures(record)]
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
