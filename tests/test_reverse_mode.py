"""``jax.grad`` through the window, under each placement, against the large batch.

Each reference differentiates the large batch without ga_optax: ``jax.grad``
of the loss over the concatenated rows, stepped by the bare optimizer. Each
test names the defect it guards: a traced micro-batch weight of exactly 0
(``accumulate``), and state kept in host memory (on one device under each
schedule, and the optimizer's state under a plain ``jax.jit`` over a mesh;
the placements JAX cannot differentiate it under are refused). Each
placement's derivative with its state in device memory (a ZeRO-1 window's
reduce-scatter, a window inside ``jax.shard_map``) is
tests/test_combinations.py's, every schedule and output of it. Differentiated,
either form traces the derivative rule's conditional (tests/test_window_form.py
holds both forms' derivatives side by side), so every test here runs once, in
the run's form: CI's run on the oldest jax pins the loops, the other runs the
conditional. The calls here are unrolled: JAX differentiates no
``lax.scan`` that carries state in host memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
  assert_finite_and_close,
  init_params,
  make_windows,
  micro_steps,
  token_mean_loss,
  tokens,
  whole,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src.placements import residency

DEVICES, ROWS, K = 8, 2, 3


def assert_derivative_matches(derivative: Any, expected: Any) -> None:
  """Finite, worth comparing, and equal within float32 rounding."""
  assert np.all(np.abs(np.asarray(expected)) > 1e-3), expected
  assert_finite_and_close(derivative, expected, rtol=2e-5, atol=1e-6)


# A traced weight of exactly 0.

MICRO_BATCHES = 4
WEIGHTS = np.array([0.0, 0.5, 1.5, 2.5], np.float32)


def linear_data() -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(3)
  inputs = rng.normal(size=(MICRO_BATCHES, 5, 3)).astype(np.float32)
  targets = rng.normal(size=(MICRO_BATCHES, 5)).astype(np.float32)
  return inputs, targets


def mean_squared_error(
  params: jax.Array, inputs: jax.Array, targets: jax.Array
) -> jax.Array:
  return jnp.mean((inputs @ params - targets) ** 2)


INITIAL = np.array([0.3, -0.2, 0.1], np.float32)


def after_one_step(params: jax.Array) -> jax.Array:
  inputs, targets = linear_data()
  return mean_squared_error(params, inputs.reshape(-1, 3), targets.reshape(-1))


def weighted_window(weights: jax.Array, nan_at_zero: bool = False) -> Any:
  """The loss after one window of ``reduction="sum"``, of the weights."""
  tx = ga_optax.accumulate(optax.sgd(0.1), MICRO_BATCHES, reduction="sum")
  params = jnp.asarray(INITIAL)
  state = tx.init(params)
  inputs, targets = linear_data()
  for index in range(MICRO_BATCHES):
    grads = jax.grad(mean_squared_error)(params, inputs[index], targets[index])
    if nan_at_zero and index == 0:
      grads = jnp.full_like(grads, jnp.nan)  # an all-padding micro-batch's
    updates, state = tx.update(grads, state, params, weight=weights[index])
    params = optax.apply_updates(params, updates)
  return after_one_step(params)


def weighted_large_batch(weights: jax.Array) -> jax.Array:
  """The same step on ``sum_i w_i L_i``, the micro-batches' weighted sum."""
  inputs, targets = linear_data()

  def weighted_sum(params: jax.Array) -> jax.Array:
    losses = jax.vmap(mean_squared_error, in_axes=(None, 0, 0))(
      params, inputs, targets
    )
    return jnp.sum(weights * losses)

  params = jnp.asarray(INITIAL)
  return after_one_step(params - 0.1 * jax.grad(weighted_sum)(params))


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_the_derivative_at_weight_zero_is_the_large_batch(jitted):
  derivative_of = jax.grad(weighted_window)
  if jitted:
    derivative_of = jax.jit(derivative_of)
  derivative = derivative_of(jnp.asarray(WEIGHTS))
  expected = jax.grad(weighted_large_batch)(jnp.asarray(WEIGHTS))
  assert WEIGHTS[0] == 0
  assert_derivative_matches(derivative, expected)


def test_a_dropped_nan_micro_batch_leaves_finite_derivatives():
  # Weight 0 drops a micro-batch whose gradient is NaN; its weight's
  # derivative is 0, as its contribution is, and the others' are the large
  # batch's without it.
  derivative = jax.jit(jax.grad(lambda w: weighted_window(w, True)))(
    jnp.asarray(WEIGHTS)
  )
  expected = jax.grad(weighted_large_batch)(jnp.asarray(WEIGHTS))
  assert float(derivative[0]) == 0.0
  assert_derivative_matches(derivative[1:], expected[1:])


def scanned_step(weights: jax.Array, closed_over: bool) -> jax.Array:
  """The loss after one SGD step of the scan's weighted mean gradient."""
  inputs, targets = linear_data()
  # Row r of the batch is a row of micro-batch r % MICRO_BATCHES, which is
  # how the scan splits it.
  batch = {
    "inputs": inputs.transpose(1, 0, 2).reshape(-1, 3),
    "targets": targets.T.reshape(-1),
    "index": np.tile(np.arange(MICRO_BATCHES), inputs.shape[1]),
  }
  if closed_over:
    # The weights reach weight_fn from outside, as a traced constant.
    def weight_fn(microbatch: dict[str, jax.Array]) -> jax.Array:
      return weights[microbatch["index"][0]]
  else:
    batch["weight"] = jnp.tile(weights, inputs.shape[1])

    def weight_fn(microbatch: dict[str, jax.Array]) -> jax.Array:
      return microbatch["weight"][0]

  def loss(params: jax.Array, microbatch: dict[str, jax.Array]) -> jax.Array:
    return mean_squared_error(
      params, microbatch["inputs"], microbatch["targets"]
    )

  params = jnp.asarray(INITIAL)
  _, grads = ga_optax.microbatched_value_and_grad(
    loss, MICRO_BATCHES, weight_fn=weight_fn
  )(params, batch)
  return after_one_step(params - 0.1 * grads)


@pytest.mark.parametrize("closed_over", [False, True], ids=["batch", "closure"])
def test_the_scans_derivative_at_weight_zero_is_the_large_batch(closed_over):
  # The scan's weighted mean, sum_i w_i g_i / sum_i w_i, against the large
  # batch's step on sum_i w_i L_i / sum_i w_i; the scan holds no window, so
  # it has one form.
  def large_batch(weights: jax.Array) -> jax.Array:
    return weighted_large_batch(weights / jnp.sum(weights))

  derivative = jax.jit(jax.grad(lambda w: scanned_step(w, closed_over)))(
    jnp.asarray(WEIGHTS)
  )
  expected = jax.grad(large_batch)(jnp.asarray(WEIGHTS))
  assert WEIGHTS[0] == 0
  assert_derivative_matches(derivative, expected)


def test_the_noise_readings_differentiate_on_one_device():
  # Both readings of one window are quadratic in its gradients: scaling the
  # loss by s scales them by s**2, so their derivative at s = 1 is twice
  # their value.
  inputs, targets = linear_data()
  tx = ga_optax.accumulate(optax.sgd(0.1), MICRO_BATCHES, noise_scale_decay=0.5)

  def readings(scale: jax.Array) -> jax.Array:
    params = jnp.asarray(INITIAL)
    state = tx.init(params)
    for index in range(MICRO_BATCHES):
      grads = scale * jax.grad(mean_squared_error)(
        params, inputs[index], targets[index]
      )
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    estimate = ga_optax.noise_scale(state)
    return jnp.stack([estimate.grad_sq, estimate.trace_sigma])

  one = jnp.float32(1.0)
  values = jax.jit(readings)(one)
  derivatives = jnp.stack(
    [jax.jit(jax.grad(lambda s, i=i: readings(s)[i]))(one) for i in range(2)]
  )
  assert_derivative_matches(derivatives, 2 * values)


# Windows of token-weighted micro-batches over DEVICES, for the plain-jit
# placements below. The derivative through a window under plain jit, ZeRO-1
# and jax.shard_map with the state in device memory is
# tests/test_combinations.py's (every placement x schedule x output).

WINDOWS = make_windows((K, K), DEVICES, ROWS, seed=11)


def plain_jit_derivative(
  make: Callable[[Any], optax.GradientTransformation], learning_rate: float
) -> jax.Array:
  """d/d(rate) of the loss after WINDOWS of ``make(rate)``, under plain jit.

  Token-weighted partial sums (``unreduced_value_and_grad``) on an Explicit
  mesh of DEVICES, the whole step differentiated under ``jax.jit``. The
  calls are unrolled: JAX differentiates no ``lax.scan`` that carries state
  in host memory.
  """
  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Explicit,))
  value_and_grad = ga_optax.unreduced_value_and_grad(
    token_mean_loss, weight_fn=tokens
  )
  with jax.set_mesh(mesh):
    batches = [jax.device_put(b, P("data")) for b, _ in micro_steps(WINDOWS, K)]
    every_row = jax.device_put(
      whole([b for w in WINDOWS for b in w]), P("data")
    )
    initial = jax.device_put(init_params(), P())

    def final_loss(rate: jax.Array) -> jax.Array:
      tx = make(rate)
      params, state = initial, tx.init(initial)
      for batch in batches:
        _, grads = value_and_grad(params, batch)
        updates, state = tx.update(grads, state, params, weight=tokens(batch))
        params = optax.apply_updates(params, updates)
      return token_mean_loss(params, every_row)

    return jax.jit(jax.grad(final_loss))(jnp.float32(learning_rate))


# State in host memory, on one device.

HOST_WINDOWS = make_windows((K, K), 1, 8, seed=12)
HOST_KINDS = [
  ("pinned_host", None),
  (None, "pinned_host"),
  ("pinned_host", "pinned_host"),
]


def host_final_loss(
  make: Callable[[Any], optax.GradientTransformation],
  kinds: tuple[str | None, str | None],
  learning_rate: jax.Array,
) -> jax.Array:
  accumulator_kind, inner_kind = kinds
  tx = ga_optax.accumulate(
    make(learning_rate),
    K,
    accumulator_memory_kind=accumulator_kind,
    inner_state_memory_kind=inner_kind,
  )
  params = init_params()
  state = tx.init(params)
  for batch, _ in micro_steps(HOST_WINDOWS, K):
    grads = jax.grad(token_mean_loss)(params, batch)
    updates, state = tx.update(grads, state, params, weight=tokens(batch))
    params = optax.apply_updates(params, updates)
  return token_mean_loss(params, whole([b for w in HOST_WINDOWS for b in w]))


def host_large_batch(
  make: Callable[[Any], optax.GradientTransformation],
  learning_rate: Any,
  windows: list[list[Any]] = HOST_WINDOWS,
) -> jax.Array:
  tx = make(learning_rate)
  params = init_params()
  state = tx.init(params)
  for window in windows:
    grads = jax.grad(token_mean_loss)(params, whole(window))
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return token_mean_loss(params, whole([b for w in windows for b in w]))


@pytest.mark.parametrize(
  "kinds", HOST_KINDS, ids=["accumulator", "inner_state", "both"]
)
def test_state_in_host_memory_has_the_large_batch_derivative(kinds):
  # Adam: a state with an integer count and moments, all kept on the host.
  def make(learning_rate: Any) -> optax.GradientTransformation:
    return optax.adam(learning_rate)

  derivative = jax.jit(jax.grad(lambda lr: host_final_loss(make, kinds, lr)))(
    jnp.float32(1e-2)
  )
  expected = jax.grad(lambda lr: host_large_batch(make, lr))(jnp.float32(1e-2))
  assert_derivative_matches(derivative, expected)


# Host memory under the host's schedule: the host closes the first window
# (closing=False, then True), the device the second (closing=None), the
# host the third. JAX makes the zeros of an unperturbed tangent in device
# memory whatever the value's kind, and types a select of scalars in device
# memory: the moves and the host's selects must not take either for the
# state's own kind.

SWITCHING_WINDOWS = make_windows((2, 2, 2), 1, 8, seed=13)
SWITCHING = (False, True, None, None, False, True)


@pytest.mark.parametrize(
  "kinds", [HOST_KINDS[0], HOST_KINDS[2]], ids=["accumulator", "both"]
)
@pytest.mark.parametrize("path", ["accumulate", "accumulate_and_apply"])
def test_state_in_host_memory_has_the_large_batch_derivative_as_the_host_switches(
  kinds, path
):
  accumulator_kind, inner_kind = kinds
  make = getattr(ga_optax, path)

  def final_loss(learning_rate: jax.Array) -> jax.Array:
    tx = make(
      optax.adam(learning_rate),
      2,
      accumulator_memory_kind=accumulator_kind,
      inner_state_memory_kind=inner_kind,
    )
    params = init_params()
    state = tx.init(params)
    batches = [batch for window in SWITCHING_WINDOWS for batch in window]
    for batch, closing in zip(batches, SWITCHING, strict=True):
      grads = jax.grad(token_mean_loss)(params, batch)
      options = {} if closing is None else {"closing": closing}
      if path == "accumulate":
        updates, state = tx.update(
          grads, state, params, weight=tokens(batch), **options
        )
        params = optax.apply_updates(params, updates)
      else:
        params, state = tx.apply(
          params, grads, state, weight=tokens(batch), **options
        )
    return token_mean_loss(params, whole(batches))

  derivative = jax.jit(jax.grad(final_loss))(jnp.float32(1e-2))
  expected = jax.grad(
    lambda lr: host_large_batch(optax.adam, lr, SWITCHING_WINDOWS)
  )(jnp.float32(1e-2))
  assert_derivative_matches(derivative, expected)


# The accumulator in host memory under jax.set_mesh: JAX before 0.12 gives
# its cotangent in host memory where its type is in device memory, and the
# step is refused there by the argument's name; JAX 0.12 differentiates it.


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize("closing", ["device", "host"])
@pytest.mark.parametrize("devices", [1, DEVICES])
def test_an_accumulator_in_host_memory_under_a_mesh(devices, closing):
  mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])

  def final_loss(learning_rate: jax.Array) -> jax.Array:
    tx = ga_optax.accumulate(
      optax.adam(learning_rate), K, accumulator_memory_kind="pinned_host"
    )
    params = init_params()
    state = tx.init(params)
    for index, (batch, _) in enumerate(micro_steps(HOST_WINDOWS, K)):
      grads = jax.grad(token_mean_loss)(params, batch)
      options = {"closing": index % K == K - 1} if closing == "host" else {}
      updates, state = tx.update(
        grads, state, params, weight=tokens(batch), **options
      )
      params = optax.apply_updates(params, updates)
    return token_mean_loss(params, whole([b for w in HOST_WINDOWS for b in w]))

  with jax.set_mesh(mesh):
    derivative_of = jax.jit(jax.grad(final_loss))
    if not residency.MESH_DIFFERENTIATES_HOST_STATE:
      with pytest.raises(
        ValueError,
        match=r"accumulator_memory_kind='pinned_host'\) under jax.set_mesh",
      ):
        derivative_of(jnp.float32(1e-2))
      return
    derivative = derivative_of(jnp.float32(1e-2))
  expected = jax.grad(lambda lr: host_large_batch(optax.adam, lr))(
    jnp.float32(1e-2)
  )
  assert_derivative_matches(derivative, expected)


def test_a_host_scheduled_close_keeps_a_step_count_in_host_memory():
  # A select of scalars is typed in device memory whatever its operands':
  # Adam's count came back on the device, and the next call refused it.
  tx = ga_optax.accumulate(
    optax.adam(1e-2), 2, inner_state_memory_kind="pinned_host"
  )
  params = init_params()
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  for closing in (False, True, False):
    _, state = jax.jit(
      lambda state, closing=closing: tx.update(
        grads, state, params, closing=closing
      )
    )(state)
  count = state.inner_state[0].count
  assert count.sharding.memory_kind == "pinned_host"
  assert int(count) == 1


# The optimizer's state in host memory under a plain jit over a mesh.


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize(
  "options",
  [{}, {"inner_state_axes": "data"}],
  ids=["unreduced", "zero1"],
)
def test_a_plain_jit_window_with_its_optimizer_state_in_host_memory(options):
  def make(rate: jax.Array) -> optax.GradientTransformation:
    return ga_optax.accumulate(
      optax.adam(rate),
      K,
      unreduced_axes="data",
      inner_state_memory_kind="pinned_host",
      **options,
    )

  derivative = plain_jit_derivative(make, 1e-2)
  expected = jax.grad(lambda lr: host_large_batch(optax.adam, lr, WINDOWS))(
    jnp.float32(1e-2)
  )
  assert_derivative_matches(derivative, expected)


# Refused: JAX's shard_map transposes to device-memory cotangents for its
# host-memory operands, and the cotangent of an accumulator typed unreduced
# comes back unreduced through the move to host memory. Each differentiates
# one micro-step with respect to the params: k=2 keeps the window open
# (only the accumulator is kept), k=1 closes it (the optimizer's state is).

REFUSED = [
  ("shard_map", "accumulator_memory_kind", 2),
  ("shard_map", "inner_state_memory_kind", 1),
  ("unreduced", "accumulator_memory_kind", 2),
  ("zero1", "accumulator_memory_kind", 2),
]


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize(
  "placement, argument, every_k",
  REFUSED,
  ids=[f"{placement}-{argument}" for placement, argument, _ in REFUSED],
)
def test_state_in_host_memory_is_refused_where_jax_cannot_differentiate_it(
  placement, argument, every_k
):
  batch, _ = next(micro_steps(WINDOWS, K))
  options = {argument: "pinned_host"}
  if placement == "shard_map":
    mesh = jax.make_mesh((DEVICES,), ("data",))
    tx = ga_optax.accumulate(
      optax.adam(1e-2), every_k, axis_name="data", **options
    )

    def local(params, state, batch):
      grads = jax.grad(token_mean_loss)(params, batch)
      updates, _ = tx.update(grads, state, params, weight=tokens(batch))
      return token_mean_loss(optax.apply_updates(params, updates), batch)

    loss_after = jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(P(), P(), P("data")),
      out_specs=P(),
      check_vma=False,
    )
  else:
    mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Explicit,))
    if placement == "zero1":
      options["inner_state_axes"] = "data"
    tx = ga_optax.accumulate(
      optax.adam(1e-2), every_k, unreduced_axes="data", **options
    )
    value_and_grad = ga_optax.unreduced_value_and_grad(
      token_mean_loss, weight_fn=tokens
    )

    def loss_after(params, state, batch):
      _, grads = value_and_grad(params, batch)
      updates, _ = tx.update(grads, state, params, weight=tokens(batch))
      return token_mean_loss(optax.apply_updates(params, updates), batch)

  with jax.set_mesh(mesh):
    params = jax.device_put(init_params(), NamedSharding(mesh, P()))
    state = tx.init(params)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    # Not differentiated, the step keeps its state in host memory.
    assert np.isfinite(float(jax.jit(loss_after)(params, state, batch)))
    with pytest.raises(
      ValueError, match=f"{argument}=None \\(device memory\\)"
    ):
      jax.jit(jax.grad(loss_after))(params, state, batch)
