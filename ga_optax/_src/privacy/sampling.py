"""Poisson sampling into fixed-size micro-batches, closed where the draw ends.

DP-SGD's accounting assumes each example joins each logical batch
independently with probability q, so the logical batch's size varies. The
compiled step must not: :func:`poisson_windows` cuts each draw into
micro-batches of one fixed size, padded with a mask, and says which
micro-batch ends the draw (``closing=True``), as Opacus' batch splitter
does. An empty draw still closes a window, on one all-padding micro-batch:
a pure-noise release, which the accountant counts like any other.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np


class MicroBatch(NamedTuple):
  """One fixed-size micro-batch of a Poisson draw.

  Attributes:
    indices: int array of length ``micro_batch_size``, the examples'
      indices in the dataset (0 where padding).
    mask: float32 array of the same length, 1 for an example, 0 for
      padding.
    closing: whether this micro-batch ends its draw (pass it as
      ``update(..., closing=...)``).
  """

  indices: np.ndarray
  mask: np.ndarray
  closing: bool


def poisson_windows(
  rng: np.random.Generator,
  dataset_size: int,
  *,
  sampling_probability: float,
  micro_batch_size: int,
  windows: int,
) -> Iterator[MicroBatch]:
  """The micro-batches of ``windows`` Poisson draws over a dataset.

  Each draw keeps every index of ``range(dataset_size)`` independently with
  probability ``sampling_probability``, and is cut into micro-batches of
  ``micro_batch_size`` indices, the last one padded; its last micro-batch
  has ``closing=True``. A draw of no index gives one all-padding
  micro-batch that closes its window.

  Args:
    rng: the NumPy generator that draws the samples (keep it secret, as
      the noise's key).
    dataset_size: the number of examples.
    sampling_probability: q in (0, 1].
    micro_batch_size: the examples per micro-batch (fixed: one compiled
      step).
    windows: the number of draws.

  Yields:
    Each draw's :class:`MicroBatch` values, draw after draw.

  Raises:
    ValueError: a size below 1 or a probability outside (0, 1].

  Example:
    >>> import numpy as np, ga_optax
    >>> batches = ga_optax.privacy.poisson_windows(
    ...     np.random.default_rng(2), 10, sampling_probability=0.5,
    ...     micro_batch_size=4, windows=1)
    >>> for batch in batches:
    ...   print(int(batch.mask.sum()), batch.closing)
    4 False
    2 True
  """
  _check_count("dataset_size", dataset_size)
  _check_count("micro_batch_size", micro_batch_size)
  _check_count("windows", windows, least=0)
  if not 0 < sampling_probability <= 1:
    raise ValueError(
      f"sampling_probability must be in (0, 1], got {sampling_probability!r}."
    )
  for _ in range(windows):
    drawn = np.flatnonzero(rng.random(dataset_size) < sampling_probability)
    yield from split_draw(drawn, micro_batch_size)


def split_draw(
  drawn: np.ndarray, micro_batch_size: int
) -> Iterator[MicroBatch]:
  """One draw's indices as padded micro-batches, the last one closing."""
  count = max(1, -(-len(drawn) // micro_batch_size))
  padded = np.zeros(count * micro_batch_size, np.int64)
  mask = np.zeros(count * micro_batch_size, np.float32)
  padded[: len(drawn)] = drawn
  mask[: len(drawn)] = 1.0
  for index in range(count):
    window = slice(index * micro_batch_size, (index + 1) * micro_batch_size)
    yield MicroBatch(padded[window], mask[window], index == count - 1)


def _check_count(name: str, value: Any, least: int = 1) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
  if value < least:
    raise ValueError(f"{name} must be >= {least}, got {value}.")
