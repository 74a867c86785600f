"""The device memory a compiled program needs, from its memory analysis.

``compiled.memory_analysis()`` is exact and deterministic, but the CPU
backend counts every buffer as device memory, host-memory ones included;
:func:`device_bytes` reads which arguments and outputs the program's layout
puts in host memory and leaves them out, so that one figure means the same
on every backend. The memory planner and the host-memory benchmark use it.
"""

from __future__ import annotations

import re
from typing import Any

import jax

from ga_optax._src.audits.hlo import shape_bytes

# One array in an entry computation's layout, e.g. ``f32[4,2]{1,0:S(5)}``.
_LAYOUT_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](?:\{([^}]*)\})?")
# ``{output index}: (parameter, {}, may-alias)``; ``{}`` for a lone output.
_ALIAS = re.compile(r"\{(\d*)\}: \((\d+), \{\}, (?:may|must)-alias\)")
# XLA's number for host memory in a layout, ``S(5)``.
_HOST_MEMORY_SPACE = "S(5)"


def device_bytes(compiled: Any) -> int:
  """Device-memory bytes a compiled program needs: what stays on the device.

  Arguments, plus outputs that do not reuse an argument's buffer, plus
  temporaries, counting only buffers in device memory. Backends that report
  host memory apart (``host_*`` fields of ``compiled.memory_analysis()``,
  as GPUs do) are read as they are; the CPU backend counts every buffer as
  device memory, so the arguments and outputs its program layout puts in
  host memory are subtracted here.

  Raises:
    RuntimeError: the backend gives no memory analysis.
  """
  analysis = compiled.memory_analysis()
  if analysis is None:
    raise RuntimeError(
      f"The {jax.default_backend()} backend gives no compiled memory"
      " analysis, so the bytes a program needs cannot be read."
    )
  total = int(
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    - analysis.alias_size_in_bytes
    + analysis.temp_size_in_bytes
  )
  reported_apart = (
    analysis.host_argument_size_in_bytes
    + analysis.host_output_size_in_bytes
    + analysis.host_temp_size_in_bytes
  )
  if reported_apart:
    return total
  return total - _host_buffer_bytes(compiled.as_text())


def _host_buffer_bytes(hlo_text: str) -> int:
  """Host-memory bytes of a program's parameters and unaliased outputs.

  Read from the entry computation's layout, where an array in host memory
  carries ``S(5)``, and from its input-output aliases.
  """
  header = hlo_text.split("\n", 1)[0]
  layout = _braced(header, "entry_computation_layout=")
  if "->" not in layout:
    return 0
  inputs, results = layout.split("->", 1)
  parameters = _LAYOUT_ARRAY.findall(inputs)
  outputs = _LAYOUT_ARRAY.findall(results)
  aliased_outputs = {
    int(output or 0)
    for output, _ in _ALIAS.findall(_braced(header, "input_output_alias="))
  }
  host = sum(_bytes(array) for array in parameters if _on_host(array))
  host += sum(
    _bytes(array)
    for index, array in enumerate(outputs)
    if _on_host(array) and index not in aliased_outputs
  )
  return host


def _braced(text: str, key: str) -> str:
  """What follows ``key`` in ``text`` between its braces (nested ones kept)."""
  start = text.find(key + "{")
  if start < 0:
    return ""
  start += len(key) + 1
  depth = 1
  for end in range(start, len(text)):
    depth += {"{": 1, "}": -1}.get(text[end], 0)
    if depth == 0:
      return text[start:end]
  return ""


def _on_host(array: tuple[str, str, str]) -> bool:
  return _HOST_MEMORY_SPACE in array[2]


def _bytes(array: tuple[str, str, str]) -> int:
  dtype, dims, _ = array
  return shape_bytes(f"{dtype}[{dims}]")
