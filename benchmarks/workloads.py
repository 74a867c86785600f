"""The benchmark workloads: a memory-bound MLP and a small Transformer LM.

Each workload is a loss ``loss_fn(params, batch)`` (the mean over the
batch), initial params and ``k`` micro-batches, all from fixed seeds so that
every run measures the same arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Workload:
  """A loss, its params and the micro-batches of one window.

  Attributes:
    name: short name used in tables and JSON.
    description: one line for the tables.
    loss_fn: ``(params, batch) -> scalar``, the mean loss over the batch.
    params: initial params.
    microbatches: ``every_k`` micro-batches (pytrees with a leading batch
      axis), in window order.
    every_k: micro-steps per window.
    config: the sizes, for the JSON record.
  """

  name: str
  description: str
  loss_fn: Callable[[Any, Any], jax.Array]
  params: Any
  microbatches: list[Any]
  every_k: int
  config: dict[str, Any]

  @property
  def window_batch(self) -> Any:
    """The window's micro-batches concatenated along the batch axis."""
    return jax.tree.map(
      lambda *leaves: jnp.concatenate(leaves), *self.microbatches
    )

  @property
  def num_params(self) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(self.params))


# (width, depth) of the MLPs a window is timed on as the model grows: 0.13M,
# 4.2M, 16.8M and 134M float32 parameters.
MLP_SIZES = ((256, 2), (1024, 4), (2048, 4), (4096, 8))


def mlp(width: int, depth: int, microbatch: int, every_k: int) -> Workload:
  """The reference: ``depth`` square tanh layers, no biases, squared error.

  With width 2048 and depth 4 it holds 16.8M float32 parameters and a
  micro-batch of 8 does little arithmetic per byte: memory-bound.
  """
  key = jax.random.PRNGKey(0)
  keys = jax.random.split(key, depth + 2 * every_k)
  params = [
    jax.random.normal(keys[i], (width, width), jnp.float32) / math.sqrt(width)
    for i in range(depth)
  ]

  def loss_fn(params: list[jax.Array], batch: dict[str, jax.Array]):
    hidden = batch["x"]
    for weight in params:
      hidden = jnp.tanh(hidden @ weight)
    return jnp.mean(jnp.sum((hidden - batch["y"]) ** 2, axis=-1))

  microbatches = [
    {
      "x": jax.random.normal(keys[depth + 2 * i], (microbatch, width)),
      "y": jax.random.normal(keys[depth + 2 * i + 1], (microbatch, width)),
    }
    for i in range(every_k)
  ]
  return Workload(
    name="mlp",
    description=(
      f"MLP {depth}x{width}x{width}, micro-batch {microbatch}, Adam,"
      f" k={every_k} (memory-bound)"
    ),
    loss_fn=loss_fn,
    params=params,
    microbatches=microbatches,
    every_k=every_k,
    config={
      "width": width,
      "depth": depth,
      "microbatch": microbatch,
      "every_k": every_k,
    },
  )


def _layer_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  mean = jnp.mean(x, axis=-1, keepdims=True)
  variance = jnp.var(x, axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(variance + 1e-5) * scale


def transformer(
  vocab: int,
  width: int,
  depth: int,
  heads: int,
  sequence: int,
  microbatch: int,
  every_k: int,
) -> Workload:
  """A pre-norm decoder-only LM with tied embeddings, next-token loss."""
  key = jax.random.PRNGKey(1)
  keys = iter(jax.random.split(key, 4 + 4 * depth + every_k))

  def dense(shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(next(keys), shape) / math.sqrt(shape[0])

  params = {
    "embed": jax.random.normal(next(keys), (vocab, width)) * 0.02,
    "position": jax.random.normal(next(keys), (sequence, width)) * 0.02,
    "final_norm": jnp.ones((width,)),
    "blocks": [
      {
        "attention_norm": jnp.ones((width,)),
        "qkv": dense((width, 3 * width)),
        "out": dense((width, width)),
        "mlp_norm": jnp.ones((width,)),
        "up": dense((width, 4 * width)),
        "down": dense((4 * width, width)),
      }
      for _ in range(depth)
    ],
  }
  causal = jnp.tril(jnp.ones((sequence, sequence), jnp.bool_))

  def block(x: jax.Array, block_params: dict[str, jax.Array]) -> jax.Array:
    batch, length, _ = x.shape
    qkv = _layer_norm(x, block_params["attention_norm"]) @ block_params["qkv"]
    qkv = qkv.reshape(batch, length, 3, heads, width // heads)
    query, key_, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key_)
    logits = logits / math.sqrt(width // heads)
    logits = jnp.where(causal[:length, :length], logits, -1e9)
    attention = jax.nn.softmax(logits, axis=-1)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", attention, value)
    x = x + mixed.reshape(batch, length, width) @ block_params["out"]
    hidden = _layer_norm(x, block_params["mlp_norm"]) @ block_params["up"]
    return x + jax.nn.gelu(hidden) @ block_params["down"]

  def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]):
    tokens = batch["tokens"]
    x = params["embed"][tokens[:, :-1]] + params["position"][: sequence - 1]
    for block_params in params["blocks"]:
      x = block(x, block_params)
    logits = _layer_norm(x, params["final_norm"]) @ params["embed"].T
    log_probs = jax.nn.log_softmax(logits)
    targets = tokens[:, 1:]
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)
    return -jnp.mean(picked)

  microbatches = [
    {
      "tokens": jax.random.randint(
        next(keys), (microbatch, sequence), 0, vocab, jnp.int32
      )
    }
    for _ in range(every_k)
  ]
  return Workload(
    name="transformer",
    description=(
      f"Transformer LM {depth} layers, width {width}, {heads} heads,"
      f" sequence {sequence}, vocab {vocab}, micro-batch {microbatch}, Adam,"
      f" k={every_k} (compute-bound)"
    ),
    loss_fn=loss_fn,
    params=params,
    microbatches=microbatches,
    every_k=every_k,
    config={
      "vocab": vocab,
      "width": width,
      "depth": depth,
      "heads": heads,
      "sequence": sequence,
      "microbatch": microbatch,
      "every_k": every_k,
    },
  )


def reference_workloads(quick: bool) -> list[Workload]:
  """The two workloads; ``quick`` shrinks them for a smoke run."""
  if quick:
    return [
      mlp(width=512, depth=4, microbatch=8, every_k=4),
      transformer(
        vocab=128,
        width=64,
        depth=2,
        heads=4,
        sequence=32,
        microbatch=4,
        every_k=4,
      ),
    ]
  return [
    mlp(width=2048, depth=4, microbatch=8, every_k=4),
    transformer(
      vocab=256,
      width=128,
      depth=2,
      heads=4,
      sequence=64,
      microbatch=8,
      every_k=4,
    ),
  ]
