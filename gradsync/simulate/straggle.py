"""Stragglers: a synchronous step waits for the slowest of its N ranks.

Each rank's compute time per step varies: data-dependent work, GPU clocks under power and
thermal limits, OS noise, I/O and the framework's own threads. Model one step's compute on
rank r as an independent draw

    T_r = mu (1 + c Z_r),   Z_r ~ N(0, 1),   c = the coefficient of variation (``jitter_cv``)

Synchronous SGD cannot finish the step's allreduces before every rank has produced its
gradients, so the step waits for ``max_r T_r``, and in expectation

    E[max_r T_r] = mu (1 + c e_N),   e_N = E[max of N independent standard normals].

``e_N`` has no closed form for N > 5, but it is one integral, cheap for any N: with
Phi the normal CDF, M = max Z_r has CDF Phi(x)^N, and for any variable
E[M] = integral_0^inf P(M > x) dx - integral_-inf^0 P(M <= x) dx, so

    e_N = integral_0^inf (1 - Phi(x)^N) dx - integral_-inf^0 Phi(x)^N dx.

``expected_max`` evaluates it with Simpson's rule on a fixed grid (a few thousand points,
independent of N: the same cost for 2 ranks and 27,360), in logarithms so that
``1 - Phi^N`` keeps its digits when Phi is within 1e-16 of 1. Checks: e_1 = 0, e_2 = 1/sqrt(pi)
= 0.5642, e_3 = 3 / (2 sqrt(pi)) = 0.8463 (exact values; the tests hold them to 1e-9), and a
Monte Carlo estimate at 4, 64 and 1,000 ranks.

Closed-form approximations, and how far off they are (docs/simulate.md has the table):

- ``sqrt(2 ln N)``, the leading term of the extreme-value limit: too high, +16% at N = 512
  (3.53 against 3.04) and +10% at 27,360 (4.52 against 4.09), converging slowly. Not used.
- Blom's ``Phi^-1((N - 0.375) / (N + 0.25))``: within 1% from N = 8 on (+4.5% at N = 2).
  ``blom`` computes it, for comparison only.

Hierarchies need no special handling: whatever the allreduce algorithm (a ring inside each
node first, then across nodes), the last bucket cannot be reduced before the slowest rank
anywhere has produced it, so every rank waits for the maximum over all N; grouping ranks
changes who waits where, not how long the step is.

``c`` is the part of a rank's variation that is its own. Variation common to all ranks
(the machine's load, a file system that stalls everyone) moves every rank together and makes
nobody wait; counted into ``c``, it overestimates the wait (``measure.straggler_check``
shows by how much on this machine).

Persistently slow GPUs. GPUs of one model and SKU differ in speed, and a slow one is slow on
every step (manufacturing variation under power management; Sinha et al., SC22, measured it
on Summit's V100s). Give GPU r a fixed speed draw P_r ~ N(0, 1) of coefficient p
(``persistent_cv``), the same for the whole job, on top of the per-step draw:

    T_r = mu (1 + p P_r + c Z_r)

For one step, p P_r + c Z_r is a sum of independent normals, itself normal with standard
deviation sqrt(p^2 + c^2), so averaged over which GPUs a job is given,

    E[max_r T_r] = mu (1 + sqrt(p^2 + c^2) e_N)

exactly: the two kinds combine in quadrature, and a job on N GPUs runs at the pace of its
slowest every step. For one given allocation the persistent part does not average out over
steps (its slowest GPU is the same every step); the formula is its expectation over
allocations. One GPU (e_1 = 0) is the mean GPU.

What the model leaves out: it stretches a rank's whole forward and backward by the same
draw (gradient readiness follows the slowest rank), draws are independent across ranks, and
both tails are normal; heavier tails (an exponential tail gives e_N ~ ln N) make the maximum
grow faster, and outliers (a GPU 1.5x slower than the median) are a fixed straggler of their
own that no normal coefficient describes: jobs that can exclude them do.
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

import numpy as np

__all__ = ["expected_max", "blom", "straggler_factor"]

_STEP = 1 / 256
"""Grid step of the integration (in standard deviations): Simpson's error is below 1e-10."""


def _log_phi(x: np.ndarray) -> np.ndarray:
    """log Phi(x), accurate for large positive x (where Phi is 1 - a tiny tail)."""
    tail = 0.5 * np.array([math.erfc(v / math.sqrt(2)) for v in np.abs(x)])
    return np.where(x >= 0, np.log1p(-tail), np.log(tail))


def _simpson(y: np.ndarray, h: float) -> float:
    return float(h / 3 * (y[0] + y[-1] + 4 * y[1:-1:2].sum() + 2 * y[2:-1:2].sum()))


@lru_cache(maxsize=None)
def expected_max(n: int) -> float:
    """E[max of ``n`` independent standard normals] (0 for one rank)."""
    if n < 1:
        raise ValueError(f"expected_max: need at least 1 rank, got {n}")
    if n == 1:
        return 0.0
    # Past x = sqrt(2 ln n) + 9, n (1 - Phi(x)) < 1e-17; below -9, Phi(x)^n < 1e-19.
    top = math.sqrt(2 * math.log(n)) + 9
    up = np.linspace(0, top, 2 * math.ceil(top / _STEP / 2) + 1)
    down = np.linspace(-9, 0, 2 * math.ceil(9 / _STEP / 2) + 1)
    above = -np.expm1(n * _log_phi(up))      # P(max > x) = 1 - Phi(x)^n
    below = np.exp(n * _log_phi(down))       # P(max <= x) = Phi(x)^n
    return _simpson(above, up[1] - up[0]) - _simpson(below, down[1] - down[0])


def blom(n: int) -> float:
    """Blom's (1958) approximation of ``expected_max(n)``: Phi^-1((n - 3/8) / (n + 1/4))."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


def straggler_factor(n: int, cv: float, persistent: float = 0.0) -> float:
    """E[slowest rank's compute] / mean compute, for ``n`` ranks whose compute varies per step
    with coefficient ``cv`` and per GPU (fixed for the job) with coefficient ``persistent``."""
    if cv < 0:
        raise ValueError(f"jitter_cv must be >= 0, got {cv}")
    if persistent < 0:
        raise ValueError(f"persistent_cv must be >= 0, got {persistent}")
    spread = math.hypot(cv, persistent)
    return 1.0 + spread * expected_max(n) if spread else 1.0
