"""Assemble cell records into statistics, rankings, Pareto fronts, matched-budget tables and
data-quality flags (docs/DESIGN.md §5). Torch-free: works from saved JSON.

A *record* is the dict a benchmark cell writes (see :mod:`kvqbench.plugin`): identity (experiment,
method, bits, seed, source, size, variant), ``status``, ``metrics`` (name → float), ``per_layer``
(name → list), ``series``/``extra`` detail, ``method_info`` and ``data`` provenance.

Multi-seed: each (source, experiment, method, bits, variant) *setting* aggregates its seeds into
mean ± 95% Student-t confidence half-width; rankings order methods by mean in each metric's
better-direction and mark methods whose CIs overlap as ties.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Any, Callable, Iterable

from kvqbench.cells import (
    is_plain_setting,
    parse_nodeid,
    setting_order,
    setting_tag,
    source_kind,
)
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
    return m, float(_student_t_ppf(0.5 + confidence / 2, n - 1) * math.sqrt(var / n))


@functools.lru_cache(maxsize=None)
def _student_t_ppf(p: float, df: int) -> float:
    """Student-t quantile: ``scipy.special.stdtrit`` — the function ``scipy.stats.t.ppf`` evaluates, the
    same value to the bit — without importing ``scipy.stats`` (about a CPU-second at session end)."""
    from scipy.special import stdtrit

    return float(stdtrit(df, p))


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
    return parse_nodeid(str(r.get("nodeid", ""))).base


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
        for setting in sorted(table[name], key=setting_order):
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
    """The best (lowest relative MSE) exp1 (method, bits) at each effective-bits budget ``≤ b``, with the
    methods whose 95% CI overlaps it (``ties``, :func:`best_at_budgets`)."""
    return [{"budget": m["budget"], "method": m["method"], "setting": m["setting"], "bits_effective": m["bits"],
             PARETO_QUALITY: m["quality"], "ties": m["ties"], "runner_up": m["runner_up"]}
            for m in _exp1_front(stats_src, budgets)["matched_budget"]]


# ------------------------------------------------------------------------------------------------
# data-quality flags — sanity checks on the measurement, never a verdict on a method
def _flag(name: str, ok: bool | None, detail: str, offenders: list | None = None,
          noted: list | None = None) -> dict[str, Any]:
    """A data-quality check's result: ``offenders`` make it FLAGGED; ``noted`` are expected exceptions
    listed for the reader without flagging."""
    out = {"name": name, "ok": ok, "detail": detail, "offenders": offenders or []}
    if noted:
        out["noted"] = noted
    return out


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
    bad, noted = [], []
    for (src, meth, kv, seed), per_bits in sorted(by.items()):
        bits = sorted(per_bits)
        for i, bits_a in enumerate(bits):
            for bits_b in bits[i + 1:]:
                a, b_ = per_bits[bits_a][0], per_bits[bits_b][0]
                if b_ > a * (1 + 1e-9) + 1e-30:
                    text = f"{src}/{meth}/{kv}/seed{seed}: {bits_a}→{bits_b} bits MSE {a:.4g}→{b_:.4g}"
                    # b → m·b: every 2^b-level min/max grid is a subgrid of the 2^(m·b)-level one (2^b − 1
                    # divides 2^(m·b) − 1), so more bits can only help; other pairs are noted, not flagged
                    (bad if bits_b % bits_a == 0 else noted if bits_b == bits[i + 1] else []).append(text)
    return _flag("mse_monotone_in_bits", not bad,
                 "MSE does not increase from b to m·b bits (per method, K and V, seed: the b-bit grid is nested in "
                 "the m·b-bit one). Between non-nested widths (e.g. 2→3) a min/max RTN grid can legitimately get "
                 "worse — on heavy-tailed data the level nearest 0 moves — so those are noted, not flagged",
                 bad, noted)


#: checks run on a source's records; experiments add theirs here
DATA_QUALITY_CHECKS: list[Callable[[list[dict]], dict]] = [_check_fp16_exact, _check_exact_at_16, _check_monotone]


def data_quality(records: list[dict]) -> list[dict]:
    return [chk(records) for chk in DATA_QUALITY_CHECKS]


# ------------------------------------------------------------------------------------------------
def assemble(records: list[dict[str, Any]], catalog: dict[str, dict], provenance: dict[str, Any]) -> dict[str, Any]:
    """Build the leaderboard document from every record of a session.

    Returns ``{"provenance", "metrics_catalog", "methods", "sources": {source: {stats, rankings,
    pareto, matched_budget, data_quality, cells: {passed, failed, skipped}, failures, data, predictivity,
    long_decode}}}`` (``long_decode``: :func:`kvqbench.report.longdecode.summarize`).
    """
    from kvqbench.report.longdecode import summarize as summarize_long

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
            # which tensor metrics predict model damage (exp5/exp6 against exp1–exp3), None without either
            "predictivity": predictivity(st, catalog),
            # exp6's curves, fp16 shares and passkey accuracies per length (None without exp6)
            "long_decode": summarize_long(recs),
        }
    from kvqbench.report.headline import choose_headline, headline_budget

    headline = choose_headline(sources, catalog)
    for src in sources.values():
        src["headline"] = headline_budget(src["stats"], headline, catalog)
    return {"provenance": provenance, "metrics_catalog": catalog, "methods": methods, "sources": sources,
            "headline": headline, "models": compare_models(sources, catalog)}


def model_sources(sources: dict[str, Any]) -> dict[str, str]:
    """``{model name: source name}`` of the first two real sources with an end-to-end run (``real`` first):
    the two models :func:`compare_models` sets side by side."""
    out: dict[str, str] = {}
    for name in sorted(sources, key=lambda s: (s != "real", s)):
        src = sources[name]
        if source_kind(name) == "real" and src.get("stats", {}).get("exp5") and len(out) < 2:
            out[(src.get("data") or {}).get("model") or name] = name
    return out


def compare_models(sources: dict[str, Any], catalog: dict[str, dict]) -> dict[str, Any] | None:
    """Two models side by side (:mod:`kvqbench.report.models`): each method's end-to-end KL rank on both
    with their rank correlation, and the headline metric's predictivity out of sample, both ways; ``None``
    unless two real sources ran the end-to-end experiment."""
    from kvqbench.report.models import predictivity_transfer, rank_table

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
        "methods": {m: {"fidelity": i.get("fidelity"), "deltas": i.get("deltas", []), "arxiv": i.get("arxiv")}
                    for m, i in board["methods"].items()},
        "sources": {
            s: {"rankings": d["rankings"], "data_quality": d["data_quality"], "pareto": d["pareto"]["front"],
                "matched_budget": d["matched_budget"], "cells": d["cells"], "failures": d["failures"],
                "headline": d.get("headline"), "predictivity": d.get("predictivity")}
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


def _check_fp16_endtoend(records: list[dict]) -> dict:
    """The fp16 control leaves the real model's next-token distributions exactly unchanged (exp5)."""
    cells = [r for r in records if r["method"] == "fp16" and r["experiment"] == "exp5" and r.get("status") == "passed"]
    if not cells:
        return _flag("fp16_endtoend_exact", None, "fp16 control did not run experiment 5")
    want = {"kl_nats": 0.0, "kl_p99_nats": 0.0, "top1_agree": 1.0, "dloss_nats": 0.0}
    bad = [f"{r['nodeid']}: {k}={v:.3g}" for r in cells for k, v in sorted(r.get("metrics", {}).items())
           if k.startswith("e2e_") and k.split("_", 2)[2] in want and v != want[k.split("_", 2)[2]]]
    return _flag("fp16_endtoend_exact", not bad,
                 "fp16 control in the model's KV cache: next-token KL exactly 0, top-1 agreement exactly 1, "
                 "Δ loss exactly 0 (prefill and decode)", bad)


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


DATA_QUALITY_CHECKS.extend([_check_fp16_accumulation, _check_local_codebook_gap, _check_fp16_endtoend,
                            _check_roundtrip_finite])


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
            lo, hi = _interval({"mean": p["mean"], "ci95": (p["ci95"] or 0.0) + floor}, better)
            return lo, hi

        top = ranked[0]
        lo, hi = iv(top)
        ties = [{"method": p["method"], "setting": p["setting"], "bits": p["bits"], "value": p["mean"], "ci95": p["ci95"]}
                for p in ranked[1:] if not (iv(p)[0] > hi or iv(p)[1] < lo)]
        out.append({"budget": b, "method": top["method"], "setting": top["setting"], "bits": top["bits"],
                    "value": top["mean"], "ci95": top["ci95"], "ties": ties,
                    "runner_up": ranked[1]["method"] if len(ranked) > 1 else None})
    return out


__all__ += ["pareto_metric", "best_at_budgets", "FP16_ACCUMULATION_TOL"]


# ------------------------------------------------------------------------------------------------
# predictivity — which tensor metrics predict model damage (experiment 5, docs/DESIGN.md §4)
#: the model-damage quantities tensor metrics are correlated with, each from the experiment the catalog
#: names (the first is the headline target): the short-window KL of exp5, the long-decode KL and the
#: passkey log-probability drop of exp6
PREDICTIVITY_TARGETS: tuple[str, ...] = ("e2e_prefill_kl_nats", "e2e_decode_kl_nats", "long_kl_nats",
                                         "passkey_logp_drop_nats")
#: experiments whose scalar metrics are candidates
PREDICTIVITY_EXPERIMENTS: tuple[str, ...] = ("exp1", "exp2", "exp3")
PREDICTIVITY_BOOTSTRAP = 2000
PREDICTIVITY_SEED = 0
#: the fewest methods a predictivity group ranks (Spearman ρ across fewer says nothing)
PREDICTIVITY_MIN_METHODS = 4


def _rank_rows(a: Any) -> Any:
    """Average ranks along the last axis (ties share their mean rank), like ``scipy.stats.rankdata``."""
    from scipy.stats import rankdata

    return rankdata(a, axis=-1)


def spearman_rows(x: Any, y: Any) -> Any:
    """Spearman ρ of each row pair of ``x``/``y`` ``(rows, n)``: the Pearson correlation of their
    average ranks (the definition ``scipy.stats.spearmanr`` uses). A row with a constant side → NaN."""
    import numpy as np

    rx = _rank_rows(np.asarray(x, dtype=float))
    ry = _rank_rows(np.asarray(y, dtype=float))
    rx = rx - rx.mean(-1, keepdims=True)
    ry = ry - ry.mean(-1, keepdims=True)
    den = np.sqrt((rx * rx).sum(-1) * (ry * ry).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (rx * ry).sum(-1) / np.where(den > 0, den, 1.0), np.nan)


def _spearman_ci(x: Any, y: Any, n_boot: int, seed: int) -> tuple[float | None, list[float] | None]:
    """ρ of ``x``/``y`` ``(methods, settings)`` (flattened) with ``scipy.stats.spearmanr``, and the
    percentile bootstrap 95 % CI over methods (each resample draws methods with replacement and keeps all
    their settings; degenerate resamples with a constant side are dropped)."""
    import warnings

    import numpy as np
    from scipy.stats import spearmanr

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # constant input: ρ is undefined (NaN), reported as None
        rho = float(spearmanr(x.ravel(), y.ravel()).statistic)
    if not math.isfinite(rho):
        return None, None
    rng = np.random.Generator(np.random.PCG64(seed))
    idx = rng.integers(0, x.shape[0], size=(n_boot, x.shape[0]))
    boot = spearman_rows(x[idx].reshape(n_boot, -1), y[idx].reshape(n_boot, -1))
    boot = boot[np.isfinite(boot)]
    if boot.size < n_boot // 2:
        return rho, None
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return rho, [float(lo), float(hi)]


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
        return (catalog.get(target) or {}).get("experiment", "exp5")

    if not any(stats_src.get(target_exp(t)) for t in PREDICTIVITY_TARGETS):
        return None
    out: dict[str, Any] = {"targets": {}, "n_boot": n_boot, "seed": seed,
                           "excluded": "exact points (target exactly 0: fp16 control, 16-bit settings), "
                                       "variant settings, bits/element metrics, settings with failed seeds"}
    candidates = sorted({(exp, name) for exp in PREDICTIVITY_EXPERIMENTS for by in stats_src.get(exp, {}).values()
                         for metrics in by.values() for name in metrics
                         if name in catalog and catalog[name].get("experiment") == exp
                         and catalog[name].get("unit") != "bits/element"})
    groups_seen: set[str] = set()
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
                rho, ci = _spearman_ci(xs, ys, n_boot, seed)
                rows.append({"metric": name, "experiment": exp, "rho": rho, "ci95": ci,
                             "n_methods": len(methods), "n_points": len(methods) * len(gset)})
            # best first; ρ compared to 12 decimals so float noise (0.9999999999999999) does not order ties
            rows.sort(key=lambda r: (r["rho"] is None, -round(r["rho"] or 0.0, 12), r["metric"]))
            if rows:
                by_group[gname] = rows
                groups_seen.add(gname)
        out["targets"][target] = by_group
        out.setdefault("pooled_settings", pooled if len(pooled) > 1 else [])
    out["groups"] = sorted(groups_seen - {"pooled"}, key=setting_order) + (["pooled"] if "pooled" in groups_seen else [])
    return out


__all__ += ["PREDICTIVITY_TARGETS", "PREDICTIVITY_MIN_METHODS", "predictivity", "spearman_rows"]
