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
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypedDict, TypeVar, Unpack

import jax.numpy as jnp
import optax

from ga_optax._src import eager, validation
from ga_optax._src import placements as parallel
from ga_optax._src.algebra import fp8, noise_scale, parts, weights
from ga_optax._src.batch_size import adaptive
from ga_optax._src.batch_size import every_k as every_k_lib
from ga_optax._src.mixed_precision import loss_scaling, precision
from ga_optax._src.placements import residency
from ga_optax._src.window import micro_step
from ga_optax._src.window.output import ApplyToParams, EmitUpdates
from ga_optax._src.window.state import AccumulateState
from ga_optax._src.window.window import Window

Entry = TypeVar("Entry", bound=Callable[..., Any])


class WindowOptions(TypedDict, total=False):
  """The keywords of ``accumulate``, which ``accumulate_and_apply`` takes too.

  Each is written here once; their meanings: :func:`ga_optax.accumulate`
  and docs/accumulate.md. A keyword not given takes its value in
  :data:`DEFAULTS`, or None.
  """

  reduction: str
  accumulator_dtype: Any
  skip_nonfinite: bool
  axis_name: Any
  unreduced_axes: Any
  accumulator_memory_kind: str | None
  inner_state_memory_kind: str | None
  inner_state_axes: Any
  noise_scale_decay: float | None
  lr_scaling: str | None


# The keywords whose default is not None.
DEFAULTS: WindowOptions = {
  "reduction": "mean",
  "accumulator_dtype": jnp.float32,
  "skip_nonfinite": False,
}


def showing_window_options(entry: Entry) -> Entry:
  """``entry(optimizer, every_k, **options)``, its keywords shown in full.

  Its signature (``help``, ``inspect.signature``, an editor's hints) lists
  every keyword of :class:`WindowOptions` with its default.
  """
  signature = inspect.signature(entry)
  positional = [
    parameter
    for parameter in signature.parameters.values()
    if parameter.kind != inspect.Parameter.VAR_KEYWORD
  ]
  keywords = [
    inspect.Parameter(
      name,
      inspect.Parameter.KEYWORD_ONLY,
      default=DEFAULTS.get(name),
      annotation=annotation,
    )
    for name, annotation in typing.get_type_hints(WindowOptions).items()
  ]
  entry.__signature__ = signature.replace(  # type: ignore[attr-defined]
    parameters=[*positional, *keywords]
  )
  return entry


def resolve(
  optimizer: Any,
  every_k: Any,
  output: EmitUpdates | ApplyToParams,
  **options: Unpack[WindowOptions],
) -> Window:
  """Checks :func:`accumulate`'s arguments; returns the window they ask for."""
  given = _given(output, options)
  skip_nonfinite = given.get("skip_nonfinite")
  if not isinstance(skip_nonfinite, bool):
    raise TypeError(f"skip_nonfinite must be a bool, got {skip_nonfinite!r}.")
  reduction = validation.check_reduction(given.get("reduction"))
  decay = noise_scale.check_decay(given.get("noise_scale_decay"))
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
  accumulator_dtype = validation.check_accumulator_dtype(
    given.get("accumulator_dtype")
  )
  # Points at the user's call of accumulate or accumulate_and_apply.
  precision.warn_if_accumulator_too_narrow(
    accumulator_dtype, every_k, stacklevel=3
  )
  placement = parallel.resolve(
    given.get("axis_name"),
    given.get("unreduced_axes"),
    given.get("inner_state_axes"),
  )
  accumulator_home, inner_state_home = _homes(given, placement)
  return Window(
    inner=validation.check_optimizer(optimizer),
    window_length=window_length,
    lr_scaling=adaptive.LearningRateScaling.of(given.get("lr_scaling")),
    reduction=reduction,
    accumulator_dtype=accumulator_dtype,
    skip_nonfinite=skip_nonfinite,
    parallel=placement,
    accumulator_home=accumulator_home,
    inner_state_home=inner_state_home,
    output=output,
    parts=window_parts(decay, reduction),
  )


def _given(
  output: EmitUpdates | ApplyToParams, options: WindowOptions
) -> WindowOptions:
  """``options`` over :data:`DEFAULTS`; a keyword not in them is refused."""
  unknown = sorted(set(options) - set(WindowOptions.__annotations__))
  if unknown:
    raise TypeError(
      f"{output.entry}() got an unexpected keyword argument {unknown[0]!r};"
      f" its keywords are {', '.join(WindowOptions.__annotations__)}."
    )
  return {**DEFAULTS, **options}


def _homes(
  given: WindowOptions, placement: Any
) -> tuple[residency.Residency, residency.Residency]:
  """Where the accumulator and the optimizer's state are kept between calls."""
  axis_name = given.get("axis_name")
  # Where jax.grad through state kept in host memory fails inside JAX:
  # shard_map's transpose hands back device-memory cotangents for its
  # host-memory operands, and the cotangent of an accumulator typed
  # unreduced comes back unreduced, not reduced, through the move to host.
  in_shard_map = partial_sums = None
  if axis_name is not None:
    in_shard_map = f"jax.shard_map (axis_name={axis_name!r})"
  if placement.unreduced_axes:
    partial_sums = f"unreduced_axes={given.get('unreduced_axes')!r}"
  accumulator_home = residency.Residency(
    residency.check_memory_kind(
      given.get("accumulator_memory_kind"), "accumulator_memory_kind"
    ),
    field="accumulator",
    argument="accumulator_memory_kind",
    refused_in_reverse_mode=in_shard_map or partial_sums,
    refused_under_a_mesh=not residency.MESH_DIFFERENTIATES_HOST_STATE,
  )
  inner_state_home = residency.Residency(
    residency.check_memory_kind(
      given.get("inner_state_memory_kind"), "inner_state_memory_kind"
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
