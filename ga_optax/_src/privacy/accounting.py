"""The privacy budget, counted in windows, through ``dp-accounting``.

Each closed window is one release of the Poisson-subsampled Gaussian
mechanism: every example joins the window's logical batch with probability
q, and the window's sum, each example clipped to norm C, gets Gaussian noise
of standard deviation sigma * C. ``windows`` such releases compose; the
micro-steps within a window are not releases and never reach the
accountant. The default accountant is Renyi DP (RDP, ``dp-accounting``'s
default orders), which is fast enough to calibrate sigma by bisection and
is the one most published DP-SGD budgets use; ``accountant="pld"`` takes
the privacy-loss distribution, tighter (a smaller epsilon for the same
run) and slower.
"""

from __future__ import annotations

import math
from typing import Any

ACCOUNTANTS = ("rdp", "pld")


def _library() -> Any:
  try:
    import dp_accounting
  except ImportError as error:
    raise ImportError(
      "ga_optax.privacy's accounting needs dp-accounting: pip install"
      " 'ga_optax[privacy]' (or dp-accounting)."
    ) from error
  return dp_accounting


def _accountant(name: str) -> Any:
  library = _library()
  if name == "rdp":
    return library.rdp.RdpAccountant()
  if name == "pld":
    return library.pld.PLDAccountant()
  raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {name!r}.")


def _event(windows: int, sampling_probability: float, noise_multiplier: float):
  library = _library()
  return library.SelfComposedDpEvent(
    library.PoissonSampledDpEvent(
      sampling_probability, library.GaussianDpEvent(noise_multiplier)
    ),
    windows,
  )


def _check(windows: Any, sampling_probability: float, delta: float) -> int:
  windows = int(windows)
  if windows < 0:
    raise ValueError(f"windows must be >= 0, got {windows}.")
  if not 0 < sampling_probability <= 1:
    raise ValueError(
      f"sampling_probability must be in (0, 1], got {sampling_probability!r}."
    )
  if not 0 < delta < 1:
    raise ValueError(f"delta must be in (0, 1), got {delta!r}.")
  return windows


def epsilon(
  windows: Any,
  *,
  sampling_probability: float,
  noise_multiplier: float,
  delta: float,
  accountant: str = "rdp",
) -> float:
  """Epsilon spent by ``windows`` closed private windows, at ``delta``.

  Args:
    windows: the closed windows (:func:`ga_optax.privacy.windows_closed`
      of the state; an int or a scalar array).
    sampling_probability: q, each example's probability of joining a
      window's logical batch.
    noise_multiplier: sigma, as given to
      :func:`ga_optax.privacy.accumulate`.
    delta: the delta of (epsilon, delta)-DP, in (0, 1).
    accountant: ``"rdp"`` (Renyi DP, the default) or ``"pld"``
      (privacy-loss distributions).

  Returns:
    Epsilon, a float (inf for noise_multiplier 0, 0 for no window).

  Raises:
    ValueError: an argument out of its range.
    ImportError: dp-accounting is not installed.

  Example:
    >>> import ga_optax
    >>> eps = ga_optax.privacy.epsilon(
    ...     1000, sampling_probability=0.01, noise_multiplier=1.0,
    ...     delta=1e-5)
    >>> round(eps, 2)
    2.1
  """
  windows = _check(windows, sampling_probability, delta)
  if noise_multiplier < 0:
    raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}.")
  if windows == 0:
    return 0.0
  if noise_multiplier == 0:
    return math.inf
  composed = _accountant(accountant)
  composed.compose(_event(windows, sampling_probability, noise_multiplier))
  return float(composed.get_epsilon(delta))


def calibrated_noise_multiplier(
  target_epsilon: float,
  *,
  windows: int,
  sampling_probability: float,
  delta: float,
  accountant: str = "rdp",
) -> float:
  """The smallest noise multiplier whose ``windows`` releases spend at most
  ``target_epsilon`` at ``delta``.

  Args:
    target_epsilon: the budget, > 0.
    windows: the windows the run will close.
    sampling_probability: q.
    delta: the delta of (epsilon, delta)-DP.
    accountant: ``"rdp"`` or ``"pld"``, as for :func:`epsilon`.

  Returns:
    sigma, to pass as ``noise_multiplier``.

  Raises:
    ValueError: an argument out of its range.
  """
  windows = _check(windows, sampling_probability, delta)
  if not target_epsilon > 0:
    raise ValueError(f"target_epsilon must be > 0, got {target_epsilon!r}.")
  library = _library()
  sigma = library.calibrate_dp_mechanism(
    lambda: _accountant(accountant),
    lambda sigma: _event(windows, sampling_probability, sigma),
    target_epsilon,
    delta,
    library.LowerEndpointAndGuess(1e-3, 1.0),
    tol=1e-4,
  )
  return float(sigma)
