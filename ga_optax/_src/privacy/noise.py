"""The private close: one Gaussian draw per window, then the optimizer.

:func:`private_close` is the optax transformation that a private window
steps once per close (the window evaluates its optimizer only on its
closing side). It receives the window's reduced sum of clipped gradients,
adds ``N(0, (noise_multiplier * l2_clip_norm)^2)`` to each coordinate,
divides by the public ``normalize_by`` and runs the user's optimizer. The
draw's key is the given key folded with the count of windows closed so
far, kept in the state: a run resumed from a checkpoint draws the noise it
would have drawn, and the count is the number of releases an accountant
composes (:func:`windows_closed`).

On several devices the window reduces its sum once before its optimizer
runs, so the key, the count and thus the draw are the same on every
device: the noise is drawn once for the window, not once per device.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ga_optax._src import validation


class PrivateState(NamedTuple):
  """State of the private close, inside the window's ``inner_state``.

  Attributes:
    key_data: uint32, the data of the key every window's draw folds from.
    windows_closed: int32, the windows closed so far, each one noisy
      release (read it with :func:`ga_optax.privacy.windows_closed`).
    inner_state: the state of the optimizer the noisy mean is handed to.
  """

  key_data: jax.Array
  windows_closed: jax.Array
  inner_state: optax.OptState


def key_parts(key: Any) -> tuple[jax.Array, Any]:
  """``key``'s data and implementation, or TypeError where it is no key.

  Both a typed key (``jax.random.key``) and a raw uint32 key
  (``jax.random.PRNGKey``) are taken.
  """
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if jnp.shape(key) != ():
      raise ValueError(f"key must be one key, got shape {jnp.shape(key)}.")
    return jax.random.key_data(key), jax.random.key_impl(key)
  if (
    dtype is not None
    and jnp.dtype(dtype) == jnp.uint32
    and jnp.shape(key) == (2,)
  ):
    return jnp.asarray(key), None
  raise TypeError(
    "key must be a JAX random key (jax.random.key(seed) or"
    f" jax.random.PRNGKey(seed)), got {type(key).__name__}"
    f"{'' if dtype is None else f' of dtype {dtype}'}."
  )


def private_close(
  optimizer: optax.GradientTransformation,
  *,
  l2_clip_norm: float,
  noise_multiplier: float,
  normalize_by: float,
  key: Any,
) -> optax.GradientTransformationExtraArgs:
  """Noise once on a window's clipped sum, divided by ``normalize_by``.

  Args:
    optimizer: the transformation stepped on the noisy mean.
    l2_clip_norm: C, the bound of each example's gradient norm.
    noise_multiplier: sigma: the noise's standard deviation is sigma * C.
    normalize_by: the public divisor (the expected logical batch size).
    key: the key every window's draw is folded from.

  Returns:
    A transformation whose state is a :class:`PrivateState`.
  """
  key_data, impl = key_parts(key)
  inner = optax.with_extra_args_support(optimizer)
  std = float(noise_multiplier) * float(l2_clip_norm)
  scale = 1.0 / float(normalize_by)

  def init_fn(params: optax.Params) -> PrivateState:
    return PrivateState(
      key_data=jnp.asarray(key_data),
      windows_closed=jnp.zeros((), jnp.int32),
      inner_state=inner.init(params),
    )

  def update_fn(
    sums: optax.Updates,
    state: PrivateState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, PrivateState]:
    window_key = jax.random.fold_in(
      jax.random.wrap_key_data(state.key_data, impl=impl),
      state.windows_closed,
    )
    leaves, treedef = jax.tree.flatten(sums)
    keys = jax.random.split(window_key, max(len(leaves), 1))
    noisy = [
      (
        (
          leaf.astype(jnp.float32)
          + std * jax.random.normal(leaf_key, leaf.shape, jnp.float32)
        )
        * scale
      ).astype(leaf.dtype)
      for leaf, leaf_key in zip(leaves, keys, strict=False)
    ]
    updates, inner_state = inner.update(
      jax.tree.unflatten(treedef, noisy),
      state.inner_state,
      params,
      **extra_args,
    )
    return updates, PrivateState(
      key_data=state.key_data,
      windows_closed=state.windows_closed + 1,
      inner_state=inner_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def windows_closed(state: Any) -> jax.Array:
  """The number of windows a private accumulation has closed.

  Each closed window is one noisy release of the Poisson-subsampled
  Gaussian mechanism: this is the count :func:`ga_optax.privacy.epsilon`
  takes, whatever the windows' lengths (micro-steps never count).

  Args:
    state: the state of :func:`ga_optax.privacy.accumulate`, or any
      optimizer state that holds exactly one (an ``optax.chain``'s, a Flax
      ``TrainState``, an NNX ``Optimizer``'s ``opt_state``).

  Returns:
    An int32 scalar array.

  Raises:
    ValueError: ``state`` holds no private window, or several.

  Example:
    >>> import jax, jax.numpy as jnp, optax, ga_optax
    >>> tx = ga_optax.privacy.accumulate(
    ...     optax.sgd(0.1), 2, l2_clip_norm=1.0, noise_multiplier=1.0,
    ...     normalize_by=8.0, key=jax.random.key(0))
    >>> params = jnp.zeros(3)
    >>> state = tx.init(params)
    >>> for _ in range(5):
    ...   _, state = tx.update(jnp.ones(3), state, params)
    >>> int(ga_optax.privacy.windows_closed(state))
    2
  """
  found = validation.find_one(
    state, PrivateState, "ga_optax.privacy.accumulate"
  )
  return jnp.asarray(found.windows_closed)
