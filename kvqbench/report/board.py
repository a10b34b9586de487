"""The leaderboard document assembled from cell records: the one module that knows every statistics
module (docs/INTERNALS.md). Torch-free.

:func:`assemble` gives the document the result files hold (``leaderboard.json``) and every renderer reads;
:func:`summary_of` its compact form (``summary.json``).
"""

from __future__ import annotations

from typing import Any

from kvqbench.report.stats.aggregate import CELL_STATES, aggregate, setting_cells
from kvqbench.report.stats.headline import choose_headline, headline_budget
from kvqbench.report.stats.longdecode import summarize as summarize_long
from kvqbench.report.stats.models import model_sources, predictivity_transfer, rank_table
from kvqbench.report.stats.paired import PAIRED_TEST
from kvqbench.report.stats.predictivity import predictivity
from kvqbench.report.stats.quality import data_quality
from kvqbench.report.stats.ranking import pareto, pareto_metric, rankings

__all__ = ["assemble", "compare_models", "summary_of"]


def assemble(records: list[dict[str, Any]], catalog: dict[str, dict], provenance: dict[str, Any]) -> dict[str, Any]:
    """Build the leaderboard document from every record of a session.

    Returns ``{"provenance", "metrics_catalog", "methods", "sources": {source: {stats, rankings,
    pareto, matched_budget, data_quality, cells: {passed, failed, skipped}, failures, data, predictivity,
    long_decode, headline}}, "headline", "paired_test", "models"}`` (``long_decode``:
    :func:`kvqbench.report.stats.longdecode.summarize`; ``headline``: :mod:`kvqbench.report.stats.headline`,
    its budget rows compared by the rule ``paired_test`` names (:data:`kvqbench.report.stats.paired.PAIRED_TEST`);
    ``models``: :func:`compare_models`).
    """
    stats = aggregate(records)
    methods: dict[str, Any] = {}
    for r in records:
        info = r.get("method_info")
        if info and r["method"] not in methods:
            methods[r["method"]] = {k: v for k, v in info.items() if k != "params"}
    sources: dict[str, Any] = {}
    for src in sorted({r["source"] for r in records}):
        recs = [r for r in records if r["source"] == src]
        st = stats.get(src, {})
        front, matched = pareto(st)
        sources[src] = {
            "sizes": sorted({r.get("size") for r in recs if r.get("size")}),
            "data": next((r.get("data") for r in recs if r.get("data")), None),
            "seeds": sorted({r["seed"] for r in recs}),
            "cells": {s: sum(1 for r in recs if r.get("status") == s) for s in CELL_STATES},
            "setting_cells": setting_cells(recs),
            "failures": [{"nodeid": r["nodeid"], "error": r.get("error", "")} for r in recs if r.get("status") == "failed"],
            "stats": st,
            "rankings": rankings(st, catalog),
            "pareto": front,
            "matched_budget": matched,
            "pareto_decode_kl": pareto_metric(st),  # pseudo-decode KL against the bits a cache really holds
            "data_quality": data_quality(recs),
            "predictivity": predictivity(st, catalog),
            "long_decode": summarize_long(recs),
        }
    headline = choose_headline(sources, catalog)
    for src in sources.values():
        src["headline"] = headline_budget(src["stats"], headline, catalog)
    return {"provenance": provenance, "metrics_catalog": catalog, "methods": methods, "sources": sources,
            "headline": headline, "paired_test": dict(PAIRED_TEST), "models": compare_models(sources, catalog)}


def compare_models(sources: dict[str, Any], catalog: dict[str, dict]) -> dict[str, Any] | None:
    """Two models side by side (:mod:`kvqbench.report.stats.models`): each method's end-to-end KL rank on both
    with their rank correlation, and the headline metric's predictivity out of sample, both ways; ``None``
    unless two real sources ran the end-to-end experiment."""
    pair = model_sources(sources)
    if len(pair) < 2:
        return None
    return {"sources": pair,
            "rank_table": rank_table({m: sources[s]["stats"] for m, s in pair.items()}),
            "transfer": predictivity_transfer({m: {"stats": sources[s]["stats"],
                                                   "predictivity": sources[s].get("predictivity")}
                                               for m, s in pair.items()}, catalog)}


def summary_of(board: dict[str, Any]) -> dict[str, Any]:
    """The compact ``summary.json``: rankings, data-quality flags, Pareto, matched budget, method
    fidelity and provenance (no per-seed values)."""
    return {
        "provenance": board["provenance"],
        "headline": board.get("headline"),
        "paired_test": board.get("paired_test"),
        "methods": {m: {"fidelity": i.get("fidelity"), "deltas": i.get("deltas", []), "arxiv": i.get("arxiv")}
                    for m, i in board["methods"].items()},
        "sources": {
            s: {"rankings": d["rankings"], "data_quality": d["data_quality"], "pareto": d["pareto"]["front"],
                "matched_budget": d["matched_budget"], "cells": d["cells"], "failures": d["failures"],
                "headline": d.get("headline"), "predictivity": d.get("predictivity")}
            for s, d in board["sources"].items()
        },
    }
