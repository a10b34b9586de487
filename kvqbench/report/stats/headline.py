"""The first screen's answer to "which method at my budget?" (docs/DESIGN.md §5). Torch-free.

Two rules, both functions of one source's (one model's) statistics:

- **The headline tensor metric** is a declared default, :data:`HEADLINE_DEFAULT`. Another scale-free
  metric replaces it only when its Spearman ρ with the end-to-end KL beats the default's by more than
  the bootstrap: the paired percentile-bootstrap 95 % CI of ρ(other) − ρ(default), both computed on the
  same resampled methods, lies wholly above 0 (:func:`headline_rule`). The bootstrap is seeded
  (PCG64, :data:`~kvqbench.report.stats.predictivity.PREDICTIVITY_SEED`) and ρ is computed on ranks, whose sums
  are exact in float64, so the choice is the same on every machine; a metric that ties the default to
  float noise never takes over.
- **The best method at each matched budget** (:func:`headline_budget`) is ranked on measured damage
  where there is some, else on the headline tensor metric, by the paired rule of
  :func:`~kvqbench.report.stats.ranking.paired_at_budgets` on the units the settings share (:func:`unit_of`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvqbench.cells import BUDGETS, is_plain_setting, setting_order, source_kind
from kvqbench.metrics import experiment_of, rank_key
from kvqbench.report.stats.intervals import is_short
from kvqbench.report.stats.longdecode import EXPERIMENT as LONG_EXPERIMENT
from kvqbench.report.stats.longdecode import long_decode_points
from kvqbench.report.stats.predictivity import (
    PREDICTIVITY_BOOTSTRAP,
    PREDICTIVITY_MIN_METHODS,
    PREDICTIVITY_SEED,
    PREDICTIVITY_TARGETS,
    percentile_ci95,
    resampled_rho,
    spearman_rows,
    target_rows,
)
from kvqbench.report.stats.ranking import budget_point, paired_at_budgets

__all__ = ["HEADLINE_DEFAULT", "FALLBACK_METRIC", "headline_rule", "choose_headline", "headline_budget",
           "paired_rho_difference", "E2E_BITS", "unit_of"]


#: the declared default headline metric: attention's next-token distribution error, what the model's
#: attention sees (scale-free)
HEADLINE_DEFAULT: dict[str, str] = {"metric": "static_attn_kl_fwd_nats",
                                    "experiment": experiment_of("static_attn_kl_fwd_nats")}
#: the headline metric when no end-to-end run says which tensor metric predicts damage
FALLBACK_METRIC: dict[str, str] = {"metric": "rel_mse", "experiment": experiment_of("rel_mse")}
#: the bits an end-to-end prefill cell billed per element, beside its KL
E2E_BITS = "e2e_prefill_bits_billed"


def unit_of(metric: str) -> str:
    """What a metric's settings share and are paired on: ``"window"`` for the end-to-end experiment (each
    seed scores another text window), ``"text"`` for the long decode (each seed decodes another text),
    ``"seed"`` for every other experiment (the seed draws the data or the method's randomness)."""
    exp = experiment_of(metric)
    return "window" if exp == experiment_of(PREDICTIVITY_TARGETS[0]) else "text" if exp == LONG_EXPERIMENT else "seed"


def paired_rho_difference(x_default: Any, x_other: Any, y: Any, *, n_boot: int = PREDICTIVITY_BOOTSTRAP,
                          seed: int = PREDICTIVITY_SEED) -> tuple[float | None, list[float] | None]:
    """ρ(other) − ρ(default) against ``y`` and its paired percentile-bootstrap 95 % CI over methods.

    Args:
        x_default, x_other, y: ``(methods, settings)`` arrays of floats (badness of each metric, the target).
        n_boot, seed: resamples and PCG64 seed; each resample draws methods with replacement and keeps
            all their settings, the same draw for both metrics (so what they share cancels).

    Returns ``(difference, [lo, hi])``; ``(None, None)`` when a ρ is undefined (a constant side), the CI
    ``None`` when fewer than half the resamples define both ρ.
    """
    xd, xo, yy = (np.asarray(a, dtype=float) for a in (x_default, x_other, y))
    full = spearman_rows(np.stack([xd.ravel(), xo.ravel()]), np.stack([yy.ravel(), yy.ravel()]))
    if not np.all(np.isfinite(full)):
        return None, None
    rd, ro = resampled_rho([xd, xo], yy, n_boot, seed)
    return float(full[1] - full[0]), percentile_ci95(ro - rd, n_boot)


def _matrices(stats_src: dict[str, Any], catalog: dict[str, dict], a: tuple[str, str], b: tuple[str, str],
              settings: list[str], target: str) -> tuple[list, list, list] | None:
    """The badness of metrics ``a`` and ``b`` (``(experiment, name)``) and the target, ``(methods,
    settings)``, over the methods that have all three, unshort, at every setting; ``None`` below 4."""
    e2e_exp = experiment_of(target)
    e2e = stats_src.get(e2e_exp) or {}

    def entry(exp: str, m: str, s: str, name: str) -> dict | None:
        e = (stats_src.get(exp) or {}).get(m, {}).get(s, {}).get(name)
        return None if e is None or is_short(e) else e

    methods = sorted(m for m in e2e if all(
        entry(e2e_exp, m, s, target) is not None and entry(e2e_exp, m, s, target)["mean"] != 0
        and entry(a[0], m, s, a[1]) is not None and entry(b[0], m, s, b[1]) is not None for s in settings))
    if len(methods) < PREDICTIVITY_MIN_METHODS:
        return None

    def bad(exp: str, name: str) -> list[list[float]]:
        better = (catalog.get(name) or {}).get("better", "lower")
        return [[rank_key(better, entry(exp, m, s, name)["mean"]) for s in settings] for m in methods]

    return bad(*a), bad(*b), [[entry(e2e_exp, m, s, target)["mean"] for s in settings] for m in methods]


def headline_rule(stats_src: dict[str, Any], predictivity_src: dict[str, Any] | None, catalog: dict[str, dict], *,
                  default: dict[str, str] = HEADLINE_DEFAULT) -> dict[str, Any] | None:
    """Apply the headline rule (module docstring) to one source's statistics and predictivity.

    Returns ``None`` when the source has no predictivity for the first target; else ``{"metric",
    "experiment", "rho", "ci95", "group", "target", "default", "default_measured", "replaced_default",
    "challenger"}``: the group is ``pooled`` (within-bit-width where one bit width ran); ``challenger`` is the
    candidate with the largest lower bound of the paired difference (``{metric, experiment, rho,
    diff, diff_ci95}``, ``None`` when there is none). When the default was not measured on this source,
    the candidate with the highest ρ is the headline (``default_measured: False``).
    """
    target = PREDICTIVITY_TARGETS[0]
    pred = predictivity_src or {}
    group, rows = target_rows(pred, target)
    rows = [r for r in rows if r["rho"] is not None and (catalog.get(r["metric"]) or {}).get("scale_free", True)]
    if not rows:
        return None
    base = {"group": group, "target": target, "default": default["metric"], "n_boot": pred.get("n_boot"),
            "seed": pred.get("seed")}
    dflt = next((r for r in rows if r["metric"] == default["metric"]), None)
    if dflt is None:
        top = rows[0]  # predictivity lists rows best first (ρ to 12 decimals, then name)
        return {**base, "metric": top["metric"], "experiment": top["experiment"], "rho": top["rho"], "ci95": top["ci95"],
                "default_measured": False, "replaced_default": True, "challenger": None}
    by_group = pred["targets"][target]
    settings = sorted((pred.get("pooled_settings") or [s for s in by_group if s != "pooled"])
                      if group == "pooled" else [group], key=setting_order)
    n_boot, seed = pred.get("n_boot") or PREDICTIVITY_BOOTSTRAP, pred.get("seed", PREDICTIVITY_SEED)
    challengers = []
    for r in rows:
        if r is dflt:
            continue
        mats = _matrices(stats_src, catalog, (dflt["experiment"], dflt["metric"]), (r["experiment"], r["metric"]),
                         settings, target)
        if mats is None:
            continue
        diff, ci = paired_rho_difference(*mats, n_boot=n_boot, seed=seed)
        if diff is None:
            continue
        challengers.append({"metric": r["metric"], "experiment": r["experiment"], "rho": r["rho"], "ci95": r["ci95"],
                            "diff": diff, "diff_ci95": ci})
    # the strongest challenger: the largest lower bound of its paired difference (then ρ, then name)
    challengers.sort(key=lambda c: (-(c["diff_ci95"][0] if c["diff_ci95"] else -math.inf),
                                    -round(c["rho"], 12), c["metric"]))
    best = challengers[0] if challengers else None
    wins = best is not None and best["diff_ci95"] is not None and best["diff_ci95"][0] > 0
    pick = best if wins else dflt
    return {**base, "metric": pick["metric"], "experiment": pick["experiment"], "rho": pick["rho"], "ci95": pick["ci95"],
            "default_measured": True, "replaced_default": wins, "default_rho": dflt["rho"], "default_ci95": dflt["ci95"],
            "challenger": best}


def choose_headline(sources: dict[str, Any], catalog: dict[str, dict] | None = None) -> dict[str, Any]:
    """The leaderboard's headline metric: :func:`headline_rule` on the first source (``real`` first, then
    by name) that has a predictivity table, with ``source`` and ``from_predictivity: True``; the declared
    fallback ``rel_mse`` (``from_predictivity: False``) when none has."""
    catalog = catalog or {}
    for src_name in sorted(sources, key=lambda s: (s != "real", source_kind(s) != "real", s)):
        src = sources[src_name]
        h = headline_rule(src.get("stats") or {}, src.get("predictivity"), catalog)
        if h is not None:
            return {**h, "source": src_name, "from_predictivity": True}
    return {**FALLBACK_METRIC, "rho": None, "ci95": None, "group": None, "target": PREDICTIVITY_TARGETS[0],
            "source": None, "from_predictivity": False, "default": HEADLINE_DEFAULT["metric"]}


def _bits_of(stats_src: dict[str, Any], m: str, s: str, metric: str) -> float | None:
    """Bits/element a (method, setting) is billed at: the end-to-end cell's own bill where it has one, else
    exp1's effective bits — for a pseudo-decode metric (``decode_*``) the bits a decoding cache bills
    (``decode_bits_effective``)."""
    e = (stats_src.get(experiment_of(E2E_BITS)) or {}).get(m, {}).get(s, {}).get(E2E_BITS)
    if e is not None and metric.startswith("e2e_"):
        return e["mean"]
    name = "decode_bits_effective" if metric.startswith("decode_") else "bits_effective"
    b = (stats_src.get(experiment_of(name)) or {}).get(m, {}).get(s, {}).get(name)
    return b["mean"] if b is not None else None


def headline_budget(stats_src: dict[str, Any], headline: dict[str, Any],
                    catalog: dict[str, dict]) -> list[dict[str, Any]]:
    """The best method at each matched bits/element budget (:data:`kvqbench.cells.BUDGETS`) of one source,
    and every other method's best setting compared with it on the units they share.

    Ranked on the end-to-end target (``headline["target"]``, e.g. ``e2e_prefill_kl_nats``) where this
    source has it, else on the headline tensor metric (its better-direction), else — a long tier's results
    alone — on the long-decode KL ``long_kl_nats`` at the bits billed at T. Exact (16-bit) settings, variant
    settings and short entries are not budget points; the fp16 control bills 16 bits and fits no budget.

    Returns one row per budget, the fields of :func:`~kvqbench.report.stats.ranking.paired_at_budgets`
    plus ``"criterion"``, ``"unit"``
    (:func:`unit_of`), ``"quality"``, ``"quality_ci95"`` (the headline tensor metric of the best's
    setting, ``None`` where not measured), ``"e2e_kl"``, ``"e2e_kl_ci95"`` and, where the source ran the
    long decode, ``"long_kl"``, ``"long_kl_ci95"``, ``"long_bits_billed"`` (bits billed at T).
    """
    metric, exp, target = headline["metric"], headline["experiment"], headline.get("target", PREDICTIVITY_TARGETS[0])
    e2e, long = stats_src.get(experiment_of(target)) or {}, stats_src.get(LONG_EXPERIMENT) or {}
    has_e2e = any(target in e for by in e2e.values() for s, e in by.items() if is_plain_setting(s))
    has_metric = any(metric in e for by in (stats_src.get(exp) or {}).values() for e in by.values())
    has_long = any("long_kl_nats" in e for by in long.values() for s, e in by.items() if is_plain_setting(s))
    # measured damage first: the end-to-end KL; else the headline tensor metric; a long tier alone ranks on its KL
    crit = target if has_e2e else "long_kl_nats" if has_long and not has_metric else metric
    better = "lower" if has_e2e or crit == "long_kl_nats" else (catalog.get(metric) or {}).get("better", "lower")
    if crit == "long_kl_nats":
        pts = long_decode_points(long)
    else:
        by_exp = stats_src.get(exp if crit == metric else experiment_of(crit)) or {}
        pts = [p for m, by in by_exp.items() for s, ms in by.items()
               if (p := budget_point(m, s, ms.get(crit), _bits_of(stats_src, m, s, crit))) is not None]
    rows = paired_at_budgets(pts, BUDGETS, better=better)
    for r in rows:
        q = (stats_src.get(exp) or {}).get(r["method"], {}).get(r["setting"], {}).get(metric) if r["method"] else None
        k = e2e.get(r["method"], {}).get(r["setting"], {}).get(target) if r["method"] else None
        r.update(criterion=crit, unit=unit_of(crit), quality=q["mean"] if q else None,
                 quality_ci95=q["ci95"] if q else None, e2e_kl=k["mean"] if k else None,
                 e2e_kl_ci95=k["ci95"] if k else None)
        if long:  # the long-decode KL of the same (method, setting), with the bits billed at T
            by = long.get(r["method"], {}).get(r["setting"], {}) if r["method"] else {}
            r.update(long_kl=(by.get("long_kl_nats") or {}).get("mean"),
                     long_kl_ci95=(by.get("long_kl_nats") or {}).get("ci95"),
                     long_bits_billed=(by.get("long_bits_billed") or {}).get("mean"))
    return rows
