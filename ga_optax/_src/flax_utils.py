"""Flax train states with accumulation: weighted updates.

``flax.training.train_state.TrainState.apply_gradients`` calls ``tx.update``
with no keyword arguments, so it cannot pass a micro-batch's ``weight`` or a
``flush``; and its ``step`` counts calls, which with accumulation are
micro-steps. The helpers here work on any such state (and on NNX optimizer
states) without importing Flax, which stays an optional dependency.
"""

from __future__ import annotations

from typing import Any

import optax


def apply_gradients(state: Any, grads: Any, **update_kwargs: Any) -> Any:
  """``TrainState.apply_gradients`` that forwards ``weight=``/``flush=``.

  Runs ``state.tx.update(grads, state.opt_state, state.params,
  **update_kwargs)``, applies the updates, and advances ``state.step`` by one:
  like Flax's method, ``step`` counts calls (micro-steps). Read the number
  of applied updates with :func:`applied_updates`.

  Args:
    state: a ``flax.training.train_state.TrainState`` (or a subclass, or any
      dataclass with ``step``, ``params``, ``tx``, ``opt_state`` and
      ``replace``) whose ``tx`` contains :func:`ga_optax.accumulate`.
    grads: gradients with the tree of ``state.params``.
    **update_kwargs: passed to ``tx.update``: ``weight=`` (this micro-batch's
      weight, such as its token count), ``flush=``, or extra arguments of the
      wrapped optimizer.

  Returns:
    The state after this micro-step.

  Raises:
    TypeError: ``state`` lacks the fields of a TrainState.

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
  updates, opt_state = state.tx.update(
    grads, state.opt_state, state.params, **update_kwargs
  )
  return state.replace(
    step=state.step + 1,
    params=optax.apply_updates(state.params, updates),
    opt_state=opt_state,
  )
