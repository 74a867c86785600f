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

A test that needs more devices than one says how many with
``@pytest.mark.devices(n)`` (a whole module: ``pytestmark``); where JAX's
default backend has fewer, the test is reported skipped, with the counts,
before it runs.

On a machine with a GPU, ``JAX_PLATFORMS=cuda,cpu`` runs the single-device
tests on the GPU and keeps the 8 CPU devices for the tests that build their
arguments on a CPU mesh. The tests marked as needing 8 devices are skipped
there (one GPU): the multi-device checks are the CPU run's. There, float32
matrix products run at full precision, as on the CPU.
"""

import os
import shutil
import tempfile

DEVICES = 8

os.environ.setdefault("PJRT_NPROC", str(2 * DEVICES))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Most of the suite's time is XLA compiling, and tests compile the same
# program more than once: a step of the forward tests and of the reverse
# ones, a large-batch reference in several tests. A compilation cache for
# the run compiles each once. Its directory is made here, in pytest's first
# process; the workers of pytest-xdist, started later, inherit it and share
# it, and the first process removes it at the end (pytest_unconfigure). A
# directory set by hand is kept and used. A program compiled for a
# compile-only GPU or TPU cannot be loaded back from the cache without the
# device; the audits keep those in memory instead
# (ga_optax/_src/audits/compile_only.py).
_RUN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _RUN_CACHE = tempfile.mkdtemp(prefix="ga-optax-compiled-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import compile_level  # noqa: E402
import jax  # noqa: E402  (the runtime reads PJRT_NPROC when JAX starts it)
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", DEVICES)

# Every test compiles the CPU's programs without LLVM's expensive
# optimizations and the compile-only GPU's without XLA:GPU's autotuner, and
# so do the subprocesses that ask (tests/compile_level.py).
compile_level.set_unoptimized(True)

# The equivalence checks compare two orders of the same float32 sums. On a
# GPU, float32 matrix products default to TensorFloat-32 (10 bits kept), and
# the two orders then differ by about 1e-3 (seen on an H100), far past the
# tolerances here; the CPU's default is already full precision.
if jax.default_backend() != "cpu" and not os.environ.get(
  "JAX_DEFAULT_MATMUL_PRECISION"
):
  jax.config.update("jax_default_matmul_precision", "highest")


# The suite's tiers, by test file: each test belongs to one, and
# ``python -m pytest -m TIER`` runs it alone (CONTRIBUTING.md, "Run the
# tests"). A file not listed is in the conformance tier.
TIERS = {
  "compiled": (
    # What the real compilers build for compile-only H100s and TPUs, and
    # the audits that read it.
    "test_compiled_window.py",
    "test_cpu_program.py",
    "test_gpu_options.py",
    "test_gpu_program.py",
    "test_gpu_report.py",
    "test_hlo.py",
    "test_host_overhead.py",
    "test_host_waits.py",
    "test_privacy_program.py",
    "test_tpu_program.py",
    "test_window_sizes.py",
  ),
  "docs": (
    # The pages and the README, run as a reader runs them; the examples,
    # at a tiny size.
    "test_batch_size_loop_example.py",
    "test_bf16_recipe_example.py",
    "test_docs_figures.py",
    "test_docs_snippets.py",
    "test_elastic_example.py",
    "test_examples.py",
    "test_readme.py",
  ),
}


def tier(path) -> str:
  """The tier of a test file: compiled, docs, or conformance."""
  for name, files in TIERS.items():
    if path.name in files:
      return name
  return "conformance"


def pytest_collection_modifyitems(config, items):
  for item in items:
    item.add_marker(getattr(pytest.mark, tier(item.path)))


def pytest_configure(config):
  config.addinivalue_line(
    "markers",
    "conformance: the library's claims against independent references,"
    " over the strategy list (every test file not in another tier)",
  )
  config.addinivalue_line(
    "markers",
    "compiled: the programs the real XLA:GPU and TPU compilers build for"
    " compile-only devices, and the audits that read them",
  )
  config.addinivalue_line(
    "markers", "docs: the docs pages, the README and the examples, executed"
  )
  config.addinivalue_line(
    "markers",
    "devices(n): the test needs n devices of JAX's default backend; with"
    " fewer, it is skipped",
  )
  config.addinivalue_line(
    "markers",
    "smoke: the quick subset, one test of each main claim (equivalence with"
    " the large batch per schedule, in-step micro-batching, Flax, Equinox,"
    " data parallel); `python -m pytest -m smoke` runs it alone",
  )


def pytest_unconfigure(config):
  # Only the process that made the run's cache removes it; a worker's
  # _RUN_CACHE is None, the directory having come from its environment.
  if _RUN_CACHE is not None:
    shutil.rmtree(_RUN_CACHE, ignore_errors=True)


def pytest_runtest_logreport(report):
  """Names a failure as it happens, not only in the summary at the end.

  A run stopped before its end (a time limit, Ctrl-C) then still says
  which tests had failed.
  """
  if report.failed and report.when == "call":
    print(f"\nFAILED {report.nodeid}", flush=True)


def pytest_runtest_setup(item):
  needed = max(
    (marker.args[0] for marker in item.iter_markers(name="devices")),
    default=1,
  )
  if jax.device_count() < needed:
    pytest.skip(
      f"needs {needed} devices; the {jax.default_backend()} backend has"
      f" {jax.device_count()}"
    )
