"""Differentially private training: per-example clipping, one draw per window.

* :func:`clipped_grad_sum`: a per-example loss into a micro-batch's mean
  loss and sum of clipped gradients (each example's norm at most C).
* :func:`accumulate`: the window of :func:`ga_optax.accumulate` over those
  sums, with one Gaussian draw added at each close, divided by a public
  ``normalize_by``; :func:`windows_closed` counts its releases.
* :func:`poisson_windows`: Poisson draws over a dataset as fixed-size
  padded micro-batches and the ``closing=`` flags that end each draw.
* :func:`epsilon` and :func:`calibrated_noise_multiplier`: the budget of
  a run, counted in windows, through ``dp-accounting``
  (``pip install 'ga_optax[privacy]'``).

See docs/how-to/privacy.md.
"""

from ga_optax._src.privacy.accounting import (
  calibrated_noise_multiplier,
  epsilon,
)
from ga_optax._src.privacy.clipping import clipped_grad_sum
from ga_optax._src.privacy.noise import PrivateState, windows_closed
from ga_optax._src.privacy.sampling import MicroBatch, poisson_windows
from ga_optax._src.privacy.window import accumulate

__all__ = [
  "MicroBatch",
  "PrivateState",
  "accumulate",
  "calibrated_noise_multiplier",
  "clipped_grad_sum",
  "epsilon",
  "poisson_windows",
  "windows_closed",
]
