"""Meshes, layouts of the params over them, and a plain-jit train step.

Shared by the tests of accumulation under a plain ``jax.jit`` on a mesh
(tests/test_plain_jit_mesh.py, tests/test_zero.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import token_mean_loss, tokens
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax


class Layout(NamedTuple):
  """A mesh, how the batch is split over it and how the params are."""

  shape: tuple[int, ...]
  axes: tuple[str, ...]
  batch_spec: P
  param_specs: dict[str, P]

  @property
  def data_parallel(self) -> int:
    """Devices the batch is split over."""
    batch_axes = self.batch_spec[0]
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    return int(np.prod([self.shape[self.axes.index(a)] for a in batch_axes]))

  def mesh(self, axis_type: AxisType) -> Mesh:
    return jax.make_mesh(
      self.shape, self.axes, axis_types=(axis_type,) * len(self.axes)
    )


REPLICATED = {"w": P(), "b": P(), "scale": P(), "w2": P()}
LAYOUTS = {
  "data": Layout((8,), ("data",), P("data"), REPLICATED),
  "data x model": Layout(
    (4, 2),
    ("data", "model"),
    P("data"),
    {
      "w": P(None, "model"),
      "b": P("model"),
      "scale": P("model"),
      "w2": P("model", None),
    },
  ),
  # The batch over both axes; w sharded over one of them (FSDP).
  "data x fsdp": Layout(
    (4, 2),
    ("data", "fsdp"),
    P(("data", "fsdp")),
    {**REPLICATED, "w": P("fsdp", None)},
  ),
}


def put(tree: Any, mesh: Mesh, specs: Any) -> Any:
  return jax.tree.map(
    lambda leaf, spec: jax.device_put(leaf, NamedSharding(mesh, spec)),
    tree,
    specs,
  )


def per_device_bytes(tree: Any) -> int:
  return sum(
    leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree)
  )


def assert_specs(tree: Any, specs: Any) -> None:
  """Each leaf's sharding is its spec (trailing Nones aside)."""
  for (path, leaf), spec in zip(
    jax.tree_util.tree_flatten_with_path(tree)[0],
    jax.tree.leaves(specs, is_leaf=lambda node: isinstance(node, P)),
    strict=True,
  ):
    want = NamedSharding(leaf.sharding.mesh, spec)
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (
      f"{jax.tree_util.keystr(path)}: {leaf.sharding.spec} is not {spec}"
    )


def unreduced_step(tx: Any, fused: bool):
  """A plain-jit train step: unreduced token-weighted grads accumulated."""
  value_and_grad = ga_optax.unreduced_value_and_grad(
    token_mean_loss, weight_fn=tokens
  )

  def step(params, state, batch, flush):
    _, grads = value_and_grad(params, batch)
    # The micro-batch's real tokens over every device: its weight.
    weight = tokens(batch)
    if fused:
      return tx.apply(params, grads, state, weight=weight, flush=flush)
    updates, state = tx.update(grads, state, params, weight=weight, flush=flush)
    return optax.apply_updates(params, updates), state

  return jax.jit(step)


def run_steps(step, params, state, steps):
  """Runs ``(batch, flush)`` micro-steps under the current mesh."""
  for batch, flush in steps:
    batch = jax.device_put(batch, P("data"))
    params, state = step(params, state, batch, jnp.bool_(flush))
  return params, state


def data_mesh(num_devices: int) -> Mesh:
  """An Explicit "data" axis over the first ``num_devices`` devices."""
  return jax.make_mesh(
    (num_devices,),
    ("data",),
    axis_types=(AxisType.Explicit,),
    devices=jax.devices()[:num_devices],
  )
