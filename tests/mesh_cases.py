"""Accumulation under plain ``jax.jit`` on a mesh, on 8 simulated devices.

JAX's default multi-device workflow: ``jax.make_mesh`` (Explicit axes) or a
mesh of Auto axes, ``jax.set_mesh``, a batch put with ``P("data")`` and a
plain ``jax.jit`` step. Each check compares the numbers with one device's
large batch and reads the compiled HLO for where the collectives run and
how many rows each device computes. Run by tests/test_mesh.py, one process
per group of checks: ``python tests/mesh_cases.py <group>``.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax import testing

TOLERANCE = {"rtol": 2e-5, "atol": 2e-6}
IN, HIDDEN, OUT = 16, 64, 4


def init_params(seed: int = 0) -> dict[str, jax.Array]:
  """A layer with a bias and a normalisation scale: the hard cases."""
  keys = jax.random.split(jax.random.key(seed), 2)
  return {
    "w": jax.random.normal(keys[0], (IN, HIDDEN)) / 4,
    "b": jnp.full((HIDDEN,), 0.1, jnp.float32),
    "scale": jnp.ones((HIDDEN,)),
    "w2": jax.random.normal(keys[1], (HIDDEN, OUT)) / 8,
  }


def forward(params: Any, x: jax.Array) -> jax.Array:
  h = x @ params["w"] + params["b"]
  mean = h.mean(-1, keepdims=True)
  variance = ((h - mean) ** 2).mean(-1, keepdims=True)
  h = (h - mean) * jax.lax.rsqrt(variance + 1e-5) * params["scale"]
  return jnp.tanh(h) @ params["w2"]


def mean_loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
  return jnp.mean((forward(params, batch["x"]) - batch["y"]) ** 2)


def make_batch(size: int, seed: int) -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(seed), 2)
  return {
    "x": jax.random.normal(keys[0], (size, IN)),
    "y": jax.random.normal(keys[1], (size, OUT)),
  }


class Layout(NamedTuple):
  """A mesh, how the batch is split over it and how the params are."""

  name: str
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  batch_spec: P
  param_specs: dict[str, P]

  @property
  def data_parallel(self) -> int:
    """Devices the batch is split over."""
    batch_axes = self.batch_spec[0]
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    return int(
      np.prod([self.shape[self.axes.index(axis)] for axis in batch_axes])
    )

  def mesh(self, axis_type: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh(
      self.shape, self.axes, axis_types=(axis_type,) * len(self.axes)
    )


REPLICATED = {"w": P(), "b": P(), "scale": P(), "w2": P()}
LAYOUTS = {
  "data": Layout("data", (8,), ("data",), P("data"), REPLICATED),
  "data x model": Layout(
    "data x model",
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
    "data x fsdp",
    (4, 2),
    ("data", "fsdp"),
    P(("data", "fsdp")),
    {**REPLICATED, "w": P("fsdp", None)},
  ),
}


def put(tree: Any, mesh: jax.sharding.Mesh, specs: Any) -> Any:
  return jax.tree.map(
    lambda leaf, spec: jax.device_put(leaf, NamedSharding(mesh, spec)),
    tree,
    specs,
  )


def per_device_bytes(tree: Any) -> int:
  return sum(
    leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree)
  )


def smallest_per_device_leaf(tree: Any) -> int:
  return min(
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


def check_audit(
  text: str,
  layout: Layout,
  params: Any,
  rows: int,
  *,
  reductions_after_loop: int,
) -> list[testing.Collective]:
  """The HLO facts of a micro-batched step; returns the collectives."""
  module = testing.parse_hlo(text)
  everywhere = testing.collectives_in_hlo(module)
  in_loops = testing.loop_collectives(module)
  param_sized = smallest_per_device_leaf(params)
  # Every device computes its own rows of every micro-batch.
  first_layer = [
    lhs for lhs, _ in testing.dot_shapes(module) if lhs.endswith(f",{IN}]")
  ]
  assert first_layer and set(first_layer) == {f"f32[{rows},{IN}]"}, first_layer
  # No parameter-sized collective per micro-batch (a model axis adds small
  # ones for its activations), and no gather of the batch anywhere.
  if "model" in layout.axes:
    moved = sum(c.operand_bytes for c in in_loops)
    assert moved < per_device_bytes(params) / 2, in_loops
  else:
    assert in_loops == [], in_loops
  gathers = [c for c in everywhere if c.opcode == "all-gather"]
  if "fsdp" in layout.axes:
    # FSDP: w's shard is gathered once per call, not per micro-batch.
    w_shard = params["w"].addressable_shards[0].data.nbytes
    assert [c.operand_bytes for c in gathers] == [w_shard], gathers
  else:
    assert gathers == [], gathers
  # After the loop: the gradients (with the value and weight sums) summed
  # over the batch axes once.
  after = [
    c
    for c in everywhere
    if c not in in_loops
    and c.opcode == "all-reduce"
    and c.operand_bytes >= param_sized
  ]
  assert len(after) == reductions_after_loop, after
  assert all(c.operand_bytes >= per_device_bytes(params) for c in after), after
  return after


def check_microbatched(axis_type: AxisType) -> None:
  """Numbers, shardings and HLO of micro-batching on each layout."""
  batch_size, k = 128, 4
  params = init_params()
  batch = make_batch(batch_size, seed=1)
  expected = jax.value_and_grad(mean_loss)(params, batch)
  for layout in LAYOUTS.values():
    mesh = layout.mesh(axis_type)
    with jax.set_mesh(mesh):
      sharded_params = put(params, mesh, layout.param_specs)
      sharded_batch = jax.device_put(
        batch, NamedSharding(mesh, layout.batch_spec)
      )
      # Explicit axes say where the batch is; Auto axes are named.
      axis_name = None
      if axis_type == AxisType.Auto:
        axis_name = layout.batch_spec[0]
      step = jax.jit(
        ga_optax.microbatched_value_and_grad(mean_loss, k, axis_name=axis_name)
      )
      value, grads = step(sharded_params, sharded_batch)
      chex.assert_trees_all_close((value, grads), expected, **TOLERANCE)
      if axis_type == AxisType.Explicit:
        assert_specs(grads, layout.param_specs)
      text = step.lower(sharded_params, sharded_batch).compile().as_text()
      rows = batch_size // (k * layout.data_parallel)
      found = check_audit(
        text, layout, sharded_params, rows, reductions_after_loop=1
      )
      print(f"{axis_type.name} {layout.name}: {rows} rows, after loop:", found)


def check_microbatched_options() -> None:
  """has_aux, weight_fn, rng and remat on a sharded batch (Explicit)."""
  batch_size, k = 64, 4
  params = init_params()
  batch = make_batch(batch_size, seed=2)
  # Token weights: the last rows are padding.
  batch["mask"] = (jnp.arange(batch_size) % 5 != 0).astype(jnp.float32)

  def masked_loss(params, batch, rng=None):
    error = ((forward(params, batch["x"]) - batch["y"]) ** 2).mean(-1)
    if rng is not None:
      keep = jax.random.bernoulli(rng, 0.9, error.shape)
      error = jnp.where(keep, error / 0.9, 0.0)
    loss = (error * batch["mask"]).sum() / jnp.maximum(batch["mask"].sum(), 1)
    return loss, {"rows": batch["mask"].sum()}

  def tokens(microbatch):
    return microbatch["mask"].sum()

  mesh = LAYOUTS["data"].mesh(AxisType.Explicit)
  expected_loss, expected_grads = jax.value_and_grad(
    lambda p: masked_loss(p, batch)[0]
  )(params)
  with jax.set_mesh(mesh):
    sharded_batch = jax.device_put(batch, P("data"))
    for remat in (False, True):
      step = jax.jit(
        ga_optax.microbatched_value_and_grad(
          masked_loss, k, has_aux=True, weight_fn=tokens, remat=remat
        )
      )
      (value, aux), grads = step(params, sharded_batch)
      chex.assert_trees_all_close(value, expected_loss, **TOLERANCE)
      chex.assert_trees_all_close(grads, expected_grads, **TOLERANCE)
      # One entry per device and micro-batch, device major, over "data".
      assert aux["rows"].shape == (8 * k,), aux["rows"].shape
      assert float(aux["rows"].sum()) == float(batch["mask"].sum())
      assert aux["rows"].sharding.spec[0] == "data", aux["rows"].sharding
      device_rows = np.asarray(batch["mask"]).reshape(8, -1)
      per_micro = device_rows.reshape(8, -1, k).sum(1).reshape(-1)
      np.testing.assert_array_equal(np.asarray(aux["rows"]), per_micro)

    # rng: each device and micro-batch draws its own mask, reproducibly.
    step = jax.jit(
      ga_optax.microbatched_value_and_grad(
        masked_loss, k, has_aux=True, weight_fn=tokens
      )
    )
    first = step(params, sharded_batch, rng=jax.random.key(3))
    again = step(params, sharded_batch, rng=jax.random.key(3))
    other = step(params, sharded_batch, rng=jax.random.key(4))
    chex.assert_trees_all_equal(first, again)
    assert not np.array_equal(first[1]["w"], other[1]["w"])
    assert np.isfinite(first[0][0]), first[0]
  print("has_aux, weight_fn, remat and rng on a sharded batch")


def check_flax_models() -> None:
  """Flax nnx Linear + LayerNorm and Linen Dense, Explicit data axis."""
  from flax import linen, nnx

  batch_size, k = 64, 4
  batch = make_batch(batch_size, seed=5)

  class NnxModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.linear = nnx.Linear(IN, HIDDEN, rngs=rngs)
      self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)
      self.out = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
      return self.out(jnp.tanh(self.norm(self.linear(x))))

  graphdef, state = nnx.split(NnxModel(nnx.Rngs(0)))

  def nnx_loss(state, batch):
    model = nnx.merge(graphdef, state)
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  class LinenModel(linen.Module):
    @linen.compact
    def __call__(self, x):
      x = linen.Dense(HIDDEN)(x)
      x = linen.LayerNorm()(x)
      return linen.Dense(OUT)(jnp.tanh(x))

  linen_model = LinenModel()
  variables = linen_model.init(jax.random.key(1), batch["x"][:1])

  def linen_loss(variables, batch):
    predictions = linen_model.apply(variables, batch["x"])
    return jnp.mean((predictions - batch["y"]) ** 2)

  mesh = LAYOUTS["data"].mesh(AxisType.Explicit)
  for name, loss, params in (
    ("nnx", nnx_loss, state),
    ("linen", linen_loss, variables),
  ):
    expected = jax.value_and_grad(loss)(params, batch)
    with jax.set_mesh(mesh):
      sharded_batch = jax.device_put(batch, P("data"))
      step = jax.jit(ga_optax.microbatched_value_and_grad(loss, k))
      chex.assert_trees_all_close(
        step(params, sharded_batch), expected, **TOLERANCE
      )
      module = testing.parse_hlo(
        step.lower(params, sharded_batch).compile().as_text()
      )
      assert testing.loop_collectives(module) == []
      reductions = testing.collectives_in_hlo(module)
      assert [c.opcode for c in reductions] == ["all-reduce"], reductions
    print(f"{name}: one all-reduce after the scan,", reductions)


def large_batch_run(inner, params, windows):
  """One device, one inner update per window of micro-batches."""
  state = inner.init(params)
  for window in windows:
    batch = jax.tree.map(lambda *rows: jnp.concatenate(rows), *window)
    updates, state = inner.update(
      jax.grad(mean_loss)(params, batch), state, params
    )
    params = optax.apply_updates(params, updates)
  return params


def accumulation_step(tx, fused: bool):
  """A plain-jit train step: unreduced grads into the accumulator."""
  value_and_grad = ga_optax.unreduced_value_and_grad(mean_loss)

  def step(params, state, batch):
    _, grads = value_and_grad(params, batch)
    if fused:
      return tx.apply(params, grads, state)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step)


def run_steps(step, params, state, batches):
  for batch in batches:
    params, state = step(params, state, jax.device_put(batch, P("data")))
  return params, state


def check_accumulate_unreduced() -> None:
  """accumulate(unreduced_axes=...): exact, one all-reduce per window."""
  k, windows = 4, 3
  params = init_params()
  batches = [make_batch(64, seed=10 + i) for i in range(k * windows)]
  inner = optax.adam(optax.linear_schedule(1e-2, 1e-3, windows))
  expected = large_batch_run(
    inner, params, [batches[i : i + k] for i in range(0, len(batches), k)]
  )
  for layout in (LAYOUTS["data"], LAYOUTS["data x model"]):
    mesh = layout.mesh(AxisType.Explicit)
    for fused in (False, True):
      make = ga_optax.accumulate_and_apply if fused else ga_optax.accumulate
      tx = make(inner, k, unreduced_axes="data")
      with jax.set_mesh(mesh):
        sharded_params = put(params, mesh, layout.param_specs)
        state = jax.jit(tx.init)(sharded_params)
        accumulator = state.accumulator
        for leaf in jax.tree.leaves(accumulator):
          assert ga_optax._src.sharding.unreduced_axes_of(leaf) == {"data"}
        step = accumulation_step(tx, fused)
        final, state = run_steps(step, sharded_params, state, batches)
        chex.assert_trees_all_close(final, expected, **TOLERANCE)
        # Params keep their sharding; the inner state is sharded like them.
        assert_specs(final, layout.param_specs)
        assert_specs(state.inner_state[0].mu, layout.param_specs)
        text = step.lower(final, state, jax.device_put(batches[0], P("data")))
        found = testing.window_collectives(text.compile().as_text())
      # Per micro-step: the loss value's scalar sum, and on a model axis
      # the model's own activation sums; nothing parameter-sized.
      if "model" in layout.axes:
        moved = sum(c.operand_bytes for c in found.every_micro_step)
        assert moved < per_device_bytes(final) / 2, found
      else:
        assert all(c.operand_bytes <= 8 for c in found.every_micro_step), found
      closing = [c for c in found.window_closing if c.operand_bytes > 8]
      assert [c.opcode for c in closing] == ["all-reduce"], found
      assert closing[0].operand_bytes == per_device_bytes(final), found
      print(
        f"accumulate fused={fused} {layout.name}: per micro-step",
        found.every_micro_step,
        "closing",
        found.window_closing,
      )


def check_mid_window_checkpoints() -> None:
  """Mid-window states saved with orbax, resumed here and on 2 devices."""
  import tempfile

  import orbax.checkpoint as ocp

  k = 4
  params = init_params()
  batches = [make_batch(64, seed=20 + i) for i in range(2 * k)]
  tx = ga_optax.accumulate(optax.adam(1e-2), k, unreduced_axes="data")
  directory = tempfile.mkdtemp()
  layout = LAYOUTS["data x model"]
  mesh = layout.mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    start = put(params, mesh, layout.param_specs)
    step = accumulation_step(tx, fused=False)
    expected, _ = run_steps(step, start, tx.init(start), batches)
    middle, state = run_steps(step, start, tx.init(start), batches[: k + 2])
    with ocp.StandardCheckpointer() as checkpointer:
      stacked = ga_optax.stack_partial_sums(state)
      checkpointer.save(f"{directory}/stacked", (middle, stacked))
      checkpointer.save(
        f"{directory}/total", (middle, ga_optax.consolidate(state))
      )
      restored = checkpointer.restore(f"{directory}/stacked", (middle, stacked))
    resumed = (
      restored[0],
      ga_optax.unstack_partial_sums(
        restored[1], jax.eval_shape(tx.init, start)
      ),
    )
    final, _ = run_steps(step, *resumed, batches[k + 2 :])
    chex.assert_trees_all_equal(final, expected)
    print("stacked partial sums: resumed bit-identically on the same mesh")
    saved_on_8 = jax.tree.map(np.asarray, stacked)

  small = jax.make_mesh(
    (2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
  )
  with jax.set_mesh(small):
    start = put(params, small, REPLICATED)
    like = tx.init(start)
    step = accumulation_step(tx, fused=False)
    with ocp.StandardCheckpointer() as checkpointer:
      middle, total = checkpointer.restore(
        f"{directory}/total", (start, ga_optax.consolidate(like))
      )
    for state in (
      ga_optax.split_total(total, like),
      ga_optax.unstack_partial_sums(jax.device_put(saved_on_8, P()), like),
    ):
      final, _ = run_steps(step, middle, state, batches[k + 2 :])
      chex.assert_trees_all_close(final, expected, **TOLERANCE)
  print("consolidated and folded partial sums: resumed on 2 devices")


def check_boundary_resume_on_other_devices() -> None:
  """A window boundary saved on 8 devices with k=1 resumes on 2 with k=4."""
  global_batch, windows = 64, 4
  params = init_params()
  data = [make_batch(global_batch, seed=50 + i) for i in range(windows)]
  inner = optax.adam(optax.linear_schedule(1e-2, 1e-3, windows))
  expected = large_batch_run(inner, params, [[batch] for batch in data])

  def train(num_devices, params, state, batches):
    mesh = jax.make_mesh(
      (num_devices,),
      ("data",),
      axis_types=(AxisType.Explicit,),
      devices=jax.devices()[:num_devices],
    )
    plan = ga_optax.elastic_plan(global_batch, num_devices, (8,))
    tx = ga_optax.accumulate(
      inner, plan.num_microbatches, unreduced_axes="data"
    )
    rows = plan.micro_batch_size * num_devices
    with jax.set_mesh(mesh):
      params = put(params, mesh, REPLICATED)
      like = tx.init(params)
      # The accumulator is unreduced even at a boundary: it goes through
      # consolidate and split_total like any saved state.
      state = like if state is None else ga_optax.split_total(state, like)
      step = accumulation_step(tx, fused=False)
      for batch in batches:
        micro = [
          jax.tree.map(lambda leaf, i=i: leaf[i : i + rows], batch)
          for i in range(0, global_batch, rows)
        ]
        params, state = run_steps(step, params, state, micro)
      assert int(state.micro_step) == 0
      # What a checkpoint holds: host arrays.
      return jax.tree.map(np.asarray, (params, ga_optax.consolidate(state)))

  middle, state = train(8, params, None, data[:2])
  final, _ = train(2, middle, state, data[2:])
  chex.assert_trees_all_close(final, expected, **TOLERANCE)
  print("window boundary: 8 devices with k=1, then 2 devices with k=4")


def check_shard_map_consolidate() -> None:
  """Inside shard_map: consolidate on 8 devices, split_total on 2."""
  k = 4
  params = init_params()
  batches = [make_batch(64, seed=30 + i) for i in range(2 * k)]
  inner = optax.adam(1e-2)
  expected = large_batch_run(inner, params, [batches[:k], batches[k:]])
  tx = ga_optax.accumulate(inner, k, axis_name="data")

  def device_step(params, state, batch, resume, save):
    if resume:
      state = ga_optax.split_total(state, axis_name="data")
    grads = jax.grad(mean_loss)(params, batch)
    # Weighted by the device's rows: the global mean on any device count.
    rows = batch["x"].shape[0]
    updates, state = tx.update(grads, state, params, weight=rows)
    if save:
      state = ga_optax.consolidate(state, axis_name="data")
    return optax.apply_updates(params, updates), state

  def run(num_devices, params, state, batches, resume_first, save_last):
    mesh = jax.make_mesh(
      (num_devices,), ("data",), devices=jax.devices()[:num_devices]
    )
    for index, batch in enumerate(batches):
      step = jax.jit(
        jax.shard_map(
          lambda p, s, b, index=index: device_step(
            p,
            s,
            b,
            resume=resume_first and index == 0,
            save=save_last and index == len(batches) - 1,
          ),
          mesh=mesh,
          in_specs=(P(), P(), P("data")),
          out_specs=(P(), P()),
          check_vma=False,
        )
      )
      params, state = step(
        params, state, jax.device_put(batch, NamedSharding(mesh, P("data")))
      )
    return params, state

  middle, saved = run(8, params, tx.init(params), batches[: k + 2], False, True)
  # What a checkpoint holds: host arrays, placed anew on the 2 devices.
  middle, saved = jax.tree.map(np.asarray, (middle, saved))
  final, _ = run(2, middle, saved, batches[k + 2 :], True, False)
  chex.assert_trees_all_close(final, expected, **TOLERANCE)
  print("shard_map: consolidated on 8 devices, resumed on 2")


def check_shard_map_check_vma() -> None:
  """accumulate(axis_name=...) in a shard_map with check_vma=True."""
  k = 4
  params = init_params()
  batches = [make_batch(64, seed=60 + i) for i in range(2 * k)]
  inner = optax.adam(1e-2)
  expected = large_batch_run(inner, params, [batches[:k], batches[k:]])
  tx = ga_optax.accumulate(inner, k, axis_name="data")
  mesh = jax.make_mesh((8,), ("data",))

  def device_step(params, state, batch):
    # Unvarying params: autodiff sums each gradient over the devices, and
    # the window must not sum it again.
    grads = jax.grad(mean_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(
    jax.shard_map(
      device_step,
      mesh=mesh,
      in_specs=(P(), P(), P("data")),
      out_specs=(P(), P()),
    )
  )
  state = tx.init(params)
  current = params
  for batch in batches:
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    current, state = step(current, state, batch)
  chex.assert_trees_all_close(current, expected, **TOLERANCE)

  def local_step(params, state, batch):
    local = jax.lax.pcast(params, "data", to="varying")
    return tx.update(jax.grad(mean_loss)(local, batch), state, params)

  try:
    jax.jit(
      jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(P(), P(), P("data")),
        out_specs=(P(), P()),
      )
    )(params, tx.init(params), batch)
  except ValueError as error:
    assert "check_vma=False" in str(error), error
  else:
    raise AssertionError("varying grads under check_vma=True were accepted")
  print("shard_map with check_vma=True: summed once; varying grads refused")


def check_clear_errors() -> None:
  """Mismatched sharding types are named errors, never ShardingTypeError."""
  params = init_params()
  batch = make_batch(64, seed=40)
  explicit = LAYOUTS["data"].mesh(AxisType.Explicit)
  auto = LAYOUTS["data"].mesh(AxisType.Auto)

  def expect(error, match, fn, *args):
    try:
      fn(*args)
    except error as raised:
      assert match in str(raised), (match, str(raised))
      return
    raise AssertionError(f"expected {error.__name__} matching {match!r}")

  tx = ga_optax.accumulate(optax.sgd(0.1), 4, unreduced_axes="data")
  with jax.set_mesh(explicit):
    sharded = jax.device_put(batch, P("data"))
    state = tx.init(params)
    replicated = jax.jit(jax.grad(mean_loss))(params, sharded)
    expect(ValueError, "unreduced_axes", jax.jit(tx.update), replicated, state)
    expect(
      ValueError,
      "unreduced_axes",
      ga_optax.accumulate(optax.sgd(0.1), 4, unreduced_axes="model").init,
      params,
    )
    # axis_name is for steps inside shard_map: init may run outside it,
    # a micro-step under a plain jit may not.
    shard_map_tx = ga_optax.accumulate(optax.sgd(0.1), 4, axis_name="data")
    outside = shard_map_tx.init(params)
    expect(
      ValueError, "axis_name", jax.jit(shard_map_tx.update), replicated, outside
    )
  with jax.set_mesh(auto):
    expect(ValueError, "Explicit", tx.init, params)
    expect(
      ValueError,
      "Explicit",
      ga_optax.unreduced_value_and_grad(mean_loss, "data"),
      params,
      jax.device_put(batch, NamedSharding(auto, P("data"))),
    )
  print("mismatched sharding types: named ValueErrors")


CHECKS = {
  "microbatched_explicit": lambda: check_microbatched(AxisType.Explicit),
  "microbatched_auto": lambda: check_microbatched(AxisType.Auto),
  "microbatched_options": check_microbatched_options,
  "flax": check_flax_models,
  "accumulate_unreduced": check_accumulate_unreduced,
  "checkpoints": check_mid_window_checkpoints,
  "boundary_resume": check_boundary_resume_on_other_devices,
  "shard_map_consolidate": check_shard_map_consolidate,
  "errors": check_clear_errors,
  "check_vma": check_shard_map_check_vma,
}


if __name__ == "__main__":
  for group in sys.argv[1:]:
    CHECKS[group]()
