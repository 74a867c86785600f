"""A new part is written in its own file: none under ``window/`` or ``scan/``.

Both drivers carry a tuple of parts (:class:`ga_optax._src.algebra.parts.
Part`): each adds its value where it adds the gradient, combines it over
the devices where it reduces the gradient, and closes it once, with a
report. The window (:class:`~ga_optax._src.algebra.parts.Windowing`) does
so across calls: it closes its parts where it steps the wrapped optimizer,
hands their reports to the strategy that picks the next k, and restarts
them after every close; the scan within one call, returning the reports.
The part here, written in this file alone, is the largest |g|∞ of the
micro-gradients of positive weight: a max over the devices where the noise
scale's terms are a sum. It is checked against NumPy on one device and on 8
inside ``jax.shard_map``: through the window in both of its forms and on the
host's schedule, and through the scan; beside the noise scale, whose
figures do not move.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src.algebra import parts
from ga_optax._src.scan import microbatch
from ga_optax._src.window import arguments, transform, window_form
from ga_optax._src.window.output import EmitUpdates

DEVICES = 8
K = 3
WINDOWS = 3
DECAY = 0.5


class LargestReport(NamedTuple):
  """What a closed window reports: its largest |g|∞ over every device."""

  largest: jax.Array


@dataclasses.dataclass(frozen=True)
class LargestEntryPart:
  """The largest |g|∞ of a window's micro-gradients of positive weight."""

  combine: parts.Combine = "max"

  def zero(self) -> jax.Array:
    return jnp.zeros((), jnp.float32)

  def add(self, largest: jax.Array, micro_batch: parts.MicroBatch) -> Any:
    entries = [
      jnp.max(jnp.abs(leaf)) for leaf in jax.tree.leaves(micro_batch.grads)
    ]
    larger = jnp.maximum(largest, jnp.max(jnp.stack(entries)))
    return jnp.where(micro_batch.counts, larger, largest)

  def close(self, largest: jax.Array, closing: parts.Closing) -> LargestReport:
    del closing  # the largest entry is all the report says
    return LargestReport(largest)


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
  # accumulate's arguments with their defaults, as resolve takes them.
  given = inspect.signature(ga_optax.accumulate).bind(
    optax.sgd(0.1), K, axis_name=axis_name, noise_scale_decay=DECAY
  )
  given.apply_defaults()
  window = arguments.resolve(*given.args, EmitUpdates(), **given.kwargs)
  if window_length is not None:
    window = dataclasses.replace(window, window_length=window_length)
  largest = parts.Windowing(LargestEntryPart())
  return transform.emitting_updates(
    dataclasses.replace(window, parts=(*window.parts, largest))
  )


def largest_of(state: Any) -> float:
  """The largest entry the state's last closed window reported."""
  (value,) = [part for part in state.parts if isinstance(part, parts.Windowed)]
  return float(value.last.largest)


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
  with pytest.raises(
    ValueError, match="0 of the parts reported a LargestReport"
  ):
    closed.report(LargestReport)


# The scan: one call's batch of K micro-batches on each device.
ROWS = 2  # per micro-batch and device
FEATURES = 4


def row_loss(w: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
  """The mean squared error of the batch's rows."""
  return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def counted_rows(batch: dict[str, jax.Array]) -> jax.Array:
  """A micro-batch's weight: its rows that count (a mask), 0 for none."""
  return jnp.sum(batch["mask"])


def scan_with_largest_entry(axis_name: Any = None) -> Any:
  """The scan measuring the noise scale, plus the toy part."""
  microbatching = microbatch.resolve(
    row_loss,
    K,
    has_aux=False,
    weight_fn=counted_rows,
    accumulator_dtype=jnp.float32,
    checkpoint_policy=None,
    remat=False,
    in_axes=0,
    noise_scale=True,
  )
  weighting = microbatching.weighting
  microbatching = microbatching._replace(
    weighting=weighting._replace(parts=(*weighting.parts, LargestEntryPart()))
  )
  return microbatch.summing(microbatching, in_axes=0, axis_name=axis_name)


def scan_batch(devices: int, seed: int) -> dict[str, np.ndarray]:
  """Rows whose largest micro-gradient comes with weight 0."""
  rng = np.random.default_rng(seed)
  rows = devices * K * ROWS
  batch = {
    "x": rng.normal(size=(rows, FEATURES)).astype(np.float32),
    "y": rng.normal(size=rows).astype(np.float32),
    "mask": np.ones(rows, np.float32),
  }
  largest = np.argmax(np.abs(batch["y"]))
  batch["y"][largest] *= 10  # its micro-batch's gradient the largest
  for start, _ in micro_batch_rows(devices, rows):
    if largest in start:
      batch["mask"][start] = 0.0  # that micro-batch weighs nothing
  return batch


def micro_batch_rows(devices: int, rows: int) -> list[tuple[np.ndarray, int]]:
  """Each micro-batch's rows, with its device: entries i, i + K, ... of it."""
  share = rows // devices
  return [
    (device * share + np.arange(index, share, K), device)
    for device in range(devices)
    for index in range(K)
  ]


def largest_micro_gradient(
  w: np.ndarray, batch: dict[str, np.ndarray], devices: int
) -> float:
  """The largest |g|∞ over micro-batches of positive weight (NumPy)."""
  largest = 0.0
  for rows, _ in micro_batch_rows(devices, len(batch["y"])):
    if batch["mask"][rows].sum() == 0:
      continue
    x, y = batch["x"][rows].astype(np.float64), batch["y"][rows]
    grad = 2 * x.T @ (x @ w - y) / len(rows)
    largest = max(largest, float(np.max(np.abs(grad))))
  return largest


def test_the_scan_carries_the_new_part_on_one_device():
  batch = scan_batch(devices=1, seed=2)
  w = np.linspace(-1, 1, FEATURES).astype(np.float32)
  result = jax.jit(scan_with_largest_entry())(jnp.asarray(w), batch)
  largest = float(result.report(LargestReport).largest)
  expected = largest_micro_gradient(w, batch, 1)
  assert np.isfinite(largest)
  assert largest == pytest.approx(expected, rel=1e-5)
  # The weight-0 micro-batch held the batch's largest entry.
  everything = dict(batch, mask=np.ones_like(batch["mask"]))
  assert expected < largest_micro_gradient(w, everything, 1)
  plain = ga_optax.microbatched_value_and_grad(
    row_loss, K, weight_fn=counted_rows, noise_scale=True
  )
  _, grads, estimate = jax.jit(plain)(jnp.asarray(w), batch)
  np.testing.assert_allclose(result.grads, grads, rtol=1e-6)
  for field, plain_field in zip(
    result.report(ga_optax.NoiseScaleEstimate), estimate, strict=True
  ):
    assert np.all(np.isfinite(field))
    np.testing.assert_allclose(field, plain_field, rtol=1e-6)


@pytest.mark.devices(DEVICES)
def test_the_scan_combines_the_new_part_by_its_max_on_eight_devices():
  batch = scan_batch(devices=DEVICES, seed=3)
  w = np.linspace(-1, 1, FEATURES).astype(np.float32)
  mesh = jax.make_mesh((DEVICES,), ("data",))
  scan = scan_with_largest_entry(axis_name="data")

  def local(w, batch):
    result = scan(w, batch)
    return result.report(LargestReport).largest, result.grads

  with jax.set_mesh(mesh):
    largest, grads = jax.jit(
      jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())
      )
    )(jax.device_put(w, P()), jax.device_put(batch, P("data")))
  expected = largest_micro_gradient(w, batch, DEVICES)
  assert np.isfinite(float(largest))
  assert float(largest) == pytest.approx(expected, rel=1e-5)
  everything = dict(batch, mask=np.ones_like(batch["mask"]))
  assert expected < largest_micro_gradient(w, everything, DEVICES)
  # The gradient is the large batch's, as without the part.
  counted = batch["mask"] > 0
  reference = jax.grad(row_loss)(
    jnp.asarray(w), {key: value[counted] for key, value in batch.items()}
  )
  assert np.all(np.isfinite(grads))
  np.testing.assert_allclose(grads, reference, rtol=1e-5, atol=1e-6)


@dataclasses.dataclass(frozen=True)
class SmallestEntryPart:
  """The smallest |g|∞ of a window's micro-gradients: its zero is +inf."""

  combine: parts.Combine = "max"  # not read: one device here

  def zero(self) -> jax.Array:
    return jnp.full((), jnp.inf, jnp.float32)

  def add(self, smallest: jax.Array, micro_batch: parts.MicroBatch) -> Any:
    entry = jnp.max(jnp.abs(micro_batch.grads))
    return jnp.where(micro_batch.counts, jnp.minimum(smallest, entry), smallest)

  def close(self, smallest: jax.Array, closing: parts.Closing) -> jax.Array:
    del closing
    return smallest


def test_a_window_restarts_a_part_at_its_own_zero():
  windowing = parts.Windowing(SmallestEntryPart())
  params = jnp.zeros(2)
  value = windowing.init(parts.OnThisDevice(), params)
  for grad in ([3.0, -1.0], [0.5, 2.0]):
    micro_batch = parts.MicroBatch.whole(jnp.asarray(grad), 1.0)
    value = windowing.add(value, micro_batch)
  closing = parts.WindowClosing(
    params, jnp.float32(2.0), parts.OnThisDevice(), (None, None)
  )
  value, report = windowing.close(value, closing)
  assert float(report) == 2.0 and float(value.last) == 2.0
  value = windowing.restart(value)
  # A sum's zero would make the next window's smallest entry 0.
  assert float(value.open) == np.inf
  value = windowing.add(
    value, parts.MicroBatch.whole(jnp.asarray([4.0, 1.0]), 1.0)
  )
  assert float(value.open) == 4.0
