"""A host-scheduled window written by hand that carries a state between calls.

``benchmarks/host_scheduled.py`` is the floor of a window: it keeps no
accumulator between windows (the first micro-step writes the sums) and no
counter. A transformation cannot do that: ``update`` is called with the
state it returned, so the state must hold the accumulator, the window's
weight and a count from call to call, and a close must leave them cleared
for the next window. This is that state, written by hand, with the least
work the host's schedule (``update(..., closing=...)``) has to do:

* ``keep_open``: the micro-batch's gradient, weighted, added into the
  donated accumulator; the weight added into the weight sum; the count
  moved on. The params are handed back untouched.
* ``close``: the same add, then the sum divided by the weight sum, one
  step of the wrapped optimizer, the updates applied to the donated params,
  and the accumulator, weight sum and count cleared.

The host chooses which of the two jitted programs runs. Neither guards a
window without weight (the divide is by its weight sum, whatever it is).

:func:`with_scalars` adds scalars the reference carries and barely
touches: the same window with more leaves in its state, which prices a
leaf's share of each call's dispatch on the host.

``benchmarks/run.py`` times ``ga_optax``'s host-scheduled window as a ratio
to this one, and ``tests/test_host_overhead.py`` holds ga_optax's compiled
programs to its launches and copies.

Example::

  reference = state_carrying_window(loss_fn, optax.adam(1e-3))
  state = reference.init(params)
  for index, batch in enumerate(batches):
    step = reference.close if index % k == k - 1 else reference.keep_open
    params, state = step(params, state, batch)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

LossFn = Callable[[Any, Any], jax.Array]
Step = Callable[..., tuple[optax.Params, "ReferenceState"]]


class ReferenceState(NamedTuple):
  """What the window carries from call to call.

  Attributes:
    accumulator: ``sum_i w_i g_i`` over the open window, float32.
    weight_sum: ``sum_i w_i``, a float32 scalar.
    count: int32, micro-steps held by the open window.
    inner_state: the wrapped optimizer's state.
  """

  accumulator: optax.Updates
  weight_sum: jax.Array
  count: jax.Array
  inner_state: optax.OptState


class StateCarryingWindow(NamedTuple):
  """The window's init and its two programs, not jitted.

  Attributes:
    init: ``params -> ReferenceState``.
    keep_open: ``(params, state, batch, weight=1.0) -> (params, state)``.
    close: ``(params, state, batch, weight=1.0) -> (params, state)``.
  """

  init: Callable[[optax.Params], ReferenceState]
  keep_open: Step
  close: Step


def state_carrying_window(
  loss_fn: LossFn, optimizer: optax.GradientTransformation
) -> StateCarryingWindow:
  """The state-carrying window of ``optimizer`` on ``loss_fn``.

  Args:
    loss_fn: ``(params, batch) -> scalar``, the mean loss over a batch.
    optimizer: the optimizer that steps once per window.

  Returns:
    A :class:`StateCarryingWindow`; jit its programs with params and state
    donated (``donate_argnums=(0, 1)``).
  """

  def init(params: optax.Params) -> ReferenceState:
    return ReferenceState(
      accumulator=jax.tree.map(
        lambda param: jnp.zeros(param.shape, jnp.float32), params
      ),
      weight_sum=jnp.zeros((), jnp.float32),
      count=jnp.zeros((), jnp.int32),
      inner_state=optimizer.init(params),
    )

  def added(
    params: optax.Params, state: ReferenceState, batch: Any, weight: Any
  ) -> ReferenceState:
    grads = jax.grad(loss_fn)(params, batch)
    weight = jnp.asarray(weight, jnp.float32)
    accumulator = jax.tree.map(
      lambda total, grad: total + weight * grad.astype(jnp.float32),
      state.accumulator,
      grads,
    )
    return state._replace(
      accumulator=accumulator,
      weight_sum=state.weight_sum + weight,
      count=state.count + 1,
    )

  def keep_open(
    params: optax.Params, state: ReferenceState, batch: Any, weight: Any = 1.0
  ) -> tuple[optax.Params, ReferenceState]:
    return params, added(params, state, batch, weight)

  def close(
    params: optax.Params, state: ReferenceState, batch: Any, weight: Any = 1.0
  ) -> tuple[optax.Params, ReferenceState]:
    state = added(params, state, batch, weight)
    scale = 1.0 / state.weight_sum
    mean = jax.tree.map(
      lambda total, param: (total * scale).astype(param.dtype),
      state.accumulator,
      params,
    )
    updates, inner_state = optimizer.update(mean, state.inner_state, params)
    cleared = ReferenceState(
      accumulator=jax.tree.map(jnp.zeros_like, state.accumulator),
      weight_sum=jnp.zeros_like(state.weight_sum),
      count=jnp.zeros_like(state.count),
      inner_state=inner_state,
    )
    return optax.apply_updates(params, updates), cleared

  return StateCarryingWindow(init, keep_open, close)


def with_scalars(
  window: StateCarryingWindow, count: int
) -> StateCarryingWindow:
  """``window`` carrying ``count`` more int32 scalars beside its state.

  The first counts the calls; the others are handed back as they came. The
  device does next to nothing more, so what the window takes beyond
  ``window``'s is what ``count`` more leaves, each an argument and a result,
  cost each call on the host.
  """
  if count < 1:
    raise ValueError(f"count must be at least 1, got {count}")

  def init(params: optax.Params) -> tuple[Any, ...]:
    scalars = tuple(jnp.zeros((), jnp.int32) for _ in range(count))
    return (window.init(params), *scalars)

  def carrying(step: Step) -> Callable[..., tuple[optax.Params, Any]]:
    def run(params, state, batch, weight=1.0):
      inner, calls, *others = state
      params, inner = step(params, inner, batch, weight)
      return params, (inner, calls + 1, *others)

    return run

  return StateCarryingWindow(
    init, carrying(window.keep_open), carrying(window.close)
  )
