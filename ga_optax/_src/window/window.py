"""The window: its checked configuration, its first state, admit and decide.

A :class:`Window` is what the arguments of ``accumulate`` resolve into
(:mod:`ga_optax._src.window.arguments`). Four of its choices are strategies
it calls without asking which kind it holds: where the window lives across
devices (:mod:`ga_optax._src.placements`), where the state is kept between
calls (:mod:`ga_optax._src.placements.residency`), what a call returns
(:mod:`ga_optax._src.window.output`), and the parts it sums beside the
gradient (:mod:`ga_optax._src.algebra.parts`: the gradient noise scale's
terms, with ``noise_scale_decay``). What one call does with them is
:mod:`ga_optax._src.window.micro_step`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ga_optax._src import validation
from ga_optax._src.algebra import dtypes, fp8, parts
from ga_optax._src.algebra.counters import increment_if
from ga_optax._src.batch_size import adaptive, every_k
from ga_optax._src.mixed_precision import precision
from ga_optax._src.placements import Placement, residency
from ga_optax._src.window.output import ApplyToParams, EmitUpdates
from ga_optax._src.window.state import AccumulateState


class Admitted(NamedTuple):
  """Whether a micro-step is kept, and the window's weight with it."""

  accepted: jax.Array
  weight_sum: jax.Array


class Decision(NamedTuple):
  """What this call does to the window.

  Attributes:
    micro_steps: the open window's micro-steps, this one included.
    every_k: the open window's k.
    closes: the window closes on this call (full, flushed, or by the
      host's word); it steps the wrapped optimizer only if it holds weight.
  """

  micro_steps: jax.Array
  every_k: jax.Array
  closes: jax.Array


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
    placement: where the window lives across devices, and its reduction.
    accumulator_home: where the accumulator is kept between calls.
    inner_state_home: where the wrapped optimizer's state is kept.
    output: what a call returns (updates, or new params).
    parts: what the window sums beside the gradient, each part's value
      carried in the state, in this order.
  """

  inner: optax.GradientTransformationExtraArgs
  window_length: every_k.WindowLength
  lr_scaling: adaptive.LearningRateScaling
  reduction: str
  accumulator_dtype: jnp.dtype
  skip_nonfinite: bool
  placement: Placement
  accumulator_home: residency.Residency
  inner_state_home: residency.Residency
  output: EmitUpdates | ApplyToParams
  parts: tuple[parts.WindowPart, ...]

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
    self.placement.check_init()
    variables = params
    params = fp8.split_variables(variables)[0]
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
    inner_state = self.placement.place_state(self.inner, inner_state, params)
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
        self.placement.init_accumulator(accumulator), unplaced=unplaced
      ),
      inner_state=self.inner_state_home.keep(inner_state, unplaced=unplaced),
      parts=tuple(part.init(self.placement, variables) for part in self.parts),
    )

  def admit(
    self, grads: optax.Updates, state: AccumulateState, weight: Any
  ) -> Admitted:
    """Whether this micro-step counts, and the window's weight after it."""
    weight_sum = state.weight_sum + jnp.asarray(weight, self.weight_dtype)
    if not self.skip_nonfinite:
      return Admitted(jnp.asarray(True), weight_sum)
    accepted = self.placement.all_finite(grads)
    return Admitted(accepted, jnp.where(accepted, weight_sum, state.weight_sum))

  def decide(
    self,
    state: AccumulateState,
    admitted: Admitted,
    schedule: Any,
    flush: Any,
  ) -> Decision:
    """Counts the micro-step; the schedule says whether the window closes."""
    micro_steps = increment_if(state.micro_step, admitted.accepted)
    every_k = self.window_length.current(state.every_k, state.update_step)
    closes = schedule.closes(micro_steps >= every_k, flush)
    return Decision(micro_steps, every_k, closes)
