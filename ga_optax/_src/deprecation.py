"""Public names that moved to a namespace, still found where they were.

A module whose names moved sets its ``__getattr__`` (PEP 562), which Python
calls only for a name the module does not hold, to :func:`moved_names` of
the namespaces that took them. The old spelling returns the same object as
the new one and warns, with a ``DeprecationWarning`` that names the new
spelling. The module neither imports the moved names nor lists them in
``__all__``, so that ``dir()``, ``from ... import *`` and the API reference
show them only where they live now.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any


def moved_names(
  module: str, *namespaces: types.ModuleType
) -> Callable[[str], Any]:
  """The ``__getattr__`` of ``module``, whose names moved to ``namespaces``.

  Args:
    module: the name of the module that held the names, say ``"ga_optax"``.
    *namespaces: the namespaces that took them: each one's ``__all__``
      lists the names it took.

  Returns:
    ``__getattr__(name)``: the object the namespace that lists ``name``
    holds under it, with a ``DeprecationWarning``; an ``AttributeError``,
    as for any missing attribute, when no namespace lists it.

  Example:
    >>> import types, warnings
    >>> tools = types.ModuleType("package.tools")
    >>> tools.__all__, tools.measure = ["measure"], len
    >>> package_getattr = moved_names("package", tools)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   package_getattr("measure") is len
    True
    >>> print(caught[0].message)  # doctest: +ELLIPSIS
    package.measure is deprecated: use package.tools.measure, which is ...
  """

  def __getattr__(name: str) -> Any:
    for namespace in namespaces:
      if name in namespace.__all__:
        warnings.warn(
          f"{module}.{name} is deprecated: use {namespace.__name__}.{name},"
          f" which is the same object; {module}.{name} will be removed in a"
          " future release.",
          DeprecationWarning,
          # The caller: the line that spelled the old name.
          stacklevel=2,
        )
        return getattr(namespace, name)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")

  return __getattr__
