"""When a load generator sends each request: offsets in seconds from the start of a run.

Gaps between arrivals are gamma distributed with shape = burstiness and scale =
1 / (rate * burstiness), so their mean is 1 / rate whatever the burstiness and their
coefficient of variation is 1 / sqrt(burstiness): burstiness 1 is a Poisson process
(exponential gaps), below 1 burstier, above 1 more regular. A rate of infinity sends
everything at t = 0. The first request goes at t = 0.

The gaps come from numpy's standard gamma draws scaled by 1 / (rate * burstiness), so one
seed and burstiness give the same pattern at every rate, stretched: runs of a rate sweep
differ by the rate alone.
"""

from __future__ import annotations

import math

import numpy as np


def send_offsets(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send times of n requests in seconds from the start, non-decreasing, first at 0."""
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate: must be > 0 (inf: all at once), got {rate}")
    if not 0 < burstiness < math.inf:
        raise ValueError(f"burstiness: must be a positive number, got {burstiness}")
    if rate == math.inf or n == 0:
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1 / (rate * burstiness), n - 1)
    return [0.0, *(float(t) for t in np.cumsum(gaps))]
