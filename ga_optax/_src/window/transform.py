"""``accumulate`` and ``accumulate_and_apply``: arguments resolved to a window.

Both functions take the same arguments, check them the same way and keep
the same state; they differ only in what a call returns (updates, or new
params). :func:`ga_optax._src.window.arguments.resolve` turns the
arguments into a :class:`~ga_optax._src.window.window.Window`, and
:func:`emitting_updates` or :func:`applying_to_params` turns that into what
the caller holds: a window with one more part
(``dataclasses.replace(window, parts=...)``) becomes a transformation so,
with no edit here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax.numpy as jnp
import optax

from ga_optax._src.batch_size import every_k as every_k_lib
from ga_optax._src.window import arguments
from ga_optax._src.window.output import ApplyToParams, EmitUpdates
from ga_optax._src.window.state import AccumulateState
from ga_optax._src.window.window import Window


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
  noise_scale_decay: float | None = None,
  lr_scaling: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates gradients of ``every_k`` micro-steps, then steps ``optimizer``.

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
    ``skip_nonfinite`` drops it. Negative weights have one rule here and in
    :func:`ga_optax.microbatched_value_and_grad`'s ``weight_fn``: a
    concrete one is a ``ValueError``; a traced one cannot be seen and is
    used as given, so it subtracts its micro-batch (traced weights 1, -1
    and 3 on gradients g1, g2, g3 emit ``(g1 - g2 + 3 g3) / 3``). A window
    whose weights sum to 0 or less emits zeros and does not step
    ``optimizer``.
  * ``flush``: a Python bool or boolean scalar; when true the window closes
    now, normalised by what it holds. A window that holds no weight emits
    zeros and does not step ``optimizer``.
  * ``closing``: who chooses the side of the window this call runs. None
    (the default): the device, from its count of micro-steps and ``flush``.
    A Python bool: the host, which in a Python training loop knows its
    micro-step; ``True`` closes the window with what it holds (as a flush
    does), ``False`` keeps it open (past its k if the host says so), and
    the compiled program holds that side alone, with no ``while`` or
    ``conditional`` (mark it static under ``jax.jit``). Not with ``flush``.
    Every close, in either schedule, leaves the accumulator at zero, so a
    run may switch schedules at any call (docs/how-to/host-schedule.md).
  * ``fp8_state``: for a Flax model with float8 state, the micro-batch's
    new float8 state (the gradient of its ``_overwrite_with_gradient``
    collection); :func:`ga_optax.apply_gradients` passes it. The window
    combines it as one large batch would, and the state holds the result
    (docs/how-to/mixed-precision.md).
  * any other keyword: forwarded to ``optimizer.update`` when the window
    closes (for example ``value=`` for ``optax.contrib.reduce_on_plateau``).

  Gradients may be wider or narrower than the params (float32 gradients of
  bfloat16 params, or the reverse, leaf by leaf): the updates come out with
  the dtypes ``optimizer`` gives for those gradients, and the state keeps
  its dtypes from call to call. Complex params get a complex accumulator.

  The gradient is added before any branch. On the device's schedule each
  branch that closes the window is a loop of at most one trip, which
  XLA:GPU compiles without copying the optimizer state (see
  docs/compiled-window.md). Under ``jax.vmap`` (several models trained side
  by side) a loop gets a batched predicate and runs while any model needs
  it, selecting per model: a micro-step then pays for a full step of
  ``optimizer`` whenever one model's window closes. The results are
  unchanged, even for models whose windows are out of phase. Under ``jit``,
  ``pmap`` and ``jax.shard_map`` the predicate is a scalar and only one side
  runs. ``update`` can be differentiated in both modes, under ``jit``
  too: a side's derivative is that of the same side written as a
  ``lax.cond`` (a ``lax.while_loop`` has no reverse mode), and a step that
  is not differentiated keeps its loops. Called outside ``jit``,
  ``update`` compiles once per shapes and dtypes.

  Args:
    optimizer: the optax transformation to apply once per window: a chain,
      a schedule, ``inject_hyperparams`` or an extra-args transformation.
    every_k: micro-steps per window: a positive int; a jittable callable
      mapping the applied-update count (int32 scalar) to k, where values
      below 1 act as 1; a dict ``{update_step: k}`` with key 0, piecewise
      constant in the applied-update count; or
      :func:`ga_optax.batch_size.adaptive_k`, a k that follows the measured
      noise scale (needs ``noise_scale_decay``). Each window's k is decided when
      the previous one closes and kept in the state
      (:func:`ga_optax.current_k`).
    reduction: ``"mean"`` (weighted mean) or ``"sum"`` (weighted sum).
    accumulator_dtype: floating dtype of the accumulator, for example
      float32 accumulation of bfloat16 gradients.
    skip_nonfinite: drop a micro-step whose gradients hold NaN or Inf
      whole: not added, not counted toward k, and counted in
      ``num_skipped``. ``init`` refuses it around
      :func:`ga_optax.mixed_precision.dynamic_loss_scale`, which must see the
      overflows to back its scale off. With ``axis_name`` or ``unreduced_axes``
      the check is global (a scalar all-reduce per micro-step) so that every
      device drops the same micro-steps.
    axis_name: the data-parallel axes, as everywhere in ga_optax: the
      axes the batch's rows are split over, each device holding its own.
      Here they must be manual, that is the step runs inside
      ``jax.shard_map`` or ``pmap`` over them: micro-steps accumulate
      device-locally with no collective, and the closing call sums
      accumulator and weights over the axes once. (Under a plain
      ``jax.jit`` the partial sums live in the accumulator's type instead:
      ``unreduced_axes``.)
    unreduced_axes: under a plain ``jax.jit`` with a batch sharded over
      Explicit mesh axes, those axes: ``init`` makes the accumulator
      ``unreduced`` over them (each parameter's sharding kept otherwise),
      ``update`` takes gradients unreduced over them (from
      :func:`ga_optax.unreduced_value_and_grad`) and adds them with no
      collective, and the closing call reduces the accumulator once, inside
      the side that closes the window. ``weight`` is then the
      micro-batch's global weight. Checkpoint such a state mid-window
      through :func:`ga_optax.planning.stack_partial_sums`.
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
      arithmetic per device are divided by the axes' device count; for an
      optimizer that works elementwise (Adam, Lion, SGD, RMSProp) that
      costs the traffic of one all-reduce, while one that needs whole
      matrices (``optax.contrib.muon``) gathers them and costs more.
      ``update`` then needs ``params``. A tree of ``PartitionSpec`` shaped
      like the params overrides the rule for each parameter's gradient and
      the state leaves that mirror it (see
      docs/how-to/sharded-optimizer-state.md).
    noise_scale_decay: None (the default) measures nothing and costs
      nothing. A number in [0, 1) measures the gradient noise scale from
      each window's micro-gradients (those of positive weight; skipped
      ones do not count), smooths the per-window estimates with that
      decay (0 keeps the last window's) and keeps them in the state for
      :func:`ga_optax.noise_scale` to read. A micro-step adds one squared
      norm on its device; a closing call adds one scalar reduction. With
      ``axis_name`` each device's gradient is a micro-gradient of its own
      weight (with ``check_vma=True``, where autodiff has already summed
      the gradients over the devices, the micro-step's gradient is one, of
      the micro-step's weight: pass the total over the devices there);
      with ``unreduced_axes`` each device's partial sum is taken as one, of
      an equal share of the micro-step's weight. Needs
      ``reduction="mean"``.
    lr_scaling: None (the default) leaves the wrapped optimizer's updates
      as they are; ``"sqrt"`` multiplies them by ``sqrt(k / k0)`` and
      ``"linear"`` by ``k / k0``, where k is the closing window's and k0
      the first window's (the rules that pair a batch change with Adam's
      and SGD's learning rate; see docs/how-to/batch-size.md).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is an
    :class:`AccumulateState`.

  Raises:
    TypeError: ``optimizer`` is not a GradientTransformation, or
      ``every_k``, ``accumulator_dtype``, ``axis_name``,
      ``unreduced_axes`` or a memory kind has a wrong type.
    ValueError: ``every_k`` below 1, a bad ``every_k`` dict,
      :func:`ga_optax.batch_size.adaptive_k` without ``noise_scale_decay``, an
      unknown ``reduction`` or ``lr_scaling``, both ``axis_name`` and
      ``unreduced_axes``, ``inner_state_axes`` without ``unreduced_axes``, or a
      memory kind the device does not offer (the message lists those it does) or
      that ``jit`` cannot keep arrays in. ``init`` and ``update`` raise for
      axes that are not of the mesh kind their argument needs; ``init``
      raises for ``skip_nonfinite=True`` around
      :func:`ga_optax.mixed_precision.dynamic_loss_scale`; ``update``
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
  window = arguments.resolve(
    optimizer,
    every_k,
    EmitUpdates(),
    reduction=reduction,
    accumulator_dtype=accumulator_dtype,
    skip_nonfinite=skip_nonfinite,
    axis_name=axis_name,
    unreduced_axes=unreduced_axes,
    accumulator_memory_kind=accumulator_memory_kind,
    inner_state_memory_kind=inner_state_memory_kind,
    inner_state_axes=inner_state_axes,
    noise_scale_decay=noise_scale_decay,
    lr_scaling=lr_scaling,
  )
  return emitting_updates(window)


def emitting_updates(window: Window) -> optax.GradientTransformationExtraArgs:
  """The transformation of ``window``, whose output strategy emits updates."""
  step = arguments.compiled_step(window)

  def update_fn(
    updates: optax.Updates,
    state: AccumulateState,
    params: optax.Params | None = None,
    *,
    weight: Any = 1,
    flush: Any = False,
    closing: bool | None = None,
    fp8_state: Any = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, AccumulateState]:
    return step(
      updates,
      state,
      params,
      weight=weight,
      flush=flush,
      closing=closing,
      fp8_state=fp8_state,
      extra_args=extra_args,
    )

  return optax.GradientTransformationExtraArgs(
    arguments.initializer(window), update_fn
  )


class FusedApplyFn(Protocol):
  """Signature of :attr:`FusedAccumulation.apply`."""

  def __call__(
    self,
    params: optax.Params,
    grads: optax.Updates,
    state: AccumulateState,
    *,
    weight: Any = 1,
    flush: Any = False,
    closing: bool | None = None,
    fp8_state: Any = None,
    **extra_args: Any,
  ) -> tuple[optax.Params, AccumulateState]: ...


class FusedAccumulation(NamedTuple):
  """What :func:`accumulate_and_apply` returns.

  Attributes:
    init: ``params -> AccumulateState``, the same state that
      :func:`ga_optax.accumulate` keeps.
    apply: ``(params, grads, state, *, weight=1, flush=False,
      closing=None, fp8_state=None, **extra_args) -> (new_params,
      new_state)``; the params
      change only on the call that closes a window.
  """

  init: Callable[[optax.Params], AccumulateState]
  apply: FusedApplyFn


def accumulate_and_apply(
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
  noise_scale_decay: float | None = None,
  lr_scaling: str | None = None,
) -> FusedAccumulation:
  """Gradient accumulation that updates the params itself, in one call.

  ``apply(params, grads, state)`` equals ``updates, state = tx.update(grads,
  state, params)`` followed by ``optax.apply_updates(params, updates)`` with
  ``tx = ga_optax.accumulate(optimizer, every_k, ...)`` (same arguments, same
  state, same ``weight=``, ``flush=``, ``closing=`` and extra keyword
  arguments), but the
  params are updated by the side of the window that runs ``optimizer``: a
  micro-step that does not close the window leaves the params untouched (in
  place when they are donated to ``jax.jit``) instead of adding zero updates
  to them.

  Prefer it to ``accumulate`` in a hand-written train step that owns its
  params (memory-bound models, where reading and writing the params is a
  large share of a micro-step). Keep ``accumulate`` where a
  ``GradientTransformation`` is required: inside ``optax.chain``, with
  Flax ``TrainState.apply_gradients`` or ``nnx.Optimizer``.

  Args:
    optimizer: the optax transformation to apply once per window.
    every_k: micro-steps per window, as for :func:`ga_optax.accumulate`.
    reduction: ``"mean"`` (weighted mean) or ``"sum"`` (weighted sum).
    accumulator_dtype: floating dtype of the accumulator.
    skip_nonfinite: drop micro-steps whose gradients hold NaN or Inf.
    axis_name: the data-parallel axes, manual inside ``jax.shard_map`` or
      ``pmap``, as for :func:`ga_optax.accumulate`.
    unreduced_axes: under a plain ``jax.jit``, the Explicit mesh axes the
      gradients are unreduced over, as for :func:`ga_optax.accumulate`.
    accumulator_memory_kind: a memory kind to keep the accumulator in
      between calls, for example ``"pinned_host"``, as for
      :func:`ga_optax.accumulate`: each call brings it to the device only to
      add the gradient.
    inner_state_memory_kind: a memory kind to keep ``optimizer``'s state
      in; it visits the device only in the call that closes a window.
    inner_state_axes: with ``unreduced_axes``, the mesh axes (or a tree of
      specs) to shard ``optimizer``'s state over, as for
      :func:`ga_optax.accumulate`.
    noise_scale_decay: measure the gradient noise scale, as for
      :func:`ga_optax.accumulate`.
    lr_scaling: scale the updates with k, as for :func:`ga_optax.accumulate`.

  Returns:
    A :class:`FusedAccumulation` ``(init, apply)``.

  Raises:
    TypeError, ValueError: as :func:`ga_optax.accumulate`, for the same
      arguments.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> fused = ga_optax.accumulate_and_apply(optax.sgd(0.1), every_k=2)
    >>> params = {"w": jnp.ones(3)}
    >>> state = fused.init(params)
    >>> params, state = fused.apply(params, {"w": jnp.full(3, 1.0)}, state)
    >>> params["w"]
    Array([1., 1., 1.], dtype=float32)
    >>> params, state = fused.apply(params, {"w": jnp.full(3, 4.0)}, state)
    >>> params["w"], bool(ga_optax.emitted(state))
    (Array([0.75, 0.75, 0.75], dtype=float32), True)
  """
  window = arguments.resolve(
    optimizer,
    every_k,
    ApplyToParams(),
    reduction=reduction,
    accumulator_dtype=accumulator_dtype,
    skip_nonfinite=skip_nonfinite,
    axis_name=axis_name,
    unreduced_axes=unreduced_axes,
    accumulator_memory_kind=accumulator_memory_kind,
    inner_state_memory_kind=inner_state_memory_kind,
    inner_state_axes=inner_state_axes,
    noise_scale_decay=noise_scale_decay,
    lr_scaling=lr_scaling,
  )
  return applying_to_params(window)


def applying_to_params(window: Window) -> FusedAccumulation:
  """The fused accumulation of ``window``, whose output applies to params."""
  step = arguments.compiled_step(window)

  def apply_fn(
    params: optax.Params,
    grads: optax.Updates,
    state: AccumulateState,
    *,
    weight: Any = 1,
    flush: Any = False,
    closing: bool | None = None,
    fp8_state: Any = None,
    **extra_args: Any,
  ) -> tuple[optax.Params, AccumulateState]:
    return step(
      grads,
      state,
      params,
      weight=weight,
      flush=flush,
      closing=closing,
      fp8_state=fp8_state,
      extra_args=extra_args,
    )

  return FusedAccumulation(init=arguments.initializer(window), apply=apply_fn)
