"""Which tensor metrics predict model damage (docs/DESIGN.md §4): Spearman ρ across methods between each
tensor metric and the measured damage, with a seeded bootstrap over methods. Torch-free."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
from scipy.stats import rankdata, spearmanr

from kvqbench.cells import is_plain_setting, setting_order
from kvqbench.metrics import experiment_of, rank_key
from kvqbench.report.stats.intervals import is_short

__all__ = ["PREDICTIVITY_TARGETS", "PREDICTIVITY_EXPERIMENTS", "PREDICTIVITY_BOOTSTRAP", "PREDICTIVITY_SEED",
           "PREDICTIVITY_MIN_METHODS", "predictivity", "spearman", "spearman_rows", "resampled_rho", "percentile_ci95",
           "target_rows"]


#: the model-damage quantities tensor metrics are correlated with, each from the experiment the catalog
#: names (the first is the headline target): the short-window KL of exp5, the long-decode KL and the
#: passkey log-probability drop of exp6
PREDICTIVITY_TARGETS: tuple[str, ...] = ("e2e_prefill_kl_nats", "e2e_decode_kl_nats", "long_kl_nats",
                                         "passkey_logp_drop_nats")

#: experiments whose scalar metrics are candidates: the tensor experiments (reconstruction, accumulation,
#: outliers)
PREDICTIVITY_EXPERIMENTS: tuple[str, ...] = tuple(experiment_of(m) for m in ("k_mse", "static_out_rel_mse",
                                                                           "offdiag_mass"))

PREDICTIVITY_BOOTSTRAP = 2000

PREDICTIVITY_SEED = 0

#: the fewest methods a predictivity group ranks (Spearman ρ across fewer says nothing)
PREDICTIVITY_MIN_METHODS = 4


def spearman_rows(x: Any, y: Any) -> Any:
    """Spearman ρ of each row pair of ``x``/``y`` ``(rows, n)``: the Pearson correlation of their
    average ranks (``scipy.stats.rankdata``; the definition ``scipy.stats.spearmanr`` uses). A row with a
    constant side → NaN."""
    rx = rankdata(np.asarray(x, dtype=float), axis=-1)
    ry = rankdata(np.asarray(y, dtype=float), axis=-1)
    rx = rx - rx.mean(-1, keepdims=True)
    ry = ry - ry.mean(-1, keepdims=True)
    den = np.sqrt((rx * rx).sum(-1) * (ry * ry).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (rx * ry).sum(-1) / np.where(den > 0, den, 1.0), np.nan)


def resampled_rho(xs: list[Any], y: Any, n_boot: int, seed: int) -> Any:
    """ρ of each of ``xs`` with ``y`` (``(methods, settings)`` arrays of floats) on ``n_boot`` resamples
    of the methods: each draws methods with replacement (PCG64 ``seed``) and keeps all their settings, the
    same draw for every ``x``. Returns ``(len(xs), n_boot)``, NaN where a resample leaves a side constant."""
    y = np.asarray(y, dtype=float)
    n = y.shape[0]
    idx = np.random.Generator(np.random.PCG64(seed)).integers(0, n, size=(n_boot, n))
    yb = y[idx].reshape(n_boot, -1)
    return np.stack([spearman_rows(np.asarray(x, dtype=float)[idx].reshape(n_boot, -1), yb) for x in xs])


def percentile_ci95(samples: Any, n_boot: int) -> list[float] | None:
    """The percentile 95 % CI ``[lo, hi]`` of the finite ``samples``; ``None`` when fewer than half of
    the ``n_boot`` resamples are finite."""
    finite = samples[np.isfinite(samples)]
    if finite.size < n_boot // 2:
        return None
    lo, hi = np.percentile(finite, [2.5, 97.5])
    return [float(lo), float(hi)]


def spearman(x: Any, y: Any) -> tuple[float | None, float | None]:
    """``scipy.stats.spearmanr`` of the 1-d ``x``, ``y`` as ``(rho, pvalue)``; ``(None, None)`` when ρ is
    undefined (a constant side)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # constant input: ρ is NaN, reported as None
        res = spearmanr(x, y)
    rho = float(res.statistic)
    return (rho, float(res.pvalue)) if math.isfinite(rho) else (None, None)


def target_rows(predictivity_src: dict[str, Any] | None, target: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(group, rows)`` of one target's table that the report reads: its ``pooled`` group where it has
    one, else its first; ``(None, [])`` without a table."""
    by_group = ((predictivity_src or {}).get("targets") or {}).get(target) or {}
    group = "pooled" if "pooled" in by_group else next(iter(by_group), None)
    return group, by_group[group] if group else []


def predictivity(stats_src: dict[str, Any], catalog: dict[str, dict], *, n_boot: int = PREDICTIVITY_BOOTSTRAP,
                 seed: int = PREDICTIVITY_SEED) -> dict[str, Any] | None:
    """Spearman ρ between every scalar tensor metric of exp1–exp3 and each model-damage target
    (:data:`PREDICTIVITY_TARGETS`: the end-to-end KL of exp5, the long-decode KL and the passkey
    log-probability drop of exp6), across methods, within each bit width and pooled over the bit widths
    that at least 4 methods ran (``pooled_settings``), with a bootstrap 95 % CI over methods.

    A point is one (method, setting) that has both the metric and the target (means over seeds); variant
    settings are left out, and so are exact points (target exactly 0: the fp16 control, 16-bit
    settings), which every error metric ranks trivially, and short entries (fewer seeds than asked,
    :func:`is_short`), which are not ranked anywhere. Metrics are taken as *badness* (lower = better:
    ``higher`` metrics negated, ``zero`` metrics by magnitude), so ρ > 0 means "more tensor error, more
    model damage"; bits/element metrics are budgets, not errors, and are left out. A group needs at least
    4 methods. Returns ``None`` without exp5 and exp6; else ``{"targets": {target: {group: [rows best first]}},
    "groups", "pooled_settings", "n_boot", "seed", "excluded"}``, a row being ``{metric, experiment, rho, ci95, n_methods,
    n_points}`` (``rho`` ``None`` when undefined).
    """
    def target_exp(target: str) -> str:
        return (catalog.get(target) or {}).get("experiment") or experiment_of(target)

    if not any(stats_src.get(target_exp(t)) for t in PREDICTIVITY_TARGETS):
        return None
    out: dict[str, Any] = {"targets": {}, "n_boot": n_boot, "seed": seed,
                           "excluded": "exact points (target exactly 0: fp16 control, 16-bit settings), "
                                       "variant settings, bits/element metrics, settings with failed seeds"}
    candidates = sorted({(exp, name) for exp in PREDICTIVITY_EXPERIMENTS for by in stats_src.get(exp, {}).values()
                         for metrics in by.values() for name in metrics
                         if name in catalog and catalog[name].get("experiment") == exp
                         and catalog[name].get("unit") != "bits/element"})
    for target in PREDICTIVITY_TARGETS:
        e2e = stats_src.get(target_exp(target)) or {}
        pts = {(m, s): e[target]["mean"] for m, by in e2e.items() for s, e in by.items()
               if is_plain_setting(s) and target in e and e[target]["mean"] != 0 and not is_short(e[target])}
        if not pts:
            continue
        settings = sorted({s for _, s in pts}, key=setting_order)
        # pooled over the settings that enough methods ran (a width run for a few methods only, such as
        # exp5's 8 bits, would otherwise leave only those methods in the pooled group)
        pooled = [s for s in settings if sum(1 for _, s2 in pts if s2 == s) >= PREDICTIVITY_MIN_METHODS]
        groups = [(s, [s]) for s in settings] + ([("pooled", pooled)] if len(pooled) > 1 else [])
        by_group: dict[str, list[dict[str, Any]]] = {}
        for gname, gset in groups:
            rows = []
            for exp, name in candidates:
                better = catalog[name]["better"]
                methods = sorted(m for m in {m for m, _ in pts}
                                 if all((m, s) in pts and name in stats_src[exp].get(m, {}).get(s, {})
                                        and not is_short(stats_src[exp][m][s][name]) for s in gset))
                if len(methods) < PREDICTIVITY_MIN_METHODS:
                    continue
                xs = [[rank_key(better, stats_src[exp][m][s][name]["mean"]) for s in gset] for m in methods]
                ys = [[pts[(m, s)] for s in gset] for m in methods]
                rho, _ = spearman(np.ravel(xs), np.ravel(ys))  # CI: bootstrap over methods
                ci = None if rho is None else percentile_ci95(resampled_rho([xs], ys, n_boot, seed)[0], n_boot)
                rows.append({"metric": name, "experiment": exp, "rho": rho, "ci95": ci,
                             "n_methods": len(methods), "n_points": len(methods) * len(gset)})
            # best first; ρ compared to 12 decimals so float noise (0.9999999999999999) does not order ties
            rows.sort(key=lambda r: (r["rho"] is None, -round(r["rho"] or 0.0, 12), r["metric"]))
            if rows:
                by_group[gname] = rows
        out["targets"][target] = by_group
        out.setdefault("pooled_settings", pooled if len(pooled) > 1 else [])
    groups_seen = {g for by_group in out["targets"].values() for g in by_group}
    out["groups"] = sorted(groups_seen - {"pooled"}, key=setting_order) + (["pooled"] if "pooled" in groups_seen else [])
    return out
