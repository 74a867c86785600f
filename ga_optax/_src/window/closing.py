"""The side of a micro-step that closes the window.

It runs when a window's last micro-step (or a flush) arrives: it adds the
last gradient (in the loop form), reduces the window over the devices,
normalises it, steps the wrapped optimizer once and decides the next
window's k. Like the side that keeps the window open
(:mod:`ga_optax._src.window.window`), it is the body of a loop of at most
one trip that carries only what it writes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from ga_optax._src.algebra import weights
from ga_optax._src.placements import residency
from ga_optax._src.window import run_once
from ga_optax._src.window.counters import increment_if

if TYPE_CHECKING:
  from ga_optax._src.window.window import MicroStep


@dataclasses.dataclass
class ClosingSide:
  """The side of a micro-step that closes the window.

  It adds the last gradient, reduces the window over the devices,
  normalises it and steps the wrapped optimizer once, writing its output
  (updates, or new params) into the micro-step's carrier buffer; then it
  decides the next window's k.

  Attributes:
    micro_step: the micro-step it is a side of.
    opened_accumulator: the accumulator as the other side left it, read
      when it does not carry the output.
    adds: whether this side adds the last gradient (it is then not in
      ``opened_accumulator``, since the other side did not run).
  """

  micro_step: MicroStep
  opened_accumulator: optax.Updates
  adds: bool

  def carry(self, opened: dict[str, Any]) -> dict[str, Any]:
    """What closing the window writes, its output's buffer among them.

    The accumulator is carried only when it is that buffer; otherwise the
    closing side reads it where keeping the window open left it.
    """
    micro_step = self.micro_step
    carry = {
      "inner_state": micro_step.window.inner_state_home.keep(
        micro_step.state.inner_state
      ),
      "noise": opened["noise"],
      # The state's own buffer, written only when the window closes: a
      # schedule's k is a constant, and a constant output frees its donated
      # buffer, which JAX may then pair with an output in another memory kind.
      "every_k": micro_step.state.every_k,
      "stepped": jnp.zeros((), jnp.bool_),
    }
    if micro_step.carrier == "accumulator":
      carry["accumulator"] = opened["accumulator"]
    elif micro_step.carrier == "grads":
      carry["grads"] = micro_step.grads
    elif micro_step.carrier == "params":
      carry["params"] = micro_step.params
    else:
      carry["zeros"] = optax.tree.zeros_like(micro_step.updates_like)
    return carry

  def normalised(self, sums: Any, weight_sum: jax.Array) -> Any:
    """The reduced window's mean, where its weight was not known before."""
    window = self.micro_step.window
    if window.parallel.weights_are_global or window.reduction != "mean":
      return sums
    # A window without weight does not step the inner optimizer anyway.
    scale = weights.reciprocal(weight_sum)
    return jax.tree.map(lambda total: total * scale.astype(total.dtype), sums)

  def close(self, carry: dict[str, Any]) -> dict[str, Any]:
    """The closing side: add, reduce, normalise, step the optimizer once."""
    micro_step = self.micro_step
    window = micro_step.window
    # A buffer that carries the output is read from the carry, so that it
    # is overwritten in place rather than copied.
    grads = carry.get("grads", micro_step.grads)
    accumulator = carry.get("accumulator", self.opened_accumulator)
    noise = carry["noise"]
    if self.adds:
      noise = window.noise.add(noise, micro_step.micro_batch(grads))
      accumulator = micro_step.added(accumulator, grads)
    sums, total_weight = window.parallel.reduce(
      accumulator,
      micro_step.admitted.weight_sum,
      carry.get("params", micro_step.params),
    )
    sums = self.normalised(sums, total_weight)
    reduced = jax.tree.map(
      lambda total, grad: total.astype(grad.dtype), sums, micro_step.grads
    )
    carry = {**carry, "noise": noise}
    step = functools.partial(self.step_inner, reduced, total_weight)
    if window.parallel.weights_are_global:
      closed = step(carry)
    else:
      # Only here is the window's total weight known: an empty window does
      # not step.
      closed = run_once.run_once_if(
        weights.has_weight(total_weight),
        step,
        carry,
        name=run_once.CLOSE_WINDOW,
      )
    return {
      **closed,
      "noise": window.noise.reset(closed["noise"], jnp.asarray(True)),
    }

  def step_inner(
    self, reduced: Any, total_weight: jax.Array, carry: dict[str, Any]
  ) -> dict[str, Any]:
    """The wrapped optimizer's one step on the window's reduced gradient."""
    micro_step = self.micro_step
    window = micro_step.window
    params = carry.get("params", micro_step.params)
    # A state kept in host memory visits the device here, and only here.
    inner_state = residency.to_device(carry["inner_state"])
    updates, new_inner_state = window.parallel.inner_update(
      window.inner, reduced, inner_state, params, micro_step.extra_args
    )
    every_k = micro_step.decision.every_k
    updates = window.lr_scaling.apply(
      updates, every_k, window.window_length.first()
    )
    # Measured in the gradients' own units: the wrapped optimizer's states
    # tell a loss scale, and a window it dropped.
    noise, micro_gradients = window.noise.close(
      carry["noise"],
      reduced,
      window.parallel,
      inner_states=(inner_state, new_inner_state),
    )
    # Gradients wider than the params (float32 for bfloat16, say) would
    # widen the optimizer's state; it keeps its dtypes from call to call.
    new_inner_state = window.inner_state_home.keep(
      _with_dtypes_of(new_inner_state, inner_state)
    )
    next_k = window.window_length.next(
      every_k,
      update_step=increment_if(micro_step.state.update_step, jnp.asarray(True)),
      noise=getattr(noise, "smoothed", None),
      micro_gradients=micro_gradients,
      window_weight=total_weight,
      full=micro_step.decision.micro_step >= micro_step.decision.every_k,
    )
    return {
      **carry,
      micro_step.carrier: window.output.closing_output(
        updates, params, carry[micro_step.carrier]
      ),
      "inner_state": new_inner_state,
      "noise": noise,
      "every_k": next_k,
      "stepped": jnp.ones((), jnp.bool_),
    }


def _with_dtypes_of(tree: Any, like: Any) -> Any:
  """``tree`` with each array leaf cast to the dtype of its twin in ``like``."""
  return jax.tree.map(
    lambda leaf, twin: (
      jnp.asarray(leaf).astype(twin.dtype) if hasattr(twin, "dtype") else leaf
    ),
    tree,
    like,
  )
