"""The byte-level Transformer LM of the LM examples, and the text it trains on.

The text is the interpreter's own help texts, ``pydoc_data.topics``, which
ships with every Python installation. :func:`text_sequences` cuts each text
into paragraphs at blank lines, and each paragraph at sentence ends into
sequences of at most ``max_len`` bytes, padded to a common width; the tokens
are the UTF-8 bytes between BOS and EOS. :class:`TransformerLM` is a small
Flax NNX decoder-only Transformer over those tokens, and :func:`make_loss`
its token-mean next-token loss, padding excluded.

Also here: the command-line presets the LM examples build their options
from (:func:`add_preset_options`, :func:`fill_from_preset`), the split of
the model into graph and params (:func:`split_model`), the training batches
and held-out sequences (:func:`load_text`) and the relative distance between
two sets of params (:func:`relative_distance`).

``examples/lm_token_weighting.py``, ``examples/batch_size_loop.py`` and
``examples/bf16_recipe.py`` import from it; it runs nothing of its own.
"""

from __future__ import annotations

import argparse
import platform
import re
from collections.abc import Callable, Sequence
from pydoc_data.topics import topics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 3
VOCAB_SIZE = NUM_SPECIAL + 256

PARAGRAPH_BREAK = re.compile(rb"\n[ \t]*\n\s*")
SENTENCE_END = re.compile(rb"[.!?]\s+")
WHITESPACE = re.compile(rb"\s")

# The model's sizes, each an option: what it counts.
MODEL_SIZES = {
  "max_len": "most bytes of text per sequence",
  "dim": "model width",
  "num_heads": "attention heads",
  "num_layers": "Transformer blocks",
}

HELD_OUT_SEQUENCES = 256


def cut_paragraph(paragraph: bytes, max_len: int) -> list[bytes]:
  """Cuts a paragraph into pieces of at most ``max_len`` bytes.

  Each piece ends at the last sentence end that fits; where none fits, at
  the last whitespace that does, and where there is none, at ``max_len``.
  Whitespace around the pieces is dropped.
  """
  sentence_ends = [match.end() for match in SENTENCE_END.finditer(paragraph)]
  pieces = []
  start = 0
  while start < len(paragraph):
    limit = start + max_len
    if limit >= len(paragraph):
      stop = len(paragraph)
    elif fitting := [end for end in sentence_ends if start < end <= limit]:
      stop = fitting[-1]
    elif spaces := list(WHITESPACE.finditer(paragraph, start, limit)):
      stop = spaces[-1].end()
    else:
      stop = limit
    if piece := paragraph[start:stop].strip():
      pieces.append(piece)
    start = stop
  return pieces


def text_sequences(texts: Sequence[str], max_len: int) -> np.ndarray:
  """The texts as padded byte sequences, int32 of shape (count, max_len + 2).

  Each row is ``BOS, bytes..., EOS, PAD, ...``, a byte ``b`` being token
  ``NUM_SPECIAL + b``; rows never cross a paragraph break.
  """
  pieces = [
    piece
    for text in texts
    for paragraph in PARAGRAPH_BREAK.split(text.encode("utf-8"))
    for piece in cut_paragraph(paragraph.strip(), max_len)
  ]
  tokens = np.full((len(pieces), max_len + 2), PAD, dtype=np.int32)
  tokens[:, 0] = BOS
  for row, piece in zip(tokens, pieces, strict=True):
    row[1 : len(piece) + 1] = NUM_SPECIAL + np.frombuffer(piece, np.uint8)
    row[len(piece) + 1] = EOS
  return tokens


def count_real_tokens(tokens: jax.Array) -> jax.Array:
  """The number of predicted tokens that are not padding."""
  return jnp.sum(tokens[:, 1:] != PAD)


class Block(nnx.Module):
  """A pre-norm Transformer block: causal self-attention, then an MLP."""

  def __init__(self, dim: int, num_heads: int, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
      num_heads=num_heads,
      in_features=dim,
      decode=False,
      keep_rngs=False,
      # A key bias shifts all attention logits of a query equally, so its
      # gradient is zero in exact arithmetic; Adam would turn its rounding
      # noise into full-size steps that differ from run to run.
      use_bias=False,
      rngs=rngs,
    )
    self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attention(self.attention_norm(x), mask=mask)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class TransformerLM(nnx.Module):
  """A small decoder-only Transformer with learned positions."""

  def __init__(
    self,
    *,
    max_len: int,
    dim: int,
    num_heads: int,
    num_layers: int,
    rngs: nnx.Rngs,
  ):
    self.token_embedding = nnx.Embed(VOCAB_SIZE, dim, rngs=rngs)
    self.position_embedding = nnx.Embed(max_len, dim, rngs=rngs)
    self.blocks = nnx.List(
      [Block(dim, num_heads, rngs) for _ in range(num_layers)]
    )
    self.final_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, VOCAB_SIZE, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    positions = jnp.arange(tokens.shape[-1])
    x = self.token_embedding(tokens) + self.position_embedding(positions)
    # Padding only follows real tokens, so the causal mask already keeps
    # every real position from seeing padding.
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.final_norm(x))


def make_loss(graphdef: nnx.GraphDef) -> Callable[..., jax.Array]:
  """The token-mean next-token loss of a batch, as a function of params."""

  def token_mean_loss(params: nnx.State, tokens: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, params)
    # The loss in float32 whatever the model computes in (a no-op for a
    # float32 model): a bfloat16 log-softmax over the vocabulary would round
    # each token's loss to 8 bits.
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    targets = tokens[:, 1:]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    real = targets != PAD
    return jnp.sum(losses * real) / jnp.sum(real)

  return token_mean_loss


@jax.jit
def relative_distance(params: Any, reference: Any) -> jax.Array:
  """``||params - reference|| / ||reference||`` over all leaves."""
  return optax.tree.norm(optax.tree.sub(params, reference)) / optax.tree.norm(
    reference
  )


def add_preset_options(
  parser: argparse.ArgumentParser,
  presets: dict[str, dict[str, int]],
  sizes: dict[str, str],
  cpu_time: str,
) -> None:
  """``--preset``, and an option for each size it sets (``sizes``: the
  size's key and what it counts), left None to take the preset's value
  (:func:`fill_from_preset`)."""
  parser.add_argument(
    "--preset",
    choices=tuple(presets),
    default="cpu",
    help=f"the sizes below: {cpu_time} on a CPU (default), or a longer"
    " run of a larger model for a GPU; an option given overrides its preset",
  )
  for key, what in sizes.items():
    cpu, gpu = presets["cpu"][key], presets["gpu"][key]
    parser.add_argument(
      f"--{key.replace('_', '-')}",
      type=int,
      help=f"{what} (cpu preset: {cpu}, gpu preset: {gpu})",
    )


def fill_from_preset(
  args: argparse.Namespace, presets: dict[str, dict[str, int]]
) -> None:
  """Each size not given on the command line, from the chosen preset."""
  for key, value in presets[args.preset].items():
    if getattr(args, key) is None:
      setattr(args, key, value)


def split_model(
  args: argparse.Namespace, max_len: int
) -> tuple[nnx.GraphDef, nnx.State]:
  """The model of ``args``' sizes, seeded by ``--seed``, split into its graph
  and its initial params."""
  model = TransformerLM(
    max_len=max_len,
    dim=args.dim,
    num_heads=args.num_heads,
    num_layers=args.num_layers,
    rngs=nnx.Rngs(args.seed),
  )
  return nnx.split(model)


def load_text(
  args: argparse.Namespace, rng: np.random.Generator
) -> tuple[list[np.ndarray], np.ndarray]:
  """The training batches, in order, and the held-out sequences."""
  sequences = text_sequences(list(topics.values()), args.max_len)
  order = rng.permutation(len(sequences))
  held_out = sequences[order[:HELD_OUT_SEQUENCES]]
  train = sequences[order[HELD_OUT_SEQUENCES:]]
  needed = args.steps * args.batch_size
  # Each epoch visits the training sequences in a new order.
  epochs = -(-needed // len(train))
  rows = np.concatenate([rng.permutation(len(train)) for _ in range(epochs)])
  lengths = (sequences[:, 1:] != PAD).sum(axis=1) - 1
  print(
    f"text: Python {platform.python_version()}'s"
    f" pydoc_data.topics, {len(topics)} help texts ->"
    f" {len(sequences)} sequences of {lengths.min()} to {lengths.max()}"
    f" bytes (mean {lengths.mean():.0f}); {len(train)} to train on"
    f" ({needed / len(train):.1f} epochs), {len(held_out)} held out"
  )
  return np.split(train[rows[:needed]], args.steps), held_out
