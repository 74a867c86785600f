"""The train steps the benchmark compares, all jitted with donated state.

Every contender is ``step(params, state, batch) -> (params, state)`` where
``batch`` is a micro-batch (``per="micro-step"``), the whole window's batch
(``per="window"``) or, for the optimizer alone, fixed gradients. Params and
state are donated, as in a real training loop.

:func:`build` gives ``benchmarks/run.py``'s contenders, one program each;
:func:`window_contenders` gives whole windows whose calls may each run a
program of their own (the host-scheduled window), for the run book.
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
from benchmarks import cond_window, host_scheduled, state_carrying
from benchmarks.workloads import Workload

LEARNING_RATE = 1e-4
HOST_SCHEDULED = "host-scheduled window"
# The host's schedule written by hand with the state a transformation
# carries (benchmarks/state_carrying.py): what ga_optax's host-scheduled
# window is held to.
STATE_CARRYING = "state-carrying reference (by hand)"
# The same with as many leaves as ga_optax's state has beyond it: the cost
# of a leaf on the host, alone.
EXTRA_SCALARS = 4
STATE_CARRYING_PADDED = (
  f"state-carrying reference, {EXTRA_SCALARS} more scalars"
)
ACCUMULATE_HOST = "ga_optax.accumulate, host-scheduled"
FUSED_HOST = "ga_optax.accumulate_and_apply, host-scheduled"


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
    closing_step: the program the host runs on a window's last call, where
      the host chooses it (``closing=True``, or the state-carrying
      reference's ``close``); None where ``step`` serves every call. Its
      compiled memory is the one reported.
  """

  name: str
  description: str
  step: Callable[..., Any]
  init: Callable[[Any], Any]
  feed: str
  closes_windows: bool
  closing_step: Callable[..., Any] | None = None


def _jit(step: Callable[..., Any]) -> Callable[..., Any]:
  return jax.jit(step, donate_argnums=(0, 1))


def _transformation_step(loss_fn, tx, **options):
  """A train step of ``tx``; ``options`` (``closing=``) go to its update."""

  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, **options)
    return optax.apply_updates(params, updates), state

  return step


def _host_chosen(make_step, k):
  """A window's ``k`` calls: ``k - 1`` micro-steps, then the closing step.

  Two programs, each without control flow; the host picks one by the
  call's index in the window.
  """
  keep_open, close = _jit(make_step(False)), _jit(make_step(True))
  return (keep_open,) * (k - 1) + (close,)


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
  contenders += host_chosen_contenders(workload, adam)
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


def host_chosen_contenders(
  workload: Workload, adam: optax.GradientTransformation
) -> list[Contender]:
  """The host's schedule: ga_optax's two windows on it (``closing=``), and
  the state-carrying reference written by hand; each call's program chosen
  by the host, ``closing_step`` on a window's last call. Left out where the
  installed ga_optax has no ``closing=``."""
  loss_fn, k = workload.loss_fn, workload.every_k
  reference = state_carrying.state_carrying_window(loss_fn, adam)
  contenders = [
    Contender(
      STATE_CARRYING,
      "gradient + add into the carried sums; the closing call: mean, Adam,"
      " apply, sums cleared",
      _jit(reference.keep_open),
      reference.init,
      "micro",
      closes_windows=True,
      closing_step=_jit(reference.close),
    )
  ]
  accumulate = ga_optax.accumulate(adam, k)
  if "closing" not in inspect.signature(accumulate.update).parameters:
    return contenders
  fused = ga_optax.accumulate_and_apply(adam, k)

  def fused_step(closing):
    def step(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      return fused.apply(params, grads, state, closing=closing)

    return step

  def accumulate_step(closing):
    return _transformation_step(loss_fn, accumulate, closing=closing)

  for name, make_step, init in (
    (ACCUMULATE_HOST, accumulate_step, accumulate.init),
    (FUSED_HOST, fused_step, fused.init),
  ):
    contenders.append(
      Contender(
        name,
        "the host chooses: closing=False, then closing=True on the last call",
        _jit(make_step(False)),
        init,
        "micro",
        closes_windows=True,
        closing_step=_jit(make_step(True)),
      )
    )
  return contenders


@dataclasses.dataclass(frozen=True)
class WindowContender:
  """A window of ``every_k`` calls, and the program each call runs.

  Attributes:
    name: row name in the tables.
    description: what a window does.
    init: ``params -> state``.
    calls: one callable per micro-step of the window, in order, each
      ``(params, state, batch) -> (params, state)`` with params and state
      donated; most contenders run one program for all of them.
  """

  name: str
  description: str
  init: Callable[[Any], Any]
  calls: tuple[Callable[..., Any], ...]


def _jit_with(options: dict[str, str] | None) -> Callable[..., Any]:
  def jit(step: Callable[..., Any]) -> Callable[..., Any]:
    return jax.jit(step, donate_argnums=(0, 1), compiler_options=options)

  return jit


def _host_scheduled_calls(
  window: host_scheduled.HostScheduledWindow,
) -> tuple[Callable[..., Any], ...]:
  """The window's calls over ``(opt_state, sums)``: the host picks each
  call's program from its index alone."""

  def call(index: int) -> Callable[..., Any]:
    def run(params, state, batch):
      opt_state, sums = state
      params, opt_state, sums, _ = host_scheduled.scheduled_step(
        window, index, params, opt_state, sums, batch
      )
      return params, (opt_state, sums)

    return run

  return tuple(call(index) for index in range(window.every_k))


def window_contenders(
  workload: Workload, gpu_options: dict[str, str] | None
) -> list[WindowContender]:
  """The forms of one window: plain Adam, ``optax.MultiSteps``, ga_optax's
  default form, the same under ``gpu_options`` (the GPU recipe, left out
  where None), both on the host's schedule (``closing=``), the same work by
  hand carrying a transformation's state (``benchmarks/state_carrying.py``;
  again with as many more scalars as ga_optax's state holds beyond it) and
  keeping none between windows (``benchmarks/host_scheduled.py``), and
  the one-``lax.cond`` window.

  Adam's learning rate is :data:`LEARNING_RATE` throughout; each window
  adds ``every_k`` micro-batches of weight 1.
  """
  loss_fn, k = workload.loss_fn, workload.every_k
  adam = optax.adam(LEARNING_RATE)
  plain = _jit(_transformation_step(loss_fn, adam))
  multi_steps = optax.MultiSteps(adam, k)
  accumulate = ga_optax.accumulate(adam, k)
  fused = ga_optax.accumulate_and_apply(adam, k)

  def fused_step(params, state, batch):
    return fused.apply(params, jax.grad(loss_fn)(params, batch), state)

  forms = {"": None}
  if gpu_options is not None:
    forms[", GPU recipe"] = gpu_options
  contenders = [
    WindowContender(
      "plain Adam", "k Adam steps, one per micro-batch", adam.init, (plain,) * k
    ),
    WindowContender(
      "optax.MultiSteps",
      "MultiSteps(Adam, k): the optimizer runs on every call",
      multi_steps.init,
      (_jit(_transformation_step(loss_fn, multi_steps)),) * k,
    ),
  ]
  for suffix, options in forms.items():
    jit = _jit_with(options)
    contenders += [
      WindowContender(
        f"ga_optax.accumulate{suffix}",
        "accumulate(Adam, k).update + apply_updates",
        accumulate.init,
        (jit(_transformation_step(loss_fn, accumulate)),) * k,
      ),
      WindowContender(
        f"ga_optax.accumulate_and_apply{suffix}",
        "the fused path",
        fused.init,
        (jit(fused_step),) * k,
      ),
    ]

  def fused_host_step(closing):
    def step(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      return fused.apply(params, grads, state, closing=closing)

    return step

  contenders += [
    WindowContender(
      "ga_optax.accumulate, host-scheduled",
      "update(..., closing=i == k - 1): two programs, chosen by the host",
      accumulate.init,
      _host_chosen(
        lambda closing: _transformation_step(
          loss_fn, accumulate, closing=closing
        ),
        k,
      ),
    ),
    WindowContender(
      "ga_optax.accumulate_and_apply, host-scheduled",
      "apply(..., closing=i == k - 1): two programs, chosen by the host",
      fused.init,
      _host_chosen(fused_host_step, k),
    ),
  ]
  window = host_scheduled.host_scheduled_window(loss_fn, adam, k)
  reference = state_carrying.state_carrying_window(loss_fn, adam)
  padded = state_carrying.with_scalars(reference, EXTRA_SCALARS)
  cond_init, cond_step = cond_window.cond_window(loss_fn, adam, k)
  return [
    *contenders,
    WindowContender(
      STATE_CARRYING,
      "the host's schedule by hand, carrying the sums, weight and count",
      reference.init,
      _host_chosen(
        lambda closing: reference.close if closing else reference.keep_open, k
      ),
    ),
    WindowContender(
      STATE_CARRYING_PADDED,
      f"the same, its state {EXTRA_SCALARS} scalar leaves longer",
      padded.init,
      _host_chosen(
        lambda closing: padded.close if closing else padded.keep_open, k
      ),
    ),
    WindowContender(
      HOST_SCHEDULED,
      "k - 1 micro-steps and a closing step, chosen by the host",
      lambda params: (adam.init(params), None),
      _host_scheduled_calls(window),
    ),
    WindowContender(
      "conditional window (one lax.cond)",
      "the gradient added outside, one lax.cond to step Adam",
      cond_init,
      (_jit(cond_step),) * k,
    ),
  ]
