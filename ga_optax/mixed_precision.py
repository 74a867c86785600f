"""Gradients in float16 across a window: a dynamic loss scale.

float16 gradients underflow unless the loss is scaled up, and overflow when
it is scaled too far. :func:`dynamic_loss_scale` wraps the optimizer that
``accumulate`` steps: it divides the window's gradient by the scale, drops a
window whose gradient is not finite and halves the scale, and doubles it
after a run of finite windows. :func:`loss_scale` reads the scale to
multiply the next loss by, :func:`dropped_windows` how many windows it
dropped, :func:`wrapped_state` the wrapped optimizer's own state (its step
count moves only on the windows kept), and :class:`DynamicLossScaleState`
is its state.

bfloat16 and float8 need no loss scale: see the "Mixed precision" page.
"""

from ga_optax._src.mixed_precision.loss_scaling import (
  DynamicLossScaleState,
  dropped_windows,
  dynamic_loss_scale,
  loss_scale,
  wrapped_state,
)

__all__ = [
  "DynamicLossScaleState",
  "dropped_windows",
  "dynamic_loss_scale",
  "loss_scale",
  "wrapped_state",
]
