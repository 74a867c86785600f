"""The batch size, closed loop: k follows the noise scale, the step follows k.

A window already measures the gradient noise scale ``B_simple``, an estimate
of the critical batch size (:mod:`ga_optax._src.algebra.noise_scale`). Here the
run acts on it: :func:`adaptive_k` is an ``every_k`` whose k doubles (by
``factor``) when a full window closes with ``B_simple`` at least ``factor``
times its total weight, the batch it held, and (with ``min_k``) halves when
``B_simple`` falls below the batch over ``factor``, once the averages hold
``warmup_windows`` windows; and
:class:`LearningRateScaling` multiplies the wrapped optimizer's updates by
``sqrt(k / k0)`` or ``k / k0`` as k moves (the rules OLMo-core and Merrill
et al. (2025) use for Adam, and SGD's linear rule).

k changes only when a window closes, is part of the state, and is decided
from values every device holds after the window's reduction, so every
device decides the same k. A window remains exactly the large-batch step
of the micro-batches it holds, whatever its k.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from ga_optax._src import validation
from ga_optax._src.algebra import noise_scale as noise_lib
from ga_optax._src.algebra import parts


@dataclasses.dataclass(frozen=True)
class AdaptiveK:
  """An ``every_k`` following the measured noise scale (see :func:`adaptive_k`).

  Attributes:
    initial_k: the first window's k.
    max_k: k never grows past it.
    min_k: k never shrinks below it; None: k never shrinks.
    factor: what k is multiplied or divided by at a change.
    threshold: how far past the batch ``B_simple`` must be to move k.
    warmup_windows: the windows the averages must hold before their
      reading moves k.
  """

  initial_k: int
  max_k: int
  min_k: int | None
  factor: int
  threshold: float
  warmup_windows: int

  def first(self) -> jax.Array:
    """The first window's k."""
    return jnp.asarray(self.initial_k, jnp.int32)

  def current(self, every_k: jax.Array, update_step: jax.Array) -> jax.Array:
    """The state's k: the windows closed so far decided it."""
    del update_step
    return every_k

  def next(self, closed: parts.ClosedWindow) -> jax.Array:
    """The next window's k, from the window that just closed.

    Reads the window's k, its total weight W over every device, whether
    it closed by count (a flushed one moves nothing: its weight is not the
    batch k stands for), and the noise scale's report: the averages with
    this window folded in, and K, its micro-gradients of positive weight
    over every device.
    """
    k, window_weight, full = closed.k, closed.weight, closed.full
    report = closed.report(noise_lib.NoiseReport)
    noise, micro_gradients = report.averages, report.micro_gradients
    b_simple = noise_lib.read(noise).b_simple
    window_weight = window_weight.astype(b_simple.dtype)
    # The first windows' averages rest on a few noisy estimates (one
    # |G|^2 estimate at or below 0 reads as infinite): they move nothing.
    warmed_up = noise.windows >= self.warmup_windows
    # k * factor is formed only where it fits the int32 k: compared as
    # k <= max_k // factor, never as the product.
    may_grow = k <= self.max_k // self.factor
    # A window of fewer than 2 micro-gradients measures nothing, warm-up or
    # not: at such a k the reading would never move again (nor would the
    # warm-up end). NaN asks for nothing.
    grows = may_grow & (
      (micro_gradients < 2)
      | (
        warmed_up
        & (
          jnp.isinf(b_simple)
          | (b_simple >= self.threshold * self.factor * window_weight)
        )
      )
    )
    new_k = jnp.where(full & grows, k * self.factor, k)
    if self.min_k is not None:
      smaller = k // self.factor
      shrinks = (
        warmed_up
        & (b_simple < window_weight / (self.threshold * self.factor))
        & (k % self.factor == 0)
        & (smaller >= self.min_k)
        # The smaller window still holds at least 2 micro-gradients at
        # this window's rate (K / k per micro-step): K / factor >= 2.
        & (micro_gradients // 2 >= self.factor)
      )
      # Growth is tried first: a reading that meets both rules (possible
      # with threshold < 1 / factor) grows k where it can.
      new_k = jnp.where(full & ~grows & shrinks, smaller, new_k)
    return new_k.astype(jnp.int32)


def _reachable_max_k(initial_k: int, max_k: int, factor: int) -> None:
  """Raises unless ``max_k`` is ``initial_k * factor**n``, a k growth reaches.

  Raises:
    ValueError: ``max_k`` is below ``initial_k`` or between two of its
      multiples by powers of ``factor``.
  """
  if max_k < initial_k:
    raise ValueError(
      f"max_k must be at least initial_k={initial_k}, got max_k={max_k}."
    )
  reachable = initial_k
  while reachable <= max_k // factor:
    reachable *= factor
  if reachable != max_k:
    raise ValueError(
      f"max_k must be initial_k={initial_k} times a power of factor={factor}"
      f" (k grows {initial_k}, {initial_k * factor},"
      f" {initial_k * factor**2}, ...), so that k can reach it; got"
      f" max_k={max_k}, between {reachable} and {reachable * factor}. Pass"
      f" max_k={reachable}."
    )


def adaptive_k(
  initial_k: int,
  *,
  max_k: int,
  min_k: int | None = None,
  factor: int = 2,
  threshold: float = 1.0,
  warmup_windows: int = 4,
) -> AdaptiveK:
  """An ``every_k`` for :func:`ga_optax.accumulate` following the noise scale.

  When a window closes by count, with the smoothed ``B_simple`` of
  :func:`ga_optax.noise_scale` (this window folded in), that window's total
  weight ``W`` over every device (in the unit of the weights: items, or
  micro-batches at the default weight 1) and its K micro-gradients (those
  of positive weight, over every device: k on one device):

  * if ``B_simple >= threshold * factor * W`` (infinite included: the
    gradient lost in the noise) and ``k * factor <= max_k``, the next
    window's k is ``k * factor``;
  * if the window held fewer than 2 micro-gradients it measured nothing,
    and k grows the same way, so that the next window measures (on one
    device, a first window of k = 1);
  * with ``min_k`` set, if ``B_simple < W / (threshold * factor)`` (0, no
    measurable noise, included), ``k`` is a multiple of ``factor`` (k
    shrinks only by an exact division: a k of 3 with factor 2 stays 3),
    ``k / factor >= min_k``, and a window of ``k / factor`` would still
    hold at least 2 micro-gradients (K / factor >= 2), it is
    ``k / factor``;
  * otherwise k stays. ``B_simple`` NaN (nothing measured yet, or a window
    that a loss scale dropped) keeps k.

  The rules are tried in this order: a reading that meets both the first
  and the third (possible only with ``threshold < 1 / factor``) grows k,
  where ``max_k`` allows.

  The reading moves k only once the averages hold ``warmup_windows``
  measured windows (this one included): the windows before decide
  nothing, whatever they read. A window's own estimates are noisy: at
  k = 2 it reads ``tr(Sigma)`` from one degree of freedom, and its
  ``|G|^2`` estimate falls to 0 or below (an infinite ``B_simple``)
  whenever the noise in that window outweighs the gradient, which would
  double k at once. A window that measures nothing (the second rule) is
  not counted, and still grows k.

  k never reaches a window that measures nothing, so it never freezes on a
  stale reading: on one device (and inside ``jax.shard_map`` with
  ``check_vma=True``, where a micro-step is one micro-gradient) it stays at
  2 or more whatever ``min_k``; ``min_k=1`` reaches 1 where every device's
  gradient is a micro-gradient of its own (``axis_name`` with
  ``check_vma=False``, ``unreduced_axes``) on at least 2 devices. Keeping
  the measurement running was chosen over refusing ``min_k=1``: the device
  count that decides it is known only in the traced step, and a run moved
  to one device keeps working.

  A flushed window does not move k: its weight is not the batch that k
  stands for. k is part of the state (:func:`ga_optax.current_k` reads
  it): a checkpoint resumes with it, and every device decides the same k.
  Needs ``noise_scale_decay`` on ``accumulate``.

  Args:
    initial_k: the first window's k, a positive int.
    max_k: the largest k: ``initial_k`` times a power of ``factor``, so that
      k can reach it.
    min_k: the smallest k, at most ``initial_k``; None (the default): k
      never shrinks.
    factor: what k is multiplied or divided by, an int of at least 2.
    threshold: a positive number: how far past the batch ``B_simple`` must
      be before k moves (1: k doubles once ``B_simple`` reaches twice the
      batch, the point past which a larger batch still cuts the steps).
    warmup_windows: a positive int: the measured windows the averages must
      hold before their reading moves k; 1 decides on the first window's
      estimates. The default, 4, averages enough windows to halve the
      standard error of one window's estimates where
      ``noise_scale_decay`` keeps them (at 0.9, 4 windows weigh 1, 0.9,
      0.81 and 0.73: worth 3.95 windows; at 0 the averages are the last
      window's, and the warm-up only delays the first move), for the cost
      of 4 windows at ``initial_k`` (8 micro-steps at k = 2).

  Every size and ``factor`` must be at most 2**31 - 1, the range of the
  state's int32 counters.

  Returns:
    An :class:`AdaptiveK`, to pass as ``every_k``.

  Raises:
    TypeError: a size, ``factor`` or ``warmup_windows`` is not an int,
      ``threshold`` not a number.
    ValueError: a value out of its range, or a ``max_k`` that is not
      ``initial_k * factor**n``.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.accumulate(
    ...     optax.sgd(0.1), ga_optax.batch_size.adaptive_k(2, max_k=8),
    ...     noise_scale_decay=0.9)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> ks = []  # the next window's k, after each window closes
    >>> for _ in range(4):  # 4 windows of k = 2: all noise, no signal
    ...   for grad in ([1.0, -1.0], [-1.0, 1.0]):
    ...     _, state = tx.update(jnp.array(grad), state, params)
    ...   ks.append(int(ga_optax.current_k(state)))
    >>> ks  # the warm-up's 3 windows, then the 4th doubles k
    [2, 2, 2, 4]
  """
  initial_k = validation.check_count(initial_k, "initial_k")
  max_k = validation.check_count(max_k, "max_k")
  if isinstance(factor, bool) or not validation.is_int(factor):
    raise TypeError(f"factor must be an int of at least 2, got {factor!r}.")
  if int(factor) < 2:
    raise ValueError(
      f"factor must be at least 2 (k moves by it), got {factor!r}."
    )
  factor = validation.check_count(factor, "factor")
  _reachable_max_k(initial_k, max_k, factor)
  if min_k is not None:
    min_k = validation.check_count(min_k, "min_k")
    if min_k > initial_k:
      raise ValueError(
        f"min_k must be at most initial_k={initial_k}, got min_k={min_k}."
      )
  if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
    raise TypeError(f"threshold must be a positive number, got {threshold!r}.")
  if not (math.isfinite(threshold) and threshold > 0):
    raise ValueError(f"threshold must be a positive number, got {threshold}.")
  warmup_windows = validation.check_count(warmup_windows, "warmup_windows")
  return AdaptiveK(
    initial_k, max_k, min_k, factor, float(threshold), warmup_windows
  )


LR_SCALINGS = (None, "sqrt", "linear")


@dataclasses.dataclass(frozen=True)
class LearningRateScaling:
  """Multiplies the wrapped optimizer's updates as k moves from the first k.

  Attributes:
    rule: None (updates as they are), ``"sqrt"`` (``sqrt(k / k0)``) or
      ``"linear"`` (``k / k0``).
  """

  rule: str | None

  @classmethod
  def of(cls, lr_scaling: Any) -> LearningRateScaling:
    """The scaling ``lr_scaling`` names.

    Raises:
      ValueError: it names none.
    """
    if lr_scaling not in LR_SCALINGS:
      raise ValueError(
        f"lr_scaling must be one of {LR_SCALINGS}: None leaves the updates"
        " alone, 'sqrt' multiplies them by sqrt(k / k0) (Adam's rule),"
        f" 'linear' by k / k0 (SGD's); got {lr_scaling!r}."
      )
    return cls(lr_scaling)

  def apply(self, updates: Any, k: jax.Array, first_k: jax.Array) -> Any:
    """``updates`` scaled for a window of ``k`` (the first's ``first_k``)."""
    if self.rule is None:
      return updates
    ratio = k.astype(jnp.float32) / first_k.astype(jnp.float32)
    scale = jnp.sqrt(ratio) if self.rule == "sqrt" else ratio
    return jax.tree.map(
      lambda update: update * scale.astype(update.dtype), updates
    )
