"""Choosing k from the measured noise scale, on the host, between windows.

The window measures ``B_simple``, an estimate of the critical batch size in
the unit of the weights (see :class:`ga_optax.NoiseScale`). These functions
turn readings of it into a k: the nearest power of two
(:func:`suggested_k`), a batch-size warm-up schedule for ``every_k``
(:func:`warmup_schedule`), and the k that trains fastest per second once
the closing step's cost is counted (:func:`goodput_k`). They are plain
Python, called between jitted steps.

All three read ``B_simple`` as :func:`ga_optax.noise_scale` returns it, and
as :func:`ga_optax.batch_size.adaptive_k` acts on it:

* NaN (no window measured yet) never grows k: 1, or the warm-up's k so far;
* infinite (the smoothed |G|^2 is at or below 0: the gradient is lost in the
  noise of batches this size) counts as larger than any batch;
* 0 (the smoothed tr(Sigma) is at or below 0: no measurable noise) is the
  smallest batch, never a reason to grow k;
* a negative value is refused: it could mean either of the last two (a
  tr(Sigma) or a |G|^2 below 0), and ``noise_scale`` never returns one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from jax.typing import ArrayLike

from ga_optax._src import validation
from ga_optax._src.algebra.noise_scale import NoiseScale
from ga_optax._src.batch_size.every_k import MAX_COUNT

# The largest power of two that accumulate's int32 counters take as a k.
MAX_POWER_OF_TWO = 1 << (MAX_COUNT.bit_length() - 1)


def read_b_simple(noise_scale: Any, name: str) -> float:
  """``B_simple`` as a Python float, from a NoiseScale or a real scalar.

  Raises:
    TypeError: neither a NoiseScale nor a real scalar, or a value traced
      inside ``jax.jit`` (these functions run on the host).
  """
  value = noise_scale
  if isinstance(noise_scale, NoiseScale):
    value = noise_scale.b_simple
  what = (
    f"{name} must be a ga_optax.NoiseScale (what"
    " ga_optax.noise_scale(state) returns) or B_simple as a real scalar"
  )
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      f"{what}; got a value traced inside jax.jit. These functions run on"
      " the host, between steps: call them outside the jitted function."
    )
  dtype = getattr(value, "dtype", None)
  if (isinstance(value, numbers.Real) and not isinstance(value, bool)) or (
    dtype is not None
    and getattr(value, "shape", None) == ()
    and (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer))
  ):
    return _not_negative(float(value), name)
  described = type(value).__name__
  if dtype is not None:
    described += f" of dtype {dtype} and shape {getattr(value, 'shape', '?')}"
  raise TypeError(f"{what}, got {value!r} ({described}).")


def _not_negative(b_simple: float, name: str) -> float:
  """``b_simple``, refused when negative: it would have two readings.

  Raises:
    ValueError: ``b_simple`` is below 0.
  """
  if b_simple < 0:
    raise ValueError(
      f"{name}'s B_simple must not be negative, got {b_simple}: a negative"
      " ratio comes from an estimated tr(Sigma) below 0 (no measurable"
      " noise, read as 0) or an estimated |G|^2 below 0 (larger than any"
      " batch, read as inf), which call for opposite k."
      " ga_optax.noise_scale(state) reads them so: pass what it returns, or"
      " 0.0 or float('inf') for these readings."
    )
  return b_simple


def check_positive_real(
  value: Any, name: str, *, zero_ok: bool = False
) -> float:
  """``value`` as a float: a finite real number above 0 (or at 0).

  Raises:
    TypeError: not a real number (a bool is not one).
    ValueError: not finite, or below the bound.
  """
  bound = "non-negative" if zero_ok else "positive"
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(
      f"{name} must be a {bound} real number, got {value!r} of type"
      f" {type(value).__name__}."
    )
  number = float(value)
  if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
    raise ValueError(f"{name} must be a finite, {bound} number, got {value!r}.")
  return number


def check_max_power_of_two(max_k: Any) -> int:
  """``max_k`` as an int: a power of two that ``accumulate`` takes as a k.

  Raises:
    TypeError: not an int.
    ValueError: below 1, not a power of two, or above 2**30.
  """
  max_k = validation.check_positive_int(max_k, "max_k")
  if max_k > MAX_POWER_OF_TWO:
    raise ValueError(
      f"max_k must be at most 2**30 = {MAX_POWER_OF_TWO}, the largest power"
      f" of two accumulate's int32 counters hold, got {max_k}."
    )
  if max_k & (max_k - 1):
    below = 1 << (max_k.bit_length() - 1)
    raise ValueError(
      "max_k must be a power of two, as every k this function answers is;"
      f" got {max_k}, between {below} and {2 * below}."
    )
  return max_k


def is_large(b_simple: float) -> bool:
  """Whether a reading counts as larger than any batch (infinite)."""
  return b_simple == math.inf


def suggested_k(
  noise_scale: NoiseScale | ArrayLike,
  items_per_micro_step: float,
  max_k: int,
) -> int:
  """The power of two nearest ``B_simple / items_per_micro_step``, up to max_k.

  ``2 ** round(log2(B_simple / items_per_micro_step))``, clamped to
  ``[1, max_k]``: the k whose window's batch is nearest ``B_simple`` on a
  log scale (a ratio of 7.9 gives 8, 5.5 gives 4; the boundary between k
  and 2k is ``k * sqrt(2)``, which rounds up: ``4 * sqrt(2)`` gives 8).
  Batches near ``B_simple`` are where, by McCandlish et al.'s model,
  doubling the batch stops saving nearly half the steps and starts costing
  nearly twice the items. Powers
  of two keep the distinct k few, so that a loop that compiles one step per
  k (the in-step path) compiles few.

  Args:
    noise_scale: what :func:`ga_optax.noise_scale` returns, or ``B_simple``
      itself as a real scalar (a Python number, a NumPy or JAX scalar),
      not negative. NaN (nothing measured yet) and 0 (no measurable noise)
      give 1; infinite (the gradient is lost in the noise: a batch larger
      than any) gives ``max_k``.
    items_per_micro_step: the items one micro-step holds, on all devices
      together, in the unit of the weights (samples, tokens; 1 at the
      default weight): a finite number above 0.
    max_k: the largest k to suggest: a power of two, at most 2**30.

  Returns:
    A power of two in ``[1, max_k]``.

  Raises:
    TypeError: ``noise_scale`` is neither a NoiseScale nor a real scalar
      (or is traced inside ``jax.jit``); ``items_per_micro_step`` is not a
      real number; ``max_k`` is not an int.
    ValueError: ``noise_scale`` is negative; ``items_per_micro_step`` is
      not finite and positive; ``max_k`` is not a power of two in
      ``[1, 2**30]``.

  Example:
    >>> import ga_optax
    >>> ga_optax.batch_size.suggested_k(126.4, 16, max_k=64)  # 126.4 / 16 = 7.9
    8
    >>> ga_optax.batch_size.suggested_k(
    ...     88.0, 16, max_k=64)  # 5.5: nearer 4 than 8
    4
    >>> ga_optax.batch_size.suggested_k(float("nan"), 16, max_k=64)
    1
    >>> ga_optax.batch_size.suggested_k(float("inf"), 16, max_k=64)
    64
  """
  b_simple = read_b_simple(noise_scale, "noise_scale")
  items = check_positive_real(items_per_micro_step, "items_per_micro_step")
  max_k = check_max_power_of_two(max_k)
  if math.isnan(b_simple):
    return 1
  ratio = b_simple / items
  if is_large(b_simple) or ratio == math.inf:
    return max_k
  if ratio == 0:
    return 1
  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1): the power of two
  # below is exact, and the tie at k * sqrt(2) goes up (Python's round
  # would send a log2 of 2.5 to 2, and log2 itself may round below it).
  mantissa, exponent = math.frexp(ratio)
  exponent = exponent - 1 + int(mantissa >= math.sqrt(0.5))
  return 1 << min(max(exponent, 0), max_k.bit_length() - 1)


def check_reading(reading: Any, index: int) -> tuple[int, float]:
  """One ``(update_step, B_simple)`` reading, checked.

  Raises:
    TypeError: not a pair, a step that is not an integer scalar, or a
      B_simple that is not a real scalar.
    ValueError: a step below 0 or above 2**31 - 1.
  """
  name = f"readings[{index}]"
  try:
    update_step, b_simple = reading
  except (TypeError, ValueError) as error:
    raise TypeError(
      f"{name} must be a pair (update_step, B_simple), got {reading!r}."
    ) from error
  dtype = getattr(update_step, "dtype", None)
  integer_scalar = (
    dtype is not None
    and getattr(update_step, "shape", None) == ()
    and np.issubdtype(dtype, np.integer)
    and not isinstance(update_step, jax.core.Tracer)
  )
  if not (validation.is_int(update_step) or integer_scalar):
    raise TypeError(
      f"{name}'s update_step must be an int or an integer scalar array (what"
      " ga_optax.applied_updates(state) returns), got"
      f" {update_step!r} of type {type(update_step).__name__}."
    )
  if not 0 <= int(update_step) <= MAX_COUNT:
    raise ValueError(
      f"{name}'s update_step must be in [0, 2**31 - 1], the range of the"
      f" state's applied-update counter, got {update_step}."
    )
  return int(update_step), read_b_simple(b_simple, f"{name}'s B_simple")


def check_doubling_range(first_k: Any, max_k: Any) -> tuple[int, int]:
  """``first_k`` and ``max_k``, with ``max_k`` first_k times a power of two.

  Raises:
    TypeError: either is not an int.
    ValueError: either is below 1 or above 2**31 - 1, ``max_k < first_k``,
      or ``max_k`` is not ``first_k * 2**n``.
  """
  first_k = validation.check_positive_int(first_k, "first_k")
  max_k = validation.check_positive_int(max_k, "max_k")
  if max_k > MAX_COUNT:
    raise ValueError(
      f"max_k must be at most 2**31 - 1 = {MAX_COUNT}, the largest k"
      f" accumulate's int32 counters hold, got {max_k}."
    )
  if max_k < first_k:
    raise ValueError(
      f"max_k must be at least first_k={first_k}, got max_k={max_k}."
    )
  reachable = first_k
  while 2 * reachable <= max_k:
    reachable *= 2
  if reachable != max_k:
    raise ValueError(
      f"max_k must be first_k={first_k} times a power of two (k doubles"
      f" from first_k: {first_k}, {2 * first_k}, {4 * first_k}, ...), got"
      f" {max_k}, between {reachable} and {2 * reachable}."
    )
  return first_k, max_k


def warmup_schedule(
  readings: Iterable[tuple[ArrayLike, NoiseScale | ArrayLike]],
  items_per_micro_step: float,
  first_k: int,
  max_k: int,
) -> dict[int, int]:
  """A batch-size warm-up: ``{update_step: k}`` from readings of B_simple.

  k starts at ``first_k`` and doubles, up to ``max_k``, at the first
  reading where ``B_simple >= 2 * k * items_per_micro_step``: where the
  doubled window's batch reaches the noise scale. Give it the readings of
  a first run (or of a probe), and pass the result as ``every_k`` to
  :func:`ga_optax.accumulate` for the next: its keys count applied
  updates, as ``every_k`` dicts do, so a reading taken after update n sets
  the k of the windows from update n on.

  * One reading can double k several times: it takes k as far as that
    reading supports, so readings taken far apart do not lag behind.
  * k never shrinks: a reading below the current batch leaves it.
  * NaN readings (nothing measured yet) are skipped; infinite ones count as
    larger than any batch (k goes to ``max_k``); 0 (no measurable noise)
    never grows k; negative ones are refused, as in :func:`suggested_k`.
  * The readings may come in any order: they are taken by update step
    (readings of the same step in the order given). A reading at step 0,
    from a probe before training, sets the first window's k.

  Args:
    readings: ``(update_step, B_simple)`` pairs: the update step as
      :func:`ga_optax.applied_updates` counts it (an int or an integer
      scalar), and ``B_simple`` as a real scalar or the
      :class:`ga_optax.NoiseScale` read then.
    items_per_micro_step: the items one micro-step holds, on all devices
      together, in the unit of the weights: a finite number above 0.
    first_k: k before any reading that grows it; an int >= 1.
    max_k: the largest k: ``first_k`` times a power of two, so that the
      doublings reach it exactly; at most 2**31 - 1.

  Returns:
    A dict with key 0 and one key per update step where k changes, in
    increasing order, mapping to k: a valid ``every_k``.

  Raises:
    TypeError: a reading is not a pair of an integer and a real scalar;
      ``items_per_micro_step`` is not a real number; ``first_k`` or
      ``max_k`` is not an int.
    ValueError: an update step is outside ``[0, 2**31 - 1]``; a
      ``B_simple`` is negative; ``items_per_micro_step`` is not finite and
      positive; ``max_k`` is below ``first_k`` or is not
      ``first_k * 2**n``.

  Example:
    Micro-steps of 16 items: k = 2 doubles once B_simple reaches 64 items,
    again at 128; a reading of 300 at once takes it from 4 to 16.

    >>> import ga_optax
    >>> readings = [(1, 40.0), (2, 70.0), (3, 100.0), (4, 300.0)]
    >>> ga_optax.batch_size.warmup_schedule(readings, 16, first_k=2, max_k=16)
    {0: 2, 2: 4, 4: 16}
  """
  items = check_positive_real(items_per_micro_step, "items_per_micro_step")
  first_k, max_k = check_doubling_range(first_k, max_k)
  if isinstance(readings, NoiseScale) or not isinstance(readings, Iterable):
    raise TypeError(
      "readings must be an iterable of (update_step, B_simple) pairs, got"
      f" {type(readings).__name__}."
    )
  checked = [check_reading(reading, i) for i, reading in enumerate(readings)]
  schedule, k = {0: first_k}, first_k
  for update_step, b_simple in sorted(checked, key=lambda pair: pair[0]):
    grown = k
    while 2 * grown <= max_k and (
      is_large(b_simple) or b_simple >= 2 * grown * items
    ):
      grown *= 2
    if grown != k:
      schedule[update_step] = k = grown
  return schedule


def goodput_k(
  noise_scale: NoiseScale | ArrayLike,
  *,
  items_per_micro_step: float,
  micro_step_seconds: float,
  closing_seconds: float,
  base_batch: float,
  max_k: int,
) -> int:
  """The power of two k that makes training progress fastest per second.

  Pollux's goodput (Qiao et al., OSDI 2021), for accumulation: the k in
  ``1, 2, 4, ..., max_k`` that maximises ``throughput(k) *
  efficiency(k)``, with

      throughput(k) = k * items / (k * micro_step_seconds + closing_seconds)
      efficiency(k) = (B_simple + base_batch) / (B_simple + k * items)

  (``items`` is ``items_per_micro_step``). Throughput counts items per
  second: a window of k micro-steps pays the closing step once, so it
  grows with k. Efficiency is the progress an item buys at batch
  ``k * items``, relative to ``base_batch``; it falls with k. Their
  product rises, then falls, with its peak at ``k = sqrt(closing_seconds /
  micro_step_seconds * B_simple / items)``: doubling k from k pays exactly
  when ``closing_seconds / micro_step_seconds * B_simple / items > 2 k^2``.
  ``base_batch`` scales every k's goodput alike, so it does not move the
  peak; it is the batch at which efficiency is 1.

  Only powers of two compete: one compiled step per distinct k on the
  in-step path stays few, and the best power of two is never more than
  ``sqrt(2)`` from the peak, where the goodput is at least ``2 sqrt(2) / 3``
  (94%) of the peak's. (``accumulate`` itself takes any k, traced, with no
  recompilation.)

  Args:
    noise_scale: what :func:`ga_optax.noise_scale` returns, or ``B_simple``
      as a real scalar, not negative. NaN (nothing measured yet) gives 1,
      as ``B_simple = 0`` does (no measurable noise: a larger batch buys
      nothing). Infinite counts as larger than any batch: efficiency 1 for
      every k, so ``max_k`` when ``closing_seconds > 0`` and 1 when it is
      0.
    items_per_micro_step: the items one micro-step holds, on all devices
      together, in the unit of the weights: a finite number above 0.
    micro_step_seconds: the time of a micro-step that does not close the
      window: above 0.
    closing_seconds: what closing a window adds to its last micro-step (the
      reduction across devices or hosts, the optimizer step, a round trip
      to host memory): 0 or more.
    base_batch: the batch, in items, at which efficiency is 1 (the batch
      the learning rate was tuned for): above 0.
    max_k: the largest k to consider: a power of two, at most 2**30.

  Returns:
    The best power of two in ``[1, max_k]``; ties go to the smaller k.

  Raises:
    TypeError: ``noise_scale`` is neither a NoiseScale nor a real scalar; a
      number is not a real number; ``max_k`` is not an int.
    ValueError: ``noise_scale`` is negative; a time or size is not finite
      or out of its range; ``max_k`` is not a power of two in
      ``[1, 2**30]``.

  Example:
    A closing step as long as a micro-step, B_simple = 200 items and
    micro-steps of 8: the peak is at sqrt(1 * 200 / 8) = 5, and 4 beats 8.

    >>> import ga_optax
    >>> ga_optax.batch_size.goodput_k(
    ...     200.0, items_per_micro_step=8, micro_step_seconds=0.02,
    ...     closing_seconds=0.02, base_batch=8, max_k=64)
    4
  """
  b_simple = read_b_simple(noise_scale, "noise_scale")
  items = check_positive_real(items_per_micro_step, "items_per_micro_step")
  micro_step = check_positive_real(micro_step_seconds, "micro_step_seconds")
  closing = check_positive_real(
    closing_seconds, "closing_seconds", zero_ok=True
  )
  base = check_positive_real(base_batch, "base_batch")
  max_k = check_max_power_of_two(max_k)
  if math.isnan(b_simple):
    return 1
  large = is_large(b_simple)

  def goodput(k: int) -> float:
    throughput = k * items / (k * micro_step + closing)
    efficiency = 1.0 if large else (b_simple + base) / (b_simple + k * items)
    return throughput * efficiency

  # max keeps the first of equals: ties go to the smaller k.
  powers = (1 << exponent for exponent in range(max_k.bit_length()))
  return max(powers, key=goodput)
