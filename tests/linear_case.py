"""A small linear model, its batch, and a one-device mesh, for tests.

Two outputs from three inputs, a batch of :data:`BATCH` rows, parameters and
rows drawn from fixed seeds; :func:`assert_finite_and_close` is the
comparison its tests make.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

BATCH = 16


def assert_finite_and_close(actual: Any, expected: Any) -> None:
  """Equal trees, shapes and dtypes, finite values within float32 rounding.

  chex compares NaN equal to NaN; finiteness is asserted first so that two
  NaN results never pass as equal.
  """
  chex.assert_trees_all_equal_shapes_and_dtypes(actual, expected)
  chex.assert_tree_all_finite(actual)
  chex.assert_tree_all_finite(expected)
  chex.assert_trees_all_close(actual, expected, rtol=1e-5, atol=1e-6)


def real(shape: tuple[int, ...], seed: int) -> jax.Array:
  """Standard normal values of ``shape`` from ``seed``."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def loss(params: Any, batch: Any) -> jax.Array:
  """The mean squared error of the linear model on ``batch``."""
  prediction = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((prediction - batch["y"]) ** 2)


def params() -> dict[str, jax.Array]:
  return {"w": real((3, 2), seed=0), "b": real((2,), seed=1)}


def batch(seed: int = 2) -> dict[str, jax.Array]:
  return {"x": real((BATCH, 3), seed), "y": real((BATCH, 2), seed + 1)}


def one_device_mesh() -> jax.sharding.Mesh:
  """A mesh of this machine's first device, over axis ``"data"``."""
  return jax.make_mesh((1,), ("data",))


def put(tree: Any, mesh: jax.sharding.Mesh, spec: PartitionSpec) -> Any:
  """``tree`` laid out on ``mesh`` as ``spec`` says.

  jax.make_mesh makes Explicit axes: shard_map's inputs must already be laid
  out as its in_specs say.
  """
  return jax.device_put(tree, NamedSharding(mesh, spec))
