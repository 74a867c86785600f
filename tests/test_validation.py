"""Bad configuration and bad input raise errors that name the argument.

Beside each argument's plainly wrong values: containers and None where a
scalar or a leaf belongs, non-floating gradients, another optimizer's state,
and traced variants of the same mistakes; and well-formed numpy inputs are
accepted.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ga_optax

PARAMS = {"w": jnp.ones((2, 3)), "b": jnp.zeros(2)}


@pytest.mark.parametrize(
  ("every_k", "error", "message"),
  [
    (0, ValueError, "every_k must be a positive int"),
    (-2, ValueError, "every_k must be a positive int"),
    (2.5, TypeError, "every_k must be a positive int"),
    (4.0, TypeError, "every_k must be a positive int"),
    ("4", TypeError, "every_k must be a positive int"),
    (True, TypeError, "every_k must be a positive int"),
    ({}, ValueError, "every_k .*empty dict"),
    ({1: 4, 3: 2}, ValueError, "every_k dict must contain key 0"),
    ({0: 4, 2: 0}, ValueError, r"every_k\[2\] must be a positive int"),
    ({0: 4, 2: -1}, ValueError, r"every_k\[2\] must be a positive int"),
    ({0: 4, -1: 2}, ValueError, "every_k dict keys must be non-negative"),
    ({0: 4, 2: 1.5}, TypeError, r"every_k\[2\] must be a positive int"),
    (lambda step: 2.5, TypeError, "every_k as a callable"),
    (lambda step: jnp.ones(2, jnp.int32), TypeError, "every_k as a callable"),
  ],
)
def test_bad_every_k(every_k, error, message):
  with pytest.raises(error, match=message):
    ga_optax.accumulate(optax.sgd(0.1), every_k)


@pytest.mark.parametrize("reduction", ["average", "MEAN", None, 1])
def test_bad_reduction(reduction):
  with pytest.raises(ValueError, match="reduction must be one of"):
    ga_optax.accumulate(optax.sgd(0.1), 2, reduction=reduction)


@pytest.mark.parametrize(
  "dtype", [jnp.int32, jnp.bool_, "int8", "not a dtype", None]
)
def test_bad_accumulator_dtype(dtype):
  with pytest.raises(TypeError, match="accumulator_dtype must be a floating"):
    ga_optax.accumulate(optax.sgd(0.1), 2, accumulator_dtype=dtype)


@pytest.mark.parametrize(
  "optimizer", [optax.sgd, "adam", None, (lambda p: p, lambda u, s: (u, s))]
)
def test_bad_optimizer(optimizer):
  with pytest.raises(TypeError, match="optimizer must be an optax"):
    ga_optax.accumulate(optimizer, 2)


def test_bad_skip_nonfinite():
  with pytest.raises(TypeError, match="skip_nonfinite must be a bool"):
    ga_optax.accumulate(optax.sgd(0.1), 2, skip_nonfinite="yes")


@pytest.mark.parametrize(
  "entry", [ga_optax.accumulate, ga_optax.accumulate_and_apply]
)
def test_a_misspelt_keyword_is_pythons_own_type_error(entry):
  with pytest.raises(
    TypeError, match=r"got an unexpected keyword argument 'reducton'"
  ):
    entry(optax.sgd(0.1), 2, reducton="sum")
  with pytest.raises(TypeError, match="positional argument"):
    entry(optax.sgd(0.1), 2, "sum")


def keywords_of(entry):
  """``entry``'s keyword-only parameters: name, default, annotation."""
  # eval_str: each annotation names real types.
  signature = inspect.signature(entry, eval_str=True)
  return [
    (parameter.name, parameter.default, parameter.annotation)
    for parameter in signature.parameters.values()
    if parameter.kind == inspect.Parameter.KEYWORD_ONLY
  ]


def test_both_signatures_show_every_keyword_with_its_default():
  for entry in (ga_optax.accumulate, ga_optax.accumulate_and_apply):
    # Written out, not rewritten: inspect reads the function itself.
    assert "__signature__" not in vars(entry)
    parameters = inspect.signature(entry).parameters
    assert [(name, parameter.kind) for name, parameter in parameters.items()][
      :2
    ] == [
      ("optimizer", inspect.Parameter.POSITIONAL_OR_KEYWORD),
      ("every_k", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ]
    # Nothing else: no **options behind the keywords.
    assert len(parameters) == 2 + len(keywords_of(entry))
  assert keywords_of(ga_optax.accumulate) == keywords_of(
    ga_optax.accumulate_and_apply
  )
  # The contract's keywords, in its order, and their defaults.
  assert [
    (name, default) for name, default, _ in keywords_of(ga_optax.accumulate)
  ] == [
    ("reduction", "mean"),
    ("accumulator_dtype", jnp.float32),
    ("skip_nonfinite", False),
    ("axis_name", None),
    ("unreduced_axes", None),
    ("accumulator_memory_kind", None),
    ("inner_state_memory_kind", None),
    ("inner_state_axes", None),
    ("noise_scale_decay", None),
    ("lr_scaling", None),
  ]
  text = str(inspect.signature(ga_optax.accumulate, eval_str=True))
  assert "reduction: str = 'mean'" in text, text
  assert "lr_scaling: str | None = None" in text, text


@pytest.mark.parametrize(
  ("fused", "use_jit"),
  [(False, False), (False, True), (True, False), (True, True)],
  ids=["update-eager", "update-jit", "apply-eager", "apply-jit"],
)
def test_a_misspelt_call_keyword_is_refused_not_dropped(fused, use_jit):
  # Extra keywords reach the optimizer only at a close, where optax.sgd
  # drops them: a misspelt weight= would make an unweighted mean.
  rng = np.random.default_rng(0)
  grads = rng.normal(size=(2, 3)).astype(np.float32)
  weights = [3.0, 1.0]
  params = {"w": jnp.zeros(3)}
  entry = ga_optax.accumulate_and_apply if fused else ga_optax.accumulate
  tx = entry(optax.sgd(1.0), 2)

  def call(g, state, **keywords):
    if fused:
      return tx.apply(params, g, state, **keywords)
    return tx.update(g, state, params, **keywords)

  if use_jit:
    call = jax.jit(call)
  state = tx.init(params)
  for g, weight in zip(grads, weights, strict=True):
    output, state = call({"w": jnp.asarray(g)}, state, weight=weight)
  # SGD at rate 1 steps by minus the weighted mean of the two gradients.
  reference = -(3.0 * grads[0] + 1.0 * grads[1]) / 4.0
  stepped = output["w"] if fused else params["w"] + output["w"]
  assert np.all(np.isfinite(stepped))
  np.testing.assert_allclose(stepped, reference, rtol=1e-6)
  state = tx.init(params)
  g = {"w": jnp.asarray(grads[0])}
  for misspelt, meant in [
    ("wieght", "weight"),
    ("closng", "closing"),
    ("flsh", "flush"),
    ("fp8state", "fp8_state"),
  ]:
    with pytest.raises(
      TypeError,
      match=f"{'apply' if fused else 'update'}\\(\\) got an unexpected"
      f" keyword argument '{misspelt}'. Did you mean '{meant}'",
    ):
      call(g, state, **{misspelt: 3.0})
  # A keyword for the optimizer, or for another member of a chain, passes.
  call(g, state, value=jnp.asarray(1.0))


def test_bad_axis_name():
  with pytest.raises(TypeError, match="axis_name must be None"):
    ga_optax.accumulate(optax.sgd(0.1), 2, axis_name=3)


@pytest.mark.parametrize("use_jit", [False, True])
def test_grads_with_another_tree(use_jit):
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  update = jax.jit(tx.update) if use_jit else tx.update
  with pytest.raises(ValueError, match="grads must have the tree structure"):
    update({"w": jnp.ones((2, 3))}, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize("use_jit", [False, True])
def test_grads_with_another_leaf_shape(use_jit):
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  update = jax.jit(tx.update) if use_jit else tx.update
  grads = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  with pytest.raises(
    ValueError, match=r"grads leaf \['w'\] has shape \(3, 2\)"
  ):
    update(grads, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize(
  ("weight", "error", "message"),
  [
    (-1.0, ValueError, "weight must be finite and >= 0"),
    (jnp.asarray(-3), ValueError, "weight must be finite and >= 0"),
    (float("nan"), ValueError, "weight must be finite and >= 0"),
    (float("inf"), ValueError, "weight must be finite and >= 0"),
    (jnp.ones(2), ValueError, "weight must be a scalar"),
    (True, TypeError, "weight must be a real number"),
    ("3", TypeError, "weight must be a real scalar"),
    (jnp.asarray(1 + 2j), TypeError, "weight must have a real numeric dtype"),
  ],
)
def test_bad_weight(weight, error, message):
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  with pytest.raises(error, match=message):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS, weight=weight)


def test_non_scalar_traced_weight():
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  update = jax.jit(
    lambda state, weight: tx.update(PARAMS, state, PARAMS, weight=weight)
  )
  with pytest.raises(ValueError, match="weight must be a scalar"):
    update(tx.init(PARAMS), jnp.ones(3))


@pytest.mark.parametrize("flush", [1, "yes", jnp.ones(2, bool), jnp.asarray(1)])
def test_bad_flush(flush):
  tx = ga_optax.accumulate(optax.sgd(0.1), 2)
  with pytest.raises(TypeError, match="flush must be a Python bool"):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS, flush=flush)


# The same mistakes in other shapes: containers and None, numpy scalars,
# traced values, non-floating gradients and another optimizer's state.


def _tx(**kwargs):
  return ga_optax.accumulate(optax.adam(0.1), 2, **kwargs)


@pytest.mark.parametrize(
  ("weight", "error", "message"),
  [
    ([1.0], TypeError, "weight must be a real scalar .* got list"),
    ((2,), TypeError, "weight must be a real scalar .* got tuple"),
    (None, TypeError, "weight must be a real scalar .* got NoneType"),
    (1j, TypeError, "weight must be a real scalar .* got complex"),
    (np.bool_(True), TypeError, "weight must be a real number .* boolean"),
    (jnp.ones(1), ValueError, r"weight must be a scalar .* shape \(1,\)"),
    (np.asarray(np.inf), ValueError, "weight must be finite and >= 0"),
    (np.int8(-1), ValueError, "weight must be finite and >= 0"),
    (jnp.asarray(-0.5, jnp.bfloat16), ValueError, "weight must be finite"),
  ],
  ids=[
    "list",
    "tuple",
    "none",
    "python-complex",
    "numpy-bool",
    "shape-1",
    "numpy-inf",
    "numpy-int8-negative",
    "bfloat16-negative",
  ],
)
def test_bad_weight_of_each_kind(weight, error, message):
  tx = _tx()
  with pytest.raises(error, match=message):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS, weight=weight)


@pytest.mark.parametrize(
  ("weight", "error", "message"),
  [
    (jnp.bool_(True), TypeError, "weight must be a real number .* boolean"),
    (jnp.ones((1, 1)), ValueError, "weight must be a scalar"),
    (jnp.asarray(1j), TypeError, "weight must have a real numeric dtype"),
  ],
  ids=["bool", "shape-1x1", "complex"],
)
def test_bad_traced_weight(weight, error, message):
  tx = _tx()
  update = jax.jit(lambda state, w: tx.update(PARAMS, state, PARAMS, weight=w))
  with pytest.raises(error, match=message):
    update(tx.init(PARAMS), weight)


@pytest.mark.parametrize(
  "flush",
  [None, 1.0, 0, np.asarray([True]), jnp.asarray(1.0), jnp.int32(1)],
  ids=["none", "float", "int-0", "numpy-shape-1", "float-array", "int-array"],
)
def test_bad_flush_of_each_kind(flush):
  tx = _tx()
  with pytest.raises(TypeError, match="flush must be a Python bool"):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS, flush=flush)


@pytest.mark.parametrize(
  "flush",
  [jnp.int32(1), jnp.ones((), jnp.float32), jnp.ones(1, bool)],
  ids=["int", "float", "shape-1"],
)
def test_bad_traced_flush(flush):
  tx = _tx()
  update = jax.jit(lambda state, f: tx.update(PARAMS, state, PARAMS, flush=f))
  with pytest.raises(TypeError, match="flush must be a Python bool"):
    update(tx.init(PARAMS), flush)


@pytest.mark.parametrize(
  "grads",
  [
    {"w": None, "b": jnp.zeros(2)},
    {"w": jnp.ones((2, 3)), "b": jnp.zeros(2), "c": jnp.ones(1)},
    (jnp.ones((2, 3)), jnp.zeros(2)),
    {"w": [[1.0] * 3] * 2, "b": jnp.zeros(2)},
    {"w": {"kernel": jnp.ones((2, 3))}, "b": jnp.zeros(2)},
    None,
  ],
  ids=["none-leaf", "extra-key", "tuple", "list-leaf", "nested", "none"],
)
@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_grads_with_another_tree_of_each_kind(grads, use_jit):
  tx = _tx()
  update = jax.jit(tx.update) if use_jit else tx.update
  with pytest.raises(ValueError, match="grads must have the tree structure"):
    update(grads, tx.init(PARAMS), PARAMS)


def test_grads_with_a_broadcastable_shape():
  tx = _tx()
  grads = {"w": jnp.ones((1, 2, 3)), "b": jnp.zeros(2)}
  with pytest.raises(ValueError, match=r"grads leaf \['w'\] has shape"):
    tx.update(grads, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize(
  ("leaf", "message"),
  [
    (jnp.ones((2, 3), jnp.int32), "of dtype int32"),
    (jnp.ones((2, 3), jnp.bool_), "of dtype bool"),
    # Under jit a numpy int64 arrives as int32 (x64 off).
    (np.ones((2, 3), np.int64), "of dtype int"),
  ],
  ids=["int32", "bool", "numpy-int64"],
)
@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_grads_with_a_non_floating_leaf(leaf, message, use_jit):
  tx = _tx()
  update = jax.jit(tx.update) if use_jit else tx.update
  grads = {"w": leaf, "b": jnp.zeros(2)}
  with pytest.raises(
    TypeError, match=rf"grads leaf \['w'\] must be a floating-point .*{message}"
  ):
    update(grads, tx.init(PARAMS), PARAMS)


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
def test_complex_grads_for_real_params(use_jit):
  tx = _tx()
  update = jax.jit(tx.update) if use_jit else tx.update
  grads = {"w": jnp.ones((2, 3), jnp.complex64), "b": jnp.zeros(2)}
  with pytest.raises(
    TypeError,
    match=r"grads leaf \['w'\] is complex \(complex64\), but its param",
  ):
    update(grads, tx.init(PARAMS), PARAMS)


def test_grads_with_a_python_scalar_leaf():
  params = {"w": jnp.ones(()), "b": jnp.zeros(2)}
  tx = _tx()
  grads = {"w": 1.0, "b": jnp.zeros(2)}
  with pytest.raises(
    TypeError, match=r"grads leaf \['w'\] must be a floating-point array"
  ):
    tx.update(grads, tx.init(params), params)


@pytest.mark.parametrize(
  "state",
  [
    optax.adam(0.1).init(PARAMS),
    None,
    {"micro_step": jnp.zeros((), jnp.int32)},
  ],
  ids=["inner-optimizer-state", "none", "dict"],
)
def test_a_state_that_is_not_an_accumulate_state(state):
  tx = _tx()
  with pytest.raises(TypeError, match="state must be the AccumulateState"):
    tx.update(PARAMS, state, PARAMS)


def test_the_state_of_a_chain_passed_to_the_bare_accumulate():
  chain = optax.chain(optax.clip(1.0), _tx())
  with pytest.raises(TypeError, match="state must be the AccumulateState"):
    _tx().update(PARAMS, chain.init(PARAMS), PARAMS)


@pytest.mark.parametrize(
  "skip_nonfinite", [1, np.bool_(True), None], ids=["int", "numpy-bool", "none"]
)
def test_bad_skip_nonfinite_of_each_kind(skip_nonfinite):
  with pytest.raises(TypeError, match="skip_nonfinite must be a bool"):
    _tx(skip_nonfinite=skip_nonfinite)


@pytest.mark.parametrize(
  "dtype",
  [jnp.complex64, "complex64", object],
  ids=["complex", "str", "object"],
)
def test_complex_or_unknown_accumulator_dtype(dtype):
  with pytest.raises(TypeError, match="accumulator_dtype must be a floating"):
    _tx(accumulator_dtype=dtype)


@pytest.mark.parametrize(
  "every_k",
  [jnp.int32(2), np.asarray([2]), [2]],
  ids=["array", "np-1d", "list"],
)
def test_every_k_as_an_array_or_list(every_k):
  with pytest.raises(TypeError, match="every_k must be a positive int"):
    ga_optax.accumulate(optax.sgd(0.1), every_k)


def test_well_formed_numpy_inputs_are_accepted():
  # The other side of the checks: numpy scalars and arrays are fine.
  tx = ga_optax.accumulate(optax.sgd(1.0), np.int64(2))
  grads = {"w": np.ones((2, 3), np.float32), "b": np.zeros(2, np.float32)}
  state = tx.init(PARAMS)
  _, state = tx.update(grads, state, PARAMS, weight=np.uint8(3))
  updates, state = tx.update(grads, state, PARAMS, flush=np.bool_(False))
  assert bool(ga_optax.emitted(state))
  np.testing.assert_allclose(updates["w"], -np.ones((2, 3)))
