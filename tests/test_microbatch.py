"""Tests of in-step micro-batching against the plain large-batch gradient."""

from __future__ import annotations

import functools
from typing import Any

import chex
import helpers
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax

hypothesis.settings.register_profile(
  "microbatch", max_examples=15, deadline=None, derandomize=True
)

BATCH = 16
FEATURES = 3


def _params() -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.PRNGKey(0), 2)
  return {
    "w": jax.random.normal(keys[0], (FEATURES, 4)),
    "b": jax.random.normal(keys[1], (4,)),
  }


def _batch(size: int = BATCH) -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.PRNGKey(1), 2)
  return {
    "x": jax.random.normal(keys[0], (size, FEATURES)),
    "y": jax.random.normal(keys[1], (size, 4)),
  }


def _mean_loss(params, batch):
  predictions = jnp.tanh(batch["x"] @ params["w"] + params["b"])
  return jnp.mean((predictions - batch["y"]) ** 2)


def _maybe_jit(fn, use_jit: bool):
  return jax.jit(fn) if use_jit else fn


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize(
  "num_microbatches", [1, 2, pytest.param(4, marks=pytest.mark.smoke), 16]
)
def test_mean_loss_matches_large_batch(num_microbatches, use_jit):
  params, batch = _params(), _batch()
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _mean_loss, num_microbatches
  )
  loss, grads = _maybe_jit(value_and_grad, use_jit)(params, batch)
  expected_loss, expected_grads = jax.value_and_grad(_mean_loss)(params, batch)
  chex.assert_trees_all_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(grads, expected_grads, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)


# A padded-sequence loss normalised by the real tokens of whatever batch it
# sees: per-micro-batch means are only combined exactly when weighted by the
# micro-batch's token count.
def _token_loss(params, batch):
  logits = batch["tokens"][..., None] * params["scale"] + params["bias"]
  per_token = (jnp.tanh(logits).sum(-1) - batch["targets"]) ** 2
  mask = batch["mask"]
  return jnp.sum(per_token * mask) / jnp.sum(mask)


def _count_tokens(microbatch):
  return jnp.sum(microbatch["mask"])


def _padded_batch(lengths: list[int], max_len: int):
  rows = len(lengths)
  tokens = jax.random.normal(jax.random.PRNGKey(2), (rows, max_len))
  targets = jax.random.normal(jax.random.PRNGKey(3), (rows, max_len))
  mask = (np.arange(max_len)[None, :] < np.asarray(lengths)[:, None]).astype(
    np.float32
  )
  return {"tokens": tokens, "targets": targets, "mask": jnp.asarray(mask)}


def _token_params():
  return {"scale": jnp.linspace(-1.0, 1.0, 5), "bias": jnp.full((5,), 0.3)}


@functools.cache
def _jitted_token_value_and_grad(num_microbatches: int):
  # One compilation per k, shared by the hypothesis examples.
  if num_microbatches == 0:
    return jax.jit(jax.value_and_grad(_token_loss))
  return jax.jit(
    ga_optax.microbatched_value_and_grad(
      _token_loss, num_microbatches, weight_fn=_count_tokens
    )
  )


@pytest.mark.smoke
@hypothesis.settings(hypothesis.settings.get_profile("microbatch"))
@hypothesis.given(
  num_microbatches=st.sampled_from([1, 2, 4, 8]),
  lengths=st.lists(st.integers(0, 6), min_size=8, max_size=8),
)
def test_token_weighted_loss_matches_large_batch(num_microbatches, lengths):
  # Rows and whole micro-batches may hold no tokens; the batch may not.
  hypothesis.assume(sum(lengths) > 0)
  params, batch = _token_params(), _padded_batch(lengths, max_len=6)
  loss, grads = _jitted_token_value_and_grad(num_microbatches)(params, batch)
  expected_loss, expected_grads = _jitted_token_value_and_grad(0)(params, batch)
  chex.assert_trees_all_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(grads, expected_grads, rtol=1e-5, atol=1e-6)


def test_unweighted_mean_of_padded_loss_is_not_large_batch():
  # The bug token weighting exists to fix: equal weights over micro-batches
  # with different token counts give a different gradient.
  # Micro-batch i holds rows i::2: 1 + 1 tokens against 6 + 6.
  params, batch = _token_params(), _padded_batch([1, 6, 1, 6], max_len=6)
  _, grads = ga_optax.microbatched_value_and_grad(_token_loss, 2)(params, batch)
  _, expected = jax.value_and_grad(_token_loss)(params, batch)
  assert not np.allclose(grads["scale"], expected["scale"], rtol=1e-3)


@pytest.mark.parametrize("use_jit", [False, True])
def test_microbatch_without_tokens_is_dropped_not_nan(use_jit):
  # Micro-batch i holds rows i::2: the second one has no tokens.
  params, batch = _token_params(), _padded_batch([3, 0, 5, 0], max_len=6)
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _token_loss, 2, weight_fn=_count_tokens
  )
  loss, grads = _maybe_jit(value_and_grad, use_jit)(params, batch)
  expected_loss, expected_grads = jax.value_and_grad(_token_loss)(params, batch)
  chex.assert_tree_all_finite((loss, grads))
  chex.assert_trees_all_close(loss, expected_loss, rtol=1e-5)
  chex.assert_trees_all_close(grads, expected_grads, rtol=1e-5, atol=1e-7)


def test_all_zero_weights_give_zeros():
  params, batch = _token_params(), _padded_batch([0, 0], max_len=3)
  loss, grads = ga_optax.microbatched_value_and_grad(
    _token_loss, 2, weight_fn=_count_tokens
  )(params, batch)
  chex.assert_trees_all_equal(
    (loss, grads), (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
  )


def test_aux_is_stacked_per_microbatch():
  params, batch = _params(), _batch()

  def loss_with_aux(params, batch):
    loss = _mean_loss(params, batch)
    return loss, {"loss": loss, "first_x": batch["x"][0]}

  (loss, aux), grads = ga_optax.microbatched_value_and_grad(
    loss_with_aux, 4, has_aux=True
  )(params, batch)
  # Micro-batch i holds rows i, i + 4, i + 8, ...
  microbatches = [jax.tree.map(lambda x, i=i: x[i::4], batch) for i in range(4)]
  expected_losses = jnp.stack([_mean_loss(params, mb) for mb in microbatches])
  chex.assert_trees_all_close(aux["loss"], expected_losses, rtol=1e-6)
  chex.assert_trees_all_equal(aux["first_x"], batch["x"][:4])
  chex.assert_trees_all_close(loss, jnp.mean(expected_losses), rtol=1e-6)
  chex.assert_trees_all_close(
    grads, jax.grad(_mean_loss)(params, batch), rtol=1e-5, atol=1e-6
  )


def test_extra_arguments_are_passed_to_every_microbatch():
  params, batch = _params(), _batch()

  def scaled_loss(params, batch, factor, *, offset):
    return factor * _mean_loss(params, batch) + offset

  loss, grads = ga_optax.microbatched_value_and_grad(scaled_loss, 4)(
    params, batch, 3.0, offset=1.0
  )
  expected = jax.value_and_grad(scaled_loss)(params, batch, 3.0, offset=1.0)
  chex.assert_trees_all_close((loss, grads), expected, rtol=1e-5, atol=1e-6)


def test_bfloat16_params_accumulate_in_float32():
  # Micro-batch gradients exact in bfloat16 (a linear loss: the gradient is
  # the row), whose sum is not: 256 then fifteen 1s. Summed in bfloat16 in
  # order, each 1 is lost beside 256 (its spacing there is 2) and the mean is
  # 16; summed in float32, 271 / 16 = 16.9375 rounds once, to 17.
  params = {"w": jnp.zeros((2,), jnp.bfloat16)}
  rows = np.ones((16, 2), np.float32)
  rows[0] = 256.0
  batch = {"x": jnp.asarray(rows, jnp.bfloat16)}

  def linear_loss(params, batch):
    return jnp.mean(batch["x"] @ params["w"])

  _, grads = ga_optax.microbatched_value_and_grad(linear_loss, 16)(
    params, batch
  )
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)
  np.testing.assert_array_equal(
    np.asarray(grads["w"], np.float32), np.full(2, 17.0, np.float32)
  )
  # The rows really are the micro-batches' gradients, exact in bfloat16.
  for index, row in enumerate(rows):
    micro_batch = {"x": batch["x"][index : index + 1]}
    np.testing.assert_array_equal(
      np.asarray(jax.grad(linear_loss)(params, micro_batch)["w"], np.float32),
      row,
    )


def test_rng_gives_each_microbatch_its_own_dropout_mask():
  params = {"w": jnp.ones((8,))}
  batch = {"x": jnp.ones((4, 8))}  # Two identical micro-batches.

  def dropout_loss(params, batch, *, rng):
    keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
    loss = jnp.mean(jnp.where(keep, batch["x"] * params["w"], 0.0))
    return loss, keep

  value_and_grad = jax.jit(
    ga_optax.microbatched_value_and_grad(dropout_loss, 2, has_aux=True)
  )
  key = jax.random.PRNGKey(7)
  (loss, masks), grads = value_and_grad(params, batch, rng=key)
  assert masks.shape == (2, 2, 8)
  assert not np.array_equal(masks[0], masks[1])
  chex.assert_trees_all_equal(
    ((loss, masks), grads), value_and_grad(params, batch, rng=key)
  )
  expected_masks = jnp.stack(
    [
      jax.random.bernoulli(jax.random.fold_in(key, i), 0.5, (2, 8))
      for i in range(2)
    ]
  )
  chex.assert_trees_all_equal(masks, expected_masks)
  (_, other_masks), _ = value_and_grad(params, batch, rng=jax.random.PRNGKey(8))
  assert not np.array_equal(masks, other_masks)


def test_axis_name_reduces_across_the_axis():
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _token_loss, 2, weight_fn=_count_tokens, axis_name="data"
  )
  params, batch = _token_params(), _padded_batch([1, 2, 6, 4, 3, 0, 5, 6], 6)
  per_device = jax.tree.map(lambda x: x.reshape(2, 4, *x.shape[1:]), batch)
  loss, grads = jax.vmap(
    value_and_grad, in_axes=(None, 0), out_axes=0, axis_name="data"
  )(params, per_device)
  expected_loss, expected_grads = jax.value_and_grad(_token_loss)(params, batch)
  for device in range(2):
    chex.assert_trees_all_close(loss[device], expected_loss, rtol=1e-5)
    chex.assert_trees_all_close(
      jax.tree.map(lambda g, d=device: g[d], grads),
      expected_grads,
      rtol=1e-5,
      atol=1e-7,
    )


def _count_primitive(jaxpr, name: str) -> int:
  return sum(1 for eqn in jaxpr.eqns if eqn.primitive.name == name)


def test_axis_name_reduces_once_after_the_scan():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  spec = jax.sharding.PartitionSpec
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _mean_loss, 4, axis_name="data"
  )
  sharded = jax.shard_map(
    value_and_grad,
    mesh=mesh,
    in_specs=(spec(), spec("data")),
    out_specs=(spec(), spec()),
    check_vma=False,
  )
  params, batch = _params(), _batch()
  closed = jax.make_jaxpr(sharded)(params, batch)
  (shard_map_eqn,) = [
    e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"
  ]
  body = shard_map_eqn.params["jaxpr"]
  (scan_eqn,) = [e for e in body.eqns if e.primitive.name == "scan"]
  assert _count_primitive(scan_eqn.params["jaxpr"].jaxpr, "psum") == 0
  # One all-reduce per summed leaf (gradients, value sum, weight sum), all
  # after the scan; XLA combines them.
  num_leaves = len(jax.tree.leaves(params)) + 2
  assert _count_primitive(body, "psum") == num_leaves
  assert "psum" not in str(scan_eqn.params["jaxpr"])
  chex.assert_trees_all_close(
    jax.jit(sharded)(params, batch),
    jax.value_and_grad(_mean_loss)(params, batch),
    rtol=1e-5,
    atol=1e-6,
  )


@pytest.mark.parametrize(
  ("bad", "error"),
  [
    (0, ValueError),
    (-2, ValueError),
    (2.0, TypeError),
    (True, TypeError),
    ("4", TypeError),
  ],
)
def test_bad_num_microbatches_is_named(bad, error):
  with pytest.raises(error, match="num_microbatches"):
    ga_optax.microbatched_value_and_grad(_mean_loss, bad)


def test_non_divisible_batch_is_named():
  value_and_grad = ga_optax.microbatched_value_and_grad(_mean_loss, 3)
  with pytest.raises(ValueError, match=r"num_microbatches \(3\)"):
    value_and_grad(_params(), _batch())


def test_leaves_with_different_leading_sizes_are_named():
  batch = {"x": jnp.ones((8, FEATURES)), "y": jnp.ones((4, 4))}
  value_and_grad = ga_optax.microbatched_value_and_grad(_mean_loss, 2)
  with pytest.raises(ValueError, match="batch"):
    jax.jit(value_and_grad)(_params(), batch)


def test_scalar_batch_leaf_is_named():
  value_and_grad = ga_optax.microbatched_value_and_grad(_mean_loss, 2)
  with pytest.raises(ValueError, match="batch leaf"):
    value_and_grad(_params(), {**_batch(), "scale": jnp.ones(())})


def test_non_scalar_weight_is_named():
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _mean_loss, 2, weight_fn=lambda microbatch: microbatch["x"][:, 0]
  )
  with pytest.raises(ValueError, match="weight_fn"):
    value_and_grad(_params(), _batch())


@pytest.mark.parametrize(
  ("kwargs", "name"),
  [
    ({"weight_fn": 3}, "weight_fn"),
    ({"has_aux": 1}, "has_aux"),
    ({"accumulator_dtype": jnp.int32}, "accumulator_dtype"),
    ({"axis_name": 0}, "axis_name"),
    ({"remat": "yes"}, "remat"),
  ],
)
def test_bad_options_are_named(kwargs, name):
  with pytest.raises(TypeError, match=name):
    ga_optax.microbatched_value_and_grad(_mean_loss, 2, **kwargs)


def test_policy_without_remat_is_named():
  with pytest.raises(ValueError, match="checkpoint_policy"):
    ga_optax.microbatched_value_and_grad(
      _mean_loss, 2, checkpoint_policy=jax.checkpoint_policies.dots_saveable
    )


def _mlp_params(width: int = 128, depth: int = 3):
  keys = jax.random.split(jax.random.PRNGKey(4), depth)
  return [
    jax.random.normal(key, (width, width)) / jnp.sqrt(width) for key in keys
  ]


def _mlp_loss(params, batch):
  hidden = batch["x"]
  for weight in params:
    hidden = jax.nn.gelu(hidden @ weight)
  return jnp.mean((hidden.sum(-1) - batch["y"]) ** 2)


def _mlp_batch(size: int, width: int = 128):
  keys = jax.random.split(jax.random.PRNGKey(5), 2)
  return {
    "x": jax.random.normal(keys[0], (size, width)),
    "y": jax.random.normal(keys[1], (size,)),
  }


@pytest.mark.parametrize(
  "policy",
  [
    None,
    jax.checkpoint_policies.dots_saveable,
    jax.checkpoint_policies.nothing_saveable,
  ],
)
def test_remat_gives_the_same_gradients_and_applies_the_policy(policy):
  params, batch = _mlp_params(width=16), _mlp_batch(8, width=16)
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _mlp_loss, 4, remat=True, checkpoint_policy=policy
  )
  chex.assert_trees_all_close(
    jax.jit(value_and_grad)(params, batch),
    ga_optax.microbatched_value_and_grad(_mlp_loss, 4)(params, batch),
    rtol=1e-5,
    atol=1e-6,
  )
  closed = jax.make_jaxpr(value_and_grad)(params, batch)
  (scan_eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
  remats = [
    eqn
    for eqn in scan_eqn.params["jaxpr"].jaxpr.eqns
    if "policy" in eqn.params and "prevent_cse" in eqn.params
  ]
  assert len(remats) == 1
  assert remats[0].params["policy"] is policy


def _temp_bytes(fn, *args) -> int:
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_sixteen_microbatches_use_well_under_a_third_of_the_memory():
  params, batch = _mlp_params(), _mlp_batch(512)
  full = _temp_bytes(jax.value_and_grad(_mlp_loss), params, batch)
  micro = _temp_bytes(
    ga_optax.microbatched_value_and_grad(_mlp_loss, 16), params, batch
  )
  assert micro < full / 3, (micro, full)


def test_rng_differs_across_devices_of_the_axis():
  def dropout_loss(params, batch, *, rng):
    keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
    return jnp.mean(jnp.where(keep, batch["x"] * params["w"], 0.0)), keep

  value_and_grad = ga_optax.microbatched_value_and_grad(
    dropout_loss, 2, has_aux=True, axis_name="data"
  )
  key = jax.random.PRNGKey(3)
  (_, masks), _ = jax.vmap(
    lambda batch: value_and_grad({"w": jnp.ones(8)}, batch, rng=key),
    axis_name="data",
  )({"x": jnp.ones((2, 4, 8))})
  assert masks.shape == (2, 2, 2, 8)
  expected = jnp.stack(
    [
      jnp.stack(
        [
          jax.random.bernoulli(
            jax.random.fold_in(jax.random.fold_in(key, device), index),
            0.5,
            (2, 8),
          )
          for index in range(2)
        ]
      )
      for device in range(2)
    ]
  )
  chex.assert_trees_all_equal(masks, expected)


@pytest.mark.devices(8)
@pytest.mark.parametrize(
  ("path", "num_microbatches"), [("microbatched", 2), ("unreduced", 1)]
)
def test_rng_differs_across_devices_under_plain_jit(path, num_microbatches):
  devices, rows, features = 8, 2, 8  # rows per micro-batch and device
  k = num_microbatches

  def dropout_loss(params, batch, *, rng):
    keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
    return jnp.mean(jnp.where(keep, batch["x"] * params["w"], 0.0)), keep

  if path == "microbatched":
    value_and_grad = ga_optax.microbatched_value_and_grad(
      dropout_loss, k, has_aux=True
    )
  else:
    value_and_grad = ga_optax.unreduced_value_and_grad(
      dropout_loss, has_aux=True
    )

  @jax.jit
  def step(params, batch, key):
    (value, masks), grads = value_and_grad(params, batch, rng=key)
    return value, masks, jax.tree.map(lambda g: jax.reshard(g, P()), grads)

  x = np.random.default_rng(4).normal(size=(devices * k * rows, features))
  batch = {"x": x.astype(np.float32)}
  params = {"w": jnp.linspace(0.5, 1.5, features)}
  key = jax.random.PRNGKey(5)
  with jax.set_mesh(jax.make_mesh((devices,), ("data",))):
    value, masks, grads = step(params, jax.device_put(batch, P("data")), key)
  # Device d holds rows d*k*rows onwards; its micro-batch i, every k-th of
  # them from the i-th, with the key folded by d, then by i.
  pieces = [
    (
      batch["x"][d * k * rows : (d + 1) * k * rows][i::k],
      np.asarray(
        jax.random.bernoulli(
          jax.random.fold_in(jax.random.fold_in(key, d), i),
          0.5,
          (rows, features),
        )
      ),
    )
    for d in range(devices)
    for i in range(k)
  ]
  expected_masks = np.stack([keep for _, keep in pieces])
  assert len({keep.tobytes() for keep in expected_masks}) == devices * k
  chex.assert_trees_all_equal(np.asarray(masks), expected_masks)
  # Every micro-batch weighs the same: the mean of their losses and
  # gradients, d/dw mean(keep * x * w) = sum(keep * x, rows) / (rows * F).
  expected_value = np.mean(
    [np.mean(np.where(keep, x * params["w"], 0.0)) for x, keep in pieces]
  )
  expected_grad = np.mean(
    [np.where(keep, x, 0.0).sum(0) / (rows * features) for x, keep in pieces],
    axis=0,
  )
  helpers.assert_finite_and_close(
    (value, grads), (expected_value, {"w": expected_grad})
  )


# A recurrent loss whose scan carry starts from a constant, under plain jit
# on 8 devices: ga_optax runs it wherever jax.value_and_grad does.

RNN_HIDDEN = 3


def _rnn_params():
  keys = jax.random.split(jax.random.key(10), 2)
  return {
    "w_hidden": jax.random.normal(keys[0], (RNN_HIDDEN, RNN_HIDDEN)) / 3,
    "w_in": jax.random.normal(keys[1], (2, RNN_HIDDEN)),
    "bias": jnp.full((RNN_HIDDEN,), 0.1),
    "scale": jnp.linspace(0.5, 1.5, RNN_HIDDEN),
  }


def _rnn_batch():
  keys = jax.random.split(jax.random.key(11), 2)
  return {
    "x": jax.random.normal(keys[0], (64, 5, 2)),
    "y": jax.random.normal(keys[1], (64,)),
  }


def _rnn_loss(carry_sharding: str):
  """An RNN's mean loss; its carry starts from ``jnp.zeros``.

  ``carry_sharding="none"`` leaves the zeros replicated, as most recurrent
  code does; ``"from_input"`` gives them the sharding of the input's batch
  axis, which Explicit axes need under plain JAX.
  """

  def loss(params, batch):
    inputs = batch["x"]
    shape = (inputs.shape[0], RNN_HIDDEN)
    if carry_sharding == "none":
      hidden = jnp.zeros(shape)
    else:
      batch_axis = jax.typeof(inputs).sharding.spec[0]
      hidden = jnp.zeros(shape, out_sharding=P(batch_axis))

    def step(hidden, x):
      hidden = hidden @ params["w_hidden"] + x @ params["w_in"]
      return jnp.tanh(hidden + params["bias"]) * params["scale"], None

    hidden, _ = jax.lax.scan(step, hidden, jnp.swapaxes(inputs, 0, 1))
    return jnp.mean((hidden.sum(-1) - batch["y"]) ** 2)

  return loss


@pytest.mark.devices(8)
def test_a_constant_scan_carry_runs_on_auto_axes_as_jax_runs_it():
  loss = _rnn_loss("none")
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh):
    batch = jax.device_put(_rnn_batch(), NamedSharding(mesh, P("data")))
    expected = jax.jit(jax.value_and_grad(loss))(_rnn_params(), batch)
    value_and_grad = ga_optax.microbatched_value_and_grad(
      loss, 4, axis_name="data"
    )
    actual = jax.jit(value_and_grad)(_rnn_params(), batch)
  helpers.assert_finite_and_close(actual, expected)
  helpers.assert_finite_and_close(
    actual, jax.value_and_grad(loss)(_rnn_params(), _rnn_batch())
  )


@pytest.mark.devices(8)
@pytest.mark.parametrize("carry_sharding", ["none", "from_input"])
@pytest.mark.parametrize("path", ["microbatched", "unreduced"])
def test_a_constant_scan_carry_on_explicit_axes(path, carry_sharding):
  # Plain JAX rejects the replicated carry against the sharded batch on
  # Explicit axes, and runs the carry given the input's sharding. ga_optax
  # runs both: its loss sees one device's entries.
  loss = _rnn_loss(carry_sharding)
  expected = jax.value_and_grad(_rnn_loss("none"))(_rnn_params(), _rnn_batch())
  mesh = jax.make_mesh((8,), ("data",))
  if path == "microbatched":
    value_and_grad = ga_optax.microbatched_value_and_grad(loss, 4)
  else:
    value_and_grad = ga_optax.unreduced_value_and_grad(loss)

  def step(params, batch):
    value, grads = value_and_grad(params, batch)
    return value, jax.tree.map(lambda grad: jax.reshard(grad, P()), grads)

  with jax.set_mesh(mesh):
    batch = jax.device_put(_rnn_batch(), P("data"))
    if carry_sharding == "none":
      with pytest.raises(TypeError, match="carry"):
        jax.jit(jax.value_and_grad(loss))(_rnn_params(), batch)
    else:
      helpers.assert_finite_and_close(
        jax.jit(jax.value_and_grad(loss))(_rnn_params(), batch), expected
      )
    actual = jax.jit(step)(_rnn_params(), batch)
  helpers.assert_finite_and_close(actual, expected)


@pytest.mark.devices(8)
@pytest.mark.parametrize("path", ["microbatched", "unreduced"])
def test_a_value_traced_in_the_step_is_passed_not_closed_over(path):
  # On Explicit axes each device's micro-batches run in a jax.shard_map,
  # which takes in no value closed over from the step: the error says to
  # pass it after the batch, and passed so it reaches every micro-batch.
  def scaled_loss(params, batch, scale):
    return scale * _rnn_loss("none")(params, batch)

  def scaled_reference(scale):
    loss = functools.partial(scaled_loss, scale=scale)
    return jax.value_and_grad(loss)(_rnn_params(), _rnn_batch())

  make = {
    "microbatched": functools.partial(
      ga_optax.microbatched_value_and_grad, num_microbatches=4
    ),
    "unreduced": ga_optax.unreduced_value_and_grad,
  }[path]

  def passed(params, batch, scale):
    value, grads = make(scaled_loss)(params, batch, scale)
    return value, jax.tree.map(lambda grad: jax.reshard(grad, P()), grads)

  def closed_over(params, batch, scale):
    return make(lambda p, b: scaled_loss(p, b, scale))(params, batch)

  with jax.set_mesh(jax.make_mesh((8,), ("data",))):
    batch = jax.device_put(_rnn_batch(), P("data"))
    scale = jnp.float32(2.5)
    with pytest.raises(ValueError, match="closes over a value traced"):
      jax.jit(closed_over)(_rnn_params(), batch, scale)
    actual = jax.jit(passed)(_rnn_params(), batch, scale)
  helpers.assert_finite_and_close(actual, scaled_reference(2.5))


# A linear model of two outputs (tests/helpers.py), its batch in
# NUM_MICROBATCHES micro-batches.
NUM_MICROBATCHES = 4


def test_explicitly_sharded_batch_without_set_mesh():
  mesh = helpers.one_device_mesh()
  batch = helpers.put(helpers.linear_batch(), mesh, P("data"))
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _elementwise_loss, NUM_MICROBATCHES
  )
  params = helpers.linear_params()["b"]
  try:
    result = value_and_grad(params, batch)
  except ValueError as error:
    # Refusing is fine too, if the message says what to do.
    assert "set_mesh" in str(error)
  else:
    helpers.assert_strictly_close(
      result, jax.value_and_grad(_elementwise_loss)(params, batch)
    )


def _elementwise_loss(scale, batch):
  # No contraction over the sharded batch axis in the forward or backward
  # pass, so that plain JAX differentiates it on an Explicit mesh unset.
  return jnp.mean((batch["y"] * scale - batch["x"][:, :2]) ** 2)


# Weights from weight_fn.


def _weighted_batch(weights: list[Any]) -> dict[str, jax.Array]:
  """A batch whose micro-batch ``i`` carries weight ``weights[i]``.

  Micro-batch ``i`` holds rows ``i, i + k, ...``, so row ``r`` gets the
  weight of micro-batch ``r % k``.
  """
  rows = BATCH // NUM_MICROBATCHES
  batch = helpers.linear_batch()
  batch["weight"] = jnp.asarray(np.tile(np.asarray(weights), rows))
  return batch


def _first_row_weight(microbatch):
  return microbatch["weight"][0]


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
def test_weight_fn_returning_a_bool_is_a_type_error(use_jit):
  value_and_grad = ga_optax.microbatched_value_and_grad(
    helpers.linear_loss, NUM_MICROBATCHES, weight_fn=_first_row_weight
  )
  if use_jit:
    value_and_grad = jax.jit(value_and_grad)
  batch = _weighted_batch([True, False, True, True])
  with pytest.raises(TypeError, match="weight_fn must return a real number"):
    # eval_shape traces without running: the error comes at trace time.
    jax.eval_shape(value_and_grad, helpers.linear_params(), batch)
  with pytest.raises(TypeError, match="weight_fn must return a real number"):
    value_and_grad(helpers.linear_params(), batch)


def test_nonnegative_weights_still_give_the_weighted_mean():
  # A weight of 0 drops its micro-batch and no more (negative weights:
  # tests/test_weights.py, one rule for both paths).
  weights = [3.0, 0.0, 2.0, 1.0]
  value_and_grad = ga_optax.microbatched_value_and_grad(
    helpers.linear_loss, NUM_MICROBATCHES, weight_fn=_first_row_weight
  )
  batch = _weighted_batch(weights)
  per_microbatch = [
    jax.value_and_grad(helpers.linear_loss)(
      helpers.linear_params(),
      jax.tree.map(lambda x, i=i: x[i::NUM_MICROBATCHES], batch),
    )
    for i in range(NUM_MICROBATCHES)
  ]
  expected = jax.tree.map(
    lambda *terms: (
      sum(w * t for w, t in zip(weights, terms, strict=True)) / sum(weights)
    ),
    *per_microbatch,
  )
  helpers.assert_strictly_close(
    value_and_grad(helpers.linear_params(), batch), expected
  )
