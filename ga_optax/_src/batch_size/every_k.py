"""Window lengths: how many micro-steps each window holds.

``accumulate`` takes ``every_k`` as an int, a jittable callable of the
applied-update count, a ``{update_step: k}`` dict, or
:func:`ga_optax.batch_size.adaptive_k`. Each is normalised here into a
:class:`WindowLength`: the first window's k, and the next window's k when a
window closes. The window keeps k in its state; the first three are
schedules of the applied-update count (:class:`Scheduled`), the last
follows the noise scale (:class:`ga_optax._src.batch_size.adaptive.AdaptiveK`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ga_optax._src import validation
from ga_optax._src.algebra import parts
from ga_optax._src.batch_size.adaptive import AdaptiveK

EveryKSchedule = Callable[[jax.Array], jax.Array]
EveryK = int | EveryKSchedule | Mapping[int, int] | AdaptiveK


class WindowLength(Protocol):
  """How many micro-steps each window holds, decided as windows close."""

  def first(self) -> jax.Array:
    """The first window's k, an int32 scalar."""
    ...

  def current(self, every_k: jax.Array, update_step: jax.Array) -> jax.Array:
    """The open window's k, from the state's k and applied-update count."""
    ...

  def next(self, closed: parts.ClosedWindow) -> jax.Array:
    """The next window's k, when ``closed`` has closed with a step."""
    ...


@dataclasses.dataclass(frozen=True)
class Scheduled:
  """k as a jittable function of the applied-update count.

  Attributes:
    schedule: ``update_step -> k``.
  """

  schedule: EveryKSchedule

  def first(self) -> jax.Array:
    return self.schedule(jnp.zeros((), jnp.int32))

  def current(self, every_k: jax.Array, update_step: jax.Array) -> jax.Array:
    """The schedule's k: a state resumed under another schedule follows it."""
    del every_k
    return self.schedule(update_step)

  def next(self, closed: parts.ClosedWindow) -> jax.Array:
    return self.schedule(closed.update_step)


MAX_COUNT = validation.MAX_COUNT


def _piecewise_constant(schedule: Mapping[int, int]) -> EveryKSchedule:
  if not schedule:
    raise ValueError(
      "every_k as a dict must map applied-update counts to k, with key 0;"
      " got an empty dict."
    )
  for start in schedule:
    if not validation.is_int(start) or int(start) < 0:
      raise ValueError(
        "every_k dict keys must be non-negative ints (applied-update"
        f" counts), got key {start!r}."
      )
    if int(start) > MAX_COUNT:
      raise ValueError(
        f"every_k dict keys must be {validation.COUNTERS}, got key {start}."
      )
  if 0 not in schedule:
    raise ValueError(
      "every_k dict must contain key 0 (the k of the first window), got"
      f" keys {sorted(schedule)}."
    )
  starts = sorted(int(start) for start in schedule)
  ks = [
    validation.check_count(schedule[start], f"every_k[{start}]")
    for start in starts
  ]
  starts_array = np.asarray(starts, dtype=np.int32)
  ks_array = np.asarray(ks, dtype=np.int32)

  def every_k_of(update_step: jax.Array) -> jax.Array:
    # Compared with every start, a handful: no loop (searchsorted's default
    # method is one), so a program that closes a window has no loop.
    piece = (
      jnp.searchsorted(
        starts_array, update_step, side="right", method="compare_all"
      )
      - 1
    )
    return jnp.asarray(ks_array)[piece]

  return every_k_of


def _checked_callable(schedule: EveryKSchedule) -> EveryKSchedule:
  try:
    result = jax.eval_shape(schedule, jax.ShapeDtypeStruct((), jnp.int32))
  except validation.NEEDS_A_CONCRETE_VALUE as error:
    raise TypeError(
      "every_k as a callable is traced: it gets the applied-update count as"
      " a traced int32 scalar, so Python control flow on it (if, int(),"
      " indexing a list) cannot run. Write a piecewise-constant schedule"
      " as a dict of applied-update counts, every_k={0: 2, 10: 4}, or"
      " compute k with jax.numpy,"
      " every_k=lambda step: jnp.where(step < 10, 2, 4)."
      f" The callable {schedule!r} raised {type(error).__name__}."
    ) from error
  shape = getattr(result, "shape", None)
  dtype = getattr(result, "dtype", None)
  if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
      "every_k as a callable must map the applied-update count (an int32"
      " scalar) to an integer scalar k; it returned"
      f" {result!r}. Wrap the result in jnp.asarray(..., jnp.int32)."
    )

  def every_k_of(update_step: jax.Array) -> jax.Array:
    # A window holds at least one micro-step: values below 1 act as 1 here,
    # once, for the window, lr_scaling's ratio and current_k alike.
    return jnp.maximum(jnp.asarray(schedule(update_step), jnp.int32), 1)

  return every_k_of


def as_window_length(every_k: EveryK) -> WindowLength:
  """The :class:`WindowLength` of any accepted ``every_k``.

  Raises:
    TypeError: ``every_k`` is of a type that is not accepted, or a callable
      that does not return an integer scalar or needs the value of its
      traced argument (Python control flow on it).
    ValueError: ``every_k`` is an int below 1 or above 2**31 - 1, or a dict
      that is empty, lacks key 0, has a key above 2**31 - 1, or maps to a k
      below 1 or above 2**31 - 1.
  """
  if isinstance(every_k, AdaptiveK):
    return every_k
  if isinstance(every_k, Mapping):
    return Scheduled(_piecewise_constant(every_k))
  if callable(every_k):
    return Scheduled(_checked_callable(every_k))
  k = validation.check_count(every_k, "every_k")
  return Scheduled(lambda update_step: jnp.asarray(k, jnp.int32))
