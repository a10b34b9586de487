"""Experiment 1 additions: codebook-generalization gap and group-size sensitivity."""

import dataclasses

import pytest
import torch

from kvqbench.data.synthetic import make_synthetic
from kvqbench.data.types import KVData
from kvqbench.experiments.generalization import (
    EVAL_SEED_OFFSET,
    SYNTHETIC_SHIFT,
    fit_eval_batches,
    run_codebook_gap,
    run_group_size,
)
from kvqbench.quantizers import available, create
from kvqbench.report.stats.quality import DATA_QUALITY_CHECKS, data_quality


def _data(seed=0, t=256):
    return make_synthetic(seed=seed, batch=1, kv_heads=2, q_heads=4, seq_len=t, head_dim=64)


@pytest.mark.parametrize("method", ["rtn_token", "rtn_channel", "kivi"])
def test_gap_is_exactly_zero_for_local_methods(method):
    res = run_codebook_gap(create(method, 2, 2), _data())
    assert res.metrics["k_codebook_gap"] == 0.0
    assert res.metrics["v_codebook_gap"] == 0.0
    assert res.metrics["codebook_gap"] == 0.0
    assert res.extra["k_rel_mse_cross"] > 0  # it did quantize


def test_gap_is_positive_for_kvquant_on_shifted_statistics():
    if "kvquant" not in available():
        pytest.skip("kvquant is not registered yet")
    m = create("kvquant", 2, 2)
    assert not m.local_stats
    res = run_codebook_gap(m, _data())
    assert res.metrics["codebook_gap"] > 0
    assert res.metrics["k_codebook_gap"] > 0 or res.metrics["v_codebook_gap"] > 0
    fitted = getattr(m, "fitted", {"k": False, "v": False})
    assert not fitted["k"] and not fitted["v"]  # the configured instance is left untouched (fits on copies)


def test_synthetic_eval_batch_is_independent_and_shifted():
    a, b = fit_eval_batches(_data(seed=3))
    assert b.meta["seed"] == 3 + EVAL_SEED_OFFSET
    assert b.meta["norm_sigma"] == SYNTHETIC_SHIFT["norm_sigma"]
    assert b.meta["channel_gain"] == SYNTHETIC_SHIFT["channel_gain"]
    assert a.k.shape == b.k.shape and not torch.equal(a.k, b.k)


def test_real_sources_split_tokens_in_halves():
    d = _data(t=10)
    cos = torch.arange(10 * 64, dtype=torch.float32).reshape(1, 10, 64)
    real = KVData("real", d.k, d.v, d.q, k_pre=d.k * 2, cos=cos, sin=cos + 1, meta={"layers": [0]})
    a, b = fit_eval_batches(real)
    assert torch.equal(a.k, d.k[..., :5, :]) and torch.equal(b.k, d.k[..., 5:, :])
    assert torch.equal(b.k_pre, 2 * d.k[..., 5:, :]) and torch.equal(b.cos, cos[:, 5:])
    assert a.meta["token_range"] == [0, 5] and b.meta["token_range"] == [5, 10]
    res = run_codebook_gap(create("rtn_token", 2, 2), real)
    assert res.metrics["codebook_gap"] == 0.0
    with pytest.raises(ValueError, match="2 tokens"):
        fit_eval_batches(dataclasses.replace(real, k=d.k[..., :1, :], v=d.v[..., :1, :], q=d.q[..., :1, :]))


def test_group_size_sensitivity_finer_groups_lower_error():
    d = _data()
    r32 = run_group_size(create("kivi", 2, 2, group_size=32), d)
    r128 = run_group_size(create("kivi", 2, 2, group_size=128), d)
    assert r32.metrics["gs_rel_mse"] < r128.metrics["gs_rel_mse"]
    assert r32.metrics["gs_bits_effective"] > r128.metrics["gs_bits_effective"]
    assert r32.extra["group_size"] == 32
    with pytest.raises(ValueError, match="grouped"):
        run_group_size(create("rtn_token", 2, 2), d)


def _rec(method, gap, local=True):
    return {"experiment": "exp1", "method": method, "status": "passed", "nodeid": method, "source": "synthetic",
            "k_bits": 2, "v_bits": 2, "seed": 0, "variant": {},
            "metrics": {"k_codebook_gap": gap, "v_codebook_gap": 0.0, "codebook_gap": gap / 2},
            "method_info": {"local_stats": local}}


def test_data_quality_flag_local_gap():
    names = [c.__name__ for c in DATA_QUALITY_CHECKS]
    assert "_check_local_codebook_gap" in names and "_check_fp16_accumulation" in names
    flags = {f["name"]: f for f in data_quality([_rec("kivi", 0.0), _rec("kvquant", 0.3, local=False)])}
    assert flags["local_methods_zero_codebook_gap"]["ok"] is True
    flags = {f["name"]: f for f in data_quality([_rec("kivi", 1e-9)])}
    assert flags["local_methods_zero_codebook_gap"]["ok"] is False
    assert flags["fp16_accumulates_no_error"]["ok"] is None
