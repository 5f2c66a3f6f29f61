"""Intervals for the numbers runs report: a success rate over episodes is a binomial proportion, so its 95 %
interval is Wilson's score interval (it stays inside [0, 1] and is honest at 0 % and 100 %, where the normal
approximation collapses to a point)."""

from __future__ import annotations

import math

Z95 = 1.959963984540054
"""the standard normal's 97.5 % quantile: a two-sided 95 % interval"""


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``successes / n``; (0, 1) when there are no trials."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must lie in [0, n], got {successes} of {n}")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    # At 0 and n the bound is exactly 0 or 1; rounding would leave it a hair inside, excluding the estimate.
    return (0.0 if successes == 0 else max(0.0, centre - half)), (1.0 if successes == n else min(1.0, centre + half))
