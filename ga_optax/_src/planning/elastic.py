"""Elastic plans: micro-batch x micro-steps x devices = global batch.

Data-parallel gradient accumulation trains on ``num_devices`` devices, each
running ``num_microbatches`` micro-steps of ``micro_batch_size`` examples
per window, so one update sees ``micro_batch_size * num_microbatches *
num_devices`` examples. Keeping that product fixed while the device count
changes keeps the training trajectory: the same global batch on 1, 2, 4 or
8 devices gives the same updates (to float rounding). These functions pick
the factors, say which device counts a global batch allows, and pick a
global batch that allows many.

The candidate micro-batch sizes are the ones a device can run (a memory
budget, a kernel that wants multiples of 8); ``max_micro_batch_size``
keeps only those that fit a memory budget, for example the size that
:func:`ga_optax.planning.plan_microbatch` finds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from ga_optax._src import validation


class ElasticPlan(NamedTuple):
  """How to reach a global batch on a number of devices.

  ``micro_batch_size * num_microbatches * num_devices == global_batch_size``.

  Attributes:
    global_batch_size: examples per optimizer update, over all devices.
    num_devices: data-parallel devices the plan is for.
    micro_batch_size: examples per device per micro-step.
    num_microbatches: micro-steps per window, the ``every_k`` of
      :func:`ga_optax.accumulate` (or the ``num_microbatches`` of
      :func:`ga_optax.microbatched_value_and_grad`).
  """

  global_batch_size: int
  num_devices: int
  micro_batch_size: int
  num_microbatches: int


def elastic_plan(
  global_batch_size: int,
  num_devices: int,
  micro_batch_sizes: Iterable[int],
  *,
  max_micro_batch_size: int | None = None,
) -> ElasticPlan:
  """Splits a global batch over devices and micro-steps.

  Picks the largest candidate micro-batch size ``m`` that divides the
  per-device batch ``global_batch_size / num_devices``; the number of
  micro-steps is what is left, so that ``m * num_microbatches *
  num_devices == global_batch_size`` exactly. The largest size makes the
  fewest micro-steps, which is usually the fastest.

  To plan within a memory budget, pass ``max_micro_batch_size``: the
  largest micro-batch one device can hold, for example
  ``ga_optax.planning.plan_microbatch(...).micro_batch_size`` (planned
  without a ``global_batch_size``, so that it is the largest size that fits,
  not the largest divisor of some batch). Candidates above it are left out. A
  size limit, rather than a byte budget or a ``fits(size)`` callable, is
  enough because the bytes grow with the micro-batch size (the memory
  planner's own assumption), and it keeps the compilation of the model
  out of this function: the memory planner compiles a handful of sizes
  once, and every plan for every device count reuses its answer.

  Args:
    global_batch_size: examples per optimizer update, over all devices.
    num_devices: data-parallel devices to plan for.
    micro_batch_sizes: the candidate sizes of a device's micro-batch, in
      any order, for example ``(1, 2, 4, 8, 16)``.
    max_micro_batch_size: the largest micro-batch that fits one device's
      memory budget, or None to consider every candidate.

  Returns:
    An :class:`ElasticPlan`.

  Raises:
    TypeError: a size or count is not an int (a bool is not one), or
      ``micro_batch_sizes`` is not a collection of ints.
    ValueError: a size or count is below 1, no candidate is left, or no
      candidate divides the per-device batch; the message lists the device
      counts that do work (see :func:`valid_device_counts`).

  Example:
    18 examples on 3 devices: 6 per device, 2 micro-steps of 3.

    >>> import ga_optax
    >>> ga_optax.planning.elastic_plan(18, 3, (1, 2, 3))
    ElasticPlan(global_batch_size=18, num_devices=3, micro_batch_size=3,
                num_microbatches=2)
    >>> ga_optax.planning.elastic_plan(
    ...     18, 3, (1, 2, 3), max_micro_batch_size=2)
    ElasticPlan(global_batch_size=18, num_devices=3, micro_batch_size=2,
                num_microbatches=3)
    >>> ga_optax.planning.elastic_plan(18, 4, (1, 2, 3))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: num_devices=4 cannot split global_batch_size=18 ... the
    device counts that can are 1, 2, 3, 6, 9, 18.
  """
  global_batch_size = validation.check_positive_int(
    global_batch_size, "global_batch_size"
  )
  num_devices = validation.check_positive_int(num_devices, "num_devices")
  sizes = _check_micro_batch_sizes(micro_batch_sizes, max_micro_batch_size)
  per_device, remainder = divmod(global_batch_size, num_devices)
  dividing = (
    [] if remainder else [size for size in sizes if per_device % size == 0]
  )
  if not dividing:
    raise ValueError(
      f"num_devices={num_devices} cannot split"
      f" global_batch_size={global_batch_size} into micro-batches of"
      f" micro_batch_sizes {sizes}: "
      + _describe_valid_counts(global_batch_size, sizes, num_devices)
    )
  micro_batch_size = dividing[-1]
  return ElasticPlan(
    global_batch_size=global_batch_size,
    num_devices=num_devices,
    micro_batch_size=micro_batch_size,
    num_microbatches=per_device // micro_batch_size,
  )


def valid_device_counts(
  global_batch_size: int,
  micro_batch_sizes: Iterable[int],
  max_devices: int,
  min_devices: int = 1,
  *,
  max_micro_batch_size: int | None = None,
) -> tuple[int, ...]:
  """The device counts on which a global batch splits into micro-batches.

  A device count ``d`` is valid when some candidate ``m`` divides the
  per-device batch, that is when ``m * d`` divides ``global_batch_size``;
  then :func:`elastic_plan` succeeds for ``d``.

  Args:
    global_batch_size: examples per optimizer update, over all devices.
    micro_batch_sizes: the candidate sizes of a device's micro-batch.
    max_devices: the largest device count to consider.
    min_devices: the smallest device count to consider.
    max_micro_batch_size: the largest micro-batch that fits one device's
      memory budget (see :func:`elastic_plan`), or None.

  Returns:
    The valid counts in ``[min_devices, max_devices]``, increasing (empty
    when there is none).

  Raises:
    TypeError: a size or count is not an int.
    ValueError: a size or count is below 1, ``min_devices > max_devices``,
      or no candidate is left under ``max_micro_batch_size``.

  Example:
    >>> import ga_optax
    >>> ga_optax.planning.valid_device_counts(18, (1, 2, 3), max_devices=8)
    (1, 2, 3, 6)
    >>> ga_optax.planning.valid_device_counts(18, (2,), max_devices=18)
    (1, 3, 9)
  """
  global_batch_size = validation.check_positive_int(
    global_batch_size, "global_batch_size"
  )
  sizes = _check_micro_batch_sizes(micro_batch_sizes, max_micro_batch_size)
  min_devices, max_devices = _check_device_range(min_devices, max_devices)
  return _valid_counts(global_batch_size, sizes, min_devices, max_devices)


def best_global_batch_size(
  max_global_batch_size: int,
  micro_batch_sizes: Iterable[int],
  *,
  min_devices: int = 1,
  max_devices: int,
  prefer_larger: bool = True,
  max_micro_batch_size: int | None = None,
) -> int:
  """The global batch, up to a limit, that runs on the most device counts.

  Choosing the global batch once, so that a job can move between device
  counts without changing its trajectory: among ``1..max_global_batch_size``
  this returns the size valid (in the sense of :func:`valid_device_counts`)
  on the most device counts in ``[min_devices, max_devices]``. Ties go to
  the largest size, or the smallest with ``prefer_larger=False``.

  It takes well under a second for limits in the millions and device
  ranges in the thousands. Memory grows in proportion to the limit (a few
  bytes per size up to it) while it runs.

  Args:
    max_global_batch_size: the largest global batch to consider.
    micro_batch_sizes: the candidate sizes of a device's micro-batch.
    min_devices: the smallest device count to consider.
    max_devices: the largest device count to consider.
    prefer_larger: how to break ties: the largest size when true, the
      smallest when false.
    max_micro_batch_size: the largest micro-batch that fits one device's
      memory budget (see :func:`elastic_plan`), or None.

  Returns:
    The global batch size, an int.

  Raises:
    TypeError: a size or count is not an int, or ``prefer_larger`` is not
      a bool.
    ValueError: a size or count is below 1, ``min_devices > max_devices``,
      no candidate is left under ``max_micro_batch_size``, or no size up to
      the limit is valid on any device count in the range.

  Example:
    Up to 16 examples on 1 to 4 devices with micro-batches of 1 or 2: only
    12 runs on all four device counts.

    >>> import ga_optax
    >>> ga_optax.planning.best_global_batch_size(16, (1, 2), max_devices=4)
    12
    >>> ga_optax.planning.valid_device_counts(12, (1, 2), max_devices=4)
    (1, 2, 3, 4)

    On 1 or 2 devices every even size runs on both; ties go to the largest
    unless ``prefer_larger=False``.

    >>> ga_optax.planning.best_global_batch_size(10, (1,), max_devices=2)
    10
    >>> ga_optax.planning.best_global_batch_size(
    ...     10, (1,), max_devices=2, prefer_larger=False)
    2
  """
  limit = validation.check_positive_int(
    max_global_batch_size, "max_global_batch_size"
  )
  sizes = _check_micro_batch_sizes(micro_batch_sizes, max_micro_batch_size)
  min_devices, max_devices = _check_device_range(min_devices, max_devices)
  if not isinstance(prefer_larger, (bool, np.bool_)):
    raise TypeError(
      f"prefer_larger must be a bool, got {prefer_larger!r} of type"
      f" {type(prefer_larger).__name__}."
    )
  counts = _count_valid_devices(limit, sizes, min_devices, max_devices)
  most = int(counts.max())
  if most == 0:
    raise ValueError(
      f"No global batch size up to max_global_batch_size={limit} splits"
      f" into micro_batch_sizes {sizes} on any device count from"
      f" min_devices={min_devices} to max_devices={max_devices}: the"
      f" smallest that does is {sizes[0] * min_devices} (the smallest"
      " candidate times min_devices); raise max_global_batch_size or lower"
      " min_devices."
    )
  best = np.flatnonzero(counts == most)
  return int(best[-1] if prefer_larger else best[0])


def _count_valid_devices(
  limit: int, sizes: tuple[int, ...], min_devices: int, max_devices: int
) -> np.ndarray:
  """For every global batch g in 0..limit, its number of valid devices.

  A device count d is valid for g when d divides g and the quotient
  q = g / d is a multiple of some candidate. So: mark once, in a boolean
  sieve, the quotients that are a multiple of some candidate; then for
  each d add that mark to every multiple of d, ``counts[d * q] +=
  has_candidate[q]``. The mark is a boolean, so d adds at most 1 to g even
  when several candidates divide q, and g gets exactly one add from each
  d that divides it, which makes the count exact. The work is one
  vectorised add per device count, over limit / d entries: about limit *
  ln(max_devices / min_devices) element operations in all, instead of one
  divisibility test per (g, d, candidate).
  """
  # A device count above limit / smallest candidate has no valid g.
  largest_devices = min(max_devices, limit // sizes[0])
  has_candidate = np.zeros(limit // min_devices + 1, dtype=bool)
  for size in sizes:
    has_candidate[size::size] = True
  # A count never exceeds the number of device counts in the range.
  dtype = np.min_scalar_type(max(largest_devices - min_devices + 1, 1))
  counts = np.zeros(limit + 1, dtype=dtype)
  for devices in range(min_devices, largest_devices + 1):
    counts[devices::devices] += has_candidate[1 : limit // devices + 1]
  return counts


def _valid_counts(
  global_batch_size: int,
  sizes: tuple[int, ...],
  min_devices: int,
  max_devices: int,
) -> tuple[int, ...]:
  return tuple(
    devices
    for devices in _divisors(global_batch_size)
    if min_devices <= devices <= max_devices
    and any((global_batch_size // devices) % size == 0 for size in sizes)
  )


def _divisors(number: int) -> list[int]:
  """The divisors of a positive int, increasing (trial division)."""
  small = [
    divisor
    for divisor in range(1, math.isqrt(number) + 1)
    if number % divisor == 0
  ]
  large = [number // divisor for divisor in reversed(small)]
  return small + large[1:] if small[-1] ** 2 == number else small + large


# Error messages list at most this many valid device counts.
_MAX_LISTED = 16


def _describe_valid_counts(
  global_batch_size: int, sizes: tuple[int, ...], num_devices: int
) -> str:
  """Which device counts do work for the global batch, for an error."""
  counts = _valid_counts(global_batch_size, sizes, 1, global_batch_size)
  if not counts:
    return (
      "no candidate divides global_batch_size, so no device count can."
      " Choose a global batch that is a multiple of a candidate"
      " (ga_optax.planning.best_global_batch_size finds one that suits many"
      " device counts)."
    )
  nearest = sorted(counts, key=lambda count: abs(count - num_devices))
  listed = sorted(nearest[:_MAX_LISTED])
  shown = ", ".join(map(str, listed))
  if len(listed) == len(counts):
    return f"the device counts that can are {shown}."
  return (
    f"the {len(listed)} device counts nearest to {num_devices} that can are"
    f" {shown} ({len(counts)} in all, none above global_batch_size;"
    " ga_optax.planning.valid_device_counts lists them)."
  )


def _check_micro_batch_sizes(
  micro_batch_sizes: Any, max_micro_batch_size: Any
) -> tuple[int, ...]:
  """The candidates as increasing distinct ints, those above the limit out."""
  if isinstance(micro_batch_sizes, (str, bytes)) or not isinstance(
    micro_batch_sizes, Iterable
  ):
    raise TypeError(
      "micro_batch_sizes must be a collection of positive ints, such as"
      f" (1, 2, 4, 8), got {micro_batch_sizes!r} of type"
      f" {type(micro_batch_sizes).__name__}."
    )
  try:
    values = list(micro_batch_sizes)
  except TypeError as error:  # A 0-d array is Iterable yet cannot iterate.
    raise TypeError(
      "micro_batch_sizes must be a collection of positive ints, such as"
      f" (1, 2, 4, 8), got {micro_batch_sizes!r}."
    ) from error
  if not values:
    raise ValueError(
      "micro_batch_sizes must hold at least one candidate size, got none."
    )
  sizes = sorted(
    {
      validation.check_positive_int(value, f"micro_batch_sizes[{index}]")
      for index, value in enumerate(values)
    }
  )
  if max_micro_batch_size is None:
    return tuple(sizes)
  limit = validation.check_positive_int(
    max_micro_batch_size, "max_micro_batch_size"
  )
  fitting = tuple(size for size in sizes if size <= limit)
  if not fitting:
    raise ValueError(
      f"max_micro_batch_size={limit} is below every candidate in"
      f" micro_batch_sizes {tuple(sizes)}: no candidate fits the memory"
      " budget. Add smaller candidates, or shrink the micro-step's memory"
      " (rematerialisation, a smaller model)."
    )
  return fitting


def _check_device_range(min_devices: Any, max_devices: Any) -> tuple[int, int]:
  min_devices = validation.check_positive_int(min_devices, "min_devices")
  max_devices = validation.check_positive_int(max_devices, "max_devices")
  if min_devices > max_devices:
    raise ValueError(
      f"min_devices ({min_devices}) must be at most max_devices"
      f" ({max_devices})."
    )
  return min_devices, max_devices
