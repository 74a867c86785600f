"""The gradient noise scale measured from the window, against NumPy and theory.

Two kinds of evidence. Exactness: for fixed micro-gradients and weights the
smoothed estimates equal a NumPy implementation of the contract (the weighted
per-window formulas, the exponential moving average, the debiasing, windows
of fewer than 2 micro-gradients left out, skipped micro-steps left out), on
one device (complex leaves too), inside ``shard_map`` with ``check_vma`` both
ways, and under plain ``jit`` with ``unreduced_axes`` on one mesh axis and on
two. Truth: for linear least squares with Gaussian inputs at frozen
parameters the noise scale is known in closed form, and the estimate must
land on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
  SGD,
  assert_finite_and_close,
  init_params,
  large_batch_reference,
  make_windows,
  micro_steps,
  token_mean_loss,
)
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from mesh_layouts import put, run_steps, unreduced_step

import ga_optax
from ga_optax._src.placements import axes as axes_lib

DEVICES = 8
DECAY = 0.8


def numpy_noise_scale(windows, decay):
  """The contract in NumPy: windows of (flat gradient, weight) pairs."""
  grad_sq = trace_sigma = debias = 0.0
  measured = 0
  for window in windows:
    kept = [(g, w) for g, w in window if w > 0]
    if len(kept) < 2:
      continue
    count = len(kept)
    weight = sum(w for _, w in kept)
    mean = sum(w * g for g, w in kept) / weight
    squares = sum(w * square_norm(g) for g, w in kept)
    window_trace = (squares - weight * square_norm(mean)) / (count - 1)
    window_grad_sq = square_norm(mean) - window_trace / weight
    grad_sq = decay * grad_sq + (1 - decay) * window_grad_sq
    trace_sigma = decay * trace_sigma + (1 - decay) * window_trace
    debias = decay * debias + (1 - decay)
    measured += 1
  return grad_sq / debias, trace_sigma / debias, measured


def square_norm(vector: np.ndarray) -> float:
  """``|v|^2``: the sum of ``|v_i|^2``, real for complex entries too."""
  return float(np.vdot(vector, vector).real)


def flat(tree) -> np.ndarray:
  return np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(tree)])


def assert_estimate(state, expected_grad_sq, expected_trace, windows):
  estimate = ga_optax.noise_scale(state)
  assert int(estimate.windows) == windows
  np.testing.assert_allclose(
    float(estimate.grad_sq), expected_grad_sq, rtol=2e-5
  )
  np.testing.assert_allclose(
    float(estimate.trace_sigma), expected_trace, rtol=2e-5
  )
  np.testing.assert_allclose(
    float(estimate.b_simple),
    numpy_b_simple(expected_grad_sq, expected_trace),
    rtol=5e-5,
  )


def numpy_b_simple(grad_sq: float, trace_sigma: float) -> float:
  """The reading: |G|^2 <= 0 is larger than any batch, tr(Sigma) <= 0 no noise."""
  if grad_sq <= 0:
    return np.inf
  return trace_sigma / grad_sq if trace_sigma > 0 else 0.0


def random_grads(rng, count):
  return [
    {
      "w": rng.normal(size=(3, 2)).astype(np.float32),
      "b": rng.normal(size=2).astype(np.float32),
    }
    for _ in range(count)
  ]


# Window lengths closed by flush; a length-1 window is not measured; the
# weights include zeros (not counted) and a NaN micro-step (skipped).
LENGTHS = (3, 1, 4, 2)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("path", ["accumulate", "accumulate_and_apply"])
def test_one_device_matches_numpy(jit, path):
  rng = np.random.default_rng(0)
  grads = random_grads(rng, sum(LENGTHS) + 1)
  weights = [3.0, 0.0, 5.0, 2.0, 1.0, 4.0, 0.0, 2.0, 7.0, 6.0, 1.0]
  nan_at = 4  # inside the third window: dropped whole
  grads[nan_at]["w"][0, 0] = np.nan
  params = jax.tree.map(np.zeros_like, grads[0])
  options = {"skip_nonfinite": True, "noise_scale_decay": DECAY}
  if path == "accumulate":
    tx = ga_optax.accumulate(optax.sgd(0.1), 100, **options)

    def step(grad, state, weight, flush):
      return tx.update(grad, state, params, weight=weight, flush=flush)[1]

  else:
    fused = ga_optax.accumulate_and_apply(optax.sgd(0.1), 100, **options)
    tx = fused

    def step(grad, state, weight, flush):
      return fused.apply(params, grad, state, weight=weight, flush=flush)[1]

  step = jax.jit(step) if jit else step
  state = tx.init(params)
  windows, index = [], 0
  for length in LENGTHS:
    window = []
    kept = 0
    while kept < length:
      state = step(grads[index], state, weights[index], kept == length - 1)
      if index != nan_at:
        window.append((flat(grads[index]), weights[index]))
        kept += 1
      index += 1
    windows.append(window)
  grad_sq, trace, measured = numpy_noise_scale(windows, DECAY)
  assert measured == 3
  assert int(ga_optax.num_skipped(state)) == 1
  assert_estimate(state, grad_sq, trace, measured)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_complex_params_count_the_modulus_squared(jit):
  # A complex leaf beside a real one: |g|^2 is the sum of |z|^2 = z conj(z),
  # not of z^2, whose real part Re(z)^2 - Im(z)^2 can be anything.
  rng = np.random.default_rng(3)
  grads = [
    {
      "z": (rng.normal(size=(3, 2)) + 1j * rng.normal(size=(3, 2))).astype(
        np.complex64
      ),
      "b": rng.normal(size=2).astype(np.float32),
    }
    for _ in range(sum(LENGTHS))
  ]
  weights = [3.0, 1.0, 5.0, 2.0, 4.0, 0.0, 6.0, 2.0, 7.0, 1.0]
  params = jax.tree.map(np.zeros_like, grads[0])
  tx = ga_optax.accumulate(optax.sgd(0.1), 100, noise_scale_decay=DECAY)

  def step(grad, state, weight, flush):
    return tx.update(grad, state, params, weight=weight, flush=flush)[1]

  step = jax.jit(step) if jit else step
  state = tx.init(params)
  assert state.accumulator["z"].dtype == np.complex64
  windows, index = [], 0
  for length in LENGTHS:
    window = []
    for position in range(length):
      state = step(grads[index], state, weights[index], position == length - 1)
      window.append((flat(grads[index]), weights[index]))
      index += 1
    windows.append(window)
  grad_sq, trace, measured = numpy_noise_scale(windows, DECAY)
  # The window of one micro-gradient is not measured.
  assert measured == len(LENGTHS) - 1
  assert np.isfinite([grad_sq, trace]).all()
  assert_estimate(state, grad_sq, trace, measured)


def test_before_a_window_closes_the_estimate_is_nan():
  tx = ga_optax.accumulate(optax.sgd(0.1), 3, noise_scale_decay=0.9)
  params = jnp.zeros(2)
  state = tx.init(params)
  _, state = tx.update(jnp.ones(2), state, params)
  estimate = ga_optax.noise_scale(state)
  assert int(estimate.windows) == 0
  assert np.isnan(float(estimate.b_simple))


def test_decay_zero_keeps_the_last_window():
  tx = ga_optax.accumulate(optax.sgd(0.0), 2, noise_scale_decay=0.0)
  params = jnp.zeros(2)
  state = tx.init(params)
  window_grads = ([1.0, 1.0], [3.0, 1.0], [0.0, 2.0], [2.0, -2.0])
  for grad in window_grads:
    _, state = tx.update(jnp.array(grad), state, params)
  last = [(np.array(g, np.float32), 1.0) for g in window_grads[2:]]
  grad_sq, trace, _ = numpy_noise_scale([last], 0.0)
  assert_estimate(state, grad_sq, trace, 2)


def test_without_a_decay_the_state_holds_nothing_more():
  params = {"w": jnp.zeros(3)}
  plain = ga_optax.accumulate(optax.adam(0.1), 2)
  state = plain.init(params)
  assert not jax.tree.leaves(state.parts)
  measured = ga_optax.accumulate(optax.adam(0.1), 2, noise_scale_decay=0.9)
  extra = len(jax.tree.leaves(measured.init(params))) - len(
    jax.tree.leaves(state)
  )
  # Three sums of the open window (sum w |g|^2, K, W), four averages.
  assert extra == 7
  with pytest.raises(ValueError, match="noise_scale_decay"):
    ga_optax.noise_scale(state)


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    ({"noise_scale_decay": 1.0}, ValueError, "noise_scale_decay"),
    ({"noise_scale_decay": -0.1}, ValueError, "noise_scale_decay"),
    ({"noise_scale_decay": "0.9"}, TypeError, "noise_scale_decay"),
    ({"noise_scale_decay": True}, TypeError, "noise_scale_decay"),
    ({"noise_scale_decay": 0.9, "reduction": "sum"}, ValueError, "reduction"),
  ],
)
def test_bad_configuration_names_the_argument(kwargs, error, match):
  with pytest.raises(error, match=match):
    ga_optax.accumulate(optax.sgd(0.1), 2, **kwargs)


def mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((DEVICES,), ("data",))


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize("check_vma", [False, True])
def test_shard_map_counts_every_device_micro_gradient(check_vma):
  rng = np.random.default_rng(1)
  k, windows_count = 3, 2
  grads = rng.normal(size=(windows_count * k, DEVICES, 4)).astype(np.float32)
  weights = rng.integers(0, 4, size=(windows_count * k, DEVICES)).astype(
    np.float32
  )
  tx = ga_optax.accumulate(
    optax.sgd(0.1), k, axis_name="data", noise_scale_decay=DECAY
  )
  params = jnp.zeros(4)

  if check_vma:
    # Gradients arrive the same on every device (as autodiff sums them);
    # the micro-gradient is the gradient over D, of the micro-step's weight.
    def local(state, grad, weight):
      return tx.update(grad[0], state, params, weight=weight[0])[1]

    in_specs = (P(), P(), P())
    feeds = [(grads[i, 0], weights[i, :1]) for i in range(len(grads))]
    expected_windows = [
      [
        (grads[i, 0] / DEVICES, weights[i, 0])
        for i in range(w * k, (w + 1) * k)
      ]
      for w in range(windows_count)
    ]
  else:

    def local(state, grad, weight):
      return tx.update(grad[0], state, params, weight=weight[0])[1]

    in_specs = (P(), P("data"), P("data"))
    feeds = [(grads[i], weights[i]) for i in range(len(grads))]
    expected_windows = [
      [
        (grads[i, d], weights[i, d])
        for i in range(w * k, (w + 1) * k)
        for d in range(DEVICES)
      ]
      for w in range(windows_count)
    ]
  step = jax.jit(
    jax.shard_map(
      local, mesh=mesh(), in_specs=in_specs, out_specs=P(), check_vma=check_vma
    )
  )
  with jax.set_mesh(mesh()):
    state = jax.device_put(tx.init(params), P())
    for grad, weight in feeds:
      spec = P() if check_vma else P("data")
      grad = jax.device_put(grad[None] if check_vma else grad, spec)
      state = step(state, grad, jax.device_put(weight, spec))
  grad_sq, trace, measured = numpy_noise_scale(expected_windows, DECAY)
  assert_estimate(state, grad_sq, trace, measured)


@pytest.mark.devices(DEVICES)
def test_unreduced_partial_sums_are_micro_gradients_of_equal_weight():
  rng = np.random.default_rng(2)
  k, windows_count = 2, 3
  partials = rng.normal(size=(windows_count * k, DEVICES, 4)).astype(np.float32)
  weights = rng.integers(1, 9, size=windows_count * k).astype(np.float32)
  with jax.set_mesh(mesh()):
    tx = ga_optax.accumulate(
      optax.sgd(0.1), k, unreduced_axes="data", noise_scale_decay=DECAY
    )
    params = jax.device_put(jnp.zeros(4), P())
    state = tx.init(params)

    @jax.jit
    def step(state, stacked, weight):
      grads = axes_lib.sum_to_unreduced(stacked, params, ("data",))
      return tx.update(grads, state, params, weight=weight)[1]

    for partial, weight in zip(partials, weights, strict=True):
      state = step(state, jax.device_put(partial, P("data")), weight)
  expected_windows = [
    [
      (DEVICES * partials[i, d], weights[i] / DEVICES)
      for i in range(w * k, (w + 1) * k)
      for d in range(DEVICES)
    ]
    for w in range(windows_count)
  ]
  grad_sq, trace, measured = numpy_noise_scale(expected_windows, DECAY)
  assert_estimate(state, grad_sq, trace, measured)


# A 4 x 2 mesh, the batch over "data", two leaves sharded over "model" and
# two replicated on it: a data device's partial sum of a replicated leaf is
# held whole by both of its model devices, and is one micro-gradient.
TWO_AXES = {"data": 4, "model": 2}
TWO_AXES_SPECS = {
  "w": P(None, "model"),
  "b": P(),
  "scale": P("model"),
  "w2": P(),
}
TWO_AXES_K = 3
TWO_AXES_LENGTHS = (3, 2, 3)  # the second window closed by a flush
TWO_AXES_ROWS = 2  # per data device and micro-step


_token_mean_grad = jax.jit(jax.grad(token_mean_loss))


def partial_sum_micro_gradients(params, batch, devices):
  """Plain jit: device d's partial sum n_d g_d / N, times D, of weight N / D.

  ``g_d`` is the gradient of the token mean over the rows device d holds;
  the rows split evenly over the D devices of the batch axes.
  """
  total = float(batch["mask"].sum())
  rows = len(batch["mask"]) // devices
  shares = [
    {name: array[rows * d : rows * (d + 1)] for name, array in batch.items()}
    for d in range(devices)
  ]
  return [
    (
      devices
      * float(share["mask"].sum())
      / total
      * flat(_token_mean_grad(params, share)),
      total / devices,
    )
    for share in shares
  ]


@pytest.mark.devices(DEVICES)
def test_unreduced_on_two_mesh_axes_counts_each_device_partial_sum_once():
  data_devices = TWO_AXES["data"]
  windows = make_windows(TWO_AXES_LENGTHS, data_devices, TWO_AXES_ROWS, seed=3)
  tx = ga_optax.accumulate(
    SGD, TWO_AXES_K, unreduced_axes="data", noise_scale_decay=DECAY
  )
  mesh = jax.make_mesh(
    tuple(TWO_AXES.values()),
    tuple(TWO_AXES),
    axis_types=(AxisType.Explicit,) * len(TWO_AXES),
  )
  with jax.set_mesh(mesh):
    params = put(init_params(), mesh, TWO_AXES_SPECS)
    params, state = run_steps(
      unreduced_step(tx, fused=False),
      params,
      jax.jit(tx.init)(params),
      micro_steps(windows, TWO_AXES_K),
    )
  assert_finite_and_close(
    params, large_batch_reference(SGD, init_params(), windows)
  )
  # Each window's micro-gradients at the params the large batch has there.
  expected_windows, reference = [], init_params()
  for window in windows:
    expected_windows.append(
      [
        pair
        for batch in window
        for pair in partial_sum_micro_gradients(reference, batch, data_devices)
      ]
    )
    reference = large_batch_reference(SGD, reference, [window])
  grad_sq, trace, measured = numpy_noise_scale(expected_windows, DECAY)
  assert measured == len(windows)
  assert_estimate(state, grad_sq, trace, measured)


# Linear least squares with x ~ N(0, I_d), y = w*.x + eps, eps ~ N(0, s^2),
# at frozen params w = w* + delta: |G|^2 = |delta|^2 and
# tr(Sigma) = (d + 1)|delta|^2 + d s^2, so B_simple = d + 1 + d s^2 / |delta|^2.
DIM, NOISE, ROWS, K, WINDOWS = 8, 0.5, 16, 4, 400


def least_squares(params, batch):
  return 0.5 * jnp.mean((batch["x"] @ params - batch["y"]) ** 2)


def closed_form(delta) -> tuple[float, float]:
  delta_sq = float(delta @ delta)
  return delta_sq, (DIM + 1) * delta_sq + DIM * NOISE**2


def regression_data(seed: int, windows: int, rows: int):
  key_x, key_noise, key_w = jax.random.split(jax.random.key(seed), 3)
  true_w = jax.random.normal(key_w, (DIM,))
  x = jax.random.normal(key_x, (windows, K, rows, DIM))
  y = x @ true_w + NOISE * jax.random.normal(key_noise, (windows, K, rows))
  return true_w, {"x": x, "y": y}


def assert_near_the_truth(state, delta):
  grad_sq, trace = closed_form(np.asarray(delta))
  estimate = ga_optax.noise_scale(state)
  assert int(estimate.windows) == WINDOWS
  assert abs(float(estimate.grad_sq) / grad_sq - 1) < 0.05, (estimate, grad_sq)
  assert abs(float(estimate.trace_sigma) / trace - 1) < 0.05, (estimate, trace)
  assert abs(float(estimate.b_simple) / (trace / grad_sq) - 1) < 0.06


def test_least_squares_lands_on_the_closed_form():
  true_w, data = regression_data(0, WINDOWS, ROWS)
  delta = jnp.full((DIM,), 0.35)
  params = true_w + delta
  tx = ga_optax.accumulate(optax.sgd(0.0), K, noise_scale_decay=0.999)

  @jax.jit
  def run(state):
    def micro_step(state, batch):
      grads = jax.grad(least_squares)(params, batch)
      return tx.update(grads, state, params, weight=ROWS)[1], None

    steps = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), data)
    return jax.lax.scan(micro_step, state, steps)[0]

  assert_near_the_truth(run(tx.init(params)), delta)


@pytest.mark.devices(DEVICES)
def test_least_squares_on_8_devices_lands_on_the_closed_form():
  rows = ROWS // 2 * DEVICES  # each device holds half a one-device micro-batch
  true_w, data = regression_data(1, WINDOWS, rows)
  delta = jnp.full((DIM,), 0.35)
  params = true_w + delta
  tx = ga_optax.accumulate(
    optax.sgd(0.0), K, axis_name="data", noise_scale_decay=0.999
  )

  def run(state, data):
    def micro_step(state, batch):
      grads = jax.grad(least_squares)(params, batch)
      weight = batch["x"].shape[0]
      return tx.update(grads, state, params, weight=weight)[1], None

    steps = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), data)
    return jax.lax.scan(micro_step, state, steps)[0]

  step = jax.jit(
    jax.shard_map(
      run,
      mesh=mesh(),
      in_specs=(P(), P(None, None, "data")),
      out_specs=P(),
      check_vma=False,
    )
  )
  with jax.set_mesh(mesh()):
    data = jax.device_put(data, P(None, None, "data"))
    state = step(tx.init(params), data)
  assert_near_the_truth(state, delta)


def regression_batch(seed: int, rows: int):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, DIM)).astype(np.float32)
  mask = (rng.random(rows) < 0.6).astype(np.float32)
  mask[0] = 1.0
  y = rng.normal(size=rows).astype(np.float32)
  return {"x": x, "y": y, "mask": mask}


def masked_least_squares(params, batch):
  errors = 0.5 * (batch["x"] @ params - batch["y"]) ** 2
  return jnp.sum(errors * batch["mask"]) / jnp.maximum(batch["mask"].sum(), 1.0)


def in_step_reference(params, pieces):
  """Each piece one micro-gradient, weighted by its real rows."""
  grad = jax.grad(masked_least_squares)
  window = [
    (np.asarray(grad(params, piece)), float(piece["mask"].sum()))
    for piece in pieces
  ]
  grad_sq, trace, _ = numpy_noise_scale([window], 0.0)
  return grad_sq, trace


def strided(batch, parts):
  return [
    {name: array[i::parts] for name, array in batch.items()}
    for i in range(parts)
  ]


def count_rows(batch):
  return batch["mask"].sum()


def test_in_step_estimates_match_numpy_and_smooth_across_steps():
  params = jnp.linspace(-1.0, 1.0, DIM)
  value_and_grad = ga_optax.microbatched_value_and_grad(
    masked_least_squares, 4, weight_fn=count_rows, noise_scale=True
  )
  averages = None
  windows = []
  for seed in range(3):
    batch = regression_batch(seed, 32)
    _, grads, estimate = jax.jit(value_and_grad)(params, batch)
    np.testing.assert_allclose(
      grads, jax.grad(masked_least_squares)(params, batch), rtol=1e-5
    )
    grad_sq, trace = in_step_reference(params, strided(batch, 4))
    np.testing.assert_allclose(
      [float(estimate.grad_sq), float(estimate.trace_sigma)],
      [grad_sq, trace],
      rtol=2e-5,
    )
    averages = ga_optax.smooth_noise_scale(averages, estimate, DECAY)
    windows.append(
      [
        (
          np.asarray(jax.grad(masked_least_squares)(params, piece)),
          float(piece["mask"].sum()),
        )
        for piece in strided(batch, 4)
      ]
    )
  grad_sq, trace, measured = numpy_noise_scale(windows, DECAY)
  assert_estimate(averages, grad_sq, trace, measured)


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize("layout", ["plain_jit", "shard_map"])
def test_in_step_estimates_count_each_device_micro_batch(layout):
  params = jnp.linspace(-1.0, 1.0, DIM)
  batch = regression_batch(5, 64)
  k = 2
  with jax.set_mesh(mesh()):
    if layout == "plain_jit":
      value_and_grad = ga_optax.microbatched_value_and_grad(
        masked_least_squares, k, weight_fn=count_rows, noise_scale=True
      )
      step = jax.jit(value_and_grad)
    else:
      value_and_grad = ga_optax.microbatched_value_and_grad(
        masked_least_squares,
        k,
        weight_fn=count_rows,
        noise_scale=True,
        axis_name="data",
      )
      step = jax.jit(
        jax.shard_map(
          value_and_grad,
          mesh=mesh(),
          in_specs=(P(), P("data")),
          out_specs=P(),
          check_vma=False,
        )
      )
    _, _, estimate = step(params, jax.device_put(batch, P("data")))
  # Device d holds rows 8d .. 8d + 7; its micro-batch i, rows i::k of them.
  pieces = [
    {name: array[8 * d : 8 * (d + 1)][i::k] for name, array in batch.items()}
    for d in range(DEVICES)
    for i in range(k)
  ]
  grad_sq, trace = in_step_reference(params, pieces)
  np.testing.assert_allclose(
    [float(estimate.grad_sq), float(estimate.trace_sigma)],
    [grad_sq, trace],
    rtol=2e-5,
  )


@pytest.mark.parametrize("path", ["accumulate", "accumulate_and_apply"])
def test_the_state_from_init_can_be_donated(path):
  params = jnp.zeros(3)
  if path == "accumulate":
    tx = ga_optax.accumulate(optax.sgd(0.1), 2, noise_scale_decay=0.9)

    def step(state, grad):
      return tx.update(grad, state, params)[1]

  else:
    tx = ga_optax.accumulate_and_apply(optax.sgd(0.1), 2, noise_scale_decay=0.9)

    def step(state, grad):
      return tx.apply(params, grad, state)[1]

  state = jax.jit(step, donate_argnums=0)(tx.init(params), jnp.ones(3))
  assert int(state.micro_step) == 1


# How the smoothed estimates are read: never a negative B_simple.


@pytest.mark.parametrize(
  ("grad_sq", "trace_sigma", "b_simple"),
  [
    (4.0, 2.0, 0.5),
    (4.0, 0.0, 0.0),  # no measurable noise
    (4.0, -1.0, 0.0),  # the same: tr(Sigma) cannot be negative
    (0.0, 2.0, np.inf),  # the gradient lost in the noise
    (-1.0, 2.0, np.inf),  # the same
    (-1.0, -1.0, np.inf),
    (0.0, 0.0, np.inf),
  ],
)
def test_the_reading_of_the_smoothed_estimates(grad_sq, trace_sigma, b_simple):
  estimate = ga_optax.NoiseScaleEstimate(
    grad_sq=jnp.float32(grad_sq),
    trace_sigma=jnp.float32(trace_sigma),
    measured=jnp.bool_(True),
  )
  averages = ga_optax.smooth_noise_scale(None, estimate, decay=0.5)
  read = ga_optax.noise_scale(averages)
  assert float(read.b_simple) == b_simple
  assert float(read.grad_sq) == grad_sq
  assert float(read.trace_sigma) == trace_sigma
  nothing = ga_optax.noise_scale(
    ga_optax.smooth_noise_scale(
      None, estimate._replace(measured=jnp.bool_(False)), decay=0.5
    )
  )
  assert np.isnan(float(nothing.b_simple))


def test_nearly_equal_micro_gradients_measure_no_noise_in_step():
  # The in-step path forms its estimates as the window does: float32
  # cancellation in the sums is no noise, not a reading of either sign.
  rng = np.random.default_rng(0)
  mean = rng.uniform(0.9, 1.15, size=8192).astype(np.float32)
  rows = mean + np.float32(1e-5) * rng.choice([-1.0, 1.0], size=(8, 8192))

  def loss(params, batch):
    return jnp.mean(batch @ params)

  value_and_grad = ga_optax.microbatched_value_and_grad(
    loss, 4, noise_scale=True
  )
  _, grads, estimate = jax.jit(value_and_grad)(
    jnp.zeros(8192), jnp.asarray(rows, jnp.float32)
  )
  np.testing.assert_allclose(grads, rows.mean(0), rtol=1e-6)
  assert float(estimate.trace_sigma) == 0.0
  assert float(estimate.grad_sq) > 8000
