"""ga_optax: gradient accumulation for JAX, equivalent to the large-batch step.

The top level holds what most training loops need. Two namespaces group
what some need: :mod:`ga_optax.batch_size` (choosing k from the measured
noise scale) and :mod:`ga_optax.mixed_precision` (a dynamic loss scale for
float16); :mod:`ga_optax.testing` holds the equivalence and compiled-program
checks.
"""

from ga_optax import batch_size, mixed_precision
from ga_optax._src.algebra.noise_scale import (
  NoiseScale,
  NoiseScaleAverages,
  NoiseScaleEstimate,
  smooth_noise_scale,
)
from ga_optax._src.planning.elastic import (
  ElasticPlan,
  best_global_batch_size,
  elastic_plan,
  valid_device_counts,
)
from ga_optax._src.planning.partial_sums import (
  consolidate,
  split_total,
  stack_partial_sums,
  unstack_partial_sums,
)
from ga_optax._src.planning.planner import (
  MicrobatchPlan,
  micro_step_bytes,
  plan_microbatch,
)
from ga_optax._src.recipes.batchnorm import combine_batch_stats
from ga_optax._src.recipes.flax_utils import apply_gradients
from ga_optax._src.recipes.gpu_recipe import gpu_compiler_options
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

__version__ = "0.2.0"

__all__ = [
  "AccumulateState",
  "ElasticPlan",
  "FusedAccumulation",
  "MicrobatchPlan",
  "NoiseScale",
  "NoiseScaleAverages",
  "NoiseScaleEstimate",
  "accumulate",
  "accumulate_and_apply",
  "applied_updates",
  "apply_gradients",
  "batch_size",
  "best_global_batch_size",
  "combine_batch_stats",
  "consolidate",
  "current_k",
  "elastic_plan",
  "emitted",
  "gpu_compiler_options",
  "micro_step_bytes",
  "microbatched_value_and_grad",
  "mixed_precision",
  "noise_scale",
  "num_skipped",
  "plan_microbatch",
  "smooth_noise_scale",
  "split_total",
  "stack_partial_sums",
  "unreduced_value_and_grad",
  "unstack_partial_sums",
  "valid_device_counts",
]
