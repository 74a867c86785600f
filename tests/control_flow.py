"""The control flow a traced step holds, and a window that has none.

For the tests of the window's form, and for the compiled-program audits'
planted control: the window a compiler would make of a conditional turned
into selects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jax_core

from ga_optax._src import scopes


def window_primitives(jaxpr: Any) -> list[str]:
  """The ``while`` and ``cond`` equations of ``jaxpr``, nested ones too.

  A ``cond`` on the platform (``lax.platform_dependent``) is left out: it
  is resolved when the step is lowered for one platform, and no control
  flow compiles from it.
  """
  names = []
  on_platform = set()
  for equation in jaxpr.eqns:
    if equation.primitive.name == "platform_index":
      on_platform.update(map(id, equation.outvars))
    platform_cond = (
      equation.primitive.name == "cond"
      and id(equation.invars[0]) in on_platform
    )
    if equation.primitive.name in ("while", "cond") and not platform_cond:
      names.append(equation.primitive.name)
    for sub in jax_core.jaxprs_in_params(equation.params):
      names += window_primitives(sub)
  return names


def window_of_selects(
  optimizer: optax.GradientTransformation,
  gradient: Callable[[Any, Any], Any],
  closes: Callable[[Any], jax.Array],
) -> Callable[..., Any]:
  """A step whose window's sides became selects: the control of the audits.

  The optimizer runs on every call, inside the scope of the window's
  closing side, and a select keeps its result only where ``closes(batch)``
  holds: what a compiler makes of a conditional whose branches are all cheap
  operations (optax.MultiSteps' shape). The closing work then sits on the
  micro-step's path, where an audit must find it.
  """

  def step(params: Any, inner_state: Any, batch: Any) -> Any:
    grads = gradient(params, batch)
    keep = closes(batch)
    with jax.named_scope(scopes.CLOSE_WINDOW):
      updates, stepped = optimizer.update(grads, inner_state, params)
    updates = jax.tree.map(lambda update: jnp.where(keep, update, 0.0), updates)
    inner_state = jax.tree.map(
      lambda new, old: jnp.where(keep, new, old), stepped, inner_state
    )
    return optax.apply_updates(params, updates), inner_state

  return step
