"""Flax train states with accumulation: weighted updates, float8 state.

``flax.training.train_state.TrainState.apply_gradients`` calls ``tx.update``
with no keyword arguments, so it cannot pass a micro-batch's ``weight`` or a
``flush``; its ``step`` counts calls, which with accumulation are
micro-steps; and it writes a float8 model's new amax histories and scales
over the old ones on every call, micro-steps included. The helper here
forwards the keywords, and hands a float8 model's new state to the window,
whose float8 part combines it as one large batch would
(:mod:`ga_optax._src.algebra.fp8`); it imports no Flax, which stays an
optional dependency.
"""

from __future__ import annotations

from typing import Any

import optax

from ga_optax._src.algebra import fp8
from ga_optax._src.window.state import find_state


def apply_gradients(state: Any, grads: Any, **update_kwargs: Any) -> Any:
  """``TrainState.apply_gradients`` that forwards ``weight=``/``flush=``.

  Runs ``state.tx.update(grads, state.opt_state, state.params,
  **update_kwargs)``, applies the updates, and advances ``state.step`` by one:
  like Flax's method, ``step`` counts calls (micro-steps). Read the number
  of applied updates with :func:`applied_updates`.

  For a model with float8 state (Flax's fp8 ops keep amax histories and
  scales in the ``_overwrite_with_gradient`` collection, beside
  ``"params"``, and their "gradient" is their new value), the optimizer sees
  ``"params"`` only, as with Flax's ``TrainState``, and the new float8 state
  goes to the window (``update(..., fp8_state=...)``), which follows it as
  it follows the gradients: the state stays at its window-start value
  during the window, so that every micro-batch quantises as the large batch
  would, and when a window closes with an update (full, or flushed) it
  becomes what one large-batch step makes it: the forward amax histories'
  elementwise max over the micro-batches, the output-gradient amax
  histories' max of each micro-batch's weighted by its share of the window
  (``w_i / W`` for ``reduction="mean"``), the scales of any micro-batch.
  It is never summed, averaged or given to the optimizer; a window that
  closes empty leaves it as it was, and a micro-step dropped by
  ``skip_nonfinite`` does not count. Inside ``jax.shard_map`` with
  ``accumulate(..., axis_name=...)`` a closing window combines every
  device's micro-batches, as it reduces their gradients. The window's
  running combination lives in the accumulation's state, so the optimizer
  state must be made for the whole variables: ``TrainState.create(
  apply_fn=..., params=variables, tx=tx).replace(opt_state=
  tx.init(variables))`` (Flax's ``create`` initialises ``tx`` with
  ``variables["params"]`` only). See docs/how-to/mixed-precision.md for
  what is exact.

  Args:
    state: a ``flax.training.train_state.TrainState`` (or a subclass, or any
      dataclass with ``step``, ``params``, ``tx``, ``opt_state`` and
      ``replace``) whose ``tx`` contains :func:`ga_optax.accumulate`.
    grads: gradients with the tree of ``state.params`` (for a model with
      float8 state, the gradient of the whole variables, the float8
      collection included).
    **update_kwargs: passed to ``tx.update``: ``weight=`` (this micro-batch's
      weight, such as its token count), ``flush=``, ``closing=``, or extra
      arguments of the wrapped optimizer.

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
  grads, latest = fp8.split_variables(grads)
  if latest is not None:
    if fp8_state is None:
      raise ValueError(
        "grads hold Flax's float8 state (the"
        f" {fp8.OVERWRITE_WITH_GRADIENT!r} collection) but state.params does"
        " not: create the TrainState with the whole variables"
        " (params=variables), and differentiate them."
      )
    update_kwargs["fp8_state"] = latest
  updates, opt_state = state.tx.update(
    grads, state.opt_state, params, **update_kwargs
  )
  if latest is not None:
    fp8_state = _fp8_in_window(opt_state).state
  return state.replace(
    step=state.step + 1,
    params=fp8.join_variables(
      state.params, optax.apply_updates(params, updates), fp8_state
    ),
    opt_state=opt_state,
  )


def _fp8_in_window(opt_state: Any) -> fp8.Fp8InWindow:
  """The float8 part's value in the accumulation's state."""
  (found,) = [
    part
    for part in find_state(opt_state).parts
    if isinstance(part, fp8.Fp8InWindow)
  ]
  return found
