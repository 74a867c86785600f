"""The wrapped optimizer's state sharded over mesh axes (ZeRO stage 1).

The checks on 8 devices (numbers against the large batch, the state's
shards, the compiled HLO, orbax checkpoints) live in tests/zero_cases.py
and run in one fresh process; here, the arguments' errors and a one-device
mesh, in this process.
"""

from __future__ import annotations

from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from absl.testing import parameterized
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_distributed import run_on_8_devices

import ga_optax

CASES = Path(__file__).resolve().parent / "zero_cases.py"
PARAMS = {"w": jnp.arange(8.0).reshape(2, 4) / 10, "b": jnp.array([0.5, -0.5])}


def one_device_mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))


def loss_fn(params, batch):
  prediction = jnp.tanh(batch["x"] @ params["w"].T + params["b"])
  return jnp.mean((prediction - batch["y"]) ** 2)


def batch(seed: int) -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(seed))
  return {
    "x": jax.random.normal(keys[0], (4, 4)),
    "y": jax.random.normal(keys[1], (4, 2)),
  }


def test_the_checks_on_8_devices():
  output = run_on_8_devices(str(CASES), timeout=600)
  assert "checkpoint: consolidated on 8 devices, resumed on 2" in output


class OneDeviceMeshTest(parameterized.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
    (
      "clip_adamw",
      optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2)),
    ),
    # Its row and column statistics are split along different dimensions.
    ("adafactor", optax.adafactor(1e-2, min_dim_size_to_factor=2)),
  )
  def test_equal_to_the_replicated_state(self, inner):
    value_and_grad = jax.jit(ga_optax.unreduced_value_and_grad(loss_fn))
    with jax.set_mesh(one_device_mesh()):
      results = []
      for inner_state_axes in (None, "data"):
        tx = ga_optax.accumulate(
          inner, 2, unreduced_axes="data", inner_state_axes=inner_state_axes
        )
        update = self.variant(tx.update)
        params, state = PARAMS, tx.init(PARAMS)
        for seed in range(6):
          _, grads = value_and_grad(
            params, jax.device_put(batch(seed), P("data"))
          )
          updates, state = update(grads, state, params)
          params = optax.apply_updates(params, updates)
        results.append((params, state.inner_state))
    chex.assert_tree_all_finite(results)
    chex.assert_trees_all_close(*results, rtol=1e-6, atol=1e-7)
    for leaf in jax.tree.leaves(results[1][1]):
      assert leaf.ndim == 0 or leaf.sharding.spec[0] == "data", leaf.sharding


@pytest.mark.parametrize(
  "make", [ga_optax.accumulate, ga_optax.accumulate_and_apply]
)
def test_inner_state_axes_needs_unreduced_axes(make):
  with pytest.raises(ValueError, match=r"inner_state_axes.*unreduced_axes"):
    make(optax.adam(1e-3), 4, inner_state_axes="data")
  with pytest.raises(ValueError, match=r"inner_state_axes.*unreduced_axes"):
    make(optax.adam(1e-3), 4, axis_name="data", inner_state_axes="data")


@pytest.mark.parametrize("wrong", [3, ["data", 1], [P(), "data"], {}])
def test_inner_state_axes_of_a_wrong_type(wrong):
  with pytest.raises(TypeError, match="inner_state_axes"):
    ga_optax.accumulate(
      optax.adam(1e-3), 4, unreduced_axes="data", inner_state_axes=wrong
    )


def test_inner_state_axes_must_be_explicit_axes_of_the_mesh():
  tx = ga_optax.accumulate(
    optax.adam(1e-3), 4, unreduced_axes="data", inner_state_axes="model"
  )
  with (
    jax.set_mesh(one_device_mesh()),
    pytest.raises(ValueError, match=r"inner_state_axes.*'model'"),
  ):
    tx.init(PARAMS)


def test_a_spec_tree_needs_the_params_structure():
  tx = ga_optax.accumulate(
    optax.adam(1e-3), 4, unreduced_axes="data", inner_state_axes={"w": P()}
  )
  with (
    jax.set_mesh(one_device_mesh()),
    pytest.raises(ValueError, match=r"inner_state_axes.*tree structure"),
  ):
    tx.init(PARAMS)


def test_update_needs_the_params():
  tx = ga_optax.accumulate(
    optax.sgd(1e-3), 1, unreduced_axes="data", inner_state_axes="data"
  )
  value_and_grad = jax.jit(ga_optax.unreduced_value_and_grad(loss_fn))
  with jax.set_mesh(one_device_mesh()):
    _, grads = value_and_grad(PARAMS, jax.device_put(batch(0), P("data")))
    with pytest.raises(ValueError, match="inner_state_axes needs the params"):
      tx.update(grads, tx.init(PARAMS))
