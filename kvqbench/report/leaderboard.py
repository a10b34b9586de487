"""Assemble cell records into statistics, rankings, Pareto fronts, matched-budget tables and
data-quality flags (SPEC §5). Torch-free: works from saved JSON.

A *record* is the dict a benchmark cell writes (see :mod:`kvqbench.plugin`): identity (experiment,
method, bits, seed, source, size, variant), ``status``, ``metrics`` (name → float), ``per_layer``
(name → list), ``series``/``extra`` detail, ``method_info`` and ``data`` provenance.

Multi-seed: each (source, experiment, method, bits, variant) *setting* aggregates its seeds into
mean ± 95% Student-t confidence half-width; rankings order methods by mean in each metric's
better-direction and mark methods whose CIs overlap as ties.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Iterable

from kvqbench.metrics import rank_key

__all__ = [
    "setting_key",
    "aggregate",
    "rankings",
    "pareto",
    "matched_budget",
    "data_quality",
    "DATA_QUALITY_CHECKS",
    "assemble",
    "BUDGETS",
    "mean_ci",
    "seeds_asked",
    "is_short",
    "setting_cells",
]

BUDGETS: tuple[float, ...] = (2.25, 2.5, 3.0, 4.25, 8.25)
#: quality metric and bits metric of the Pareto front and the matched-budget selector
PARETO_QUALITY = "rel_mse"
PARETO_BITS = "bits_effective"
EXACT_TOL = 0.0


def mean_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float | None]:
    """Mean and Student-t half-width of the ``confidence`` interval (``None`` for one value)."""
    n = len(values)
    m = math.fsum(values) / n
    if n < 2:
        return m, None
    if max(values) == min(values):  # identical seeds (deterministic method on fixed data): exactly 0
        return values[0], 0.0
    var = math.fsum((v - m) ** 2 for v in values) / (n - 1)
    from scipy.stats import t as student_t

    return m, float(student_t.ppf(0.5 + confidence / 2, n - 1) * math.sqrt(var / n))


def _variant_tag(variant: dict[str, Any]) -> str:
    return "".join(f"-{k}{v}" for k, v in sorted(variant.items()))


def setting_key(rec: dict[str, Any]) -> str:
    """``"k2v2"`` plus any variant axes, e.g. ``"k2v2-group_size64"``."""
    return f"k{rec['k_bits']}v{rec['v_bits']}" + _variant_tag(rec.get("variant") or {})


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
            layers = [r.get("per_layer", {}).get(name) for r in recs]
            layers = [lst for lst in layers if lst]
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
    return str(r.get("nodeid", "")).split("[", 1)[0]


def seeds_asked(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str], int]:
    """``(source, experiment, test function)`` → how many seeds its cells were asked for: the distinct
    seeds among its records whatever their status (a failed seed was still asked for). Keyed by test
    function because one experiment may run some tests on every seed and others on one."""
    seen: dict[tuple[str, str, str], set] = defaultdict(set)
    for r in records:
        seen[(r["source"], r["experiment"], _test_of(r))].add(r["seed"])
    return {k: len(v) for k, v in seen.items()}


def is_short(entry: dict[str, Any]) -> bool:
    """Whether a stats entry has fewer seeds than asked (see :func:`aggregate`)."""
    return entry.get("n", 0) < entry.get("n_asked", 0)


def setting_cells(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """``experiment → method → setting → {"passed", "failed", "skipped"}`` cell counts of one source, so a
    missing value can be told apart: failed, skipped, or (absent here) not run."""
    out: dict[str, Any] = {}
    for r in records:
        st = r.get("status")
        if st not in ("passed", "failed", "skipped"):
            continue
        c = out.setdefault(r["experiment"], {}).setdefault(r["method"], {}).setdefault(
            setting_key(r), {"passed": 0, "failed": 0, "skipped": 0})
        c[st] += 1
    return out


def _interval(entry: dict[str, Any], better: str) -> tuple[float, float]:
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
        for setting in sorted(table[name], key=_setting_sort):
            rows = sorted(table[name][setting], key=lambda me: (rank_key(better, me[1]["mean"]), me[0]))
            short = [(m, e) for m, e in rows if is_short(e)]
            rows = [(m, e) for m, e in rows if not is_short(e)]
            ivs = {m: _interval(e, better) for m, e in rows}
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


def _setting_sort(setting: str) -> tuple:
    import re

    nums = [int(x) for x in re.findall(r"\d+", setting)]
    return (nums, setting)


def _exp1_front(stats_src: dict[str, Any], budgets: tuple[float, ...] = BUDGETS) -> dict[str, Any]:
    return pareto_metric(stats_src, experiment="exp1", quality=PARETO_QUALITY, bits=PARETO_BITS, budgets=budgets)


def pareto(stats_src: dict[str, Any]) -> dict[str, Any]:
    """Every exp1 (method, bits) point as (effective bits/element, relative MSE) and the non-dominated
    front (no other point has both fewer-or-equal bits and lower-or-equal error, one strictly).
    The generic rule is :func:`pareto_metric`; this names the fields after the metrics."""
    gen = _exp1_front(stats_src)
    bits_nominal = {(m, s): e.get("bits_nominal", {}).get("mean")
                    for m, by in stats_src.get("exp1", {}).items() for s, e in by.items()}

    def named(p: dict[str, Any]) -> dict[str, Any]:
        return {"method": p["method"], "setting": p["setting"], "bits_effective": p["bits"],
                PARETO_QUALITY: p["quality"]}

    pts = [{**named(p), "bits_nominal": bits_nominal.get((p["method"], p["setting"])), "ci95": p["ci95"],
            "on_front": p["on_front"]} for p in gen["points"]]
    return {"quality": PARETO_QUALITY, "bits": PARETO_BITS, "points": pts, "front": [named(p) for p in gen["front"]]}


def matched_budget(stats_src: dict[str, Any], budgets: tuple[float, ...] = BUDGETS) -> list[dict[str, Any]]:
    """The best (lowest relative MSE) exp1 (method, bits) at each effective-bits budget ``≤ b``."""
    return [{"budget": m["budget"], "method": m["method"], "setting": m["setting"], "bits_effective": m["bits"],
             PARETO_QUALITY: m["quality"], "runner_up": m["runner_up"]}
            for m in _exp1_front(stats_src, budgets)["matched_budget"]]


# ------------------------------------------------------------------------------------------------
# data-quality flags — sanity checks on the measurement, never a verdict on a method
def _flag(name: str, ok: bool | None, detail: str, offenders: list | None = None) -> dict[str, Any]:
    return {"name": name, "ok": ok, "detail": detail, "offenders": offenders or []}


def _check_fp16_exact(records: list[dict]) -> dict:
    cells = [r for r in records if r["method"] == "fp16" and r["experiment"] == "exp1" and r.get("status") == "passed"]
    if not cells:
        return _flag("fp16_roundtrip_exact", None, "fp16 control did not run")
    bad = [r["nodeid"] for r in cells if r["metrics"].get("k_mse", 0) != 0 or r["metrics"].get("v_mse", 0) != 0]
    return _flag("fp16_roundtrip_exact", not bad, "fp16 control reconstructs K and V with MSE 0", bad)


def _check_exact_at_16(records: list[dict]) -> dict:
    cells = [r for r in records if r["experiment"] == "exp1" and r.get("status") == "passed"
             and r["k_bits"] >= 16 and r["v_bits"] >= 16 and not r.get("variant")]
    if not cells:
        return _flag("exact_at_16_bits", None, "no 16-bit cells ran")
    bad = [r["nodeid"] for r in cells if r["metrics"].get("k_mse", 0) != 0 or r["metrics"].get("v_mse", 0) != 0]
    return _flag("exact_at_16_bits", not bad, "every method is an exact passthrough at 16 bits", bad)


def _check_monotone(records: list[dict]) -> dict:
    by: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r["experiment"] != "exp1" or r.get("status") != "passed" or r.get("variant") or r["k_bits"] != r["v_bits"]:
            continue
        for kv in ("k", "v"):
            if f"{kv}_mse" in r["metrics"]:
                by[(r["source"], r["method"], kv, r["seed"])][r["k_bits"]].append(r["metrics"][f"{kv}_mse"])
    if not by:
        return _flag("mse_monotone_in_bits", None, "no exp1 bit sweep ran")
    bad = []
    for (src, meth, kv, seed), per_bits in sorted(by.items()):
        seq = [per_bits[b][0] for b in sorted(per_bits)]
        for a, b_, bits_a, bits_b in zip(seq, seq[1:], sorted(per_bits), sorted(per_bits)[1:]):
            if b_ > a * (1 + 1e-9) + 1e-30:
                bad.append(f"{src}/{meth}/{kv}/seed{seed}: {bits_a}→{bits_b} bits MSE {a:.4g}→{b_:.4g}")
    return _flag("mse_monotone_in_bits", not bad,
                 "MSE does not increase with bits (per method, K and V, seed). Expected exception: min/max RTN "
                 "grids at b and b+1 bits are not nested, so a coarse-granularity RTN (per tensor/channel) on "
                 "heavy-tailed data can legitimately get worse from 2 to 3 bits; b → 2b is always monotone", bad)


#: checks run on a source's records; experiments add theirs here
DATA_QUALITY_CHECKS: list[Callable[[list[dict]], dict]] = [_check_fp16_exact, _check_exact_at_16, _check_monotone]


def data_quality(records: list[dict]) -> list[dict]:
    return [chk(records) for chk in DATA_QUALITY_CHECKS]


# ------------------------------------------------------------------------------------------------
def assemble(records: list[dict[str, Any]], catalog: dict[str, dict], provenance: dict[str, Any]) -> dict[str, Any]:
    """Build the leaderboard document from every record of a session.

    Returns ``{"provenance", "metrics_catalog", "methods", "sources": {source: {stats, rankings,
    pareto, matched_budget, data_quality, cells: {passed, failed, skipped}, failures, data}}}``.
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
        sizes = sorted({r.get("size") for r in recs if r.get("size")})
        data_meta = next((r.get("data") for r in recs if r.get("data")), None)
        sources[src] = {
            "sizes": sizes,
            "data": data_meta,
            "seeds": sorted({r["seed"] for r in recs}),
            "cells": {s: sum(1 for r in recs if r.get("status") == s) for s in ("passed", "failed", "skipped")},
            "setting_cells": setting_cells(recs),
            "failures": [{"nodeid": r["nodeid"], "error": r.get("error", "")} for r in recs if r.get("status") == "failed"],
            "stats": st,
            "rankings": rankings(st, catalog),
            "pareto": pareto(st),
            "matched_budget": matched_budget(st),
            # the same selection for what attention sees while decoding: pseudo-decode KL against
            # the bits a cache really holds (fp16 sink/window tokens billed at 16)
            "pareto_decode_kl": pareto_metric(st),
            "data_quality": data_quality(recs),
        }
    return {"provenance": provenance, "metrics_catalog": catalog, "methods": methods, "sources": sources}


def summary_of(board: dict[str, Any]) -> dict[str, Any]:
    """The compact ``summary.json``: rankings, data-quality flags, Pareto, matched budget, method
    fidelity and provenance (no per-seed values)."""
    return {
        "provenance": board["provenance"],
        "methods": {m: {"fidelity": i.get("fidelity"), "deltas": i.get("deltas", []), "arxiv": i.get("arxiv")}
                    for m, i in board["methods"].items()},
        "sources": {
            s: {"rankings": d["rankings"], "data_quality": d["data_quality"], "pareto": d["pareto"]["front"],
                "matched_budget": d["matched_budget"], "cells": d["cells"], "failures": d["failures"]}
            for s, d in board["sources"].items()
        },
    }


__all__.append("summary_of")


# ------------------------------------------------------------------------------------------------
# data-quality flags of experiments 1 (additions) and 2 — appended; see kvqbench/experiments/
# accumulation.py and generalization.py
#: |value| at or below which an fp16-control accumulation metric counts as "~0"
FP16_ACCUMULATION_TOL = 1e-12


def _check_fp16_accumulation(records: list[dict]) -> dict:
    """The fp16 control accumulates ~0 output error and ~0 attention KL in both regimes (exp2)."""
    cells = [r for r in records if r["method"] == "fp16" and r["experiment"] == "exp2" and r.get("status") == "passed"]
    if not cells:
        return _flag("fp16_accumulates_no_error", None, "fp16 control did not run experiment 2")
    bad = []
    for r in cells:
        off = {k: v for k, v in r.get("metrics", {}).items()
               if k.startswith(("static_", "decode_")) and "bits" not in k and abs(v) > FP16_ACCUMULATION_TOL}
        if off:
            bad.append(f"{r['nodeid']}: " + ", ".join(f"{k}={v:.3g}" for k, v in sorted(off.items())))
    return _flag("fp16_accumulates_no_error", not bad,
                 f"fp16 control: attention output error, KL and logit error within {FP16_ACCUMULATION_TOL:g} of 0 "
                 "(static and pseudo-decode)", bad)


def _check_local_codebook_gap(records: list[dict]) -> dict:
    """Methods with purely local per-group statistics show a zero codebook-generalization gap (exp1)."""
    cells = [r for r in records if r["experiment"] == "exp1" and r.get("status") == "passed"
             and "codebook_gap" in r.get("metrics", {}) and (r.get("method_info") or {}).get("local_stats")]
    if not cells:
        return _flag("local_methods_zero_codebook_gap", None, "no codebook-generalization cell of a local method ran")
    bad = [f"{r['nodeid']}: k={r['metrics'].get('k_codebook_gap')}, v={r['metrics'].get('v_codebook_gap')}"
           for r in cells if any(r["metrics"].get(n, 0.0) != 0.0
                                 for n in ("k_codebook_gap", "v_codebook_gap", "codebook_gap"))]
    return _flag("local_methods_zero_codebook_gap", not bad,
                 "methods with local_stats show a codebook-generalization gap of exactly 0", bad)


def _check_roundtrip_finite(records: list[dict]) -> dict:
    """Every method's reconstructions are finite in every experiment (the experiments tally NaN/±inf
    elements of K̂ and V̂ in ``extra["roundtrip_nonfinite"]``, failed cells included)."""
    cells = [r for r in records if isinstance((r.get("extra") or {}).get("roundtrip_nonfinite"), dict)]
    if not cells:
        return _flag("roundtrip_finite", None, "no cell recorded whether its round trip is finite")
    bad: dict[str, list[str]] = defaultdict(list)
    for r in cells:
        d = r["extra"]["roundtrip_nonfinite"]
        if d.get("k") or d.get("v"):
            bad[r["method"]].append(f"{r['experiment']} {setting_key(r)}")
    offenders = [f"{m}: {len(v)} cell(s), e.g. {v[0]}" for m, v in sorted(bad.items())]
    return _flag("roundtrip_finite", not bad,
                 "every method's reconstruction K̂, V̂ is finite (no NaN/inf) in every experiment", offenders)


DATA_QUALITY_CHECKS.extend([_check_fp16_accumulation, _check_local_codebook_gap, _check_roundtrip_finite])


def pareto_metric(stats_src: dict[str, Any], *, experiment: str = "exp2", quality: str = "decode_attn_kl_fwd_nats",
                  bits: str = "decode_bits_effective",
                  budgets: tuple[float, ...] = BUDGETS) -> dict[str, Any]:
    """Pareto front and matched-budget selector for any (quality, bits) pair of one experiment, e.g. the
    pseudo-decode attention KL against the bits a cache really holds (fp16 windows billed at 16 bits).

    Same rules as :func:`pareto` / :func:`matched_budget` (lower quality is better; variant settings are
    not budget points, nor are settings with fewer seeds than asked). Returns ``{"experiment", "quality", "bits", "points", "front", "matched_budget"}``.
    """
    pts = []
    for meth, by_setting in stats_src.get(experiment, {}).items():
        for setting, metrics in by_setting.items():
            if "-" in setting or quality not in metrics or bits not in metrics:
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
    matched = []
    for b in budgets:
        ok = sorted((p for p in pts if p["bits"] <= b + 1e-9), key=lambda p: (p["quality"], p["bits"], p["method"]))
        matched.append({"budget": b, "method": ok[0]["method"] if ok else None,
                        "setting": ok[0]["setting"] if ok else None, "bits": ok[0]["bits"] if ok else None,
                        "quality": ok[0]["quality"] if ok else None,
                        "runner_up": ok[1]["method"] if len(ok) > 1 else None})
    return {"experiment": experiment, "quality": quality, "bits": bits, "points": pts, "front": front,
            "matched_budget": matched}


__all__ += ["pareto_metric", "FP16_ACCUMULATION_TOL"]
