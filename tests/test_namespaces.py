"""Names that moved or went: each old spelling names its replacement.

``ga_optax.planning`` took the planner's, the elastic plans' and the partial
sums' names from the top level; the compiled-program audits of
``ga_optax.testing`` and ``ga_optax.testing.hlo`` went behind the one entry
point ``ga_optax.testing.audit``; ``ga_optax.gpu_compiler_options`` went,
for the host's schedule (``closing=``). An old spelling raises an
``AttributeError`` that names what to use instead; ``dir()`` and ``__all__``
show only what is there, and docs/api.md lists exactly that.
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
PUBLIC_MODULES = (
  "ga_optax",
  "ga_optax.testing",
  "ga_optax.batch_size",
  "ga_optax.mixed_precision",
  "ga_optax.planning",
  "ga_optax.privacy",
)

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
AUDITS = (
  "compile_for_gpu",
  "compile_for_tpu",
  "path_audit",
  "PathAudit",
  "Copy",
  "window_sides",
  "host_waits",
  "count_host_waits",
  "HostWaits",
  "window_collectives",
  "WindowCollectives",
  "loop_collectives",
  "gpu_devices",
  "tpu_devices",
  "GpuCompilerUnavailable",
  "TpuCompilerUnavailable",
  "hlo",
  # ga_optax.testing.hlo's, once ga_optax.testing's too.
  "parse_hlo",
  "reachable",
  "collectives_in_hlo",
  "HloModule",
  "HloInstruction",
  "Collective",
  "dot_shapes",
)
# (the module a name was in, the name, what the error must name)
REMOVED = (
  [("ga_optax", name, f"ga_optax.planning.{name}") for name in PLANNING]
  + [("ga_optax.testing", name, "ga_optax.testing.audit") for name in AUDITS]
  + [("ga_optax", "gpu_compiler_options", "closing=")]
)


@pytest.mark.parametrize(("old", "name", "replacement"), REMOVED)
def test_a_removed_name_raises_an_attribute_error_naming_its_replacement(
  old, name, replacement
):
  module = sys.modules[old]
  with pytest.raises(
    AttributeError, match=rf"^{re.escape(f'{old}.{name}')} was removed: use"
  ) as raised:
    getattr(module, name)
  assert replacement in str(raised.value)
  assert not hasattr(module, name)
  assert name not in module.__all__ and name not in dir(module)


def test_the_gpu_recipe_error_points_at_the_gpu_page():
  with pytest.raises(AttributeError, match=re.escape("docs/how-to/gpu.md")):
    ga_optax.gpu_compiler_options  # noqa: B018 (the lookup is the test)


@pytest.mark.parametrize("name", PLANNING)
def test_a_moved_name_is_public_in_planning(name):
  assert name in ga_optax.planning.__all__
  assert name in vars(ga_optax.planning)


@pytest.mark.parametrize(
  ("old", "name"),
  [("ga_optax", "plan_microbatch"), ("ga_optax.testing", "path_audit")],
)
def test_an_import_of_a_removed_name_fails(old, name):
  with pytest.raises(ImportError, match=name):
    exec(f"from {old} import {name}", {})


def test_no_public_module_parses_hlo_text():
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module("ga_optax.testing.hlo")
  assert not (ROOT / "ga_optax" / "testing" / "hlo.py").exists()


def test_importing_the_package_and_its_namespaces_warns_nothing():
  subprocess.run(
    [
      sys.executable,
      "-W",
      "error",
      "-c",
      "import " + ", ".join(PUBLIC_MODULES),
    ],
    env={**os.environ, "PYTHONPATH": str(ROOT)},
    check=True,
  )


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_the_public_names_warn_nothing(module):
  module = importlib.import_module(module)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for name in module.__all__:
      getattr(module, name)


@pytest.mark.parametrize("module", [ga_optax, ga_optax.testing])
def test_an_unknown_name_is_still_an_attribute_error(module):
  with pytest.raises(
    AttributeError,
    match=rf"^module '{re.escape(module.__name__)}' has no attribute 'plan'$",
  ):
    module.plan  # noqa: B018 (the lookup is the test)
  assert not hasattr(module, "plan")


# A row of docs/api.md's tables: | `module.name` | purpose |
_API_ROW = re.compile(r"^\| `([\w.]+)` \| (.+) \|$")


def _api_rows() -> dict[str, str]:
  text = (ROOT / "docs" / "api.md").read_text()
  rows = {}
  for line in text.splitlines():
    match = _API_ROW.match(line)
    if match:
      assert match[1] not in rows, f"{match[1]} is listed twice"
      rows[match[1]] = match[2]
  return rows


def test_api_md_lists_exactly_the_public_names_each_with_a_purpose():
  public = {
    f"{module}.{name}"
    for module in PUBLIC_MODULES
    for name in importlib.import_module(module).__all__
  }
  rows = _api_rows()
  assert sorted(set(rows) - public) == [], "listed but not public"
  assert sorted(public - set(rows)) == [], "public but not listed"
  for name, purpose in rows.items():
    assert len(purpose.split()) >= 3, f"{name}: no purpose given"


def test_api_md_renders_only_public_names():
  text = (ROOT / "docs" / "api.md").read_text()
  rendered = re.findall(r"^::: ([\w.]+)$", text, flags=re.MULTILINE)
  rows = _api_rows()
  assert rendered, "docs/api.md renders no reference"
  assert sorted(set(rendered) - set(rows)) == []
