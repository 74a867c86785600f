"""Data, optimizer and batching shared by the Flax Linen and NNX tests.

Both test modules train the same kinds of model on the same data, split the
same way into windows and micro-batches, so their results are comparable.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

NUM_WINDOWS = 3
MICRO_BATCHES = 4
MICRO_BATCH_SIZE = 2
BATCH_SIZE = MICRO_BATCHES * MICRO_BATCH_SIZE
VOCAB = 11
SEQ_LEN = 7


def classification_data(shape: tuple[int, ...], key: int):
  keys = jax.random.split(jax.random.PRNGKey(key), 2)
  size = NUM_WINDOWS * BATCH_SIZE
  return {
    "x": jax.random.normal(keys[0], (size, *shape)),
    "label": jax.random.randint(keys[1], (size,), 0, 3),
  }


def lm_data():
  size = NUM_WINDOWS * BATCH_SIZE
  tokens = jax.random.randint(jax.random.PRNGKey(3), (size, SEQ_LEN), 1, VOCAB)
  # Lengths from 2 to SEQ_LEN: micro-batches hold different token counts.
  lengths = 2 + np.arange(size) * 5 % (SEQ_LEN - 1)
  mask = (np.arange(SEQ_LEN)[None, :] < lengths[:, None]).astype(np.float32)
  return {"tokens": tokens * mask.astype(np.int32), "mask": jnp.asarray(mask)}


def lm_tokens(batch):
  return jnp.sum(batch["mask"][:, 1:])


def samples(batch):
  return jnp.asarray(jax.tree.leaves(batch)[0].shape[0], jnp.float32)


def optimizer() -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


def windows(data: Any) -> list[Any]:
  return [
    jax.tree.map(lambda x, w=w: x[w * BATCH_SIZE : (w + 1) * BATCH_SIZE], data)
    for w in range(NUM_WINDOWS)
  ]


def microbatches(batch: Any) -> list[Any]:
  return [
    jax.tree.map(
      lambda x, i=i: x[i * MICRO_BATCH_SIZE : (i + 1) * MICRO_BATCH_SIZE],
      batch,
    )
    for i in range(MICRO_BATCHES)
  ]
