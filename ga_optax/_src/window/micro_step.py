"""One ``update`` call: a micro-step, and the two sides it may run.

:func:`update` is the window's ``update``: :meth:`Window.admit` says whether
the micro-step counts and with what weight, :meth:`Window.decide` whether
the window closes, and :class:`MicroStep` runs one of its two sides: keep
the window open (add the weighted gradient into the accumulator), or close
it (:class:`ClosingSide`: add the last gradient, reduce over the devices,
normalise, step the wrapped optimizer once).

How buffers flow decides the cost (see docs/compiled-window.md): each side
is a loop of at most one trip (:mod:`ga_optax._src.window.run_once`) that
carries only what it writes, in place, so a micro-step copies nothing on
XLA:GPU; the first micro-step of a window overwrites the accumulator instead
of adding, so no call spends a pass zeroing it; and the closing side adds
the last gradient in the optimizer's own pass, so the accumulator is read
once. On the CPU, where loop bodies run on one core, the gradient is added
first and the closing side is a conditional (:meth:`MicroStep.add_first`);
the choice of form is made in :mod:`ga_optax._src.window.window_form`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ga_optax._src import validation
from ga_optax._src.algebra import fp8, parts, weights
from ga_optax._src.algebra.counters import increment_if
from ga_optax._src.placements import residency
from ga_optax._src.window import run_once, window_form
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
  extra_args: dict[str, Any],
) -> tuple[Any, AccumulateState]:
  """One micro-step: the output (updates, or new params) and the state."""
  state = check_state(state)
  window.accumulator_home.check_kept(state.accumulator)
  window.inner_state_home.check_kept(state.inner_state)
  fp8.refuse_as_gradients(grads)
  validation.check_grads_match(
    grads, state.accumulator, window.parallel.unreduced_axes
  )
  weight = weights.check(weight)
  flush = validation.check_flush(flush)
  window.parallel.check_update(grads, weight)

  admitted = window.admit(grads, state, weight)
  decision = window.decide(state, admitted, flush)
  micro_step = MicroStep(
    window,
    grads,
    state,
    params,
    weight,
    admitted,
    decision,
    extra_args,
    accumulator=residency.to_device_after(state.accumulator, grads),
  )
  accumulator, closed = window_form.choose(
    decision.steps,
    conditional=micro_step.add_first,
    loops=micro_step.folded,
  )
  output = closed[micro_step.carrier]
  new_state = AccumulateState(
    micro_step=jnp.where(decision.closes, 0, decision.micro_step),
    update_step=increment_if(state.update_step, closed["stepped"]),
    every_k=closed["every_k"],
    num_skipped=increment_if(state.num_skipped, ~admitted.accepted),
    emitted=closed["stepped"],
    weight_sum=jnp.where(
      decision.closes,
      jnp.zeros_like(admitted.weight_sum),
      admitted.weight_sum,
    ),
    accumulator=window.accumulator_home.keep(accumulator),
    inner_state=closed["inner_state"],
    noise_scale=closed["noise"],
    fp8_window=state.fp8_window,
  )
  return micro_step.emit(output, closed["stepped"]), new_state


@dataclasses.dataclass
class MicroStep:
  """One ``update`` call: what both its sides read, and the side that adds.

  Each side is the body of a loop of at most one trip
  (:func:`ga_optax._src.window.run_once.run_once_if`) and carries only what it
  writes: keeping the window open (:meth:`keep_open`) adds the gradient into
  the accumulator; closing it (:class:`ClosingSide`) adds the last gradient,
  reduces, normalises and steps the wrapped optimizer once, writing its
  output into the :attr:`carrier`'s buffer.

  Attributes:
    window: the accumulation's configuration.
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
  """

  window: Window
  grads: optax.Updates
  state: AccumulateState
  params: optax.Params | None
  weight: Any
  admitted: Admitted
  decision: Decision
  extra_args: dict[str, Any]
  accumulator: optax.Updates

  @functools.cached_property
  def updates_like(self) -> Any:
    """Shapes and dtypes of the inner optimizer's updates for these grads."""
    parallel = self.window.parallel

    def inner_updates(grads: Any) -> Any:
      reduced, _ = parallel.reduce(grads, jnp.ones(()), self.params)
      return parallel.inner_update(
        self.window.inner,
        reduced,
        residency.to_device(self.state.inner_state),
        self.params,
        self.extra_args,
      )[0]

    return jax.eval_shape(inner_updates, self.grads)

  @functools.cached_property
  def carrier(self) -> str:
    """The buffer the closing side writes its output into."""
    carriers = self.window.parallel.carriers(self.state.accumulator, self.grads)
    return self.window.output.carrier(self.updates_like, carriers)

  def added(self, accumulator: optax.Updates, grads: optax.Updates) -> Any:
    """``accumulator`` with ``weight * grads`` added, scaled by the decision.

    The first micro-step of a window overwrites the stale buffer: a select,
    not a multiply, since a stale buffer may hold anything, NaN too.
    """
    window, admitted = self.window, self.admitted
    restarts = self.state.micro_step == 0
    weight = window.parallel.factor(self.weight)
    scale = window.parallel.factor(self.decision.scale)
    scaled = window.parallel.weights_are_global and window.reduction == "mean"

    def add_grad(total: jax.Array, grad: jax.Array) -> jax.Array:
      kept = jnp.where(restarts, jnp.zeros_like(total), total)
      added = kept + weights.weighted(grad, weight, total.dtype)
      if window.skip_nonfinite:
        added = jnp.where(admitted.accepted, added, total)
      return added * scale.astype(added.dtype) if scaled else added

    return jax.tree.map(add_grad, accumulator, grads)

  def micro_batch(self, grads: optax.Updates) -> parts.MicroBatch:
    """This micro-step as a part of the window adds it."""
    return parts.MicroBatch.of(
      grads,
      self.weight,
      self.admitted.accepted,
      functools.partial(self.window.parallel.own_gradients, grads),
    )

  def folded(self, steps: jax.Array) -> tuple[Any, dict[str, Any]]:
    """The two sides as loops, the last gradient added by the closing one.

    What XLA:GPU compiles best: each side updates its buffers in place, and
    the closing side reads the accumulator once. Returns the accumulator
    and what the closing side left.
    """
    opened = run_once.run_once_if(
      ~steps, self.keep_open, self.open_carry(), name=run_once.KEEP_OPEN
    )
    closing = ClosingSide(self, opened["accumulator"], adds=True)
    closed = run_once.run_once_if(
      steps, closing.close, closing.carry(opened), name=run_once.CLOSE_WINDOW
    )
    return closed.get("accumulator", opened["accumulator"]), closed

  def add_first(self, steps: jax.Array) -> tuple[Any, dict[str, Any]]:
    """The gradient added first, then the closing side alone.

    What XLA:CPU compiles best: it splits the add over the cores outside
    any branch, and adds the gradient as its product comes out, one
    parameter at a time; inside a branch, every gradient would be alive at
    once (a micro-step of the reference MLP took twice as long).
    """
    opened = self.keep_open(self.open_carry())
    closing = ClosingSide(self, opened["accumulator"], adds=False)
    closed = run_once.run_once_if(
      steps, closing.close, closing.carry(opened), name=run_once.CLOSE_WINDOW
    )
    return closed.get("accumulator", opened["accumulator"]), closed

  def open_carry(self) -> dict[str, Any]:
    """What keeping the window open writes: the accumulator, the noise sums."""
    return {"accumulator": self.accumulator, "noise": self.state.noise_scale}

  def keep_open(self, carry: dict[str, Any]) -> dict[str, Any]:
    """The gradient added: the side of a micro-step that does not step.

    A window that closes without stepping (flushed, or full, with no
    weight) emits nothing and starts anew.
    """
    noise: Any = self.window.noise.add(
      carry["noise"], self.micro_batch(self.grads)
    )
    return {
      "accumulator": self.added(carry["accumulator"], self.grads),
      "noise": self.window.noise.reset(
        noise, self.decision.closes & ~self.decision.steps
      ),
    }

  def emit(self, output: Any, stepped: jax.Array) -> Any:
    """The closing side's output as the caller sees it."""
    return self.window.output.emit(
      output, stepped, self.updates_like, self.carrier
    )


@dataclasses.dataclass
class ClosingSide:
  """The side of a micro-step that closes the window.

  It adds the last gradient, reduces the window over the devices,
  normalises it and steps the wrapped optimizer once, writing its output
  (updates, or new params) into the micro-step's carrier buffer; then it
  decides the next window's k.

  Attributes:
    micro_step: the micro-step it is a side of.
    opened_accumulator: the accumulator as the other side left it, read
      when it does not carry the output.
    adds: whether this side adds the last gradient (it is then not in
      ``opened_accumulator``, since the other side did not run).
  """

  micro_step: MicroStep
  opened_accumulator: optax.Updates
  adds: bool

  def carry(self, opened: dict[str, Any]) -> dict[str, Any]:
    """What closing the window writes, its output's buffer among them.

    The accumulator is carried only when it is that buffer; otherwise the
    closing side reads it where keeping the window open left it.
    """
    micro_step = self.micro_step
    carry = {
      "inner_state": micro_step.window.inner_state_home.keep(
        micro_step.state.inner_state
      ),
      "noise": opened["noise"],
      # The state's own buffer, written only when the window closes: a
      # schedule's k is a constant, and a constant output frees its donated
      # buffer, which JAX may then pair with an output in another memory kind.
      "every_k": micro_step.state.every_k,
      "stepped": jnp.zeros((), jnp.bool_),
    }
    if micro_step.carrier == "accumulator":
      carry["accumulator"] = opened["accumulator"]
    elif micro_step.carrier == "grads":
      carry["grads"] = micro_step.grads
    elif micro_step.carrier == "params":
      carry["params"] = micro_step.params
    else:
      carry["zeros"] = optax.tree.zeros_like(micro_step.updates_like)
    return carry

  def normalised(self, sums: Any, weight_sum: jax.Array) -> Any:
    """The reduced window's mean, where its weight was not known before."""
    window = self.micro_step.window
    if window.parallel.weights_are_global or window.reduction != "mean":
      return sums
    # A window without weight does not step the inner optimizer anyway.
    scale = weights.reciprocal(weight_sum)
    return jax.tree.map(lambda total: total * scale.astype(total.dtype), sums)

  def close(self, carry: dict[str, Any]) -> dict[str, Any]:
    """The closing side: add, reduce, normalise, step the optimizer once."""
    micro_step = self.micro_step
    window = micro_step.window
    # A buffer that carries the output is read from the carry, so that it
    # is overwritten in place rather than copied.
    grads = carry.get("grads", micro_step.grads)
    accumulator = carry.get("accumulator", self.opened_accumulator)
    noise = carry["noise"]
    if self.adds:
      noise = window.noise.add(noise, micro_step.micro_batch(grads))
      accumulator = micro_step.added(accumulator, grads)
    sums, total_weight = window.parallel.reduce(
      accumulator,
      micro_step.admitted.weight_sum,
      carry.get("params", micro_step.params),
    )
    sums = self.normalised(sums, total_weight)
    reduced = jax.tree.map(
      lambda total, grad: total.astype(grad.dtype), sums, micro_step.grads
    )
    carry = {**carry, "noise": noise}
    step = functools.partial(self.step_inner, reduced, total_weight)
    if window.parallel.weights_are_global:
      closed = step(carry)
    else:
      # Only here is the window's total weight known: an empty window does
      # not step.
      closed = run_once.run_once_if(
        weights.has_weight(total_weight),
        step,
        carry,
        name=run_once.CLOSE_WINDOW,
      )
    return {
      **closed,
      "noise": window.noise.reset(closed["noise"], jnp.asarray(True)),
    }

  def step_inner(
    self, reduced: Any, total_weight: jax.Array, carry: dict[str, Any]
  ) -> dict[str, Any]:
    """The wrapped optimizer's one step on the window's reduced gradient."""
    micro_step = self.micro_step
    window = micro_step.window
    params = carry.get("params", micro_step.params)
    # A state kept in host memory visits the device here, and only here.
    inner_state = residency.to_device(carry["inner_state"])
    updates, new_inner_state = window.parallel.inner_update(
      window.inner, reduced, inner_state, params, micro_step.extra_args
    )
    every_k = micro_step.decision.every_k
    updates = window.lr_scaling.apply(
      updates, every_k, window.window_length.first()
    )
    # Measured in the gradients' own units: the wrapped optimizer's states
    # tell a loss scale, and a window it dropped.
    noise, micro_gradients = window.noise.close(
      carry["noise"],
      reduced,
      window.parallel,
      inner_states=(inner_state, new_inner_state),
    )
    # Gradients wider than the params (float32 for bfloat16, say) would
    # widen the optimizer's state; it keeps its dtypes from call to call.
    new_inner_state = window.inner_state_home.keep(
      _with_dtypes_of(new_inner_state, inner_state)
    )
    next_k = window.window_length.next(
      every_k,
      update_step=increment_if(micro_step.state.update_step, jnp.asarray(True)),
      noise=getattr(noise, "smoothed", None),
      micro_gradients=micro_gradients,
      window_weight=total_weight,
      full=micro_step.decision.micro_step >= micro_step.decision.every_k,
    )
    return {
      **carry,
      micro_step.carrier: window.output.closing_output(
        updates, params, carry[micro_step.carrier]
      ),
      "inner_state": new_inner_state,
      "noise": noise,
      "every_k": next_k,
      "stepped": jnp.ones((), jnp.bool_),
    }


def _with_dtypes_of(tree: Any, like: Any) -> Any:
  """``tree`` with each array leaf cast to the dtype of its twin in ``like``."""
  return jax.tree.map(
    lambda leaf, twin: (
      jnp.asarray(leaf).astype(twin.dtype) if hasattr(twin, "dtype") else leaf
    ),
    tree,
    like,
  )
