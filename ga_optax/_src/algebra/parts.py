"""The parts of a window: what it sums beside its weighted gradients.

A window (across calls, :mod:`ga_optax._src.window`) and a batch (within a
call, :mod:`ga_optax._src.scan`) both hold ``sum_i w_i g_i`` and
``sum_i w_i``. A feature that needs more of each micro-batch is a
:class:`Part`: its own value with a zero, an add for one micro-batch, how
the devices' values combine (a sum or a max) and a close, where the window's
value becomes what the feature reports. Both drivers carry a part's value
unchanged in type, add it where they add the gradient, combine it where they
reduce the gradient, and close it once. The noise scale's terms
(:mod:`ga_optax._src.algebra.noise_scale`) and a float8 model's amax
(:mod:`ga_optax._src.algebra.fp8`) are parts; a new feature is one more.

A part never learns where the window lives. What a device's own
micro-gradient is, and how a value held per device becomes the window's, is
the placement's to say (:mod:`ga_optax._src.placements`): the part reads it
through :class:`OwnGradients`, and a value it combines by a sum goes through
the placement's ``combine``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol, TypeVar

import jax
import jax.numpy as jnp

from ga_optax._src.algebra import weights

# How the devices' values of a part become the window's.
Combine = Literal["sum", "max"]


class OwnGradients(Protocol):
  """A micro-step's micro-gradients, as the device that holds them sees them.

  One device's gradient is one micro-gradient; where each device holds a
  partial sum of a batch's gradient, each is taken as a micro-gradient of
  the batch's part on that device. Which it is, the placement says.
  """

  @property
  def weight(self) -> jax.Array:
    """The weight of each micro-gradient (0 where the micro-step is dropped)."""
    ...

  @property
  def count(self) -> int:
    """How many micro-gradients the micro-step makes over every device."""
    ...

  def weighted_total(self, leaf_fn: Any) -> jax.Array:
    """``sum_i w_i sum_leaves leaf_fn(leaf)`` over micro-gradients that count.

    Only micro-gradients of positive weight count (``weights.counts``). As
    this device holds it: its placement's ``combine`` turns it into the
    total over every device.
    """
    ...


def leaf_total(tree: Any, leaf_fn: Any) -> jax.Array:
  """``sum over the leaves of tree of leaf_fn(leaf)``; 0 for no leaf."""
  terms = [leaf_fn(leaf) for leaf in jax.tree.leaves(tree)]
  return sum(terms[1:], terms[0]) if terms else jnp.zeros((), jnp.float32)


@dataclasses.dataclass(frozen=True)
class Whole:
  """A gradient that is one micro-gradient, whole on this device."""

  grads: Any
  weight: jax.Array

  @property
  def count(self) -> int:
    return 1

  def weighted_total(self, leaf_fn: Any) -> jax.Array:
    total = leaf_total(self.grads, leaf_fn)
    weight = jnp.asarray(self.weight, jnp.float32)
    return jnp.where(weights.counts(weight), weight * total, 0.0)


class Held(Protocol):
  """Where a part's values are held: what a placement tells a part."""

  def zero_total(self) -> jax.Array:
    """A scalar 0, typed as ``OwnGradients.weighted_total`` gives it."""
    ...

  def combine(self, value: Any, combine: Combine) -> Any:
    """``value`` as each device holds it, made the window's (closing only)."""
    ...


class OnThisDevice:
  """Values held whole on one device: nothing to combine."""

  def zero_total(self) -> jax.Array:
    return jnp.zeros((), jnp.float32)

  def combine(self, value: Any, combine: Combine) -> Any:
    del combine
    return value


class MicroBatch(NamedTuple):
  """One micro-batch, as a part adds it.

  Attributes:
    grads: its gradient; for a model with float8 state, with the state's new
      values among the variables.
    weight: its weight, 0 where it does not count (a dropped micro-step).
    kept: whether it counts at all (False for a dropped micro-step, whose
      gradient may not be finite).
    own: its micro-gradients, as the device that holds them sees them.
  """

  grads: Any
  weight: jax.Array
  kept: jax.Array
  own: OwnGradients

  @classmethod
  def of(
    cls,
    grads: Any,
    weight: Any,
    kept: Any,
    own: Callable[[jax.Array], OwnGradients],
  ) -> MicroBatch:
    """A micro-batch; ``own(weight)`` says what its micro-gradients are.

    A dropped micro-batch weighs nothing (its gradient may not be finite).
    """
    weight = jnp.where(kept, jnp.asarray(weight, jnp.float32), 0.0)
    return cls(grads, weight, jnp.asarray(kept), own(weight))

  @classmethod
  def whole(
    cls, grads: Any, weight: Any, kept: Any = True, micro_gradient: Any = None
  ) -> MicroBatch:
    """A micro-batch whose gradient is whole on this device.

    ``micro_gradient``: its micro-gradient, where that is not all of
    ``grads`` (a float8 model's new state is not a gradient); ``grads``
    by default.
    """
    own = grads if micro_gradient is None else micro_gradient
    return cls.of(grads, weight, kept, lambda w: Whole(own, w))

  @property
  def counts(self) -> jax.Array:
    """Whether it makes micro-gradients (see ``weights.counts``)."""
    return self.kept & weights.counts(self.weight)


class Closing(NamedTuple):
  """What a part's close may read of the window that closes.

  Attributes:
    mean_grads: the window's mean gradient, over every device.
    weight: the window's weight, over every device.
  """

  mean_grads: Any
  weight: jax.Array


class Part(Protocol):
  """A feature's sum over a window's micro-batches."""

  @property
  def combine(self) -> Combine:
    """How the devices' values become the window's: a sum or a max."""
    ...

  def zero(self) -> Any:
    """The value of a window with no micro-batch yet."""
    ...

  def add(self, value: Any, micro_batch: MicroBatch) -> Any:
    """``value`` with one micro-batch added."""
    ...

  def close(self, value: Any, closing: Closing) -> Any:
    """What the window's value reports.

    A driver hands over the value combined over every device, or, where a
    placement holds it per device (:class:`Held`), as this device holds it
    for the part to combine.
    """
    ...


def across_axes(value: Any, combine: Combine, axes: Any) -> Any:
  """``value`` combined over the devices of named ``axes``, on each of them."""
  if combine == "sum":
    return jax.lax.psum(value, axes)
  return jax.lax.pmax(value, axes)


class WindowClosing(NamedTuple):
  """What a window's part reads when the window closes with a step.

  Attributes:
    mean_grads: the window's reduced mean gradient, over every device.
    weight: the window's weight, over every device.
    held: where the part's sums are held; its ``combine`` makes each
      device's sums the window's.
    inner_states: the wrapped optimizer's state before and after its step
      on this window (a loss scale there says the gradients' units).
    read: what this part read of ``mean_grads`` before the wrapped
      optimizer stepped (:meth:`WindowPart.read`).
  """

  mean_grads: Any
  weight: jax.Array
  held: Held
  inner_states: tuple[Any, Any]
  read: Any = None


class WindowPart(Protocol):
  """A part the window (:mod:`ga_optax._src.window`) carries from call to call.

  Its value lives in the state (``AccumulateState.parts``): the open
  window's sums, and whatever the part keeps of the windows closed so far
  (the noise scale's averages). The window adds every micro-step where it
  adds the gradient, closes the part where it steps the wrapped optimizer,
  and restarts it after every close, with a step or without.
  """

  def init(self, held: Held, params: Any) -> Any:
    """The value of a run that has no micro-step yet.

    ``params`` are what the transformation's ``init`` was given (for a
    Flax model with float8 state, its whole variables).
    """
    ...

  def add(self, value: Any, micro_batch: MicroBatch) -> Any:
    """``value`` with one micro-batch added.

    For a model with float8 state, ``micro_batch.grads`` holds the
    gradients as Flax variables, the state's new values among them
    (``update(..., fp8_state=...)``).
    """
    ...

  def read(self, value: Any, mean_grads: Any) -> Any:
    """What the close needs of the window's mean gradient, read early.

    Read before the wrapped optimizer steps, and handed to :meth:`close`
    as ``closing.read``: the window may write the optimizer's output over
    the buffer the mean is read from, and XLA:CPU copied that buffer
    whole on every close where a part read it after the step. None where
    the close reads nothing of it, or reads ``closing.mean_grads`` itself.
    """
    ...

  def close(self, value: Any, closing: WindowClosing) -> tuple[Any, Any]:
    """``(value, report)`` when the window closes with a step.

    The value keeps what the part carries past the window; the report is
    what this window tells the strategies that read it, such as the next
    window's k (see ``ClosedWindow.report``).
    """
    ...

  def restart(self, value: Any) -> Any:
    """``value`` with the window's sums emptied, after it closes."""
    ...


class Windowed(NamedTuple):
  """The value of a :class:`Part` the window carries (:class:`Windowing`).

  Attributes:
    open: the open window's sums, as this device holds them.
    last: what the last window that closed with a step reported; zeros
      before the first.
  """

  open: Any
  last: Any


@dataclasses.dataclass(frozen=True)
class Windowing:
  """A batch's :class:`Part`, carried by the window from call to call.

  The part a batch sums within one call (:mod:`ga_optax._src.scan`) is
  summed over a window's calls the same way: each micro-step adds to the
  open window's sums, the window's close combines them over every device
  and closes the part, and the sums restart. The last report is kept in
  the state (:class:`Windowed`) and handed to what follows the window
  (:class:`ClosedWindow`). A feature written as a :class:`Part` is so
  carried by both drivers.

  Attributes:
    part: the batch's part.
  """

  part: Part

  def init(self, held: Held, params: Any) -> Windowed:
    del held  # the part's zero is how a device holds its sums
    zero = self.part.zero()
    # The report's zeros, shaped as a close of this window would give it.
    mean_grads = jax.tree.map(
      lambda leaf: leaf if hasattr(leaf, "dtype") else None, params
    )
    report = jax.eval_shape(
      lambda: self.part.close(
        zero, Closing(mean_grads, jnp.zeros((), jnp.float32))
      )
    )
    no_report = jax.tree.map(
      lambda shape: jnp.zeros(shape.shape, shape.dtype), report
    )
    return Windowed(zero, no_report)

  def add(self, value: Windowed, micro_batch: MicroBatch) -> Windowed:
    return value._replace(open=self.part.add(value.open, micro_batch))

  def read(self, value: Windowed, mean_grads: Any) -> None:
    # A batch's part reads the mean in its own close.
    del value, mean_grads

  def close(
    self, value: Windowed, closing: WindowClosing
  ) -> tuple[Windowed, Any]:
    sums = closing.held.combine(value.open, self.part.combine)
    report = self.part.close(sums, Closing(closing.mean_grads, closing.weight))
    return value._replace(last=report), report

  def restart(self, value: Windowed) -> Windowed:
    # The part's zero, typed as the sums are held (zeros_like keeps a
    # value's varying axes inside a shard_map).
    return value._replace(
      open=jax.tree.map(
        lambda zero, held: jnp.zeros_like(held) + zero,
        self.part.zero(),
        value.open,
      )
    )


Report = TypeVar("Report")


def report_of(reports: tuple[Any, ...], kind: type[Report]) -> Report:
  """The one report of type ``kind`` among ``reports``.

  Raises:
    ValueError: no part, or several, reported one.
  """
  found = [report for report in reports if isinstance(report, kind)]
  if len(found) != 1:
    raise ValueError(
      f"{len(found)} of the parts reported a {kind.__name__}, not one."
    )
  return found[0]


class ClosedWindow(NamedTuple):
  """A window that has closed with a step, as what follows it reads it.

  Attributes:
    k: the window's k.
    update_step: updates applied, this window's included.
    weight: the window's total weight, over every device.
    full: whether it closed by count (not by a flush, nor by the host's
      word before its k).
    reports: what each of the window's parts reported when it closed
      (:meth:`WindowPart.close`), in the window's order of parts.
  """

  k: jax.Array
  update_step: jax.Array
  weight: jax.Array
  full: jax.Array
  reports: tuple[Any, ...]

  def report(self, kind: type[Report]) -> Report:
    """The one report of type ``kind`` (see :func:`report_of`)."""
    return report_of(self.reports, kind)
