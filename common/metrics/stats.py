"""Intervals for the numbers runs report. A success rate over episodes is a binomial proportion, so its 95 %
interval is Wilson's score interval (it stays inside [0, 1] and is honest at 0 % and 100 %, where the normal
approximation collapses to a point). A mean over a few seeds gets Student's t interval."""

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


# Student's t 97.5 % quantiles for 1..30 degrees of freedom (two-sided 95 %); beyond 30 the normal's is within 2 %.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean across independent runs (e.g. seeds) with its 95 % Student-t interval; one value
    has no spread to estimate, so its interval is the value itself."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n == 1:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = _T975[n - 2] if n - 1 <= len(_T975) else Z95
    half = t * sd / math.sqrt(n)
    return mean, mean - half, mean + half
