"""The accumulator and the optimizer state in host memory: steps and figures.

:data:`CONFIGS` are the four ways to run the same jitted, donated train step
``step(params, state, batch) -> (params, state)``: a plain Adam step, and
``ga_optax.accumulate(adam, k)`` with its state on the device, its
accumulator in ``pinned_host`` memory, or its accumulator and Adam's state
there. :func:`measure` compiles and runs each on a workload of
:func:`workloads`: the device bytes of each executable
(``ga_optax._src.planning.device_memory.device_bytes``), the bytes of the
state moved to the host, and median step times over interleaved rounds;
:func:`figures` sets the device bytes saved against those offloaded, and
:func:`peak_of` reads a configuration's peak bytes in a fresh process.
``benchmarks/host_memory.py``, ``benchmarks/largest_batch.py`` and
``benchmarks/gpu_report.py`` use them.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ga_optax
from benchmarks import workloads as workloads_lib
from ga_optax._src.planning import device_memory

# The script whose ``--peak-of`` runs one configuration in a fresh process.
HOST_MEMORY_SCRIPT = (
  pathlib.Path(__file__).resolve().with_name("host_memory.py")
)
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


def workloads(quick: bool) -> dict[str, workloads_lib.Workload]:
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


def step_and_init(config: Config, workload: workloads_lib.Workload):
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


def measure(workload, repeats: int, warmup: int) -> dict[str, Any]:
  """Each configuration's device bytes, offloaded bytes and median times."""
  fresh = lambda: jax.tree.map(jnp.copy, workload.params)  # noqa: E731
  steps, carries, results = {}, {}, {}
  for config in CONFIGS:
    step, init = step_and_init(config, workload)
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


def figures(record: dict[str, Any]) -> list[dict[str, Any]]:
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


def peak_of(workload_name: str, config_index: int, quick: bool) -> dict:
  """Runs one configuration in a fresh process of ``benchmarks/host_memory.py``
  (its ``--peak-of``, which calls :func:`peak_here`): its peak."""
  command = [
    sys.executable,
    str(HOST_MEMORY_SCRIPT),
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


def peak_here(workload_name: str, config_index: int, quick: bool) -> None:
  """Prints the device's peak bytes in use over two windows, as JSON."""
  workload = workloads(quick)[workload_name]
  config = CONFIGS[config_index]
  step, init = step_and_init(config, workload)
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
