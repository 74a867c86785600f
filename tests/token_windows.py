"""Windows of unequal weight, and the one-device large batch they must equal.

Shared by the multi-device tests. Every micro-batch holds padded rows (mask
0) beside real ones, in numbers that differ from device to device, from
micro-step to micro-step and from window to window, and one window is shorter
than k and closed by a flush. So the windows carry unequal total weight, and
an accumulation that divides by the wrong number, forgets a device's weight
or sums where it should average ends somewhere else than the reference.

The reference never runs ga_optax: per window, ``jax.grad`` of the token
mean loss over all the window's rows, then one step of the bare optimizer.
With plain ``optax.sgd`` it is linear in the gradient, so a wrong scale
shows in every parameter.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

IN, HIDDEN, OUT = 16, 64, 4
# Float32 sums over devices and micro-steps add in another order than one
# sum over the window's rows.
TOLERANCE = {"rtol": 2e-5, "atol": 2e-6}
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


def assert_finite_and_close(actual: Any, expected: Any, **tolerance) -> None:
  """Equal within float32 rounding; NaN anywhere fails (chex says NaN == NaN)."""
  actual, expected = jax.device_get((actual, expected))
  chex.assert_tree_all_finite(actual)
  chex.assert_tree_all_finite(expected)
  chex.assert_trees_all_close(actual, expected, **(tolerance or TOLERANCE))
