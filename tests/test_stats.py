"""The intervals runs report with their success rates."""

from __future__ import annotations

import pytest

from common.metrics.stats import wilson_interval


@pytest.mark.parametrize("k,n,lo,hi", [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0),
                                       (22, 100, 0.1500, 0.3107), (1, 1, 0.2065, 1.0)])
def test_wilson_interval_matches_the_textbook_values(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-4)
    assert got[0] <= k / n <= got[1]


def test_no_trials_say_nothing_and_impossible_counts_fail():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match=r"successes must lie in \[0, n\]"):
        wilson_interval(11, 10)


def test_mean_interval_over_seeds_uses_students_t():
    from common.metrics.stats import mean_interval

    mean, lo, hi = mean_interval([0.2, 0.3, 0.4])  # sd 0.1, t(2) = 4.303
    assert mean == pytest.approx(0.3) and hi - mean == pytest.approx(4.303 * 0.1 / 3 ** 0.5, rel=1e-6)
    assert mean_interval([0.5]) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError):
        mean_interval([])
