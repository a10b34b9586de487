"""Attention numerics and experiment 2 (accumulation): independent closed forms and invariants."""

import math

import pytest
import torch

from kvqbench.data.synthetic import make_synthetic
from kvqbench.experiments.accumulation import AccumulationConfig, context_grid, run_accumulation
from kvqbench.metrics import CATALOG
from kvqbench.numerics.attention import attention_error, expand_kv, kl_rows, least_squares_slope
from kvqbench.quantizers import create


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qkv(seed=0, b=1, hkv=2, hq=4, nq=5, t=48, d=16):
    g = _gen(seed)
    return (torch.randn(b, hq, nq, d, generator=g), torch.randn(b, hkv, t, d, generator=g),
            torch.randn(b, hkv, t, d, generator=g))


def test_identical_inputs_give_exactly_zero():
    q, k, v = _qkv()
    err = attention_error(q, k, v, k.clone(), v.clone())
    assert all(val == 0.0 for val in err.as_dict().values()), err


def test_one_token_shift_matches_closed_form():
    # V exact, K̂ = K + c on token j only: e_t = q·c for t = j, else 0. Per query (L tokens):
    # bias² = (q·c)²/L², var = (q·c)²(L−1)/L², mean e² = (q·c)²/L; attention-weighted K error = p_j‖c‖².
    q, k, v = (x.double() for x in _qkv(seed=1, hkv=1, hq=1, nq=3, t=40, d=8))
    c = torch.linspace(-1.0, 2.0, 8, dtype=torch.float64)
    j, length = 7, 40
    k_hat = k.clone()
    k_hat[0, 0, j] += c
    err = attention_error(q, k, v, k_hat, v)
    qc = (q[0, 0].double() @ c.double())  # (nq,)
    assert err.logit_bias2 == pytest.approx(float((qc**2 / length**2).mean()), rel=1e-12)
    assert err.logit_var == pytest.approx(float((qc**2 * (length - 1) / length**2).mean()), rel=1e-12)
    assert err.logit_mse == pytest.approx(float((qc**2 / length).mean()), rel=1e-12)
    p = torch.softmax(q[0, 0].double() @ k[0, 0].double().T / math.sqrt(8), dim=-1)
    assert err.attn_k_err == pytest.approx(float(p[:, j].mean() * (c.double() ** 2).sum()), rel=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_bias2_plus_variance_is_mean_square(seed):
    q, k, v = _qkv(seed=seed)
    g = _gen(100 + seed)
    err = attention_error(q, k, v, k + 0.3 * torch.randn(k.shape, generator=g) + 0.2, v)
    assert err.logit_bias2 + err.logit_var == pytest.approx(err.logit_mse, rel=1e-12)
    assert err.logit_bias2 > 0 and err.logit_var > 0


@pytest.mark.parametrize("seed", range(5))
def test_kl_nonnegative_and_zero_only_when_attention_unchanged(seed):
    q, k, v = _qkv(seed=seed)
    g = _gen(200 + seed)
    changed = attention_error(q, k, v, k + 0.2 * torch.randn(k.shape, generator=g), v)
    assert changed.kl_fwd > 0 and changed.kl_rev > 0
    # the same vector added to every key shifts each query's logits by a constant: attention unchanged,
    # so KL is 0 up to rounding although K̂ != K
    shift = torch.randn(k.shape[-1], generator=g)
    same = attention_error(q.double(), k.double(), v.double(), k.double() + shift.double(), v.double())
    assert 0.0 <= same.kl_fwd < 1e-12 and 0.0 <= same.kl_rev < 1e-12
    assert same.logit_var < 1e-18 * max(1.0, same.logit_bias2) + 1e-18
    assert same.logit_bias2 > 0  # the softmax-invariant part of the logit error


def test_kl_rows_properties():
    logp = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64), -1)
    logq = torch.log_softmax(torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64), -1)
    p = logp.exp()
    expected = float((p * (logp - logq)).sum())
    assert float(kl_rows(logp, logq)[0]) == pytest.approx(expected, rel=1e-14)
    assert float(kl_rows(logp, logp)[0]) == 0.0
    # a zero-probability entry contributes nothing (no NaN from 0·(−inf))
    logz = torch.tensor([[0.0, -math.inf]], dtype=torch.float64)
    assert float(kl_rows(logz, torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64)))[0]) == pytest.approx(math.log(2))


def test_gqa_query_head_reads_kv_head_h_div_group():
    q, k, v = _qkv(seed=3, hkv=2, hq=6, nq=4, t=20, d=8)
    g = _gen(9)
    k_hat = k + 0.1 * torch.randn(k.shape, generator=g)
    full = attention_error(q, k, v, k_hat, v)
    # per query head against its KV head, then averaged
    kls = []
    for h in range(6):
        kv = h // 3
        e = attention_error(q[:, h : h + 1], k[:, kv : kv + 1], v[:, kv : kv + 1], k_hat[:, kv : kv + 1], v[:, kv : kv + 1])
        kls.append(e.kl_fwd)
    assert full.kl_fwd == pytest.approx(sum(kls) / 6, rel=1e-12)
    assert torch.equal(expand_kv(k, 6)[:, 4], k[:, 1])


def test_shape_errors():
    q, k, v = _qkv(hkv=2, hq=3)
    with pytest.raises(ValueError, match="multiple"):
        attention_error(q, k, v, k, v)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="shape"):
        attention_error(q, k, v, k[..., :-1, :], v)


def test_least_squares_slope_and_grid():
    assert least_squares_slope([0.5, 1.0, 2.0], [1.5, 2.0, 3.0]) == pytest.approx(1.0)
    assert least_squares_slope([1.0], [3.0]) == 0.0
    assert context_grid(2048, 6, 64) == [320, 704, 1024, 1344, 1728, 2048]
    assert context_grid(100, 4, 32) == [32, 64, 100]
    assert all(length % 64 == 0 for length in context_grid(1024, 6, 64))


def _small(seed=0, t=128):
    return make_synthetic(seed=seed, batch=1, kv_heads=2, q_heads=4, seq_len=t, head_dim=32)


@pytest.mark.parametrize("bits", [2, 16])
def test_fp16_control_accumulates_exactly_zero_in_both_regimes(bits):
    res = run_accumulation(create("fp16", bits, bits), _small(), AccumulationConfig(n_lengths=4, n_queries=8, block=16))
    nonzero = {k: v for k, v in res.metrics.items() if "bits" not in k and v != 0.0}
    assert not nonzero
    for regime in ("static", "decode"):
        for name, values in res.series[regime].items():
            if name in ("bits_effective", "fp16_token_share"):
                continue
            assert all(x == 0.0 for x in values), (regime, name)
    assert res.metrics["decode_bits_effective"] == 16.0


def test_accumulation_metrics_are_catalogued_and_series_aligned():
    res = run_accumulation(create("rtn_token", 2, 2), _small(), AccumulationConfig(n_lengths=4, n_queries=8, block=16))
    missing = [k for k in res.metrics if k not in CATALOG]
    assert not missing
    assert all(CATALOG[k].experiment == "exp2" for k in res.metrics)
    n = len(res.series["context_lengths"])
    assert res.series["context_lengths"][-1] == 128
    for regime in ("static", "decode"):
        assert all(len(v) == n for v in res.series[regime].values())
        assert res.metrics[f"{regime}_attn_kl_fwd_nats"] > 0
    # rtn_token has no streaming rules: every arriving block is quantized, no fp16 token is billed
    assert res.series["decode"]["fp16_token_share"] == [0.0] * n


def test_accumulation_is_deterministic():
    cfg = AccumulationConfig(n_lengths=3, n_queries=8, block=32)
    a = run_accumulation(create("kivi", 2, 2, residual_tokens=32), _small(), cfg)
    b = run_accumulation(create("kivi", 2, 2, residual_tokens=32), _small(), cfg)
    assert a.metrics == b.metrics and a.series == b.series


def test_config_validation():
    with pytest.raises(ValueError):
        AccumulationConfig(block=0)
    with pytest.raises(ValueError):
        AccumulationConfig(regimes=("nope",))


def test_by_batch_matches_per_slice_and_pooled():
    from kvqbench.numerics.attention import attention_error_by_batch, attention_reference

    q, k, v = _qkv(seed=4, b=3, hkv=2, hq=4, nq=3, t=30, d=8)
    g = _gen(5)
    k_hat, v_hat = k + 0.2 * torch.randn(k.shape, generator=g), v + 0.1 * torch.randn(v.shape, generator=g)
    per = attention_error_by_batch(attention_reference(q, k, v), k_hat, v_hat)
    for i, e in enumerate(per):
        one = attention_error(q[i : i + 1], k[i : i + 1], v[i : i + 1], k_hat[i : i + 1], v_hat[i : i + 1])
        for name, val in one.as_dict().items():
            assert getattr(e, name) == pytest.approx(val, rel=1e-12, abs=1e-15), name
    pooled = attention_error(q, k, v, k_hat, v_hat)
    assert pooled.kl_fwd == pytest.approx(sum(e.kl_fwd for e in per) / 3, rel=1e-12)


def test_pareto_metric_at_matched_decode_budget():
    from kvqbench.report.stats.ranking import pareto_metric

    def e(v):
        return {"mean": v, "ci95": None, "n": 1, "seeds": [0], "values": [v]}

    stats = {"exp2": {
        "a": {"k2v2": {"decode_attn_kl_fwd_nats": e(0.5), "decode_bits_effective": e(2.2)}},
        "b": {"k2v2": {"decode_attn_kl_fwd_nats": e(0.2), "decode_bits_effective": e(2.9)},
              "k2v2-group_size32": {"decode_attn_kl_fwd_nats": e(0.0), "decode_bits_effective": e(1.0)}},
        "c": {"k2v2": {"decode_attn_kl_fwd_nats": e(0.6), "decode_bits_effective": e(2.5)}},
    }}
    out = pareto_metric(stats, budgets=(2.25, 3.0, 1.5))
    assert [p["method"] for p in out["front"]] == ["a", "b"]
    assert [m["method"] for m in out["matched_budget"]] == ["a", "b", None]
    assert out["matched_budget"][1]["runner_up"] == "a"
    # one seed: compared (ratios), no paired test, so no verdict rather than a tie
    row = out["matched_budget"][1]
    assert [(c["method"], c["p"]) for c in row["comparisons"]] == [("a", None), ("c", None)]
    assert row["ties"] == [] and "one shared unit" in row["no_verdict"]


@pytest.mark.parametrize("method", ["rtn_token", "kivi"])
def test_decode_errors_are_those_of_the_decode_states(method):
    """Each decode length's errors equal attention_error of the stream's state at that length (the
    reference), also when run_accumulation reuses the static errors for a state equal to the static
    reconstruction (rtn_token quantizes each token on its own: equal; KIVI's windows: not equal)."""
    from kvqbench.experiments.accumulation import PER_LENGTH_METRICS, _queries, _stream_states
    from kvqbench.experiments.common import roundtrip_kv

    data = make_synthetic(seed=3, batch=1, kv_heads=2, q_heads=4, seq_len=96, head_dim=32)
    cfg = AccumulationConfig(n_lengths=3, n_queries=4, block=16)
    res = run_accumulation(create(method, 2, 2), data, cfg)
    m = create(method, 2, 2)
    sk, sv = _stream_states(m, data, 16)
    equal = []
    for i, length in enumerate(res.series["context_lengths"]):
        k_state, v_state = sk.state(data.k, length), sv.state(data.v, length)
        static = roundtrip_kv(create(method, 2, 2), data.truncate(length))
        equal.append(torch.equal(k_state, static.k_hat) and torch.equal(v_state, static.v_hat))
        want = attention_error(_queries(data.q, length, 4), data.k[..., :length, :], data.v[..., :length, :],
                               k_state, v_state).as_dict()
        for field, suffix in PER_LENGTH_METRICS.items():
            assert res.series["decode"][suffix][i] == pytest.approx(want[field], rel=1e-12, abs=1e-15), suffix
    assert all(equal) == (method == "rtn_token") and any(equal) == (method == "rtn_token")


@pytest.mark.parametrize("seed", range(3))
def test_kl_and_logit_terms_match_the_term_by_term_forms(seed):
    # attention_error computes KL from row dot products (Σp·log p − Σp·log p̂) and the logit variance
    # from the centred error; a second, term-by-term implementation from the definitions
    q, k, v = (x.double() for x in _qkv(seed=seed, b=2, hkv=2, hq=4, nq=3, t=37, d=8))
    g = _gen(300 + seed)
    k_hat = k + 0.4 * torch.randn(k.shape, generator=g, dtype=torch.float64) + 0.1
    err = attention_error(q, k, v, k_hat, v)
    kk, kh = expand_kv(k, 4), expand_kv(k_hat, 4)
    logp = torch.log_softmax(q @ kk.transpose(-1, -2) / math.sqrt(8), -1)
    logq = torch.log_softmax(q @ kh.transpose(-1, -2) / math.sqrt(8), -1)
    assert err.kl_fwd == pytest.approx(float(kl_rows(logp, logq).mean()), rel=1e-12)
    assert err.kl_rev == pytest.approx(float(kl_rows(logq, logp).mean()), rel=1e-12)
    e = q @ kh.transpose(-1, -2) - q @ kk.transpose(-1, -2)
    assert err.logit_var == pytest.approx(float(e.var(-1, unbiased=False).mean()), rel=1e-12)
    assert err.logit_mse == pytest.approx(float((e * e).mean()), rel=1e-12)
