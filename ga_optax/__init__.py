"""ga_optax: gradient accumulation for JAX, equivalent to the large-batch step."""

from ga_optax._src.algebra.noise_scale import (
  NoiseScale,
  NoiseScaleAverages,
  NoiseScaleEstimate,
  smooth_noise_scale,
)
from ga_optax._src.batch_size.adaptive import AdaptiveK, adaptive_k
from ga_optax._src.batch_size.advice import (
  goodput_k,
  suggested_k,
  warmup_schedule,
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
from ga_optax._src.recipes.loss_scaling import (
  DynamicLossScaleState,
  dropped_windows,
  dynamic_loss_scale,
  loss_scale,
)
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
  "AdaptiveK",
  "DynamicLossScaleState",
  "ElasticPlan",
  "FusedAccumulation",
  "MicrobatchPlan",
  "NoiseScale",
  "NoiseScaleAverages",
  "NoiseScaleEstimate",
  "accumulate",
  "accumulate_and_apply",
  "adaptive_k",
  "applied_updates",
  "apply_gradients",
  "best_global_batch_size",
  "combine_batch_stats",
  "consolidate",
  "current_k",
  "dropped_windows",
  "dynamic_loss_scale",
  "elastic_plan",
  "emitted",
  "goodput_k",
  "gpu_compiler_options",
  "loss_scale",
  "micro_step_bytes",
  "microbatched_value_and_grad",
  "noise_scale",
  "num_skipped",
  "plan_microbatch",
  "smooth_noise_scale",
  "split_total",
  "stack_partial_sums",
  "suggested_k",
  "unreduced_value_and_grad",
  "unstack_partial_sums",
  "valid_device_counts",
  "warmup_schedule",
]
