"""Checks that users can run on their own model, optimizer, data and steps.

Gradient accumulation is only worth having if it trains the same model as the
large batch would. :func:`compare_with_large_batch` trains twice from the same
parameters, once on each large batch and once on its micro-batches through
:func:`ga_optax.accumulate`, and reports how far apart the results are;
:func:`assert_equivalent_to_large_batch` turns that into an assertion for a
test suite. A leaf that only float rounding moves (an attention block's key
bias) cannot be judged by any tolerance: ``exclude=`` leaves it out, by path.

Whether it costs what it should is a question for the compiled program:
:func:`audit` compiles a step for a named compile-only target (an H100, 8
H100s, a v5e chip, 4 v5e chips, the CPU) and reports, per kind of call,
the bytes it moves, the buffers it duplicates, its collectives, how often a
GPU's host waits for it, closing work a micro-step pays for, and the
program's control flow and peak memory, beside another step's if asked.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ga_optax._src import deprecation, validation
from ga_optax._src.audits.report import AuditReport, PathReport, audit
from ga_optax._src.audits.tree_difference import (
  PathFilter,
  excluded_paths,
  leaf_difference,
  max_relative_difference,
  non_finite_counts,
  paired_leaves,
  relative_difference,
)
from ga_optax._src.window.transform import accumulate

__all__ = [
  "AuditReport",
  "EquivalenceResult",
  "PathReport",
  "assert_equivalent_to_large_batch",
  "audit",
  "compare_with_large_batch",
  "max_relative_difference",
]

LossFn = Callable[[optax.Params, Any], jax.Array]

# The compiled-program audits of 0.2.0 went behind audit(): their names,
# and ga_optax.testing.hlo's, raise an AttributeError that says so.
__getattr__ = deprecation.removed_names(
  __name__,
  dict.fromkeys(deprecation.REMOVED_AUDITS, "ga_optax.testing.audit"),
)


class EquivalenceResult(NamedTuple):
  """What :func:`compare_with_large_batch` measured.

  Attributes:
    max_relative_difference: the largest, over parameter leaves, of
      ``max|accumulated - large_batch| / max(max|large_batch|, tiny)``;
      ``inf`` when the non-finite values of a leaf differ (see
      :func:`max_relative_difference`).
    large_batch_params: parameters after one optimizer step per large batch
      (for an NNX model, its ``nnx.Param`` state: ``nnx.update(model,
      result.large_batch_params)`` loads it).
    accumulated_params: parameters after accumulating the same batches.
    excluded: the paths of the leaves ``exclude`` left out of
      ``max_relative_difference``, in tree order; empty by default.
  """

  max_relative_difference: float
  large_batch_params: optax.Params
  accumulated_params: optax.Params
  excluded: tuple[str, ...] = ()


def _leading_size(batch: Any) -> int:
  sizes = {
    jnp.shape(leaf)[0] for leaf in jax.tree.leaves(batch) if jnp.ndim(leaf)
  }
  if not sizes:
    raise ValueError(
      "batches: a batch must hold at least one leaf with a leading (batch)"
      " axis to split into micro-batches; got only scalars, which every"
      f" micro-batch shares: {batch!r:.200}. Give the items their own"
      " leading axis, shape (batch_size, ...)."
    )
  if len(sizes) != 1:
    raise ValueError(
      "every leaf of a batch must share one leading (batch) axis, got"
      f" leading sizes {sorted(sizes)}."
    )
  return sizes.pop()


def _rows(batch: Any, start: int, end: int) -> Any:
  # A scalar has no items to split: every micro-batch shares it, as a leaf
  # with in_axes=None does in microbatched_value_and_grad.
  return jax.tree.map(
    lambda leaf: leaf[start:end] if jnp.ndim(leaf) else leaf, batch
  )


def _trained_part(loss_fn: LossFn, params: Any) -> tuple[LossFn, optax.Params]:
  """The pytree both runs train, and ``loss_fn`` as a function of it.

  A Flax NNX model is split as NNX users split it: its ``nnx.Param`` state
  is trained, and the loss rebuilds the model around it; the rest (RNG
  streams, batch statistics) goes unchanged to every call. Anything else
  is trained as it is.
  """
  # Flax is optional: a model can only be an NNX one if NNX is imported.
  nnx = sys.modules.get("flax.nnx")
  if nnx is None or not isinstance(params, nnx.Module):
    return loss_fn, params
  graphdef, trained, rest = nnx.split(params, nnx.Param, ...)

  def trained_loss(trained: Any, batch: Any) -> jax.Array:
    # copy=True: the model's Variables must belong to the gradient's trace.
    return loss_fn(nnx.merge(graphdef, trained, rest, copy=True), batch)

  return trained_loss, trained


def _microbatch_bounds(
  batch_size: int, micro_batch_sizes: int | Sequence[int]
) -> list[tuple[int, int]]:
  sizes = _micro_batch_sizes(batch_size, micro_batch_sizes)
  ends = np.cumsum(sizes)
  return [
    (int(end - size), int(end)) for size, end in zip(sizes, ends, strict=True)
  ]


def _micro_batch_sizes(
  batch_size: int, micro_batch_sizes: int | Sequence[int]
) -> list[int]:
  if validation.is_int(micro_batch_sizes):
    count = int(micro_batch_sizes)  # type: ignore[arg-type]
    if count < 1 or batch_size % count:
      raise ValueError(
        "micro_batch_sizes as an int is the number of equal micro-batches"
        f" and must divide the batch size {batch_size}, got"
        f" {micro_batch_sizes!r}."
      )
    return [batch_size // count] * count
  if isinstance(micro_batch_sizes, (str, bytes)) or not isinstance(
    micro_batch_sizes, Iterable
  ):
    raise TypeError(
      "micro_batch_sizes must be the number of equal micro-batches (an int)"
      " or a sequence of their sizes (ints), got"
      f" {micro_batch_sizes!r} of type {type(micro_batch_sizes).__name__}."
    )
  sizes = list(micro_batch_sizes)
  for size in sizes:
    if not validation.is_int(size):
      raise TypeError(
        "micro_batch_sizes entries must be ints (micro-batch sizes), got"
        f" {size!r} of type {type(size).__name__} in {sizes!r}."
      )
  if any(size < 1 for size in sizes) or sum(sizes) != batch_size:
    raise ValueError(
      "micro_batch_sizes must be positive and add up to the batch size"
      f" {batch_size}, got {sizes!r}."
    )
  return [int(size) for size in sizes]


def compare_with_large_batch(
  loss_fn: LossFn,
  optimizer: optax.GradientTransformation,
  params: optax.Params,
  batches: Iterable[Any],
  micro_batch_sizes: int | Sequence[int],
  *,
  weight_fn: Callable[[Any], Any] | None = None,
  reduction: str = "mean",
  use_jit: bool = True,
  exclude: PathFilter | None = None,
) -> EquivalenceResult:
  """Trains with and without accumulation and measures the difference.

  For each large batch, the reference takes one ``optimizer`` step on
  ``jax.grad(loss_fn)(params, batch)``; the accumulated run splits the same
  batch into micro-batches and feeds them, one ``update`` call each, to
  ``ga_optax.accumulate(optimizer, len(micro-batches))``.

  The relative difference cannot judge a leaf whose gradient is structurally
  zero, so that only float rounding noise reaches it. An attention block's
  key bias is the common case, in every transformer whose attention has
  one: softmax ignores a shift shared by every key. Adam-like optimizers (Adam,
  AdamW, RMSProp, Lion...) divide that noise by its own magnitude and take
  full-size steps of random sign in both runs; with any optimizer, a leaf that
  starts at zero is compared with values that are themselves noise. No
  tolerance, relative to the leaf or to how far training moved it, tells such a
  leaf apart from a defect. Leave it out with ``exclude``; every other leaf is
  still held to the tolerance, and the result lists what was left out.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, the mean (or, with
      ``reduction="sum"``, the sum) of the batch's per-item losses; for an
      NNX model, ``loss_fn(model, batch)``.
    optimizer: the optax transformation to compare.
    params: initial parameters, shared by both runs; or a Flax NNX model
      (an ``nnx.Module``), whose ``nnx.Param`` state both runs train, the
      loss getting the model rebuilt around it with ``nnx.merge`` (its
      other state, RNG streams and batch statistics, goes unchanged to
      every call; the model passed in is not modified).
    batches: large batches, pytrees whose leaves share a leading axis; each
      is one window. A scalar leaf (a loss scale, a temperature) has no
      items to split: every micro-batch gets it whole.
    micro_batch_sizes: the number of equal micro-batches (a Python or NumPy
      int), or a sequence of their sizes (the same split for every batch).
    weight_fn: ``weight_fn(microbatch) -> scalar`` passed as ``weight=``.
      Defaults to the micro-batch's item count for ``"mean"`` and to 1 for
      ``"sum"``, which is exact for mean and sum losses respectively.
    reduction: the ``reduction`` of :func:`ga_optax.accumulate`.
    use_jit: run both training loops under ``jax.jit``.
    exclude: ``exclude(path) -> bool``, true for the parameter leaves to
      leave out of ``max_relative_difference``. ``path`` is the leaf's
      :func:`jax.tree_util.keystr`, as failure messages print it (for a
      Flax NNX state, ``"['attn']['key']['bias'].value"``); for example
      ``lambda path: "['key']['bias']" in path`` picks the key bias of
      every attention layer. An excluded leaf still fails when only one run
      holds a NaN or an infinity there. By default every leaf is compared.

  Returns:
    An :class:`EquivalenceResult`.

  Raises:
    TypeError: ``micro_batch_sizes`` is neither an int nor a sequence of ints
      (a bool is neither), or ``exclude`` is not callable.
    ValueError: ``batches`` is empty, or a batch holds only scalars, or its
      batches differ in size, or ``micro_batch_sizes`` does not split the
      batch size, or ``exclude`` matches no parameter leaf, or every one.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from ga_optax.testing import compare_with_large_batch
    >>> def loss_fn(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> batch = {"x": jnp.arange(12.0).reshape(6, 2) / 10, "y": jnp.ones(6)}
    >>> result = compare_with_large_batch(
    ...     loss_fn, optax.adam(0.1), jnp.zeros(2), [batch, batch], [1, 2, 3])
    >>> result.max_relative_difference < 1e-5
    True

    A Flax NNX model goes in as it is:

    >>> from flax import nnx
    >>> def model_loss(model, batch):
    ...   return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)
    >>> result = compare_with_large_batch(
    ...     model_loss, optax.sgd(0.1), nnx.Linear(2, 1, rngs=nnx.Rngs(0)),
    ...     [batch, batch], 3)
    >>> result.max_relative_difference < 1e-5
    True
  """
  batches = list(batches)
  if not batches:
    raise ValueError("batches must hold at least one large batch, got none.")
  loss_fn, params = _trained_part(loss_fn, params)
  batch_size = _leading_size(batches[0])
  for batch in batches:
    if _leading_size(batch) != batch_size:
      raise ValueError(
        "batches must all have the same size, got"
        f" {_leading_size(batch)} and {batch_size}."
      )
  bounds = _microbatch_bounds(batch_size, micro_batch_sizes)
  # Checked before training, so that a stale filter fails at once.
  excluded = excluded_paths(
    [
      jax.tree_util.keystr(path)
      for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ],
    exclude,
  )
  if weight_fn is None:
    weight_fn = _leading_size if reduction == "mean" else (lambda _: 1)
  maybe_jit = jax.jit if use_jit else (lambda fn: fn)

  @maybe_jit
  def large_batch_step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  large_batch_params, opt_state = params, optimizer.init(params)
  for batch in batches:
    large_batch_params, opt_state = large_batch_step(
      large_batch_params, opt_state, batch
    )

  tx = accumulate(optimizer, len(bounds), reduction=reduction)

  @maybe_jit
  def micro_step(params, tx_state, microbatch, weight):
    grads = jax.grad(loss_fn)(params, microbatch)
    updates, tx_state = tx.update(grads, tx_state, params, weight=weight)
    return optax.apply_updates(params, updates), tx_state

  accumulated_params, tx_state = params, tx.init(params)
  for batch in batches:
    for start, end in bounds:
      microbatch = _rows(batch, start, end)
      accumulated_params, tx_state = micro_step(
        accumulated_params, tx_state, microbatch, weight_fn(microbatch)
      )

  return EquivalenceResult(
    max_relative_difference=max_relative_difference(
      accumulated_params, large_batch_params, exclude=exclude
    ),
    large_batch_params=large_batch_params,
    accumulated_params=accumulated_params,
    excluded=excluded,
  )


def assert_equivalent_to_large_batch(
  loss_fn: LossFn,
  optimizer: optax.GradientTransformation,
  params: optax.Params,
  batches: Iterable[Any],
  micro_batch_sizes: int | Sequence[int],
  *,
  rtol: float = 1e-5,
  weight_fn: Callable[[Any], Any] | None = None,
  reduction: str = "mean",
  use_jit: bool = True,
  exclude: PathFilter | None = None,
) -> EquivalenceResult:
  """Asserts that accumulation reproduces large-batch training within ``rtol``.

  Runs :func:`compare_with_large_batch` with the same arguments.

  By default every parameter leaf is held to ``rtol``, and a leaf that only
  float rounding moves fails: an attention block's key bias under Adam,
  AdamW, RMSProp or Lion, or any leaf with a structurally zero gradient that
  starts at zero (see :func:`compare_with_large_batch`). Pass ``exclude``
  to leave such leaves out, and only those.

  Args:
    loss_fn: see :func:`compare_with_large_batch`.
    optimizer: see :func:`compare_with_large_batch`.
    params: see :func:`compare_with_large_batch`.
    batches: see :func:`compare_with_large_batch`.
    micro_batch_sizes: see :func:`compare_with_large_batch`.
    rtol: the largest acceptable ``max_relative_difference``.
    weight_fn: see :func:`compare_with_large_batch`.
    reduction: see :func:`compare_with_large_batch`.
    use_jit: see :func:`compare_with_large_batch`.
    exclude: see :func:`compare_with_large_batch`.

  Returns:
    The :class:`EquivalenceResult`, for further checks.

  Raises:
    AssertionError: the runs differ by more than ``rtol``, or their
      parameters differ in where they hold NaN or infinite values (the
      message names the parameter leaf that differs most, of those not
      excluded, and how many leaves were excluded), or the large-batch run
      itself diverged to NaN or infinity, where agreeing proves nothing.
    TypeError: see :func:`compare_with_large_batch`.
    ValueError: see :func:`compare_with_large_batch`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from ga_optax.testing import assert_equivalent_to_large_batch
    >>> def loss_fn(w, batch):
    ...   return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)
    >>> batch = {"x": jnp.arange(16.0).reshape(8, 2) / 10, "y": jnp.ones(8)}
    >>> _ = assert_equivalent_to_large_batch(
    ...     loss_fn, optax.sgd(0.1, momentum=0.9), jnp.zeros(2), [batch] * 3, 4)
  """
  result = compare_with_large_batch(
    loss_fn,
    optimizer,
    params,
    batches,
    micro_batch_sizes,
    weight_fn=weight_fn,
    reduction=reduction,
    use_jit=use_jit,
    exclude=exclude,
  )
  if not result.max_relative_difference <= rtol:
    raise AssertionError(_describe_difference(result, rtol))
  diverged = [
    path
    for path, _, large_batch in paired_leaves(
      result.accumulated_params, result.large_batch_params
    )
    if not np.all(np.isfinite(large_batch))
  ]
  if diverged:
    # Two runs that both diverge agree on their NaNs, and prove nothing.
    raise AssertionError(
      "the large-batch run itself diverged: its params hold NaN or infinite"
      f" values at {diverged[:3]} ({len(diverged)} leaves), so agreeing with"
      " it proves nothing; lower the learning rate or check the loss."
    )
  return result


def _describe_difference(result: EquivalenceResult, rtol: float) -> str:
  leaves = paired_leaves(result.accumulated_params, result.large_batch_params)
  path, accumulated, large_batch = max(
    leaves, key=lambda leaf: leaf_difference(leaf, result.excluded)
  )
  difference = relative_difference(accumulated, large_batch)
  message = (
    "accumulated training differs from large-batch training: max relative"
    f" difference {difference:.3g} > rtol {rtol:.3g} at params leaf {path}"
  )
  if result.excluded:
    message += (
      f" (exclude left out {len(result.excluded)} of {len(leaves)} leaves)"
    )
  if np.isfinite(difference):
    return message + "."
  return (
    f"{message}: the accumulated params hold {non_finite_counts(accumulated)}"
    f" values there, the large-batch params {non_finite_counts(large_batch)}"
    " (a NaN or infinity counts as equal only where both hold the same one)."
  )
