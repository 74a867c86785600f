"""BatchNorm running statistics updated once per effective batch.

In the micro-batched path every micro-batch is normalised with its own
statistics, and each one returns the running statistics its layer would
store, ``m * r + (1 - m) * s_i``, all from the same starting ``r``. This
module merges those into the single update a large batch would make,
``m * r + (1 - m) * S``, where ``S`` combines the micro-batches' means and
(biased) variances by the law of total variance.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp

_MEAN = "mean"
_VAR = "var"


def _stat_name_and_layer(path: tuple[Any, ...]) -> tuple[str | None, str]:
  """The statistic's name (``mean``/``var``) and a key for its layer.

  NNX stores each statistic in a Variable, whose value adds a trailing
  attribute key to the path; it is skipped.
  """
  keys = list(path)
  while keys and isinstance(keys[-1], jax.tree_util.GetAttrKey):
    keys.pop()
  if not keys:
    return None, ""
  last = keys[-1]
  name = getattr(last, "key", getattr(last, "name", None))
  return (name if isinstance(name, str) else None), jax.tree_util.keystr(
    tuple(keys[:-1])
  )


def combine_batch_stats(stacked_stats: Any, momentum: float) -> Any:
  """Merges per-micro-batch BatchNorm running statistics into one update.

  ``stacked_stats`` holds, for each micro-batch ``i`` (leading axis), the
  running statistics a BatchNorm layer stored after seeing only that
  micro-batch, all from the same starting statistics ``r`` (as
  ``microbatched_value_and_grad(..., has_aux=True)`` returns them when
  ``fun`` returns the updated ``batch_stats``). With equal-sized
  micro-batches of means ``mu_i`` and biased variances ``v_i``, the result is
  the update one large batch would make:

  * ``mean = m * r_mean + (1 - m) * mean_i(mu_i)``
  * ``var = m * r_var + (1 - m) * (mean_i(v_i) + mean_i((mu_i - mu)^2))``

  computed from the stored values without knowing ``r``: the mean of the
  stored means, and the mean of the stored variances plus the spread of the
  stored means divided by ``1 - m``. This matches Flax's Linen and NNX
  ``BatchNorm``, whose variance is biased (no Bessel correction).

  Args:
    stacked_stats: a pytree of running statistics with a leading micro-batch
      axis, such as Linen's ``batch_stats`` collection or
      ``nnx.state(model, nnx.BatchStat)``; every leaf must be named ``mean``
      or ``var``, and each ``var`` needs a ``mean`` beside it.
    momentum: the layers' BatchNorm momentum ``m`` in ``[0, 1)``, shared by
      all of them (Flax's default is 0.99).

  Returns:
    The merged running statistics, with the tree of one micro-batch's.

  Raises:
    TypeError: ``momentum`` is not a real number.
    ValueError: ``momentum`` is outside ``[0, 1)``, a leaf is named neither
      ``mean`` nor ``var``, a ``var`` has no ``mean`` of the same shape beside
      it, or a leaf has no leading micro-batch axis.

  Example:
    >>> import jax.numpy as jnp, ga_optax
    >>> # Two micro-batches, means 1 and 5, variances 1 and 1, from r = 0, 1.
    >>> stacked = {"bn": {"mean": jnp.array([[0.1], [0.5]]),
    ...                   "var": jnp.array([[1.0], [1.0]])}}
    >>> layer = ga_optax.combine_batch_stats(stacked, momentum=0.9)["bn"]
    >>> layer["mean"], layer["var"]
    (Array([0.3], dtype=float32), Array([1.4], dtype=float32))
  """
  if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
    raise TypeError(
      f"momentum must be a real number in [0, 1), got {momentum!r}."
    )
  if not 0.0 <= float(momentum) < 1.0:
    raise ValueError(
      f"momentum must be in [0, 1) (the BatchNorm layers' momentum), got"
      f" {momentum}."
    )
  leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(
    stacked_stats
  )
  means: dict[str, jax.Array] = {}
  for path, leaf in leaves_with_paths:
    name, layer = _stat_name_and_layer(path)
    if name not in (_MEAN, _VAR):
      raise ValueError(
        "stacked_stats leaves must be BatchNorm statistics named 'mean' or"
        f" 'var', got {jax.tree_util.keystr(path)}."
      )
    if jnp.ndim(leaf) < 1:
      raise ValueError(
        f"stacked_stats leaf {jax.tree_util.keystr(path)} has no leading"
        " micro-batch axis; pass the statistics stacked per micro-batch."
      )
    if name == _MEAN:
      means[layer] = leaf

  merged = []
  for path, leaf in leaves_with_paths:
    name, layer = _stat_name_and_layer(path)
    stat = jnp.asarray(leaf)
    if name == _MEAN:
      merged.append(jnp.mean(stat, axis=0))
      continue
    stored_means = means.get(layer)
    if stored_means is None or jnp.shape(stored_means) != jnp.shape(stat):
      raise ValueError(
        f"stacked_stats leaf {jax.tree_util.keystr(path)} needs a 'mean' of"
        f" shape {jnp.shape(stat)} beside it to combine variances."
      )
    stored_means = jnp.asarray(stored_means)
    # The stored means differ by (1 - m)(mu_i - mu); their spread over
    # (1 - m) is the (1 - m)-weighted between-micro-batch variance.
    spread = jnp.var(stored_means.astype(jnp.float32), axis=0)
    between = spread / (1.0 - momentum)
    merged.append(
      (jnp.mean(stat.astype(jnp.float32), axis=0) + between).astype(stat.dtype)
    )
  return jax.tree_util.tree_unflatten(treedef, merged)
