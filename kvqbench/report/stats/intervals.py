"""Means, 95 % intervals over seeds and the tie rules every ranking uses. Torch-free.

A setting's seeds give a mean ± the 95 % Student-t half-width (:func:`mean_ci`). Two methods are *tied*
when their intervals, taken in badness space (lower = better whatever the metric's direction,
:func:`interval`), overlap; :func:`ranked_with_floor` also ties methods whose means differ by no more
than the larger of their noise floors (float noise measured on its own).
"""

from __future__ import annotations

import functools
import math
from typing import Any

__all__ = ["mean_ci", "interval", "is_short", "ranked_with_floor"]


def mean_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float | None]:
    """Mean and Student-t half-width of the ``confidence`` interval (``None`` for one value)."""
    n = len(values)
    m = math.fsum(values) / n
    if n < 2:
        return m, None
    if max(values) == min(values):  # identical seeds (deterministic method on fixed data): exactly 0
        return values[0], 0.0
    var = math.fsum((v - m) ** 2 for v in values) / (n - 1)
    return m, float(_student_t_ppf(0.5 + confidence / 2, n - 1) * math.sqrt(var / n))


@functools.lru_cache(maxsize=None)
def _student_t_ppf(p: float, df: int) -> float:
    """Student-t quantile: ``scipy.special.stdtrit`` — the function ``scipy.stats.t.ppf`` evaluates, the
    same value to the bit — without importing all of ``scipy.stats``."""
    from scipy.special import stdtrit

    return float(stdtrit(df, p))


def is_short(entry: dict[str, Any]) -> bool:
    """Whether a stats entry has fewer seeds than asked (see :func:`kvqbench.report.stats.aggregate.aggregate`)."""
    return entry.get("n", 0) < entry.get("n_asked", 0)


def interval(entry: dict[str, Any], better: str) -> tuple[float, float]:
    """The 95% CI in "badness" space (lower = better whatever the metric's direction)."""
    m, ci = entry["mean"], entry["ci95"] or 0.0
    lo, hi = m - ci, m + ci
    if better == "zero":
        if lo <= 0 <= hi:
            return 0.0, max(abs(lo), abs(hi))
        return min(abs(lo), abs(hi)), max(abs(lo), abs(hi))
    if better == "higher":
        return -hi, -lo
    return lo, hi


def ranked_with_floor(entries: dict[str, tuple[float, float | None, float | None]]) -> list[dict[str, Any]]:
    """Methods ranked by a lower-is-better mean, with ties from the CIs and the noise floor.

    Args:
        entries: ``method → (mean, 95 % half-width or None, noise standard deviation or None)``.
    Returns:
        Rows best mean first, ``{"method", "mean", "rank", "ties"}``: two methods tie when their intervals
        ``mean ± half-width`` overlap or ``|Δ mean|`` is at most the larger of their noise floors;
        ``rank`` = 1 + the methods better than this one without a tie, never lower than the rank above.
    """
    def tie(a: str, b: str) -> bool:
        (ma, ca, na), (mb, cb, nb) = entries[a], entries[b]
        if abs(ma - mb) <= max(na or 0.0, nb or 0.0):
            return True
        return not (ma + (ca or 0.0) < mb - (cb or 0.0) or mb + (cb or 0.0) < ma - (ca or 0.0))

    order = sorted(entries, key=lambda m: (entries[m][0], m))
    rows: list[dict[str, Any]] = []
    for m in order:
        rank = 1 + sum(1 for o in order if entries[o][0] < entries[m][0] and not tie(o, m))
        if rows:
            rank = max(rank, rows[-1]["rank"])
        rows.append({"method": m, "mean": entries[m][0], "rank": rank,
                     "ties": [o for o in order if o != m and tie(o, m)]})
    return rows
