"""Dynamic loss scaling for float16 training, one loss scale per window.

float16 keeps 5 exponent bits: gradients below about 6e-8 flush to zero and
values above 65504 overflow. Loss scaling multiplies the loss by a large
scale S before differentiating, so that the small gradients of the float16
backward pass stay representable, and divides the gradient by S before the
optimizer sees it. A dynamic scale is halved whenever the scaled gradient
overflows (that step is dropped) and doubled after a run of steps that did
not, so it settles just below overflow.

:func:`dynamic_loss_scale` wraps the optimizer: it unscales the gradient it
is given, checks that it is finite, and either steps the wrapped optimizer
or drops the step and backs the scale off. Placed inside
:func:`ga_optax.accumulate` it runs once per window, on the window's reduced
gradient, and that alone gives gradient accumulation the semantics of
PyTorch AMP's ``GradScaler``: one scale for every micro-batch of a window
(the state changes only when a window closes), one unscale of the window's
sum, a window dropped whole when that sum is not finite, and growth counted
in windows. The reduced gradient is the same on every device, so every
device takes the same decision with no collective of its own.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ga_optax._src import validation
from ga_optax._src.algebra.counters import increment_if


class DynamicLossScaleState(NamedTuple):
  """Plain pytree state of :func:`ga_optax.mixed_precision.dynamic_loss_scale`.

  "Window" below means one ``update`` call of the transformation: a closed
  window inside :func:`ga_optax.accumulate`, a step when it is used alone.

  Attributes:
    scale: float32, the scale to multiply the next window's losses by (read
      it with :func:`ga_optax.mixed_precision.loss_scale`).
    finite_windows: int32, finite windows since the last dropped window or
      the last growth of the scale; the scale grows when it reaches
      ``growth_interval``.
    dropped_windows: int32, windows dropped because their gradient was not
      finite, over the whole run (read it with
      :func:`ga_optax.mixed_precision.dropped_windows`).
    inner_state: the wrapped optimizer's state, which a dropped window
      leaves as it was.
  """

  scale: jax.Array
  finite_windows: jax.Array
  dropped_windows: jax.Array
  inner_state: optax.OptState


def _check_real(value: Any, name: str) -> float:
  """``value`` as a float, once checked to be a real number, finite in float32.

  Raises:
    TypeError: not a real number (a bool included).
    ValueError: not finite once rounded to float32.
  """
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(
      f"{name} must be a real number, got {value!r} of type"
      f" {type(value).__name__}."
    )
  # The scale is kept in float32: a value finite in Python may not be there.
  if not abs(float(value)) <= float(np.finfo(np.float32).max):
    raise ValueError(f"{name} must be finite in float32, got {value!r}.")
  return float(value)


@dataclasses.dataclass(frozen=True)
class ScaleRule:
  """How the scale moves after a window: the checked arguments, and the rule.

  Attributes:
    initial_scale: the first scale.
    growth_factor: the factor after ``growth_interval`` finite windows.
    backoff_factor: the factor after a dropped window.
    growth_interval: finite windows in a row before a growth.
    min_scale: the floor of a backoff.
  """

  initial_scale: float
  growth_factor: float
  backoff_factor: float
  growth_interval: int
  min_scale: float

  @classmethod
  def of(
    cls,
    initial_scale: Any,
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    min_scale: Any,
  ) -> ScaleRule:
    """The rule the arguments of :func:`dynamic_loss_scale` ask for.

    Raises:
      TypeError: an argument of the wrong type.
      ValueError: an argument out of its range.
    """
    rule = cls(
      initial_scale=_check_real(initial_scale, "initial_scale"),
      growth_factor=_check_real(growth_factor, "growth_factor"),
      backoff_factor=_check_real(backoff_factor, "backoff_factor"),
      growth_interval=validation.check_positive_int(
        growth_interval, "growth_interval"
      ),
      min_scale=_check_real(min_scale, "min_scale"),
    )
    if rule.growth_factor < 1.0:
      raise ValueError(
        "growth_factor must be >= 1 (2.0 doubles the scale; 1.0 never grows"
        f" it), got {growth_factor}."
      )
    if not 0.0 < rule.backoff_factor <= 1.0:
      raise ValueError(
        "backoff_factor must be in (0, 1] (0.5 halves the scale; 1.0 keeps"
        f" it), got {backoff_factor}."
      )
    if rule.min_scale <= 0.0:
      raise ValueError(f"min_scale must be positive, got {min_scale}.")
    if rule.initial_scale < rule.min_scale:
      raise ValueError(
        f"initial_scale must be at least min_scale ({min_scale}), got"
        f" {initial_scale}; lower min_scale to start below it."
      )
    return rule

  def next(
    self, scale: jax.Array, finite_windows: jax.Array, finite: jax.Array
  ) -> tuple[jax.Array, jax.Array]:
    """The scale and the count of finite windows after one more window."""
    finite_windows = jnp.where(finite, finite_windows + 1, 0)
    grows = finite_windows >= self.growth_interval
    grown = scale * self.growth_factor
    # A scale that would overflow float32 stays where it is.
    kept = jnp.where(grows & jnp.isfinite(grown), grown, scale)
    backed_off = jnp.maximum(scale * self.backoff_factor, self.min_scale)
    return (
      jnp.where(finite, kept, backed_off).astype(jnp.float32),
      jnp.where(grows, 0, finite_windows).astype(jnp.int32),
    )


def _unscaled(grad: Any, scale: jax.Array) -> Any:
  """``grad / scale``, divided in at least float32, in ``grad``'s dtype.

  Dividing in float16 would overflow for a scale below 1 (``1 / scale``
  too, below 2**-16) and round twice; the quotient is rounded once.
  """
  if not validation.is_inexact_array(grad):
    return grad
  wide = jnp.promote_types(grad.dtype, jnp.float32)
  return (grad.astype(wide) / scale.astype(wide)).astype(grad.dtype)


def _all_finite(tree: Any) -> jax.Array:
  """Whether every floating or complex leaf of ``tree`` is finite in its dtype.

  Compared with the dtype's largest value rather than with ``isfinite``:
  XLA:GPU may keep a float16 value in float32 between fused ops (XLA's
  excess precision, on by default), so a window's sum that overflows float16
  when cast reads finite there (seen on an H100: 4 x 30000 was not dropped).
  A NaN fails the comparison too.
  """
  flags = [
    jnp.all(jnp.abs(leaf) <= jnp.finfo(leaf.dtype).max)
    for leaf in jax.tree.leaves(tree)
    if validation.is_inexact_array(leaf)
  ]
  return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def _check_state(state: Any) -> DynamicLossScaleState:
  if not isinstance(state, DynamicLossScaleState):
    raise TypeError(
      "state must be the DynamicLossScaleState made by this transformation's"
      f" init (or restored into its structure), got {type(state).__name__}."
    )
  return state


def dynamic_loss_scale(
  optimizer: optax.GradientTransformation,
  *,
  initial_scale: float = 2.0**15,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  growth_interval: int = 2000,
  min_scale: float = 1.0,
) -> optax.GradientTransformationExtraArgs:
  """Unscales a loss-scaled gradient, steps ``optimizer`` if it is finite.

  The train step multiplies its loss by
  :func:`ga_optax.mixed_precision.loss_scale` of the optimizer state before
  differentiating, and hands the (scaled) gradient to ``update``. Each
  ``update`` call divides the gradient by the scale and then:

  * if every element is finite: runs ``optimizer`` on the unscaled
    gradient and returns its updates; after ``growth_interval`` such calls
    in a row the scale is multiplied by ``growth_factor`` (kept unchanged
    where the product would not be finite in float32);
  * otherwise: drops the call, returning zero updates and leaving
    ``optimizer``'s state as it was, multiplies the scale by
    ``backoff_factor`` (not below ``min_scale``) and restarts the count.

  Inside ``ga_optax.accumulate(dynamic_loss_scale(opt), k)`` it runs once
  per window, on the reduced gradient, which gives PyTorch AMP's
  ``GradScaler`` semantics under accumulation: every micro-batch of a
  window is scaled by the same scale; the window's reduced gradient is
  unscaled once; a window whose reduced gradient is not finite is dropped
  whole and the scale backs off; growth is counted in windows. The reduced
  gradient is the same on every device (``axis_name``,
  ``unreduced_axes``), so all devices drop the same windows. Keep the
  accumulator float32 (the default): a float16 one overflows on the
  window's sum of scaled gradients where no micro-batch did.
  ``accumulate(..., skip_nonfinite=True)`` refuses it (at ``init``): that
  would drop the overflowing micro-steps before the window sees them, so
  that the scale never backs off. The noise scale that ``accumulate``
  measures (``noise_scale_decay``) is in the gradients' own units: the
  window divides the scale out, and a dropped window is not measured. A clip
  goes inside it, ``dynamic_loss_scale(optax.chain(clip, opt))``: outside,
  it would clip the scaled gradient. See docs/how-to/mixed-precision.md.

  The unscaled gradient keeps the dtype of the gradient given (the division
  itself runs in at least float32): with float32 master params and float16
  compute, as PyTorch AMP requires, it is float32; float16 gradients of
  float16 params are rounded back to float16 after unscaling, losing the
  entries below float16's range that the scale had kept.

  Args:
    optimizer: the optax transformation to step on finite gradients.
    initial_scale: the first loss scale.
    growth_factor: what the scale is multiplied by after
      ``growth_interval`` finite calls in a row; at least 1 (1 never grows
      it).
    backoff_factor: what the scale is multiplied by when a call is dropped;
      in (0, 1] (1 keeps it).
    growth_interval: finite calls (windows, inside ``accumulate``) in a row
      after which the scale grows.
    min_scale: the scale never backs off below it, so that a gradient that
      is never finite (a NaN in the data, say) keeps dropping windows at
      this scale instead of driving it to 0.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`DynamicLossScaleState`; extra keyword arguments of ``update``
    are forwarded to ``optimizer``.

  Raises:
    TypeError: ``optimizer`` is not a GradientTransformation, a scale or
      factor is not a real number, or ``growth_interval`` is not an int.
      ``update`` raises for a state that is not a
      :class:`DynamicLossScaleState`.
    ValueError: ``growth_factor`` below 1, ``backoff_factor`` outside
      (0, 1], ``growth_interval`` below 1, ``min_scale`` not positive,
      ``initial_scale`` below ``min_scale``, or a value not finite in
      float32.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.mixed_precision.dynamic_loss_scale(
    ...     optax.sgd(0.1), initial_scale=1024.0, growth_interval=2)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> scale = ga_optax.mixed_precision.loss_scale(state)
    >>> scaled = scale * jnp.array([1.0, 2.0])
    >>> updates, state = tx.update(scaled, state, params)
    >>> updates
    Array([-0.1, -0.2], dtype=float32)
    >>> updates, state = tx.update(jnp.array([jnp.inf, 0.0]), state, params)
    >>> updates, float(ga_optax.mixed_precision.loss_scale(state))
    (Array([0., 0.], dtype=float32), 512.0)
  """
  inner = validation.check_optimizer(optimizer)
  rule = ScaleRule.of(
    initial_scale, growth_factor, backoff_factor, growth_interval, min_scale
  )

  def init_fn(params: optax.Params) -> DynamicLossScaleState:
    return DynamicLossScaleState(
      scale=jnp.asarray(rule.initial_scale, jnp.float32),
      finite_windows=jnp.zeros((), jnp.int32),
      dropped_windows=jnp.zeros((), jnp.int32),
      inner_state=inner.init(params),
    )

  def update_fn(
    updates: optax.Updates,
    state: DynamicLossScaleState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, DynamicLossScaleState]:
    state = _check_state(state)
    scale = jnp.asarray(state.scale)
    grads = jax.tree.map(lambda grad: _unscaled(grad, scale), updates)
    # The scaled gradient as given, and what the optimizer would be given:
    # unscaling by a scale below 1 can overflow a gradient that was finite.
    finite = _all_finite(updates) & _all_finite(grads)
    # Run on every call and selected (optax.apply_if_finite branches with
    # lax.cond instead): the selects fuse into the optimizer's own
    # elementwise pass over its state, where a conditional would cost its
    # operands' copies.
    inner_updates, inner_state = inner.update(
      grads, state.inner_state, params, **extra_args
    )
    inner_updates = jax.tree.map(
      lambda update: jnp.where(finite, update, jnp.zeros_like(update)),
      inner_updates,
    )
    inner_state = jax.tree.map(
      lambda new, old: jnp.where(finite, new, jnp.asarray(old, new.dtype)),
      inner_state,
      state.inner_state,
    )
    new_scale, finite_windows = rule.next(scale, state.finite_windows, finite)
    return inner_updates, DynamicLossScaleState(
      scale=new_scale,
      finite_windows=finite_windows,
      dropped_windows=increment_if(state.dropped_windows, ~finite),
      inner_state=inner_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def find_loss_scale_state(state: Any) -> DynamicLossScaleState:
  """The one :class:`DynamicLossScaleState` inside an optimizer state.

  Raises:
    ValueError: ``state`` holds none, or several.
  """
  return validation.find_one(
    state, DynamicLossScaleState, "ga_optax.mixed_precision.dynamic_loss_scale"
  )


def _loss_scale_states(state: Any) -> list[DynamicLossScaleState]:
  """Every :class:`DynamicLossScaleState` inside an optimizer state."""

  def is_scale(node: Any) -> bool:
    return isinstance(node, DynamicLossScaleState)

  return [
    node for node in jax.tree.leaves(state, is_leaf=is_scale) if is_scale(node)
  ]


def gradient_units(
  inner_state: Any, new_inner_state: Any
) -> tuple[jax.Array, jax.Array]:
  """The loss scale a window's gradients carry, and whether it was kept.

  ``(scale, kept)``, float32 and bool, from the wrapped optimizer's state
  before and after its step, for the noise scale that
  :func:`ga_optax.accumulate` measures: its micro-gradients are those of the
  loss times the scale at the window's start, and a window that
  :func:`dynamic_loss_scale` drops measures nothing. A state without a loss
  scale gives ``(1, True)``; one with several raises a ``ValueError``.
  """
  if not _loss_scale_states(inner_state):
    return jnp.ones((), jnp.float32), jnp.asarray(True)
  before = find_loss_scale_state(inner_state)
  after = find_loss_scale_state(new_inner_state)
  # The count saturates at 2**31 - 1 drops, far beyond any run.
  kept = after.dropped_windows == before.dropped_windows
  return jnp.asarray(before.scale, jnp.float32), kept


def refuse_skipped_overflows(inner_state: Any) -> None:
  """Raises if ``skip_nonfinite=True`` would hide overflows from a loss scale.

  Raises:
    ValueError: ``inner_state`` holds a :class:`DynamicLossScaleState`.
  """
  if _loss_scale_states(inner_state):
    raise ValueError(
      "accumulate(..., skip_nonfinite=True) drops every micro-step whose"
      " gradient is not finite before the window closes, so the"
      " dynamic_loss_scale it wraps never sees an overflow and never backs"
      " its scale off: under a scale too large every micro-step is dropped"
      " and nothing is applied. Pass skip_nonfinite=False (the default):"
      " ga_optax.mixed_precision.dynamic_loss_scale drops a window whose"
      " gradient is not finite and backs off by itself."
    )


def loss_scale(state: Any) -> jax.Array:
  """The loss scale to multiply the loss by, before taking its gradient.

  Multiply the loss in float32 (a float16 loss would overflow at the scale
  itself):
  ``loss_fn(params, batch) * ga_optax.mixed_precision.loss_scale(opt_state)``.
  Inside :func:`ga_optax.accumulate` the scale changes only when a window
  closes, so every micro-batch of a window gets the same one.

  Args:
    state: a :class:`DynamicLossScaleState`, or any optimizer state that
      holds exactly one: that of ``accumulate(dynamic_loss_scale(...), k)``,
      of an ``optax.chain``, a Flax ``TrainState`` or an NNX
      ``Optimizer``'s ``opt_state``.

  Returns:
    A float32 scalar array.

  Raises:
    ValueError: ``state`` holds no :class:`DynamicLossScaleState`, or
      several.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.accumulate(
    ...     ga_optax.mixed_precision.dynamic_loss_scale(optax.adam(1e-3)), 4)
    >>> float(ga_optax.mixed_precision.loss_scale(tx.init(jnp.zeros(3))))
    32768.0
  """
  # Flax NNX's Optimizer wraps state leaves in Variables: asarray returns
  # the plain array.
  return jnp.asarray(find_loss_scale_state(state).scale)


def dropped_windows(state: Any) -> jax.Array:
  """The number of windows dropped because their gradient was not finite.

  Inside :func:`ga_optax.accumulate` a dropped window still counts as an
  applied update there (:func:`ga_optax.emitted` is true, and a schedule of
  k moves on); this tells the two apart.

  Args:
    state: a :class:`DynamicLossScaleState`, or any optimizer state that
      holds exactly one.

  Returns:
    An int32 scalar array, counted over the whole run.

  Raises:
    ValueError: ``state`` holds no :class:`DynamicLossScaleState`, or
      several.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.accumulate(
    ...     ga_optax.mixed_precision.dynamic_loss_scale(optax.sgd(0.1)), 2)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> for grad in ([1.0, jnp.inf], [1.0, 1.0]):
    ...   _, state = tx.update(jnp.array(grad), state, params)
    >>> (int(ga_optax.mixed_precision.dropped_windows(state)),
    ...  float(ga_optax.mixed_precision.loss_scale(state)))
    (1, 16384.0)
  """
  return jnp.asarray(find_loss_scale_state(state).dropped_windows)


def wrapped_state(state: Any) -> Any:
  """The state of the optimizer that :func:`dynamic_loss_scale` wraps.

  Its step count moves only on the windows the loss scale kept, so it can
  differ from :func:`ga_optax.applied_updates`, which counts every window
  that closed. This reads it wherever the loss scale sits, without
  spelling the path through ``accumulate``'s and the loss scale's states.

  Args:
    state: a :class:`DynamicLossScaleState`, or any optimizer state that
      holds exactly one.

  Returns:
    The wrapped optimizer's state, as that optimizer's ``update`` takes it.

  Raises:
    ValueError: ``state`` holds no :class:`DynamicLossScaleState`, or
      several.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.accumulate(
    ...     ga_optax.mixed_precision.dynamic_loss_scale(optax.adam(0.1)), 2)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> for grad in ([1.0, 1.0], [jnp.inf, 1.0], [1.0, 1.0], [1.0, 1.0]):
    ...   _, state = tx.update(jnp.array(grad), state, params)
    >>> adam = ga_optax.mixed_precision.wrapped_state(state)[0]
    >>> (int(adam.count), int(ga_optax.applied_updates(state)))
    (1, 2)
  """
  return find_loss_scale_state(state).inner_state
