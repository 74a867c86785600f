"""The host's schedule against the state-carrying reference, compiled.

For an MLP with biases, micro-batch 8, Adam, k = 4, this compiles the two
programs of each host-scheduled window (``closing=False`` and ``True``):
``ga_optax.accumulate``'s, ``ga_optax.accumulate_and_apply``'s and the
state-carrying reference written by hand (``benchmarks/state_carrying.py``),
and reads, per program:

* on an H100 (XLA:GPU, compile-only, XLA's defaults): the launches, the
  thunks at the top level of the program (kernels, library calls, copies),
  and per window, ``k - 1`` micro-steps and one closing step;
* on the CPU, an H100 and a v5e chip (libtpu, compile-only): the copies of
  a parameter's size or more that duplicate a buffer in its memory space.

Usage::

  python benchmarks/host_overhead.py            # 4 x 1024^2 and 2 x 256^2
  python benchmarks/host_overhead.py --quick    # 2 x 256^2 only

``tests/test_host_overhead.py`` holds ga_optax's programs to the
reference's: launches per window at most its + 2, copies at most its.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import ga_optax  # noqa: E402
from benchmarks import state_carrying  # noqa: E402
from ga_optax._src import audits  # noqa: E402

EVERY_K = 4
ROWS = 8
REFERENCE = "state-carrying reference"
WINDOWS = (REFERENCE, "ga_optax.accumulate", "ga_optax.accumulate_and_apply")
TARGETS = ("cpu", "h100", "v5e")
Program = tuple[Callable[..., Any], tuple[Any, ...]]
# A thunk as XLA:GPU prints its sequence: ``012: kCopy  [...]``, indented
# by its nesting; a command buffer (a CUDA graph) holds the kernels it
# launches, and is no launch of its own.
_THUNK = re.compile(r"^ *\d+: (k\w+)", re.MULTILINE)
_NOT_LAUNCHED = frozenset({"kCommandBuffer"})
_CONTROL_FLOW = frozenset({"kWhile", "kConditional"})


def biased_mlp(width: int, depth: int) -> tuple[Callable[..., Any], Any, Any]:
  """``(loss_fn, params, batch)``: ``depth`` tanh layers with biases."""
  keys = jax.random.split(jax.random.PRNGKey(0), depth + 2)
  params = [
    {
      "w": jax.random.normal(keys[i], (width, width)) / math.sqrt(width),
      "b": jnp.zeros((width,)),
    }
    for i in range(depth)
  ]

  def loss_fn(params: Any, batch: Any) -> jax.Array:
    hidden = batch["x"]
    for layer in params:
      hidden = jnp.tanh(hidden @ layer["w"] + layer["b"])
    return jnp.mean(jnp.sum((hidden - batch["y"]) ** 2, axis=-1))

  batch = {
    "x": jax.random.normal(keys[-2], (ROWS, width)),
    "y": jax.random.normal(keys[-1], (ROWS, width)),
  }
  return loss_fn, params, batch


def window_programs(
  loss_fn: Callable[..., Any], params: Any, batch: Any, every_k: int = EVERY_K
) -> dict[str, dict[bool, Program]]:
  """Each window's two programs, by name and ``closing``: ``(step, args)``,
  ``step(params, state, batch) -> (params, state)``, params and state to be
  donated."""
  adam = optax.adam(1e-3)
  reference = state_carrying.state_carrying_window(loss_fn, adam)
  tx = ga_optax.accumulate(adam, every_k)
  fused = ga_optax.accumulate_and_apply(adam, every_k)

  def accumulate_step(closing: bool) -> Callable[..., Any]:
    def step(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      updates, state = tx.update(grads, state, params, closing=closing)
      return optax.apply_updates(params, updates), state

    return step

  def fused_step(closing: bool) -> Callable[..., Any]:
    def step(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      return fused.apply(params, grads, state, closing=closing)

    return step

  steps = {
    REFERENCE: (
      {False: reference.keep_open, True: reference.close},
      reference.init(params),
    ),
    "ga_optax.accumulate": (
      {closing: accumulate_step(closing) for closing in (False, True)},
      tx.init(params),
    ),
    "ga_optax.accumulate_and_apply": (
      {closing: fused_step(closing) for closing in (False, True)},
      fused.init(params),
    ),
  }
  return {
    name: {
      closing: (step, (params, state, batch))
      for closing, step in by_closing.items()
    }
    for name, (by_closing, state) in steps.items()
  }


def gpu_launches(program: Program) -> tuple[Any, int]:
  """``program`` compiled for an H100 (XLA's defaults, params and state
  donated), and the kernels, library calls and copies it launches.

  Raises:
    ValueError: the program holds a loop or a conditional (a host-scheduled
      program holds neither, and each trip would launch its body anew).
  """
  step, args = program
  with tempfile.TemporaryDirectory(prefix="ga_optax_launches_") as dump:
    compiled_program = audits.compile_for_gpu(
      step, *args, donate_argnums=(0, 1), compiler_options={"xla_dump_to": dump}
    )
    paths = sorted(
      pathlib.Path(dump).glob("*.thunk_sequence_after_thunk_passes.txt")
    ) or sorted(pathlib.Path(dump).glob("*.thunk_sequence.txt"))
    if len(paths) != 1:
      raise RuntimeError(f"expected one thunk sequence, found {len(paths)}.")
    kinds = _THUNK.findall(paths[0].read_text())
  if _CONTROL_FLOW.intersection(kinds):
    raise ValueError(f"the program holds control flow: {kinds}")
  return compiled_program, sum(kind not in _NOT_LAUNCHED for kind in kinds)


def compiled(program: Program, target: str) -> Any:
  """``program`` compiled for ``target``, params and state donated."""
  step, args = program
  if target == "h100":
    return gpu_launches(program)[0]
  if target == "v5e":
    return audits.compile_for_tpu(step, *args, donate_argnums=(0, 1))
  return jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()


def parameter_sized_copies(program: Any, params: Any) -> list[audits.Copy]:
  """The copies in ``program`` of at least the smallest parameter's bytes
  that duplicate a buffer in its own memory space."""
  smallest = min(
    leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params)
  )
  found = audits.path_audit(program, "micro_step", require_window=False)
  return [copy for copy in found.duplicates if copy.bytes >= smallest]


def measure(width: int, depth: int) -> dict[str, Any]:
  """Launches and parameter-sized copies of every program, by target."""
  loss_fn, params, batch = biased_mlp(width, depth)
  programs = window_programs(loss_fn, params, batch)
  record: dict[str, Any] = {}
  for name in WINDOWS:
    row: dict[str, Any] = {}
    for closing in (False, True):
      side = "closing" if closing else "micro_step"
      for target in TARGETS:
        print(f"  {name} {side} {target}", file=sys.stderr, flush=True)
        if target == "h100":
          program, row[f"{side} launches"] = gpu_launches(
            programs[name][closing]
          )
        else:
          program = compiled(programs[name][closing], target)
        row[f"{side} copies {target}"] = len(
          parameter_sized_copies(program, params)
        )
    row["window launches"] = (EVERY_K - 1) * row["micro_step launches"] + row[
      "closing launches"
    ]
    record[name] = row
  return record


def table(record: dict[str, Any]) -> str:
  columns = list(next(iter(record.values())))
  lines = [
    "| window | " + " | ".join(columns) + " |",
    "|---|" + "---:|" * len(columns),
  ]
  for name, row in record.items():
    lines.append(f"| {name} | " + " | ".join(str(row[c]) for c in columns))
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="2 x 256^2 only")
  args = parser.parse_args(argv)
  sizes = [(256, 2)] if args.quick else [(1024, 4), (256, 2)]
  print(f"jax {jax.__version__}, k = {EVERY_K}, micro-batch {ROWS}, Adam")
  for width, depth in sizes:
    print(f"\nMLP {depth} x {width}^2 with biases\n")
    print(table(measure(width, depth)))


if __name__ == "__main__":
  main()
