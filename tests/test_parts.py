"""The window algebra's laws, for each part and the weight rule.

A part's value over a window must not depend on which device added which
micro-batch: adding them on 8 devices and combining (a sum or a max, over
the devices) gives what adding them all on one gives, and both what NumPy
computes from the definitions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ga_optax._src.algebra import fp8, noise_scale, parts, weights

DEVICES = 8
PER_DEVICE = 2
MICRO_BATCHES = DEVICES * PER_DEVICE

pytestmark = pytest.mark.devices(DEVICES)


def _weights() -> np.ndarray:
  # Positive, zero and negative weights, zeros twice on one device.
  rng = np.random.default_rng(3)
  values = rng.integers(1, 9, MICRO_BATCHES).astype(np.float32)
  values[[1, 4, 5]] = 0.0
  values[[7, 12]] = -2.0
  return values


def _grads() -> np.ndarray:
  return np.random.default_rng(5).standard_normal((MICRO_BATCHES, 4, 3))


def _added(part, grads, weights_, start):
  """The part's value with ``grads[i]`` of weight ``weights_[i]`` added."""
  value = start
  for grad, weight in zip(grads, weights_, strict=True):
    value = part.add(value, parts.MicroBatch.whole({"w": grad}, weight))
  return value


def _on_eight_devices(fn, *arrays):
  """``fn`` on each device's rows of ``arrays``; its value, the same on all."""
  mesh = jax.make_mesh((DEVICES,), ("d",))
  arrays = [
    jax.device_put(jnp.asarray(array), NamedSharding(mesh, P("d")))
    for array in arrays
  ]
  specs = tuple(P("d") for _ in arrays)
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P())
  return jax.jit(mapped)(*arrays)


def _over_devices(part, grads, weights_):
  """Each device adds its own micro-batches; the devices' values combined."""

  def per_device(grads, weights_):
    value = _added(part, grads, weights_, part.zero())
    return parts.across_axes(value, part.combine, "d")

  return _on_eight_devices(per_device, grads.astype(np.float32), weights_)


def test_noise_terms_add_up_the_same_on_one_device_and_on_eight():
  grads, weights_ = _grads(), _weights()
  part = noise_scale.NoiseTermsPart()
  one = _added(part, jnp.asarray(grads, jnp.float32), weights_, part.zero())
  eight = _over_devices(part, grads, weights_)
  counted = weights_ > 0
  expected = (
    np.sum(weights_[counted] * np.sum(grads[counted] ** 2, axis=(1, 2))),
    int(np.sum(counted)),
    float(np.sum(weights_)),
  )
  for value in (one, eight):
    assert np.all(np.isfinite(np.asarray(value.square_sum)))
    np.testing.assert_allclose(value.square_sum, expected[0], rtol=1e-5)
    assert int(value.micro_gradients) == expected[1] == 11
    np.testing.assert_allclose(value.weight, expected[2], rtol=1e-6)


def test_float8_amax_combines_the_same_on_one_device_and_on_eight():
  rng = np.random.default_rng(7)
  start = {
    "input_amax_history": jnp.zeros(3),
    "output_grad_amax_history": jnp.zeros(3),
  }
  amaxes = rng.uniform(0.5, 4.0, (MICRO_BATCHES, 2)).astype(np.float32)
  weights_ = _weights()

  def latest(amax):
    return {
      "input_amax_history": jnp.zeros(3).at[0].set(amax[0]),
      "output_grad_amax_history": jnp.zeros(3).at[0].set(amax[1]),
    }

  part = fp8.Fp8Part(start, reduction="sum")

  def add_all(amaxes, weights_, value):
    for amax, weight in zip(amaxes, weights_, strict=True):
      variables = {
        "params": None,
        fp8.OVERWRITE_WITH_GRADIENT: latest(amax),
      }
      micro_batch = parts.MicroBatch.whole(variables, weight)
      value = part.add(value, micro_batch)
    return value

  one = add_all(jnp.asarray(amaxes), weights_, part.zero())
  eight = _on_eight_devices(
    lambda amaxes, weights_: parts.across_axes(
      add_all(amaxes, weights_, part.zero()), part.combine, "d"
    ),
    amaxes,
    weights_,
  )
  # Forward amaxes count for every micro-batch; an output gradient's only
  # where its weight makes a micro-gradient, scaled by that weight.
  counted = weights_ > 0
  expected_forward = np.max(amaxes[:, 0])
  expected_gradient = np.max(weights_[counted] * amaxes[counted, 1])
  for window in (one, eight):
    combined = window.combined
    assert float(combined["input_amax_history"][0]) == expected_forward
    np.testing.assert_allclose(
      combined["output_grad_amax_history"][0], expected_gradient, rtol=1e-6
    )


def test_the_weight_rule():
  nan = jnp.full(3, jnp.nan)
  # Weight 0 selects zeros: a padding micro-batch's 0 / 0 gradient adds
  # nothing. A negative weight subtracts.
  np.testing.assert_array_equal(weights.weighted(nan, 0.0, jnp.float32), 0.0)
  np.testing.assert_array_equal(
    weights.weighted(jnp.ones(3), -2.0, jnp.float32), -2.0
  )
  # A total of no positive weight has no mean: zeros, never 0 / 0.
  for total in (0.0, -3.0):
    assert float(weights.reciprocal(jnp.float32(total))) == 0.0
    assert float(weights.divisor(jnp.float32(total))) == 1.0
    assert not bool(weights.has_weight(jnp.float32(total)))
  assert float(weights.reciprocal(jnp.float32(4.0))) == 0.25
  assert [bool(weights.counts(w)) for w in (-1.0, 0.0, 0.5)] == [
    False,
    False,
    True,
  ]
  with pytest.raises(ValueError, match="my weight must be finite and >= 0"):
    weights.check(-1.0, "my weight")
  traced = jax.jit(lambda w: weights.check(w, "weight") * 1)(jnp.float32(-1))
  assert float(traced) == -1.0
