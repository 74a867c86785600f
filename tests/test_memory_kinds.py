"""Tests of state kept in host memory: accumulator_memory_kind and friends.

Every claim is read off the arrays themselves: the memory kind of every
leaf (``leaf.sharding.memory_kind``) after ``init`` and after each call,
eager, jitted and jitted with donated state, and numbers equal bit for bit to
the run that keeps everything in device memory. The CPU backend offers
``pinned_host``, so all of this runs without an accelerator.

Checks that could take the process down (donated buffers) or need several
devices run this file as a script in a process of their own:
``python tests/test_memory_kinds.py CASE``.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import cpu_process_environment
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src.placements import residency
from ga_optax._src.planning import device_memory
from ga_optax._src.window import window_form

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOST = "pinned_host"
K = 3
# (accumulator_memory_kind, inner_state_memory_kind)
PLACEMENTS = [(HOST, None), (None, HOST), (HOST, HOST)]


def _params() -> dict[str, jax.Array]:
  return {"w": jnp.arange(12.0).reshape(3, 4) / 10, "b": jnp.zeros(4)}


def _grads(step: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(step)
  return {
    "w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
  }


def _optimizer() -> optax.GradientTransformation:
  return optax.adamw(optax.linear_schedule(1e-2, 1e-3, 4))


def _kinds(tree: Any) -> set[str]:
  return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def assert_placed(state: Any, accumulator_kind: Any, inner_kind: Any) -> None:
  """Every accumulator and inner-state leaf is where it was asked to live."""
  state = ga_optax._src.window.state.find_state(state)
  assert _kinds(state.accumulator) == {accumulator_kind or "device"}
  assert _kinds(state.inner_state) == {inner_kind or "device"}
  counters = (state.micro_step, state.update_step, state.weight_sum)
  assert _kinds(counters) == {"device"}


def assert_finite(tree: Any) -> None:
  """NaN equals NaN for chex's equality: the runs compared must be finite."""
  assert all(
    bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(tree)
  )


def _calls() -> list[dict[str, Any]]:
  """Two windows of K, weights included, then a flushed partial window."""
  calls = [
    {"grads": _grads(i), "weight": float(i % 3 + 1), "flush": False}
    for i in range(2 * K + 1)
  ]
  calls[-1]["flush"] = True
  return calls


def _run(tx, mode: str, check=None):
  """Runs _calls() through ``tx``; returns every call's (updates, state)."""
  params = _params()

  def step(state, call, params):
    return tx.update(
      call["grads"], state, params, weight=call["weight"], flush=call["flush"]
    )

  if mode == "jit":
    step = jax.jit(step)
  state = jax.jit(tx.init)(params) if mode == "jit" else tx.init(params)
  results = []
  for call in _calls():
    updates, state = step(state, call, params)
    if check is not None:
      check(state)
    results.append((updates, state))
  return results


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_init_puts_the_state_in_its_memory_kind(mode, placement):
  tx = ga_optax.accumulate(
    _optimizer(),
    K,
    accumulator_memory_kind=placement[0],
    inner_state_memory_kind=placement[1],
  )
  init = jax.jit(tx.init) if mode == "jit" else tx.init
  state = init(_params())
  assert_placed(state, *placement)
  chex.assert_trees_all_equal(
    state, ga_optax.accumulate(_optimizer(), K).init(_params())
  )


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_update_keeps_the_state_there_and_the_numbers(mode, placement):
  tx = ga_optax.accumulate(
    _optimizer(),
    K,
    accumulator_memory_kind=placement[0],
    inner_state_memory_kind=placement[1],
  )
  results = _run(tx, mode, check=lambda state: assert_placed(state, *placement))
  expected = _run(ga_optax.accumulate(_optimizer(), K), mode)
  assert_finite(expected)
  chex.assert_trees_all_equal(results, expected)
  updates = [updates for updates, _ in results]
  assert _kinds(updates) == {"device"}
  # The run did apply updates: a flushed window and two full ones.
  assert int(results[-1][1].update_step) == 3
  assert all(bool(jnp.any(u["w"] != 0)) for u in updates[K - 1 :: K])


def test_fused_path_keeps_the_state_there_and_the_numbers():
  def run(**kinds):
    fused = ga_optax.accumulate_and_apply(_optimizer(), K, **kinds)
    apply = jax.jit(fused.apply)
    params, state = _params(), fused.init(_params())
    history = []
    for call in _calls():
      params, state = apply(
        params, call["grads"], state, weight=call["weight"], flush=call["flush"]
      )
      history.append((params, state))
      if kinds:
        assert_placed(state, HOST, HOST)
    return history

  expected = run()
  assert_finite(expected)
  chex.assert_trees_all_equal(
    run(accumulator_memory_kind=HOST, inner_state_memory_kind=HOST), expected
  )


@pytest.mark.parametrize("path", ["accumulate", "accumulate_and_apply"])
def test_host_memory_matches_the_large_batch(path):
  """The anchor: host-memory state against ``jax.grad`` of each window.

  The runs above compare ga_optax with ga_optax; this one compares it with
  the bare optimizer stepped once per window on the gradient of the
  window's whole batch. SGD with momentum is linear in the gradient (a
  wrong scale shows) and keeps a state to place in host memory; the
  windows hold unequal numbers of rows, the last one flushed.
  """
  optimizer = optax.sgd(0.1, momentum=0.5)
  kinds = {"accumulator_memory_kind": HOST, "inner_state_memory_kind": HOST}
  rng = np.random.default_rng(5)
  sizes = [[1, 4, 2], [3, 3, 4], [2, 1]]
  windows = [
    [
      {
        "x": jnp.asarray(rng.normal(size=(size, 3)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(size, 4)), jnp.float32),
      }
      for size in window
    ]
    for window in sizes
  ]

  def loss(params, batch):
    prediction = batch["x"] @ params["w"] + params["b"]
    return jnp.mean(((prediction - batch["y"]) ** 2).sum(-1))

  if path == "accumulate":
    tx = ga_optax.accumulate(optimizer, K, **kinds)

    def step(params, state, batch, flush):
      grads = jax.grad(loss)(params, batch)
      updates, state = tx.update(
        grads, state, params, weight=batch["x"].shape[0], flush=flush
      )
      return optax.apply_updates(params, updates), state

    init = tx.init
  else:
    fused = ga_optax.accumulate_and_apply(optimizer, K, **kinds)

    def step(params, state, batch, flush):
      grads = jax.grad(loss)(params, batch)
      return fused.apply(
        params, grads, state, weight=batch["x"].shape[0], flush=flush
      )

    init = fused.init
  step = jax.jit(step)
  params = _params()
  state = init(params)
  expected, opt_state = _params(), optimizer.init(_params())
  for window in windows:
    for index, batch in enumerate(window):
      flush = len(window) < K and index == len(window) - 1
      params, state = step(params, state, batch, flush)
      assert_placed(state, HOST, HOST)
    large_batch = jax.tree.map(lambda *rows: jnp.concatenate(rows), *window)
    grads = jax.grad(loss)(expected, large_batch)
    updates, opt_state = optimizer.update(grads, opt_state, expected)
    expected = optax.apply_updates(expected, updates)
    assert_finite((params, expected))
    chex.assert_trees_all_close(params, expected, rtol=1e-5, atol=1e-6)
  assert int(state.update_step) == len(windows)


def test_inside_optax_chain():
  def run(**kinds):
    tx = optax.chain(
      optax.clip_by_global_norm(1.0),
      ga_optax.accumulate(_optimizer(), K, **kinds),
    )
    return _run(
      tx, "jit", check=lambda s: assert_placed(s, HOST, HOST) if kinds else None
    )

  chex.assert_trees_all_equal(
    run(accumulator_memory_kind=HOST, inner_state_memory_kind=HOST), run()
  )


def test_flax_train_state_and_nnx_optimizer():
  train_state = pytest.importorskip("flax.training.train_state")
  nnx = pytest.importorskip("flax.nnx")
  x = jnp.ones((4, 3))

  def train_state_run(**kinds):
    state = train_state.TrainState.create(
      apply_fn=None,
      params={"w": jnp.ones((3, 2))},
      tx=ga_optax.accumulate(_optimizer(), 2, **kinds),
    )
    step = jax.jit(
      lambda state, x: state.apply_gradients(
        grads=jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(state.params)
      )
    )
    for i in range(4):
      state = step(state, x * i)
      if kinds:
        assert_placed(state.opt_state, HOST, HOST)
    return state

  def nnx_run(**kinds):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
      model, ga_optax.accumulate(_optimizer(), 2, **kinds), wrt=nnx.Param
    )

    @nnx.jit
    def step(model, optimizer, x):
      grads = nnx.grad(lambda model: jnp.mean(model(x) ** 2))(model)
      optimizer.update(model, grads)

    for i in range(4):
      step(model, optimizer, x * i)
    if kinds:
      assert_placed(optimizer.opt_state, HOST, HOST)
    return nnx.state(model)

  host = {"accumulator_memory_kind": HOST, "inner_state_memory_kind": HOST}
  chex.assert_trees_all_equal(
    train_state_run(**host).params, train_state_run().params
  )
  chex.assert_trees_all_equal(nnx_run(**host), nnx_run())


def test_sharded_params_keep_their_spec_in_host_memory():
  mesh = jax.make_mesh((1,), ("data",))
  specs = {"w": P(None, "data"), "b": P("data")}
  params = jax.tree.map(
    lambda leaf, spec: jax.device_put(leaf, NamedSharding(mesh, spec)),
    _params(),
    specs,
  )
  tx = ga_optax.accumulate(
    _optimizer(), 2, accumulator_memory_kind=HOST, inner_state_memory_kind=HOST
  )
  with jax.set_mesh(mesh):
    state = tx.init(params)
    for _ in range(2):
      _, state = jax.jit(tx.update)(_grads(0), state, params)
  for name, spec in specs.items():
    for leaf in (state.accumulator[name], state.inner_state[0].mu[name]):
      assert leaf.sharding == NamedSharding(mesh, spec, memory_kind=HOST)
  assert int(state.update_step) == 1
  # Scalars of the state follow the params onto the mesh.
  count = state.inner_state[0].count
  assert count.sharding == NamedSharding(mesh, P(), memory_kind=HOST)


def test_orbax_restores_into_the_same_memory_kind(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = ga_optax.accumulate(
    _optimizer(), K, accumulator_memory_kind=HOST, inner_state_memory_kind=HOST
  )
  params = _params()
  state = tx.init(params)
  _, state = tx.update(_grads(0), state, params)  # mid-window
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored = checkpointer.restore(tmp_path / "state", target)
  assert_placed(restored, HOST, HOST)
  chex.assert_trees_all_equal(restored, state)
  chex.assert_trees_all_equal(
    tx.update(_grads(1), restored, params), tx.update(_grads(1), state, params)
  )


@pytest.mark.parametrize(
  ("argument", "kind"),
  [("accumulator_memory_kind", "hbm"), ("inner_state_memory_kind", "cpu")],
)
def test_an_unknown_kind_names_the_argument_and_the_offered_kinds(
  argument, kind
):
  offered = [m.kind for m in jax.devices()[0].addressable_memories()]
  for make in (ga_optax.accumulate, ga_optax.accumulate_and_apply):
    with pytest.raises(ValueError, match=argument) as error:
      make(optax.sgd(0.1), 2, **{argument: kind})
    assert all(
      repr(offered_kind) in str(error.value) for offered_kind in offered
    )


def test_a_kind_jit_cannot_keep_is_refused_clearly():
  if "unpinned_host" not in residency.offered_kinds():
    pytest.skip("the device offers no unpinned_host memory")
  with pytest.raises(ValueError, match=r"accumulator_memory_kind.*pinned_host"):
    ga_optax.accumulate(
      optax.sgd(0.1), 2, accumulator_memory_kind="unpinned_host"
    )


@pytest.mark.parametrize("kind", [1, b"pinned_host", jax.memory.Space.Host])
def test_a_kind_that_is_not_a_string_is_a_type_error(kind):
  with pytest.raises(TypeError, match="inner_state_memory_kind"):
    ga_optax.accumulate(optax.sgd(0.1), 2, inner_state_memory_kind=kind)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_state_in_another_memory_kind_is_refused(mode):
  on_device = ga_optax.accumulate(optax.adam(0.1), 2)
  on_host = ga_optax.accumulate(
    optax.adam(0.1), 2, accumulator_memory_kind=HOST
  )
  params = _params()
  update = jax.jit(on_host.update) if mode == "jit" else on_host.update
  with pytest.raises(
    ValueError, match=r"state.accumulator\['b'\] is in 'device'"
  ):
    update(_grads(0), on_device.init(params), params)
  update = jax.jit(on_device.update) if mode == "jit" else on_device.update
  with pytest.raises(ValueError, match="accumulator_memory_kind=None"):
    update(_grads(0), on_host.init(params), params)


def test_donation_unreduced_axes_and_axis_name_with_host_memory():
  """In one fresh process on 8 devices: donated state (single device),
  unreduced_axes under plain jit and axis_name under shard_map."""
  run_case("donation", "several_devices", devices=8)


def _loss_fn(params, batch):
  hidden = jnp.tanh(batch["x"] @ params["w1"])
  return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def _planner_inputs():
  params = {"w1": jnp.ones((64, 256)), "w2": jnp.ones((256, 8))}
  batch = {"x": jnp.ones((1, 64)), "y": jnp.ones((1, 8))}
  return params, batch


def test_micro_step_bytes_leave_out_what_lives_on_the_host():
  params, batch = _planner_inputs()
  param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))

  def measure(**kinds):
    return ga_optax.planning.micro_step_bytes(
      _loss_fn, params, batch, 4, optimizer=optax.adam(1e-3), **kinds
    )

  on_device = measure()
  accumulator_on_host = measure(accumulator_memory_kind=HOST)
  both_on_host = measure(
    accumulator_memory_kind=HOST, inner_state_memory_kind=HOST
  )
  if jax.default_backend() != "cpu":
    pytest.skip("exact on CPU only, where the moves compile to no copies")
  # Exactly the offloaded state leaves the device, where both programs
  # schedule their device work alike. In the CPU's conditional form, jax
  # 0.12's XLA:CPU (unlike 0.10's) runs w1's gradient product before it adds
  # w2's gradient into the host accumulator, so w2's gradient (8192 bytes)
  # is a device temporary of that program alone: the audit counts it.
  one_gradient_held = (
    jax.__version_info__ >= (0, 12)
    and window_form.form_for("cpu") == window_form.CONDITIONAL
  )
  expected = param_bytes - (params["w2"].nbytes if one_gradient_held else 0)
  assert on_device - accumulator_on_host == expected
  # Adam's moments and its int32 count.
  assert accumulator_on_host - both_on_host == 2 * param_bytes + 4
  without_optimizer = ga_optax.planning.micro_step_bytes(
    _loss_fn, params, batch, 4
  )
  assert (
    without_optimizer
    - ga_optax.planning.micro_step_bytes(
      _loss_fn, params, batch, 4, accumulator_memory_kind=HOST
    )
    == param_bytes
  )
  with pytest.raises(ValueError, match="inner_state_memory_kind"):
    ga_optax.planning.micro_step_bytes(
      _loss_fn, params, batch, 4, inner_state_memory_kind=HOST
    )


def test_the_plan_grows_when_the_state_leaves_the_device():
  if jax.default_backend() != "cpu":
    # On an H100 the device copies of a host state made the micro-step need
    # more device bytes, and no plan fitted the budget (host-memory.md).
    pytest.skip("the device copies of the state depend on the backend")
  params, batch = _planner_inputs()
  budget = ga_optax.planning.micro_step_bytes(
    _loss_fn, params, batch, 4, optimizer=optax.adam(1e-3)
  )
  plans = [
    ga_optax.planning.plan_microbatch(
      _loss_fn,
      params,
      batch,
      budget,
      global_batch_size=32,
      optimizer=optax.adam(1e-3),
      **kinds,
    )
    for kinds in (
      {},
      {"accumulator_memory_kind": HOST, "inner_state_memory_kind": HOST},
    )
  ]
  assert plans[0].micro_batch_size == 4
  assert plans[1].micro_batch_size > plans[0].micro_batch_size
  assert plans[1].compiled_bytes <= budget
  assert plans[1].next_size is None or plans[1].next_size_bytes > budget


def test_device_bytes_is_the_whole_analysis_when_nothing_is_on_the_host():
  params, batch = _planner_inputs()
  compiled = (
    jax.jit(jax.grad(_loss_fn), donate_argnums=0).lower(params, batch).compile()
  )
  analysis = compiled.memory_analysis()
  assert device_memory.device_bytes(compiled) == (
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
    + analysis.temp_size_in_bytes
  )


def run_case(*cases: str, devices: int = 1) -> None:
  """Runs ``cases`` of this file in a fresh process; fails with its output."""
  result = subprocess.run(
    [sys.executable, __file__, *cases],
    env=cpu_process_environment(devices, ROOT),
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, f"{cases}:\n{result.stdout}\n{result.stderr}"
  assert result.stdout.split() == [word for c in cases for word in (c, "ok")]


def _copied(tree: Any) -> Any:
  """A host copy of ``tree``; on CPU a zero-copy view would keep the buffers
  from being donated."""
  return jax.tree.map(lambda leaf: np.array(leaf, copy=True), tree)


def case_donation() -> None:
  """Donated params and host state, both paths: in place, exact, no abort."""

  def run(fused: bool, **kinds):
    if fused:
      tx = ga_optax.accumulate_and_apply(_optimizer(), K, **kinds)
      step = tx.apply
    else:
      tx = ga_optax.accumulate(_optimizer(), K, **kinds)

      def step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 2))
    params = _params()
    state = tx.init(params)
    history = []
    for i in range(2 * K):
      donated = jax.tree.leaves((params, state.accumulator, state.inner_state))
      params, state = step(params, _grads(i), state)
      assert all(leaf.is_deleted() for leaf in donated)
      if kinds:
        assert_placed(state, HOST, HOST)
      history.append(_copied((params, state)))
    return history

  for fused in (False, True):
    chex.assert_trees_all_equal(
      run(fused, accumulator_memory_kind=HOST, inner_state_memory_kind=HOST),
      run(fused),
    )


def case_several_devices() -> None:
  """unreduced_axes under plain jit, axis_name under shard_map, 8 devices."""
  assert jax.device_count() == 8
  keys = jax.random.split(jax.random.key(0), 3)
  params = {
    "w": jax.random.normal(keys[0], (4, 8)),
    "b": jnp.zeros(8),
  }
  x = jax.random.normal(keys[1], (32, 4))
  y = jax.random.normal(keys[2], (32, 8))

  def loss(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w"]) + params["b"] - y) ** 2)

  def unreduced_run(**kinds):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    tx = ga_optax.accumulate(_optimizer(), 2, unreduced_axes="data", **kinds)
    value_and_grad = ga_optax.unreduced_value_and_grad(
      lambda params, batch: loss(params, *batch)
    )

    @jax.jit
    def step(params, state, batch):
      _, grads = value_and_grad(params, batch)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    with jax.set_mesh(mesh):
      sharded = {
        "w": jax.device_put(params["w"], P(None, "model")),
        "b": jax.device_put(params["b"], P("model")),
      }
      state = jax.jit(tx.init)(sharded)
      history = []
      for i in range(4):
        batch = jax.device_put((x * (i + 1), y), P("data"))
        sharded, state = step(sharded, state, batch)
        if kinds:
          assert_placed(state, HOST, HOST)
          spec = state.accumulator["w"].sharding.spec
          assert spec.unreduced == {"data"}, spec
          assert spec.partitions[1] == "model", spec
        history.append(jax.device_get(sharded))
      return history

  def shard_map_run(**kinds):
    mesh = jax.make_mesh(
      (8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    tx = ga_optax.accumulate(_optimizer(), 2, axis_name="data", **kinds)

    def step(params, state, x, y):
      updates, state = tx.update(jax.grad(loss)(params, x, y), state, params)
      return optax.apply_updates(params, updates), state

    step = jax.jit(
      jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=(P(), P()),
        check_vma=False,
      ),
      donate_argnums=(0, 1),
    )
    # A copy: the replicated array may share the original's buffer on one
    # device, and donation deletes it.
    replicated = jax.device_put(
      jax.tree.map(jnp.copy, params), NamedSharding(mesh, P())
    )
    state = tx.init(replicated)
    history = []
    for i in range(4):
      replicated, state = step(replicated, state, x * (i + 1), y)
      if kinds:
        assert_placed(state, HOST, HOST)
      history.append(_copied((replicated, state)))
    return history

  host = {"accumulator_memory_kind": HOST, "inner_state_memory_kind": HOST}
  chex.assert_trees_all_equal(unreduced_run(**host), unreduced_run())
  chex.assert_trees_all_equal(shard_map_run(**host), shard_map_run())


if __name__ == "__main__":
  cases = {"donation": case_donation, "several_devices": case_several_devices}
  for case in sys.argv[1:]:
    cases[case]()
    print(f"{case} ok", flush=True)
