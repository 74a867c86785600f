"""Gradient accumulation as an Optax ``GradientTransformation``.

``accumulate`` wraps an optimizer so that k calls of ``update`` (one per
micro-batch) add their gradients into an accumulator and emit zero updates;
the call that closes the window hands the reduced gradient to the wrapped
optimizer, once. The wrapped optimizer is evaluated under ``lax.cond`` only on
that call, so on the other micro-steps it costs nothing and its counters and
schedules do not move.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ga_optax._src import distributed, validation
from ga_optax._src import every_k as every_k_lib


class AccumulateState(NamedTuple):
  """State of :func:`accumulate`: a plain pytree that jits and checkpoints.

  Attributes:
    micro_step: int32, micro-steps held by the open window (0 right after a
      window closes).
    update_step: int32, updates the inner optimizer has applied; the
      argument of a callable or dict ``every_k``.
    num_skipped: int32, non-finite micro-steps dropped by
      ``skip_nonfinite=True`` over the whole run.
    emitted: bool, whether the last ``update`` call ran the inner optimizer
      (see :func:`emitted`).
    weight_sum: sum of the weights of the micro-steps in the open window.
    accumulator: sum of ``weight * grads`` over the open window, in
      ``accumulator_dtype``, with the tree of the params. Meaningful only
      while ``micro_step > 0``: the first micro-step of a window overwrites
      it instead of adding, so closing a window need not zero it, and the
      closing call reuses its buffer to carry the updates (see
      :func:`accumulate`).
    inner_state: the wrapped optimizer's state.
  """

  micro_step: jax.Array
  update_step: jax.Array
  num_skipped: jax.Array
  emitted: jax.Array
  weight_sum: jax.Array
  accumulator: optax.Updates
  inner_state: optax.OptState


def _increment_if(count: jax.Array, condition: jax.Array) -> jax.Array:
  """Adds one where ``condition`` holds, saturating at the int32 maximum."""
  limit = jnp.iinfo(count.dtype).max
  return jnp.where(condition & (count < limit), count + 1, count)


def _all_finite(tree: Any) -> jax.Array:
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.asarray(True)
  return jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]).all()


def _window_functions(
  optimizer: optax.GradientTransformation,
  every_k: every_k_lib.EveryK,
  *,
  reduction: str,
  accumulator_dtype: Any,
  skip_nonfinite: bool,
  axis_name: Any,
) -> tuple[Callable[..., AccumulateState], Callable[..., Any]]:
  """Checks the arguments; returns the init function and the micro-step.

  Shared by :func:`accumulate` and the fused path, so both take the same
  arguments, raise the same errors and keep the same state.

  The micro-step returns the updates (``apply_to_params=False``, the
  ``GradientTransformation`` path) or, for the fused path, the new params
  with the updates applied inside the closing branch.

  How buffers flow decides the cost (see docs/benchmarks.md): the gradient is
  added into the accumulator outside any conditional, in place, and the
  first micro-step of a window overwrites instead of adding, so no call
  spends a pass zeroing it. One conditional takes the inner state (and, on
  the fused path, the params) as operands that the open branch hands back
  untouched, so XLA aliases them with no copy. On the transformation path
  its first output carries, through the accumulator's own buffer, the
  accumulator (open branch) or the updates (closing branch): updates leaving
  a conditional must live in some buffer, and the window's sum is no longer
  needed once the optimizer has read it. Outside the conditional a select
  turns that output into zeros or updates, which XLA fuses into the
  caller's ``apply_updates``.
  """
  inner = validation.check_optimizer(optimizer)
  schedule = every_k_lib.as_schedule(every_k)
  reduction = validation.check_reduction(reduction)
  accumulator_dtype = validation.check_accumulator_dtype(accumulator_dtype)
  axis_name = validation.check_axis_name(axis_name)
  if not isinstance(skip_nonfinite, bool):
    raise TypeError(f"skip_nonfinite must be a bool, got {skip_nonfinite!r}.")
  # Weight sums count tokens; bfloat16 would round them from 256 on.
  weight_dtype = jnp.promote_types(accumulator_dtype, jnp.float32)

  def init_fn(params: optax.Params) -> AccumulateState:
    return AccumulateState(
      micro_step=jnp.zeros((), jnp.int32),
      update_step=jnp.zeros((), jnp.int32),
      num_skipped=jnp.zeros((), jnp.int32),
      emitted=jnp.zeros((), jnp.bool_),
      weight_sum=jnp.zeros((), weight_dtype),
      accumulator=optax.tree.zeros_like(params, dtype=accumulator_dtype),
      inner_state=inner.init(params),
    )

  def window_step(
    grads: optax.Updates,
    state: AccumulateState,
    params: optax.Params | None,
    *,
    weight: Any,
    flush: Any,
    extra_args: dict[str, Any],
    apply_to_params: bool,
  ) -> tuple[Any, AccumulateState]:
    if not isinstance(state, AccumulateState):
      raise TypeError(
        "state must be the AccumulateState made by this transformation's"
        " init (or restored into its structure), got"
        f" {type(state).__name__}."
      )
    validation.check_grads_match(grads, state.accumulator)
    weight = validation.check_weight(weight)
    flush = validation.check_flush(flush)

    weight_sum = state.weight_sum + jnp.asarray(weight, weight_dtype)
    accepted = jnp.asarray(True)
    if skip_nonfinite:
      accepted = _all_finite(grads)
      if axis_name is not None:
        accepted = jax.lax.pmin(accepted.astype(jnp.int32), axis_name) > 0
      weight_sum = jnp.where(accepted, weight_sum, state.weight_sum)

    micro_step = _increment_if(state.micro_step, accepted)
    closes = (micro_step >= schedule(state.update_step)) | flush
    # Without a device axis the window's weight is known here, so an empty
    # window (a flush with no weight) takes the open branch and the closing
    # branch needs no nested conditional (which would need its own output
    # buffers); the mean is also formed here, by the same loop that adds the
    # gradient, so the optimizer reads it from the accumulator's buffer.
    local = axis_name is None
    steps = closes & (weight_sum > 0) if local else closes
    scale = jnp.ones((), accumulator_dtype)
    if local and reduction == "mean":
      scale = jnp.where(steps, 1.0 / jnp.where(steps, weight_sum, 1.0), 1.0)
      scale = scale.astype(accumulator_dtype)

    restarts = state.micro_step == 0

    def add_grad(total: jax.Array, grad: jax.Array) -> jax.Array:
      # A select, not a multiply: a stale buffer may hold anything, NaN too.
      kept = jnp.where(restarts, jnp.zeros((), total.dtype), total)
      added = kept + _weighted(grad, weight, accumulator_dtype)
      if skip_nonfinite:
        added = jnp.where(accepted, added, total)
      if local and reduction == "mean":
        added = added * scale
      return added

    accumulator = jax.tree.map(add_grad, state.accumulator, grads)

    inner_updates_shape = jax.eval_shape(
      lambda: inner.update(grads, state.inner_state, params, **extra_args)[0]
    )
    # The updates ride in the accumulator's buffer when every leaf converts
    # to the accumulator's dtype and back exactly (bfloat16 updates in a
    # float32 accumulator do); otherwise the open branch writes zeros.
    carries_updates = not apply_to_params and _fits_exactly(
      inner_updates_shape, state.accumulator
    )

    def unchanged(params, accumulator, inner_state):
      if apply_to_params:
        return params, inner_state, jnp.asarray(False)
      if carries_updates:
        return accumulator, inner_state, jnp.asarray(False)
      zeros = optax.tree.zeros_like(inner_updates_shape)
      return zeros, inner_state, jnp.asarray(False)

    def close_window(params, accumulator, inner_state):
      accumulator, total_weight = distributed.sum_across_devices(
        (accumulator, weight_sum), axis_name
      )
      if not local and reduction == "mean":
        # The guard keeps a window without weight from computing 0 / 0; such
        # a window does not step the inner optimizer anyway.
        device_scale = 1.0 / jnp.where(total_weight > 0, total_weight, 1.0)
        accumulator = jax.tree.map(
          lambda total: total * device_scale.astype(total.dtype), accumulator
        )
      reduced = jax.tree.map(
        lambda total, g: total.astype(g.dtype), accumulator, grads
      )

      def step_inner(params, inner_state):
        new_updates, new_inner_state = inner.update(
          reduced, inner_state, params, **extra_args
        )
        if apply_to_params:
          new_updates = optax.apply_updates(params, new_updates)
        elif carries_updates:
          new_updates = jax.tree.map(
            lambda update, slot: update.astype(slot.dtype),
            new_updates,
            accumulator,
          )
        return new_updates, new_inner_state, jnp.asarray(True)

      if local:
        return step_inner(params, inner_state)
      # Only here is the window's total weight known: a nested conditional
      # (with its own output buffers) keeps an empty window from stepping.
      return jax.lax.cond(
        total_weight > 0,
        step_inner,
        lambda params, inner_state: unchanged(params, accumulator, inner_state),
        params,
        inner_state,
      )

    output, inner_state, stepped = jax.lax.cond(
      steps,
      close_window,
      unchanged,
      params,
      accumulator,
      state.inner_state,
    )
    new_state = AccumulateState(
      micro_step=jnp.where(closes, 0, micro_step),
      update_step=_increment_if(state.update_step, stepped),
      num_skipped=_increment_if(state.num_skipped, ~accepted),
      emitted=stepped,
      weight_sum=jnp.where(closes, jnp.zeros_like(weight_sum), weight_sum),
      accumulator=output if carries_updates else accumulator,
      inner_state=inner_state,
    )
    if carries_updates:
      output = jax.tree.map(
        lambda carried, like: jnp.where(
          stepped, carried.astype(like.dtype), jnp.zeros((), like.dtype)
        ),
        output,
        inner_updates_shape,
      )
    return output, new_state

  return init_fn, window_step


def _fits_exactly(updates_shape: Any, accumulator: Any) -> bool:
  """Whether every updates leaf round-trips exactly through its accumulator slot."""
  updates_tree: Any = jax.tree.structure(updates_shape)
  if updates_tree != jax.tree.structure(accumulator):
    return False
  return all(
    update.shape == slot.shape
    and jnp.promote_types(update.dtype, slot.dtype) == slot.dtype
    for update, slot in zip(
      jax.tree.leaves(updates_shape), jax.tree.leaves(accumulator), strict=True
    )
  )


def _weighted(grad: jax.Array, weight: Any, dtype: Any) -> jax.Array:
  """``weight * grad`` in ``dtype``: a plain cast for weight 1, zeros for 0."""
  grad = grad.astype(dtype)
  if isinstance(weight, (int, float)) and weight == 1:
    return grad
  weight = jnp.asarray(weight, dtype)
  # A micro-batch of weight 0 (all padding, say) must add nothing, even
  # though the gradient of its mean loss is 0 / 0 = NaN: 0 * NaN is NaN.
  return jnp.where(weight == 0, 0, weight * grad)


def accumulate(
  optimizer: optax.GradientTransformation,
  every_k: every_k_lib.EveryK,
  *,
  reduction: str = "mean",
  accumulator_dtype: Any = jnp.float32,
  skip_nonfinite: bool = False,
  axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates gradients over ``every_k`` micro-steps, then steps ``optimizer``.

  Each ``update`` call adds ``weight * grads`` to an accumulator and returns
  zero updates, until the call that closes the window: that one reduces the
  accumulator (``sum(w_i g_i) / sum(w_i)`` for ``"mean"``, ``sum(w_i g_i)``
  for ``"sum"``), runs ``optimizer`` on it once, returns its updates and
  resets the window. With ``g_i`` the gradient of micro-batch ``i``'s mean
  loss and ``w_i`` its number of items, the emitted gradient is exactly the
  gradient of the large batch's mean loss.

  ``update`` takes, besides ``updates, state, params``:

  * ``weight``: a scalar >= 0 for this micro-batch (default 1), a Python
    number or an array of any integer or floating dtype, traced or not. A
    micro-step of weight 0 adds nothing, even where its gradient is NaN (the
    mean loss of an all-padding micro-batch); it counts toward k unless
    ``skip_nonfinite`` drops it. A concrete weight is checked; a traced one
    cannot be and is used as given, so a negative traced weight subtracts
    its micro-batch. A window whose weights sum to 0 or less emits zeros and
    does not step ``optimizer``.
  * ``flush``: a Python bool or boolean scalar; when true the window closes
    now, normalised by what it holds. A window that holds no weight emits
    zeros and does not step ``optimizer``.
  * any other keyword: forwarded to ``optimizer.update`` when the window
    closes (for example ``value=`` for ``optax.contrib.reduce_on_plateau``).

  Under ``jax.vmap`` (several models trained side by side) the window's
  ``lax.cond`` gets a batched predicate and becomes a select: both branches
  run on every micro-step, so each micro-step pays for a full step of
  ``optimizer`` plus a select over its state and updates, as
  ``optax.MultiSteps`` always does. The results are unchanged, even for
  models whose windows are out of phase. Under ``jit``, ``pmap`` and
  ``jax.shard_map`` the predicate is a scalar and only one branch runs.

  Args:
    optimizer: the optax transformation to apply once per window: a chain,
      a schedule, ``inject_hyperparams`` or an extra-args transformation.
    every_k: micro-steps per window: a positive int; a jittable callable
      mapping the applied-update count (int32 scalar) to k, where values
      below 1 act as 1; or a dict ``{update_step: k}`` with key 0, piecewise
      constant in the applied-update count.
    reduction: ``"mean"`` (weighted mean) or ``"sum"`` (weighted sum).
    accumulator_dtype: floating dtype of the accumulator, for example
      float32 accumulation of bfloat16 gradients.
    skip_nonfinite: drop a micro-step whose gradients hold NaN or Inf
      whole: not added, not counted toward k, and counted in
      ``num_skipped``. With ``axis_name`` the finiteness check is global
      (a scalar all-reduce per micro-step) so that every device drops the
      same micro-steps.
    axis_name: inside ``jax.shard_map`` or ``pmap``, the data-parallel axis.
      Micro-steps accumulate device-locally with no collective; the closing
      call sums accumulator and weights over the axis once.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`AccumulateState`.

  Raises:
    TypeError: ``optimizer`` is not a GradientTransformation, or
      ``every_k``, ``accumulator_dtype`` or ``axis_name`` has a wrong type.
    ValueError: ``every_k`` below 1, a bad ``every_k`` dict, or an unknown
      ``reduction``. ``update`` raises for ``grads`` that do not match the
      state and for a bad ``weight`` or ``flush``.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.accumulate(optax.sgd(0.1), every_k=2)
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.full(3, 1.0)}, state, params)
    >>> updates["w"], bool(ga_optax.emitted(state))
    (Array([0., 0., 0.], dtype=float32), False)
    >>> updates, state = tx.update({"w": jnp.full(3, 3.0)}, state, params)
    >>> updates["w"], bool(ga_optax.emitted(state))
    (Array([-0.2, -0.2, -0.2], dtype=float32), True)
  """
  init_fn, window_step = _window_functions(
    optimizer,
    every_k,
    reduction=reduction,
    accumulator_dtype=accumulator_dtype,
    skip_nonfinite=skip_nonfinite,
    axis_name=axis_name,
  )

  def update_fn(
    updates: optax.Updates,
    state: AccumulateState,
    params: optax.Params | None = None,
    *,
    weight: Any = 1,
    flush: Any = False,
    **extra_args: Any,
  ) -> tuple[optax.Updates, AccumulateState]:
    return window_step(
      updates,
      state,
      params,
      weight=weight,
      flush=flush,
      extra_args=extra_args,
      apply_to_params=False,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def emitted(state: Any) -> jax.Array:
  """Whether the last ``update`` call closed a window and applied an update.

  False on micro-steps that only accumulate, and on a flush of a window that
  held no weight (nothing is applied then).

  Args:
    state: an :class:`AccumulateState`, or any optimizer state that holds
      exactly one, for example that of an ``optax.chain``.

  Returns:
    A bool scalar array.

  Raises:
    ValueError: ``state`` holds no :class:`AccumulateState`, or several.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = optax.chain(optax.clip(1.0), ga_optax.accumulate(optax.sgd(1.0), 1))
    >>> params = jnp.zeros(2)
    >>> _, state = tx.update(jnp.ones(2), tx.init(params), params)
    >>> bool(ga_optax.emitted(state))
    True
  """
  # Flax NNX's Optimizer wraps state leaves in Variables: asarray returns
  # the plain array (a snapshot, not the live Variable).
  return jnp.asarray(find_state(state).emitted)


def find_state(state: Any) -> AccumulateState:
  """The one :class:`AccumulateState` inside an optimizer state.

  Raises:
    ValueError: ``state`` holds no ``AccumulateState``, or several.
  """
  found = [
    node
    for node in jax.tree.leaves(
      state, is_leaf=lambda node: isinstance(node, AccumulateState)
    )
    if isinstance(node, AccumulateState)
  ]
  if len(found) != 1:
    raise ValueError(
      "state must hold exactly one AccumulateState (the state of"
      f" ga_optax.accumulate), found {len(found)}."
    )
  return found[0]
