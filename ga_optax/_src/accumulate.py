"""Gradient accumulation as an Optax ``GradientTransformation``.

``accumulate`` wraps an optimizer so that k calls of ``update`` (one per
micro-batch) add their gradients into an accumulator and emit zero updates;
the call that closes the window hands the reduced gradient to the wrapped
optimizer, once. The wrapped optimizer is evaluated under ``lax.cond`` only on
that call, so on the other micro-steps it costs nothing and its counters and
schedules do not move.

A window's life cycle is four functions of :class:`Window`, in call order:
``admit`` (is this micro-step kept, and with what weight), ``add`` (into the
accumulator), the conditional that either keeps the window open or closes it
(reduce across devices, normalise, step the optimizer), and ``reset`` (the
counters of the next state).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from ga_optax._src import (
  distributed,
  dtypes,
  eager,
  memory_kinds,
  precision,
  sharding,
  validation,
  zero,
)
from ga_optax._src import every_k as every_k_lib


class AccumulateState(NamedTuple):
  """State of :func:`accumulate`: a plain pytree that jits and checkpoints.

  Attributes:
    micro_step: int32, micro-steps held by the open window (0 right after a
      window closes).
    update_step: int32, updates the inner optimizer has applied; the
      argument of a callable or dict ``every_k``.
    num_skipped: int32, non-finite micro-steps dropped by
      ``skip_nonfinite=True`` over the whole run.
    emitted: bool, whether the last ``update`` call ran the inner optimizer
      (see :func:`emitted`).
    weight_sum: sum of the weights of the micro-steps in the open window.
    accumulator: sum of ``weight * grads`` over the open window, in
      ``accumulator_dtype`` (complex leaves in the complex dtype of that
      precision), with the tree of the params. Meaningful only while
      ``micro_step > 0``: the first micro-step of a window overwrites it
      instead of adding, so closing a window need not zero it, and the
      closing call may reuse its buffer to carry the updates (see
      :func:`accumulate`). With ``unreduced_axes`` its leaves are
      ``unreduced`` over those mesh axes: each device holds its own partial
      sum. With ``accumulator_memory_kind`` its leaves live in that memory
      kind.
    inner_state: the wrapped optimizer's state, in
      ``inner_state_memory_kind`` when one is given.
  """

  micro_step: jax.Array
  update_step: jax.Array
  num_skipped: jax.Array
  emitted: jax.Array
  weight_sum: jax.Array
  accumulator: optax.Updates
  inner_state: optax.OptState


class Admitted(NamedTuple):
  """Whether a micro-step is kept, and the window's weight with it."""

  accepted: jax.Array
  weight_sum: jax.Array


class Decision(NamedTuple):
  """What this call does to the window.

  Attributes:
    micro_step: the open window's micro-steps, this one included.
    closes: the window closes on this call (full, or flushed).
    steps: the inner optimizer runs on this call.
    scale: what the accumulator is multiplied by as the gradient is added
      (``1 / weight_sum`` when this call closes a window whose weight is
      known on this device, else 1).
  """

  micro_step: jax.Array
  closes: jax.Array
  steps: jax.Array
  scale: jax.Array


def _increment_if(count: jax.Array, condition: jax.Array) -> jax.Array:
  """Adds one where ``condition`` holds, saturating at the int32 maximum."""
  limit = jnp.iinfo(count.dtype).max
  return jnp.where(condition & (count < limit), count + 1, count)


class Window(NamedTuple):
  """The checked configuration of one accumulation, and its life cycle.

  Shared by :func:`accumulate` and :func:`ga_optax.accumulate_and_apply`, so
  both take the same arguments, raise the same errors and keep the same
  state.

  How buffers flow decides the cost (see docs/benchmarks.md): the gradient is
  added into the accumulator outside any conditional, in place, and the
  first micro-step of a window overwrites instead of adding, so no call
  spends a pass zeroing it. One conditional takes the inner state (and, on
  the fused path, the params) as operands that the open branch hands back
  untouched, so XLA aliases them with no copy. On the transformation path
  its first output carries, through the accumulator's own buffer, the
  accumulator (open branch) or the updates (closing branch): updates leaving
  a conditional must live in some buffer, and the window's sum is no longer
  needed once the optimizer has read it. Outside the conditional a select
  turns that output into zeros or updates, which XLA fuses into the
  caller's ``apply_updates``.

  Attributes:
    inner: the wrapped optimizer, taking extra arguments.
    schedule: ``update_step -> k``.
    reduction: ``"mean"`` or ``"sum"``.
    accumulator_dtype: floating dtype of the accumulator.
    skip_nonfinite: drop micro-steps whose gradients are not finite.
    axis_name: manual axes (``shard_map``/``pmap``) to sum over when a
      window closes; empty for none.
    unreduced_axes: mesh axes the gradients and the accumulator are
      ``unreduced`` over; empty for none.
    inner_state_axes: how the inner state is sharded over mesh axes
      (ZeRO-1); None to keep it as ``inner.init`` makes it.
    accumulator_memory_kind: the memory kind the accumulator is kept in
      between calls (``"pinned_host"``, say); None leaves it where JAX puts
      it.
    inner_state_memory_kind: the same for the inner optimizer's state.
  """

  inner: optax.GradientTransformationExtraArgs
  schedule: every_k_lib.EveryKSchedule
  reduction: str
  accumulator_dtype: jnp.dtype
  skip_nonfinite: bool
  axis_name: sharding.Axes
  unreduced_axes: sharding.Axes
  inner_state_axes: zero.StatePlacement | None
  accumulator_memory_kind: str | None
  inner_state_memory_kind: str | None

  @property
  def weight_dtype(self) -> jnp.dtype:
    return dtypes.weight_dtype(self.accumulator_dtype)

  @property
  def accumulator_home(self) -> str:
    """The memory kind ``update`` leaves the accumulator in."""
    return self.accumulator_memory_kind or "device"

  @property
  def inner_state_home(self) -> str:
    """The memory kind ``update`` leaves the inner optimizer's state in."""
    return self.inner_state_memory_kind or "device"

  @property
  def weights_are_global(self) -> bool:
    """Whether every device sees the window's whole weight (no ``axis_name``).

    Then an empty window is known before the conditional, and the mean is
    formed as the last gradient is added.
    """
    return not self.axis_name

  def init(self, params: optax.Params) -> AccumulateState:
    """The state of an empty window, the accumulator shaped like ``params``."""
    self.check_mesh()
    accumulator = jax.tree.map(
      lambda param: jnp.zeros_like(
        param, dtypes.sum_dtype(jnp.result_type(param), self.accumulator_dtype)
      ),
      params,
    )
    if self.unreduced_axes:
      accumulator = sharding.cast_to_unreduced(accumulator, self.unreduced_axes)
    inner_state = zero.place(
      self.inner, self.inner.init(params), params, self.inner_state_axes
    )
    # The state's arrays that JAX has not placed (scalars such as Adam's
    # count) follow the params' devices into the memory kind.
    unplaced = memory_kinds.replicated_over(params)
    return AccumulateState(
      micro_step=jnp.zeros((), jnp.int32),
      update_step=jnp.zeros((), jnp.int32),
      num_skipped=jnp.zeros((), jnp.int32),
      emitted=jnp.zeros((), jnp.bool_),
      weight_sum=jnp.zeros((), self.weight_dtype),
      accumulator=memory_kinds.put(
        accumulator, self.accumulator_memory_kind, unplaced=unplaced
      ),
      inner_state=memory_kinds.put(
        inner_state, self.inner_state_memory_kind, unplaced=unplaced
      ),
    )

  def check_mesh(self) -> None:
    """Checks that the named mesh axes are of the kind their argument needs."""
    if self.unreduced_axes:
      sharding.check_explicit(self.unreduced_axes, "unreduced_axes")
    zero.check_mesh(self.inner_state_axes)

  def check_axis_name(self, grads: optax.Updates, weight: Any) -> None:
    """Checks that ``axis_name`` is bound here and how the grads vary.

    ``init`` needs no bound axis (it may run outside ``shard_map``); each
    micro-step does. Inside a ``shard_map`` that tracks variance
    (``check_vma=True``), gradients of parameters that do not vary over the
    axes arrive already summed over them by autodiff; the window then adds
    them as they are and only sums the weights. Gradients or weights that
    vary would leave a per-device accumulator in a state typed as the same
    on every device, which that ``shard_map`` refuses.
    """
    misplaced = sharding.mesh_axes(self.axis_name)
    if misplaced:
      raise ValueError(
        f"axis_name {self.axis_name!r} names mesh axes {misplaced!r} that no"
        " enclosing jax.shard_map is manual over: it is for steps inside"
        " shard_map or pmap. Under a plain jax.jit with a sharded batch,"
        " pass unreduced_axes=... and gradients from"
        " ga_optax.unreduced_value_and_grad instead."
      )
    if not self.summed_by_autodiff:
      return
    names = set(self.axis_name)
    for name, tree in (("grads", grads), ("weight", weight)):
      if any(names & sharding.varying_axes(x) for x in jax.tree.leaves(tree)):
        raise ValueError(
          f"{name} vary over axis_name {self.axis_name!r} inside a"
          " jax.shard_map with check_vma=True: a per-device accumulator"
          " cannot live in a state that shard_map checks to be the same on"
          " every device. Run the step in jax.shard_map(...,"
          " check_vma=False) to accumulate on each device and reduce once"
          " per window, or pass gradients of unvarying params (autodiff"
          " then sums them over the devices on every micro-step)."
        )

  @property
  def summed_by_autodiff(self) -> bool:
    """Whether gradients over ``axis_name`` come summed (``check_vma=True``)."""
    return bool(self.axis_name) and sharding.tracks_variance(self.axis_name)

  def check_memory_kinds(self, state: AccumulateState) -> None:
    """Checks that the state is in the memory kinds ``update`` leaves it in."""
    memory_kinds.check_kept_in(
      state.accumulator,
      self.accumulator_home,
      "accumulator",
      "accumulator_memory_kind",
    )
    memory_kinds.check_kept_in(
      state.inner_state,
      self.inner_state_home,
      "inner_state",
      "inner_state_memory_kind",
    )

  def admit(
    self, grads: optax.Updates, state: AccumulateState, weight: Any
  ) -> Admitted:
    """Whether this micro-step counts, and the window's weight after it."""
    weight_sum = state.weight_sum + jnp.asarray(weight, self.weight_dtype)
    if not self.skip_nonfinite:
      return Admitted(jnp.asarray(True), weight_sum)
    accepted = _all_finite(grads, self.unreduced_axes)
    if self.axis_name:
      # Every device must drop the same micro-steps.
      accepted = jax.lax.pmin(accepted.astype(jnp.int32), self.axis_name) > 0
    return Admitted(accepted, jnp.where(accepted, weight_sum, state.weight_sum))

  def decide(
    self, state: AccumulateState, admitted: Admitted, flush: Any
  ) -> Decision:
    """Counts the micro-step and decides whether the window closes."""
    micro_step = _increment_if(state.micro_step, admitted.accepted)
    closes = (micro_step >= self.schedule(state.update_step)) | flush
    scale = jnp.ones((), self.accumulator_dtype)
    if not self.weights_are_global:
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
    weight = sharding.as_reduced(weight, self.unreduced_axes)
    scale = sharding.as_reduced(decision.scale, self.unreduced_axes)
    scaled = self.weights_are_global and self.reduction == "mean"

    def add_grad(total: jax.Array, grad: jax.Array) -> jax.Array:
      kept = jnp.where(restarts, jnp.zeros_like(total), total)
      added = kept + _weighted(grad, weight, total.dtype)
      if self.skip_nonfinite:
        added = jnp.where(admitted.accepted, added, total)
      return added * scale.astype(added.dtype) if scaled else added

    accumulator = memory_kinds.to_device_after(state.accumulator, grads)
    return jax.tree.map(add_grad, accumulator, grads)

  def reduce(
    self,
    accumulator: optax.Updates,
    weight_sum: jax.Array,
    params: optax.Params | None,
  ) -> tuple[optax.Updates, jax.Array]:
    """The window's sum and weight, reduced over the devices (closing only).

    The one cross-device reduction of a window: an all-reduce over
    ``axis_name``, or the reshard of an accumulator unreduced over
    ``unreduced_axes`` to the params' sharding.
    """
    if self.unreduced_axes:
      reduced = zero.reduce(accumulator, params, self.inner_state_axes)
      return reduced, weight_sum
    if self.summed_by_autodiff:
      # Each gradient is already the sum over the devices: only the
      # weights, the same on every device, are summed (times D).
      weight_sum = jax.lax.psum(weight_sum, self.axis_name)
    else:
      accumulator, weight_sum = distributed.sum_across_devices(
        (accumulator, weight_sum), self.axis_name or None
      )
    if not self.weights_are_global and self.reduction == "mean":
      # The guard keeps a window without weight from computing 0 / 0; such
      # a window does not step the inner optimizer anyway.
      scale = 1.0 / jnp.where(weight_sum > 0, weight_sum, 1.0)
      accumulator = jax.tree.map(
        lambda total: total * scale.astype(total.dtype), accumulator
      )
    return accumulator, weight_sum

  def update(
    self,
    grads: optax.Updates,
    state: AccumulateState,
    params: optax.Params | None,
    *,
    weight: Any,
    flush: Any,
    extra_args: dict[str, Any],
    apply_to_params: bool,
  ) -> tuple[Any, AccumulateState]:
    """One micro-step: the updates (or, fused, the new params) and state."""
    state = _check_state(state)
    self.check_mesh()
    self.check_memory_kinds(state)
    validation.check_grads_match(grads, state.accumulator, self.unreduced_axes)
    weight = validation.check_weight(weight)
    self.check_axis_name(grads, weight)
    flush = validation.check_flush(flush)

    admitted = self.admit(grads, state, weight)
    decision = self.decide(state, admitted, flush)
    accumulator = self.add(state, grads, weight, admitted, decision)
    closing = Closing(self, grads, state, params, extra_args, apply_to_params)
    output, inner_state, stepped = jax.lax.cond(
      decision.steps,
      functools.partial(closing.close, weight_sum=admitted.weight_sum),
      closing.keep_open,
      closing.operands(
        accumulator,
        memory_kinds.put(state.inner_state, self.inner_state_home),
        predicate=decision.steps,
      ),
    )
    new_state = AccumulateState(
      micro_step=jnp.where(decision.closes, 0, decision.micro_step),
      update_step=_increment_if(state.update_step, stepped),
      num_skipped=_increment_if(state.num_skipped, ~admitted.accepted),
      emitted=stepped,
      weight_sum=jnp.where(
        decision.closes,
        jnp.zeros_like(admitted.weight_sum),
        admitted.weight_sum,
      ),
      accumulator=memory_kinds.put(
        output if closing.carrier == "accumulator" else accumulator,
        self.accumulator_home,
      ),
      inner_state=inner_state,
    )
    return closing.emitted_output(output, stepped), new_state


@dataclasses.dataclass
class Closing:
  """The two branches of a micro-step's conditional, and what they return.

  Attributes:
    window: the accumulation's configuration.
    grads: this micro-step's gradients (for their tree and dtypes).
    state: the state before this micro-step.
    params: the params (None when the transformation is called without).
    extra_args: forwarded to the inner optimizer.
    apply_to_params: the fused path: return params, not updates.
  """

  window: Window
  grads: optax.Updates
  state: AccumulateState
  params: optax.Params | None
  extra_args: dict[str, Any]
  apply_to_params: bool

  @functools.cached_property
  def updates_like(self) -> Any:
    """Shapes and dtypes of the inner optimizer's updates for these grads."""
    window = self.window

    def inner_updates(grads: Any) -> Any:
      if window.unreduced_axes:
        grads = sharding.reduce_unreduced(grads, self.params)
      inner_state = memory_kinds.to_device(self.state.inner_state)
      return zero.update(
        window.inner,
        window.inner_state_axes,
        grads,
        inner_state,
        self.params,
        **self.extra_args,
      )[0]

    return jax.eval_shape(inner_updates, self.grads)

  @functools.cached_property
  def carrier(self) -> str:
    """The operand the open branch hands back where the closing one has output.

    ``"params"`` on the fused path. Else ``"accumulator"`` when every
    updates leaf converts to the accumulator's dtype and back exactly
    (bfloat16 updates in a float32 accumulator do) and the accumulator is
    an ordinary array (not unreduced): the updates then ride in its buffer,
    which the window no longer needs once the optimizer has read it. Else
    ``"grads"`` when the updates fit the gradients so (their buffer is dead
    once added). Else ``"zeros"``, made outside the conditional.
    """
    if self.apply_to_params:
      return "params"
    if self.window.unreduced_axes:
      return "zeros"
    if _fits_exactly(self.updates_like, self.state.accumulator):
      return "accumulator"
    if _fits_exactly(self.updates_like, self.grads):
      return "grads"
    return "zeros"

  def operands(
    self, accumulator: Any, inner_state: Any, *, predicate: jax.Array
  ) -> dict[str, Any]:
    """What the conditional takes: all that either branch reads or returns.

    XLA:GPU turns a conditional whose two branches hold only cheap
    (elementwise) ops into selects that run both branches, which would run
    the optimizer on every micro-step. It keeps a conditional one of whose
    branches only forwards its operands, so everything the open branch
    returns is an operand made outside it: its ``False`` flag is the
    predicate itself (a constant would be folded into the branch), and its
    output is an operand of the updates' type (see :attr:`carrier`).
    """
    operands = {
      "params": self.params,
      "accumulator": accumulator,
      "inner_state": inner_state,
      "not_stepped": predicate,
    }
    if self.carrier == "grads":
      operands["grads"] = self.grads
    if self.carrier == "zeros":
      operands["zeros"] = optax.tree.zeros_like(self.updates_like)
    return operands

  def keep_open(self, operands: dict[str, Any]) -> tuple[Any, Any, jax.Array]:
    """The open branch: operands handed back untouched, and nothing else."""
    return (
      operands[self.carrier],
      operands["inner_state"],
      operands["not_stepped"],
    )

  def close(
    self, operands: dict[str, Any], *, weight_sum: Any
  ) -> tuple[Any, Any, jax.Array]:
    """The closing branch: reduce, normalise, step the optimizer once."""
    window = self.window
    accumulator, total_weight = window.reduce(
      operands["accumulator"], weight_sum, operands["params"]
    )
    reduced = jax.tree.map(
      lambda total, grad: total.astype(grad.dtype), accumulator, self.grads
    )
    if self.carrier == "zeros":
      # XLA folds zeros handed to a conditional into the branch that returns
      # them, which then no longer only forwards its operands. A barrier is
      # an op XLA:GPU does not inline into selects: the conditional stays.
      reduced = jax.lax.optimization_barrier(reduced)

    def step_inner(operands: dict[str, Any]) -> tuple[Any, Any, jax.Array]:
      params = operands["params"]
      # A state kept in host memory visits the device here, and only here.
      inner_state = memory_kinds.to_device(operands["inner_state"])
      new_updates, new_inner_state = zero.update(
        window.inner,
        window.inner_state_axes,
        reduced,
        inner_state,
        params,
        **self.extra_args,
      )
      # Gradients wider than the params (float32 for bfloat16, say) would
      # widen the optimizer's state; it keeps its dtypes from call to call.
      new_inner_state = memory_kinds.put(
        _with_dtypes_of(new_inner_state, inner_state), window.inner_state_home
      )
      if self.apply_to_params:
        new_updates = optax.apply_updates(params, new_updates)
      elif self.carrier == "accumulator":
        new_updates = jax.tree.map(
          lambda update, slot: update.astype(slot.dtype),
          new_updates,
          operands["accumulator"],
        )
      return new_updates, new_inner_state, jnp.asarray(True)

    if window.weights_are_global:
      return step_inner(operands)
    # Only here is the window's total weight known: a nested conditional,
    # whose open branch also only forwards operands, keeps an empty window
    # from stepping.
    has_weight = total_weight > 0
    return jax.lax.cond(
      has_weight,
      step_inner,
      self.keep_open,
      {**operands, "accumulator": accumulator, "not_stepped": has_weight},
    )

  def emitted_output(self, output: Any, stepped: jax.Array) -> Any:
    """The conditional's output as the caller sees it: zeros until a step."""
    if self.carrier not in ("accumulator", "grads"):
      return output
    return jax.tree.map(
      lambda carried, like: jnp.where(
        stepped, carried.astype(like.dtype), jnp.zeros((), like.dtype)
      ),
      output,
      self.updates_like,
    )


def _check_state(state: Any) -> AccumulateState:
  if not isinstance(state, AccumulateState):
    raise TypeError(
      "state must be the AccumulateState made by this transformation's"
      " init (or restored into its structure), got"
      f" {type(state).__name__}."
    )
  return state


def _all_finite(tree: Any, unreduced_axes: sharding.Axes) -> jax.Array:
  """Whether every leaf of ``tree`` is finite, on every device.

  Unreduced partial sums cannot be inspected elementwise; the sum of all
  their elements is reduced instead (a 4-byte all-reduce), which is
  non-finite whenever any element on any device is (or the elements sum
  beyond the float range).
  """
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.asarray(True)
  if unreduced_axes:
    total = sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in leaves)
    return jnp.isfinite(jax.reshard(total, PartitionSpec()))
  return jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]).all()


def _with_dtypes_of(tree: Any, like: Any) -> Any:
  """``tree`` with each array leaf cast to the dtype of its twin in ``like``."""
  return jax.tree.map(
    lambda leaf, twin: (
      jnp.asarray(leaf).astype(twin.dtype) if hasattr(twin, "dtype") else leaf
    ),
    tree,
    like,
  )


def _fits_exactly(updates_shape: Any, accumulator: Any) -> bool:
  """Whether every updates leaf round-trips exactly through its accumulator slot."""
  updates_tree: Any = jax.tree.structure(updates_shape)
  if updates_tree != jax.tree.structure(accumulator):
    return False
  return all(
    update.shape == slot.shape
    and jnp.promote_types(update.dtype, slot.dtype) == slot.dtype
    for update, slot in zip(
      jax.tree.leaves(updates_shape), jax.tree.leaves(accumulator), strict=True
    )
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


def make_window(
  optimizer: Any,
  every_k: Any,
  *,
  reduction: Any,
  accumulator_dtype: Any,
  skip_nonfinite: Any,
  axis_name: Any,
  unreduced_axes: Any,
  accumulator_memory_kind: Any = None,
  inner_state_memory_kind: Any = None,
  inner_state_axes: Any = None,
) -> Window:
  """Checks the arguments of :func:`accumulate`; returns its :class:`Window`."""
  if not isinstance(skip_nonfinite, bool):
    raise TypeError(f"skip_nonfinite must be a bool, got {skip_nonfinite!r}.")
  axis_name = validation.check_axis_name(axis_name)
  unreduced = () if unreduced_axes is None else unreduced_axes
  unreduced = sharding.as_axes(unreduced, "unreduced_axes") if unreduced else ()
  if axis_name is not None and unreduced:
    raise ValueError(
      "pass axis_name (inside jax.shard_map or pmap) or unreduced_axes"
      f" (under a plain jax.jit), not both; got axis_name={axis_name!r} and"
      f" unreduced_axes={unreduced!r}."
    )
  schedule = every_k_lib.as_schedule(every_k)
  accumulator_dtype = validation.check_accumulator_dtype(accumulator_dtype)
  # Points at the user's call of accumulate or accumulate_and_apply.
  precision.warn_if_accumulator_too_narrow(
    accumulator_dtype, every_k, stacklevel=3
  )
  return Window(
    inner=validation.check_optimizer(optimizer),
    schedule=schedule,
    reduction=validation.check_reduction(reduction),
    accumulator_dtype=accumulator_dtype,
    skip_nonfinite=skip_nonfinite,
    axis_name=()
    if axis_name is None
    else sharding.as_axes(axis_name, "axis_name"),
    unreduced_axes=unreduced,
    accumulator_memory_kind=memory_kinds.check_memory_kind(
      accumulator_memory_kind, "accumulator_memory_kind"
    ),
    inner_state_memory_kind=memory_kinds.check_memory_kind(
      inner_state_memory_kind, "inner_state_memory_kind"
    ),
    inner_state_axes=zero.check_inner_state_axes(inner_state_axes, unreduced),
  )


def compiled_step(
  window: Window, *, apply_to_params: bool
) -> Callable[..., tuple[Any, AccumulateState]]:
  """``window.update`` for one path, compiled once when called eagerly.

  Under a caller's ``jit`` it runs as written. Called eagerly, a concrete
  ``weight`` is checked first and passed as an array, so that micro-batches
  of different sizes share one compiled program.
  """
  step = eager.compiled_when_eager(
    functools.partial(window.update, apply_to_params=apply_to_params)
  )

  def checked_step(
    grads: Any,
    state: Any,
    params: Any,
    *,
    weight: Any,
    flush: Any,
    extra_args: dict[str, Any],
  ) -> tuple[Any, AccumulateState]:
    if not eager.is_traced((grads, state, params, weight, flush, extra_args)):
      # In the window's weight dtype: a Python int, a NumPy float and an
      # int32 array weight then share one compiled program.
      weight = jnp.asarray(validation.check_weight(weight), window.weight_dtype)
    return step(
      grads, state, params, weight=weight, flush=flush, extra_args=extra_args
    )

  return checked_step


def accumulate(
  optimizer: optax.GradientTransformation,
  every_k: every_k_lib.EveryK,
  *,
  reduction: str = "mean",
  accumulator_dtype: Any = jnp.float32,
  skip_nonfinite: bool = False,
  axis_name: Any = None,
  unreduced_axes: Any = None,
  accumulator_memory_kind: str | None = None,
  inner_state_memory_kind: str | None = None,
  inner_state_axes: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates gradients over ``every_k`` micro-steps, then steps ``optimizer``.

  Each ``update`` call adds ``weight * grads`` to an accumulator and returns
  zero updates, until the call that closes the window: that one reduces the
  accumulator (``sum(w_i g_i) / sum(w_i)`` for ``"mean"``, ``sum(w_i g_i)``
  for ``"sum"``), runs ``optimizer`` on it once, returns its updates and
  resets the window. With ``g_i`` the gradient of micro-batch ``i``'s mean
  loss and ``w_i`` its number of items, the emitted gradient is exactly the
  gradient of the large batch's mean loss.

  ``update`` takes, besides ``updates, state, params``:

  * ``weight``: a scalar >= 0 for this micro-batch (default 1), a Python
    number or an array of any integer or floating dtype, traced or not. A
    micro-step of weight 0 adds nothing, even where its gradient is NaN (the
    mean loss of an all-padding micro-batch); it counts toward k unless
    ``skip_nonfinite`` drops it. A concrete weight is checked; a traced one
    cannot be and is used as given, so a negative traced weight subtracts
    its micro-batch. A window whose weights sum to 0 or less emits zeros and
    does not step ``optimizer``.
  * ``flush``: a Python bool or boolean scalar; when true the window closes
    now, normalised by what it holds. A window that holds no weight emits
    zeros and does not step ``optimizer``.
  * any other keyword: forwarded to ``optimizer.update`` when the window
    closes (for example ``value=`` for ``optax.contrib.reduce_on_plateau``).

  Gradients may be wider or narrower than the params (float32 gradients of
  bfloat16 params, or the reverse, leaf by leaf): the updates come out with
  the dtypes ``optimizer`` gives for those gradients, and the state keeps
  its dtypes from call to call. Complex params get a complex accumulator.

  Under ``jax.vmap`` (several models trained side by side) the window's
  ``lax.cond`` gets a batched predicate and becomes a select: both branches
  run on every micro-step, so each micro-step pays for a full step of
  ``optimizer`` plus a select over its state and updates, as
  ``optax.MultiSteps`` always does. The results are unchanged, even for
  models whose windows are out of phase. Under ``jit``, ``pmap`` and
  ``jax.shard_map`` the predicate is a scalar and only one branch runs.
  Called outside ``jit``, ``update`` compiles once per shapes and dtypes.

  Args:
    optimizer: the optax transformation to apply once per window: a chain,
      a schedule, ``inject_hyperparams`` or an extra-args transformation.
    every_k: micro-steps per window: a positive int; a jittable callable
      mapping the applied-update count (int32 scalar) to k, where values
      below 1 act as 1; or a dict ``{update_step: k}`` with key 0, piecewise
      constant in the applied-update count.
    reduction: ``"mean"`` (weighted mean) or ``"sum"`` (weighted sum).
    accumulator_dtype: floating dtype of the accumulator, for example
      float32 accumulation of bfloat16 gradients.
    skip_nonfinite: drop a micro-step whose gradients hold NaN or Inf
      whole: not added, not counted toward k, and counted in
      ``num_skipped``. With ``axis_name`` or ``unreduced_axes`` the check is
      global (a scalar all-reduce per micro-step) so that every device drops
      the same micro-steps.
    axis_name: inside ``jax.shard_map`` or ``pmap``, the data-parallel axis.
      Micro-steps accumulate device-locally with no collective; the closing
      call sums accumulator and weights over the axis once.
    unreduced_axes: under a plain ``jax.jit`` with a batch sharded over
      Explicit mesh axes, those axes: ``init`` makes the accumulator
      ``unreduced`` over them (each parameter's sharding kept otherwise),
      ``update`` takes gradients unreduced over them (from
      :func:`ga_optax.unreduced_value_and_grad`) and adds them with no
      collective, and the closing call reduces the accumulator once, inside
      the branch that closes the window. ``weight`` is then the
      micro-batch's global weight. Checkpoint such a state mid-window
      through :func:`ga_optax.stack_partial_sums`.
    accumulator_memory_kind: a memory kind of the device to keep the
      accumulator in between calls, for example ``"pinned_host"`` (host
      memory), to free its bytes on the device; None (the default) leaves
      it in device memory. ``init`` (eager or under ``jit``) and every
      ``update`` leave its leaves there, each with its parameter's
      sharding; a micro-step brings it to the device only to add the
      gradient, and sends it back: it moves twice its bytes over the host
      link per micro-step (see docs/how-to/host-memory.md). The numbers are
      those of the accumulator in device memory, bit for bit. Works with
      ``axis_name`` and with ``unreduced_axes``. The state passed to
      ``update`` must be in the memory kinds that ``init`` gave it (restore
      a checkpoint onto ``tx.init(params)``'s shardings): a state donated to
      a jitted step in another memory kind would crash the process, so it
      is refused. Place sharded params on their devices before ``init``;
      the state's scalars follow them.
    inner_state_memory_kind: the same for ``optimizer``'s state (Adam's
      moments, say): it stays in that memory kind and visits the device
      only in the call that closes a window.
    inner_state_axes: with ``unreduced_axes``, mesh axes to shard
      ``optimizer``'s state over (ZeRO stage 1): ``init`` puts each state
      leaf sharded over them along its first dimension that no mesh axis
      shards yet and whose size their device count divides (as it is when
      none does); the closing call reduce-scatters the accumulator onto
      that sharding, steps ``optimizer`` on the slices and all-gathers the
      updates to each parameter's sharding. State memory and update
      arithmetic per device are divided by the axes' device count, for the
      traffic of one all-reduce. ``update`` then needs ``params``. A tree
      of ``PartitionSpec`` shaped like the params overrides the rule for
      each parameter's gradient and the state leaves that mirror it (see
      docs/how-to/sharded-optimizer-state.md).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`AccumulateState`.

  Raises:
    TypeError: ``optimizer`` is not a GradientTransformation, or
      ``every_k``, ``accumulator_dtype``, ``axis_name``,
      ``unreduced_axes`` or a memory kind has a wrong type.
    ValueError: ``every_k`` below 1, a bad ``every_k`` dict, an unknown
      ``reduction``, both ``axis_name`` and ``unreduced_axes``,
      ``inner_state_axes`` without ``unreduced_axes``, or a memory
      kind the device does not offer (the message lists those it does) or
      that ``jit`` cannot keep arrays in. ``init`` and ``update`` raise for
      axes that are not of the mesh kind their argument needs; ``update``
      raises for ``grads`` that do not match the state (tree, shapes,
      dtypes, or unreduced axes), for a state in other memory kinds than
      those it is kept in, and for a bad ``weight`` or ``flush``.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.accumulate(optax.sgd(0.1), every_k=2)
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.full(3, 1.0)}, state, params)
    >>> updates["w"], bool(ga_optax.emitted(state))
    (Array([0., 0., 0.], dtype=float32), False)
    >>> updates, state = tx.update({"w": jnp.full(3, 4.0)}, state, params)
    >>> updates["w"], bool(ga_optax.emitted(state))
    (Array([-0.25, -0.25, -0.25], dtype=float32), True)
  """
  window = make_window(
    optimizer,
    every_k,
    reduction=reduction,
    accumulator_dtype=accumulator_dtype,
    skip_nonfinite=skip_nonfinite,
    axis_name=axis_name,
    unreduced_axes=unreduced_axes,
    accumulator_memory_kind=accumulator_memory_kind,
    inner_state_memory_kind=inner_state_memory_kind,
    inner_state_axes=inner_state_axes,
  )
  step = compiled_step(window, apply_to_params=False)

  def update_fn(
    updates: optax.Updates,
    state: AccumulateState,
    params: optax.Params | None = None,
    *,
    weight: Any = 1,
    flush: Any = False,
    **extra_args: Any,
  ) -> tuple[optax.Updates, AccumulateState]:
    return step(
      updates, state, params, weight=weight, flush=flush, extra_args=extra_args
    )

  return optax.GradientTransformationExtraArgs(window.init, update_fn)


def emitted(state: Any) -> jax.Array:
  """Whether the last ``update`` call closed a window and applied an update.

  False on micro-steps that only accumulate, and on a flush of a window that
  held no weight (nothing is applied then).

  Args:
    state: an :class:`AccumulateState`, or any optimizer state that holds
      exactly one, for example that of an ``optax.chain``.

  Returns:
    A bool scalar array.

  Raises:
    ValueError: ``state`` holds no :class:`AccumulateState`, or several.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = optax.chain(optax.clip(1.0), ga_optax.accumulate(optax.sgd(1.0), 1))
    >>> params = jnp.zeros(2)
    >>> _, state = tx.update(jnp.ones(2), tx.init(params), params)
    >>> bool(ga_optax.emitted(state))
    True
  """
  # Flax NNX's Optimizer wraps state leaves in Variables: asarray returns
  # the plain array (a snapshot, not the live Variable).
  return jnp.asarray(find_state(state).emitted)


def find_state(state: Any) -> AccumulateState:
  """The one :class:`AccumulateState` inside an optimizer state.

  Raises:
    ValueError: ``state`` holds no ``AccumulateState``, or several.
  """
  found = [
    node
    for node in jax.tree.leaves(
      state, is_leaf=lambda node: isinstance(node, AccumulateState)
    )
    if isinstance(node, AccumulateState)
  ]
  if len(found) != 1:
    raise ValueError(
      "state must hold exactly one AccumulateState (the state of"
      f" ga_optax.accumulate), found {len(found)}."
    )
  return found[0]
