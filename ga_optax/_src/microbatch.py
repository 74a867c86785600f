"""In-step micro-batching: one ``lax.scan`` over the micro-batches of a batch.

``microbatched_value_and_grad`` turns a loss on a batch into a function that
splits the batch into micro-batches, computes each one's value and gradient
inside a ``lax.scan`` (so only one micro-batch's activations are alive at a
time), and returns their weighted mean. The gradient is carried through the
scan in a floating accumulator; with ``axis_name`` the sums are reduced
across devices once, after the scan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ga_optax._src import distributed, validation

WeightFn = Callable[[Any], Any]


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
  """Reshapes every leaf of ``batch`` from ``(B, ...)`` to ``(k, B // k, ...)``.

  Micro-batch ``i`` holds the contiguous rows ``[i * B // k, (i + 1) * B // k)``.

  Raises:
    ValueError: ``batch`` has no array leaves, a leaf has no leading axis,
      the leaves' leading sizes differ, or they are not divisible by
      ``num_microbatches``.
  """
  leaves_with_paths = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not leaves_with_paths:
    raise ValueError(
      "batch must be a pytree of arrays with a leading batch axis, got one"
      " with no leaves."
    )
  sizes = {}
  for path, leaf in leaves_with_paths:
    shape = jnp.shape(leaf)
    if not shape:
      raise ValueError(
        f"batch leaf {jax.tree_util.keystr(path)} is a scalar; every leaf of"
        " batch needs a leading batch axis to split into micro-batches."
        " Pass per-call constants as extra positional arguments instead."
      )
    sizes[jax.tree_util.keystr(path)] = shape[0]
  if len(set(sizes.values())) > 1:
    raise ValueError(
      "every leaf of batch must have the same leading (batch) size, got"
      f" {sizes}."
    )
  batch_size = next(iter(sizes.values()))
  if batch_size % num_microbatches:
    raise ValueError(
      f"the leading size of batch ({batch_size}) must be divisible by"
      f" num_microbatches ({num_microbatches})."
    )
  return jax.tree.map(
    lambda leaf: jnp.reshape(
      leaf, (num_microbatches, batch_size // num_microbatches, *leaf.shape[1:])
    ),
    batch,
  )


def _scalar_weight(weight: Any, dtype: jnp.dtype) -> jax.Array:
  if jnp.shape(weight) != ():
    raise ValueError(
      "weight_fn must return a scalar per micro-batch (for example its"
      f" number of real tokens), got shape {jnp.shape(weight)}."
    )
  return jnp.asarray(weight, dtype)


def microbatched_value_and_grad(
  fun: Callable[..., Any],
  num_microbatches: int,
  *,
  has_aux: bool = False,
  weight_fn: WeightFn | None = None,
  axis_name: Any = None,
  accumulator_dtype: Any = jnp.float32,
  checkpoint_policy: Callable[..., bool] | None = None,
  remat: bool = False,
) -> Callable[..., Any]:
  """Value and gradient of ``fun`` accumulated over micro-batches in one scan.

  The returned ``g(params, batch, *args, rng=None, **kwargs)`` splits every
  leaf of ``batch`` along its leading axis into ``num_microbatches``
  contiguous micro-batches, evaluates ``jax.value_and_grad(fun)`` on each
  inside one ``lax.scan`` and returns the weighted mean
  ``sum(w_i v_i) / sum(w_i)`` of values and gradients, with
  ``w_i = weight_fn(microbatch_i)`` (1 by default). When ``fun`` is the mean
  loss of its batch (normalised by its own item count) and ``w_i`` counts the
  items, this equals ``jax.value_and_grad(fun)(params, batch)``. Micro-batches
  of weight 0 (for example padding only) are dropped whole, so a loss of
  ``0 / 0`` there does not poison the result.

  ``args`` and ``kwargs`` are passed unchanged to every call of ``fun``. When
  ``rng`` is given, ``fun`` receives ``rng=jax.random.fold_in(rng, i)`` for
  micro-batch ``i`` (with ``axis_name``, ``rng`` is first folded with the
  device's ``axis_index``): each micro-batch draws its own dropout masks, and
  the result depends only on ``rng``.

  Args:
    fun: ``fun(params, microbatch, *args, **kwargs)`` returning a scalar loss,
      or ``(loss, aux)`` with ``has_aux=True``.
    num_microbatches: how many micro-batches to split ``batch`` into; its
      leading size must be divisible by it.
    has_aux: ``fun`` returns ``(loss, aux)``. ``g`` then returns
      ``((value, aux), grads)`` with every leaf of ``aux`` stacked along a
      new leading axis of size ``num_microbatches`` (per micro-batch, not
      averaged: metrics such as counts, maxima or BatchNorm statistics each
      need their own reduction).
    weight_fn: ``weight_fn(microbatch)`` returns the micro-batch's scalar
      weight >= 0, such as its number of real tokens.
    axis_name: inside ``jax.shard_map`` or ``pmap``, the data-parallel axis.
      The scan runs device-locally; after it, the weighted gradient sum,
      weighted value sum and weight sum are summed over the axis once, so
      ``g`` returns the global weighted mean on every device.
    accumulator_dtype: floating dtype of the gradient sum carried through
      the scan (float32 by default, also for bfloat16 parameters).
    checkpoint_policy: with ``remat=True``, the ``jax.checkpoint`` policy
      deciding which intermediates of a micro-batch's forward pass are saved
      for its backward pass (for example
      ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``); None
      saves none.
    remat: wrap each micro-batch's ``fun`` in ``jax.checkpoint``, trading a
      second forward pass for less memory.

  Returns:
    ``g(params, batch, *args, rng=None, **kwargs)`` returning
    ``(value, grads)``, or ``((value, aux), grads)`` with ``has_aux``;
    ``grads`` has the tree and dtypes of ``params``; ``value`` is a scalar
    in the precision of the sums (float32 unless ``accumulator_dtype`` is
    wider).

  Raises:
    TypeError: ``num_microbatches`` is not an int, ``fun`` or ``weight_fn``
      is not callable, or ``accumulator_dtype`` is not floating.
    ValueError: ``num_microbatches`` is below 1. ``g`` raises for a ``batch``
      whose leaves' leading sizes differ or are not divisible by
      ``num_microbatches``, and for a ``weight_fn`` that is not scalar.

  Example:
    >>> import jax, jax.numpy as jnp, ga_optax
    >>> def loss_fn(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> batch = {"x": jnp.arange(16.0).reshape(8, 2), "y": jnp.ones(8)}
    >>> w = jnp.array([0.1, -0.2])
    >>> loss, grads = ga_optax.microbatched_value_and_grad(loss_fn, 4)(w, batch)
    >>> full_loss, full_grads = jax.value_and_grad(loss_fn)(w, batch)
    >>> bool(jnp.allclose(loss, full_loss)), bool(jnp.allclose(grads, full_grads))
    (True, True)
  """
  if not callable(fun):
    raise TypeError(f"fun must be callable, got {type(fun).__name__}.")
  num_microbatches = validation.check_positive_int(
    num_microbatches, "num_microbatches"
  )
  if weight_fn is not None and not callable(weight_fn):
    raise TypeError(
      "weight_fn must be None or a callable microbatch -> scalar weight,"
      f" got {type(weight_fn).__name__}."
    )
  if not isinstance(has_aux, bool):
    raise TypeError(f"has_aux must be a bool, got {has_aux!r}.")
  if not isinstance(remat, bool):
    raise TypeError(f"remat must be a bool, got {remat!r}.")
  if checkpoint_policy is not None and not remat:
    raise ValueError(
      "checkpoint_policy only applies with remat=True; pass remat=True or"
      " drop checkpoint_policy."
    )
  axis_name = validation.check_axis_name(axis_name)
  accumulator_dtype = validation.check_accumulator_dtype(accumulator_dtype)
  # Values and weights sum item counts; bfloat16 would round them from 256 on.
  sum_dtype = jnp.promote_types(accumulator_dtype, jnp.float32)

  per_microbatch_fun = fun
  if remat:
    per_microbatch_fun = jax.checkpoint(fun, policy=checkpoint_policy)
  grad_fn = jax.value_and_grad(per_microbatch_fun, has_aux=has_aux)

  @functools.wraps(fun)
  def value_and_grad_fn(
    params: Any, batch: Any, *args: Any, rng: Any = None, **kwargs: Any
  ) -> Any:
    microbatches = split_microbatches(batch, num_microbatches)
    if rng is not None and axis_name is not None:
      # Devices hold different data: they must not share dropout masks.
      rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))

    def accumulate_microbatch(carry, xs):
      grad_sum, value_sum, weight_sum = carry
      index, microbatch = xs
      call_kwargs = dict(kwargs)
      if rng is not None:
        call_kwargs["rng"] = jax.random.fold_in(rng, index)
      output, grads = grad_fn(params, microbatch, *args, **call_kwargs)
      value, aux = output if has_aux else (output, None)
      if weight_fn is None:
        weight = jnp.ones((), sum_dtype)
        grad_sum = jax.tree.map(
          lambda total, g: total + g.astype(accumulator_dtype),
          grad_sum,
          grads,
        )
        value_sum = value_sum + value.astype(sum_dtype)
      else:
        weight = _scalar_weight(weight_fn(microbatch), sum_dtype)
        # A weight-0 micro-batch may hold a 0/0 loss: select, not multiply.
        has_weight = weight > 0
        grad_sum = jax.tree.map(
          lambda total, g: (
            total
            + jnp.where(
              has_weight, weight.astype(accumulator_dtype) * g, 0
            ).astype(accumulator_dtype)
          ),
          grad_sum,
          grads,
        )
        value_sum = value_sum + jnp.where(
          has_weight, weight * value.astype(sum_dtype), 0
        )
      return (grad_sum, value_sum, weight_sum + weight), aux

    initial = (
      optax.tree.zeros_like(params, dtype=accumulator_dtype),
      jnp.zeros((), sum_dtype),
      jnp.zeros((), sum_dtype),
    )
    indices = jnp.arange(num_microbatches, dtype=jnp.int32)
    (grad_sum, value_sum, weight_sum), aux = jax.lax.scan(
      accumulate_microbatch, initial, (indices, microbatches)
    )
    grad_sum, value_sum, weight_sum = distributed.sum_across_devices(
      (grad_sum, value_sum, weight_sum), axis_name
    )
    # All-zero weights (a batch of padding only) give zeros, not 0 / 0.
    scale = 1.0 / jnp.where(weight_sum > 0, weight_sum, 1.0)
    value = value_sum * scale
    grads = jax.tree.map(
      lambda total, param: (total * scale.astype(total.dtype)).astype(
        jnp.result_type(param)
      ),
      grad_sum,
      params,
    )
    if has_aux:
      return (value, aux), grads
    return value, grads

  return value_and_grad_fn
