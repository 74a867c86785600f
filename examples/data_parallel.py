"""Data-parallel training with device-local gradient accumulation.

A small Flax MLP learns scikit-learn's bundled digits (8x8 images, 10
classes). Every device runs its own micro-batches and accumulates their
gradients locally; the devices exchange gradients once per window, when it
closes (``ga_optax.accumulate(..., axis_name="data")`` inside
``jax.shard_map``). For comparison, the same windows are trained on one
device as plain large batches; the two runs end with the same parameters.

Runs on 8 simulated CPU devices by default, on every GPU when there are any::

  python examples/data_parallel.py
  python examples/data_parallel.py --epochs=20 --microbatch=16
"""

from __future__ import annotations

import os

# Must happen before jax is imported; it only adds CPU devices, so GPUs,
# when present, are still the default backend.
if "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits

import ga_optax
from ga_optax.testing import max_relative_difference


class MLP(nn.Module):
  """Two dense layers: enough to learn digits to about 95% accuracy."""

  hidden: int

  @nn.compact
  def __call__(self, images: jax.Array) -> jax.Array:
    hidden = nn.relu(nn.Dense(self.hidden)(images))
    return nn.Dense(10)(hidden)


def load_data(seed: int) -> tuple[np.ndarray, ...]:
  digits = load_digits()
  images = (digits.data / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(labels))
  images, labels = images[order], labels[order]
  num_test = len(labels) // 6
  return (
    images[num_test:],
    labels[num_test:],
    images[:num_test],
    labels[:num_test],
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument(
    "--microbatch", type=int, default=8, help="examples per device per step"
  )
  parser.add_argument("--accumulation-steps", type=int, default=4)
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  devices = jax.devices()
  mesh = Mesh(np.array(devices), ("data",))
  num_devices = len(devices)
  window = num_devices * args.microbatch * args.accumulation_steps
  train_images, train_labels, test_images, test_labels = load_data(args.seed)

  model = MLP(args.hidden)
  initial_params = model.init(
    jax.random.key(args.seed), jnp.zeros((1, train_images.shape[1]))
  )

  def loss_fn(params, images, labels):
    logits = model.apply(params, images)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()

  optimizer = optax.adamw(args.learning_rate, weight_decay=1e-4)
  tx = ga_optax.accumulate(optimizer, args.accumulation_steps, axis_name="data")

  def device_step(params, state, images, labels):
    # Runs on each device with its own micro-batch: no collective here
    # until the window closes inside tx.update.
    grads = jax.grad(loss_fn)(params, images, labels)
    updates, state = tx.update(grads, state, params, weight=images.shape[0])
    return optax.apply_updates(params, updates), state

  data_parallel_step = jax.jit(
    jax.shard_map(
      device_step,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P(), P()),
      check_vma=False,
    ),
    donate_argnums=(0, 1),
  )

  @jax.jit
  def large_batch_step(params, opt_state, images, labels):
    grads = jax.grad(loss_fn)(params, images, labels)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  @jax.jit
  def evaluate(params, images, labels):
    logits = model.apply(params, images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return loss.mean(), jnp.mean(jnp.argmax(logits, -1) == labels)

  # Copies, because the data-parallel step donates its inputs.
  params = jax.tree.map(jnp.array, initial_params)
  state = tx.init(params)
  reference_params = jax.tree.map(jnp.array, initial_params)
  reference_state = optimizer.init(reference_params)
  rng = np.random.default_rng(args.seed)
  num_windows = 0
  seconds = {"deferred": 0.0, "large batch": 0.0}
  for _ in range(args.epochs):
    order = rng.permutation(len(train_labels))
    for start in range(0, len(order) - window + 1, window):
      rows = order[start : start + window]
      images, labels = train_images[rows], train_labels[rows]

      began = time.perf_counter()
      # Micro-step s hands each device its own args.microbatch rows.
      per_device = images.reshape(
        num_devices, args.accumulation_steps, args.microbatch, -1
      )
      per_device_labels = labels.reshape(
        num_devices, args.accumulation_steps, args.microbatch
      )
      for micro_step in range(args.accumulation_steps):
        params, state = data_parallel_step(
          params,
          state,
          per_device[:, micro_step].reshape(-1, images.shape[1]),
          per_device_labels[:, micro_step].reshape(-1),
        )
      jax.block_until_ready(params)
      seconds["deferred"] += time.perf_counter() - began

      began = time.perf_counter()
      reference_params, reference_state = large_batch_step(
        reference_params, reference_state, images, labels
      )
      jax.block_until_ready(reference_params)
      seconds["large batch"] += time.perf_counter() - began
      num_windows += 1

  print(
    f"{num_devices} x {devices[0].platform} devices, micro-batch"
    f" {args.microbatch} per device, k = {args.accumulation_steps}:"
    f" {window} examples per update, {num_windows} updates\n"
  )
  print("| run | devices | test loss | test accuracy | seconds |")
  print("|---|---:|---:|---:|---:|")
  for name, run_params, run_devices, key in (
    ("deferred reduction (ga_optax)", params, num_devices, "deferred"),
    ("large batch, one device", reference_params, 1, "large batch"),
  ):
    loss, accuracy = evaluate(run_params, test_images, test_labels)
    print(
      f"| {name} | {run_devices} | {float(loss):.4f} |"
      f" {float(accuracy):.3f} | {seconds[key]:.2f} |"
    )
  difference = max_relative_difference(
    jax.device_get(params), jax.device_get(reference_params)
  )
  print(
    f"\nlargest relative parameter difference between the runs: {difference:.1e}"
  )


if __name__ == "__main__":
  main()
