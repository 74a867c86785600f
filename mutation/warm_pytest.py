"""Each mutant's pytest, in a process forked from one that imported its dependencies.

Every mutant's tests run in a fresh process, and much of a short run was
Python importing the same third-party packages (JAX, optax, flax, equinox,
hypothesis, pytest) before the first test. A fork server imports them once,
and each run is a process forked from it: it starts with them imported and
imports the rest (ga_optax from the mutant's copy, the test modules) as a
fresh process would.

Nothing the server imports may start JAX's backend (the tests set the device
count before it starts): ``server`` checks that. Nor may it import ga_optax,
which each mutant's copy provides (the ``harness_plugin`` checks where the
mutated modules come from in every run). What JAX reads from
the environment when it is imported, the server reads from this process's:
``server`` sets what tests/conftest.py would set before importing JAX.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence

# Imported once, in the server: what every test process imports and no
# mutant changes.
PRELOADED = (
  "numpy",
  "jax",
  "jax.numpy",
  "optax",
  "chex",
  "flax.linen",
  "flax.nnx",
  "equinox",
  "hypothesis",
  "pytest",
)

_CONTEXT = multiprocessing.get_context("forkserver")


def _check_preloaded() -> None:
  """In a process forked from the server: no backend started, asserts on."""
  from jax._src import xla_bridge

  if xla_bridge.backends_are_initialized():
    raise RuntimeError("a preloaded module started JAX's backend")
  if sys.flags.optimize:
    raise RuntimeError("the tests' bare asserts must run: no -O")


@contextlib.contextmanager
def server() -> Iterator[None]:
  """The fork server, its imports done, for the runs inside the block.

  JAX reads the platforms and the compilation cache from the environment
  when it is imported, so they are set here as tests/conftest.py sets them:
  the CPU unless set, and one cache for the whole check unless set
  (conftest would make one per run, which no other run could use), removed
  at the end.
  """
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.pop("PYTHONOPTIMIZE", None)
  made = None
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    made = tempfile.mkdtemp(prefix="ga-optax-mutation-compiled-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = made
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  try:
    _CONTEXT.set_forkserver_preload(list(PRELOADED))
    checker = _CONTEXT.Process(target=_check_preloaded)
    checker.start()
    checker.join()
    if checker.exitcode != 0:
      raise RuntimeError("the mutation check's fork server could not start")
    yield
  finally:
    if made is not None:
      del os.environ["JAX_COMPILATION_CACHE_DIR"]
      shutil.rmtree(made, ignore_errors=True)


def _pytest(
  root: str,
  path: Sequence[str],
  variables: Mapping[str, str | None],
  arguments: Sequence[str],
  output: str,
) -> None:
  """In the forked process: pytest on ``arguments`` from ``root``."""
  descriptor = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  # Pytest's output and that of the subprocesses tests start, into one file.
  os.dup2(descriptor, 1)
  os.dup2(descriptor, 2)
  # The server's environment holds what the preloaded modules set (JAX
  # tells libtpu not to query a cloud's metadata server, which it would
  # otherwise wait for): changed, never replaced.
  for name, value in variables.items():
    if value is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = value
  # What ``python -m pytest`` from ``root`` with PYTHONPATH=path would see,
  # and what the subprocesses tests start see.
  os.environ["PYTHONPATH"] = os.pathsep.join(path)
  os.chdir(root)
  sys.path[:] = [root, *path, *(p for p in sys.path if p not in ("", root))]
  import pytest

  code = pytest.main(list(arguments))
  sys.stdout.flush()
  sys.stderr.flush()
  raise SystemExit(int(code))


def run(
  root: pathlib.Path,
  path: Sequence[str],
  variables: Mapping[str, str | None],
  arguments: Sequence[str],
  timeout: float,
) -> tuple[int, str]:
  """``python -m pytest ARGUMENTS`` run from ``root``: (exit code, output).

  ``path`` is the run's ``PYTHONPATH`` and leads its module search path,
  and ``variables`` change this process's environment for the run (None:
  the variable is removed). The exit code is -1 when the run took longer than
  ``timeout`` seconds, and negative when a signal ended it.
  """
  with tempfile.NamedTemporaryFile(suffix=".log") as log:
    process = _CONTEXT.Process(
      target=_pytest,
      args=(
        str(root),
        list(path),
        dict(variables),
        list(arguments),
        log.name,
      ),
    )
    process.start()
    process.join(timeout)
    timed_out = process.is_alive()
    if timed_out:
      process.kill()
      process.join()
    output = pathlib.Path(log.name).read_text(errors="replace")
  if timed_out:
    return -1, output + f"\n(timed out after {timeout} s)"
  code = process.exitcode
  assert code is not None  # joined
  return code, output
