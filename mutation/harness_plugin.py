"""The pytest plugin of the mutation check (``-p harness_plugin``).

It does two things before any test module is imported:

* It refuses to run unless the mutated copy is what is imported.
  ``mutation/run.py`` names, in the environment, the copy's root and the
  files its mutant changed; each changed module is imported and must come
  from the copy, otherwise the run stops with a usage error (exit code 4),
  which the harness reports as an error, never as a verdict.
* It loads a hypothesis profile without the shrink phase: a mutant is
  killed by the first failing example, and shrinking it to the smallest one
  would take minutes. (Settings a test states itself still win.)
"""

from __future__ import annotations

import importlib
import os
import pathlib

import hypothesis
import pytest

ROOT_VARIABLE = "GA_OPTAX_MUTANT_ROOT"
FILES_VARIABLE = "GA_OPTAX_MUTANT_FILES"


def _module_name(path: str) -> str:
  """``ga_optax/_src/accumulate.py`` -> ``ga_optax._src.accumulate``."""
  parts = pathlib.PurePosixPath(path).with_suffix("").parts
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def pytest_configure(config: pytest.Config) -> None:
  del config  # Both steps need only the environment.
  hypothesis.settings.register_profile(
    "mutation",
    phases=[
      hypothesis.Phase.explicit,
      hypothesis.Phase.reuse,
      hypothesis.Phase.generate,
    ],
  )
  hypothesis.settings.load_profile("mutation")
  root = pathlib.Path(os.environ[ROOT_VARIABLE]).resolve()
  files = [f for f in os.environ.get(FILES_VARIABLE, "").split(os.pathsep) if f]
  for path in ["ga_optax/__init__.py", *files]:
    module = importlib.import_module(_module_name(path))
    imported = pathlib.Path(module.__file__ or "").resolve()
    if imported != root / path:
      raise pytest.UsageError(
        f"{module.__name__} was imported from {imported}, not from the"
        f" mutated copy {root / path}: the mutant would not be tested."
      )
