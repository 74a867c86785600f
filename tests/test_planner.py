"""Tests of the memory planner, checked against XLA's analysis itself.

Every claim of a plan is re-derived here from ``micro_step_bytes``: the
chosen size fits the budget, the next candidate size up does not, and
``num_microbatches`` reaches the global batch. Those checks compare the planner with
itself; the last test computes ``micro_step_bytes`` by hand, from the
``memory_analysis()`` of the micro-step compiled here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import ga_optax

WIDTH = 128


def _loss_fn(params, batch):
  hidden = jnp.tanh(batch["x"] @ params["w1"])
  return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def _params():
  return {"w1": jnp.ones((WIDTH, 4 * WIDTH)), "w2": jnp.ones((4 * WIDTH, 8))}


def _batch(size: int = 3):
  return {"x": jnp.ones((size, WIDTH)), "y": jnp.ones((size, 8))}


@functools.cache
def _bytes(size: int, with_optimizer: bool = False) -> int:
  return ga_optax.planning.micro_step_bytes(
    _loss_fn,
    _params(),
    _batch(),
    size,
    optimizer=optax.adam(1e-3) if with_optimizer else None,
  )


def test_bytes_grow_with_the_microbatch_and_the_optimizer_state():
  assert _bytes(1) < _bytes(64) < _bytes(1024)
  assert _bytes(64) < _bytes(64, with_optimizer=True)


def test_plan_is_the_largest_size_within_budget():
  budget = (_bytes(40) + _bytes(41)) // 2 if _bytes(41) > _bytes(40) else None
  budget = budget or _bytes(40)
  plan = ga_optax.planning.plan_microbatch(
    _loss_fn, _params(), _batch(), budget, max_micro_batch_size=4096
  )
  assert plan.num_microbatches is None
  assert plan.compiled_bytes == _bytes(plan.micro_batch_size) <= budget
  assert plan.next_size == plan.micro_batch_size + 1
  assert plan.next_size_bytes == _bytes(plan.next_size) > budget
  assert plan.micro_batch_size >= 40


def test_plan_reaches_the_global_batch_with_a_divisor():
  global_batch_size = 96
  budget = _bytes(20)
  plan = ga_optax.planning.plan_microbatch(
    _loss_fn, _params(), _batch(), budget, global_batch_size=global_batch_size
  )
  assert global_batch_size % plan.micro_batch_size == 0
  assert plan.num_microbatches * plan.micro_batch_size == global_batch_size
  assert plan.compiled_bytes == _bytes(plan.micro_batch_size) <= budget
  divisors = [
    d for d in range(1, global_batch_size + 1) if global_batch_size % d == 0
  ]
  following = divisors[divisors.index(plan.micro_batch_size) + 1]
  assert plan.next_size == following
  assert _bytes(following) > budget


def test_whole_batch_fits_means_k_equal_one():
  plan = ga_optax.planning.plan_microbatch(
    _loss_fn, _params(), _batch(), _bytes(16) + 1, global_batch_size=16
  )
  assert (plan.micro_batch_size, plan.num_microbatches, plan.next_size) == (
    16,
    1,
    None,
  )


def test_optimizer_state_counts_against_the_budget():
  budget = _bytes(64, with_optimizer=False)
  plain = ga_optax.planning.plan_microbatch(
    _loss_fn, _params(), _batch(), budget, global_batch_size=64
  )
  with_adam_budget = _bytes(64, with_optimizer=True)
  with_adam = ga_optax.planning.plan_microbatch(
    _loss_fn,
    _params(),
    _batch(),
    with_adam_budget,
    global_batch_size=64,
    optimizer=optax.adam(1e-3),
  )
  assert plain.micro_batch_size == 64
  assert with_adam.micro_batch_size == 64
  assert with_adam.compiled_bytes > plain.compiled_bytes


def test_abstract_params_plan_like_concrete_ones():
  abstract = jax.tree.map(
    lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), _params()
  )
  assert ga_optax.planning.micro_step_bytes(
    _loss_fn, abstract, _batch(), 8
  ) == _bytes(8)


def test_has_aux_losses_are_planned():
  def loss_with_aux(params, batch):
    return _loss_fn(params, batch), {"size": batch["x"].shape[0]}

  assert ga_optax.planning.micro_step_bytes(
    loss_with_aux, _params(), _batch(), 8, has_aux=True
  ) == _bytes(8)


@pytest.mark.parametrize(
  ("budget", "error", "match"),
  [
    (0, ValueError, "memory_budget_bytes"),
    (-5, ValueError, "memory_budget_bytes"),
    (1.5e9, TypeError, "memory_budget_bytes"),
    (True, TypeError, "memory_budget_bytes"),
    (1000, ValueError, "micro-batch of 1"),
  ],
)
def test_bad_budgets_raise(budget, error, match):
  with pytest.raises(error, match=match):
    ga_optax.planning.plan_microbatch(_loss_fn, _params(), _batch(), budget)


def test_bad_batches_and_sizes_raise():
  budget = _bytes(8)
  with pytest.raises(ValueError, match="global_batch_size"):
    ga_optax.planning.plan_microbatch(
      _loss_fn, _params(), _batch(), budget, global_batch_size=0
    )
  with pytest.raises(TypeError, match="global_batch_size"):
    ga_optax.planning.plan_microbatch(
      _loss_fn, _params(), _batch(), budget, global_batch_size=8.0
    )
  with pytest.raises(ValueError, match="leading"):
    ga_optax.planning.plan_microbatch(
      _loss_fn,
      _params(),
      {"x": jnp.ones((3, WIDTH)), "y": jnp.ones((4, 8))},
      budget,
    )
  with pytest.raises(ValueError, match="example_batch"):
    ga_optax.planning.plan_microbatch(
      _loss_fn, _params(), {"x": jnp.ones(())}, budget
    )
  with pytest.raises(ValueError, match="micro_batch_size"):
    ga_optax.planning.micro_step_bytes(_loss_fn, _params(), _batch(), 0)
  # A device is a jax.Device (a compile-only TPU chip, say), not a name.
  with pytest.raises(TypeError, match="device"):
    ga_optax.planning.plan_microbatch(
      _loss_fn, _params(), _batch(), budget, device="tpu"
    )


def _by_hand(step, donate, *args) -> tuple[int, int]:
  """XLA's figure for ``step``, read off its memory analysis by hand.

  Returns ``(bytes, temporary bytes)``: arguments, plus outputs that do not
  reuse a donated argument's buffer, plus temporaries.
  """
  compiled = jax.jit(step, donate_argnums=donate).lower(*args).compile()
  analysis = compiled.memory_analysis()
  total = (
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
    + analysis.temp_size_in_bytes
  )
  return total, analysis.temp_size_in_bytes


def test_micro_step_bytes_is_the_memory_analysis_computed_by_hand():
  """The planner's figure, from compiling the documented micro-step here.

  Without an optimizer the micro-step is the gradient added into a float32
  accumulator; with one it is ``accumulate(optimizer, k).update`` and
  ``optax.apply_updates``; params and state are donated. Every other test
  of this file compares the planner with itself.
  """
  size = 64
  params, batch = _params(), _batch(size)

  def accumulate_gradient(params, accumulator, batch):
    grads = jax.grad(_loss_fn)(params, batch)
    return jax.tree.map(
      lambda total, grad: total + grad.astype(total.dtype), accumulator, grads
    )

  accumulator = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  expected, temporaries = _by_hand(
    accumulate_gradient, 1, params, accumulator, batch
  )
  # Activations of 64 rows: a figure that left them out would differ.
  assert temporaries > size * 4 * WIDTH * 4
  assert _bytes(size) == expected

  tx = ga_optax.accumulate(optax.adam(1e-3), 2)

  def micro_step(params, state, batch):
    grads = jax.grad(_loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  expected, temporaries = _by_hand(
    micro_step, (0, 1), params, tx.init(params), batch
  )
  assert temporaries > size * 4 * WIDTH * 4
  assert _bytes(size, with_optimizer=True) == expected
