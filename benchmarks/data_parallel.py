"""Data-parallel accumulation on a mesh: rows per device, all-reduces, time.

One window of ``B`` rows on ``D`` devices in ``k`` micro-batches, then one
Adam step, written each way a JAX user would reach for:

* ga_optax under JAX's default workflow (``jax.make_mesh`` with Explicit
  axes, ``jax.set_mesh``, a batch put with ``P("data")``, a plain
  ``jax.jit``): ``microbatched_value_and_grad`` (the window in one call), and
  ``unreduced_value_and_grad`` + ``accumulate(unreduced_axes="data")`` (one
  call per micro-batch);
* ga_optax under Auto axes: ``microbatched_value_and_grad(axis_name="data")``;
* ``optax.microbatching.microbatch`` of ``jax.value_and_grad`` (Auto axes);
* ``optax.MultiSteps`` fed ``jax.value_and_grad``'s replicated gradients,
  one call per micro-batch (Explicit axes);
* ga_optax inside ``jax.shard_map``: ``microbatched_value_and_grad(
  axis_name="data")`` in one call, and ``accumulate(axis_name="data")``
  across calls;
* and the large batch itself, for reference.

Read from each compiled program with ``ga_optax.testing``: the rows each
device multiplies per micro-batch (``hlo.dot_shapes``: the activations that
meet a kernel), and the all-reduces of one window as they run (a loop body's
once per iteration, the closing branch's once per window, the others once
per call). Window times are medians over windows; the variants take turns
window by window, in a rotating order, so that a busy host slows them alike.
The last column is each variant's largest relative parameter difference
from the large batch after the run. Prints a Markdown table, the ratios and
the targets, and writes JSON::

  python benchmarks/data_parallel.py                   # 8 simulated CPU devices
  python benchmarks/data_parallel.py --width 1024 --windows 20
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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src import audits
from ga_optax.testing import max_relative_difference

Batch = dict[str, jax.Array]


def init_mlp(width: int, layers: int, seed: int = 0) -> list[dict[str, Any]]:
  keys = jax.random.split(jax.random.key(seed), layers)
  return [
    {
      "kernel": jax.random.normal(key, (width, width)) / np.sqrt(width),
      "bias": jnp.zeros(width),
    }
    for key in keys
  ]


def loss_fn(params: list[dict[str, Any]], batch: Batch) -> jax.Array:
  hidden = batch["x"]
  for layer in params[:-1]:
    hidden = jnp.tanh(hidden @ layer["kernel"] + layer["bias"])
  prediction = hidden @ params[-1]["kernel"] + params[-1]["bias"]
  return jnp.mean((prediction - batch["y"]) ** 2)


def optimizer_step(value_and_grad: Callable, tx: Any) -> Callable:
  """``(params, state, batch) -> (params, state, loss)``."""

  def step(params: Any, state: Any, batch: Batch) -> tuple[Any, Any, Any]:
    loss, grads = value_and_grad(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


class Variant(NamedTuple):
  """One way to train a window.

  Attributes:
    name: the row's name.
    mesh: the mesh it runs on (Explicit or Auto axes).
    calls_per_window: 1 when a call takes the window, k when a micro-batch.
    init: ``params -> state``.
    step: ``(params, state, batch) -> (params, state, loss)``, jitted with
      params and state donated.
  """

  name: str
  mesh: Mesh
  calls_per_window: int
  init: Callable[[Any], Any]
  step: Any


LARGE_BATCH = "large batch (no accumulation)"
EXPLICIT_IN_STEP = "ga_optax Explicit: microbatched_value_and_grad"
EXPLICIT_ACROSS = "ga_optax Explicit: unreduced_value_and_grad + accumulate"
AUTO_IN_STEP = "ga_optax Auto: microbatched_value_and_grad(axis_name)"
OPTAX_MICROBATCHING = "optax.microbatching (Auto)"
MULTI_STEPS = "optax.MultiSteps, replicated grads (Explicit)"
SHARD_MAP_IN_STEP = "ga_optax shard_map: microbatched_value_and_grad(axis_name)"
SHARD_MAP_ACROSS = "ga_optax shard_map: accumulate(axis_name)"
PLAIN_JIT_GA_OPTAX = (EXPLICIT_IN_STEP, EXPLICIT_ACROSS, AUTO_IN_STEP)


def make_variants(
  explicit: Mesh, auto: Mesh, k: int, micro_batch_rows: int
) -> list[Variant]:
  optimizer = optax.adam(1e-3)

  def jitted(step: Callable) -> Any:
    return jax.jit(step, donate_argnums=(0, 1))

  unreduced_tx = ga_optax.accumulate(optimizer, k, unreduced_axes="data")
  multi_steps = optax.MultiSteps(optimizer, k)
  optax_microbatched = optax.microbatching.microbatch(
    jax.value_and_grad(loss_fn),
    argnums=1,
    microbatch_size=micro_batch_rows,
    accumulator=optax.microbatching.AccumulationType.MEAN,
  )
  mapped_tx = ga_optax.accumulate(optimizer, k, axis_name="data")

  def mapped_across_steps(params: Any, state: Any, batch: Batch):
    # Each device's own rows: no collective until the window closes.
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = mapped_tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss[None]

  return [
    Variant(
      LARGE_BATCH,
      explicit,
      1,
      optimizer.init,
      jitted(optimizer_step(jax.value_and_grad(loss_fn), optimizer)),
    ),
    Variant(
      EXPLICIT_IN_STEP,
      explicit,
      1,
      optimizer.init,
      jitted(
        optimizer_step(
          ga_optax.microbatched_value_and_grad(loss_fn, k), optimizer
        )
      ),
    ),
    Variant(
      EXPLICIT_ACROSS,
      explicit,
      k,
      unreduced_tx.init,
      jitted(
        optimizer_step(ga_optax.unreduced_value_and_grad(loss_fn), unreduced_tx)
      ),
    ),
    Variant(
      AUTO_IN_STEP,
      auto,
      1,
      optimizer.init,
      jitted(
        optimizer_step(
          ga_optax.microbatched_value_and_grad(loss_fn, k, axis_name="data"),
          optimizer,
        )
      ),
    ),
    Variant(
      OPTAX_MICROBATCHING,
      auto,
      1,
      optimizer.init,
      jitted(optimizer_step(optax_microbatched, optimizer)),
    ),
    Variant(
      MULTI_STEPS,
      explicit,
      k,
      multi_steps.init,
      jitted(optimizer_step(jax.value_and_grad(loss_fn), multi_steps)),
    ),
    Variant(
      SHARD_MAP_IN_STEP,
      explicit,
      1,
      optimizer.init,
      jitted(
        jax.shard_map(
          optimizer_step(
            ga_optax.microbatched_value_and_grad(loss_fn, k, axis_name="data"),
            optimizer,
          ),
          mesh=explicit,
          in_specs=(P(), P(), P("data")),
          out_specs=P(),
        )
      ),
    ),
    Variant(
      SHARD_MAP_ACROSS,
      explicit,
      k,
      # axis_name names a manual axis: init inside a shard_map too.
      jax.jit(
        jax.shard_map(
          mapped_tx.init, mesh=explicit, in_specs=P(), out_specs=P()
        )
      ),
      jitted(
        # Between closes each device's accumulator is its own partial sum,
        # not the replicated value out_specs=P() claims: the check is off.
        jax.shard_map(
          mapped_across_steps,
          mesh=explicit,
          in_specs=(P(), P(), P("data")),
          out_specs=(P(), P(), P("data")),
          check_vma=False,
        )
      ),
    ),
  ]


class Audit(NamedTuple):
  """What one window runs, read from the compiled step.

  Attributes:
    rows_per_device: rows of a micro-batch each device computes (the
      leading size of the activations the kernels multiply).
    all_reduces: all-reduces per window, counted as they run.
    parameter_sized: those that move at least the parameters' bytes.
    all_reduce_bytes: their operand bytes on one device, per window.
  """

  rows_per_device: int
  all_reduces: int
  parameter_sized: int
  all_reduce_bytes: int


def audit(hlo_text: str, calls: int, width: int, parameter_bytes: int) -> Audit:
  """Counts a loop body's all-reduces once per iteration, the closing
  branch's once per window, the others' once per call."""
  module = audits.parse_hlo(hlo_text)
  closing = audits.window_collectives(hlo_text).closing_branch
  sizes: list[int] = []

  def visit(computation: str, times: int) -> None:
    for collective in audits.collectives_in_hlo(module, [computation]):
      if collective.opcode.startswith("all-reduce"):
        sizes.extend([collective.operand_bytes] * times)
    for instruction in module.computations.get(computation, ()):
      trips = 1
      if instruction.opcode == "while":
        if instruction.trip_count is None:
          raise ValueError(f"unknown trip count of {instruction.name}")
        trips = instruction.trip_count
      for callee in instruction.callees:
        visit(callee, times // calls if callee == closing else times * trips)

  visit(module.entry, calls)
  return Audit(
    rows_per_device=rows_per_device(hlo_text, width),
    all_reduces=len(sizes),
    parameter_sized=sum(size >= parameter_bytes for size in sizes),
    all_reduce_bytes=sum(sizes),
  )


def rows_per_device(hlo_text: str, width: int) -> int:
  """The most rows a dot multiplies by a ``width x width`` kernel."""
  kernel = f"[{width},{width}]"
  rows = [
    int(activation[activation.index("[") + 1 : activation.index(",")])
    for shapes in audits.dot_shapes(hlo_text)
    if any(shape.endswith(kernel) for shape in shapes)
    for activation in shapes
    if not activation.endswith(kernel) and activation.count(",") == 1
  ]
  return max(rows)


class Timed(NamedTuple):
  """A variant's compiled step, its state, and its window times."""

  variant: Variant
  compiled: Any
  state: dict[str, Any]
  windows: list[Any]
  seconds: list[float]


def prepare(
  variant: Variant,
  host_params: Any,
  xs: np.ndarray,
  ys: np.ndarray,
) -> Timed:
  """Places params, state and every call's batch on the variant's mesh."""
  with jax.set_mesh(variant.mesh):
    params = jax.device_put(host_params, NamedSharding(variant.mesh, P()))
    state = variant.init(params)
    rows_per_call = xs.shape[1] // variant.calls_per_window
    batch_sharding = NamedSharding(variant.mesh, P("data"))
    windows = [
      [
        jax.device_put(
          {
            "x": x[call * rows_per_call : (call + 1) * rows_per_call],
            "y": y[call * rows_per_call : (call + 1) * rows_per_call],
          },
          batch_sharding,
        )
        for call in range(variant.calls_per_window)
      ]
      for x, y in zip(xs, ys, strict=True)
    ]
    compiled = variant.step.lower(params, state, windows[0][0]).compile()
  return Timed(
    variant, compiled, {"params": params, "state": state}, windows, []
  )


def run_window(timed: Timed, window: int, measured: bool) -> None:
  began = time.perf_counter()
  for batch in timed.windows[window]:
    timed.state["params"], timed.state["state"], _ = timed.compiled(
      timed.state["params"], timed.state["state"], batch
    )
  jax.block_until_ready(timed.state["params"])
  if measured:
    timed.seconds.append(time.perf_counter() - began)


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument(
    "--batch", type=int, default=128, help="B, rows per window (global)"
  )
  parser.add_argument("--k", type=int, default=8, help="micro-batches")
  parser.add_argument("--windows", type=int, default=10, help="timed windows")
  parser.add_argument(
    "--json",
    type=Path,
    default=Path(__file__).resolve().parent / "results" / "data_parallel.json",
  )
  return parser.parse_args()


def main() -> None:
  args = parse_args()
  devices = jax.devices()
  num_devices = len(devices)
  explicit = jax.make_mesh((num_devices,), ("data",), devices=devices)
  auto = jax.make_mesh(
    (num_devices,), ("data",), (AxisType.Auto,), devices=devices
  )
  host_params = jax.device_get(init_mlp(args.width, args.layers))
  parameter_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(host_params))
  rng = np.random.default_rng(1)
  shape = (args.windows + 1, args.batch, args.width)
  xs = rng.normal(size=shape).astype(np.float32)
  ys = rng.normal(size=shape).astype(np.float32)

  variants = make_variants(explicit, auto, args.k, args.batch // args.k)
  runs = [prepare(variant, host_params, xs, ys) for variant in variants]
  audits = {
    run.variant.name: audit(
      run.compiled.as_text(),
      run.variant.calls_per_window,
      args.width,
      parameter_bytes,
    )
    for run in runs
  }
  # Window 0 warms up. The variants take turns window by window, in an
  # order that rotates, so that a busy host slows them alike.
  for window in range(args.windows + 1):
    shift = window % len(runs)
    for run in runs[shift:] + runs[:shift]:
      with jax.set_mesh(run.variant.mesh):
        run_window(run, window, measured=window > 0)
  reference = jax.device_get(runs[0].state["params"])
  target_rows = args.batch // (args.k * num_devices)

  rows = []
  for run in runs:
    found = audits[run.variant.name]
    rows.append(
      {
        "variant": run.variant.name,
        "calls_per_window": run.variant.calls_per_window,
        "rows_per_device_per_microbatch": found.rows_per_device,
        "all_reduces_per_window": found.all_reduces,
        "parameter_sized_all_reduces_per_window": found.parameter_sized,
        "all_reduce_bytes_per_window": found.all_reduce_bytes,
        "window_ms": 1e3 * statistics.median(run.seconds),
        "max_relative_difference_to_large_batch": max_relative_difference(
          jax.device_get(run.state["params"]), reference
        ),
      }
    )
  by_name = {row["variant"]: row for row in rows}
  multi_steps = by_name[MULTI_STEPS]
  optax_microbatching = by_name[OPTAX_MICROBATCHING]
  for row in rows:
    # Against the shard_map path that takes as many calls per window.
    shard_map = by_name[
      SHARD_MAP_IN_STEP if row["calls_per_window"] == 1 else SHARD_MAP_ACROSS
    ]
    row["bytes_vs_multisteps"] = (
      row["all_reduce_bytes_per_window"]
      / multi_steps["all_reduce_bytes_per_window"]
    )
    row["time_vs_optax_microbatching"] = (
      row["window_ms"] / optax_microbatching["window_ms"]
    )
    row["time_vs_shard_map"] = row["window_ms"] / shard_map["window_ms"]

  print(
    f"{num_devices} x {devices[0].platform} devices"
    f" ({'simulated on the host' if devices[0].platform == 'cpu' else 'real'}),"
    f" MLP {args.layers} x {args.width}x{args.width}"
    f" ({parameter_bytes // 4:,} float32 parameters, {parameter_bytes:,}"
    f" bytes), Adam; B = {args.batch} rows per window, k = {args.k},"
    f" D = {num_devices}: B/(k*D) = {target_rows} rows per device per"
    f" micro-batch; medians of {args.windows} windows\n"
  )
  print(
    "| variant | calls per window | rows per device per micro-batch |"
    " all-reduces per window (parameter-sized) | all-reduce bytes per window"
    " | bytes / MultiSteps' | window ms | time / optax.microbatching |"
    " time / shard_map path | max rel. difference to large batch |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for row in rows:
    print(
      f"| {row['variant']} | {row['calls_per_window']} |"
      f" {row['rows_per_device_per_microbatch']} |"
      f" {row['all_reduces_per_window']}"
      f" ({row['parameter_sized_all_reduces_per_window']}) |"
      f" {row['all_reduce_bytes_per_window']:,} |"
      f" {row['bytes_vs_multisteps']:.6f} | {row['window_ms']:.1f} |"
      f" {row['time_vs_optax_microbatching']:.2f} |"
      f" {row['time_vs_shard_map']:.2f} |"
      f" {row['max_relative_difference_to_large_batch']:.1e} |"
    )

  targets = {
    row["variant"]: {
      f"rows per device == {target_rows}": (
        row["rows_per_device_per_microbatch"] == target_rows
      ),
      "parameter-sized all-reduces per window == 1": (
        row["parameter_sized_all_reduces_per_window"] == 1
      ),
      f"bytes per window <= MultiSteps' / {args.k}": (
        row["bytes_vs_multisteps"] <= 1 / args.k
      ),
      "time <= optax.microbatching's": row["time_vs_optax_microbatching"] <= 1,
      "time <= 1.1 x the shard_map path's": row["time_vs_shard_map"] <= 1.1,
    }
    for row in rows
    if row["variant"] in PLAIN_JIT_GA_OPTAX
  }
  print("\nTargets for ga_optax under plain jit:\n")
  names = list(next(iter(targets.values())))
  print("| variant | " + " | ".join(names) + " |")
  print("|---|" + "---|" * len(names))
  for variant, met in targets.items():
    print(
      f"| {variant} | "
      + " | ".join("yes" if met[name] else "no" for name in names)
      + " |"
    )

  report = {
    "benchmark": "data_parallel",
    "devices": num_devices,
    "platform": devices[0].platform,
    "device_kind": devices[0].device_kind,
    "host": platform.processor() or platform.machine(),
    "jax": jax.__version__,
    "optax": optax.__version__,
    "config": vars(args)
    | {"json": str(args.json), "parameter_bytes": parameter_bytes},
    "rows": rows,
    "targets": targets,
  }
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps(report, indent=2) + "\n")
  print(f"\nwrote {args.json}")


if __name__ == "__main__":
  main()
