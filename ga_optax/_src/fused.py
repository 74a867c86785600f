"""The fused path: accumulate, and apply the update in the same call.

``accumulate`` is a ``GradientTransformation``, so every micro-step returns
updates (zeros until the window closes) that the caller adds to the params:
inside one ``jit`` XLA fuses the zeros into that add, but the params are
still read and written on every micro-step. ``accumulate_and_apply`` takes
the params instead and updates them inside the conditional that runs the
optimizer, so a micro-step only adds the gradient into the accumulator. It keeps the state
of ``accumulate``, with the same fields and meanings, and is built by the
same code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax.numpy as jnp
import optax

from ga_optax._src import accumulate as accumulate_lib
from ga_optax._src import every_k as every_k_lib


class FusedApplyFn(Protocol):
  """Signature of :attr:`FusedAccumulation.apply`."""

  def __call__(
    self,
    params: optax.Params,
    grads: optax.Updates,
    state: accumulate_lib.AccumulateState,
    *,
    weight: Any = 1,
    flush: Any = False,
    **extra_args: Any,
  ) -> tuple[optax.Params, accumulate_lib.AccumulateState]: ...


class FusedAccumulation(NamedTuple):
  """What :func:`accumulate_and_apply` returns.

  Attributes:
    init: ``params -> AccumulateState``, the same state that
      :func:`ga_optax.accumulate` keeps.
    apply: ``(params, grads, state, *, weight=1, flush=False, **extra_args)
      -> (new_params, new_state)``; the params change only on the call that
      closes a window.
  """

  init: Callable[[optax.Params], accumulate_lib.AccumulateState]
  apply: FusedApplyFn


def accumulate_and_apply(
  optimizer: optax.GradientTransformation,
  every_k: every_k_lib.EveryK,
  *,
  reduction: str = "mean",
  accumulator_dtype: Any = jnp.float32,
  skip_nonfinite: bool = False,
  axis_name: Any = None,
  unreduced_axes: Any = None,
  accumulator_memory_kind: str | None = None,
  inner_state_memory_kind: str | None = None,
  inner_state_axes: Any = None,
) -> FusedAccumulation:
  """Gradient accumulation that updates the params itself, in one call.

  ``apply(params, grads, state)`` equals ``updates, state = tx.update(grads,
  state, params)`` followed by ``optax.apply_updates(params, updates)`` with
  ``tx = ga_optax.accumulate(optimizer, every_k, ...)`` (same arguments, same
  state, same ``weight=``, ``flush=`` and extra keyword arguments), but the
  params are updated inside the conditional that runs ``optimizer``: a
  micro-step that does not close the window hands the params back untouched
  (in place when they are donated to ``jax.jit``) instead of adding zero
  updates to them.

  Prefer it to ``accumulate`` in a hand-written train step that owns its
  params (memory-bound models, where reading and writing the params is a
  large share of a micro-step). Keep ``accumulate`` where a
  ``GradientTransformation`` is required: inside ``optax.chain``, with
  Flax ``TrainState.apply_gradients`` or ``nnx.Optimizer``.

  Args:
    optimizer: the optax transformation to apply once per window.
    every_k: micro-steps per window, as for :func:`ga_optax.accumulate`.
    reduction: ``"mean"`` (weighted mean) or ``"sum"`` (weighted sum).
    accumulator_dtype: floating dtype of the accumulator.
    skip_nonfinite: drop micro-steps whose gradients hold NaN or Inf.
    axis_name: the data-parallel axis inside ``jax.shard_map`` or ``pmap``.
    unreduced_axes: under a plain ``jax.jit``, the Explicit mesh axes the
      gradients are unreduced over, as for :func:`ga_optax.accumulate`.
    accumulator_memory_kind: a memory kind to keep the accumulator in
      between calls, for example ``"pinned_host"``, as for
      :func:`ga_optax.accumulate`: each call brings it to the device only to
      add the gradient.
    inner_state_memory_kind: a memory kind to keep ``optimizer``'s state
      in; it visits the device only in the call that closes a window.
    inner_state_axes: with ``unreduced_axes``, the mesh axes (or a tree of
      specs) to shard ``optimizer``'s state over, as for
      :func:`ga_optax.accumulate`.

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
  window = accumulate_lib.make_window(
    optimizer,
    every_k,
    reduction=reduction,
    accumulator_dtype=accumulator_dtype,
    skip_nonfinite=skip_nonfinite,
    axis_name=axis_name,
    unreduced_axes=unreduced_axes,
    accumulator_memory_kind=accumulator_memory_kind,
    inner_state_memory_kind=inner_state_memory_kind,
    inner_state_axes=inner_state_axes,
  )
  step = accumulate_lib.compiled_step(window, apply_to_params=True)

  def apply_fn(
    params: optax.Params,
    grads: optax.Updates,
    state: accumulate_lib.AccumulateState,
    *,
    weight: Any = 1,
    flush: Any = False,
    **extra_args: Any,
  ) -> tuple[optax.Params, accumulate_lib.AccumulateState]:
    return step(
      grads, state, params, weight=weight, flush=flush, extra_args=extra_args
    )

  return FusedAccumulation(init=window.init, apply=apply_fn)
