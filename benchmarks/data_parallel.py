"""Cross-device traffic of data-parallel accumulation, deferred or not.

Compares two ways to accumulate over k micro-steps on a ``data`` mesh:

* deferred: ``ga_optax.accumulate(..., axis_name="data")``; micro-steps add
  into device-local accumulators and the window's closing step sums them
  across devices once;
* every micro-step: each micro-step averages its gradients across devices
  (``lax.pmean``, like a plain DDP loop without ``no_sync``) and then
  accumulates them with ``ga_optax.accumulate`` without ``axis_name``.

Collective counts and bytes come from the compiled program
(``ga_optax._src.distributed.window_collectives``): the all-reduce operand
bytes per device of the part that runs on every micro-step and of the branch
that runs when a window closes. Step times are medians over windows of the
jitted, donated step. Prints a Markdown table and writes JSON::

  python benchmarks/data_parallel.py                   # 8 simulated CPU devices
  python benchmarks/data_parallel.py --json out.json --width 1024
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src import distributed
from ga_optax.testing import max_relative_difference


def init_mlp(width: int, layers: int, seed: int = 0) -> list[dict[str, Any]]:
  keys = jax.random.split(jax.random.key(seed), layers)
  return [
    {
      "kernel": jax.random.normal(key, (width, width)) / np.sqrt(width),
      "bias": jnp.zeros(width),
    }
    for key in keys
  ]


def loss_fn(params, x, y):
  hidden = x
  for layer in params[:-1]:
    hidden = jnp.tanh(hidden @ layer["kernel"] + layer["bias"])
  prediction = hidden @ params[-1]["kernel"] + params[-1]["bias"]
  return jnp.mean((prediction - y) ** 2)


def deferred_step(tx: optax.GradientTransformationExtraArgs) -> Callable:
  def step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def every_micro_step(tx: optax.GradientTransformationExtraArgs) -> Callable:
  def step(params, state, x, y):
    grads = jax.lax.pmean(jax.grad(loss_fn)(params, x, y), "data")
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def summarize(collectives: list[distributed.Collective]) -> dict[str, int]:
  return {
    "count": len(collectives),
    "bytes": sum(collective.operand_bytes for collective in collectives),
  }


class Variant:
  """One way of accumulating: its compiled step, its audit and its timings."""

  def __init__(
    self,
    name: str,
    step_fn: Callable,
    tx: optax.GradientTransformationExtraArgs,
    mesh: Mesh,
    args: argparse.Namespace,
    example: tuple[np.ndarray, np.ndarray],
  ):
    self.name, self.k = name, args.k
    self.step = jax.jit(
      jax.shard_map(
        step_fn,
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=(P(), P()),
        check_vma=False,
      ),
      donate_argnums=(0, 1),
    )
    self.params = init_mlp(args.width, args.layers)
    self.state = tx.init(self.params)
    found = distributed.window_collectives(
      self.step.lower(self.params, self.state, *example).compile().as_text()
    )
    self.per_micro_step = summarize(found.every_micro_step)
    self.closing = summarize(found.window_closing)
    self.micro_seconds: list[float] = []
    self.closing_seconds: list[float] = []

  def run_window(self, xs: np.ndarray, ys: np.ndarray, timed: bool) -> None:
    for micro_step in range(self.k):
      began = time.perf_counter()
      self.params, self.state = self.step(
        self.params, self.state, xs[micro_step], ys[micro_step]
      )
      jax.block_until_ready((self.params, self.state))
      elapsed = time.perf_counter() - began
      if timed:
        closes = micro_step == self.k - 1
        (self.closing_seconds if closes else self.micro_seconds).append(elapsed)

  def row(self) -> dict[str, Any]:
    per_window = {
      key: self.k * self.per_micro_step[key] + self.closing[key]
      for key in self.closing
    }
    return {
      "variant": self.name,
      "collectives_per_micro_step": self.per_micro_step["count"],
      "bytes_per_micro_step": self.per_micro_step["bytes"],
      "collectives_when_window_closes": self.closing["count"],
      "bytes_when_window_closes": self.closing["bytes"],
      "collectives_per_window": per_window["count"],
      "bytes_per_window": per_window["bytes"],
      "micro_step_ms": (
        1e3 * statistics.median(self.micro_seconds)
        if self.micro_seconds
        else None
      ),
      "closing_step_ms": 1e3 * statistics.median(self.closing_seconds),
    }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument(
    "--microbatch", type=int, default=8, help="examples per device"
  )
  parser.add_argument("--k", type=int, default=4, help="micro-steps per window")
  parser.add_argument("--windows", type=int, default=5, help="timed windows")
  parser.add_argument(
    "--json",
    type=Path,
    default=Path(__file__).resolve().parent / "results" / "data_parallel.json",
  )
  args = parser.parse_args()

  devices = jax.devices()
  mesh = Mesh(np.array(devices), ("data",))
  optimizer = optax.adam(1e-3)
  rng = np.random.default_rng(1)
  shape = (args.windows + 1, args.k, len(devices) * args.microbatch, args.width)
  xs = rng.normal(size=shape).astype(np.float32)
  ys = rng.normal(size=shape).astype(np.float32)
  variants = [
    Variant(
      "deferred (axis_name)",
      deferred_step(
        tx := ga_optax.accumulate(optimizer, args.k, axis_name="data")
      ),
      tx,
      mesh,
      args,
      (xs[0, 0], ys[0, 0]),
    ),
    Variant(
      "pmean every micro-step",
      every_micro_step(tx := ga_optax.accumulate(optimizer, args.k)),
      tx,
      mesh,
      args,
      (xs[0, 0], ys[0, 0]),
    ),
  ]
  # Window 0 warms up (compilation, and a recompilation once the state
  # carries the mesh's sharding). The variants take turns window by window
  # so that a busy host slows both alike.
  for window in range(args.windows + 1):
    for variant in variants:
      variant.run_window(xs[window], ys[window], timed=window > 0)
  rows = [variant.row() for variant in variants]
  final_params = [jax.device_get(variant.params) for variant in variants]

  num_params = sum(
    leaf.size for leaf in jax.tree.leaves(init_mlp(args.width, args.layers))
  )
  ratio = rows[1]["bytes_per_window"] / rows[0]["bytes_per_window"]
  difference = max_relative_difference(final_params[0], final_params[1])
  print(
    f"{len(devices)} x {devices[0].platform} devices"
    f" ({'simulated on the host' if devices[0].platform == 'cpu' else 'real'}),"
    f" MLP {args.layers} x {args.width}x{args.width} ({num_params:,} float32"
    f" parameters), Adam, micro-batch {args.microbatch} per device,"
    f" k = {args.k}\n"
  )
  print(
    "| variant | all-reduces per micro-step | all-reduces when a window"
    " closes | all-reduces per window | bytes per window (per device) |"
    " micro-step ms | closing step ms |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|")
  for row in rows:
    micro_ms = (
      "n/a" if row["micro_step_ms"] is None else f"{row['micro_step_ms']:.2f}"
    )
    print(
      f"| {row['variant']} | {row['collectives_per_micro_step']} |"
      f" {row['collectives_when_window_closes']} |"
      f" {row['collectives_per_window']} | {row['bytes_per_window']:,} |"
      f" {micro_ms} | {row['closing_step_ms']:.2f} |"
    )
  print(
    f"\ntraffic per window, every micro-step / deferred: {ratio:.2f}x;"
    f" largest relative parameter difference between the variants:"
    f" {difference:.1e}"
  )

  report = {
    "benchmark": "data_parallel",
    "devices": len(devices),
    "platform": devices[0].platform,
    "device_kind": devices[0].device_kind,
    "host": platform.processor() or platform.machine(),
    "jax": jax.__version__,
    "config": vars(args) | {"json": str(args.json), "parameters": num_params},
    "rows": rows,
    "traffic_ratio_per_window": ratio,
    "max_relative_parameter_difference": difference,
  }
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps(report, indent=2) + "\n")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
