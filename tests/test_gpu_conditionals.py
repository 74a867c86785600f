"""Every conditional ga_optax emits stays a conditional on a GPU.

XLA:GPU replaces a two-branch conditional of cheap ops by selects that run
both branches, unless one branch only forwards its operands. Two checks,
neither needing a GPU: on the jaxpr, every ``cond`` has a branch whose
outputs are its inputs; and on the compiled program, the conditionals
survive XLA:GPU's index rewrite emulated on the CPU
(:func:`ga_optax.testing.gpu_conditional_audit`), over a matrix of
optimizers, options and device layouts. A deliberately bad conditional shows
that the emulation can fail.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax import testing
from ga_optax._src import gpu_conditionals

SHAPES = {"w": (32, 16), "b": (16,), "scale": (16,)}


def params_of(dtype: Any = jnp.float32) -> dict[str, jax.Array]:
  return {
    name: jnp.linspace(-1.0, 1.0, num=int(jnp.prod(jnp.asarray(shape))))
    .reshape(shape)
    .astype(dtype)
    for name, shape in SHAPES.items()
  }


def audited(lowered: jax.stages.Lowered) -> testing.ConditionalAudit:
  try:
    return testing.gpu_conditional_audit(lowered)
  except testing.EmulationUnavailable as error:
    pytest.skip(str(error))


def assert_every_conditional_survives(
  step: Callable[..., Any], *args: Any, expected: int
) -> None:
  """The jaxpr and the emulated GPU compile keep all ``expected`` conds."""
  branches = gpu_conditionals.forwarding_branches(jax.make_jaxpr(step)(*args))
  assert len(branches) == expected, branches
  assert all(branches), f"a cond has no forwarding branch: {branches}"
  audit = audited(jax.jit(step).lower(*args))
  assert audit.rewritten == expected, audit
  assert audit.compiled >= 1, audit
  assert audit.as_on_gpu == audit.compiled, audit


def accumulate_case(
  optimizer: optax.GradientTransformation, dtype: Any = jnp.float32, **options
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  tx = ga_optax.accumulate(optimizer, options.pop("every_k", 4), **options)
  params = params_of(dtype)
  state = tx.init(params)

  def step(grads, state, params, weight, flush):
    return tx.update(grads, state, params, weight=weight, flush=flush)

  return step, (params, state, params, jnp.float32(3.0), jnp.asarray(False))


def fused_case(
  optimizer: optax.GradientTransformation, **options
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  fused = ga_optax.accumulate_and_apply(optimizer, 4, **options)
  params = params_of()
  state = fused.init(params)

  def step(params, grads, state):
    return fused.apply(params, grads, state)

  return step, (params, params, state)


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)
SINGLE_DEVICE = {
  "adam": lambda: accumulate_case(optax.adam(1e-3)),
  "sgd_momentum": lambda: accumulate_case(optax.sgd(0.1, momentum=0.9)),
  "lion": lambda: accumulate_case(optax.lion(1e-4)),
  "rmsprop": lambda: accumulate_case(optax.rmsprop(1e-3)),
  "adamw_schedule": lambda: accumulate_case(optax.adamw(SCHEDULE)),
  "adafactor": lambda: accumulate_case(optax.adafactor(1e-3)),
  "clip_adamw": lambda: accumulate_case(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  ),
  "dict_every_k_skip_nonfinite": lambda: accumulate_case(
    optax.adam(1e-3), every_k={0: 2, 10: 4}, skip_nonfinite=True
  ),
  "sum": lambda: accumulate_case(optax.sgd(0.1), reduction="sum"),
  "bf16_params_f32_accumulator": lambda: accumulate_case(
    optax.adam(1e-3), jnp.bfloat16
  ),
  "f16_accumulator_of_f32": lambda: accumulate_case(
    optax.adam(1e-3), accumulator_dtype=jnp.float16
  ),
  "accumulator_in_host_memory": lambda: accumulate_case(
    optax.adam(1e-3), accumulator_memory_kind="pinned_host"
  ),
  "state_in_host_memory": lambda: accumulate_case(
    optax.adam(1e-3), inner_state_memory_kind="pinned_host"
  ),
  "fused_adam": lambda: fused_case(optax.adam(1e-3)),
  "fused_sgd": lambda: fused_case(optax.sgd(0.1)),
  "fused_host_memory": lambda: fused_case(
    optax.adam(1e-3), accumulator_memory_kind="pinned_host"
  ),
}


@pytest.mark.parametrize("case", sorted(SINGLE_DEVICE))
def test_one_device(case):
  step, args = SINGLE_DEVICE[case]()
  assert_every_conditional_survives(step, *args, expected=1)


def test_an_update_called_eagerly_compiles_its_conditional_as_under_jit():
  # The eager path jit-compiles the same window update; its program is the
  # one audited above. Here: the eager call emits the same updates.
  step, args = SINGLE_DEVICE["adam"]()
  chex_args = jax.tree.map(jnp.asarray, args)
  eager_updates, _ = step(*chex_args)
  jit_updates, _ = jax.jit(step)(*chex_args)
  for eager, jitted in zip(
    jax.tree.leaves(eager_updates), jax.tree.leaves(jit_updates), strict=True
  ):
    assert bool(jnp.array_equal(eager, jitted))


def test_a_zeros_branch_beside_an_adam_branch_is_reported_lost():
  """The control: the emulation catches what the GPU would do."""
  optimizer = optax.adam(1e-3)
  params = params_of()

  def bad_step(closes, grads, state):
    return jax.lax.cond(
      closes,
      lambda grads, state: optimizer.update(grads, state, params),
      lambda grads, state: (jax.tree.map(jnp.zeros_like, grads), state),
      grads,
      state,
    )

  args = (jnp.asarray(True), params, optimizer.init(params))
  assert gpu_conditionals.forwarding_branches(
    jax.make_jaxpr(bad_step)(*args)
  ) == [False]
  audit = audited(jax.jit(bad_step).lower(*args))
  assert audit == testing.ConditionalAudit(compiled=1, as_on_gpu=0, rewritten=1)


def test_a_switch_of_three_branches_is_not_rewritten():
  def switch(index, x):
    return jax.lax.switch(index, [jnp.sin, jnp.cos, jnp.tanh], x)

  audit = audited(jax.jit(switch).lower(jnp.int32(1), jnp.ones(4)))
  assert audit.rewritten == 0
  assert audit.as_on_gpu == audit.compiled


def test_nested_conditionals_are_rewritten_inside_out():
  def nested(outer, inner, x):
    return jax.lax.cond(
      outer,
      lambda x: jax.lax.cond(inner, lambda x: x * 2.0, lambda x: x, x),
      lambda x: x,
      x,
    )

  audit = audited(
    jax.jit(nested).lower(jnp.asarray(True), jnp.asarray(False), jnp.ones(3))
  )
  assert audit.rewritten == 2
  assert audit.compiled == audit.as_on_gpu == 2


def test_the_rewrite_swaps_the_branches_and_keeps_the_numbers():
  def pick(flag, x):
    return jax.lax.cond(flag, lambda x: x + 1.0, lambda x: x, x)

  lowered = jax.jit(pick).lower(jnp.asarray(True), jnp.ones(3))
  text, count = gpu_conditionals.rewrite_to_predicates(lowered.as_text())
  assert count == 1
  assert '"stablehlo.if"' in text and '"stablehlo.case"' not in text
  true_branch = text.index("stablehlo.add")
  assert true_branch < text.index('"stablehlo.if"') + 200


def test_audit_rejects_what_is_not_lowered():
  with pytest.raises(TypeError, match="lowered"):
    testing.gpu_conditional_audit(lambda x: x)


# Several devices: plain jit over a mesh (unreduced accumulators, ZeRO-1)
# and shard_map with axis_name, on models with biases and scales.

needs_8_devices = pytest.mark.skipif(
  jax.device_count() < 8, reason="needs 8 (simulated) devices"
)


def loss_fn(params, batch):
  hidden = batch["x"] @ params["w"] + params["b"]
  hidden = hidden * params["scale"]
  return jnp.mean((hidden - batch["y"]) ** 2)


def mesh_batch() -> dict[str, jax.Array]:
  return {
    "x": jnp.linspace(-1.0, 1.0, 64 * 32).reshape(64, 32),
    "y": jnp.linspace(0.0, 1.0, 64 * 16).reshape(64, 16),
  }


def unreduced_case(transformation: str, **options):
  value_and_grad = ga_optax.unreduced_value_and_grad(loss_fn)
  params = params_of()
  batch = jax.device_put(mesh_batch(), P("data"))
  if transformation == "accumulate":
    tx = ga_optax.accumulate(
      optax.adam(1e-3),
      options.pop("every_k", 4),
      unreduced_axes="data",
      **options,
    )
    state = tx.init(params)

    def step(params, state, batch):
      _, grads = value_and_grad(params, batch)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

  else:
    fused = ga_optax.accumulate_and_apply(
      optax.adam(1e-3), 4, unreduced_axes="data", **options
    )
    state = fused.init(params)

    def step(params, state, batch):
      _, grads = value_and_grad(params, batch)
      return fused.apply(params, grads, state)

  return step, (params, state, batch)


MESH_CASES = {
  "unreduced": lambda: unreduced_case("accumulate"),
  "unreduced_fused": lambda: unreduced_case("fused"),
  "unreduced_dict_every_k": lambda: unreduced_case(
    "accumulate", every_k={0: 2, 3: 4}
  ),
  "unreduced_f16_accumulator": lambda: unreduced_case(
    "accumulate", accumulator_dtype=jnp.float16
  ),
  "zero1_rule": lambda: unreduced_case("accumulate", inner_state_axes="data"),
  "zero1_fused": lambda: unreduced_case("fused", inner_state_axes="data"),
  "unreduced_host_memory": lambda: unreduced_case(
    "accumulate", accumulator_memory_kind="pinned_host"
  ),
}


@needs_8_devices
@pytest.mark.parametrize("case", sorted(MESH_CASES))
def test_plain_jit_on_a_mesh(case):
  with jax.set_mesh(jax.make_mesh((8,), ("data",))):
    step, args = MESH_CASES[case]()
    assert_every_conditional_survives(step, *args, expected=1)


@needs_8_devices
@pytest.mark.parametrize("check_vma", [False, True])
@pytest.mark.parametrize("path", ["accumulate", "fused"])
def test_shard_map_with_axis_name(check_vma, path):
  mesh = jax.make_mesh((8,), ("data",))
  params = params_of()
  if path == "accumulate":
    tx = ga_optax.accumulate(optax.adam(1e-3), 4, axis_name="data")
    state = tx.init(params)

    def local_step(params, state, x, y):
      grads = jax.grad(loss_fn)(params, {"x": x, "y": y})
      updates, state = tx.update(grads, state, params, weight=x.shape[0])
      return optax.apply_updates(params, updates), state

  else:
    fused = ga_optax.accumulate_and_apply(optax.adam(1e-3), 4, axis_name="data")
    state = fused.init(params)

    def local_step(params, state, x, y):
      grads = jax.grad(loss_fn)(params, {"x": x, "y": y})
      return fused.apply(params, grads, state, weight=x.shape[0])

  step = jax.shard_map(
    local_step,
    mesh=mesh,
    in_specs=(P(), P(), P("data"), P("data")),
    out_specs=(P(), P()),
    check_vma=check_vma,
  )
  with jax.set_mesh(mesh):
    batch = jax.device_put(mesh_batch(), P("data"))
    # The closing branch holds a second conditional: the window's total
    # weight is known only after its reduction.
    assert_every_conditional_survives(
      step, params, state, batch["x"], batch["y"], expected=2
    )
