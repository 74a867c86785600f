"""In-step micro-batching: one ``lax.scan`` over the micro-batches of a batch.

``microbatched_value_and_grad`` turns a loss on a batch into a function that
splits the batch into micro-batches, computes each one's value and gradient
inside a ``lax.scan`` (so only one micro-batch's activations are alive at a
time), and returns their weighted mean. The pipeline has three stages: split
the batch along each leaf's ``in_axes`` axis
(:func:`batch_layout.split_microbatches`), add one micro-batch's weighted
value and gradient into the sums (the scan body,
:meth:`Microbatching.add_microbatch`), and reduce the sums to means once,
after the scan (:meth:`Microbatching.mean`).

Gradients are taken of the floating (and complex) array leaves of the
parameters; every other leaf (an Equinox model's activation functions, an
integer counter) is held static, as ``equinox.filter_value_and_grad`` does
(:class:`Trainable`).

On several devices the scan runs per device, on each device's own entries,
and the sums are reduced once after it: inside a ``jax.shard_map`` the
caller wrote (``axis_name``), or inside one this module writes over the mesh
axes a batch is sharded over under a plain ``jax.jit``
(:func:`per_device_sums`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

from ga_optax._src import batch_layout, dtypes, eager, validation
from ga_optax._src import noise_scale as noise_lib
from ga_optax._src.batch_layout import BatchLayout
from ga_optax._src.parallel import axes as axes_lib

WeightFn = Callable[[Any], Any]


class Trainable(NamedTuple):
  """Parameters split into what is differentiated and what is held static.

  Both trees have the parameters' structure, each with None where the other
  has the leaf (``equinox.partition``'s convention), so that gradients come
  out with the parameters' structure and None at every static leaf.

  Attributes:
    diff: the floating and complex array leaves.
    static: every other leaf: functions, strings, integer or key arrays.
  """

  diff: Any
  static: Any

  @classmethod
  def of(cls, params: Any) -> Trainable:
    """``params`` split by :func:`validation.is_inexact_array`."""
    return cls(
      diff=jax.tree.map(
        lambda leaf: leaf if validation.is_inexact_array(leaf) else None,
        params,
      ),
      static=jax.tree.map(
        lambda leaf: None if validation.is_inexact_array(leaf) else leaf,
        params,
      ),
    )

  def params(self, diff: Any) -> Any:
    """The parameters with ``diff`` in place of the differentiated leaves."""
    return jax.tree.map(
      lambda trained, held: held if trained is None else trained,
      diff,
      self.static,
      is_leaf=lambda node: node is None,
    )


class Inputs(NamedTuple):
  """One call's arguments, its batch split by the batch's layout.

  Attributes:
    trainable: the parameters.
    layout: where the batch's entries lie.
    split: the batch leaves split into micro-batches (one device's share
      inside a ``shard_map``).
    whole: the batch leaves passed whole to every micro-batch.
    args: extra positional arguments, for every micro-batch.
    kwargs: extra keyword arguments, for every micro-batch.
    rng: the key folded per micro-batch, or None.
  """

  trainable: Trainable
  layout: BatchLayout
  split: list[Any]
  whole: list[Any]
  args: tuple[Any, ...]
  kwargs: dict[str, Any]
  rng: Any

  def shared(self) -> tuple[Any, ...]:
    """What every device needs whole: all but the split batch leaves."""
    return self.trainable, self.whole, self.args, self.kwargs, self.rng

  def with_shared(self, shared: tuple[Any, ...], split: list[Any]) -> Inputs:
    """These inputs with ``shared`` (as :meth:`shared` gives) and ``split``."""
    trainable, whole, args, kwargs, rng = shared
    return self._replace(
      trainable=trainable,
      split=split,
      whole=whole,
      args=args,
      kwargs=kwargs,
      rng=rng,
    )


class Sums(NamedTuple):
  """Weighted sums over micro-batches, kept in the carry of the scan.

  Attributes:
    grads: ``sum(w_i * grad_i)``, a tree like the differentiated params.
    value: ``sum(w_i * value_i)``.
    weight: ``sum(w_i)``; NaN once a negative weight was seen.
    square: with ``noise_scale``, ``sum(w_i |grad_i|^2)``; else None.
    micro_batches: with ``noise_scale``, how many micro-batches had weight
      > 0; else None.
  """

  grads: Any
  value: jax.Array
  weight: jax.Array
  square: Any = None
  micro_batches: Any = None


class Microbatching(NamedTuple):
  """How to split a batch and sum its micro-batches' values and gradients.

  Attributes:
    fun: the loss, ``fun(params, microbatch, *args, **kwargs)``.
    num_microbatches: micro-batches per batch.
    has_aux: the loss returns ``(value, aux)``.
    weight_fn: ``microbatch -> scalar weight``, or None for weight 1.
    accumulator_dtype: the floating dtype of the gradient sums.
    remat: each micro-batch's loss runs under ``jax.checkpoint``.
    checkpoint_policy: the ``jax.checkpoint`` policy with ``remat``.
    noise_scale: also sum what the gradient noise scale needs.
  """

  fun: Callable[..., Any]
  num_microbatches: int
  has_aux: bool
  weight_fn: WeightFn | None
  accumulator_dtype: jnp.dtype
  remat: bool
  checkpoint_policy: Callable[..., bool] | None
  noise_scale: bool = False

  def zeros(self, diff: Any) -> Sums:
    """Empty sums for the differentiated params ``diff``."""
    return Sums(
      # zeros_like keeps each parameter's sharding over other mesh axes.
      grads=jax.tree.map(
        lambda param: jnp.zeros_like(
          param,
          dtypes.sum_dtype(jnp.result_type(param), self.accumulator_dtype),
        ),
        diff,
      ),
      value=jnp.zeros((), dtypes.weight_dtype(self.accumulator_dtype)),
      weight=jnp.zeros((), dtypes.weight_dtype(self.accumulator_dtype)),
      square=jnp.zeros((), jnp.float32) if self.noise_scale else None,
      micro_batches=jnp.zeros((), jnp.int32) if self.noise_scale else None,
    )

  def weight_of(self, microbatch: Any) -> jax.Array:
    """The micro-batch's weight; a negative one becomes NaN.

    A negative weight cannot be refused at trace time; NaN makes it poison
    the result instead of giving a plausible wrong number.
    """
    weight_dtype = dtypes.weight_dtype(self.accumulator_dtype)
    if self.weight_fn is None:
      return jnp.ones((), weight_dtype)
    weight = self.weight_fn(microbatch)
    if jnp.shape(weight) != ():
      raise ValueError(
        "weight_fn must return a scalar per micro-batch (for example its"
        f" number of real tokens), got shape {jnp.shape(weight)}."
      )
    dtype = jnp.result_type(weight)
    if (
      not (
        jnp.issubdtype(dtype, jnp.integer)
        or jnp.issubdtype(dtype, jnp.floating)
      )
      or dtype == jnp.bool_
    ):
      raise TypeError(
        "weight_fn must return a real number (an integer or floating"
        f" scalar such as a token count), got dtype {dtype}. A boolean"
        " mask must be summed first."
      )
    weight = jnp.asarray(weight, weight_dtype)
    return jnp.where(weight < 0, jnp.nan, weight)

  def value_and_grad(
    self,
    trainable: Trainable,
    microbatch: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
  ) -> tuple[Any, Any]:
    """``fun``'s output on one micro-batch, and its gradient in ``diff``."""

    def loss(diff: Any) -> Any:
      return self.fun(trainable.params(diff), microbatch, *args, **kwargs)

    if self.remat:
      loss = jax.checkpoint(loss, policy=self.checkpoint_policy)
    return jax.value_and_grad(loss, has_aux=self.has_aux)(trainable.diff)

  def add_microbatch(
    self,
    sums: Sums,
    trainable: Trainable,
    microbatch: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
  ) -> tuple[Sums, Any]:
    """Adds one micro-batch's weighted value and gradient to ``sums``."""
    output, grads = self.value_and_grad(trainable, microbatch, args, kwargs)
    value, aux = output if self.has_aux else (output, None)
    weight = self.weight_of(microbatch)
    # A weight-0 micro-batch may hold a 0 / 0 loss: select, not multiply.
    has_weight = weight > 0

    def add(total: jax.Array, term: jax.Array) -> jax.Array:
      term = term.astype(total.dtype)
      if self.weight_fn is None:
        return total + term
      weighted = weight.astype(total.dtype) * term
      return total + jnp.where(has_weight, weighted, jnp.zeros((), total.dtype))

    new_sums = Sums(
      grads=jax.tree.map(add, sums.grads, grads),
      value=add(sums.value, value),
      weight=sums.weight + weight,
    )
    if self.noise_scale:
      square = weight.astype(jnp.float32) * noise_lib.square_norm(grads)
      new_sums = new_sums._replace(
        square=sums.square + jnp.where(has_weight, square, 0.0),
        micro_batches=sums.micro_batches + has_weight.astype(jnp.int32),
      )
    return new_sums, aux

  def sums(
    self, inputs: Inputs, varying_axes: axes_lib.Axes = ()
  ) -> tuple[Sums, Any]:
    """The weighted sums over the micro-batches of ``inputs``' batch.

    ``varying_axes``: inside a ``jax.shard_map`` that checks varying axes,
    the manual axes the gradients vary over; the carry is cast to vary over
    them too, so that the scan keeps its type.
    """
    layout, trainable = inputs.layout, inputs.trainable
    microbatches = batch_layout.split_microbatches(
      inputs.split, layout.split_axes, self.num_microbatches
    )
    initial = axes_lib.cast_to_varying(self.zeros(trainable.diff), varying_axes)

    def scan_body(sums: Sums, xs: tuple[jax.Array, Any]) -> tuple[Sums, Any]:
      index, split = xs
      microbatch = layout.rebuild(split, inputs.whole)
      kwargs = dict(inputs.kwargs)
      if inputs.rng is not None:
        kwargs["rng"] = jax.random.fold_in(inputs.rng, index)
      return self.add_microbatch(
        sums, trainable, microbatch, inputs.args, kwargs
      )

    indices = jnp.arange(self.num_microbatches, dtype=jnp.int32)
    return jax.lax.scan(scan_body, initial, (indices, microbatches))

  def mean(self, sums: Sums, diff: Any) -> tuple[jax.Array, Any]:
    """``(value, grads)``: the sums over their weight, grads in diff's dtypes.

    All-zero weights (a batch of padding only) give zeros, not 0 / 0; a NaN
    weight (a negative one was seen) gives NaN.
    """
    scale = 1.0 / jnp.where(sums.weight == 0, 1.0, sums.weight)
    grads = jax.tree.map(
      lambda total, param: (total * scale.astype(total.dtype)).astype(
        jnp.result_type(param)
      ),
      sums.grads,
      diff,
    )
    return sums.value * scale, grads

  def estimate(self, sums: Sums) -> noise_lib.NoiseScaleEstimate | None:
    """The noise scale's estimates from sums over every micro-batch."""
    if not self.noise_scale:
      return None
    scale = 1.0 / jnp.where(sums.weight == 0, 1.0, sums.weight)
    mean_square = (
      noise_lib.square_norm(sums.grads) * scale.astype(jnp.float32) ** 2
    )
    return noise_lib.window_estimate(
      sums.square,
      sums.micro_batches,
      sums.weight.astype(jnp.float32),
      mean_square,
    )


def per_device_sums(
  microbatching: Microbatching,
  axes: axes_lib.Axes,
  inputs: Inputs,
  *,
  unreduced: bool,
) -> tuple[jax.Array, Any, Any, Any]:
  """Micro-batching of a batch sharded over mesh ``axes``, under plain jit.

  Each device scans its own entries; the map over the devices does not
  check varying axes, so each micro-batch's gradient stays a device-local
  partial sum and the user's loss runs as JAX runs it. The sums are reduced
  once, after the scan. With ``unreduced``, the gradients leave scaled by
  the global weight but not summed over devices: ``unreduced`` over
  ``axes``, for ``accumulate(..., unreduced_axes=axes)`` to sum once per
  window.

  Returns:
    ``(value, grads, aux, estimate)``; aux leaves are stacked per
    sub-batch, device major: entry ``d * k + i`` is micro-batch ``i`` on
    device ``d``; ``estimate`` is the noise scale's (or None).
  """
  devices = batch_layout.device_count(axes)
  batch_layout.check_divisible(
    inputs.layout, microbatching.num_microbatches, devices
  )
  local_layout = inputs.layout._replace(size=inputs.layout.size // devices)
  arrays, rebuild = batch_layout.split_arrays(inputs.shared())
  diff = inputs.trainable.diff

  def per_device(arrays: list[Any], split: list[Any]) -> Any:
    local = inputs.with_shared(rebuild(arrays), split)
    local = local._replace(layout=local_layout)
    if local.rng is not None:
      # Devices hold different entries: they must not share dropout masks.
      local = local._replace(
        rng=jax.random.fold_in(local.rng, jax.lax.axis_index(axes))
      )
    sums, aux = microbatching.sums(local)
    if not unreduced:
      sums = jax.lax.psum(sums, axes)
      value, grads = microbatching.mean(sums, local.trainable.diff)
      return value, grads, aux, microbatching.estimate(sums)
    value_sum, weight_sum = jax.lax.psum((sums.value, sums.weight), axes)
    value, grads = microbatching.mean(
      Sums(sums.grads, value_sum, weight_sum), local.trainable.diff
    )
    # One partial sum per device, stacked along a new leading axis: a
    # shard_map may not return unreduced values while other axes stay
    # outside it, so they are summed into unreduced ones below.
    return value, jax.tree.map(lambda grad: grad[None], grads), aux, None

  # Gradients keep each parameter's spec over other mesh axes; stacked
  # partial sums get a leading axis over the batch axes.
  grad_specs = jax.tree.map(
    lambda param: PartitionSpec(
      *((axes,) if unreduced else ()),
      *axes_lib.without_axes(axes_lib.spec_of(param), axes).partitions,
    ),
    diff,
  )
  value, grads, aux, estimate = batch_layout.map_over_batch_axes(
    per_device,
    axes,
    arrays,
    inputs.split,
    inputs.layout.split_axes,
    out_specs=(
      PartitionSpec(),
      grad_specs,
      PartitionSpec(axes),
      PartitionSpec(),
    ),
  )
  if unreduced:
    grads = axes_lib.sum_to_unreduced(grads, diff, axes)
  elif _explicit(axes):
    # A parameter sharded over a batch axis (FSDP) was gathered for the
    # scan; its gradient goes back to the parameter's own sharding.
    grads = axes_lib.reshard_tree(grads, jax.tree.map(axes_lib.spec_of, diff))
  return value, grads, aux, estimate


def _explicit(axes: axes_lib.Axes) -> bool:
  types = axes_lib.mesh_axis_types()
  return all(types[axis] == AxisType.Explicit for axis in axes)


def _check_options(
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
  """Checks the arguments; returns the :class:`Microbatching` they describe."""
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
  return Microbatching(
    fun=fun,
    num_microbatches=num_microbatches,
    has_aux=has_aux,
    weight_fn=weight_fn,
    accumulator_dtype=validation.check_accumulator_dtype(accumulator_dtype),
    remat=remat,
    checkpoint_policy=checkpoint_policy,
    noise_scale=noise_scale,
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


def _data_parallel_axes(
  inputs: Inputs, axis_name: Any
) -> tuple[axes_lib.Axes, axes_lib.Axes]:
  """``(mesh_axes, manual_axes)``: where the batch is split, and how.

  ``mesh_axes``: the axes of a batch sharded under plain ``jit``, from
  ``axis_name`` or, under Explicit axes, from the batch's type.
  ``manual_axes``: axes the caller's ``shard_map`` (or ``pmap``) is manual
  over, to be summed over with a collective.
  """
  sharded_over = batch_layout.sharded_axes(inputs.layout, inputs.split)
  if axis_name is None:
    types = axes_lib.mesh_axis_types()
    missing = [axis for axis in sharded_over if axis not in types]
    if missing:
      raise ValueError(
        f"batch is sharded over mesh axes {sharded_over!r}, but no mesh"
        f" with {missing!r} is set: call the function under"
        " jax.set_mesh(mesh) (or `with jax.set_mesh(mesh):`), so that each"
        " device can work on its own entries."
      )
    return sharded_over, ()
  named = axes_lib.as_axes(axis_name, "axis_name")
  in_mesh = axes_lib.mesh_axes(named)
  if not in_mesh:
    for axis in named:
      try:
        jax.lax.axis_size(axis)
      except NameError:
        raise ValueError(
          f"axis_name {axis!r} is neither an axis of the current mesh nor"
          " bound by an enclosing jax.shard_map or pmap. Under a plain"
          " jax.jit, set the mesh the batch is sharded on with"
          " jax.set_mesh(mesh)."
        ) from None
    return (), named
  if in_mesh != named:
    raise ValueError(
      f"axis_name {named!r} mixes mesh axes {in_mesh!r} with axes this code"
      " is already manual over (inside shard_map or pmap); name one kind."
    )
  if sharded_over and sharded_over != named:
    raise ValueError(
      f"axis_name is {named!r}, but batch is sharded over {sharded_over!r}"
      " along its batch axis (in_axes); pass axis_name=None to use the"
      " batch's own axes, or reshard the batch."
    )
  return named, ()


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
      ``TypeError``; a negative weight cannot be refused at trace time and
      makes value and gradients NaN, never a plausible wrong number.
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
    >>> bool(jnp.allclose(loss, full_loss)), bool(jnp.allclose(grads, full_grads))
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
  microbatching = _check_options(
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
  if axis_name is not None:
    axes_lib.as_axes(axis_name, "axis_name")

  @functools.wraps(fun)
  def value_and_grad_fn(
    params: Any, batch: Any, *args: Any, rng: Any = None, **kwargs: Any
  ) -> Any:
    inputs = _inputs(params, batch, in_axes, args, kwargs, rng)
    mesh_axes, manual_axes = _data_parallel_axes(inputs, axis_name)
    if mesh_axes:
      value, grads, aux, estimate = per_device_sums(
        microbatching, mesh_axes, inputs, unreduced=False
      )
    else:
      value, grads, aux, estimate = _local_or_manual(
        microbatching, manual_axes, inputs
      )
    output = ((value, aux), grads) if has_aux else (value, grads)
    return (*output, estimate) if noise_scale else output

  return eager.compiled_when_eager(value_and_grad_fn)


def _local_or_manual(
  microbatching: Microbatching, manual_axes: axes_lib.Axes, inputs: Inputs
) -> tuple[jax.Array, Any, Any, Any]:
  """One device's batch, or the caller's ``shard_map`` over ``manual_axes``."""
  batch_layout.check_divisible(
    inputs.layout,
    microbatching.num_microbatches,
    where=(
      f"inside the jax.shard_map (or pmap) over axis_name {manual_axes!r}"
      if manual_axes
      else ""
    ),
  )
  # Inside a shard_map that checks varying axes, varying parameters give
  # device-local gradients: no collective in the backward pass of each
  # micro-batch, one sum after the scan. (pmap and vmap axes do not track
  # variance.)
  varying_axes = axes_lib.shard_map_axes(manual_axes)
  trainable = inputs.trainable
  trainable = trainable._replace(
    diff=axes_lib.cast_to_varying(trainable.diff, varying_axes)
  )
  inputs = inputs._replace(trainable=trainable)
  if manual_axes and inputs.rng is not None:
    inputs = inputs._replace(
      rng=jax.random.fold_in(inputs.rng, jax.lax.axis_index(manual_axes))
    )
  sums, aux = microbatching.sums(inputs, varying_axes=varying_axes)
  if manual_axes:
    sums = jax.lax.psum(sums, manual_axes)
  value, grads = microbatching.mean(sums, trainable.diff)
  return value, grads, aux, microbatching.estimate(sums)


def unreduced_value_and_grad(
  fun: Callable[..., Any],
  *,
  unreduced_axes: Any = None,
  has_aux: bool = False,
  weight_fn: WeightFn | None = None,
  in_axes: Any = 0,
  accumulator_dtype: Any = jnp.float32,
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
      devices' gradients are combined in proportion (one more scalar
      all-reduce). By default all devices weigh the same, which is exact
      for a mean loss (every device holds as many entries).
    in_axes: an int axis or None per leaf of ``batch`` (a pytree prefix of
      it), as in :func:`microbatched_value_and_grad`; default 0.
    accumulator_dtype: floating dtype in which each device's weighted
      gradient is formed.

  Returns:
    ``g(params, batch, *args, rng=None, **kwargs) -> (value, grads)`` (or
    ``((value, aux), grads)``), ``grads`` unreduced over the axes. ``rng``
    reaches ``fun`` folded with the device's index.

  Raises:
    TypeError: ``fun`` or ``weight_fn`` is not callable, ``unreduced_axes``
      is not an axis name or a tuple of them, or a leaf of ``in_axes`` is
      neither an int nor None.
    ValueError: (from ``g``) the axes are not Explicit mesh axes, the batch
      is sharded over other axes, or ``in_axes`` does not fit the batch.

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
  """
  microbatching = _check_options(
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

  @functools.wraps(fun)
  def value_and_grad_fn(
    params: Any, batch: Any, *args: Any, rng: Any = None, **kwargs: Any
  ) -> Any:
    inputs = _inputs(params, batch, in_axes, args, kwargs, rng)
    axes = _unreduced_batch_axes(inputs, unreduced_axes)
    value, grads, aux, _ = per_device_sums(
      microbatching, axes, inputs, unreduced=True
    )
    return ((value, aux), grads) if has_aux else (value, grads)

  return value_and_grad_fn


def _unreduced_batch_axes(inputs: Inputs, unreduced_axes: Any) -> axes_lib.Axes:
  """The Explicit mesh axes to leave the gradients unreduced over."""
  sharded_over = batch_layout.sharded_axes(inputs.layout, inputs.split)
  axes = (
    sharded_over
    if unreduced_axes is None
    else axes_lib.as_axes(unreduced_axes, "unreduced_axes")
  )
  if not axes:
    raise ValueError(
      "unreduced_axes is None and batch is not sharded along its batch axis"
      " (in_axes); put the batch with jax.device_put(batch, P('data'))"
      " under a mesh with Explicit axes (jax.make_mesh + jax.set_mesh), or"
      " name the axes."
    )
  types = axes_lib.mesh_axis_types()
  not_explicit = [axis for axis in axes if types.get(axis) != AxisType.Explicit]
  if not_explicit:
    raise ValueError(
      f"unreduced_axes {axes!r} must be Explicit axes of the current mesh;"
      f" {not_explicit!r} are not (mesh axes: {types}). Create the mesh with"
      " jax.make_mesh(..., axis_types=(AxisType.Explicit, ...)) and set it"
      " with jax.set_mesh."
    )
  if sharded_over and sharded_over != axes:
    raise ValueError(
      f"unreduced_axes is {axes!r}, but batch is sharded over"
      f" {sharded_over!r} along its batch axis (in_axes)."
    )
  return axes
