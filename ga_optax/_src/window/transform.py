"""``accumulate`` and ``accumulate_and_apply``: arguments resolved to a window.

Both functions take the same arguments, check them the same way and keep
the same state; they differ only in what a call returns (updates, or new
params). :func:`ga_optax._src.window.arguments.resolve` turns the
arguments into a :class:`~ga_optax._src.window.window.Window`, and
:func:`emitting_updates` or :func:`applying_to_params` turns that into what
the caller holds: a window with one more part
(``dataclasses.replace(window, parts=...)``) becomes a transformation so,
with no edit here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from ga_optax._src.batch_size import every_k as every_k_lib
from ga_optax._src.window import arguments
from ga_optax._src.window.output import ApplyToParams, EmitUpdates
from ga_optax._src.window.state import AccumulateState
from ga_optax._src.window.window import Window


def accumulate(
  optimizer: optax.GradientTransformation,
  every_k: every_k_lib.EveryK,
  *,
  reduction: str = "mean",
  accumulator_dtype: DTypeLike = jnp.float32,
  skip_nonfinite: bool = False,
  axis_name: str | tuple[str, ...] | None = None,
  unreduced_axes: arguments.Axes | None = None,
  accumulator_memory_kind: str | None = None,
  inner_state_memory_kind: str | None = None,
  inner_state_axes: arguments.Axes | arguments.PartitionSpecTree | None = None,
  noise_scale_decay: float | None = None,
  lr_scaling: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates gradients of ``every_k`` micro-steps, then steps ``optimizer``.

  Each ``update`` call adds ``weight * grads`` to an accumulator and returns
  zero updates, until the call that closes the window: that one reduces the
  accumulator (``sum(w_i g_i) / sum(w_i)`` for ``"mean"``, ``sum(w_i g_i)``
  for ``"sum"``), runs ``optimizer`` on it once, returns its updates and
  leaves the accumulator at zero. With ``g_i`` the gradient of micro-batch
  ``i``'s mean loss and ``w_i`` its number of items, the emitted gradient is
  the gradient of the large batch's mean loss.

  ``update(grads, state, params, *, weight=1, flush=False, closing=None,
  fp8_state=None, **extra_args)``: ``weight`` is the micro-batch's (0 adds
  nothing, even a NaN gradient); ``flush=True`` closes the window now with
  what it holds; ``closing`` a bool (Python's or NumPy's; static under
  ``jax.jit``) says which side this call runs, as a training loop in
  Python knows (a program per side, no branch between them), None leaves
  it to the device's count; ``fp8_state`` is a Flax float8 model's new
  state (:func:`ga_optax.apply_gradients` passes it); other keywords go to
  ``optimizer.update`` when the window closes, but one that misspells
  these four (``wieght=``) is a ``TypeError``. Every argument and keyword
  in full: docs/accumulate.md.

  Args:
    optimizer: the optax transformation to apply once per window.
    every_k: micro-steps per window: an int, a jittable callable or a
      ``{update_step: k}`` dict of the applied-update count, or
      :func:`ga_optax.batch_size.adaptive_k`.
    reduction: ``"mean"`` (weighted mean, the default) or ``"sum"``
      (weighted sum).
    accumulator_dtype: floating dtype of the accumulator (float32).
    skip_nonfinite: drop whole a micro-step whose gradients are not finite
      (default False).
    axis_name: inside ``jax.shard_map`` or ``pmap``, the data-parallel axes
      whose devices accumulate locally and reduce once per window.
    unreduced_axes: under a plain ``jax.jit``, the mesh axes the gradients
      and the accumulator are ``unreduced`` over.
    accumulator_memory_kind: a memory kind to keep the accumulator in
      between calls (``"pinned_host"``); None: device memory.
    inner_state_memory_kind: the same for ``optimizer``'s state.
    inner_state_axes: with ``unreduced_axes``, mesh axes (or a tree of
      ``jax.sharding.PartitionSpec`` shaped like the params) to shard
      ``optimizer``'s state over (ZeRO stage 1).
    noise_scale_decay: None, or a decay in [0, 1) to measure the gradient
      noise scale (:func:`ga_optax.noise_scale`).
    lr_scaling: None, ``"sqrt"`` or ``"linear"``: how the updates follow k.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`AccumulateState`.

  Raises:
    TypeError, ValueError: an argument, or a call's ``grads``, state,
      ``weight``, ``flush``, ``closing`` or a misspelt keyword, that the
      window cannot take; the message names it (docs/accumulate.md lists
      them).

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.accumulate(optax.sgd(0.1), every_k=2)
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.full(3, 1.0)}, state, params)
    >>> updates["w"], bool(ga_optax.emitted(state))
    (Array([0., 0., 0.], dtype=float32), False)
    >>> updates, state = tx.update({"w": jnp.full(3, 4.0)}, state, params)
    >>> updates["w"], bool(ga_optax.emitted(state))
    (Array([-0.25, -0.25, -0.25], dtype=float32), True)
  """
  window = arguments.resolve(
    optimizer,
    every_k,
    EmitUpdates(),
    reduction=reduction,
    accumulator_dtype=accumulator_dtype,
    skip_nonfinite=skip_nonfinite,
    axis_name=axis_name,
    unreduced_axes=unreduced_axes,
    accumulator_memory_kind=accumulator_memory_kind,
    inner_state_memory_kind=inner_state_memory_kind,
    inner_state_axes=inner_state_axes,
    noise_scale_decay=noise_scale_decay,
    lr_scaling=lr_scaling,
  )
  return emitting_updates(window)


def emitting_updates(window: Window) -> optax.GradientTransformationExtraArgs:
  """The transformation of ``window``, whose output strategy emits updates."""
  step = arguments.compiled_step(window)

  def update_fn(
    updates: optax.Updates,
    state: AccumulateState,
    params: optax.Params | None = None,
    *,
    weight: Any = 1,
    flush: Any = False,
    closing: bool | None = None,
    fp8_state: Any = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, AccumulateState]:
    return step(
      updates,
      state,
      params,
      weight=weight,
      flush=flush,
      closing=closing,
      fp8_state=fp8_state,
      extra_args=extra_args,
    )

  return optax.GradientTransformationExtraArgs(
    arguments.initializer(window), update_fn
  )


class FusedApplyFn(Protocol):
  """Signature of :attr:`FusedAccumulation.apply`."""

  def __call__(
    self,
    params: optax.Params,
    grads: optax.Updates,
    state: AccumulateState,
    *,
    weight: Any = 1,
    flush: Any = False,
    closing: bool | None = None,
    fp8_state: Any = None,
    **extra_args: Any,
  ) -> tuple[optax.Params, AccumulateState]: ...


class FusedAccumulation(NamedTuple):
  """What :func:`accumulate_and_apply` returns.

  Attributes:
    init: ``params -> AccumulateState``, the same state that
      :func:`ga_optax.accumulate` keeps.
    apply: ``(params, grads, state, *, weight=1, flush=False,
      closing=None, fp8_state=None, **extra_args) -> (new_params,
      new_state)``; the params
      change only on the call that closes a window.
  """

  init: Callable[[optax.Params], AccumulateState]
  apply: FusedApplyFn


def accumulate_and_apply(
  optimizer: optax.GradientTransformation,
  every_k: every_k_lib.EveryK,
  *,
  reduction: str = "mean",
  accumulator_dtype: DTypeLike = jnp.float32,
  skip_nonfinite: bool = False,
  axis_name: str | tuple[str, ...] | None = None,
  unreduced_axes: arguments.Axes | None = None,
  accumulator_memory_kind: str | None = None,
  inner_state_memory_kind: str | None = None,
  inner_state_axes: arguments.Axes | arguments.PartitionSpecTree | None = None,
  noise_scale_decay: float | None = None,
  lr_scaling: str | None = None,
) -> FusedAccumulation:
  """Gradient accumulation that updates the params itself, in one call.

  ``apply(params, grads, state)`` equals ``updates, state = tx.update(grads,
  state, params)`` followed by ``optax.apply_updates(params, updates)`` with
  ``tx = ga_optax.accumulate(optimizer, every_k, ...)`` (same arguments, same
  state, same ``weight=``, ``flush=``, ``closing=`` and extra keyword
  arguments), but the
  params are updated by the side of the window that runs ``optimizer``: a
  micro-step that does not close the window leaves the params untouched (in
  place when they are donated to ``jax.jit``) instead of adding zero updates
  to them.

  Prefer it to ``accumulate`` in a hand-written train step that owns its
  params (memory-bound models, where reading and writing the params is a
  large share of a micro-step). Keep ``accumulate`` where a
  ``GradientTransformation`` is required: inside ``optax.chain``, with
  Flax ``TrainState.apply_gradients`` or ``nnx.Optimizer``.

  Args:
    optimizer: the optax transformation to apply once per window.
    every_k: micro-steps per window, as for :func:`ga_optax.accumulate`.
    reduction: as for :func:`ga_optax.accumulate` (``"mean"`` or
      ``"sum"``).
    accumulator_dtype: as for :func:`ga_optax.accumulate` (float32).
    skip_nonfinite: as for :func:`ga_optax.accumulate` (False).
    axis_name: as for :func:`ga_optax.accumulate` (``shard_map``, ``pmap``).
    unreduced_axes: as for :func:`ga_optax.accumulate` (plain ``jit``).
    accumulator_memory_kind: as for :func:`ga_optax.accumulate`.
    inner_state_memory_kind: as for :func:`ga_optax.accumulate`; the
      optimizer's state then visits the device only in the call that closes
      a window.
    inner_state_axes: as for :func:`ga_optax.accumulate` (ZeRO stage 1).
    noise_scale_decay: as for :func:`ga_optax.accumulate`.
    lr_scaling: as for :func:`ga_optax.accumulate`.

  Returns:
    A :class:`FusedAccumulation` ``(init, apply)``.

  Raises:
    TypeError, ValueError: as :func:`ga_optax.accumulate`, for the same
      arguments.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> fused = ga_optax.accumulate_and_apply(optax.sgd(0.1), every_k=2)
    >>> params = {"w": jnp.ones(3)}
    >>> state = fused.init(params)
    >>> params, state = fused.apply(params, {"w": jnp.full(3, 1.0)}, state)
    >>> params["w"]
    Array([1., 1., 1.], dtype=float32)
    >>> params, state = fused.apply(params, {"w": jnp.full(3, 4.0)}, state)
    >>> params["w"], bool(ga_optax.emitted(state))
    (Array([0.75, 0.75, 0.75], dtype=float32), True)
  """
  window = arguments.resolve(
    optimizer,
    every_k,
    ApplyToParams(),
    reduction=reduction,
    accumulator_dtype=accumulator_dtype,
    skip_nonfinite=skip_nonfinite,
    axis_name=axis_name,
    unreduced_axes=unreduced_axes,
    accumulator_memory_kind=accumulator_memory_kind,
    inner_state_memory_kind=inner_state_memory_kind,
    inner_state_axes=inner_state_axes,
    noise_scale_decay=noise_scale_decay,
    lr_scaling=lr_scaling,
  )
  return applying_to_params(window)


def applying_to_params(window: Window) -> FusedAccumulation:
  """The fused accumulation of ``window``, whose output applies to params."""
  step = arguments.compiled_step(window)

  def apply_fn(
    params: optax.Params,
    grads: optax.Updates,
    state: AccumulateState,
    *,
    weight: Any = 1,
    flush: Any = False,
    closing: bool | None = None,
    fp8_state: Any = None,
    **extra_args: Any,
  ) -> tuple[optax.Params, AccumulateState]:
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

  return FusedAccumulation(init=arguments.initializer(window), apply=apply_fn)
