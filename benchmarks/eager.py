"""Cost of un-jitted calls: ga_optax against the plain optax and JAX calls.

Notebooks and debugging loops call ``update`` without ``jit``. Each row
times one eager call of a ga_optax function and one eager call of what it
replaces, on the same small model (a 64 x 64 dense layer and its bias), and
reports their medians and ratio (target: at most 10):

* ``accumulate(adam, k).update`` against ``optax.adam(...).update``;
* ``accumulate_and_apply(adam, k).apply`` against ``optax.adam(...).update``
  followed by ``optax.apply_updates``;
* ``microbatched_value_and_grad(loss, k)`` against
  ``jax.value_and_grad(loss)`` on the same batch.

The calls alternate between the two sides of a row, so a slow spell of the
machine falls on both; every call is timed until its results are ready. The
first call of each side (which compiles) is timed apart and left out of the
medians. Prints a Markdown table and writes JSON::

  python benchmarks/eager.py
  python benchmarks/eager.py --calls 400 --output eager.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

# Runs as a script from any directory: the repository root holds the package
# and the `benchmarks` helpers.
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import ga_optax  # noqa: E402
from benchmarks import environment as environment_lib  # noqa: E402

WIDTH = 64
EVERY_K = 4
BATCH_SIZE = 32
TARGET_RATIO = 10.0


def _model() -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  rng = np.random.default_rng(0)
  params = {
    "w": jnp.asarray(rng.standard_normal((WIDTH, WIDTH)) / 8, jnp.float32),
    "b": jnp.zeros(WIDTH, jnp.float32),
  }
  batch = {
    "x": jnp.asarray(rng.standard_normal((BATCH_SIZE, WIDTH)), jnp.float32),
    "y": jnp.asarray(rng.standard_normal((BATCH_SIZE, WIDTH)), jnp.float32),
  }
  return params, batch


def _loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]):
  prediction = jnp.tanh(batch["x"] @ params["w"] + params["b"])
  return jnp.mean((prediction - batch["y"]) ** 2)


class Side:
  """One side of a row: a call that carries its own state along."""

  def __init__(self, name: str, step: Callable[[Any], Any], carry: Any):
    self.name = name
    self.step = step
    self.carry = carry
    self.first_ms = 0.0
    self.times_ms: list[float] = []

  def call(self) -> float:
    start = time.perf_counter()
    self.carry = jax.block_until_ready(self.step(self.carry))
    return (time.perf_counter() - start) * 1e3


def _rows() -> list[tuple[str, Side, Side]]:
  params, batch = _model()
  grads = jax.grad(_loss)(params, batch)
  adam = optax.adam(1e-3)

  def plain_update(carry):
    _, state = carry
    updates, state = adam.update(grads, state, params)
    return updates, state

  tx = ga_optax.accumulate(adam, EVERY_K)

  def accumulate_update(carry):
    _, state = carry
    updates, state = tx.update(grads, state, params)
    return updates, state

  def plain_update_and_apply(carry):
    current, state = carry
    updates, state = adam.update(grads, state, current)
    return optax.apply_updates(current, updates), state

  fused = ga_optax.accumulate_and_apply(adam, EVERY_K)

  def fused_apply(carry):
    current, state = carry
    return fused.apply(current, grads, state)

  plain_value_and_grad = jax.value_and_grad(_loss)
  microbatched = ga_optax.microbatched_value_and_grad(_loss, EVERY_K)

  return [
    (
      "accumulate(adam).update / optax.adam update",
      Side("ga_optax.accumulate", accumulate_update, (None, tx.init(params))),
      Side("optax.adam", plain_update, (None, adam.init(params))),
    ),
    (
      "accumulate_and_apply(adam).apply / adam update + apply_updates",
      Side(
        "ga_optax.accumulate_and_apply",
        fused_apply,
        (params, fused.init(params)),
      ),
      Side(
        "optax.adam + apply_updates",
        plain_update_and_apply,
        (params, adam.init(params)),
      ),
    ),
    (
      f"microbatched_value_and_grad (k={EVERY_K}) / jax.value_and_grad",
      Side(
        "ga_optax.microbatched_value_and_grad",
        lambda _: microbatched(params, batch),
        None,
      ),
      Side(
        "jax.value_and_grad",
        lambda _: plain_value_and_grad(params, batch),
        None,
      ),
    ),
  ]


def measure(calls: int) -> list[dict[str, Any]]:
  records = []
  for figure, ours, theirs in _rows():
    for side in (ours, theirs):
      side.first_ms = side.call()
    for _ in range(calls):
      for side in (ours, theirs):
        side.times_ms.append(side.call())
    ours_ms = statistics.median(ours.times_ms)
    theirs_ms = statistics.median(theirs.times_ms)
    records.append(
      {
        "figure": figure,
        "ga_optax": ours.name,
        "baseline": theirs.name,
        "ga_optax_median_ms": ours_ms,
        "baseline_median_ms": theirs_ms,
        "ratio": ours_ms / theirs_ms,
        "target": f"<= {TARGET_RATIO}",
        "met": ours_ms / theirs_ms <= TARGET_RATIO,
        "ga_optax_first_call_ms": ours.first_ms,
        "baseline_first_call_ms": theirs.first_ms,
        "ga_optax_ms": ours.times_ms,
        "baseline_ms": theirs.times_ms,
      }
    )
  return records


def _markdown(environment: dict[str, Any], records: list[dict]) -> str:
  device = environment["device"]
  lines = [
    f"Date: {environment['date']} · device: {device['platform']}"
    f" ({device['kind']}) · CPU cores: {environment['machine']['cpu_count']}"
    f" · jax {environment['versions']['jax']}",
    "",
    f"Command: `{environment['command']}`",
    "",
    f"Eager calls on a {WIDTH} x {WIDTH} dense layer with bias, k = {EVERY_K};"
    " medians over alternating calls, first (compiling) calls apart.",
    "",
    "| figure | ga_optax ms | baseline ms | ratio | target | met |"
    " first call ms (ga_optax / baseline) |",
    "|---|---:|---:|---:|---|---|---:|",
  ]
  for record in records:
    met = "yes" if record["met"] else "**no**"
    lines.append(
      f"| {record['figure']} | {record['ga_optax_median_ms']:.3f} |"
      f" {record['baseline_median_ms']:.3f} | {record['ratio']:.2f} |"
      f" {record['target']} | {met} |"
      f" {record['ga_optax_first_call_ms']:.0f} /"
      f" {record['baseline_first_call_ms']:.0f} |"
    )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--calls", type=int, default=200, help="timed calls of each side"
  )
  parser.add_argument(
    "--output",
    type=pathlib.Path,
    default=REPO_ROOT / "benchmarks" / "results" / "eager.json",
    help="where to write the JSON record",
  )
  args = parser.parse_args(argv)
  if args.calls < 1:
    parser.error("--calls must be >= 1")
  command = "python benchmarks/eager.py " + " ".join(
    sys.argv[1:] if argv is None else argv
  )
  environment = environment_lib.environment(command.strip())
  records = measure(args.calls)
  args.output.parent.mkdir(parents=True, exist_ok=True)
  args.output.write_text(
    json.dumps({**environment, "calls": args.calls, "rows": records}, indent=1)
  )
  print(f"JSON written to {args.output}", file=sys.stderr)
  print(_markdown(environment, records))


if __name__ == "__main__":
  main()
