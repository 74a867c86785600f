"""The HLO audits of ga_optax.testing, on hand-written and compiled modules.

The hand-written modules follow the layout XLA prints: computations before
the ENTRY one, operands named without their shapes (older XLA printed each
shape beside its operand, which the parser also reads). The CPU compiles
collectives synchronously; a GPU prints them as asynchronous ``-start`` /
``-done`` pairs, which one hand-written module puts through every audit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ga_optax._src import audits
from ga_optax._src.audits import Collective
from ga_optax._src.audits.hlo import shape_bytes

# A window-closing conditional and nothing else.
WINDOW_TEXT = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%keep_open (param: (f32[4,3], f32[])) -> (f32[4,3], f32[]) {
  %param = (f32[4,3]{1,0}, f32[]) parameter(0)
  ROOT %copy = (f32[4,3]{1,0}, f32[]) copy(%param)
}

%close (param.1: (f32[4,3], f32[])) -> (f32[4,3], f32[]) {
  %param.1 = (f32[4,3]{1,0}, f32[]) parameter(0)
  %gte.0 = f32[4,3]{1,0} get-tuple-element(%param.1), index=0
  %gte.1 = f32[] get-tuple-element(%param.1), index=1
  %all-reduce = (f32[4,3]{1,0}, f32[]) all-reduce(%gte.0, /*index=1*/%gte.1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %result = (f32[4,3]{1,0}, f32[]) copy(%all-reduce)
}

ENTRY %main (p0: pred[], p1: (f32[4,3], f32[]), p2: bf16[16]) -> (f32[4,3], f32[]) {
  %p0 = pred[] parameter(0)
  %p1 = (f32[4,3]{1,0}, f32[]) parameter(1)
  %p2 = bf16[16]{0} parameter(2)
  %EVERY_STEP
  ROOT %conditional = (f32[4,3]{1,0}, f32[]) conditional(%p0, %p1, %p1), branch_computations={%keep_open, %close}
}
"""


def window_text(every_step: str = "") -> str:
  return WINDOW_TEXT.replace("%EVERY_STEP", every_step)


# A scan over 8 micro-batches of 2 rows: in its body a fused dot, an
# all-reduce, a called computation with an all-reduce and a conditional
# whose last branch permutes; in its condition an all-reduce. Outside it: an
# all-gather, a conditional whose last branch all-reduces, a convolution.
LOOP_TEXT = """\
HloModule jit_train, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%matmul (param_0: f32[2,16], param_1: f32[16,32]) -> f32[2,32] {
  %param_0 = f32[2,16]{1,0} parameter(0)
  %param_1 = f32[16,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[2,32]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%count_votes (vote: s32[]) -> s32[] {
  %vote = s32[] parameter(0)
  ROOT %votes = s32[] all-reduce(%vote), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}

%pass (pass.param: (f32[2,32])) -> (f32[2,32]) {
  ROOT %pass.param = (f32[2,32]{1,0}) parameter(0)
}

%shift (shift.param: (f32[2,32])) -> (f32[2,32]) {
  %shift.param = (f32[2,32]{1,0}) parameter(0)
  %shift.gte = f32[2,32]{1,0} get-tuple-element(%shift.param), index=0
  %permuted = f32[2,32]{1,0} collective-permute(%shift.gte), channel_id=3, source_target_pairs={{0,1},{1,0}}
  ROOT %shifted = (f32[2,32]{1,0}) tuple(%permuted)
}

%body (state: (s32[], f32[2,32], f32[2,16], f32[16,32], pred[])) -> (s32[], f32[2,32], f32[2,16], f32[16,32], pred[]) {
  %state = (s32[], f32[2,32]{1,0}, f32[2,16]{1,0}, f32[16,32]{1,0}, pred[]) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %total = f32[2,32]{1,0} get-tuple-element(%state), index=1
  %x = f32[2,16]{1,0} get-tuple-element(%state), index=2
  %w = f32[16,32]{1,0} get-tuple-element(%state), index=3
  %flag = pred[] get-tuple-element(%state), index=4
  %product = f32[2,32]{1,0} fusion(%x, %w), kind=kOutput, calls=%matmul
  %reduced = f32[2,32]{1,0} all-reduce(%product), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %vote.sum = s32[] call(%i), to_apply=%count_votes
  %wrapped = (f32[2,32]{1,0}) tuple(%reduced)
  %branch = (f32[2,32]{1,0}) conditional(%flag, %wrapped, %wrapped), branch_computations={%pass, %shift}
  %next = f32[2,32]{1,0} get-tuple-element(%branch), index=0
  ROOT %carry = (s32[], f32[2,32]{1,0}, f32[2,16]{1,0}, f32[16,32]{1,0}, pred[]) tuple(%vote.sum, %next, %x, %w, /*index=4*/%flag)
}

%cond (cond.state: (s32[], f32[2,32], f32[2,16], f32[16,32], pred[])) -> pred[] {
  %cond.state = (s32[], f32[2,32]{1,0}, f32[2,16]{1,0}, f32[16,32]{1,0}, pred[]) parameter(0)
  %cond.i = s32[] get-tuple-element(%cond.state), index=0
  %agreed.i = s32[] all-reduce(%cond.i), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %limit = s32[] constant(8)
  ROOT %more = pred[] compare(%agreed.i, %limit), direction=LT
}

%keep_open (open.param: (f32[2,32])) -> (f32[2,32]) {
  ROOT %open.param = (f32[2,32]{1,0}) parameter(0)
}

%close (close.param: (f32[2,32])) -> (f32[2,32]) {
  %close.param = (f32[2,32]{1,0}) parameter(0)
  %close.gte = f32[2,32]{1,0} get-tuple-element(%close.param), index=0
  %window.sum = f32[2,32]{1,0} all-reduce(%close.gte), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %closed = (f32[2,32]{1,0}) tuple(%window.sum)
}

ENTRY %main (p0: f32[16,32], p1: f32[2,16], p2: pred[], p3: bf16[16], p4: f32[2,3,8,8], p5: f32[4,3,3,3]) -> ((f32[2,32]), f32[2,4,6,6]) {
  %p0 = f32[16,32]{1,0} parameter(0)
  %p1 = f32[2,16]{1,0} parameter(1)
  %p2 = pred[] parameter(2)
  %p3 = bf16[16]{0} parameter(3)
  %p4 = f32[2,3,8,8]{3,2,1,0} parameter(4)
  %p5 = f32[4,3,3,3]{3,2,1,0} parameter(5)
  %gathered = bf16[128]{0} all-gather(%p3), dimensions={0}, replica_groups={{0,1,2,3,4,5,6,7}}
  %zero = s32[] constant(0)
  %zeros = f32[2,32]{1,0} broadcast(%zero), dimensions={}
  %init = (s32[], f32[2,32]{1,0}, f32[2,16]{1,0}, f32[16,32]{1,0}, pred[]) tuple(%zero, %zeros, %p1, %p0, /*index=4*/%p2)
  %loop = (s32[], f32[2,32]{1,0}, f32[2,16]{1,0}, f32[16,32]{1,0}, pred[]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"8"}}
  %sums = f32[2,32]{1,0} get-tuple-element(%loop), index=1
  %window = (f32[2,32]{1,0}) tuple(%sums)
  %update = (f32[2,32]{1,0}) conditional(%p2, %window, %window), branch_computations={%keep_open, %close}
  %image = f32[2,4,6,6]{3,2,1,0} convolution(%p4, %p5), window={size=3x3}, dim_labels=bf01_oi01->bf01
  ROOT %out = ((f32[2,32]{1,0}), f32[2,4,6,6]{3,2,1,0}) tuple(%update, %image)
}
"""

PER_ITERATION = [
  Collective("count_votes", "votes", "all-reduce", 4),
  Collective("body", "reduced", "all-reduce", 2 * 32 * 4),
  Collective("cond", "agreed.i", "all-reduce", 4),
]


def test_parse_hlo_reads_computations_loops_and_callees():
  module = audits.parse_hlo(LOOP_TEXT)
  assert module.entry == "main"
  assert list(module.computations) == [
    "add",
    "matmul",
    "count_votes",
    "pass",
    "shift",
    "body",
    "cond",
    "keep_open",
    "close",
    "main",
  ]
  (loop,) = [i for i in module.computations["main"] if i.opcode == "while"]
  assert loop == audits.HloInstruction(
    name="loop",
    opcode="while",
    shape=("(s32[], f32[2,32]{1,0}, f32[2,16]{1,0}, f32[16,32]{1,0}, pred[])"),
    operands=("init",),
    callees=("cond", "body"),
    trip_count=8,
  )
  body = {i.name: i for i in module.computations["body"]}
  assert body["product"].callees == ("matmul",)
  assert body["branch"].callees == ("pass", "shift")
  assert body["carry"].operands == ("vote.sum", "next", "x", "w", "flag")


def test_reachable_follows_calls_and_stops_at_excluded():
  module = audits.parse_hlo(LOOP_TEXT)
  assert audits.reachable(module, "body") == {
    "body",
    "matmul",
    "count_votes",
    "add",
    "pass",
    "shift",
  }
  assert audits.reachable(module, "main", excluded={"body", "close"}) == {
    "main",
    "cond",
    "add",
    "keep_open",
  }


def test_loop_collectives_are_those_of_the_body_and_condition():
  # A collective in a computation the body calls also runs once per
  # iteration; one in a branch of a conditional inside the body runs only on
  # the iterations that take that branch, so it is not counted.
  assert audits.loop_collectives(LOOP_TEXT) == PER_ITERATION


def test_loop_collectives_leave_out_what_runs_outside_the_loop():
  module = audits.parse_hlo(LOOP_TEXT)
  outside = {c.name for c in audits.collectives_in_hlo(module)} - {
    c.name for c in audits.loop_collectives(module)
  }
  # The all-gather before the loop and the all-reduce of the conditional
  # after it (in its closing branch) run once per call; the permute in a
  # branch inside the loop runs only on the iterations that take it.
  assert outside == {"gathered", "window.sum", "permuted"}


def test_loop_collectives_is_empty_without_a_loop():
  # WINDOW_TEXT has a collective, in a conditional's branch, but no loop.
  assert audits.collectives_in_hlo(audits.parse_hlo(window_text()))
  assert audits.loop_collectives(window_text()) == []


def test_text_and_parsed_module_give_the_same_audit():
  module = audits.parse_hlo(LOOP_TEXT)
  assert audits.loop_collectives(module) == audits.loop_collectives(LOOP_TEXT)
  assert audits.dot_shapes(module) == audits.dot_shapes(LOOP_TEXT)


def test_dot_shapes_of_fused_dots_and_convolutions():
  # The dot's operands are the parameters of its fusion; the convolution's
  # are the entry's parameters. Layouts are left out.
  assert audits.dot_shapes(LOOP_TEXT) == [
    ("f32[2,16]", "f32[16,32]"),
    ("f32[2,3,8,8]", "f32[4,3,3,3]"),
  ]


def test_dot_shapes_reads_operands_printed_with_their_shapes():
  text = """\
HloModule jit_predict

ENTRY %main (x: bf16[4,16], w: bf16[16,32]) -> f32[4,32] {
  %x = bf16[4,16]{1,0:T(8,128)(2,1)} parameter(0)
  %w = bf16[16,32]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %dot.3 = f32[4,32]{1,0} dot(bf16[4,16]{1,0:T(8,128)(2,1)} %x, bf16[16,32]{1,0:T(8,128)(2,1)} %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
  assert audits.dot_shapes(text) == [("bf16[4,16]", "bf16[16,32]")]


def test_dot_shapes_rejects_a_dot_on_undefined_operands():
  text = """\
HloModule jit_partial

ENTRY %main (x: f32[4,16]) -> f32[4,32] {
  %x = f32[4,16]{1,0} parameter(0)
  ROOT %dot = f32[4,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
  with pytest.raises(ValueError, match="operand %w of %dot is not defined"):
    audits.dot_shapes(text)


@pytest.mark.parametrize("audit", [audits.loop_collectives, audits.dot_shapes])
def test_audits_ask_for_text_instead_of_a_compiled_object(audit):
  compiled = jax.jit(jnp.sin).lower(1.0).compile()
  with pytest.raises(TypeError, match=r"pass its \.as_text\(\)"):
    audit(compiled)


def test_a_compiled_scan_of_a_dot_on_one_device():
  def predict(w, xs):
    def micro_step(total, x):
      return total + jnp.tanh(x @ w).sum(), None

    return jax.lax.scan(micro_step, 0.0, xs)[0]

  # 4 micro-batches of 8 rows, 16 features in, 32 out.
  w, xs = jnp.ones((16, 32)), jnp.ones((4, 8, 16))
  text = jax.jit(predict).lower(w, xs).compile().as_text()
  module = audits.parse_hlo(text)
  loops = [
    instruction
    for instructions in module.computations.values()
    for instruction in instructions
    if instruction.opcode == "while"
  ]
  assert [loop.trip_count for loop in loops] == [4]
  assert audits.dot_shapes(module) == [("f32[8,16]", "f32[16,32]")]
  # The dot runs inside the loop: once per micro-batch, on its 8 rows.
  in_loop = set().union(
    *(audits.reachable(module, callee) for callee in loops[0].callees)
  )
  with_dots = {
    name
    for name, instructions in module.computations.items()
    if any(instruction.opcode == "dot" for instruction in instructions)
  }
  assert with_dots and with_dots <= in_loop, (with_dots, in_loop)
  assert audits.collectives_in_hlo(module) == []
  assert audits.loop_collectives(module) == []


def test_window_collectives_finds_the_closing_branch():
  found = audits.window_collectives(window_text())
  assert found.every_micro_step == []
  assert found.closing_branch == "close"
  assert found.window_closing == [
    Collective("close", "all-reduce", "all-reduce", 4 * 12 + 4)
  ]


def test_window_collectives_sees_collectives_on_every_step():
  found = audits.window_collectives(
    window_text(
      "%all-gather = bf16[128]{0} all-gather(%p2), dimensions={0},"
      " replica_groups={{0,1,2,3,4,5,6,7}}"
    )
  )
  assert found.every_micro_step == [
    Collective("main", "all-gather", "all-gather", 2 * 16)
  ]
  assert len(found.window_closing) == 1


def test_window_collectives_rejects_collectives_in_the_open_branch():
  text = window_text().replace(
    "branch_computations={%keep_open, %close}",
    "branch_computations={%close, %keep_open}",
  )
  with pytest.raises(ValueError, match="last one of its conditional"):
    audits.window_collectives(text)


def test_window_collectives_refuses_collectives_in_two_branches():
  # The conditional inside the loop body sits in no other branch either, so
  # two branches hold collectives: the audit refuses rather than guess.
  with pytest.raises(ValueError, match=r"found them in \['close', 'shift'\]"):
    audits.window_collectives(LOOP_TEXT)


# What XLA:GPU prints: asynchronous collectives, a "-start" that launches
# the transfer and a "-done" that waits for it (an all-gather-start's shape
# is the tuple of its operand and result), and a reduce-scatter wrapped in
# an async-start that calls it. The scan body all-reduces and permutes on
# every micro-batch; an all-gather runs before the loop; the closing branch
# of the window's conditional all-reduces, reduce-scatters and all-gathers
# (as a sharded optimizer state's window does).
ASYNC_TEXT = """\
HloModule jit_gpu_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%body (state: (s32[], f32[2,32])) -> (s32[], f32[2,32]) {
  %state = (s32[], f32[2,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %total = f32[2,32]{1,0} get-tuple-element(%state), index=1
  %grad.start = f32[2,32]{1,0} all-reduce-start(f32[2,32]{1,0} %total), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":false}}
  %grad.done = f32[2,32]{1,0} all-reduce-done(f32[2,32]{1,0} %grad.start)
  %shift.start = (f32[2,32]{1,0}, f32[2,32]{1,0}, u32[], u32[]) collective-permute-start(f32[2,32]{1,0} %grad.done), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %shift.done = f32[2,32]{1,0} collective-permute-done((f32[2,32]{1,0}, f32[2,32]{1,0}, u32[], u32[]) %shift.start)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %carry = (s32[], f32[2,32]{1,0}) tuple(%next, %shift.done)
}

%cond (cond.state: (s32[], f32[2,32])) -> pred[] {
  %cond.state = (s32[], f32[2,32]{1,0}) parameter(0)
  %cond.i = s32[] get-tuple-element(%cond.state), index=0
  %limit = s32[] constant(4)
  ROOT %more = pred[] compare(%cond.i, %limit), direction=LT
}

%keep_open (open.param: (f32[2,32])) -> (f32[2,32]) {
  ROOT %open.param = (f32[2,32]{1,0}) parameter(0)
}

%scatter (scatter.param: f32[2,32]) -> f32[2,4] {
  %scatter.param = f32[2,32]{1,0} parameter(0)
  ROOT %scattered = f32[2,4]{1,0} reduce-scatter(%scatter.param), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={1}, to_apply=%add
}

%close (close.param: (f32[2,32])) -> (f32[2,32]) {
  %close.param = (f32[2,32]{1,0}) parameter(0)
  %close.gte = f32[2,32]{1,0} get-tuple-element(%close.param), index=0
  %window.start = f32[2,32]{1,0} all-reduce-start(f32[2,32]{1,0} %close.gte), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %window.done = f32[2,32]{1,0} all-reduce-done(f32[2,32]{1,0} %window.start)
  %shards.start = ((f32[2,32]{1,0}), f32[2,4]{1,0}) async-start(f32[2,32]{1,0} %window.done), calls=%scatter
  %shards.done = f32[2,4]{1,0} async-done(((f32[2,32]{1,0}), f32[2,4]{1,0}) %shards.start)
  %updates.start = (f32[2,4]{1,0}, f32[2,32]{1,0}) all-gather-start(f32[2,4]{1,0} %shards.done), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={1}
  %updates.done = f32[2,32]{1,0} all-gather-done((f32[2,4]{1,0}, f32[2,32]{1,0}) %updates.start)
  ROOT %closed = (f32[2,32]{1,0}) tuple(%updates.done)
}

ENTRY %main (p0: f32[2,32], p1: pred[], p2: bf16[16]) -> (f32[2,32]) {
  %p0 = f32[2,32]{1,0} parameter(0)
  %p1 = pred[] parameter(1)
  %p2 = bf16[16]{0} parameter(2)
  %gather.start = (bf16[16]{0}, bf16[128]{0}) all-gather-start(bf16[16]{0} %p2), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %gather.done = bf16[128]{0} all-gather-done((bf16[16]{0}, bf16[128]{0}) %gather.start)
  %zero = s32[] constant(0)
  %init = (s32[], f32[2,32]{1,0}) tuple(%zero, %p0)
  %loop = (s32[], f32[2,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %sums = f32[2,32]{1,0} get-tuple-element(%loop), index=1
  %window = (f32[2,32]{1,0}) tuple(%sums)
  ROOT %update = (f32[2,32]{1,0}) conditional(%p1, %window, %window), branch_computations={%keep_open, %close}
}
"""

# Each asynchronous collective counts once, at its "-start", with the bytes
# of the operand it sends; a "-done" moves nothing new.
ASYNC_IN_LOOP = [
  Collective("body", "grad.start", "all-reduce-start", 2 * 32 * 4),
  Collective("body", "shift.start", "collective-permute-start", 2 * 32 * 4),
]
ASYNC_BEFORE_LOOP = Collective("main", "gather.start", "all-gather-start", 32)
ASYNC_CLOSING = [
  Collective("scatter", "scattered", "reduce-scatter", 2 * 32 * 4),
  Collective("close", "window.start", "all-reduce-start", 2 * 32 * 4),
  Collective("close", "updates.start", "all-gather-start", 2 * 4 * 4),
]


def test_collectives_in_hlo_counts_asynchronous_collectives_once():
  found = audits.collectives_in_hlo(audits.parse_hlo(ASYNC_TEXT))
  assert sorted(found) == sorted(
    [*ASYNC_IN_LOOP, ASYNC_BEFORE_LOOP, *ASYNC_CLOSING]
  )
  assert not [c for c in found if c.opcode.endswith("-done")]


def test_loop_collectives_sees_asynchronous_collectives_in_the_body():
  # On a GPU, "nothing moves inside the scan" must not hold because the
  # audit cannot read what the GPU prints.
  assert audits.loop_collectives(ASYNC_TEXT) == ASYNC_IN_LOOP


def test_window_collectives_sees_asynchronous_collectives_on_both_paths():
  found = audits.window_collectives(ASYNC_TEXT)
  assert found.closing_branch == "close"
  assert sorted(found.window_closing) == sorted(ASYNC_CLOSING)
  assert sorted(found.every_micro_step) == sorted(
    [*ASYNC_IN_LOOP, ASYNC_BEFORE_LOOP]
  )


def test_an_asynchronous_all_reduce_in_the_open_branch_is_refused():
  text = ASYNC_TEXT.replace(
    "branch_computations={%keep_open, %close}",
    "branch_computations={%close, %keep_open}",
  )
  with pytest.raises(ValueError, match="last one of its conditional"):
    audits.window_collectives(text)


def test_parse_hlo_rejects_text_without_an_entry():
  with pytest.raises(ValueError, match="hlo_text must be the text"):
    audits.parse_hlo("f32[] add(%a, %b)")


@pytest.mark.parametrize(
  ("shape", "expected"),
  [
    ("f32[4,3]{1,0}", 48),
    ("(f32[4,3]{1,0}, /*index=1*/bf16[2], pred[])", 48 + 4 + 1),
    ("s32[]", 4),
    ("token[]", 0),
  ],
)
def test_shape_bytes(shape, expected):
  assert shape_bytes(shape) == expected


# The head of the hand-written modules below: the computations of a
# window's side, a loop of at most one trip (its scope is named where the
# entry runs it). An audit refuses a module without one.
A_WINDOW_SIDE = """\
HloModule jit_step, is_scheduled=true

%side_cond (c: (pred[], f32[8])) -> pred[] {
  %c = (pred[], f32[8]{0}) parameter(0)
  ROOT %go = pred[] get-tuple-element(%c), index=0
}

%side_body (b: (pred[], f32[8])) -> (pred[], f32[8]) {
  ROOT %b = (pred[], f32[8]{0}) parameter(0)
}
"""


def a_micro_step_on_p(instructions: str) -> str:
  """A module whose entry opens the window's side, then runs
  ``instructions`` (the last of them its root) on its parameter ``%p``, an
  ``f32[256]``."""
  return (
    A_WINDOW_SIDE
    + """
ENTRY %main (p: f32[256], q: (pred[], f32[8])) -> f32[256] {
  %p = f32[256]{0} parameter(0)
  %q = (pred[], f32[8]{0}) parameter(1)
  %opened = (pred[], f32[8]{0}) while(%q), condition=%side_cond, body=%side_body, metadata={op_name="jit(step)/ga_optax_keep_open/while"}
"""
    + instructions
    + "}\n"
  )


# A window's micro-step that copies a buffer to host memory asynchronously:
# XLA prints the copy as a ``copy-start`` / ``copy-done`` pair, the start's
# result a tuple of the destination, the source and a context.
ASYNC_COPY_TEXT = a_micro_step_on_p("""\
  %copy-start = (f32[256]{0:S(5)}, f32[256]{0}, u32[]) copy-start(%p)
  ROOT %copy-done = f32[256]{0:S(5)} copy-done(%copy-start)
""")


def test_path_audit_counts_an_asynchronous_copy_once():
  audit = audits.path_audit(ASYNC_COPY_TEXT, "micro_step")
  assert audit.copies == [audits.Copy("main", "copy-start", 1024, True)]
  assert audit.duplicates == []  # a move into host memory (S(5))
  # Read once and written once, as a copy: not its tuple's 2 KiB and more.
  assert audit.bytes_moved == 2 * 1024


# A TPU program prefetches a buffer into its on-chip memory (S(1)) in
# slices: each ``slice-start``'s result is a tuple of the source, the slice
# and a context, and a ``ConcatBitcast`` custom call views the slices, side
# by side, as one buffer.
SLICED_PREFETCH_TEXT = a_micro_step_on_p("""\
  %slice-start = ((f32[256]{0}), f32[128]{0:S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[0:128]}
  %slice-start.1 = ((f32[256]{0}), f32[128]{0:S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[128:256]}
  %slice-done = f32[128]{0:S(1)} slice-done(%slice-start)
  %slice-done.1 = f32[128]{0:S(1)} slice-done(%slice-start.1)
  %custom-call = f32[256]{0:S(1)} custom-call(%slice-done, %slice-done.1), custom_call_target="ConcatBitcast"
  ROOT %negate = f32[256]{0} negate(%custom-call)
""")


def test_path_audit_counts_a_sliced_prefetch_once():
  audit = audits.path_audit(SLICED_PREFETCH_TEXT, "micro_step")
  # By hand: each slice-start reads and writes its 512 bytes (not the whole
  # 1 KiB source, nor its tuple); the view moves nothing; the negate reads
  # and writes 1 KiB.
  assert audit.bytes_moved == 2 * (512 + 512) + 2 * 1024
  assert audit.copies == []


def test_path_audit_refuses_a_step_without_a_window():
  def adamw_step(params, grads):
    return params - 1e-3 * grads

  params = jnp.ones((8, 8))
  program = jax.jit(adamw_step).lower(params, params).compile()
  with pytest.raises(ValueError, match="no ga_optax window") as refused:
    audits.path_audit(program, "micro_step")
  # The message says what to compare instead.
  assert "require_window=False" in str(refused.value)
  assert "optax.MultiSteps" in str(refused.value)
  # Audited as a baseline, both paths are the whole program.
  micro_step, closing = (
    audits.path_audit(program, path, require_window=False)
    for path in ("micro_step", "closing")
  )
  assert micro_step == closing._replace(path="micro_step")
  assert micro_step.bytes_moved >= 3 * params.nbytes


# The path audit's counting, on one hand-written module: a branch that
# empties a window closed without weight (run on neither path), one
# computation called from two call sites (run twice), an asynchronous copy
# within device memory (a duplicate, not a move), and a plain copy of 512
# bytes.
COUNTING_TEXT = (
  A_WINDOW_SIDE
  + """
%empty_cond (ec: (pred[], f32[256])) -> pred[] {
  %ec = (pred[], f32[256]{0}) parameter(0)
  ROOT %ego = pred[] get-tuple-element(%ec), index=0
}

%empty_body (eb: (pred[], f32[256])) -> (pred[], f32[256]) {
  %eb = (pred[], f32[256]{0}) parameter(0)
  %flag = pred[] get-tuple-element(%eb), index=0
  %sums = f32[256]{0} get-tuple-element(%eb), index=1
  %zeros = f32[256]{0} multiply(%sums, %sums)
  ROOT %emptied = (pred[], f32[256]{0}) tuple(%flag, %zeros)
}

%twice (x: f32[64]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  ROOT %y = f32[64]{0} add(%x, %x)
}

ENTRY %main (p: f32[256], q: (pred[], f32[8]), r: (pred[], f32[256]), s: f32[64], t: f32[128]) -> (f32[64], f32[64], f32[256], f32[128]) {
  %p = f32[256]{0} parameter(0)
  %q = (pred[], f32[8]{0}) parameter(1)
  %r = (pred[], f32[256]{0}) parameter(2)
  %s = f32[64]{0} parameter(3)
  %t = f32[128]{0} parameter(4)
  %opened = (pred[], f32[8]{0}) while(%q), condition=%side_cond, body=%side_body, metadata={op_name="jit(step)/ga_optax_keep_open/while"}
  %empty = (pred[], f32[256]{0}) while(%r), condition=%empty_cond, body=%empty_body, metadata={op_name="jit(step)/ga_optax_empty_window/while"}
  %once = f32[64]{0} call(%s), to_apply=%twice
  %again = f32[64]{0} call(%s), to_apply=%twice
  %copy-start = (f32[256]{0}, f32[256]{0}, u32[]) copy-start(%p)
  %copy-done = f32[256]{0} copy-done(%copy-start)
  %copy = f32[128]{0} copy(%t)
  ROOT %out = (f32[64]{0}, f32[64]{0}, f32[256]{0}, f32[128]{0}) tuple(%once, %again, %copy-done, %copy)
}
"""
)


@pytest.mark.parametrize("path", ["micro_step", "closing"])
def test_path_audit_counts_each_call_and_no_empty_window(path):
  audit = audits.path_audit(COUNTING_TEXT, path)
  # By hand: each call's add reads 2 x 256 bytes and writes 256; the
  # asynchronous copy reads and writes 1 KiB; the copy 512 bytes each way.
  # The empty window's multiply (3 KiB) runs on neither path.
  assert audit.bytes_moved == 2 * 768 + 2 * 1024 + 2 * 512
  duplicates = [audits.Copy("main", "copy-start", 1024, False)]
  duplicates.append(audits.Copy("main", "copy", 512, False))
  assert audit.copies == duplicates
  # Both in device memory: duplicates, not moves between memory spaces.
  assert audit.duplicates == duplicates
  # A copy of exactly at_least bytes counts.
  assert audit.copied_bytes(at_least=512) == 1024 + 512
  assert audit.copied_bytes(at_least=1024) == 1024
  assert audit.copied_bytes(at_least=1025) == 0
