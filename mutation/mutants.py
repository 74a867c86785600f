"""The curated defects of the mutation check, and the tests that must see them.

Each mutant is a realistic bug, written as exact edits of the source under
``ga_optax/``: a snippet that must occur exactly once in its file, and its
replacement. When the library is refactored, ``python mutation/run.py``
stops on a snippet it cannot find; re-target the mutant at the new code (the
defect stays the same), never drop it. ``tests`` are the pytest node ids (or
files) that claim the guarantee the mutant breaks: only they run, so each
mutant costs seconds, and each must make at least one of them fail.

Guarantees (see ../shared/DESIGN.md, "The guarantees the tests must prove",
and the contract's additions): equivalence with the large batch (mean,
weights, flush, skipped micro-steps, schedules of k), k = 1 is the bare
optimizer, cost (the optimizer runs only when a window closes, on every
backend), data parallel (the global mean, collectives only where the window
closes), dtypes, counters, the memory planner, the in-step micro-batching,
host memory, and the docs that show all of these.
"""

from __future__ import annotations

from typing import NamedTuple


class Edit(NamedTuple):
  """Replace ``old`` (found exactly once) by ``new`` in ``path``."""

  path: str
  old: str
  new: str


class Mutant(NamedTuple):
  """A defect, the guarantee it breaks, and the tests that must catch it.

  ``window_form`` pins the window's form while the tests run
  (``GA_OPTAX_WINDOW_FORM``, see ga_optax/_src/window/window_form.py): a defect in
  code that only the loops run is executed on the CPU under ``"loops"``.
  """

  name: str
  guarantee: str
  defect: str
  edits: tuple[Edit, ...]
  tests: tuple[str, ...]
  window_form: str | None = None


WINDOW = "ga_optax/_src/window/window.py"
RUN_ONCE = "ga_optax/_src/window/run_once.py"
OUTPUT = "ga_optax/_src/window/output.py"
MICROBATCH = "ga_optax/_src/scan/microbatch_scan.py"
MICROBATCH_DEVICES = "ga_optax/_src/scan/microbatch_devices.py"
HLO = "ga_optax/_src/audits/hlo.py"
DEVICE_MEMORY = "ga_optax/_src/planning/device_memory.py"
PLANNER = "ga_optax/_src/planning/planner.py"
TREE_DIFFERENCE = "ga_optax/_src/audits/tree_difference.py"
BATCHNORM = "ga_optax/_src/recipes/batchnorm.py"
NOISE_SCALE = "ga_optax/_src/algebra/noise_scale.py"
ADAPTIVE = "ga_optax/_src/batch_size/adaptive.py"
ELASTIC = "ga_optax/_src/planning/elastic.py"
COLLECTIVE = "ga_optax/_src/placements/collective.py"
UNREDUCED = "ga_optax/_src/placements/unreduced.py"
PARTIAL_SUMS = "ga_optax/_src/planning/partial_sums.py"
ZERO = "ga_optax/_src/placements/zero.py"
COMPILED_PATHS = "ga_optax/_src/audits/compiled_paths.py"
HOST_WAITS = "ga_optax/_src/audits/host_waits.py"
GPU_RECIPE = "ga_optax/_src/recipes/gpu_recipe.py"
GPU_COMPILE = "ga_optax/_src/audits/gpu_compile.py"
FP8 = "ga_optax/_src/algebra/fp8.py"
WEIGHTS = "ga_optax/_src/algebra/weights.py"
ARGUMENTS = "ga_optax/_src/window/arguments.py"
MICRO_STEP = "ga_optax/_src/window/micro_step.py"
SCHEDULE = "ga_optax/_src/window/schedule.py"
LOCAL = "ga_optax/_src/placements/local.py"
RESIDENCY = "ga_optax/_src/placements/residency.py"
BATCH_LAYOUT = "ga_optax/_src/scan/batch_layout.py"
PARTS = "ga_optax/_src/algebra/parts.py"
PRIVATE_NOISE = "ga_optax/_src/privacy/noise.py"
PRIVATE_WINDOW = "ga_optax/_src/privacy/window.py"
PRIVATE_CLIPPING = "ga_optax/_src/privacy/clipping.py"
PRIVACY_TESTS = "tests/test_privacy.py"
TPU_COMPILE = "ga_optax/_src/audits/tpu_compile.py"

MUTANTS: tuple[Mutant, ...] = (
  # Equivalence with the large batch.
  Mutant(
    name="sum_instead_of_mean",
    guarantee="equivalence",
    defect="the closing micro-step emits sum(w_i g_i), never divided by"
    " the window's weight",
    edits=(
      Edit(
        MICRO_STEP,
        "scale = weights.reciprocal(total_weight)",
        "scale = jnp.ones_like(total_weight)",
      ),
    ),
    tests=(
      "tests/test_equivalence.py::test_uniform_micro_batches_match_the_large_batch[sgd-4]",
      "tests/test_dtypes.py::test_eagerly",
      "tests/test_fused.py::test_weighted_windows_match_the_large_batch",
      "tests/test_transformations.py::test_accumulate_matches_the_large_batch",
      "tests/test_memory_kinds.py::test_host_memory_matches_the_large_batch",
      "tests/test_fuzz.py::test_sgd_equals_the_large_batch_step",
    ),
  ),
  Mutant(
    name="weight_ignored",
    guarantee="equivalence (weights)",
    defect="weight= is dropped: every micro-step counts 1, an unweighted"
    " mean of the micro-batches' gradients",
    edits=(
      Edit(
        WINDOW,
        "weight_sum = state.weight_sum + jnp.asarray(weight, self.weight_dtype)",
        "weight_sum = state.weight_sum + jnp.asarray(1, self.weight_dtype)",
      ),
      Edit(
        MICRO_STEP,
        "added = total + weights.weighted(grad, weight, total.dtype)",
        "added = total + weights.weighted(grad, 1, total.dtype)",
      ),
    ),
    tests=(
      "tests/test_weights.py",
      "tests/test_fused.py::test_weighted_windows_match_the_large_batch",
    ),
  ),
  Mutant(
    name="flush_normalised_as_full",
    guarantee="equivalence (flush)",
    defect="a flushed partial window is divided as if it held k micro-steps"
    " of its mean weight (the 1/k bug)",
    edits=(
      Edit(
        MICRO_STEP,
        "scale = weights.reciprocal(total_weight)",
        "scale = call.decision.micro_step / (\n        total_weight * call.decision.every_k\n      )",
      ),
    ),
    tests=(
      "tests/test_equivalence.py::test_partial_last_window_closed_by_flush",
    ),
  ),
  Mutant(
    name="skipped_weight_counted",
    guarantee="equivalence (skipped non-finite micro-steps)",
    defect="a non-finite micro-step dropped by skip_nonfinite still adds its"
    " weight to the window's",
    edits=(
      Edit(
        WINDOW,
        "return Admitted(accepted, jnp.where(accepted, weight_sum, state.weight_sum))",
        "return Admitted(accepted, weight_sum)",
      ),
    ),
    tests=("tests/test_nonfinite.py",),
  ),
  Mutant(
    name="no_accumulation",
    guarantee="equivalence",
    defect="each micro-step overwrites the accumulator instead of adding to"
    " it: the window emits its last micro-batch's gradient",
    edits=(
      Edit(
        MICRO_STEP,
        "added = total + weights.weighted(grad, weight, total.dtype)",
        "added = jnp.zeros_like(total) + weights.weighted(grad, weight, total.dtype)",
      ),
    ),
    tests=(
      "tests/test_accumulate.py",
      "ga_optax/_src/window/transform.py",
    ),
  ),
  Mutant(
    name="empty_window_steps",
    guarantee="equivalence (empty windows)",
    defect="a window whose weights sum to 0 steps the optimizer on 0 / 0",
    edits=(
      Edit(
        MICRO_STEP,
        "has_weight = weights.has_weight(total_weight)",
        "has_weight = jnp.asarray(True)",
      ),
    ),
    tests=(
      "tests/test_weights.py",
      "tests/test_fused.py::test_matches_accumulate_then_apply_updates",
    ),
  ),
  Mutant(
    name="window_closes_one_late",
    guarantee="equivalence (every_k)",
    defect="the window closes on micro-step k + 1, not k",
    edits=(
      Edit(
        WINDOW,
        "closes = schedule.closes(micro_steps >= every_k, flush)",
        "closes = schedule.closes(micro_steps > every_k, flush)",
      ),
    ),
    tests=("tests/test_accumulate.py",),
  ),
  Mutant(
    name="fused_update_never_applied",
    guarantee="equivalence (fused path)",
    defect="accumulate_and_apply steps the optimizer but hands back the"
    " params unchanged",
    edits=(
      Edit(
        OUTPUT,
        "    del carrier\n    return optax.apply_updates(params, updates)\n",
        "    del carrier, updates\n    return params\n",
      ),
    ),
    tests=(
      "tests/test_dtypes.py::test_eagerly",
      "tests/test_fused.py::test_weighted_windows_match_the_large_batch",
    ),
  ),
  Mutant(
    name="closing_updates_zeroed",
    guarantee="equivalence",
    defect="the call that closes a window emits zeros: the select after the"
    " conditional never picks the updates",
    edits=(
      Edit(
        OUTPUT,
        "        stepped, carried.astype(like.dtype), jnp.zeros((), like.dtype)",
        "        False, carried.astype(like.dtype), jnp.zeros((), like.dtype)",
      ),
    ),
    tests=("tests/test_fuzz.py::test_sgd_equals_the_large_batch_step",),
  ),
  # Counters.
  Mutant(
    name="update_counter_counts_calls",
    guarantee="counters",
    defect="update_step (applied updates) advances on every call, as if it"
    " counted micro-steps",
    edits=(
      Edit(
        MICRO_STEP,
        "update_step=increment_if(state.update_step, closed.stepped),",
        "update_step=increment_if(state.update_step, jnp.asarray(True)),",
      ),
    ),
    tests=(
      "tests/test_counters.py",
      "tests/test_docs_snippets.py::test_page_runs[README.md]",
      "tests/test_docs_snippets.py::test_page_runs[docs/how-to/fused.md]",
    ),
  ),
  # Cost: the optimizer runs only on the side that closes the window, and a
  # micro-step copies nothing, as XLA:GPU compiles it.
  Mutant(
    name="window_as_conditional",
    guarantee="cost (a copy-free micro-step on XLA:GPU)",
    defect="each side of the window is a lax.cond instead of a loop of at"
    " most one trip: XLA:GPU copies every buffer the untaken side forwards,"
    " the optimizer state included, on every micro-step",
    edits=(
      Edit(
        RUN_ONCE,
        "    loops=functools.partial(_as_loop, body),\n",
        "    loops=functools.partial(_as_conditional, body),\n",
      ),
    ),
    tests=(
      "tests/test_gpu_program.py::test_one_gpu[adam]",
      "tests/test_gpu_program.py::test_one_gpu[fused_sgd]",
    ),
  ),
  Mutant(
    name="zeros_read_from_the_accumulator",
    guarantee="cost (accumulate's closing step zeroes without reading)",
    defect="the accumulator's zeros are computed from it (leaf * 0): the"
    " closing side's zeroing, after apply_updates has read the updates out"
    " of its buffer, reads the buffer it writes",
    edits=(
      Edit(
        LOCAL,
        "  return ((iota + (index + 1)) * 0).astype(leaf.dtype)\n",
        "  del iota\n"
        "  return jnp.where(jnp.isfinite(leaf), leaf * 0, jnp.zeros_like(leaf))\n",
      ),
    ),
    tests=("tests/test_gpu_program.py::test_bytes_moved_meet_the_targets",),
  ),
  Mutant(
    name="optimizer_runs_every_micro_step",
    guarantee="cost (the optimizer is not evaluated on micro-steps)",
    defect="both sides run on every micro-step and a select picks one,"
    " as optax.MultiSteps does",
    edits=(
      Edit(
        RUN_ONCE,
        "  return window_form.choose(\n"
        "    predicate,\n"
        "    carry,\n"
        "    invariants,\n"
        "    loops=functools.partial(_as_loop, body),\n"
        "    conditional=functools.partial(_as_conditional, body),\n"
        "  )\n",
        "  return jax.tree.map(\n"
        "    lambda ran, kept: jnp.where(predicate, ran, kept),\n"
        "    body(carry, *invariants),\n"
        "    carry,\n"
        "  )\n",
      ),
    ),
    tests=(
      "tests/test_compiled_window.py",
      "tests/test_gpu_program.py::test_one_gpu[adam]",
      "tests/test_accumulate.py",
    ),
  ),
  # The loop form, what GPUs and TPUs run: executed on the CPU with the form
  # pinned, since the CPU's own form never runs this code.
  Mutant(
    name="close_without_the_last_gradient",
    guarantee="equivalence (the GPU's form of the window)",
    defect="the closing side reads the accumulator as the micro-step found"
    " it: every window a GPU closes leaves its last micro-batch out",
    edits=(
      Edit(
        MICRO_STEP,
        "      accumulator=accumulator,\n",
        "      accumulator=call.accumulator,\n",
      ),
    ),
    tests=(
      "tests/test_equivalence.py::test_uniform_micro_batches_match_the_large_batch",
    ),
    window_form="loops",
  ),
  Mutant(
    name="noise_terms_not_kept",
    guarantee="the gradient noise scale (the GPU's form of the window)",
    defect="the closing side and the state keep the noise sums as the"
    " micro-step found them: each micro-gradient is left out, and the bytes"
    " hardly change",
    edits=(
      Edit(
        MICRO_STEP,
        "      parts=added_parts,\n",
        "      parts=call.state.parts,\n",
      ),
    ),
    tests=("tests/test_noise_scale.py::test_one_device_matches_numpy",),
    window_form="loops",
  ),
  Mutant(
    name="loop_predicate_never_cleared",
    guarantee="cost (each side of the window runs at most once)",
    defect="a loop's body hands its predicate back unchanged: the side that"
    " runs would run forever, and a GPU step hangs",
    edits=(
      Edit(
        RUN_ONCE,
        "return jnp.zeros((), jnp.bool_), body(carried, *read), read",
        "return state[0], body(carried, *read), read",
      ),
    ),
    tests=("tests/test_window_form.py::test_each_loop_runs_at_most_once",),
    window_form="loops",
  ),
  Mutant(
    name="loop_shardings_left_to_the_partitioner",
    guarantee="data parallel (ZeRO-1: the optimizer state stays sharded)",
    defect="inside the window's loops only unreduced values are pinned to"
    " their types; with a global-norm clip the partitioner gathers a ZeRO-1"
    " state whole before the loop, on every micro-step",
    edits=(
      Edit(
        RUN_ONCE,
        "      return leaf\n    return jax.reshard(leaf, sharding.spec)",
        "      return leaf\n"
        "    if not sharding.spec.unreduced:\n"
        "      return leaf\n"
        "    return jax.reshard(leaf, sharding.spec)",
      ),
    ),
    tests=(
      "tests/test_gpu_program.py::test_eight_gpus_under_plain_jit[zero1_clip_adamw_fused]",
      "tests/test_zero.py::test_clip_adamw_fused_shards_and_checkpoints",
    ),
  ),
  Mutant(
    name="loop_shardings_unpinned",
    guarantee="data parallel (the global mean under plain jit)",
    defect="inside the window's loops (on GPUs) no value is pinned to its"
    " type: the partitioner guesses the shardings of a ZeRO-1 state and of"
    " the partial sums the closing side reduces",
    edits=(
      Edit(
        RUN_ONCE,
        "    carried, read = pin_types(carried), pin_types(read)\n",
        "",
      ),
    ),
    tests=(
      "tests/test_zero.py::test_clip_adamw_fused_shards_and_checkpoints",
      "tests/test_gpu_program.py::test_eight_gpus_under_plain_jit[zero1_clip_adamw_fused]",
    ),
    window_form="loops",
  ),
  # Dtypes.
  Mutant(
    name="accumulator_dtype_ignored",
    guarantee="dtypes",
    defect="low-precision gradients are summed in their own dtype, not in"
    " accumulator_dtype (float32)",
    edits=(
      Edit(
        MICRO_STEP,
        "added = total + weights.weighted(grad, weight, total.dtype)",
        "added = (\n        total.astype(grad.dtype) + weights.weighted(grad, weight, grad.dtype)\n      ).astype(total.dtype)",
      ),
    ),
    tests=(
      "tests/test_dtypes.py::test_the_window_sum_of_low_precision_gradients_is_kept_in_float32",
      "tests/test_fuzz.py::test_low_precision_gradients_are_summed_in_float32",
    ),
  ),
  Mutant(
    name="state_dtypes_widened",
    guarantee="dtypes",
    defect="float32 gradients of bfloat16 params widen the optimizer's"
    " state to float32 at the first window",
    edits=(
      Edit(
        MICRO_STEP,
        "_with_dtypes_of(new_inner_state, inner_state)",
        "new_inner_state",
      ),
    ),
    tests=("tests/test_dtypes.py::test_eagerly",),
  ),
  Mutant(
    name="carrier_dtype_ignored",
    guarantee="dtypes (the updates' own precision)",
    defect="the closing side writes the updates into the first buffer of"
    " their shapes, whatever its dtype: a bfloat16 accumulator rounds the"
    " updates of float32 params",
    edits=(
      Edit(
        OUTPUT,
        "    update.shape == slot.shape\n"
        "    and jnp.promote_types(update.dtype, slot.dtype) == slot.dtype\n",
        "    update.shape == slot.shape\n",
      ),
    ),
    tests=(
      "tests/test_dtypes.py::test_a_bfloat16_accumulator_gives_float32_exact_updates",
    ),
  ),
  # In-step micro-batching.
  Mutant(
    name="microbatch_sum_in_param_dtype",
    guarantee="dtypes (in-step micro-batching)",
    defect="microbatched_value_and_grad sums low-precision gradients in"
    " their own dtype, not in float32",
    edits=(
      Edit(
        MICROBATCH,
        "      return total + weights.weighted(term, factor, total.dtype)\n",
        "      return (\n        total.astype(term.dtype) + weights.weighted(term, factor, term.dtype)\n      ).astype(total.dtype)\n",
      ),
    ),
    tests=(
      "tests/test_dtypes.py::test_microbatched_gradients_of_low_precision_params_are_summed_in_float32",
    ),
  ),
  Mutant(
    name="microbatch_weight_ignored",
    guarantee="equivalence (in-step micro-batching, weight_fn)",
    defect="microbatched_value_and_grad adds each micro-batch's gradient"
    " unweighted but divides by the sum of the weights",
    edits=(
      Edit(
        MICROBATCH,
        "factor = 1 if self.weight_fn is None else weight",
        "factor = 1",
      ),
    ),
    tests=(
      "tests/test_microbatch.py::test_token_weighted_loss_matches_large_batch",
    ),
  ),
  Mutant(
    name="microbatch_sum_instead_of_mean",
    guarantee="equivalence (in-step micro-batching)",
    defect="microbatched_value_and_grad returns the sums over micro-batches,"
    " not their mean",
    edits=(
      Edit(
        MICROBATCH,
        "    scale = weights.reciprocal(sums.weight)\n",
        "    scale = jnp.ones_like(sums.weight)\n",
      ),
    ),
    tests=(
      "tests/test_microbatch.py::test_mean_loss_matches_large_batch",
      "tests/test_docs_snippets.py::test_page_runs[docs/how-to/microbatching.md]",
    ),
  ),
  Mutant(
    name="microbatch_devices_share_rng",
    guarantee="in-step micro-batching (each device's own dropout masks)",
    defect="under plain jit the rng reaches every device unfolded by its"
    " index: the devices draw the same dropout masks for different rows",
    edits=(
      Edit(
        MICROBATCH_DEVICES,
        "    if local.rng is not None:\n"
        "      # Devices hold different entries: they must not share dropout masks.\n"
        "      local = local._replace(\n"
        "        rng=jax.random.fold_in(local.rng, jax.lax.axis_index(axes))\n"
        "      )\n",
        "",
      ),
    ),
    tests=(
      "tests/test_microbatch.py::test_rng_differs_across_devices_under_plain_jit",
    ),
  ),
  Mutant(
    name="batchnorm_between_not_rescaled",
    guarantee="BatchNorm statistics once per effective batch",
    defect="the variance between micro-batches is read off the stored"
    " means without undoing their (1 - m) factor",
    edits=(
      Edit(
        BATCHNORM,
        "between = spread / (1.0 - momentum)",
        "between = spread",
      ),
    ),
    tests=("tests/test_batchnorm.py",),
  ),
  # Host memory.
  Mutant(
    name="a_part_never_restarts",
    guarantee="the window's parts (each restarts after every close)",
    defect="the window's parts keep the closed window's sums: a part's"
    " next window starts from the last one's",
    edits=(
      Edit(
        MICRO_STEP,
        "        part.restart(value)\n",
        "        value\n",
      ),
    ),
    tests=(
      "tests/test_window_parts.py::test_one_device_carries_the_new_part_beside_the_noise_scale",
    ),
  ),
  Mutant(
    name="a_windowed_part_restarts_at_a_sums_zero",
    guarantee="the window's parts (each restarts at its own zero)",
    defect="a batch's part carried by the window restarts at 0, not at its"
    " own zero: a running minimum's next window starts from 0",
    edits=(
      Edit(
        PARTS,
        "        lambda zero, held: jnp.zeros_like(held) + zero,",
        "        lambda zero, held: jnp.zeros_like(held),",
      ),
    ),
    tests=(
      "tests/test_window_parts.py::test_a_window_restarts_a_part_at_its_own_zero",
    ),
  ),
  Mutant(
    name="a_scan_part_combined_by_a_sum",
    guarantee="the window's parts (each combined over devices by its own"
    " combine)",
    defect="the scan sums every part over the devices, a part combined by"
    " a max too",
    edits=(
      Edit(
        MICROBATCH,
        "        parts.across_axes(value, part.combine, axes)",
        '        parts.across_axes(value, "sum", axes)',
      ),
    ),
    tests=(
      "tests/test_window_parts.py::test_the_scan_combines_the_new_part_by_its_max_on_eight_devices",
    ),
  ),
  Mutant(
    name="accumulator_left_on_device",
    guarantee="host memory (accumulator_memory_kind)",
    defect="update brings the accumulator to the device to add, and does"
    " not send it back to its memory kind",
    edits=(
      Edit(
        MICRO_STEP,
        "    accumulator=window.accumulator_home.keep(\n"
        "      call.cleared(closed.accumulator, closed.stepped)\n"
        "    ),\n",
        "    accumulator=call.cleared(closed.accumulator, closed.stepped),\n",
      ),
    ),
    tests=(
      "tests/test_memory_kinds.py::test_every_update_keeps_the_state_there_and_the_numbers",
    ),
  ),
  # The batch size, closed loop.
  Mutant(
    name="adaptive_k_moved_by_a_flush",
    guarantee="batch size, closed loop (a flushed window moves nothing)",
    defect="a flushed window's weight decides the next k as a full one does",
    edits=(
      Edit(
        MICRO_STEP,
        "full=decision.micro_steps >= decision.every_k,",
        "full=jnp.asarray(True),",
      ),
    ),
    tests=("tests/test_adaptive.py::test_a_flushed_window_does_not_move_k",),
  ),
  Mutant(
    name="adaptive_k_counts_micro_steps_not_weight",
    guarantee="batch size, closed loop (B_simple against the window's weight)",
    defect="B_simple is compared with k, the micro-steps, instead of the"
    " window's total weight in the unit of the weights",
    edits=(
      Edit(
        ADAPTIVE,
        "    window_weight = window_weight.astype(b_simple.dtype)",
        "    window_weight = k.astype(b_simple.dtype)",
      ),
    ),
    tests=(
      "tests/test_adaptive.py::test_k_and_updates_follow_the_reference",
      "tests/test_adaptive.py::test_b_simple_is_weighed_against_the_windows_weight_not_k",
    ),
  ),
  Mutant(
    name="lr_scaling_rules_swapped",
    guarantee="batch size, closed loop (lr_scaling)",
    defect="'sqrt' scales the updates by k / k0 and 'linear' by its root",
    edits=(
      Edit(
        ADAPTIVE,
        'scale = jnp.sqrt(ratio) if self.rule == "sqrt" else ratio',
        'scale = ratio if self.rule == "sqrt" else jnp.sqrt(ratio)',
      ),
    ),
    tests=(
      "tests/test_adaptive.py::test_k_and_updates_follow_the_reference",
      "tests/test_adaptive.py::test_lr_scaling_follows_a_dict_schedule_too",
    ),
  ),
  Mutant(
    name="schedule_k_frozen_in_the_state",
    guarantee="elastic (a state resumed under another every_k follows it)",
    defect="a schedule's k is read from the state, as an adaptive k is: a"
    " run resumed with another k keeps the saved one",
    edits=(
      Edit(
        "ga_optax/_src/batch_size/every_k.py",
        '    """The schedule\'s k: a state resumed under another schedule follows it."""\n'
        "    del every_k\n"
        "    return self.schedule(update_step)",
        '    """The schedule\'s k: a state resumed under another schedule follows it."""\n'
        "    del update_step\n"
        "    return every_k",
      ),
    ),
    tests=(
      "tests/test_plain_jit_mesh.py::test_a_window_boundary_resumes_on_other_devices_with_another_k",
    ),
  ),
  # Semantics settled before 0.6.0: each a defect an adversarial pass found,
  # or a planted one the tests let through.
  Mutant(
    name="callable_k_below_one_kept",
    guarantee="schedules of k (a callable's k below 1 acts as 1)",
    defect="a callable every_k's values below 1 reach lr_scaling and"
    " current_k as they are: NaN, uphill or zero updates",
    edits=(
      Edit(
        "ga_optax/_src/batch_size/every_k.py",
        "    return jnp.maximum(jnp.asarray(schedule(update_step), jnp.int32), 1)",
        "    return jnp.asarray(schedule(update_step), jnp.int32)",
      ),
    ),
    tests=(
      "tests/test_every_k.py::test_a_callable_k_below_one_acts_as_one_everywhere",
    ),
  ),
  Mutant(
    name="current_k_lags_a_window",
    guarantee="counters (current_k is the open window's k)",
    defect="a closing window stores the schedule's k of the update before"
    " its own: current_k lags one window behind",
    edits=(
      Edit(
        MICRO_STEP,
        "        update_step=increment_if(call.state.update_step, jnp.asarray(True)),",
        "        update_step=call.state.update_step,",
      ),
    ),
    tests=(
      "tests/test_every_k.py::test_current_k_is_the_next_windows_k_after_each_close",
    ),
  ),
  Mutant(
    name="adaptive_k_grows_only_past_the_threshold",
    guarantee="batch size, closed loop (growth at B_simple >= the threshold)",
    defect="k grows only when B_simple is strictly above threshold * factor"
    " * W",
    edits=(
      Edit(
        ADAPTIVE,
        "      | (b_simple >= self.threshold * self.factor * window_weight)",
        "      | (b_simple > self.threshold * self.factor * window_weight)",
      ),
    ),
    tests=("tests/test_adaptive.py::test_k_grows_at_exactly_the_threshold",),
  ),
  Mutant(
    name="adaptive_k_shrinks_by_floor_division",
    guarantee="batch size, closed loop (k shrinks only by an exact division)",
    defect="a k that factor does not divide shrinks to k // factor",
    edits=(Edit(ADAPTIVE, "        & (k % self.factor == 0)\n", ""),),
    tests=(
      "tests/test_adaptive.py::test_a_k_that_factor_does_not_divide_does_not_shrink",
    ),
  ),
  Mutant(
    name="adaptive_k_shrinks_to_a_window_that_measures_nothing",
    guarantee="batch size, closed loop (k never freezes)",
    defect="min_k=1 on one device lets k shrink to 1, where a window"
    " measures nothing and the stale reading keeps it there",
    edits=(
      Edit(ADAPTIVE, "        & (micro_gradients // 2 >= self.factor)\n", ""),
    ),
    tests=(
      "tests/test_adaptive.py::test_min_k_one_keeps_measuring_on_one_device",
    ),
  ),
  Mutant(
    name="adaptive_k_growth_product_overflows",
    guarantee="batch size, closed loop (sizes within int32)",
    defect="growth is checked as k * factor <= max_k, a product that wraps"
    " in int32",
    edits=(
      Edit(
        ADAPTIVE,
        "    may_grow = k <= self.max_k // self.factor",
        "    may_grow = k * self.factor <= self.max_k",
      ),
    ),
    tests=(
      "tests/test_adaptive.py::test_factor_and_max_k_at_the_int32_limit_do_not_wrap",
    ),
  ),
  Mutant(
    name="lr_scaling_by_the_micro_steps_held",
    guarantee="batch size, closed loop (lr_scaling of a flushed window)",
    defect="the updates are scaled by the micro-steps the window held over"
    " the first k, not by its k: a flushed window's step shrinks",
    edits=(
      Edit(
        MICRO_STEP,
        "      updates, decision.every_k, window.window_length.first()\n",
        "      updates, decision.micro_steps, window.window_length.first()\n",
      ),
    ),
    tests=(
      "tests/test_adaptive.py::test_a_flushed_window_is_scaled_for_its_k",
    ),
  ),
  Mutant(
    name="adaptive_k_shrink_bound_times_threshold",
    guarantee="batch size, closed loop (shrink below W / (threshold * factor))",
    defect="k shrinks below W * threshold / factor: a threshold above 1"
    " shrinks k sooner instead of later",
    edits=(
      Edit(
        ADAPTIVE,
        "& (b_simple < window_weight / (self.threshold * self.factor))",
        "& (b_simple < window_weight * self.threshold / self.factor)",
      ),
    ),
    tests=(
      "tests/test_adaptive.py::test_k_shrinks_only_below_the_batch_over_threshold_times_factor",
    ),
  ),
  Mutant(
    name="adaptive_k_shrink_overrides_growth",
    guarantee="batch size, closed loop (growth is tried first)",
    defect="a reading that meets both rules (threshold < 1 / factor)"
    " shrinks k where it can grow",
    edits=(
      Edit(
        ADAPTIVE,
        "new_k = jnp.where(full & ~grows & shrinks, smaller, new_k)",
        "new_k = jnp.where(full & shrinks, smaller, new_k)",
      ),
    ),
    tests=(
      "tests/test_adaptive.py::test_a_reading_that_meets_both_rules_grows_k",
    ),
  ),
  Mutant(
    name="adaptive_k_decides_during_the_warm_up",
    guarantee="batch size, closed loop (the warm-up moves nothing)",
    defect="the first window's reading moves k whatever warmup_windows says",
    edits=(
      Edit(
        ADAPTIVE,
        "    warmed_up = noise.windows >= self.warmup_windows",
        "    warmed_up = noise.windows >= 1",
      ),
    ),
    tests=("tests/test_adaptive.py::test_no_decision_before_the_warm_up_ends",),
  ),
  Mutant(
    name="adaptive_k_warm_up_a_window_too_long",
    guarantee="batch size, closed loop (the warm-up ends on time)",
    defect="the window that completes the warm-up does not decide: the"
    " first move comes a window late",
    edits=(
      Edit(
        ADAPTIVE,
        "    warmed_up = noise.windows >= self.warmup_windows",
        "    warmed_up = noise.windows > self.warmup_windows",
      ),
    ),
    tests=("tests/test_adaptive.py::test_no_decision_before_the_warm_up_ends",),
  ),
  Mutant(
    name="adaptive_k_shrinks_during_the_warm_up",
    guarantee="batch size, closed loop (the warm-up moves nothing)",
    defect="the warm-up holds back growth only: a quiet first window shrinks k",
    edits=(
      Edit(
        ADAPTIVE,
        "        warmed_up\n        & (b_simple < window_weight",
        "        (b_simple < window_weight",
      ),
    ),
    tests=(
      "tests/test_adaptive.py::test_k_does_not_shrink_during_the_warm_up",
    ),
  ),
  Mutant(
    name="adaptive_k_warm_up_freezes_a_window_that_measures_nothing",
    guarantee="batch size, closed loop (k never freezes)",
    defect="a window of one micro-gradient grows k only after the warm-up,"
    " which it never ends: k = 1 stays 1",
    edits=(
      Edit(
        ADAPTIVE,
        "      (micro_gradients < 2)\n      | (\n",
        "      ((micro_gradients < 2) & warmed_up)\n      | (\n",
      ),
    ),
    tests=(
      "tests/test_adaptive.py::test_a_window_that_measures_nothing_grows_k_during_the_warm_up",
    ),
  ),
  Mutant(
    name="noise_cancellation_read_as_noise",
    guarantee="gradient noise scale (noise-free gradients never grow k)",
    defect="the window's spread is used below the float32 rounding of its"
    " sums: nearly equal gradients read as noise of either sign",
    edits=(
      Edit(
        NOISE_SCALE,
        "  spread = jnp.where(spread > RESOLUTION * square_sum, spread, 0.0)\n",
        "",
      ),
    ),
    tests=(
      "tests/test_adaptive.py::test_noise_free_gradients_never_grow_k",
      "tests/test_noise_scale.py::test_nearly_equal_micro_gradients_measure_no_noise_in_step",
    ),
  ),
  Mutant(
    name="noise_scale_in_loss_scaled_units",
    guarantee="gradient noise scale (in the gradients' own units)",
    defect="under dynamic_loss_scale the noise scale is measured on the"
    " scaled gradients, S**2 too large and mixing scales",
    edits=(
      Edit(
        NOISE_SCALE,
        "    units_squared = jnp.square(jnp.asarray(scale, jnp.float32))",
        "    units_squared = jnp.ones((), jnp.float32)",
      ),
    ),
    tests=(
      "tests/test_loss_scaling.py::test_the_noise_scale_is_in_the_gradients_own_units",
    ),
  ),
  Mutant(
    name="dropped_window_measured",
    guarantee="gradient noise scale (a dropped window does not count)",
    defect="a window that dynamic_loss_scale drops enters the averages"
    " when its sums are finite",
    edits=(
      Edit(
        NOISE_SCALE,
        "      measured=estimate.measured & kept,\n",
        "      measured=estimate.measured,\n",
      ),
    ),
    tests=(
      "tests/test_loss_scaling.py::test_a_dropped_window_does_not_enter_the_noise_scale",
    ),
  ),
  Mutant(
    name="skip_nonfinite_around_a_loss_scale_accepted",
    guarantee="mixed precision (the scale must see overflows)",
    defect="skip_nonfinite=True around dynamic_loss_scale is accepted: the"
    " scale never backs off",
    edits=(
      Edit(
        ARGUMENTS,
        "    loss_scaling.refuse_skipped_overflows(state.inner_state)\n",
        "",
      ),
    ),
    tests=(
      "tests/test_loss_scaling.py::test_skip_nonfinite_around_a_loss_scale_is_refused_at_init",
    ),
  ),
  Mutant(
    name="loss_scale_unscales_in_float16",
    guarantee="mixed precision (unscaling above float16's range)",
    defect="float16 gradients are divided by the scale in float16, where"
    " 2**16 is inf: every gradient unscales to 0",
    edits=(
      Edit(
        "ga_optax/_src/mixed_precision/loss_scaling.py",
        "  wide = jnp.promote_types(grad.dtype, jnp.float32)",
        "  wide = grad.dtype",
      ),
    ),
    tests=(
      "tests/test_loss_scaling.py::test_float16_gradients_unscaled_by_a_scale_above_float16s_range",
      "tests/test_loss_scaling.py::test_a_scale_growing_past_65504_keeps_the_updates_exact",
    ),
  ),
  Mutant(
    name="precision_warning_judges_adaptive_k_by_initial_k",
    guarantee="dtypes (the accumulator warning)",
    defect="an adaptive k is judged by its first k, not the largest it can"
    " reach",
    edits=(
      Edit(
        "ga_optax/_src/mixed_precision/precision.py",
        "    return every_k.max_k",
        "    return every_k.initial_k",
      ),
    ),
    tests=(
      "tests/test_precision.py::test_an_adaptive_k_is_judged_by_its_largest_k",
    ),
  ),
  Mutant(
    name="suggested_k_ties_to_even",
    guarantee="batch size (suggested_k's documented tie)",
    defect="suggested_k rounds log2 with Python's round: k * sqrt(2) goes"
    " to the even exponent",
    edits=(
      Edit(
        "ga_optax/_src/batch_size/advice.py",
        "  mantissa, exponent = math.frexp(ratio)\n"
        "  exponent = exponent - 1 + int(mantissa >= math.sqrt(0.5))\n",
        "  exponent = round(math.log2(ratio))\n",
      ),
    ),
    tests=(
      "tests/test_batch_size.py::test_suggested_k_tie_at_k_sqrt_two_rounds_up",
    ),
  ),
  Mutant(
    name="negative_weight_dropped",
    guarantee="equivalence (one rule for negative weights)",
    defect="the weight rule drops a traced negative weight's micro-batch"
    " from the gradient sums (in both paths) but keeps its weight",
    edits=(
      Edit(
        WEIGHTS,
        "  return jnp.where(weight == 0, jnp.zeros_like(term), weight * term)\n",
        "  return jnp.where(weight <= 0, jnp.zeros_like(term), weight * term)\n",
      ),
    ),
    tests=(
      "tests/test_weights.py::test_zero_and_traced_negative_weights_mean_the_same_in_both_paths",
    ),
  ),
  # The gradient noise scale.
  Mutant(
    name="noise_scale_not_debiased",
    guarantee="gradient noise scale",
    defect="the moving averages are read without dividing by"
    " 1 - decay**windows",
    edits=(
      Edit(
        NOISE_SCALE,
        "  grad_sq = smoothed.grad_sq / smoothed.debias\n"
        "  trace_sigma = smoothed.trace_sigma / smoothed.debias\n",
        "  grad_sq = smoothed.grad_sq\n  trace_sigma = smoothed.trace_sigma\n",
      ),
    ),
    tests=("tests/test_noise_scale.py::test_one_device_matches_numpy",),
  ),
  Mutant(
    name="noise_scale_complex_squared",
    guarantee="gradient noise scale (complex params)",
    defect="a complex gradient's squared norm is read as the real part of"
    " the sum of z**2, not as the sum of |z|**2",
    edits=(
      Edit(
        NOISE_SCALE,
        "    jnp.abs(leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))) ** 2\n",
        "    jnp.real(leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32)) ** 2)\n",
      ),
    ),
    tests=(
      "tests/test_noise_scale.py::test_complex_params_count_the_modulus_squared",
    ),
  ),
  Mutant(
    name="part_values_not_combined_across_devices",
    guarantee="the window algebra (a part's devices combine)",
    defect="a part combined by a sum keeps each device's value: the scan's"
    " and the shard_map window's noise terms count one device's"
    " micro-batches",
    edits=(
      Edit(
        PARTS,
        "    return jax.lax.psum(value, axes)\n",
        "    return value\n",
      ),
    ),
    tests=(
      "tests/test_parts.py::test_noise_terms_add_up_the_same_on_one_device_and_on_eight",
    ),
  ),
  Mutant(
    name="noise_scale_one_device_only",
    guarantee="gradient noise scale (every device's micro-gradients)",
    defect="inside shard_map the window's sum of w |g|^2 and K are not"
    " summed over the devices",
    edits=(
      Edit(
        COLLECTIVE,
        "    return parts.across_axes(value, combine, self.axes)\n",
        "    return value\n",
      ),
    ),
    tests=(
      "tests/test_noise_scale.py::test_shard_map_counts_every_device_micro_gradient",
    ),
  ),
  Mutant(
    name="noise_scale_partial_sums_unweighted",
    guarantee="gradient noise scale (plain jit)",
    defect="under unreduced_axes a device's partial sum is taken as a"
    " micro-gradient without rescaling it by the device count",
    edits=(
      Edit(
        UNREDUCED,
        "leaf_fn(block * devices) / copies",
        "leaf_fn(block / devices) / copies",
      ),
    ),
    tests=(
      "tests/test_noise_scale.py::test_unreduced_partial_sums_are_micro_gradients_of_equal_weight",
    ),
  ),
  Mutant(
    name="noise_scale_replicas_counted_twice",
    guarantee="gradient noise scale (plain jit, several mesh axes)",
    defect="under unreduced_axes a leaf held whole on the devices of"
    " another mesh axis adds its square once per replica",
    edits=(
      Edit(
        UNREDUCED,
        "        total = total + leaf_fn(block * devices) / copies\n",
        "        total = total + leaf_fn(block * devices)\n",
      ),
    ),
    tests=(
      "tests/test_noise_scale.py::test_unreduced_on_two_mesh_axes_counts_each_device_partial_sum_once",
    ),
  ),
  Mutant(
    name="partial_sums_drop_host_memory",
    guarantee="host memory (with the partial-sum helpers)",
    defect="unstack_partial_sums and split_total leave the accumulator in"
    " device memory though the state keeps it in host memory",
    edits=(
      Edit(
        PARTIAL_SUMS,
        "  return residency.like_kinds(\n"
        "    axes_lib.sum_to_unreduced(stacked, twin, axes), twin\n"
        "  )\n",
        "  return axes_lib.sum_to_unreduced(stacked, twin, axes)\n",
      ),
    ),
    tests=(
      "tests/test_intersections.py::test_partial_sums_keep_the_accumulator_in_host_memory",
    ),
  ),
  Mutant(
    name="stack_partial_sums_drops_host_memory",
    guarantee="host memory (with the partial-sum helpers)",
    defect="stack_partial_sums brings an accumulator kept in host memory"
    " to the device to stack it, and saves it from there",
    edits=(
      Edit(
        PARTIAL_SUMS,
        "    )(residency.to_device(leaf))\n"
        "    return residency.like_kinds(stacked, leaf)\n",
        "    )(residency.to_device(leaf))\n    return stacked\n",
      ),
    ),
    tests=(
      "tests/test_intersections.py::test_the_saved_partial_sums_stay_in_host_memory[stack]",
    ),
  ),
  Mutant(
    name="consolidate_drops_host_memory",
    guarantee="host memory (with the partial-sum helpers)",
    defect="consolidate under plain jit sums an accumulator kept in host"
    " memory on the device and leaves the total there",
    edits=(
      Edit(
        PARTIAL_SUMS,
        "        residency.like_kinds(\n"
        "          jax.reshard(residency.to_device(leaf), axes_lib.plain_spec(leaf)),\n"
        "          leaf,\n"
        "        )\n",
        "        jax.reshard(residency.to_device(leaf), axes_lib.plain_spec(leaf))\n",
      ),
    ),
    tests=(
      "tests/test_intersections.py::test_the_saved_partial_sums_stay_in_host_memory[consolidate]",
    ),
  ),
  Mutant(
    name="consolidate_drops_micro_gradient_count",
    guarantee="gradient noise scale (a window resumed from consolidate)",
    defect="consolidate and split_total sum and split the weights and the"
    " squares of the noise sums but leave K, the micro-gradients counted"
    " per device, as each device holds it",
    edits=(
      Edit(
        PARTIAL_SUMS,
        "    part.terms for part in state.parts if isinstance(part, WindowNoise)\n",
        "    (part.terms.square_sum, part.terms.weight)\n    for part in state.parts\n    if isinstance(part, WindowNoise)\n",
      ),
      Edit(
        PARTIAL_SUMS,
        "      part._replace(terms=next(terms))\n",
        "      part._replace(\n        terms=part.terms._replace(**dict(zip(('square_sum', 'weight'), next(terms))))\n      )\n",
      ),
    ),
    tests=(
      "tests/test_combinations.py::test_the_combination_ends_where_the_large_batch_ends[shard_map_unchecked-device-accumulate_and_apply-switching-consolidate]",
      "tests/test_combinations.py::test_the_combination_ends_where_the_large_batch_ends[shard_map_unchecked-accumulator_host-accumulate-switching-consolidate]",
      "tests/test_combinations.py::test_the_combination_ends_where_the_large_batch_ends[shard_map_unchecked-both_host-accumulate_and_apply-host-consolidate]",
    ),
  ),
  Mutant(
    name="partial_sum_helpers_ignore_noise_sums",
    guarantee="gradient noise scale (a window resumed from a checkpoint)",
    defect="consolidate and split_total combine the accumulator and the"
    " weights, not the noise scale's sums of the open window",
    edits=(
      Edit(
        PARTIAL_SUMS,
        "  noise_terms = tuple(\n    part.terms for part in state.parts if isinstance(part, WindowNoise)\n  )\n",
        "  noise_terms = ()\n",
      ),
      Edit(
        PARTIAL_SUMS,
        "      part._replace(terms=next(terms))\n",
        "      part\n",
      ),
    ),
    tests=(
      "tests/test_combinations.py::test_the_combination_ends_where_the_large_batch_ends[shard_map_unchecked-device-accumulate_and_apply-switching-consolidate]",
      "tests/test_combinations.py::test_the_combination_ends_where_the_large_batch_ends[shard_map_unchecked-accumulator_host-accumulate-switching-consolidate]",
      "tests/test_combinations.py::test_the_combination_ends_where_the_large_batch_ends[shard_map_unchecked-both_host-accumulate_and_apply-host-consolidate]",
    ),
  ),
  Mutant(
    name="zero_spec_tree_ignored_for_state",
    guarantee="data parallel (ZeRO-1 placement)",
    defect="a spec tree's specs never reach the optimizer state: every"
    " moment follows the placement rule instead of its parameter's spec",
    edits=(
      Edit(
        ZERO,
        "        if spec is not None and shape == leaf.shape:\n",
        "        if spec is not None and shape == leaf.shape and False:\n",
      ),
    ),
    tests=(
      "tests/test_intersections.py::test_a_spec_tree_places_each_moment_with_its_own_parameter",
    ),
  ),
  # Elasticity.
  Mutant(
    name="elastic_smallest_micro_batch",
    guarantee="elastic plans",
    defect="elastic_plan picks the smallest micro-batch that divides, not"
    " the largest",
    edits=(
      Edit(
        ELASTIC,
        "micro_batch_size = dividing[-1]",
        "micro_batch_size = dividing[0]",
      ),
    ),
    tests=("tests/test_elastic.py",),
  ),
  # Data parallel.
  Mutant(
    name="axis_name_sum_not_mean",
    guarantee="data parallel (axis_name)",
    defect="with axis_name the window's sum over the devices is divided by"
    " this device's weight instead of every device's",
    edits=(
      Edit(
        COLLECTIVE,
        "return jax.lax.psum(weight_sum, self.axes)",
        "return weight_sum",
      ),
    ),
    tests=(
      "tests/test_transformations.py::test_pmap_over_two_devices_matches_the_large_batch",
      "tests/test_shard_map.py::test_shard_map_matches_the_large_batch",
    ),
  ),
  Mutant(
    name="unreduced_all_reduce_every_micro_step",
    guarantee="data parallel (one reduction per window, in its closing branch)",
    defect="with unreduced_axes each micro-step's gradient is all-reduced"
    " before it is added (the numbers are unchanged)",
    edits=(
      Edit(
        MICRO_STEP,
        "    window, admitted = self.window, self.admitted\n",
        "    if self.window.placement.unreduced_axes:\n      from ga_optax._src.placements import axes as axes_lib\n\n      grads = axes_lib.cast_to_unreduced(\n        axes_lib.reduce_unreduced(grads, None),\n        self.window.placement.unreduced_axes,\n      )\n    window, admitted = self.window, self.admitted\n",
      ),
    ),
    tests=(
      "tests/test_plain_jit_mesh.py::test_accumulate_unreduced_matches_the_large_batch",
    ),
  ),
  Mutant(
    name="returned_weight_is_one_devices",
    guarantee="data parallel (one reduction of the token count)",
    defect="unreduced_value_and_grad(return_weight=True) returns each"
    " device's own weight, not the sum over the devices",
    edits=(
      Edit(
        MICROBATCH_DEVICES,
        "    return Result(value, stacked, None, weight_sum, ())",
        "    return Result(value, stacked, None, sums.weight, ())",
      ),
    ),
    tests=("tests/test_language_model_data_parallel.py",),
  ),
  Mutant(
    name="in_step_fp8_loss_not_a_share",
    guarantee="mixed precision (float8 state in-step)",
    defect="the in-step scan differentiates each micro-batch's mean loss"
    " instead of its share of the batch's, so its backward pass quantises"
    " gradients W / w_i times the large batch's",
    edits=(
      Edit(
        MICROBATCH,
        "        share = jnp.where(weights.counts(weight), weight / batch_weight, 1.0)",
        "        share = jnp.ones_like(weight)",
      ),
    ),
    tests=(
      "tests/test_fp8.py::test_microbatched_value_and_grad_combines_the_fp8_state",
    ),
  ),
  Mutant(
    name="fp8_state_summed_not_combined",
    guarantee="mixed precision (float8 state per call)",
    defect="a forward amax history is summed over the micro-batches, as a"
    " gradient would be, instead of taking their max",
    edits=(
      Edit(
        "ga_optax/_src/algebra/fp8.py",
        "      combined = jnp.maximum(kept, new)",
        "      combined = kept + new",
      ),
    ),
    tests=(
      "tests/test_fp8.py::test_fresh_state_window_is_the_large_batch",
      "tests/test_fp8.py::test_microbatched_value_and_grad_combines_the_fp8_state",
    ),
  ),
  Mutant(
    name="fp8_state_not_combined_across_devices",
    guarantee="mixed precision (float8 state per call, inside shard_map)",
    defect="with axis_name, a closing window's float8 state keeps this"
    " device's amaxes instead of the max over every device",
    edits=(
      Edit(
        FP8,
        "    running = closing.held.combine(value.running, self.combine)\n",
        "    running = value.running\n",
      ),
    ),
    tests=(
      "tests/test_fp8.py::test_share_windows_across_devices_in_shard_map",
    ),
  ),
  Mutant(
    name="fp8_state_of_a_dropped_micro_step_counts",
    guarantee="mixed precision (float8 state per call, skip_nonfinite)",
    defect="the window's float8 part combines the new state of a micro-step"
    " that skip_nonfinite dropped, whose amaxes may not be finite",
    edits=(
      Edit(
        FP8,
        "      value.running, latest, micro_batch.weight, contributes=micro_batch.kept\n",
        "      value.running, latest, micro_batch.weight, contributes=True\n",
      ),
    ),
    tests=("tests/test_fp8.py::test_windows_with_flush_skip_and_weights",),
  ),
  Mutant(
    name="fp8_weight_not_summed_across_devices",
    guarantee="mixed precision (float8 state per call, inside shard_map)",
    defect="a closing window's float8 state divides by this device's weight"
    " instead of the window's weight over every device",
    edits=(
      Edit(
        FP8,
        '    weight = closing.held.combine(value.weight, "sum")\n',
        "    weight = value.weight\n",
      ),
    ),
    tests=("tests/test_fp8.py::test_mean_windows_across_devices_in_shard_map",),
  ),
  Mutant(
    name="equivalence_helper_tolerates_ten_times_rtol",
    guarantee="equivalence helpers (ga_optax.testing)",
    defect="assert_equivalent_to_large_batch accepts a difference of up to"
    " 10 x rtol",
    edits=(
      Edit(
        "ga_optax/testing/__init__.py",
        "  if not result.max_relative_difference <= rtol:",
        "  if not result.max_relative_difference <= 10 * rtol:",
      ),
    ),
    tests=("tests/test_testing.py::test_a_difference_just_above_rtol_fails",),
  ),
  # The memory planner.
  Mutant(
    name="planner_drops_temporaries",
    guarantee="memory planner",
    defect="the device bytes of a compiled micro-step leave out its"
    " temporaries",
    edits=(
      Edit(
        DEVICE_MEMORY,
        "    - analysis.alias_size_in_bytes\n"
        "    + analysis.temp_size_in_bytes\n",
        "    - analysis.alias_size_in_bytes\n",
      ),
    ),
    tests=(
      "tests/test_planner.py::test_micro_step_bytes_is_the_memory_analysis_computed_by_hand",
    ),
  ),
  Mutant(
    name="planner_counts_arguments_only",
    guarantee="memory planner",
    defect="micro_step_bytes returns the bytes of the micro-step's"
    " arguments alone",
    edits=(
      Edit(
        PLANNER,
        "  return device_memory.device_bytes(compiled)\n",
        "  return int(compiled.memory_analysis().argument_size_in_bytes)\n",
      ),
    ),
    tests=(
      "tests/test_planner.py::test_micro_step_bytes_is_the_memory_analysis_computed_by_hand",
    ),
  ),
  Mutant(
    name="planner_ignores_the_device",
    guarantee="memory planner",
    defect="micro_step_bytes compiles for the default backend whatever"
    " device= names",
    edits=(
      Edit(
        PLANNER,
        "  abstract_params = residency.abstract_in(_abstract(params), None,"
        " device)\n",
        "  device = None\n"
        "  abstract_params = residency.abstract_in(_abstract(params), None,"
        " device)\n",
      ),
    ),
    tests=(
      "tests/test_tpu_program.py::test_the_planner_compiles_for_a_tpu_chip",
    ),
  ),
  # The HLO audits (ga_optax._src.audits), behind ga_optax.testing.audit.
  Mutant(
    name="async_collectives_unseen",
    guarantee="data parallel (the audits that prove it)",
    defect="the HLO audits do not count asynchronous collectives"
    " (all-reduce-start and friends, what XLA:GPU prints)",
    edits=(
      Edit(HLO, '    "all-reduce-start",\n', ""),
      Edit(HLO, '    "all-gather-start",\n', ""),
      Edit(HLO, '    "collective-permute-start",\n', ""),
    ),
    tests=("tests/test_hlo.py",),
  ),
  Mutant(
    name="testing_nan_within_tolerance",
    guarantee="equivalence-testing helpers",
    defect="max_relative_difference ignores a NaN on one side only",
    edits=(
      Edit(
        TREE_DIFFERENCE,
        "  if not (np.all(np.isfinite(actual)) and np.all(np.isfinite(expected))):\n"
        '    return float("inf")\n',
        "  finite = np.isfinite(actual) & np.isfinite(expected)\n"
        "  actual, expected = actual[finite], expected[finite]\n",
      ),
    ),
    tests=("tests/test_testing.py",),
  ),
  # The audits of the compiled program: copies, host waits, the GPU recipe.
  Mutant(
    name="asynchronous_copies_not_counted",
    guarantee="cost (no copy on the micro-step path)",
    defect="path_audit sees a copy-start/copy-done pair as no copy at all",
    edits=(
      Edit(
        COMPILED_PATHS,
        '_COPY_OPCODES = frozenset({"copy", "copy-start"})',
        '_COPY_OPCODES = frozenset({"copy"})',
      ),
    ),
    tests=(
      "tests/test_hlo.py::test_path_audit_counts_an_asynchronous_copy_once",
    ),
  ),
  Mutant(
    name="path_audit_accepts_a_step_without_a_window",
    guarantee="the audits say what they cannot see",
    defect="path_audit reads a step with no ga_optax window as the whole program on both paths, which looks like no optimizer work per micro-step",
    edits=(
      Edit(
        COMPILED_PATHS,
        "  if require_window:\n    _refuse_without_a_window(module)\n",
        "  if not require_window:\n    _refuse_without_a_window(module)\n",
      ),
    ),
    tests=(
      "tests/test_hlo.py::test_path_audit_refuses_a_step_without_a_window",
    ),
  ),
  Mutant(
    name="asynchronous_copy_counted_as_its_tuple",
    guarantee="cost (bytes moved per path)",
    defect="an asynchronous copy is counted as the whole tuple its start returns (twice the copy and a counter)",
    edits=(
      Edit(
        COMPILED_PATHS,
        '  if instruction.opcode == "copy-start":\n    return read, read\n',
        "",
      ),
    ),
    tests=(
      "tests/test_hlo.py::test_path_audit_counts_an_asynchronous_copy_once",
    ),
  ),
  Mutant(
    name="sliced_prefetch_counted_as_its_source",
    guarantee="cost (bytes moved per path)",
    defect="a TPU's prefetch of a slice is counted as its tuple (the whole"
    " buffer it is cut from, the slice and a counter)",
    edits=(
      Edit(
        COMPILED_PATHS,
        '  if instruction.opcode == "slice-start":\n',
        '  if instruction.opcode == "slice-start" and False:\n',
      ),
    ),
    tests=("tests/test_hlo.py::test_path_audit_counts_a_sliced_prefetch_once",),
  ),
  Mutant(
    name="prefetched_slices_viewed_as_a_copy",
    guarantee="cost (bytes moved per path)",
    defect="the view of a TPU's prefetched slices as one buffer is counted"
    " as a read and a write of it",
    edits=(
      Edit(
        COMPILED_PATHS,
        '_VIEWS = frozenset({"ConcatBitcast"})',
        "_VIEWS: frozenset[str] = frozenset()",
      ),
    ),
    tests=("tests/test_hlo.py::test_path_audit_counts_a_sliced_prefetch_once",),
  ),
  Mutant(
    name="command_buffers_ignored",
    guarantee="zero host waits on a GPU (the audit)",
    defect="a loop inside a command buffer is counted as driven by the host",
    edits=(
      Edit(
        HOST_WAITS,
        "in_command_buffer=any(k == _COMMAND_BUFFER for _, k in enclosing),",
        "in_command_buffer=False,",
      ),
    ),
    tests=("tests/test_host_waits.py",),
  ),
  Mutant(
    name="loop_exit_wait_not_counted",
    guarantee="zero host waits on a GPU (the audit)",
    defect="a loop of unknown trip count costs one wait per trip, not one more for the predicate that ends it",
    edits=(
      Edit(
        HOST_WAITS,
        "return trips_on_path(instruction, path) + 1",
        "return trips_on_path(instruction, path)",
      ),
    ),
    tests=("tests/test_host_waits.py",),
  ),
  Mutant(
    name="host_waits_count_loops_of_a_side_that_does_not_run",
    guarantee="zero host waits on a GPU (the audit)",
    defect="a loop inside the side of the window that does not run is"
    " counted as running once: a closing call's waits include keep-open's"
    " loops",
    edits=(
      Edit(
        HOST_WAITS,
        "        walk(callee, times * trips)",
        "        walk(callee, times)",
      ),
    ),
    tests=(
      "tests/test_host_waits.py::test_a_loop_in_the_side_that_does_not_run_costs_no_wait",
    ),
  ),
  Mutant(
    name="known_trip_count_loops_wait",
    guarantee="zero host waits on a GPU (the audit)",
    defect="a loop of known trip count (a lax.scan) is counted as reading its predicate on the host",
    edits=(
      Edit(
        HOST_WAITS,
        "if instruction.trip_count is not None:",
        "if instruction.trip_count is None:",
      ),
    ),
    tests=("tests/test_host_waits.py",),
  ),
  Mutant(
    name="recipe_without_while",
    guarantee="zero host waits on a GPU (the recipe)",
    defect="gpu_compiler_options leaves WHILE out of the command buffers: every micro-step waits for the host again",
    edits=(
      Edit(GPU_RECIPE, '_WINDOW_KINDS = ("WHILE",)', "_WINDOW_KINDS = ()"),
    ),
    tests=(
      "tests/test_host_waits.py",
      "tests/test_gpu_program.py::test_one_gpu[adam]",
    ),
  ),
  Mutant(
    name="recipe_without_collectives",
    guarantee="zero host waits on 8 GPUs (the recipe)",
    defect="gpu_compiler_options leaves COLLECTIVES out: the closing loop, which holds the window's all-reduce, stays on the host",
    edits=(
      Edit(GPU_RECIPE, '_COLLECTIVES = ("COLLECTIVES",)', "_COLLECTIVES = ()"),
    ),
    tests=(
      "tests/test_gpu_options.py::test_by_default_the_recipe_captures_loops_and_collectives",
      "tests/test_gpu_program.py::test_eight_gpus_under_plain_jit[unreduced]",
    ),
  ),
  Mutant(
    name="recipe_collectives_off_by_default",
    guarantee="zero host waits on 8 GPUs (the recipe's default)",
    defect="gpu_compiler_options() leaves COLLECTIVES out unless asked:"
    " the closing side of a window reduced across GPUs stays on the host",
    edits=(
      Edit(
        GPU_RECIPE,
        "def gpu_compiler_options(*, collectives: bool = True)",
        "def gpu_compiler_options(*, collectives: bool = False)",
      ),
    ),
    tests=(
      "tests/test_gpu_options.py::test_by_default_the_recipe_captures_loops_and_collectives",
    ),
  ),
  Mutant(
    name="collective_kernels_a_version_late",
    guarantee="the recipe keeps XLA's defaults (on the newest jaxlib)",
    defect="COLLECTIVES_KERNEL is added from jaxlib 0.13, not 0.12: on 0.12"
    " the list drops one of XLA's defaults (the same program on 0.10)",
    edits=(
      Edit(
        GPU_RECIPE,
        "_COLLECTIVE_KERNELS_SINCE = (0, 12)",
        "_COLLECTIVE_KERNELS_SINCE = (0, 13)",
      ),
    ),
    tests=(
      "tests/test_gpu_options.py::test_collective_kernels_are_asked_for_from_jaxlib_0_12",
    ),
  ),
  Mutant(
    name="recipe_drops_a_default_kind",
    guarantee="the recipe keeps XLA's defaults",
    defect="gpu_compiler_options replaces XLA's default list without CONDITIONAL",
    edits=(Edit(GPU_RECIPE, '  "CONDITIONAL",\n', ""),),
    tests=("tests/test_host_waits.py",),
  ),
  Mutant(
    name="target_without_a_driver_version",
    guarantee="zero host waits on a GPU (the audit sees what a GPU runs)",
    defect="the compile-only H100 reports driver 0.0.0, for which XLA:GPU"
    " keeps loops out of command buffers whatever the options say",
    edits=(Edit(GPU_COMPILE, '  driver_version: "13.0.0"\n', ""),),
    tests=("tests/test_gpu_program.py::test_one_gpu[adam]",),
  ),
  Mutant(
    name="a_close_keeps_the_accumulator",
    guarantee="one state for both schedules (every close empties the window)",
    defect="the step that closes a window leaves the window's sums in the"
    " accumulator, so the next window adds to them",
    edits=(
      Edit(
        MICRO_STEP,
        "    emptied = self.emptied(carry)\n",
        "    emptied = carry\n",
      ),
    ),
    tests=(
      "tests/test_accumulate.py::AccumulateTest",
      "tests/test_host_schedule.py::test_the_host_schedule_is_the_large_batch",
    ),
    # In the CPU's form both schedules zero the sums after the close.
    window_form="loops",
  ),
  Mutant(
    name="the_cpu_close_keeps_the_updates_in_the_accumulator",
    guarantee="one state for both schedules (every close empties the window)",
    defect="on the CPU the select that zeroes the accumulator after its"
    " buffer carried the updates out keeps it: the next window adds onto the"
    " last one's updates",
    edits=(
      Edit(
        RUN_ONCE,
        "jnp.where(taken, zero, leaf)",
        "jnp.where(taken, leaf, leaf)",
      ),
    ),
    tests=(
      "tests/test_accumulate.py::AccumulateTest::test_every_close_leaves_the_accumulator_at_zero_(fused=False, host_scheduled=False, window='steps')__with_jit",
      "tests/test_equivalence.py::test_uniform_micro_batches_match_the_large_batch[sgd-4]",
    ),
    window_form="conditional",
  ),
  Mutant(
    name="the_cpu_fused_close_keeps_its_sums",
    guarantee="one state for both schedules (every close empties the window)",
    defect="on the CPU nothing zeroes the accumulator that the closing"
    " branch of accumulate_and_apply leaves to the select after it: the next"
    " window adds onto the last one's sums",
    edits=(
      Edit(
        MICRO_STEP,
        "      return self.schedule.emptied_after_close(\n"
        "        self.decision.closes,\n"
        "        self.window.placement.emptied,\n"
        "        accumulator,\n"
        "        stepped,\n"
        "      )\n",
        "      return accumulator\n",
      ),
    ),
    tests=(
      "tests/test_accumulate.py::AccumulateTest::test_every_close_leaves_the_accumulator_at_zero_(fused=True, host_scheduled=False, window='steps')__with_jit",
    ),
    window_form="conditional",
  ),
  Mutant(
    name="the_cpu_fused_branch_writes_its_own_zeros",
    guarantee="cost (accumulate_and_apply on the CPU: temporaries, copies)",
    defect="on the CPU the closing branch of accumulate_and_apply writes"
    " zeros over the accumulator itself: XLA:CPU gives them a buffer of"
    " their own, holds every layer's sum apart and copies the accumulator"
    " on every close",
    edits=(
      Edit(
        RUN_ONCE,
        "  def as_conditional(carried: Carry) -> Carry:\n    return carried\n",
        "  def as_conditional(carried: Carry) -> Carry:\n"
        "    return emptied(carried)\n",
      ),
    ),
    tests=(
      "tests/test_cpu_program.py::test_the_window_holds_one_gradient_layer_of_temporaries[accumulate_and_apply]",
    ),
  ),
  Mutant(
    name="the_cpu_conditional_lists_leaves_first_leaf_first",
    guarantee="cost (accumulate on the CPU: temporaries)",
    defect="on the CPU the window's conditional lists its operands first"
    " leaf first: XLA:CPU gives the accumulator's buffer of the gradient"
    " backpropagation makes first to the gradients made after it, and"
    " holds that sum apart",
    edits=(Edit(RUN_ONCE, "    reverse=True,\n", "    reverse=False,\n"),),
    tests=(
      "tests/test_cpu_program.py::test_the_window_holds_one_gradient_layer_of_temporaries[accumulate]",
    ),
  ),
  Mutant(
    name="the_cpu_conditional_sorts_numbered_names_as_text",
    guarantee="cost (accumulate on the CPU: temporaries)",
    defect="on the CPU the window's conditional lists its operands by"
    " their names as text sorts them (layer_10 before layer_2): past nine"
    " layers the sums of the layers out of order lose their buffers",
    edits=(
      Edit(
        RUN_ONCE,
        "      _numbers_as_numbers(jax.tree_util.keystr(flat[index][0])),\n",
        "      jax.tree_util.keystr(flat[index][0]),\n",
      ),
    ),
    tests=(
      "tests/test_cpu_program.py::test_twelve_numbered_layers_hold_no_more_than_the_fused_window",
    ),
  ),
  Mutant(
    name="the_cpu_conditional_lists_scalars_among_the_layers",
    guarantee="cost (the noise scale on the CPU: temporaries)",
    defect="on the CPU the window's conditional lists its scalars by their"
    " paths among the layers' buffers: the noise scale's sum of squares,"
    " made from every layer's gradient, comes first, and the sum of the"
    " gradient made first loses its accumulator's buffer",
    edits=(
      Edit(RUN_ONCE, "      jnp.ndim(flat[index][1]) > 0,\n", "      True,\n"),
    ),
    tests=(
      "tests/test_cpu_program.py::test_the_window_holds_one_gradient_layer_of_temporaries[noise_scale]",
    ),
  ),
  Mutant(
    name="the_parts_read_the_sums_after_the_step",
    guarantee="cost (the noise scale on the CPU: copies)",
    defect="on the CPU nothing orders the parts' read of the window's mean"
    " before the optimizer's step writes the updates over the sums: the"
    " closing branch copies every layer's sum",
    edits=(
      Edit(
        RUN_ONCE, "    return after_read, read\n", "    return summed, read\n"
      ),
    ),
    tests=(
      "tests/test_cpu_program.py::test_a_micro_step_copies_no_layer[noise_scale]",
    ),
  ),
  Mutant(
    name="the_cpu_host_guard_steps_and_selects",
    guarantee="the host's schedule costs what a transformation must (CPU copies)",
    defect="on the CPU the host's closing program guards a window without"
    " weight with selects, as on a GPU, not with a conditional: it reads"
    " the optimizer's state beside the step, and accumulate_and_apply"
    " copies each of its leaves",
    edits=(
      Edit(
        SCHEDULE,
        "    return window_form.choose(\n"
        "      jnp.asarray(predicate), carry, loops=selected, conditional=conditional\n"
        "    )\n",
        "    return selected(predicate, carry)\n",
      ),
    ),
    tests=(
      "tests/test_host_overhead.py::test_on_the_cpu_only_the_fused_guards_selects_copy_adams_state",
    ),
  ),
  Mutant(
    name="the_cpu_host_zeros_before_the_close",
    guarantee="the host's schedule costs what a transformation must (CPU"
    " temporaries)",
    defect="on the CPU the host's closing program makes the accumulator's"
    " zeros before its step has read the sums: each takes a buffer of its"
    " own, and each sum is copied",
    edits=(
      Edit(
        SCHEDULE,
        "  zero = jnp.asarray(after, jnp.float32) * 0\n",
        "  zero = jnp.zeros((), jnp.float32)\n",
      ),
    ),
    tests=(
      "tests/test_host_overhead.py::test_on_the_cpu_the_guarded_close_holds_fewer_temporaries_than_the_reference",
    ),
  ),
  Mutant(
    name="an_empty_window_keeps_its_sums",
    guarantee="one state for both schedules (an empty window is emptied too)",
    defect="a window closed without weight (weights 0, or summing to 0)"
    " leaves its sums in the accumulator",
    edits=(
      Edit(
        LOCAL,
        "    leaves, treedef = jax.tree.flatten(accumulator)\n"
        "    return jax.tree.unflatten(\n"
        "      treedef, [zeroed(leaf, index) for index, leaf in enumerate(leaves)]\n"
        "    )",
        "    return accumulator",
      ),
    ),
    tests=("tests/test_accumulate.py::AccumulateTest",),
  ),
  Mutant(
    name="the_host_word_inverted",
    guarantee="the host's schedule (closing=)",
    defect="closing=False runs the closing side and closing=True keeps the"
    " window open",
    edits=(
      Edit(SCHEDULE, "    if not self.closing:\n", "    if self.closing:\n"),
    ),
    tests=(
      "tests/test_host_schedule.py::test_the_host_schedule_is_the_large_batch",
    ),
  ),
  Mutant(
    name="host_micro_step_copies_a_constant_emitted",
    guarantee="the host's schedule costs what a transformation must (launches)",
    defect="a host-scheduled micro-step writes emitted=False as a constant,"
    " which XLA copies into the state by a kernel of its own: one launch"
    " more than the hand-written window's on every micro-step",
    edits=(
      Edit(
        SCHEDULE,
        "    return _never(weight_sum)\n",
        "    return stepped\n",
      ),
    ),
    tests=(
      "tests/test_host_overhead.py::test_launches_per_window_are_the_references_plus_two_at_most",
    ),
  ),
  Mutant(
    name="host_close_copies_constant_counters",
    guarantee="the host's schedule costs what a transformation must (launches)",
    defect="the host's closing program clears the micro-step count and the"
    " weight sum to constants, each copied into the state by kernels of"
    " their own",
    edits=(
      Edit(
        SCHEDULE,
        "      return jnp.where(_never(weight_sum), value, jnp.zeros_like(value))\n",
        "      return jnp.zeros_like(value)\n",
      ),
    ),
    tests=(
      "tests/test_host_overhead.py::test_launches_per_window_are_the_references_plus_two_at_most",
    ),
  ),
  # Reverse mode.
  Mutant(
    name="weight_zero_has_no_derivative",
    guarantee="reverse mode (a micro-batch weight of exactly 0)",
    defect="the derivative with respect to a weight of 0 is 0, the"
    " select's, where the large batch's is the micro-batch's term",
    edits=(
      Edit(
        WEIGHTS,
        "  through_weight = weight_dot * jnp.where(weight == 0, _finite(term), term)\n",
        "  through_weight = weight_dot * jnp.where(weight == 0, zeros, term)\n",
      ),
    ),
    tests=(
      "tests/test_reverse_mode.py::test_the_scans_derivative_at_weight_zero_is_the_large_batch",
    ),
  ),
  Mutant(
    name="host_select_leaves_a_scalar_on_the_device",
    guarantee="the host's schedule with state in host memory",
    defect="the host-scheduled close selects a host-kept scalar (Adam's"
    " count) with a plain select, which JAX types in device memory",
    edits=(
      Edit(
        SCHEDULE,
        "      new if new is old else residency.where(predicate, new, old)\n",
        "      new if new is old else jnp.where(predicate, new, old)\n",
      ),
    ),
    tests=(
      "tests/test_reverse_mode.py::test_a_host_scheduled_close_keeps_a_step_count_in_host_memory",
    ),
  ),
  Mutant(
    name="reverse_mode_host_memory_not_refused",
    guarantee="reverse mode (host memory where JAX cannot differentiate it)",
    defect="jax.grad through state in host memory inside jax.shard_map"
    " fails inside JAX instead of naming the argument to leave at None",
    edits=(
      Edit(
        RESIDENCY,
        "    if self.kind is not None and refused is not None:\n",
        "    if False:\n",
      ),
    ),
    tests=(
      "tests/test_reverse_mode.py::test_state_in_host_memory_is_refused_where_jax_cannot_differentiate_it",
    ),
  ),
  Mutant(
    name="closed_over_tracer_left_to_jax",
    guarantee="the scan on Explicit axes (errors name the fix)",
    defect="a loss closed over a value traced in the step fails with"
    " JAX's error about a shard_map the user never wrote",
    edits=(
      Edit(
        BATCH_LAYOUT,
        "    raise ValueError(CLOSED_OVER_TRACER) from error\n",
        "    raise\n",
      ),
    ),
    tests=(
      "tests/test_microbatch.py::test_a_value_traced_in_the_step_is_passed_not_closed_over",
    ),
  ),
  Mutant(
    name="memory_space_moves_read_as_duplicates",
    guarantee="the audits read TPU programs (copies)",
    defect="a copy into a TPU's on-chip memory is taken for a duplicate of"
    " the buffer",
    edits=(
      Edit(
        COMPILED_PATHS,
        "  return bool(source) and bool(destination) and source != destination\n",
        "  return False\n",
      ),
    ),
    tests=(
      "tests/test_tpu_program.py::test_the_audit_tells_memory_space_moves_from_duplicates",
    ),
  ),
  Mutant(
    name="closing_int_accepted_under_jit",
    guarantee="the host's schedule (closing= is None or a bool)",
    defect="closing=1 is taken for the host's word inside jax.jit, where"
    " the value reaches update untraced (eagerly the wrapper traces the"
    " int and the refusal still fires)",
    edits=(
      Edit(
        SCHEDULE,
        "  if closing is None or isinstance(closing, bool):\n",
        "  if closing is None or isinstance(closing, (bool, int)):\n",
      ),
    ),
    tests=(
      "tests/test_host_schedule.py::test_closing_of_another_type_is_refused",
    ),
  ),
  Mutant(
    name="numpy_bool_closing_traced",
    guarantee="the host's schedule (closing= is None or a bool)",
    defect="closing=np.bool_(True) is handed to the eager wrapper, which"
    " traces it, and refused as if the user had traced it",
    edits=(
      Edit(
        ARGUMENTS,
        "    closing = schedule.check_closing(closing)\n",
        "",
      ),
    ),
    tests=(
      "tests/test_host_schedule.py::test_a_numpy_bool_closing_is_the_hosts_word",
    ),
  ),
  Mutant(
    name="misspelt_call_keyword_forwarded",
    guarantee="errors name the argument (a misspelt call keyword)",
    defect="update(..., wieght=3.0) forwards wieght to the optimizer at the"
    " close, where optax.sgd drops it: an unweighted mean, without a word",
    edits=(
      Edit(
        ARGUMENTS,
        "    refuse_misspelt_keywords(window.output, extra_args)\n",
        "",
      ),
    ),
    tests=(
      "tests/test_validation.py::test_a_misspelt_call_keyword_is_refused_not_dropped",
    ),
  ),
  Mutant(
    name="private_noise_per_micro_step",
    guarantee="privacy: one draw per window, at its close",
    defect="the noise is added to every micro-batch's clipped sum (sqrt(k)"
    " times too much) instead of once to the window's",
    edits=(
      Edit(
        PRIVATE_NOISE,
        "  std = float(noise_multiplier) * float(l2_clip_norm)\n",
        "  std = 0.0\n",
      ),
      Edit(
        PRIVATE_WINDOW,
        "    return window_tx.update(\n      clipped_sum,",
        "    micro_key = jax.random.fold_in(\n"
        "      jax.random.key(0), state.micro_step + 4096 * state.update_step\n"
        "    )\n"
        "    clipped_sum = jax.tree.map(\n"
        "      lambda g: g + noise_multiplier * l2_clip_norm\n"
        "      * jax.random.normal(micro_key, g.shape, g.dtype),\n"
        "      clipped_sum,\n"
        "    )\n"
        "    return window_tx.update(\n      clipped_sum,",
      ),
    ),
    tests=(
      f"{PRIVACY_TESTS}::test_noise_std_is_sigma_c_over_normalize_by_whatever_k",
      f"{PRIVACY_TESTS}::test_the_micro_step_program_draws_no_random_number",
    ),
  ),
  Mutant(
    name="private_division_by_the_realised_count",
    guarantee="privacy: the sum divided by the public normalize_by only",
    defect="each micro-batch's clipped sum is divided by its count of real"
    " examples (the data's batch size, as optax's DP aggregate does)",
    edits=(
      Edit(
        PRIVATE_CLIPPING,
        "      lambda summed, param: jnp.sum(summed, axis=0).astype(\n",
        "      lambda summed, param: (\n"
        "        jnp.sum(summed, axis=0) / jnp.maximum(jnp.sum(weights), 1.0)\n"
        "      ).astype(\n",
      ),
    ),
    tests=(PRIVACY_TESTS,),
  ),
  Mutant(
    name="private_window_mean_of_micro_batches",
    guarantee="privacy: the sum divided by the public normalize_by only",
    defect="the private window averages its micro-batches"
    " (reduction='mean'), dividing by a count the draw decides",
    edits=(
      Edit(PRIVATE_WINDOW, '    reduction="sum",\n', '    reduction="mean",\n'),
    ),
    tests=(
      f"{PRIVACY_TESTS}::test_partition_invariance_with_noise",
      f"{PRIVACY_TESTS}::test_without_noise_the_window_is_the_clipped_mean_of_its_batch",
    ),
  ),
  Mutant(
    name="private_budget_counted_in_micro_steps",
    guarantee="privacy: the budget counted in windows",
    defect="the count handed to the accountant is the micro-steps of the"
    " windows closed (updates times k), not the windows",
    edits=(
      Edit(
        PRIVATE_NOISE,
        "  return jnp.asarray(found.windows_closed)\n",
        "  from ga_optax._src.window.state import find_state\n\n"
        "  window = find_state(state)\n"
        "  return jnp.asarray(window.update_step * window.every_k)\n",
      ),
    ),
    tests=(
      f"{PRIVACY_TESTS}::test_windows_closed_counts_windows_not_micro_steps",
    ),
  ),
  Mutant(
    name="private_float16_norm",
    guarantee="privacy: each example clipped to C (its norm in float32)",
    defect="the per-example norm is computed in the params' dtype: float16"
    " overflows to inf and the gradient is dropped, not clipped",
    edits=(
      Edit(
        PRIVATE_CLIPPING,
        "    jnp.sum(jnp.square(leaf.astype(jnp.float32)))\n",
        "    jnp.sum(jnp.square(leaf)).astype(jnp.float32)\n",
      ),
    ),
    tests=(f"{PRIVACY_TESTS}::test_float16_params_clip_by_a_float32_norm",),
  ),
  Mutant(
    name="private_key_not_folded_by_the_window_count",
    guarantee="privacy: independent noise in every window",
    defect="every window draws from the same key: the same noise each time",
    edits=(Edit(PRIVATE_NOISE, "      state.windows_closed,\n", "      0,\n"),),
    tests=(
      f"{PRIVACY_TESTS}::test_consecutive_windows_draw_uncorrelated_noise",
    ),
  ),
  Mutant(
    name="private_noise_per_device",
    guarantee="privacy: on several devices, one draw per window",
    defect="each device draws its own noise, from the key folded with its"
    " index",
    edits=(
      Edit(
        PRIVATE_WINDOW,
        "    return window_tx.update(\n      clipped_sum,",
        "    if axis_name is not None:\n"
        "      inner = state.inner_state\n"
        "      device_key = jax.random.fold_in(\n"
        "        jax.random.wrap_key_data(inner.key_data),\n"
        "        jax.lax.axis_index(axis_name),\n"
        "      )\n"
        "      state = state._replace(\n"
        "        inner_state=inner._replace(\n"
        "          key_data=jax.random.key_data(device_key)\n"
        "        )\n"
        "      )\n"
        "    return window_tx.update(\n      clipped_sum,",
      ),
    ),
    tests=(f"{PRIVACY_TESTS}::test_eight_devices_draw_once_per_window",),
  ),
  Mutant(
    name="private_clipped_after_the_devices_sum",
    guarantee="privacy: each example clipped to C, on every placement",
    defect="inside a shard_map that tracks variance, autodiff sums the"
    " devices' gradients before each example is clipped",
    edits=(
      Edit(
        PRIVATE_CLIPPING,
        "    if varying:\n",
        "    if False:\n",
      ),
    ),
    tests=(
      f"{PRIVACY_TESTS}::test_inside_a_checked_shard_map_each_device_clips_its_own_examples",
    ),
  ),
  Mutant(
    name="weightless_window_stepped_on_its_zeros",
    guarantee="reverse mode (the host's schedule, a window without weight)",
    defect="jax.grad through a window the host closes without weight is NaN"
    " (Adam's step on a zero gradient, selected away: 0 * inf reaches the"
    " gradient and the state) where the device's schedule gives 0",
    edits=(
      Edit(
        SCHEDULE,
        "        jnp.where(has_weight, leaf, jax.lax.stop_gradient(leaf))\n",
        "        leaf\n",
      ),
    ),
    tests=(
      "tests/test_host_schedule.py::test_a_window_without_weight_has_the_large_batch_derivative",
    ),
    # In the CPU's form the guard is a conditional: nothing is selected away.
    window_form="loops",
  ),
  Mutant(
    name="host_accumulator_under_a_mesh_not_refused",
    guarantee="reverse mode (host memory where JAX cannot differentiate it)",
    defect="jax.grad through an accumulator in host memory under"
    " jax.set_mesh fails inside JAX before 0.12 (a cotangent in host"
    " memory) instead of naming the argument to leave at None",
    edits=(
      Edit(
        ARGUMENTS,
        "    refused_under_a_mesh=not residency.MESH_DIFFERENTIATES_HOST_STATE,\n",
        "    refused_under_a_mesh=False,\n",
      ),
    ),
    tests=(
      "tests/test_reverse_mode.py::test_an_accumulator_in_host_memory_under_a_mesh",
    ),
  ),
  Mutant(
    name="weight_rule_without_its_select_in_forward_mode",
    guarantee="forward mode (a micro-batch weight of exactly 0)",
    defect="jax.jacfwd through a window holding an all-padding micro-batch"
    " at weight 0 is NaN: the weight's derivative multiplies its NaN term"
    " without the select at weight 0",
    edits=(
      Edit(
        WEIGHTS,
        "  through_weight = weight_dot * jnp.where(weight == 0, _finite(term), term)\n",
        "  through_weight = weight_dot * term\n",
      ),
    ),
    tests=(
      "tests/test_weights.py::test_forward_mode_through_a_dropped_nan_micro_batch_is_finite",
    ),
  ),
  Mutant(
    name="weight_rule_term_derivative_without_its_select",
    guarantee="forward mode (a micro-batch weight of exactly 0)",
    defect="the derivative through a dropped micro-batch's term is 0 times"
    " its NaN tangent, not 0",
    edits=(
      Edit(
        WEIGHTS,
        "  through_term = jnp.where(weight == 0, zeros, weight * term_dot)\n",
        "  through_term = weight * term_dot\n",
      ),
    ),
    tests=(
      "tests/test_weights.py::test_forward_mode_through_a_dropped_nan_micro_batch_is_finite",
    ),
  ),
  Mutant(
    name="scalar_accumulator_never_cleared",
    guarantee="equivalence (every close leaves the accumulator at zero)",
    defect="a scalar parameter's accumulator is left as it is at the"
    " close: the next window adds onto the last one's sum",
    edits=(
      Edit(
        LOCAL,
        "  if not leaf.ndim:  # a scalar: nothing worth sharing or copying\n"
        "    return jnp.zeros_like(leaf)\n",
        "  if not leaf.ndim:  # a scalar: nothing worth sharing or copying\n"
        "    return leaf\n",
      ),
    ),
    tests=(
      "tests/test_accumulate.py::test_a_scalar_parameters_accumulator_is_cleared_at_each_close",
    ),
  ),
  Mutant(
    name="weight_sum_carried_after_a_weightless_window",
    guarantee="equivalence (weights: a window without weight)",
    defect="a window closed without a step (its weights summing to 0 or"
    " less) leaves its weight sum to the next window",
    edits=(
      Edit(
        MICRO_STEP,
        "  weight_sum = schedule.cleared(\n    decision.closes,",
        "  weight_sum = schedule.cleared(\n    closed.stepped,",
      ),
    ),
    tests=(
      "tests/test_weights.py::test_a_window_without_weight_leaves_nothing_to_the_next",
    ),
  ),
  Mutant(
    name="host_schedule_keeps_a_weightless_windows_sums",
    guarantee="the host's schedule (a window without weight)",
    defect="a window the host closes without weight leaves its gradient"
    " sums in the accumulator for the next window",
    edits=(
      Edit(
        MICRO_STEP,
        "    if call.carrier is not Carrier.ACCUMULATOR:\n"
        "      # A window without weight",
        "    if call.carrier is not Carrier.ACCUMULATOR and isinstance(\n"
        "      schedule, schedule_lib.DeviceScheduled\n"
        "    ):\n"
        "      # A window without weight",
      ),
    ),
    tests=(
      "tests/test_weights.py::test_a_window_without_weight_leaves_nothing_to_the_next",
    ),
    # In the CPU's form the host's close zeroes the sums whatever the weight.
    window_form="loops",
  ),
  Mutant(
    name="one_chip_v4_slice_without_its_host_bounds",
    guarantee="the audits compile for TPUs (every documented slice)",
    defect="the one-chip v4 slice (two devices) is described without one"
    " chip per host, which libtpu refuses",
    edits=(
      Edit(
        TPU_COMPILE,
        '  one_chip = set(name.split(":")[1].split("x")) == {"1"}\n',
        "  one_chip = num_devices == 1\n",
      ),
    ),
    tests=(
      "tests/test_tpu_program.py::test_the_one_chip_v4_slice_compiles_a_window",
    ),
  ),
  Mutant(
    name="asynchronous_duplicate_read_as_a_move",
    guarantee="the audits read compiled programs (copies)",
    defect="an asynchronous copy within device memory is taken for a move"
    " between memory spaces, and left out of the duplicates",
    edits=(
      Edit(
        COMPILED_PATHS,
        "    return len(spaces) >= 2 and spaces[0] != spaces[1]\n",
        "    return len(spaces) >= 2\n",
      ),
    ),
    tests=(
      "tests/test_hlo.py::test_path_audit_counts_each_call_and_no_empty_window",
    ),
  ),
  Mutant(
    name="empty_window_counted_on_the_closing_path",
    guarantee="the audits read compiled programs (paths)",
    defect="the branch that empties a window closed without weight is"
    " counted on the closing path, which steps the optimizer",
    edits=(
      Edit(
        COMPILED_PATHS,
        "  if side == scopes.EMPTY_WINDOW:\n    return False\n",
        '  if side == scopes.EMPTY_WINDOW:\n    return path == "closing"\n',
      ),
    ),
    tests=(
      "tests/test_hlo.py::test_path_audit_counts_each_call_and_no_empty_window",
    ),
  ),
  Mutant(
    name="computation_called_twice_counted_once",
    guarantee="the audits read compiled programs (bytes moved)",
    defect="a computation reached from two call sites is walked once, its"
    " bytes counted once",
    edits=(
      Edit(
        COMPILED_PATHS,
        "  misplaced: list[str] = []\n",
        "  misplaced: list[str] = []\n  walked: set[str] = set()\n",
      ),
      Edit(
        COMPILED_PATHS,
        "    instructions = module.computations.get(computation, [])\n",
        "    if computation in walked:\n"
        "      return\n"
        "    walked.add(computation)\n"
        "    instructions = module.computations.get(computation, [])\n",
      ),
    ),
    tests=(
      "tests/test_hlo.py::test_path_audit_counts_each_call_and_no_empty_window",
    ),
  ),
  Mutant(
    name="copied_bytes_leaves_out_a_copy_of_exactly_at_least",
    guarantee="the audits read compiled programs (copies)",
    defect="copied_bytes(at_least=n) leaves out a copy of exactly n bytes",
    edits=(
      Edit(
        COMPILED_PATHS,
        "    return sum(copy.bytes for copy in self.copies if copy.bytes >= at_least)\n",
        "    return sum(copy.bytes for copy in self.copies if copy.bytes > at_least)\n",
      ),
    ),
    tests=(
      "tests/test_hlo.py::test_path_audit_counts_each_call_and_no_empty_window",
    ),
  ),
)
