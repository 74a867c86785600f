"""Cross-device traffic of data-parallel accumulation, deferred or not.

Compares two ways to accumulate over k micro-steps on a ``data`` mesh:

* deferred: ``ga_optax.accumulate(..., axis_name="data")``; micro-steps add
  into device-local accumulators and the window's closing step sums them
  across devices once;
* every micro-step: each micro-step averages its gradients across devices
  (``lax.pmean``, like a plain DDP loop without ``no_sync``) and then
  accumulates them with ``ga_optax.accumulate`` without ``axis_name``.

Collective counts and bytes come from the compiled program
(``ga_optax.testing.window_collectives``): the all-reduce operand
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
from ga_optax import testing
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


def summarize(collectives: list[testing.Collective]) -> dict[str, int]:
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
    found = testing.window_collectives(
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


def executed_collectives(hlo_text: str) -> dict[str, int]:
  """Collectives one call runs, a loop body's counted once per iteration."""
  module = testing.parse_hlo(hlo_text)
  totals = {"count": 0, "bytes": 0, "in_loops": 0}

  def visit(computation: str, times: int, in_loop: bool) -> None:
    for collective in testing.collectives_in_hlo(module, [computation]):
      totals["count"] += times
      totals["bytes"] += times * collective.operand_bytes
      totals["in_loops"] += in_loop
    for instruction in module.computations.get(computation, ()):
      if instruction.opcode == "while":
        if instruction.trip_count is None:
          raise ValueError(f"unknown trip count of {instruction.name}")
        for callee in instruction.callees:
          visit(callee, times * instruction.trip_count, True)
      else:
        for callee in instruction.callees:
          visit(callee, times, in_loop)

  visit(module.entry, 1, False)
  return totals


def scan_window_step(
  optimizer: optax.GradientTransformation, k: int, deferred: bool
) -> Callable:
  """One window in one call: a lax.scan over k micro-batches, then Adam."""
  if deferred:
    value_and_grad = ga_optax.microbatched_value_and_grad(
      lambda params, batch: loss_fn(params, *batch), k, axis_name="data"
    )
  else:

    def value_and_grad(params, batch):
      microbatches = jax.tree.map(
        lambda leaf: leaf.reshape(k, -1, *leaf.shape[1:]), batch
      )

      def body(grad_sum, microbatch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *microbatch)
        grads = jax.lax.pmean(grads, "data")
        return jax.tree.map(jnp.add, grad_sum, grads), loss

      grad_sum, losses = jax.lax.scan(
        body, optax.tree.zeros_like(params), microbatches
      )
      return losses.mean(), optax.tree.scale(1 / k, grad_sum)

  def step(params, opt_state, x, y):
    _, grads = value_and_grad(params, (x, y))
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def scan_variant(
  name: str,
  deferred: bool,
  optimizer: optax.GradientTransformation,
  mesh: Mesh,
  args: argparse.Namespace,
  xs: np.ndarray,
  ys: np.ndarray,
) -> tuple[Callable, Callable, dict[str, Any]]:
  """Compiles and audits a one-call-per-window variant; times it on demand."""
  step = jax.jit(
    jax.shard_map(
      scan_window_step(optimizer, args.k, deferred),
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P(), P()),
      check_vma=False,
    ),
    donate_argnums=(0, 1),
  )
  params = init_mlp(args.width, args.layers)
  opt_state = optimizer.init(params)
  # Each device's rows hold its k micro-batches, back to back.
  num_devices = mesh.devices.size
  windows_x = xs.reshape(xs.shape[0], num_devices, -1, xs.shape[-1])
  windows_x = windows_x.reshape(xs.shape[0], -1, xs.shape[-1])
  windows_y = ys.reshape(windows_x.shape)
  totals = executed_collectives(
    step.lower(params, opt_state, windows_x[0], windows_y[0])
    .compile()
    .as_text()
  )
  seconds: list[float] = []
  state = {"params": params, "opt_state": opt_state}

  def run_window(window: int) -> None:
    began = time.perf_counter()
    state["params"], state["opt_state"] = step(
      state["params"], state["opt_state"], windows_x[window], windows_y[window]
    )
    jax.block_until_ready(state["params"])
    if window > 0:
      seconds.append(time.perf_counter() - began)

  def row() -> dict[str, Any]:
    return {
      "variant": name,
      "collectives_per_window": totals["count"],
      "collective_ops_in_scan_body": totals["in_loops"],
      "bytes_per_window": totals["bytes"],
      "window_ms": 1e3 * statistics.median(seconds),
    }

  return run_window, row, state


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

  scan_variants = [
    scan_variant(name, deferred, optimizer, mesh, args, xs, ys)
    for name, deferred in (
      ("microbatched_value_and_grad(axis_name)", True),
      ("lax.scan with pmean per micro-batch", False),
    )
  ]
  for window in range(args.windows + 1):
    for run_window, _, _ in scan_variants:
      run_window(window)
  scan_rows = [row() for _, row, _ in scan_variants]
  scan_params = [
    jax.device_get(state["params"]) for _, _, state in scan_variants
  ]
  scan_ratio = (
    scan_rows[1]["bytes_per_window"] / scan_rows[0]["bytes_per_window"]
  )
  scan_difference = max_relative_difference(scan_params[0], scan_params[1])
  print(
    "\nIn-step micro-batching (one call per window):\n\n"
    "| variant | all-reduces per window | all-reduce ops in the scan body |"
    " bytes per window (per device) | window ms |\n"
    "|---|---:|---:|---:|---:|"
  )
  for row in scan_rows:
    print(
      f"| {row['variant']} | {row['collectives_per_window']} |"
      f" {row['collective_ops_in_scan_body']} | {row['bytes_per_window']:,} |"
      f" {row['window_ms']:.2f} |"
    )
  print(
    f"\ntraffic per window, pmean per micro-batch / deferred:"
    f" {scan_ratio:.2f}x; largest relative parameter difference:"
    f" {scan_difference:.1e}"
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
    "microbatched_rows": scan_rows,
    "microbatched_traffic_ratio_per_window": scan_ratio,
    "microbatched_max_relative_parameter_difference": scan_difference,
  }
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps(report, indent=2) + "\n")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
