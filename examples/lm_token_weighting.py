"""Token-weighted accumulation on a small Transformer LM trained on English text.

A language model's loss is the mean over *real* tokens, padding excluded. When
a large batch is split into micro-batches, each micro-batch holds a different
number of real tokens, so the mean of the micro-batch means is not the
large-batch loss: the tokens of short micro-batches count for more. This
script trains one Flax NNX Transformer from the same initial parameters, on
the same batches, four ways, and reports how far each run ends from the
large batch:

1. the large batch, with the token-mean loss;
2. naive accumulation: each micro-batch's token mean, averaged over the k
   micro-batches (``ga_optax.accumulate`` without ``weight=``; the same
   arithmetic as ``optax.MultiSteps``);
3. ``ga_optax.accumulate`` with ``weight=`` the micro-batch's real tokens;
4. ``ga_optax.microbatched_value_and_grad`` with a ``weight_fn`` that counts
   real tokens: the whole window in one jitted step.

The text is the interpreter's own help texts, ``pydoc_data.topics``, which
ships with every Python installation (79 topics, about 465 KB; the wording
changes a little from one Python release to the next). Each topic is cut
into paragraphs at blank lines, and each paragraph at sentence ends into
sequences of at most ``--max-len`` bytes: whole sentences, as many as fit,
and a sentence longer than that cut at its last space before the limit. The
tokens are the UTF-8 bytes between BOS and EOS, padded to a common width. A
heading holds a few bytes, a paragraph of prose the full width, so the
micro-batches hold different numbers of real tokens. The model, the text and
the helpers the LM examples share are in ``examples/byte_lm.py``.

The defaults take about a minute on a CPU; ``--preset gpu`` is a longer run
of a larger model for a GPU. The script prints a results table and writes a
PNG plot to ``./ga_optax_output/lm_token_weighting`` under the current
directory (``--output-dir`` changes it).

    python examples/lm_token_weighting.py
    python examples/lm_token_weighting.py --preset gpu
"""

from __future__ import annotations

import argparse
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
from ga_optax.testing import max_relative_difference

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_lm import (
  MODEL_SIZES,
  PAD,
  add_preset_options,
  count_real_tokens,
  fill_from_preset,
  load_text,
  make_loss,
  relative_distance,
  split_model,
)

# Under the directory the script is run from, never inside the source tree.
DEFAULT_OUTPUT_DIR = Path("ga_optax_output", "lm_token_weighting")

# The sizes of a run, chosen by --preset; any option given overrides them.
# The gpu preset's 300 updates of 64 read its 3,300 or so training sequences
# about six times.
PRESETS: dict[str, dict[str, int]] = {
  "cpu": {
    "steps": 100,
    "batch_size": 32,
    "every_k": 4,
    "max_len": 128,
    "dim": 64,
    "num_heads": 4,
    "num_layers": 2,
  },
  "gpu": {
    "steps": 300,
    "batch_size": 64,
    "every_k": 8,
    "max_len": 256,
    "dim": 256,
    "num_heads": 8,
    "num_layers": 4,
  },
}
LEARNING_RATES = {"adam": 3e-3, "sgd": 0.3}


class Run(NamedTuple):
  """One way of training: ``step(params, opt_state, tokens)`` per update."""

  step: Callable[..., tuple[Any, Any, float]]
  optimizer: optax.GradientTransformation


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
  """The optimizer every run steps with (wrapped by the accumulating ones)."""
  if args.optimizer == "sgd":
    return optax.sgd(args.learning_rate)
  return optax.adam(args.learning_rate)


def large_batch_run(loss: Callable, args: argparse.Namespace) -> Run:
  optimizer = make_optimizer(args)
  value_and_grad = jax.value_and_grad(loss)

  @jax.jit
  def step(params, opt_state, tokens):
    value, grads = value_and_grad(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return Run(step, optimizer)


def accumulate_runs(loss: Callable, args: argparse.Namespace) -> list[Run]:
  """``ga_optax.accumulate``, one ``update`` call per micro-batch.

  Returns the naive run (every micro-batch weighs 1) and the token-weighted
  run. They share one compiled micro-step, ``weighted`` being an argument.
  """
  optimizer = ga_optax.accumulate(make_optimizer(args), args.every_k)
  value_and_grad = jax.value_and_grad(loss)

  @jax.jit
  def micro_step(params, opt_state, tokens, weighted):
    value, grads = value_and_grad(params, tokens)
    num_tokens = count_real_tokens(tokens)
    # With weight= the real-token count, the window's gradient is the
    # gradient of the large batch's token mean; with weight 1, every
    # micro-batch counts the same whatever it holds.
    weight = jnp.where(weighted, num_tokens, 1)
    updates, opt_state = optimizer.update(
      grads, opt_state, params, weight=weight
    )
    return optax.apply_updates(params, updates), opt_state, value, num_tokens

  def make_step(weighted: bool) -> Callable[..., tuple[Any, Any, float]]:
    def step(params, opt_state, tokens):
      total = weight_sum = 0.0
      for micro_batch in np.split(tokens, args.every_k):
        params, opt_state, value, num_tokens = micro_step(
          params, opt_state, micro_batch, weighted
        )
        # Logged as the large batch's token mean in every run, so that the
        # curves differ only where the trajectories do.
        total += float(value) * int(num_tokens)
        weight_sum += int(num_tokens)
      return params, opt_state, total / weight_sum

    return step

  return [Run(make_step(False), optimizer), Run(make_step(True), optimizer)]


def microbatched_run(loss: Callable, args: argparse.Namespace) -> Run:
  """``ga_optax.microbatched_value_and_grad``: one jitted step per window."""
  optimizer = make_optimizer(args)
  value_and_grad = ga_optax.microbatched_value_and_grad(
    loss, args.every_k, weight_fn=count_real_tokens
  )

  @jax.jit
  def step(params, opt_state, tokens):
    value, grads = value_and_grad(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return Run(step, optimizer)


def plot(
  losses: dict[str, list[float]],
  distances: dict[str, list[float]],
  path: Path,
) -> None:
  """Loss curves, and each run's distance from the large-batch parameters."""
  figure = Figure(figsize=(11, 4), layout="constrained")
  loss_axes, distance_axes = figure.subplots(1, 2)
  styles = [
    ("C0", "-", 2.5),
    ("C3", "-", 1.5),
    ("C1", "--", 1.5),
    ("C2", ":", 2.0),
  ]
  for name, (color, line, width) in zip(losses, styles, strict=True):
    style = {"color": color, "linestyle": line, "linewidth": width}
    loss_axes.plot(losses[name], label=name, **style)
    if name in distances:
      distance_axes.plot(distances[name], label=name, **style)
  loss_axes.set_title("training loss (token mean over each large batch)")
  loss_axes.set_yscale("log")
  distance_axes.set_title(
    "||params - large-batch params|| / ||large-batch params||"
  )
  distance_axes.set_yscale("log")
  for axes in (loss_axes, distance_axes):
    axes.set_xlabel("optimizer update")
    axes.legend()
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path, dpi=120)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_preset_options(
    parser,
    PRESETS,
    {
      "steps": "optimizer updates",
      "batch_size": "sequences per update",
      "every_k": "micro-batches per update",
      **MODEL_SIZES,
    },
    cpu_time="about a minute",
  )
  parser.add_argument(
    "--optimizer",
    choices=tuple(LEARNING_RATES),
    default="adam",
    help="adam (default), or plain sgd, whose update is proportional to the"
    " gradient: a gradient of the wrong scale shows in full, where Adam"
    " divides most of it out",
  )
  parser.add_argument(
    "--learning-rate",
    type=float,
    help=", ".join(
      f"default with {name}: {rate:g}" for name, rate in LEARNING_RATES.items()
    ),
  )
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
    help="hide the progress bar",
  )
  args = parser.parse_args(argv)
  fill_from_preset(args, PRESETS)
  if args.learning_rate is None:
    args.learning_rate = LEARNING_RATES[args.optimizer]
  if args.batch_size % args.every_k:
    parser.error(
      f"--batch-size ({args.batch_size}) must be a multiple of --every-k"
      f" ({args.every_k})."
    )
  return args


def train(
  runs: dict[str, Run],
  initial_params: Any,
  batches: list[np.ndarray],
  progress: bool,
) -> tuple[dict[str, Any], dict[str, list[float]], dict[str, list[float]]]:
  """Trains every run on the batches, in lockstep.

  Returns each run's final parameters, its loss at every update, and (but for
  the large batch) its relative distance from the large-batch parameters
  after every update.
  """
  params = dict.fromkeys(runs, initial_params)
  opt_states = {
    name: run.optimizer.init(initial_params) for name, run in runs.items()
  }
  losses: dict[str, list[float]] = {name: [] for name in runs}
  distances: dict[str, list[float]] = {
    name: [] for name in runs if name != "large batch"
  }
  for tokens in tqdm(
    batches,
    desc="training",
    unit="update",
    disable=not progress,
    file=sys.stderr,
  ):
    for name, run in runs.items():
      params[name], opt_states[name], value = run.step(
        params[name], opt_states[name], tokens
      )
      losses[name].append(float(value))
    for name in distances:
      distances[name].append(
        float(relative_distance(params[name], params["large batch"]))
      )
  return params, losses, distances


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
  """Runs the comparison; returns each run's losses and parameter distance.

  Per run: ``first_loss`` and ``final_loss`` (training), ``held_out_loss``,
  ``params_finite``, ``max_param_difference`` (``max_relative_difference``
  to the large batch's parameters) and ``relative_distance`` (the norm of
  the difference over the norm of the large batch's parameters).
  """
  args = parse_args(argv)
  rng = np.random.default_rng(args.seed)
  batches, held_out = load_text(args, rng)
  micro_size = args.batch_size // args.every_k
  tokens_per_row = (np.concatenate(batches)[:, 1:] != PAD).sum(axis=1)
  micro_counts = tokens_per_row.reshape(-1, micro_size).sum(axis=1)
  print(
    f"device: {jax.devices()[0].platform}  {args.steps} updates of"
    f" {args.batch_size} sequences = {micro_size} x {args.every_k}"
    f" micro-batches; real tokens per micro-batch: {micro_counts.min()} to"
    f" {micro_counts.max()} (mean {micro_counts.mean():.0f})"
  )

  graphdef, initial_params = split_model(args, held_out.shape[1] - 1)
  loss = make_loss(graphdef)
  naive_run, weighted_run = accumulate_runs(loss, args)
  runs = {
    "large batch": large_batch_run(loss, args),
    "naive (mean of means)": naive_run,
    "accumulate(weight=)": weighted_run,
    "microbatched(weight_fn=)": microbatched_run(loss, args),
  }
  # float32 matmuls at full precision (GPUs may otherwise use TF32): the
  # comparison is about the accumulation, not about matmul rounding.
  with jax.default_matmul_precision("highest"):
    params, losses, distances = train(
      runs, initial_params, batches, args.progress
    )
    eval_loss = jax.jit(loss)
    held_out_losses = {
      name: float(eval_loss(params[name], held_out)) for name in runs
    }

  params = jax.device_get(params)
  reference = params["large batch"]
  results = {
    name: {
      "first_loss": losses[name][0],
      "final_loss": losses[name][-1],
      "held_out_loss": held_out_losses[name],
      # Checked on its own: NaN where the large batch has NaN counts as
      # equal in the difference below.
      "params_finite": all(
        np.isfinite(leaf).all() for leaf in jax.tree.leaves(params[name])
      ),
      "max_param_difference": max_relative_difference(params[name], reference),
      "relative_distance": float(relative_distance(params[name], reference)),
    }
    for name in runs
  }
  print(
    f"\n{'run':<26}{'final loss':>11}{'held-out loss':>15}"
    f"{'max rel. param diff':>21}{'rel. distance':>15}"
  )
  for name, row in results.items():
    print(
      f"{name:<26}{row['final_loss']:>11.5f}{row['held_out_loss']:>15.5f}"
      f"{row['max_param_difference']:>21.2e}{row['relative_distance']:>15.2e}"
    )
  plot_path = args.output_dir / "lm_token_weighting.png"
  plot(losses, distances, plot_path)
  print(f"\nplot: {plot_path.resolve()}")
  return results


if __name__ == "__main__":
  main()
