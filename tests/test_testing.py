"""The public equivalence helpers of ga_optax.testing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ga_optax import testing


def loss_fn(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


PARAMS = {"w": jnp.zeros(3), "b": jnp.zeros(())}
BATCHES = [
  {"x": jax.random.normal(key, (12, 3)), "y": jnp.arange(12.0) / 12}
  for key in jax.random.split(jax.random.key(0), 3)
]


def test_max_relative_difference_is_per_leaf_and_relative():
  expected = {"a": jnp.array([100.0, 0.0]), "b": jnp.array([1.0])}
  actual = {"a": jnp.array([101.0, 0.0]), "b": jnp.array([1.02])}
  assert testing.max_relative_difference(actual, expected) == pytest.approx(
    0.02
  )
  assert testing.max_relative_difference(expected, expected) == 0.0


def test_max_relative_difference_rejects_other_trees():
  with pytest.raises(ValueError, match="same tree structure"):
    testing.max_relative_difference({"a": jnp.ones(1)}, [jnp.ones(1)])


def test_max_relative_difference_rejects_leaves_of_other_shapes():
  with pytest.raises(
    ValueError, match=r"leaf \['w'\] has shape \(3,\) in actual and \(2, 3\)"
  ):
    testing.max_relative_difference(
      {"b": jnp.ones(2), "w": jnp.ones(3)},
      {"b": jnp.ones(2), "w": jnp.ones((2, 3))},
    )


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
  ("actual", "expected"),
  [
    ([NAN, 1.0], [1.0, 1.0]),
    ([1.0, 1.0], [NAN, 1.0]),
    ([INF, 1.0], [1.0, 1.0]),
    ([1.0, 1.0], [-INF, 1.0]),
    ([INF, 1.0], [-INF, 1.0]),
    ([NAN, 1.0], [INF, 1.0]),
    ([NAN, 1.0], [1.0, NAN]),
  ],
)
def test_unmatched_non_finite_values_differ_infinitely(actual, expected):
  ok = {"ok": jnp.ones(2)}
  difference = testing.max_relative_difference(
    {**ok, "w": np.array(actual)}, {**ok, "w": np.array(expected)}
  )
  assert difference == float("inf")


def test_matched_non_finite_values_are_equal_and_left_out():
  expected = np.array([NAN, INF, -INF, 2.0, 1.0])
  actual = np.array([NAN, INF, -INF, 2.02, 1.0])
  # The infinities take no part in the scale: 0.02 / 2.
  assert testing.max_relative_difference(
    {"w": actual}, {"w": expected}
  ) == pytest.approx(0.01)
  assert (
    testing.max_relative_difference(
      {"w": np.array([NAN, -INF])}, {"w": np.array([NAN, -INF])}
    )
    == 0.0
  )


@pytest.mark.parametrize("use_jit", [True, False])
def test_compare_returns_both_runs(use_jit):
  result = testing.compare_with_large_batch(
    loss_fn, optax.sgd(0.1), PARAMS, BATCHES, 3, use_jit=use_jit
  )
  assert result.max_relative_difference < 1e-6
  # The large-batch run is what three plain SGD steps give.
  params = PARAMS
  for batch in BATCHES:
    grads = jax.grad(loss_fn)(params, batch)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  for name in params:
    np.testing.assert_allclose(
      result.large_batch_params[name], params[name], rtol=1e-6
    )


def test_assert_raises_when_the_runs_differ():
  # Equal weights for micro-batches of 1 and 11 samples are not the large
  # batch's mean.
  with pytest.raises(AssertionError, match="max relative difference"):
    testing.assert_equivalent_to_large_batch(
      loss_fn, optax.sgd(0.1), PARAMS, BATCHES, [1, 11], weight_fn=lambda b: 1
    )


def test_sum_reduction_uses_unit_weights():
  def sum_loss(params, batch):
    return jnp.sum((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

  testing.assert_equivalent_to_large_batch(
    sum_loss, optax.sgd(0.01), PARAMS, BATCHES, [5, 7], reduction="sum"
  )


@pytest.mark.parametrize("sizes", [5, 0, [4, 4], [6, 0, 6], [13, -1]])
def test_bad_microbatch_sizes(sizes):
  with pytest.raises(ValueError, match="micro_batch_sizes"):
    testing.compare_with_large_batch(
      loss_fn, optax.sgd(0.1), PARAMS, BATCHES, sizes
    )


@pytest.mark.parametrize(
  "sizes",
  [np.int64(4), np.int32(4), [np.int64(5), np.int64(7)], np.array([5, 7])],
  ids=["np.int64", "np.int32", "list of np.int64", "int array"],
)
def test_numpy_microbatch_sizes(sizes):
  result = testing.compare_with_large_batch(
    loss_fn, optax.sgd(0.1), PARAMS, BATCHES, sizes
  )
  assert result.max_relative_difference < 1e-6


@pytest.mark.parametrize(
  "sizes",
  [True, np.bool_(True), 4.0, "12", [True, 11], [6.0, 6.0], [6, None]],
)
def test_microbatch_sizes_of_other_types(sizes):
  with pytest.raises(TypeError, match="micro_batch_sizes"):
    testing.compare_with_large_batch(
      loss_fn, optax.sgd(0.1), PARAMS, BATCHES, sizes
    )


def masked_mean_loss(params, batch, *, safe=False):
  """The mean squared error over the real (unmasked) tokens."""
  errors = (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2
  count = jnp.sum(batch["mask"])
  return jnp.sum(batch["mask"] * errors) / (
    jnp.maximum(count, 1) if safe else count
  )


def test_assert_catches_nan_from_a_micro_batch_of_padding_only():
  # The last 4 of 12 sequences are padding only: that micro-batch's loss is
  # 0 / 0, so its gradient, and with it the accumulated params, are NaN,
  # while the large batch (which has real tokens) is finite.
  keys = jax.random.split(jax.random.key(1), 3)
  batch = {
    "x": jax.random.normal(keys[0], (12, 5, 3)),
    "y": jax.random.normal(keys[1], (12, 5)),
    "mask": jnp.concatenate(
      [(jax.random.uniform(keys[2], (8, 5)) < 0.7), jnp.zeros((4, 5), bool)]
    ).astype(jnp.float32),
  }
  result = testing.compare_with_large_batch(
    masked_mean_loss, optax.sgd(0.1), PARAMS, [batch], 3
  )
  assert np.isnan(result.accumulated_params["w"]).all()
  assert np.isfinite(result.large_batch_params["w"]).all()
  assert result.max_relative_difference == float("inf")

  with pytest.raises(
    AssertionError,
    match=r"difference inf > rtol 1e-05 at params leaf \['b'\]: the"
    r" accumulated params hold 1 NaN and 0 infinite values there, the"
    r" large-batch params 0 NaN and 0 infinite",
  ):
    testing.assert_equivalent_to_large_batch(
      masked_mean_loss, optax.sgd(0.1), PARAMS, [batch], 3
    )

  # The fix: a loss that is 0 on padding only, weighted by real tokens.
  testing.assert_equivalent_to_large_batch(
    lambda params, batch: masked_mean_loss(params, batch, safe=True),
    optax.sgd(0.1),
    PARAMS,
    [batch],
    3,
    weight_fn=lambda microbatch: jnp.sum(microbatch["mask"]),
  )


def test_assert_names_the_leaf_that_differs_most():
  with pytest.raises(AssertionError, match=r"at params leaf \['(w|b)'\]\.$"):
    testing.assert_equivalent_to_large_batch(
      loss_fn, optax.sgd(0.1), PARAMS, BATCHES, [1, 11], weight_fn=lambda b: 1
    )


def test_no_batches():
  with pytest.raises(ValueError, match="batches must hold at least one"):
    testing.compare_with_large_batch(loss_fn, optax.sgd(0.1), PARAMS, [], 2)


def test_batches_with_unequal_leading_sizes():
  batch = {"x": jnp.ones((4, 3)), "y": jnp.ones(5)}
  with pytest.raises(ValueError, match="share one leading"):
    testing.compare_with_large_batch(
      loss_fn, optax.sgd(0.1), PARAMS, [batch], 2
    )


class AttentionBlock(nnx.Module):
  """Self-attention and a linear read-out: a transformer block's core."""

  def __init__(self, rngs: nnx.Rngs):
    self.attn = nnx.MultiHeadAttention(
      num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=rngs
    )
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(self.attn(x))[..., 0].mean(axis=-1)


ATTENTION_GRAPHDEF, ATTENTION_PARAMS = nnx.split(AttentionBlock(nnx.Rngs(0)))
ATTENTION_BATCHES = [
  {
    "x": jax.random.normal(key, (8, 5, 8)),
    "y": jax.random.normal(jax.random.fold_in(key, 1), (8,)),
  }
  for key in jax.random.split(jax.random.key(1), 3)
]
KEY_BIAS = "['attn']['key']['bias'].value"


def attention_loss(params, batch):
  model = nnx.merge(ATTENTION_GRAPHDEF, params)
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def is_key_bias(path: str) -> bool:
  return path.endswith("['key']['bias'].value")


def test_attention_key_bias_cannot_be_judged_by_the_default():
  # The key bias's gradient is float noise (softmax ignores a shift shared
  # by every key), and AdamW turns it into full-size steps in both runs.
  grads = jax.jit(jax.grad(attention_loss))(
    ATTENTION_PARAMS, ATTENTION_BATCHES[0]
  )
  assert float(jnp.max(jnp.abs(grads["attn"]["key"]["bias"][...]))) < 1e-6
  assert float(jnp.max(jnp.abs(grads["attn"]["key"]["kernel"][...]))) > 1e-2
  with pytest.raises(
    AssertionError,
    match=r"at params leaf \['attn'\]\['key'\]\['bias'\]\.value\.$",
  ):
    testing.assert_equivalent_to_large_batch(
      attention_loss, optax.adamw(1e-2), ATTENTION_PARAMS, ATTENTION_BATCHES, 4
    )


def test_exclude_leaves_out_only_the_key_bias():
  result = testing.assert_equivalent_to_large_batch(
    attention_loss,
    optax.adamw(1e-2),
    ATTENTION_PARAMS,
    ATTENTION_BATCHES,
    [2, 6],
    exclude=is_key_bias,
  )
  assert result.excluded == (KEY_BIAS,)
  for params in (result.accumulated_params, result.large_batch_params):
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))
  # The key bias does differ, far beyond rounding; every other leaf agrees.
  assert (
    testing.max_relative_difference(
      result.accumulated_params, result.large_batch_params
    )
    > 1e-2
  )
  assert result.max_relative_difference < 1e-5


def test_exclude_does_not_hide_a_wrong_weighting():
  # Micro-batches of 2 and 6 samples weighted equally are not the large
  # batch's mean: the leaves still judged say so.
  with pytest.raises(
    AssertionError,
    match=r"at params leaf \['(attn|out)'\]\S* \(exclude left out 1 of"
    r" 10 leaves\)\.$",
  ) as failure:
    testing.assert_equivalent_to_large_batch(
      attention_loss,
      optax.adamw(1e-2),
      ATTENTION_PARAMS,
      ATTENTION_BATCHES,
      [2, 6],
      weight_fn=lambda microbatch: 1,
      exclude=is_key_bias,
    )
  assert KEY_BIAS not in str(failure.value)


def test_an_excluded_leaf_still_fails_on_a_nan():
  expected = {"b": np.array([1e-9]), "w": np.ones(2)}
  actual = {"b": np.array([NAN]), "w": np.ones(2)}
  exclude = lambda path: path == "['b']"  # noqa: E731
  assert testing.max_relative_difference(
    actual, expected, exclude=exclude
  ) == float("inf")
  assert (
    testing.max_relative_difference(
      {**actual, "b": np.array([-1e-9])}, expected, exclude=exclude
    )
    == 0.0
  )


@pytest.mark.parametrize(
  ("exclude", "error", "message"),
  [
    (lambda path: "bias" in path, ValueError, "matched no leaf"),
    (lambda path: True, ValueError, "matched every leaf"),
    (["['b']"], TypeError, "exclude must be a function of a leaf's path"),
  ],
  ids=["matches nothing", "matches everything", "a list of paths"],
)
def test_bad_exclude(exclude, error, message):
  with pytest.raises(error, match=message):
    testing.max_relative_difference(PARAMS, PARAMS, exclude=exclude)
  # Before any training.
  with pytest.raises(error, match=message):
    testing.compare_with_large_batch(
      loss_fn, optax.sgd(0.1), PARAMS, BATCHES, 3, exclude=exclude
    )


def test_a_large_batch_run_that_diverges_is_no_reference():
  def loss_fn(w, batch):
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

  batch = {"x": jnp.arange(16.0).reshape(8, 2), "y": jnp.ones(8)}
  # Both runs overflow to the same infinities and NaNs, and agree.
  with pytest.raises(AssertionError, match="diverged"):
    testing.assert_equivalent_to_large_batch(
      loss_fn, optax.sgd(1e30), jnp.ones(2), [batch] * 4, 4
    )


# A scalar batch leaf is shared by every micro-batch.


def scaled_loss(params, batch):
  return batch["scale"] * loss_fn(params, batch)


@pytest.mark.parametrize(
  "scale", [jnp.float32(2.0), 2.0, np.float32(2.0)], ids=type
)
def test_a_scalar_batch_leaf_is_shared_by_every_micro_batch(scale):
  batches = [{**batch, "scale": scale} for batch in BATCHES]
  sizes = [5, 7]
  result = testing.compare_with_large_batch(
    scaled_loss, optax.sgd(0.1), PARAMS, batches, sizes
  )
  # The references: plain SGD on each large batch, and on the size-weighted
  # mean of its two micro-batches' gradients, each seeing the scale.
  large, accumulated = PARAMS, PARAMS
  for batch in batches:
    grads = jax.grad(scaled_loss)(large, batch)
    large = jax.tree.map(lambda p, g: p - 0.1 * g, large, grads)
    first = {**batch, "x": batch["x"][:5], "y": batch["y"][:5]}
    second = {**batch, "x": batch["x"][5:], "y": batch["y"][5:]}
    mean_grads = jax.tree.map(
      lambda a, b: (5 * a + 7 * b) / 12,
      jax.grad(scaled_loss)(accumulated, first),
      jax.grad(scaled_loss)(accumulated, second),
    )
    accumulated = jax.tree.map(
      lambda p, g: p - 0.1 * g, accumulated, mean_grads
    )
  for name in PARAMS:
    assert np.all(np.isfinite(result.accumulated_params[name]))
    np.testing.assert_allclose(
      result.large_batch_params[name], large[name], rtol=1e-6
    )
    np.testing.assert_allclose(
      result.accumulated_params[name], accumulated[name], rtol=1e-5, atol=1e-7
    )
  # The scale reached the micro-batches: without it the step is halved.
  unscaled = jax.tree.map(
    lambda p, g: p - 0.1 * g, PARAMS, jax.grad(loss_fn)(PARAMS, BATCHES[0])
  )
  assert not np.allclose(result.large_batch_params["w"], unscaled["w"])


def test_a_batch_of_scalars_only_is_refused():
  batch = {"x": jnp.float32(1.0), "y": 2.0}
  with pytest.raises(ValueError, match=r"batches: .*got only scalars"):
    testing.compare_with_large_batch(
      lambda params, batch: jnp.sum(params["w"]) * batch["x"],
      optax.sgd(0.1),
      PARAMS,
      [batch],
      1,
    )


# rtol is held exactly.


def test_a_difference_just_above_rtol_fails():
  # With micro-batches of one row, SGD on w * mean(x)**2 steps by the mean of
  # x_i**2 instead of the mean of x squared: a known, finite difference.
  def square_mean_loss(params, batch):
    return params["w"] * jnp.mean(batch["x"]) ** 2

  rows = np.array([1.0, 1.2])
  learning_rate, start = 0.1, 1.0
  large = start - learning_rate * rows.mean() ** 2
  accumulated = start - learning_rate * np.mean(rows**2)
  difference = abs(accumulated - large) / abs(large)
  batches = [{"x": jnp.asarray(rows, jnp.float32)}]
  params = {"w": jnp.float32(start)}

  result = testing.compare_with_large_batch(
    square_mean_loss, optax.sgd(learning_rate), params, batches, 2
  )
  np.testing.assert_allclose(
    result.max_relative_difference, difference, rtol=1e-3
  )
  with pytest.raises(AssertionError, match="max relative difference"):
    testing.assert_equivalent_to_large_batch(
      square_mean_loss,
      optax.sgd(learning_rate),
      params,
      batches,
      2,
      rtol=difference / 1.05,
    )
  testing.assert_equivalent_to_large_batch(
    square_mean_loss,
    optax.sgd(learning_rate),
    params,
    batches,
    2,
    rtol=difference * 1.05,
  )


# A Flax NNX model goes in as it is.


class DropoutClassifier(nnx.Module):
  """A model with state besides its parameters: its dropout RNG stream."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(3, 8, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, deterministic=True, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(self.dropout(jnp.tanh(self.hidden(x))))[:, 0]


def model_loss(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("use_jit", [True, False])
def test_an_nnx_model_goes_in_directly(use_jit):
  model = DropoutClassifier(nnx.Rngs(0))
  before = jax.tree.map(
    np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))
  )
  sizes = [4, 8]
  result = testing.assert_equivalent_to_large_batch(
    model_loss, optax.sgd(0.1), model, BATCHES, sizes, use_jit=use_jit
  )

  # The references, in plain JAX on the parameter state.
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def params_loss(params, batch):
    return model_loss(nnx.merge(graphdef, params, rest, copy=True), batch)

  def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  large, accumulated = params, params
  for batch in BATCHES:
    large = sgd(large, jax.grad(params_loss)(large, batch))
    first = jax.tree.map(lambda leaf: leaf[:4], batch)
    second = jax.tree.map(lambda leaf: leaf[4:], batch)
    accumulated = sgd(
      accumulated,
      jax.tree.map(
        lambda a, b: (4 * a + 8 * b) / 12,
        jax.grad(params_loss)(accumulated, first),
        jax.grad(params_loss)(accumulated, second),
      ),
    )
  assert result.max_relative_difference < 1e-5
  for got, want in [
    (result.large_batch_params, large),
    (result.accumulated_params, accumulated),
  ]:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for got_leaf, want_leaf in zip(
      jax.tree.leaves(got), jax.tree.leaves(want), strict=True
    ):
      assert np.all(np.isfinite(got_leaf))
      np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=1e-7)
  # Training moved the parameters, and left the model passed in as it was.
  assert not np.allclose(
    large["out"]["kernel"][...], params["out"]["kernel"][...]
  )
  after = jax.tree.map(
    np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))
  )
  jax.tree.map(np.testing.assert_array_equal, after, before)


def test_an_nnx_model_is_judged_by_its_parameter_paths():
  # The paths exclude= sees are those of the model's nnx.Param state.
  result = testing.assert_equivalent_to_large_batch(
    lambda model, batch: jnp.mean((model(batch["x"]) - batch["y"]) ** 2),
    optax.sgd(0.1),
    AttentionBlock(nnx.Rngs(0)),
    ATTENTION_BATCHES,
    4,
    exclude=is_key_bias,
  )
  assert result.excluded == (KEY_BIAS,)
  assert result.max_relative_difference < 1e-5
