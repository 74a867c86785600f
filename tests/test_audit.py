"""The audit entry point, ``ga_optax.testing.audit``, on its named targets.

A device-scheduled step is one program whose paths are the micro-step and
the closing step; a host-scheduled step is two programs (``closing=False``
and ``True``) without the window's branches, each one path. The report is
checked against what the private audits read off the same program, and
against figures that need no audit: the bytes of the state, a plain optax
step beside it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from gpu_compiler import compiled_for_gpu, or_skip
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src import audits
from ga_optax._src.window import window_form
from ga_optax.testing import AuditReport, PathReport, audit

WIDTH = 256


def loss_fn(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def params_of():
  return {"w": jnp.full((WIDTH, WIDTH), 0.01), "b": jnp.zeros(WIDTH)}


def batch_of(rows=8):
  return {"x": jnp.ones((rows, WIDTH)), "y": jnp.zeros((rows, WIDTH))}


TX = ga_optax.accumulate(optax.adam(1e-3), 4)


def step(params, state, batch, *, closing=None):
  grads = jax.grad(loss_fn)(params, batch)
  updates, state = TX.update(grads, state, params, closing=closing)
  return optax.apply_updates(params, updates), state


def adam_step(params, state, batch):
  grads = jax.grad(loss_fn)(params, batch)
  updates, state = optax.adam(1e-3).update(grads, state, params)
  return optax.apply_updates(params, updates), state


def args_of():
  params = params_of()
  return params, TX.init(params), batch_of()


def state_bytes(tree) -> int:
  return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


@functools.cache
def on(target: str, closing: bool | None = None) -> AuditReport:
  params = params_of()
  return or_skip(
    audit,
    step,
    *args_of(),
    target=target,
    donate_argnums=(0, 1),
    closing=closing,
    baseline=(adam_step, (params, optax.adam(1e-3).init(params), batch_of())),
  )


@pytest.mark.parametrize("target", ["h100", "cpu"])
def test_a_device_scheduled_step_runs_the_optimizer_on_the_closing_path(
  target,
):
  report = on(target)
  assert report.schedule == "device"
  assert [path.path for path in report.paths] == ["micro_step", "closing"]
  assert report.window_branches >= 2 and report.control_flow >= 2
  micro_step, closing = report.paths
  assert micro_step.misplaced_closing_work == 0
  # Adam reads and writes its two moments only when the window closes.
  adam_state = state_bytes(optax.adam(1e-3).init(params_of()))
  assert closing.bytes_moved - micro_step.bytes_moved >= adam_state
  # A micro-step moves less than a plain Adam step on the same batch.
  (plain,) = report.baseline.paths
  assert plain.path == "every_call"
  assert micro_step.bytes_moved < plain.bytes_moved
  assert report.baseline.schedule == "none"
  assert report.baseline.baseline is None


@pytest.mark.parametrize("target", ["h100", "cpu"])
def test_a_host_scheduled_program_is_one_path(target):
  for closing, name in ((False, "micro_step"), (True, "closing")):
    report = on(target, closing)
    assert report.schedule == "host"
    # No control flow, but the guard that keeps a window without weight
    # from stepping, a conditional in the CPU's form of the closing step.
    guards = int(
      closing
      and target == "cpu"
      and window_form.form_for("cpu") == window_form.CONDITIONAL
    )
    assert (report.control_flow, report.window_branches) == (guards, guards)
    (path,) = report.paths
    assert path.path == name
    assert report.path(name) is path
    # Its own work is where it belongs: the closing program's optimizer is
    # not "closing work" misplaced on a micro-step.
    assert path.misplaced_closing_work == 0
    with pytest.raises(KeyError, match="serves"):
      report.path("closing" if name == "micro_step" else "micro_step")
  adam_state = state_bytes(optax.adam(1e-3).init(params_of()))
  micro_step, closing = on(target, False).paths[0], on(target, True).paths[0]
  assert closing.bytes_moved - micro_step.bytes_moved >= adam_state


def test_the_closing_program_read_as_a_micro_step_would_misreport(monkeypatch):
  # The control for the test above: the private path audit, asked for the
  # micro-step of the closing=True program, calls its optimizer misplaced
  # (in the loops form: the CPU's guard would be a branch it skips).
  monkeypatch.setenv(window_form.VARIABLE, window_form.LOOPS)
  program = jax.jit(functools.partial(step, closing=True)).lower(*args_of())
  found = audits.path_audit(program.compile(), "micro_step")
  assert found.misplaced_closing_work


def test_the_host_never_waits_on_the_hosts_schedule():
  for closing in (False, True):
    (path,) = on("h100", closing).paths
    assert path.host_waits == 0
  # On the device's schedule the host drives the window's loops: the count
  # is the private audit's of the same step.
  waits = or_skip(audits.host_waits, step, *args_of(), donate_argnums=(0, 1))
  micro_step, closing = on("h100").paths
  assert (micro_step.host_waits, closing.host_waits) == (
    waits.micro_step,
    waits.closing,
  )
  assert micro_step.host_waits > 0


def test_peak_memory_is_the_compilers_and_holds_the_state():
  program = compiled_for_gpu(step, *args_of(), donate_argnums=(0, 1))
  report = on("h100")
  assert report.peak_memory == program.memory_analysis().peak_memory_in_bytes
  params, state, batch = args_of()
  assert report.peak_memory >= state_bytes((params, state, batch))


def test_no_parameter_is_duplicated_on_the_h100_programs():
  smallest = WIDTH * 4  # the bias's bytes
  paths = [on("h100", closing).paths[0] for closing in (False, True)]
  for path in [*paths, *on("h100").paths]:
    assert path.duplicated_bytes < smallest, path


def test_the_report_prints_a_table_of_its_paths():
  report = on("cpu")
  text = str(report)
  assert text.startswith("device-scheduled step on cpu")
  rows = [
    line for line in report.table().splitlines() if line[2:6] in "step baseline"
  ]
  assert [row.split(" | ")[1] for row in rows] == [
    "micro_step",
    "closing",
    "every_call",
  ]
  micro_step = report.paths[0]
  assert f"{micro_step.bytes_moved / 2**20:.1f}" in rows[0]
  assert all(isinstance(path, PathReport) for path in report.paths)


@pytest.mark.devices(8)
def test_the_windows_all_reduce_is_on_the_closing_program_only():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  tx = ga_optax.accumulate(optax.sgd(0.1), 4, unreduced_axes="data")
  value_and_grad = ga_optax.unreduced_value_and_grad(loss_fn)

  def dp_step(params, state, batch, *, closing):
    _, grads = value_and_grad(params, batch)
    updates, state = tx.update(grads, state, params, closing=closing)
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(mesh):
    params = jax.device_put(params_of(), P())
    args = (params, tx.init(params), jax.device_put(batch_of(64), P("data")))
  gradient_bytes = state_bytes(params_of())
  for target in ("cpu", "8xh100"):
    reports = {
      closing: or_skip(audit, dp_step, *args, target=target, closing=closing)
      for closing in (False, True)
    }
    (micro_step,) = reports[False].paths
    (closing,) = reports[True].paths
    # The micro-step adds unreduced gradients: no gradient crosses devices.
    assert micro_step.collective_bytes < gradient_bytes, target
    reduced = [
      size for opcode, size in closing.collectives if "all-reduce" in opcode
    ]
    assert sum(reduced) >= gradient_bytes, (target, closing.collectives)


def test_bad_arguments_are_named():
  args = args_of()
  with pytest.raises(ValueError, match="target must be one of"):
    audit(step, *args, target="tpu")
  with pytest.raises(TypeError, match="closing must be None"):
    audit(step, *args, target="cpu", closing=1)
  with pytest.raises(TypeError, match="baseline must be a pair"):
    audit(step, *args, target="cpu", baseline=adam_step)
  with pytest.raises(TypeError, match="step must be"):
    audit("step", *args, target="cpu")
