"""The names of a micro-step's work in the compiled program.

The window names each part of a micro-step's work with a
``jax.named_scope``, and the names reach the ``op_name`` of every
instruction XLA compiles from it. The audits
(:mod:`ga_optax._src.audits`) read them back to tell which side of the
window an instruction belongs to. Both import the names from here, so
neither needs the other.
"""

# The add that keeps the window open: every call runs it.
KEEP_OPEN = "ga_optax_keep_open"
# The branches that close the window (reduce, normalise, step, clear).
CLOSE_WINDOW = "ga_optax_close_window"
# The branch that empties a window closed without weight: neither a
# micro-step nor a closing step that steps the optimizer runs it.
EMPTY_WINDOW = "ga_optax_empty_window"
SIDES = (KEEP_OPEN, CLOSE_WINDOW, EMPTY_WINDOW)
