"""Planning a run: the micro-batch that fits, and the plan for a device count.

A window's micro-batch size, its k and the device count multiply to the
global batch. This namespace groups what chooses them before a run, and
what carries a run's open window from one device count to another:

* :func:`plan_microbatch` and :func:`micro_step_bytes`: the largest
  micro-batch whose compiled micro-step fits a memory budget (a
  :class:`MicrobatchPlan`), read from the compiler, nothing run.
* :func:`elastic_plan`, :func:`valid_device_counts` and
  :func:`best_global_batch_size`: the micro-batch and k that keep a global
  batch on a device count (an :class:`ElasticPlan`), the counts a global
  batch allows, and a global batch that allows many.
* :func:`stack_partial_sums` / :func:`unstack_partial_sums` and
  :func:`consolidate` / :func:`split_total`: an open window's per-device
  partial sums in forms a checkpoint can hold, to resume on the same
  devices or on any device count.
"""

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

__all__ = [
  "ElasticPlan",
  "MicrobatchPlan",
  "best_global_batch_size",
  "consolidate",
  "elastic_plan",
  "micro_step_bytes",
  "plan_microbatch",
  "split_total",
  "stack_partial_sums",
  "unstack_partial_sums",
  "valid_device_counts",
]
