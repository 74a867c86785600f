"""The tests' models, data, large-batch reference and comparisons.

Written once here, so that every test that speaks of the same model, the
same windows or the same reference means the same thing:

- Token windows: a normalised two-layer model, windows of unequal weight
  and their token-weighted losses (the multi-device tests' case).
- The large-batch reference those windows must equal, computed without
  ga_optax.
- A small linear model, its batch and a one-device mesh.
- The Flax cases: the data, optimizer and batching that the Flax Linen and
  NNX tests share.
- Comparisons: finite and close within float32 rounding, and a run's state
  without what no number of the run depends on.
- The environment of a test's fresh JAX process on simulated CPU devices.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import ga_optax

# --- Token windows -----------------------------------------------------------
#
# Every micro-batch holds padded rows (mask 0) beside real ones, in numbers
# that differ from device to device, from micro-step to micro-step and from
# window to window, and one window is shorter than k and closed by a flush.
# So the windows carry unequal total weight, and an accumulation that divides
# by the wrong number, forgets a device's weight or sums where it should
# average ends somewhere else than the large-batch reference.

IN, HIDDEN, OUT = 16, 64, 4
# Plain SGD: the update is the gradient times a constant, so the gradient's
# scale is the update's. Large enough to move every parameter far more than
# the tolerance in one window.
SGD = optax.sgd(0.3)
# Each window has its own density of real rows, so the totals differ.
DENSITIES = (0.9, 0.35, 0.6, 0.75)

Batch = dict[str, np.ndarray]


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
  """A layer with a bias and a normalisation scale: the hard cases."""
  keys = jax.random.split(jax.random.key(seed), 2)
  return jax.device_get(
    {
      "w": jax.random.normal(keys[0], (IN, HIDDEN)) / 4,
      "b": jnp.full((HIDDEN,), 0.1, jnp.float32),
      "scale": jnp.ones((HIDDEN,)),
      "w2": jax.random.normal(keys[1], (HIDDEN, OUT)) / 8,
    }
  )


def forward(params: Any, x: jax.Array) -> jax.Array:
  h = x @ params["w"] + params["b"]
  mean = h.mean(-1, keepdims=True)
  variance = ((h - mean) ** 2).mean(-1, keepdims=True)
  h = (h - mean) * jax.lax.rsqrt(variance + 1e-5) * params["scale"]
  return jnp.tanh(h) @ params["w2"]


def token_sum_loss(params: Any, batch: Any) -> jax.Array:
  """The squared error summed over the batch's real rows."""
  errors = jnp.mean((forward(params, batch["x"]) - batch["y"]) ** 2, axis=-1)
  return jnp.sum(errors * batch["mask"])


def tokens(batch: Any) -> jax.Array:
  """How many real rows the batch holds: its weight."""
  return jnp.sum(batch["mask"])


def token_mean_loss(params: Any, batch: Any) -> jax.Array:
  """The mean error over the real rows; 0 (not 0 / 0) when there are none."""
  return token_sum_loss(params, batch) / jnp.maximum(tokens(batch), 1.0)


def make_windows(
  lengths: Sequence[int],
  devices: int,
  rows_per_device: int,
  seed: int = 0,
) -> list[list[Batch]]:
  """Windows of ``lengths[i]`` micro-batches of ``devices * rows`` rows each.

  On several devices the first device's rows of the first micro-batch are
  all padding (its weight is 0 there); every micro-batch holds at least one
  real row.
  """
  rng = np.random.default_rng(seed)
  rows = devices * rows_per_device
  windows = []
  for index, length in enumerate(lengths):
    window = []
    for _ in range(length):
      mask = rng.random(rows) < DENSITIES[index % len(DENSITIES)]
      mask[-1] = True
      window.append(
        {
          "x": rng.standard_normal((rows, IN), np.float32),
          "y": rng.standard_normal((rows, OUT), np.float32),
          "mask": mask.astype(np.float32),
        }
      )
    windows.append(window)
  if devices > 1:
    windows[0][0]["mask"][:rows_per_device] = 0.0
  totals = [sum(float(batch["mask"].sum()) for batch in w) for w in windows]
  assert len(set(totals)) == len(totals), f"equal window weights: {totals}"
  return windows


def micro_steps(
  windows: Sequence[Sequence[Batch]], every_k: int
) -> Iterator[tuple[Batch, bool]]:
  """Each micro-batch and its ``flush``: true where a short window ends."""
  for window in windows:
    assert len(window) <= every_k, (len(window), every_k)
    for index, batch in enumerate(window):
      yield batch, len(window) < every_k and index == len(window) - 1


def whole(window: Sequence[Batch]) -> Batch:
  """The window's micro-batches as one batch."""
  return {
    name: np.concatenate([batch[name] for batch in window])
    for name in window[0]
  }


# --- The large-batch reference -----------------------------------------------
#
# It never runs ga_optax: per window, ``jax.grad`` of the token mean loss over
# all the window's rows, then one step of the bare optimizer. With plain
# ``optax.sgd`` it is linear in the gradient, so a wrong scale shows in every
# parameter.

_window_grad = jax.jit(jax.grad(token_mean_loss))


def large_batch_reference(
  optimizer: optax.GradientTransformation,
  params: Any,
  windows: Sequence[Sequence[Batch]],
) -> Any:
  """One device: per window, the gradient of its token mean, one update."""
  params = jax.device_get(params)
  state = optimizer.init(params)
  for window in windows:
    grads = _window_grad(params, whole(window))
    updates, state = optimizer.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return jax.device_get(params)


# --- A small linear model ----------------------------------------------------
#
# Two outputs from three inputs, a batch of LINEAR_ROWS rows, parameters and
# rows drawn from fixed seeds.

LINEAR_ROWS = 16


def standard_normal(shape: tuple[int, ...], seed: int) -> jax.Array:
  """Standard normal values of ``shape`` from ``seed``."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def linear_loss(params: Any, batch: Any) -> jax.Array:
  """The mean squared error of the linear model on ``batch``."""
  prediction = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((prediction - batch["y"]) ** 2)


def linear_params() -> dict[str, jax.Array]:
  return {"w": standard_normal((3, 2), seed=0), "b": standard_normal((2,), 1)}


def linear_batch(seed: int = 2) -> dict[str, jax.Array]:
  return {
    "x": standard_normal((LINEAR_ROWS, 3), seed),
    "y": standard_normal((LINEAR_ROWS, 2), seed + 1),
  }


def one_device_mesh() -> jax.sharding.Mesh:
  """A mesh of this machine's first device, over axis ``"data"``."""
  return jax.make_mesh((1,), ("data",))


def put(tree: Any, mesh: jax.sharding.Mesh, spec: PartitionSpec) -> Any:
  """``tree`` laid out on ``mesh`` as ``spec`` says.

  jax.make_mesh makes Explicit axes: shard_map's inputs must already be laid
  out as its in_specs say.
  """
  return jax.device_put(tree, NamedSharding(mesh, spec))


# --- The Flax cases ----------------------------------------------------------
#
# The Flax Linen and NNX tests train the same kinds of model on the same data,
# split the same way into windows and micro-batches, so their results are
# comparable.

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


def flax_optimizer() -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


def flax_windows(data: Any) -> list[Any]:
  """``data`` in NUM_WINDOWS windows of BATCH_SIZE rows."""
  return [
    jax.tree.map(lambda x, w=w: x[w * BATCH_SIZE : (w + 1) * BATCH_SIZE], data)
    for w in range(NUM_WINDOWS)
  ]


def flax_microbatches(batch: Any) -> list[Any]:
  """A window in MICRO_BATCHES micro-batches of MICRO_BATCH_SIZE rows."""
  return [
    jax.tree.map(
      lambda x, i=i: x[i * MICRO_BATCH_SIZE : (i + 1) * MICRO_BATCH_SIZE],
      batch,
    )
    for i in range(MICRO_BATCHES)
  ]


# --- Comparisons -------------------------------------------------------------


def assert_finite_and_close(
  actual: Any,
  expected: Any,
  *,
  rtol: float = 2e-5,
  atol: float = 2e-6,
  same_shapes_and_dtypes: bool = False,
) -> None:
  """Equal trees of finite values within float32 rounding.

  The default tolerance is the token windows': their float32 sums over
  devices and micro-steps add in another order than one sum over the
  window's rows. ``same_shapes_and_dtypes`` also holds every leaf to its
  expected shape and dtype (off by default: some expected values are
  Python floats). chex compares NaN equal to NaN; finiteness is asserted
  first so that two NaN results never pass as equal.
  """
  actual, expected = jax.device_get((actual, expected))
  if same_shapes_and_dtypes:
    chex.assert_trees_all_equal_shapes_and_dtypes(actual, expected)
  chex.assert_tree_all_finite(actual)
  chex.assert_tree_all_finite(expected)
  chex.assert_trees_all_close(actual, expected, rtol=rtol, atol=atol)


def assert_strictly_close(actual: Any, expected: Any) -> None:
  """:func:`assert_finite_and_close`, leaf shapes and dtypes equal, tighter.

  The comparison of the small linear model and its one-device sums, which
  add in nearly the order of their references.
  """
  assert_finite_and_close(
    actual, expected, rtol=1e-5, atol=1e-6, same_shapes_and_dtypes=True
  )


def without_stale_accumulator(tree: Any) -> Any:
  """``tree`` with the accumulator of every closed window zeroed.

  Between windows the accumulator's buffer holds whatever the closing call
  left there (its updates, say), and the next window's first micro-step
  clears it: no number of a run depends on it, and two runs that agree may
  leave different things there.
  """

  def clear(node: Any) -> Any:
    if isinstance(node, ga_optax.AccumulateState) and int(node.micro_step) == 0:
      return node._replace(accumulator=optax.tree.zeros_like(node.accumulator))
    return node

  return jax.tree.map(
    clear, tree, is_leaf=lambda node: isinstance(node, ga_optax.AccumulateState)
  )


# --- Fresh processes ---------------------------------------------------------


def cpu_process_environment(
  devices: int, *path: str | os.PathLike[str]
) -> dict[str, str]:
  """This process's environment, for a fresh JAX process on the CPU.

  The device count is fixed when JAX starts its backend: a test that needs
  a process of its own (another device count, or a fresh start) gives it
  ``devices`` simulated CPU devices and ``path`` first on its module path.
  """
  env = dict(os.environ)
  if devices > 1:
    env["XLA_FLAGS"] = " ".join(
      filter(
        None,
        [
          env.get("XLA_FLAGS", ""),
          f"--xla_force_host_platform_device_count={devices}",
        ],
      )
    )
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(
    filter(None, [*map(str, path), env.get("PYTHONPATH", "")])
  )
  return env
