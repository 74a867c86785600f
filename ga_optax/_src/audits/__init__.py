"""The private audits of compiled programs, gathered for the tests and tools.

What users call is :func:`ga_optax.testing.audit`; the pieces it is built
from read HLO text and XLA:GPU's thunk dumps, which change with every jax
release, and so are not public. The tests, benchmarks and the mutation
check import them from here.
"""

from ga_optax._src.audits.compiled_paths import (
  Copy,
  PathAudit,
  path_audit,
  window_sides,
)
from ga_optax._src.audits.gpu_compile import (
  GpuCompilerUnavailable,
  compile_for_gpu,
  gpu_devices,
)
from ga_optax._src.audits.hlo import (
  Collective,
  HloInstruction,
  HloModule,
  collectives_in_hlo,
  parse_hlo,
  reachable,
)
from ga_optax._src.audits.hlo_audits import (
  WindowCollectives,
  dot_shapes,
  loop_collectives,
  window_collectives,
)
from ga_optax._src.audits.host_waits import (
  HostWaits,
  count_host_waits,
  host_waits,
)
from ga_optax._src.audits.tpu_compile import (
  TpuCompilerUnavailable,
  compile_for_tpu,
  tpu_devices,
)

__all__ = [
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
  "host_waits",
  "loop_collectives",
  "parse_hlo",
  "path_audit",
  "reachable",
  "tpu_devices",
  "window_collectives",
  "window_sides",
]
