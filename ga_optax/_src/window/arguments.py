"""The arguments of ``accumulate``, checked and resolved into a window.

:func:`resolve` chooses each strategy of a
:class:`~ga_optax._src.window.window.Window` once: where the window lives
across devices (:func:`ga_optax._src.placements.resolve`), where the
accumulator and the optimizer state are kept
(:class:`~ga_optax._src.placements.residency.Residency`), the output, and
the parts it sums beside the gradient. :func:`initializer` and
:func:`compiled_step` are the window's ``init`` and ``update`` as
``accumulate`` and ``accumulate_and_apply`` hand them out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from ga_optax._src import eager, placements, validation
from ga_optax._src.algebra import fp8, noise_scale, parts, weights
from ga_optax._src.batch_size import adaptive
from ga_optax._src.batch_size import every_k as every_k_lib
from ga_optax._src.mixed_precision import loss_scaling, precision
from ga_optax._src.placements import residency
from ga_optax._src.window import micro_step, schedule
from ga_optax._src.window.output import ApplyToParams, EmitUpdates
from ga_optax._src.window.state import AccumulateState
from ga_optax._src.window.window import Window

# The mesh axes an argument names: one name, or several.
Axes = str | Sequence[str]
# A tree of jax.sharding.PartitionSpec shaped like the params.
PartitionSpecTree = Any


def resolve(
  optimizer: Any,
  every_k: Any,
  output: EmitUpdates | ApplyToParams,
  *,
  reduction: str,
  accumulator_dtype: DTypeLike,
  skip_nonfinite: bool,
  axis_name: str | tuple[str, ...] | None,
  unreduced_axes: Axes | None,
  accumulator_memory_kind: str | None,
  inner_state_memory_kind: str | None,
  inner_state_axes: Axes | PartitionSpecTree | None,
  noise_scale_decay: float | None,
  lr_scaling: str | None,
) -> Window:
  """Checks :func:`accumulate`'s arguments; returns the window they ask for.

  Each keyword is :func:`ga_optax.accumulate`'s, given explicitly: the
  defaults are written in the two public signatures alone.
  """
  if not isinstance(skip_nonfinite, bool):
    raise TypeError(f"skip_nonfinite must be a bool, got {skip_nonfinite!r}.")
  reduction = validation.check_reduction(reduction)
  decay = noise_scale.check_decay(noise_scale_decay)
  if decay is not None and reduction != "mean":
    raise ValueError(
      "noise_scale_decay measures the spread of the micro-gradients around"
      " their weighted mean, which reduction='mean' emits; got"
      f" reduction={reduction!r}."
    )
  window_length = every_k_lib.as_window_length(every_k)
  if isinstance(window_length, adaptive.AdaptiveK) and decay is None:
    raise ValueError(
      "every_k=ga_optax.batch_size.adaptive_k(...) follows the measured"
      " gradient noise scale: pass noise_scale_decay too (for example"
      " noise_scale_decay=0.95, averaging over about 20 windows)."
    )
  accumulator_dtype = validation.check_accumulator_dtype(accumulator_dtype)
  # Points at the user's call of accumulate or accumulate_and_apply.
  precision.warn_if_accumulator_too_narrow(
    accumulator_dtype, every_k, stacklevel=3
  )
  placement = placements.resolve(axis_name, unreduced_axes, inner_state_axes)
  accumulator_home, inner_state_home = _homes(
    placement,
    axis_name=axis_name,
    unreduced_axes=unreduced_axes,
    accumulator_memory_kind=accumulator_memory_kind,
    inner_state_memory_kind=inner_state_memory_kind,
  )
  return Window(
    inner=validation.check_optimizer(optimizer),
    window_length=window_length,
    lr_scaling=adaptive.LearningRateScaling.of(lr_scaling),
    reduction=reduction,
    accumulator_dtype=accumulator_dtype,
    skip_nonfinite=skip_nonfinite,
    placement=placement,
    accumulator_home=accumulator_home,
    inner_state_home=inner_state_home,
    output=output,
    parts=window_parts(decay, reduction),
  )


def _homes(
  placement: Any,
  *,
  axis_name: Any,
  unreduced_axes: Any,
  accumulator_memory_kind: Any,
  inner_state_memory_kind: Any,
) -> tuple[residency.Residency, residency.Residency]:
  """Where the accumulator and the optimizer's state are kept between calls."""
  # Where jax.grad through state kept in host memory fails inside JAX:
  # shard_map's transpose hands back device-memory cotangents for its
  # host-memory operands, and the cotangent of an accumulator typed
  # unreduced comes back unreduced, not reduced, through the move to host.
  in_shard_map = partial_sums = None
  if axis_name is not None:
    in_shard_map = f"jax.shard_map (axis_name={axis_name!r})"
  if placement.unreduced_axes:
    partial_sums = f"unreduced_axes={unreduced_axes!r}"
  accumulator_home = residency.Residency(
    residency.check_memory_kind(
      accumulator_memory_kind, "accumulator_memory_kind"
    ),
    field="accumulator",
    argument="accumulator_memory_kind",
    refused_in_reverse_mode=in_shard_map or partial_sums,
    refused_under_a_mesh=not residency.MESH_DIFFERENTIATES_HOST_STATE,
  )
  inner_state_home = residency.Residency(
    residency.check_memory_kind(
      inner_state_memory_kind, "inner_state_memory_kind"
    ),
    field="inner_state",
    argument="inner_state_memory_kind",
    refused_in_reverse_mode=in_shard_map,
  )
  return accumulator_home, inner_state_home


def window_parts(
  decay: float | None, reduction: str
) -> tuple[parts.WindowPart, ...]:
  """What the window sums beside the gradient, in the state's order.

  The noise scale's terms where a decay is given; a Flax model's float8
  state, whose value is None (no leaves) for any other model.
  """
  # Measured in the gradients' own units: a wrapped loss scale's removed.
  units = loss_scaling.gradient_units
  measured = () if decay is None else (noise_scale.Measured(decay, units),)
  return (*measured, fp8.Fp8WindowPart(reduction))


def initializer(window: Window) -> Callable[[optax.Params], AccumulateState]:
  """``window.init``, refusing what only the wrapped state shows.

  ``skip_nonfinite=True`` around
  :func:`ga_optax.mixed_precision.dynamic_loss_scale` is refused here: the
  optimizer is opaque until its state is made.
  """
  if not window.skip_nonfinite:
    return window.init

  def init_fn(params: optax.Params) -> AccumulateState:
    state = window.init(params)
    loss_scaling.refuse_skipped_overflows(state.inner_state)
    return state

  return init_fn


# The keywords of a call (``update``, ``apply``) that the window reads.
CALL_KEYWORDS = ("weight", "flush", "closing", "fp8_state")


def refuse_misspelt_keywords(
  output: EmitUpdates | ApplyToParams, extra_args: dict[str, Any]
) -> None:
  """Raises for an extra keyword that misspells one of :data:`CALL_KEYWORDS`.

  Extra keywords reach the wrapped optimizer only when the window closes,
  and optax's wrapper of a transformation without extra arguments drops
  them: a misspelt ``weight=`` would be ignored without a word. Any other
  extra keyword passes, as ``optax.chain`` hands every member all of them.

  Raises:
    TypeError: a keyword that Python's own rule takes for a misspelling of
      one of the window's (``wieght=``, ``closng=``, ``flsh=``).
  """
  for name in extra_args:
    intended = validation.misspelt(name, CALL_KEYWORDS)
    if intended is not None:
      raise TypeError(
        f"{output.entry}(...).{output.call}() got an unexpected keyword"
        f" argument {name!r}. Did you mean {intended!r}? Keywords other than"
        f" {', '.join(CALL_KEYWORDS)} reach the wrapped optimizer's update"
        " only when the window closes, where a transformation without"
        " extra arguments drops them; one this near the window's own is"
        " taken for a misspelling."
      )


def compiled_step(window: Window) -> Callable[..., tuple[Any, AccumulateState]]:
  """One ``update`` call of ``window``, compiled once per shapes when eager.

  Under a caller's ``jit`` it runs as written. Called eagerly, a concrete
  ``weight`` is checked first and passed as an array, so that micro-batches
  of different sizes share one compiled program.
  """
  step = eager.compiled_when_eager(functools.partial(micro_step.update, window))

  def checked_step(
    grads: Any,
    state: Any,
    params: Any,
    *,
    weight: Any,
    flush: Any,
    closing: Any,
    fp8_state: Any,
    extra_args: dict[str, Any],
  ) -> tuple[Any, AccumulateState]:
    refuse_misspelt_keywords(window.output, extra_args)
    # Read before the eager wrapper, which would trace a NumPy bool.
    closing = schedule.check_closing(closing)
    arrays = (grads, state, params, weight, flush, fp8_state, extra_args)
    if not eager.is_traced(arrays):
      # In the window's weight dtype: a Python int, a NumPy float and an
      # int32 array weight then share one compiled program.
      weight = jnp.asarray(weights.check(weight), window.weight_dtype)
    return step(
      grads,
      state,
      params,
      weight=weight,
      flush=flush,
      closing=closing,
      fp8_state=fp8_state,
      extra_args=extra_args,
    )

  return checked_step
