"""The train steps the benchmark compares, all jitted with donated state.

Every contender is ``step(params, state, batch) -> (params, state)`` where
``batch`` is a micro-batch (``per="micro-step"``), the whole window's batch
(``per="window"``) or, for the optimizer alone, fixed gradients. Params and
state are donated, as in a real training loop.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import ga_optax
from benchmarks.workloads import Workload

LEARNING_RATE = 1e-4


@dataclasses.dataclass(frozen=True)
class Contender:
  """One jitted train step and how to feed it.

  Attributes:
    name: row name in the tables.
    description: what one call does.
    step: jitted ``(params, state, batch) -> (params, state)``.
    init: ``params -> state``.
    feed: ``"micro"`` (one micro-batch per call, ``every_k`` calls per
      window), ``"window"`` (the window's batch, one call per window) or
      ``"grads"`` (fixed gradients, one optimizer step per call).
    closes_windows: whether the call at the end of a window differs from
      the others (accumulating contenders), so it is timed apart.
  """

  name: str
  description: str
  step: Callable[..., Any]
  init: Callable[[Any], Any]
  feed: str
  closes_windows: bool


def _jit(step: Callable[..., Any]) -> Callable[..., Any]:
  return jax.jit(step, donate_argnums=(0, 1))


def _transformation_step(loss_fn, tx):
  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def build(workload: Workload) -> list[Contender]:
  """All contenders for ``workload``; those the installed ga_optax lacks are
  left out (the micro-batched path, the fused path and the noise scale are
  optional here so that the script also measures older versions)."""
  loss_fn, k = workload.loss_fn, workload.every_k
  adam = optax.adam(LEARNING_RATE)
  contenders = [
    Contender(
      "plain Adam step",
      "gradient + Adam + apply_updates, every call",
      _jit(_transformation_step(loss_fn, adam)),
      adam.init,
      "micro",
      closes_windows=False,
    ),
    Contender(
      "optax.MultiSteps",
      "gradient + MultiSteps(Adam, k).update + apply_updates",
      _jit(_transformation_step(loss_fn, optax.MultiSteps(adam, k))),
      optax.MultiSteps(adam, k).init,
      "micro",
      closes_windows=True,
    ),
  ]
  accumulate = ga_optax.accumulate(adam, k)
  contenders.append(
    Contender(
      "ga_optax.accumulate",
      "gradient + accumulate(Adam, k).update + apply_updates",
      _jit(_transformation_step(loss_fn, accumulate)),
      accumulate.init,
      "micro",
      closes_windows=True,
    )
  )
  if "noise_scale_decay" in inspect.signature(ga_optax.accumulate).parameters:
    measured = ga_optax.accumulate(adam, k, noise_scale_decay=0.99)
    contenders.append(
      Contender(
        "ga_optax.accumulate + noise scale",
        "the above, measuring the gradient noise scale (noise_scale_decay)",
        _jit(_transformation_step(loss_fn, measured)),
        measured.init,
        "micro",
        closes_windows=True,
      )
    )
  if hasattr(ga_optax, "accumulate_and_apply"):
    fused = ga_optax.accumulate_and_apply(adam, k)

    def fused_step(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      return fused.apply(params, grads, state)

    contenders.append(
      Contender(
        "ga_optax.accumulate_and_apply",
        "gradient + fused accumulate-and-apply",
        _jit(fused_step),
        fused.init,
        "micro",
        closes_windows=True,
      )
    )
  if hasattr(ga_optax, "microbatched_value_and_grad"):
    value_and_grad = ga_optax.microbatched_value_and_grad(loss_fn, k)

    def microbatched_step(params, state, batch):
      _, grads = value_and_grad(params, batch)
      updates, state = adam.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    contenders.append(
      Contender(
        "ga_optax.microbatched_value_and_grad",
        "one lax.scan over k micro-batches + one Adam step, per window",
        _jit(microbatched_step),
        adam.init,
        "window",
        closes_windows=False,
      )
    )

  def gradient_step(params, previous_grads, batch):
    del previous_grads
    return params, jax.grad(loss_fn)(params, batch)

  def optimizer_step(params, state, grads):
    updates, state = adam.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def floor_accumulate(params, accumulator, batch):
    grads = jax.grad(loss_fn)(params, batch)
    return params, jax.tree.map(jnp.add, accumulator, grads)

  def floor_zero_updates(params, accumulator, batch):
    params, accumulator = floor_accumulate(params, accumulator, batch)
    # The barrier keeps XLA from folding `params + 0` away: the zero updates
    # are written and added, as a GradientTransformation micro-step must.
    zeros = jax.lax.optimization_barrier(optax.tree.zeros_like(params))
    return optax.apply_updates(params, zeros), accumulator

  def zeros_init(params):
    return optax.tree.zeros_like(params)

  contenders += [
    Contender(
      "floor: gradient + accumulate",
      "gradient + add into a donated accumulator",
      _jit(floor_accumulate),
      zeros_init,
      "micro",
      closes_windows=False,
    ),
    Contender(
      "floor: + write and apply zero updates",
      "the above + materialised zero updates added to the params",
      _jit(floor_zero_updates),
      zeros_init,
      "micro",
      closes_windows=False,
    ),
    Contender(
      "gradient only",
      "gradient of one micro-batch",
      _jit(gradient_step),
      zeros_init,
      "micro",
      closes_windows=False,
    ),
    Contender(
      "optimizer only",
      "Adam update + apply_updates on fixed gradients",
      _jit(optimizer_step),
      adam.init,
      "grads",
      closes_windows=False,
    ),
  ]
  return contenders
