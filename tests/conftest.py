"""Every test process sees 8 simulated CPU devices.

Multi-device checks then run in the test process, beside the single-device
ones, which use the first device as JAX's default. The count must be set
before JAX starts its backend, so it is set here, when pytest imports this
file, before any test module is collected.

The CPU runtime launches each device's part of a multi-device program on a
thread of one pool of ``max(cores, devices)`` threads: 8 on a machine of 8
cores or fewer, just enough for one collective. Under two test workers on 2
cores, runs stalled there (7 of 16 runs of the matrix's multi-device cases):
a stack dump showed seven of the eight threads waiting in an all-reduce and
the eighth waiting for an in-flight slot of its device, with no thread left
for whatever held it; after 40 s the runtime aborts the process.
``PJRT_NPROC``, which the runtime reads as the core count, gives the pool
twice as many threads as devices (0 stalls in 16 runs). Subprocesses the
tests start inherit it; a value set by hand is kept.

The suite runs on the CPU: ``JAX_PLATFORMS=cpu`` unless set by hand. With
JAX's CUDA plugin installed (CI installs it for XLA:GPU, which compiles the
GPU-program tests for compile-only H100s), a machine without a GPU needs it:
the plugin fails to start there and compiles nothing.

On a machine with a GPU, ``JAX_PLATFORMS=cuda,cpu`` runs the single-device
tests on the GPU and keeps the 8 CPU devices for the tests that build their
arguments on a CPU mesh. A test whose mesh asks the default backend for more
devices than it has (8 on one GPU) is reported skipped, with the counts, not
failed: the multi-device checks are the CPU run's. There, float32 matrix
products run at full precision, as on the CPU.
"""

import os
import re

DEVICES = 8

os.environ.setdefault("PJRT_NPROC", str(2 * DEVICES))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (the runtime reads PJRT_NPROC when JAX starts it)
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", DEVICES)

# The equivalence checks compare two orders of the same float32 sums. On a
# GPU, float32 matrix products default to TensorFloat-32 (10 bits kept), and
# the two orders then differ by about 1e-3 (seen on an H100), far past the
# tolerances here; the CPU's default is already full precision.
if jax.default_backend() != "cpu" and not os.environ.get(
  "JAX_DEFAULT_MATMUL_PRECISION"
):
  jax.config.update("jax_default_matmul_precision", "highest")

# What jax.make_mesh raises when a mesh is larger than the devices at hand.
TOO_FEW_DEVICES = re.compile(r"Number of devices \d+ must be >= the product")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  excinfo = call.excinfo
  if (
    excinfo is not None
    and jax.device_count() < DEVICES
    and excinfo.errisinstance(ValueError)
    and TOO_FEW_DEVICES.search(str(excinfo.value))
  ):
    report.outcome = "skipped"
    report.longrepr = (
      str(item.path),
      item.location[1] or 0,
      f"Skipped: needs {DEVICES} devices; the {jax.default_backend()} backend"
      f" has {jax.device_count()}",
    )
