"""dynamic_loss_scale: PyTorch AMP GradScaler semantics, one scale per window.

The model computes in float16 from float32 master params (the loss itself
in float32), as mixed-precision training does. The references never run
ga_optax: PyTorch's GradScaler written out step by step (scale the loss,
take the gradient, check it, unscale it, step the bare optimizer or skip
the step, update the scale), either on each window's large batch or, where
float16 overflow is what drives the scale, on the window's micro-batches
as accumulation computes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax

IN, HIDDEN, OUT = 4, 8, 2
DEVICES = 8
Batch = dict[str, np.ndarray]
Window = list[Batch]


class Scaler(NamedTuple):
  """The arguments of dynamic_loss_scale, and of the reference."""

  initial_scale: float = 2.0**10
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  growth_interval: int = 2

  def transformation(
    self, inner: optax.GradientTransformation
  ) -> optax.GradientTransformationExtraArgs:
    return ga_optax.mixed_precision.dynamic_loss_scale(inner, **self._asdict())


def init_params(seed: int = 0) -> dict[str, jax.Array]:
  """float32 master params."""
  keys = jax.random.split(jax.random.key(seed), 2)
  return {
    "w1": jax.random.normal(keys[0], (IN, HIDDEN)) / 2,
    "b1": jnp.full((HIDDEN,), 0.1, jnp.float32),
    "w2": jax.random.normal(keys[1], (HIDDEN, OUT)) / 3,
  }


def mean_loss(params: Any, batch: Any, compute: Any = jnp.float16) -> Any:
  """The mean squared error, the model run in ``compute``, the loss in float32."""
  low = jax.tree.map(lambda leaf: leaf.astype(compute), params)
  hidden = jnp.tanh(batch["x"].astype(compute) @ low["w1"] + low["b1"])
  errors = (hidden @ low["w2"]).astype(jnp.float32) - batch["y"]
  return jnp.mean(errors**2)


def make_windows(
  num_windows: int,
  k: int,
  rows: int,
  *,
  seed: int,
  poisoned: Sequence[tuple[int, int, int]] = (),
) -> list[Window]:
  """Windows of k micro-batches; ``(window, micro-step, row)`` get an Inf.

  An Inf in a row's input makes that micro-batch's gradient non-finite (and
  the large batch's holding it), as a bad sample would.
  """
  rng = np.random.default_rng(seed)
  windows = [
    [
      {
        "x": rng.normal(size=(rows, IN)).astype(np.float32),
        "y": rng.normal(size=(rows, OUT)).astype(np.float32),
      }
      for _ in range(k)
    ]
    for _ in range(num_windows)
  ]
  for window, micro_step, row in poisoned:
    windows[window][micro_step]["x"][row, 0] = np.inf
  return windows


def whole(window: Window) -> Batch:
  return {
    key: np.concatenate([batch[key] for batch in window]) for key in window[0]
  }


def all_finite(tree: Any) -> bool:
  return all(
    np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(tree)
  )


class ReferenceRun(NamedTuple):
  """Where the reference ends, and the scale after each of its windows."""

  params: Any
  scales: list[float]
  dropped: list[bool]


def grad_scaler_reference(
  inner: optax.GradientTransformation,
  params: Any,
  windows: list[Window],
  scaler: Scaler,
  window_grads: Callable[[Any, Window, float], Any],
) -> ReferenceRun:
  """PyTorch AMP GradScaler, one optimizer step per window, written out.

  ``window_grads(params, window, scale)`` is the window's scaled gradient.
  """
  scale, finite_in_a_row = scaler.initial_scale, 0
  opt_state = inner.init(params)
  inner_update = jax.jit(inner.update)
  scales, dropped = [], []
  for window in windows:
    grads = window_grads(params, window, scale)
    found_inf = not all_finite(grads)
    if found_inf:
      scale *= scaler.backoff_factor
      finite_in_a_row = 0
    else:
      # GradScaler multiplies by the float32 reciprocal.
      inverse = np.float32(1.0 / scale)
      unscaled = jax.tree.map(lambda grad, inv=inverse: grad * inv, grads)
      updates, opt_state = inner_update(unscaled, opt_state, params)
      params = optax.apply_updates(params, updates)
      finite_in_a_row += 1
      if finite_in_a_row == scaler.growth_interval:
        scale *= scaler.growth_factor
        finite_in_a_row = 0
    scales.append(scale)
    dropped.append(found_inf)
  return ReferenceRun(params, scales, dropped)


def large_batch_grads(compute: Any) -> Callable[[Any, Window, float], Any]:
  """The scaled gradient of the large batch: ``jax.grad`` on all its rows."""

  @jax.jit
  def scaled_grads(params: Any, batch: Batch, scale: jax.Array) -> Any:
    return jax.grad(lambda p: mean_loss(p, batch, compute) * scale)(params)

  def grads(params: Any, window: Window, scale: float) -> Any:
    return scaled_grads(params, whole(window), np.float32(scale))

  return grads


@jax.jit
def _scaled_micro_grads(params: Any, batch: Batch, scale: jax.Array) -> Any:
  return jax.grad(lambda p: mean_loss(p, batch) * scale)(params)


def micro_batch_grads(params: Any, window: Window, scale: float) -> Any:
  """The window's scaled gradient as accumulation forms it.

  Each micro-batch's mean loss times the scale, differentiated in float16;
  the gradients summed in float32 and divided by their count.
  """
  total = None
  for batch in window:
    grads = _scaled_micro_grads(params, batch, np.float32(scale))
    grads = jax.tree.map(lambda grad: np.asarray(grad, np.float32), grads)
    # Overflowed gradients add up to Inf or NaN, as they do on the device.
    with np.errstate(invalid="ignore", over="ignore"):
      total = grads if total is None else jax.tree.map(np.add, total, grads)
  return jax.tree.map(lambda grad: grad / np.float32(len(window)), total)


def assert_close(actual: Any, expected: Any, **tolerance: float) -> None:
  assert all_finite(actual)
  chex.assert_trees_all_close(actual, expected, **tolerance)


def train_step(tx: Any, fused: bool, compute: Any = jnp.float16) -> Callable:
  """One micro-step: the loss scaled by the state's scale, then accumulated."""

  def step(params, state, batch):
    scale = ga_optax.mixed_precision.loss_scale(state)
    grads = jax.grad(lambda p: mean_loss(p, batch, compute) * scale)(params)
    if fused:
      return tx.apply(params, grads, state)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def run_windows(step: Callable, params: Any, state: Any, windows: list[Window]):
  """Runs every micro-step; the scale and dropped count after each window."""
  scales, dropped = [], []
  for window in windows:
    for batch in window:
      params, state = step(params, state, batch)
    assert bool(ga_optax.emitted(state))
    scales.append(float(ga_optax.mixed_precision.loss_scale(state)))
    dropped.append(int(ga_optax.mixed_precision.dropped_windows(state)))
  return params, state, scales, dropped


K = 4
ROWS = 4  # per micro-batch
# growth_interval=2 from 2**10: windows 0 and 1 grow the scale, window 2 (an
# Inf in one micro-batch) is dropped and backs it off, 3 and 4 grow it.
POISONED = ((2, 1, 3),)
EXPECTED_SCALES = [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11]
ADAM = optax.adam(1e-2)
# float16 compute rounds the micro-batches' products otherwise than the
# large batch's (gradients about 1e-3 apart, relative; the params 1e-5
# apart after these windows); float32 only reorders sums. Adam moves the
# params by about 0.04.
TOLERANCE = {
  "float32": {"rtol": 1e-5, "atol": 1e-6},
  "float16": {"rtol": 1e-3, "atol": 1e-4},
}


@pytest.mark.parametrize(
  ("compute", "fused"),
  [("float16", False), ("float32", True)],
  ids=["float16-update", "float32-apply"],
)
def test_windows_equal_grad_scaler_on_the_large_batch(compute, fused):
  windows = make_windows(5, K, ROWS, seed=0, poisoned=POISONED)
  scaler = Scaler()
  inner = scaler.transformation(ADAM)
  make = ga_optax.accumulate_and_apply if fused else ga_optax.accumulate
  tx = make(inner, K)
  params = init_params()
  step = jax.jit(train_step(tx, fused, jnp.dtype(compute)))
  final, state, scales, dropped = run_windows(
    step, params, tx.init(params), windows
  )

  reference = grad_scaler_reference(
    ADAM, params, windows, scaler, large_batch_grads(jnp.dtype(compute))
  )
  assert reference.scales == EXPECTED_SCALES
  assert reference.dropped == [False, False, True, False, False]
  assert scales == reference.scales
  assert dropped == [0, 0, 1, 1, 1]
  assert_close(final, reference.params, **TOLERANCE[compute])
  # The dropped window did not step Adam: 4 steps in 5 windows.
  adam_state = state.inner_state.inner_state[0]
  assert int(adam_state.count) == 4
  # accumulate counts the dropped window as an applied update.
  assert int(ga_optax.applied_updates(state)) == 5


def test_overflow_backs_off_like_grad_scaler_under_accumulation():
  """float16 overflow, not a bad sample: the scale settles below it.

  From 2**20 the micro-batches' float16 backward pass overflows: the first
  windows are dropped and the scale halves until it fits; growing it again
  overflows again, the saw-tooth of dynamic loss scaling.
  """
  windows = make_windows(12, 2, 4, seed=1)
  scaler = Scaler(initial_scale=2.0**20, growth_interval=3)
  inner = optax.sgd(0.05, momentum=0.5)
  tx = ga_optax.accumulate(scaler.transformation(inner), 2)
  params = init_params(seed=1)
  step = jax.jit(train_step(tx, fused=False))
  final, _, scales, dropped = run_windows(
    step, params, tx.init(params), windows
  )

  reference = grad_scaler_reference(
    inner, params, windows, scaler, micro_batch_grads
  )
  assert scales == reference.scales
  assert dropped == list(np.cumsum(reference.dropped))
  # The run drops windows at first, grows the scale and drops again.
  assert reference.dropped[:2] == [True, True]
  assert np.any(np.diff(reference.scales) > 0)
  assert sum(reference.dropped[4:]) >= 1
  assert_close(final, reference.params, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("placement", ["alone", "accumulate_k1"])
def test_in_step_micro_batching_with_a_loss_scale(placement):
  """microbatched_value_and_grad on the scaled loss, then the loss scale."""
  windows = make_windows(5, K, ROWS, seed=2, poisoned=POISONED)
  scaler = Scaler()
  inner = scaler.transformation(ADAM)
  tx = ga_optax.accumulate(inner, 1) if placement == "accumulate_k1" else inner
  value_and_grad = ga_optax.microbatched_value_and_grad(
    lambda p, batch, scale: mean_loss(p, batch, jnp.float32) * scale, K
  )

  @jax.jit
  def step(params, state, batch):
    _, grads = value_and_grad(
      params, batch, ga_optax.mixed_precision.loss_scale(state)
    )
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = init_params()
  state = tx.init(params)
  final, scales = params, []
  for window in windows:
    # Micro-batch i of the scan is rows i::K: the window's order.
    batch = {
      key: np.stack([b[key] for b in window], 1).reshape(-1, v.shape[-1])
      for key, v in window[0].items()
    }
    final, state = step(final, state, batch)
    scales.append(float(ga_optax.mixed_precision.loss_scale(state)))

  reference = grad_scaler_reference(
    ADAM, params, windows, scaler, large_batch_grads(jnp.float32)
  )
  assert scales == reference.scales == EXPECTED_SCALES
  assert int(ga_optax.mixed_precision.dropped_windows(state)) == 1
  assert_close(final, reference.params, **TOLERANCE["float32"])


# Several devices: one device's micro-batch overflows, every device drops.

MULTI_DEVICE_POISON = ((1, 1, 2 * 5 + 1),)  # a row of device 5's share


def assert_devices_agree(tree: Any) -> None:
  """Every device holds the same value of every replicated leaf."""
  for leaf in jax.tree.leaves(tree):
    shards = [np.asarray(shard.data) for shard in leaf.addressable_shards]
    if leaf.sharding.is_fully_replicated:
      for shard in shards[1:]:
        np.testing.assert_array_equal(shard, shards[0])


def multi_device_reference(inner, params, windows, scaler):
  return grad_scaler_reference(
    inner, params, windows, scaler, large_batch_grads(jnp.float16)
  )


def test_shard_map_every_device_drops_the_window():
  windows = make_windows(
    3, 2, 2 * DEVICES, seed=3, poisoned=MULTI_DEVICE_POISON
  )
  scaler = Scaler(growth_interval=1)
  tx = ga_optax.accumulate(scaler.transformation(ADAM), 2, axis_name="data")
  mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))
  step = jax.jit(
    jax.shard_map(
      train_step(tx, fused=False),
      mesh=mesh,
      in_specs=(P(), P(), P("data")),
      out_specs=(P(), P()),
      check_vma=False,
    )
  )
  params = init_params()
  state = tx.init(params)
  final, scales = params, []
  for window in windows:
    for batch in window:
      batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
      final, state = step(final, state, batch)
      # With check_vma=False each device hands back its own copy: they
      # must be the same (the accumulator aside: each device's own sum).
      assert_devices_agree((final, state.inner_state))
    scales.append(float(ga_optax.mixed_precision.loss_scale(state)))

  reference = multi_device_reference(ADAM, params, windows, scaler)
  assert reference.dropped == [False, True, False]
  assert scales == reference.scales == [2.0**11, 2.0**10, 2.0**11]
  assert int(ga_optax.mixed_precision.dropped_windows(state)) == 1
  assert_close(final, reference.params, **TOLERANCE["float16"])


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize("zero", [False, True], ids=["replicated", "zero1"])
def test_unreduced_axes_every_device_drops_the_window(zero):
  windows = make_windows(
    3, 2, 2 * DEVICES, seed=3, poisoned=MULTI_DEVICE_POISON
  )
  scaler = Scaler(growth_interval=1)
  tx = ga_optax.accumulate(
    scaler.transformation(ADAM),
    2,
    unreduced_axes="data",
    inner_state_axes="data" if zero else None,
  )
  value_and_grad = ga_optax.unreduced_value_and_grad(
    lambda p, batch, scale: mean_loss(p, batch) * scale
  )

  @jax.jit
  def step(params, state, batch):
    _, grads = value_and_grad(
      params, batch, ga_optax.mixed_precision.loss_scale(state)
    )
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    params = jax.device_put(init_params(), P())
    state = jax.jit(tx.init)(params)
    final, scales = params, []
    for window in windows:
      for batch in window:
        final, state = step(final, state, jax.device_put(batch, P("data")))
        assert_devices_agree((final, state.inner_state))
      scales.append(float(ga_optax.mixed_precision.loss_scale(state)))

  reference = multi_device_reference(ADAM, init_params(), windows, scaler)
  assert reference.dropped == [False, True, False]
  assert scales == reference.scales
  assert int(ga_optax.mixed_precision.dropped_windows(state)) == 1
  assert_close(jax.device_get(final), reference.params, **TOLERANCE["float16"])


# The transformation on its own.


def test_a_dropped_step_leaves_the_optimizer_and_backs_off():
  inner = optax.adam(0.1)
  tx = ga_optax.mixed_precision.dynamic_loss_scale(
    inner, initial_scale=4.0, growth_interval=3, min_scale=2.0
  )
  update = jax.jit(tx.update)
  params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  state = tx.init(params)
  good = {"w": jnp.full(3, 4.0), "b": jnp.full(2, 8.0)}  # 1 and 2 unscaled
  _, state = update(good, state, params)
  bad = {"w": jnp.array([1.0, jnp.nan, 1.0]), "b": jnp.zeros(2)}
  updates, dropped = update(bad, state, params)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
  chex.assert_trees_all_equal(dropped.inner_state, state.inner_state)
  assert float(dropped.scale) == 2.0
  assert int(dropped.finite_windows) == 0
  assert int(dropped.dropped_windows) == 1
  # min_scale is a floor.
  _, floor = update(bad, dropped, params)
  assert float(floor.scale) == 2.0
  assert int(floor.dropped_windows) == 2
  # A finite step is the bare optimizer's on the unscaled gradient.
  updates, _ = update(good, state, params)
  expected, _ = jax.jit(inner.update)(
    {"w": jnp.ones(3), "b": jnp.full(2, 2.0)}, state.inner_state, params
  )
  chex.assert_trees_all_equal(updates, expected)


def test_the_scale_grows_only_while_it_stays_finite():
  largest = float(jnp.finfo(jnp.float32).max)
  tx = ga_optax.mixed_precision.dynamic_loss_scale(
    optax.sgd(1.0), initial_scale=largest, growth_interval=1
  )
  params = jnp.zeros(2)
  _, state = tx.update(jnp.ones(2), tx.init(params), params)
  assert float(state.scale) == largest
  assert int(state.finite_windows) == 0


def test_float16_gradients_are_unscaled_into_float16():
  """All-float16 params: the quotient is rounded to float16 once.

  An unscaled gradient that float16 cannot hold (a scale below 1) is not
  finite: the window is dropped rather than handed to the optimizer.
  """
  params = jnp.zeros(2, jnp.float16)
  grads = jnp.array([0.03, 60000.0], jnp.float16)
  for scale, dropped in [(2.0**15, 0), (2.0**-10, 1)]:
    tx = ga_optax.accumulate(
      ga_optax.mixed_precision.dynamic_loss_scale(
        optax.sgd(1.0), initial_scale=scale, min_scale=2.0**-10
      ),
      2,
    )
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    updates, state = tx.update(grads, state, params)
    assert updates.dtype == jnp.float16
    assert int(ga_optax.mixed_precision.dropped_windows(state)) == dropped
    expected = -(np.asarray(grads, np.float32) / np.float32(scale))
    if not dropped:
      np.testing.assert_array_equal(updates, expected.astype(np.float16))
    else:
      np.testing.assert_array_equal(updates, np.zeros(2, np.float16))


def test_the_accumulator_must_be_wide_enough_for_the_window_sum():
  """A float16 accumulator overflows on a sum no micro-batch overflowed."""
  # The CPU cannot fail this test: it never keeps a float16 value in float32
  # between ops. XLA:GPU may (excess precision, on by default), and there a
  # window sum of 4 x 30000 read finite to isfinite and was not dropped (H100);
  # loss_scaling._all_finite compares with float16's largest value instead.
  # Only a GPU run guards that fix.
  grads = jnp.full(2, 30000.0, jnp.float16)  # a scaled float16 gradient
  params = jnp.zeros(2, jnp.float16)
  for accumulator_dtype, dropped in [(jnp.float32, 0), (jnp.float16, 1)]:
    tx = ga_optax.accumulate(
      ga_optax.mixed_precision.dynamic_loss_scale(optax.sgd(1.0)),
      4,
      accumulator_dtype=accumulator_dtype,
    )
    state = tx.init(params)
    for _ in range(4):
      updates, state = tx.update(grads, state, params)
    assert int(ga_optax.mixed_precision.dropped_windows(state)) == dropped, (
      accumulator_dtype
    )
    assert all_finite(updates)


def test_a_summed_float16_window_overflows_as_the_large_batch_does():
  """reduction="sum" casts the window's sum back to float16 gradients."""
  # The CPU cannot fail this test: it never keeps a float16 value in float32
  # between ops. XLA:GPU may (excess precision, on by default), and there a
  # window sum of 4 x 30000 read finite to isfinite and was not dropped (H100);
  # loss_scaling._all_finite compares with float16's largest value instead.
  # Only a GPU run guards that fix.
  grads = jnp.full(2, 30000.0, jnp.float16)
  params = jnp.zeros(2, jnp.float16)
  for reduction, dropped in [("mean", 0), ("sum", 1)]:
    tx = ga_optax.accumulate(
      ga_optax.mixed_precision.dynamic_loss_scale(optax.sgd(1.0)),
      4,
      reduction=reduction,
    )
    state = tx.init(params)
    for _ in range(4):
      _, state = tx.update(grads, state, params)
    assert int(ga_optax.mixed_precision.dropped_windows(state)) == dropped, (
      reduction
    )


def noise_scale_of_windows(
  windows: Sequence[np.ndarray], decay: float
) -> ga_optax.NoiseScale:
  """The noise scale of plain float32 windows, no loss scale anywhere."""
  tx = ga_optax.accumulate(
    optax.sgd(0.0), len(windows[0]), noise_scale_decay=decay
  )
  params = jnp.zeros(windows[0].shape[1:])
  state = tx.init(params)
  for window in windows:
    for grad in window:
      _, state = tx.update(jnp.asarray(grad, jnp.float32), state, params)
  return ga_optax.noise_scale(state)


def assert_same_noise_scale(got: Any, want: Any) -> None:
  assert int(got.windows) == int(want.windows)
  for field in ("b_simple", "grad_sq", "trace_sigma"):
    value = float(getattr(got, field))
    assert np.isfinite(value), field
    np.testing.assert_allclose(
      value, float(getattr(want, field)), rtol=1e-5, err_msg=field
    )


def test_the_noise_scale_is_in_the_gradients_own_units():
  """The window divides the loss scale out, even as it moves every window."""
  rng = np.random.default_rng(4)
  windows = rng.normal(1.0, 1.0, size=(4, 3, 5)).astype(np.float32)
  tx = ga_optax.accumulate(
    ga_optax.mixed_precision.dynamic_loss_scale(
      optax.sgd(0.0), initial_scale=2.0**10, growth_interval=1
    ),
    3,
    noise_scale_decay=0.5,
  )
  params = jnp.zeros(5)
  state = tx.init(params)
  scales = []
  for window in windows:
    scales.append(float(ga_optax.mixed_precision.loss_scale(state)))
    for grad in window:
      scaled = ga_optax.mixed_precision.loss_scale(state) * jnp.asarray(grad)
      _, state = tx.update(scaled, state, params)
  assert scales == [2.0**10, 2.0**11, 2.0**12, 2.0**13]
  assert_same_noise_scale(
    ga_optax.noise_scale(state), noise_scale_of_windows(windows, 0.5)
  )


def test_a_dropped_window_does_not_enter_the_noise_scale():
  """Even one whose sums are finite: float16 gradients that overflow only
  once unscaled (a scale below 1). The scale backs off from 2**-10 to
  2**-11 after it; quarters times those scales, and the means of 4 of them,
  are exact in float16."""
  rng = np.random.default_rng(5)
  kept = (rng.integers(4, 17, size=(2, 4, 4)) / 4).astype(np.float32)
  overflowing = np.full((4, 4), 60000.0, np.float32)
  tx = ga_optax.accumulate(
    ga_optax.mixed_precision.dynamic_loss_scale(
      optax.sgd(0.0),
      initial_scale=2.0**-10,
      min_scale=2.0**-12,
      growth_interval=100,
    ),
    4,
    noise_scale_decay=0.5,
  )
  params = jnp.zeros(4, jnp.float16)
  state = tx.init(params)
  for window in (kept[0], overflowing / 2.0**-10, kept[1]):
    scale = float(ga_optax.mixed_precision.loss_scale(state))
    for grad in window:
      scaled = jnp.asarray(grad * scale, jnp.float16)
      assert bool(jnp.all(jnp.isfinite(scaled)))
      _, state = tx.update(scaled, state, params)
  assert int(ga_optax.mixed_precision.dropped_windows(state)) == 1
  assert float(ga_optax.mixed_precision.loss_scale(state)) == 2.0**-11
  assert_same_noise_scale(
    ga_optax.noise_scale(state), noise_scale_of_windows(kept, 0.5)
  )


@pytest.mark.parametrize(
  "make", [ga_optax.accumulate, ga_optax.accumulate_and_apply]
)
def test_skip_nonfinite_around_a_loss_scale_is_refused_at_init(make):
  # Every overflowing micro-step would be dropped before the window saw it:
  # the scale would never back off, and nothing would be applied.
  for inner in (
    ga_optax.mixed_precision.dynamic_loss_scale(optax.sgd(1.0)),
    optax.chain(
      optax.clip(1.0),
      ga_optax.mixed_precision.dynamic_loss_scale(optax.sgd(1.0)),
    ),
  ):
    tx = make(inner, 2, skip_nonfinite=True)
    with pytest.raises(ValueError, match="skip_nonfinite=True") as raised:
      tx.init(jnp.zeros(2))
    assert "dynamic_loss_scale" in str(raised.value)
  # Either alone is fine.
  make(ga_optax.mixed_precision.dynamic_loss_scale(optax.sgd(1.0)), 2).init(
    jnp.zeros(2)
  )
  make(optax.sgd(1.0), 2, skip_nonfinite=True).init(jnp.zeros(2))


# Scales above float16's range: 2**16 is already inf in float16, and the
# default 2**15 reaches it after one growth.


def test_float16_gradients_unscaled_by_a_scale_above_float16s_range():
  grads = jnp.array([2.0**15, 2.0**10], jnp.float16)
  params = jnp.zeros(2, jnp.float16)
  tx = ga_optax.mixed_precision.dynamic_loss_scale(
    optax.sgd(1.0), initial_scale=2.0**16
  )
  updates, state = tx.update(grads, tx.init(params), params)
  assert updates.dtype == jnp.float16
  np.testing.assert_array_equal(
    updates, np.array([-0.5, -(2.0**-6)], np.float16)
  )
  assert int(state.dropped_windows) == 0


def test_a_scale_growing_past_65504_keeps_the_updates_exact():
  rng = np.random.default_rng(6)
  # Multiples of 2**-8 up to 2**-4: times 2**18 at most 2**14, and their
  # means multiples of 2**-9, all exact in float16.
  windows = rng.integers(-16, 17, size=(4, 2, 3)) / 2.0**8
  params = jnp.zeros(3, jnp.float16)
  tx = ga_optax.accumulate(
    ga_optax.mixed_precision.dynamic_loss_scale(
      optax.sgd(1.0), growth_interval=1
    ),
    2,
  )
  state = tx.init(params)
  scales = []
  for window in windows:
    scales.append(float(ga_optax.mixed_precision.loss_scale(state)))
    for grad in window:
      scaled = jnp.asarray(grad * scales[-1], jnp.float16)
      updates, state = tx.update(scaled, state, params)
    assert updates.dtype == jnp.float16
    np.testing.assert_array_equal(
      updates, (-window.mean(axis=0)).astype(np.float16)
    )
  assert scales == [2.0**15, 2.0**16, 2.0**17, 2.0**18]
  assert int(ga_optax.mixed_precision.dropped_windows(state)) == 0


def test_readers_find_the_state_anywhere():
  tx = optax.chain(
    optax.clip(1.0),
    ga_optax.accumulate(
      ga_optax.mixed_precision.dynamic_loss_scale(optax.sgd(0.1)), 2
    ),
  )
  state = tx.init(jnp.zeros(2))
  assert float(ga_optax.mixed_precision.loss_scale(state)) == 2.0**15
  assert int(ga_optax.mixed_precision.dropped_windows(state)) == 0
  with pytest.raises(ValueError, match="exactly one DynamicLossScaleState"):
    ga_optax.mixed_precision.loss_scale(optax.adam(0.1).init(jnp.zeros(2)))
  twice = (state, state)
  with pytest.raises(ValueError, match="found 2"):
    ga_optax.mixed_precision.dropped_windows(twice)
  with pytest.raises(TypeError, match="DynamicLossScaleState"):
    ga_optax.mixed_precision.dynamic_loss_scale(optax.sgd(0.1)).update(
      jnp.zeros(2), optax.sgd(0.1).init(jnp.zeros(2))
    )


@pytest.mark.parametrize(
  ("arguments", "error", "match"),
  [
    ({"initial_scale": "big"}, TypeError, "initial_scale"),
    ({"initial_scale": True}, TypeError, "initial_scale"),
    ({"initial_scale": 1e39}, ValueError, "initial_scale.*float32"),
    ({"initial_scale": 0.5}, ValueError, "initial_scale.*min_scale"),
    ({"growth_factor": 0.5}, ValueError, "growth_factor"),
    ({"backoff_factor": 0.0}, ValueError, "backoff_factor"),
    ({"backoff_factor": 2.0}, ValueError, "backoff_factor"),
    ({"growth_interval": 0}, ValueError, "growth_interval"),
    ({"growth_interval": 2.0}, TypeError, "growth_interval"),
    ({"min_scale": -1.0}, ValueError, "min_scale"),
    ({"min_scale": float("nan")}, ValueError, "min_scale"),
  ],
)
def test_bad_arguments_name_themselves(arguments, error, match):
  with pytest.raises(error, match=match):
    ga_optax.mixed_precision.dynamic_loss_scale(optax.sgd(0.1), **arguments)


def test_the_optimizer_must_be_a_transformation():
  with pytest.raises(TypeError, match="optimizer"):
    ga_optax.mixed_precision.dynamic_loss_scale(lambda grads: grads)  # type: ignore[arg-type]
