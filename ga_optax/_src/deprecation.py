"""Public names that went, and the error that names their replacement.

A module whose names moved or went sets its ``__getattr__`` (PEP 562),
which Python calls only for a name the module does not hold, to
:func:`removed_names`: the old spelling raises an ``AttributeError`` that
says what to use instead. The module neither holds the old names nor lists
them in ``__all__``, so that ``dir()``, ``from ... import *`` and the API
reference show only what is there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# The compiled-program audits that ga_optax.testing and ga_optax.testing.hlo
# exported, now private behind ga_optax.testing.audit.
REMOVED_AUDITS = (
  "Collective",
  "Copy",
  "GpuCompilerUnavailable",
  "HloInstruction",
  "HloModule",
  "HostWaits",
  "PathAudit",
  "TpuCompilerUnavailable",
  "WindowCollectives",
  "collectives_in_hlo",
  "compile_for_gpu",
  "compile_for_tpu",
  "count_host_waits",
  "dot_shapes",
  "gpu_devices",
  "hlo",
  "host_waits",
  "loop_collectives",
  "parse_hlo",
  "path_audit",
  "reachable",
  "tpu_devices",
  "window_collectives",
  "window_sides",
)


def removed_names(
  module: str, replacements: Mapping[str, str]
) -> Callable[[str], Any]:
  """The ``__getattr__`` of ``module``, whose ``replacements`` names went.

  Args:
    module: the name of the module that held the names, say ``"ga_optax"``.
    replacements: each removed name mapped to what replaces it, as the
      error should say it (``"ga_optax.planning.plan_windows"``, say).

  Returns:
    ``__getattr__(name)``, which raises an ``AttributeError``: naming the
    replacement for a removed name, as for any missing attribute otherwise.

  Example:
    >>> package_getattr = removed_names("package", {"old": "package.new"})
    >>> package_getattr("old")
    Traceback (most recent call last):
    ...
    AttributeError: package.old was removed: use package.new.
  """

  def __getattr__(name: str) -> Any:
    if name in replacements:
      raise AttributeError(
        f"{module}.{name} was removed: use {replacements[name]}.",
        name=name,
      )
    raise AttributeError(f"module {module!r} has no attribute {name!r}")

  return __getattr__
