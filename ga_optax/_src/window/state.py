"""The state of an accumulation, and the readers users call on it.

:class:`AccumulateState` is what :func:`ga_optax.accumulate` and
:func:`ga_optax.accumulate_and_apply` keep: a plain pytree that jits,
donates, shards and checkpoints like any optax state. Each reader below
takes any optimizer state holding exactly one (an ``optax.chain``'s, a Flax
``TrainState``, an NNX ``Optimizer``'s) and returns one scalar array.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ga_optax._src import validation
from ga_optax._src.algebra.noise_scale import (
  NoiseScale,
  NoiseScaleAverages,
  WindowNoise,
  read,
)


class AccumulateState(NamedTuple):
  """State of :func:`ga_optax.accumulate`: a plain pytree to jit and checkpoint.

  Attributes:
    micro_step: int32, micro-steps held by the open window (0 right after a
      window closes).
    update_step: int32, updates the inner optimizer has applied; the
      argument of a callable or dict ``every_k`` (read it with
      :func:`ga_optax.applied_updates`).
    every_k: int32, the k of the open window, decided when the previous
      window closed (read it with :func:`ga_optax.current_k`). With
      :func:`ga_optax.batch_size.adaptive_k` the windows so far decided it; with
      a schedule the schedule does: a state resumed under another ``every_k``
      closes its windows by the new one from its next call, and holds the
      new k from the next window on.
    num_skipped: int32, non-finite micro-steps dropped by
      ``skip_nonfinite=True`` over the whole run (read it with
      :func:`ga_optax.num_skipped`).
    emitted: bool, whether the last ``update`` call ran the inner optimizer
      (read it with :func:`ga_optax.emitted`).
    weight_sum: sum of the weights of the micro-steps in the open window.
    accumulator: sum of ``weight * grads`` over the open window, in
      ``accumulator_dtype`` (complex leaves in the complex dtype of that
      precision), with the tree of the params. Every close leaves it at
      zero, in either schedule (``closing=``), and every micro-step adds to
      it (a checkpoint of 0.2.0, whose boundary states held the last
      window's sums there, carries over as the page "Checkpointing"
      shows). With
      ``unreduced_axes`` its leaves are ``unreduced`` over those mesh axes:
      each device holds its own partial sum. With
      ``accumulator_memory_kind`` its leaves live in that memory kind.
    inner_state: the wrapped optimizer's state, in
      ``inner_state_memory_kind`` when one is given.
    parts: what the window sums beside the gradient, one value per part:
      with ``noise_scale_decay``, the open window's sums for the gradient
      noise scale and the averages over closed windows (a
      :class:`~ga_optax._src.algebra.noise_scale.WindowNoise`; read them
      with :func:`ga_optax.noise_scale`), then, for a Flax model with
      float8 state, the window's running combination of its micro-batches'
      new float8 state and the state the model computes with (a
      :class:`~ga_optax._src.algebra.fp8.Fp8InWindow`, None for any other
      model; see :func:`ga_optax.apply_gradients`). Parts with nothing to
      hold have no leaves and cost nothing.
  """

  micro_step: jax.Array
  update_step: jax.Array
  every_k: jax.Array
  num_skipped: jax.Array
  emitted: jax.Array
  weight_sum: jax.Array
  accumulator: optax.Updates
  inner_state: optax.OptState
  parts: tuple[Any, ...] = ()


def check_state(state: Any) -> AccumulateState:
  """``state`` itself, once checked to be an :class:`AccumulateState`.

  Raises:
    TypeError: it is not one.
  """
  if not isinstance(state, AccumulateState):
    raise TypeError(
      "state must be the AccumulateState made by this transformation's"
      " init (or restored into its structure), got"
      f" {type(state).__name__}."
    )
  return state


def find_state(state: Any) -> AccumulateState:
  """The one :class:`AccumulateState` inside an optimizer state.

  Raises:
    ValueError: ``state`` holds no ``AccumulateState``, or several.
  """
  return validation.find_one(state, AccumulateState, "ga_optax.accumulate")


def emitted(state: Any) -> jax.Array:
  """Whether the last ``update`` call closed a window and applied an update.

  False on micro-steps that only accumulate, and on a flush of a window that
  held no weight (nothing is applied then).

  True whenever the wrapped optimizer ran, whatever it decided: a window
  that :func:`ga_optax.mixed_precision.dynamic_loss_scale` drops (float16
  overflow) emits zero updates with ``emitted`` True, and counts in
  :func:`ga_optax.applied_updates`, as PyTorch's loop counter moves on past a
  skipped ``scaler.step``; schedules of k move on with it. The wrapped
  optimizer decides the drop where ``accumulate`` cannot see it:
  :func:`ga_optax.mixed_precision.dropped_windows` counts those windows.

  Args:
    state: an :class:`AccumulateState`, or any optimizer state that holds
      exactly one, for example that of an ``optax.chain``.

  Returns:
    A bool scalar array.

  Raises:
    ValueError: ``state`` holds no :class:`AccumulateState`, or several.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = optax.chain(
    ...     optax.clip(1.0), ga_optax.accumulate(optax.sgd(1.0), 1))
    >>> params = jnp.zeros(2)
    >>> _, state = tx.update(jnp.ones(2), tx.init(params), params)
    >>> bool(ga_optax.emitted(state))
    True
  """
  # Flax NNX's Optimizer wraps state leaves in Variables: asarray returns
  # the plain array (a snapshot, not the live Variable).
  return jnp.asarray(find_state(state).emitted)


def applied_updates(state: Any) -> jax.Array:
  """The number of updates the wrapped optimizer has applied.

  A train state's ``step`` (Flax ``TrainState.step``, or the count of an NNX
  ``Optimizer``) counts ``update`` calls, that is micro-steps; this counts
  closed windows, the steps of a large-batch run. A window that a wrapped
  :func:`ga_optax.mixed_precision.dynamic_loss_scale` drops counts here too (see
  :func:`ga_optax.emitted`).

  Args:
    state: an :class:`AccumulateState`, or any optimizer state that holds
      exactly one: a ``TrainState``, its ``opt_state``, an NNX
      ``Optimizer``'s ``opt_state``, or the state of an ``optax.chain``.

  Returns:
    An int32 scalar array.

  Raises:
    ValueError: ``state`` holds no ``AccumulateState``, or several.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.accumulate(optax.sgd(0.1), 2)
    >>> params = jnp.zeros(3)
    >>> state = tx.init(params)
    >>> for _ in range(5):
    ...   _, state = tx.update(jnp.ones(3), state, params)
    >>> int(ga_optax.applied_updates(state))
    2
  """
  return jnp.asarray(find_state(state).update_step)


def current_k(state: Any) -> jax.Array:
  """The k of the open window: micro-steps it holds when it closes by count.

  Decided when the previous window closed: by the schedule of ``every_k``
  (an int, a callable or a dict of the applied-update count), or by the
  noise scale with :func:`ga_optax.batch_size.adaptive_k`.

  Args:
    state: an :class:`AccumulateState`, or any optimizer state that holds
      exactly one.

  Returns:
    An int32 scalar array.

  Raises:
    ValueError: ``state`` holds no ``AccumulateState``, or several.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.accumulate(optax.sgd(0.1), {0: 2, 1: 3})
    >>> params = jnp.zeros(3)
    >>> state = tx.init(params)
    >>> int(ga_optax.current_k(state))
    2
    >>> for _ in range(2):
    ...   _, state = tx.update(jnp.ones(3), state, params)
    >>> int(ga_optax.current_k(state))  # one update applied: k is 3
    3
  """
  return jnp.asarray(find_state(state).every_k)


def num_skipped(state: Any) -> jax.Array:
  """The number of non-finite micro-steps ``skip_nonfinite=True`` dropped.

  Args:
    state: an :class:`AccumulateState`, or any optimizer state that holds
      exactly one.

  Returns:
    An int32 scalar array, counted over the whole run.

  Raises:
    ValueError: ``state`` holds no ``AccumulateState``, or several.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.accumulate(optax.sgd(0.1), 2, skip_nonfinite=True)
    >>> params = jnp.zeros(3)
    >>> _, state = tx.update(jnp.full(3, jnp.nan), tx.init(params), params)
    >>> int(ga_optax.num_skipped(state)), int(ga_optax.applied_updates(state))
    (1, 0)
  """
  return jnp.asarray(find_state(state).num_skipped)


def noise_scale(state: Any) -> NoiseScale:
  """The gradient noise scale from ``accumulate(..., noise_scale_decay=...)``.

  ``b_simple`` estimates the critical batch size, in the unit of the
  weights (items; micro-batches at the default weight 1): far below it, a
  larger batch cuts the steps to a given loss nearly in proportion; far
  above it, the extra items are wasted (see docs/how-to/batch-size.md).

  Args:
    state: an :class:`AccumulateState` made with ``noise_scale_decay``, any
      optimizer state that holds exactly one, or the averages kept by
      :func:`ga_optax.smooth_noise_scale`.

  Returns:
    A :class:`ga_optax.NoiseScale` of plain scalar arrays (also from an
    NNX ``Optimizer``'s state, whose leaves NNX wraps in Variables): NaN
    until a window of at least 2 micro-gradients has closed.

  Raises:
    ValueError: the state holds no ``AccumulateState`` (or several), or
      was made without ``noise_scale_decay``.

  Example:
    >>> import jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.accumulate(optax.sgd(0.0), 2, noise_scale_decay=0.5)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> for grad in ([1.0, 1.0], [3.0, 1.0]):
    ...   _, state = tx.update(jnp.array(grad), state, params)
    >>> estimate = ga_optax.noise_scale(state)
    >>> float(estimate.trace_sigma), float(estimate.grad_sq)
    (2.0, 4.0)
  """
  if isinstance(state, NoiseScaleAverages):
    averages = state
  else:
    found = [
      part for part in find_state(state).parts if isinstance(part, WindowNoise)
    ]
    if not found:
      raise ValueError(
        "state holds no noise scale: pass noise_scale_decay to"
        " ga_optax.accumulate (for example noise_scale_decay=0.99) to"
        " measure it."
      )
    averages = found[0].smoothed
  # Field by field: a Variable is a pytree node, so jax.tree.map would map
  # the array inside it and hand the Variable back.
  return read(NoiseScaleAverages(*(jnp.asarray(field) for field in averages)))
