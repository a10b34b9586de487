"""Paired comparisons of settings scored on the same units (docs/METRICS.md, "Paired comparisons").

A *unit* is what every compared setting was scored on: the text window (exp5), the text (exp6 long
decode), the seed (synthetic data, exp1–4). Unit-to-unit difficulty is shared by all settings and
cancels in a paired difference, so settings are compared unit by unit, never by whether two marginal
intervals overlap. Damage metrics are ratio-scale (KL, MSE, error norms) and are compared on the log
scale: a result reads as "× the best's".

Values must be finite and, on the log scale, positive (:func:`log_differences`; exact settings, damage 0,
are not budget points). Pure functions of their arguments (numpy and scipy.stats): the same numbers on
every run.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Hashable, Mapping, Sequence

import numpy as np
from scipy import stats

__all__ = ["ALPHA", "CONFIDENCE", "BOOTSTRAP", "BOOTSTRAP_SEED", "PAIRED_TEST", "shared_units", "aligned",
           "log_differences", "paired_ratio", "holm", "mcnemar_exact", "rank_intervals", "budget_verdict",
           "compare_gate", "paired_ranking"]

#: family-wise error rate of the one-sided tests of one budget row (Holm over the candidates compared with
#: the best): 0.025, the one-sided half of the two-sided 5 % level, so that a comparison called separated
#: (Holm-adjusted, hence also unadjusted, p ≤ 0.025) always has its two-sided 95 % ratio interval wholly
#: above 1 — the verdict and the interval shown beside it never disagree
ALPHA = 0.025
#: confidence of the ratio intervals and the rank intervals
CONFIDENCE = 0.95
#: resamples of the paired cluster bootstrap and its PCG64 seed
BOOTSTRAP = 2000
BOOTSTRAP_SEED = 0
#: the board's top-level description of the rule (docs/METRICS.md)
PAIRED_TEST: dict[str, Any] = {"test": "one-sided paired t-test on log values", "correction": "Holm", "alpha": ALPHA,
                               "confidence": CONFIDENCE, "bootstrap": BOOTSTRAP, "bootstrap_seed": BOOTSTRAP_SEED}


def shared_units(per_setting: Mapping[Hashable, Mapping[Hashable, float]]) -> list:
    """The sorted unit ids every setting of ``per_setting`` (setting key → (unit id → value), unit ids of
    one kind) has a finite value for; ``[]`` when none is shared or there is no setting."""
    common: set | None = None
    for by_unit in per_setting.values():
        have = {u for u, v in by_unit.items() if v is not None and np.isfinite(v)}
        common = have if common is None else common & have
    return sorted(common or ())


def aligned(per_setting: Mapping[Hashable, Mapping[Hashable, float]], units: Sequence | None = None) -> np.ndarray:
    """The values as a ``(settings, units)`` float64 array, rows in ``per_setting``'s order, columns in the
    order of ``units`` (default :func:`shared_units`). Raises ``KeyError`` when a setting lacks a unit."""
    units = shared_units(per_setting) if units is None else units
    return np.array([[float(by_unit[u]) for u in units] for by_unit in per_setting.values()],
                    dtype=np.float64).reshape(len(per_setting), len(units))


def log_differences(best: Sequence[float], other: Sequence[float]) -> np.ndarray:
    """Per-unit ``log(other) − log(best)``, float64, shape ``(n,)``.

    A unit where both values are exactly equal gives exactly 0 (both 0 included). Raises ``ValueError``
    on different lengths, a non-finite value, or a value ≤ 0 at a unit where the two differ.
    """
    a, b = np.asarray(best, dtype=np.float64), np.asarray(other, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired values need two 1-d arrays of one length, got shapes {a.shape} and {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("paired values must be finite")
    same = a == b
    bad = ~same & ((a <= 0) | (b <= 0))
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"the log scale needs positive values: unit {i} has {a[i]!r} and {b[i]!r}")
    out = np.zeros_like(a)
    out[~same] = np.log(b[~same]) - np.log(a[~same])
    return out


def paired_ratio(best: Sequence[float], other: Sequence[float]) -> dict[str, Any]:
    """Geometric-mean ratio other/best over paired units, its paired CI and the one-sided p.

    Args:
        best, other: the two settings' values at the same units, in the same order (``(n,)``, ``n ≥ 1``).

    Returns ``{"n_units", "ratio", "ratio_ci95", "p"}``: ``ratio = exp(mean d)`` with ``d`` the per-unit
    log differences (:func:`log_differences`); ``ratio_ci95`` the exponentiated 95 % Student-t interval
    on ``mean d``; ``p`` the one-sided paired t-test of ``mean d > 0`` (``scipy.stats.ttest_1samp`` on
    ``d``). With one unit there is no test: ``ratio_ci95`` and ``p`` are ``None``. When every unit has the
    same ``d`` (zero variance) the interval is the point and ``p`` is 0 for ``d > 0``, 1 otherwise (the t
    statistic's limit). Raises ``ValueError`` as :func:`log_differences` does, or on no unit.
    """
    d = log_differences(best, other)
    n = d.size
    if n == 0:
        raise ValueError("a paired comparison needs at least one shared unit")
    mean = float(np.mean(d))
    ratio = float(np.exp(mean))
    if n < 2:
        return {"n_units": 1, "ratio": ratio, "ratio_ci95": None, "p": None}
    if np.ptp(d) == 0:
        return {"n_units": n, "ratio": ratio, "ratio_ci95": [ratio, ratio], "p": 0.0 if mean > 0 else 1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # near-constant differences: a huge t, as it should be
        ci = stats.ttest_1samp(d, 0.0).confidence_interval(CONFIDENCE)  # ttest_rel on the logs: the same test
        p = stats.ttest_1samp(d, 0.0, alternative="greater").pvalue
    return {"n_units": n, "ratio": ratio, "ratio_ci95": [float(np.exp(ci.low)), float(np.exp(ci.high))],
            "p": float(p)}


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (Holm 1979), in the input order.

    With the ``m`` p-values sorted ascending, ``p_(1) ≤ … ≤ p_(m)``, the adjusted value of ``p_(i)`` is
    ``min(1, max_{j ≤ i} (m − j + 1) p_(j))``; a hypothesis is rejected at family-wise level α when its
    adjusted value is ≤ α. ``None`` (no test possible) counts in ``m`` as p = 1 and stays ``None``.
    Ties keep the input order.
    """
    m = len(pvalues)
    p = np.array([1.0 if v is None else float(v) for v in pvalues], dtype=np.float64)
    order = np.argsort(p, kind="stable")
    adj = np.empty(m, dtype=np.float64)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adj[i] = running
    return [None if v is None else float(a) for v, a in zip(pvalues, adj)]


def mcnemar_exact(best: Sequence[bool], other: Sequence[bool], *, alternative: str = "greater") -> dict[str, Any]:
    """McNemar's exact test on paired binary trials (e.g. passkey exact match per trial).

    Args:
        best, other: per-trial success (``bool``), the same trials in the same order.
        alternative: ``"greater"`` tests "``best`` succeeds where ``other`` fails more often than the
            reverse" (other is worse); ``"two-sided"`` tests any difference.

    Only discordant trials carry information: with ``b`` = trials only ``best`` passed and ``c`` = trials
    only ``other`` passed, ``p`` is ``scipy.stats.binomtest(b, b + c, 0.5, alternative)``; 1 when no trial
    is discordant. Returns ``{"n_trials", "best_only", "other_only", "p"}``. Raises ``ValueError`` on
    different lengths.
    """
    a, o = np.asarray(best, dtype=bool), np.asarray(other, dtype=bool)
    if a.shape != o.shape or a.ndim != 1:
        raise ValueError(f"paired trials need two 1-d arrays of one length, got shapes {a.shape} and {o.shape}")
    b, c = int(np.sum(a & ~o)), int(np.sum(~a & o))
    p = 1.0 if b + c == 0 else float(stats.binomtest(b, b + c, 0.5, alternative=alternative).pvalue)
    return {"n_trials": int(a.size), "best_only": b, "other_only": c, "p": p}


def rank_intervals(logs: Any, *, n_boot: int = BOOTSTRAP,
                   seed: int = BOOTSTRAP_SEED) -> tuple[list[list[int]], list[float]]:
    """Rank intervals and probability of ranking first by a paired cluster bootstrap.

    Args:
        logs: ``(settings, units)`` float array of log damage (lower is better).
        n_boot: resamples; each draws ``units`` unit indices with replacement (PCG64 seeded by ``seed``)
            and applies the same draw to every setting, so what the units share cancels.

    In each resample a setting's rank is 1 + the number of settings with a strictly lower mean (equal
    means share the better rank). Returns ``(intervals, p_best)`` in the row order: ``[lo, hi]`` the
    2.5 % and 97.5 % quantiles of its ranks (observed ranks,
    ``inverted_cdf``), and the fraction of resamples where it ranks first.
    """
    x = np.asarray(logs, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"rank intervals need a (settings, units) array with units, got shape {x.shape}")
    s, n = x.shape
    rng = np.random.Generator(np.random.PCG64(seed))
    idx = rng.integers(0, n, size=(n_boot, n))
    means = x[:, idx].mean(axis=2)  # (settings, n_boot)
    ranks = 1 + (means[None, :, :] < means[:, None, :]).sum(axis=1)  # (settings, n_boot)
    tail = (1.0 - CONFIDENCE) / 2
    lo = np.quantile(ranks, tail, axis=1, method="inverted_cdf")
    hi = np.quantile(ranks, 1.0 - tail, axis=1, method="inverted_cdf")
    return [[int(a), int(b)] for a, b in zip(lo, hi)], [float(v) for v in np.mean(ranks == 1, axis=1)]


def budget_verdict(candidates: Mapping[Hashable, Mapping[Hashable, float]], *, n_boot: int = BOOTSTRAP,
                   seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """The first screen's answer at one budget: the best candidate and who it is separated from.

    Args:
        candidates: setting key (e.g. ``(method, setting)``) → (unit id → damage > 0); one entry per
            method, its best setting within the budget. The mapping's order breaks exact ties.
        n_boot, seed: of :func:`rank_intervals`.

    On the units every candidate shares (:func:`shared_units`) the best has the lowest mean log damage.
    Every other candidate is compared with it by :func:`paired_ratio` (ratio other/best, one-sided p),
    the p-values Holm-adjusted over the row (:func:`holm`); a candidate is *tied* with the best when its
    adjusted p is above :data:`ALPHA` or undefined (one unit), and only then.

    Returns ``{"best", "n_units", "units", "rank_interval", "p_best", "comparisons": [{"key", "n_units",
    "ratio", "ratio_ci95", "p", "p_holm", "tied", "rank_interval", "p_best"}]}`` with the comparisons
    in ascending mean log damage. Raises ``ValueError`` when there is no candidate, no shared unit, or a
    shared value ≤ 0.
    """
    keys = list(candidates)
    if not keys:
        raise ValueError("a budget verdict needs at least one candidate")
    units = shared_units(candidates)
    if not units:
        raise ValueError(f"the candidates {keys} share no unit with a finite value")
    x = aligned(candidates, units)
    if np.any(x <= 0):
        s, u = np.argwhere(x <= 0)[0]
        raise ValueError(f"the log scale needs positive damage: {keys[s]!r} has {x[s, u]!r} at unit {units[u]!r}")
    logs = np.log(x)
    order = sorted(range(len(keys)), key=lambda i: float(np.mean(logs[i])))  # stable: input order breaks ties
    best = order[0]
    comps = [paired_ratio(x[best], x[i]) for i in order[1:]]
    adjusted = holm([c["p"] for c in comps])
    intervals, p_best = rank_intervals(logs, n_boot=n_boot, seed=seed)
    return {"best": keys[best], "n_units": len(units), "units": units, "rank_interval": intervals[best],
            "p_best": p_best[best],
            "comparisons": [{"key": keys[i], **c, "p_holm": ph, "tied": ph is None or ph > ALPHA,
                             "rank_interval": intervals[i], "p_best": p_best[i]}
                            for i, c, ph in zip(order[1:], comps, adjusted)]}


def compare_gate(base: Mapping[Hashable, float], new: Mapping[Hashable, float]) -> dict[str, Any]:
    """Is NEW worse than BASE beyond the paired CI? One cell's damage scored per unit on both sides.

    Args:
        base, new: unit id → damage ≥ 0 (lower is better); compared on the units both have (finite).

    Returns ``{"n_units", "ratio", "ratio_ci95", "worse", "exact_lost"}``: ``ratio`` = geometric-mean
    NEW/BASE with its paired interval (:func:`paired_ratio`); ``worse`` is ``True`` when the interval lies
    wholly above 1, ``None`` when there is no interval (one unit: the caller's threshold decides alone).
    Exact zeros: a unit exact in BASE (0) and not in NEW is a loss of exactness, listed in
    ``exact_lost``; then ``ratio`` is ``inf`` and ``worse`` ``True``. Units exact in NEW only cannot make
    NEW worse and are left out of the test (``ratio`` 0 when no unit is left). Raises ``ValueError`` when
    no unit is shared or a value is negative.
    """
    units = shared_units({"base": base, "new": new})
    if not units:
        raise ValueError("BASE and NEW share no unit with a finite value")
    b = np.array([float(base[u]) for u in units], dtype=np.float64)
    w = np.array([float(new[u]) for u in units], dtype=np.float64)
    if np.any(b < 0) or np.any(w < 0):
        raise ValueError("damage values must be ≥ 0")
    lost = [u for u, x, y in zip(units, b, w) if x == 0 < y]
    if lost:
        return {"n_units": len(units), "ratio": float("inf"), "ratio_ci95": None, "worse": True, "exact_lost": lost}
    keep = ~((w == 0) & (b > 0))
    if not np.any(keep):
        return {"n_units": 0, "ratio": 0.0, "ratio_ci95": None, "worse": False, "exact_lost": []}
    r = paired_ratio(b[keep], w[keep])
    worse = None if r["ratio_ci95"] is None else r["ratio_ci95"][0] > 1.0
    return {"n_units": r["n_units"], "ratio": r["ratio"], "ratio_ci95": r["ratio_ci95"], "worse": worse,
            "exact_lost": []}


def paired_ranking(per_setting: Mapping[Hashable, Mapping[Hashable, float]], *, ratio_scale: bool,
                   better: str = "lower") -> dict[str, Any]:
    """A ranking table by the paired rule (docs/METRICS.md, "A ranking table"): every pair tested.

    Args:
        per_setting: setting key → (unit id → value); its order breaks exact ties.
        ratio_scale: log scale (:func:`kvqbench.metrics.is_ratio_scale`); a pair with a value ≤ 0 goes raw.
        better: ``lower``, ``higher`` (badness −value, −log) or ``zero`` (badness ``|value|``, raw).

    Settings are listed by mean (log) badness over their own units, then mean raw badness. Each pair is
    tested one-sided, "the later one is worse", on the shared units (``scipy.stats.ttest_1samp`` on the
    badness differences = ``ttest_rel``; zero variance: p = 0 for a difference > 0, else 1), Holm over
    the pairs (:func:`holm`); separated when the adjusted p ≤ :data:`ALPHA`. ``rank`` = 1 + the settings
    above that are separated from it, never below the rank above; ``ties`` = those not separated. On a
    ratio-scale lower-is-better metric a setting 0 at every shared unit (exact: the fp16 control) is not
    tested: separated from the rest, tied with the other exact ones. Returns ``{"n_units", "no_verdict",
    "rows": [{"key", "rank", "ties"}]}`` best first; with < 2 shared units ``no_verdict`` says why and
    every ``rank`` is ``None``.
    """
    keys, sign, ratio_scale = list(per_setting), -1.0 if better == "higher" else 1.0, ratio_scale and better != "zero"

    def badness(v: np.ndarray, log: bool) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.abs(v) if better == "zero" else sign * (np.log(np.where(v > 0, v, 0.0)) if log else v)

    own = [np.array([float(v) for v in per_setting[k].values() if v is not None and np.isfinite(v)]) for k in keys]
    order = sorted(range(len(keys)), key=lambda i: (float(np.mean(badness(own[i], ratio_scale))), float(np.mean(
        badness(own[i], False))), i) if own[i].size else (math.inf, math.inf, i))
    units = shared_units(per_setting)
    if len(units) < 2:
        return {"n_units": len(units), "no_verdict": f"{'one' if units else 'no'} shared unit: no paired test",
                "rows": [{"key": keys[i], "rank": None, "ties": []} for i in order]}
    x = aligned(per_setting, units)[order]
    log = ratio_scale & np.all(x > 0, axis=1)
    exact = np.all(x == 0, axis=1) & (ratio_scale and better == "lower")  # damage 0 by construction: not a sample
    pairs = [(a, b) for b in range(len(order)) for a in range(b) if not (exact[a] or exact[b])]  # a listed above b
    d = np.array([badness(x[b], log[a] & log[b]) - badness(x[a], log[a] & log[b]) for a, b in pairs]).reshape(-1, len(units))
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # near-constant differences: a huge t, p ≈ 0, as it should be
        p = stats.ttest_1samp(d, 0.0, axis=1, alternative="greater").pvalue if pairs else np.zeros(0)
    p = np.where(np.ptp(d, axis=1) == 0, np.where(d[:, 0] > 0, 0.0, 1.0), p)
    separated = {pr for pr, ph in zip(pairs, holm([float(v) for v in p])) if ph <= ALPHA}
    separated |= {(a, b) for b in range(len(order)) for a in range(b) if exact[a] != exact[b]}
    rows: list[dict[str, Any]] = []
    for b, i in enumerate(order):
        rank = max([1 + sum((a, b) in separated for a in range(b))] + [r["rank"] for r in rows[-1:]])
        rows.append({"key": keys[i], "rank": rank, "ties": [keys[order[o]] for o in range(len(order))
                                                             if o != b and (min(o, b), max(o, b)) not in separated]})
    return {"n_units": len(units), "no_verdict": None, "rows": rows}
