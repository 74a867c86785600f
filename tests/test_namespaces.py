"""Names that moved to a namespace: found there, and still where they were.

``ga_optax.planning`` took the planner's, the elastic plans' and the partial
sums' names from the top level, and ``ga_optax.testing.hlo`` the HLO
building blocks from ``ga_optax.testing``. The old spelling returns the
same object with a ``DeprecationWarning`` that names the new one; nothing
else warns, and ``dir()`` and ``__all__`` show each name only at its new
place.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

import ga_optax
import ga_optax.testing

ROOT = pathlib.Path(__file__).resolve().parent.parent

PLANNING = (
  "MicrobatchPlan",
  "plan_microbatch",
  "micro_step_bytes",
  "ElasticPlan",
  "elastic_plan",
  "best_global_batch_size",
  "valid_device_counts",
  "consolidate",
  "split_total",
  "stack_partial_sums",
  "unstack_partial_sums",
)
HLO = (
  "parse_hlo",
  "reachable",
  "collectives_in_hlo",
  "HloModule",
  "HloInstruction",
  "Collective",
  "dot_shapes",
)
# (the module a name was in, the namespace it moved to, the name)
MOVED = [("ga_optax", "ga_optax.planning", name) for name in PLANNING] + [
  ("ga_optax.testing", "ga_optax.testing.hlo", name) for name in HLO
]


@pytest.mark.parametrize(("old", "new", "name"), MOVED)
def test_a_moved_name_is_public_in_its_namespace(old, new, name):
  namespace = importlib.import_module(new)
  assert name in namespace.__all__
  # An attribute of its own, not one found by a module __getattr__.
  assert name in vars(namespace)


@pytest.mark.parametrize(("old", "new", "name"), MOVED)
def test_the_old_spelling_is_the_same_object_and_warns(old, new, name):
  module, namespace = sys.modules[old], importlib.import_module(new)
  with pytest.warns(
    DeprecationWarning, match=rf"^{re.escape(f'{old}.{name}')} is deprecated:"
  ) as record:
    found = getattr(module, name)
  assert found is getattr(namespace, name)
  (warning,) = record
  assert f"use {new}.{name}," in str(warning.message)
  # The warning points at the line that spelled the old name.
  assert warning.filename == __file__


@pytest.mark.parametrize(
  ("old", "new", "name"),
  [MOVED[0], ("ga_optax.testing", "ga_optax.testing.hlo", "parse_hlo")],
)
def test_an_import_of_the_old_spelling_warns(old, new, name):
  scope: dict[str, object] = {}
  with pytest.warns(DeprecationWarning, match=re.escape(f"use {new}.{name}")):
    exec(f"from {old} import {name}", scope)
  assert scope[name] is getattr(importlib.import_module(new), name)


def test_importing_the_package_and_its_namespaces_warns_nothing():
  subprocess.run(
    [
      sys.executable,
      "-W",
      "error",
      "-c",
      "import ga_optax, ga_optax.planning, ga_optax.testing,"
      " ga_optax.testing.hlo; from ga_optax.testing import hlo",
    ],
    env={**os.environ, "PYTHONPATH": str(ROOT)},
    check=True,
  )


@pytest.mark.parametrize("module", [ga_optax, ga_optax.testing])
def test_the_names_that_stay_warn_nothing(module):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for name in module.__all__:
      getattr(module, name)


@pytest.mark.parametrize(
  ("module", "namespace", "moved"),
  [(ga_optax, "planning", PLANNING), (ga_optax.testing, "hlo", HLO)],
)
def test_dir_and_all_show_the_namespace_not_the_old_names(
  module, namespace, moved
):
  assert namespace in module.__all__
  assert namespace in dir(module)
  assert not set(moved) & set(module.__all__)
  assert not set(moved) & set(dir(module))


@pytest.mark.parametrize("module", [ga_optax, ga_optax.testing])
def test_an_unknown_name_is_still_an_attribute_error(module):
  with pytest.raises(
    AttributeError,
    match=rf"^module '{re.escape(module.__name__)}' has no attribute 'plan'$",
  ):
    module.plan  # noqa: B018 (the lookup is the test)
  assert not hasattr(module, "plan")
