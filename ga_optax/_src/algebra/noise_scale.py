"""The gradient noise scale, measured from the window's own micro-gradients.

A window holds K micro-gradients ``g_i``, each the gradient of the mean loss
over ``w_i`` items, and their weighted mean ``G = sum(w_i g_i) / W`` with
``W = sum(w_i)``. Then (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", appendix A, in its weighted form)

    trace_sigma = (sum_i w_i |g_i|^2 - W |G|^2) / (K - 1)
    grad_sq     = |G|^2 - trace_sigma / W

are unbiased estimates of tr(Sigma), the trace of the per-item gradient
covariance, and of |G|^2, the true gradient's squared norm. Their ratio
``B_simple = tr(Sigma) / |G|^2`` estimates the critical batch size. One
window's estimates are noisy (``grad_sq`` is often negative when
``B_simple`` exceeds the window's batch), so each is smoothed on its own by
an exponential moving average, debiased like Adam's moments, and only the
smoothed values are divided: the ratio of noisy estimates is biased.

``trace_sigma`` is a weighted sample variance, never negative, but formed in
float32 as a difference of two sums close to each other when the
micro-gradients nearly agree; a difference within the sums' rounding
(``RESOLUTION`` of them) is read as 0, no measurable noise, rather than as a
rounding error of either sign. The smoothed values are read so: a |G|^2 at
or below 0 means "larger than any batch" (``B_simple`` infinite); a
tr(Sigma) at or below 0 with |G|^2 above 0 means "no measurable noise"
(``B_simple`` 0, never a reason for a larger batch).

The window pays for it with one squared norm per micro-step, read from the
gradient the add reads anyway, and one scalar reduction when it closes.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ga_optax._src.algebra import parts, weights


class NoiseScale(NamedTuple):
  """Smoothed gradient noise scale, as :func:`ga_optax.noise_scale` reads it.

  Attributes:
    b_simple: ``trace_sigma / grad_sq``, the simple noise scale, an estimate
      of the critical batch size in items (the unit of the weights), never
      negative. NaN until a window has been measured; infinite when the
      smoothed ``grad_sq`` is at or below 0 (the gradient is lost in the
      noise at this batch size: larger than any batch); 0 when
      ``grad_sq`` is above 0 and ``trace_sigma`` at or below 0 (no
      measurable noise: never a reason for a larger batch).
    grad_sq: smoothed, debiased estimate of |G|^2.
    trace_sigma: smoothed, debiased estimate of tr(Sigma), per item.
    windows: windows measured (those of at least 2 micro-gradients whose
      estimates are finite and that a loss scale did not drop).
  """

  b_simple: jax.Array
  grad_sq: jax.Array
  trace_sigma: jax.Array
  windows: jax.Array


class NoiseScaleEstimate(NamedTuple):
  """One window's raw, unbiased estimates, as the in-step path returns them.

  Attributes:
    grad_sq: estimate of |G|^2 from this window alone.
    trace_sigma: estimate of tr(Sigma) from this window alone.
    measured: whether the window held at least 2 micro-gradients (else both
      estimates are meaningless and :func:`ga_optax.smooth_noise_scale`
      leaves the averages be).
  """

  grad_sq: jax.Array
  trace_sigma: jax.Array
  measured: jax.Array


class NoiseScaleAverages(NamedTuple):
  """Moving averages of window estimates, read by :func:`ga_optax.noise_scale`.

  Attributes:
    grad_sq: the average of ``grad_sq`` estimates, not yet debiased.
    trace_sigma: the same for ``trace_sigma``.
    debias: ``1 - decay ** windows``, what the averages are divided by.
    windows: windows measured.
  """

  grad_sq: jax.Array
  trace_sigma: jax.Array
  debias: jax.Array
  windows: jax.Array


class NoiseTerms(NamedTuple):
  """The noise scale's part of a window: its sums over micro-gradients.

  Attributes:
    square_sum: ``sum_i w_i |g_i|^2`` over the micro-gradients of positive
      weight, as this device holds it.
    micro_gradients: K, how many micro-gradients had positive weight.
    weight: W, the sum of the micro-gradients' weights.
  """

  square_sum: jax.Array
  micro_gradients: jax.Array
  weight: jax.Array


class WindowNoise(NamedTuple):
  """The noise scale's part of an :class:`ga_optax.AccumulateState`.

  Attributes:
    terms: the open window's sums, as this device holds them.
    smoothed: the averages over the windows closed so far.
  """

  terms: NoiseTerms
  smoothed: NoiseScaleAverages


def check_decay(decay: Any) -> float | None:
  """A decay checked: None, or a real number in [0, 1).

  Raises:
    TypeError: not None and not a real number.
    ValueError: outside [0, 1).
  """
  if decay is None:
    return None
  if isinstance(decay, bool) or not isinstance(decay, numbers.Real):
    raise TypeError(
      "noise_scale_decay must be None (no measurement) or a real number in"
      f" [0, 1), got {decay!r} of type {type(decay).__name__}."
    )
  if not 0.0 <= float(decay) < 1.0:
    raise ValueError(
      "noise_scale_decay must be in [0, 1) (0 keeps only the last window's"
      f" estimates; 0.99 averages over about 100 windows), got {decay}."
    )
  return float(decay)


def no_averages() -> NoiseScaleAverages:
  """Averages over no window yet."""
  # Arrays of their own: a state is donated leaf by leaf.
  return NoiseScaleAverages(
    grad_sq=jnp.zeros((), jnp.float32),
    trace_sigma=jnp.zeros((), jnp.float32),
    debias=jnp.zeros((), jnp.float32),
    windows=jnp.zeros((), jnp.int32),
  )


def leaf_square(leaf: jax.Array) -> jax.Array:
  """``|leaf|^2``, the sum of its squared elements, in float32 or wider."""
  return jnp.sum(
    jnp.abs(leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))) ** 2
  )


def square_norm(tree: Any) -> jax.Array:
  """``|tree|^2``, the sum of every leaf's squared elements, in float32."""
  return parts.leaf_total(tree, leaf_square)


# Relative to ``sum_i w_i |g_i|^2``, the spread below which the float32 sums
# cannot tell it from rounding: each squared norm sums a model's worth of
# squares, rounded about sqrt(n) * 2**-24 apart for n parameters (1e-4 at
# 10**8), and the sums differ by the spread alone. A spread this small is a
# B_simple under 2**-10 of a micro-gradient's weight: no measurable noise.
RESOLUTION = 2.0**-10


def window_estimate(
  square_sum: jax.Array,
  micro_gradients: jax.Array,
  weight: jax.Array,
  mean_square: jax.Array,
) -> NoiseScaleEstimate:
  """The unbiased estimates of one window, from its sums.

  ``trace_sigma`` is 0 where the spread ``square_sum - weight *
  mean_square`` is within ``RESOLUTION`` of ``square_sum`` (float32
  cancellation, of either sign, when the micro-gradients nearly agree).

  Args:
    square_sum: ``sum_i w_i |g_i|^2`` over the window.
    micro_gradients: K, the number of micro-gradients.
    weight: W, the sum of their weights.
    mean_square: ``|G|^2`` of their weighted mean.
  """
  count = micro_gradients.astype(jnp.float32)
  measured = micro_gradients >= 2
  spread = square_sum - weight * mean_square
  spread = jnp.where(spread > RESOLUTION * square_sum, spread, 0.0)
  # A guard keeps an unmeasured window from computing 0 / 0.
  trace_sigma = spread / jnp.where(measured, count - 1.0, 1.0)
  grad_sq = mean_square - trace_sigma / weights.divisor(weight)
  return NoiseScaleEstimate(grad_sq, trace_sigma, measured)


def smooth(
  smoothed: NoiseScaleAverages, estimate: NoiseScaleEstimate, decay: float
) -> NoiseScaleAverages:
  """The averages after one more window; unchanged if it was not measured.

  A window whose estimates are not finite is not measured either: its
  gradient overflowed (a window that a loss scale drops), and folding it in
  would leave the averages NaN for the rest of the run.
  """
  counted = (
    estimate.measured
    & jnp.isfinite(estimate.grad_sq)
    & jnp.isfinite(estimate.trace_sigma)
  )

  def average(old: jax.Array, new: jax.Array) -> jax.Array:
    return jnp.where(counted, decay * old + (1.0 - decay) * new, old).astype(
      old.dtype
    )

  return NoiseScaleAverages(
    grad_sq=average(smoothed.grad_sq, estimate.grad_sq),
    trace_sigma=average(smoothed.trace_sigma, estimate.trace_sigma),
    debias=average(smoothed.debias, jnp.ones((), smoothed.debias.dtype)),
    windows=smoothed.windows + counted.astype(smoothed.windows.dtype),
  )


def smooth_noise_scale(
  averages: NoiseScaleAverages | None,
  estimate: NoiseScaleEstimate,
  decay: float,
) -> NoiseScaleAverages:
  """Folds one window's estimates into the averages, as ``accumulate`` does.

  For the in-step path: ``microbatched_value_and_grad(...,
  noise_scale=True)`` returns each call's raw estimates; keep the averages
  across train steps with this, and read them with
  :func:`ga_optax.noise_scale`.

  Args:
    averages: what the previous call returned, or None to start.
    estimate: one window's estimates.
    decay: in [0, 1): each window's estimates count ``1 - decay`` against
      the average so far (0 keeps the last window's).

  Returns:
    The new averages (a pytree of scalars: jit it, carry it, save it).

  Raises:
    TypeError, ValueError: ``decay`` is not a number in [0, 1).

  Example:
    >>> import jax.numpy as jnp, ga_optax
    >>> estimate = ga_optax.NoiseScaleEstimate(
    ...     grad_sq=jnp.float32(4.0), trace_sigma=jnp.float32(2.0),
    ...     measured=jnp.bool_(True))
    >>> averages = ga_optax.smooth_noise_scale(None, estimate, decay=0.9)
    >>> read = ga_optax.noise_scale(averages)
    >>> float(read.grad_sq), float(read.trace_sigma), float(read.b_simple)
    (4.0, 2.0, 0.5)
  """
  checked = check_decay(decay)
  if checked is None:
    raise TypeError("decay must be a number in [0, 1), got None.")
  if averages is None:
    averages = no_averages()
  return smooth(averages, estimate, checked)


def b_simple_of(grad_sq: jax.Array, trace_sigma: jax.Array) -> jax.Array:
  """``trace_sigma / grad_sq``, never negative.

  Infinite where ``grad_sq <= 0`` (larger than any batch), 0 where
  ``grad_sq > 0`` and ``trace_sigma <= 0`` (no measurable noise), NaN where
  either is NaN (nothing measured yet).
  """
  ratio = trace_sigma / jnp.where(grad_sq > 0, grad_sq, 1.0)
  ratio = jnp.where(trace_sigma > 0, ratio, jnp.zeros_like(ratio))
  ratio = jnp.where(grad_sq > 0, ratio, jnp.full_like(ratio, jnp.inf))
  nothing = jnp.isnan(grad_sq) | jnp.isnan(trace_sigma)
  return jnp.where(nothing, jnp.full_like(ratio, jnp.nan), ratio)


def read(smoothed: NoiseScaleAverages) -> NoiseScale:
  """The debiased averages and their ratio."""
  grad_sq = smoothed.grad_sq / smoothed.debias
  trace_sigma = smoothed.trace_sigma / smoothed.debias
  return NoiseScale(
    b_simple=b_simple_of(grad_sq, trace_sigma),
    grad_sq=grad_sq,
    trace_sigma=trace_sigma,
    windows=smoothed.windows,
  )


@dataclasses.dataclass(frozen=True)
class NoiseTermsPart:
  """The noise scale as a part of the window algebra (:mod:`.parts`).

  Each micro-batch adds ``w |g|^2``, its micro-gradients and their weight,
  per micro-gradient as the placement defines one; the close forms the
  window's unbiased estimates from the sums over every device.

  Attributes:
    held: where the sums are held, and how each device's become the
      window's.
  """

  held: parts.Held = dataclasses.field(default_factory=parts.OnThisDevice)
  combine: parts.Combine = "sum"

  def zero(self) -> NoiseTerms:
    return NoiseTerms(
      square_sum=self.held.zero_total(),
      micro_gradients=jnp.zeros((), jnp.int32),
      weight=jnp.zeros((), jnp.float32),
    )

  def add(self, terms: NoiseTerms, micro_batch: parts.MicroBatch) -> NoiseTerms:
    own = micro_batch.own
    weight = jnp.asarray(own.weight, jnp.float32)
    counted = weights.counts(weight).astype(jnp.int32)
    return NoiseTerms(
      square_sum=terms.square_sum + own.weighted_total(leaf_square),
      micro_gradients=terms.micro_gradients + counted * own.count,
      weight=terms.weight + own.count * weight,
    )

  def close(
    self, terms: NoiseTerms, closing: parts.Closing
  ) -> NoiseScaleEstimate:
    """The window's estimates, from its sums over every device.

    ``closing.weight`` is not read: the terms hold their micro-gradients'
    own weight, which a placement may count otherwise than the window's
    (a device's share of it, where each device holds the whole gradient).
    """
    terms = self.held.combine(terms, self.combine)
    return window_estimate(
      terms.square_sum,
      terms.micro_gradients,
      terms.weight,
      square_norm(closing.mean_grads),
    )


# (inner_state, new_inner_state) -> (scale, kept): see Measured.units.
GradientUnits = Callable[[Any, Any], tuple[jax.Array, jax.Array]]


def same_units(
  inner_state: Any, new_inner_state: Any
) -> tuple[jax.Array, jax.Array]:
  """Gradients in their own units, every window kept: no loss scale."""
  del inner_state, new_inner_state
  return jnp.ones((), jnp.float32), jnp.asarray(True)


class NoiseReport(NamedTuple):
  """What a closed window tells of the noise scale, for the next window's k.

  Attributes:
    averages: the averages, this window folded in.
    micro_gradients: K, the window's micro-gradients of positive weight
      over every device.
  """

  averages: NoiseScaleAverages
  micro_gradients: jax.Array


class Measured:
  """The gradient noise scale as a part of the window (``noise_scale_decay``).

  Its value is a :class:`WindowNoise`: the open window's
  :class:`NoiseTermsPart` sums, added on the device that computed each
  micro-gradient, and the averages over the windows closed so far, into
  which each closing window's estimates (over every device) are folded.

  Attributes:
    decay: the averages' decay.
    units: ``(inner_state, new_inner_state) -> (scale, kept)``: the factor
      the window's gradients carry over their own units (a loss scale) and
      whether the wrapped optimizer kept the window; the estimates are
      divided by ``scale**2``, and a window not kept is not measured.
  """

  def __init__(self, decay: float, units: GradientUnits = same_units) -> None:
    self.decay = decay
    self.units = units

  def init(self, held: parts.Held, params: Any) -> WindowNoise:
    del params
    return WindowNoise(NoiseTermsPart(held).zero(), no_averages())

  def add(
    self, noise: WindowNoise, micro_batch: parts.MicroBatch
  ) -> WindowNoise:
    """The open window's sums with this micro-step's (if it is kept)."""
    terms = NoiseTermsPart().add(noise.terms, micro_batch)
    return noise._replace(terms=terms)

  def read(self, noise: WindowNoise, mean_grads: Any) -> jax.Array:
    """``|G|^2``, the window's mean gradient's squared norm."""
    del noise
    return square_norm(mean_grads)

  def close(
    self, noise: WindowNoise, closing: parts.WindowClosing
  ) -> tuple[WindowNoise, NoiseReport]:
    """The averages with the closing window's estimates folded in.

    ``closing.read`` is ``|G|^2``, from :meth:`read`.
    """
    # Combined here, once: K is reported beside the estimates.
    terms = closing.held.combine(noise.terms, "sum")
    estimate = window_estimate(
      terms.square_sum, terms.micro_gradients, terms.weight, closing.read
    )
    # Both estimates are linear in the squares: divided by the units'
    # square, they are in the gradients' own units.
    scale, kept = self.units(*closing.inner_states)
    units_squared = jnp.square(jnp.asarray(scale, jnp.float32))
    estimate = NoiseScaleEstimate(
      grad_sq=estimate.grad_sq / units_squared,
      trace_sigma=estimate.trace_sigma / units_squared,
      measured=estimate.measured & kept,
    )
    smoothed = smooth(noise.smoothed, estimate, self.decay)
    report = NoiseReport(smoothed, terms.micro_gradients)
    return noise._replace(smoothed=smoothed), report

  def restart(self, noise: WindowNoise) -> WindowNoise:
    """The sums emptied; the averages kept."""
    return noise._replace(terms=jax.tree.map(jnp.zeros_like, noise.terms))
