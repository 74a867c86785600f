"""The program a TPU compiles: the window's claims on a compile-only TPU.

``libtpu`` compiles for a v5e slice on this machine
(:func:`audits.compile_for_tpu`); the programs are read, never run.
The workload is a 4 x 1024² tanh MLP with Adam, k = 4, params and state
donated as a training loop does (bias-free, micro-batches of 64 rows; the
claims on duplicates also hold on one with biases and 8 rows). Every ratio
below compares two programs compiled here, in one run; none is a time.

On a TPU the window takes its loop form (the platform's). The device's
schedule keeps the optimizer off the micro-step, and the host's schedule
(``closing=``) compiles to programs without control flow. Every audit has a
planted control, a program that breaks its claim and fails it. Three claims
fail on a TPU and are held as known misses: at 4 x 4096², past the chip's
on-chip memory, ``accumulate``'s device-scheduled program duplicates its
accumulator in HBM on every call (the updates the closing side wrote into
its buffer, copied before it is zeroed) and peaks above MultiSteps; at
4 x 1024² it duplicates nothing. ``accumulate_and_apply`` duplicates
nothing, and from 4 x 2048² its micro-step moves the floor's bytes; at
4 x 1024² it does not, nor does ``accumulate``'s micro-step come within
1.5 floors at either size: the chip moves the closing side's state into
its on-chip memory and back on every call.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from control_flow import window_of_selects
from gpu_compiler import or_skip
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src import audits

# Skipped where libtpu is missing, except in CI, which installs it: there
# the tests fail with TpuCompilerUnavailable and the command that installs it.
if importlib.util.find_spec("libtpu") is None and not os.environ.get("CI"):
  pytest.skip(
    f'libtpu compiles for TPUs: pip install "jax[tpu]=={jax.__version__}"',
    allow_module_level=True,
  )

WIDTH, LAYERS, ROWS, K = 1024, 4, 64, 4
PARAM_BYTES = LAYERS * WIDTH * WIDTH * 4


def mlp_params(
  layers: int = LAYERS, biases: bool = False, width: int = WIDTH
) -> dict[str, jax.Array]:
  params = {f"w{i}": jnp.zeros((width, width)) for i in range(layers)}
  if biases:
    params.update({f"b{i}": jnp.zeros((width,)) for i in range(layers)})
  return params


def mlp_loss(params: dict[str, jax.Array], inputs: jax.Array) -> jax.Array:
  for index in range(sum(name.startswith("w") for name in params)):
    inputs = inputs @ params[f"w{index}"]
    if f"b{index}" in params:
      inputs = inputs + params[f"b{index}"]
    inputs = jnp.tanh(inputs)
  return jnp.mean(inputs**2)


def train_step(tx: optax.GradientTransformation, **update_options: Any) -> Any:
  def step(params, state, inputs):
    grads = jax.grad(mlp_loss)(params, inputs)
    updates, state = tx.update(grads, state, params, **update_options)
    return optax.apply_updates(params, updates), state

  return step


def steps() -> dict[str, tuple[Any, Any]]:
  """Each contender's train step and its transformation (for its state)."""
  adam = optax.adam(1e-3)
  accumulate = ga_optax.accumulate(adam, K)
  fused = ga_optax.accumulate_and_apply(adam, K)
  multi_steps = optax.MultiSteps(adam, K)

  def fused_step(params, state, inputs):
    return fused.apply(params, jax.grad(mlp_loss)(params, inputs), state)

  return {
    "accumulate": (train_step(accumulate), accumulate),
    "host_micro_step": (train_step(accumulate, closing=False), accumulate),
    "host_closing": (train_step(accumulate, closing=True), accumulate),
    "accumulate_and_apply": (fused_step, fused),
    "multi_steps": (train_step(multi_steps), multi_steps),
  }


# The models the programs are compiled for, as (biases, rows per
# micro-batch): the tests' own, and one with biases and micro-batches of 8
# rows, on which the duplicate claims are held too (the chip's compiler
# places their buffers differently).
MODELS = {"bias_free_64_rows": (False, ROWS), "biases_8_rows": (True, 8)}


@functools.cache
def compiled(
  name: str, model: str = "bias_free_64_rows", width: int = WIDTH
) -> Any:
  """The step ``name`` compiled for one v5e chip, params and state donated."""
  step, tx = steps()[name]
  biases, rows = MODELS[model]
  params = mlp_params(biases=biases, width=width)
  return audits.compile_for_tpu(
    step,
    params,
    tx.init(params),
    jnp.zeros((rows, width)),
    donate_argnums=(0, 1),
  )


def peak(name: str) -> int:
  return compiled(name).memory_analysis().peak_memory_in_bytes


def large_duplicates(audit: audits.PathAudit) -> list[audits.Copy]:
  """Duplicates of a buffer of a megabyte or more (a parameter's, say)."""
  return [copy for copy in audit.duplicates if copy.bytes >= 2**20]


def test_the_host_scheduled_programs_hold_no_control_flow():
  for name in ("host_micro_step", "host_closing"):
    text = compiled(name).as_text()
    assert " while(" not in text and " conditional(" not in text, name
  # The control: the device-scheduled step holds its window's loops.
  assert " while(" in compiled("accumulate").as_text()


def test_no_program_peaks_above_multi_steps():
  multi_steps = peak("multi_steps")
  assert multi_steps > PARAM_BYTES  # a figure worth comparing
  for name in ("accumulate", "host_micro_step", "host_closing"):
    assert peak(name) <= multi_steps, (name, peak(name) / multi_steps)


# The steps compiled at 4 x 4096². (accumulate_and_apply is left out of
# the 4 x 1024² comparison: there on-chip memory decides, and on jax 0.12
# it peaks at 8.77 x the params against MultiSteps' 8.34.)
WIDE = (
  "accumulate",
  "host_micro_step",
  "host_closing",
  "accumulate_and_apply",
  "multi_steps",
)


WIDE_WIDTH = 4096


def wide_params() -> dict[str, jax.ShapeDtypeStruct]:
  """The params at 4 x 4096² (256 MiB): past the chip's on-chip memory."""
  return {
    f"w{i}": jax.ShapeDtypeStruct((WIDE_WIDTH, WIDE_WIDTH), jnp.float32)
    for i in range(LAYERS)
  }


def compiled_wide(step: Any, state: Any) -> Any:
  """``step`` compiled at 4 x 4096² for one v5e chip, donated."""
  return audits.compile_for_tpu(
    step,
    wide_params(),
    state,
    jax.ShapeDtypeStruct((ROWS, WIDE_WIDTH), jnp.float32),
    donate_argnums=(0, 1),
  )


def wide_peak(program: Any) -> float:
  """A program's peak memory at 4 x 4096², in multiples of the params."""
  return program.memory_analysis().peak_memory_in_bytes / (
    LAYERS * WIDE_WIDTH * WIDE_WIDTH * 4
  )


@functools.cache
def wide_peaks() -> dict[str, float]:
  """Peak memory at 4 x 4096², in multiples of the params: past the chip's
  on-chip memory, where a duplicated buffer costs HBM."""
  peaks = {}
  for name in WIDE:
    step, tx = steps()[name]
    program = compiled_wide(step, jax.eval_shape(tx.init, wide_params()))
    peaks[name] = wide_peak(program)
  return peaks


def test_at_4096_wide_the_host_schedule_and_the_fused_window_peak_at_most_multi_steps():
  peaks = wide_peaks()
  assert peaks["multi_steps"] > 4  # params, Adam's two moments, accumulator
  for name in ("host_micro_step", "host_closing", "accumulate_and_apply"):
    assert peaks[name] <= peaks["multi_steps"], peaks


@pytest.mark.xfail(
  strict=True,
  raises=AssertionError,
  reason="known miss: at 4 x 4096² accumulate's device-scheduled window"
  " duplicates its accumulator in HBM (5.00 x params against MultiSteps'"
  " 4.52 x)",
)
def test_at_4096_wide_accumulates_device_scheduled_window_peaks_below_multi_steps():
  peaks = wide_peaks()
  assert peaks["accumulate"] <= peaks["multi_steps"], peaks


def test_clearing_on_the_next_first_micro_step_trades_the_tpu_peak_for_h100_bytes():
  """Why the window clears its accumulator at the close, measured.

  Cleared on the next window's first micro-step instead
  (benchmarks/clearing.py), the closing call can leave the updates in the
  accumulator's buffer: the TPU then duplicates nothing and peaks at most at
  MultiSteps' at 4 x 4096², where accumulate does not (the known miss
  above, 5.00 x params against 4.52 x). But a micro-step then selects
  before it adds, and on the H100 its add no longer ends the gradient's
  matrix product: it moves more than accumulate's micro-step. The state has
  one meaning on every platform (a checkpoint moves between them), so one of
  the two must give.
  """
  from benchmarks import clearing

  adam = optax.adam(1e-3)
  program = compiled_wide(
    clearing.deferred_clearing_step(mlp_loss, adam, K),
    clearing.deferred_clearing_state(adam, wide_params()),
  )
  deferred = wide_peak(program)
  micro = audits.path_audit(program, "micro_step")
  assert large_duplicates(micro) == []
  peaks = wide_peaks()
  assert deferred <= peaks["multi_steps"], (deferred, peaks)
  h100 = or_skip(clearing.on_an_h100, WIDTH, LAYERS, ROWS, K)
  assert (
    h100[clearing.ACCUMULATE]["micro_step_x_floor"]
    < h100[clearing.DEFERRED]["micro_step_x_floor"]
    < h100[clearing.MULTI_STEPS]["micro_step_x_floor"]
  ), h100


def test_a_loop_that_keeps_its_state_peaks_above_multi_steps():
  """The control: the same window, its state not donated.

  The program must then hold the old state and the new one at once, which
  the peak-memory audit has to see.
  """
  tx = ga_optax.accumulate(optax.adam(1e-3), K)
  params = mlp_params()
  program = audits.compile_for_tpu(
    train_step(tx),
    params,
    tx.init(params),
    jnp.zeros((ROWS, WIDTH)),
    donate_argnums=(0,),
  )
  kept = program.memory_analysis().peak_memory_in_bytes
  assert kept > peak("multi_steps") + PARAM_BYTES, kept / PARAM_BYTES


def test_a_micro_step_runs_no_optimizer_and_moves_less_than_multi_steps():
  multi_steps = audits.path_audit(
    compiled("multi_steps"), "micro_step", require_window=False
  )
  micro = audits.path_audit(compiled("accumulate"), "micro_step")
  closing = audits.path_audit(compiled("accumulate"), "closing")
  host_micro = audits.path_audit(
    compiled("host_micro_step"), "micro_step", require_window=False
  )
  assert micro.misplaced_closing_work == []
  # Adam runs only when the window closes: at least its moments' bytes more.
  assert closing.bytes_moved - micro.bytes_moved >= 2 * PARAM_BYTES
  assert micro.bytes_moved < multi_steps.bytes_moved
  assert host_micro.bytes_moved < micro.bytes_moved
  assert large_duplicates(host_micro) == []


def micro_step_x_floor(name: str, model: str, width: int) -> float:
  """The bytes ``name``'s micro-step moves, in multiples of the floor's.

  The floor is the host's micro-step (``closing=False``): the gradient and
  its add, in a program without control flow.
  """
  floor = audits.path_audit(
    compiled("host_micro_step", model, width),
    "micro_step",
    require_window=False,
  )
  micro = audits.path_audit(compiled(name, model, width), "micro_step")
  assert micro.misplaced_closing_work == []
  return micro.bytes_moved / floor.bytes_moved


# Below 4 x 2048² the chip's compiler moves Adam's moments into its on-chip
# memory before the window's closing loop and back after it, on every call
# whether the loop runs or not; neither form of the window keeps them out
# (docs/benchmarks.md, the v5e section of 2026-12-05).
ON_CHIP_MOVES = pytest.mark.xfail(
  strict=True,
  raises=AssertionError,
  reason="known miss: at 4 x 1024² the chip moves Adam's moments on-chip"
  " and back around the closing loop on every call",
)


@pytest.mark.parametrize(
  "width", [pytest.param(WIDTH, marks=ON_CHIP_MOVES), 2 * WIDTH]
)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_fused_window_s_micro_step_moves_the_floor_s_bytes(model, width):
  """``accumulate_and_apply`` device-scheduled: a micro-step at the floor.

  Within 1% of the host's micro-step, not equal to it: the chip moves a
  few more small buffers in and out of its on-chip memory for the
  window's program. Both models, from 4 x 2048².
  """
  assert micro_step_x_floor("accumulate_and_apply", model, width) <= 1.01


@pytest.mark.xfail(
  strict=True,
  raises=AssertionError,
  reason="known miss: accumulate's micro-step also applies zero updates"
  " (the params read and written) and the chip copies its accumulator"
  " around the window's loops",
)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_accumulate_s_micro_step_moves_at_most_one_and_a_half_floors(model):
  assert micro_step_x_floor("accumulate", model, 2 * WIDTH) <= 1.5


def test_a_window_turned_into_selects_runs_the_optimizer_on_the_micro_step():
  """The control: Adam on every call, a select keeping its result.

  What a compiler makes of a window whose sides became selects: the
  closing work then sits on the micro-step's path, where the audit finds
  it, and the micro-step's bytes hold Adam's moments, read and written.
  """
  adam = optax.adam(1e-3)
  step = window_of_selects(
    adam, jax.grad(mlp_loss), lambda inputs: inputs[0, 0] > 0
  )
  params = mlp_params()
  program = audits.compile_for_tpu(
    step,
    params,
    adam.init(params),
    jnp.zeros((ROWS, WIDTH)),
    donate_argnums=(0, 1),
  )
  micro = audits.path_audit(program, "micro_step", require_window=False)
  host_micro = audits.path_audit(
    compiled("host_micro_step"), "micro_step", require_window=False
  )
  assert micro.misplaced_closing_work != []
  assert micro.bytes_moved - host_micro.bytes_moved >= 4 * PARAM_BYTES


def test_the_audit_tells_memory_space_moves_from_duplicates():
  # A buffer returned twice is duplicated in the chip's main memory; the
  # window's step moves buffers into on-chip memory and back, and those
  # moves are no duplicates.
  control = audits.path_audit(
    audits.compile_for_tpu(lambda x: (x, x), jnp.zeros((WIDTH, WIDTH))),
    "micro_step",
    require_window=False,
  )
  assert [copy.bytes for copy in large_duplicates(control)] == [WIDTH**2 * 4]
  micro = audits.path_audit(compiled("accumulate"), "micro_step")
  moves = [copy for copy in micro.copies if copy.between_memory_spaces]
  assert sum(copy.bytes for copy in moves) >= PARAM_BYTES


@pytest.mark.parametrize("model", sorted(MODELS))
def test_no_path_of_the_device_scheduled_windows_duplicates_a_parameter(model):
  """Neither window duplicates a parameter-sized buffer, on either path.

  ``accumulate``'s closing side zeroes the accumulator with zeros it writes
  without reading (placements/local.py: zeroed); zeros read from the
  updates' buffer made the TPU compiler copy four parameter-sized buffers
  in on-chip memory on every call. ``accumulate_and_apply`` writes the new
  params into their own buffer and leaves the accumulator at zero in its
  own. The buffers the chip moves into its on-chip memory and back are no
  duplicates (the audit's control is above).
  """
  for name in ("accumulate", "accumulate_and_apply"):
    for path in ("micro_step", "closing"):
      audit = audits.path_audit(compiled(name, model), path)
      assert large_duplicates(audit) == [], (name, path)
      assert audit.misplaced_closing_work == [], (name, path)


@pytest.mark.devices(4)
def test_on_four_chips_the_gradient_is_reduced_once_per_window():
  mesh = jax.make_mesh(
    (4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4]
  )
  tx = ga_optax.accumulate(optax.adam(1e-3), K, unreduced_axes="data")
  value_and_grad = ga_optax.unreduced_value_and_grad(mlp_loss)

  def step(params, state, inputs):
    _, grads = value_and_grad(params, inputs)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    params = jax.device_put(mlp_params(2), P())
    program = audits.compile_for_tpu(
      step,
      params,
      jax.jit(tx.init)(params),
      jax.device_put(jnp.zeros((ROWS, WIDTH)), P("data")),
      num_devices=4,
      donate_argnums=(0, 1),
    )
  gradient_bytes = 2 * WIDTH * WIDTH * 4
  micro = audits.path_audit(program, "micro_step")
  closing = audits.path_audit(program, "closing")
  # Every call sums the micro-step's weight, a scalar; only the closing
  # call reduces the gradient, once.
  assert [c.operand_bytes for c in micro.collectives] == [4]
  assert sorted(c.operand_bytes for c in closing.collectives) == [
    4,
    gradient_bytes,
  ]


@pytest.mark.devices(4)
def test_on_four_chips_a_reduced_gradient_is_all_reduced_on_every_call():
  """The control: without ``unreduced_axes`` the data-parallel gradient is
  summed over the chips where it is made, on every micro-step; the
  collective audit must see it on the micro-step's path."""
  mesh = jax.make_mesh(
    (4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4]
  )
  tx = ga_optax.accumulate(optax.adam(1e-3), K)
  with jax.set_mesh(mesh):
    params = jax.device_put(mlp_params(2), P())
    program = audits.compile_for_tpu(
      train_step(tx),
      params,
      jax.jit(tx.init)(params),
      jax.device_put(jnp.zeros((ROWS, WIDTH)), P("data")),
      num_devices=4,
      donate_argnums=(0, 1),
    )
  micro = audits.path_audit(program, "micro_step")
  gradient_bytes = 2 * WIDTH * WIDTH * 4
  assert sum(c.operand_bytes for c in micro.collectives) >= gradient_bytes


def test_the_planner_compiles_for_a_tpu_chip():
  """``device=`` compiles the planner's micro-step for a v5e chip.

  Its bytes are the TPU program's memory analysis, read here by hand from
  the same step compiled with ``compile_for_tpu``, and differ from the CPU
  program's. (docs/how-to/tpu.md plans a micro-batch with them.)
  """
  (chip,) = audits.tpu_devices()
  adam = optax.adam(1e-3)
  params = mlp_params(2)

  def loss_fn(params, batch):
    return mlp_loss(params, batch["x"])

  # The planner's micro-step: accumulate(optimizer, 2), params and state
  # donated.
  tx = ga_optax.accumulate(adam, 2)
  program = audits.compile_for_tpu(
    train_step(tx),
    params,
    tx.init(params),
    jnp.zeros((32, WIDTH)),
    donate_argnums=(0, 1),
  )
  analysis = program.memory_analysis()
  by_hand = (
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
    + analysis.temp_size_in_bytes
  )
  batch = {"x": jnp.zeros((1, WIDTH))}
  on_the_chip = ga_optax.planning.micro_step_bytes(
    loss_fn, params, batch, 32, optimizer=adam, device=chip
  )
  on_the_cpu = ga_optax.planning.micro_step_bytes(
    loss_fn, params, batch, 32, optimizer=adam
  )
  assert on_the_chip == by_hand != on_the_cpu


def test_the_one_chip_v4_slice_compiles_a_window():
  """A v4 chip is two devices to JAX: its one-chip slice, as documented."""
  devices = audits.tpu_devices(2, target="v4")
  assert len(devices) == 2
  tx = ga_optax.accumulate(optax.adam(1e-3), 2)
  params = mlp_params(1)
  program = audits.compile_for_tpu(
    train_step(tx),
    params,
    tx.init(params),
    jnp.zeros((8, WIDTH)),
    num_devices=2,
    target="v4",
    donate_argnums=(0, 1),
  )
  micro = audits.path_audit(program, "micro_step")
  # The micro-step reads the parameter at least, and holds no closing work.
  assert micro.bytes_moved >= WIDTH * WIDTH * 4
  assert micro.misplaced_closing_work == []


def test_a_bad_slice_is_named():
  with pytest.raises(ValueError, match="num_devices"):
    audits.tpu_devices(3)
  with pytest.raises(ValueError, match="target"):
    audits.tpu_devices(1, target="v3")
  with pytest.raises(TypeError, match="num_devices"):
    audits.tpu_devices(True)


def test_the_memory_benchmark_runs_and_its_plan_fits(tmp_path):
  from benchmarks import tpu_memory

  small = ["--depth", "1", "--width", "256", "--micro-batch", "8"]
  record = tpu_memory.main(
    [*small, "--global-batch", "64", "--output", str(tmp_path / "tpu.json")]
  )
  peaks = record["peak_bytes"]
  assert len(peaks) == 6 and min(peaks.values()) > record["param_bytes"]
  moved = record["micro_step_bytes_moved"]
  assert list(moved) == list(tpu_memory.MICRO_STEPS)
  # MultiSteps runs Adam on every call; the floor, no optimizer at all.
  assert moved["optax.MultiSteps"] > moved[tpu_memory.FLOOR] > 0
  plan = record["plan"]
  assert plan["micro_batch_size"] * plan["num_microbatches"] == 64
  assert plan["compiled_bytes"] <= plan["memory_budget_bytes"]
