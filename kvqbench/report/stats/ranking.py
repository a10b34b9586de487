"""Rankings, Pareto fronts and the best method at matched bits budgets (docs/DESIGN.md §5). Torch-free.

Rankings order methods by mean in each metric's better-direction and mark methods whose 95 % CIs overlap
as ties (:func:`kvqbench.report.stats.intervals.interval`); the detail tables of exp1 and exp2 budgets do
too (:func:`best_at_budgets`). The first screen compares settings on the units they share instead
(:func:`paired_at_budgets`, the rule of :mod:`kvqbench.report.stats.paired`). A budget point is a plain
setting (no variant axes) with every seed it was asked for.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from kvqbench.cells import BUDGETS, is_plain_setting, setting_order
from kvqbench.metrics import experiment_of, rank_key
from kvqbench.report.stats.intervals import interval, is_short
from kvqbench.report.stats.paired import budget_verdict

__all__ = ["rankings", "pareto", "matched_budget", "pareto_metric", "best_at_budgets", "paired_at_budgets",
           "PARETO_QUALITY", "PARETO_BITS"]

#: quality metric and bits metric of the Pareto front and the matched-budget selector
PARETO_QUALITY = "rel_mse"
PARETO_BITS = "bits_effective"


def rankings(stats_src: dict[str, Any], catalog: dict[str, dict]) -> dict[str, Any]:
    """Per metric, per setting: every method that ran, best first.

    Returns ``{metric: {"better", "unit", "by_setting": {setting: [{method, mean, ci95, n, rank,
    ties}]}}}``. Methods are listed best mean first; ``rank`` = 1 + the number of methods that are
    *significantly* better (their whole 95% CI lies on the better side of this method's CI; with one
    seed, a strictly better value), raised where needed so it never decreases down the list (a method
    with a very wide CI shares its better neighbour's rank instead of rank 1). Methods that cannot be
    told apart share a rank and ties do not chain; ``ties`` lists every method whose CI overlaps this
    one's. Metrics not in ``catalog`` are not ranked. A method whose entry is short (fewer seeds than
    asked, :func:`is_short`) is listed last with ``rank: None``, ``short: true`` and ``n_asked``.
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
        spec = catalog[name]
        better = spec["better"]
        by_setting = {}
        for setting in sorted(table[name], key=setting_order):
            rows = sorted(table[name][setting], key=lambda me: (rank_key(better, me[1]["mean"]), me[0]))
            short = [(m, e) for m, e in rows if is_short(e)]
            rows = [(m, e) for m, e in rows if not is_short(e)]
            ivs = {m: interval(e, better) for m, e in rows}
            ranked = []
            for m, e in rows:
                lo, hi = ivs[m]
                ties = [m2 for m2, _ in rows if m2 != m and not (ivs[m2][1] < lo or ivs[m2][0] > hi)]
                rank = 1 + sum(1 for m2, _ in rows if ivs[m2][1] < lo)
                if ranked:  # listed by mean: a rank never goes down the list (a wide CI shares its
                    rank = max(rank, ranked[-1]["rank"])  # neighbour's rank, not rank 1)
                ranked.append({"method": m, "mean": e["mean"], "ci95": e["ci95"], "n": e["n"],
                               "rank": rank, "ties": ties,
                               **({"worst_layer": e["worst_layer"]} if "worst_layer" in e else {})})
            for m, e in short:  # fewer seeds than asked: listed after the ranked methods, never ranked
                ranked.append({"method": m, "mean": e["mean"], "ci95": e["ci95"], "n": e["n"],
                               "n_asked": e["n_asked"], "rank": None, "ties": [], "short": True})
            by_setting[setting] = ranked
        out[name] = {"better": better, "unit": spec["unit"], "experiment": spec["experiment"],
                     "by_setting": by_setting}
    return out


def _quality_front(stats_src: dict[str, Any], budgets: tuple[float, ...] = BUDGETS) -> dict[str, Any]:
    return pareto_metric(stats_src, quality=PARETO_QUALITY, bits=PARETO_BITS, budgets=budgets)


def pareto(stats_src: dict[str, Any]) -> dict[str, Any]:
    """Every exp1 (method, bits) point as (effective bits/element, relative MSE) and the non-dominated
    front (no other point has both fewer-or-equal bits and lower-or-equal error, one strictly).
    The generic rule is :func:`pareto_metric`; this names the fields after the metrics."""
    gen = _quality_front(stats_src)
    bits_nominal = {(m, s): e.get("bits_nominal", {}).get("mean")
                    for m, by in stats_src.get(experiment_of(PARETO_QUALITY), {}).items() for s, e in by.items()}

    def named(p: dict[str, Any]) -> dict[str, Any]:
        return {"method": p["method"], "setting": p["setting"], "bits_effective": p["bits"],
                PARETO_QUALITY: p["quality"]}

    pts = [{**named(p), "bits_nominal": bits_nominal.get((p["method"], p["setting"])), "ci95": p["ci95"],
            "on_front": p["on_front"]} for p in gen["points"]]
    return {"quality": PARETO_QUALITY, "bits": PARETO_BITS, "points": pts, "front": [named(p) for p in gen["front"]]}


def matched_budget(stats_src: dict[str, Any], budgets: tuple[float, ...] = BUDGETS) -> list[dict[str, Any]]:
    """The best (lowest relative MSE) exp1 (method, bits) at each effective-bits budget ``≤ b``, with the
    methods whose 95% CI overlaps it (``ties``, :func:`best_at_budgets`)."""
    return [{"budget": m["budget"], "method": m["method"], "setting": m["setting"], "bits_effective": m["bits"],
             PARETO_QUALITY: m["quality"], "ties": m["ties"], "runner_up": m["runner_up"]}
            for m in _quality_front(stats_src, budgets)["matched_budget"]]


def pareto_metric(stats_src: dict[str, Any], *, quality: str = "decode_attn_kl_fwd_nats",
                  bits: str = "decode_bits_effective", budgets: tuple[float, ...] = BUDGETS) -> dict[str, Any]:
    """Pareto front and matched-budget selector for any (quality, bits) pair of one experiment (the
    quality metric's, :func:`kvqbench.metrics.experiment_of`), e.g. the
    pseudo-decode attention KL against the bits a cache really holds (fp16 windows billed at 16 bits).

    Same rules as :func:`pareto` / :func:`matched_budget` (lower quality is better; variant settings are
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
                        "quality": metrics[quality]["mean"], "ci95": metrics[quality]["ci95"]})
    pts.sort(key=lambda p: (p["bits"], p["quality"], p["method"]))
    front = []
    for p in pts:
        p["on_front"] = not any(
            q is not p and q["bits"] <= p["bits"] and q["quality"] <= p["quality"]
            and (q["bits"] < p["bits"] or q["quality"] < p["quality"]) for q in pts)
        if p["on_front"]:
            front.append({k: p[k] for k in ("method", "setting", "bits", "quality")})
    matched = [{"budget": r["budget"], "method": r["method"], "setting": r["setting"], "bits": r["bits"],
                "quality": r["value"], "ties": r["ties"], "runner_up": r["runner_up"]}
               for r in best_at_budgets([{**p, "mean": p["quality"]} for p in pts], budgets)]
    return {"experiment": experiment, "quality": quality, "bits": bits, "points": pts, "front": front,
            "matched_budget": matched}


def best_at_budgets(points: list[dict[str, Any]], budgets: tuple[float, ...] = BUDGETS, *, better: str = "lower",
                    floor: float = 0.0) -> list[dict[str, Any]]:
    """The best point at each bits budget ``≤ b`` and the methods tied with it.

    Args:
        points: ``{method, setting, bits, mean, ci95}`` (``ci95`` ``None`` for one seed).
        budgets: bits/element budgets.
        better: the direction of ``mean`` (``lower``, ``higher``, ``zero``).
        floor: a noise floor in the units of ``mean``: intervals are widened by it (0: the 95% CIs alone).

    Each method is represented by its best point within the budget (ties broken by fewer bits). The best
    has the best mean (then fewer bits, then name); every other method whose interval ``mean ± (ci95 +
    floor)`` overlaps the best's is a tie (the overlap rule of :func:`rankings`). Returns per budget
    ``{"budget", "method", "setting", "bits", "value", "ci95", "ties": [{method, setting, bits, value,
    ci95}] (best mean first), "runner_up"}`` (the second method, tied or not; ``method`` ``None`` when no
    point fits).
    """
    out = []
    for b in budgets:
        own: dict[str, dict[str, Any]] = {}
        for p in sorted((p for p in points if p["bits"] <= b + 1e-9),
                        key=lambda p: (rank_key(better, p["mean"]), p["bits"], p["method"], p["setting"])):
            own.setdefault(p["method"], p)
        ranked = sorted(own.values(), key=lambda p: (rank_key(better, p["mean"]), p["bits"], p["method"]))
        if not ranked:
            out.append({"budget": b, "method": None, "setting": None, "bits": None, "value": None, "ci95": None,
                        "ties": [], "runner_up": None})
            continue

        def iv(p: dict[str, Any]) -> tuple[float, float]:
            lo, hi = interval({"mean": p["mean"], "ci95": (p["ci95"] or 0.0) + floor}, better)
            return lo, hi

        top = ranked[0]
        lo, hi = iv(top)
        ties = [{"method": p["method"], "setting": p["setting"], "bits": p["bits"], "value": p["mean"], "ci95": p["ci95"]}
                for p in ranked[1:] if not (iv(p)[0] > hi or iv(p)[1] < lo)]
        out.append({"budget": b, "method": top["method"], "setting": top["setting"], "bits": top["bits"],
                    "value": top["mean"], "ci95": top["ci95"], "ties": ties,
                    "runner_up": ranked[1]["method"] if len(ranked) > 1 else None})
    return out


def _mean_log(units: dict[Any, float]) -> float:
    """Mean log damage over a point's units (``-inf`` where a value is ≤ 0: such a point sorts first and
    its verdict says why it has none)."""
    vals = list(units.values())
    return math.fsum(math.log(v) if v > 0 else -math.inf for v in vals) / len(vals) if vals else math.inf


def paired_at_budgets(points: list[dict[str, Any]], budgets: tuple[float, ...] = BUDGETS, *,
                      better: str = "lower") -> list[dict[str, Any]]:
    """The best point at each bits budget ``≤ b`` by the paired rule (:func:`~kvqbench.report.stats.paired.budget_verdict`).

    Args:
        points: ``{method, setting, bits, mean, ci95, units: {unit id: value}}``, one per setting (the
            unit ids are what every setting was scored on: seeds, text windows, texts).
        budgets: bits/element budgets.
        better: the direction of the values: ``lower`` (damage) or ``zero`` (damage = ``|value|``);
            ``higher`` has no ratio scale and gives no verdict.

    Each method is represented by its point within the budget with the lowest mean log damage over its
    units (then fewer bits, then setting); the best is the representative with the lowest mean log damage
    and every other is compared with it unit by unit, one-sided, Holm over the row. Returns per budget
    ``{"budget", "method", "setting", "bits", "value", "ci95", "n_units", "rank_interval", "p_best",
    "comparisons": [{method, setting, bits, value, ci95, ratio, ratio_ci95, p, p_holm, tied, n_units,
    rank_interval, p_best}] (ascending mean log damage), "ties" (the comparisons with ``tied``),
    "runner_up" (the first comparison's method), "no_verdict"}``: ``value``/``ci95`` are the arithmetic
    mean ± 95 % half-width over units; ``no_verdict`` is ``None``, or the reason the row has no paired
    verdict (a value ≤ 0, no shared unit, a higher-is-better metric), in which case the best is the
    lowest mean log damage (then the lowest mean) and ``comparisons``/``ties`` are empty. ``method``
    ``None`` when no point fits.
    """
    def damage(p: dict[str, Any]) -> dict[Any, float]:
        return {u: abs(v) if better == "zero" else v for u, v in (p.get("units") or {}).items()}

    out = []
    for b in budgets:
        own: dict[str, dict[str, Any]] = {}
        for p in sorted((p for p in points if p["bits"] <= b + 1e-9),
                        key=lambda p: (_mean_log(damage(p)), rank_key(better, p["mean"]), p["bits"], p["method"],
                                       setting_order(p["setting"]))):
            own.setdefault(p["method"], p)
        ranked = sorted(own.values(), key=lambda p: (_mean_log(damage(p)), rank_key(better, p["mean"]), p["bits"],
                                                     p["method"]))
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
            v = budget_verdict({(p["method"], p["setting"]): damage(p) for p in ranked})
        except ValueError as e:
            out.append({**row, **entry(ranked[0]), "no_verdict": str(e)})
            continue
        by_key = {(p["method"], p["setting"]): p for p in ranked}
        comps = [{**entry(by_key[c["key"]]), **{k: c[k] for k in ("ratio", "ratio_ci95", "p", "p_holm", "tied",
                                                                  "n_units", "rank_interval", "p_best")}}
                 for c in v["comparisons"]]
        out.append({**row, **entry(by_key[v["best"]]), "n_units": v["n_units"], "rank_interval": v["rank_interval"],
                    "p_best": v["p_best"], "comparisons": comps, "ties": [c for c in comps if c["tied"]],
                    "runner_up": comps[0]["method"] if comps else None})
    return out
