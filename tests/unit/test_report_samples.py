"""Hand-built, torch-free result sets for the report/compare/plots/publish tests (imported by them),
plus checks that the builder produces what those tests assume.

The values follow simple closed forms (error ×¼ per extra bit, exact at 16 bits, fp16 exact
everywhere), so the tests can state expected outcomes without running any quantizer.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest

from kvqbench.metrics import catalog_dict
from kvqbench.report.board import assemble
from kvqbench.report.io import write_json_atomic, write_text_atomic
from kvqbench.report.render.markdown import render_markdown

METHODS = ("fp16", "rtn_token", "kivi", "kvarn")
BASE_ERR = {"fp16": 0.0, "rtn_token": 0.7, "kivi": 0.55, "kvarn": 0.23}
OVERHEAD = {"fp16": None, "rtn_token": 0.25, "kivi": 0.1875, "kvarn": 0.25}
BITS = (2, 4, 16)
SEEDS = (0, 1)
CTX = [64, 128, 256, 512]

#: catalog records for the fake exp2–exp4 metrics (added only where the real catalog lacks the name)
EXTRA_CATALOG = {
    "attn_kl_fwd": {"name": "attn_kl_fwd", "unit": "nats", "better": "lower", "description": "fake exp2 KL",
                    "experiment": "exp2", "scale_free": True, "headline": False},
    "attn_cos_gain": {"name": "attn_cos_gain", "unit": "1", "better": "higher", "description": "fake higher-better",
                      "experiment": "exp2", "scale_free": True, "headline": False},
    "quantize_ms": {"name": "quantize_ms", "unit": "ms", "better": "lower", "description": "fake latency",
                    "experiment": "exp4", "scale_free": False, "headline": False, "varies": "timing"},
    "dequantize_ms": {"name": "dequantize_ms", "unit": "ms", "better": "lower", "description": "fake latency",
                      "experiment": "exp4", "scale_free": False, "headline": False, "varies": "timing"},
    "cost_bits_effective": {"name": "cost_bits_effective", "unit": "bits/element", "better": "lower",
                            "description": "fake bits", "experiment": "exp4", "scale_free": True, "headline": False},
}

PROVENANCE = {
    "kvqbench_version": "0.1.0", "git_commit": "0123456789ab", "torch_version": "2.13.0+cpu",
    "python_version": "3.11.7", "device": "cpu", "device_name": "cpu (x86_64, 2 cores)", "seeds": list(SEEDS),
    "bits": list(BITS), "model": None, "shapes": [{"source": "synthetic", "size": "smoke", "k": [1, 2, 256, 128]}],
    "command": "pytest tests/bench -m smoke --kvq-out /home/alice/kvq/results", "start_time": "2026-01-01T00:00:00+00:00",
}


def catalog() -> dict[str, dict]:
    cat = catalog_dict()
    for k, v in EXTRA_CATALOG.items():
        cat.setdefault(k, v)
    return cat


def _rec(exp: str, method: str, bits: int, seed: int, source: str, metrics: dict[str, float],
         series: dict[str, Any] | None = None) -> dict[str, Any]:
    r = {"experiment": exp, "method": method, "k_bits": bits, "v_bits": bits, "seed": seed, "source": source,
         "size": "smoke", "variant": {}, "bits_tag": f"k{bits}v{bits}",
         "nodeid": f"tests/bench/test_{exp}.py::test_x[{method}-k{bits}v{bits}-seed{seed}-{source}-smoke]",
         "status": "passed", "metrics": metrics, "per_layer": {}, "duration_s": 0.01,
         "method_info": {"id": method, "name": method.upper(), "fidelity": "faithful", "deltas": [], "arxiv": None}}
    if series is not None:
        r["series"] = series
    return r


def records(*, sources: tuple[str, ...] = ("synthetic",), experiments: tuple[str, ...] = ("exp1", "exp2", "exp3", "exp4"),
            degrade: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Cell records; ``degrade={method: factor}`` multiplies that method's errors (a worse NEW set)."""
    degrade = degrade or {}
    out = []
    for src in sources:
        for m in METHODS:
            f = degrade.get(m, 1.0)
            for b in BITS:
                exact = m == "fp16" or b >= 16
                for s in SEEDS:
                    jitter = 1.0 + 0.02 * s
                    err = 0.0 if exact else BASE_ERR[m] * 4.0 ** (-(b - 2)) * jitter * f
                    eff = 16.0 if (m == "fp16" or b >= 16) else b + OVERHEAD[m]
                    if "exp1" in experiments:
                        out.append(_rec("exp1", m, b, s, src, {
                            "rel_mse": err, "k_rel_mse": err * 1.2, "v_rel_mse": err * 0.8, "k_mse": err * 3.0,
                            "v_mse": err * 2.0, "bits_effective": eff, "bits_nominal": eff,
                            "k_bits_effective": eff, "v_bits_effective": eff, "k_norm_bias": -err / 10}))
                    if "exp2" in experiments:
                        grow = [err * (1 + math.log2(c / CTX[0])) for c in CTX]
                        out.append(_rec("exp2", m, b, s, src, {"attn_kl_fwd": err / 5, "attn_cos_gain": 1 - err},
                                        {"context_len": CTX,
                                         "static": {"attn_mse": grow, "attn_kl": [g / 5 for g in grow]},
                                         "pseudo_decode": {"attn_mse": [g * 1.5 for g in grow],
                                                           "attn_kl": [g / 4 for g in grow]}}))
                    if "exp3" in experiments:
                        edges = [-2.0 + 0.25 * i for i in range(17)]
                        width = max(err, 1e-3)
                        counts = [math.exp(-((a + 0.125) ** 2) / (2 * width)) * 100 for a in edges[:-1]]
                        out.append(_rec("exp3", m, b, s, src, {},
                                        {"k_norm_diff": {"edges": edges, "counts": counts},
                                         "v_norm_diff": {"edges": edges, "counts": counts[::-1]}}))
                    if "exp4" in experiments:
                        lat = {"fp16": 0.01, "rtn_token": 0.2, "kivi": 0.5, "kvarn": 3.0}[m]
                        out.append(_rec("exp4", m, b, s, src, {"quantize_ms": lat * jitter,
                                                               "dequantize_ms": lat / 2 * jitter,
                                                               "cost_bits_effective": eff}))
    return out


def board(recs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return assemble(recs if recs is not None else records(), catalog(), copy.deepcopy(PROVENANCE))


def write_results(out: Path, recs: list[dict[str, Any]] | None = None) -> Path:
    """Write a results folder like a run does (exp JSON per source, leaderboard.json, LEADERBOARD.md)."""
    recs = recs if recs is not None else records()
    cat = catalog()
    for exp in sorted({r["experiment"] for r in recs}):
        for src in sorted({r["source"] for r in recs if r["experiment"] == exp}):
            cells = [r for r in recs if r["experiment"] == exp and r["source"] == src]
            write_json_atomic(out / f"{exp}_{src}.json", {"provenance": PROVENANCE, "experiment": exp, "source": src,
                                                          "metrics_catalog": cat, "cells": cells})
    b = board(recs)
    write_json_atomic(out / "leaderboard.json", b)
    write_text_atomic(out / "LEADERBOARD.md", render_markdown(b))
    return out


# ------------------------------------------------------------------------------------------------
def test_sample_board_has_every_experiment_and_a_front():
    b = board()
    syn = b["sources"]["synthetic"]
    assert set(syn["stats"]) == {"exp1", "exp2", "exp3", "exp4"}
    assert syn["pareto"]["front"], "the sample must have a Pareto front"
    assert syn["stats"]["exp1"]["kivi"]["k2v2"]["rel_mse"]["n"] == 2


def test_sample_degrade_worsens_only_that_method():
    base = board()["sources"]["synthetic"]["stats"]["exp1"]
    worse = board(records(degrade={"kivi": 1.2}))["sources"]["synthetic"]["stats"]["exp1"]
    assert worse["kivi"]["k2v2"]["rel_mse"]["mean"] == pytest.approx(base["kivi"]["k2v2"]["rel_mse"]["mean"] * 1.2)
    assert worse["kvarn"]["k2v2"]["rel_mse"]["mean"] == base["kvarn"]["k2v2"]["rel_mse"]["mean"]
