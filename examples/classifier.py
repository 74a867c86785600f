"""Gradient accumulation that matches the large batch, on a small classifier.

Trains one Flax Linen MLP from the same initial parameters, on the same data
in the same order, three ways:

1. the large batch: one batch of 64 per optimizer step;
2. ``ga_optax.accumulate``: 4 micro-batches of 16 per step, each weighted by
   its number of samples; the Python loop says which micro-batch closes each
   window (``closing=``), so each call compiles to a program without control
   flow, and the epoch's short last window closes when its batch ends;
3. the naive hand-written loop: sum the micro-batch gradients and divide by
   k, also for the partial window at the end of the epoch.

The training set does not divide into batches of 64, so every epoch ends with
a partial window. ga_optax normalises it by what it holds and stays on the
large-batch trajectory; the naive loop divides it by 4 and drifts away.

By default the data are scikit-learn's bundled 8x8 digits (no download); with
``--data-dir`` the four Fashion-MNIST IDX files in that folder. The script
prints a results table and writes a PNG of the three loss curves to
``./ga_optax_output/classifier`` under the current directory
(``--output-dir`` changes it).

With ``--noise-scale`` the ga_optax run also measures the gradient noise
scale ``B_simple`` from its windows (``noise_scale_decay=``), in samples,
prints it at a few points of training and plots it next to the batch in use
(``noise_scale.png``): how large a batch would still pay (see the docs page
"How big should the batch be?").

    python examples/classifier.py
    python examples/classifier.py --noise-scale
    python examples/classifier.py --data-dir ~/data/fashion-mnist --epochs 2
"""

from __future__ import annotations

import argparse
import functools
import gzip
import math
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter
from tqdm import tqdm

import ga_optax
from ga_optax.testing import max_relative_difference

# Under the directory the script is run from, never inside the source tree.
DEFAULT_OUTPUT_DIR = Path("ga_optax_output", "classifier")

FASHION_MNIST_FILES = {
  "x_train": "train-images-idx3-ubyte.gz",
  "y_train": "train-labels-idx1-ubyte.gz",
  "x_test": "t10k-images-idx3-ubyte.gz",
  "y_test": "t10k-labels-idx1-ubyte.gz",
}

# The third byte of an IDX file's magic number names the element type; the
# data are stored big-endian.
IDX_DTYPES = {
  0x08: np.dtype(np.uint8),
  0x09: np.dtype(np.int8),
  0x0B: np.dtype(">i2"),
  0x0C: np.dtype(">i4"),
  0x0D: np.dtype(">f4"),
  0x0E: np.dtype(">f8"),
}


class Dataset(NamedTuple):
  """Flattened float32 images in [0, 1] and int32 labels."""

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int


class NoiseScaleTrace(NamedTuple):
  """The gradient noise scale as read after each update of a run.

  Attributes:
    items: the batch in use: samples in each update's window.
    b_simple: the smoothed ``B_simple`` after each update, in samples.
  """

  items: list[float]
  b_simple: list[float]


class RunResult(NamedTuple):
  """What one training run produced."""

  params: Any
  losses: list[float]
  test_accuracy: float
  noise_scale: NoiseScaleTrace | None = None


def read_idx(path: Path) -> np.ndarray:
  """Reads an IDX file (gzipped when its name ends in .gz) into an array.

  Args:
    path: the file.

  Returns:
    The array, with the shape the header gives and native byte order.

  Raises:
    ValueError: the file is not a well-formed IDX file.
  """
  opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
  with opener(path, "rb") as file:
    raw = file.read()
  if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
    raise ValueError(
      f"{path} is not an IDX file: it should start with two zero bytes,"
      f" got {raw[:4]!r}."
    )
  type_code, num_dims = raw[2], raw[3]
  if type_code not in IDX_DTYPES:
    raise ValueError(
      f"{path} has IDX type code {type_code:#04x}; expected one of"
      f" {[f'{code:#04x}' for code in IDX_DTYPES]}."
    )
  header_size = 4 + 4 * num_dims
  if len(raw) < header_size:
    raise ValueError(
      f"{path} is truncated: its header announces {num_dims} dimensions"
      f" but the file holds {len(raw)} bytes."
    )
  shape = struct.unpack(f">{num_dims}I", raw[4:header_size])
  dtype = IDX_DTYPES[type_code]
  expected_bytes = dtype.itemsize * math.prod(shape)
  if len(raw) - header_size != expected_bytes:
    raise ValueError(
      f"{path} holds {len(raw) - header_size} bytes of data, but its header"
      f" says shape {shape} of {dtype} ({expected_bytes} bytes)."
    )
  data = np.frombuffer(raw, dtype=dtype, offset=header_size).reshape(shape)
  return data.astype(dtype.newbyteorder("="))


def load_fashion_mnist(data_dir: Path) -> Dataset:
  """Loads the four Fashion-MNIST IDX files from ``data_dir``."""
  missing = [
    name
    for name in FASHION_MNIST_FILES.values()
    if not (data_dir / name).is_file()
  ]
  if missing:
    raise FileNotFoundError(
      f"--data-dir {data_dir} lacks {', '.join(missing)}; it must hold the"
      f" four Fashion-MNIST files {', '.join(FASHION_MNIST_FILES.values())}."
    )
  arrays = {
    key: read_idx(data_dir / name) for key, name in FASHION_MNIST_FILES.items()
  }
  for split in ("train", "test"):
    images, labels = arrays[f"x_{split}"], arrays[f"y_{split}"]
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
      raise ValueError(
        f"Fashion-MNIST {split} files do not match: images of shape"
        f" {images.shape} (expected (n, rows, cols)) and labels of shape"
        f" {labels.shape} (expected (n,))."
      )

  def flat(images: np.ndarray) -> np.ndarray:
    return images.reshape(len(images), -1).astype(np.float32) / 255.0

  return Dataset(
    x_train=flat(arrays["x_train"]),
    y_train=arrays["y_train"].astype(np.int32),
    x_test=flat(arrays["x_test"]),
    y_test=arrays["y_test"].astype(np.int32),
    num_classes=10,
  )


def load_digits(seed: int) -> Dataset:
  """Loads scikit-learn's bundled digits: 1437 training and 360 test images.

  1437 is not a multiple of 64, so each epoch ends with a partial window.
  """
  from sklearn.datasets import load_digits as sklearn_digits
  from sklearn.model_selection import train_test_split

  digits = sklearn_digits()
  images = digits.data.astype(np.float32) / 16.0
  labels = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(
    images, labels, test_size=360, random_state=seed, stratify=labels
  )
  return Dataset(x_train, y_train, x_test, y_test, num_classes=10)


class MLP(nn.Module):
  """Two hidden ReLU layers and a linear classifier head."""

  hidden: int
  num_classes: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.relu(nn.Dense(self.hidden)(x))
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.num_classes)(x)


def epoch_batches(
  num_examples: int, batch_size: int, epoch: int, seed: int
) -> list[np.ndarray]:
  """The shuffled index batches of one epoch; the last one may be short."""
  order = np.random.default_rng([seed, epoch]).permutation(num_examples)
  return [
    order[start : start + batch_size]
    for start in range(0, num_examples, batch_size)
  ]


def micro_batches(
  batch: np.ndarray, micro_batch_size: int
) -> Iterator[np.ndarray]:
  """Splits one large batch into consecutive micro-batches."""
  for start in range(0, len(batch), micro_batch_size):
    yield batch[start : start + micro_batch_size]


def train_large_batch(
  model: MLP, params: Any, data: Dataset, args: argparse.Namespace
) -> RunResult:
  """The reference: one optimizer step per batch of ``args.batch_size``."""
  optimizer = optax.adam(args.learning_rate)
  value_and_grad = jax.value_and_grad(make_loss(model))

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = value_and_grad(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = optimizer.init(params)
  losses = []
  for batch in progress(args, "large batch", data):
    params, opt_state, loss = step(
      params, opt_state, data.x_train[batch], data.y_train[batch]
    )
    losses.append(float(loss))
  return RunResult(params, losses, accuracy(model, params, data))


def train_ga_optax(
  model: MLP, params: Any, data: Dataset, args: argparse.Namespace
) -> RunResult:
  """``ga_optax.accumulate``: weight each micro-batch by its sample count.

  With ``args.noise_scale``, the window also measures the gradient noise
  scale (in samples, the unit of the weights), read after every update.
  """
  tx = ga_optax.accumulate(
    optax.adam(args.learning_rate),
    args.every_k,
    noise_scale_decay=args.noise_scale_decay if args.noise_scale else None,
  )
  value_and_grad = jax.value_and_grad(make_loss(model))

  # The host knows which micro-batch closes each batch's window: two
  # programs (closing False or True), neither with control flow.
  @functools.partial(jax.jit, static_argnames="closing")
  def micro_step(params, state, x, y, closing):
    loss, grads = value_and_grad(params, x, y)
    # The gradient of a micro-batch's mean loss, weighted by its size, sums
    # to the gradient of the large batch's mean loss: a short last
    # micro-batch counts for what it holds.
    updates, state = tx.update(
      grads, state, params, weight=x.shape[0], closing=closing
    )
    return optax.apply_updates(params, updates), state, loss

  state = tx.init(params)
  losses = []
  trace = NoiseScaleTrace(items=[], b_simple=[])
  window_loss = window_size = 0.0
  micro_size = args.batch_size // args.every_k
  for batch in progress(args, "ga_optax", data):
    micro = list(micro_batches(batch, micro_size))
    for index, micro_batch in enumerate(micro):
      # Each batch is one window, the epoch's short last one included: its
      # last micro-batch closes it, normalised by what it holds.
      closing = index == len(micro) - 1
      params, state, loss = micro_step(
        params,
        state,
        data.x_train[micro_batch],
        data.y_train[micro_batch],
        closing,
      )
      window_loss += float(loss) * len(micro_batch)
      window_size += len(micro_batch)
      if closing:
        losses.append(window_loss / window_size)
        if args.noise_scale:
          trace.items.append(window_size)
          trace.b_simple.append(float(ga_optax.noise_scale(state).b_simple))
        window_loss = window_size = 0.0
  return RunResult(
    params,
    losses,
    accuracy(model, params, data),
    trace if args.noise_scale else None,
  )


def train_naive(
  model: MLP, params: Any, data: Dataset, args: argparse.Namespace
) -> RunResult:
  """A hand-written loop: average micro-batch gradients by dividing by k."""
  optimizer = optax.adam(args.learning_rate)
  value_and_grad = jax.jit(jax.value_and_grad(make_loss(model)))

  @jax.jit
  def apply_window(params, opt_state, grad_sum):
    # Every window is divided by k, also the short one that ends the epoch.
    grads = jax.tree.map(lambda g: g / args.every_k, grad_sum)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = optimizer.init(params)
  losses = []
  micro_size = args.batch_size // args.every_k
  for batch in progress(args, "naive loop", data):
    grad_sum = optax.tree.zeros_like(params)
    window_loss = 0.0
    for micro_batch in micro_batches(batch, micro_size):
      loss, grads = value_and_grad(
        params, data.x_train[micro_batch], data.y_train[micro_batch]
      )
      grad_sum = optax.tree.add(grad_sum, grads)
      window_loss += float(loss) * len(micro_batch)
    # Windows follow the large batches, so the last one of an epoch is short.
    params, opt_state = apply_window(params, opt_state, grad_sum)
    # Logged like the other runs (the batch's mean loss) so the curves
    # differ only where the trajectories do.
    losses.append(window_loss / len(batch))
  return RunResult(params, losses, accuracy(model, params, data))


def make_loss(model: MLP) -> Callable[..., jax.Array]:
  def mean_loss(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return mean_loss


def accuracy(model: MLP, params: Any, data: Dataset) -> float:
  logits = jax.jit(model.apply)({"params": params}, data.x_test)
  return float(jnp.mean(jnp.argmax(logits, -1) == data.y_test))


def progress(
  args: argparse.Namespace, name: str, data: Dataset
) -> Iterator[Any]:
  """Yields the batches of every epoch under a tqdm bar."""
  num_train = len(data.x_train)
  steps_per_epoch = math.ceil(num_train / args.batch_size)
  with tqdm(
    total=args.epochs * steps_per_epoch,
    desc=f"{name:<12}",
    unit="step",
    disable=not args.progress,
    file=sys.stderr,
  ) as bar:
    for epoch in range(args.epochs):
      batches = epoch_batches(num_train, args.batch_size, epoch, args.seed)
      for batch in batches:
        yield batch
        bar.update()


def plot_losses(runs: dict[str, RunResult], path: Path) -> None:
  """Loss curves, and how far each run's loss is from the large batch's."""
  figure = Figure(figsize=(11, 4), layout="constrained")
  curves, gaps = figure.subplots(1, 2)
  reference = np.asarray(runs["large batch"].losses)
  styles = [("C0", "-", 2.5), ("C1", "--", 1.5), ("C2", ":", 1.5)]
  for (name, run), (color, line, width) in zip(
    runs.items(), styles, strict=True
  ):
    style = {"color": color, "linestyle": line, "linewidth": width}
    curves.plot(run.losses, label=name, **style)
    if name != "large batch":
      # Zeros (identical losses) fall off the log scale and are not drawn.
      gap = np.abs(np.asarray(run.losses) - reference)
      gaps.plot(gap, label=name, **style)
  curves.set_title("training loss (mean over each large batch)")
  gaps.set_title("|loss - large-batch loss|")
  for axes in (curves, gaps):
    axes.set_xlabel("optimizer update")
    axes.set_yscale("log")
    axes.legend()
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path, dpi=120)


def plot_noise_scale(trace: NoiseScaleTrace, decay: float, path: Path) -> None:
  """``B_simple`` over training next to the batch in use."""
  figure = Figure(figsize=(7, 3.6), layout="constrained")
  axes = figure.subplots()
  updates = np.arange(1, len(trace.items) + 1)
  b_simple = np.asarray(trace.b_simple)
  # A smoothed |G|^2 at or below 0 (the gradient lost in the noise of a
  # batch this size) gives a B_simple that a log scale cannot show.
  shown = np.where(b_simple > 0, b_simple, np.nan)
  axes.plot(updates, shown, color="C3", label=f"B_simple (decay {decay})")
  axes.step(
    updates,
    trace.items,
    where="mid",
    color="C0",
    label="batch in use (short at each epoch's end)",
  )
  # Powers of 2 as plain numbers: a doubling of the batch is one step up.
  axes.set_yscale("log", base=2)
  axes.yaxis.set_major_formatter(ScalarFormatter())
  axes.set_xlabel("optimizer update")
  axes.set_ylabel("samples")
  axes.set_title("gradient noise scale and the batch in use")
  axes.legend(loc="upper left")
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path, dpi=100)


def report_noise_scale(
  trace: NoiseScaleTrace, args: argparse.Namespace, path: Path
) -> None:
  """Prints ``B_simple`` at a few points of training and plots all of it."""
  b_simple = np.asarray(trace.b_simple)
  count = len(b_simple)
  print(
    f"\ngradient noise scale B_simple (samples; decay"
    f" {args.noise_scale_decay}) against a batch of {args.batch_size}:"
  )
  for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
    update = max(1, round(fraction * count))
    print(f"  after update {update:>4}: {b_simple[update - 1]:10.1f}")
  plot_noise_scale(trace, args.noise_scale_decay, path)
  print(f"noise scale: {path.resolve()}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--data-dir",
    type=Path,
    help="folder with the four Fashion-MNIST .gz IDX files (default: the"
    " scikit-learn digits bundled with scikit-learn)",
  )
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument(
    "--train-size",
    type=int,
    help="use only the first N training examples (default: all)",
  )
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--every-k", type=int, default=4)
  parser.add_argument("--hidden", type=int, default=128)
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--noise-scale",
    action="store_true",
    help="also measure the gradient noise scale B_simple in the ga_optax run"
    " and plot it next to the batch in use",
  )
  parser.add_argument(
    "--noise-scale-decay",
    type=float,
    default=0.95,
    help="with --noise-scale: how slowly the per-window estimates are"
    " averaged (default 0.95, about 20 windows)",
  )
  parser.add_argument(
    "--output-dir",
    type=Path,
    default=DEFAULT_OUTPUT_DIR,
    help=f"where the loss plot goes (default: ./{DEFAULT_OUTPUT_DIR})",
  )
  parser.add_argument(
    "--no-progress",
    dest="progress",
    action="store_false",
    help="hide the progress bars",
  )
  args = parser.parse_args(argv)
  if args.batch_size % args.every_k:
    parser.error(
      f"--batch-size ({args.batch_size}) must be a multiple of --every-k"
      f" ({args.every_k})."
    )
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
  """Runs the comparison; returns what each run ended with.

  Per run: ``test_accuracy``, ``first_loss`` and ``final_loss``,
  ``params_finite``, and ``max_param_difference``: the
  ``max_relative_difference`` of its parameters to the large batch's. With
  ``--noise-scale``, the ga_optax run's also has the lists ``items`` and
  ``b_simple`` of :class:`NoiseScaleTrace`, one entry per update.
  """
  args = parse_args(argv)
  if args.data_dir is not None:
    data = load_fashion_mnist(args.data_dir.expanduser())
  else:
    data = load_digits(args.seed)
  if args.train_size is not None:
    data = data._replace(
      x_train=data.x_train[: args.train_size],
      y_train=data.y_train[: args.train_size],
    )
  num_train = len(data.x_train)
  print(
    f"device: {jax.devices()[0].platform}  train: {num_train}  test:"
    f" {len(data.x_test)}  batch {args.batch_size} ="
    f" {args.batch_size // args.every_k} x {args.every_k} micro-batches; the"
    f" last batch of each epoch holds {num_train % args.batch_size or args.batch_size}"
  )

  model = MLP(args.hidden, data.num_classes)
  params = model.init(jax.random.key(args.seed), data.x_train[:1])["params"]
  trainers = {
    "large batch": train_large_batch,
    "ga_optax.accumulate": train_ga_optax,
    "naive loop (/ k)": train_naive,
  }
  # float32 matmuls at full precision (GPUs may otherwise use TF32): the
  # comparison is about the accumulation, not about matmul rounding.
  with jax.default_matmul_precision("highest"):
    runs = {
      name: trainer(model, params, data, args)
      for name, trainer in trainers.items()
    }

  params = {name: jax.device_get(run.params) for name, run in runs.items()}
  results = {
    name: {
      "test_accuracy": run.test_accuracy,
      "first_loss": run.losses[0],
      "final_loss": run.losses[-1],
      # Checked on its own: NaN where the large batch has NaN counts as
      # equal in the difference below.
      "params_finite": all(
        np.isfinite(leaf).all() for leaf in jax.tree.leaves(params[name])
      ),
      "max_param_difference": max_relative_difference(
        params[name], params["large batch"]
      ),
    }
    for name, run in runs.items()
  }
  print(
    f"\n{'run':<22}{'updates':>9}{'final loss':>12}{'test acc':>10}"
    f"{'max rel. param - large batch':>31}"
  )
  for name, run in runs.items():
    row = results[name]
    print(
      f"{name:<22}{len(run.losses):>9}{row['final_loss']:>12.5f}"
      f"{row['test_accuracy']:>10.2%}{row['max_param_difference']:>31.2e}"
    )
  plot_path = args.output_dir / "classifier_losses.png"
  plot_losses(runs, plot_path)
  print(f"\nloss curves: {plot_path.resolve()}")
  trace = runs["ga_optax.accumulate"].noise_scale
  if trace is not None:
    results["ga_optax.accumulate"] |= trace._asdict()
    report_noise_scale(trace, args, args.output_dir / "noise_scale.png")
  return results


if __name__ == "__main__":
  main()
