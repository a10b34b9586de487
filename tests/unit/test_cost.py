"""Experiment 4 (cost): timing plumbing, bits, compression, memory accounting and the leaderboard's
coverage of the new metrics."""

import math

import pytest
import torch

from kvqbench.data.synthetic import make_synthetic
from kvqbench.experiments.cost import CostConfig, held_bytes, run_cost, time_call
from kvqbench.metrics import CATALOG, NONDETERMINISTIC_METRICS, catalog_dict
from kvqbench.quantizers import create
from kvqbench.report.board import assemble


def _data():
    return make_synthetic(seed=0, batch=1, kv_heads=2, q_heads=4, seq_len=128, head_dim=64)


def test_time_call_counts_and_returns_last_result():
    calls = []
    times, out = time_call(lambda: calls.append(1) or len(calls), torch.device("cpu"), warmup=2, repeats=3)
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert out == 5 and len(calls) == 5


@pytest.mark.parametrize("method,bits", [("fp16", 2), ("kivi", 2), ("rtn_token", 4)])
def test_run_cost_metrics(method, bits):
    d = _data()
    m = create(method, bits, bits)
    res = run_cost(m, d, CostConfig(warmup=0, repeats=2))
    mt = res.metrics
    assert set(mt) <= set(CATALOG) and all(CATALOG[k].experiment == "exp4" for k in mt)
    assert mt["compression_ratio"] == pytest.approx(16.0 / mt["cost_bits_effective"])
    k_eff = m.quantize(d.k, "k").effective_bits()
    v_eff = m.quantize(d.v, "v").effective_bits()
    assert mt["cost_bits_effective"] == pytest.approx((k_eff + v_eff) / 2)
    assert res.extra["unreliable_timing"] is True
    assert set(res.extra["nondeterministic_metrics"]) == set(NONDETERMINISTIC_METRICS)
    assert len(res.extra["timings"]["k_quant_ms_all"]) == 2
    gb = 2 * (d.k.numel() + d.v.numel()) / 1e9
    assert mt["quant_throughput_gbps"] == pytest.approx(gb / (mt["quant_latency_ms"] * 1e-3), rel=1e-9)
    # CPU peak memory is the deterministic estimate input + representation + output
    expected = sum(x.numel() * x.element_size() * 2 + held_bytes(m.quantize(x, kind))
                   for kind, x in (("k", d.k), ("v", d.v)))
    assert mt["peak_mem_mib"] == pytest.approx(expected / 2**20)


def test_fp16_compression_is_one():
    res = run_cost(create("fp16", 2, 2), _data(), CostConfig(warmup=0, repeats=1))
    assert res.metrics["compression_ratio"] == 1.0 and res.metrics["cost_bits_nominal"] == 16.0


def test_cost_config_validation():
    with pytest.raises(ValueError):
        CostConfig(repeats=0)
    with pytest.raises(ValueError):
        CostConfig(warmup=-1)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="benchmark_rounds"):
            CostConfig(benchmark_rounds=bad)


class _Bench:
    """Stands in for pytest-benchmark's fixture: records how it was asked to time, runs the function the
    number of times it was given and reports those rounds."""

    def __init__(self):
        self.asked, self.stats = None, None

    def _run(self, fn, rounds):
        import types

        for _ in range(rounds):
            fn()
        st = types.SimpleNamespace(rounds=rounds, min=1e-3, median=2e-3, iqr=0.0, mean=2e-3)
        self.stats = types.SimpleNamespace(stats=st)

    def __call__(self, fn):
        self.asked = "calibrated"
        self._run(fn, 7)

    def pedantic(self, fn, *, rounds, warmup_rounds, iterations):
        self.asked = ("pedantic", rounds, warmup_rounds, iterations)
        self._run(fn, warmup_rounds + rounds)


@pytest.mark.parametrize("rounds", [None, 4])
def test_benchmark_rounds_fixed_or_calibrated(rounds):
    """``benchmark_rounds`` fixes pytest-benchmark's rounds (pedantic, after the warm-up rounds);
    ``None`` leaves them to its calibration. Either way its median is the round-trip latency."""
    bench = _Bench()
    res = run_cost(create("kivi", 2, 2), _data(), CostConfig(warmup=1, repeats=1, benchmark_rounds=rounds),
                   benchmark=bench)
    assert bench.asked == ("calibrated" if rounds is None else ("pedantic", 4, 1, 1))
    assert res.extra["roundtrip_timer"] == "pytest-benchmark" and res.metrics["roundtrip_latency_ms"] == 2.0


def test_nondeterministic_metrics_are_catalogued():
    assert NONDETERMINISTIC_METRICS <= set(CATALOG)
    assert all(CATALOG[n].experiment == "exp4" for n in NONDETERMINISTIC_METRICS)


def _record(exp, method, seed, metrics):
    return {"experiment": exp, "method": method, "k_bits": 2, "v_bits": 2, "seed": seed, "source": "synthetic",
            "size": "smoke", "variant": {}, "nodeid": f"{exp}-{method}-{seed}", "status": "passed",
            "metrics": metrics, "per_layer": {}}


def test_leaderboard_ranks_every_new_metric_with_ci():
    new = [n for n, m in CATALOG.items() if m.experiment in ("exp2", "exp3", "exp4")
           or n.endswith("codebook_gap") or n.startswith("gs_")]
    assert len(new) > 40
    recs = []
    for exp in ("exp1", "exp2", "exp3", "exp4"):
        names = [n for n in new if CATALOG[n].experiment == exp]
        for mi, method in enumerate(("a", "b")):
            for seed in range(3):
                recs.append(_record(exp, method, seed, {n: float(mi + 0.1 * seed + 1) for n in names}))
    board = assemble(recs, catalog_dict(), {})
    ranks = board["sources"]["synthetic"]["rankings"]
    for n in new:
        rows = ranks[n]["by_setting"]["k2v2"]
        assert {r["method"] for r in rows} == {"a", "b"}
        assert rows[0]["ci95"] is not None and math.isfinite(rows[0]["ci95"])
        best = "a" if CATALOG[n].better in ("lower", "zero") else "b"
        assert rows[0]["method"] == best, n


@pytest.mark.parametrize("warmup,repeats", [(1, 3), (2, 1), (0, 2)])
def test_run_cost_calls_each_quantize_warmup_plus_twice_repeats(warmup, repeats, monkeypatch):
    """Without pytest-benchmark: per kind, ``warmup + repeats`` timed-loop quantize calls, then the round
    trip's ``repeats`` (no warm-up round trip: its calls were just warmed up); the repeats are recorded."""
    m = create("rtn_token", 2, 2)
    calls = {"k": 0, "v": 0}
    orig = type(m).quantize

    def counting(self, x, kind):
        calls[kind] += 1
        return orig(self, x, kind)

    monkeypatch.setattr(type(m), "quantize", counting)
    res = run_cost(m, _data(), CostConfig(warmup=warmup, repeats=repeats))
    assert calls == {"k": warmup + 2 * repeats, "v": warmup + 2 * repeats}
    assert len(res.extra["timings"]["roundtrip_ms_all"]) == repeats
