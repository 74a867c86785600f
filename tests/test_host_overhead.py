"""The host's schedule costs what a state-carrying window written by hand does.

The reference (``benchmarks/state_carrying.py``) carries what a
transformation must (the accumulator, the window's weight, a count, Adam's
state) and does the same work: the weighted add, the mean, one Adam step, a
cleared accumulator; the host chooses which of its two programs runs. Each
program of ``accumulate`` and ``accumulate_and_apply`` on the host's
schedule (``closing=False`` and ``True``), on an MLP of 2 x 256^2 with
biases, Adam, k = 4, is compiled once and held to the reference's:

* on an H100 (XLA:GPU, compile-only, XLA's defaults), a micro-step
  launches no more kernels than the reference's, and a window of 3
  micro-steps and a closing step at most 2 more;
* on an H100 and a v5e chip (libtpu, compile-only), no program copies more
  buffers of a parameter's size than the reference's;
* on the CPU the same, and no program copies the optimizer's state: the
  guard of a window without weight is a conditional there. In the loops
  form (GPUs and TPUs, pinned on the CPU by ``GA_OPTAX_WINDOW_FORM``) the
  guard is selects, whose one cost on the CPU is in
  ``accumulate_and_apply`` (docs/how-to/host-schedule.md): its closing
  program copies each of the optimizer state's parameter-sized leaves
  once, which the reference, stepping whatever the weight, does not.
  ``accumulate``'s writes its selects in order and, from jax 0.12, copies
  none of them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import jax
import pytest
from gpu_compiler import or_skip

from benchmarks import host_overhead
from ga_optax._src import audits
from ga_optax._src.window import window_form

REFERENCE = host_overhead.REFERENCE
WINDOWS = ("ga_optax.accumulate", "ga_optax.accumulate_and_apply")
MICRO_STEPS = host_overhead.EVERY_K - 1
# The optimizer's state among a program's parameters (JAX names each by
# its path in the arguments: ``state_inner_state_0__mu_...``).
INNER_STATE = "state_inner_state"
# accumulate's selects written in order copy nothing on the CPU from jax
# 0.12; jax 0.10's XLA copies the optimizer's state all the same.
ORDERED_ON_THE_CPU = jax.__version_info__ >= (0, 12)
# The CPU's guard: a conditional, unless the run pins the loops form.
GUARDED_BY_A_CONDITIONAL = (
  window_form.form_for("cpu") == window_form.CONDITIONAL
)


@functools.cache
def model() -> tuple[Any, Any, Any]:
  return host_overhead.biased_mlp(256, 2)


@functools.cache
def programs() -> dict[str, dict[bool, host_overhead.Program]]:
  return host_overhead.window_programs(*model())


@functools.cache
def on_gpu(name: str, closing: bool) -> tuple[Any, int]:
  """The program for an H100 and its launches: compiled once a session."""
  return host_overhead.gpu_launches(programs()[name][closing])


def gpu_launches(name: str, closing: bool) -> int:
  return or_skip(on_gpu, name, closing)[1]


@functools.cache
def on_target(name: str, closing: bool, target: str) -> Any:
  return host_overhead.compiled(programs()[name][closing], target)


def compiled(name: str, closing: bool, target: str) -> Any:
  if target == "h100":
    return or_skip(on_gpu, name, closing)[0]
  if target == "v5e" and importlib.util.find_spec("libtpu") is None:
    if os.environ.get("CI"):
      raise RuntimeError("CI installs libtpu: the v5e programs must compile.")
    pytest.skip(
      f'pip install "jax[tpu]=={jax.__version__}" to compile for TPUs'
    )
  return on_target(name, closing, target)


def copies(name: str, closing: bool, target: str) -> list[audits.Copy]:
  return host_overhead.parameter_sized_copies(
    compiled(name, closing, target), model()[1]
  )


def window_launches(name: str) -> int:
  return MICRO_STEPS * gpu_launches(name, False) + gpu_launches(name, True)


@pytest.mark.parametrize("name", WINDOWS)
def test_launches_per_window_are_the_references_plus_two_at_most(name):
  reference = window_launches(REFERENCE)
  # The reference's closing step launches Adam's kernels beside the add.
  assert gpu_launches(REFERENCE, True) > gpu_launches(REFERENCE, False) > 0
  # Every scalar a micro-step changes is written by a kernel that runs
  # anyway (no constant copied into the state, no counter of its own).
  assert gpu_launches(name, False) <= gpu_launches(REFERENCE, False)
  assert window_launches(name) <= reference + 2, (
    window_launches(name),
    reference,
  )


@pytest.mark.parametrize("closing", [False, True])
@pytest.mark.parametrize("target", ["h100", "v5e"])
@pytest.mark.parametrize("name", WINDOWS)
def test_no_more_parameter_sized_copies_than_the_reference(
  name, target, closing
):
  found = copies(name, closing, target)
  reference = copies(REFERENCE, closing, target)
  assert len(found) <= len(reference), (found, reference)


def copied_parameter(program: Any, copy: audits.Copy) -> str:
  """The name of the program's parameter ``copy`` copies ('' for none)."""
  module = audits.parse_hlo(program.as_text())
  instructions = {
    instruction.name: instruction
    for instruction in module.computations[copy.computation]
  }
  (operand,) = instructions[copy.name].operands
  source = instructions.get(operand)
  return operand if source and source.opcode == "parameter" else ""


@pytest.mark.parametrize("closing", [False, True])
@pytest.mark.parametrize("name", WINDOWS)
def test_on_the_cpu_only_the_fused_guards_selects_copy_adams_state(
  name, closing
):
  program = compiled(name, closing, "cpu")
  found = copies(name, closing, "cpu")
  of_state = [
    copy
    for copy in found
    if copied_parameter(program, copy).startswith(INNER_STATE)
  ]
  others = [copy for copy in found if copy not in of_state]
  reference = copies(REFERENCE, closing, "cpu")
  assert len(others) <= len(reference), (others, reference)
  if (
    not closing
    or GUARDED_BY_A_CONDITIONAL
    or (name == "ga_optax.accumulate" and ORDERED_ON_THE_CPU)
  ):
    assert of_state == [], of_state
    return
  # Adam's two moments of each parameter: the selects that keep the state
  # of a window without weight, read beside the step, copy each once (the
  # cost docs/how-to/host-schedule.md states: 8 copies here).
  state_leaves = 2 * len(jax.tree.leaves(model()[1]))
  assert state_leaves == 8
  assert len(of_state) == state_leaves, of_state
  assert len({copied_parameter(program, copy) for copy in of_state}) == len(
    of_state
  )


@pytest.mark.skipif(
  not GUARDED_BY_A_CONDITIONAL,
  reason="the loops form is pinned: the CPU's guard is selects",
)
@pytest.mark.parametrize("name", WINDOWS)
def test_on_the_cpu_the_guarded_close_holds_fewer_temporaries_than_the_reference(
  name,
):
  # The conditional leaves the sums where they are and the zeros are
  # written over them once the step has read them: made earlier, they
  # would take buffers of their own (and a copy of each sum).
  def temporaries(window: str) -> int:
    program = compiled(window, True, "cpu")
    return program.memory_analysis().temp_size_in_bytes

  assert temporaries(name) < temporaries(REFERENCE)
