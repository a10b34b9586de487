"""Cell records grouped by setting and aggregated over seeds (docs/DESIGN.md §5). Torch-free.

A *record* is the dict a benchmark cell writes (see :mod:`kvqbench.plugin`): identity (experiment,
method, bits, seed, source, size, variant), ``status``, ``metrics`` (name → float), ``per_layer``
(name → list), ``series``/``extra`` detail, ``method_info`` and ``data`` provenance.

Each (source, experiment, method, bits, variant) *setting* aggregates its seeds into mean ± 95 %
Student-t half-width (:func:`kvqbench.report.stats.intervals.mean_ci`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

from kvqbench.cells import parse_nodeid, setting_tag
from kvqbench.report.stats.intervals import mean_ci

__all__ = ["setting_key", "aggregate", "seeds_asked", "setting_cells", "CELL_STATES"]

#: the states a cell is counted in
CELL_STATES = ("passed", "failed", "skipped")


def setting_key(rec: dict[str, Any]) -> str:
    """``"k2v2"`` plus any variant axes by name, e.g. ``"k2v2-group_size64"`` (:func:`kvqbench.cells.setting_tag`)."""
    return setting_tag(rec["k_bits"], rec["v_bits"], sorted((rec.get("variant") or {}).items()))


def aggregate(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Group passed records by source → experiment → method → setting and aggregate over seeds.

    Returns ``stats[source][experiment][method][setting][metric] = {mean, ci95, n, n_asked, seeds, values,
    worst_layer, worst_layer_index}``; ``n`` counts the seeds with a finite value, ``n_asked`` the seeds
    the experiment was run with (:func:`seeds_asked`). An entry with ``n < n_asked`` is *short* (a seed
    failed or gave a non-finite value): it is listed, marked, but not ranked and not a Pareto or
    matched-budget point.
    """
    records = list(records)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    asked = seeds_asked(records)
    for r in records:
        if r.get("status") != "passed":
            continue
        groups[(r["source"], r["experiment"], r["method"], setting_key(r))].append(r)
    stats: dict[str, Any] = {}
    for (src, exp, meth, setting), recs in sorted(groups.items()):
        recs = sorted(recs, key=lambda r: r["seed"])
        names = sorted(set().union(*(r.get("metrics", {}) for r in recs)))
        out: dict[str, Any] = {}
        for name in names:
            vals = [float(r["metrics"][name]) for r in recs if name in r.get("metrics", {})]
            vals = [v for v in vals if math.isfinite(v)]
            if not vals:
                continue
            m, ci = mean_ci(vals)
            entry: dict[str, Any] = {
                "mean": m,
                "ci95": ci,
                "n": len(vals),
                "n_asked": max([asked.get((src, exp, _test_of(r)), 0) for r in recs if name in r.get("metrics", {})]
                               + [len(vals)]),
                "seeds": [r["seed"] for r in recs if name in r.get("metrics", {})],
                "values": vals,
            }
            layers = [lst for r in recs if (lst := r.get("per_layer", {}).get(name))]
            if layers and len(layers[0]) > 1 and all(len(x) == len(layers[0]) for x in layers):
                per = [math.fsum(col) / len(col) for col in zip(*layers)]
                entry["per_layer_mean"] = per
                entry["worst_layer_index"] = max(range(len(per)), key=lambda i: per[i])
                entry["worst_layer"] = per[entry["worst_layer_index"]]
            out[name] = entry
        stats.setdefault(src, {}).setdefault(exp, {}).setdefault(meth, {})[setting] = out
    return stats


def _test_of(r: dict[str, Any]) -> str:
    """The test function that produced a record (its node id without the parameters)."""
    return parse_nodeid(str(r.get("nodeid", ""))).base


def seeds_asked(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str], int]:
    """``(source, experiment, test function)`` → how many seeds its cells were asked for: the distinct
    seeds among its records whatever their status (a failed seed was still asked for). Keyed by test
    function because one experiment may run some tests on every seed and others on one."""
    seen: dict[tuple[str, str, str], set] = defaultdict(set)
    for r in records:
        seen[(r["source"], r["experiment"], _test_of(r))].add(r["seed"])
    return {k: len(v) for k, v in seen.items()}


def setting_cells(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """``experiment → method → setting → {"passed", "failed", "skipped"}`` cell counts of one source, so a
    missing value can be told apart: failed, skipped, or (absent here) not run."""
    out: dict[str, Any] = {}
    for r in records:
        st = r.get("status")
        if st not in CELL_STATES:
            continue
        c = out.setdefault(r["experiment"], {}).setdefault(r["method"], {}).setdefault(
            setting_key(r), dict.fromkeys(CELL_STATES, 0))
        c[st] += 1
    return out
