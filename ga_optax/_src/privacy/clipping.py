"""Per-example clipping: a batch's sum of gradients, each of norm <= C.

The sensitivity of a window's sum to one example is C only if every
example's whole gradient is scaled to norm at most C. The norm is taken in
float32 whatever the params' dtype: a float16 sum of squares overflows to
inf past about 256 per coordinate, and ``C / inf`` would let the gradient
through at factor 0, or a NaN through at none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ga_optax._src.placements import axes as axes_lib


def clipped_grad_sum(
  loss_fn: Callable[[optax.Params, Any], jax.Array], l2_clip_norm: float
) -> Callable[..., tuple[jax.Array, optax.Updates]]:
  """``f(params, batch, mask=None) -> (mean loss, sum of clipped gradients)``.

  Each example's gradient ``g`` of ``loss_fn(params, example)`` (vmapped
  over the leading axis of every leaf of ``batch``) is scaled by
  ``min(1, l2_clip_norm / ||g||)``, its global norm computed in float32,
  then multiplied by its ``mask`` value (1 for a real example, 0 for
  padding; a public weight in [0, 1] otherwise) and summed. A padding
  example contributes exactly zero, even where its loss is not finite.

  Args:
    loss_fn: ``loss_fn(params, example) -> scalar``, the loss of one
      example (its leaves without the batch axis).
    l2_clip_norm: C > 0.

  Inside a ``jax.shard_map``, each device clips its own examples and
  returns their sum: a per-device partial sum, which
  :func:`ga_optax.privacy.accumulate` (``axis_name=``, in a ``shard_map``
  with ``check_vma=False``) reduces once per window.

  Returns:
    ``f(params, batch, mask=None)``: the masked mean of the examples' losses
    (0 for an all-padding batch) and the clipped sum, shaped and typed like
    ``params``.

  Raises:
    ValueError: ``l2_clip_norm`` is not a finite number > 0.

  Example:
    >>> import jax.numpy as jnp, ga_optax
    >>> loss = lambda w, x: jnp.sum(w * x)
    >>> f = ga_optax.privacy.clipped_grad_sum(loss, 1.0)
    >>> _, total = f(jnp.zeros(2), jnp.array([[3.0, 4.0], [0.3, 0.4]]))
    >>> total
    Array([0.90000004, 1.2       ], dtype=float32)
  """
  clip = float(l2_clip_norm)
  if not clip > 0 or not jnp.isfinite(clip):
    raise ValueError(
      f"l2_clip_norm must be a finite number > 0, got {l2_clip_norm!r}."
    )
  clipped = functools.partial(
    _clipped_example, jax.value_and_grad(loss_fn), clip
  )

  def batch_fn(
    params: optax.Params, batch: Any, mask: Any = None
  ) -> tuple[jax.Array, optax.Updates]:
    weights = _example_weights(batch, mask)
    # Inside a shard_map that tracks variance, autodiff would sum the
    # gradient of a parameter that does not vary over the devices' axes
    # across the devices, and each example would be clipped as that sum.
    # As varying, each device clips its own examples and keeps their sum.
    varying = set().union(
      *(axes_lib.varying_axes(leaf) for leaf in jax.tree.leaves(batch))
    )
    if varying:
      params = axes_lib.cast_to_varying(params, tuple(sorted(varying)))
    losses, contributions = jax.vmap(clipped, in_axes=(None, 0, 0))(
      params, batch, weights
    )
    total = jax.tree.map(
      lambda summed, param: jnp.sum(summed, axis=0).astype(
        jnp.result_type(param)
      ),
      contributions,
      params,
    )
    count = jnp.sum(weights)
    mean_loss = jnp.sum(weights * losses) / jnp.where(count > 0, count, 1.0)
    return mean_loss, total

  return batch_fn


def _clipped_example(
  value_and_grad: Callable[..., Any],
  clip: float,
  params: Any,
  example: Any,
  weight: jax.Array,
) -> tuple[jax.Array, Any]:
  """One example's loss and gradient, its norm (float32) clipped to ``clip``."""
  loss, grad = value_and_grad(params, example)
  squares = sum(
    jnp.sum(jnp.square(leaf.astype(jnp.float32)))
    for leaf in jax.tree.leaves(grad)
  )
  norm = jnp.sqrt(squares)
  factor = jnp.minimum(1.0, clip / norm)
  keep = weight > 0
  # Selected, not multiplied: a padding example's gradient may be NaN.
  scale = jnp.where(keep, weight * factor, 0.0)
  contribution = jax.tree.map(
    lambda leaf: jnp.where(keep, leaf.astype(jnp.float32) * scale, 0.0),
    grad,
  )
  return jnp.where(keep, loss.astype(jnp.float32), 0.0), contribution


def _example_weights(batch: Any, mask: Any) -> jax.Array:
  """Each example's public weight in [0, 1]: ``mask``, or ones without one."""
  size = jax.tree.leaves(batch)[0].shape[0]
  weights = (
    jnp.ones((size,), jnp.float32)
    if mask is None
    else jnp.asarray(mask).astype(jnp.float32)
  )
  if not isinstance(weights, jax.core.Tracer) and not bool(
    jnp.all((weights >= 0) & (weights <= 1))
  ):
    raise ValueError(
      "mask must hold public weights in [0, 1] (1 an example, 0 padding):"
      " a larger weight would raise an example's contribution past"
      " l2_clip_norm."
    )
  if weights.shape != (size,):
    raise ValueError(
      f"mask must have shape ({size},), one value per example, got"
      f" {weights.shape}."
    )
  return weights
