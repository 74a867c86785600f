"""The options of :func:`gpu_compiler_options`, read without a GPU.

What the recipe asks XLA:GPU for is a string, so its promises are checked
here on any machine, without JAX's CUDA plugin: the window's loops and, by
default, the collectives of a window reduced across GPUs; and collective
kernels from the jaxlib that knows them (tests/test_host_waits.py checks the
list against the defaults of the installed XLA:GPU, where the plugin is).
"""

from __future__ import annotations

import jaxlib
import pytest

from ga_optax._src.recipes.gpu_recipe import gpu_compiler_options

OPTION = "xla_gpu_enable_command_buffer"


def command_buffer_kinds(**options) -> list[str]:
  recipe = gpu_compiler_options(**options)
  assert list(recipe) == [OPTION]
  return recipe[OPTION].split(",")


def test_by_default_the_recipe_captures_loops_and_collectives():
  kinds = command_buffer_kinds()
  assert "WHILE" in kinds and "COLLECTIVES" in kinds, kinds
  assert kinds == command_buffer_kinds(collectives=True)
  assert len(kinds) == len(set(kinds)), kinds


def test_without_collectives_only_the_collectives_are_left_out():
  with_collectives = command_buffer_kinds(collectives=True)
  without = command_buffer_kinds(collectives=False)
  assert "WHILE" in without and "COLLECTIVES" not in without, without
  assert [kind for kind in with_collectives if kind != "COLLECTIVES"] == (
    without
  )


@pytest.mark.parametrize(
  ("version", "knows_collective_kernels"),
  [
    ("0.10.2", False),
    ("0.11.2", False),
    ("0.12.0", True),
    ("0.12.0.1", True),
    ("0.13.1", True),
  ],
)
def test_collective_kernels_are_asked_for_from_jaxlib_0_12(
  monkeypatch, version, knows_collective_kernels
):
  # An older jaxlib refuses the kind as unknown; 0.12's XLA enables it by
  # default, so a list that replaces the defaults must repeat it there.
  monkeypatch.setattr(jaxlib, "__version__", version)
  kinds = command_buffer_kinds()
  assert ("COLLECTIVES_KERNEL" in kinds) == knows_collective_kernels, kinds
  monkeypatch.setattr(jaxlib, "__version__", "0.11.2")
  older = command_buffer_kinds()
  assert [kind for kind in kinds if kind != "COLLECTIVES_KERNEL"] == older
