"""The emulation of what XLA:GPU does to conditionals, on any backend.

XLA:GPU replaces a two-branch conditional of cheap ops by selects that run
both branches, unless one branch only forwards its operands.
:func:`ga_optax.testing.gpu_conditional_audit` emulates that on the CPU, for
users whose own steps hold conditionals and who have no CUDA plugin to
compile with XLA:GPU itself (ga_optax's window has no conditional: see
tests/test_gpu_program.py, which compiles it with XLA:GPU). A deliberately
bad conditional shows that the emulation can fail; the others that it keeps
what survives.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest

from ga_optax import testing
from ga_optax._src.audits import gpu_conditionals

SHAPES = {"w": (32, 16), "b": (16,), "scale": (16,)}


def params_of(dtype: Any = jnp.float32) -> dict[str, jax.Array]:
  return {
    name: jnp.linspace(-1.0, 1.0, num=int(jnp.prod(jnp.asarray(shape))))
    .reshape(shape)
    .astype(dtype)
    for name, shape in SHAPES.items()
  }


def audited(lowered: jax.stages.Lowered) -> testing.ConditionalAudit:
  try:
    return testing.gpu_conditional_audit(lowered)
  except testing.EmulationUnavailable as error:
    pytest.skip(str(error))


def test_a_forwarding_branch_beside_an_adam_branch_survives():
  optimizer = optax.adam(1e-3)
  params = params_of()

  def good_step(closes, grads, state):
    return jax.lax.cond(
      closes,
      lambda grads, state: optimizer.update(grads, state, params),
      lambda grads, state: (grads, state),
      grads,
      state,
    )

  args = (jnp.asarray(True), params, optimizer.init(params))
  assert gpu_conditionals.forwarding_branches(
    jax.make_jaxpr(good_step)(*args)
  ) == [True]
  audit = audited(jax.jit(good_step).lower(*args))
  assert audit == testing.ConditionalAudit(compiled=1, as_on_gpu=1, rewritten=1)


def test_a_zeros_branch_beside_an_adam_branch_is_reported_lost():
  """The control: the emulation catches what the GPU would do."""
  optimizer = optax.adam(1e-3)
  params = params_of()

  def bad_step(closes, grads, state):
    return jax.lax.cond(
      closes,
      lambda grads, state: optimizer.update(grads, state, params),
      lambda grads, state: (jax.tree.map(jnp.zeros_like, grads), state),
      grads,
      state,
    )

  args = (jnp.asarray(True), params, optimizer.init(params))
  assert gpu_conditionals.forwarding_branches(
    jax.make_jaxpr(bad_step)(*args)
  ) == [False]
  audit = audited(jax.jit(bad_step).lower(*args))
  assert audit == testing.ConditionalAudit(compiled=1, as_on_gpu=0, rewritten=1)


def test_a_switch_of_three_branches_is_not_rewritten():
  def switch(index, x):
    return jax.lax.switch(index, [jnp.sin, jnp.cos, jnp.tanh], x)

  audit = audited(jax.jit(switch).lower(jnp.int32(1), jnp.ones(4)))
  assert audit.rewritten == 0
  assert audit.as_on_gpu == audit.compiled


def test_nested_conditionals_are_rewritten_inside_out():
  def nested(outer, inner, x):
    return jax.lax.cond(
      outer,
      lambda x: jax.lax.cond(inner, lambda x: x * 2.0, lambda x: x, x),
      lambda x: x,
      x,
    )

  audit = audited(
    jax.jit(nested).lower(jnp.asarray(True), jnp.asarray(False), jnp.ones(3))
  )
  assert audit.rewritten == 2
  assert audit.compiled == audit.as_on_gpu == 2


def test_the_rewrite_swaps_the_branches_and_keeps_the_numbers():
  def pick(flag, x):
    return jax.lax.cond(flag, lambda x: x + 1.0, lambda x: x, x)

  lowered = jax.jit(pick).lower(jnp.asarray(True), jnp.ones(3))
  text, count = gpu_conditionals.rewrite_to_predicates(lowered.as_text())
  assert count == 1
  assert '"stablehlo.if"' in text and '"stablehlo.case"' not in text
  true_branch = text.index("stablehlo.add")
  assert true_branch < text.index('"stablehlo.if"') + 200


def test_audit_rejects_what_is_not_lowered():
  with pytest.raises(TypeError, match="lowered"):
    testing.gpu_conditional_audit(lambda x: x)
