"""Every experiment checks that the round trip is finite (issue 9, item 5): a method whose dequantize
returns NaN is caught by exp1 (reconstruction, codebook gap, group size), exp2, exp3 and exp4, and the
``roundtrip_finite`` data-quality flag names it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvqbench.data.synthetic import make_synthetic
from kvqbench.experiments.accumulation import AccumulationConfig, run_accumulation
from kvqbench.experiments.common import NonFiniteRoundTrip, check_roundtrip_finite, count_nonfinite
from kvqbench.experiments.cost import CostConfig, run_cost
from kvqbench.experiments.generalization import run_codebook_gap, run_group_size
from kvqbench.experiments.outliers import run_outliers
from kvqbench.experiments.reconstruction import run_reconstruction
from kvqbench.quantizers import create
from kvqbench.report.stats.quality import data_quality
from tests.property.strategies import kv_tensors

RUNS = {
    "exp1": run_reconstruction,
    "exp1_codebook_gap": run_codebook_gap,
    "exp1_group_size": run_group_size,
    "exp2": lambda m, d: run_accumulation(m, d, AccumulationConfig(n_lengths=2, block=16, n_queries=4)),
    "exp3": run_outliers,
    "exp4": lambda m, d: run_cost(m, d, CostConfig(warmup=0, repeats=1)),
}


@pytest.fixture(scope="module")
def data():
    return make_synthetic(seed=0, batch=1, kv_heads=2, q_heads=4, seq_len=64, head_dim=32)


def _nan_method():
    m = create("kivi", 4, 4)
    real = m.dequantize
    m.dequantize = lambda qt: torch.full_like(real(qt), float("nan"))  # a broken method: all-NaN output
    return m


@pytest.mark.parametrize("exp", sorted(RUNS))
def test_every_experiment_catches_a_nan_round_trip(exp, data):
    res = RUNS[exp](_nan_method(), data)
    d = res.extra["roundtrip_nonfinite"]
    assert d["k"] > 0 and d["v"] > 0
    with pytest.raises(NonFiniteRoundTrip, match="kivi: non-finite round trip"):
        check_roundtrip_finite(res, "kivi")
    ok = RUNS[exp](create("kivi", 4, 4), data)
    assert ok.extra["roundtrip_nonfinite"] == {"k": 0, "v": 0}
    check_roundtrip_finite(ok, "kivi")  # finite: no exception


def test_exp1_counts_every_nan_element(data):
    res = run_reconstruction(_nan_method(), data)
    assert res.extra["roundtrip_nonfinite"] == {"k": data.k.numel(), "v": data.v.numel()}


def test_flag_names_the_method_with_a_nonfinite_round_trip():
    def rec(method, exp, k, status="passed"):
        return {"experiment": exp, "method": method, "k_bits": 2, "v_bits": 2, "seed": 0, "source": "synthetic",
                "variant": {}, "status": status, "metrics": {}, "nodeid": f"{method}-{exp}",
                "extra": {"roundtrip_nonfinite": {"k": k, "v": 0}}}

    flags = {f["name"]: f for f in data_quality([rec("kivi", "exp1", 0), rec("broken", "exp4", 7),
                                                 rec("broken", "exp1", 7, "failed")])}
    f = flags["roundtrip_finite"]
    assert f["ok"] is False and len(f["offenders"]) == 1 and f["offenders"][0].startswith("broken: 2 cell(s)")
    assert data_quality([rec("kivi", "exp1", 0)])[-1]["ok"] is True
    assert {f["name"]: f for f in data_quality([])}["roundtrip_finite"]["ok"] is None


@given(x=kv_tensors(dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64)),
       bad=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([float("nan"), float("inf"), -float("inf"),
                                                                       3e38, -3e38, 6e4])), max_size=6))
def test_count_nonfinite_matches_the_elementwise_count(x, bad):
    """The one-sum fast path gives the count of ``isfinite``'s mask (the reference), also when finite
    values overflow the sum (3e38 in fp32, 6e4 in fp16) and when +inf and −inf cancel to NaN."""
    flat = x.reshape(-1).clone()
    for i, v in bad:
        flat[i % flat.numel()] = v  # 3e38 overflows fp16/bf16 to ±inf: that is the value the tensor holds
    y = flat.reshape(x.shape)
    assert count_nonfinite(y) == y.numel() - int(torch.isfinite(y).sum())


def test_count_nonfinite_of_empty_and_integer_tensors():
    assert count_nonfinite(torch.empty(0)) == 0
    assert count_nonfinite(torch.arange(5)) == 0
