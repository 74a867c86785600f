"""Float8 state across a window: what Flax's fp8 ops keep beside the params.

Flax's fp8 dot products (``flax.linen.Fp8DirectDotGeneralOp``,
``Fp8Einsum``, ``Fp8DotGeneralOp``) keep amax histories and scales in the
``_overwrite_with_gradient`` collection. Their "gradient" is their new value,
which Flax's ``TrainState`` writes over the old one instead of stepping an
optimizer. Each call computes, from the state it is given:

* ``*_scale``: the scale for this call, from the largest amax of the old
  history (delayed scaling): it does not depend on the batch;
* ``*_amax_history``: the old history rolled by one, with the batch's amax
  at index 0: only index 0 depends on the batch.

So across a window the state never reaches the optimizer and is never
summed: it stays at its window-start value, so that every micro-batch
quantises as the large batch would, and the window keeps a running
combination of the micro-batches' new values (:class:`Fp8Window`), which
becomes the state when the window closes (:func:`close`):

* forward histories (``input_``, ``kernel_amax_history``): the elementwise
  max, which is the large batch's new history exactly;
* output-gradient histories (``output_grad_amax_history``): at index 0 the
  max over micro-batches of ``c_i * amax_i``, where ``c_i`` is the factor by
  which the window's gradient weighs micro-batch ``i``'s gradient
  (``w_i / W`` for ``reduction="mean"``, ``w_i`` for ``"sum"``): the
  large batch's output gradient is ``c_i`` times the micro-batch's, row by
  row, where the backward passes agree (see docs/how-to/mixed-precision.md
  for when they do);
* scales: any micro-batch's, identical across the window; the latest.

A micro-batch of weight 0 (padding only) counts in the forward histories,
since the large batch quantises its rows too, and not in the
output-gradient ones, where its ``0 / 0`` loss gives NaN.

As a part of the window algebra, combined across devices by a max, the
in-step scan drives it (:class:`Fp8Part`), and so does ``accumulate``'s
window (:class:`Fp8WindowPart`), given each micro-batch's new state as
``update(..., fp8_state=...)`` (:func:`ga_optax.apply_gradients` passes it).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ga_optax._src.algebra import parts, weights

# Flax's name for the collection (flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT),
# spelled here so that Flax stays an optional dependency.
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"

REDUCTIONS = ("mean", "sum")


class Kind(enum.Enum):
  """How a leaf of the float8 state combines across micro-batches."""

  FORWARD_HISTORY = "forward amax history"
  GRADIENT_HISTORY = "output-gradient amax history"
  SCALE = "scale"


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["combined"],
  meta_fields=["reduction"],
)
@dataclasses.dataclass(frozen=True)
class Fp8Window:
  """The open window's running combination of its micro-batches' fp8 state.

  Attributes:
    combined: a tree like the float8 state: forward histories hold the
      elementwise max of the micro-batches' new histories; output-gradient
      histories hold, at index 0, the max of ``weight * amax`` and, after
      it, the (shared) rolled old history; scales hold the latest. Zeros
      (the identity of a max of amaxes, which are >= 0) until a micro-batch
      contributes.
    reduction: the window's reduction, ``"mean"`` or ``"sum"``: whether
      :func:`close` divides the output-gradient amax by the window's weight.
  """

  combined: Any
  reduction: str = "mean"


def split_variables(variables: Any) -> tuple[Any, Any]:
  """``(params, fp8_state)`` of Flax variables; ``(variables, None)`` else.

  Variables that hold the float8 collection are split as Flax's
  ``TrainState`` splits them: the optimizer sees their ``"params"``.

  Example:
    >>> from ga_optax._src.algebra import fp8
    >>> fp8.split_variables({"params": {"w": 1.0},
    ...                      "_overwrite_with_gradient": {"s": 2.0}})
    ({'w': 1.0}, {'s': 2.0})
    >>> fp8.split_variables({"w": 1.0})
    ({'w': 1.0}, None)
  """
  if isinstance(variables, Mapping) and OVERWRITE_WITH_GRADIENT in variables:
    return variables["params"], variables[OVERWRITE_WITH_GRADIENT]
  return variables, None


def refuse_as_gradients(grads: Any) -> None:
  """Raises where ``grads`` hold Flax's float8 state, which is not summed.

  Raises:
    ValueError: ``grads`` hold the ``_overwrite_with_gradient`` collection.
  """
  if split_variables(grads)[1] is not None:
    raise ValueError(
      f"grads hold Flax's float8 state (the {OVERWRITE_WITH_GRADIENT!r}"
      " collection), which is combined by a max, never summed: step a float8"
      " model with ga_optax.apply_gradients(state, grads) around accumulate,"
      " or differentiate it with microbatched_value_and_grad."
      " accumulate_and_apply and tx.update take the gradients of"
      " variables['params'] alone, and the collection's as fp8_state=."
    )


def join_variables(variables: Any, params: Any, fp8_state: Any) -> Any:
  """``variables`` with new ``params`` and float8 state, its other parts kept.

  The inverse of :func:`split_variables`: the container keeps its type (a
  ``dict``, or a Flax ``FrozenDict``) and any other collection it holds, so
  that a jitted loop's carry keeps its structure.
  """
  if fp8_state is None:
    return params
  joined = {
    **variables,
    "params": params,
    OVERWRITE_WITH_GRADIENT: fp8_state,
  }
  return type(variables)(joined)


def kind_of(path: tuple[Any, ...]) -> Kind:
  """How the leaf at ``path`` of a float8 state combines, from its name.

  Raises:
    ValueError: the name is none of Flax's fp8 names.
  """
  keys = list(path)
  # An NNX Variable adds a trailing attribute key for its value.
  while keys and isinstance(keys[-1], jax.tree_util.GetAttrKey):
    keys.pop()
  last = keys[-1] if keys else None
  name = str(getattr(last, "key", getattr(last, "name", "")))
  if name.endswith("output_grad_amax_history"):
    return Kind.GRADIENT_HISTORY
  if name.endswith("amax_history"):
    return Kind.FORWARD_HISTORY
  if name.endswith("scale"):
    return Kind.SCALE
  raise ValueError(
    f"the float8 state ({OVERWRITE_WITH_GRADIENT!r} collection) holds"
    f" {jax.tree_util.keystr(path)!r}, which is none of Flax's fp8 names"
    " (*_amax_history, output_grad_amax_history, *_scale): ga_optax does"
    " not know how a large batch would update it. Keep only Flax's fp8"
    " ops in that collection."
  )


def _check_state(fp8_state: Any) -> None:
  """Raises where a leaf is not one of Flax's fp8 leaves."""

  def check(path: tuple[Any, ...], leaf: Any) -> None:
    kind = kind_of(path)
    if kind is not Kind.SCALE and jnp.ndim(leaf) < 1:
      raise ValueError(
        f"the float8 state's {kind.value} {jax.tree_util.keystr(path)!r}"
        f" must have a history axis first, got shape {jnp.shape(leaf)}."
      )

  jax.tree_util.tree_map_with_path(check, fp8_state)


def init_window(fp8_state: Any, reduction: str = "mean") -> Fp8Window | None:
  """The window's running combination before its first micro-batch.

  Args:
    fp8_state: the ``_overwrite_with_gradient`` collection of Flax
      variables, or None (a model without float8 state).
    reduction: how the window reduces its gradients, as
      :func:`ga_optax.accumulate`'s ``reduction``.

  Returns:
    An empty :class:`Fp8Window`, or None for None.

  Raises:
    ValueError: ``reduction`` is neither ``"mean"`` nor ``"sum"``, or the
      state holds a leaf that is not one of Flax's fp8 leaves.

  Example:
    >>> import jax.numpy as jnp
    >>> from ga_optax._src.algebra import fp8
    >>> state = {"input_amax_history": jnp.ones(3), "input_scale": jnp.ones(1)}
    >>> fp8.init_window(state).combined["input_amax_history"]
    Array([0., 0., 0.], dtype=float32)
  """
  if reduction not in REDUCTIONS:
    raise ValueError(
      f"reduction must be one of {REDUCTIONS}, got {reduction!r}."
    )
  if fp8_state is None:
    return None
  _check_state(fp8_state)
  return Fp8Window(jax.tree.map(jnp.zeros_like, fp8_state), reduction)


def check_like(window: Fp8Window, tree: Any, name: str) -> None:
  """Raises where ``tree`` does not have the tree of the window's state.

  Raises:
    ValueError: it does not; the message names it ``name``.
  """
  # Annotated Any: the stubs give PyTreeDef an __eq__ but no __ne__.
  expected: Any = jax.tree.structure(window.combined)
  if expected != jax.tree.structure(tree):
    raise ValueError(
      f"{name} must have the tree of the float8 state the window was made"
      f" for ({expected}), got {jax.tree.structure(tree)}: make the"
      " optimizer state with tx.init(variables) for these variables."
    )


def restarted(window: Fp8Window, restart: Any) -> Fp8Window:
  """``window``, or the empty combination where ``restart`` (a bool scalar).

  A window's first micro-step starts from the empty combination: what the
  state holds then is the last window's, stale.
  """
  restart = jnp.asarray(restart)
  return dataclasses.replace(
    window,
    combined=jax.tree.map(
      lambda running: jnp.where(restart, jnp.zeros_like(running), running),
      window.combined,
    ),
  )


def combine(
  window: Fp8Window,
  latest: Any,
  weight: Any,
  *,
  contributes: Any = True,
  restart: Any = False,
) -> Fp8Window:
  """The window with one micro-batch's new float8 state combined in.

  Args:
    window: the running combination.
    latest: the micro-batch's new float8 state: the "gradient" of the
      ``_overwrite_with_gradient`` collection, computed from the
      window-start state.
    weight: the factor by which the window's sum weighs this micro-batch's
      gradient (its ``weight=``; 1 where each micro-batch's loss is already
      its share of the window's loss and the window sums). At 0 (padding
      only) its output-gradient amax, which may be ``0 / 0``, is left out;
      its forward amaxes count, as the large batch quantises those rows too.
    contributes: whether the micro-batch counts at all (a bool scalar):
      False for a micro-step dropped as non-finite, whose new state may not
      be finite.
    restart: whether ``window`` is stale (a bool scalar): True on the first
      micro-step of a window, which starts from the empty combination.

  Returns:
    The new running combination.

  Raises:
    ValueError: ``latest`` does not have the tree of the window's state.

  Example:
    >>> import jax.numpy as jnp
    >>> from ga_optax._src.algebra import fp8
    >>> start = {"input_amax_history": jnp.zeros(2),
    ...          "output_grad_amax_history": jnp.zeros(2)}
    >>> window = fp8.init_window(start)
    >>> for amax, weight in ((3.0, 2.0), (1.0, 6.0)):
    ...   latest = {"input_amax_history": jnp.array([amax, 0.0]),
    ...             "output_grad_amax_history": jnp.array([amax, 0.0])}
    ...   window = fp8.combine(window, latest, weight)
    >>> window.combined["input_amax_history"]  # max(3, 1)
    Array([3., 0.], dtype=float32)
    >>> window.combined["output_grad_amax_history"]  # max(2 * 3, 6 * 1)
    Array([6., 0.], dtype=float32)
  """
  check_like(window, latest, "latest")
  contributes = jnp.asarray(contributes)
  window = restarted(window, restart)

  def combine_leaf(path: tuple[Any, ...], kept: Any, new: Any) -> Any:
    new = jnp.asarray(new, kept.dtype)
    kind = kind_of(path)
    if kind is Kind.FORWARD_HISTORY:
      combined = jnp.maximum(kept, new)
    elif kind is Kind.GRADIENT_HISTORY:
      # Only index 0 is this micro-batch's; the rest is the rolled old
      # history, the same for every micro-batch, and is not scaled. A
      # select, not a product: 0 * NaN is NaN.
      factor = jnp.asarray(weight, kept.dtype)
      scaled = jnp.where(
        weights.counts(factor), factor * new[0], jnp.zeros_like(new[0])
      )
      combined = new.at[0].set(jnp.maximum(kept[0], scaled))
    else:
      combined = new
    return jnp.where(contributes, combined, kept)

  return dataclasses.replace(
    window,
    combined=jax.tree_util.tree_map_with_path(
      combine_leaf, window.combined, latest
    ),
  )


def close(window: Fp8Window, start: Any, weight_sum: Any) -> Any:
  """The float8 state a closing window leaves: the large batch's new state.

  Args:
    window: the running combination, every micro-batch combined in.
    start: the float8 state at the start of the window.
    weight_sum: the window's total weight ``W`` (over every device), the
      sum of the weights of the micro-batches that contributed.

  Returns:
    A tree like ``start``: the combination, the output-gradient amaxes
    divided by ``W`` for ``reduction="mean"``; ``start`` itself where the
    window holds no weight (nothing contributed).

  Raises:
    ValueError: ``start`` does not have the tree of the window's state.

  Example:
    >>> import jax.numpy as jnp
    >>> from ga_optax._src.algebra import fp8
    >>> start = {"output_grad_amax_history": jnp.array([5.0, 4.0])}
    >>> window = fp8.init_window(start)
    >>> latest = {"output_grad_amax_history": jnp.array([3.0, 5.0])}
    >>> window = fp8.combine(window, latest, 2.0)
    >>> fp8.close(window, start, 8.0)["output_grad_amax_history"]
    Array([0.75, 5.  ], dtype=float32)
    >>> fp8.close(window, start, 0.0)["output_grad_amax_history"]
    Array([5., 4.], dtype=float32)
  """
  check_like(window, start, "start")
  weight_sum = jnp.asarray(weight_sum)
  # An empty window keeps start.
  has_weight = weights.has_weight(weight_sum)
  divisor = weights.divisor(weight_sum)

  def close_leaf(path: tuple[Any, ...], combined: Any, old: Any) -> Any:
    if kind_of(path) is Kind.GRADIENT_HISTORY and window.reduction == "mean":
      combined = combined.at[0].set(
        combined[0] / divisor.astype(combined.dtype)
      )
    return jnp.where(has_weight, combined, jnp.asarray(old, combined.dtype))

  return jax.tree_util.tree_map_with_path(close_leaf, window.combined, start)


@dataclasses.dataclass(frozen=True)
class Fp8Part:
  """The float8 state as a part of the window algebra (:mod:`.parts`).

  Its value is an :class:`Fp8Window`; each micro-batch's new float8 state is
  combined in (:func:`combine`), devices combine by a max, and the close is
  the large batch's new state (:func:`close`).

  Attributes:
    start: the float8 state at the start of the window.
    reduction: the window's reduction, ``"mean"`` or ``"sum"``.
    scaled_to_share: each micro-batch's loss was scaled to its share of the
      window's (the in-step scan does so, so that each backward pass
      quantises as the large batch's): its output-gradient amax is then
      weighed already, and counts with factor 1.
  """

  start: Any
  reduction: str = "mean"
  scaled_to_share: bool = False
  combine: parts.Combine = "max"

  def zero(self) -> Fp8Window | None:
    return init_window(self.start, self.reduction)

  def add(self, window: Fp8Window, micro_batch: parts.MicroBatch) -> Any:
    _, latest = split_variables(micro_batch.grads)
    factor = micro_batch.weight
    if self.scaled_to_share:
      factor = micro_batch.counts.astype(jnp.float32)
    return combine(window, latest, factor, contributes=micro_batch.kept)

  def close(self, window: Fp8Window, closing: parts.Closing) -> Any:
    return close(window, self.start, closing.weight)


class Fp8InWindow(NamedTuple):
  """The float8 part's value in the window's state.

  Attributes:
    running: the open window's running combination.
    weight: the weight of the open window's micro-batches that brought
      float8 values, as this device holds it.
    state: the float8 state the model computes with: its value at the
      start of the open window, which a window that closes with a step
      replaces by the large batch's new state. Read it after each call
      (:func:`ga_optax.apply_gradients` writes it into the variables).
  """

  running: Fp8Window
  weight: jax.Array
  state: Any


@dataclasses.dataclass(frozen=True)
class Fp8WindowPart:
  """A Flax model's float8 state as a part of the window.

  Each micro-batch's new float8 state (``update(..., fp8_state=...)``) is
  combined in (:func:`combine`, by its weight), devices combine by a max
  and their weights by a sum, and a window that closes with a step leaves
  the large batch's new state (:func:`close`). Its value is None (no
  leaves, no cost) for params without float8 state.

  Attributes:
    reduction: the window's reduction, ``"mean"`` or ``"sum"``.
  """

  reduction: str = "mean"
  combine: parts.Combine = "max"

  def init(self, held: parts.Held, params: Any) -> Fp8InWindow | None:
    del held
    start = split_variables(params)[1]
    window = init_window(start, self.reduction)
    if window is None:
      return None
    return Fp8InWindow(window, jnp.zeros((), jnp.float32), start)

  def add(
    self, value: Fp8InWindow | None, micro_batch: parts.MicroBatch
  ) -> Fp8InWindow | None:
    latest = split_variables(micro_batch.grads)[1]
    if latest is None:
      # Params' gradients alone: a step that keeps the float8 state.
      return value
    if value is None:
      raise ValueError(
        f"fp8_state holds Flax's float8 state (the {OVERWRITE_WITH_GRADIENT!r}"
        " collection) but the optimizer state has no window for it: make it"
        " with tx.init(variables) for the whole variables, not"
        " variables['params'] (Flax's TrainState.create does the latter:"
        " state = TrainState.create(apply_fn=..., params=variables,"
        " tx=tx).replace(opt_state=tx.init(variables)))."
      )
    check_like(value.running, latest, "fp8_state")
    running = combine(
      value.running, latest, micro_batch.weight, contributes=micro_batch.kept
    )
    return value._replace(
      running=running, weight=value.weight + micro_batch.weight
    )

  def read(self, value: Fp8InWindow | None, mean_grads: Any) -> None:
    # The float8 state's close reads its own running amax, not the mean.
    del value, mean_grads

  def close(
    self, value: Fp8InWindow | None, closing: parts.WindowClosing
  ) -> tuple[Fp8InWindow | None, None]:
    if value is None:
      return None, None
    running = closing.held.combine(value.running, self.combine)
    weight = closing.held.combine(value.weight, "sum")
    return value._replace(state=close(running, value.state, weight)), None

  def restart(self, value: Fp8InWindow | None) -> Fp8InWindow | None:
    if value is None:
      return None
    return value._replace(
      running=restarted(value.running, True),
      weight=jnp.zeros_like(value.weight),
    )
