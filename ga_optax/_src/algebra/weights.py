"""What a micro-batch's weight means, for every driver of the window algebra.

One rule for ``accumulate``'s ``weight=`` and for what
``microbatched_value_and_grad``'s ``weight_fn`` returns:

* a weight is a real scalar (a boolean is refused);
* a concrete one (a Python number, a NumPy scalar, a JAX array with a
  value) must be finite and >= 0, else ``ValueError``;
* a traced one cannot be seen and is used as given: a negative weight
  subtracts its micro-batch, ``w_i g_i`` and ``w_i`` entering the sums.
  Refusing it would take a host round trip per micro-step, and subtracting
  is what the sums mean; both drivers do it;
* weight 0 adds nothing, even where the gradient is NaN (the ``0 / 0`` mean
  loss of an all-padding micro-batch): :func:`weighted` selects, it does
  not multiply. Its derivative is still the product's: with respect to a
  traced weight, the term (at weight 0 too, where the select alone would
  give 0); with respect to the term, the weight. Where the weight is 0 and
  the term is not finite the micro-batch is dropped, and both derivatives
  are 0 there, as its contribution is (a per-device partial sum typed
  ``unreduced`` cannot be read elementwise: its weight's derivative is the
  term as it is);
* a window (a batch, in the in-step path) whose weights sum to 0 or less
  has no mean: it gives zeros (:func:`reciprocal`), and ``accumulate`` does
  not step its optimizer on it (:func:`has_weight`);
* only micro-batches of positive weight are micro-gradients
  (:func:`counts`): of the gradient noise scale, and of a float8
  output-gradient amax.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check(weight: Any, name: str = "weight") -> jax.Array | float:
  """A micro-batch weight, checked by the rule above.

  Args:
    weight: the weight.
    name: how the messages name it.

  Returns:
    ``weight`` itself.

  Raises:
    TypeError: a boolean, or not a real scalar.
    ValueError: not a scalar, or a concrete value that is negative or not
      finite.
  """
  if isinstance(weight, bool) or (
    hasattr(weight, "dtype") and jnp.dtype(weight.dtype) == jnp.bool_
  ):
    raise TypeError(
      f"{name} must be a real number (for example the micro-batch's token"
      f" count), got a boolean {weight!r}."
    )
  if isinstance(weight, numbers.Real):
    value = float(weight)
  else:
    if not hasattr(weight, "shape") or not hasattr(weight, "dtype"):
      raise TypeError(
        f"{name} must be a real scalar (a Python number or a 0-d array),"
        f" got {type(weight).__name__}."
      )
    if jnp.shape(weight) != ():
      raise ValueError(
        f"{name} must be a scalar (one weight per micro-batch), got shape"
        f" {jnp.shape(weight)}. Sum per-example weights first."
      )
    if not (
      jnp.issubdtype(weight.dtype, jnp.integer)
      or jnp.issubdtype(weight.dtype, jnp.floating)
    ):
      raise TypeError(
        f"{name} must have a real numeric dtype, got {weight.dtype}."
      )
    if isinstance(weight, jax.core.Tracer):
      return weight
    value = float(np.asarray(weight))
  if not np.isfinite(value) or value < 0:
    raise ValueError(
      f"{name} must be finite and >= 0 (a count or a share), got {value}."
      " Only a traced weight may be negative (it then subtracts its"
      " micro-batch)."
    )
  return weight


def check_returned(weight: Any) -> Any:
  """What a ``weight_fn`` returned, checked as one micro-batch's weight.

  Raises:
    ValueError: not a scalar, or concrete and negative or not finite.
    TypeError: not of a real dtype (a boolean mask, say).
  """
  if jnp.shape(weight) != ():
    raise ValueError(
      "weight_fn must return a scalar per micro-batch (for example its"
      f" number of real tokens), got shape {jnp.shape(weight)}."
    )
  dtype = jnp.result_type(weight)
  if dtype == jnp.bool_ or not (
    jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
  ):
    raise TypeError(
      "weight_fn must return a real number (an integer or floating"
      f" scalar such as a token count), got dtype {dtype}. A boolean"
      " mask must be summed first."
    )
  if not isinstance(weight, jax.core.Tracer):
    check(weight, "weight_fn's weight")
  return weight


def weighted(term: jax.Array, weight: Any, dtype: Any) -> jax.Array:
  """``weight * term`` in ``dtype``: a plain cast for weight 1, zeros for 0.

  Weight 0 selects zeros rather than multiplying: the gradient of a
  micro-batch of padding only is ``0 / 0``, and ``0 * NaN`` is NaN.
  """
  term = jnp.asarray(term).astype(dtype)
  if isinstance(weight, (int, float)) and weight == 1:
    return term
  return _selected_product(term, jnp.asarray(weight).astype(dtype))


@jax.custom_jvp
def _selected_product(term: jax.Array, weight: jax.Array) -> jax.Array:
  return jnp.where(weight == 0, jnp.zeros_like(term), weight * term)


@_selected_product.defjvp
def _selected_product_jvp(
  primals: tuple[jax.Array, jax.Array], tangents: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
  # The select's own derivative is 0 at weight 0, where the product's, with
  # respect to the weight, is the term: a meta-gradient through a window
  # would miss every micro-batch whose weight happens to be 0.
  term, weight = primals
  term_dot, weight_dot = tangents
  zeros = jnp.zeros_like(term)
  through_weight = weight_dot * jnp.where(weight == 0, _finite(term), term)
  through_term = jnp.where(weight == 0, zeros, weight * term_dot)
  return _selected_product(term, weight), through_weight + through_term


def _finite(term: jax.Array) -> jax.Array:
  """``term`` with its non-finite elements at 0.

  A per-device partial sum (typed ``unreduced`` over mesh axes) cannot be
  read elementwise, and is returned as it is.
  """
  spec = getattr(getattr(jax.typeof(term), "sharding", None), "spec", None)
  if getattr(spec, "unreduced", None):
    return term
  return jnp.where(jnp.isfinite(term), term, jnp.zeros_like(term))


def counts(weight: Any) -> jax.Array:
  """Whether a micro-batch of this weight makes a micro-gradient."""
  return jnp.asarray(weight) > 0


def has_weight(total: jax.Array) -> jax.Array:
  """Whether a window (or batch) of this total weight has a mean."""
  return total > 0


def divisor(total: jax.Array) -> jax.Array:
  """``total`` where it has a mean, else 1: a division that cannot be 0 / 0."""
  return jnp.where(has_weight(total), total, jnp.ones_like(total))


def reciprocal(total: jax.Array) -> jax.Array:
  """``1 / total`` where the total has a mean, else 0 (zeros, not 0 / 0)."""
  return jnp.where(has_weight(total), 1.0 / divisor(total), 0.0)
