"""Every combination of the features that place a window, against the large batch.

The features meet in one generated matrix: where the window lives across
devices (one device; ``jax.shard_map`` with ``axis_name``, ``check_vma`` both
ways; plain ``jax.jit`` with ``unreduced_axes`` on Explicit axes, alone and
with ``inner_state_axes`` as a rule and as a spec tree) x where the state is
kept (device memory; the accumulator in host memory; the accumulator and the
optimizer state in host memory) x what a call returns (``accumulate``'s
updates, ``accumulate_and_apply``'s params), each case under one of three
schedules (the device chooses the side, from its counter; the host does,
with ``closing=``; or the host, then the device, then the host again,
switching at window boundaries, the second switch right after a window the
device closed with ``flush``) and checkpointed
mid-window by every way its mode offers (a plain copy, ``stack`` /
``unstack_partial_sums``, ``consolidate`` / ``split_total``) or not at all.

Every case runs the same ten micro-steps through all the other features at
once: token weights (every micro-batch holds its own number of real rows,
each device its own share), a ``{update_step: k}`` schedule (k = 2, then 3),
a ``flush`` that closes a short window (``closing=True`` where the host
schedules), a micro-step whose gradients
are NaN, dropped by ``skip_nonfinite``, and the gradient noise scale, held
to a NumPy computation of the contract from each mode's micro-gradients. The windows that result
hold unequal weights, and plain SGD makes the update the gradient's own
scale: each case must end where the one-device large batch ends, computed
with ``jax.grad`` over each window's rows and the bare optimizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
  IN,
  OUT,
  assert_finite_and_close,
  init_params,
  large_batch_reference,
  token_mean_loss,
  token_sum_loss,
  tokens,
  whole,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ga_optax

DEVICES = 8
ROWS = 2  # per device and micro-step
SGD = optax.sgd(0.3)
EVERY_K = {0: 2, 2: 3}
NUM_MICRO_STEPS = 10
NAN_STEP = 3  # its gradients are NaN: skipped, not counted
FLUSH_STEP = 6  # closes the third window after 2 of its 3 micro-steps
# What the schedule, the skip and the flush make of the ten micro-steps.
WINDOWS = ((0, 1), (2, 4), (5, 6), (7, 8, 9))
# The micro-steps a host schedule closes a window on.
CLOSING_STEPS = frozenset(window[-1] for window in WINDOWS)
# Who chooses the side of each micro-step: the device (None), or the host.
SCHEDULES = {
  "device": (None,) * NUM_MICRO_STEPS,
  "host": tuple(index in CLOSING_STEPS for index in range(NUM_MICRO_STEPS)),
  # Host, device for the flushed window (5, 6), host again.
  "switching": tuple(
    None if index in WINDOWS[2] else index in CLOSING_STEPS
    for index in range(NUM_MICRO_STEPS)
  ),
}
# The state is saved after eight micro-steps: the last window then holds
# the partial sums of micro-step 7, its first. There every row of one device
# is padding, so the devices differ in what they count (K, the weight) as
# well as in their sums, and a saved sum that stands for every device's is
# wrong.
CHECKPOINT_AFTER = 8
ZERO_WEIGHT_STEP, ZERO_WEIGHT_DEVICE = 7, 0
NOISE_DECAY = 0.5

pytestmark = pytest.mark.devices(DEVICES)


def micro_batches() -> list[dict[str, np.ndarray]]:
  """Ten micro-batches of 16 rows, each with its own share of padding."""
  rng = np.random.default_rng(7)
  batches = []
  for index in range(NUM_MICRO_STEPS):
    rows = DEVICES * ROWS
    mask = (rng.random(rows) < 0.3 + 0.06 * index).astype(np.float32)
    mask[index % rows] = 1.0  # every micro-batch holds a real row
    batch = {
      "x": rng.standard_normal((rows, IN), np.float32),
      "y": rng.standard_normal((rows, OUT), np.float32),
      "mask": mask,
    }
    if index == ZERO_WEIGHT_STEP:
      device_rows = slice(
        ROWS * ZERO_WEIGHT_DEVICE, ROWS * (ZERO_WEIGHT_DEVICE + 1)
      )
      mask[device_rows] = 0.0
      assert mask.any()
    if index == NAN_STEP:
      # On a real row: a device whose rows are all padding weighs 0, and
      # its gradient (0 / 0 there) is dropped before it is ever added.
      batch["x"][index % rows, 0] = np.nan
    batches.append(batch)
  return batches


def reference(params: Any, batches: list[dict[str, np.ndarray]]) -> Any:
  windows = [[batches[index] for index in window] for window in WINDOWS]
  weights = [sum(float(b["mask"].sum()) for b in window) for window in windows]
  assert len(set(weights)) == len(weights), weights
  return large_batch_reference(SGD, params, windows)


_micro_grad = jax.jit(jax.grad(token_mean_loss))


def micro_gradients(parallel: str, params: Any, batch: Any) -> list:
  """The micro-gradients one micro-step adds, as the mode defines them."""
  if parallel in ("one_device", "shard_map_checked"):
    return [(flat(_micro_grad(params, batch)), float(batch["mask"].sum()))]
  shares = [
    {name: array[ROWS * d : ROWS * (d + 1)] for name, array in batch.items()}
    for d in range(DEVICES)
  ]
  if parallel == "shard_map_unchecked":
    return [
      (flat(_micro_grad(params, rows)), float(rows["mask"].sum()))
      for rows in shares
    ]
  # Plain jit: a device's partial sum n_d g_d / N, times D, of weight N / D.
  total = float(batch["mask"].sum())
  return [
    (
      DEVICES
      * float(rows["mask"].sum())
      / total
      * flat(_micro_grad(params, rows)),
      total / DEVICES,
    )
    for rows in shares
  ]


def flat(tree: Any) -> np.ndarray:
  return np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(tree)])


def noise_reference(parallel: str, params: Any, batches: list) -> tuple:
  """The contract's smoothed estimates, along the large batch's trajectory."""
  grad_sq = trace_sigma = debias = 0.0
  for window in WINDOWS:
    kept = [
      (g, w)
      for index in window
      for g, w in micro_gradients(parallel, params, batches[index])
      if w > 0
    ]
    weight = sum(w for _, w in kept)
    mean = sum(w * g for g, w in kept) / weight
    squares = sum(w * float(g @ g) for g, w in kept)
    window_trace = (squares - weight * float(mean @ mean)) / (len(kept) - 1)
    window_grad_sq = float(mean @ mean) - window_trace / weight
    grad_sq = NOISE_DECAY * grad_sq + (1 - NOISE_DECAY) * window_grad_sq
    trace_sigma = NOISE_DECAY * trace_sigma + (1 - NOISE_DECAY) * window_trace
    debias = NOISE_DECAY * debias + (1 - NOISE_DECAY)
    params = large_batch_reference(SGD, params, [[batches[i] for i in window]])
  return grad_sq / debias, trace_sigma / debias


@dataclasses.dataclass(frozen=True)
class Case:
  parallel: str
  residency: str
  path: str
  schedule: str
  checkpoint: str

  @property
  def options(self) -> dict[str, Any]:
    options: dict[str, Any] = {
      "skip_nonfinite": True,
      "noise_scale_decay": NOISE_DECAY,
    }
    if self.residency in ("accumulator_host", "both_host"):
      options["accumulator_memory_kind"] = "pinned_host"
    if self.residency == "both_host":
      options["inner_state_memory_kind"] = "pinned_host"
    if self.parallel.startswith("shard_map"):
      options["axis_name"] = "data"
    if self.parallel in ("unreduced", "zero_rule", "zero_specs"):
      options["unreduced_axes"] = "data"
    if self.parallel == "zero_rule":
      options["inner_state_axes"] = "data"
    if self.parallel == "zero_specs":
      options["inner_state_axes"] = {
        "w": P(None, "data"),
        "b": P(),
        "scale": P("data"),
        "w2": P("data", None),
      }
    return options


# The mid-window checkpoints each mode can take.
CHECKPOINTS = {
  "one_device": ("none", "copy"),
  "shard_map_unchecked": ("none", "consolidate"),
  # With check_vma=True the window holds gradients summed over the devices:
  # the same on every device, so a plain copy is the checkpoint.
  "shard_map_checked": ("none", "copy"),
  "unreduced": ("none", "stack", "consolidate"),
  "zero_rule": ("none", "stack", "consolidate"),
  "zero_specs": ("none", "stack", "consolidate"),
}
RESIDENCIES = ("device", "accumulator_host", "both_host")
PATHS = ("accumulate", "accumulate_and_apply")


def cases() -> list[Case]:
  """Every mode x residency x path; the schedules and the checkpoints cycle.

  Along the residencies the schedule turns, one further on for the second
  path and for each mode, so that each mode meets every schedule on both
  paths and each residency every schedule; the checkpoints cycle the same
  way, one further
  on along the paths (a plain cycle would give a mode of two checkpoints
  its second on one path only).
  """
  schedules = list(SCHEDULES)
  generated = []
  for mode, (parallel, checkpoints) in enumerate(CHECKPOINTS.items()):
    for (row, residency), (column, path) in itertools.product(
      enumerate(RESIDENCIES), enumerate(PATHS)
    ):
      schedule = schedules[(mode + row + column) % len(schedules)]
      checkpoint = checkpoints[(row + column) % len(checkpoints)]
      generated.append(Case(parallel, residency, path, schedule, checkpoint))
  return generated


class Runner:
  """One case's transformation, step and checkpoint, on its devices."""

  def __init__(
    self,
    case: Case,
    mesh: jax.sharding.Mesh,
    optimizer: optax.GradientTransformation = SGD,
  ) -> None:
    self.case, self.mesh = case, mesh
    if case.path == "accumulate":
      self.tx = ga_optax.accumulate(optimizer, EVERY_K, **case.options)
    else:
      self.tx = ga_optax.accumulate_and_apply(
        optimizer, EVERY_K, **case.options
      )
    # One program per side the host may choose, one for the device.
    self.steps = {
      closing: jax.jit(self._make_step(closing))
      for closing in set(SCHEDULES[case.schedule])
    }

  def step(self, params: Any, state: Any, batch: Any, index: int) -> Any:
    """Micro-step ``index``, on the side its schedule chooses."""
    closing = SCHEDULES[self.case.schedule][index]
    flush = jnp.asarray(index == FLUSH_STEP)
    return self.steps[closing](params, state, batch, flush)

  def apply(self, params, grads, state, weight, flush, closing):
    # Where the host chooses, its closing=True closes the flushed window.
    options = {"flush": flush} if closing is None else {"closing": closing}
    if self.case.path == "accumulate":
      updates, state = self.tx.update(
        grads, state, params, weight=weight, **options
      )
      return optax.apply_updates(params, updates), state
    return self.tx.apply(params, grads, state, weight=weight, **options)

  def _make_step(self, closing: bool | None) -> Callable[..., Any]:
    parallel = self.case.parallel
    if parallel == "one_device":

      def step(params, state, batch, flush):
        grads = jax.grad(token_mean_loss)(params, batch)
        return self.apply(params, grads, state, tokens(batch), flush, closing)

      return step
    if parallel.startswith("shard_map"):
      checked = parallel == "shard_map_checked"

      def local(params, state, batch, flush):
        if checked:
          # Autodiff sums the devices' gradients: each device's loss is its
          # token sum over the micro-batch's mean tokens per device, and
          # the weight is the micro-batch's, the same on every device.
          weight = jax.lax.psum(tokens(batch), "data")
          per_device = weight / jax.lax.axis_size("data")
          grads = jax.grad(lambda p: token_sum_loss(p, batch) / per_device)(
            params
          )
        else:
          weight = tokens(batch)
          grads = jax.grad(token_mean_loss)(params, batch)
        return self.apply(params, grads, state, weight, flush, closing)

      return jax.shard_map(
        local,
        mesh=self.mesh,
        in_specs=(P(), P(), P("data"), P()),
        out_specs=(P(), P()),
        check_vma=checked,
      )
    value_and_grad = ga_optax.unreduced_value_and_grad(
      token_mean_loss, weight_fn=tokens
    )

    def step(params, state, batch, flush):
      _, grads = value_and_grad(params, batch)
      return self.apply(params, grads, state, tokens(batch), flush, closing)

    return step

  def place(self, tree: Any, spec: P) -> Any:
    """``tree`` on the first device alone, or over the mesh as ``spec``."""
    if self.case.parallel == "one_device":
      return jax.device_put(tree, jax.devices()[0])
    return jax.device_put(tree, NamedSharding(self.mesh, spec))

  def checkpoint(self, state: Any, params: Any) -> Any:
    """``state`` saved to host NumPy mid-window and restored onto init's."""
    like = self.tx.init(params)
    kind = self.case.checkpoint
    if kind == "none":
      return state
    if kind == "copy":
      return restored(state, like)
    if kind == "stack":
      saved = ga_optax.planning.stack_partial_sums(state)
      return ga_optax.planning.unstack_partial_sums(
        restored(saved, ga_optax.planning.stack_partial_sums(like)), like
      )
    if self.case.parallel.startswith("shard_map"):
      in_map = in_shard_map(self.mesh)
      saved = in_map(
        lambda s: ga_optax.planning.consolidate(s, axis_name="data")
      )(state)
      return in_map(
        lambda s: ga_optax.planning.split_total(s, axis_name="data")
      )(restored(saved, like))
    saved = ga_optax.planning.consolidate(state)
    return ga_optax.planning.split_total(
      restored(saved, ga_optax.planning.consolidate(like)), like
    )


def in_shard_map(mesh: jax.sharding.Mesh) -> Callable[..., Any]:
  """Wraps a function of the state as a jitted ``shard_map`` over ``data``."""

  def wrap(function: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return jax.jit(
      jax.shard_map(
        function, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False
      )
    )

  return wrap


def restored(saved: Any, like: Any) -> Any:
  """A round trip through host NumPy, onto ``like``'s shardings."""
  on_host = jax.device_get(saved)
  return jax.tree.map(
    lambda leaf, twin: jax.device_put(np.asarray(leaf), twin.sharding),
    on_host,
    like,
  )


@pytest.mark.parametrize(
  "case", cases(), ids=lambda case: "-".join(vars(case).values())
)
def test_the_combination_ends_where_the_large_batch_ends(case: Case):
  batches = micro_batches()
  expected = reference(init_params(), batches)
  mesh = jax.make_mesh((DEVICES,), ("data",))
  one_device = case.parallel == "one_device"
  with contextlib.nullcontext() if one_device else jax.set_mesh(mesh):
    runner = Runner(case, mesh)
    params = runner.place(init_params(), P())
    state = runner.tx.init(params)
    for index, batch in enumerate(batches):
      if index == CHECKPOINT_AFTER:
        state = runner.checkpoint(state, params)
      batch = runner.place(batch, P("data"))
      params, state = runner.step(params, state, batch, index)
  assert int(ga_optax.applied_updates(state)) == len(WINDOWS)
  assert int(ga_optax.num_skipped(state)) == 1
  assert_finite_and_close(params, expected)
  estimate = ga_optax.noise_scale(state)
  grad_sq, trace_sigma = noise_reference(case.parallel, init_params(), batches)
  assert int(estimate.windows) == len(WINDOWS)
  np.testing.assert_allclose(
    [float(estimate.grad_sq), float(estimate.trace_sigma)],
    [grad_sq, trace_sigma],
    rtol=1e-4,
  )


# Reverse mode: the derivative of the loss after the ten micro-steps with
# respect to the learning rate, through every window, against the same
# derivative of the large batch: every case of ``cases``. State in host
# memory differentiates on one device; on several, every host case keeps
# either state inside jax.shard_map or an accumulator of partial sums in
# host memory, which JAX cannot differentiate: those raise a ValueError
# naming the argument, and a step not differentiated keeps them (the
# forward tests above).
REVERSE_CASES = cases()
LEARNING_RATE = 0.3


def differentiates(case: Case) -> bool:
  return case.residency == "device" or case.parallel == "one_device"


def large_batch_final_loss(
  learning_rate: jax.Array, batches: list[dict[str, np.ndarray]]
) -> jax.Array:
  """The loss over every window's rows after a plain SGD step per window."""
  params = init_params()
  for window in WINDOWS:
    rows = whole([batches[index] for index in window])
    grads = jax.grad(token_mean_loss)(params, rows)
    params = jax.tree.map(
      lambda param, grad: param - learning_rate * grad, params, grads
    )
  return token_mean_loss(params, all_rows(batches))


@functools.cache
def large_batch_derivative() -> float:
  """The large batch's derivative in the rate: the same for every case."""
  derivative = jax.grad(large_batch_final_loss)(
    jnp.asarray(LEARNING_RATE), micro_batches()
  )
  return float(derivative)


def all_rows(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  return whole([batches[index] for window in WINDOWS for index in window])


def with_learning_rate(state: Any, learning_rate: jax.Array) -> Any:
  """``state`` whose injected learning rate is ``learning_rate``."""
  found = ga_optax._src.window.state.find_state(state)
  injected = found.inner_state
  hyperparams = {**injected.hyperparams, "learning_rate": learning_rate}
  return found._replace(inner_state=injected._replace(hyperparams=hyperparams))


def learning_rate_of(state: Any) -> jax.Array:
  found = ga_optax._src.window.state.find_state(state)
  return found.inner_state.hyperparams["learning_rate"]


def scanned_runs(
  schedule: tuple[bool | None, ...],
) -> list[tuple[tuple[bool | None, ...], list[list[int]]]]:
  """The micro-steps differentiated, in runs that one ``lax.scan`` can drive.

  The NaN step is left out. Each device-scheduled micro-step is a block of
  its own (its ``flush`` is data); each host-scheduled window (``closing=``,
  a Python bool, is static) is one block. Consecutive blocks of the same
  sides make one run, ``(sides, blocks)``: scanned (``scans``), its body is
  one block, compiled once for the whole run. The device's schedule is one
  run of nine calls; the host's, three windows of two calls and one of
  three; the switching one, two windows of two, two calls of the device's
  and a window of three.
  """
  blocks, window = [], []
  for index in range(NUM_MICRO_STEPS):
    if index == NAN_STEP:
      continue
    if schedule[index] is None:
      assert not window, window
      blocks.append([index])
      continue
    window.append(index)
    if schedule[index]:
      blocks.append(window)
      window = []
  assert not window, window
  runs: list[tuple[tuple[bool | None, ...], list[list[int]]]] = []
  for block in blocks:
    sides = tuple(schedule[index] for index in block)
    if runs and runs[-1][0] == sides:
      runs[-1][1].append(block)
    else:
      runs.append((sides, [block]))
  return runs


def scans(case: Case, blocks: list[list[int]]) -> bool:
  """Whether a run's blocks are driven by one ``lax.scan`` or unrolled.

  Scanned where it compiles faster: a run of three blocks or more (a scan
  of one or two blocks compiled slower than the same calls unrolled: its
  loop carries and stacks the window's residuals). JAX differentiates no
  scan that carries state in host memory (the cotangent it gives a
  ``pinned_host`` leaf is typed in device memory, on JAX 0.10 and 0.12
  alike), so those cases are unrolled.
  """
  return case.residency == "device" and len(blocks) >= 3


@pytest.mark.parametrize(
  "case",
  REVERSE_CASES,
  # Nothing is checkpointed: a round trip through host NumPy has no
  # derivative.
  ids=lambda case: "-".join(
    (case.parallel, case.residency, case.path, case.schedule)
  ),
)
def test_reverse_mode_matches_the_large_batch(case: Case):
  batches = micro_batches()
  mesh = jax.make_mesh((DEVICES,), ("data",))
  one_device = case.parallel == "one_device"
  runs = scanned_runs(SCHEDULES[case.schedule])
  # Every micro-step but the NaN one, in order. A NaN input makes the
  # loss's own second derivative NaN (its backward pass multiplies a zero
  # cotangent by NaN), whatever the window does with the micro-batch: the
  # skip is the forward matrix's. Left out, it leaves the windows as they
  # were.
  assert [i for _, blocks in runs for b in blocks for i in b] == [
    index for index in range(NUM_MICRO_STEPS) if index != NAN_STEP
  ]
  with contextlib.nullcontext() if one_device else jax.set_mesh(mesh):
    # The rate is a leaf of the state, kept where the case keeps the
    # optimizer's state, and enters every step as the state does.
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=LEARNING_RATE)
    runner = Runner(case, mesh, optimizer)
    params = runner.place(init_params(), P())
    initial = runner.tx.init(params)
    # Per run, per place in its block: the blocks' micro-batches stacked,
    # and their flushes.
    scanned = [
      tuple(
        (
          runner.place(
            {
              name: np.stack([batches[block[place]][name] for block in blocks])
              for name in batches[0]
            },
            P(None, "data"),
          ),
          jnp.asarray([block[place] == FLUSH_STEP for block in blocks]),
        )
        for place in range(len(sides))
      )
      for sides, blocks in runs
    ]
    rows = runner.place(all_rows(batches), P("data"))

    def final_loss(learning_rate: jax.Array, state: Any) -> jax.Array:
      state = with_learning_rate(state, learning_rate)

      def block(sides, carry, places):
        moved, state = carry
        for closing, (batch, flush) in zip(sides, places, strict=True):
          moved, state = runner.steps[closing](moved, state, batch, flush)
        return (moved, state), None

      carry = (params, state)
      for (sides, blocks), places in zip(runs, scanned, strict=True):
        if scans(case, blocks):
          carry, _ = jax.lax.scan(
            functools.partial(block, sides), carry, places
          )
        else:
          for i in range(len(blocks)):
            carry, _ = block(
              sides, carry, jax.tree.map(lambda a, i=i: a[i], places)
            )
      return token_mean_loss(carry[0], rows)

    differentiate = jax.jit(jax.grad(final_loss))
    if not differentiates(case):
      with pytest.raises(ValueError, match="_memory_kind=None"):
        differentiate(learning_rate_of(initial), initial)
      return
    derivative = differentiate(learning_rate_of(initial), initial)
  expected = large_batch_derivative()
  assert abs(expected) > 1e-2  # a derivative worth comparing
  assert_finite_and_close(derivative, expected, rtol=1e-4, atol=1e-6)
