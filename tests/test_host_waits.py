"""Host waits read off the thunks XLA:GPU builds, and the recipe that ends them.

:func:`audits.host_waits` counts, per path of the window, how
often the host waits for the GPU: once per trip of a loop outside a CUDA
graph and once more to leave it (none for a loop of known trip count), once
per conditional. First on printed thunk sequences, where every figure is
known; then on programs XLA:GPU compiles for compile-only H100s (the
window's whole matrix is in tests/test_gpu_program.py): control flow of
each kind on the host and in a graph, the driver version without which a
compile-only H100 keeps every loop on the host, and
:func:`gpu_compiler_options` against the defaults of the installed
XLA, which it must repeat.
"""

from __future__ import annotations

import pathlib
import re
import tempfile

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from gpu_compiler import compiled_for_gpu, host_waits_on_gpu

import ga_optax
from ga_optax._src import audits
from ga_optax._src.audits import gpu_compile
from ga_optax._src.recipes.gpu_recipe import gpu_compiler_options

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A step of the window written as XLA:GPU compiles it: the keep-open side,
# the closing side, and a lax.scan of known trip count inside the closing
# side; and a conditional outside the window.
HLO = """\
HloModule step, is_scheduled=true

%side_cond (c: (pred[], f32[8])) -> pred[] {
  %c = (pred[], f32[8]{0}) parameter(0)
  ROOT %go = pred[] get-tuple-element(%c), index=0
}

%side_body (b: (pred[], f32[8])) -> (pred[], f32[8]) {
  ROOT %b = (pred[], f32[8]{0}) parameter(0)
}

%scan_cond (sc: (s32[], f32[8])) -> pred[] {
  %sc = (s32[], f32[8]{0}) parameter(0)
  ROOT %more = pred[] constant(true)
}

%close_body (cb: (pred[], f32[8])) -> (pred[], f32[8]) {
  %cb = (pred[], f32[8]{0}) parameter(0)
  %scan = (s32[], f32[8]{0}) while(%cb), condition=%scan_cond, body=%side_body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %out = (pred[], f32[8]{0}) copy(%cb)
}

%branch (x: f32[8]) -> f32[8] {
  ROOT %x = f32[8]{0} parameter(0)
}

ENTRY %main (p: (pred[], f32[8]), q: pred[], r: f32[8]) -> f32[8] {
  %p = (pred[], f32[8]{0}) parameter(0)
  %q = pred[] parameter(1)
  %r = f32[8]{0} parameter(2)
  %opened = (pred[], f32[8]{0}) while(%p), condition=%side_cond, body=%side_body, metadata={op_name="jit(step)/ga_optax_keep_open/while"}
  %closed = (pred[], f32[8]{0}) while(%opened), condition=%side_cond, body=%close_body, metadata={op_name="jit(step)/ga_optax_close_window/while"}
  ROOT %picked = f32[8]{0} conditional(%q, %r, %r), true_computation=%branch, false_computation=%branch
}
"""

# Thunks as XLA prints them: ids, kinds, nesting by indentation.
ALL_ON_THE_HOST = """\
001: kCustomKernel  [source       | next=002 (1)] loop_fusion grid: [1, 1, 1]
002: kWhile         [prev=001 (1) | next=003 (1)]
condition:
    No thunks.  body:
    000: kCommandBuffer [source | sink]
        004: kCustomKernel [source | sink] loop_add_fusion grid: [8, 1, 1]
003: kWhile         [prev=002 (1) | next=006 (1)]
condition:
    No thunks.  body:
    005: kWhile        [source | sink]
    condition:
        No thunks.  body:
        007: kCustomKernel [source | sink] loop_fusion grid: [1, 1, 1]
006: kConditional  [prev=003 (1) | sink        ]
  false_branch:
    008: kCustomKernel [source | sink] loop_fusion grid: [1, 1, 1]
  true_branch:
    009: kCustomKernel [source | sink] loop_fusion grid: [1, 1, 1]
"""
ONE_GRAPH = """\
000: kCommandBuffer [source | sink]
    002: kWhile        [source | sink]
    condition:
        No thunks.  body:
        004: kCustomKernel [source | sink] loop_add_fusion grid: [8, 1, 1]
    003: kWhile        [source | sink]
    condition:
        No thunks.  body:
        005: kWhile        [source | sink]
    006: kConditional  [source | sink]
"""
METADATA = "".join(
  f"""thunk_metadata {{
  thunk_info {{
    profile_annotation: "{name}"
    thunk_id: {thunk_id}
  }}
  thunk_kind: "{kind}"
}}
"""
  for thunk_id, name, kind in [
    (2, "opened", "kWhile"),
    (3, "closed", "kWhile"),
    (5, "scan", "kWhile"),
    (6, "picked", "kConditional"),
  ]
)


def test_waits_are_counted_per_path_from_the_printed_thunks():
  waits = audits.count_host_waits(HLO, ALL_ON_THE_HOST, METADATA)
  assert waits.top_level == ("custom_kernel", "while", "while", "conditional")
  assert waits.on_host == ("opened", "closed", "scan", "picked")
  # A micro-step: keep-open's one trip (2), the closing side's none (1),
  # the conditional (1); the scan inside the closing side does not run.
  assert waits.micro_step == 2 + 1 + 1
  # Closing: the other way round; the scan's 4 trips, counted by the host,
  # wait for nothing.
  assert waits.closing == 1 + 2 + 1


# The keep-open side holding a loop of unknown trip count: the loop runs
# once on a micro-step and not at all when the window closes.
HLO_LOOP_IN_THE_OPEN_SIDE = """\
HloModule step, is_scheduled=true

%side_cond (c: (pred[], f32[8])) -> pred[] {
  %c = (pred[], f32[8]{0}) parameter(0)
  ROOT %go = pred[] get-tuple-element(%c), index=0
}

%side_body (b: (pred[], f32[8])) -> (pred[], f32[8]) {
  ROOT %b = (pred[], f32[8]{0}) parameter(0)
}

%open_body (ob: (pred[], f32[8])) -> (pred[], f32[8]) {
  %ob = (pred[], f32[8]{0}) parameter(0)
  ROOT %inner = (pred[], f32[8]{0}) while(%ob), condition=%side_cond, body=%side_body
}

ENTRY %main (p: (pred[], f32[8])) -> (pred[], f32[8]) {
  %p = (pred[], f32[8]{0}) parameter(0)
  %opened = (pred[], f32[8]{0}) while(%p), condition=%side_cond, body=%open_body, metadata={op_name="jit(step)/ga_optax_keep_open/while"}
  ROOT %closed = (pred[], f32[8]{0}) while(%opened), condition=%side_cond, body=%side_body, metadata={op_name="jit(step)/ga_optax_close_window/while"}
}
"""
LOOP_IN_THE_OPEN_SIDE_ON_THE_HOST = """\
001: kWhile         [source       | next=002 (1)]
condition:
    No thunks.  body:
    003: kWhile        [source | sink]
    condition:
        No thunks.  body:
        004: kCustomKernel [source | sink] loop_fusion grid: [1, 1, 1]
002: kWhile         [prev=001 (1) | sink        ]
condition:
    No thunks.  body:
    005: kCustomKernel [source | sink] loop_add_fusion grid: [8, 1, 1]
"""
LOOP_IN_THE_OPEN_SIDE_METADATA = "".join(
  f"""thunk_metadata {{
  thunk_info {{
    profile_annotation: "{name}"
    thunk_id: {thunk_id}
  }}
  thunk_kind: "kWhile"
}}
"""
  for thunk_id, name in [(1, "opened"), (2, "closed"), (3, "inner")]
)


def test_a_loop_in_the_side_that_does_not_run_costs_no_wait():
  waits = audits.count_host_waits(
    HLO_LOOP_IN_THE_OPEN_SIDE,
    LOOP_IN_THE_OPEN_SIDE_ON_THE_HOST,
    LOOP_IN_THE_OPEN_SIDE_METADATA,
  )
  assert waits.on_host == ("opened", "inner", "closed")
  # A micro-step: keep-open's one trip (2), its loop's one (2), the
  # closing side's none (1).
  assert waits.micro_step == 2 + 2 + 1
  # Closing: keep-open's none (1), which leaves its loop unrun (0); the
  # closing side's one trip (2).
  assert waits.closing == 1 + 0 + 2


def test_control_flow_inside_a_command_buffer_costs_no_wait():
  waits = audits.count_host_waits(HLO, ONE_GRAPH, METADATA)
  assert waits[:4] == (0, 0, ("command_buffer",), ())


def test_counting_refuses_a_dump_of_another_program():
  with pytest.raises(ValueError, match="holds no thunk"):
    audits.count_host_waits(HLO, "", METADATA)
  with pytest.raises(ValueError, match="does not hold"):
    audits.count_host_waits(
      HLO, ALL_ON_THE_HOST, METADATA.replace('"closed"', '"elsewhere"')
    )
  with pytest.raises(TypeError, match="compiled program"):
    audits.count_host_waits(3, ALL_ON_THE_HOST, METADATA)


def test_host_waits_refuses_bad_arguments():
  with pytest.raises(TypeError, match="fun must be"):
    audits.host_waits("step")
  with pytest.raises(TypeError, match="compiler_options must be a mapping"):
    audits.host_waits(jnp.sin, 1.0, compiler_options=["WHILE"])
  with pytest.raises(ValueError, match="xla_dump_to"):
    audits.host_waits(jnp.sin, 1.0, compiler_options={"xla_dump_to": "/x"})
  with pytest.raises(TypeError, match="compiler_options must be a mapping"):
    audits.compile_for_gpu(jnp.sin, 1.0, compiler_options="WHILE")


def test_the_recipe_refuses_a_non_bool():
  with pytest.raises(TypeError, match="collectives must be True or False"):
    gpu_compiler_options(collectives="yes")


def test_the_recipe_changes_nothing_on_the_cpu():
  tx = ga_optax.accumulate(optax.adam(1e-2), 2)
  params = {"w": jnp.arange(6.0).reshape(2, 3)}

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  cpu = jax.devices("cpu")[0]
  params = jax.device_put(params, cpu)
  plain = jax.jit(step)
  recipe = jax.jit(step, compiler_options=gpu_compiler_options())
  expected, got = (params, tx.init(params)), (params, tx.init(params))
  for _ in range(4):
    expected = plain(*expected, params)
    got = recipe(*got, params)
  chex.assert_trees_all_equal(got, expected)


# On programs XLA:GPU compiles: each kind of control flow on the host under
# no command buffer at all, and captured under the recipe.


def control_flow(w, x, trips):
  """A conditional, a loop of unknown trip count, a lax.scan of 3 trips."""
  y = jax.lax.cond(
    x[0, 0] > 0, lambda: jnp.tanh(x @ w) @ w, lambda: (x @ w) @ w
  )
  y, _ = jax.lax.while_loop(
    lambda carry: carry[1] < trips,
    lambda carry: (jnp.tanh(carry[0] @ w), carry[1] + 1),
    (y, 0),
  )
  y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), y, None, length=3)
  return y


CONTROL_FLOW_ARGS = (jnp.ones((256, 256)), jnp.ones((256, 256)), 3)


def test_control_flow_outside_command_buffers_makes_the_host_wait():
  waits = host_waits_on_gpu(
    control_flow,
    *CONTROL_FLOW_ARGS,
    compiler_options={"xla_gpu_enable_command_buffer": ""},
  )
  assert waits.top_level.count("while") == 2, waits.top_level
  assert "conditional" in waits.top_level
  assert "command_buffer" not in waits.top_level
  # The conditional (1) and the loop of unknown trips, counted once (2);
  # the scan's trips the host counts without reading the device.
  assert waits.micro_step == waits.closing == 1 + 2


def test_the_recipe_captures_every_loop_and_conditional():
  waits = host_waits_on_gpu(
    control_flow,
    *CONTROL_FLOW_ARGS,
    compiler_options=gpu_compiler_options(),
  )
  assert waits[:4] == (0, 0, ("command_buffer",), ())


def accumulate_step():
  tx = ga_optax.accumulate(optax.adam(1e-3), 4)
  params = {"w": jnp.ones((512, 512))}

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step, (params, tx.init(params), params)


def test_a_target_without_a_driver_version():
  """A compile-only GPU reports driver 0.0.0 unless its target says more.

  jax 0.10's XLA:GPU then drops loops and conditionals from the
  command-buffer kinds whatever the options ask: the program compiled would
  not be the one a GPU with a CUDA 13 driver runs, hence the driver in the
  H100 target. jax 0.12's no longer holds a compile-only device to it.
  """
  without_driver = re.sub(r"\n *driver_version: [^\n]*", "", gpu_compile.H100)
  assert without_driver != gpu_compile.H100
  step, args = accumulate_step()
  options = {
    "donate_argnums": (0, 1),
    "compiler_options": gpu_compiler_options(),
  }
  waits = host_waits_on_gpu(step, *args, **options)
  assert (waits.micro_step, waits.closing) == (0, 0), waits.top_level
  # Every loop left on the host, as under XLA's default options.
  defaults = host_waits_on_gpu(step, *args, donate_argnums=(0, 1))
  assert defaults.micro_step > 0 and defaults.closing > 0, defaults.top_level
  waits = host_waits_on_gpu(step, *args, target=without_driver, **options)
  on_the_host = (
    (defaults.micro_step, defaults.closing)
    if jax.__version_info__ < (0, 12)
    else (0, 0)
  )
  assert (waits.micro_step, waits.closing) == on_the_host, waits.top_level


def xla_default_kinds() -> set[str]:
  """The command-buffer kinds the installed XLA:GPU enables by default.

  Read off the configuration XLA dumps with a compiled program.
  """
  with tempfile.TemporaryDirectory() as dump:
    compiled_for_gpu(
      jnp.sin, jnp.ones(4), compiler_options={"xla_dump_to": dump}
    )
    (config,) = [
      path
      for path in pathlib.Path(dump).glob("*.config.pbtxt")
      if "gpu_target_config" not in path.name
    ]
    return set(
      re.findall(r"xla_gpu_enable_command_buffer: (\w+)", config.read_text())
    )


def test_the_recipe_repeats_the_defaults_of_the_installed_xla():
  defaults = xla_default_kinds()
  assert "FUSION" in defaults, defaults
  for collectives in (True, False):
    options = gpu_compiler_options(collectives=collectives)
    kinds = set(options["xla_gpu_enable_command_buffer"].split(","))
    assert defaults <= kinds, defaults - kinds
    assert kinds - defaults == (
      {"WHILE", "COLLECTIVES"} if collectives else {"WHILE"}
    )
