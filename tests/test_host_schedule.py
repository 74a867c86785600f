"""``closing=``: the host says which side of the window a call runs.

A Python loop knows its micro-step. With ``closing`` a Python bool the
program holds that side alone, with no ``while`` and no ``conditional`` but
the CPU's guard of a window closed without weight (checked on the traced
program of every configuration here, in both forms of the window; the
programs XLA:GPU compiles for an H100 are checked in test_gpu_program.py),
and the numbers stay those of the large batch: each window ends where
``jax.grad`` of its concatenated micro-batches and the bare optimizer end,
also where the host's word disagrees with the counter (it closes the window
with what it holds, or keeps it open past its k). The combination matrix
(test_combinations.py) runs the host schedule through every placement.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from control_flow import window_primitives
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax._src.window import window_form

FEATURES = 6


def init_params() -> dict[str, jax.Array]:
  key_w, key_v = jax.random.split(jax.random.key(0))
  return {
    "w": jax.random.normal(key_w, (FEATURES, 4)) / np.sqrt(FEATURES),
    "b": jnp.zeros(4),
    "v": jax.random.normal(key_v, (4,)) / 2.0,
  }


def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
  hidden = jnp.tanh(batch["x"] @ params["w"] + params["b"])
  return jnp.mean((hidden @ params["v"] - batch["y"]) ** 2)


def micro_batches(sizes: list[int], seed: int = 1) -> list[dict[str, Any]]:
  rng = np.random.default_rng(seed)
  return [
    {
      "x": jnp.asarray(rng.normal(size=(size, FEATURES)), jnp.float32),
      "y": jnp.asarray(rng.normal(size=(size,)), jnp.float32),
    }
    for size in sizes
  ]


def large_batch(optimizer, windows: list[list[dict[str, Any]]]) -> Any:
  """The independent reference: one bare step per concatenated window."""
  params, state = init_params(), optimizer.init(init_params())
  for window in windows:
    batch = jax.tree.map(lambda *rows: jnp.concatenate(rows), *window)
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = optimizer.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


@functools.cache
def host_step(every_k: Any, closing: bool, fused: bool = False):
  """A jitted train step whose side the host chose."""
  optimizer = optax.adam(0.05)
  if fused:
    tx = ga_optax.accumulate_and_apply(optimizer, every_k)

    def fused_step(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      weight = batch["x"].shape[0]
      return tx.apply(params, grads, state, weight=weight, closing=closing)

    return tx, jax.jit(fused_step)
  tx = ga_optax.accumulate(optimizer, every_k)

  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(
      grads, state, params, weight=batch["x"].shape[0], closing=closing
    )
    return optax.apply_updates(params, updates), state

  return tx, jax.jit(step)


def run(windows, every_k, *, fused=False):
  """Each window's micro-batches, the last one closing it by the host's word."""
  tx, _ = host_step(every_k, False, fused)
  params, state = init_params(), tx.init(init_params())
  for window in windows:
    for index, batch in enumerate(window):
      closing = index == len(window) - 1
      _, step = host_step(every_k, closing, fused)
      params, state = step(params, state, batch)
  return params, state


def assert_close_and_finite(actual, expected):
  chex.assert_tree_all_finite(actual)
  chex.assert_tree_all_finite(expected)
  chex.assert_trees_all_close(actual, expected, rtol=2e-5, atol=1e-6)


@pytest.mark.smoke
@pytest.mark.parametrize("fused", [False, True])
def test_the_host_schedule_is_the_large_batch(fused):
  windows = [micro_batches([3, 5, 2, 6], seed) for seed in range(3)]
  params, state = run(windows, 4, fused=fused)
  assert int(ga_optax.applied_updates(state)) == 3
  assert_close_and_finite(params, large_batch(optax.adam(0.05), windows))


@pytest.mark.parametrize("fused", [False, True])
def test_the_hosts_word_decides_where_it_disagrees_with_the_counter(fused):
  """Closed early, a window is flushed; held open, it grows past its k.

  Either way the update is the large-batch step of what the window held.
  """
  windows = [
    micro_batches([4, 2], 1),  # closed after 2 of its 4 micro-steps
    micro_batches([3, 1, 2, 5, 2, 4], 2),  # held open for 6
    micro_batches([2, 2, 3, 1], 3),
  ]
  tx, _ = host_step(4, False, fused)
  params, state = init_params(), tx.init(init_params())
  held = []
  for window in windows:
    for index, batch in enumerate(window):
      closing = index == len(window) - 1
      params, state = host_step(4, closing, fused)[1](params, state, batch)
      held.append(int(state.micro_step))
  # The counter shows what each window held: 6 micro-steps where k is 4.
  assert held == [1, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0]
  assert int(ga_optax.current_k(state)) == 4
  assert_close_and_finite(params, large_batch(optax.adam(0.05), windows))


@pytest.mark.smoke
def test_schedules_switch_at_any_call():
  """Device, host, device: every close leaves one kind of state."""
  windows = [micro_batches([2, 3, 4], seed) for seed in range(4)]
  optimizer = optax.adam(0.05)
  tx = ga_optax.accumulate(optimizer, 3)

  @functools.partial(jax.jit, static_argnames="closing")
  def step(params, state, batch, closing):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(
      grads, state, params, weight=batch["x"].shape[0], closing=closing
    )
    return optax.apply_updates(params, updates), state

  params, state = init_params(), tx.init(init_params())
  call = 0
  for window in windows:
    for index, batch in enumerate(window):
      # Odd calls are scheduled by the device, even ones by the host.
      closing = None if call % 2 else index == len(window) - 1
      params, state = step(params, state, batch, closing=closing)
      call += 1
  assert_close_and_finite(params, large_batch(optimizer, windows))


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit-static"])
def test_a_numpy_bool_closing_is_the_hosts_word(use_jit):
  # A NumPy loop counter's comparison: concrete, as a Python bool is.
  rng = np.random.default_rng(0)
  grads = rng.normal(size=(5, 3)).astype(np.float32)
  # k = 2; the second window is held open past it, to three micro-steps.
  closings = np.array([False, True, False, False, True])
  tx = ga_optax.accumulate_and_apply(optax.sgd(1.0), 2)
  apply = tx.apply
  if use_jit:
    # Fresh: its first trace sees the NumPy bools, not Python ones.
    apply = jax.jit(tx.apply, static_argnames="closing")
  params = {"w": jnp.zeros(3)}
  state = tx.init(params)
  expected, held = np.zeros(3, np.float32), []
  for g, closing in zip(grads, closings, strict=True):
    assert type(closing) is np.bool_
    params, state = apply(params, {"w": jnp.asarray(g)}, state, closing=closing)
    held.append(g)
    if closing:  # SGD at rate 1: minus the mean of what the window held
      expected, held = expected - np.mean(held, axis=0), []
    assert bool(ga_optax.emitted(state)) == bool(closing)
    assert np.all(np.isfinite(params["w"]))
    np.testing.assert_allclose(params["w"], expected, rtol=1e-6, atol=1e-7)
  assert int(ga_optax.applied_updates(state)) == 2


def test_a_traced_closing_is_told_to_be_static():
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  params = init_params()
  grads = optax.tree.zeros_like(params)
  state = tx.init(params)

  @jax.jit
  def step(grads, state, closing):
    return tx.update(grads, state, params, closing=closing)

  with pytest.raises(TypeError) as error:
    step(grads, state, True)
  message = str(error.value)
  assert "closing is traced" in message, message
  assert 'static_argnames="closing"' in message, message
  # Not flush=, which would move the run to the device's schedule.
  assert "flush" not in message, message


@pytest.mark.parametrize(
  "closing", [1, 0, "yes", jnp.asarray(True)], ids=["1", "0", "str", "array"]
)
@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_closing_of_another_type_is_refused(closing, use_jit):
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  params = init_params()
  grads = optax.tree.zeros_like(params)
  update = tx.update
  if use_jit:
    # Inside jax.jit, as a step that marks closing static sees it: the value
    # itself, not traced (the eager wrapper would trace a Python int).
    def update(grads, state, params, closing):
      return jax.jit(lambda g, s: tx.update(g, s, params, closing=closing))(
        grads, state
      )

  with pytest.raises(TypeError, match=r"closing must be None .* got"):
    update(grads, tx.init(params), params, closing=closing)


@pytest.mark.parametrize("flush", [True, jnp.asarray(False)])
@pytest.mark.parametrize("closing", [True, False])
def test_flush_with_closing_is_refused(flush, closing):
  tx = ga_optax.accumulate_and_apply(optax.sgd(0.1), 2)
  params = init_params()
  with pytest.raises(ValueError, match="flush= closes a window"):
    tx.apply(
      params,
      optax.tree.zeros_like(params),
      tx.init(params),
      flush=flush,
      closing=closing,
    )


# Every configuration's host-scheduled micro-step holds no control flow of
# the window's: a straight line of work. Its closing step holds one branch,
# the guard that keeps a window without weight from stepping: selects in
# the loops form (GPUs, TPUs; and for a state kept in host memory), a
# conditional in the CPU's form, where it makes the host wait for nothing.


def assert_guarded_as_the_form_says(
  jaxpr: Any, closing: bool, form: str, on_device: bool = True
) -> None:
  primitives = window_primitives(jaxpr)
  if closing and form == window_form.CONDITIONAL and on_device:
    assert primitives and set(primitives) == {"cond"}, primitives
  else:
    assert primitives == [], primitives


ONE_DEVICE = {
  "adam": dict(optimizer=optax.adam(1e-3)),
  "clip_adamw_schedule": dict(
    optimizer=optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(optax.linear_schedule(1e-3, 1e-4, 10)),
    )
  ),
  "dict_every_k_skip_nonfinite": dict(
    optimizer=optax.sgd(0.1), every_k={0: 2, 3: 4}, skip_nonfinite=True
  ),
  "sum": dict(optimizer=optax.sgd(0.1), reduction="sum"),
  "noise_scale_adaptive_k_sqrt": dict(
    optimizer=optax.adam(1e-3),
    every_k=ga_optax.batch_size.adaptive_k(2, max_k=8),
    noise_scale_decay=0.9,
    lr_scaling="sqrt",
  ),
  "bf16_accumulator": dict(
    optimizer=optax.adam(1e-3), accumulator_dtype=jnp.bfloat16
  ),
  "accumulator_in_host_memory": dict(
    optimizer=optax.adam(1e-3),
    accumulator_memory_kind="pinned_host",
    inner_state_memory_kind="pinned_host",
  ),
}


def options_of(config: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
  options = dict(config)
  return options.pop("optimizer"), options.pop("every_k", 4), options


@pytest.mark.parametrize("form", window_form.FORMS)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("closing", [False, True])
@pytest.mark.parametrize("name", sorted(ONE_DEVICE))
def test_a_host_scheduled_program_has_no_control_flow_but_the_cpus_guard(
  name, closing, fused, form, monkeypatch
):
  monkeypatch.setenv(window_form.VARIABLE, form)
  optimizer, every_k, options = options_of(ONE_DEVICE[name])
  params = init_params()
  batch = micro_batches([4])[0]
  if fused:
    tx = ga_optax.accumulate_and_apply(optimizer, every_k, **options)

    def step(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      return tx.apply(params, grads, state, weight=4.0, closing=closing)

  else:
    tx = ga_optax.accumulate(optimizer, every_k, **options)

    def step(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      updates, state = tx.update(
        grads, state, params, weight=4.0, closing=closing
      )
      return optax.apply_updates(params, updates), state

  state = tx.init(params)
  jaxpr = jax.make_jaxpr(step)(params, state, batch).jaxpr
  assert_guarded_as_the_form_says(
    jaxpr,
    closing,
    form,
    on_device=not any(key.endswith("_memory_kind") for key in options),
  )
  # The control: the device's schedule holds the window's branches.
  if not closing:

    def device_step(params, state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      if fused:
        return tx.apply(params, grads, state, weight=4.0)
      return tx.update(grads, state, params, weight=4.0)

    device = jax.make_jaxpr(device_step)(params, state, batch).jaxpr
    assert window_primitives(device) != []


DEVICES = 8


@pytest.mark.devices(DEVICES)
@pytest.mark.parametrize("form", window_form.FORMS)
@pytest.mark.parametrize("closing", [False, True])
@pytest.mark.parametrize(
  "placement", ["shard_map", "unreduced", "zero1", "unreduced_noise_scale"]
)
def test_every_placement_host_schedules_without_control_flow_but_the_guard(
  placement, closing, form, monkeypatch
):
  monkeypatch.setenv(window_form.VARIABLE, form)
  mesh = jax.make_mesh((DEVICES,), ("data",))
  params = init_params()
  with jax.set_mesh(mesh):
    batch = jax.device_put(micro_batches([2 * DEVICES])[0], P("data"))
    if placement == "shard_map":
      tx = ga_optax.accumulate(optax.adam(1e-3), 4, axis_name="data")

      def local(params, state, x, y):
        grads = jax.grad(loss_fn)(params, {"x": x, "y": y})
        updates, state = tx.update(
          grads, state, params, weight=x.shape[0], closing=closing
        )
        return optax.apply_updates(params, updates), state

      step = jax.shard_map(
        local,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=(P(), P()),
        check_vma=False,
      )
      args = (params, tx.init(params), batch["x"], batch["y"])
    else:
      options: dict[str, Any] = {"unreduced_axes": "data"}
      if placement == "zero1":
        options["inner_state_axes"] = "data"
      if placement == "unreduced_noise_scale":
        options["noise_scale_decay"] = 0.9
      tx = ga_optax.accumulate(optax.adam(1e-3), 4, **options)
      value_and_grad = ga_optax.unreduced_value_and_grad(loss_fn)

      def step(params, state, batch):
        _, grads = value_and_grad(params, batch)
        updates, state = tx.update(grads, state, params, closing=closing)
        return optax.apply_updates(params, updates), state

      args = (params, tx.init(params), batch)
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
  assert_guarded_as_the_form_says(jaxpr, closing, form)


@pytest.mark.parametrize("form", window_form.FORMS)
def test_the_host_scheduled_micro_step_does_not_depend_on_the_window_form(
  form, monkeypatch
):
  """Neither form is traced: the same program whichever is pinned."""
  monkeypatch.setenv(window_form.VARIABLE, form)
  tx = ga_optax.accumulate(optax.adam(1e-3), 2)
  params = init_params()
  grads = jax.grad(loss_fn)(params, micro_batches([3])[0])

  def step(grads, state):
    return tx.update(grads, state, params, closing=False)

  jaxpr = jax.make_jaxpr(step)(grads, tx.init(params))
  monkeypatch.delenv(window_form.VARIABLE)
  assert str(jaxpr) == str(jax.make_jaxpr(step)(grads, tx.init(params)))


def test_an_adaptive_k_read_once_per_window_is_the_large_batch():
  """The host reads the next window's k when a window closes.

  Every window is the large-batch step of the micro-batches the host put in
  it, whatever k the noise scale chose.
  """
  optimizer = optax.sgd(0.2)
  tx = ga_optax.accumulate(
    optimizer,
    # Decides from the first window on, so that the windows differ in size.
    ga_optax.batch_size.adaptive_k(2, max_k=8, warmup_windows=1),
    noise_scale_decay=0.0,
  )

  @functools.partial(jax.jit, static_argnames="closing")
  def step(params, state, batch, closing):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(
      grads, state, params, weight=batch["x"].shape[0], closing=closing
    )
    return optax.apply_updates(params, updates), state

  stream = iter(micro_batches([4] * 40, seed=5))
  params, state = init_params(), tx.init(init_params())
  windows = []
  for _ in range(5):
    k = int(ga_optax.current_k(state))  # once per window
    window = [next(stream) for _ in range(k)]
    for index, batch in enumerate(window):
      params, state = step(params, state, batch, closing=index == k - 1)
    windows.append(window)
  assert int(ga_optax.applied_updates(state)) == 5
  # The noise scale moved k: the windows are not all of one size.
  assert len({len(window) for window in windows}) > 1
  assert_close_and_finite(params, large_batch(optimizer, windows))


@pytest.mark.parametrize("fused", [False, True])
def test_a_loss_scale_drops_the_window_of_an_overflow_as_the_host_closes_it(
  fused,
):
  """``dynamic_loss_scale`` under ``closing=``: one scale per window.

  The loss is scaled by the scale the window started with, a window that
  holds an Inf is dropped whole when the host closes it (the scale halves),
  and the others are the large batch's steps: the reference steps Adam on
  the finite windows' concatenated rows and skips the dropped one.
  """
  windows = [micro_batches([3, 5, 2], seed) for seed in range(4)]
  windows[1][1]["x"] = windows[1][1]["x"].at[0, 0].set(jnp.inf)
  optimizer = optax.adam(0.05)
  scaled = ga_optax.mixed_precision.dynamic_loss_scale(optimizer)
  tx = (ga_optax.accumulate_and_apply if fused else ga_optax.accumulate)(
    scaled, 3
  )

  @functools.partial(jax.jit, static_argnames="closing")
  def step(params, state, batch, closing):
    scale = ga_optax.mixed_precision.loss_scale(state)
    grads = jax.grad(lambda p: loss_fn(p, batch) * scale)(params)
    weight = batch["x"].shape[0]
    if fused:
      return tx.apply(params, grads, state, weight=weight, closing=closing)
    updates, state = tx.update(
      grads, state, params, weight=weight, closing=closing
    )
    return optax.apply_updates(params, updates), state

  params, state = init_params(), tx.init(init_params())
  scales = []
  for window in windows:
    for index, batch in enumerate(window):
      params, state = step(params, state, batch, closing=index == 2)
    scales.append(float(ga_optax.mixed_precision.loss_scale(state)))
  initial = float(ga_optax.mixed_precision.loss_scale(tx.init(params)))
  assert scales == [initial, initial / 2, initial / 2, initial / 2]
  assert int(ga_optax.mixed_precision.dropped_windows(state)) == 1
  assert int(ga_optax.applied_updates(state)) == 4
  kept = [window for index, window in enumerate(windows) if index != 1]
  assert_close_and_finite(params, large_batch(optimizer, kept))


# A window without weight, differentiated: the closing program steps the
# optimizer and selects the step away, and the select's derivative is 0
# times the step's. On a zero gradient Adam's is infinite (the square root
# of a second moment at 0), and 0 * inf was NaN where the device's schedule,
# which does not run the step, gives 0.

WEIGHTLESS = {
  "zeros": [0.0, 0.0, 0.0],  # weights learnt from 0, all still at 0
  "cancelling": [1.0, -1.0, 0.0],  # traced, so a negative one subtracts
  "weighted": [0.0, 0.5, 1.5],  # the reference's check: a step
}


def weighted_large_batch(
  weights: jax.Array, params: Any, batches: list[Any], reduction: str
) -> jax.Array:
  """The loss after one bare Adam step of the weighted batch, if it has weight.

  The independent reference: ``jax.grad`` of the micro-batches' weighted
  loss, normalised by the total weight for a mean, and no step where the
  total is not positive (``lax.cond``: the untaken step has no derivative).
  """
  adam = optax.adam(0.1)

  def weighted_loss(params: Any) -> jax.Array:
    return sum(
      weight * loss_fn(params, batch)
      for weight, batch in zip(weights, batches, strict=True)
    )

  total = jnp.sum(weights)

  def step(params: Any) -> Any:
    grads = jax.grad(weighted_loss)(params)
    if reduction == "mean":
      grads = jax.tree.map(lambda grad: grad / total, grads)
    updates, _ = adam.update(grads, adam.init(params), params)
    return optax.apply_updates(params, updates)

  stepped = jax.lax.cond(total > 0, step, lambda params: params, params)
  return loss_fn(stepped, whole(batches))


def whole(batches: list[Any]) -> Any:
  return jax.tree.map(lambda *rows: jnp.concatenate(rows), *batches)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("path", ["accumulate", "accumulate_and_apply"])
def test_a_window_without_weight_has_the_large_batch_derivative(
  path, reduction
):
  batches = micro_batches([3, 2, 4], seed=7)
  k = len(batches)

  def after_window(weights: jax.Array, params: Any) -> jax.Array:
    tx = getattr(ga_optax, path)(optax.adam(0.1), k, reduction=reduction)
    state, start = tx.init(params), params
    for index, batch in enumerate(batches):
      grads = jax.grad(loss_fn)(start, batch)
      options = {"weight": weights[index], "closing": index == k - 1}
      if path == "accumulate":
        updates, state = tx.update(grads, state, params, **options)
        params = optax.apply_updates(params, updates)
      else:
        params, state = tx.apply(params, grads, state, **options)
    return loss_fn(params, whole(batches))

  derivative = jax.jit(jax.grad(after_window, argnums=(0, 1)))
  expected = jax.jit(
    jax.grad(
      functools.partial(
        weighted_large_batch, batches=batches, reduction=reduction
      ),
      argnums=(0, 1),
    )
  )
  for name, weights in WEIGHTLESS.items():
    weights = jnp.asarray(weights, jnp.float32)
    actual = derivative(weights, init_params())
    reference = expected(weights, init_params())
    if name != "weighted":
      np.testing.assert_array_equal(reference[0], np.zeros(k))
    chex.assert_tree_all_finite(actual)
    chex.assert_trees_all_close(actual, reference, rtol=2e-5, atol=1e-6)
