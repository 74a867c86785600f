"""Calls outside jit compile once per shapes and dtypes, and match jit.

Users debug without ``jit`` and notebooks call ``update`` eagerly. A
``lax.cond`` or ``lax.scan`` built from fresh closures on every call would
compile a new program every time; the library compiles the whole call once
instead. Compilations are counted with ``jax.monitoring``: JAX records one
backend-compile event per program it compiles, from ``jit`` and from
op-by-op dispatch alike.

Op-by-op dispatch caches its small programs for the whole process, so what a
first call compiles besides its own program depends on what ran before it.
Each test therefore warms those caches with a twin transformation first;
then a fresh transformation's first call compiles exactly one program (its
own), and no later call with the same shapes and dtypes compiles anything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ga_optax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

EVERY_K = 3
NUM_CALLS = 6  # two windows: calls 3 and 6 close one
# Weights of one dtype and varying values: none may recompile.
WEIGHTS = (1.0, 2.5, 3.0, 4.0, 1.0, 0.5)


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
  """Collects the name of every program compiled inside the block."""
  names: list[str] = []

  def listener(event: str, duration: float, **kwargs: Any) -> None:
    del duration
    if event == BACKEND_COMPILE_EVENT:
      names.append(kwargs.get("fun_name", "?"))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _compiles_per_call(calls: list[Callable[[], Any]]) -> list[list[str]]:
  """Runs the calls in order; the programs each one compiled."""
  per_call = []
  for call in calls:
    with compilations() as names:
      jax.block_until_ready(call())
    per_call.append(names)
  return per_call


def _params(dtype: Any = jnp.float32) -> dict[str, jax.Array]:
  rng = np.random.default_rng(0)
  return {
    "w": jnp.asarray(rng.standard_normal((8, 4)), dtype),
    "b": jnp.zeros(4, dtype),
  }


def _grads(index: int, dtype: Any = jnp.float32) -> dict[str, jax.Array]:
  rng = np.random.default_rng(1 + index)
  return {
    "w": jnp.asarray(rng.standard_normal((8, 4)), dtype),
    "b": jnp.asarray(rng.standard_normal(4), dtype),
  }


def _accumulate_run(update: Callable[..., Any], init: Callable[..., Any]):
  """The per-call closures of a run of ``accumulate``, and its outputs."""
  params = _params()
  carry = {"state": init(params)}
  outputs: list[Any] = []

  def make_call(index: int) -> Callable[[], Any]:
    def call() -> Any:
      updates, carry["state"] = update(
        _grads(index), carry["state"], params, weight=WEIGHTS[index]
      )
      outputs.append((updates, carry["state"]))
      return outputs[-1]

    return call

  return [make_call(index) for index in range(NUM_CALLS)], outputs


def _assert_same_results(eager: Any, jitted: Any) -> None:
  chex.assert_tree_all_finite(eager)
  chex.assert_trees_all_equal_shapes_and_dtypes(eager, jitted)
  chex.assert_trees_all_close(eager, jitted, rtol=1e-6, atol=1e-7)


def _run_twice(make: Callable[[], Any], run: Callable[..., Any]):
  """Compilations per call of a fresh ``make()``, after a warm-up twin."""
  warm_calls, _ = run(make())
  _compiles_per_call(warm_calls)
  calls, outputs = run(make())
  return _compiles_per_call(calls), outputs


def test_accumulate_update_compiles_once():
  def make():
    return ga_optax.accumulate(optax.adam(1e-2), EVERY_K)

  def run(tx):
    return _accumulate_run(tx.update, tx.init)

  per_call, outputs = _run_twice(make, run)
  assert len(per_call[0]) == 1, per_call
  assert per_call[1:] == [[]] * (NUM_CALLS - 1), per_call
  assert [bool(ga_optax.emitted(state)) for _, state in outputs] == [
    False,
    False,
    True,
  ] * 2

  tx = make()
  jitted_calls, jitted_outputs = _accumulate_run(jax.jit(tx.update), tx.init)
  for call in jitted_calls:
    call()
  _assert_same_results(outputs, jitted_outputs)


def test_each_kind_of_flush_compiles_one_program():
  # A Python bool flush is static (the default False included): flush=True
  # compiles its own program once. A boolean array is an argument: one
  # program serves both of its values.
  flushes = [False, True, False, True]
  flushes += [jnp.asarray(False), jnp.asarray(True), jnp.asarray(False)]

  def run(tx):
    params = _params()
    carry = {"state": tx.init(params)}
    emitted = []

    def make_call(index: int) -> Callable[[], Any]:
      def call() -> Any:
        updates, carry["state"] = tx.update(
          _grads(index), carry["state"], params, flush=flushes[index]
        )
        emitted.append(bool(ga_optax.emitted(carry["state"])))
        return updates

      return call

    return [make_call(index) for index in range(len(flushes))], emitted

  per_call, emitted = _run_twice(
    lambda: ga_optax.accumulate(optax.adam(1e-2), EVERY_K), run
  )
  assert [len(names) for names in per_call] == [1, 1, 0, 0, 1, 0, 0], per_call
  assert emitted == [False, True, False, True, False, True, False]


def test_weights_of_any_real_dtype_share_one_program():
  weights = [1.0, 3, np.float32(2.0), np.int64(3), jnp.asarray(5, jnp.int32)]

  def run(tx):
    params = _params()
    carry = {"state": tx.init(params)}

    def make_call(index: int) -> Callable[[], Any]:
      def call() -> Any:
        updates, carry["state"] = tx.update(
          _grads(index), carry["state"], params, weight=weights[index]
        )
        return updates

      return call

    return [make_call(index) for index in range(len(weights))], None

  per_call, _ = _run_twice(
    lambda: ga_optax.accumulate(optax.adam(1e-2), EVERY_K), run
  )
  assert [len(names) for names in per_call] == [1, 0, 0, 0, 0], per_call


def test_accumulate_and_apply_compiles_once():
  def make():
    return ga_optax.accumulate_and_apply(optax.adam(1e-2), EVERY_K)

  def run(fused):
    def apply(grads, state, params, **kwargs):
      return fused.apply(params, grads, state, **kwargs)

    return _accumulate_run(apply, fused.init)

  per_call, outputs = _run_twice(make, run)
  assert len(per_call[0]) == 1, per_call
  assert per_call[1:] == [[]] * (NUM_CALLS - 1), per_call

  fused = make()
  jitted_apply = jax.jit(fused.apply)
  jitted_calls, jitted_outputs = _accumulate_run(
    lambda grads, state, params, **kwargs: jitted_apply(
      params, grads, state, **kwargs
    ),
    fused.init,
  )
  for call in jitted_calls:
    call()
  _assert_same_results(outputs, jitted_outputs)


def _mean_loss(params, batch):
  prediction = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((prediction - batch["y"]) ** 2)


def _batch(index: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(100 + index)
  return {
    "x": jnp.asarray(rng.standard_normal((12, 8)), jnp.float32),
    "y": jnp.asarray(rng.standard_normal((12, 4)), jnp.float32),
  }


def _microbatched_run(value_and_grad: Callable[..., Any]):
  params = _params()
  outputs: list[Any] = []

  def make_call(index: int) -> Callable[[], Any]:
    def call() -> Any:
      outputs.append(value_and_grad(params, _batch(index)))
      return outputs[-1]

    return call

  return [make_call(index) for index in range(NUM_CALLS)], outputs


def test_microbatched_value_and_grad_compiles_once():
  def make():
    return ga_optax.microbatched_value_and_grad(
      _mean_loss, 3, weight_fn=lambda microbatch: microbatch["x"].shape[0]
    )

  per_call, outputs = _run_twice(make, _microbatched_run)
  assert len(per_call[0]) == 1, per_call
  assert per_call[1:] == [[]] * (NUM_CALLS - 1), per_call

  jitted_calls, jitted_outputs = _microbatched_run(jax.jit(make()))
  for call in jitted_calls:
    call()
  _assert_same_results(outputs, jitted_outputs)
  # And the eager result is the large batch's.
  _assert_same_results(
    outputs[0], jax.value_and_grad(_mean_loss)(_params(), _batch(0))
  )


def test_jitted_step_with_mixed_dtypes_compiles_once():
  # float32 gradients of bfloat16 params: the state keeps its dtypes across
  # window closes, so the jitted step is traced and compiled once.
  def run(tx):
    params = _params(jnp.bfloat16)
    step = jax.jit(tx.update)
    carry = {"state": tx.init(params)}

    def make_call(index: int) -> Callable[[], Any]:
      grads = _grads(index)

      def call() -> Any:
        updates, carry["state"] = step(grads, carry["state"], params)
        return updates

      return call

    return [make_call(index) for index in range(NUM_CALLS)], carry

  per_call, carry = _run_twice(
    lambda: ga_optax.accumulate(optax.adamw(1e-2), EVERY_K), run
  )
  assert len(per_call[0]) == 1, per_call
  assert per_call[1:] == [[]] * (NUM_CALLS - 1), per_call
  assert int(ga_optax.applied_updates(carry["state"])) == NUM_CALLS // EVERY_K


# Python numbers are arguments, as jax.jit makes them.

# A loss that stalls and then improves: reduce_on_plateau halves its scale
# after the stall, so the reference below depends on every value passed.
PLATEAU_VALUES = (4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 3.0, 3.0, 2.5, 2.5)


def _plateau_optimizer() -> optax.GradientTransformationExtraArgs:
  return optax.chain(
    optax.sgd(0.1),
    optax.contrib.reduce_on_plateau(factor=0.5, patience=1, cooldown=0),
  )


def test_python_float_extra_args_compile_once():
  # value=float(loss) changes on every call; a new program per value would
  # make an eager training loop compile on every micro-step.
  every_k = 2

  def make():
    return ga_optax.accumulate(_plateau_optimizer(), every_k)

  def run(tx):
    params = _params()
    carry = {"state": tx.init(params)}
    outputs: list[Any] = []

    def make_call(index: int) -> Callable[[], Any]:
      def call() -> Any:
        updates, carry["state"] = tx.update(
          _grads(index), carry["state"], params, value=PLATEAU_VALUES[index]
        )
        outputs.append(updates)
        return updates

      return call

    calls = [make_call(index) for index in range(len(PLATEAU_VALUES))]
    return calls, outputs

  per_call, outputs = _run_twice(make, run)
  assert len(per_call[0]) == 1, per_call
  assert per_call[1:] == [[]] * (len(PLATEAU_VALUES) - 1), per_call

  # The reference: plain optax on each window's mean gradient, with the
  # value the closing call passed.
  reference = _plateau_optimizer()
  params = _params()
  reference_state = reference.init(params)
  scales = []
  for closing in range(every_k - 1, len(PLATEAU_VALUES), every_k):
    window = [
      _grads(index) for index in range(closing - every_k + 1, closing + 1)
    ]
    mean_grads = jax.tree.map(lambda *leaves: sum(leaves) / every_k, *window)
    expected, reference_state = reference.update(
      mean_grads, reference_state, params, value=PLATEAU_VALUES[closing]
    )
    scales.append(float(reference_state[1].scale))
    chex.assert_tree_all_finite(outputs[closing])
    chex.assert_trees_all_close(
      outputs[closing], expected, rtol=1e-6, atol=1e-7
    )
  # The values did reach the plateau logic: the scale dropped on the way.
  assert scales[0] == 1.0 and scales[-1] < 1.0, scales


def _scaled_loss(params, batch, scale):
  return scale * _mean_loss(params, batch)


def test_python_float_positional_args_compile_once():
  scales = (0.5, 1.5, 2.0, 3.25, 0.75, 1.0)

  def make():
    return ga_optax.microbatched_value_and_grad(_scaled_loss, 3)

  def run(value_and_grad):
    params = _params()
    outputs: list[Any] = []

    def make_call(index: int) -> Callable[[], Any]:
      def call() -> Any:
        outputs.append(value_and_grad(params, _batch(index), scales[index]))
        return outputs[-1]

      return call

    return [make_call(index) for index in range(len(scales))], outputs

  per_call, outputs = _run_twice(make, run)
  assert len(per_call[0]) == 1, per_call
  assert per_call[1:] == [[]] * (len(scales) - 1), per_call
  for index, output in enumerate(outputs):
    expected = jax.value_and_grad(_scaled_loss)(
      _params(), _batch(index), scales[index]
    )
    # A mean of 3 micro-batch means against one mean: float32 rounding.
    chex.assert_tree_all_finite(output)
    chex.assert_trees_all_close(output, expected, rtol=1e-5, atol=1e-6)


def test_python_control_flow_on_a_number_still_runs_eagerly():
  # jax.jit would reject this function (a Python branch on a traced number);
  # called eagerly it ran before, and still does, once per value.
  def branching_loss(params, batch, scale):
    loss = _mean_loss(params, batch)
    return loss if scale == 1 else scale * loss

  value_and_grad = ga_optax.microbatched_value_and_grad(branching_loss, 3)
  for index, scale in enumerate((1, 2, 2)):
    output = value_and_grad(_params(), _batch(index), scale)
    expected = jax.value_and_grad(branching_loss)(
      _params(), _batch(index), scale
    )
    _assert_same_results(output, expected)
