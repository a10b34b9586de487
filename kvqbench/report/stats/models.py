"""Two models side by side (docs/DESIGN.md §5): does a method's end-to-end rank, and the choice of headline
tensor metric, carry over from one model to another? Torch-free. Each model's statistics are one
source's ``stats`` (:func:`kvqbench.report.stats.aggregate.aggregate`), keyed by model name."""

from __future__ import annotations

from typing import Any

from scipy.stats import rankdata

from kvqbench.cells import source_kind
from kvqbench.metrics import experiment_of
from kvqbench.report.stats.headline import headline_rule
from kvqbench.report.stats.intervals import is_short
from kvqbench.report.stats.predictivity import PREDICTIVITY_TARGETS, spearman, target_rows

__all__ = ["MODEL_SETTINGS", "model_sources", "kl_points", "rank_table", "predictivity_transfer"]

#: the bit widths the per-model rank table compares
MODEL_SETTINGS: tuple[str, ...] = ("k2v2", "k4v4")
_END_TO_END = experiment_of(PREDICTIVITY_TARGETS[0])


def model_sources(sources: dict[str, Any]) -> dict[str, str]:
    """``{model name: source name}`` of the first two real sources with an end-to-end run (``real`` first):
    the two models :func:`kvqbench.report.board.compare_models` sets side by side."""
    out: dict[str, str] = {}
    for name in sorted(sources, key=lambda s: (s != "real", s)):
        src = sources[name]
        if source_kind(name) == "real" and src.get("stats", {}).get(_END_TO_END) and len(out) < 2:
            out[(src.get("data") or {}).get("model") or name] = name
    return out


def _two(stats_by_model: dict[str, Any]) -> list[str]:
    names = list(stats_by_model)
    if len(names) != 2:
        raise ValueError(f"a comparison of models takes exactly two result sets, got {len(names)}: {names}")
    return names


def kl_points(stats_src: dict[str, Any], *, target: str = PREDICTIVITY_TARGETS[0]) -> dict[tuple[str, str], dict]:
    """One model's end-to-end KL per (method, setting): ``{(method, setting): {mean, ci95}}``, leaving out
    exact points (KL exactly 0: the fp16 control, 16-bit settings) and short entries (fewer seeds than asked)."""
    by_method = stats_src.get(experiment_of(target)) or {}
    return {(m, s): {"mean": e["mean"], "ci95": e["ci95"]} for m, by in by_method.items() for s, ms in by.items()
            if (e := ms.get(target)) is not None and e["mean"] != 0 and not is_short(e)}


def rank_table(stats_by_model: dict[str, Any], *, target: str = PREDICTIVITY_TARGETS[0]) -> dict[str, Any]:
    """Each method's end-to-end KL rank on each of two models at each setting of :data:`MODEL_SETTINGS`, and
    the rank correlation between the models.

    Args:
        stats_by_model: ``{model name: stats of its real source}``, exactly two.
        target: the end-to-end metric (lower is better).

    Ranks are among the methods that have a non-exact value on that model at that setting (1 = lowest
    KL; equal values share their mean rank, ``scipy.stats.rankdata``). ρ is ``scipy.stats.spearmanr`` of
    the two models' KL over the methods that have both (``None`` below 3 methods or with a constant side).

    Returns ``{"models", "settings", "target", "rows": [{method, <model>: {setting: {kl, ci95, rank}}}],
    "rho": {setting: {rho, pvalue, n_methods}}}``; rows in order of the first model's mean rank.

    Raises:
        ValueError: not exactly two models.
    """
    names = _two(stats_by_model)
    pts = {n: kl_points(stats_by_model[n], target=target) for n in names}
    methods = sorted({m for n in names for m, _ in pts[n]})
    rows: dict[str, dict[str, Any]] = {m: {"method": m, **{n: {} for n in names}} for m in methods}
    rho: dict[str, Any] = {}
    settings = MODEL_SETTINGS
    for s in settings:
        for n in names:
            ms = sorted(m for m in methods if (m, s) in pts[n])
            ranks = rankdata([pts[n][(m, s)]["mean"] for m in ms]) if ms else []
            for m, r in zip(ms, ranks, strict=True):
                rows[m][n][s] = {"kl": pts[n][(m, s)]["mean"], "ci95": pts[n][(m, s)]["ci95"], "rank": float(r)}
        both = sorted(m for m in methods if all((m, s) in pts[n] for n in names))
        value, p = (spearman([pts[names[0]][(m, s)]["mean"] for m in both],
                             [pts[names[1]][(m, s)]["mean"] for m in both]) if len(both) >= 3 else (None, None))
        rho[s] = {"rho": value, "pvalue": p, "n_methods": len(both)}

    def order(m: str) -> tuple:
        ranks = [rows[m][names[0]].get(s, {}).get("rank") for s in settings]
        got = [r for r in ranks if r is not None]
        return (not got, sum(got) / len(got) if got else 0.0, m)

    return {"models": names, "settings": list(settings), "target": target,
            "rows": [rows[m] for m in sorted(methods, key=order)], "rho": rho}


def predictivity_transfer(models: dict[str, dict[str, Any]], catalog: dict[str, dict]) -> dict[str, Any]:
    """Predictivity out of sample: the headline metric chosen on one model, its ρ (with CI) on the other,
    both ways, and how stably every metric predicts damage across the two.

    Args:
        models: ``{model name: {"stats": stats of its real source, "predictivity": its predictivity}}``,
            exactly two.
        catalog: the metrics catalog.

    The choice on model A is :func:`kvqbench.report.stats.headline.headline_rule` on A. It *transfers* to B when
    the same rule on B, with A's choice as the declared default, keeps it (no metric predicts B's damage
    better by more than the paired bootstrap). Returns ``{"models", "directions": [{from, to, metric,
    experiment, rho_from, ci_from, rho_to, ci_to, transfers, best_on_to}], "metrics": [{metric, experiment,
    <model>: {rho, ci95}}], "metric_order_rho"}``: ``metrics`` holds every metric ranked on both (in order
    of the lower of its two CI lower bounds, best first), ``metric_order_rho`` the Spearman ρ between the
    two models' ρ over those metrics (does the ordering of metrics carry over; ``None`` below 3).

    Raises:
        ValueError: not exactly two models.
    """
    names = _two(models)
    target = PREDICTIVITY_TARGETS[0]
    chosen = {n: headline_rule(models[n]["stats"], models[n].get("predictivity"), catalog) for n in names}
    by = {n: {r["metric"]: r for r in target_rows(models[n].get("predictivity"), target)[1]} for n in names}
    directions = []
    for a, b in (names, names[::-1]):
        h = chosen[a]
        if h is None:
            directions.append({"from": a, "to": b, "metric": None})
            continue
        on_b = by[b].get(h["metric"]) or {}
        kept = headline_rule(models[b]["stats"], models[b].get("predictivity"), catalog,
                             default={"metric": h["metric"], "experiment": h["experiment"]})
        directions.append({"from": a, "to": b, "metric": h["metric"], "experiment": h["experiment"],
                           "rho_from": h["rho"], "ci_from": h["ci95"], "rho_to": on_b.get("rho"), "ci_to": on_b.get("ci95"),
                           "transfers": bool(kept and kept["default_measured"] and not kept["replaced_default"]),
                           "best_on_to": kept["metric"] if kept else None})
    common = sorted(m for m in by[names[0]] if m in by[names[1]] and all(by[n][m]["rho"] is not None for n in names)
                    and (catalog.get(m) or {}).get("scale_free", True))

    def low(m: str) -> float:
        return min((by[n][m]["ci95"] or [by[n][m]["rho"]])[0] for n in names)

    metrics = [{"metric": m, "experiment": by[names[0]][m]["experiment"],
                **{n: {"rho": by[n][m]["rho"], "ci95": by[n][m]["ci95"]} for n in names}}
               for m in sorted(common, key=lambda m: (-round(low(m), 12), m))]
    order_rho = (spearman([by[names[0]][m]["rho"] for m in common], [by[names[1]][m]["rho"] for m in common])[0]
                 if len(common) >= 3 else None)
    return {"models": names, "target": target, "directions": directions, "metrics": metrics,
            "metric_order_rho": order_rho}
