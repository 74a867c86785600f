"""The GPU run book: what the compiler and the device do to ga_optax's window.

One command checks and measures ga_optax on the machine at hand::

  python benchmarks/gpu_report.py --output-dir DIR          # full sizes
  python benchmarks/gpu_report.py --output-dir DIR --quick  # smoke run
  python benchmarks/gpu_report.py --output-dir DIR --no-peak --repeats 20

It writes ``DIR/gpu_report.md`` (also printed) and ``DIR/gpu_report.json``.
It runs on any backend. Every section names the backend that measured it, and
a run without a GPU says at the top that none of its figures is a GPU figure.

1. **Environment.** Backend, device kind and count, the versions of jax,
   jaxlib (and any JAX plugin), optax and ga_optax, the ``XLA_*`` and
   ``JAX_*`` environment variables (``XLA_FLAGS`` among them), the device's
   memory statistics, the machine without its host name, and the date.

2. **Conditionals.** For each configuration of the matrix, the window update
   (``tx.update`` + ``optax.apply_updates``, or the fused ``apply``; params
   and state donated, weight and flush traced) is lowered and compiled for
   this backend; on a GPU that is the real GPU compilation. Columns:

   * *compiled*: ``conditional`` instructions in the compiled program;
   * *emulated*: those left by ``ga_optax.testing.gpu_conditional_audit``,
     which emulates XLA:GPU's rewrite on any backend. On a GPU whose XLA has
     the rewrite both counts come from the same compiler and must agree;
   * *index*: ``pred`` when the compiled conditionals are indexed by a
     predicate (this compiler ran the GPU's index rewrite), ``s32`` when not.

   Then the check that the optimizer runs only when the window closes, read
   from the same compiled program:

   * the *closing branch* of a conditional is its true branch, the one
     ``lax.cond`` takes when the window closes: the last of its
     ``branch_computations``, or its ``true_computation`` once XLA has given
     it a ``pred`` index;
   * *outside* is every computation reachable from the entry without
     entering a closing branch (fusions, loops and the open branch included);
   * a *parameter-sized* instruction has an array result with at least as
     many elements as the smallest parameter leaf;
   * the optimizer's *characteristic ops* are opcodes its step uses and the
     window's own arithmetic (add, multiply by 1 / weight, select,
     is-finite, convert) does not: ``sqrt``, ``rsqrt``, ``divide`` and
     ``power`` for Adam, AdamW and RMSProp, ``sign`` for Lion, none for SGD;
   * the *extra ops* are the parameter-sized ops outside, counted opcode by
     opcode, beyond those of the same configuration wrapping
     ``optax.identity()``, which has no step that could leak out of the
     branch. This covers SGD, whose ops are the window's own.

   The optimizer is *confined* when no parameter-sized characteristic op
   sits outside, at least one sits in a closing branch (so the check can
   see them), and there are no extra ops. Three controls show that the
   checks can fail: ``optax.MultiSteps(adam)`` (no conditional: Adam runs
   on every micro-step), and a ``lax.cond`` with an Adam, then an SGD with
   momentum, branch beside a zeros branch (lost in the emulation, and in a
   GPU compilation whose XLA has the rewrite).

3. **Step time.** The contenders of ``benchmarks/contenders.py`` on the
   workloads of ``benchmarks/workloads.py``, run by
   ``benchmarks/run.py``: medians over interleaved rounds, the call that
   closes a window timed apart. Ratios of the micro-step and of the
   window-closing step to a plain Adam step and to ``optax.MultiSteps``.

4. **In-step window.** ``ga_optax.microbatched_value_and_grad`` against a
   hand-written ``lax.scan`` doing the same work and
   ``optax.microbatching.microbatch`` (where the installed optax has it):
   medians of alternating single jitted calls, and each result's distance to
   the full-batch ``jax.value_and_grad``.

5. **Memory.** An MLP and a global batch ``G``. For each ``k`` in 1, 2, 4,
   8, 16, 32 (1, 4, 32 with ``--quick``), compiled device bytes (``compiled.memory_analysis()``:
   arguments, outputs that reuse no argument, temporaries, in device memory
   only) of: the plain Adam step on a micro-batch of ``G / k`` (the
   micro-batch run alone), the ``accumulate`` micro-step on it, the same
   with the accumulator in ``"pinned_host"``, and the in-step window over
   ``G`` in ``k`` micro-batches; the large batch is the plain step on ``G``.
   Where the device reports ``memory_stats()`` (GPUs, TPUs; not the CPU),
   each of them also runs in a fresh process of this script that reports the
   device's ``peak_bytes_in_use``. Then the largest single batch, the
   largest ``accumulate`` micro-batch and the largest in-step window batch
   (k = 32) whose compiled bytes fit the device's memory: a fraction of
   ``bytes_limit`` from ``memory_stats()``, or, on a backend without one, a
   nominal budget that the report labels as such. Sizes are found from
   compilations only (bytes grow about linearly with the batch: the search
   aims at the crossing from two sizes, then brackets and bisects it), so
   nothing runs out of memory.

On a GPU, compilations for memory are made with autotuning off
(``xla_gpu_autotune_level=0``), in the fresh processes too, so that neither
the search's many shapes nor the autotuner's trial buffers weigh on the
figures.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

# Runs as a script from any directory: the repository root holds the package
# and the `benchmarks` helpers.
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import ga_optax  # noqa: E402
from benchmarks import run as run_lib  # noqa: E402
from benchmarks import workloads as workloads_lib  # noqa: E402
from ga_optax import testing  # noqa: E402
from ga_optax._src import device_memory  # noqa: E402

MIB = 2**20
LEARNING_RATE = 1e-4
EVERY_K = 4
MEMORY_KS = (1, 2, 4, 8, 16, 32)
# Compile options for memory figures: autotuning trial buffers and the time
# the autotuner spends on each new shape would weigh on them (GPU only; the
# option is ignored elsewhere).
MEMORY_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}
# Part of the device's allocator limit a step may plan for: the rest is
# headroom for the runtime's own buffers and fragmentation.
DEFAULT_MEMORY_FRACTION = 0.9


# -- 1. Environment ----------------------------------------------------------


def offered_memory_kinds() -> tuple[str, ...]:
  """The memory kinds of JAX's default device."""
  return tuple(
    memory.kind for memory in jax.devices()[0].addressable_memories()
  )


def environment(command: str, quick: bool) -> dict[str, Any]:
  """Backend, versions, flags, machine and date of this run."""
  record = run_lib._environment(command)
  device = jax.devices()[0]
  record["versions"]["jaxlib"] = importlib.metadata.version("jaxlib")
  record["versions"]["plugins"] = {
    dist.metadata["Name"]: dist.version
    for dist in importlib.metadata.distributions()
    if re.match(r"jax[-_](cuda|rocm)", dist.metadata["Name"] or "")
  }
  record["device"]["platform_version"] = getattr(
    device.client, "platform_version", None
  )
  record["device"]["memory_kinds"] = list(offered_memory_kinds())
  record["device"]["memory_stats"] = device.memory_stats()
  record["backend"] = device.platform
  record["gpu"] = device.platform == "gpu"
  record["label"] = (
    f"GPU run on {device.device_kind}"
    if record["gpu"]
    else f"{device.platform.upper()} run: no GPU; none of these figures is"
    " a GPU figure"
  )
  record["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  record["environment_variables"] = {
    name: value
    for name, value in sorted(os.environ.items())
    if name.startswith(("XLA_", "JAX_"))
  }
  record["quick"] = quick
  return record


# -- 2. Conditionals ---------------------------------------------------------

ADAM_OPS = frozenset({"sqrt", "rsqrt", "divide", "power"})
LION_OPS = frozenset({"sign"})
# Opcodes that move, name or call values rather than compute on them; the
# check counts only the others.
STRUCTURAL_OPS = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast",
    "bitcast-convert", "copy", "copy-start", "copy-done", "broadcast",
    "reshape", "transpose", "slice", "dynamic-slice", "dynamic-update-slice",
    "concatenate", "pad", "iota", "convert", "fusion", "call", "conditional",
    "while", "custom-call", "async-start", "async-update", "async-done",
    "opt-barrier",
})  # fmt: skip
_ARRAY = re.compile(r"^([a-z][a-z0-9]*)\[([0-9,]*)\]")
_TRUE_BRANCH = re.compile(r"true_computation=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Configuration:
  """One row of the matrix: a window update and what to look for in it.

  Attributes:
    name: row name.
    optimizer: builds the wrapped optimizer.
    characteristic: opcodes of the optimizer's step that the window's own
      arithmetic lacks.
    fused: ``accumulate_and_apply`` instead of ``accumulate``.
    dtype: the params' (and gradients') dtype.
    options: keyword arguments of ``accumulate`` / ``accumulate_and_apply``.
    needs_memory_kind: a memory kind the device must offer.
  """

  name: str
  optimizer: Callable[[], optax.GradientTransformation]
  characteristic: frozenset[str]
  fused: bool = False
  dtype: Any = jnp.float32
  options: dict[str, Any] = dataclasses.field(default_factory=dict)
  needs_memory_kind: str | None = None


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)
MATRIX = [
  Configuration("accumulate · adam", lambda: optax.adam(1e-3), ADAM_OPS),
  Configuration(
    "accumulate · sgd, momentum 0.9",
    lambda: optax.sgd(0.1, momentum=0.9),
    frozenset(),
  ),
  Configuration("accumulate · lion", lambda: optax.lion(1e-4), LION_OPS),
  Configuration("accumulate · rmsprop", lambda: optax.rmsprop(1e-3), ADAM_OPS),
  Configuration(
    "accumulate · adamw, warmup-cosine schedule",
    lambda: optax.adamw(SCHEDULE),
    ADAM_OPS,
  ),
  Configuration(
    "accumulate · chain(clip_by_global_norm, adamw)",
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    ADAM_OPS,
  ),
  Configuration(
    "accumulate_and_apply · adam",
    lambda: optax.adam(1e-3),
    ADAM_OPS,
    fused=True,
  ),
  Configuration(
    "accumulate_and_apply · sgd",
    lambda: optax.sgd(0.1),
    frozenset(),
    fused=True,
  ),
  Configuration(
    "accumulate · adam, skip_nonfinite, every_k {0: 2, 10: 4}",
    lambda: optax.adam(1e-3),
    ADAM_OPS,
    options={"every_k": {0: 2, 10: 4}, "skip_nonfinite": True},
  ),
  Configuration(
    'accumulate · sgd, reduction="sum", traced flush',
    lambda: optax.sgd(0.1),
    frozenset(),
    options={"reduction": "sum"},
  ),
  Configuration(
    "accumulate · adam, bfloat16 params, float32 accumulator",
    lambda: optax.adam(1e-3),
    ADAM_OPS,
    dtype=jnp.bfloat16,
    options={"accumulator_dtype": jnp.float32},
  ),
  Configuration(
    'accumulate · adam, accumulator in "pinned_host"',
    lambda: optax.adam(1e-3),
    ADAM_OPS,
    options={"accumulator_memory_kind": "pinned_host"},
    needs_memory_kind="pinned_host",
  ),
]


def matrix_params(quick: bool, dtype: Any) -> dict[str, jax.Array]:
  """A weight matrix and a bias, the shapes of a dense layer."""
  width = 128 if quick else 2048
  shapes = {"w": (width, width // 2), "b": (width // 2,)}
  return {
    name: jnp.linspace(-1.0, 1.0, int(np.prod(shape)))
    .reshape(shape)
    .astype(dtype)
    for name, shape in shapes.items()
  }


def lower_update(
  configuration: Configuration,
  optimizer: optax.GradientTransformation,
  quick: bool,
) -> jax.stages.Lowered:
  """The jitted window update of ``configuration`` around ``optimizer``."""
  params = matrix_params(quick, configuration.dtype)
  options = dict(configuration.options)
  every_k = options.pop("every_k", EVERY_K)
  if configuration.fused:
    fused = ga_optax.accumulate_and_apply(optimizer, every_k, **options)

    def fused_step(params, state, grads, weight, flush):
      return fused.apply(params, grads, state, weight=weight, flush=flush)

    step, state = fused_step, fused.init(params)
  else:
    tx = ga_optax.accumulate(optimizer, every_k, **options)

    def transformation_step(params, state, grads, weight, flush):
      updates, state = tx.update(
        grads, state, params, weight=weight, flush=flush
      )
      return optax.apply_updates(params, updates), state

    step, state = transformation_step, tx.init(params)
  return jax.jit(step, donate_argnums=(0, 1)).lower(
    params, state, params, jnp.float32(3.0), jnp.asarray(False)
  )


def closing_branches(hlo_text: str) -> set[str]:
  """The true branch of every conditional in a compiled module's text."""
  branches = set()
  for line in hlo_text.splitlines():
    if " conditional(" not in line:
      continue
    true_branch = _TRUE_BRANCH.search(line)
    if true_branch:
      branches.add(true_branch.group(1))
    else:
      listed = _BRANCHES.search(line)
      if listed:
        branches.add(listed.group(1).split(",")[-1].strip().lstrip("%"))
  return branches


def index_forms(hlo_text: str) -> list[str]:
  """For each conditional: ``pred`` (GPU index rewrite ran) or ``s32``."""
  return [
    "pred" if "true_computation=" in line else "s32"
    for line in hlo_text.splitlines()
    if " conditional(" in line
  ]


def _elements(shape: str) -> int:
  """Elements of an array shape string; 0 for a tuple."""
  array = _ARRAY.match(shape)
  if array is None:
    return 0
  return int(np.prod([int(d) for d in array.group(2).split(",") if d] or [1]))


class PlacedOps(NamedTuple):
  """Parameter-sized ops of a compiled program, by where they run.

  Attributes:
    outside: opcode counts outside every closing branch.
    inside: opcode counts inside closing branches.
  """

  outside: collections.Counter[str]
  inside: collections.Counter[str]


def placed_ops(hlo_text: str, min_elements: int) -> PlacedOps:
  """Counts the parameter-sized ops inside and outside closing branches."""
  module = testing.parse_hlo(hlo_text)
  closing = closing_branches(hlo_text)
  outside = testing.reachable(module, module.entry, excluded=closing)
  inside: set[str] = set()
  for branch in closing:
    inside |= testing.reachable(module, branch)

  def count(computations: set[str]) -> collections.Counter[str]:
    return collections.Counter(
      instruction.opcode
      for computation in computations
      for instruction in module.computations.get(computation, ())
      if instruction.opcode not in STRUCTURAL_OPS
      and _elements(instruction.shape) >= min_elements
    )

  return PlacedOps(count(outside - inside), count(inside))


def optimizer_check(
  hlo_text: str,
  identity_text: str,
  characteristic: frozenset[str],
  min_elements: int,
) -> dict[str, Any]:
  """Whether the optimizer's ops sit only in the closing branch (see top)."""
  ops = placed_ops(hlo_text, min_elements)
  outside = {op: ops.outside[op] for op in sorted(characteristic)}
  inside = {op: ops.inside[op] for op in sorted(characteristic)}
  baseline = placed_ops(identity_text, min_elements).outside
  extra = dict(sorted((ops.outside - baseline).items()))
  confined = (
    sum(outside.values()) == 0
    and (not characteristic or sum(inside.values()) > 0)
    and not extra
  )
  return {
    "characteristic_ops": sorted(characteristic),
    "characteristic_outside": outside,
    "characteristic_inside": inside,
    "extra_ops_outside_vs_identity": extra,
    "confined": confined,
  }


def audit(lowered: jax.stages.Lowered) -> dict[str, Any]:
  """Conditionals compiled here and as the emulation of XLA:GPU keeps them."""
  try:
    found = testing.gpu_conditional_audit(lowered)
  except testing.EmulationUnavailable as error:
    compiled_text = lowered.compile().as_text() or ""
    return {
      "compiled": len(index_forms(compiled_text)),
      "emulated": None,
      "rewritten": None,
      "emulation_unavailable": str(error),
    }
  return {
    "compiled": found.compiled,
    "emulated": found.as_on_gpu,
    "rewritten": found.rewritten,
  }


def check_configuration(
  configuration: Configuration, quick: bool, identity_texts: dict[str, str]
) -> dict[str, Any]:
  """Conditionals and optimizer check of one configuration of the matrix.

  ``identity_texts`` caches the compiled text of the same window around
  ``optax.identity()``, shared by configurations that differ only in their
  optimizer.
  """
  lowered = lower_update(configuration, configuration.optimizer(), quick)
  record = audit(lowered)
  # The audit compiled it already; this reads the same cached executable.
  text = lowered.compile().as_text() or ""
  window = repr(
    (configuration.fused, configuration.dtype, configuration.options)
  )
  if window not in identity_texts:
    identity = lower_update(configuration, optax.identity(), quick)
    identity_texts[window] = identity.compile().as_text() or ""
  record["index"] = index_forms(text)
  params = matrix_params(quick, jnp.float32)
  record.update(
    optimizer_check(
      text,
      identity_texts[window],
      configuration.characteristic,
      min_elements=min(leaf.size for leaf in jax.tree.leaves(params)),
    )
  )
  return record


def lower_multi_steps(
  optimizer: optax.GradientTransformation, params: Any
) -> jax.stages.Lowered:
  """A control: ``optax.MultiSteps`` runs ``optimizer`` on every call."""
  multi_steps = optax.MultiSteps(optimizer, EVERY_K)

  def step(params, state, grads):
    updates, state = multi_steps.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step).lower(params, multi_steps.init(params), params)


def lower_zeros_branch(
  optimizer: optax.GradientTransformation, params: Any
) -> jax.stages.Lowered:
  """A control: a ``lax.cond`` whose other branch makes zeros, which
  XLA:GPU turns into selects."""

  def step(closes, grads, state):
    return jax.lax.cond(
      closes,
      lambda grads, state: optimizer.update(grads, state, params),
      lambda grads, state: (jax.tree.map(jnp.zeros_like, grads), state),
      grads,
      state,
    )

  return jax.jit(step).lower(jnp.asarray(True), params, optimizer.init(params))


CONTROLS = {
  "optax.MultiSteps(adam): no conditional": (
    lower_multi_steps,
    lambda: optax.adam(1e-3),
    ADAM_OPS,
  ),
  "lax.cond(closes, adam step, zeros)": (
    lower_zeros_branch,
    lambda: optax.adam(1e-3),
    ADAM_OPS,
  ),
  "lax.cond(closes, sgd momentum step, zeros)": (
    lower_zeros_branch,
    lambda: optax.sgd(0.1, momentum=0.9),
    frozenset(),
  ),
}


def control_records(quick: bool) -> dict[str, dict[str, Any]]:
  """The controls: programs the checks must flag (see the top)."""
  params = matrix_params(quick, jnp.float32)
  min_elements = min(leaf.size for leaf in jax.tree.leaves(params))
  identity_texts: dict[Any, str] = {}
  records = {}
  for name, (lower, optimizer, characteristic) in CONTROLS.items():
    _progress(f"conditionals: control {name}")
    lowered = lower(optimizer(), params)
    record = audit(lowered)
    text = lowered.compile().as_text() or ""
    if lower not in identity_texts:
      identity = lower(optax.identity(), params)
      identity_texts[lower] = identity.compile().as_text() or ""
    record["index"] = index_forms(text)
    record.update(
      optimizer_check(text, identity_texts[lower], characteristic, min_elements)
    )
    records[name] = record
  return records


def conditionals_section(quick: bool) -> dict[str, Any]:
  """The matrix and the controls."""
  offered = offered_memory_kinds()
  matrix, skipped = {}, {}
  identity_texts: dict[str, str] = {}
  for configuration in MATRIX:
    needed = configuration.needs_memory_kind
    if needed is not None and needed not in offered:
      skipped[configuration.name] = (
        f"the device offers no {needed!r} memory (it offers {offered!r})"
      )
      continue
    _progress(f"conditionals: {configuration.name}")
    matrix[configuration.name] = check_configuration(
      configuration, quick, identity_texts
    )
  return {
    "matrix": matrix,
    "skipped": skipped,
    "controls": control_records(quick),
  }


# -- 3. Step time ------------------------------------------------------------


def time_workloads(quick: bool) -> list[workloads_lib.Workload]:
  """benchmarks/workloads.py's reference workloads; for a smoke run, one
  small MLP."""
  if quick:
    return [workloads_lib.mlp(width=256, depth=2, microbatch=8, every_k=4)]
  return workloads_lib.reference_workloads(quick=False)


def in_step_workloads(quick: bool) -> list[workloads_lib.Workload]:
  """The step-time workloads; on a GPU, also a window of 4096 rows, where
  the device has work to do."""
  found = time_workloads(quick)
  if jax.devices()[0].platform == "gpu" and not quick:
    large = workloads_lib.mlp(width=2048, depth=4, microbatch=512, every_k=8)
    found.append(
      dataclasses.replace(
        large,
        name="mlp, large window",
        description="MLP 4x2048x2048, 4096 rows in 8 micro-batches",
      )
    )
  return found


STEP_ROWS = (
  "plain Adam step",
  "optax.MultiSteps",
  "ga_optax.accumulate",
  "ga_optax.accumulate_and_apply",
)


def step_time_section(
  workloads: list[workloads_lib.Workload], repeats: int, warmup: int
) -> dict[str, Any]:
  """benchmarks/run.py's measurement, with ratios to plain Adam and
  MultiSteps."""
  records: dict[str, Any] = {}
  for workload in workloads:
    _progress(f"step time: {workload.description}")
    record = run_lib._measure_workload(workload, repeats, warmup)
    results = record["contenders"]
    plain = results["plain Adam step"]
    multi_steps = results["optax.MultiSteps"]
    record["ratios"] = {
      name: _step_ratios(results[name], plain, multi_steps)
      for name in STEP_ROWS
      if name in results
    }
    record["figures"] = run_lib._figures(workload.name, record)
    records[workload.name] = record
  return records


def _step_ratios(
  result: dict[str, Any], plain: dict[str, Any], multi_steps: dict[str, Any]
) -> dict[str, float]:
  """A contender's micro-step and closing step against plain Adam's step
  and MultiSteps' own, and its temporaries against plain Adam's."""
  return {
    "micro_over_plain_adam": result["micro_ms"] / plain["micro_ms"],
    "closing_over_plain_adam": result["closing_ms"] / plain["micro_ms"],
    "micro_over_multi_steps_micro": result["micro_ms"]
    / multi_steps["micro_ms"],
    "closing_over_multi_steps_closing": result["closing_ms"]
    / multi_steps["closing_ms"],
    "temp_over_plain_adam": result["temp_bytes"] / max(plain["temp_bytes"], 1),
  }


# -- 4. In-step window -------------------------------------------------------


def hand_written_scan(
  loss_fn: Callable[..., Any], num_microbatches: int
) -> Callable[..., Any]:
  """Value and gradient of the mean loss, one ``lax.scan`` over
  contiguous micro-batches: what a user would write by hand."""
  value_and_grad = jax.value_and_grad(loss_fn)

  def window(params, batch):
    microbatches = jax.tree.map(
      lambda leaf: leaf.reshape(num_microbatches, -1, *leaf.shape[1:]), batch
    )

    def add(sums, microbatch):
      return jax.tree.map(
        jnp.add, sums, value_and_grad(params, microbatch)
      ), None

    zeros = (jnp.zeros((), jnp.float32), optax.tree.zeros_like(params))
    sums, _ = jax.lax.scan(add, zeros, microbatches)
    return jax.tree.map(lambda total: total / num_microbatches, sums)

  return window


def in_step_contenders(
  workload: workloads_lib.Workload,
) -> tuple[dict[str, Any], str | None]:
  """The jitted ``(params, batch) -> (loss, grads)`` windows to compare, and
  why optax.microbatching is missing, if it is."""
  loss_fn, k = workload.loss_fn, workload.every_k
  windows = {
    "ga_optax.microbatched_value_and_grad": jax.jit(
      ga_optax.microbatched_value_and_grad(loss_fn, k)
    ),
    "hand-written lax.scan": jax.jit(hand_written_scan(loss_fn, k)),
  }
  microbatching = getattr(optax, "microbatching", None)
  if microbatching is None:
    return windows, f"optax {optax.__version__} has no microbatching module"
  rows = jax.tree.leaves(workload.window_batch)[0].shape[0]
  windows["optax.microbatching.microbatch"] = jax.jit(
    microbatching.microbatch(
      jax.value_and_grad(loss_fn),
      argnums=1,
      microbatch_size=rows // k,
      accumulator=microbatching.AccumulationType.MEAN,
    )
  )
  return windows, None


def in_step_section(
  workloads: list[workloads_lib.Workload], repeats: int, warmup: int
) -> dict[str, Any]:
  """Alternating single calls of each window; medians and ratios."""
  records = {}
  for workload in workloads:
    _progress(f"in-step window: {workload.description}")
    windows, missing = in_step_contenders(workload)
    params, batch = workload.params, workload.window_batch
    expected = jax.jit(jax.value_and_grad(workload.loss_fn))(params, batch)
    results: dict[str, dict[str, Any]] = {}
    for name, window in windows.items():
      compiled = window.lower(params, batch).compile()
      results[name] = {
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "max_relative_difference_to_full_batch": (
          testing.max_relative_difference(window(params, batch), expected)
        ),
        "calls_ms": [],
      }
    names = list(windows)
    for round_index in range(warmup + repeats):
      shift = round_index % len(names)
      for name in names[shift:] + names[:shift]:
        start = time.perf_counter()
        jax.block_until_ready(windows[name](params, batch))
        if round_index >= warmup:
          results[name]["calls_ms"].append((time.perf_counter() - start) * 1e3)
    reference = float(np.median(results["hand-written lax.scan"]["calls_ms"]))
    for result in results.values():
      result["median_ms"] = float(np.median(result["calls_ms"]))
      result["over_hand_written_scan"] = result["median_ms"] / reference
    records[workload.name] = {
      "description": workload.description,
      "num_microbatches": workload.every_k,
      "rows": jax.tree.leaves(workload.window_batch)[0].shape[0],
      "windows": results,
      "optax_microbatching": missing or "measured",
    }
  return records


# -- 5. Memory ---------------------------------------------------------------

MEMORY_STEPS = ("plain", "accumulate", "accumulate_host", "window")


@dataclasses.dataclass(frozen=True)
class MemoryModel:
  """The MLP of the memory section and the global batch it is fed."""

  width: int
  depth: int
  global_batch: int
  ks: tuple[int, ...] = MEMORY_KS

  def workload(self) -> workloads_lib.Workload:
    """The MLP's loss and params (its one-row batch goes unused)."""
    return workloads_lib.mlp(self.width, self.depth, microbatch=1, every_k=1)


def memory_model(quick: bool) -> MemoryModel:
  """Sizes where activations outweigh the state at k = 1 and the state
  outweighs them at k = 32."""
  if quick:
    return MemoryModel(width=128, depth=2, global_batch=256, ks=(1, 4, 32))
  return MemoryModel(width=2048, depth=4, global_batch=8192)


def memory_step(
  kind: str, loss_fn: Callable[..., Any], every_k: int
) -> tuple[Callable[..., Any], Callable[[Any], Any]]:
  """The jitted, donated ``step(params, state, batch)`` of ``kind``, and the
  init of its state.

  ``plain``: gradient + Adam on the batch; ``accumulate``: gradient +
  ``accumulate(adam, every_k)`` micro-step; ``accumulate_host``: the same
  with the accumulator in ``"pinned_host"``; ``window``: the in-step window,
  ``microbatched_value_and_grad`` over ``every_k`` micro-batches + Adam.
  """
  adam = optax.adam(LEARNING_RATE)
  if kind == "window":
    value_and_grad = ga_optax.microbatched_value_and_grad(loss_fn, every_k)

    def window_step(params, state, batch):
      _, grads = value_and_grad(params, batch)
      updates, state = adam.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    return jax.jit(window_step, donate_argnums=(0, 1)), adam.init
  tx: optax.GradientTransformation = adam
  if kind == "accumulate":
    tx = ga_optax.accumulate(adam, every_k)
  elif kind == "accumulate_host":
    tx = ga_optax.accumulate(
      adam, every_k, accumulator_memory_kind="pinned_host"
    )

  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1)), tx.init


def _batch(width: int, rows: int, abstract: bool) -> dict[str, Any]:
  if abstract:
    leaf = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    return {"x": leaf, "y": leaf}
  return {"x": jnp.zeros((rows, width)), "y": jnp.zeros((rows, width))}


class MemoryProbe:
  """Device bytes of the memory steps, by kind, k and batch rows.

  Compiled bytes for any size; peaks, where asked for, in fresh processes.
  Each figure is measured once: the plain step does not depend on k, so
  the large batch is the plain step of k = 1.
  """

  def __init__(self, model: MemoryModel, peaks: bool) -> None:
    self.model = model
    self.workload = model.workload()
    self._peaks = peaks
    self._steps: dict[tuple[str, int], tuple[Any, Any]] = {}
    self._compiled: dict[tuple[str, int, int], dict[str, int]] = {}
    self._peak: dict[tuple[str, int, int], dict[str, Any]] = {}

  def compiled_bytes(self, kind: str, every_k: int, rows: int) -> int:
    """Compiled device bytes of ``kind``'s step on ``rows`` rows."""
    return self._compile(kind, every_k, rows)["device_bytes"]

  def entry(self, kind: str, every_k: int, rows: int) -> dict[str, Any]:
    """Compiled device and temporary bytes, and the peak if measured."""
    found: dict[str, Any] = dict(self._compile(kind, every_k, rows))
    if self._peaks:
      key = self._key(kind, every_k, rows)
      if key not in self._peak:
        self._peak[key] = peak_bytes(self.model, *key)
      found.update(self._peak[key])
    return found

  def _key(self, kind: str, every_k: int, rows: int) -> tuple[str, int, int]:
    return (kind, 1 if kind == "plain" else every_k, rows)

  def _compile(self, kind: str, every_k: int, rows: int) -> dict[str, int]:
    key = self._key(kind, every_k, rows)
    if key not in self._compiled:
      if key[:2] not in self._steps:
        step, init = memory_step(kind, self.workload.loss_fn, key[1])
        self._steps[key[:2]] = (step, init(self.workload.params))
      step, state = self._steps[key[:2]]
      compiled = step.lower(
        self.workload.params,
        state,
        _batch(self.model.width, rows, abstract=True),
      ).compile(compiler_options=MEMORY_COMPILER_OPTIONS)
      self._compiled[key] = {
        "device_bytes": device_memory.device_bytes(compiled),
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
      }
    return self._compiled[key]


def largest_fitting(
  bytes_at: Callable[[int], int],
  budget: int,
  unit: int,
  max_rows: int,
  first_rows: int,
) -> dict[str, Any]:
  """The largest multiple of ``unit`` rows whose bytes fit ``budget``.

  Keeps a bracket: ``low`` units fit, ``high`` do not (or lie past
  ``max_rows``). Bytes grow about linearly with the rows, so each size is
  aimed at where the line through the last two sizes measured crosses the
  budget; once both ends are measured, an aim that failed to halve the
  bracket is followed by a bisection. The answer is exact for any curve
  that grows; a straight one takes about four compilations. The first line
  runs from ``unit`` rows to ``first_rows`` (a size measured already, at
  best, and large enough to show the slope).
  """
  measured: dict[int, int] = {}

  def measure(units: int) -> int:
    if units not in measured:
      measured[units] = bytes_at(units * unit)
    return measured[units]

  if measure(1) > budget:
    return {
      "rows": None,
      "bytes": None,
      "next_rows": unit,
      "next_bytes": measured[1],
      "compilations": 1,
    }
  low, high = 1, max(max_rows // unit, 1) + 1
  previous, size = 1, max(first_rows // unit, 2)
  while high - low > 1:
    size = min(max(size, low + 1), high - 1)
    width = high - low
    if measure(size) <= budget:
      low = size
    else:
      high = size
    slope = (measured[size] - measured[previous]) / (size - previous)
    previous = size
    if slope > 0 and (high not in measured or 2 * (high - low) <= width):
      size += int((budget - measured[size]) // slope)
    elif high in measured:
      size = (low + high) // 2
    else:
      size = 2 * low
  return {
    "rows": low * unit,
    "bytes": measured[low],
    "next_rows": high * unit if high in measured else None,
    "next_bytes": measured.get(high),
    "compilations": len(measured),
  }


def memory_budget(
  requested_mib: float | None, fraction: float, quick: bool
) -> tuple[int, str]:
  """The bytes a step may use, and where that figure comes from."""
  stats = jax.devices()[0].memory_stats() or {}
  if requested_mib is not None:
    return int(requested_mib * MIB), "--memory-budget-mib"
  if stats.get("bytes_limit"):
    return (
      int(stats["bytes_limit"] * fraction),
      f"{fraction} x bytes_limit of memory_stats()",
    )
  nominal = 16 if quick else 1024
  return (
    nominal * MIB,
    f"nominal {nominal} MiB: the {jax.devices()[0].platform} backend reports"
    " no memory limit",
  )


def peak_bytes(
  model: MemoryModel, kind: str, every_k: int, rows: int
) -> dict[str, Any]:
  """Runs one memory step in a fresh process of this script: its peak."""
  spec = json.dumps(
    {
      "width": model.width,
      "depth": model.depth,
      "kind": kind,
      "every_k": every_k,
      "rows": rows,
    }
  )
  # Without autotuning, whose trial buffers would make the compilation's
  # peak the process's.
  env = {
    **os.environ,
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
    + " --xla_gpu_autotune_level=0",
  }
  completed = subprocess.run(
    [sys.executable, __file__, "--peak-of", spec],
    capture_output=True,
    text=True,
    env=env,
    check=False,
  )
  if completed.returncode != 0:
    return {"error": completed.stderr.strip().splitlines()[-1:]}
  return json.loads(completed.stdout.strip().splitlines()[-1])


def peak_here(spec_text: str) -> None:
  """Prints the device's peak bytes in use over two windows, as JSON."""
  spec = json.loads(spec_text)
  model = MemoryModel(spec["width"], spec["depth"], global_batch=0)
  workload = model.workload()
  step, init = memory_step(spec["kind"], workload.loss_fn, spec["every_k"])
  # One copy of the params alive, as in training.
  params = jax.tree.map(jnp.copy, workload.params)
  del workload
  state = init(params)
  batch = _batch(model.width, spec["rows"], abstract=False)
  calls = 2 if spec["kind"] in ("plain", "window") else 2 * spec["every_k"]
  for _ in range(calls):
    params, state = step(params, state, batch)
  jax.block_until_ready((params, state))
  stats = jax.devices()[0].memory_stats() or {}
  print(
    json.dumps(
      {
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "bytes_in_use_after": stats.get("bytes_in_use"),
      }
    )
  )


def memory_section(
  quick: bool, budget_mib: float | None, fraction: float, peaks: bool
) -> dict[str, Any]:
  """Device bytes over k, and the largest batches that fit."""
  model = memory_model(quick)
  run_peaks = peaks and jax.devices()[0].memory_stats() is not None
  probe = MemoryProbe(model, run_peaks)
  kinds = [
    kind
    for kind in MEMORY_STEPS
    if kind != "accumulate_host" or "pinned_host" in offered_memory_kinds()
  ]
  accumulator_bytes = sum(
    leaf.size * 4 for leaf in jax.tree.leaves(probe.workload.params)
  )
  large = probe.entry("plain", 1, model.global_batch)
  rows_by_k = []
  for every_k in model.ks:
    _progress(f"memory: k={every_k}")
    micro = model.global_batch // every_k
    row: dict[str, Any] = {"every_k": every_k, "microbatch": micro}
    for kind in kinds:
      rows = model.global_batch if kind == "window" else micro
      row[kind] = probe.entry(kind, every_k, rows)
    row["ratios"] = _memory_ratios(row, large, accumulator_bytes)
    rows_by_k.append(row)

  budget, budget_source = memory_budget(budget_mib, fraction, quick)
  _progress("memory: largest batches that fit")
  window_k = model.ks[-1]
  searches = {
    "single batch (plain Adam step)": ("plain", 1, 8),
    "accumulate micro-batch": ("accumulate", window_k, 8),
    f"in-step window batch, k={window_k}": ("window", window_k, 8 * window_k),
  }
  largest = {
    name: largest_fitting(
      functools.partial(probe.compiled_bytes, kind, every_k),
      budget,
      unit=unit,
      max_rows=2**22,
      first_rows=model.global_batch,
    )
    for name, (kind, every_k, unit) in searches.items()
  }
  for name, found in largest.items():
    # One update takes this many rows: the micro-batch's k times over.
    per_update = window_k if searches[name][0] == "accumulate" else 1
    found["effective_batch"] = (found["rows"] or 0) * per_update
  return {
    "model": dataclasses.asdict(model),
    "num_params": probe.workload.num_params,
    "accumulator_bytes": accumulator_bytes,
    "peaks": "measured" if run_peaks else _why_no_peaks(peaks),
    "large_batch": large,
    "by_k": rows_by_k,
    "budget_bytes": budget,
    "budget_source": budget_source,
    "largest": largest,
  }


def _why_no_peaks(requested: bool) -> str:
  if not requested:
    return "not measured (--no-peak)"
  return (
    f"not measured: the {jax.devices()[0].platform} backend gives no"
    " memory_stats()"
  )


def _memory_ratios(
  row: dict[str, Any], large: dict[str, Any], accumulator_bytes: int
) -> dict[str, dict[str, float]]:
  """The figures of one k, from compiled bytes and, where measured, peaks."""
  figures: dict[str, dict[str, float]] = collections.defaultdict(dict)
  for measure, label in (
    ("device_bytes", "compiled"),
    ("peak_bytes_in_use", "peak"),
  ):
    plain = row["plain"].get(measure)
    if not plain:
      continue
    figures["accumulate / (micro-batch run + accumulator)"][label] = row[
      "accumulate"
    ][measure] / (plain + accumulator_bytes)
    if "accumulate_host" in row:
      host = row["accumulate_host"][measure]
      figures["accumulator on host / micro-batch run"][label] = host / plain
      figures["accumulator on host / on device"][label] = (
        host / row["accumulate"][measure]
      )
    if large.get(measure):
      figures["in-step window / large batch"][label] = (
        row["window"][measure] / large[measure]
      )
  return dict(figures)


# -- Report ------------------------------------------------------------------


def _mib(value: int | None, digits: int = 1) -> str:
  return "" if value is None else f"{value / MIB:.{digits}f}"


def _bytes_cell(entry: dict[str, Any] | None) -> str:
  """Compiled MiB, and the peak where it was measured."""
  if entry is None:
    return "n/a"
  text = _mib(entry["device_bytes"])
  if entry.get("peak_bytes_in_use") is not None:
    text += f" (peak {_mib(entry['peak_bytes_in_use'])})"
  elif "error" in entry:
    text += " (peak run failed)"
  return text


def _ratio_cell(ratios: dict[str, dict[str, float]], figure: str) -> str:
  """A figure from compiled bytes, then from peaks where measured."""
  values = ratios.get(figure, {}).values()
  return " / ".join(f"{value:.3f}" for value in values) or "n/a"


def _counts(counts: dict[str, int]) -> str:
  return ", ".join(f"{op} {count}" for op, count in counts.items() if count)


def _conditional_table(records: dict[str, dict[str, Any]]) -> list[str]:
  lines = [
    "| configuration | compiled | emulated | index |"
    " characteristic ops outside | inside | extra ops outside vs identity |"
    " optimizer confined |",
    "|---|---:|---:|---|---|---|---|---|",
  ]
  for name, record in records.items():
    emulated = record["emulated"]
    lines.append(
      f"| {name} | {record['compiled']} |"
      f" {'n/a' if emulated is None else emulated} |"
      f" {', '.join(record['index']) or '—'} |"
      f" {_counts(record['characteristic_outside']) or 'none'} |"
      f" {_counts(record['characteristic_inside']) or 'none'} |"
      f" {_counts(record['extra_ops_outside_vs_identity']) or 'none'} |"
      f" {'yes' if record['confined'] else '**no**'} |"
    )
  return lines


def markdown(report: dict[str, Any]) -> str:
  """The report's tables, one section after another."""
  backend = report["environment"]["backend"]
  return "\n".join(
    _header_lines(report)
    + _conditional_lines(report["conditionals"], backend)
    + _step_time_lines(report["step_time"], backend)
    + _in_step_lines(report["in_step"], backend)
    + _memory_lines(report["memory"], backend)
  )


def _header_lines(report: dict[str, Any]) -> list[str]:
  env = report["environment"]
  device, versions = env["device"], env["versions"]
  plugins = "".join(
    f", {name} {version}" for name, version in versions["plugins"].items()
  )
  return [
    "# ga_optax GPU run book",
    "",
    f"**{env['label']}.**",
    "",
    f"- Date: {env['date']}; elapsed {report['elapsed_s']:.0f} s",
    f"- Device: {device['kind']} ({env['backend']}, {device['count']}"
    f" device(s), platform version {device['platform_version']}); memory"
    f" kinds {', '.join(device['memory_kinds'])}",
    f"- Versions: jax {versions['jax']}, jaxlib {versions['jaxlib']}, optax"
    f" {versions['optax']}, ga_optax {versions['ga_optax']}{plugins}",
    f"- XLA_FLAGS: `{env['xla_flags'] or '(unset)'}`",
    f"- Machine: {env['machine']['platform']},"
    f" {env['machine']['cpu_count']} CPU cores, Python"
    f" {env['machine']['python']}",
    f"- Command: `{env['command']}`",
    "",
  ]


def _conditional_lines(section: dict[str, Any], backend: str) -> list[str]:
  lines = [
    f"## Conditionals of the window, compiled for {backend}",
    "",
    "compiled: `conditional` instructions in the program compiled for this"
    " backend; emulated: those left by"
    " `ga_optax.testing.gpu_conditional_audit`; index: `pred` where the"
    " compiler ran XLA:GPU's index rewrite. Ops are parameter-sized; see the"
    " script's docstring for the check.",
    "",
    *_conditional_table(section["matrix"]),
    "",
  ]
  for name, reason in section["skipped"].items():
    lines += [f"Skipped {name}: {reason}.", ""]
  return [
    *lines,
    "Controls, which the checks must flag: MultiSteps is never confined; a"
    " zeros branch beside the optimizer's is lost in the emulation"
    " (emulated 0), and in a compilation whose index is `pred` (compiled 0,"
    " not confined: ops outside, or extra ops for SGD):",
    "",
    *_conditional_table(section["controls"]),
    "",
  ]


def _step_time_lines(section: dict[str, Any], backend: str) -> list[str]:
  lines = [f"## Step time on {backend}", ""]
  for record in section.values():
    lines += [
      f"### {record['description']}",
      "",
      f"{record['num_params']:,} parameters; medians over interleaved"
      " rounds of benchmarks/run.py.",
      "",
      "| contender | micro-step ms | window-closing ms | micro / plain Adam |"
      " closing / plain Adam | micro / MultiSteps micro |"
      " closing / MultiSteps closing | temp / plain Adam's |",
      "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, ratios in record["ratios"].items():
      result = record["contenders"][name]
      lines.append(
        f"| {name} | {result['micro_ms']:.3f} | {result['closing_ms']:.3f} |"
        + "".join(f" {value:.2f} |" for value in ratios.values())
      )
    lines += [
      "",
      "| figure | value | target (set on the CPU) | met |",
      "|---|---:|---|---|",
    ]
    for row in record["figures"]:
      met = {True: "yes", False: "**no**", None: ""}[row["met"]]
      lines.append(
        f"| {row['figure']} | {row['value']:.2f} | {row['target'] or ''} |"
        f" {met} |"
      )
    lines.append("")
  return lines


def _in_step_lines(section: dict[str, Any], backend: str) -> list[str]:
  lines = [f"## In-step window on {backend}", ""]
  for record in section.values():
    lines += [
      f"### {record['description']}",
      "",
      f"{record['rows']} rows in {record['num_microbatches']} micro-batches;"
      " medians of alternating single calls. optax.microbatching:"
      f" {record['optax_microbatching']}.",
      "",
      "| window | median ms | / hand-written scan | temp MiB |"
      " max relative difference to the full batch |",
      "|---|---:|---:|---:|---:|",
    ]
    for name, result in record["windows"].items():
      lines.append(
        f"| {name} | {result['median_ms']:.3f} |"
        f" {result['over_hand_written_scan']:.2f} |"
        f" {_mib(result['temp_bytes'])} |"
        f" {result['max_relative_difference_to_full_batch']:.1e} |"
      )
    lines.append("")
  return lines


def _memory_lines(memory: dict[str, Any], backend: str) -> list[str]:
  model = memory["model"]
  large = memory["large_batch"]
  lines = [
    f"## Memory on {backend}",
    "",
    f"MLP {model['depth']} x {model['width']} x {model['width']}"
    f" ({memory['num_params']:,} parameters, Adam), global batch"
    f" {model['global_batch']}. MiB of device memory compiled"
    " (`memory_analysis()`); peak: `memory_stats()['peak_bytes_in_use']` of"
    f" a fresh process ({memory['peaks']}). Accumulator:"
    f" {_mib(memory['accumulator_bytes'])} MiB. Large batch: plain Adam"
    f" step on {model['global_batch']} rows, {_mib(large['device_bytes'])}"
    f" MiB compiled, peak {_mib(large.get('peak_bytes_in_use')) or 'n/a'}.",
    "",
    "| k | micro-batch | plain step on it | accumulate micro-step |"
    " accumulate / (plain + accumulator) | accumulator on host |"
    " host / plain | host / on device | in-step window |"
    " window / large batch |",
    "|---:|---:|---|---|---:|---|---:|---:|---|---:|",
  ]
  for row in memory["by_k"]:
    ratios = row["ratios"]
    lines.append(
      f"| {row['every_k']} | {row['microbatch']} |"
      f" {_bytes_cell(row['plain'])} | {_bytes_cell(row['accumulate'])} |"
      f" {_ratio_cell(ratios, 'accumulate / (micro-batch run + accumulator)')}"
      f" | {_bytes_cell(row.get('accumulate_host'))} |"
      f" {_ratio_cell(ratios, 'accumulator on host / micro-batch run')} |"
      f" {_ratio_cell(ratios, 'accumulator on host / on device')} |"
      f" {_bytes_cell(row['window'])} |"
      f" {_ratio_cell(ratios, 'in-step window / large batch')} |"
    )
  lines += [
    "",
    "Ratios: compiled bytes, then peak bytes where measured.",
    "",
    f"Largest batches whose compiled bytes fit {_mib(memory['budget_bytes'])}"
    f" MiB ({memory['budget_source']}):",
    "",
    "| step | largest rows | their MiB | next rows | their MiB |"
    f" rows per update (accumulate: x k={memory['model']['ks'][-1]}) |"
    " compilations |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for name, found in memory["largest"].items():
    lines.append(
      f"| {name} | {found['rows'] or 'none'} | {_mib(found['bytes'], 2)} |"
      f" {found.get('next_rows') or ''} |"
      f" {_mib(found.get('next_bytes'), 2)} | {found['effective_batch']} |"
      f" {found.get('compilations', 1)} |"
    )
  lines.append("")
  return lines


def _progress(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
  """Runs the report; returns it (None in a ``--peak-of`` child process)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--output-dir",
    type=pathlib.Path,
    default=REPO_ROOT / "benchmarks" / "results",
    help="where gpu_report.md and gpu_report.json go",
  )
  parser.add_argument(
    "--quick", action="store_true", help="small sizes, few rounds (smoke)"
  )
  parser.add_argument(
    "--repeats", type=int, default=None, help="measured rounds (default 10)"
  )
  parser.add_argument(
    "--warmup", type=int, default=1, help="unmeasured rounds first"
  )
  parser.add_argument(
    "--no-peak",
    action="store_true",
    help="skip the fresh processes that measure peak device memory",
  )
  parser.add_argument(
    "--memory-budget-mib",
    type=float,
    default=None,
    help="budget for the largest batch that fits (default: a fraction of"
    " the device's bytes_limit)",
  )
  parser.add_argument(
    "--memory-fraction",
    type=float,
    default=DEFAULT_MEMORY_FRACTION,
    help="part of bytes_limit a step may use",
  )
  parser.add_argument("--peak-of", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.peak_of:
    peak_here(args.peak_of)
    return None
  repeats = args.repeats or (2 if args.quick else 10)
  if repeats < 1 or args.warmup < 0:
    parser.error("--repeats must be >= 1 and --warmup >= 0")
  started = time.perf_counter()
  command = "python benchmarks/gpu_report.py " + " ".join(
    sys.argv[1:] if argv is None else [str(arg) for arg in argv]
  )
  workloads = time_workloads(args.quick)
  report: dict[str, Any] = {
    "environment": environment(command.strip(), args.quick),
    "repeats": repeats,
    "warmup": args.warmup,
    "conditionals": conditionals_section(args.quick),
    "step_time": step_time_section(workloads, repeats, args.warmup),
    "in_step": in_step_section(
      in_step_workloads(args.quick), 3 * repeats, args.warmup
    ),
    "memory": memory_section(
      args.quick,
      args.memory_budget_mib,
      args.memory_fraction,
      peaks=not args.no_peak,
    ),
  }
  report["elapsed_s"] = time.perf_counter() - started
  text = markdown(report)
  args.output_dir.mkdir(parents=True, exist_ok=True)
  (args.output_dir / "gpu_report.md").write_text(text + "\n")
  (args.output_dir / "gpu_report.json").write_text(
    json.dumps(report, indent=1, default=str)
  )
  print(text)
  _progress(f"written to {args.output_dir}")
  return report


if __name__ == "__main__":
  main()
