"""Tests of the elastic planner, checked against brute force.

The brute forces below test every (global batch, device count, candidate)
triple directly; the library never does, so they are an independent
reference for the sieve in ``best_global_batch_size``.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ga_optax


def brute_valid_counts(global_batch, sizes, min_devices, max_devices):
  return tuple(
    devices
    for devices in range(min_devices, max_devices + 1)
    if any(global_batch % (size * devices) == 0 for size in sizes)
  )


def brute_best(limit, sizes, min_devices, max_devices, prefer_larger):
  """The best global batch by counting every candidate's devices, or None."""
  counts = {
    global_batch: len(
      brute_valid_counts(global_batch, sizes, min_devices, max_devices)
    )
    for global_batch in range(1, limit + 1)
  }
  most = max(counts.values())
  if most == 0:
    return None
  best = [size for size, count in counts.items() if count == most]
  return best[-1] if prefer_larger else best[0]


sizes_strategy = st.lists(st.integers(1, 12), min_size=1, max_size=4)


@st.composite
def device_ranges(draw, largest=40, width=24):
  min_devices = draw(st.integers(1, largest))
  max_devices = draw(st.integers(min_devices, min_devices + width))
  return min_devices, max_devices


def test_eighteen_is_three_by_two_by_three():
  plan = ga_optax.planning.elastic_plan(18, 3, (1, 2, 3))
  assert plan == ga_optax.planning.ElasticPlan(
    global_batch_size=18, num_devices=3, micro_batch_size=3, num_microbatches=2
  )
  assert ga_optax.planning.valid_device_counts(18, (1, 2, 3), 18) == (
    1,
    2,
    3,
    6,
    9,
    18,
  )


@settings(max_examples=200, deadline=None)
@given(
  global_batch=st.integers(1, 2000),
  num_devices=st.integers(1, 64),
  sizes=sizes_strategy,
)
def test_plans_multiply_to_the_global_batch(global_batch, num_devices, sizes):
  dividing = [
    size for size in sizes if global_batch % (size * num_devices) == 0
  ]
  if not dividing:
    with pytest.raises(ValueError, match=f"num_devices={num_devices} "):
      ga_optax.planning.elastic_plan(global_batch, num_devices, sizes)
    return
  plan = ga_optax.planning.elastic_plan(global_batch, num_devices, sizes)
  assert (
    plan.micro_batch_size * plan.num_microbatches * plan.num_devices
    == plan.global_batch_size
    == global_batch
  )
  assert plan.num_devices == num_devices
  assert plan.micro_batch_size == max(dividing)
  assert all(type(field) is int for field in plan)


@settings(max_examples=50, deadline=None)
@given(global_batch=st.integers(1, 240), sizes=sizes_strategy)
def test_plans_exist_exactly_on_the_valid_counts(global_batch, sizes):
  valid = ga_optax.planning.valid_device_counts(
    global_batch, sizes, 2 * global_batch
  )
  for num_devices in range(1, 2 * global_batch + 1):
    if num_devices in valid:
      ga_optax.planning.elastic_plan(global_batch, num_devices, sizes)
    else:
      with pytest.raises(ValueError):
        ga_optax.planning.elastic_plan(global_batch, num_devices, sizes)


def test_the_largest_dividing_candidate_wins_whatever_the_order():
  for sizes in ((1, 2, 4, 8, 16), (16, 1, 8, 4, 2), [4, 16, 4, 1]):
    plan = ga_optax.planning.elastic_plan(64, 2, sizes)
    assert (plan.micro_batch_size, plan.num_microbatches) == (16, 2)
  # 16 does not divide 48 / 2 = 24, so 8 does the job in 3 micro-steps.
  plan = ga_optax.planning.elastic_plan(48, 2, (1, 2, 4, 8, 16))
  assert (plan.micro_batch_size, plan.num_microbatches) == (8, 3)


def test_one_device_and_the_whole_batch_per_device():
  assert ga_optax.planning.elastic_plan(8, 1, (8,)) == (8, 1, 8, 1)
  assert ga_optax.planning.elastic_plan(8, 8, (1,)) == (8, 8, 1, 1)


def test_numpy_ints_are_accepted_and_plain_ints_returned():
  plan = ga_optax.planning.elastic_plan(
    np.int64(18), np.int32(3), np.array([1, 2, 3])
  )
  assert plan == (18, 3, 3, 2)
  assert all(type(field) is int for field in plan)
  counts = ga_optax.planning.valid_device_counts(
    np.int64(18), range(1, 4), np.int16(8), np.uint8(2)
  )
  assert counts == (2, 3, 6)
  assert all(type(count) is int for count in counts)
  best = ga_optax.planning.best_global_batch_size(
    np.int64(16), (np.int8(1), 2), max_devices=np.int64(4)
  )
  assert best == 12
  assert type(best) is int


def test_an_impossible_count_lists_the_valid_ones():
  with pytest.raises(ValueError) as error:
    ga_optax.planning.elastic_plan(18, 4, (1, 2, 3))
  message = str(error.value)
  assert "num_devices=4" in message
  assert "global_batch_size=18" in message
  assert "micro_batch_sizes (1, 2, 3)" in message
  assert message.endswith("the device counts that can are 1, 2, 3, 6, 9, 18.")


def test_a_long_list_of_valid_counts_shows_the_nearest():
  # 720720 = 2^4 * 3^2 * 5 * 7 * 11 * 13 has 240 divisors; 49 is not one.
  with pytest.raises(ValueError) as error:
    ga_optax.planning.elastic_plan(720720, 49, (1, 2, 4))
  message = str(error.value)
  listed = [
    int(count)
    for count in re.search(r"can are ([\d, ]+) \(", message)[1].split(", ")
  ]
  valid = ga_optax.planning.valid_device_counts(720720, (1, 2, 4), 720720)
  assert len(valid) == 240
  assert "240 in all" in message
  assert listed == sorted(listed) and set(listed) <= set(valid)
  assert 48 in listed and 52 in listed and len(listed) == 16


def test_no_candidate_dividing_the_batch_says_so():
  with pytest.raises(ValueError, match="no candidate divides global_batch"):
    ga_optax.planning.elastic_plan(7, 1, (2, 4))


@settings(max_examples=150, deadline=None)
@given(
  global_batch=st.integers(1, 600),
  sizes=sizes_strategy,
  devices=device_ranges(),
  limit=st.none() | st.integers(1, 12),
)
def test_valid_device_counts_match_brute_force(
  global_batch, sizes, devices, limit
):
  min_devices, max_devices = devices
  fitting = [size for size in sizes if limit is None or size <= limit]
  if not fitting:
    with pytest.raises(ValueError, match="max_micro_batch_size"):
      ga_optax.planning.valid_device_counts(
        global_batch,
        sizes,
        max_devices,
        min_devices,
        max_micro_batch_size=limit,
      )
    return
  counts = ga_optax.planning.valid_device_counts(
    global_batch, sizes, max_devices, min_devices, max_micro_batch_size=limit
  )
  assert counts == brute_valid_counts(
    global_batch, fitting, min_devices, max_devices
  )


@settings(max_examples=100, deadline=None)
@given(
  limit=st.integers(1, 200),
  sizes=sizes_strategy,
  devices=device_ranges(largest=24, width=16),
  prefer_larger=st.booleans(),
)
def test_best_global_batch_size_matches_brute_force(
  limit, sizes, devices, prefer_larger
):
  min_devices, max_devices = devices
  expected = brute_best(limit, sizes, min_devices, max_devices, prefer_larger)
  arguments = {
    "min_devices": min_devices,
    "max_devices": max_devices,
    "prefer_larger": prefer_larger,
  }
  if expected is None:
    with pytest.raises(ValueError, match="max_global_batch_size"):
      ga_optax.planning.best_global_batch_size(limit, sizes, **arguments)
    return
  assert (
    ga_optax.planning.best_global_batch_size(limit, sizes, **arguments)
    == expected
  )


def test_ties_go_to_the_largest_or_the_smallest():
  # On 1 or 2 devices with micro-batches of 1, every even size is valid on
  # both counts.
  assert ga_optax.planning.best_global_batch_size(11, (1,), max_devices=2) == 10
  assert (
    ga_optax.planning.best_global_batch_size(
      11, (1,), max_devices=2, prefer_larger=False
    )
    == 2
  )
  # Only multiples of 16 run on 4 devices with micro-batches of 4.
  assert (
    ga_optax.planning.best_global_batch_size(
      100, (4,), min_devices=4, max_devices=4, prefer_larger=False
    )
    == 16
  )
  assert (
    ga_optax.planning.best_global_batch_size(
      100, (4,), min_devices=4, max_devices=4
    )
    == 96
  )


def test_best_global_batch_size_at_scale_beats_every_sampled_size():
  """A sieve at the documented scale, spot-checked through the public API."""
  sizes, max_devices = (1, 2, 4, 8, 16, 32), 2048
  best = ga_optax.planning.best_global_batch_size(
    2_000_000, sizes, max_devices=max_devices
  )
  most = len(ga_optax.planning.valid_device_counts(best, sizes, max_devices))
  rng = np.random.default_rng(0)
  sample = rng.integers(1, 2_000_001, size=200).tolist()
  # Highly composite sizes are the serious rivals.
  sample += [720720, 1081080, 1441440, 1663200, 1801800, 1965600]
  for global_batch in sample:
    count = len(
      ga_optax.planning.valid_device_counts(global_batch, sizes, max_devices)
    )
    assert count < most or (count == most and global_batch <= best)


def test_device_counts_above_the_batch_are_never_valid():
  assert ga_optax.planning.valid_device_counts(6, (1,), 1000, 7) == ()
  assert (
    ga_optax.planning.best_global_batch_size(6, (1,), max_devices=1000) == 6
  )
  with pytest.raises(ValueError, match="smallest that does is 14"):
    ga_optax.planning.best_global_batch_size(
      6, (2,), min_devices=7, max_devices=1000
    )


def test_max_micro_batch_size_leaves_out_larger_candidates():
  plan = ga_optax.planning.elastic_plan(
    64, 2, (4, 8, 16, 32), max_micro_batch_size=10
  )
  assert (plan.micro_batch_size, plan.num_microbatches) == (8, 4)
  assert ga_optax.planning.valid_device_counts(
    32, (16,), 4, max_micro_batch_size=16
  ) == (1, 2)
  assert ga_optax.planning.best_global_batch_size(
    40, (4, 8), max_devices=2, max_micro_batch_size=4
  ) == ga_optax.planning.best_global_batch_size(40, (4,), max_devices=2)
  with pytest.raises(ValueError, match=r"max_micro_batch_size=3 .*\(4, 8\)"):
    ga_optax.planning.elastic_plan(64, 2, (8, 4), max_micro_batch_size=3)


def test_a_memory_budget_bounds_the_micro_batch():
  """The limit the memory planner would give: the largest size that fits.

  The page's block runs ``plan_microbatch`` itself (test_the_how_to_page_runs);
  here the bytes of the chosen size and of the next candidate are checked.
  """

  def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)

  params = {"w1": jnp.ones((64, 256)), "w2": jnp.ones((256, 4))}
  batch = {"x": jnp.ones((1, 64)), "y": jnp.ones((1, 4))}
  budget = ga_optax.planning.micro_step_bytes(loss_fn, params, batch, 12)

  plan = ga_optax.planning.elastic_plan(
    128, 2, (1, 2, 4, 8, 16, 32), max_micro_batch_size=12
  )

  assert (plan.micro_batch_size, plan.num_microbatches) == (8, 8)
  assert ga_optax.planning.micro_step_bytes(loss_fn, params, batch, 8) <= budget
  assert ga_optax.planning.micro_step_bytes(loss_fn, params, batch, 16) > budget


INT_ARGUMENTS = [
  (0, ValueError),
  (-3, ValueError),
  (2.0, TypeError),
  (True, TypeError),
  ("4", TypeError),
  (None, TypeError),
]


@pytest.mark.parametrize(("value", "error"), INT_ARGUMENTS)
def test_bad_sizes_and_counts_name_the_argument(value, error):
  calls = {
    "global_batch_size": lambda: ga_optax.planning.elastic_plan(value, 2, (1,)),
    "num_devices": lambda: ga_optax.planning.elastic_plan(8, value, (1,)),
    "max_micro_batch_size": lambda: ga_optax.planning.elastic_plan(
      8, 2, (1,), max_micro_batch_size=value
    ),
    "max_devices": lambda: ga_optax.planning.valid_device_counts(
      8, (1,), value
    ),
    "min_devices": lambda: ga_optax.planning.valid_device_counts(
      8, (1,), 4, value
    ),
    "max_global_batch_size": lambda: ga_optax.planning.best_global_batch_size(
      value, (1,), max_devices=4
    ),
  }
  if value is None:
    del calls["max_micro_batch_size"]  # None is its default: no limit.
  for name, call in calls.items():
    with pytest.raises(error, match=rf"^{name}\b"):
      call()
  with pytest.raises(error, match=r"^max_devices\b"):
    ga_optax.planning.best_global_batch_size(8, (1,), max_devices=value)
  with pytest.raises(error, match=r"^min_devices\b"):
    ga_optax.planning.best_global_batch_size(
      8, (1,), min_devices=value, max_devices=4
    )


@pytest.mark.parametrize(
  ("sizes", "error", "match"),
  [
    ([], ValueError, "at least one"),
    ((), ValueError, "at least one"),
    (4, TypeError, "collection of positive ints"),
    ("124", TypeError, "collection of positive ints"),
    (None, TypeError, "collection of positive ints"),
    (np.array(4), TypeError, "collection of positive ints"),
    ([2, 0], ValueError, r"micro_batch_sizes\[1\]"),
    ([2, -4], ValueError, r"micro_batch_sizes\[1\]"),
    ([True, 2], TypeError, r"micro_batch_sizes\[0\]"),
    ([2, 4.0], TypeError, r"micro_batch_sizes\[1\]"),
    ([2, "4"], TypeError, r"micro_batch_sizes\[1\]"),
  ],
)
def test_bad_candidates_name_the_argument(sizes, error, match):
  with pytest.raises(error, match=match):
    ga_optax.planning.elastic_plan(8, 2, sizes)
  with pytest.raises(error, match=match):
    ga_optax.planning.valid_device_counts(8, sizes, 4)
  with pytest.raises(error, match=match):
    ga_optax.planning.best_global_batch_size(8, sizes, max_devices=4)


def test_an_empty_device_range_is_an_error():
  with pytest.raises(ValueError, match=r"min_devices \(5\).*max_devices \(4\)"):
    ga_optax.planning.valid_device_counts(8, (1,), 4, 5)
  with pytest.raises(ValueError, match=r"min_devices \(5\).*max_devices \(4\)"):
    ga_optax.planning.best_global_batch_size(
      8, (1,), min_devices=5, max_devices=4
    )


@pytest.mark.parametrize("prefer_larger", [1, 0, None, "yes"])
def test_prefer_larger_must_be_a_bool(prefer_larger):
  with pytest.raises(TypeError, match="prefer_larger must be a bool"):
    ga_optax.planning.best_global_batch_size(
      8, (1,), max_devices=4, prefer_larger=prefer_larger
    )


def test_prefer_larger_may_be_a_numpy_bool():
  assert (
    ga_optax.planning.best_global_batch_size(
      11, (1,), max_devices=2, prefer_larger=np.bool_(False)
    )
    == 2
  )


@pytest.mark.parametrize(
  "make", [ga_optax.accumulate, ga_optax.accumulate_and_apply]
)
def test_the_state_does_not_depend_on_k(make):
  # A run moved to another device count changes k; its saved state must
  # restore into the new transformation's state as it is.
  params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2, jnp.bfloat16)}
  shapes = [
    jax.eval_shape(make(optax.adam(1e-3), every_k).init, params)
    for every_k in (1, 8, {0: 2, 10: 4})
  ]
  for other in shapes[1:]:
    assert jax.tree.structure(other) == jax.tree.structure(shapes[0])
    chex.assert_trees_all_equal_shapes_and_dtypes(other, shapes[0])
