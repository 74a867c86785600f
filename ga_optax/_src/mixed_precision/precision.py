"""Whether an accumulator dtype can hold the sum of a window's gradients.

Also whether an optimizer's state has the exponent range its moments need
(see :func:`warn_if_state_range_too_narrow`).

A window's accumulator holds ``sum(weight_i * grad_i)`` over up to k
micro-steps. As the sum grows, each new term is rounded to the sum's spacing:
with p significant bits, a sum of k gradients of similar size and sign leaves
each new one about ``p - log2(k)`` bits, and at ``k = 2**p`` adding one more
changes nothing. In float32 (p = 24) that is far beyond any window; in
bfloat16 (p = 8) it is 256 micro-steps, and in float16 (p = 11) 2048.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ga_optax._src import validation
from ga_optax._src.batch_size.adaptive import AdaptiveK
from ga_optax._src.batch_size.every_k import EveryK


def significand_bits(dtype: Any) -> int:
  """Significant bits of a floating dtype, the implicit leading bit included."""
  return int(jnp.finfo(dtype).nmant) + 1


def smallest_imprecise_k(accumulator_dtype: Any) -> int:
  """The window length from which ``accumulator_dtype`` warns: 2**(p - 2).

  From there on the sum of k gradients of similar size is at least
  ``2**(p - 2)`` times the average one, so a gradient under a quarter of
  the average adds nothing, and equal gradients are only a factor 4 from
  the point, ``k = 2**p``, where they stop adding at all.
  """
  return 2 ** (significand_bits(accumulator_dtype) - 2)


def _largest_k(every_k: EveryK) -> int | None:
  if isinstance(every_k, AdaptiveK):
    return every_k.max_k
  if isinstance(every_k, Mapping):
    return max(int(k) for k in every_k.values())
  if validation.is_int(every_k):
    return int(every_k)  # type: ignore[arg-type]
  return None


def warn_if_accumulator_too_narrow(
  accumulator_dtype: Any,
  every_k: EveryK,
  *,
  stacklevel: int = 2,
  window_argument: str = "k",
) -> None:
  """Warns when ``accumulator_dtype`` cannot sum windows of ``every_k``.

  Emits a ``UserWarning`` when the largest k that ``every_k`` allows (the
  int, the largest value of a dict, or an adaptive k's ``max_k``) is at least
  ``2**(p - 2)`` for an accumulator with p significant bits: 64 for bfloat16
  (p = 8), 512 for float16 (p = 11), 2**22 for float32. A callable
  ``every_k`` is not looked at: its values are only known inside the traced
  step, so no warning is possible for it.

  Measured through ``ga_optax.accumulate`` (SGD with learning rate 1, so
  the update is minus the emitted mean; float32 gradients in):

  - k unit gradients: the mean is exact up to k = 2**p (256 in bfloat16,
    2048 in float16), then the sum stops growing and the mean comes out as
    ``2**p / k``: 0.996 at k = 257, 0.852 at 300, 0.5 at 512 in bfloat16;
    0.5 at 4096 in float16.
  - k gradients of one sign: the relative error of the mean grows with k
    and jumps once the sum stops growing (docs/not-equivalent.md tabulates
    it for gradients drawn from uniform(0.5, 1.5)).
  - zero-mean gradients: the sum does not grow with k, and the error stays
    at the rounding of one value.

  Args:
    accumulator_dtype: the floating dtype of the accumulator, as given to
      :func:`ga_optax.accumulate` (already validated).
    every_k: the window length, as given to :func:`ga_optax.accumulate`
      (already validated): an int, a ``{update_step: k}`` dict or a callable.
    stacklevel: as for ``warnings.warn``, counted from the caller of this
      function: 1 points the warning at the line that calls it, 2 (the
      default) at the line that called that function.
    window_argument: how the message names the window's length: ``"k"``
      (the default, for ``every_k``), or the caller's own argument, such as
      ``"num_microbatches"`` for :func:`ga_optax.microbatched_value_and_grad`,
      whose scan sums its micro-batches' gradients in ``accumulator_dtype``
      too.

  Example:
    >>> import warnings
    >>> import jax.numpy as jnp
    >>> from ga_optax._src.mixed_precision.precision import (
    ...     warn_if_accumulator_too_narrow)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   warn_if_accumulator_too_narrow(jnp.bfloat16, 300)
    >>> print(caught[0].message)  # doctest: +ELLIPSIS
    accumulator_dtype bfloat16 keeps 8 significant bits, too few for windows
    of k = 300 micro-steps: ...
  """
  largest_k = _largest_k(every_k)
  limit = smallest_imprecise_k(accumulator_dtype)
  if largest_k is None or largest_k < limit:
    return
  bits = significand_bits(accumulator_dtype)
  stall = 2**bits
  consequence = (
    f"a sum of equal gradients stops growing after {stall} of them, so their"
    f" mean comes out {stall / largest_k:.3g} times the true one"
    if largest_k > stall
    else f"from k = {limit} on a gradient under a quarter of the window's"
    f" average adds nothing, and at k = {stall} even equal ones stop adding"
  )
  warnings.warn(
    f"accumulator_dtype {jnp.dtype(accumulator_dtype).name} keeps {bits}"
    f" significant bits, too few for windows of {window_argument} ="
    f" {largest_k} micro-steps: {consequence}. Keep {window_argument} below"
    f" {limit}{_wider_advice(accumulator_dtype)}.",
    UserWarning,
    stacklevel=stacklevel + 1,
  )


def _wider_advice(accumulator_dtype: Any) -> str:
  """How to widen the accumulator, or nothing where no wider float exists."""
  bits = significand_bits(accumulator_dtype)
  if bits < significand_bits(jnp.float32):
    return (
      ", or accumulate in jnp.float32 (the default, which keeps"
      f" {significand_bits(jnp.float32)} bits)"
    )
  if bits < significand_bits(jnp.float64):
    return (
      ", or accumulate in jnp.float64 (53 bits; it needs"
      ' jax.config.update("jax_enable_x64", True))'
    )
  return ""


def _narrow_range_dtypes(tree: Any) -> list[str]:
  """The floating dtypes in ``tree`` whose exponents stop short of float32's."""
  float32_min_exponent = jnp.finfo(jnp.float32).minexp
  found = set()
  for leaf in jax.tree.leaves(tree):
    dtype = getattr(leaf, "dtype", None)
    if (
      dtype is not None
      and jnp.issubdtype(dtype, jnp.floating)
      and jnp.finfo(dtype).minexp > float32_min_exponent
    ):
      found.add(jnp.dtype(dtype).name)
  return sorted(found)


def warn_if_state_range_too_narrow(
  state: Any, *, argument: str = "optimizer", stacklevel: int = 2
) -> None:
  """Warns when an optimizer's state holds floats of less range than float32.

  optax makes an optimizer's moments in the dtype of the params its
  ``init`` sees (Adam's ``nu`` always, ``mu`` unless ``mu_dtype`` is
  given), so float16 params give it a float16 state. Adam-like optimizers
  average squared gradients there, and float16 ends at 6e-08 (its smallest
  subnormal): a squared gradient under that flushes to zero, and so does
  Adam's default ``eps`` of 1e-8, so the update divides by zero. Measured
  with ``optax.adam(1e-3)`` on float16 params, on the first step: a
  gradient of 1e-2 gives an update of -9.2e-4 (float32: -1e-3), one of
  magnitude 5e-3 or less an infinite update, and a zero gradient NaN. The
  float8 formats end sooner still.

  bfloat16 keeps float32's exponent range and is not warned about: its 8
  significant bits round the moments coarsely, but no value flushes to
  zero. (Measured on ``examples/bf16_recipe.py``, bfloat16 moments of
  bfloat16 params cost about a tenth of what the params' own rounding
  costs; see the bfloat16 recipe in docs/how-to/mixed-precision.md.)

  Args:
    state: the optimizer's state, as its ``init`` made it: only the dtypes
      of its leaves are read, so abstract or traced leaves do as well.
    argument: the argument that gave the optimizer, for the message.
    stacklevel: as for ``warnings.warn``, counted from the caller of this
      function: 1 points the warning at the line that calls it, 2 (the
      default) at the line that called that function.

  Example:
    >>> import warnings
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from ga_optax._src.mixed_precision.precision import (
    ...     warn_if_state_range_too_narrow)
    >>> state = optax.adam(1e-3).init(jnp.zeros(3, jnp.float16))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   warn_if_state_range_too_narrow(state)
    >>> print(caught[0].message)  # doctest: +ELLIPSIS
    optimizer's state holds float16 arrays, whose range ends at 6e-08: ...
  """
  narrow = _narrow_range_dtypes(state)
  if not narrow:
    return
  smallest = min(float(jnp.finfo(name).smallest_subnormal) for name in narrow)
  warnings.warn(
    f"{argument}'s state holds {' and '.join(narrow)} arrays, whose range"
    f" ends at {smallest:.1g}: the squared gradients that Adam-like"
    " optimizers average (Adam's nu) flush to zero there, and so does"
    " Adam's default eps of 1e-8, so the update divides by zero (optax.adam"
    " on float16 params: infinite updates from the first step for gradients"
    " of magnitude 5e-3 or less). Keep the optimizer's state in float32:"
    " float32 master params, or an init from float32 copies of the params"
    " (see the bfloat16 recipe in docs/how-to/mixed-precision.md).",
    UserWarning,
    stacklevel=stacklevel + 1,
  )
