"""What a private window costs, as XLA:GPU compiles it for an H100.

Compiler figures, not times: a compile-only H100 through JAX's CUDA plugin,
no GPU. One tanh layer with a bias, the gradients clipped per example by
``ga_optax.privacy.clipped_grad_sum``, SGD, k = 4, the host's schedule,
params and state donated. Two windows take the same clipped sums: the
private one (``ga_optax.privacy.accumulate``, one Gaussian draw per close)
and the plain one (``ga_optax.accumulate(..., reduction="sum")``). Each
program is read through ``ga_optax.testing.audit``. Prints a Markdown table
and writes JSON::

  JAX_PLATFORMS=cpu python benchmarks/privacy_bytes.py
  JAX_PLATFORMS=cpu python benchmarks/privacy_bytes.py --width 1024 --json out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import ga_optax
from ga_optax import privacy
from ga_optax.testing import audit

CLIP = 1.0
EVERY_K = 4


def example_loss(params: Any, example: Any) -> jax.Array:
  prediction = jnp.tanh(example["x"] @ params["w"] + params["b"])
  return 0.5 * jnp.sum((prediction - example["y"]) ** 2)


def windows() -> dict[str, optax.GradientTransformationExtraArgs]:
  private = privacy.accumulate(
    optax.sgd(0.1),
    EVERY_K,
    l2_clip_norm=CLIP,
    noise_multiplier=1.1,
    normalize_by=32.0,
    key=jax.random.key(0),
  )
  plain = ga_optax.accumulate(optax.sgd(0.1), EVERY_K, reduction="sum")
  return {"private window": private, "plain window, reduction='sum'": plain}


def measure(width: int, rows: int) -> list[dict[str, Any]]:
  gradients = privacy.clipped_grad_sum(example_loss, CLIP)
  params = {"w": jnp.full((width, width), 0.01), "b": jnp.zeros(width)}
  batch = {"x": jnp.ones((rows, width)), "y": jnp.zeros((rows, width))}
  results = []
  for name, tx in windows().items():

    def step(params, state, batch, mask, *, closing, tx=tx):
      _, clipped_sum = gradients(params, batch, mask)
      updates, state = tx.update(clipped_sum, state, params, closing=closing)
      return optax.apply_updates(params, updates), state

    for closing in (False, True):
      report = audit(
        step,
        params,
        tx.init(params),
        batch,
        jnp.ones(rows),
        target="h100",
        donate_argnums=(0, 1),
        closing=closing,
      )
      (path,) = report.paths
      results.append(
        {
          "window": name,
          "path": path.path,
          "bytes_moved": path.bytes_moved,
          "duplicated_bytes": path.duplicated_bytes,
          "peak_memory": report.peak_memory,
        }
      )
  return results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--json", type=Path, default=None)
  args = parser.parse_args()
  results = measure(args.width, args.rows)
  print(f"H100 program (compile-only), width {args.width}, {args.rows} rows")
  print("| window | path | bytes moved | duplicated bytes | peak bytes |")
  print("|---|---|---:|---:|---:|")
  for row in results:
    print(
      f"| {row['window']} | {row['path']} | {row['bytes_moved']:,}"
      f" | {row['duplicated_bytes']:,} | {row['peak_memory']:,} |"
    )
  if args.json is not None:
    record = {"jax": jax.__version__, "width": args.width, "rows": args.rows}
    args.json.write_text(json.dumps({**record, "results": results}, indent=2))


if __name__ == "__main__":
  main()
