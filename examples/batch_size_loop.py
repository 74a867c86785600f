"""The batch size, closed loop: k follows the measured noise scale, on real text.

Trains the small Transformer LM of ``examples/byte_lm.py`` on its text
(Python's own help texts), micro-batch by micro-batch, with the same budget
of micro-batches, several ways:

1. each fixed k from ``--small-k`` (default 2) to ``--large-k`` (default
   16) by doublings, the learning rate multiplied by ``sqrt(k / small_k)``
   (the rule ``lr_scaling="sqrt"`` applies as k moves);
2. ``ga_optax.batch_size.adaptive_k(small_k, max_k=large_k)`` with
   ``lr_scaling="sqrt"``: k starts small and doubles whenever the measured
   noise scale ``B_simple`` reaches twice the batch the window held (k = 1
   cannot start it: a window of one micro-gradient measures no noise).

Every micro-batch is weighted by its real tokens, so ``B_simple`` is in
tokens and a window's batch is its token count. The script reports, for
each run, the held-out loss at the end of the budget, the optimizer steps it
took, and the micro-batches (items) and steps it needed to reach the loss
the fixed large k ends at; it plots the held-out loss against items and
against steps, and the adaptive run's k and ``B_simple`` against items, to
``./ga_optax_output/batch_size_loop`` (``--output-dir`` changes it).

    python examples/batch_size_loop.py                # about a minute, CPU
    python examples/batch_size_loop.py --preset gpu
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from matplotlib.figure import Figure
from tqdm import tqdm

import ga_optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_lm import (
  HELD_OUT_SEQUENCES,
  MODEL_SIZES,
  add_preset_options,
  count_real_tokens,
  fill_from_preset,
  make_loss,
  split_model,
  text_sequences,
)

DEFAULT_OUTPUT_DIR = Path("ga_optax_output", "batch_size_loop")

PRESETS: dict[str, dict[str, int]] = {
  "cpu": {
    "micro_batches": 384,
    "micro_batch_size": 8,
    "max_len": 64,
    "dim": 64,
    "num_heads": 4,
    "num_layers": 2,
    "eval_every": 16,
  },
  "gpu": {
    "micro_batches": 4096,
    "micro_batch_size": 16,
    "max_len": 256,
    "dim": 256,
    "num_heads": 8,
    "num_layers": 4,
    "eval_every": 64,
  },
}


class Trace(NamedTuple):
  """A run's course, one entry per evaluation."""

  items: list[int]
  steps: list[int]
  held_out_loss: list[float]
  k: list[int]
  b_simple: list[float]


def fixed_ks(args: argparse.Namespace) -> list[int]:
  ks = [args.small_k]
  while ks[-1] * 2 <= args.large_k:
    ks.append(ks[-1] * 2)
  return ks


def make_runs(args: argparse.Namespace) -> dict[str, Any]:
  """The transformations, each wrapping Adam, by name."""
  runs = {
    f"fixed k = {k}": ga_optax.accumulate(
      optax.adam(args.learning_rate * math.sqrt(k / args.small_k)),
      k,
      noise_scale_decay=0.9,
    )
    for k in fixed_ks(args)
  }
  runs["adaptive k"] = ga_optax.accumulate(
    optax.adam(args.learning_rate),
    ga_optax.batch_size.adaptive_k(args.small_k, max_k=args.large_k),
    noise_scale_decay=0.9,
    lr_scaling="sqrt",
  )
  return runs


def train(
  tx: Any,
  initial_params: Any,
  loss: Any,
  micro_batches: list[np.ndarray],
  held_out: np.ndarray,
  args: argparse.Namespace,
  name: str,
) -> Trace:
  """One run over the micro-batches, evaluated every ``eval_every``."""
  value_and_grad = jax.value_and_grad(loss)

  @jax.jit
  def micro_step(params, state, tokens):
    _, grads = value_and_grad(params, tokens)
    updates, state = tx.update(
      grads, state, params, weight=count_real_tokens(tokens)
    )
    return optax.apply_updates(params, updates), state

  evaluate = jax.jit(loss)
  params, state = initial_params, tx.init(initial_params)
  trace = Trace([], [], [], [], [])
  for index, tokens in enumerate(
    tqdm(micro_batches, desc=name, disable=not args.progress, file=sys.stderr)
  ):
    params, state = micro_step(params, state, tokens)
    if (index + 1) % args.eval_every == 0 or index + 1 == len(micro_batches):
      trace.items.append(index + 1)
      trace.steps.append(int(ga_optax.applied_updates(state)))
      trace.held_out_loss.append(float(evaluate(params, held_out)))
      trace.k.append(int(ga_optax.current_k(state)))
      trace.b_simple.append(float(ga_optax.noise_scale(state).b_simple))
  return trace


def first_reaching(
  trace: Trace, target: float
) -> tuple[int | None, int | None]:
  """Items and steps at the first evaluation whose loss is at most ``target``."""
  for items, steps, value in zip(
    trace.items, trace.steps, trace.held_out_loss, strict=True
  ):
    if value <= target:
      return items, steps
  return None, None


def summary(traces: dict[str, Trace], target: float) -> dict[str, Any]:
  rows = {}
  for name, trace in traces.items():
    items, steps = first_reaching(trace, target)
    rows[name] = {
      "final_held_out_loss": trace.held_out_loss[-1],
      "optimizer_steps": trace.steps[-1],
      "final_k": trace.k[-1],
      "micro_batches_to_target": items,
      "steps_to_target": steps,
    }
  return rows


def plot(traces: dict[str, Trace], tokens_per_micro_batch: float, path: Path):
  figure = Figure(figsize=(13, 3.8), layout="constrained")
  by_items, by_steps, loop = figure.subplots(1, 3)
  for name, trace in traces.items():
    by_items.plot(trace.items, trace.held_out_loss, label=name)
    by_steps.plot(trace.steps, trace.held_out_loss, label=name)
  by_items.set(xlabel="micro-batches seen", ylabel="held-out loss")
  by_steps.set(xlabel="optimizer steps", xscale="log")
  by_items.legend()
  adaptive = traces["adaptive k"]
  loop.step(adaptive.items, adaptive.k, where="post", label="k")
  loop.set(xlabel="micro-batches seen", ylabel="k (micro-batches per window)")
  measured = loop.twinx()
  measured.plot(
    adaptive.items,
    np.asarray(adaptive.b_simple) / tokens_per_micro_batch,
    color="tab:red",
    label="B_simple / tokens per micro-batch",
  )
  measured.set(ylabel="B_simple, in micro-batches", yscale="log")
  measured.legend(loc="lower right")
  loop.set_title("the adaptive run")
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path, dpi=110)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_preset_options(
    parser,
    PRESETS,
    {
      "micro_batches": "micro-batches in the budget of every run",
      "micro_batch_size": "sequences per micro-batch",
      **MODEL_SIZES,
      "eval_every": "micro-batches between held-out evaluations",
    },
    cpu_time="about a minute",
  )
  parser.add_argument("--small-k", type=int, default=2)
  parser.add_argument("--large-k", type=int, default=16)
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
  parser.add_argument("--no-progress", dest="progress", action="store_false")
  args = parser.parse_args(argv)
  fill_from_preset(args, PRESETS)
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  rng = np.random.default_rng(args.seed)
  sequences = text_sequences(list(topics.values()), args.max_len)
  order = rng.permutation(len(sequences))
  held_out = sequences[order[:HELD_OUT_SEQUENCES]]
  train_rows = order[HELD_OUT_SEQUENCES:]
  needed = args.micro_batches * args.micro_batch_size
  rows = np.concatenate(
    [rng.permutation(train_rows) for _ in range(-(-needed // len(train_rows)))]
  )[:needed]
  micro_batches = np.split(sequences[rows], args.micro_batches)
  tokens_per_micro_batch = float(
    np.mean([int(count_real_tokens(batch)) for batch in micro_batches])
  )
  graphdef, initial_params = split_model(args, args.max_len + 1)
  loss = make_loss(graphdef)
  traces = {
    name: train(tx, initial_params, loss, micro_batches, held_out, args, name)
    for name, tx in make_runs(args).items()
  }
  # The bar: the loss the fixed large k ends at.
  target = traces[f"fixed k = {args.large_k}"].held_out_loss[-1]
  rows = summary(traces, target)
  print(
    f"{args.micro_batches} micro-batches of {args.micro_batch_size} sequences"
    f" ({tokens_per_micro_batch:.0f} real tokens each on average); target"
    f" held-out loss {target:.4f}"
  )
  print(
    f"{'run':<18} {'final loss':>10} {'steps':>6} {'final k':>8}"
    f" {'micro-batches to target':>24} {'steps to target':>16}"
  )
  for name, row in rows.items():
    print(
      f"{name:<18} {row['final_held_out_loss']:>10.4f}"
      f" {row['optimizer_steps']:>6} {row['final_k']:>8}"
      f" {row['micro_batches_to_target']!s:>24}"
      f" {row['steps_to_target']!s:>16}"
    )
  plot(traces, tokens_per_micro_batch, args.output_dir / "batch_size_loop.png")
  record = {
    "preset": args.preset,
    "backend": jax.default_backend(),
    "target_held_out_loss": target,
    "runs": rows,
    "traces": {name: trace._asdict() for name, trace in traces.items()},
  }
  (args.output_dir / "batch_size_loop.json").write_text(json.dumps(record))
  return record


if __name__ == "__main__":
  main()
