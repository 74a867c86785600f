"""``ga_optax.privacy.accumulate``: the window of ``accumulate``, made private.

A private window is ``ga_optax.accumulate(private_close, every_k,
reduction="sum", ...)``: the window sums the micro-batches' sums of
clipped per-example gradients (a sum, never divided by a count read from
the data), reduces them once across devices, and at the close steps
:func:`~ga_optax._src.privacy.noise.private_close`, which adds the noise,
divides by the public ``normalize_by`` and runs the user's optimizer.

Each micro-step enters the window with weight 1, so every close has weight
and steps: a window closed on an all-padding micro-batch (an empty Poisson
draw) is a pure-noise release, as the accountant counts it. The features
that would read private data outside the noise are refused here, each with
its reason.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ga_optax._src.batch_size import adaptive
from ga_optax._src.batch_size import every_k as every_k_lib
from ga_optax._src.privacy import noise
from ga_optax._src.window import arguments, transform
from ga_optax._src.window.output import EmitUpdates

# Why each of accumulate's keywords is not taken by a private window.
REFUSED = {
  "reduction": (
    "a private window sums the clipped gradients (reduction='sum') and"
    " divides by the public normalize_by; a mean would divide by the"
    " number of micro-steps, a count the data decides under Poisson"
    " sampling"
  ),
  "noise_scale_decay": (
    "the gradient noise scale reads the spread of each micro-batch's"
    " gradient, a statistic of private data that no noise covers"
  ),
  "skip_nonfinite": (
    "whether a micro-step is dropped depends on its examples' gradients:"
    " the skip itself would reveal them. Clipped gradients are finite"
    " wherever the loss is"
  ),
  "lr_scaling": (
    "the learning rate would follow the window's k, which under Poisson"
    " sampling is the size of the private draw; put a schedule of the step"
    " count in the optimizer instead"
  ),
}


def accumulate(
  optimizer: optax.GradientTransformation,
  every_k: every_k_lib.EveryK,
  *,
  l2_clip_norm: float,
  noise_multiplier: float,
  normalize_by: float,
  key: Any,
  accumulator_dtype: Any = jnp.float32,
  axis_name: Any = None,
  unreduced_axes: Any = None,
  accumulator_memory_kind: str | None = None,
  inner_state_memory_kind: str | None = None,
  inner_state_axes: Any = None,
  **refused: Any,
) -> optax.GradientTransformationExtraArgs:
  """Differentially private windows: clipped sums, one draw per window.

  Each ``update`` call adds a micro-batch's sum of clipped per-example
  gradients (:func:`ga_optax.privacy.clipped_grad_sum`) to the window and
  returns zero updates, until the call that closes it: that one adds one
  Gaussian draw ``N(0, (noise_multiplier * l2_clip_norm)^2)`` per coordinate
  to the window's sum, divides by ``normalize_by`` and steps ``optimizer``
  once. The draw's key is ``key`` folded with the count of windows closed
  so far (:func:`ga_optax.privacy.windows_closed`), so a resumed run draws
  the same noise; the micro-step's program holds no random-number op.

  ``update(clipped_sum, state, params=None, *, flush=False, closing=None,
  **extra_args)``, as :func:`ga_optax.accumulate`'s: ``closing`` a Python
  bool closes the window where the host says (a Poisson draw's micro-batches
  end), None leaves it to the count of ``every_k``. A micro-step has no
  ``weight=``: each example's weight is its mask in ``clipped_grad_sum``.

  Args:
    optimizer: the optax transformation stepped once per window, on the
      noisy sum divided by ``normalize_by``.
    every_k: micro-steps per window on the device's schedule: an int, or a
      schedule of the count of windows (a callable or a dict), as for
      :func:`ga_optax.accumulate`; not ``adaptive_k``.
    l2_clip_norm: C > 0, the bound the clipped gradients were clipped to.
    noise_multiplier: sigma >= 0; the noise's standard deviation is
      ``sigma * C`` per coordinate.
    normalize_by: > 0, the public divisor of the noisy sum: the expected
      logical batch size (the sampling probability times the dataset size).
    key: a JAX random key (``jax.random.key`` or ``jax.random.PRNGKey``).
    accumulator_dtype: as for :func:`ga_optax.accumulate`.
    axis_name: as for :func:`ga_optax.accumulate`; on several devices the
      window reduces once before the noise is drawn: one draw per window,
      not per device.
    unreduced_axes: as for :func:`ga_optax.accumulate`, likewise.
    accumulator_memory_kind: as for :func:`ga_optax.accumulate`.
    inner_state_memory_kind: as for :func:`ga_optax.accumulate`.
    inner_state_axes: as for :func:`ga_optax.accumulate` (ZeRO-1); each
      shard draws the noise an unsharded state would.
    **refused: ``reduction``, ``noise_scale_decay``, ``skip_nonfinite`` and
      ``lr_scaling`` are refused, each with its reason.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`ga_optax.AccumulateState` (``ga_optax.applied_updates`` and the
    other readers work on it).

  Raises:
    TypeError, ValueError: an argument the mechanism cannot bound, or a
      refused keyword; the message says why.

  Example:
    >>> import jax, jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.privacy.accumulate(
    ...     optax.sgd(1.0), 2, l2_clip_norm=1.0, noise_multiplier=0.0,
    ...     normalize_by=4.0, key=jax.random.key(0))
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> _, state = tx.update(jnp.ones(2), state, params)
    >>> updates, state = tx.update(jnp.ones(2), state, params)
    >>> updates
    Array([-0.5, -0.5], dtype=float32)
  """
  _refuse(refused)
  if isinstance(every_k_lib.as_window_length(every_k), adaptive.AdaptiveK):
    raise ValueError(
      "every_k=adaptive_k(...) is refused in a private window: it follows"
      " the gradient noise scale measured from each micro-batch's gradient,"
      " a statistic of private data that no noise covers. Pass an int or a"
      " schedule of the window count."
    )
  close = noise.private_close(
    optimizer,
    l2_clip_norm=_checked("l2_clip_norm", l2_clip_norm, above=0.0),
    noise_multiplier=_checked("noise_multiplier", noise_multiplier, least=0.0),
    normalize_by=_checked("normalize_by", normalize_by, above=0.0),
    key=key,
  )
  window = arguments.resolve(
    close,
    every_k,
    EmitUpdates(),
    # The sum of the window's clipped sums: the division is the public
    # normalize_by's, in the private close.
    reduction="sum",
    accumulator_dtype=accumulator_dtype,
    # A data-dependent skip, a noise scale or a k that follows the window
    # would each release a statistic of private data.
    skip_nonfinite=False,
    noise_scale_decay=None,
    lr_scaling=None,
    axis_name=axis_name,
    unreduced_axes=unreduced_axes,
    accumulator_memory_kind=accumulator_memory_kind,
    inner_state_memory_kind=inner_state_memory_kind,
    inner_state_axes=inner_state_axes,
  )
  window_tx = transform.emitting_updates(window)

  def update_fn(
    clipped_sum: optax.Updates,
    state: Any,
    params: optax.Params | None = None,
    *,
    flush: Any = False,
    closing: bool | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, Any]:
    _refuse_call_keywords(extra_args)
    return window_tx.update(
      clipped_sum, state, params, flush=flush, closing=closing, **extra_args
    )

  return optax.GradientTransformationExtraArgs(window_tx.init, update_fn)


def _refuse_call_keywords(extra_args: dict[str, Any]) -> None:
  """Refuses what a private micro-step cannot take, saying why."""
  if "weight" in extra_args:
    raise TypeError(
      "a private window takes no weight=: every micro-step enters with"
      " weight 1, so that every closed window, even an empty draw's, is"
      " a noisy release. Weigh examples through the mask of"
      " clipped_grad_sum (public values in [0, 1])."
    )
  if extra_args.get("fp8_state") is not None:
    raise ValueError(
      "fp8_state is refused in a private window: a float8 model's scales"
      " follow the amax of each micro-batch's activations and gradients,"
      " statistics of private data that no noise covers."
    )


def _refuse(refused: dict[str, Any]) -> None:
  for name in refused:
    if name in REFUSED:
      raise ValueError(
        f"{name}= is refused by ga_optax.privacy.accumulate: {REFUSED[name]}."
      )
    raise TypeError(
      f"ga_optax.privacy.accumulate() got an unexpected keyword argument"
      f" {name!r}."
    )


def _checked(
  name: str,
  value: Any,
  *,
  above: float | None = None,
  least: float | None = None,
) -> float:
  """``value`` as a float: a public constant, finite, within its bound."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    if getattr(value, "shape", None) != () or not hasattr(value, "dtype"):
      raise TypeError(
        f"{name} must be a real number (a public constant), got"
        f" {type(value).__name__}."
      )
    try:
      value = float(value)
    except jax.errors.ConcretizationTypeError as error:
      raise TypeError(
        f"{name} must be a concrete number (a public constant of the"
        " mechanism), got a traced value."
      ) from error
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value}.")
  if above is not None and not value > above:
    raise ValueError(f"{name} must be > {above}, got {value}.")
  if least is not None and not value >= least:
    raise ValueError(f"{name} must be >= {least}, got {value}.")
  return value
