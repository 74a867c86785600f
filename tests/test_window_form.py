"""The window's two forms: chosen in one place, both exact, both differentiable.

``GA_OPTAX_WINDOW_FORM`` pins the form a step is traced with (see
ga_optax/_src/window/window_form.py); CI runs the equivalence tests a second time
with it set to ``"loops"``, so that the CPU executes the program a GPU runs.
This module checks the choice itself, what each form lowers to, the loop
bodies' predicates, and reverse-mode derivatives through a window against
the same derivative of the large-batch step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from control_flow import window_primitives
from jax.extend import core as jax_core

import ga_optax
from ga_optax._src.window import window_form

FORMS = (window_form.LOOPS, window_form.CONDITIONAL)


@pytest.fixture(params=FORMS)
def form(request, monkeypatch) -> Iterator[str]:
  """Each form in turn, pinned for the steps the test traces."""
  monkeypatch.setenv(window_form.VARIABLE, request.param)
  yield request.param


def test_the_variable_pins_a_form_or_leaves_the_platform_to_choose(
  monkeypatch,
):
  monkeypatch.delenv(window_form.VARIABLE, raising=False)
  assert window_form.pinned() is None
  monkeypatch.setenv(window_form.VARIABLE, " Loops ")
  assert window_form.pinned() == "loops"
  monkeypatch.setenv(window_form.VARIABLE, "selects")
  with pytest.raises(ValueError, match="GA_OPTAX_WINDOW_FORM"):
    window_form.pinned()


def sgd_step_jaxpr() -> Any:
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  return jax.make_jaxpr(lambda grads, state: tx.update(grads, state, params))(
    params, state
  ).jaxpr


def test_a_pinned_form_is_the_only_one_traced(form):
  primitives = window_primitives(sgd_step_jaxpr())
  # The add is outside any branch. The closing side, the optimizer's step
  # inside it (taken where the window holds weight), and the accumulator
  # zeroed once the updates it carried out are read: each a loop of at most
  # one trip, or a conditional, but that last a select in the conditional
  # form (a branch made XLA:CPU copy the accumulator on every micro-step).
  if form == window_form.LOOPS:
    assert primitives == ["while", "while", "while"]
  else:
    assert primitives == ["cond", "cond"]


def test_unpinned_the_step_holds_both_forms(monkeypatch):
  monkeypatch.delenv(window_form.VARIABLE, raising=False)
  primitives = window_primitives(sgd_step_jaxpr())
  # lax.platform_dependent traces both, and the platform's lowering keeps one.
  assert "while" in primitives and "cond" in primitives


def loop_predicates(jaxpr: Any) -> Iterator[Any]:
  """What each loop's body hands back as the next trip's predicate."""
  for equation in jaxpr.eqns:
    if equation.primitive.name == "while":
      yield equation.params["body_jaxpr"].jaxpr.outvars[0]
    for sub in jax_core.jaxprs_in_params(equation.params):
      yield from loop_predicates(sub)


def test_each_loop_runs_at_most_once(monkeypatch):
  # A body that does not hand back a constant false would run its side
  # again and again: on a GPU the step would hang.
  monkeypatch.setenv(window_form.VARIABLE, window_form.LOOPS)
  predicates = list(loop_predicates(sgd_step_jaxpr()))
  assert len(predicates) == 3
  for predicate in predicates:
    assert isinstance(predicate, jax_core.Literal)
    assert predicate.val is False or predicate.val == np.False_


# Reverse mode: a meta-gradient through whole windows, under jit.

MICRO_BATCHES = 6  # two windows of 3
K = 3


def data() -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(0)
  inputs = rng.normal(size=(MICRO_BATCHES, 4, 3)).astype(np.float32)
  targets = rng.normal(size=(MICRO_BATCHES, 4)).astype(np.float32)
  return inputs, targets


def loss_fn(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
  return jnp.mean((inputs @ params["w"] + params["b"] - targets) ** 2)


def initial_params() -> dict[str, jax.Array]:
  return {"w": jnp.array([0.3, -0.2, 0.1]), "b": jnp.array(0.05)}


def final_loss(params: Any) -> jax.Array:
  inputs, targets = data()
  return loss_fn(params, inputs.reshape(-1, 3), targets.reshape(-1))


def accumulated_run(
  learning_rate: jax.Array, make: Callable[..., Any], fused: bool = False
) -> jax.Array:
  """The loss after two windows, as a function of the rate: of
  ``accumulate``, or of ``accumulate_and_apply`` (``fused``), whose closing
  side returns new params."""
  optimizer = make(learning_rate)
  if fused:
    tx = ga_optax.accumulate_and_apply(optimizer, K)
  else:
    tx = ga_optax.accumulate(optimizer, K)
  params = initial_params()
  state = tx.init(params)
  inputs, targets = data()
  for index in range(MICRO_BATCHES):
    grads = jax.grad(loss_fn)(params, inputs[index], targets[index])
    if fused:
      params, state = tx.apply(params, grads, state)
    else:
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
  return final_loss(params)


def large_batch_run(
  learning_rate: jax.Array, make: Callable[..., Any]
) -> jax.Array:
  """The same two steps of the bare optimizer, on the concatenated batches."""
  tx = make(learning_rate)
  params = initial_params()
  state = tx.init(params)
  inputs, targets = data()
  for window in range(MICRO_BATCHES // K):
    rows = slice(window * K, (window + 1) * K)
    grads = jax.grad(loss_fn)(
      params, inputs[rows].reshape(-1, 3), targets[rows].reshape(-1)
    )
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return final_loss(params)


OPTIMIZERS = {
  "sgd_momentum": lambda lr: optax.sgd(lr, momentum=0.9),
  "adam": lambda lr: optax.adam(lr),
  "clip_adamw": lambda lr: optax.chain(
    optax.clip_by_global_norm(0.5), optax.adamw(lr, weight_decay=0.1)
  ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_reverse_mode_through_windows_under_jit(form, name):
  make = OPTIMIZERS[name]
  learning_rate = jnp.asarray(0.05)
  derivative = jax.jit(jax.grad(lambda lr: accumulated_run(lr, make)))(
    learning_rate
  )
  expected = jax.grad(lambda lr: large_batch_run(lr, make))(learning_rate)
  assert np.isfinite(derivative) and np.isfinite(expected)
  assert abs(float(expected)) > 1e-3  # a derivative worth comparing
  np.testing.assert_allclose(derivative, expected, rtol=2e-5, atol=1e-7)


def test_reverse_mode_through_the_fused_path(form):
  learning_rate = jnp.asarray(0.05)
  derivative = jax.jit(
    jax.grad(lambda lr: accumulated_run(lr, optax.adam, fused=True))
  )(learning_rate)
  expected = jax.grad(lambda lr: large_batch_run(lr, optax.adam))(learning_rate)
  assert np.isfinite(derivative)
  np.testing.assert_allclose(derivative, expected, rtol=2e-5, atol=1e-7)


def test_an_undifferentiated_step_keeps_its_loops(monkeypatch):
  # The derivative rule is the conditional's; the primal stays the loops.
  monkeypatch.setenv(window_form.VARIABLE, window_form.LOOPS)
  tx = ga_optax.accumulate(optax.adam(1e-2), 2)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)

  def step(grads: Any, state: Any) -> Any:
    return tx.update(grads, state, params)

  lowered = jax.jit(step).lower(params, state).as_text()
  assert lowered.count("stablehlo.while") == 3
  assert "stablehlo.case" not in lowered and "stablehlo.if" not in lowered
