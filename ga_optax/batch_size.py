"""How many micro-steps a window holds, chosen from what training measures.

A window's k need not be fixed. This namespace groups what chooses it:

* :func:`adaptive_k`: k grows, within bounds, as the gradient noise scale
  measured from the window's own micro-gradients grows (the batch size in a
  closed loop); pass it as ``accumulate(..., every_k=...)``.
* :func:`suggested_k` and :func:`goodput_k`: the k a measured noise scale
  suggests, read on the host, for a run planned by hand.
* :func:`warmup_schedule`: a k that grows on a fixed schedule of steps.

The noise scale itself, and :func:`ga_optax.current_k` (the k of the open
window, whatever chose it), stay at the top level.
"""

from ga_optax._src.batch_size.adaptive import AdaptiveK, adaptive_k
from ga_optax._src.batch_size.advice import (
  goodput_k,
  suggested_k,
  warmup_schedule,
)

__all__ = [
  "AdaptiveK",
  "adaptive_k",
  "goodput_k",
  "suggested_k",
  "warmup_schedule",
]
