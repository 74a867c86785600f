"""A new part of the window is written in its own file: none under ``window/``.

The window carries a tuple of parts (:class:`ga_optax._src.algebra.parts.
WindowPart`), each with its own value in the state: it adds each where it
adds the gradient, closes each where it steps the wrapped optimizer, hands
their reports to the strategy that picks the next k, and restarts each
after every close. The part here, written in this file alone, keeps the
largest |g|∞ of a window's micro-gradients: a max over the devices where
the noise scale's terms are a sum. It is checked against NumPy on one
device and on 8 inside ``jax.shard_map``, in both forms of the window and
on the host's schedule, beside the noise scale, whose figures do not move.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src.algebra import parts
from ga_optax._src.window import arguments, transform, window_form
from ga_optax._src.window.output import EmitUpdates

DEVICES = 8
K = 3
WINDOWS = 3
DECAY = 0.5


class LargestEntry(NamedTuple):
  """The toy part's value: the open window's max, and the last window's."""

  open: jax.Array
  last: jax.Array


class LargestReport(NamedTuple):
  """What a closed window reports: its largest |g|∞ over every device."""

  largest: jax.Array


@dataclasses.dataclass(frozen=True)
class LargestEntryPart:
  """The largest |g|∞ of a window's micro-gradients of positive weight."""

  combine: parts.Combine = "max"

  def init(self, held: parts.Held, params: Any) -> LargestEntry:
    del held, params  # a max is held whole on each device
    zero = jnp.zeros((), jnp.float32)
    return LargestEntry(zero, zero)

  def add(self, value: LargestEntry, micro_batch: parts.MicroBatch) -> Any:
    entry = parts.leaf_total(
      micro_batch.grads, lambda leaf: jnp.max(jnp.abs(leaf))
    )
    larger = jnp.maximum(value.open, entry)
    return value._replace(
      open=jnp.where(micro_batch.counts, larger, value.open)
    )

  def close(
    self, value: LargestEntry, closing: parts.WindowClosing
  ) -> tuple[LargestEntry, LargestReport]:
    largest = closing.held.combine(value.open, self.combine)
    return value._replace(last=largest), LargestReport(largest)

  def restart(self, value: LargestEntry) -> LargestEntry:
    return value._replace(open=jnp.zeros_like(value.open))


@dataclasses.dataclass(frozen=True)
class GrowPastLargest:
  """k doubles once a window's largest entry passes ``bound``: reads a report."""

  bound: float

  def first(self) -> jax.Array:
    return jnp.asarray(K, jnp.int32)

  def current(self, every_k: jax.Array, update_step: jax.Array) -> jax.Array:
    del update_step
    return every_k

  def next(self, closed: parts.ClosedWindow) -> jax.Array:
    largest = closed.report(LargestReport).largest
    return jnp.where(largest > self.bound, 2 * closed.k, closed.k).astype(
      jnp.int32
    )


def with_largest_entry(axis_name: Any = None, window_length: Any = None) -> Any:
  """``accumulate(sgd)`` measuring the noise scale, plus the toy part."""
  window = arguments.resolve(
    optax.sgd(0.1),
    K,
    EmitUpdates(),
    reduction="mean",
    accumulator_dtype=jnp.float32,
    skip_nonfinite=False,
    axis_name=axis_name,
    unreduced_axes=None,
    accumulator_memory_kind=None,
    inner_state_memory_kind=None,
    inner_state_axes=None,
    noise_scale_decay=DECAY,
    lr_scaling=None,
  )
  if window_length is not None:
    window = dataclasses.replace(window, window_length=window_length)
  return transform.emitting_updates(
    dataclasses.replace(window, parts=(*window.parts, LargestEntryPart()))
  )


def largest_of(state: Any) -> float:
  (value,) = [part for part in state.parts if isinstance(part, LargestEntry)]
  return float(value.last)


def assert_largest_of_window(state, grads, weights, call: int) -> float:
  """Checks the part against NumPy after the window that ``call`` closed."""
  window = slice(call + 1 - K, call + 1)
  counted = weights[window] > 0
  expected = np.max(np.abs(grads[window][counted]))
  assert np.isfinite(largest_of(state))
  assert largest_of(state) == pytest.approx(expected, rel=1e-6)
  return expected


@pytest.fixture(params=["loops", "conditional", "host"])
def schedule(request, monkeypatch) -> str:
  """Each form of the device's schedule, pinned, and the host's schedule."""
  if request.param != "host":
    monkeypatch.setenv(window_form.VARIABLE, request.param)
  return request.param


def closing_of(schedule: str, call: int) -> bool | None:
  return (call + 1) % K == 0 if schedule == "host" else None


def test_one_device_carries_the_new_part_beside_the_noise_scale(schedule):
  rng = np.random.default_rng(0)
  grads = rng.normal(size=(WINDOWS * K, 5)).astype(np.float32)
  grads[:K] *= 4  # the first window's entries larger than the next ones'
  weights = rng.integers(1, 4, size=WINDOWS * K).astype(np.float32)
  # The largest entry of the first window comes with weight 0.
  weights[np.argmax(np.max(np.abs(grads[:K]), axis=1))] = 0.0
  tx = with_largest_entry()
  plain = ga_optax.accumulate(optax.sgd(0.1), K, noise_scale_decay=DECAY)
  params = jnp.zeros(5)
  state, plain_state = tx.init(params), plain.init(params)
  maxima = []
  step = jax.jit(tx.update, static_argnames="closing")
  for call in range(WINDOWS * K):
    closing = closing_of(schedule, call)
    updates, state = step(
      jnp.asarray(grads[call]),
      state,
      params,
      weight=weights[call],
      closing=closing,
    )
    plain_updates, plain_state = plain.update(
      jnp.asarray(grads[call]), plain_state, params, weight=weights[call]
    )
    assert np.all(np.isfinite(updates))
    np.testing.assert_allclose(updates, plain_updates, rtol=1e-6)
    if (call + 1) % K == 0:
      maxima.append(assert_largest_of_window(state, grads, weights, call))
  # A window below an earlier one: a part never restarted would not be.
  assert min(maxima[1:]) < maxima[0]
  noise, plain_noise = (
    ga_optax.noise_scale(state),
    ga_optax.noise_scale(plain_state),
  )
  for field, plain_field in zip(noise, plain_noise, strict=True):
    assert np.isfinite(float(field))
    np.testing.assert_allclose(field, plain_field, rtol=1e-6)


@pytest.mark.devices(DEVICES)
def test_eight_devices_combine_the_new_part_by_its_max(schedule):
  rng = np.random.default_rng(1)
  grads = rng.normal(size=(WINDOWS * K, DEVICES, 4)).astype(np.float32)
  grads[:K] *= 4  # the first window's entries larger than the next ones'
  # The largest entry of some window sits on a device whose weight is 0.
  weights = rng.integers(1, 4, size=(WINDOWS * K, DEVICES)).astype(np.float32)
  at = np.unravel_index(np.argmax(np.abs(grads[:K])), grads[:K].shape)
  weights[at[0], at[1]] = 0.0
  tx = with_largest_entry(axis_name="data")
  params = jnp.zeros(4)
  mesh = jax.make_mesh((DEVICES,), ("data",))

  @functools.cache
  def step(closing):
    def local(state, grad, weight):
      return tx.update(
        grad[0], state, params, weight=weight[0], closing=closing
      )[1]

    return jax.jit(
      jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=P(),
        check_vma=False,
      )
    )

  with jax.set_mesh(mesh):
    state = jax.device_put(tx.init(params), P())
    maxima = []
    for call in range(WINDOWS * K):
      state = step(closing_of(schedule, call))(
        state,
        jax.device_put(grads[call], P("data")),
        jax.device_put(weights[call], P("data")),
      )
      if (call + 1) % K == 0:
        expected = assert_largest_of_window(state, grads, weights, call)
        maxima.append(expected)
        if call + 1 == K:  # the zero-weight device held the window's largest
          assert expected < np.max(np.abs(grads[:K]))
  assert min(maxima[1:]) < maxima[0]


def test_a_strategy_for_k_reads_the_new_part_by_its_report():
  grads = [1.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0]
  tx = with_largest_entry(window_length=GrowPastLargest(bound=5.0))
  params = jnp.zeros(1)
  state = tx.init(params)
  ks = []
  for grad in grads:
    _, state = tx.update(jnp.full(1, grad), state, params)
    ks.append(int(ga_optax.current_k(state)))
  # Windows of 3: the second holds 9 > 5, so the third window's k is 6.
  assert ks == [3, 3, 3, 3, 3, 6, 6, 6, 6]


def test_a_report_no_part_gives_is_a_clear_error():
  closed = parts.ClosedWindow(
    k=jnp.int32(2),
    update_step=jnp.int32(1),
    weight=jnp.float32(2.0),
    full=jnp.bool_(True),
    reports=(),
  )
  with pytest.raises(ValueError, match="0 reports of type LargestReport"):
    closed.report(LargestReport)
