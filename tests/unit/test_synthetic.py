"""Synthetic K/V/Q: determinism, shapes, the lognormal norm law, outlier channels, device handling."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from kvqbench.data import KVData, make_synthetic


def test_same_seed_gives_identical_tensors() -> None:
    a = make_synthetic(seed=7, seq_len=64, head_dim=32)
    b = make_synthetic(seed=7, seq_len=64, head_dim=32)
    for name in ("k", "v", "q"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.meta == b.meta


def test_different_seeds_differ() -> None:
    a = make_synthetic(seed=0, seq_len=64, head_dim=32)
    b = make_synthetic(seed=1, seq_len=64, head_dim=32)
    for name in ("k", "v", "q"):
        assert not torch.equal(getattr(a, name), getattr(b, name)), name


def test_global_rng_untouched() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    make_synthetic(seed=0, seq_len=16, head_dim=16)
    assert torch.equal(torch.get_rng_state(), before)


def test_shapes_dtype_and_source() -> None:
    d = make_synthetic(seed=0, batch=3, kv_heads=2, seq_len=40, head_dim=16)
    assert isinstance(d, KVData)
    assert d.source == "synthetic"
    assert d.k.shape == d.v.shape == (3, 2, 40, 16)
    assert d.q.shape == (3, 4, 40, 16)  # default q_heads = 2 * kv_heads (GQA)
    assert {d.k.dtype, d.v.dtype, d.q.dtype} == {torch.float32}
    assert d.k_pre is None and d.cos is None and d.sin is None and not d.has_rope
    assert d.k_grad2 is None and d.v_grad2 is None
    assert all(bool(torch.isfinite(x).all()) for x in (d.k, d.v, d.q))


def test_q_heads_does_not_change_k_and_v() -> None:
    a = make_synthetic(seed=3, kv_heads=2, q_heads=2, seq_len=32, head_dim=16)
    b = make_synthetic(seed=3, kv_heads=2, q_heads=8, seq_len=32, head_dim=16)
    assert b.q.shape == (1, 8, 32, 16)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_log_norms_are_normal_with_sigma() -> None:
    sigma = 1.0
    d = make_synthetic(seed=0, batch=2, kv_heads=4, seq_len=1024, head_dim=64, norm_sigma=sigma)
    for x in (d.v, d.q):  # no outliers: norms are exactly the lognormal draw
        log_norm = x.norm(dim=-1).log().flatten()
        n = log_norm.numel()
        # the sample sd of n normal draws has standard error ≈ σ/√(2n); allow 5 of those
        assert abs(float(log_norm.std()) - sigma) < 5 * sigma / math.sqrt(2 * n)
        assert abs(float(log_norm.mean()) - math.log(math.sqrt(64))) < 5 * sigma / math.sqrt(n)


def test_zero_sigma_gives_constant_norms() -> None:
    d = make_synthetic(seed=0, seq_len=32, head_dim=16, norm_sigma=0.0, n_outlier_channels=0)
    torch.testing.assert_close(d.k.norm(dim=-1), torch.full((1, 2, 32), 4.0))


def test_outlier_channels_have_channel_gain_magnitude() -> None:
    gain = 10.0
    d = make_synthetic(seed=5, kv_heads=4, seq_len=2048, head_dim=64, channel_gain=gain)
    chans = d.meta["outlier_channels"]
    assert len(chans) == 4 == d.meta["n_outlier_channels"]
    assert chans == sorted(set(chans)) and all(0 <= c < 64 for c in chans)
    mag = d.k.abs().mean(dim=(0, 1, 2))  # mean |k| per channel
    normal = torch.ones(64, dtype=torch.bool)
    normal[chans] = False
    ratio = mag[chans] / mag[normal].mean()
    assert torch.all((ratio > 0.85 * gain) & (ratio < 1.15 * gain)), ratio
    # the same channels stand out in every head (persistent), and V and Q have none
    per_head = d.k.abs().mean(dim=(0, 2))  # (heads, D)
    assert all(set(per_head[h].topk(4).indices.tolist()) == set(chans) for h in range(4))
    for x in (d.v, d.q):
        m = x.abs().mean(dim=(0, 1, 2))
        assert float(m.max() / m.mean()) < 1.3


def test_no_outliers_option() -> None:
    d = make_synthetic(seed=0, seq_len=16, head_dim=16, n_outlier_channels=0)
    assert d.meta["outlier_channels"] == []


def test_meta_records_generator_parameters() -> None:
    d = make_synthetic(seed=11, kv_heads=1, q_heads=3, seq_len=8, head_dim=8, norm_sigma=0.5,
                       n_outlier_channels=2, channel_gain=4.0)
    m = d.meta
    assert m["seed"] == 11 and m["q_heads"] == 3 and m["kv_heads"] == 1
    assert m["norm_sigma"] == 0.5 and m["channel_gain"] == 4.0 and m["n_outlier_channels"] == 2
    assert m["norm_distribution"] == "lognormal" and m["rope"] is None


def test_device_param() -> None:
    a = make_synthetic(seed=0, seq_len=16, head_dim=16, device=torch.device("cpu"))
    assert a.k.device.type == "cpu"
    with pytest.raises(ValueError, match="device"):
        make_synthetic(seed=0, device="not-a-device")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gives_the_same_numbers() -> None:
    cpu = make_synthetic(seed=2, seq_len=64, head_dim=32)
    gpu = make_synthetic(seed=2, seq_len=64, head_dim=32, device="cuda")
    assert gpu.k.is_cuda and gpu.q.is_cuda
    assert torch.equal(gpu.k.cpu(), cpu.k) and torch.equal(gpu.v.cpu(), cpu.v)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 0, "batch": 0}, "batch"),
        ({"seed": 0, "kv_heads": 2, "q_heads": 3}, "multiple"),
        ({"seed": 0, "seq_len": True}, "seq_len"),
        ({"seed": 0, "head_dim": 8, "n_outlier_channels": 9}, "n_outlier_channels"),
        ({"seed": 0, "norm_sigma": -0.1}, "norm_sigma"),
        ({"seed": 0, "norm_sigma": float("nan")}, "norm_sigma"),
        ({"seed": 0, "channel_gain": 0.0}, "channel_gain"),
        ({"seed": 0, "channel_gain": float("inf")}, "channel_gain"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_synthetic(**kwargs)


def test_synthetic_path_never_imports_transformers() -> None:
    code = (
        "import sys\n"
        "import kvqbench.data\n"
        "from kvqbench.data import make_synthetic\n"
        "make_synthetic(seed=0, seq_len=8, head_dim=8)\n"
        "print('transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
