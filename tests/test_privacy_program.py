"""A private window as the real XLA:GPU compiler builds it, with no GPU.

Compiled for compile-only H100s through ``ga_optax.testing.audit``, on the
host's schedule (``closing=`` from a Poisson draw's end): a private
micro-step moves what the plain window's micro-step moves on the same
clipped sums (the privacy is all in the closing program), and holds no
random-number op; on 8 GPUs a micro-step exchanges no gradient, and the
closing program reduces the window once (that the noise is then drawn once,
not once per device, tests/test_privacy.py holds against the one-device
run).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from gpu_compiler import or_skip
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import ga_optax
from ga_optax import privacy
from ga_optax._src import audits
from ga_optax.testing import audit

WIDTH = 256
ROWS = 8
CLIP = 1.0
# The random-number ops a draw compiles to: XLA's own generator, or the
# threefry hash JAX's default keys lower to (a custom call or its rounds).
RANDOM = re.compile(r"rng-bit-generator|threefry", re.IGNORECASE)


def example_loss(params, example):
  prediction = jnp.tanh(example["x"] @ params["w"] + params["b"])
  return 0.5 * jnp.sum((prediction - example["y"]) ** 2)


def params_of():
  return {
    "w": jnp.full((WIDTH, WIDTH), 0.01, jnp.float32),
    "b": jnp.zeros(WIDTH, jnp.float32),
  }


def batch_of(rows=ROWS):
  return {"x": jnp.ones((rows, WIDTH)), "y": jnp.zeros((rows, WIDTH))}


def private(**keywords):
  return privacy.accumulate(
    optax.sgd(0.1),
    4,
    l2_clip_norm=CLIP,
    noise_multiplier=1.1,
    normalize_by=32.0,
    key=jax.random.key(0),
    **keywords,
  )


def plain(**keywords):
  # The same window without privacy: clipped sums summed, then the optimizer.
  return ga_optax.accumulate(optax.sgd(0.1), 4, reduction="sum", **keywords)


def step_of(tx, gradients):
  def step(params, state, batch, mask, *, closing):
    _, clipped_sum = gradients(params, batch, mask)
    updates, state = tx.update(clipped_sum, state, params, closing=closing)
    return optax.apply_updates(params, updates), state

  return step


def arguments(tx, rows=ROWS):
  params = params_of()
  return params, tx.init(params), batch_of(rows), jnp.ones(rows)


def random_ops(closing: bool, tx, gradients, args) -> int:
  """The random-number ops of the program compiled for one H100."""
  step = step_of(tx, gradients)
  program = or_skip(
    audits.compile_for_gpu,
    lambda *a: step(*a, closing=closing),
    *args,
  )
  return len(RANDOM.findall(program.as_text()))


def test_a_private_micro_step_costs_what_the_plain_one_does():
  gradients = privacy.clipped_grad_sum(example_loss, CLIP)
  reports = {}
  for name, tx in (("private", private()), ("plain", plain())):
    reports[name] = or_skip(
      audit,
      step_of(tx, gradients),
      *arguments(tx),
      target="h100",
      donate_argnums=(0, 1),
      closing=False,
    )
  (private_step,) = reports["private"].paths
  (plain_step,) = reports["plain"].paths
  assert private_step.path == plain_step.path == "micro_step"
  # The key and the window count are 12 bytes of state, passed through.
  assert private_step.bytes_moved <= plain_step.bytes_moved + 64
  assert private_step.duplicated_bytes == plain_step.duplicated_bytes
  tx = private()
  args = arguments(tx)
  assert random_ops(False, tx, gradients, args) == 0
  assert random_ops(True, tx, gradients, args) > 0


@pytest.mark.devices(8)
def test_on_8_gpus_a_private_window_reduces_once_at_its_close():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  tx = private(unreduced_axes="data")
  per_device = privacy.clipped_grad_sum(example_loss, CLIP)

  def own_sum(params, rows, mask):
    # Each device's clipped sum, stacked along the devices.
    loss, total = per_device(params, rows, mask)
    return loss[None], jax.tree.map(lambda leaf: leaf[None], total)

  def gradients(params, batch, mask):
    losses, stacked = jax.shard_map(
      own_sum, in_specs=(P(), P("data"), P("data")), out_specs=P("data")
    )(params, batch, mask)
    # Summed over the devices, left unreduced: no collective yet.
    unreduced = jax.tree.map(
      lambda leaf: jnp.einsum(
        "d...->...", leaf, out_sharding=P(unreduced={"data"})
      ),
      stacked,
    )
    return losses, unreduced

  with jax.set_mesh(mesh):
    params = jax.device_put(params_of(), P())
    state = tx.init(params)
    batch = jax.device_put(batch_of(64), P("data"))
    mask = jax.device_put(jnp.ones(64), P("data"))
  step = step_of(tx, gradients)
  reports = {
    closing: or_skip(
      audit, step, params, state, batch, mask, target="8xh100", closing=closing
    )
    for closing in (False, True)
  }
  (micro_step,) = reports[False].paths
  (closing,) = reports[True].paths
  gradient_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params_of()))
  # A micro-step adds each device's clipped sums: no gradient crosses.
  assert micro_step.collective_bytes < gradient_bytes, micro_step.collectives
  # The closing program reduces the window's sums once, across devices.
  reduced = [
    size for opcode, size in closing.collectives if "all-reduce" in opcode
  ]
  assert gradient_bytes <= sum(reduced) < 2 * gradient_bytes, (
    closing.collectives
  )
