"""The house's rules for code: room sizes, and classes abstract or final.

A class that shares code with another does so through a base whose shared
methods are concrete and whose differing ones are abstract
(``placements.local.DeviceSums`` under ``Local`` and ``Collective``): a
reader of a method never has to ask which of two bodies runs. Checked on
every class under ``ga_optax._src``, against every base of the project's own.
And no module of the package is over 500 lines, no class over 160, no
function's body (its docstring aside) over 60.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import pkgutil
from typing import Any

import ga_optax._src


def project_classes() -> list[type]:
  classes = []
  for module_info in pkgutil.walk_packages(
    ga_optax._src.__path__, "ga_optax._src."
  ):
    module = importlib.import_module(module_info.name)
    for _, cls in inspect.getmembers(module, inspect.isclass):
      if cls.__module__ == module.__name__:
        classes.append(cls)
  return classes


def is_concrete(member: Any) -> bool:
  function = member.fget if isinstance(member, property) else member
  if not callable(function):
    return False
  return not getattr(function, "__isabstractmethod__", False)


def overridden(cls: type) -> list[str]:
  """``Base.name`` of each concrete method of a project base ``cls`` redefines."""
  found = []
  for base in cls.__mro__[1:]:
    if not base.__module__.startswith("ga_optax."):
      continue
    if getattr(base, "_is_protocol", False):
      continue  # a protocol's bodies are the interface's, never run
    for name in vars(cls):
      if name.startswith("__") or name not in vars(base):
        continue
      if is_concrete(vars(base)[name]):
        found.append(f"{base.__name__}.{name}")
  return found


def test_no_class_overrides_a_concrete_method_of_the_project():
  classes = project_classes()
  assert len(classes) > 50  # every wing was walked
  offences = {cls.__qualname__: overridden(cls) for cls in classes}
  assert {name: found for name, found in offences.items() if found} == {}


def test_the_rule_sees_an_override():
  # The planted control: a subclass that redefines a concrete method.
  from ga_optax._src.placements.local import Local

  class Verbose(Local):
    def reduce(self, accumulator: Any, params: Any) -> Any:
      return accumulator

  Verbose.__module__ = "ga_optax._src.placements.verbose"
  assert overridden(Verbose) == ["Local.reduce"]


PACKAGE = pathlib.Path(ga_optax._src.__file__).parent.parent


def oversized(path: pathlib.Path) -> list[str]:
  """What in one module is over the house's sizes."""
  text = path.read_text()
  found = []
  if len(text.splitlines()) > 500:
    found.append(f"{path.name}: {len(text.splitlines())} lines")
  for node in ast.walk(ast.parse(text)):
    if isinstance(node, ast.ClassDef):
      lines = node.end_lineno - node.lineno + 1
      if lines > 160:
        found.append(f"class {node.name}: {lines} lines")
    if isinstance(node, ast.FunctionDef):
      body = node.body
      if ast.get_docstring(node) is not None:
        body = body[1:]
      lines = body[-1].end_lineno - body[0].lineno + 1 if body else 0
      if lines > 60:
        found.append(f"def {node.name}: a body of {lines} lines")
  return found


def test_no_room_is_over_the_house_sizes():
  modules = sorted(PACKAGE.rglob("*.py"))
  assert len(modules) > 50
  found = {str(path.relative_to(PACKAGE)): oversized(path) for path in modules}
  assert {path: sizes for path, sizes in found.items() if sizes} == {}


def test_the_size_rule_sees_a_long_body(tmp_path):
  long = tmp_path / "long.py"
  long.write_text("def f():\n" + "  x = 1\n" * 61)
  assert oversized(long) == ["def f: a body of 61 lines"]
