"""The memory planner: the largest micro-batch that fits, from XLA's analysis.

Instead of trying batch sizes until one runs out of memory, the planner
compiles the accumulation micro-step for candidate micro-batch sizes on
abstract inputs (nothing is allocated or run) and reads the bytes the
executable needs from ``compiled.memory_analysis()``. A binary search over
sizes finds the largest that fits the budget; ``num_microbatches`` follows from
the global batch wanted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import optax

from ga_optax._src import validation
from ga_optax._src.placements import residency
from ga_optax._src.planning import device_memory
from ga_optax._src.window import transform

LossFn = Callable[..., Any]


class MicrobatchPlan(NamedTuple):
  """What :func:`plan_microbatch` found.

  Attributes:
    micro_batch_size: the largest micro-batch size that fits the budget (a
      divisor of ``global_batch_size`` when one was given).
    num_microbatches: micro-steps per window,
      ``global_batch_size // micro_batch_size``; None when no
      ``global_batch_size`` was given.
    compiled_bytes: device bytes the micro-step needs at that size
      (see :func:`micro_step_bytes`).
    next_size: the next candidate size up, which does not fit; None when
      ``micro_batch_size`` is already the largest candidate.
    next_size_bytes: device bytes the micro-step needs at ``next_size``.
    memory_budget_bytes: the budget planned for.
  """

  micro_batch_size: int
  num_microbatches: int | None
  compiled_bytes: int
  next_size: int | None
  next_size_bytes: int | None
  memory_budget_bytes: int


def _abstract(tree: Any) -> Any:
  return jax.tree.map(
    lambda leaf: jax.ShapeDtypeStruct(jax.numpy.shape(leaf), leaf.dtype), tree
  )


def _batch_of_size(example_batch: Any, size: int) -> Any:
  """Abstract ``example_batch`` with its leading (batch) axis set to size."""
  leaves = jax.tree.leaves(example_batch)
  if not leaves:
    raise ValueError("example_batch must hold at least one array, got none.")
  for leaf in leaves:
    if not hasattr(leaf, "shape") or len(leaf.shape) == 0:
      raise ValueError(
        "example_batch leaves must be arrays with a leading batch axis, got"
        f" a leaf of shape {getattr(leaf, 'shape', None)!r}."
      )
  leading = {leaf.shape[0] for leaf in leaves}
  if len(leading) != 1:
    raise ValueError(
      "example_batch leaves must share their leading (batch) axis, got"
      f" sizes {sorted(leading)}."
    )
  return jax.tree.map(
    lambda leaf: jax.ShapeDtypeStruct((size, *leaf.shape[1:]), leaf.dtype),
    example_batch,
  )


def micro_step_bytes(
  loss_fn: LossFn,
  params: optax.Params,
  example_batch: Any,
  micro_batch_size: int,
  *,
  optimizer: optax.GradientTransformation | None = None,
  has_aux: bool = False,
  accumulator_memory_kind: str | None = None,
  inner_state_memory_kind: str | None = None,
  device: jax.Device | None = None,
) -> int:
  """Device bytes one accumulation micro-step needs, from compilation alone.

  The micro-step is the gradient of ``loss_fn`` on a micro-batch plus, with
  ``optimizer``, ``ga_optax.accumulate(optimizer, k).update`` and
  ``optax.apply_updates``; without it, an add of the gradient into a float32
  accumulator. Params and state are donated, as in a training loop. The
  bytes are those of XLA's memory analysis: arguments, plus outputs that do
  not reuse an argument's buffer, plus temporaries, in device memory only:
  state kept in host memory (``accumulator_memory_kind``,
  ``inner_state_memory_kind``) does not count, the device copy a micro-step
  makes of it to compute on does. The micro-step is compiled for ``device``
  when one is given: a compile-only TPU chip or GPU (one of
  ``jax.experimental.topologies.get_topology_desc(...).devices``) gives the
  bytes the program of that platform needs, from a machine without one.

  Args:
    loss_fn: ``loss_fn(params, batch)`` returning a scalar (or
      ``(scalar, aux)`` with ``has_aux=True``).
    params: the params, arrays or ``jax.ShapeDtypeStruct``.
    example_batch: a batch pytree whose leaves share a leading batch axis
      (any size); only shapes and dtypes are used.
    micro_batch_size: the leading-axis size to compile for.
    optimizer: the optimizer that ``accumulate`` wraps, or None.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    accumulator_memory_kind: the memory kind the accumulator is kept in, as
      for :func:`ga_optax.accumulate` (None: device memory).
    inner_state_memory_kind: the memory kind ``optimizer``'s state is kept
      in; needs an ``optimizer``.
    device: the device to compile for (a ``jax.Device``), or None for the
      default backend's first device.

  Returns:
    The number of bytes, an int.

  Raises:
    TypeError, ValueError: a bad size, batch, device or memory kind (as
      :func:`ga_optax.accumulate` checks it), or ``inner_state_memory_kind``
      without an ``optimizer``.
    RuntimeError: the backend gives no compiled memory analysis.

  Example:
    >>> import jax.numpy as jnp
    >>> from ga_optax.planning import micro_step_bytes
    >>> loss_fn = lambda w, batch: jnp.mean((batch["x"] @ w) ** 2)
    >>> batch = {"x": jnp.ones((4, 8))}
    >>> small = micro_step_bytes(loss_fn, jnp.ones((8, 2)), batch, 1)
    >>> large = micro_step_bytes(loss_fn, jnp.ones((8, 2)), batch, 64)
    >>> small < large
    True
  """
  micro_batch_size = validation.check_positive_int(
    micro_batch_size, "micro_batch_size"
  )
  accumulator_kind = residency.check_memory_kind(
    accumulator_memory_kind, "accumulator_memory_kind"
  )
  if optimizer is None and inner_state_memory_kind is not None:
    raise ValueError(
      f"inner_state_memory_kind={inner_state_memory_kind!r} places the state"
      " of an optimizer, but no optimizer was given: pass optimizer=... or"
      " leave inner_state_memory_kind at None."
    )
  if device is not None and not isinstance(device, jax.Device):
    raise TypeError(
      "device must be None or a jax.Device (a compile-only TPU chip from"
      " jax.experimental.topologies.get_topology_desc(...).devices), got"
      f" {type(device).__name__}."
    )
  abstract_params = residency.abstract_in(_abstract(params), None, device)
  gradient = _gradient_fn(loss_fn, has_aux)
  if optimizer is None:
    step = _adding_step(gradient, abstract_params, accumulator_kind, device)
  else:
    step = _accumulating_step(
      gradient,
      abstract_params,
      optimizer,
      accumulator_kind,
      inner_state_memory_kind,
      device,
    )
  batch = residency.abstract_in(
    _batch_of_size(example_batch, micro_batch_size), None, device
  )
  compiled = (
    jax.jit(step.fn, donate_argnums=step.donate_argnums)
    .lower(abstract_params, step.state, batch)
    .compile()
  )
  return device_memory.device_bytes(compiled)


class _MicroStep(NamedTuple):
  """A micro-step to compile: ``fn(params, state, batch)`` and its state.

  Attributes:
    fn: the step.
    state: its abstract state (what it carries from call to call).
    donate_argnums: the arguments a training loop donates.
  """

  fn: Callable[..., Any]
  state: Any
  donate_argnums: tuple[int, ...]


def _gradient_fn(loss_fn: LossFn, has_aux: bool) -> Callable[..., Any]:
  """``loss_fn``'s gradient in the params, its aux left out."""
  grad_fn = jax.grad(loss_fn, has_aux=has_aux)

  def gradient(params: Any, batch: Any) -> Any:
    grads = grad_fn(params, batch)
    return grads[0] if has_aux else grads

  return gradient


def _adding_step(
  gradient: Callable[..., Any],
  abstract_params: Any,
  accumulator_kind: str | None,
  device: jax.Device | None,
) -> _MicroStep:
  """Gradient accumulation alone: an add into a float32 accumulator."""

  def step(params: Any, accumulator: Any, batch: Any) -> Any:
    grads = gradient(params, batch)
    accumulator = residency.to_device(accumulator)
    accumulator = jax.tree.map(
      lambda total, g: total + g.astype(total.dtype), accumulator, grads
    )
    return residency.put(accumulator, accumulator_kind)

  accumulator = residency.abstract_in(
    jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(leaf.shape, jax.numpy.float32),
      abstract_params,
    ),
    accumulator_kind,
    device,
  )
  return _MicroStep(step, accumulator, donate_argnums=(1,))


def _accumulating_step(
  gradient: Callable[..., Any],
  abstract_params: Any,
  optimizer: optax.GradientTransformation,
  accumulator_kind: str | None,
  inner_state_kind: str | None,
  device: jax.Device | None,
) -> _MicroStep:
  """``accumulate(optimizer, k).update`` and ``optax.apply_updates``."""
  # k does not change what a micro-step holds; 2 keeps both branches.
  tx = transform.accumulate(
    optimizer,
    2,
    accumulator_memory_kind=accumulator_kind,
    inner_state_memory_kind=inner_state_kind,
  )

  def step(params: Any, state: Any, batch: Any) -> Any:
    updates, state = tx.update(gradient(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  state = jax.eval_shape(tx.init, abstract_params)
  state = residency.abstract_in(state, None, device)._replace(
    accumulator=residency.abstract_in(
      state.accumulator, accumulator_kind, device
    ),
    inner_state=residency.abstract_in(
      state.inner_state, inner_state_kind, device
    ),
  )
  return _MicroStep(step, state, donate_argnums=(0, 1))


def plan_microbatch(
  loss_fn: LossFn,
  params: optax.Params,
  example_batch: Any,
  memory_budget_bytes: int,
  *,
  global_batch_size: int | None = None,
  optimizer: optax.GradientTransformation | None = None,
  max_micro_batch_size: int = 65536,
  has_aux: bool = False,
  accumulator_memory_kind: str | None = None,
  inner_state_memory_kind: str | None = None,
  device: jax.Device | None = None,
) -> MicrobatchPlan:
  """Finds the largest micro-batch that fits a memory budget, and its k.

  Compiles (never runs) the micro-step of :func:`micro_step_bytes` for
  candidate sizes and binary-searches the largest whose bytes are at most
  ``memory_budget_bytes``: every divisor of ``global_batch_size`` when it is
  given (so that ``num_microbatches * micro_batch_size == global_batch_size``),
  else every size up to ``max_micro_batch_size``. The search assumes that bytes
  grow with the micro-batch size, as activations do, from the first size that
  fits; the plan reports the next size up, which does not fit, so the boundary
  can be checked.

  Leave headroom in the budget for what the analysis does not see: the
  runtime's own allocations, fragmentation, and other live arrays. State kept
  in host memory (``accumulator_memory_kind``, ``inner_state_memory_kind``)
  leaves the device, so a larger micro-batch fits the same budget.

  Args:
    loss_fn: ``loss_fn(params, batch)`` returning a scalar (or
      ``(scalar, aux)`` with ``has_aux=True``), the mean over the batch.
    params: the params, arrays or ``jax.ShapeDtypeStruct``.
    example_batch: a batch pytree whose leaves share a leading batch axis;
      only shapes and dtypes are used.
    memory_budget_bytes: the device bytes one micro-step may use.
    global_batch_size: the effective batch wanted; the plan's
      ``num_microbatches`` then reaches it exactly.
    optimizer: the optimizer that ``ga_optax.accumulate`` will wrap (its
      state counts against the budget), or None for gradient accumulation
      alone.
    max_micro_batch_size: the largest size tried when ``global_batch_size`` is
      None.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    accumulator_memory_kind: the memory kind ``ga_optax.accumulate`` will
      keep the accumulator in (``"pinned_host"``, say); None for device
      memory.
    inner_state_memory_kind: the memory kind it will keep ``optimizer``'s
      state in; needs an ``optimizer``.
    device: the device to plan for, as for :func:`micro_step_bytes`: a
      compile-only TPU chip plans a TPU's micro-batch from a machine
      without one (see docs/how-to/tpu.md).

  Returns:
    A :class:`MicrobatchPlan`.

  Raises:
    TypeError: a size or the budget is not an int, or ``device`` is not a
      ``jax.Device``.
    ValueError: a size or the budget is below 1, ``example_batch`` has no
      common leading axis, not even a micro-batch of 1 fits the budget, or a
      memory kind is not one the device offers.

  Example:
    >>> import jax.numpy as jnp, ga_optax
    >>> loss_fn = lambda w, batch: jnp.mean((batch["x"] @ w) ** 2)
    >>> params, batch = jnp.ones((256, 256)), {"x": jnp.ones((1, 256))}
    >>> budget = ga_optax.planning.micro_step_bytes(loss_fn, params, batch, 32)
    >>> plan = ga_optax.planning.plan_microbatch(
    ...     loss_fn, params, batch, budget, global_batch_size=256)
    >>> plan.micro_batch_size * plan.num_microbatches
    256
    >>> plan.compiled_bytes <= budget < plan.next_size_bytes
    True
  """
  budget = validation.check_positive_int(
    memory_budget_bytes, "memory_budget_bytes"
  )
  if global_batch_size is not None:
    global_batch_size = validation.check_positive_int(
      global_batch_size, "global_batch_size"
    )
    sizes: Sequence[int] = [
      size
      for size in range(1, global_batch_size + 1)
      if global_batch_size % size == 0
    ]
  else:
    largest = validation.check_positive_int(
      max_micro_batch_size, "max_micro_batch_size"
    )
    sizes = range(1, largest + 1)
  _batch_of_size(example_batch, 1)  # Checks the batch before compiling.

  measured: dict[int, int] = {}

  def bytes_at(size: int) -> int:
    if size not in measured:
      measured[size] = micro_step_bytes(
        loss_fn,
        params,
        example_batch,
        size,
        optimizer=optimizer,
        has_aux=has_aux,
        accumulator_memory_kind=accumulator_memory_kind,
        inner_state_memory_kind=inner_state_memory_kind,
        device=device,
      )
    return measured[size]

  low = _largest_fitting(
    len(sizes), lambda index: bytes_at(sizes[index]) <= budget
  )
  if low is None:
    raise ValueError(
      f"memory_budget_bytes={budget} is below what a micro-batch of"
      f" {sizes[0]} needs ({bytes_at(sizes[0])} bytes): raise the budget,"
      " shrink the model or rematerialise activations (jax.checkpoint)."
    )
  size = sizes[low]
  # The search tried the next size up and found it does not fit.
  next_size = sizes[low + 1] if low + 1 < len(sizes) else None
  return MicrobatchPlan(
    micro_batch_size=size,
    num_microbatches=None
    if global_batch_size is None
    else global_batch_size // size,
    compiled_bytes=bytes_at(size),
    next_size=next_size,
    next_size_bytes=None if next_size is None else bytes_at(next_size),
    memory_budget_bytes=budget,
  )


def _largest_fitting(count: int, fits: Callable[[int], bool]) -> int | None:
  """The largest index below ``count`` that ``fits``, or None if none does.

  Assumes that from the first index that fits, every index fits up to some
  index and none after it (bytes grow with the size). Gallops up to the
  first index that fits and on to the first after it that does not, then
  bisects between them; on return ``fits`` has been called on the next index
  up, when there is one. A compiler may give a micro-batch of one a costlier
  program than a micro-batch of two (an outer product instead of a matrix
  product, and a copy to the layout the window wants), so a smallest size
  that does not fit does not end the search.
  """
  low, probe = None, 0
  while probe < count:
    if fits(probe):
      low = probe
    elif low is not None:
      break
    probe = 2 * probe if probe else 1
  if low is None:
    return None
  # Invariant: low fits; high does not, or is past the end.
  high = min(probe, count)
  while high - low > 1:
    middle = (low + high) // 2
    if fits(middle):
      low = middle
    else:
      high = middle
  return low
