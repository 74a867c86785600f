"""Every test process sees 8 simulated CPU devices.

Multi-device checks then run in the test process, beside the single-device
ones, which use the first device as JAX's default. The count must be set
before JAX starts its backend, so it is set here, when pytest imports this
file, before any test module is collected.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
