"""ga_optax.privacy: clipped sums over the window, one draw per window.

Every claim is held to an independent reference: the clipped mean of the
whole logical batch in NumPy, the same batch split otherwise (partition
invariance: the noise depends on the window, not on its micro-batches), the
one-device run on 8 devices, the Gaussian's law (a chi-square interval on
the noise's variance), and dp-accounting's own composition built by hand.
"""

from __future__ import annotations

import functools

import dp_accounting
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P
from scipy import stats

import ga_optax
from ga_optax import privacy

DIM = 4
CLIP = 1.0
SIGMA = 1.0
LOGICAL = 6  # examples per window
LR = 0.5
# Examples per micro-batch, real examples in each micro-batch of a window.
SPLITS = {
  "k1": (6, (6,)),
  "k2": (3, (3, 3)),
  "k4": (2, (2, 2, 2, 0)),
  "ragged": (3, (3, 1, 2)),
}


def example_loss(params, example):
  x, y = example[:DIM], example[DIM]
  return 0.5 * (x @ params["w"] + params["b"] - y) ** 2


def init_params():
  return {"w": jnp.zeros(DIM), "b": jnp.zeros(())}


def logical_batches(windows, size=LOGICAL, seed=0):
  rng = np.random.default_rng(seed)
  # Targets large enough that some examples are clipped, some not.
  data = rng.normal(size=(windows, size, DIM + 1)).astype(np.float32)
  data[..., DIM] *= 3.0
  return data


def private_tx(every_k, sigma=SIGMA, normalize_by=LOGICAL, **keywords):
  return privacy.accumulate(
    optax.sgd(LR),
    every_k,
    l2_clip_norm=CLIP,
    noise_multiplier=sigma,
    normalize_by=float(normalize_by),
    key=jax.random.key(7),
    **keywords,
  )


def micro_step(tx, closing):
  grad_sum = privacy.clipped_grad_sum(example_loss, CLIP)

  def step(params, state, batch, mask):
    _, total = grad_sum(params, batch, mask)
    updates, state = tx.update(total, state, params, closing=closing)
    return optax.apply_updates(params, updates), state

  return step


@functools.cache
def run_split(split, schedule, sigma=SIGMA, windows=2):
  """Params after ``windows`` logical batches cut as ``split``."""
  size, counts = SPLITS[split]
  tx = private_tx(len(counts), sigma)
  host = schedule == "host"
  steps = {
    closing: jax.jit(micro_step(tx, closing))
    for closing in ((False, True) if host else (None,))
  }
  params = init_params()
  state = tx.init(params)
  for examples in logical_batches(windows):
    start = 0
    for index, count in enumerate(counts):
      # Padding rows are NaN: the mask must drop them, not multiply them.
      batch = np.full((size, DIM + 1), np.nan, np.float32)
      batch[:count] = examples[start : start + count]
      mask = (np.arange(size) < count).astype(np.float32)
      start += count
      closing = (index == len(counts) - 1) if host else None
      params, state = steps[closing](params, state, batch, mask)
  assert int(privacy.windows_closed(state)) == windows
  return jax.device_get(params)


def clipped_mean_sgd(windows):
  """The noiseless reference in NumPy: SGD on each window's clipped mean."""
  w, b = np.zeros(DIM), 0.0
  for examples in logical_batches(windows).astype(np.float64):
    x, y = examples[:, :DIM], examples[:, DIM]
    residual = x @ w + b - y
    grads = np.concatenate([residual[:, None] * x, residual[:, None]], axis=1)
    norms = np.linalg.norm(grads, axis=1)
    clipped = grads * np.minimum(1.0, CLIP / norms)[:, None]
    mean = clipped.sum(axis=0) / LOGICAL
    w, b = w - LR * mean[:DIM], b - LR * mean[DIM]
  return {"w": w, "b": np.asarray(b)}


def assert_close(actual, expected):
  for leaf in jax.tree.leaves(actual):
    assert np.all(np.isfinite(leaf))
  jax.tree.map(
    lambda a, e: np.testing.assert_allclose(a, e, rtol=2e-5, atol=2e-6),
    actual,
    expected,
  )


@pytest.mark.parametrize("schedule", ["host", "device"])
def test_without_noise_the_window_is_the_clipped_mean_of_its_batch(schedule):
  expected = clipped_mean_sgd(2)
  for split in ("k1", "ragged"):
    assert_close(run_split(split, schedule, sigma=0.0), expected)


@pytest.mark.parametrize("schedule", ["host", "device"])
def test_partition_invariance_with_noise(schedule):
  noiseless = run_split("k1", schedule, sigma=0.0)
  reference = run_split("k1", schedule)
  # The noise moved the params: the comparison below is not of noiseless runs.
  assert np.max(np.abs(reference["w"] - noiseless["w"])) > 0.01
  for split in ("k2", "k4", "ragged"):
    assert_close(run_split(split, schedule), reference)


def test_partition_invariance_across_schedules():
  assert_close(run_split("ragged", "host"), run_split("k1", "device"))


def test_a_resumed_state_draws_the_same_noise():
  tx = private_tx(1)
  step = jax.jit(micro_step(tx, True))
  mask = np.ones(LOGICAL, np.float32)
  batches = logical_batches(3)
  params, state = init_params(), tx.init(init_params())
  saved = None
  for index, batch in enumerate(batches):
    if index == 2:
      saved = jax.device_get((params, state))
    params, state = step(params, state, batch, mask)
  resumed = step(*jax.tree.map(jnp.asarray, saved), batches[2], mask)
  assert_close(resumed[0], params)


def data_mesh():
  return Mesh(np.array(jax.devices()[:8]), ("data",))


@pytest.mark.devices(8)
@pytest.mark.parametrize("k", [1, 2])
def test_eight_devices_draw_once_per_window(k):
  """Each device sums its examples; the noise is the one-device run's."""
  windows, logical = 2, 16
  batches = logical_batches(windows, logical)
  expected = one_device_run(batches)

  tx = private_tx(k, normalize_by=logical, axis_name="data")
  step = jax.jit(
    jax.shard_map(
      micro_step(tx, None),
      mesh=data_mesh(),
      in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P(), P()),
      check_vma=False,
    )
  )
  params = init_params()
  state = tx.init(params)
  rows = logical // (8 * k)
  for batch in batches:
    # Micro-step i holds rows [i * rows, (i + 1) * rows) of every device.
    per_device = batch.reshape(8, k, rows, DIM + 1)
    for index in range(k):
      micro = per_device[:, index].reshape(8 * rows, DIM + 1)
      params, state = step(params, state, micro, np.ones(8 * rows, np.float32))
  assert int(privacy.windows_closed(state)) == windows
  assert_close(params, expected)


def one_device_run(batches):
  """The one-device run of ``batches``, one window each, every example real."""
  logical = batches.shape[1]
  tx = private_tx(1, normalize_by=logical)
  step = jax.jit(micro_step(tx, True))
  params = init_params()
  state = tx.init(params)
  for batch in batches:
    params, state = step(params, state, batch, np.ones(logical, np.float32))
  return params


@pytest.mark.devices(8)
@pytest.mark.parametrize("sharded_state", [False, True])
def test_unreduced_windows_draw_once_per_window(sharded_state):
  """Under a plain jit: per-device clipped sums, unreduced, reduced once.

  With ``inner_state_axes`` (ZeRO-1) the noise is drawn on the state's
  slices: the same draw as unsharded.
  """
  windows, logical, k = 2, 16, 2
  batches = logical_batches(windows, logical)
  extra = {"inner_state_axes": "data"} if sharded_state else {}
  tx = private_tx(k, normalize_by=logical, unreduced_axes="data", **extra)
  grad_sum = privacy.clipped_grad_sum(example_loss, CLIP)

  def own_sum(params, rows, mask):
    return jax.tree.map(
      lambda leaf: leaf[None], grad_sum(params, rows, mask)[1]
    )

  def step(params, state, rows, mask):
    stacked = jax.shard_map(
      own_sum, in_specs=(P(), P("data"), P("data")), out_specs=P("data")
    )(params, rows, mask)
    unreduced = jax.tree.map(
      lambda leaf: jnp.einsum(
        "d...->...", leaf, out_sharding=P(unreduced={"data"})
      ),
      stacked,
    )
    updates, state = tx.update(unreduced, state, params)
    return optax.apply_updates(params, updates), state

  mesh = jax.make_mesh(
    (8,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:8]
  )
  with jax.set_mesh(mesh):
    step = jax.jit(step)
    params = init_params()
    state = tx.init(params)
    mask = jax.device_put(np.ones(logical // k, np.float32), P("data"))
    for batch in batches:
      for rows in np.split(batch, k):
        rows = jax.device_put(rows, P("data"))
        params, state = step(params, state, rows, mask)
    assert int(privacy.windows_closed(state)) == windows
    params = jax.device_get(params)
  assert_close(params, one_device_run(batches))


NOISE_DIM = 64
NOISE_WINDOWS = 2000


@functools.cache
def noise_updates(k):
  """The updates of 2,000 windows of zero gradients, SGD at rate 1."""
  tx = privacy.accumulate(
    optax.sgd(1.0),
    k,
    l2_clip_norm=2.0,
    noise_multiplier=1.5,
    normalize_by=4.0,
    key=jax.random.key(3),
  )
  params = jnp.zeros(NOISE_DIM)

  def window(state, _):
    updates = None
    for _ in range(k):
      updates, state = tx.update(jnp.zeros(NOISE_DIM), state, params)
    return state, updates

  state, updates = jax.jit(
    lambda state: jax.lax.scan(window, state, length=NOISE_WINDOWS)
  )(tx.init(params))
  assert int(privacy.windows_closed(state)) == NOISE_WINDOWS
  return np.asarray(updates, np.float64)


@pytest.mark.parametrize("k", [1, 8])
def test_noise_std_is_sigma_c_over_normalize_by_whatever_k(k):
  updates = noise_updates(k)
  assert np.all(np.isfinite(updates))
  expected_std = 1.5 * 2.0 / 4.0
  samples = updates.size
  # (n - 1) s^2 / sigma^2 is chi-square with n - 1 degrees of freedom.
  statistic = (samples - 1) * np.var(updates, ddof=1) / expected_std**2
  low, high = stats.chi2.ppf([0.005, 0.995], samples - 1)
  assert low < statistic < high, np.std(updates)
  assert abs(np.mean(updates)) < 4 * expected_std / np.sqrt(samples)


@pytest.mark.parametrize("k", [1, 8])
def test_consecutive_windows_draw_uncorrelated_noise(k):
  updates = noise_updates(k)
  now, following = updates[:-1].ravel(), updates[1:].ravel()
  correlation = np.corrcoef(now, following)[0, 1]
  assert abs(correlation) < 4 / np.sqrt(now.size)


def test_a_huge_gradient_contributes_exactly_c():
  grad_sum = privacy.clipped_grad_sum(lambda w, x: 1e6 * jnp.sum(w * x), 2.5)
  batch = jnp.array([[3.0, 4.0, 12.0]])
  _, total = grad_sum(jnp.zeros(3), batch)
  np.testing.assert_allclose(np.linalg.norm(total), 2.5, rtol=1e-6)
  np.testing.assert_allclose(total, 2.5 * np.array([3, 4, 12]) / 13, rtol=1e-6)


def test_a_small_gradient_is_kept_and_padding_adds_nothing():
  grad_sum = privacy.clipped_grad_sum(lambda w, x: jnp.sum(w * x), 1.0)
  batch = jnp.array([[0.3, 0.4], [jnp.nan, jnp.inf], [1e9, 1e9]])
  loss, total = grad_sum(jnp.ones(2), batch, jnp.array([1.0, 0.0, 0.0]))
  np.testing.assert_array_equal(total, np.array([0.3, 0.4], np.float32))
  np.testing.assert_allclose(loss, 0.7, rtol=1e-6)
  loss, total = grad_sum(jnp.ones(2), batch, jnp.zeros(3))
  np.testing.assert_array_equal(total, np.zeros(2, np.float32))
  assert float(loss) == 0.0


def test_float16_params_clip_by_a_float32_norm():
  # Each coordinate's square (1e6) overflows float16 (max 65504).
  grad_sum = privacy.clipped_grad_sum(lambda w, x: jnp.sum(w * x), 1.0)
  params = jnp.zeros(64, jnp.float16)
  _, total = grad_sum(params, jnp.full((1, 64), 1000.0, jnp.float16))
  assert total.dtype == jnp.float16
  norm = np.linalg.norm(np.asarray(total, np.float32))
  np.testing.assert_allclose(norm, 1.0, rtol=2e-3)


def test_mask_weights_outside_0_1_are_refused():
  grad_sum = privacy.clipped_grad_sum(lambda w, x: jnp.sum(w * x), 1.0)
  with pytest.raises(ValueError, match=r"mask .* \[0, 1\]"):
    grad_sum(jnp.ones(2), jnp.ones((2, 2)), jnp.array([1.0, 2.0]))


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_is_dp_accountings_for_the_windows(accountant):
  q, sigma, windows, delta = 0.01, 1.1, 1200, 1e-5
  by_hand = (
    dp_accounting.rdp.RdpAccountant()
    if accountant == "rdp"
    else dp_accounting.pld.PLDAccountant()
  )
  by_hand.compose(
    dp_accounting.PoissonSampledDpEvent(
      q, dp_accounting.GaussianDpEvent(sigma)
    ),
    windows,
  )
  expected = by_hand.get_epsilon(delta)
  got = privacy.epsilon(
    windows,
    sampling_probability=q,
    noise_multiplier=sigma,
    delta=delta,
    accountant=accountant,
  )
  assert np.isfinite(got)
  np.testing.assert_allclose(got, expected, rtol=1e-9)


def test_the_calibrated_noise_spends_the_target_epsilon():
  q, windows, delta = 0.02, 500, 1e-5
  sigma = privacy.calibrated_noise_multiplier(
    2.0, windows=windows, sampling_probability=q, delta=delta
  )
  spent = privacy.epsilon(
    windows, sampling_probability=q, noise_multiplier=sigma, delta=delta
  )
  assert 1.99 <= spent <= 2.0
  assert (
    privacy.epsilon(
      windows,
      sampling_probability=q,
      noise_multiplier=0.98 * sigma,
      delta=delta,
    )
    > 2.0
  )


@pytest.mark.parametrize("k", [1, 3])
def test_windows_closed_counts_windows_not_micro_steps(k):
  tx = optax.chain(optax.identity(), private_tx(k))
  params = init_params()
  state = tx.init(params)
  step = jax.jit(lambda state: tx.update(params, state, params)[1])
  for _ in range(7):
    state = step(state)
  assert int(privacy.windows_closed(state)) == 7 // k
  assert int(ga_optax.applied_updates(state)) == 7 // k


def test_an_empty_draw_is_a_pure_noise_window():
  """One all-padding micro-batch closed by the host steps, on noise alone."""
  tx = private_tx(4)
  step = jax.jit(micro_step(tx, True))
  batch = np.full((3, DIM + 1), np.nan, np.float32)
  params, state = step(
    init_params(), tx.init(init_params()), batch, np.zeros(3)
  )
  assert bool(ga_optax.emitted(state))
  assert int(privacy.windows_closed(state)) == 1
  assert np.all(np.isfinite(params["w"])) and np.any(params["w"] != 0)


def test_poisson_windows_cover_each_draw_once():
  rng = np.random.default_rng(1)
  closes, sizes, current = 0, [], 0
  for batch in privacy.poisson_windows(
    rng, 40, sampling_probability=0.1, micro_batch_size=3, windows=200
  ):
    assert batch.indices.shape == batch.mask.shape == (3,)
    current += int(batch.mask.sum())
    if batch.closing:
      closes, sizes, current = closes + 1, [*sizes, current], 0
  assert closes == 200 and current == 0
  assert 0 in sizes  # some draws were empty, and still closed a window
  # The draws' mean size is q * n = 4, within 4 standard errors.
  assert abs(np.mean(sizes) - 4.0) < 4 * np.sqrt(40 * 0.1 * 0.9 / 200)


def random_primitives(jaxpr):
  names = set()
  for equation in jaxpr.eqns:
    if "random" in equation.primitive.name or "threefry" in (
      equation.primitive.name
    ):
      names.add(equation.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(equation.params):
      names |= random_primitives(sub)
  return names


def test_the_micro_step_program_draws_no_random_number():
  tx = private_tx(2)
  args = (
    init_params(),
    tx.init(init_params()),
    np.zeros((3, DIM + 1), np.float32),
    np.ones(3, np.float32),
  )
  micro = jax.make_jaxpr(micro_step(tx, False))(*args)
  closing = jax.make_jaxpr(micro_step(tx, True))(*args)
  assert random_primitives(micro.jaxpr) == set()
  assert random_primitives(closing.jaxpr)
  hlo = jax.jit(micro_step(tx, False)).lower(*args).compile().as_text()
  assert "rng" not in hlo.lower() and "threefry" not in hlo.lower()


@pytest.mark.parametrize(
  ("keywords", "error", "match"),
  [
    ({"noise_scale_decay": 0.9}, ValueError, "noise scale reads"),
    ({"skip_nonfinite": True}, ValueError, "skip itself"),
    ({"lr_scaling": "sqrt"}, ValueError, "size of the private draw"),
    ({"reduction": "mean"}, ValueError, "normalize_by"),
    ({"l2_clip_norm": 0.0}, ValueError, "l2_clip_norm must be > 0"),
    ({"noise_multiplier": -1.0}, ValueError, "noise_multiplier must be >= 0"),
    ({"normalize_by": 0.0}, ValueError, "normalize_by must be > 0"),
    ({"key": 3}, TypeError, "key must be a JAX random key"),
    ({"colsing": True}, TypeError, "unexpected keyword"),
  ],
)
def test_refused_arguments_say_why(keywords, error, match):
  arguments = {
    "l2_clip_norm": 1.0,
    "noise_multiplier": 1.0,
    "normalize_by": 4.0,
    "key": jax.random.key(0),
    **keywords,
  }
  with pytest.raises(error, match=match):
    privacy.accumulate(optax.sgd(0.1), 2, **arguments)


def test_adaptive_k_and_weights_are_refused():
  with pytest.raises(ValueError, match="statistic of private data"):
    privacy.accumulate(
      optax.sgd(0.1),
      ga_optax.batch_size.adaptive_k(1, max_k=8),
      l2_clip_norm=1.0,
      noise_multiplier=1.0,
      normalize_by=4.0,
      key=jax.random.key(0),
    )
  tx = private_tx(2)
  params = init_params()
  with pytest.raises(TypeError, match="takes no weight"):
    tx.update(params, tx.init(params), params, weight=2)


@pytest.mark.devices(8)
def test_inside_a_checked_shard_map_each_device_clips_its_own_examples():
  """Autodiff must not sum the devices' gradients before they are clipped."""
  grad_sum = privacy.clipped_grad_sum(example_loss, CLIP)
  batch = logical_batches(1, 8)[0]
  expected = [grad_sum(init_params(), batch[i : i + 1])[1] for i in range(8)]

  def local(params, rows):
    return jax.tree.map(lambda leaf: leaf[None], grad_sum(params, rows)[1])

  per_device = jax.jit(
    jax.shard_map(
      local, mesh=data_mesh(), in_specs=(P(), P("data")), out_specs=P("data")
    )
  )(init_params(), batch)
  stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *expected)
  assert_close(per_device, stacked)

  tx = private_tx(1, axis_name="data")
  checked = jax.shard_map(
    micro_step(tx, None),
    mesh=data_mesh(),
    in_specs=(P(), P(), P("data"), P("data")),
    out_specs=(P(), P()),
  )
  params = init_params()
  with pytest.raises(ValueError, match="check_vma=False"):
    checked(params, tx.init(params), batch, np.ones(8, np.float32))
