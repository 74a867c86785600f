"""The window's life cycle: admit, decide, add, and the conditional that closes it.

Each ``update`` call is one micro-step: :meth:`Window.admit` says whether it
counts and with what weight, :meth:`Window.decide` whether the window closes,
:meth:`Window.add` adds the weighted gradient into the accumulator, and one
``lax.cond`` (:class:`Closing`) either keeps the window open, handing its
operands back untouched, or closes it: reduce over the devices, normalise,
step the wrapped optimizer once.

Four choices made once from the arguments are strategies the window calls
without asking which kind it holds: where the window lives across devices
(:mod:`ga_optax._src.parallel`), where the state is kept between calls
(:mod:`ga_optax._src.residency`), what a call returns
(:mod:`ga_optax._src.output`), and whether the gradient noise scale is
measured (:mod:`ga_optax._src.noise_scale`).

How buffers flow decides the cost (see docs/benchmarks.md): the gradient is
added into the accumulator outside any conditional, in place, and the first
micro-step of a window overwrites instead of adding, so no call spends a
pass zeroing it. The conditional takes the inner state (and the params) as
operands that the open branch hands back untouched, so XLA aliases them with
no copy, and its open branch does nothing but forward operands, so XLA:GPU
keeps it a conditional (see docs/compiled-window.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ga_optax._src import dtypes, every_k, residency, validation
from ga_optax._src.noise_scale import Measured, Unmeasured
from ga_optax._src.output import ApplyToParams, EmitUpdates
from ga_optax._src.parallel import Parallel
from ga_optax._src.state import AccumulateState, check_state


class Admitted(NamedTuple):
  """Whether a micro-step is kept, and the window's weight with it."""

  accepted: jax.Array
  weight_sum: jax.Array


class Decision(NamedTuple):
  """What this call does to the window.

  Attributes:
    micro_step: the open window's micro-steps, this one included.
    closes: the window closes on this call (full, or flushed).
    steps: the conditional takes its closing branch.
    scale: what the accumulator is multiplied by as the gradient is added
      (``1 / weight_sum`` when this call closes a window whose weight is
      known on this device, else 1).
  """

  micro_step: jax.Array
  closes: jax.Array
  steps: jax.Array
  scale: jax.Array


def increment_if(count: jax.Array, condition: jax.Array) -> jax.Array:
  """Adds one where ``condition`` holds, saturating at the int32 maximum."""
  limit = jnp.iinfo(count.dtype).max
  return jnp.where(condition & (count < limit), count + 1, count)


@dataclasses.dataclass(frozen=True)
class Window:
  """The checked configuration of one accumulation, and its life cycle.

  Attributes:
    inner: the wrapped optimizer, taking extra arguments.
    schedule: ``update_step -> k``.
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
  schedule: every_k.EveryKSchedule
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
    """The state of an empty window, the accumulator shaped like ``params``."""
    validation.check_array_leaves(params, "params")
    self.parallel.check_init()
    accumulator = jax.tree.map(
      lambda param: jnp.zeros_like(
        param, dtypes.sum_dtype(jnp.result_type(param), self.accumulator_dtype)
      ),
      params,
    )
    inner_state = self.parallel.place_state(
      self.inner, self.inner.init(params), params
    )
    # The state's arrays that JAX has not placed (scalars such as Adam's
    # count) follow the params' devices into the memory kind.
    unplaced = residency.replicated_over(params)
    return AccumulateState(
      micro_step=jnp.zeros((), jnp.int32),
      update_step=jnp.zeros((), jnp.int32),
      num_skipped=jnp.zeros((), jnp.int32),
      emitted=jnp.zeros((), jnp.bool_),
      weight_sum=jnp.zeros((), self.weight_dtype),
      accumulator=self.accumulator_home.keep(
        self.parallel.init_accumulator(accumulator), unplaced=unplaced
      ),
      inner_state=self.inner_state_home.keep(inner_state, unplaced=unplaced),
      noise_scale=self.noise.init(self.parallel),
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
    validation.check_grads_match(
      grads, state.accumulator, self.parallel.unreduced_axes
    )
    weight = validation.check_weight(weight)
    flush = validation.check_flush(flush)
    self.parallel.check_update(grads, weight)

    admitted = self.admit(grads, state, weight)
    decision = self.decide(state, admitted, flush)
    accumulator = self.add(state, grads, weight, admitted, decision)
    noise = self.noise.add(
      state.noise_scale, grads, weight, admitted.accepted, self.parallel
    )
    closing = Closing(self, grads, state, params, extra_args)
    output, inner_state, noise, stepped = jax.lax.cond(
      decision.steps,
      functools.partial(closing.close, weight_sum=admitted.weight_sum),
      closing.keep_open,
      closing.operands(
        accumulator,
        self.inner_state_home.keep(state.inner_state),
        noise,
        predicate=decision.steps,
      ),
    )
    new_state = AccumulateState(
      micro_step=jnp.where(decision.closes, 0, decision.micro_step),
      update_step=increment_if(state.update_step, stepped),
      num_skipped=increment_if(state.num_skipped, ~admitted.accepted),
      emitted=stepped,
      weight_sum=jnp.where(
        decision.closes,
        jnp.zeros_like(admitted.weight_sum),
        admitted.weight_sum,
      ),
      accumulator=self.accumulator_home.keep(
        output if closing.carrier == "accumulator" else accumulator
      ),
      inner_state=inner_state,
      noise_scale=self.noise.reset(noise, decision.closes),
    )
    return closing.emit(output, stepped), new_state

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
    closes = (micro_step >= self.schedule(state.update_step)) | flush
    scale = jnp.ones((), self.accumulator_dtype)
    if not self.parallel.weights_are_global:
      # The window's weight is only known after the closing reduction.
      return Decision(micro_step, closes, closes, scale)
    steps = closes & (admitted.weight_sum > 0)
    if self.reduction == "mean":
      weight_sum = jnp.where(steps, admitted.weight_sum, 1.0)
      scale = jnp.where(steps, 1.0 / weight_sum, 1.0).astype(scale.dtype)
    return Decision(micro_step, closes, steps, scale)

  def add(
    self,
    state: AccumulateState,
    grads: optax.Updates,
    weight: Any,
    admitted: Admitted,
    decision: Decision,
  ) -> optax.Updates:
    """The accumulator with ``weight * grads`` added, scaled by ``decision``.

    The first micro-step of a window overwrites the stale buffer: a select,
    not a multiply, since a stale buffer may hold anything, NaN too. An
    accumulator kept in another memory kind is brought to the device leaf
    by leaf, each once its gradient is there; the sum stays on the device
    until the state is put back.
    """
    restarts = state.micro_step == 0
    weight = self.parallel.factor(weight)
    scale = self.parallel.factor(decision.scale)
    scaled = self.parallel.weights_are_global and self.reduction == "mean"

    def add_grad(total: jax.Array, grad: jax.Array) -> jax.Array:
      kept = jnp.where(restarts, jnp.zeros_like(total), total)
      added = kept + _weighted(grad, weight, total.dtype)
      if self.skip_nonfinite:
        added = jnp.where(admitted.accepted, added, total)
      return added * scale.astype(added.dtype) if scaled else added

    accumulator = residency.to_device_after(state.accumulator, grads)
    return jax.tree.map(add_grad, accumulator, grads)


@dataclasses.dataclass
class Closing:
  """The two branches of a micro-step's conditional, and what they return.

  Attributes:
    window: the accumulation's configuration.
    grads: this micro-step's gradients (for their tree and dtypes).
    state: the state before this micro-step.
    params: the params (None when the transformation is called without).
    extra_args: forwarded to the inner optimizer.
  """

  window: Window
  grads: optax.Updates
  state: AccumulateState
  params: optax.Params | None
  extra_args: dict[str, Any]

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
    """The operand the open branch forwards in the output's place."""
    carriers = self.window.parallel.carriers(self.state.accumulator, self.grads)
    return self.window.output.carrier(self.updates_like, carriers)

  def operands(
    self,
    accumulator: Any,
    inner_state: Any,
    noise: Any,
    *,
    predicate: jax.Array,
  ) -> dict[str, Any]:
    """What the conditional takes: all that either branch reads or returns.

    XLA:GPU turns a conditional whose two branches hold only cheap
    (elementwise) ops into selects that run both branches, which would run
    the optimizer on every micro-step. It keeps a conditional one of whose
    branches only forwards its operands, so everything the open branch
    returns is an operand made outside it: its ``False`` flag is the
    predicate itself (a constant would be folded into the branch), and its
    output is the :attr:`carrier`.
    """
    operands = {
      "params": self.params,
      "accumulator": accumulator,
      "inner_state": inner_state,
      "noise": noise,
      "not_stepped": predicate,
    }
    if self.carrier == "grads":
      operands["grads"] = self.grads
    elif self.carrier == "zeros":
      operands["zeros"] = optax.tree.zeros_like(self.updates_like)
    return operands

  def normalised(self, sums: Any, weight_sum: jax.Array) -> Any:
    """The reduced window's mean, where its weight was not known before."""
    window = self.window
    if window.parallel.weights_are_global or window.reduction != "mean":
      return sums
    # The guard keeps a window without weight from computing 0 / 0; such a
    # window does not step the inner optimizer anyway.
    scale = 1.0 / jnp.where(weight_sum > 0, weight_sum, 1.0)
    return jax.tree.map(lambda total: total * scale.astype(total.dtype), sums)

  def keep_open(
    self, operands: dict[str, Any]
  ) -> tuple[Any, Any, Any, jax.Array]:
    """The open branch: operands handed back untouched, and nothing else."""
    return (
      operands[self.carrier],
      operands["inner_state"],
      operands["noise"],
      operands["not_stepped"],
    )

  def close(
    self, operands: dict[str, Any], *, weight_sum: Any
  ) -> tuple[Any, Any, Any, jax.Array]:
    """The closing branch: reduce, normalise, step the optimizer once."""
    window = self.window
    sums, total_weight = window.parallel.reduce(
      operands["accumulator"], weight_sum, operands["params"]
    )
    sums = self.normalised(sums, total_weight)
    reduced = jax.tree.map(
      lambda total, grad: total.astype(grad.dtype), sums, self.grads
    )
    if self.carrier == "zeros":
      # XLA folds zeros handed to a conditional into the branch that returns
      # them, which then no longer only forwards its operands. A barrier is
      # an op XLA:GPU does not turn into selects: the conditional stays.
      reduced = jax.lax.optimization_barrier(reduced)
    step = functools.partial(self.step_inner, reduced, total_weight)
    if window.parallel.weights_are_global:
      return step(operands)
    # Only here is the window's total weight known: a nested conditional,
    # whose open branch also only forwards operands, keeps an empty window
    # from stepping.
    has_weight = total_weight > 0
    return jax.lax.cond(
      has_weight,
      step,
      self.keep_open,
      {**operands, "accumulator": sums, "not_stepped": has_weight},
    )

  def step_inner(
    self, reduced: Any, total_weight: jax.Array, operands: dict[str, Any]
  ) -> tuple[Any, Any, Any, jax.Array]:
    """The wrapped optimizer's one step on the window's reduced gradient."""
    window, params = self.window, operands["params"]
    # A state kept in host memory visits the device here, and only here.
    inner_state = residency.to_device(operands["inner_state"])
    updates, new_inner_state = window.parallel.inner_update(
      window.inner, reduced, inner_state, params, self.extra_args
    )
    # Gradients wider than the params (float32 for bfloat16, say) would
    # widen the optimizer's state; it keeps its dtypes from call to call.
    new_inner_state = window.inner_state_home.keep(
      _with_dtypes_of(new_inner_state, inner_state)
    )
    output = window.output.closing_output(
      updates, params, operands[self.carrier]
    )
    noise = window.noise.close(
      operands["noise"], reduced, total_weight, window.parallel
    )
    return output, new_inner_state, noise, jnp.asarray(True)

  def emit(self, output: Any, stepped: jax.Array) -> Any:
    """The conditional's output as the caller sees it."""
    return self.window.output.emit(
      output, stepped, self.updates_like, self.carrier
    )


def _with_dtypes_of(tree: Any, like: Any) -> Any:
  """``tree`` with each array leaf cast to the dtype of its twin in ``like``."""
  return jax.tree.map(
    lambda leaf, twin: (
      jnp.asarray(leaf).astype(twin.dtype) if hasattr(twin, "dtype") else leaf
    ),
    tree,
    like,
  )


def _weighted(grad: jax.Array, weight: Any, dtype: Any) -> jax.Array:
  """``weight * grad`` in ``dtype``: a plain cast for weight 1, zeros for 0."""
  grad = grad.astype(dtype)
  if isinstance(weight, (int, float)) and weight == 1:
    return grad
  weight = jnp.asarray(weight).astype(dtype)
  # A micro-batch of weight 0 (all padding, say) must add nothing, even
  # though the gradient of its mean loss is 0 / 0 = NaN: 0 * NaN is NaN.
  return jnp.where(weight == 0, jnp.zeros_like(grad), weight * grad)
