"""The suite's programs compiled without work that does not shape them.

Most of the suite's time is XLA compiling programs that then run once on a
few rows (the CPU's) or are only read (the compile-only H100s'). Every test
(tests/conftest.py) compiles at the suite's level:

- A CPU program as JAX's ``jax_disable_most_optimizations`` compiles it:
  backend optimization level 0, LLVM's expensive passes off. XLA's own
  passes run as by default, so the optimized HLO, its buffers and its
  copies are a user's (tests/test_cpu_program.py compares them on the
  window's program), and every claim compares two programs compiled alike
  (the window against its large-batch reference). Floats may differ from a
  default build's in the last bits, as they differ between two host CPUs of
  other vector widths: a printed value the docs quote must not hang on
  them, and every page printed the same at both levels when the docs'
  tests moved to this one.
- A program for a compile-only GPU without XLA:GPU's autotuner
  (``xla_gpu_autotune_level=0``). Without a device it times nothing, yet it
  took much of each compilation's time; the program it leaves has the
  default's instructions, buffers and peak memory
  (tests/test_gpu_program.py compares them), so every claim read from it
  holds for a default build.

The TPU programs keep XLA's defaults. JAX's own flags would reach every
platform, hence the hook on the compile options here. A change of level
clears JAX's in-memory caches and the audits' (no compiled program crosses
from one level to the other), and a test's subprocess compiles at its
test's level (it inherits the level with the environment:
``from_environment``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax
from jax._src import compiler

from ga_optax._src import audits
from ga_optax._src.audits import compile_only

_LEVEL = {"unoptimized": False}
VARIABLE = "GA_OPTAX_TEST_UNOPTIMIZED"
_DEFAULT_COMPILE_OPTIONS = compiler.get_compile_options


def _compile_options(*args: Any, **kwargs: Any) -> Any:
  backend = kwargs.get("backend")
  platform = getattr(backend, "platform", None)
  # A real GPU (JAX_PLATFORMS=cuda,cpu) runs its programs: they keep the
  # autotuner, which chooses how fast they run.
  without_device = type(backend).__name__ == "CompileOnlyPyClient"
  if _LEVEL["unoptimized"] and platform == "gpu" and without_device:
    # Not a field of jaxlib's DebugOptions: XLA parses it by name.
    kwargs["env_options_overrides"] = {
      **(kwargs.get("env_options_overrides") or {}),
      "xla_gpu_autotune_level": 0,
    }
  options = _DEFAULT_COMPILE_OPTIONS(*args, **kwargs)
  if _LEVEL["unoptimized"] and platform == "cpu":
    debug = options.executable_build_options.debug_options
    debug.xla_backend_optimization_level = 0
    debug.xla_llvm_disable_expensive_passes = True
  return options


# JAX builds every jitted program's options here (pxla passes the backend
# by keyword); the persistent cache keys on them, so the levels never share
# an entry.
compiler.get_compile_options = _compile_options


def set_unoptimized(unoptimized: bool) -> None:
  """Compiles the CPU's and the GPU's programs from now on at the given level.

  The level is also written into this process's environment, which every
  subprocess a test starts inherits: one that calls ``from_environment``
  compiles at the level of the test that started it.
  """
  if unoptimized != _LEVEL["unoptimized"]:
    jax.clear_caches()
    compile_only._COMPILED.clear()
    _LEVEL["unoptimized"] = unoptimized
  os.environ[VARIABLE] = "1" if unoptimized else "0"


@contextlib.contextmanager
def unoptimized(value: bool) -> Iterator[None]:
  """The programs compiled at the given level inside the block."""
  before = _LEVEL["unoptimized"]
  set_unoptimized(value)
  try:
    yield
  finally:
    set_unoptimized(before)


def from_environment() -> None:
  """In a test's subprocess: the level of the test that started it."""
  set_unoptimized(os.environ.get(VARIABLE) == "1")


def assert_same_program(default: Any, suite: Any, name: str = "") -> None:
  """Two compiled programs, one built at XLA's defaults and one at the
  suite's level, hold the same instructions in every computation (their
  source locations aside) and the same memory figures; ``name`` says which
  step a failure is about."""
  assert (
    audits.parse_hlo(default.as_text()).computations
    == audits.parse_hlo(suite.as_text()).computations
  ), name
  memory = [program.memory_analysis() for program in (default, suite)]
  for field in (
    "temp_size_in_bytes",
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "peak_memory_in_bytes",
  ):
    assert getattr(memory[0], field) == getattr(memory[1], field), (
      name,
      field,
    )
