"""The host-scheduled window: the floor of a window, as a form one can run.

The host knows which micro-step of a window it is about to run, so it can
pick the program instead of the device: two jitted programs without control
flow, and a loop that chooses between them.

* ``micro_step``: the micro-batch's gradient, weighted, added into a
  donated accumulator; on the first micro-step of a window it overwrites
  the accumulator instead of reading it (pass ``None``), as ga_optax's
  window does. Returns the sums and the micro-batch's loss.
* ``closing_step``: the last micro-batch's gradient added likewise, the
  sum normalised by the window's weight, one step of the wrapped optimizer
  and the updates applied to the donated params. The accumulator is not
  returned: the next window's first micro-step writes a new one, so
  resetting it costs nothing.

A micro-step moves what the work needs (a gradient plus an add into the
accumulator), which is the floor ``ga_optax.accumulate``'s compiled
micro-step is measured against, and the host never waits for the device to
choose. ``benchmarks/compiled.py`` compiles both programs for a compile-only
H100; ``benchmarks/gpu_report.py`` times them beside ``accumulate``.

Example::

  window = host_scheduled_window(loss_fn, optax.adam(1e-3), every_k=4)
  opt_state = window.init(params)
  params, opt_state, losses = run_window(window, params, opt_state, batches)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

# The arguments each program donates: the accumulator's sums (a micro-step),
# the params and the optimizer's state (the closing step). The closing step
# returns nothing the sums' buffers could hold: donated, they would only be
# refused; the caller drops them.
MICRO_STEP_DONATED = (1,)
CLOSING_STEP_DONATED = (0, 1)

LossFn = Callable[[Any, Any], jax.Array]


class WindowSums(NamedTuple):
  """What an open window holds between micro-steps.

  Attributes:
    gradients: ``sum_i w_i g_i`` over the window's micro-steps so far, in
      the accumulator's dtype.
    weight: ``sum_i w_i``, a float32 scalar.
  """

  gradients: optax.Updates
  weight: jax.Array


class HostScheduledWindow(NamedTuple):
  """A window's two programs; the host chooses which one each call runs.

  Attributes:
    every_k: micro-steps per window; the ``every_k``-th runs
      ``closing_step``.
    init: ``params -> opt_state``, the wrapped optimizer's ``init``.
    micro_step: jitted ``(params, sums, batch, weight) -> (sums, loss)``;
      ``sums`` (donated) is None on a window's first micro-step, ``weight``
      a scalar or None (weight 1).
    closing_step: jitted ``(params, opt_state, sums, batch, weight) ->
      (params, opt_state, loss)``; params and opt_state donated, ``sums``
      None when the window has one micro-step.
  """

  every_k: int
  init: Callable[[optax.Params], optax.OptState]
  micro_step: Callable[..., tuple[WindowSums, jax.Array]]
  closing_step: Callable[..., tuple[optax.Params, optax.OptState, jax.Array]]


def micro_step_fn(
  loss_fn: LossFn, accumulator_dtype: Any = jnp.float32
) -> Callable[..., tuple[WindowSums, jax.Array]]:
  """The micro-step, not jitted: ``(params, sums, batch, weight)``."""

  def micro_step(
    params: optax.Params,
    sums: WindowSums | None,
    batch: Any,
    weight: jax.Array | float | None,
  ) -> tuple[WindowSums, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    # None is a static argument: the program of weight 1 has no multiply.
    weight_value = jnp.ones((), jnp.float32) if weight is None else weight
    weight_value = jnp.asarray(weight_value, jnp.float32)

    def weighted(grad: jax.Array) -> jax.Array:
      grad = grad.astype(accumulator_dtype)
      return grad if weight is None else grad * weight_value.astype(grad.dtype)

    if sums is None:  # the window's first micro-step: nothing to read
      return WindowSums(jax.tree.map(weighted, grads), weight_value), loss
    gradients = jax.tree.map(
      lambda total, grad: total + weighted(grad), sums.gradients, grads
    )
    return WindowSums(gradients, sums.weight + weight_value), loss

  return micro_step


def closing_step_fn(
  loss_fn: LossFn,
  optimizer: optax.GradientTransformation,
  accumulator_dtype: Any = jnp.float32,
) -> Callable[..., tuple[optax.Params, optax.OptState, jax.Array]]:
  """The closing step, not jitted: ``(params, opt_state, sums, batch,
  weight)``."""
  add = micro_step_fn(loss_fn, accumulator_dtype)

  def closing_step(
    params: optax.Params,
    opt_state: optax.OptState,
    sums: WindowSums | None,
    batch: Any,
    weight: jax.Array | float | None,
  ) -> tuple[optax.Params, optax.OptState, jax.Array]:
    sums, loss = add(params, sums, batch, weight)
    # The window's total weight must be positive: a window of weight 0
    # has no mean, and this floor does not guard against one.
    scale = 1.0 / sums.weight
    mean = jax.tree.map(
      lambda total, param: (total * scale.astype(total.dtype)).astype(
        param.dtype
      ),
      sums.gradients,
      params,
    )
    updates, opt_state = optimizer.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return closing_step


def host_scheduled_window(
  loss_fn: LossFn,
  optimizer: optax.GradientTransformation,
  every_k: int,
  *,
  accumulator_dtype: Any = jnp.float32,
) -> HostScheduledWindow:
  """The host-scheduled window of ``optimizer`` over ``every_k`` micro-steps.

  Args:
    loss_fn: ``(params, batch) -> scalar``, the mean loss over a batch.
    optimizer: the optimizer that steps once per window.
    every_k: micro-steps per window, at least 1.
    accumulator_dtype: the dtype the sums are kept in.

  Returns:
    A :class:`HostScheduledWindow`; :func:`scheduled_step` or
    :func:`run_window` pick its programs.

  Raises:
    ValueError: ``every_k`` is not a positive int.
  """
  if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
    raise ValueError(f"every_k must be a positive int, got {every_k!r}.")
  return HostScheduledWindow(
    every_k=every_k,
    init=optimizer.init,
    micro_step=jax.jit(
      micro_step_fn(loss_fn, accumulator_dtype),
      donate_argnums=MICRO_STEP_DONATED,
    ),
    closing_step=jax.jit(
      closing_step_fn(loss_fn, optimizer, accumulator_dtype),
      donate_argnums=CLOSING_STEP_DONATED,
    ),
  )


def scheduled_step(
  window: HostScheduledWindow,
  micro_step_index: int,
  params: optax.Params,
  opt_state: optax.OptState,
  sums: WindowSums | None,
  batch: Any,
  weight: jax.Array | float | None = None,
) -> tuple[optax.Params, optax.OptState, WindowSums | None, jax.Array]:
  """One call of the window, the program chosen by the micro-step's index.

  Args:
    window: the window's programs.
    micro_step_index: ``0`` to ``every_k - 1``, the position in the window.
    params, opt_state: the model's params and the optimizer's state.
    sums: what the window holds: None exactly at index 0.
    batch: this micro-step's batch.
    weight: this micro-batch's weight (its item count, say), or None for 1.

  Returns:
    ``(params, opt_state, sums, loss)``: sums is None after the closing
    step, whose params and state are the stepped ones.

  Raises:
    ValueError: the index is out of the window, or ``sums`` does not match
      it (the host's count and the carried sums disagree).
  """
  if not 0 <= micro_step_index < window.every_k:
    raise ValueError(
      f"micro_step_index must be in [0, {window.every_k}), got"
      f" {micro_step_index}."
    )
  if (sums is None) != (micro_step_index == 0):
    raise ValueError(
      f"At micro-step {micro_step_index} of a window the sums must be"
      f" {'None' if micro_step_index == 0 else 'those of the earlier ones'},"
      f" got {'None' if sums is None else 'sums'}: the host's count of the"
      " window and the sums it carries disagree."
    )
  if micro_step_index == window.every_k - 1:
    params, opt_state, loss = window.closing_step(
      params, opt_state, sums, batch, weight
    )
    return params, opt_state, None, loss
  sums, loss = window.micro_step(params, sums, batch, weight)
  return params, opt_state, sums, loss


def run_window(
  window: HostScheduledWindow,
  params: optax.Params,
  opt_state: optax.OptState,
  microbatches: Sequence[Any],
  weights: Sequence[jax.Array | float] | None = None,
) -> tuple[optax.Params, optax.OptState, list[jax.Array]]:
  """One whole window: ``every_k`` micro-batches, one optimizer step.

  Args:
    window: the window's programs.
    params, opt_state: donated; use the returned ones.
    microbatches: ``every_k`` batches, in order.
    weights: one weight per micro-batch, or None for weight 1 each.

  Returns:
    ``(params, opt_state, losses)``, one loss per micro-batch.

  Raises:
    ValueError: not ``every_k`` micro-batches, or not one weight each.
  """
  if len(microbatches) != window.every_k:
    raise ValueError(
      f"A window takes every_k = {window.every_k} micro-batches, got"
      f" {len(microbatches)}."
    )
  if weights is not None and len(weights) != len(microbatches):
    raise ValueError(
      f"weights must hold one weight per micro-batch ({len(microbatches)}),"
      f" got {len(weights)}."
    )
  sums, losses = None, []
  for index, batch in enumerate(microbatches):
    weight = None if weights is None else weights[index]
    params, opt_state, sums, loss = scheduled_step(
      window, index, params, opt_state, sums, batch, weight
    )
    losses.append(loss)
  return params, opt_state, losses
