"""The program XLA:CPU compiles for the device's schedule (the default).

Every test, every small experiment and every drop-in user runs this program,
on the CPU in the window's conditional form
(ga_optax/_src/window/window_form.py). Its cost, judged in bytes and copies
as the compiler lays them out: the MLP of benchmarks/run.py, smaller (4 x
256^2, float32, no biases, micro-batch 8, Adam, k = 4), jitted, params and
state donated, each program compiled once. The compiled temporaries and
copies are deterministic for a jax release; times are benchmarks/run.py's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import compile_level
import jax
import jax.extend
import jax.numpy as jnp
import optax
import pytest
from jax._src import compiler

import ga_optax
from ga_optax._src import audits
from ga_optax._src.window import window_form

WIDTH, DEPTH, ROWS, EVERY_K = 256, 4, 8, 4

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu", reason="the program XLA:CPU compiles"
)


def loss_fn(params, batch):
  if isinstance(params, dict):  # named as a model's layers: layer_0, ...
    params = [params[f"layer_{index}"] for index in range(len(params))]
  hidden = batch["x"]
  for weight in params:
    hidden = jnp.tanh(hidden @ weight)
  return jnp.mean(jnp.sum((hidden - batch["y"]) ** 2, axis=-1))


def params_of(depth=DEPTH, named=False):
  """``depth`` layers, a list or a dict of ``layer_0``, ``layer_1``..."""
  keys = jax.random.split(jax.random.key(0), depth)
  layers = [
    jax.random.normal(key, (WIDTH, WIDTH)) / math.sqrt(WIDTH) for key in keys
  ]
  if not named:
    return layers
  return {f"layer_{index}": layer for index, layer in enumerate(layers)}


def batch_of():
  x_key, y_key = jax.random.split(jax.random.key(1))
  return {
    "x": jax.random.normal(x_key, (ROWS, WIDTH)),
    "y": jax.random.normal(y_key, (ROWS, WIDTH)),
  }


def compiled(tx, params=None):
  """``tx``'s train step for the CPU, params and state donated."""

  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    if isinstance(tx, ga_optax.FusedAccumulation):
      return tx.apply(params, grads, state)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = params_of() if params is None else params
  return (
    jax.jit(step, donate_argnums=(0, 1))
    .lower(params, tx.init(params), batch_of())
    .compile()
  )


@contextlib.contextmanager
def the_form_the_cpu_chooses() -> Iterator[None]:
  """Whatever form the environment pins for the run."""
  with pytest.MonkeyPatch.context() as patch:
    patch.delenv(window_form.VARIABLE, raising=False)
    yield


@pytest.fixture(scope="module")
def programs():
  """The plain Adam step, ``accumulate``'s (with and without the noise
  scale) and ``accumulate_and_apply``'s, each compiled once, in the form
  the CPU chooses, at the suite's level (tests/compile_level.py)."""
  adam = optax.adam(1e-3)
  with the_form_the_cpu_chooses():
    return {
      "adam": compiled(adam),
      "accumulate": compiled(ga_optax.accumulate(adam, EVERY_K)),
      "accumulate_and_apply": compiled(
        ga_optax.accumulate_and_apply(adam, EVERY_K)
      ),
      "noise_scale": compiled(
        ga_optax.accumulate(adam, EVERY_K, noise_scale_decay=0.9)
      ),
    }


def temporaries(program) -> int:
  return program.memory_analysis().temp_size_in_bytes


WINDOWS = ["accumulate", "accumulate_and_apply", "noise_scale"]


@pytest.mark.parametrize("name", WINDOWS)
def test_the_window_holds_one_gradient_layer_of_temporaries(programs, name):
  """One layer's gradient and small buffers, within the contract's 0.6 of a
  plain Adam step's: each sum is written over its accumulator.

  Three windows held more. ``accumulate``'s held the sum of the gradient
  backpropagation makes first apart, as many temporaries as a plain Adam
  step, while its conditional listed the leaves first leaf first
  (ga_optax/_src/window/run_once.py, ``_as_conditional``), and again with
  the noise scale while the conditional listed its scalars first;
  ``accumulate_and_apply``'s held every layer's sum apart while its
  closing branch zeroed the accumulator itself (``emptied_in_branch``).
  Temporaries past the C library's threshold for mapped allocations are
  mapped afresh on every call, each page faulted in again: so the noise
  scale's micro-step missed its cost target (benchmarks/run.py).
  """
  leaf_bytes = WIDTH * WIDTH * 4
  window, plain = (
    temporaries(programs[name]),
    temporaries(programs["adam"]),
  )
  assert leaf_bytes <= window < 2 * leaf_bytes, (window, leaf_bytes)
  assert window <= 0.6 * plain, (window, plain)


def test_twelve_numbered_layers_hold_no_more_than_the_fused_window():
  """Past nine layers the names sort out of order (``layer_10`` before
  ``layer_2``): the window reads the numbers in them as numbers, and
  ``accumulate`` still writes each sum over its accumulator. Listed by the
  names as they sort, its temporaries came near a plain Adam step's.
  """
  params = params_of(depth=12, named=True)
  adam = optax.adam(1e-3)
  with the_form_the_cpu_chooses():
    window, fused = (
      temporaries(compiled(tx, params))
      for tx in (
        ga_optax.accumulate(adam, EVERY_K),
        ga_optax.accumulate_and_apply(adam, EVERY_K),
      )
    )
  assert window <= fused, (window, fused)


@pytest.mark.parametrize("name", WINDOWS)
def test_a_micro_step_copies_no_layer(programs, name):
  """Nothing the size of a layer is copied on either path (the window at
  the floor copied the whole accumulator on every micro-step, in the
  conditional that zeroed it; the fused window copied it on every close,
  and the noise scale's while it read the window's mean after the
  optimizer's step: ``run_once.read_before_step``), and the closing side's
  work stays in it."""
  leaf_bytes = WIDTH * WIDTH * 4
  program = programs[name]
  for path in ("micro_step", "closing"):
    audit = audits.path_audit(program, path)
    assert audit.copied_bytes(at_least=leaf_bytes) == 0, (path, audit.copies)
  micro_step = audits.path_audit(program, "micro_step")
  assert micro_step.misplaced_closing_work == []


def test_the_suite_compiles_the_window_as_xla_s_defaults_do(programs):
  """The suite's CPU level (tests/compile_level.py) leaves XLA's passes
  alone: the optimized program and its memory are the default build's, so
  the figures above are a user's."""
  cpu = jax.extend.backend.get_backend("cpu")
  for unoptimized in (False, True):
    with compile_level.unoptimized(unoptimized):
      options = compiler.get_compile_options(1, 1, backend=cpu)
      level = options.executable_build_options.debug_options
      # The level the suite sets, or XLA's default.
      assert (level.xla_backend_optimization_level == 0) == unoptimized
  suite = programs["accumulate"]
  with compile_level.unoptimized(False), the_form_the_cpu_chooses():
    default = compiled(ga_optax.accumulate(optax.adam(1e-3), EVERY_K))
  compile_level.assert_same_program(default, suite)
