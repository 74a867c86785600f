"""Flax train states with accumulation: weighted updates, float8 state.

``flax.training.train_state.TrainState.apply_gradients`` calls ``tx.update``
with no keyword arguments, so it cannot pass a micro-batch's ``weight`` or a
``flush``; its ``step`` counts calls, which with accumulation are
micro-steps; and it writes a float8 model's new amax histories and scales
over the old ones on every call, micro-steps included. The helper here does
the first right and the last once per window (:mod:`ga_optax._src.algebra.fp8`),
without importing Flax, which stays an optional dependency.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from ga_optax._src.algebra import fp8, parts
from ga_optax._src.window.state import AccumulateState, find_state


def apply_gradients(
  state: Any, grads: Any, *, axis_name: Any = None, **update_kwargs: Any
) -> Any:
  """``TrainState.apply_gradients`` that forwards ``weight=``/``flush=``.

  Runs ``state.tx.update(grads, state.opt_state, state.params,
  **update_kwargs)``, applies the updates, and advances ``state.step`` by one:
  like Flax's method, ``step`` counts calls (micro-steps). Read the number
  of applied updates with :func:`applied_updates`.

  For a model with float8 state (Flax's fp8 ops keep amax histories and
  scales in the ``_overwrite_with_gradient`` collection, beside
  ``"params"``, and their "gradient" is their new value), the optimizer sees
  ``"params"`` only, as with Flax's ``TrainState``, and the float8 state
  follows the window: it stays at its window-start value during the window,
  so that every micro-batch quantises as the large batch would, and when a
  window closes with an update (full, or flushed) it becomes what one
  large-batch step makes it: the forward amax histories' elementwise max
  over the micro-batches, the output-gradient amax histories' max of each
  micro-batch's weighted by its share of the window (``w_i / W`` for
  ``reduction="mean"``), the scales of any micro-batch. It is never summed,
  averaged or given to the optimizer; a window that closes empty leaves it
  as it was, and a micro-step dropped by ``skip_nonfinite`` does not count.
  The window's running combination lives in the accumulation's state, so
  the optimizer state must be made for the whole variables:
  ``TrainState.create(apply_fn=..., params=variables, tx=tx).replace(
  opt_state=tx.init(variables))`` (Flax's ``create`` initialises ``tx`` with
  ``variables["params"]`` only). See docs/how-to/mixed-precision.md for
  what is exact.

  Args:
    state: a ``flax.training.train_state.TrainState`` (or a subclass, or any
      dataclass with ``step``, ``params``, ``tx``, ``opt_state`` and
      ``replace``) whose ``tx`` contains :func:`ga_optax.accumulate`.
    grads: gradients with the tree of ``state.params`` (for a model with
      float8 state, the gradient of the whole variables, the float8
      collection included).
    axis_name: inside ``jax.shard_map``, the data-parallel axes of
      ``accumulate(..., axis_name=...)``: a closing window's float8 state
      then combines every device's micro-batches (without it, each device
      keeps its own rows' amaxes). Unused without float8 state.
    **update_kwargs: passed to ``tx.update``: ``weight=`` (this micro-batch's
      weight, such as its token count), ``flush=``, or extra arguments of the
      wrapped optimizer.

  Returns:
    The state after this micro-step.

  Raises:
    TypeError: ``state`` lacks the fields of a TrainState.
    ValueError: ``grads`` hold the float8 collection and ``state.params``
      does not, or the optimizer state has no window for it (it was made
      for ``variables["params"]`` only), or one made for another state.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> from flax.training import train_state
    >>> state = train_state.TrainState.create(
    ...     apply_fn=None, params={"w": jnp.zeros(2)},
    ...     tx=ga_optax.accumulate(optax.sgd(1.0), 2))
    >>> state = ga_optax.apply_gradients(state, {"w": jnp.ones(2)}, weight=3)
    >>> state = ga_optax.apply_gradients(state, {"w": -jnp.ones(2)}, weight=1)
    >>> state.params["w"], int(state.step), int(ga_optax.applied_updates(state))
    (Array([-0.5, -0.5], dtype=float32), 2, 1)
  """
  missing = [
    field
    for field in ("step", "params", "tx", "opt_state", "replace")
    if not hasattr(state, field)
  ]
  if missing:
    raise TypeError(
      "state must be a flax TrainState (with step, params, tx, opt_state"
      f" and replace), got {type(state).__name__} without {missing}."
    )
  params, fp8_state = fp8.split_variables(state.params)
  variables_grads = grads
  grads, latest_fp8 = fp8.split_variables(grads)
  before = (
    None
    if latest_fp8 is None
    else _fp8_window_state(state, fp8_state, latest_fp8)
  )
  updates, opt_state = state.tx.update(
    grads, state.opt_state, params, **update_kwargs
  )
  if before is not None:
    window, fp8_state = _fp8_micro_step(
      before,
      find_state(opt_state),
      fp8.Fp8Part(fp8_state, before.fp8_window.reduction),
      variables_grads,
      update_kwargs.get("weight", 1),
      axis_name,
    )
    opt_state = _with_fp8_window(opt_state, window)
  return state.replace(
    step=state.step + 1,
    params=fp8.join_variables(
      state.params, optax.apply_updates(params, updates), fp8_state
    ),
    opt_state=opt_state,
  )


def _fp8_window_state(
  state: Any, fp8_state: Any, latest_fp8: Any
) -> AccumulateState:
  """The accumulation's state, checked to hold a window for the fp8 state."""
  collection = fp8.OVERWRITE_WITH_GRADIENT
  if fp8_state is None:
    raise ValueError(
      f"grads hold Flax's float8 state (the {collection!r} collection) but"
      " state.params does not: create the TrainState with the whole"
      " variables (params=variables), and differentiate them."
    )
  before = find_state(state.opt_state)
  if before.fp8_window is None:
    raise ValueError(
      f"grads hold Flax's float8 state (the {collection!r} collection) but"
      " the optimizer state has no window for it: TrainState.create"
      " initialises tx with variables['params'] only. Initialise it with"
      " the whole variables: state = TrainState.create(apply_fn=...,"
      " params=variables, tx=tx).replace(opt_state=tx.init(variables))."
    )
  fp8.check_like(
    before.fp8_window, latest_fp8, f"grads' {collection!r} collection"
  )
  return before


def _fp8_micro_step(
  before: AccumulateState,
  after: AccumulateState,
  part: fp8.Fp8Part,
  variables_grads: Any,
  weight: Any,
  axis_name: Any = None,
) -> tuple[fp8.Fp8Window, Any]:
  """One ``update`` call's effect on the float8 state, read off the window.

  Args:
    before: the accumulation's state before the call; its ``fp8_window``
      is the running combination.
    after: its state after the call.
    part: the float8 state's part, from the state at the start of the
      window (what the micro-batch computed with).
    variables_grads: the micro-batch's gradients of the variables, the
      float8 state's new values among them.
    weight: the call's ``weight=``.
    axis_name: inside ``jax.shard_map``, the data-parallel axes: the state
      a closing window leaves combines every device's micro-batches (a
      ``pmax`` of the combination, a few amax histories, and a ``psum`` of
      the weight, on every call).

  Returns:
    ``(window, fp8_state)``: the running combination to keep in the state,
    and the float8 state after the call: the large batch's new state when
    the call closed a window that applied an update, the window-start state
    otherwise (a micro-step, or a window that closed empty).
  """
  # A micro-step dropped by skip_nonfinite is counted in num_skipped (which
  # saturates only after 2**31 - 1 drops).
  accepted = after.num_skipped == before.num_skipped
  weight = jnp.where(accepted, jnp.asarray(weight, before.weight_sum.dtype), 0)
  window = fp8.restarted(before.fp8_window, before.micro_step == 0)
  micro_batch = parts.MicroBatch.whole(variables_grads, weight, accepted)
  window = part.add(window, micro_batch)
  weight_sum = before.weight_sum + weight
  everywhere = window
  if axis_name is not None:
    everywhere = parts.across_axes(window, part.combine, axis_name)
    weight_sum = jax.lax.psum(weight_sum, axis_name)
  closed = part.close(everywhere, parts.Closing(None, weight_sum))
  fp8_state = jax.tree.map(
    lambda new, old: jnp.where(after.emitted, new, old), closed, part.start
  )
  return window, fp8_state


def _with_fp8_window(opt_state: Any, window: fp8.Fp8Window) -> Any:
  """``opt_state`` with its :class:`AccumulateState`'s window replaced."""

  def is_state(node: Any) -> bool:
    return isinstance(node, AccumulateState)

  return jax.tree.map(
    lambda node: node._replace(fp8_window=window) if is_state(node) else node,
    opt_state,
    is_leaf=is_state,
  )
