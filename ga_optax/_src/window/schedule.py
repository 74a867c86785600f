"""Who chooses the side of the window a call runs: the device, or the host.

A micro-step either keeps the window open or closes it. ``update``'s
``closing=`` says who chooses:

* :class:`DeviceScheduled` (``closing=None``, the default): the device
  counts the micro-steps and decides; the closing side is a branch of the
  compiled program (:func:`ga_optax._src.window.run_once.run_once_if`), so
  one program serves every call, as a ``lax.scan`` over steps or an
  exported step needs.
* :class:`HostScheduled` (``closing=True`` or ``False``): a training loop
  written in Python knows which micro-step it is about to run and says so.
  The program then holds that side alone: a micro-step is the gradient
  added into the accumulator and nothing more, and the closing call is the
  same work a large-batch step does, plus that add. On GPUs and TPUs
  neither program holds control flow, so they need no compiler recipe; on
  the CPU the closing call guards its step with a conditional
  (:meth:`HostScheduled.branch`), which makes nothing wait there.

The host's word is what happens. ``closing=True`` closes the window with
what it holds, normalised by what it holds (as ``flush=True`` does), and
``closing=False`` keeps it open, past its k if the host says so. Either way
the update is the large-batch step of the micro-batches the window held,
never a number of some other batch; ``AccumulateState.micro_step`` above
:func:`ga_optax.current_k` shows a window held open past its k.

Both schedules keep one state: every close, in either, leaves the
accumulator at zero, so a run may switch at any call and a checkpoint of
either resumes in the other.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ga_optax._src import scopes
from ga_optax._src.placements import axes as axes_lib
from ga_optax._src.placements import residency
from ga_optax._src.window import run_once, window_form

Carry = TypeVar("Carry")


class DeviceScheduled:
  """``closing=None``: the device counts and decides; each side a branch."""

  def closes(self, by_count: jax.Array, flush: Any) -> jax.Array:
    """Whether this call closes the window: full, or flushed."""
    return by_count | flush

  def close_window(
    self,
    closes: jax.Array,
    close: Callable[[Carry], Carry],
    carry: Carry,
  ) -> Carry:
    """The closing side, where the window closes."""
    return run_once.run_once_if(closes, close, carry, name=scopes.CLOSE_WINDOW)

  def branch(
    self,
    predicate: jax.Array,
    body: Callable[[Carry], Carry],
    carry: Carry,
    *,
    name: str,
    in_order: bool = False,
  ) -> Carry:
    """A branch of the closing work: ``body(carry)`` where ``predicate``.

    ``in_order`` is the host's schedule's (:meth:`HostScheduled.branch`).
    """
    del in_order  # a branch writes its buffers in place
    return run_once.run_once_if(predicate, body, carry, name=name)

  def stepped_on(self, has_weight: jax.Array, inputs: Any) -> Any:
    """The optimizer's inputs, as they are: it runs only with weight."""
    del has_weight
    return inputs

  def emitted(self, stepped: jax.Array, weight_sum: jax.Array) -> jax.Array:
    """The state's ``emitted``: whether the wrapped optimizer stepped."""
    del weight_sum
    return stepped

  def cleared(
    self, closes: jax.Array, value: jax.Array, weight_sum: jax.Array
  ) -> jax.Array:
    """A counter of the window (or its weight): 0 where it closes."""
    del weight_sum
    return jnp.where(closes, jnp.zeros_like(value), value)

  @property
  def carries_buffers(self) -> bool:
    """Whether the closing side may write its output into a carried buffer."""
    return True

  def emptied_in_close(
    self, emptied: Callable[[Any], Any], accumulator: Any
  ) -> Any:
    """The accumulator as the closing side leaves it, once it has read it:
    zeros, or on the CPU the sums, zeroed after the branch
    (:func:`ga_optax._src.window.run_once.emptied_in_branch`)."""
    return run_once.emptied_in_branch(emptied, accumulator)

  def emptied_after_close(
    self,
    closes: jax.Array,
    emptied: Callable[[Any], Any],
    accumulator: Any,
    stepped: jax.Array,
  ) -> Any:
    """The accumulator the closing side left, at zero where it closed."""
    del stepped  # the select reads ``closes``, known after the branch
    return run_once.emptied_after_branch(closes, emptied, accumulator)


@dataclasses.dataclass(frozen=True)
class HostScheduled:
  """``closing=True`` or ``False``: the host says which side runs.

  Attributes:
    closing: whether this call closes the window.
  """

  closing: bool

  def closes(self, by_count: jax.Array, flush: Any) -> jax.Array:
    del by_count, flush  # the host's word, whatever the counter says
    return jnp.asarray(self.closing)

  def close_window(
    self,
    closes: jax.Array,
    close: Callable[[Carry], Carry],
    carry: Carry,
  ) -> Carry:
    del closes  # the host's word: traced as a constant
    if not self.closing:
      return carry
    with jax.named_scope(scopes.CLOSE_WINDOW):
      return close(carry)

  def branch(
    self,
    predicate: jax.Array,
    body: Callable[[Carry], Carry],
    carry: Carry,
    *,
    name: str,
    in_order: bool = False,
  ) -> Carry:
    """``body(carry)`` where ``predicate`` holds.

    The one branch the host's schedule keeps: a window closed without
    weight must not step, and an optimizer's step is opaque. On the CPU
    (the conditional form) it is a conditional, which makes nothing wait
    there: the untaken side forwards its buffers, and the step writes the
    optimizer's state in place. On GPUs and TPUs (the loops form), and for
    a carry partly in host memory, ``body`` runs and selects keep its
    result where ``predicate`` holds: no control flow. With ``in_order``,
    on the CPU each field is then written after the fields that follow it
    (:func:`_select_in_order`).

    The selects are elementwise and fuse into the work that makes their
    operands (Adam's moments, say), so they move no byte of their own. On
    the CPU, unordered, XLA copies each of the optimizer state's
    parameter-sized leaves once for them (the update of the params, which
    recomputes the step, reads the state the select overwrites); in order
    it copies none from jax 0.12.
    """

    def selected(predicate: jax.Array, carry: Carry) -> Carry:
      with jax.named_scope(name):
        taken = body(carry)
      if not (in_order and _in_order(carry)):
        return _select(predicate, taken, carry)
      return _select_changed(predicate, taken, carry)

    def conditional(predicate: jax.Array, carry: Carry) -> Carry:
      with jax.named_scope(name):
        return jax.lax.cond(predicate, body, lambda carried: carried, carry)

    if not _on_device(carry):
      return selected(predicate, carry)
    return window_form.choose(
      jnp.asarray(predicate), carry, loops=selected, conditional=conditional
    )

  def stepped_on(self, has_weight: jax.Array, inputs: Any) -> Any:
    """The optimizer's inputs, differentiated only where the window has weight.

    Where the guard is selects (:meth:`branch`), a window without weight is
    stepped too, then selected away, and the select gives the step a
    cotangent of 0. On a zero gradient the step's own derivative may be
    infinite (Adam's square root of a second moment at 0), and ``0 * inf``
    is NaN, which would reach the gradient, the weights and the optimizer's
    state. Each input
    is ``where(has_weight, x, stop_gradient(x))``: the transpose of that
    select sends 0, not the NaN, where the window has no weight. Its two
    operands are one value, so the compiled program holds no select: the
    forward values are bit for bit those without it, at no cost.
    """
    return jax.tree.map(
      lambda leaf: (
        jnp.where(has_weight, leaf, jax.lax.stop_gradient(leaf))
        if isinstance(leaf, jax.Array)
        and jnp.issubdtype(leaf.dtype, jnp.inexact)
        else leaf
      ),
      inputs,
    )

  def emitted(self, stepped: jax.Array, weight_sum: jax.Array) -> jax.Array:
    """The state's ``emitted``, written by the kernel that writes the weight.

    A call that keeps the window open emits nothing: False, written as
    :meth:`cleared` writes its zeros.
    """
    if self.closing or not _keeps_comparison(weight_sum):
      return stepped
    return _never(weight_sum)

  def cleared(
    self, closes: jax.Array, value: jax.Array, weight_sum: jax.Array
  ) -> jax.Array:
    """A counter of the window (or its weight): 0 where the host closes it.

    A constant 0 in a donated output is copied there by a kernel of its
    own, one launch per scalar (two on XLA:GPU, through a temporary).
    ``where(_never(weight_sum), value, 0)`` is 0 whatever the weight sum,
    and the fusion that reads the window's weight writes it beside.
    """
    del closes  # the host's word: traced as a constant
    if self.closing and _keeps_comparison(weight_sum):
      return jnp.where(_never(weight_sum), value, jnp.zeros_like(value))
    return jnp.zeros_like(value) if self.closing else value

  def emptied_in_close(
    self, emptied: Callable[[Any], Any], accumulator: Any
  ) -> Any:
    """Zeros, or on the CPU the sums, zeroed after the close
    (:func:`ga_optax._src.window.run_once.emptied_in_branch`)."""
    return run_once.emptied_in_branch(emptied, accumulator)

  def emptied_after_close(
    self,
    closes: jax.Array,
    emptied: Callable[[Any], Any],
    accumulator: Any,
    stepped: jax.Array,
  ) -> Any:
    """The accumulator the closing side left, at zero if the host closed.

    In the conditional form the closing side hands the sums back and the
    zeros are written here, once ``stepped`` is known: made from nothing
    (``emptied``), they would be written before the step that reads the
    sums, into buffers of their own (one parameter-sized temporary per
    leaf, then a copy into the accumulator's buffer).
    """
    del closes  # the host's word: traced as a constant

    def as_loops(carried: Any) -> Any:
      return carried  # emptied by the closing side

    if self.closing:
      return window_form.choose(
        accumulator,
        loops=as_loops,
        conditional=functools.partial(_zeros_after, emptied, stepped),
      )
    return accumulator

  @property
  def carries_buffers(self) -> bool:
    # Without a loop no buffer needs to be carried: the output is made
    # fresh, and the accumulator is left at zero.
    return False


Schedule = DeviceScheduled | HostScheduled


def _select(predicate: jax.Array, taken: Carry, carry: Carry) -> Carry:
  """Each leaf of ``taken`` where ``predicate`` holds, else ``carry``'s."""
  return jax.tree.map(
    lambda new, old: (
      new if new is old else residency.where(predicate, new, old)
    ),
    taken,
    carry,
  )


def _zeros_after(
  emptied: Callable[[Any], Any], after: jax.Array, accumulator: Any
) -> Any:
  """``emptied(accumulator)``, computed once ``after`` is.

  Each leaf of zeros adds ``0 * after``, which XLA does not fold (a float
  times 0 may be NaN): the zeros are written once what makes ``after`` has
  run, in place of the sums it read. Passed through an optimization
  barrier instead, the 0 was folded by jax 0.10's XLA, which then copied
  the sums away first. The partial sums of an unreduced window take no
  plain addend and are left as ``emptied`` makes them.
  """
  zero = jnp.asarray(after, jnp.float32) * 0

  def fenced(leaf: jax.Array) -> jax.Array:
    if axes_lib.spec_of(leaf).unreduced:
      return leaf  # a partial sum takes no plain addend
    return leaf + zero.astype(leaf.dtype)

  return jax.tree.map(fenced, emptied(accumulator))


def _on_device(carry: Any) -> bool:
  """Whether every leaf of ``carry`` lives in the device's memory."""
  return all(
    residency.kind_of(leaf) == "device" for leaf in jax.tree.leaves(carry)
  )


def _in_order(carry: Any) -> bool:
  """Whether :func:`_select_in_order` may write ``carry``: a record of
  fields whose leaves all live in the device's memory."""
  return isinstance(carry, tuple) and _on_device(carry)


def _select_changed(predicate: jax.Array, taken: Any, carry: Any) -> Any:
  """The fields of the record ``carry`` that ``taken`` changed, selected:
  on the CPU in order (:func:`_select_in_order`), elsewhere as they come.

  Only those: inside ``platform_dependent`` every operand is a value of its
  own, and an unchanged field would be selected against itself.
  """
  changed = [
    index
    for index, (new, old) in enumerate(zip(taken, carry, strict=True))
    if any(
      a is not b
      for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True)
    )
  ]
  selected = jax.lax.platform_dependent(
    predicate,
    [taken[index] for index in changed],
    [carry[index] for index in changed],
    cpu=_select_in_order,
    default=_select,
  )
  fields = list(carry)
  for index, value in zip(changed, selected, strict=True):
    fields[index] = value
  return type(carry)(*fields)


def _select_in_order(predicate: jax.Array, taken: Any, carry: Any) -> Any:
  """:func:`_select`, each field written after the fields that follow it.

  On the CPU, XLA computes the step anew inside each select that reads it:
  the output's select reads the optimizer's state as it was, which the
  state's own select overwrites in place. Left unordered, XLA copies each
  of the state's leaves first. Here each field's select reads its old
  value through an optimization barrier that comes after the selects of
  the fields that follow it (the output, the parts, then the optimizer's
  state, then the accumulator, in :class:`Carry`'s order): every reader of
  an old buffer runs before the select that overwrites it, and nothing is
  copied.
  """
  fields = list(carry)
  written: list[Any] = []
  for index in reversed(range(len(fields))):
    old = fields[index]
    if written:
      written, old = jax.lax.optimization_barrier((written, old))
    fields[index] = _select(predicate, taken[index], old)
    written = [*written, fields[index]]
  return fields


def _keeps_comparison(weight_sum: jax.Array) -> bool:
  """Whether :func:`_never` is a comparison XLA keeps: a float sum."""
  return jnp.issubdtype(weight_sum.dtype, jnp.floating)


def _never(weight_sum: jax.Array) -> jax.Array:
  """False for every float weight sum, NaN among them, computed from it.

  XLA does not fold ``weight_sum < -inf`` to a constant, so the fusion that
  reads the window's weight (for ``has_weight``, or to add to it) writes
  the result beside, where a constant in a donated output is copied there
  by a kernel of its own.
  """
  return weight_sum < -jnp.inf


def of(closing: Any) -> Schedule:
  """The schedule ``update(..., closing=...)`` asks for.

  Raises:
    TypeError: as :func:`check_closing`.
  """
  closing = check_closing(closing)
  if closing is None:
    return DeviceScheduled()
  return HostScheduled(closing)


def check_closing(closing: Any) -> bool | None:
  """``closing`` as the schedule reads it: None, or a Python bool.

  A NumPy bool (a NumPy loop counter's comparison, ``step % k == k - 1``)
  is a value known in Python, read as the Python bool it holds.

  Raises:
    TypeError: ``closing`` is traced (under ``jax.jit``, a step argument
      not marked static), or is neither None nor a bool.
  """
  if closing is None or isinstance(closing, bool):
    return closing
  if (
    isinstance(closing, (np.bool_, np.ndarray))
    and closing.shape == ()
    and closing.dtype == np.bool_
  ):
    return bool(closing)
  if isinstance(closing, jax.core.Tracer):
    raise TypeError(
      f"closing is traced ({closing!r}): it chooses the program compiled"
      " (which side of the window this call runs), so its value must be"
      " known in Python while the step is traced. Mark it static:"
      ' jax.jit(step, static_argnames="closing") compiles one program for'
      " closing=False and one for closing=True (eqx.filter_jit keeps a"
      " Python bool static: pass bool(closing) there)."
    )
  raise TypeError(
    "closing must be None (the device decides from its counter) or a bool,"
    " Python or NumPy (the host says whether this call closes the window),"
    f" got {closing!r}."
  )
