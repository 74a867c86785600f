"""The bfloat16 recipe, measured: bf16 params, float32 accumulator and moments.

Trains the small Transformer LM of ``examples/byte_lm.py`` on its text
(Python's own help texts), from the same initial parameters, on the same
windows of token-weighted micro-batches (``ga_optax.accumulate`` with
``weight=`` the real tokens), with AdamW on a warm-up and cosine schedule,
five ways:

1. ``float32``: params, accumulator and Adam's moments in float32, the
   reference;
2. ``bf16-recipe``: bfloat16 params (and compute), a float32 accumulator
   (``accumulator_dtype=jnp.float32``, ga_optax's default) and float32
   moments (``float32_state`` below);
3. ``bf16-default-moments``: bfloat16 params with both libraries'
   defaults: the accumulator is float32, but optax makes Adam's moments in
   the params' dtype;
4. ``all-bf16``: params, accumulator and moments in bfloat16;
5. ``float32-master``: params, accumulator and moments in float32, the
   model computing in bfloat16 from a copy made inside the loss.

For each run it reports the training loss, the held-out loss (every run's
params evaluated in float32), the bytes of params and optimizer state kept
per parameter, and the drift from the float32 run: ``||params - float32
params|| / ||float32 params||`` after every window, the params cast to
float32. It prints a table, plots the curves to
``./ga_optax_output/bf16_recipe`` (``--output-dir`` changes it) and, with
``--output``, writes the figures as JSON.

    python examples/bf16_recipe.py                # a minute or two, CPU
    python examples/bf16_recipe.py --preset gpu
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from matplotlib.figure import Figure
from tqdm import tqdm

import ga_optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_lm import (
  MODEL_SIZES,
  add_preset_options,
  count_real_tokens,
  fill_from_preset,
  load_text,
  make_loss,
  relative_distance,
  split_model,
)

DEFAULT_OUTPUT_DIR = Path("ga_optax_output", "bf16_recipe")

# The sizes of a run, chosen by --preset; any option given overrides them.
PRESETS: dict[str, dict[str, int]] = {
  "cpu": {
    "steps": 150,
    "batch_size": 32,
    "every_k": 4,
    "max_len": 64,
    "dim": 64,
    "num_heads": 4,
    "num_layers": 2,
    "eval_every": 10,
  },
  "gpu": {
    "steps": 1000,
    "batch_size": 64,
    "every_k": 8,
    "max_len": 256,
    "dim": 256,
    "num_heads": 8,
    "num_layers": 4,
    "eval_every": 25,
  },
}
LEARNING_RATE = 3e-3
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)


class Precision(NamedTuple):
  """Where one run keeps its numbers."""

  params: jnp.dtype  # the params, as stored and stepped
  compute: jnp.dtype  # the forward and backward pass
  accumulator: jnp.dtype  # ga_optax.accumulate's accumulator_dtype
  float32_moments: bool  # Adam's mu and nu float32 (else the params' dtype)


RUNS = {
  "float32": Precision(F32, F32, F32, float32_moments=True),
  "bf16-recipe": Precision(BF16, BF16, F32, float32_moments=True),
  "bf16-default-moments": Precision(BF16, BF16, F32, float32_moments=False),
  "all-bf16": Precision(BF16, BF16, BF16, float32_moments=False),
  "float32-master": Precision(F32, BF16, F32, float32_moments=True),
}
# The run the others' drift is measured from.
REFERENCE = "float32"
# Color, line style and width of each run's curves.
STYLES = {
  "float32": ("C0", "-", 2.5),
  "bf16-recipe": ("C2", "--", 1.8),
  "bf16-default-moments": ("C1", "-", 1.2),
  "all-bf16": ("C3", "-", 1.2),
  "float32-master": ("C4", ":", 2.0),
}


def float32_state(
  optimizer: optax.GradientTransformation,
) -> optax.GradientTransformation:
  """``optimizer`` with its state in float32, whatever the params' dtype.

  optax's Adam makes ``nu`` (and ``mu`` without ``mu_dtype``) in the dtype
  of the params that ``init`` sees, and its update casts them back to the
  dtype they had (``optax.tree.cast_like``): made from float32 copies of the
  params, they stay float32 on every update. The updates come out float32;
  ``optax.apply_updates`` rounds the new params to their own dtype.
  """

  def init(params: Any) -> Any:
    return optimizer.init(optax.tree.cast(params, jnp.float32))

  return optax.GradientTransformation(init, optimizer.update)


def make_optimizer(
  precision: Precision, args: argparse.Namespace
) -> optax.GradientTransformation:
  """AdamW inside ``ga_optax.accumulate``, in the run's dtypes."""
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=args.learning_rate,
    warmup_steps=max(1, args.steps // 10),
    decay_steps=args.steps,
    end_value=args.learning_rate / 10,
  )
  adamw = optax.adamw(schedule)
  if precision.float32_moments:
    adamw = float32_state(adamw)
  return ga_optax.accumulate(
    adamw, args.every_k, accumulator_dtype=precision.accumulator
  )


class Run(NamedTuple):
  """``window_step(params, opt_state, micro_batches)`` per update."""

  window_step: Callable[..., tuple[Any, Any, jax.Array]]
  optimizer: optax.GradientTransformation


def make_run(
  loss: Callable[..., jax.Array],
  precision: Precision,
  args: argparse.Namespace,
) -> Run:
  """One window per call: k micro-steps of ``accumulate`` in a ``lax.scan``."""
  optimizer = make_optimizer(precision, args)

  def compute_loss(params: Any, tokens: jax.Array) -> jax.Array:
    # A no-op but for master params, whose gradient is then float32.
    return loss(optax.tree.cast(params, precision.compute), tokens)

  value_and_grad = jax.value_and_grad(compute_loss)

  @jax.jit
  def window_step(params, opt_state, micro_batches):
    def micro_step(carry, tokens):
      params, opt_state = carry
      value, grads = value_and_grad(params, tokens)
      num_tokens = count_real_tokens(tokens)
      updates, opt_state = optimizer.update(
        grads, opt_state, params, weight=num_tokens
      )
      params = optax.apply_updates(params, updates)
      return (params, opt_state), (value, num_tokens)

    (params, opt_state), (values, num_tokens) = jax.lax.scan(
      micro_step, (params, opt_state), micro_batches
    )
    # The large batch's token mean, in every run alike.
    return params, opt_state, jnp.sum(values * num_tokens) / jnp.sum(num_tokens)

  return Run(window_step, optimizer)


def bytes_per_param(params: Any, opt_state: Any) -> float:
  """Bytes of params and optimizer state (accumulator included) per param."""
  size = sum(leaf.size for leaf in jax.tree.leaves(params))
  stored = sum(
    leaf.nbytes for leaf in jax.tree.leaves((params, opt_state)) if leaf.ndim
  )
  return stored / size


class Curves(NamedTuple):
  """A run's course: per window, and per evaluation."""

  train_loss: list[float]
  drift: list[float]
  held_out_loss: list[float]


@jax.jit
def unchanged_share(params: Any, previous: Any) -> jax.Array:
  """The share of the parameters equal in ``params`` and ``previous``."""
  equal = jax.tree.map(lambda new, old: jnp.sum(new == old), params, previous)
  size = sum(leaf.size for leaf in jax.tree.leaves(params))
  return sum(jax.tree.leaves(equal)) / size


def train(
  runs: dict[str, Run],
  initial_params: Any,
  loss: Callable[..., jax.Array],
  batches: list[np.ndarray],
  held_out: np.ndarray,
  eval_windows: list[int],
  args: argparse.Namespace,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Curves], dict[str, float]]:
  """Trains every run on the batches, in lockstep.

  Returns each run's final params and optimizer state; its curves: the
  training loss and the drift from the float32 run after every window, and
  the held-out loss after each of ``eval_windows`` (0: before training);
  and the share of its params that the last window's update left as they
  were (an update under half a rounding step of a param rounds back to it).
  """
  params = {
    name: optax.tree.cast(initial_params, RUNS[name].params) for name in runs
  }
  opt_states = {
    name: run.optimizer.init(params[name]) for name, run in runs.items()
  }
  curves = {name: Curves([], [], []) for name in runs}
  # Every run's params as trained, evaluated alike: cast to float32.
  evaluate = jax.jit(lambda p: loss(optax.tree.cast(p, jnp.float32), held_out))

  def record_held_out() -> None:
    for name in runs:
      curves[name].held_out_loss.append(float(evaluate(params[name])))

  if 0 in eval_windows:
    record_held_out()
  for window, tokens in enumerate(
    tqdm(
      batches,
      desc="training",
      unit="window",
      disable=not args.progress,
      file=sys.stderr,
    ),
    start=1,
  ):
    micro_batches = tokens.reshape(args.every_k, -1, tokens.shape[-1])
    previous = dict(params)
    for name, run in runs.items():
      params[name], opt_states[name], value = run.window_step(
        params[name], opt_states[name], micro_batches
      )
      curves[name].train_loss.append(float(value))
    reference = params[REFERENCE]
    for name in runs:
      curves[name].drift.append(
        float(relative_distance(optax.tree.cast(params[name], F32), reference))
      )
    if window in eval_windows:
      record_held_out()
  unchanged = {
    name: float(unchanged_share(params[name], previous[name])) for name in runs
  }
  return params, opt_states, curves, unchanged


def plot(curves: dict[str, Curves], eval_windows: list[int], path: Path):
  """Training loss; held-out loss and params, each against the float32 run."""
  figure = Figure(figsize=(15, 4.2), layout="constrained")
  train_axes, held_out_axes, drift_axes = figure.subplots(1, 3)
  reference = np.asarray(curves[REFERENCE].held_out_loss)
  for name, run_curves in curves.items():
    color, line, width = STYLES[name]
    style = {"color": color, "linestyle": line, "linewidth": width}
    windows = np.arange(1, len(run_curves.train_loss) + 1)
    train_axes.plot(windows, run_curves.train_loss, label=name, **style)
    if name == REFERENCE:
      continue
    held_out_axes.plot(
      eval_windows,
      np.asarray(run_curves.held_out_loss) - reference,
      label=name,
      **style,
    )
    drift_axes.plot(windows, run_curves.drift, label=name, **style)
  train_axes.set_title("training loss (token mean of each window)")
  train_axes.set_yscale("log")
  held_out_axes.set_title("held-out loss - float32's (params cast to float32)")
  drift_axes.set_title("||params - float32 params|| / ||float32 params||")
  drift_axes.set_yscale("log")
  for axes in (train_axes, held_out_axes, drift_axes):
    axes.set_xlabel("window (optimizer update)")
    axes.legend(fontsize="small")
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path, dpi=110)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_preset_options(
    parser,
    PRESETS,
    {
      "steps": "windows, one optimizer update each",
      "batch_size": "sequences per window",
      "every_k": "micro-batches per window",
      **MODEL_SIZES,
      "eval_every": "windows between held-out evaluations",
    },
    cpu_time="a minute or two",
  )
  parser.add_argument(
    "--learning-rate",
    type=float,
    default=LEARNING_RATE,
    help=f"AdamW's peak learning rate (default {LEARNING_RATE:g})",
  )
  parser.add_argument(
    "--runs",
    nargs="+",
    choices=tuple(RUNS),
    default=list(RUNS),
    metavar="RUN",
    help=f"the runs to train, {REFERENCE} among them (default: all of"
    f" {', '.join(RUNS)})",
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--output-dir",
    type=Path,
    default=DEFAULT_OUTPUT_DIR,
    help=f"where the plot goes (default: ./{DEFAULT_OUTPUT_DIR})",
  )
  parser.add_argument(
    "--output", type=Path, help="also write the figures to this JSON file"
  )
  parser.add_argument(
    "--no-progress",
    dest="progress",
    action="store_false",
    help="hide the progress bar",
  )
  args = parser.parse_args(argv)
  fill_from_preset(args, PRESETS)
  if REFERENCE not in args.runs:
    parser.error(
      f"--runs must include {REFERENCE}, the run the drift is measured from."
    )
  # In the order of the table, each once.
  args.runs = [name for name in RUNS if name in args.runs]
  if args.batch_size % args.every_k:
    parser.error(
      f"--batch-size ({args.batch_size}) must be a multiple of --every-k"
      f" ({args.every_k})."
    )
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the comparison; returns the figures, as ``--output`` writes them.

  ``{"config": the sizes, "eval_windows": [...], "runs": {name: ...}}``,
  each run with its dtypes, ``bytes_per_param``, ``train_loss``,
  ``held_out_loss`` and ``drift`` (lists) and the final figures the table
  prints: ``final_train_loss`` (mean of the last 10 windows),
  ``final_held_out_loss``, ``final_drift`` and ``params_finite``.
  """
  args = parse_args(argv)
  rng = np.random.default_rng(args.seed)
  batches, held_out = load_text(args, rng)
  print(
    f"device: {jax.devices()[0].platform}  {args.steps} windows of"
    f" {args.batch_size} sequences = {args.batch_size // args.every_k} x"
    f" {args.every_k} micro-batches, token-weighted; AdamW, peak learning"
    f" rate {args.learning_rate:g}"
  )
  graphdef, initial_params = split_model(args, held_out.shape[1] - 1)
  loss = make_loss(graphdef)
  runs = {name: make_run(loss, RUNS[name], args) for name in args.runs}
  eval_windows = [*range(0, args.steps, args.eval_every), args.steps]
  # float32 matmuls at full precision (GPUs may otherwise use TF32): the
  # reference is float32 throughout.
  with jax.default_matmul_precision("highest"):
    params, opt_states, curves, unchanged = train(
      runs, initial_params, loss, batches, held_out, eval_windows, args
    )
  results: dict[str, Any] = {
    "config": {
      key: getattr(args, key)
      for key in (*PRESETS["cpu"], "learning_rate", "seed", "runs")
    },
    "device": jax.devices()[0].platform,
    "eval_windows": eval_windows,
    "runs": {},
  }
  for name in args.runs:
    precision = RUNS[name]
    run_curves = curves[name]
    results["runs"][name] = {
      "params_dtype": precision.params.name,
      "compute_dtype": precision.compute.name,
      "accumulator_dtype": precision.accumulator.name,
      "moments_dtype": "float32"
      if precision.float32_moments
      else precision.params.name,
      "bytes_per_param": bytes_per_param(params[name], opt_states[name]),
      "params_finite": all(
        bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(params[name])
      ),
      "final_train_loss": float(np.mean(run_curves.train_loss[-10:])),
      "final_held_out_loss": run_curves.held_out_loss[-1],
      "final_drift": run_curves.drift[-1],
      "unchanged_by_last_update": unchanged[name],
      **run_curves._asdict(),
    }
  print_table(results["runs"], args.steps)
  plot_path = args.output_dir / "bf16_recipe.png"
  plot(curves, eval_windows, plot_path)
  print(f"\nplot: {plot_path.resolve()}")
  if args.output is not None:
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1))
    print(f"figures: {args.output.resolve()}")
  return results


def print_table(runs: dict[str, Any], steps: int) -> None:
  print(
    f"\n{'run':<22}{'params':>7}{'compute':>8}{'accum.':>7}{'moments':>8}"
    f"{'B/param':>8}{'train loss':>11}{'held-out':>9}{f'drift @{steps}':>12}"
    f"{'unchanged':>10}"
  )
  short = {"float32": "f32", "bfloat16": "bf16"}
  for name, row in runs.items():
    print(
      f"{name:<22}{short[row['params_dtype']]:>7}"
      f"{short[row['compute_dtype']]:>8}{short[row['accumulator_dtype']]:>7}"
      f"{short[row['moments_dtype']]:>8}{row['bytes_per_param']:>8.1f}"
      f"{row['final_train_loss']:>11.4f}{row['final_held_out_loss']:>9.4f}"
      f"{row['final_drift']:>12.2e}{row['unchanged_by_last_update']:>10.1%}"
    )


if __name__ == "__main__":
  main()
