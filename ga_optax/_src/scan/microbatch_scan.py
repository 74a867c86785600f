"""One device's micro-batches: a ``lax.scan`` summing their weighted gradients.

Three ideas, one class each: what a micro-batch computes (its loss and
gradient, :class:`MicrobatchLoss`), how the micro-batches are weighed into
the carried :class:`Sums` and averaged once after the scan
(:class:`Weighting`), and the scan that joins them (:class:`Microbatching`).
Only one micro-batch's activations are alive at a time.

Gradients are taken of the floating (and complex) array leaves of the
parameters; every other leaf (an Equinox model's activation functions, an
integer counter) is held static, as ``equinox.filter_value_and_grad`` does
(:class:`Trainable`). Flax float8 state (the ``_overwrite_with_gradient``
collection of Linen variables) is read once, at its value before the scan,
by every micro-batch; its "gradients" (new values) are combined as one
large batch makes them (:mod:`ga_optax._src.algebra.fp8`), never summed. So that
each micro-batch's backward pass quantises as the large batch's does, its
loss is scaled to its share of the batch's, ``w_i / W``, while it is
differentiated (the weights are summed before the scan), and its gradient
is scaled back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ga_optax._src import validation
from ga_optax._src.algebra import dtypes, fp8, parts, weights
from ga_optax._src.algebra.parts import Part
from ga_optax._src.placements import axes as axes_lib
from ga_optax._src.scan import batch_layout
from ga_optax._src.scan.batch_layout import BatchLayout

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
    weight: ``sum(w_i)``.
    parts: each part's value (:mod:`ga_optax._src.algebra.parts`), in the
      order of :meth:`Weighting.carried`: the parts asked for (the noise
      scale's terms with ``noise_scale``), then the float8 state's
      combination for Flax variables with float8 state (``grads`` holds
      zeros there).
  """

  grads: Any
  value: jax.Array
  weight: jax.Array
  parts: tuple[Any, ...]

  def reduced(self, axes: axes_lib.Axes, parts_of: tuple[Part, ...]) -> Sums:
    """The sums over the devices of ``axes``, each part by its combine."""
    summed = jax.lax.psum(self._replace(parts=()), axes)
    return summed._replace(
      parts=tuple(
        parts.across_axes(value, part.combine, axes)
        for part, value in zip(parts_of, self.parts, strict=True)
      )
    )


class MicrobatchLoss(NamedTuple):
  """The loss of one micro-batch, and its gradient in the trained leaves.

  Attributes:
    fun: the loss, ``fun(params, microbatch, *args, **kwargs)``.
    has_aux: the loss returns ``(value, aux)``.
    remat: the loss runs under ``jax.checkpoint``.
    checkpoint_policy: the ``jax.checkpoint`` policy with ``remat``.
  """

  fun: Callable[..., Any]
  has_aux: bool
  remat: bool
  checkpoint_policy: Callable[..., bool] | None

  def value_and_grad(
    self,
    trainable: Trainable,
    microbatch: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    share: Any = None,
  ) -> tuple[Any, Any, Any]:
    """``(value, aux, grads)`` of ``fun`` on one micro-batch.

    ``aux`` is None without ``has_aux``; ``grads`` is a tree like
    ``trainable.diff``. With ``share``, the loss differentiated is ``fun``
    times ``share``, and the value and gradient returned are that one's.
    """

    def loss(diff: Any) -> Any:
      output = self.fun(trainable.params(diff), microbatch, *args, **kwargs)
      if share is None:
        return output
      if self.has_aux:
        return output[0] * share, output[1]
      return output * share

    if self.remat:
      loss = jax.checkpoint(loss, policy=self.checkpoint_policy)
    output, grads = jax.value_and_grad(loss, has_aux=self.has_aux)(
      trainable.diff
    )
    value, aux = output if self.has_aux else (output, None)
    return value, aux, grads


class Weighting(NamedTuple):
  """How micro-batches are weighed, summed into :class:`Sums` and averaged.

  Attributes:
    weight_fn: ``microbatch -> scalar weight``, or None for weight 1.
    accumulator_dtype: the floating dtype of the gradient sums.
    parts: the parts asked for beside the gradient (the noise scale's
      terms, with ``noise_scale``), each reporting when the sums close.
  """

  weight_fn: WeightFn | None
  accumulator_dtype: jnp.dtype
  parts: tuple[Part, ...] = ()

  def carried(self, diff: Any) -> tuple[Part, ...]:
    """The parts these sums carry, for the differentiated params ``diff``.

    The parts asked for, then float8's where ``diff`` holds float8 state.
    """
    start = fp8.split_variables(diff)[1]
    if start is None:
      return self.parts
    # Each micro-batch's loss is its share of the batch's: the window
    # sums the output-gradient amaxes instead of averaging them.
    return (
      *self.parts,
      fp8.Fp8Part(start, reduction="sum", scaled_to_share=True),
    )

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
      parts=tuple(part.zero() for part in self.carried(diff)),
    )

  def weight_of(self, microbatch: Any) -> jax.Array:
    """The micro-batch's weight, by the rule of :mod:`.weights`."""
    weight_dtype = dtypes.weight_dtype(self.accumulator_dtype)
    if self.weight_fn is None:
      return jnp.ones((), weight_dtype)
    weight = weights.check_returned(self.weight_fn(microbatch))
    return jnp.asarray(weight, weight_dtype)

  def add(
    self, sums: Sums, value: Any, grads: Any, weight: jax.Array, diff: Any
  ) -> Sums:
    """``sums`` with one micro-batch's value and gradient added, weighted."""
    # The float8 state's "gradient" is its new value: its part combines
    # it, and the gradient sums (and micro-gradients) hold zeros there.
    params_grads, latest = fp8.split_variables(grads)
    summed = fp8.join_variables(
      grads, params_grads, jax.tree.map(jnp.zeros_like, latest)
    )
    micro_batch = parts.MicroBatch.whole(grads, weight, micro_gradient=summed)
    new_parts = tuple(
      part.add(value, micro_batch)
      for part, value in zip(self.carried(diff), sums.parts, strict=True)
    )
    grads = summed
    factor = 1 if self.weight_fn is None else weight

    def add_term(total: jax.Array, term: jax.Array) -> jax.Array:
      return total + weights.weighted(term, factor, total.dtype)

    return Sums(
      grads=jax.tree.map(add_term, sums.grads, grads),
      value=add_term(sums.value, value),
      weight=sums.weight + weight,
      parts=new_parts,
    )

  def close(
    self, sums: Sums, diff: Any
  ) -> tuple[jax.Array, Any, tuple[Any, ...]]:
    """``(value, grads, reports)``: the means, grads in diff's dtypes.

    Weights that sum to 0 or less (a batch of padding only, or one whose
    traced negative weights outweigh the rest) give zeros, as such a window
    of ``accumulate`` does. ``reports``: what each carried part's close
    gives, in their order; none where the sums carry no parts.
    """
    scale = weights.reciprocal(sums.weight)
    mean = jax.tree.map(
      lambda total: total * scale.astype(total.dtype), sums.grads
    )
    closing = parts.Closing(mean, sums.weight.astype(jnp.float32))
    grads = jax.tree.map(
      lambda total, param: total.astype(jnp.result_type(param)), mean, diff
    )
    reports = []
    # Sums handed out unreduced carry no parts: a part needs every device.
    if sums.parts:
      for part, value in zip(self.carried(diff), sums.parts, strict=True):
        reports.append(part.close(value, closing))
        if isinstance(part, fp8.Fp8Part):
          # The float8 state's "gradient" is the large batch's new state.
          params_grads, _ = fp8.split_variables(grads)
          grads = fp8.join_variables(grads, params_grads, reports[-1])
    return sums.value * scale, grads, tuple(reports)


class Microbatching(NamedTuple):
  """A batch split into micro-batches, each's loss weighed into the sums.

  Attributes:
    loss: what each micro-batch computes.
    weighting: how the micro-batches' results are weighed and summed.
    num_microbatches: micro-batches per batch.
  """

  loss: MicrobatchLoss
  weighting: Weighting
  num_microbatches: int

  def sums(
    self,
    inputs: Inputs,
    varying_axes: axes_lib.Axes = (),
    device_axes: axes_lib.Axes = (),
  ) -> tuple[Sums, Any]:
    """The weighted sums over the micro-batches of ``inputs``' batch.

    ``varying_axes``: inside a ``jax.shard_map`` that checks varying axes,
    the manual axes the gradients vary over; the carry is cast to vary over
    them too, so that the scan keeps its type. ``device_axes``: the axes
    the batch is split over, whose devices' weights make the batch's.
    """
    layout, trainable = inputs.layout, inputs.trainable
    microbatches = batch_layout.split_microbatches(
      inputs.split, layout.split_axes, self.num_microbatches
    )
    initial = axes_lib.cast_to_varying(
      self.weighting.zeros(trainable.diff), varying_axes
    )
    batch_weight = None
    if fp8.split_variables(trainable.diff)[1] is not None:
      micro_weights = jax.lax.map(
        lambda split: self.weighting.weight_of(
          layout.rebuild(split, inputs.whole)
        ),
        microbatches,
      )
      batch_weight = jnp.sum(micro_weights)
      if device_axes:
        batch_weight = jax.lax.psum(batch_weight, device_axes)

    def scan_body(sums: Sums, xs: tuple[jax.Array, Any]) -> tuple[Sums, Any]:
      index, split = xs
      microbatch = layout.rebuild(split, inputs.whole)
      kwargs = dict(inputs.kwargs)
      if inputs.rng is not None:
        kwargs["rng"] = jax.random.fold_in(inputs.rng, index)
      weight = self.weighting.weight_of(microbatch)
      if batch_weight is None:
        value, aux, grads = self.loss.value_and_grad(
          trainable, microbatch, inputs.args, kwargs
        )
      else:
        # Float8 state: the loss's share of the batch's, so that its
        # backward pass quantises as the large batch's; scaled back after.
        share = jnp.where(weights.counts(weight), weight / batch_weight, 1.0)
        value, aux, grads = self.loss.value_and_grad(
          trainable, microbatch, inputs.args, kwargs, share
        )
        params_grads, latest = fp8.split_variables(grads)
        params_grads = jax.tree.map(
          lambda grad: grad / share.astype(grad.dtype), params_grads
        )
        grads = fp8.join_variables(grads, params_grads, latest)
        value = value / share
      sums = self.weighting.add(sums, value, grads, weight, trainable.diff)
      return sums, aux

    indices = jnp.arange(self.num_microbatches, dtype=jnp.int32)
    return jax.lax.scan(scan_body, initial, (indices, microbatches))
