"""Means and 95 % intervals over seeds. Torch-free.

A setting's seeds give a mean ± the 95 % Student-t half-width (:func:`mean_ci`), shown beside each value;
methods are compared by the paired rule (:mod:`kvqbench.report.stats.paired`), not by these intervals.
"""

from __future__ import annotations

import functools
import math
from typing import Any

__all__ = ["mean_ci", "is_short", "units_of"]


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


def units_of(entry: dict[str, Any]) -> dict[Any, float]:
    """A stats entry's values by unit (its ``seeds``: seeds, text windows or texts)."""
    return dict(zip(entry.get("seeds") or [], entry.get("values") or []))
