"""Optimizer-state memory and window time with the state sharded (ZeRO-1).

Two ways to accumulate over k micro-steps under a plain ``jax.jit`` on an
Explicit ``data`` mesh (``jax.make_mesh`` + ``jax.set_mesh``, a batch
sharded ``P("data")``, replicated params, gradients from
``ga_optax.unreduced_value_and_grad``):

* replicated state: ``accumulate(adam, k, unreduced_axes="data")``; the
  window's close all-reduces the accumulator and every device runs Adam on
  the whole of it;
* sharded state: the same with ``inner_state_axes="data"``; the close
  reduce-scatters the accumulator onto the state's slices, each device runs
  Adam on its slice and the updates are all-gathered.

Optimizer-state bytes per device come from the arrays (the shard one device
holds) and from the compiler (``compiled.memory_analysis()`` of the program
that makes the state, and of the train step); collectives from the compiled
step's HLO (``audits.window_collectives``); window times are
medians over windows of k jitted, donated calls (each call waited for, so
that the micro-steps and the closing call are timed apart), the two variants
taking turns window by window. Prints a Markdown table and writes JSON::

  python benchmarks/zero.py                   # 8 simulated CPU devices
  python benchmarks/zero.py --width 1024 --json out.json
"""

from __future__ import annotations

import os

# Before jax is imported; it only adds CPU devices, so GPUs, when present,
# remain the default backend.
if "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src.audits import window_collectives
from ga_optax.testing import max_relative_difference

OUTPUTS = 10


def init_mlp(width: int, layers: int, seed: int = 0) -> dict[str, Any]:
  """Square hidden layers and a 10-way head: its bias divides by no D > 2."""
  keys = jax.random.split(jax.random.key(seed), layers + 1)
  hidden = [
    {
      "kernel": jax.random.normal(key, (width, width)) / np.sqrt(width),
      "bias": jnp.zeros(width),
    }
    for key in keys[:-1]
  ]
  head = {
    "kernel": jax.random.normal(keys[-1], (width, OUTPUTS)) / np.sqrt(width),
    "bias": jnp.zeros(OUTPUTS),
  }
  return {"hidden": hidden, "head": head}


def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
  hidden = batch["x"]
  for layer in params["hidden"]:
    hidden = jnp.tanh(hidden @ layer["kernel"] + layer["bias"])
  head = params["head"]
  prediction = hidden @ head["kernel"] + head["bias"]
  return jnp.mean((prediction - batch["y"]) ** 2)


def shard_bytes(tree: Any) -> int:
  """Bytes one device holds of ``tree``'s arrays."""
  return sum(
    leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree)
  )


def divisible_leaf_ratio(state: Any, devices: int) -> float:
  """Shard bytes over whole bytes for the leaves some dimension D divides."""
  leaves = [
    leaf
    for leaf in jax.tree.leaves(state)
    if any(size % devices == 0 for size in leaf.shape)
  ]
  whole = sum(leaf.nbytes for leaf in leaves)
  return sum(leaf.addressable_shards[0].data.nbytes for leaf in leaves) / whole


class Variant:
  """One accumulation: its compiled step, memory, collectives and timings."""

  def __init__(
    self,
    name: str,
    inner_state_axes: Any,
    args: argparse.Namespace,
    example: dict[str, jax.Array],
  ):
    self.name, self.k = name, args.k
    self.tx = ga_optax.accumulate(
      optax.adam(1e-3),
      args.k,
      unreduced_axes="data",
      inner_state_axes=inner_state_axes,
    )
    value_and_grad = ga_optax.unreduced_value_and_grad(loss_fn)

    def step(params, state, batch):
      _, grads = value_and_grad(params, batch)
      updates, state = self.tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    self.step = jax.jit(step, donate_argnums=(0, 1))
    self.params = init_mlp(args.width, args.layers)
    self.state = jax.jit(self.tx.init)(self.params)
    make_inner_state = jax.jit(lambda params: self.tx.init(params).inner_state)
    self.inner_state_compiled = (
      make_inner_state.lower(self.params)
      .compile()
      .memory_analysis()
      .output_size_in_bytes
    )
    compiled = self.step.lower(self.params, self.state, example).compile()
    self.step_memory = compiled.memory_analysis()
    found = window_collectives(compiled.as_text())
    self.per_micro_step = found.every_micro_step
    self.closing = found.window_closing
    self.micro_seconds: list[float] = []
    self.closing_seconds: list[float] = []
    self.window_seconds: list[float] = []

  def run_window(
    self, batches: list[dict[str, jax.Array]], timed: bool
  ) -> None:
    seconds = []
    for batch in batches:
      began = time.perf_counter()
      self.params, self.state = self.step(self.params, self.state, batch)
      jax.block_until_ready((self.params, self.state))
      seconds.append(time.perf_counter() - began)
    if timed:
      self.micro_seconds += seconds[:-1]
      self.closing_seconds.append(seconds[-1])
      self.window_seconds.append(sum(seconds))

  def row(self, devices: int) -> dict[str, Any]:
    inner_state = self.state.inner_state
    closing_bytes: dict[str, int] = {}
    for collective in self.closing:
      closing_bytes[collective.opcode] = (
        closing_bytes.get(collective.opcode, 0) + collective.operand_bytes
      )
    return {
      "variant": self.name,
      "state_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(inner_state)),
      "state_bytes_per_device": shard_bytes(inner_state),
      "state_bytes_per_device_compiled": self.inner_state_compiled,
      "divisible_leaves_shard_fraction": divisible_leaf_ratio(
        inner_state, devices
      ),
      "step_argument_bytes_compiled": self.step_memory.argument_size_in_bytes,
      "step_temp_bytes_compiled": self.step_memory.temp_size_in_bytes,
      "bytes_per_micro_step": sum(c.operand_bytes for c in self.per_micro_step),
      "closing_bytes_by_collective": closing_bytes,
      "micro_step_ms": 1e3 * statistics.median(self.micro_seconds),
      "closing_step_ms": 1e3 * statistics.median(self.closing_seconds),
      "window_ms": 1e3 * statistics.median(self.window_seconds),
    }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument(
    "--microbatch", type=int, default=8, help="examples per device"
  )
  parser.add_argument("--k", type=int, default=4, help="micro-steps per window")
  parser.add_argument("--windows", type=int, default=20, help="timed windows")
  parser.add_argument(
    "--json",
    type=Path,
    default=Path(__file__).resolve().parent / "results" / "zero.json",
  )
  args = parser.parse_args()

  devices = jax.devices()
  jax.set_mesh(jax.make_mesh((len(devices),), ("data",)))
  rng = np.random.default_rng(1)
  rows_per_call = len(devices) * args.microbatch
  windows = [
    [
      jax.device_put(
        {
          "x": rng.normal(size=(rows_per_call, args.width)).astype(np.float32),
          "y": rng.normal(size=(rows_per_call, OUTPUTS)).astype(np.float32),
        },
        P("data"),
      )
      for _ in range(args.k)
    ]
    for _ in range(args.windows + 1)
  ]
  variants = [
    Variant("replicated state", None, args, windows[0][0]),
    Variant("sharded state (inner_state_axes)", "data", args, windows[0][0]),
  ]
  # Window 0 warms up. The variants take turns window by window so that a
  # busy host slows both alike.
  for index, batches in enumerate(windows):
    for variant in variants:
      variant.run_window(batches, timed=index > 0)
  rows = [variant.row(len(devices)) for variant in variants]
  difference = max_relative_difference(
    *(jax.device_get(variant.params) for variant in variants)
  )
  num_params = sum(
    leaf.size for leaf in jax.tree.leaves(init_mlp(args.width, args.layers))
  )
  state_ratio = (
    rows[1]["state_bytes_per_device"] / rows[0]["state_bytes_per_device"]
  )
  time_ratio = rows[1]["window_ms"] / rows[0]["window_ms"]
  closing_ratio = rows[1]["closing_step_ms"] / rows[0]["closing_step_ms"]

  print(
    f"{len(devices)} x {devices[0].platform} devices"
    f" ({'simulated on the host' if devices[0].platform == 'cpu' else 'real'}),"
    f" MLP {args.layers} x {args.width}x{args.width} + head"
    f" ({num_params:,} float32 parameters), Adam, micro-batch"
    f" {args.microbatch} per device, k = {args.k}\n"
  )
  print(
    "| variant | Adam state bytes per device (shards) | (compiled) |"
    " shard / whole, divisible leaves | step arguments per device |"
    " step temporaries | collectives when a window closes (bytes per"
    " device) | micro-step ms | closing step ms | window ms |"
  )
  print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
  for row in rows:
    closing = ", ".join(
      f"{opcode} {size:,}"
      for opcode, size in sorted(row["closing_bytes_by_collective"].items())
    )
    print(
      f"| {row['variant']} | {row['state_bytes_per_device']:,} |"
      f" {row['state_bytes_per_device_compiled']:,} |"
      f" {row['divisible_leaves_shard_fraction']:.4f} |"
      f" {row['step_argument_bytes_compiled']:,} |"
      f" {row['step_temp_bytes_compiled']:,} | {closing} |"
      f" {row['micro_step_ms']:.2f} | {row['closing_step_ms']:.2f} |"
      f" {row['window_ms']:.2f} |"
    )
  print(
    f"\nstate bytes per device, sharded / replicated: {state_ratio:.4f}"
    f" (1/D = {1 / len(devices):.4f}); window time, sharded / replicated:"
    f" {time_ratio:.2f}x (closing call {closing_ratio:.2f}x); largest"
    f" relative parameter difference: {difference:.1e}"
  )

  report = {
    "benchmark": "zero",
    "devices": len(devices),
    "platform": devices[0].platform,
    "device_kind": devices[0].device_kind,
    "host": platform.processor() or platform.machine(),
    "jax": jax.__version__,
    "config": vars(args) | {"json": str(args.json), "parameters": num_params},
    "rows": rows,
    "state_bytes_per_device_ratio": state_ratio,
    "window_time_ratio": time_ratio,
    "closing_step_time_ratio": closing_ratio,
    "max_relative_parameter_difference": difference,
  }
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps(report, indent=2) + "\n")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
