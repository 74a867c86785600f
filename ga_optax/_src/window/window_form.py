"""Which form the window takes in the compiled program: chosen here, once.

On the device's schedule a micro-step adds its gradient outside any branch,
and the branches that close the window take one of two forms in the
compiled program:

* ``"loops"``: each branch is a loop of at most one trip
  (:func:`ga_optax._src.window.run_once.run_once_if`). XLA:GPU updates a
  loop's buffers in place, so a micro-step copies nothing; every platform
  but the CPU (GPUs, TPUs) runs this form.
* ``"conditional"``: each branch is a ``lax.cond``. XLA:CPU splits
  elementwise work over its cores in a conditional's branch but not inside a
  loop body, and its copy insertion copies nothing for a branch that
  forwards its operands. The one exception is the accumulator, which this
  form zeroes with a select after the branches: zeroed after the caller has
  read the updates out of its buffer, a branch that forwards it would be
  copied on every micro-step (XLA:CPU cannot order it after that read:
  :func:`ga_optax._src.window.run_once.emptied_if`), and zeros written by
  the closing branch itself got a buffer of their own, into which the other
  branch's accumulator was copied
  (:func:`ga_optax._src.window.run_once.emptied_in_branch`).

The host's schedule (``closing=``) has no branch between the sides. Its
closing program keeps one: the guard that keeps a window without weight
from stepping, a conditional in the conditional form and selects in the
loops form (:meth:`ga_optax._src.window.schedule.HostScheduled.branch`).

By default the platform decides, when the step is lowered
(``jax.lax.platform_dependent``): the CPU takes the conditional form, every
other platform the loops. The environment variable
``GA_OPTAX_WINDOW_FORM`` (``"loops"`` or ``"conditional"``) pins one form on
every platform, for the whole process: the tests set it to execute on the
CPU the program a GPU runs. It is read when a step is traced, so set it
before the first step is traced (a jitted step keeps the form it was
traced with).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax

# The variable that pins the form, and the forms it may name.
VARIABLE = "GA_OPTAX_WINDOW_FORM"
LOOPS = "loops"
CONDITIONAL = "conditional"
FORMS = (LOOPS, CONDITIONAL)


def pinned() -> str | None:
  """The form ``GA_OPTAX_WINDOW_FORM`` pins, or None to let the platform say.

  Raises:
    ValueError: the variable names no form.
  """
  form = os.environ.get(VARIABLE, "").strip().lower()
  if not form:
    return None
  if form not in FORMS:
    raise ValueError(
      f"{VARIABLE} must be one of {FORMS} or unset, got {form!r}."
    )
  return form


def form_for(platform: str) -> str:
  """The form of a step lowered for ``platform`` (``"cpu"``, ``"cuda"``...)."""
  pinned_form = pinned()
  if pinned_form is not None:
    return pinned_form
  return CONDITIONAL if platform == "cpu" else LOOPS


def choose(
  *operands: Any,
  loops: Callable[..., Any],
  conditional: Callable[..., Any],
) -> Any:
  """``loops(*operands)`` or ``conditional(*operands)``.

  The form pinned by ``GA_OPTAX_WINDOW_FORM``, or else the platform's: the
  conditional form on the CPU, the loops everywhere else.
  """
  form = pinned()
  if form == LOOPS:
    return loops(*operands)
  if form == CONDITIONAL:
    return conditional(*operands)
  return jax.lax.platform_dependent(*operands, cpu=conditional, default=loops)
