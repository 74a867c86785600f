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
  The program then holds that side alone, with no ``while`` and no
  ``conditional``: a micro-step is the gradient added into the accumulator
  and nothing more, and the closing call is the same work a large-batch
  step does, plus that add. Two programs, each without control flow, need
  no compiler recipe on any platform.

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
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ga_optax._src import scopes
from ga_optax._src.placements import residency
from ga_optax._src.window import run_once

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
    *,
    conditional: bool = False,
  ) -> Carry:
    """The closing side, where the window closes (in a ``lax.cond`` with
    ``conditional``: the TPU's window)."""
    return run_once.run_once_if(
      closes, close, carry, name=scopes.CLOSE_WINDOW, conditional=conditional
    )

  def branch(
    self,
    predicate: jax.Array,
    body: Callable[[Carry], Carry],
    carry: Carry,
    *,
    name: str,
  ) -> Carry:
    """A branch of the closing work: ``body(carry)`` where ``predicate``."""
    return run_once.run_once_if(predicate, body, carry, name=name)

  def stepped_on(self, has_weight: jax.Array, inputs: Any) -> Any:
    """The optimizer's inputs, as they are: it runs only with weight."""
    del has_weight
    return inputs

  @property
  def carries_buffers(self) -> bool:
    """Whether the closing side may write its output into a carried buffer."""
    return True


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
  ) -> Carry:
    """``body(carry)`` where ``predicate`` holds, selected: no control flow.

    The selects are elementwise and fuse into the work that makes their
    operands (Adam's moments, say), so they move no byte of their own.
    """
    with jax.named_scope(name):
      taken = body(carry)
    return jax.tree.map(
      lambda new, old: residency.where(predicate, new, old), taken, carry
    )

  def stepped_on(self, has_weight: jax.Array, inputs: Any) -> Any:
    """The optimizer's inputs, differentiated only where the window has weight.

    A window without weight is stepped too, then selected away
    (:meth:`branch`), and the select gives the step a cotangent of 0. On a
    zero gradient the step's own derivative may be infinite (Adam's square
    root of a second moment at 0), and ``0 * inf`` is NaN, which would
    reach the gradient, the weights and the optimizer's state. Each input
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

  @property
  def carries_buffers(self) -> bool:
    # Without a loop no buffer needs to be carried: the output is made
    # fresh, and the accumulator is left at zero.
    return False


Schedule = DeviceScheduled | HostScheduled


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
