"""The house's rule for classes: abstract or final, no concrete method overridden.

A class that shares code with another does so through a base whose shared
methods are concrete and whose differing ones are abstract
(``placements.local.DeviceSums`` under ``Local`` and ``Collective``): a
reader of a method never has to ask which of two bodies runs. Checked on
every class under ``ga_optax._src``, against every base of the project's own.
"""

from __future__ import annotations

import importlib
import inspect
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
