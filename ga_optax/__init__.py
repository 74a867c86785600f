"""ga_optax: gradient accumulation for JAX, equivalent to the large-batch step.

The top level holds what most training loops need. Three namespaces group
what some need: :mod:`ga_optax.batch_size` (choosing k from the measured
noise scale), :mod:`ga_optax.mixed_precision` (a dynamic loss scale for
float16) and :mod:`ga_optax.planning` (the micro-batch that fits, elastic
plans, partial sums to save); :mod:`ga_optax.testing` holds the equivalence
checks and the audit of a compiled step.
"""

from ga_optax import batch_size, mixed_precision, planning, privacy
from ga_optax._src import deprecation
from ga_optax._src.algebra.noise_scale import (
  NoiseScale,
  NoiseScaleAverages,
  NoiseScaleEstimate,
  smooth_noise_scale,
)
from ga_optax._src.recipes.batchnorm import combine_batch_stats
from ga_optax._src.recipes.flax_utils import apply_gradients
from ga_optax._src.scan.microbatch import (
  microbatched_value_and_grad,
  unreduced_value_and_grad,
)
from ga_optax._src.window.state import (
  AccumulateState,
  applied_updates,
  current_k,
  emitted,
  noise_scale,
  num_skipped,
)
from ga_optax._src.window.transform import (
  FusedAccumulation,
  accumulate,
  accumulate_and_apply,
)

__version__ = "0.6.6"

__all__ = [
  "AccumulateState",
  "FusedAccumulation",
  "NoiseScale",
  "NoiseScaleAverages",
  "NoiseScaleEstimate",
  "accumulate",
  "accumulate_and_apply",
  "applied_updates",
  "apply_gradients",
  "batch_size",
  "combine_batch_stats",
  "current_k",
  "emitted",
  "microbatched_value_and_grad",
  "mixed_precision",
  "noise_scale",
  "num_skipped",
  "planning",
  "privacy",
  "smooth_noise_scale",
  "unreduced_value_and_grad",
]

# The names of ga_optax.planning were top-level names up to 0.2.0, and
# gpu_compiler_options() was a top-level recipe: the old spellings raise an
# AttributeError naming what replaces them.
__getattr__ = deprecation.removed_names(
  __name__,
  {
    **{name: f"ga_optax.planning.{name}" for name in planning.__all__},
    "gpu_compiler_options": (
      "the host's schedule, update(..., closing=...) from the training"
      " loop, which needs no compiler options (its captured loops closed"
      " windows on the wrong calls on an H200; docs/how-to/gpu.md)"
    ),
  },
)
