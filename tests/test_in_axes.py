"""``in_axes``: micro-batching any batch layout, in every mode.

Each layout (time-major sequences scanned by an LSTM-style cell, a leaf
shared by the whole batch, a PRNG key shared by it, per-entry keys, negative
axes) is compared with ``jax.value_and_grad`` of the whole batch on one
device, on one device and on the 8 simulated devices of tests/conftest.py:
inside ``jax.shard_map``, and under a plain ``jax.jit`` on Explicit and on
Auto mesh axes. The multi-device modes are also read in the compiled HLO:
no gather of the batch and no collective inside the scan, so a leaf whose
batch axis is not 0 keeps its sharding.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src import audits

TIME, BATCH, FEATURES, HIDDEN = 3, 32, 2, 4
K = 2
DEVICES = 8
TOLERANCE = {"rtol": 2e-5, "atol": 2e-6}


def _params() -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(0), 3)
  return {
    "w_in": jax.random.normal(keys[0], (FEATURES, 4 * HIDDEN)) / 2,
    "w_hidden": jax.random.normal(keys[1], (HIDDEN, 4 * HIDDEN)) / 3,
    "bias": jnp.full((4 * HIDDEN,), 0.1),
    "scale": jnp.ones((HIDDEN,)),
    "w_out": jax.random.normal(keys[2], (HIDDEN,)) / 2,
  }


def _lstm_last_hidden(params: Any, inputs: jax.Array) -> jax.Array:
  """An LSTM over time-major ``inputs`` (time, batch, features).

  The carry starts from ``jnp.zeros``, a constant, as recurrent models
  write it.
  """
  batch_size = inputs.shape[1]
  carry = (jnp.zeros((batch_size, HIDDEN)), jnp.zeros((batch_size, HIDDEN)))

  def cell(carry, x):
    hidden, memory = carry
    gates = x @ params["w_in"] + hidden @ params["w_hidden"] + params["bias"]
    i, f, g, o = jnp.split(gates, 4, axis=-1)
    memory = jax.nn.sigmoid(f) * memory + jax.nn.sigmoid(i) * jnp.tanh(g)
    hidden = jax.nn.sigmoid(o) * jnp.tanh(memory) * params["scale"]
    return (hidden, memory), None

  (hidden, _), _ = jax.lax.scan(cell, carry, inputs)
  return hidden


def _time_major_loss(params, batch):
  prediction = _lstm_last_hidden(params, batch["x"]) @ params["w_out"]
  return jnp.mean((prediction - batch["y"]) ** 2)


def _shared_leaf_loss(params, batch):
  # "feature_scale" is one table for the whole batch (in_axes None).
  inputs = batch["x"] * batch["feature_scale"]
  return _time_major_loss(params, {**batch, "x": inputs})


def _shared_key_loss(params, batch):
  # One key for the whole batch: the same weight noise for every entry, so
  # every micro-batch draws what the whole batch draws.
  noise = jax.random.normal(batch["key"], params["w_out"].shape)
  noisy = {**params, "w_out": params["w_out"] + 0.1 * noise}
  return _time_major_loss(noisy, batch)


def _per_entry_key_loss(params, batch):
  # One key per entry, split with the batch: each entry's dropout mask is
  # its own, whichever micro-batch it lands in.
  hidden = _lstm_last_hidden(params, batch["x"])
  keep = jax.vmap(lambda key: jax.random.bernoulli(key, 0.7, (HIDDEN,)))(
    batch["keys"]
  )
  prediction = jnp.where(keep, hidden / 0.7, 0.0) @ params["w_out"]
  return jnp.mean((prediction - batch["y"]) ** 2)


def _batch() -> dict[str, Any]:
  keys = jax.random.split(jax.random.key(1), 3)
  return {
    "x": jax.random.normal(keys[0], (TIME, BATCH, FEATURES)),
    "y": jax.random.normal(keys[1], (BATCH,)),
    "feature_scale": jnp.array([0.5, 2.0]),
    "key": jax.random.key(7),
    "keys": jax.random.split(keys[2], BATCH),
  }


class Case(NamedTuple):
  """A batch layout: the loss, the leaves it reads and their ``in_axes``."""

  loss: Any
  leaves: tuple[str, ...]
  in_axes: Any


CASES = {
  "time_major": Case(_time_major_loss, ("x", "y"), {"x": 1, "y": 0}),
  "negative_axes": Case(_time_major_loss, ("x", "y"), {"x": -2, "y": -1}),
  "shared_leaf": Case(
    _shared_leaf_loss,
    ("x", "y", "feature_scale"),
    {"x": 1, "y": 0, "feature_scale": None},
  ),
  "shared_key": Case(
    _shared_key_loss, ("x", "y", "key"), {"x": 1, "y": 0, "key": None}
  ),
  "per_entry_keys": Case(
    _per_entry_key_loss, ("x", "y", "keys"), {"x": 1, "y": 0, "keys": 0}
  ),
}


def _case_batch(case: Case) -> dict[str, Any]:
  batch = _batch()
  return {name: batch[name] for name in case.leaves}


def _batch_specs(case: Case, batch: dict[str, Any]) -> dict[str, P]:
  """Each leaf's spec: the data axis on its own batch axis."""
  specs = {}
  for name, leaf in batch.items():
    axis = case.in_axes[name]
    if axis is None:
      specs[name] = P()
    else:
      specs[name] = P(*[None] * (axis % jnp.ndim(leaf)), "data")
  return specs


@functools.cache
def _expected(name: str) -> Any:
  case = CASES[name]
  result = jax.jit(jax.value_and_grad(case.loss))(_params(), _case_batch(case))
  chex.assert_tree_all_finite(result)
  return result


def _assert_close(actual: Any, expected: Any) -> None:
  chex.assert_tree_all_finite(actual)
  chex.assert_trees_all_equal_structs(actual, expected)
  chex.assert_trees_all_close(actual, expected, **TOLERANCE)


def _check_no_gather_and_no_collective_in_the_scan(step, *args) -> None:
  module = audits.parse_hlo(step.lower(*args).compile().as_text())
  assert audits.loop_collectives(module) == []
  gathers = [
    collective
    for collective in audits.collectives_in_hlo(module)
    if collective.opcode in ("all-gather", "all-to-all")
  ]
  assert gathers == [], gathers


@pytest.mark.parametrize("name", list(CASES))
def test_one_device(name):
  case = CASES[name]
  value_and_grad = ga_optax.microbatched_value_and_grad(
    case.loss, 4, in_axes=case.in_axes
  )
  _assert_close(
    jax.jit(value_and_grad)(_params(), _case_batch(case)), _expected(name)
  )


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize("name", ["time_major", "shared_leaf", "shared_key"])
def test_inside_shard_map(name):
  case = CASES[name]
  mesh = jax.make_mesh((DEVICES,), ("data",))
  batch = _case_batch(case)
  specs = _batch_specs(case, batch)
  value_and_grad = ga_optax.microbatched_value_and_grad(
    case.loss, K, in_axes=case.in_axes, axis_name="data"
  )
  step = jax.jit(
    jax.shard_map(
      value_and_grad,
      mesh=mesh,
      in_specs=(P(), specs),
      out_specs=(P(), P()),
      check_vma=False,
    )
  )
  batch = jax.tree.map(
    lambda leaf, spec: jax.device_put(leaf, NamedSharding(mesh, spec)),
    batch,
    specs,
  )
  _assert_close(step(_params(), batch), _expected(name))
  _check_no_gather_and_no_collective_in_the_scan(step, _params(), batch)


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize(
  # Negative axes are read before any device is involved: one device tests
  # them.
  "name",
  [name for name in CASES if name != "negative_axes"],
)
def test_plain_jit_on_a_mesh(name, axis_type):
  case = CASES[name]
  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(axis_type,))
  batch = _case_batch(case)
  specs = _batch_specs(case, batch)
  # Explicit axes say where the batch is; Auto axes are named.
  axis_name = "data" if axis_type == AxisType.Auto else None
  value_and_grad = ga_optax.microbatched_value_and_grad(
    case.loss, K, in_axes=case.in_axes, axis_name=axis_name
  )
  with jax.set_mesh(mesh):
    batch = jax.tree.map(
      lambda leaf, spec: jax.device_put(leaf, NamedSharding(mesh, spec)),
      batch,
      specs,
    )
    step = jax.jit(value_and_grad)
    _assert_close(step(_params(), batch), _expected(name))
    _check_no_gather_and_no_collective_in_the_scan(step, _params(), batch)


@pytest.mark.devices(DEVICES)
def test_unreduced_value_and_grad_with_in_axes():
  name = "shared_leaf"
  case = CASES[name]
  mesh = jax.make_mesh((DEVICES,), ("data",))
  batch = _case_batch(case)
  specs = _batch_specs(case, batch)
  value_and_grad = ga_optax.unreduced_value_and_grad(
    case.loss, in_axes=case.in_axes
  )
  with jax.set_mesh(mesh):
    batch = jax.device_put(batch, specs)
    value, grads = jax.jit(value_and_grad)(_params(), batch)
    for leaf in jax.tree.leaves(grads):
      assert jax.typeof(leaf).sharding.spec.unreduced == {"data"}
    grads = jax.tree.map(lambda grad: jax.reshard(grad, P()), grads)
  _assert_close((value, grads), _expected(name))


def _rows_loss(params, batch):
  loss = _time_major_loss(params, batch)
  return loss, {"y_sum": jnp.sum(batch["y"])}


@pytest.mark.devices(DEVICES)
def test_aux_is_stacked_device_major_on_a_mesh():
  # Entry d * k + i: micro-batch i (entries i::k) of device d's share.
  mesh = jax.make_mesh((DEVICES,), ("data",))
  batch = _case_batch(CASES["time_major"])
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _rows_loss, K, has_aux=True, in_axes={"x": 1, "y": 0}
  )
  with jax.set_mesh(mesh):
    sharded = jax.device_put(batch, {"x": P(None, "data"), "y": P("data")})
    (_, aux), _ = jax.jit(value_and_grad)(_params(), sharded)
  shares = np.asarray(batch["y"]).reshape(DEVICES, -1)
  expected = np.stack([shares[:, i::K].sum(-1) for i in range(K)], axis=1)
  np.testing.assert_allclose(aux["y_sum"], expected.reshape(-1), rtol=1e-6)
  assert aux["y_sum"].sharding.spec[0] == "data"


def test_aux_is_stacked_per_microbatch_on_one_device():
  batch = _case_batch(CASES["time_major"])
  (_, aux), _ = ga_optax.microbatched_value_and_grad(
    _rows_loss, 4, has_aux=True, in_axes={"x": 1, "y": 0}
  )(_params(), batch)
  expected = [jnp.sum(batch["y"][i::4]) for i in range(4)]
  chex.assert_trees_all_close(aux["y_sum"], jnp.stack(expected), rtol=1e-6)


def test_a_shared_leaf_is_never_split():
  seen = []

  def loss(params, batch):
    seen.append(jnp.shape(batch["table"]))
    return jnp.mean(batch["x"] @ batch["table"] * params)

  batch = {"x": jnp.ones((8, 3)), "table": jnp.ones((3, 8))}
  ga_optax.microbatched_value_and_grad(
    loss, 4, in_axes={"x": 0, "table": None}
  )(jnp.ones(()), batch)
  assert set(seen) == {(3, 8)}


def test_python_values_may_be_shared_leaves():
  def loss(params, batch):
    assert batch["mode"] == "train"
    return jnp.mean(batch["x"] * params)

  batch = {"x": jnp.arange(8.0), "mode": "train"}
  value, grads = ga_optax.microbatched_value_and_grad(
    loss, 4, in_axes={"x": 0, "mode": None}
  )(jnp.ones(()), batch)
  chex.assert_trees_all_close((value, grads), (3.5, 3.5))


# Leaves not sharded over the batch axes (a mask made in the step, a
# replicated batch with the axes named).


def _masked_loss(params, batch):
  errors = (_lstm_last_hidden(params, batch["x"]) @ params["w_out"]) ** 2
  return jnp.sum(errors * batch["mask"]) / jnp.sum(batch["mask"])


def _masked_batch() -> dict[str, jax.Array]:
  batch = _batch()
  mask = (jnp.arange(BATCH) % 3 != 0).astype(jnp.float32)
  return {"x": batch["x"], "mask": mask}


def _count(microbatch):
  return jnp.sum(microbatch["mask"])


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize("path", ["microbatched", "unreduced"])
def test_a_mask_made_in_the_step_is_split_like_the_batch(path):
  batch = _masked_batch()
  expected = jax.value_and_grad(_masked_loss)(_params(), batch)
  in_axes = {"x": 1, "mask": 0}
  if path == "microbatched":
    value_and_grad = ga_optax.microbatched_value_and_grad(
      _masked_loss, K, weight_fn=_count, in_axes=in_axes
    )
  else:
    value_and_grad = ga_optax.unreduced_value_and_grad(
      _masked_loss, weight_fn=_count, in_axes=in_axes
    )

  def step(params, x):
    # Made here, under Explicit axes: replicated, not sharded like x.
    mask = (jnp.arange(BATCH) % 3 != 0).astype(jnp.float32)
    value, grads = value_and_grad(params, {"x": x, "mask": mask})
    return value, jax.tree.map(lambda grad: jax.reshard(grad, P()), grads)

  mesh = jax.make_mesh((DEVICES,), ("data",))
  with jax.set_mesh(mesh):
    x = jax.device_put(batch["x"], P(None, "data"))
    result = jax.jit(step)(_params(), x)
  _assert_close(result, expected)


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_a_replicated_batch_with_the_axes_named_is_split_over_them(axis_type):
  batch = _masked_batch()
  expected = jax.value_and_grad(_masked_loss)(_params(), batch)
  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(axis_type,))
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _masked_loss,
    K,
    weight_fn=_count,
    in_axes={"x": 1, "mask": 0},
    axis_name="data",
  )
  with jax.set_mesh(mesh):
    replicated = jax.device_put(batch, NamedSharding(mesh, P()))
    step = jax.jit(value_and_grad)
    _assert_close(step(_params(), replicated), expected)
    text = step.lower(_params(), replicated).compile().as_text()
  # Each device computes its own share: B / (k * D) entries per micro-batch.
  shapes = {lhs for lhs, _ in audits.dot_shapes(audits.parse_hlo(text))}
  entries = BATCH // (K * DEVICES)
  assert f"f32[{entries},{FEATURES}]" in shapes, shapes
  assert f"f32[{BATCH // K},{FEATURES}]" not in shapes, shapes


def _row_major_masked_loss(params, batch):
  errors = (jnp.tanh(batch["x"] @ params["w"]) @ params["v"]) ** 2
  return jnp.sum(errors * batch["mask"]) / jnp.sum(batch["mask"])


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize(
  "case", ["mask_made_in_step", "replicated_named", "replicated_unreduced"]
)
def test_leaves_not_sharded_over_the_batch_axes_with_default_in_axes(case):
  # The defect as met: a batch split along axis 0 (in_axes left at its
  # default) with a leaf that is not sharded over the data axis.
  keys = jax.random.split(jax.random.key(5), 3)
  params = {
    "w": jax.random.normal(keys[0], (FEATURES, HIDDEN)),
    "v": jax.random.normal(keys[1], (HIDDEN,)),
  }
  x = jax.random.normal(keys[2], (BATCH, FEATURES))
  mask = (jnp.arange(BATCH) % 3 != 0).astype(jnp.float32)
  expected = jax.value_and_grad(_row_major_masked_loss)(
    params, {"x": x, "mask": mask}
  )
  if case == "replicated_unreduced":
    value_and_grad = ga_optax.unreduced_value_and_grad(
      _row_major_masked_loss, unreduced_axes="data", weight_fn=_count
    )
  else:
    value_and_grad = ga_optax.microbatched_value_and_grad(
      _row_major_masked_loss,
      K,
      weight_fn=_count,
      axis_name="data" if case == "replicated_named" else None,
    )

  def step(params, x):
    # Made here, under Explicit axes: replicated.
    mask = (jnp.arange(BATCH) % 3 != 0).astype(jnp.float32)
    value, grads = value_and_grad(params, {"x": x, "mask": mask})
    return value, jax.tree.map(lambda grad: jax.reshard(grad, P()), grads)

  with jax.set_mesh(jax.make_mesh((DEVICES,), ("data",))):
    spec = P("data") if case == "mask_made_in_step" else P()
    result = jax.jit(step)(params, jax.device_put(x, spec))
  _assert_close(result, expected)


# Bad in_axes: errors that name in_axes and the leaf.


def _loss(params, batch):
  return jnp.mean(batch["x"].sum(-1) * params - batch["y"])


def _simple_batch() -> dict[str, jax.Array]:
  return {"x": jnp.ones((4, 8, 2)), "y": jnp.ones((8,))}


@pytest.mark.parametrize(
  ("in_axes", "match"),
  [
    ({"x": 1}, r"in_axes must be a pytree prefix of batch"),
    ((1, 0), r"in_axes must be a pytree prefix of batch"),
    ({"x": 1, "y": [0]}, r"in_axes must be a pytree prefix of batch"),
    ({"x": 3, "y": 0}, r"in_axes gives axis 3 for batch leaf \['x'\]"),
    ({"x": 1, "y": -2}, r"in_axes gives axis -2 for batch leaf \['y'\]"),
    ({"x": 0, "y": 0}, r"in_axes.*\['x'\]: 4, \['y'\]: 8"),
    (None, r"in_axes splits no leaf of batch"),
  ],
)
def test_bad_in_axes_for_the_batch_are_named(in_axes, match):
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _loss, 2, in_axes=in_axes
  )
  with pytest.raises(ValueError, match=match):
    value_and_grad(jnp.ones(()), _simple_batch())
  with pytest.raises(ValueError, match=match):
    ga_optax.unreduced_value_and_grad(
      _loss, unreduced_axes="data", in_axes=in_axes
    )(jnp.ones(()), _simple_batch())


@pytest.mark.parametrize("in_axes", ["x", 1.0, True, {"x": 1, "y": "0"}])
def test_in_axes_that_are_not_ints_or_none_are_type_errors(in_axes):
  with pytest.raises(TypeError, match="in_axes"):
    ga_optax.microbatched_value_and_grad(_loss, 2, in_axes=in_axes)
  with pytest.raises(TypeError, match="in_axes"):
    ga_optax.unreduced_value_and_grad(_loss, in_axes=in_axes)


def test_a_size_not_divisible_along_the_axis_names_in_axes_and_the_leaf():
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _loss, 3, in_axes={"x": 1, "y": 0}
  )
  with pytest.raises(
    ValueError,
    match=(
      r"batch has 8 entries along its batch axes \(in_axes: \['x'\] axis 1,"
      r" \['y'\] axis 0\), which num_microbatches \(3\) must divide"
    ),
  ):
    value_and_grad(jnp.ones(()), _simple_batch())


@pytest.mark.devices(DEVICES)
def test_a_sharded_batch_names_its_global_size_and_each_devices_share():
  # 64 entries on 8 devices: 8 each, which 3 micro-batches cannot split.
  mesh = jax.make_mesh((DEVICES,), ("data",))
  value_and_grad = ga_optax.microbatched_value_and_grad(_loss, 3)
  batch = {"x": jnp.ones((64, 2)), "y": jnp.ones((64,))}
  with jax.set_mesh(mesh):
    batch = jax.device_put(batch, P("data"))
    with pytest.raises(
      ValueError,
      match=(
        r"batch has 64 entries .*, 8 on each of the 8 devices it is sharded"
        r" over, which num_microbatches \(3\) must divide"
      ),
    ):
      jax.jit(value_and_grad)(jnp.ones(()), batch)


@pytest.mark.devices(DEVICES)
def test_a_batch_the_devices_cannot_share_is_named():
  mesh = jax.make_mesh((DEVICES,), ("data",))
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _loss, 1, axis_name="data"
  )
  batch = {"x": jnp.ones((12, 2)), "y": jnp.ones((12,))}
  with (
    jax.set_mesh(mesh),
    pytest.raises(
      ValueError, match=r"batch has 12 entries .* the 8 devices it is sharded"
    ),
  ):
    jax.jit(value_and_grad)(jnp.ones(()), batch)


@pytest.mark.devices(DEVICES)
def test_inside_shard_map_the_error_names_each_devices_share():
  mesh = jax.make_mesh((DEVICES,), ("data",))
  value_and_grad = ga_optax.microbatched_value_and_grad(
    _loss, 3, axis_name="data"
  )
  step = jax.shard_map(
    value_and_grad,
    mesh=mesh,
    in_specs=(P(), P("data")),
    out_specs=(P(), P()),
    check_vma=False,
  )
  batch = {"x": jnp.ones((64, 2)), "y": jnp.ones((64,))}
  with pytest.raises(
    ValueError,
    match=(
      r"inside the jax.shard_map \(or pmap\) over axis_name \('data',\),"
      r" each device's batch has 8 entries"
    ),
  ):
    jax.jit(step)(
      jnp.ones(()), jax.device_put(batch, NamedSharding(mesh, P("data")))
    )
