"""One global batch on 1, 2, 4 and 8 devices: one training trajectory.

Trains a small Flax MLP on scikit-learn's bundled digits with the same
global batch, from the same initial parameters, on the same windows of
data, on 1, 2, 4 and 8 devices. For each device count
``ga_optax.planning.elastic_plan`` splits the global batch into micro-batch
x k x devices; every device accumulates its own micro-batches
(``ga_optax.accumulate(..., axis_name="data")`` inside ``jax.shard_map``)
and the devices reduce once per window.
The loss curves of the four device counts coincide.

Then the move: train on 8 devices, save the state with orbax at a window
boundary half-way, restore it and go on on 2 devices with the 2-device
plan's k. The moved run ends where the runs that never moved end.

Runs on 8 simulated CPU devices (fewer than 8 GPUs are not enough, so then
the CPU is used); writes a PNG of the loss curves and the checkpoint to
``./ga_optax_output/elastic`` under the current directory (``--output-dir``
changes it)::

  python examples/elastic.py
  python examples/elastic.py --epochs 10 --global-batch 128
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.figure import Figure
from sklearn.datasets import load_digits
from tqdm import tqdm

import ga_optax
from ga_optax import planning
from ga_optax.testing import max_relative_difference

# Under the directory the script is run from, never inside the source tree.
DEFAULT_OUTPUT_DIR = Path("ga_optax_output", "elastic")


class MLP(nn.Module):
  """Two dense layers: enough to learn digits to about 95% accuracy."""

  hidden: int

  @nn.compact
  def __call__(self, images: jax.Array) -> jax.Array:
    hidden = nn.relu(nn.Dense(self.hidden)(images))
    return nn.Dense(10)(hidden)


class Data(NamedTuple):
  """Flattened float32 images in [0, 1] and int32 labels."""

  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray


class Run(NamedTuple):
  """Where a run ended, and the loss of each window before its update."""

  params: Any
  opt_state: ga_optax.AccumulateState
  losses: list[float]


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
  num_train: int, global_batch: int, epochs: int, seed: int
) -> list[np.ndarray]:
  """The rows of every window, the same for every device count."""
  rng = np.random.default_rng(seed)
  windows = []
  for _ in range(epochs):
    order = rng.permutation(num_train)
    for start in range(0, num_train - global_batch + 1, global_batch):
      windows.append(order[start : start + global_batch])
  return windows


class Trainer:
  """The model, its loss and optimizer, and a data-parallel step per plan."""

  def __init__(self, args: argparse.Namespace, devices: list[Any]) -> None:
    self.model = MLP(args.hidden)
    self.apply = jax.jit(self.model.apply)
    self.optimizer = optax.adamw(args.learning_rate, weight_decay=1e-4)
    self.devices = devices
    self.progress = args.progress
    self.compiled: dict[planning.ElasticPlan, tuple[Callable, Callable]] = {}

  def loss_fn(self, params: Any, images: jax.Array, labels: jax.Array):
    logits = self.model.apply(params, images)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()

  def mesh(self, num_devices: int) -> Mesh:
    return Mesh(np.array(self.devices[:num_devices]), ("data",))

  def transformation(self, plan: planning.ElasticPlan):
    return ga_optax.accumulate(
      self.optimizer, plan.num_microbatches, axis_name="data"
    )

  def replicated(self, tree: Any, plan: planning.ElasticPlan) -> Any:
    """``tree`` copied onto every device of the plan's mesh."""
    sharding = NamedSharding(self.mesh(plan.num_devices), P())
    return jax.tree.map(lambda leaf: jax.device_put(leaf, sharding), tree)

  def init_and_step(
    self, plan: planning.ElasticPlan
  ) -> tuple[Callable, Callable]:
    """The plan's jitted ``tx.init`` and data-parallel micro-step."""
    if plan in self.compiled:
      return self.compiled[plan]
    tx = self.transformation(plan)

    def device_step(params, opt_state, images, labels):
      # Each device's own micro-batch; the only collective is the one in
      # tx.update on the micro-step that closes the window.
      loss, grads = jax.value_and_grad(self.loss_fn)(params, images, labels)
      updates, opt_state = tx.update(
        grads, opt_state, params, weight=images.shape[0]
      )
      return optax.apply_updates(params, updates), opt_state, loss[None]

    step = jax.jit(
      jax.shard_map(
        device_step,
        mesh=self.mesh(plan.num_devices),
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=(P(), P(), P("data")),
        check_vma=False,
      ),
      donate_argnums=(0, 1),
    )
    self.compiled[plan] = (jax.jit(tx.init), step)
    return self.compiled[plan]

  def train(
    self,
    plan: planning.ElasticPlan,
    params: Any,
    opt_state: ga_optax.AccumulateState | None,
    data: Data,
    windows: list[np.ndarray],
    label: str,
  ) -> Run:
    """Trains on ``windows`` with the plan's micro-batches and k."""
    init, step = self.init_and_step(plan)
    params = self.replicated(params, plan)
    opt_state = self.replicated(
      init(params) if opt_state is None else opt_state, plan
    )
    shape = (plan.num_devices, plan.num_microbatches, plan.micro_batch_size)
    losses = []
    for rows in tqdm(
      windows,
      desc=f"{label:<8}",
      unit="update",
      disable=not self.progress,
      file=sys.stderr,
    ):
      # Micro-step s hands device i the rows images[i, s].
      images = data.train_images[rows].reshape(*shape, -1)
      labels = data.train_labels[rows].reshape(shape)
      window_losses = []
      for micro_step in range(plan.num_microbatches):
        params, opt_state, device_losses = step(
          params,
          opt_state,
          images[:, micro_step].reshape(-1, images.shape[-1]),
          labels[:, micro_step].reshape(-1),
        )
        window_losses.append(device_losses)
      # Equal micro-batches: the mean of their means is the window's mean.
      losses.append(float(np.mean(jax.device_get(window_losses))))
    return Run(params, opt_state, losses)

  def test_accuracy(self, params: Any, data: Data) -> float:
    logits = np.asarray(self.apply(params, data.test_images))
    return float(np.mean(np.argmax(logits, -1) == data.test_labels))


def save_and_restore_on(
  trainer: Trainer, run: Run, plan: planning.ElasticPlan, path: Path
) -> tuple[Any, ga_optax.AccumulateState]:
  """Saves a run's state; restores it onto the new plan's devices."""
  # At a window boundary the accumulator is the same on every device, so
  # the replicated state that orbax writes once is the whole state.
  assert int(run.opt_state.micro_step) == 0, "not at a window boundary"
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, (run.params, run.opt_state), force=True)
  # The state's structure does not depend on k: the new transformation's
  # init describes the saved state, placed on the new mesh.
  sharding = NamedSharding(trainer.mesh(plan.num_devices), P())
  target = jax.tree.map(
    lambda leaf: jax.ShapeDtypeStruct(
      leaf.shape, leaf.dtype, sharding=sharding
    ),
    jax.eval_shape(
      lambda: (run.params, trainer.transformation(plan).init(run.params))
    ),
  )
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path, target)


def param_difference(tree: Any, reference: Any) -> float:
  """``max_relative_difference`` of two trees of device arrays, on the host."""
  return max_relative_difference(
    jax.device_get(tree), jax.device_get(reference)
  )


def plot_losses(
  runs: dict[str, Run], reference: str, moved_at: int, path: Path
) -> None:
  """The loss curves, and how far each is from the reference run's."""
  figure = Figure(figsize=(11, 4), layout="constrained")
  curves, gaps = figure.subplots(1, 2)
  reference_losses = np.asarray(runs[reference].losses)
  markers = "osD^v<>"
  for index, (name, run) in enumerate(runs.items()):
    # Wider lines underneath, so that coinciding curves all show.
    curves.plot(
      run.losses,
      label=name,
      color=f"C{index}",
      linewidth=4.0 - 0.7 * index,
      linestyle=":" if index == len(runs) - 1 else "-",
    )
    if name != reference:
      # Zeros (identical losses) fall off the log scale and are not drawn.
      gaps.plot(
        np.abs(np.asarray(run.losses) - reference_losses),
        markers[index % len(markers)],
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
  curves.set_title("training loss of each window (same global batch)")
  gaps.set_title(f"|loss - loss on {reference}| (zeros not drawn)")
  for axes in (curves, gaps):
    axes.axvline(moved_at, color="gray", linewidth=0.8)
    axes.set_xlabel(f"optimizer update (grey line: the move at {moved_at})")
    axes.legend()
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path, dpi=120)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument(
    "--global-batch", type=int, default=64, help="examples per update"
  )
  parser.add_argument(
    "--micro-batch-sizes",
    type=int,
    nargs="+",
    default=[2, 4, 8],
    help="candidate micro-batch sizes per device",
  )
  parser.add_argument(
    "--device-counts", type=int, nargs="+", default=[1, 2, 4, 8]
  )
  parser.add_argument(
    "--move",
    type=int,
    nargs=2,
    default=[8, 2],
    metavar=("FROM", "TO"),
    help="device counts before and after the half-way checkpoint",
  )
  parser.add_argument("--hidden", type=int, default=32)
  parser.add_argument("--learning-rate", type=float, default=1e-2)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--output-dir",
    type=Path,
    default=DEFAULT_OUTPUT_DIR,
    help="where the plot and the checkpoint go (default:"
    f" ./{DEFAULT_OUTPUT_DIR})",
  )
  parser.add_argument(
    "--no-progress",
    dest="progress",
    action="store_false",
    help="hide the progress bars",
  )
  return parser.parse_args(argv)


def device_label(count: int) -> str:
  return f"{count} device" if count == 1 else f"{count} devices"


def pick_devices(wanted: int) -> list[Any]:
  for devices in (jax.devices(), jax.devices("cpu")):
    if len(devices) >= wanted:
      return devices
  raise SystemExit(
    f"{wanted} devices wanted, {len(jax.devices('cpu'))} CPU devices seen:"
    f" set XLA_FLAGS=--xla_force_host_platform_device_count={wanted} before"
    " starting Python."
  )


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
  """Trains on every device count and moves one run; returns the results."""
  args = parse_args(argv)
  counts = sorted(set(args.device_counts) | set(args.move))
  devices = pick_devices(max(counts))
  output_dir = args.output_dir.resolve()
  sizes = args.micro_batch_sizes
  plans = {
    count: planning.elastic_plan(args.global_batch, count, sizes)
    for count in counts
  }
  data = load_data(args.seed)
  windows = make_windows(
    len(data.train_labels), args.global_batch, args.epochs, args.seed
  )
  moved_at = len(windows) // 2
  valid = planning.valid_device_counts(args.global_batch, sizes, max(counts))
  best = planning.best_global_batch_size(
    args.global_batch, sizes, max_devices=max(counts)
  )
  print(
    f"{len(devices[: max(counts)])} x {devices[0].platform} devices; global"
    f" batch {args.global_batch}, micro-batch sizes {tuple(sizes)}: valid on"
    f" {valid} of 1..{max(counts)} devices (the best global batch up to"
    f" {args.global_batch} would be {best}, valid on"
    f" {planning.valid_device_counts(best, sizes, max(counts))})"
  )

  trainer = Trainer(args, devices)
  initial_params = jax.device_get(
    jax.jit(trainer.model.init)(
      jax.random.key(args.seed), np.zeros((1, data.train_images.shape[1]))
    )
  )
  source, destination = args.move
  runs: dict[str, Run] = {}
  # float32 matmuls at full precision (GPUs may otherwise use TF32): the
  # comparison is about the split of the batch, not about matmul rounding.
  with jax.default_matmul_precision("highest"):
    for count in args.device_counts:
      runs[device_label(count)] = trainer.train(
        plans[count],
        initial_params,
        None,
        data,
        windows,
        f"{count} dev",
      )
    first_half = trainer.train(
      plans[source],
      initial_params,
      None,
      data,
      windows[:moved_at],
      f"{source} dev",
    )
    checkpoint = output_dir / "checkpoints" / f"window_{moved_at}"
    params, opt_state = save_and_restore_on(
      trainer, first_half, plans[destination], checkpoint
    )
    second_half = trainer.train(
      plans[destination],
      params,
      opt_state,
      data,
      windows[moved_at:],
      f"{destination} dev",
    )
  moved = f"{source} -> {destination} devices"
  runs[moved] = Run(
    second_half.params,
    second_half.opt_state,
    first_half.losses + second_half.losses,
  )

  def split(count: int) -> str:
    return f"{plans[count].micro_batch_size} x {plans[count].num_microbatches}"

  splits = {device_label(count): split(count) for count in args.device_counts}
  splits[moved] = f"{split(source)}, then {split(destination)}"
  reference = device_label(args.device_counts[0])
  results: dict[str, dict[str, Any]] = {}
  print(
    f"\n| run | micro-batch x k | updates | final loss | test accuracy |"
    f" max rel. param - {reference} |"
  )
  print("|---|---|---:|---:|---:|---:|")
  for name, run in runs.items():
    results[name] = {
      "first_loss": run.losses[0],
      "final_loss": run.losses[-1],
      "test_accuracy": trainer.test_accuracy(run.params, data),
      # Checked on its own: NaN where the reference has NaN counts as
      # equal in the difference below.
      "params_finite": all(
        np.isfinite(leaf).all()
        for leaf in jax.tree.leaves(jax.device_get(run.params))
      ),
      "max_param_difference": param_difference(
        run.params, runs[reference].params
      ),
      "max_loss_difference": float(
        np.max(np.abs(np.subtract(run.losses, runs[reference].losses)))
      ),
    }
    print(
      f"| {name} | {splits[name]} | {len(run.losses)} |"
      f" {results[name]['final_loss']:.5f} |"
      f" {results[name]['test_accuracy']:.3f} |"
      f" {results[name]['max_param_difference']:.1e} |"
    )
  unmoved = device_label(destination)
  if unmoved in runs:
    results[moved]["max_param_difference_to_unmoved"] = param_difference(
      runs[moved].params, runs[unmoved].params
    )
    print(
      f"\nmoved at update {moved_at} (a window boundary): max rel. param"
      f" difference to the {unmoved} run that never moved:"
      f" {results[moved]['max_param_difference_to_unmoved']:.1e}"
    )
  # np.max, unlike max, keeps a NaN.
  largest = np.max([row["max_loss_difference"] for row in results.values()])
  print(f"largest loss difference from the {reference} curve: {largest:.1e}")
  plot_path = output_dir / "elastic_losses.png"
  plot_losses(runs, reference, moved_at, plot_path)
  print(f"\nloss curves: {plot_path}\ncheckpoint: {checkpoint}")
  return results


if __name__ == "__main__":
  main()
