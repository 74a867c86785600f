"""Data-parallel gradient accumulation under JAX's default mesh workflow.

A Flax Linen MLP (with a LayerNorm) learns scikit-learn's bundled digits on
a device mesh made with ``jax.make_mesh`` and set with ``jax.set_mesh``; each
batch is sharded over the ``"data"`` axis and every step is a plain
``jax.jit``. From the same initial parameters, on the same windows of data,
four runs:

1. **large batch**: ``jax.value_and_grad`` on the whole window, one step;
2. **deferred, in one step**: ``ga_optax.microbatched_value_and_grad``, the
   window's k micro-batches in one ``lax.scan`` per device, one all-reduce;
3. **deferred, across steps**: one call per micro-batch, gradients from
   ``ga_optax.unreduced_value_and_grad`` (left unreduced over ``"data"``)
   into ``ga_optax.accumulate(..., unreduced_axes="data")``, which
   all-reduces them once, when the window closes;
4. **reduced every micro-step**: ``jax.value_and_grad`` into
   ``ga_optax.accumulate`` without ``unreduced_axes``: the same updates, but
   the compiler all-reduces the gradients on every micro-step.

``--mode shard_map`` runs runs 2 and 3 the second way instead, inside
``jax.shard_map`` with ``axis_name="data"``. The table gives each run's
distance from the large batch and the all-reduces of one window, read from
the compiled programs.

Runs on 8 simulated CPU devices by default, on every GPU when there are any.
Writes a PNG of the loss curves to ``./ga_optax_output/data_parallel`` under
the current directory (``--output-dir`` changes it)::

  python examples/data_parallel.py
  python examples/data_parallel.py --mode shard_map --epochs 20
"""

from __future__ import annotations

import os

# Must happen before jax is imported; it only adds CPU devices, so GPUs,
# when present, are still the default backend.
if "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from matplotlib.figure import Figure
from sklearn.datasets import load_digits
from tqdm import tqdm

import ga_optax
from ga_optax.testing import audit, max_relative_difference

# Under the directory the script is run from, never inside the source tree.
DEFAULT_OUTPUT_DIR = Path("ga_optax_output", "data_parallel")


class MLP(nn.Module):
  """Dense, LayerNorm, Dense: biases and a normalisation scale to learn."""

  hidden: int

  @nn.compact
  def __call__(self, images: jax.Array) -> jax.Array:
    hidden = nn.relu(nn.LayerNorm()(nn.Dense(self.hidden)(images)))
    return nn.Dense(10)(hidden)


class Data(NamedTuple):
  """Flattened float32 images in [0, 1] and int32 labels, on the host."""

  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray


class Run(NamedTuple):
  """How one run trains: its step, its state, and its calls per window.

  Attributes:
    name: the row's name in the table.
    how: the ga_optax (or JAX) functions it uses.
    calls_per_window: 1 for a step that takes the whole window, k for one
      that takes a micro-batch.
    init: ``params -> state``.
    step: ``(params, state, batch) -> (params, state, loss)``, jitted.
  """

  name: str
  how: str
  calls_per_window: int
  init: Callable[[Any], Any]
  step: Any


class Result(NamedTuple):
  """Where a run ended, the loss of every window, and its wall time."""

  params: Any
  losses: list[float]
  seconds: float


def load_data(seed: int) -> Data:
  digits = load_digits()
  images = (digits.data / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(labels))
  images, labels = images[order], labels[order]
  num_test = len(labels) // 6
  return Data(
    images[num_test:], labels[num_test:], images[:num_test], labels[:num_test]
  )


def make_windows(
  num_train: int, window: int, epochs: int, seed: int
) -> list[np.ndarray]:
  """The rows of every window, the same for every run."""
  rng = np.random.default_rng(seed)
  windows = []
  for _ in range(epochs):
    order = rng.permutation(num_train)
    for start in range(0, num_train - window + 1, window):
      windows.append(order[start : start + window])
  return windows


def make_runs(args: argparse.Namespace, model: MLP) -> list[Run]:
  """The four runs; with ``--mode shard_map``, runs 2 and 3 in shard_map."""
  k = args.accumulation_steps
  optimizer = optax.adamw(args.learning_rate, weight_decay=1e-4)

  def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    logits = model.apply(params, batch["images"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["labels"]
    ).mean()

  def train_step(value_and_grad: Callable, tx: Any) -> Callable:
    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, Any]:
      loss, grads = value_and_grad(params, batch)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, loss

    return step

  def jitted(step: Callable) -> Any:
    return jax.jit(
      step,
      donate_argnums=(0, 1),
    )

  unreduced_tx = ga_optax.accumulate(optimizer, k, unreduced_axes="data")
  reduced_tx = ga_optax.accumulate(optimizer, k)
  large_batch = Run(
    "large batch",
    "jax.value_and_grad",
    1,
    optimizer.init,
    jitted(train_step(jax.value_and_grad(loss_fn), optimizer)),
  )
  reduced_every_micro_step = Run(
    "reduced every micro-step",
    "jax.value_and_grad + accumulate",
    k,
    reduced_tx.init,
    jitted(train_step(jax.value_and_grad(loss_fn), reduced_tx)),
  )
  if args.mode == "shard_map":
    return [
      large_batch,
      *shard_map_runs(loss_fn, optimizer, train_step, k),
      reduced_every_micro_step,
    ]
  return [
    large_batch,
    Run(
      "deferred, in one step",
      "microbatched_value_and_grad",
      1,
      optimizer.init,
      jitted(
        train_step(ga_optax.microbatched_value_and_grad(loss_fn, k), optimizer)
      ),
    ),
    Run(
      "deferred, across steps",
      "unreduced_value_and_grad + accumulate(unreduced_axes)",
      k,
      unreduced_tx.init,
      jitted(
        train_step(ga_optax.unreduced_value_and_grad(loss_fn), unreduced_tx)
      ),
    ),
    reduced_every_micro_step,
  ]


def shard_map_runs(
  loss_fn: Callable, optimizer: Any, train_step: Callable, k: int
) -> list[Run]:
  """The deferred runs written per device, inside ``jax.shard_map``."""
  in_one_step = train_step(
    ga_optax.microbatched_value_and_grad(loss_fn, k, axis_name="data"),
    optimizer,
  )
  tx = ga_optax.accumulate(optimizer, k, axis_name="data")

  def across_steps(params: Any, state: Any, batch: Any):
    # Each device's own rows: no collective until the window closes.
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss[None]

  return [
    Run(
      "deferred, in one step",
      "shard_map + microbatched_value_and_grad(axis_name)",
      1,
      optimizer.init,
      jax.jit(
        jax.shard_map(
          in_one_step, in_specs=(P(), P(), P("data")), out_specs=P()
        ),
        donate_argnums=(0, 1),
      ),
    ),
    Run(
      "deferred, across steps",
      "shard_map + accumulate(axis_name)",
      k,
      tx.init,
      jax.jit(
        # Between closes each device's accumulator holds its own partial
        # sum, so the state is not replicated: the type check must be off.
        jax.shard_map(
          across_steps,
          in_specs=(P(), P(), P("data")),
          out_specs=(P(), P(), P("data")),
          check_vma=False,
        ),
        donate_argnums=(0, 1),
      ),
    ),
  ]


def sharded(data: Data, rows: np.ndarray) -> dict[str, jax.Array]:
  """The batch of ``rows``, sharded over ``"data"``: each device its share."""
  return jax.device_put(
    {"images": data.train_images[rows], "labels": data.train_labels[rows]},
    P("data"),
  )


class WindowAllReduces(NamedTuple):
  """The all-reduces of one window, read from the compiled step.

  Attributes:
    count: all-reduces per window.
    of_gradients: those that reduce at least the gradients' bytes.
    bytes: their operand bytes on one device, summed.
  """

  count: int
  of_gradients: int
  bytes: int


def all_reduces_per_window(
  run: Run, args: tuple[Any, ...], gradient_bytes: int
) -> WindowAllReduces:
  report = audit(run.step, *args, target="cpu", donate_argnums=(0, 1))
  by_path = {
    path.path: [c for c in path.collectives if "all-reduce" in c[0]]
    for path in report.paths
  }
  # A window is k - 1 calls that keep it open and one that closes it; a
  # step without a window runs its one path on every call.
  if "closing" in by_path:
    window = by_path["micro_step"] * (run.calls_per_window - 1)
    window += by_path["closing"]
  else:
    window = by_path["every_call"] * run.calls_per_window
  return WindowAllReduces(
    len(window),
    sum(size >= gradient_bytes for _, size in window),
    sum(size for _, size in window),
  )


def train(
  run: Run,
  initial_params: Any,
  data: Data,
  windows: list[np.ndarray],
  progress: bool,
) -> tuple[Result, WindowAllReduces]:
  """Trains ``run`` on ``windows``; compiles first, so seconds exclude it."""
  params = jax.device_put(initial_params, P())
  state = run.init(params)
  micro_batches = np.split(windows[0], run.calls_per_window)
  compiled = run.step.lower(
    params, state, sharded(data, micro_batches[0])
  ).compile()
  gradient_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
  all_reduces = all_reduces_per_window(
    run, (params, state, sharded(data, micro_batches[0])), gradient_bytes
  )
  losses = []
  began = time.perf_counter()
  for rows in tqdm(
    windows,
    desc=f"{run.name:<24}",
    unit="update",
    disable=not progress,
    file=sys.stderr,
  ):
    window_losses = []
    for micro_batch in np.split(rows, run.calls_per_window):
      params, state, loss = compiled(params, state, sharded(data, micro_batch))
      window_losses.append(loss)
    # Equal micro-batches: the mean of their means is the window's mean.
    losses.append(float(np.mean(jax.device_get(window_losses))))
  jax.block_until_ready(params)
  return Result(params, losses, time.perf_counter() - began), all_reduces


def plot_losses(results: dict[str, Result], reference: str, path: Path) -> None:
  """The loss curves, and how far each is from the reference run's."""
  figure = Figure(figsize=(11, 4), layout="constrained")
  curves, gaps = figure.subplots(1, 2)
  reference_losses = np.asarray(results[reference].losses)
  for index, (name, result) in enumerate(results.items()):
    # Wider lines underneath, so that coinciding curves all show.
    curves.plot(
      result.losses,
      label=name,
      color=f"C{index}",
      linewidth=4.0 - 0.8 * index,
    )
    if name != reference:
      # Zeros (identical losses) fall off the log scale and are not drawn.
      gaps.plot(
        np.abs(np.asarray(result.losses) - reference_losses),
        "osD^"[index % 4],
        label=name,
        color=f"C{index}",
        fillstyle="none",
      )
  gaps.axhline(
    np.finfo(np.float32).eps * float(np.max(reference_losses)),
    color="gray",
    linestyle="--",
    label="float32 epsilon x loss",
  )
  gaps.set_yscale("log")
  curves.set_title("training loss of each window")
  gaps.set_title(f"|loss - {reference} loss| (zeros not drawn)")
  for axes in (curves, gaps):
    axes.set_xlabel("optimizer update")
    axes.legend()
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path, dpi=120)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--mode",
    choices=("jit", "shard_map"),
    default="jit",
    help="the deferred runs under a plain jax.jit (default) or in shard_map",
  )
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument(
    "--microbatch", type=int, default=8, help="examples per device per step"
  )
  parser.add_argument(
    "--accumulation-steps", type=int, default=4, help="k, micro-batches"
  )
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--output-dir",
    type=Path,
    default=DEFAULT_OUTPUT_DIR,
    help=f"where the plot goes (default: ./{DEFAULT_OUTPUT_DIR})",
  )
  parser.add_argument(
    "--no-progress",
    dest="progress",
    action="store_false",
    help="hide the progress bars",
  )
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
  """Trains the four runs on a mesh over every device; returns the results."""
  args = parse_args(argv)
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("data",), devices=devices)
  k = args.accumulation_steps
  window = len(devices) * args.microbatch * k
  data = load_data(args.seed)
  windows = make_windows(len(data.train_labels), window, args.epochs, args.seed)
  model = MLP(args.hidden)
  initial_params = jax.device_get(
    jax.jit(model.init)(
      jax.random.key(args.seed), np.zeros((1, data.train_images.shape[1]))
    )
  )
  print(
    f"{len(devices)} x {devices[0].platform} devices, mesh"
    f" {dict(mesh.shape)} ({args.mode}), micro-batch {args.microbatch} per"
    f" device, k = {k}: {window} examples per update, {len(windows)} updates"
  )
  results: dict[str, Result] = {}
  all_reduces: dict[str, WindowAllReduces] = {}
  runs: list[Run] = []
  # float32 matmuls at full precision (GPUs may otherwise use TF32): the
  # comparison is about the split of the batch, not about matmul rounding.
  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    runs = make_runs(args, model)
    for run in runs:
      results[run.name], all_reduces[run.name] = train(
        run, initial_params, data, windows, args.progress
      )
    apply = jax.jit(model.apply)
    accuracies = {
      name: float(
        np.mean(
          np.argmax(apply(result.params, data.test_images), -1)
          == data.test_labels
        )
      )
      for name, result in results.items()
    }

  reference = runs[0].name
  summary: dict[str, dict[str, Any]] = {}
  print(
    "\n| run | how | final loss | test accuracy | max rel. param difference"
    " to large batch | all-reduces per window (of the gradients) | bytes"
    " per window | seconds |"
  )
  print("|---|---|---:|---:|---:|---:|---:|---:|")
  for run in runs:
    result = results[run.name]
    summary[run.name] = {
      "first_loss": result.losses[0],
      "final_loss": result.losses[-1],
      "test_accuracy": accuracies[run.name],
      # Checked on its own: NaN where the reference has NaN counts as
      # equal in the difference below.
      "params_finite": all(
        np.isfinite(leaf).all()
        for leaf in jax.tree.leaves(jax.device_get(result.params))
      ),
      "max_param_difference": max_relative_difference(
        jax.device_get(result.params), jax.device_get(results[reference].params)
      ),
      "max_loss_difference": float(
        np.max(np.abs(np.subtract(result.losses, results[reference].losses)))
      ),
      "all_reduces_per_window": all_reduces[run.name].count,
      "gradient_all_reduces_per_window": all_reduces[run.name].of_gradients,
      "all_reduce_bytes_per_window": all_reduces[run.name].bytes,
      "seconds": result.seconds,
    }
    row = summary[run.name]
    print(
      f"| {run.name} | `{run.how}` | {row['final_loss']:.5f} |"
      f" {row['test_accuracy']:.3f} | {row['max_param_difference']:.1e} |"
      f" {row['all_reduces_per_window']}"
      f" ({row['gradient_all_reduces_per_window']}) |"
      f" {row['all_reduce_bytes_per_window']:,} | {row['seconds']:.2f} |"
    )
  plot_path = args.output_dir.resolve() / "data_parallel_losses.png"
  plot_losses(results, reference, plot_path)
  print(f"\nloss curves: {plot_path}")
  return summary


if __name__ == "__main__":
  main()
