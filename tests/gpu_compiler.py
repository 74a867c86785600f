"""XLA:GPU for the tests: a step compiled for compile-only H100s, or a skip.

Shared by the tests that read an H100-compiled program
(tests/test_gpu_program.py, tests/test_host_waits.py, tests/test_fp8.py,
tests/test_window_sizes.py). Where JAX's CUDA plugin is missing the test is
skipped with how to install it, except in CI, which installs the plugin:
there it fails.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from ga_optax._src import audits

Result = TypeVar("Result")


def or_skip(
  compile_: Callable[..., Result], *args: Any, **options: Any
) -> Result:
  """``compile_(*args, **options)``; without XLA:GPU a skip (in CI, a failure)."""
  try:
    return compile_(*args, **options)
  except audits.GpuCompilerUnavailable as error:
    if os.environ.get("CI"):
      raise
    pytest.skip(
      f"{error} To run this test: pip install 'jax[cuda13]' and run pytest"
      " with JAX_PLATFORMS=cpu (tests/conftest.py sets it)."
    )


def compiled_for_gpu(
  step: Callable[..., Any], *args: Any, **options: Any
) -> Any:
  """``audits.compile_for_gpu(step, *args, **options)``, or a skip."""
  return or_skip(audits.compile_for_gpu, step, *args, **options)


def host_waits_on_gpu(
  step: Callable[..., Any], *args: Any, **options: Any
) -> audits.HostWaits:
  """``audits.host_waits(step, *args, **options)``, or a skip."""
  return or_skip(audits.host_waits, step, *args, **options)
