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
"""

import os

DEVICES = 8

os.environ.setdefault("PJRT_NPROC", str(2 * DEVICES))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (the runtime reads PJRT_NPROC when JAX starts it)

jax.config.update("jax_num_cpu_devices", DEVICES)
