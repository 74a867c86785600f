"""In-step micro-batching: one ``lax.scan`` over the micro-batches of a batch.

``microbatched_value_and_grad`` turns a loss on a batch into a function that
splits the batch into micro-batches along each leaf's ``in_axes`` axis
(:func:`batch_layout.split_microbatches`), sums each one's weighted value and
gradient inside a ``lax.scan`` (:mod:`ga_optax._src.scan.microbatch_scan`), and
returns their weighted mean. ``unreduced_value_and_grad`` is one micro-batch
per device, its gradients left unreduced. Where the scan runs on several
devices is :mod:`ga_optax._src.scan.microbatch_devices`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from ga_optax._src import eager, validation
from ga_optax._src.algebra import noise_scale as noise_lib
from ga_optax._src.mixed_precision import precision
from ga_optax._src.placements import axes as axes_lib
from ga_optax._src.placements import unreduced
from ga_optax._src.scan import batch_layout
from ga_optax._src.scan.microbatch_devices import (
  LeftUnreduced,
  ReducedAfterScan,
  Result,
  data_parallel_axes,
  local_or_manual,
  per_device_sums,
  unreduced_batch_axes,
)
from ga_optax._src.scan.microbatch_scan import (
  Inputs,
  Microbatching,
  MicrobatchLoss,
  Trainable,
  WeightFn,
  Weighting,
)


def resolve(
  fun: Any,
  num_microbatches: Any,
  *,
  has_aux: Any,
  weight_fn: Any,
  accumulator_dtype: Any,
  checkpoint_policy: Any,
  remat: Any,
  in_axes: Any,
  noise_scale: Any = False,
) -> Microbatching:
  """Checks the arguments; returns the :class:`Microbatching` they describe.

  A micro-batching with one more part
  (``weighting=microbatching.weighting._replace(parts=...)``) sums it
  beside the gradient, and :func:`summing` reports it, with no edit here.
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
  if not isinstance(noise_scale, bool):
    raise TypeError(f"noise_scale must be a bool, got {noise_scale!r}.")
  if checkpoint_policy is not None and not remat:
    raise ValueError(
      "checkpoint_policy only applies with remat=True; pass remat=True or"
      " drop checkpoint_policy."
    )
  batch_layout.check_in_axes(in_axes)
  accumulator_dtype = validation.check_accumulator_dtype(accumulator_dtype)
  # Points at the user's call of microbatched_value_and_grad.
  precision.warn_if_accumulator_too_narrow(
    accumulator_dtype,
    num_microbatches,
    stacklevel=3,
    window_argument="num_microbatches",
  )
  return Microbatching(
    loss=MicrobatchLoss(
      fun=fun,
      has_aux=has_aux,
      remat=remat,
      checkpoint_policy=checkpoint_policy,
    ),
    weighting=Weighting(
      weight_fn=weight_fn,
      accumulator_dtype=accumulator_dtype,
      parts=(noise_lib.NoiseTermsPart(),) if noise_scale else (),
    ),
    num_microbatches=num_microbatches,
  )


def _inputs(
  params: Any,
  batch: Any,
  in_axes: Any,
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  rng: Any,
) -> Inputs:
  """One call's arguments, with the batch read by ``in_axes``."""
  layout = batch_layout.layout_of(batch, in_axes)
  split, whole = layout.parts(batch)
  return Inputs(Trainable.of(params), layout, split, whole, args, kwargs, rng)


def _value_and_grad(result: Result, has_aux: bool) -> tuple[Any, Any]:
  """``(value, grads)``, or ``((value, aux), grads)`` with ``has_aux``."""
  value = (result.value, result.aux) if has_aux else result.value
  return value, result.grads


def microbatched_value_and_grad(
  fun: Callable[..., Any],
  num_microbatches: int,
  *,
  has_aux: bool = False,
  weight_fn: WeightFn | None = None,
  axis_name: Any = None,
  in_axes: Any = 0,
  accumulator_dtype: Any = jnp.float32,
  checkpoint_policy: Callable[..., bool] | None = None,
  remat: bool = False,
  noise_scale: bool = False,
) -> Callable[..., Any]:
  """Value and gradient of ``fun`` accumulated over micro-batches in one scan.

  The returned ``g(params, batch, *args, rng=None, **kwargs)`` splits every
  leaf of ``batch`` along its batch axis (``in_axes``; the leading axis by
  default) into ``num_microbatches`` micro-batches, micro-batch ``i``
  holding entries ``i, i + k, i + 2k, ...``; evaluates the value and
  gradient of ``fun`` on each inside one ``lax.scan``; and returns the
  weighted mean ``sum(w_i v_i) / sum(w_i)`` of values and gradients, with
  ``w_i = weight_fn(microbatch_i)`` (1 by default). When ``fun`` is the
  mean loss of its batch (normalised by its own item count) and ``w_i``
  counts the items, this equals ``jax.value_and_grad(fun)(params, batch)``.
  Micro-batches of weight 0 (for example padding only) are dropped whole,
  so a loss of ``0 / 0`` there does not poison the result.

  Gradients are taken of the floating and complex array leaves of
  ``params``; every other leaf (an Equinox model's activation functions,
  Python numbers, integer or key arrays) is held static, as
  ``equinox.filter_value_and_grad`` does, and is None in ``grads``. For a
  tree of floating arrays (plain, Flax Linen or NNX) that is every leaf.

  On several devices, each device scans its own entries and the sums are
  reduced once, after the scan, with no collective inside it:

  * under a plain ``jax.jit`` with a batch sharded over mesh axes (for
    example ``P("data")`` on a mesh set with ``jax.set_mesh``), the axes are
    read from the batch's type under Explicit axes; under Auto axes name
    them with ``axis_name``. Each device computes ``B / (k * D)`` entries
    per micro-batch, the batch is never gathered, and the gradients come
    out sharded like the params. A split leaf that is not sharded over those
    axes (a mask made in the step) is resharded onto them on the way in.
    Without ``axis_name`` under Auto axes the compiler still splits the
    entries but reduces every micro-batch's gradient inside the loop.
  * inside ``jax.shard_map`` (or ``pmap``), name the data-parallel axis
    with ``axis_name``; every device returns the global mean.

  ``fun`` then sees one device's entries of a micro-batch, with the batch's
  mesh axes manual: a mean loss over them is combined exactly (all devices
  hold equally many entries), a loss that couples the entries of a batch
  (contrastive, in-batch BatchNorm) sees ``B / (k * D)`` of them.

  ``args`` and ``kwargs`` are passed unchanged to every call of ``fun``. When
  ``rng`` is given, ``fun`` receives ``rng=jax.random.fold_in(rng, i)`` for
  micro-batch ``i``, the key first folded with the device's index along the
  data-parallel axes on several devices: each micro-batch draws its own
  dropout masks, and the result depends only on ``rng`` and the device
  count.

  Args:
    fun: ``fun(params, microbatch, *args, **kwargs)`` returning a scalar loss,
      or ``(loss, aux)`` with ``has_aux=True``.
    num_microbatches: how many micro-batches to split ``batch`` into; its
      batch size (per device, on several) must be divisible by it.
    has_aux: ``fun`` returns ``(loss, aux)``. ``g`` then returns
      ``((value, aux), grads)`` with every leaf of ``aux`` stacked along a
      new leading axis, one entry per micro-batch (not averaged: metrics
      such as counts, maxima or BatchNorm statistics each need their own
      reduction). With a batch sharded over ``D`` devices under plain
      ``jit`` the axis has ``D * k`` entries, one per device and
      micro-batch (entry ``d * k + i``), sharded over the batch's axes.
    weight_fn: ``weight_fn(microbatch)`` returns the micro-batch's scalar
      weight >= 0, such as its number of real tokens. A boolean is a
      ``TypeError``. Negative weights follow the rule of
      :func:`ga_optax.accumulate`'s ``weight=``: a concrete one (a constant)
      is a ``ValueError``; a traced one, which cannot be seen, subtracts its
      micro-batch from the sums; a batch whose weights sum to 0 or less
      gives zeros.
    axis_name: the data-parallel axes, as everywhere in ga_optax: the
      axes the batch's rows are split over (a mesh axis name or a tuple of
      them). Under plain ``jit`` they are mesh axes (read from the batch's
      type under Explicit axes when None; name them under Auto axes).
      Inside ``jax.shard_map`` or ``pmap`` they are the manual axes to sum
      over after the scan.
    in_axes: where each leaf of ``batch`` holds the batch's entries, with
      ``jax.vmap``'s meaning: an int axis or None for each leaf, given as a
      pytree prefix of ``batch`` (``0``: every leaf along its leading axis;
      ``{"x": 1, "y": 0}`` for time-major inputs). Negative axes count from
      the end. A None leaf (a mask or a table shared by the batch, a PRNG
      key) goes whole to every micro-batch. Inside ``jax.shard_map``, its
      ``in_specs`` put the data axis on each leaf's own batch axis.
    accumulator_dtype: floating dtype of the gradient sum carried through
      the scan (float32 by default, also for bfloat16 parameters; complex
      parameters are summed in the complex dtype of that precision).
    checkpoint_policy: with ``remat=True``, the ``jax.checkpoint`` policy
      deciding which intermediates of a micro-batch's forward pass are saved
      for its backward pass (for example
      ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``); None
      saves none.
    remat: wrap each micro-batch's ``fun`` in ``jax.checkpoint``, trading a
      second forward pass for less memory.
    noise_scale: also return the batch's raw gradient noise scale
      estimates (a :class:`ga_optax.NoiseScaleEstimate`), each micro-batch
      (on each device) one micro-gradient of its weight; smooth them
      across steps with :func:`ga_optax.smooth_noise_scale`. Costs one
      squared norm per micro-batch and nothing without.

  Returns:
    ``g(params, batch, *args, rng=None, **kwargs)`` returning
    ``(value, grads)``, or ``((value, aux), grads)`` with ``has_aux``, and
    with ``noise_scale`` the estimate as a third element;
    ``grads`` has the tree of ``params`` (None at static leaves) and the
    dtypes of its leaves; ``value`` is a scalar in the precision of the
    sums (float32 unless ``accumulator_dtype`` is wider). Called outside
    ``jit``, ``g`` compiles once per input shapes and dtypes and reuses the
    compiled program.

  Raises:
    TypeError: ``num_microbatches`` is not an int, ``fun`` or ``weight_fn``
      is not callable, ``accumulator_dtype`` is not floating, or a leaf of
      ``in_axes`` is neither an int nor None.
    ValueError: ``num_microbatches`` is below 1. ``g`` raises for an
      ``in_axes`` that is not a prefix of ``batch`` or gives an axis out of
      range, for split leaves whose batch sizes differ or are not divisible
      by ``num_microbatches`` (per device), for a ``weight_fn`` that is not
      scalar, and for an ``axis_name`` that does not match the batch's
      sharding.

  Example:
    >>> import jax, jax.numpy as jnp, ga_optax
    >>> def loss_fn(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> batch = {"x": jnp.arange(16.0).reshape(8, 2), "y": jnp.ones(8)}
    >>> w = jnp.array([0.1, -0.2])
    >>> loss, grads = ga_optax.microbatched_value_and_grad(loss_fn, 4)(w, batch)
    >>> full_loss, full_grads = jax.value_and_grad(loss_fn)(w, batch)
    >>> (bool(jnp.allclose(loss, full_loss)),
    ...  bool(jnp.allclose(grads, full_grads)))
    (True, True)

    Time-major inputs hold the batch on axis 1; a shared leaf has None:

    >>> def sequence_loss(w, batch):  # x: (time, batch, 2), y: (batch,)
    ...   hidden = jnp.tanh(batch["x"] @ w).sum(0) * batch["scale"]
    ...   return jnp.mean((hidden - batch["y"]) ** 2)
    >>> batch = {"x": jnp.ones((5, 8, 2)), "y": jnp.arange(8.0),
    ...          "scale": jnp.float32(0.5)}
    >>> g = ga_optax.microbatched_value_and_grad(
    ...     sequence_loss, 4, in_axes={"x": 1, "y": 0, "scale": None})
    >>> loss, grads = g(w, batch)
    >>> bool(jnp.allclose(grads, jax.grad(sequence_loss)(w, batch)))
    True
  """
  microbatching = resolve(
    fun,
    num_microbatches,
    has_aux=has_aux,
    weight_fn=weight_fn,
    accumulator_dtype=accumulator_dtype,
    checkpoint_policy=checkpoint_policy,
    remat=remat,
    in_axes=in_axes,
    noise_scale=noise_scale,
  )
  results = summing(microbatching, in_axes=in_axes, axis_name=axis_name)

  @functools.wraps(fun)
  def value_and_grad_fn(
    params: Any, batch: Any, *args: Any, rng: Any = None, **kwargs: Any
  ) -> Any:
    result = results(params, batch, *args, rng=rng, **kwargs)
    output = _value_and_grad(result, has_aux)
    if noise_scale:
      return (*output, result.report(noise_lib.NoiseScaleEstimate))
    return output

  # The params' Python numbers are not differentiated: they stay static.
  return eager.compiled_when_eager(value_and_grad_fn, numbers_static_in=(0,))


def summing(
  microbatching: Microbatching, *, in_axes: Any, axis_name: Any
) -> Callable[..., Result]:
  """``(params, batch, *args, rng=None, **kwargs) -> Result`` of one scan.

  The batch split by ``in_axes`` and its micro-batches summed by
  ``microbatching``, over the devices of ``axis_name`` (or of the batch's
  sharding): every part of the sums reports in ``Result.reports``.
  """
  if axis_name is not None:
    axes_lib.as_axes(axis_name, "axis_name")

  def result_of(
    params: Any, batch: Any, *args: Any, rng: Any = None, **kwargs: Any
  ) -> Result:
    inputs = _inputs(params, batch, in_axes, args, kwargs, rng)
    mesh_axes, manual_axes = data_parallel_axes(inputs, axis_name)
    if mesh_axes:
      return per_device_sums(
        microbatching, mesh_axes, inputs, ReducedAfterScan()
      )
    return local_or_manual(microbatching, manual_axes, inputs)

  return result_of


def unreduced_value_and_grad(
  fun: Callable[..., Any],
  *,
  unreduced_axes: Any = None,
  has_aux: bool = False,
  weight_fn: WeightFn | None = None,
  in_axes: Any = 0,
  accumulator_dtype: Any = jnp.float32,
  return_weight: bool = False,
) -> Callable[..., Any]:
  """``jax.value_and_grad`` with the gradients left unreduced over mesh axes.

  For a train step under a plain ``jax.jit`` whose batch is sharded over
  Explicit mesh axes (``jax.make_mesh`` + ``jax.set_mesh`` + a batch put
  with ``P("data")``): the returned ``g(params, batch, *args, rng=None,
  **kwargs)`` runs ``fun`` on each device's entries and returns the
  gradients ``unreduced`` over ``unreduced_axes``: each device holds its
  partial sum, and no collective runs. Feed them to
  ``ga_optax.accumulate(..., unreduced_axes=...)``, which sums them over the
  devices once per window, in the branch that closes it, instead of once
  per micro-step.

  The gradients' true value (the sum of the partial sums) is the gradient
  of the batch's weighted mean loss, exactly what ``jax.value_and_grad(fun)``
  returns for a mean loss; the value is that mean, already reduced (one
  scalar all-reduce). Works for any model: each device differentiates its
  loss inside a ``jax.shard_map`` over the batch axes that leaves the loss
  as JAX runs it (parameters sharded over other mesh axes keep their
  sharding). A parameter sharded over a batch axis (FSDP) is gathered for
  the call; its gradient comes out whole, unreduced. As in
  :func:`microbatched_value_and_grad`, gradients are taken of the floating
  and complex array leaves of ``params`` and are None at the others, and
  ``in_axes`` says where each leaf of ``batch`` holds its entries.

  Args:
    fun: ``fun(params, batch, *args, **kwargs)`` returning the scalar mean
      loss of its batch, or ``(loss, aux)`` with ``has_aux=True``.
    unreduced_axes: the mesh axes the batch is sharded over; None reads
      them from the batch's type. They must be Explicit.
    has_aux: ``fun`` returns ``(loss, aux)``; ``g`` then returns
      ``((value, aux), grads)`` with every leaf of ``aux`` stacked along a
      new leading axis, one entry per device, sharded over the axes.
    weight_fn: ``weight_fn(entries)`` returns the scalar weight of one
      device's entries (for example its number of real tokens); the
      devices' gradients are combined in proportion, their weights summed
      in the all-reduce that already sums the value. By default all
      devices weigh the same, which is exact for a mean over rows (every
      device holds as many) but not for a mean over each device's real
      tokens. With token weights the count is needed twice, here and as
      ``weight=`` to ``update``: pass ``return_weight=True`` and hand
      ``update`` the weight ``g`` returns (a step that passes ``update`` a
      weight while its gradients come from here without ``weight_fn``
      warns).
    in_axes: an int axis or None per leaf of ``batch`` (a pytree prefix of
      it), as in :func:`microbatched_value_and_grad`; default 0.
    accumulator_dtype: floating dtype in which each device's weighted
      gradient is formed.
    return_weight: ``g`` also returns the batch's weight, ``weight_fn``'s
      counts summed over the devices, the same on every device: the
      ``weight=`` this micro-step gives ``update``. It comes out of the
      all-reduce that sums the value; counting the sharded batch again in
      the step would all-reduce a second scalar on every micro-step. Needs
      ``weight_fn``.

  Returns:
    ``g(params, batch, *args, rng=None, **kwargs) -> (value, grads)`` (or
    ``((value, aux), grads)``), ``grads`` unreduced over the axes, and with
    ``return_weight`` the weight as a third element (a scalar in the
    precision of the sums, float32 unless ``accumulator_dtype`` is wider).
    ``rng`` reaches ``fun`` folded with the device's index.

  Raises:
    TypeError: ``fun`` or ``weight_fn`` is not callable, ``unreduced_axes``
      is not an axis name or a tuple of them, a leaf of ``in_axes`` is
      neither an int nor None, or ``return_weight`` is not a bool.
    ValueError: ``return_weight=True`` without ``weight_fn``; (from ``g``)
      the axes are not Explicit mesh axes, the batch is sharded over other
      axes, or ``in_axes`` does not fit the batch.

  Example:
    >>> import jax, jax.numpy as jnp, ga_optax
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> def loss_fn(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> with jax.set_mesh(mesh):
    ...   batch = jax.device_put(
    ...       {"x": jnp.ones((4, 2)), "y": jnp.zeros(4)}, jax.P("data"))
    ...   loss, grads = jax.jit(ga_optax.unreduced_value_and_grad(loss_fn))(
    ...       jnp.ones(2), batch)
    >>> jax.typeof(grads)
    ShapedArray(float32[2]{U:data})

    Weighted by a count, the step passes the returned weight on:

    >>> def count(batch):
    ...   return jnp.sum(batch["y"] == 0)
    >>> g = ga_optax.unreduced_value_and_grad(
    ...     loss_fn, weight_fn=count, return_weight=True)
    >>> with jax.set_mesh(mesh):
    ...   loss, grads, weight = jax.jit(g)(jnp.ones(2), batch)
    >>> float(weight)
    4.0
  """
  microbatching = resolve(
    fun,
    1,
    has_aux=has_aux,
    weight_fn=weight_fn,
    accumulator_dtype=accumulator_dtype,
    checkpoint_policy=None,
    remat=False,
    in_axes=in_axes,
  )
  if unreduced_axes is not None:
    axes_lib.as_axes(unreduced_axes, "unreduced_axes")
  _check_return_weight(return_weight, weight_fn)

  @functools.wraps(fun)
  def value_and_grad_fn(
    params: Any, batch: Any, *args: Any, rng: Any = None, **kwargs: Any
  ) -> Any:
    inputs = _inputs(params, batch, in_axes, args, kwargs, rng)
    axes = unreduced_batch_axes(inputs, unreduced_axes)
    result = per_device_sums(microbatching, axes, inputs, LeftUnreduced())
    if weight_fn is None:
      unreduced.mark_devices_weighed_alike(result.grads)
    output = _value_and_grad(result, has_aux)
    return (*output, result.weight) if return_weight else output

  return value_and_grad_fn


def _check_return_weight(return_weight: Any, weight_fn: Any) -> None:
  """Raises unless ``return_weight`` is a bool that has a weight to return."""
  if not isinstance(return_weight, bool):
    raise TypeError(f"return_weight must be a bool, got {return_weight!r}.")
  if return_weight and weight_fn is None:
    raise ValueError(
      "return_weight=True returns the batch's weight, weight_fn's counts"
      " summed over the devices, but weight_fn is None: pass weight_fn=..."
      " (for example the count of real tokens), or leave return_weight"
      " False; without weight_fn every micro-step weighs the same, and"
      " update needs no weight=."
    )
