"""The window's sides in the compiled program, and the path audit itself.

The gradient is added outside any branch; each branch that closes the
window is a loop of at most one trip named by its scope (on the CPU, a
conditional). On the program this backend compiles: the sides are there,
nothing of the closing side runs on a micro-step, and on 8 simulated devices a ZeRO-1
micro-step exchanges scalars only (tests/test_gpu_program.py holds the same
and more on the program XLA:GPU compiles for H100s). Then
:func:`audits.path_audit` on hand-written HLO, where every figure
it reports is known, and what the loops mean for transformations of
``update``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src import audits
from ga_optax._src.window import window_form


def loss_fn(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def params_of():
  return {"w": jnp.full((64, 32), 0.1), "b": jnp.zeros(32)}


def batch_of(rows=8):
  return {"x": jnp.ones((rows, 64)), "y": jnp.zeros((rows, 32))}


def compiled_step(tx, fused=False):
  params = params_of()

  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    if fused:
      return tx.apply(params, grads, state)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return (
    jax.jit(step, donate_argnums=(0, 1))
    .lower(params, tx.init(params), batch_of())
    .compile()
  )


@pytest.mark.parametrize(
  "make",
  [
    lambda: (ga_optax.accumulate(optax.adamw(1e-3), 4), False),
    lambda: (
      ga_optax.accumulate(optax.lion(1e-4), 4, noise_scale_decay=0.9),
      False,
    ),
    lambda: (ga_optax.accumulate_and_apply(optax.adam(1e-3), 4), True),
  ],
  ids=["adamw", "lion_noise_scale", "fused_adam"],
)
def test_the_optimizer_runs_only_on_the_closing_side(make):
  tx, fused = make()
  program = compiled_step(tx, fused)
  # In either form the gradient is added before any branch. The closing
  # side holds the optimizer's step (where the window has weight); the
  # updates' buffer, the accumulator's, is zeroed once they are read (by a
  # loop of its own; in the CPU's conditional form by a select, which no
  # branch holds), and the params' owner empties a window closed without
  # weight itself.
  form = window_form.form_for(jax.default_backend())
  zeroed_after_read = 1 if form == window_form.LOOPS else 0
  assert audits.window_sides(program) == (
    {"keep_open": 0, "close_window": 2, "empty_window": 1}
    if fused
    else {
      "keep_open": 0,
      "close_window": 2 + zeroed_after_read,
      "empty_window": 0,
    }
  )
  micro_step = audits.path_audit(program, "micro_step")
  closing = audits.path_audit(program, "closing")
  assert micro_step.misplaced_closing_work == []
  # Two more passes over the state (Adam's or Lion's moments) when closing.
  state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params_of()))
  assert closing.bytes_moved - micro_step.bytes_moved >= 2 * state_bytes


@pytest.mark.devices(8)
def test_a_zero1_micro_step_exchanges_scalars_only():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    params = jax.device_put(
      {"w": jnp.full((64, 64), 0.1), "b": jnp.zeros(64)}, P()
    )
    tx = ga_optax.accumulate(
      optax.adam(1e-3), 4, unreduced_axes="data", inner_state_axes="data"
    )
    value_and_grad = ga_optax.unreduced_value_and_grad(loss_fn)

    def step(params, state, batch):
      _, grads = value_and_grad(params, batch)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    batch = jax.device_put(
      {"x": jnp.ones((64, 64)), "y": jnp.zeros((64, 64))}, P("data")
    )
    program = jax.jit(step).lower(params, tx.init(params), batch).compile()
  micro_step = audits.path_audit(program, "micro_step")
  closing = audits.path_audit(program, "closing")
  assert all(c.operand_bytes <= 8 for c in micro_step.collectives), (
    micro_step.collectives
  )
  scattered = [c for c in closing.collectives if c.opcode == "reduce-scatter"]
  assert sum(c.operand_bytes for c in scattered) == (64 * 64 + 64) * 4


# The path audit on hand-written HLO: a scan of 4 trips, the two sides of a
# window (found by their scopes in op_name), and a conditional.
HLO = """\
HloModule step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%scan_body (s: (s32[], f32[256])) -> (s32[], f32[256]) {
  %s = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[256]{0} get-tuple-element(%s), index=1
  %y = f32[256]{0} exponential(%x)
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %y)
}

%scan_cond (c: (s32[], f32[256])) -> pred[] {
  %c = (s32[], f32[256]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%open_body (o: (pred[], f32[1024])) -> (pred[], f32[1024]) {
  %o = (pred[], f32[1024]{0}) parameter(0)
  %acc = f32[1024]{0} get-tuple-element(%o), index=1
  %added = f32[1024]{0} add(%acc, %acc), metadata={op_name="jit(step)/ga_optax_keep_open/while/body/add"}
  %no = pred[] constant(false)
  ROOT %ot = (pred[], f32[1024]{0}) tuple(%no, %added)
}

%close_body (w: (pred[], f32[1024])) -> (pred[], f32[1024]) {
  %w = (pred[], f32[1024]{0}) parameter(0)
  %v = f32[1024]{0} get-tuple-element(%w), index=1
  %reduced = f32[1024]{0} all-reduce(%v), replica_groups={}, to_apply=%add, metadata={op_name="jit(step)/ga_optax_close_window/while/body/psum"}
  %stepped = f32[1024]{0} sqrt(%reduced), metadata={op_name="jit(step)/ga_optax_close_window/while/body/sqrt"}
  %wno = pred[] constant(false)
  ROOT %wt = (pred[], f32[1024]{0}) tuple(%wno, %stepped)
}

%side_cond (q: (pred[], f32[1024])) -> pred[] {
  %q = (pred[], f32[1024]{0}) parameter(0)
  ROOT %go = pred[] get-tuple-element(%q), index=0
}

%branch_false (bf: f32[64]) -> f32[64] {
  ROOT %bf = f32[64]{0} parameter(0)
}

%branch_true (bt: f32[64]) -> f32[64] {
  %bt = f32[64]{0} parameter(0)
  ROOT %neg = f32[64]{0} negate(%bt)
}

ENTRY %main (p0: f32[256], p1: f32[1024], p2: pred[], p3: f32[64]) -> f32[1024] {
  %p0 = f32[256]{0} parameter(0)
  %p1 = f32[1024]{0} parameter(1)
  %p2 = pred[] parameter(2)
  %p3 = f32[64]{0} parameter(3)
  %zero = s32[] constant(0)
  %init = (s32[], f32[256]{0}) tuple(%zero, %p0)
  %scan = (s32[], f32[256]{0}) while(%init), condition=%scan_cond, body=%scan_body, backend_config={"known_trip_count":{"n":"4"}}
  %hoisted = f32[1024]{0} multiply(%p1, %p1), metadata={op_name="jit(step)/ga_optax_close_window/while/body/mul"}
  %index = s32[] convert(%p2), metadata={op_name="jit(step)/ga_optax_close_window/cond/convert_element_type"}
  %copied = f32[1024]{0} copy(%hoisted)
  %not = pred[] not(%p2)
  %open_in = (pred[], f32[1024]{0}) tuple(%not, %copied)
  %opened = (pred[], f32[1024]{0}) while(%open_in), condition=%side_cond, body=%open_body, metadata={op_name="jit(step)/ga_optax_keep_open/while"}
  %acc_out = f32[1024]{0} get-tuple-element(%opened), index=1
  %close_in = (pred[], f32[1024]{0}) tuple(%p2, %acc_out)
  %closed = (pred[], f32[1024]{0}) while(%close_in), condition=%side_cond, body=%close_body, metadata={op_name="jit(step)/ga_optax_close_window/while"}
  %picked = f32[64]{0} conditional(%p2, %p3, %p3), true_computation=%branch_true, false_computation=%branch_false
  ROOT %out = f32[1024]{0} get-tuple-element(%closed), index=1
}
"""

SCAN = 4 * (256 * 4 * 2)  # 4 trips of exp: read and write 1 KiB each
HOISTED = 3 * 4096  # the multiply: two operands and a result of 4 KiB
COPY = 2 * 4096
NOT = 2  # a pred in, a pred out
# The closing side's index, a scalar of its scope outside it: not work.
INDEX = 1 + 4
OPEN = 3 * 4096  # add: two operands and a result
CLOSE = 2 * 4096 + 2 * 4096  # the all-reduce, then the sqrt
TRUE_BRANCH = 2 * 256  # negate of 64 floats


def test_the_micro_step_path_runs_the_open_side_and_the_false_branch():
  audit = audits.path_audit(HLO, "micro_step")
  assert audit.bytes_moved == SCAN + HOISTED + INDEX + COPY + NOT + OPEN
  assert audit.copies == [audits.Copy("main", "copied", 4096)]
  assert audit.collectives == []
  # The multiply came from the closing side and runs outside its loop.
  assert audit.misplaced_closing_work == ["hoisted"]


def test_the_closing_path_runs_the_closing_side_and_the_true_branch():
  audit = audits.path_audit(HLO, "closing")
  assert audit.bytes_moved == (
    SCAN + HOISTED + INDEX + COPY + NOT + CLOSE + TRUE_BRANCH
  )
  assert [c.name for c in audit.collectives] == ["reduced"]
  assert audit.misplaced_closing_work == ["hoisted"]
  assert audit.copied_bytes(at_least=4097) == 0
  assert audit.copied_bytes() == 4096


def test_window_sides_are_found_by_their_scopes():
  assert audits.window_sides(HLO) == {
    "keep_open": 1,
    "close_window": 1,
    "empty_window": 0,
  }
  # The window's sides are branches, not loops over micro-batches.
  assert audits.loop_collectives(HLO) == []
  found = audits.window_collectives(HLO)
  assert found.closing_branch == "close_body"
  assert [c.name for c in found.window_closing] == ["reduced"]
  assert found.every_micro_step == []


def test_path_audit_refuses_what_it_cannot_read():
  with pytest.raises(ValueError, match="path must be one of"):
    audits.path_audit(HLO, "window")
  with pytest.raises(TypeError, match="compiled program"):
    audits.path_audit(jax.jit(jnp.sin).lower(1.0), "closing")


def test_compile_for_gpu_names_a_bad_argument():
  with pytest.raises(ValueError, match="num_devices"):
    audits.compile_for_gpu(jnp.sin, 1.0, num_devices=0)
  with pytest.raises(ValueError, match="target"):
    audits.compile_for_gpu(jnp.sin, 1.0, target="tpu-v5")


# What the loops mean for transformations of update.


def test_update_has_forward_derivatives():
  tx = ga_optax.accumulate(optax.sgd(0.5), 2)
  params = {"w": jnp.ones(3)}
  _, state = tx.update({"w": jnp.arange(3.0)}, tx.init(params), params)

  def closing_updates(grads):
    return tx.update(grads, state, params)[0]["w"]

  grads, tangent = {"w": jnp.arange(3.0)}, {"w": jnp.ones(3)}
  updates, derivative = jax.jvp(closing_updates, (grads,), (tangent,))
  # -0.5 times the window's mean, (g_1 + g_2) / 2: its tangent is -0.25.
  np.testing.assert_allclose(updates, -0.5 * np.arange(3.0))
  np.testing.assert_allclose(derivative, np.full(3, -0.25))
