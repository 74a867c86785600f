"""The control flow a traced step holds, for the tests of the window's form."""

from __future__ import annotations

from typing import Any

from jax.extend import core as jax_core


def window_primitives(jaxpr: Any) -> list[str]:
  """The ``while`` and ``cond`` equations of ``jaxpr``, nested ones too."""
  names = []
  for equation in jaxpr.eqns:
    if equation.primitive.name in ("while", "cond"):
      names.append(equation.primitive.name)
    for sub in jax_core.jaxprs_in_params(equation.params):
      names += window_primitives(sub)
  return names
