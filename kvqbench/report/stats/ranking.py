"""Rankings, Pareto fronts and the best method at matched bits budgets (docs/DESIGN.md §5). Torch-free.

Every comparison pairs the settings on the units they share (seeds, text windows, texts) by the rule of
:mod:`kvqbench.report.stats.paired`."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from kvqbench.cells import BUDGETS, is_exact_setting, is_plain_setting, setting_order
from kvqbench.metrics import experiment_of, is_ratio_scale, rank_key
from kvqbench.report.stats.intervals import is_short, units_of
from kvqbench.report.stats.paired import budget_verdict, paired_ranking

__all__ = ["rankings", "pareto", "pareto_metric", "paired_at_budgets", "budget_point", "damage",
           "PARETO_QUALITY", "PARETO_BITS"]

#: quality metric and bits metric of the Pareto front and the matched-budget selector
PARETO_QUALITY = "rel_mse"
PARETO_BITS = "bits_effective"


def budget_point(method: str, setting: str, e: dict[str, Any] | None, bits: float | None) -> dict[str, Any] | None:
    """A point of :func:`paired_at_budgets` from stats entry ``e`` billed ``bits`` per element; ``None``
    where there is none: no entry or bits, a short entry, a variant or an exact (16-bit) setting."""
    if e is None or bits is None or is_short(e) or not is_plain_setting(setting) or is_exact_setting(setting):
        return None
    return {"method": method, "setting": setting, "bits": bits, "mean": e["mean"], "ci95": e["ci95"],
            "units": units_of(e)}


def damage(units: dict[Any, float], better: str) -> dict[Any, float]:
    """Values by unit as damage (lower is better): ``|value|`` where ``better`` is ``zero``."""
    return {u: abs(v) if better == "zero" else v for u, v in units.items()}


def rankings(stats_src: dict[str, Any], catalog: dict[str, dict]) -> dict[str, Any]:
    """Per metric in ``catalog``, per setting: every method that ran, best first, by the paired rule.

    Returns ``{metric: {"better", "unit", "experiment", "by_setting": {setting: [{method, mean, ci95, n,
    rank, ties}]}}}``: order, ``rank`` and ``ties`` of :func:`~kvqbench.report.stats.paired.paired_ranking`
    on the units (seeds, windows, texts) the methods share, log scale where the metric is ratio-scale
    (:func:`kvqbench.metrics.is_ratio_scale`); without a test (< 2 shared units) ``rank`` is ``None`` and
    ``no_verdict`` says why. A short entry (fewer seeds than asked, :func:`is_short`) is listed last with
    ``rank: None``, ``short: true`` and ``n_asked``.
    """
    table: dict[str, dict[str, list[tuple[str, dict]]]] = defaultdict(lambda: defaultdict(list))
    for by_method in stats_src.values():
        for meth, by_setting in by_method.items():
            for setting, metrics in by_setting.items():
                for name, entry in metrics.items():
                    if name in catalog:
                        table[name][setting].append((meth, entry))
    out: dict[str, Any] = {}
    for name in sorted(table):
        spec, by_setting = catalog[name], {}
        for setting in sorted(table[name], key=setting_order):
            entries = {m: e for m, e in sorted(table[name][setting]) if not is_short(e)}
            v = paired_ranking({m: units_of(e) for m, e in entries.items()}, ratio_scale=is_ratio_scale(name, spec),
                               better=spec["better"])
            by_setting[setting] = [
                {"method": r["key"], **{k: entries[r["key"]][k] for k in ("mean", "ci95", "n")}, "rank": r["rank"],
                 "ties": r["ties"], **({"no_verdict": v["no_verdict"]} if v["no_verdict"] else {}),
                 **{k: entries[r["key"]][k] for k in ("worst_layer",) if k in entries[r["key"]]}} for r in v["rows"]] + [
                {"method": m, **{k: e[k] for k in ("mean", "ci95", "n", "n_asked")}, "rank": None, "ties": [],
                 "short": True} for m, e in sorted(table[name][setting], key=lambda me: (rank_key(spec["better"], me[1]["mean"]), me[0]))
                if is_short(e)]  # fewer seeds than asked: listed after the ranked methods, never ranked
        out[name] = {"better": spec["better"], "unit": spec["unit"], "experiment": spec["experiment"],
                     "by_setting": by_setting}
    return out


def pareto(stats_src: dict[str, Any],
           budgets: tuple[float, ...] = BUDGETS) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """:func:`pareto_metric` of exp1's relative MSE against its effective bits, the fields named after the
    metrics: ``(pareto, matched_budget)``, every (method, bits) point as (effective bits/element, relative
    MSE) with the non-dominated front, and the best (lowest relative MSE) point at each effective-bits
    budget ``≤ b`` with every other method compared with it over the seeds (:func:`paired_at_budgets`)."""
    gen = pareto_metric(stats_src, quality=PARETO_QUALITY, bits=PARETO_BITS, budgets=budgets)
    bits_nominal = {(m, s): e.get("bits_nominal", {}).get("mean")
                    for m, by in stats_src.get(experiment_of(PARETO_QUALITY), {}).items() for s, e in by.items()}

    def named(p: dict[str, Any]) -> dict[str, Any]:
        return {"method": p["method"], "setting": p["setting"], "bits_effective": p["bits"],
                PARETO_QUALITY: p["quality"]}

    pts = [{**named(p), "bits_nominal": bits_nominal.get((p["method"], p["setting"])), "ci95": p["ci95"],
            "on_front": p["on_front"]} for p in gen["points"]]
    matched = [{**{k: v for k, v in m.items() if k not in ("bits", "quality")}, "bits_effective": m["bits"],
                PARETO_QUALITY: m["quality"]} for m in gen["matched_budget"]]
    return {"quality": PARETO_QUALITY, "bits": PARETO_BITS, "points": pts,
            "front": [named(p) for p in gen["front"]]}, matched


def pareto_metric(stats_src: dict[str, Any], *, quality: str = "decode_attn_kl_fwd_nats",
                  bits: str = "decode_bits_effective", budgets: tuple[float, ...] = BUDGETS) -> dict[str, Any]:
    """Pareto front and matched-budget selector for any (quality, bits) pair of one experiment (the
    quality metric's, :func:`kvqbench.metrics.experiment_of`), e.g. the
    pseudo-decode attention KL against the bits a cache really holds (fp16 windows billed at 16 bits).

    Same rules as :func:`pareto` (lower quality is better; variant settings are
    not budget points, nor are settings with fewer seeds than asked). Returns ``{"experiment", "quality", "bits", "points", "front", "matched_budget"}``.
    """
    experiment = experiment_of(quality)
    pts = []
    for meth, by_setting in stats_src.get(experiment, {}).items():
        for setting, metrics in by_setting.items():
            if not is_plain_setting(setting) or quality not in metrics or bits not in metrics:
                continue
            if is_short(metrics[quality]) or is_short(metrics[bits]):
                continue  # fewer seeds than asked: not a budget point (see aggregate)
            pts.append({"method": meth, "setting": setting, "bits": metrics[bits]["mean"],
                        "quality": metrics[quality]["mean"], "ci95": metrics[quality]["ci95"],
                        "units": units_of(metrics[quality])})
    pts.sort(key=lambda p: (p["bits"], p["quality"], p["method"]))
    front = []
    for p in pts:
        p["on_front"] = not any(
            q is not p and q["bits"] <= p["bits"] and q["quality"] <= p["quality"]
            and (q["bits"] < p["bits"] or q["quality"] < p["quality"]) for q in pts)
        if p["on_front"]:
            front.append({k: p[k] for k in ("method", "setting", "bits", "quality")})
    matched = [{**{k: v for k, v in r.items() if k != "value"}, "quality": r["value"]}
               for r in paired_at_budgets([{**p, "mean": p["quality"]} for p in pts], budgets)]
    return {"experiment": experiment, "quality": quality, "bits": bits,
            "points": [{k: v for k, v in p.items() if k != "units"} for p in pts], "front": front,
            "matched_budget": matched}


def _mean_log(units: dict[Any, float]) -> float:
    """Mean log damage over a point's units (``-inf`` where a value is ≤ 0: such a point sorts first and
    its verdict says why it has none)."""
    vals = list(units.values())
    return math.fsum(math.log(v) if v > 0 else -math.inf for v in vals) / len(vals) if vals else math.inf


def paired_at_budgets(points: list[dict[str, Any]], budgets: tuple[float, ...] = BUDGETS, *,
                      better: str = "lower") -> list[dict[str, Any]]:
    """The best point at each bits budget ``≤ b`` by the paired rule (:func:`~kvqbench.report.stats.paired.budget_verdict`).

    Args:
        points: ``{method, setting, bits, mean, ci95, units: {unit id: value}}``, one per setting (units:
            what every setting was scored on — seeds, text windows, texts).
        budgets: bits/element budgets.
        better: ``lower`` (damage) or ``zero`` (damage = ``|value|``); ``higher`` gives no verdict.

    Each method is represented by its point within the budget with the lowest mean log damage (then fewer
    bits, then setting); the best representative is compared with every other unit by unit. Returns per
    budget ``{"budget", "method", "setting", "bits", "value", "ci95", "n_units", "rank_interval", "p_best",
    "comparisons": [{method, setting, bits, value, ci95, ratio, ratio_ci95, p, p_holm, tied, n_units,
    rank_interval, p_best}] (ascending mean log damage), "ties" (those ``tied``), "runner_up", "no_verdict"}``
    (``value``/``ci95``: mean ± 95 % half-width over units). ``no_verdict`` is ``None`` or why the row has
    no paired verdict: a value ≤ 0, no shared unit, a higher-is-better metric (then no comparisons), or one
    shared unit (comparisons with ratios, no ties). ``method`` ``None`` when no point fits.
    """
    out = []
    for b in budgets:
        own: dict[str, dict[str, Any]] = {}
        for p in sorted((p for p in points if p["bits"] <= b + 1e-9),
                        key=lambda p: (_mean_log(damage(p["units"], better)), rank_key(better, p["mean"]), p["bits"],
                                       p["method"], setting_order(p["setting"]))):
            own.setdefault(p["method"], p)
        ranked = sorted(own.values(), key=lambda p: (_mean_log(damage(p["units"], better)), rank_key(better, p["mean"]),
                                                     p["bits"], p["method"]))
        row: dict[str, Any] = {"budget": b, "method": None, "setting": None, "bits": None, "value": None, "ci95": None,
                               "n_units": None, "rank_interval": None, "p_best": None, "comparisons": [], "ties": [],
                               "runner_up": None, "no_verdict": None}
        if not ranked:
            out.append(row)
            continue

        def entry(p: dict[str, Any]) -> dict[str, Any]:
            return {"method": p["method"], "setting": p["setting"], "bits": p["bits"], "value": p["mean"],
                    "ci95": p["ci95"]}

        try:
            if better == "higher":
                raise ValueError("a higher-is-better metric has no damage ratio")
            v = budget_verdict({(p["method"], p["setting"]): damage(p["units"], better) for p in ranked})
        except ValueError as e:
            out.append({**row, **entry(ranked[0]), "no_verdict": str(e)})
            continue
        by_key = {(p["method"], p["setting"]): p for p in ranked}
        comps = [{**entry(by_key[c["key"]]), **{k: c[k] for k in ("ratio", "ratio_ci95", "p", "p_holm", "tied",
                                                                  "n_units", "rank_interval", "p_best")}}
                 for c in v["comparisons"]]
        out.append({**row, **entry(by_key[v["best"]]), "n_units": v["n_units"], "rank_interval": v["rank_interval"],
                    "p_best": v["p_best"], "comparisons": comps,
                    "ties": [c for c in comps if c["tied"]] if v["n_units"] > 1 else [],
                    "runner_up": comps[0]["method"] if comps else None,
                    "no_verdict": None if v["n_units"] > 1 or not comps else "one shared unit: no paired test"})
    return out
