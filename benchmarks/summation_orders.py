"""The demo's large batch, twice, in two summation orders: what rounding does.

``examples/classifier.py`` trains one MLP with the large batch and with
``ga_optax.accumulate`` and reports how far apart the parameters end. On
one H100 (2026-11-26) they ended 8.4e-2 of an array's largest value apart,
where the CPU's ended 3.5e-7 apart. A window sums its micro-batches in
another order than the large batch does; Adam divides each step by the
root of the squared gradients, so a gradient that is rounding noise gets a
full-size step, and the trajectories may part.

To tell that apart from a defect this runs the demo's large batch a second
time with the rows of every batch permuted: the same samples, the same
mean, summed in another order. If the two large-batch runs end as far apart
as the large batch and ga_optax do, the distance is rounding amplified by
Adam; if the large-batch runs agree much more closely, it is not.
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import jax
import numpy as np

from ga_optax.testing import max_relative_difference

CLASSIFIER = (
  pathlib.Path(__file__).resolve().parent.parent / "examples" / "classifier.py"
)
# The demo's defaults; the quick run trains on fewer samples for one epoch.
QUICK_ARGS = ["--train-size", "256", "--epochs", "1"]
Record = dict[str, Any]


def load_demo() -> ModuleType:
  """``examples/classifier.py`` as a module of its own (it is a script)."""
  spec = importlib.util.spec_from_file_location(
    "summation_orders_demo", CLASSIFIER
  )
  assert spec is not None and spec.loader is not None
  demo = importlib.util.module_from_spec(spec)
  # Flax builds its modules' dataclasses from their module's namespace.
  sys.modules[spec.name] = demo
  spec.loader.exec_module(demo)
  return demo


@contextlib.contextmanager
def rows_permuted(demo: ModuleType) -> Iterator[None]:
  """Within every batch the demo draws, its rows in another order.

  The batches hold the same samples; only the order in which a batch's
  mean is summed changes. ``demo`` is this module's own copy of the
  example, so nothing else sees the change.
  """
  draw = demo.epoch_batches

  def permuted(num_examples: int, batch_size: int, epoch: int, seed: int):
    rng = np.random.default_rng([seed, epoch, 1])
    return [
      batch[rng.permutation(len(batch))]
      for batch in draw(num_examples, batch_size, epoch, seed)
    ]

  demo.epoch_batches = permuted
  try:
    yield
  finally:
    demo.epoch_batches = draw


def measure(quick: bool) -> Record:
  """The three runs' ends and the distances between their parameters."""
  demo = load_demo()
  args = demo.parse_args([*(QUICK_ARGS if quick else []), "--no-progress"])
  data = demo.load_digits(args.seed)
  if args.train_size is not None:
    data = data._replace(
      x_train=data.x_train[: args.train_size],
      y_train=data.y_train[: args.train_size],
    )
  model = demo.MLP(args.hidden, data.num_classes)
  params = model.init(jax.random.key(args.seed), data.x_train[:1])["params"]
  runs = {}
  # As the demo runs them: float32 products at full precision.
  with jax.default_matmul_precision("highest"):
    runs["large batch"] = demo.train_large_batch(model, params, data, args)
    with rows_permuted(demo):
      runs["large batch, rows permuted"] = demo.train_large_batch(
        model, params, data, args
      )
    runs["ga_optax.accumulate"] = demo.train_ga_optax(model, params, data, args)
  ends = {name: jax.device_get(run.params) for name, run in runs.items()}
  pairs = [
    ("large batch, rows permuted", "large batch"),
    ("ga_optax.accumulate", "large batch"),
    ("ga_optax.accumulate", "large batch, rows permuted"),
  ]
  return {
    "command": " ".join(
      ["python examples/classifier.py", *(QUICK_ARGS if quick else [])]
    ),
    "runs": [
      {
        "run": name,
        "updates": len(run.losses),
        "final_loss": run.losses[-1],
        "test_accuracy": run.test_accuracy,
        "params_finite": all(
          bool(np.isfinite(leaf).all()) for leaf in jax.tree.leaves(ends[name])
        ),
      }
      for name, run in runs.items()
    ],
    "distances": [
      {
        "params of": first,
        "against": second,
        "max_relative_difference": max_relative_difference(
          ends[first], ends[second]
        ),
      }
      for first, second in pairs
    ],
  }
