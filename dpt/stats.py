"""Means with their 95% intervals: what the benchmarks and the lessons' measurements report.

:func:`mean_ci` is the plain t-interval; :func:`positive_ci` the one for times and other
positive quantities (on their logarithms, so it never goes below zero).

Pure computation on lists of numbers (the same seed-by-seed or round-by-round values a table
shows), so it is tested with made-up values.
"""

from __future__ import annotations

import math
import statistics

# Two-sided 95% Student t quantiles, by degrees of freedom (for n values, df = n - 1).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (table, conservative:
    between two rows of the table, the fewer degrees of freedom, whose quantile is larger)."""
    if df < 1:
        raise ValueError("a t-interval needs at least 2 samples")
    if df > 30:
        return 1.96 + 2.4 / df  # within 0.01 of the exact quantile above 30
    return _T975[max(k for k in _T975 if k <= df)]


def mean_ci(xs: list[float]) -> tuple[float, float | None, float | None]:
    """Mean and 95% t-interval of ``xs``; (mean, None, None) from a single value."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, None, None
    half = t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - half, m + half


def positive_ci(xs: list[float]) -> tuple[float, float | None, float | None]:
    """Geometric mean and 95% interval of positive quantities (times, throughputs, ratios).

    A t-interval on the logarithms, turned back: the interval is ``[g / f, g * f]`` for a
    factor ``f > 1``, so it never reaches zero or below, as a plain t-interval on two widely
    spread times does (``5.2 [-27.8, 38.2]`` ms). (geomean, None, None) from a single value.
    """
    if not xs:
        raise ValueError("an interval needs at least one value")
    bad = [x for x in xs if not x > 0 or not math.isfinite(x)]
    if bad:
        raise ValueError(f"positive_ci takes positive finite values only, got {bad[0]!r}")
    m, lo, hi = mean_ci([math.log(x) for x in xs])
    if lo is None or hi is None:
        return math.exp(m), None, None
    return math.exp(m), math.exp(lo), math.exp(hi)
