"""The window's life cycle: admit, decide, add, and the side that closes it.

Each ``update`` call is one micro-step: :meth:`Window.admit` says whether it
counts and with what weight, :meth:`Window.decide` whether the window closes,
and :class:`MicroStep` runs one of its two sides: keep the window open
(add the weighted gradient into the accumulator), or close it (add the last
gradient, reduce over the devices, normalise, step the wrapped optimizer
once).

Four choices made once from the arguments are strategies the window calls
without asking which kind it holds: where the window lives across devices
(:mod:`ga_optax._src.placements`), where the state is kept between calls
(:mod:`ga_optax._src.placements.residency`), what a call returns
(:mod:`ga_optax._src.window.output`), and whether the gradient noise scale is
measured (:mod:`ga_optax._src.algebra.noise_scale`).

How buffers flow decides the cost (see docs/compiled-window.md): each side
is a loop of at most one trip (:mod:`ga_optax._src.window.run_once`) that carries
only what it writes, in place, so a micro-step copies nothing on XLA:GPU;
the first micro-step of a window overwrites the accumulator instead of
adding, so no call spends a pass zeroing it; and the closing side adds the
last gradient in the optimizer's own pass, so the accumulator is read once.
On the CPU, where loop bodies run on one core, the gradient is added first
and the closing side is a conditional (:meth:`MicroStep.add_first`); the
choice of form is made in :mod:`ga_optax._src.window.window_form`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ga_optax._src import validation
from ga_optax._src.algebra import dtypes, fp8, parts, weights
from ga_optax._src.algebra.noise_scale import Measured, Unmeasured
from ga_optax._src.batch_size import adaptive, every_k
from ga_optax._src.placements import Parallel, residency
from ga_optax._src.window import precision, run_once, window_form
from ga_optax._src.window.closing import ClosingSide
from ga_optax._src.window.counters import increment_if
from ga_optax._src.window.output import ApplyToParams, EmitUpdates
from ga_optax._src.window.state import AccumulateState, check_state


class Admitted(NamedTuple):
  """Whether a micro-step is kept, and the window's weight with it."""

  accepted: jax.Array
  weight_sum: jax.Array


class Decision(NamedTuple):
  """What this call does to the window.

  Attributes:
    micro_step: the open window's micro-steps, this one included.
    every_k: the open window's k.
    closes: the window closes on this call (full, or flushed).
    steps: the call runs the closing side (a window that closes with no
      weight on a device that knows the window's whole weight does not).
    scale: what the accumulator is multiplied by as the gradient is added
      (``1 / weight_sum`` when this call closes a window whose weight is
      known on this device, else 1).
  """

  micro_step: jax.Array
  every_k: jax.Array
  closes: jax.Array
  steps: jax.Array
  scale: jax.Array


@dataclasses.dataclass(frozen=True)
class Window:
  """The checked configuration of one accumulation, and its life cycle.

  Attributes:
    inner: the wrapped optimizer, taking extra arguments.
    window_length: the first window's k, and each next one's.
    lr_scaling: how the wrapped optimizer's updates follow k.
    reduction: ``"mean"`` or ``"sum"``.
    accumulator_dtype: floating dtype of the accumulator.
    skip_nonfinite: drop micro-steps whose gradients are not finite.
    parallel: where the window lives across devices, and its reduction.
    accumulator_home: where the accumulator is kept between calls.
    inner_state_home: where the wrapped optimizer's state is kept.
    output: what a call returns (updates, or new params).
    noise: whether and how the gradient noise scale is measured.
  """

  inner: optax.GradientTransformationExtraArgs
  window_length: every_k.WindowLength
  lr_scaling: adaptive.LearningRateScaling
  reduction: str
  accumulator_dtype: jnp.dtype
  skip_nonfinite: bool
  parallel: Parallel
  accumulator_home: residency.Residency
  inner_state_home: residency.Residency
  output: EmitUpdates | ApplyToParams
  noise: Unmeasured | Measured

  @property
  def weight_dtype(self) -> jnp.dtype:
    return dtypes.weight_dtype(self.accumulator_dtype)

  def init(self, params: optax.Params) -> AccumulateState:
    """The state of an empty window, the accumulator shaped like the gradients.

    The gradients are shaped like ``params``, but for Flax variables that
    hold float8 state (then like their ``"params"``) and for
    ``optax.lookahead``'s params (then like the fast ones).
    """
    validation.check_array_leaves(params, "params")
    self.parallel.check_init()
    params, fp8_state = fp8.split_variables(params)
    trained = (
      params.fast if isinstance(params, optax.LookaheadParams) else params
    )
    accumulator = jax.tree.map(
      lambda param: jnp.zeros_like(
        param, dtypes.sum_dtype(jnp.result_type(param), self.accumulator_dtype)
      ),
      trained,
    )
    inner_state = self.inner.init(params)
    # Points at the user's call of init.
    precision.warn_if_state_range_too_narrow(inner_state)
    inner_state = self.parallel.place_state(self.inner, inner_state, params)
    # The state's arrays that JAX has not placed (scalars such as Adam's
    # count) follow the params' devices into the memory kind.
    unplaced = residency.replicated_over(params)
    return AccumulateState(
      micro_step=jnp.zeros((), jnp.int32),
      update_step=jnp.zeros((), jnp.int32),
      every_k=self.window_length.first(),
      num_skipped=jnp.zeros((), jnp.int32),
      emitted=jnp.zeros((), jnp.bool_),
      weight_sum=jnp.zeros((), self.weight_dtype),
      accumulator=self.accumulator_home.keep(
        self.parallel.init_accumulator(accumulator), unplaced=unplaced
      ),
      inner_state=self.inner_state_home.keep(inner_state, unplaced=unplaced),
      noise_scale=self.noise.init(self.parallel),
      fp8_window=fp8.init_window(fp8_state, reduction=self.reduction),
    )

  def update(
    self,
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
    self.accumulator_home.check_kept(state.accumulator)
    self.inner_state_home.check_kept(state.inner_state)
    fp8.refuse_as_gradients(grads)
    validation.check_grads_match(
      grads, state.accumulator, self.parallel.unreduced_axes
    )
    weight = weights.check(weight)
    flush = validation.check_flush(flush)
    self.parallel.check_update(grads, weight)

    admitted = self.admit(grads, state, weight)
    decision = self.decide(state, admitted, flush)
    micro_step = MicroStep(
      self,
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
      accumulator=self.accumulator_home.keep(accumulator),
      inner_state=closed["inner_state"],
      noise_scale=closed["noise"],
      fp8_window=state.fp8_window,
    )
    return micro_step.emit(output, closed["stepped"]), new_state

  def admit(
    self, grads: optax.Updates, state: AccumulateState, weight: Any
  ) -> Admitted:
    """Whether this micro-step counts, and the window's weight after it."""
    weight_sum = state.weight_sum + jnp.asarray(weight, self.weight_dtype)
    if not self.skip_nonfinite:
      return Admitted(jnp.asarray(True), weight_sum)
    accepted = self.parallel.all_finite(grads)
    return Admitted(accepted, jnp.where(accepted, weight_sum, state.weight_sum))

  def decide(
    self, state: AccumulateState, admitted: Admitted, flush: Any
  ) -> Decision:
    """Counts the micro-step and decides whether the window closes."""
    micro_step = increment_if(state.micro_step, admitted.accepted)
    every_k = self.window_length.current(state.every_k, state.update_step)
    closes = (micro_step >= every_k) | flush
    scale = jnp.ones((), self.accumulator_dtype)
    if not self.parallel.weights_are_global:
      # The window's weight is only known after the closing reduction.
      return Decision(micro_step, every_k, closes, closes, scale)
    steps = closes & weights.has_weight(admitted.weight_sum)
    if self.reduction == "mean":
      scale = jnp.where(steps, weights.reciprocal(admitted.weight_sum), 1.0)
      scale = scale.astype(self.accumulator_dtype)
    return Decision(micro_step, every_k, closes, steps, scale)


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
    accepted = self.admitted.accepted
    weight = jnp.where(accepted, jnp.asarray(self.weight, jnp.float32), 0.0)
    own = self.window.parallel.own_gradients(grads, weight)
    return parts.MicroBatch(grads, weight, accepted, own)

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
