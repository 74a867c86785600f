"""One ``update`` call: a micro-step, and the closing side it may run.

:func:`update` is the window's ``update``: :meth:`Window.admit` says whether
the micro-step counts and with what weight, :meth:`Window.decide` whether
the window closes, :class:`Call` adds the weighted gradient into the
accumulator, and :class:`ClosingSide` closes the window (reduce over the
devices, normalise, step the wrapped optimizer once, leave the accumulator
at zero). Who decides whether the closing side runs is the schedule
(:mod:`ga_optax._src.window.schedule`): the device, as a branch of one
program, or the host, as one of two programs, one per side.

How buffers flow decides the cost (see docs/compiled-window.md). The
gradient is added before any branch, as a plain add into a donated
accumulator that every close leaves at zero: XLA:GPU then writes each
layer's sum in the epilogue of the matrix product that makes its gradient,
and no whole gradient is ever held. The closing side reads the sum once,
in the optimizer's pass, and carries only what it writes, in place, so a
micro-step copies nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ga_optax._src import scopes, validation
from ga_optax._src.algebra import fp8, parts, weights
from ga_optax._src.algebra.counters import increment_if
from ga_optax._src.placements import residency
from ga_optax._src.window import run_once
from ga_optax._src.window import schedule as schedule_lib
from ga_optax._src.window.output import Carrier
from ga_optax._src.window.state import AccumulateState, check_state
from ga_optax._src.window.window import Admitted, Decision, Window


def update(
  window: Window,
  grads: optax.Updates,
  state: AccumulateState,
  params: optax.Params | None,
  *,
  weight: Any,
  flush: Any,
  closing: Any,
  fp8_state: Any,
  extra_args: dict[str, Any],
) -> tuple[Any, AccumulateState]:
  """One micro-step: the output (updates, or new params) and the state."""
  state = check_state(state)
  window.accumulator_home.check_kept(state.accumulator)
  window.inner_state_home.check_kept(state.inner_state)
  fp8.refuse_as_gradients(grads)
  validation.check_grads_match(
    grads, state.accumulator, window.placement.unreduced_axes
  )
  weight = weights.check(weight)
  flush = validation.check_flush(flush)
  schedule = schedule_lib.of(closing)
  if closing is not None and flush is not False:
    raise ValueError(
      "flush= closes a window on the device's schedule; with closing= the"
      " host's word decides: pass closing=True to close the window now (with"
      f" what it holds, as a flush does), got flush={flush!r} with"
      f" closing={closing!r}."
    )
  window.placement.check_update(grads, weight)

  admitted = window.admit(grads, state, weight)
  decision = window.decide(state, admitted, schedule, flush)
  call = Call(
    window,
    schedule,
    grads,
    state,
    params,
    weight,
    admitted,
    decision,
    extra_args,
    accumulator=residency.to_device_after(state.accumulator, grads),
    fp8_state=fp8_state,
  )
  closing_side = ClosingSide(call)
  closed = schedule.close_window(
    decision.closes, closing_side.close, closing_side.carry()
  )
  output = call.emit(closing_side.output(closed), closed.stepped)
  weight_sum = schedule.cleared(
    decision.closes, admitted.weight_sum, admitted.weight_sum
  )
  new_state = AccumulateState(
    micro_step=schedule.cleared(
      decision.closes, decision.micro_steps, admitted.weight_sum
    ),
    update_step=increment_if(state.update_step, closed.stepped),
    every_k=closed.every_k,
    num_skipped=increment_if(state.num_skipped, ~admitted.accepted),
    emitted=schedule.emitted(closed.stepped, weight_sum),
    weight_sum=weight_sum,
    accumulator=window.accumulator_home.keep(
      call.cleared(closed.accumulator, closed.stepped)
    ),
    inner_state=closed.inner_state,
    parts=closed.parts,
  )
  return output, new_state


class Carry(NamedTuple):
  """What the closing side writes, each buffer in place.

  Attributes:
    accumulator: the window's sum (and the output's buffer, where the
      output's carrier is the accumulator).
    inner_state: the wrapped optimizer's state.
    parts: each of the window's parts' values.
    every_k: the state's k: a schedule's k is a constant, and a constant
      output frees its donated buffer, which JAX may then pair with an
      output in another memory kind; carried, it is written only when the
      window closes.
    stepped: whether the wrapped optimizer stepped.
    output: the output's buffer, unless it is the accumulator (None then).
  """

  accumulator: optax.Updates
  inner_state: optax.OptState
  parts: tuple[Any, ...]
  every_k: jax.Array
  stepped: jax.Array
  output: Any


@dataclasses.dataclass
class Call:
  """One ``update`` call: what the closing side reads, and the add.

  Attributes:
    window: the accumulation's configuration.
    schedule: who decides whether the window closes.
    grads: this micro-step's gradients.
    state: the state before this micro-step.
    params: the params (None when the transformation is called without).
    weight: this micro-step's weight.
    admitted: whether it counts, and the window's weight with it.
    decision: what it does to the window.
    extra_args: forwarded to the inner optimizer.
    accumulator: the accumulator on the device, each leaf brought there
      once its gradient is computed: left free, XLA would start moving an
      accumulator kept in another memory kind at the very beginning of the
      program, and it would hold device memory through the forward and
      backward pass.
    fp8_state: for a Flax model with float8 state, this micro-batch's new
      float8 state (the gradient of its ``_overwrite_with_gradient``
      collection), which the window's parts see among the gradients as
      Flax variables; None for any other model.
  """

  window: Window
  schedule: schedule_lib.Schedule
  grads: optax.Updates
  state: AccumulateState
  params: optax.Params | None
  weight: Any
  admitted: Admitted
  decision: Decision
  extra_args: dict[str, Any]
  accumulator: optax.Updates
  fp8_state: Any = None

  @functools.cached_property
  def updates_like(self) -> Any:
    """Shapes and dtypes of the inner optimizer's updates for these grads."""
    placement = self.window.placement

    def inner_updates(grads: Any) -> Any:
      reduced = placement.reduce(grads, self.params)
      return placement.inner_update(
        self.window.inner,
        reduced,
        residency.to_device(self.state.inner_state),
        self.params,
        self.extra_args,
      )[0]

    return jax.eval_shape(inner_updates, self.grads)

  @functools.cached_property
  def carrier(self) -> Carrier:
    """The buffer the closing side writes its output into."""
    carriers = {}
    if self.window.placement.carries_updates and self.schedule.carries_buffers:
      carriers = {
        Carrier.ACCUMULATOR: self.accumulator,
        Carrier.GRADS: self.grads,
      }
    return self.window.output.carrier(self.updates_like, carriers)

  def added(self, accumulator: optax.Updates, grads: optax.Updates) -> Any:
    """``accumulator`` with ``weight * grads`` added: a plain add.

    Every close leaves the accumulator at zero, so a window's first
    micro-step adds like any other, and XLA:GPU can write the sum where
    the gradient's matrix product ends.
    """
    window, admitted = self.window, self.admitted
    weight = window.placement.factor(self.weight)

    def add_grad(total: jax.Array, grad: jax.Array) -> jax.Array:
      added = total + weights.weighted(grad, weight, total.dtype)
      if window.skip_nonfinite:
        added = jnp.where(admitted.accepted, added, total)
      return added

    return jax.tree.map(add_grad, accumulator, grads)

  def added_parts(self) -> tuple[Any, ...]:
    """Each part's value with this micro-step added."""
    window = self.window
    if not window.parts:
      return ()
    micro_batch = parts.MicroBatch.of(
      fp8.join_variables({}, self.grads, self.fp8_state),
      self.weight,
      self.admitted.accepted,
      functools.partial(window.placement.own_gradients, self.grads),
    )
    return tuple(
      part.add(value, micro_batch)
      for part, value in zip(window.parts, self.state.parts, strict=True)
    )

  def emit(self, output: Any, stepped: jax.Array) -> Any:
    """The closing side's output as the caller sees it."""
    return self.window.output.emit(
      output, stepped, self.updates_like, self.carrier
    )

  def cleared(
    self, accumulator: optax.Updates, stepped: jax.Array
  ) -> optax.Updates:
    """The accumulator at zero once the window has closed.

    Where its buffer carried the updates out (only the device's schedule
    does), those are read first, then the buffer is zeroed in place, by a
    branch of its own that a micro-step skips (on the CPU, a select:
    :func:`ga_optax._src.window.run_once.emptied_if`). Otherwise the closing
    side zeroes it, except on the CPU, where zeros written after the close
    do, once ``stepped`` is known
    (:meth:`ga_optax._src.window.schedule.HostScheduled.emptied_after_close`,
    and on the device's schedule a select after the branch).
    """
    if self.carrier is not Carrier.ACCUMULATOR:
      return self.schedule.emptied_after_close(
        self.decision.closes,
        self.window.placement.emptied,
        accumulator,
        stepped,
      )
    return run_once.emptied_if(
      self.decision.closes,
      self.window.placement.emptied,
      accumulator,
      name=scopes.CLOSE_WINDOW,
    )


@dataclasses.dataclass
class ClosingSide:
  """The side of a micro-step that closes the window.

  It reduces the window over the devices, normalises it and steps the
  wrapped optimizer once (not for a window without weight), writing its
  output (updates, or new params) into the micro-step's carrier buffer; it
  closes the window's parts, decides the next k, and zeroes the accumulator.

  Attributes:
    call: the call it is a side of.
  """

  call: Call

  def carry(self) -> Carry:
    """The gradient added, outside any branch, and what closing may write."""
    call = self.call
    with jax.named_scope(scopes.KEEP_OPEN):
      accumulator = call.added(call.accumulator, call.grads)
      added_parts = call.added_parts()
    return Carry(
      accumulator=accumulator,
      inner_state=call.window.inner_state_home.keep(call.state.inner_state),
      parts=added_parts,
      every_k=call.state.every_k,
      stepped=jnp.zeros((), jnp.bool_),
      output=self.initial_output(),
    )

  def initial_output(self) -> Any:
    """The output's buffer as the closing side finds it."""
    call = self.call
    match call.carrier:
      case Carrier.GRADS:
        return call.grads
      case Carrier.PARAMS:
        return call.params
      case Carrier.ZEROS:
        return optax.tree.zeros_like(call.updates_like)
    return None  # the accumulator: carried as such

  def output(self, carry: Carry) -> Any:
    """The output's buffer in ``carry``."""
    if self.call.carrier is Carrier.ACCUMULATOR:
      return carry.accumulator
    return carry.output

  def with_output(self, carry: Carry, output: Any) -> Carry:
    """``carry`` with ``output`` written into the output's buffer."""
    if self.call.carrier is Carrier.ACCUMULATOR:
      return carry._replace(accumulator=output)
    return carry._replace(output=output)

  def close(self, carry: Carry) -> Carry:
    """The closing side: step the optimizer once if the window has weight."""
    call = self.call
    window, schedule = call.window, call.schedule
    total_weight = window.placement.window_weight(call.admitted.weight_sum)
    has_weight = weights.has_weight(total_weight)
    closed = schedule.branch(
      has_weight,
      functools.partial(self.step_inner, total_weight),
      carry,
      name=scopes.CLOSE_WINDOW,
      in_order=_selects_in_order(call.carrier),
    )
    if call.carrier is not Carrier.ACCUMULATOR:
      # A window without weight leaves its sums: the next starts from zero.
      closed = schedule.branch(
        ~has_weight, self.emptied, closed, name=scopes.EMPTY_WINDOW
      )
    return closed._replace(
      parts=tuple(
        part.restart(value)
        for part, value in zip(window.parts, closed.parts, strict=True)
      )
    )

  def emptied(self, carry: Carry) -> Carry:
    """``carry`` with its accumulator at zero, written in place (on the
    device's schedule on the CPU, left for :meth:`Call.cleared`)."""
    call = self.call
    return carry._replace(
      accumulator=call.schedule.emptied_in_close(
        call.window.placement.emptied, carry.accumulator
      )
    )

  def mean(self, sums: Any, total_weight: jax.Array) -> Any:
    """The window's reduced gradient, in the gradients' dtypes."""
    call = self.call
    if call.window.reduction == "mean":
      scale = weights.reciprocal(total_weight)
      sums = jax.tree.map(lambda total: total * scale.astype(total.dtype), sums)
    return jax.tree.map(
      lambda total, grad: total.astype(grad.dtype), sums, call.grads
    )

  def step_inner(self, total_weight: jax.Array, carry: Carry) -> Carry:
    """The wrapped optimizer's one step on the window's mean (or sum).

    Normalised here, inside the branch, so that the scaling is done in the
    optimizer's own pass over the sums, which then leaves the accumulator
    at zero (unless its buffer carries the updates out).
    """
    call = self.call
    window, decision = call.window, call.decision
    params = carry.output if call.carrier is Carrier.PARAMS else call.params
    # Reduced here, from the carry: the one reduction of the window runs
    # only where it steps, and reads the buffer it then overwrites; the
    # parts read the window's mean before the step does.
    summed = window.placement.reduce(carry.accumulator, params)
    summed, reads = run_once.read_before_step(
      summed, _read(window.parts, carry.parts, self.mean(summed, total_weight))
    )
    reduced = self.mean(summed, total_weight)
    # A state kept in host memory visits the device here, and only here.
    inner_state = residency.to_device(carry.inner_state)
    # Differentiated only where the window has weight (the host's
    # schedule steps a window without weight too, then selects it away).
    stepped_grads, stepped_state = call.schedule.stepped_on(
      weights.has_weight(total_weight), (reduced, inner_state)
    )
    updates, new_inner_state = window.placement.inner_update(
      window.inner, stepped_grads, stepped_state, params, call.extra_args
    )
    updates = window.lr_scaling.apply(
      updates, decision.every_k, window.window_length.first()
    )
    # Each part reads the window over every device; the wrapped optimizer's
    # states tell a loss scale, and a window it dropped.
    closing = parts.WindowClosing(
      reduced, total_weight, window.placement, (inner_state, new_inner_state)
    )
    values, reports = _close(window.parts, carry.parts, reads, closing)
    # Gradients wider than the params (float32 for bfloat16, say) would
    # widen the optimizer's state; it keeps its dtypes from call to call.
    new_inner_state = window.inner_state_home.keep(
      _with_dtypes_of(new_inner_state, inner_state)
    )
    next_k = window.window_length.next(
      parts.ClosedWindow(
        k=decision.every_k,
        update_step=increment_if(call.state.update_step, jnp.asarray(True)),
        weight=total_weight,
        full=decision.micro_steps >= decision.every_k,
        reports=reports,
      )
    )
    emptied = self.emptied(carry)
    output = window.output.closing_output(updates, params, self.output(carry))
    return self.with_output(emptied, output)._replace(
      inner_state=new_inner_state,
      parts=values,
      every_k=next_k,
      stepped=jnp.ones((), jnp.bool_),
    )


def _selects_in_order(carrier: Carrier) -> bool:
  """Whether the host's weight guard writes its selects in order on the CPU.

  Not where the output is the new params: in order, they would all be
  written before the optimizer's state, and XLA:CPU would hold every leaf
  of the new state at once, slower than the copies it saves
  (benchmarks/run.py).
  """
  return carrier is not Carrier.PARAMS


def _read(
  window_parts: tuple[parts.WindowPart, ...],
  values: tuple[Any, ...],
  mean_grads: Any,
) -> tuple[Any, ...]:
  """What each part reads of the window's mean before the optimizer steps."""
  return tuple(
    part.read(value, mean_grads)
    for part, value in zip(window_parts, values, strict=True)
  )


def _close(
  window_parts: tuple[parts.WindowPart, ...],
  values: tuple[Any, ...],
  reads: tuple[Any, ...],
  closing: parts.WindowClosing,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
  """Each part's closed value and report, from what it read before."""
  return _unzip(
    part.close(value, closing._replace(read=read))
    for part, value, read in zip(window_parts, values, reads, strict=True)
  )


def _unzip(pairs: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
  """``((a, b), (c, d))`` as ``((a, c), (b, d))``; two empty tuples for none."""
  firsts: list[Any] = []
  seconds: list[Any] = []
  for first, second in pairs:
    firsts.append(first)
    seconds.append(second)
  return tuple(firsts), tuple(seconds)


def _with_dtypes_of(tree: Any, like: Any) -> Any:
  """``tree`` with each array leaf cast to the dtype of its twin in ``like``."""
  return jax.tree.map(
    lambda leaf, twin: (
      jnp.asarray(leaf).astype(twin.dtype) if hasattr(twin, "dtype") else leaf
    ),
    tree,
    like,
  )
