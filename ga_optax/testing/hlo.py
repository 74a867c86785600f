"""Reading the text of a compiled HLO module, for audits of one's own.

``jax.jit(step).lower(...).compile().as_text()`` is the program XLA will
run, after sharding propagation and SPMD partitioning: its collectives are
the cross-device traffic, and its array shapes are per device. The audits
of :mod:`ga_optax.testing` ask a step's questions of that text; this
namespace holds the pieces they are built from:

* :func:`parse_hlo`: the text as an :class:`HloModule`, its computations
  and their instructions (each an :class:`HloInstruction`).
* :func:`reachable`: the computations one computation reaches through its
  calls (fusions, loops, and branches unless told not to enter them).
* :func:`collectives_in_hlo`: the collectives of a set of computations
  (each a :class:`Collective`), with the bytes each moves per device.
* :func:`dot_shapes`: the per-device operand shapes of every matrix product,
  whose rows say how many examples each device multiplies at a time.
"""

from ga_optax._src.audits.hlo import (
  Collective,
  HloInstruction,
  HloModule,
  collectives_in_hlo,
  parse_hlo,
  reachable,
)
from ga_optax._src.audits.hlo_audits import dot_shapes

__all__ = [
  "Collective",
  "HloInstruction",
  "HloModule",
  "collectives_in_hlo",
  "dot_shapes",
  "parse_hlo",
  "reachable",
]
