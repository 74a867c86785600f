"""Where a benchmark ran: the date, the machine, the device and the versions.

Every script's JSON record starts with :func:`environment`, so that two
records can be told apart by what measured them.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from typing import Any

import jax
import optax

import ga_optax


def environment(command: str) -> dict[str, Any]:
  """The date, machine, device and versions of this run, and its command."""
  device = jax.devices()[0]
  return {
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "machine": {
      "platform": platform.platform(),
      "processor": platform.processor() or platform.machine(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
    },
    "device": {
      "platform": device.platform,
      "kind": device.device_kind,
      "count": jax.device_count(),
    },
    "versions": {
      "jax": jax.__version__,
      "jaxlib": getattr(jax.lib, "__version__", None)
      or getattr(sys.modules.get("jaxlib"), "__version__", None),
      "optax": optax.__version__,
      "ga_optax": ga_optax.__version__,
    },
    "command": command,
  }
