"""PolarQuant (arXiv:2502.00527): polar transform of RoPE pairs, min/max floor quantization decoded at
bin midpoints, the ±π seam, zero radii, bits accounting."""

from __future__ import annotations

import math

import pytest
import torch

from kvqbench.quantizers import create, get
from kvqbench.quantizers.polarquant import PolarQuant, from_polar, to_polar


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _pairs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Build K ``(1, 1, T, 2P)`` whose rotate-half pairs are ``(a[:, j], b[:, j])``."""
    return torch.cat([a, b], dim=-1)[None, None]


def test_registered_with_metadata() -> None:
    cls = get("polarquant")
    assert cls is PolarQuant
    assert cls.arxiv == "2502.00527" and cls.fidelity in ("faithful", "approximate")
    assert cls.grouped and cls.local_stats and not cls.rotation
    assert any("fp16" in d for d in cls.deltas)
    q = create("polarquant")
    assert q.params() == {"k_bits": 4, "v_bits": 4, "seed": 0, "group_size": 128, "v_fp16": False}


def test_r4t4_g128_bits() -> None:
    q = PolarQuant(4)
    x = _randn(2, 4, 256, 128)
    qt = q.quantize(x, "k")
    # 4 + 4 bits per pair = 4 bits/element; fp16 min & max of radius and angle per pair and group of
    # 128 tokens: 4·16 / (2·128) = 0.25
    assert qt.effective_bits() == pytest.approx(4.25)
    assert q.effective_bits_for("k", 4, (2, 4, 256, 128)) == pytest.approx(4.25)
    # benchmark budget: min as FP16 zero-point + range as FP8 scale → 4 + 2·24/256
    assert q.nominal_bits("k", (2, 4, 256, 128)) == pytest.approx(4.1875)
    assert q.quantize(x, "v").effective_bits() == pytest.approx(4 + 32 / 128)


def test_partial_group_bits_count_every_group() -> None:
    q = PolarQuant(3, group_size=64)
    x = _randn(1, 2, 100, 32)
    qt = q.quantize(x, "k")
    # 2 groups (64 + 36 tokens) per pair: 3 + 2 groups · 16 pairs · 64 bits / (100 · 32)
    assert qt.effective_bits() == pytest.approx(3 + 2 * 16 * 64 / (100 * 32))
    assert q.dequantize(qt).shape == x.shape


def test_pairs_are_rope_rotate_half_pairs() -> None:
    # each rotate-half pair (x_j, x_{j+D/2}) has a constant radius r_j over time: the decoded radius
    # is exact (its group min == max), which adjacent pairing (2j, 2j+1) would not give
    t, p = 200, 8
    theta = torch.linspace(0, 6.0, t)[:, None] + torch.arange(p)[None, :]
    r = torch.arange(1, p + 1, dtype=torch.float32)[None, :]
    x = _pairs(r * torch.cos(theta), r * torch.sin(theta))
    x_hat = PolarQuant(2).roundtrip(x, "k")
    rho_hat, _ = to_polar(x_hat[0, 0])
    torch.testing.assert_close(rho_hat, r.expand(t, p), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 4])
def test_error_within_half_bin_of_radius_and_angle(bits: int) -> None:
    x = _randn(1, 2, 128, 16, seed=3)
    x_hat = PolarQuant(bits, group_size=128).roundtrip(x, "k")
    rho, phi = to_polar(x.double())
    rho_hat, phi_hat = to_polar(x_hat.double())
    s_rho = (rho.amax(2, keepdim=True) - rho.amin(2, keepdim=True)) / 2**bits
    s_phi = (phi.amax(2, keepdim=True) - phi.amin(2, keepdim=True)) / 2**bits
    assert bool(((rho_hat - rho).abs() <= s_rho / 2 + 1e-5).all())
    dphi = torch.remainder(phi_hat - phi + math.pi, 2 * math.pi) - math.pi  # angular difference
    assert bool((dphi.abs() <= s_phi / 2 + 1e-4).all())


def test_angle_range_and_seam_at_pi() -> None:
    # atan2 returns ±π on the negative axis depending on the sign of zero: both map to π
    a = torch.tensor([[-1.0, -1.0, 1.0, 0.0]])
    b = torch.tensor([[0.0, -0.0, -1e-30, 0.0]])
    rho, phi = to_polar(torch.cat([a, b], -1))
    assert phi[0, 0].item() == pytest.approx(math.pi) and phi[0, 1].item() == pytest.approx(math.pi)
    assert 0.0 <= phi[0, 2].item() < 2 * math.pi  # tiny negative angle: folded, never 2π
    assert rho[0, 3].item() == 0.0 and phi[0, 3].item() == 0.0


def test_cluster_across_pi_seam_is_not_split() -> None:
    # angles in π ± 0.01 (crossing atan2's ±π seam): the group's angle range is 0.02, not ~2π, so the
    # decoded angle is within 0.02/2^b/2 of the truth
    t = 128
    g = torch.Generator().manual_seed(5)
    ang = math.pi + (torch.rand(t, 4, generator=g) * 0.02 - 0.01)
    x = _pairs(torch.cos(ang), torch.sin(ang))
    x_hat = PolarQuant(4).roundtrip(x.double(), "k")
    _, phi_hat = to_polar(x_hat[0, 0])
    _, phi = to_polar(x[0, 0].double())
    assert float((phi_hat - phi).abs().max()) <= 0.02 / 16 / 2 + 1e-9
    assert float((x_hat - x).abs().max()) < 1e-3


def test_zero_radius_decodes_to_zero() -> None:
    x = torch.zeros(1, 2, 64, 16)
    x_hat = PolarQuant(4).roundtrip(x, "k")
    assert torch.equal(x_hat, torch.zeros_like(x))
    # one pair all zero among non-zero pairs: its group min == max == 0 → exactly 0
    y = _randn(1, 1, 64, 16, seed=2)
    y[..., 3] = 0.0
    y[..., 3 + 8] = 0.0
    y_hat = PolarQuant(2).roundtrip(y, "k")
    assert not torch.isnan(y_hat).any()
    assert torch.equal(y_hat[..., 3], torch.zeros(1, 1, 64)) and torch.equal(y_hat[..., 11], torch.zeros(1, 1, 64))


def test_constant_input_round_trips_exactly() -> None:
    x = torch.full((1, 2, 50, 8), -0.75)
    x_hat = PolarQuant(1).roundtrip(x, "k")
    torch.testing.assert_close(x_hat, x, rtol=1e-6, atol=1e-6)
    assert torch.equal(PolarQuant(1).roundtrip(x, "v"), x)


def test_odd_head_dim_raises() -> None:
    with pytest.raises(ValueError, match="even head_dim"):
        PolarQuant(4).quantize(_randn(1, 1, 8, 7), "k")


def test_bits_above_8_below_16_raise() -> None:
    with pytest.raises(ValueError, match="1..8"):
        PolarQuant(9).quantize(_randn(1, 1, 8, 8), "k")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtype_and_shape_preserved(dtype: torch.dtype) -> None:
    x = _randn(2, 3, 40, 16, dtype=dtype)
    for kind in ("k", "v"):
        x_hat = PolarQuant(4).roundtrip(x, kind)
        assert x_hat.dtype == dtype and x_hat.shape == x.shape
        assert torch.isfinite(x_hat.float()).all()


def test_v_fp16_variant_is_exact_and_billed_16() -> None:
    x = _randn(1, 2, 64, 32)
    q = PolarQuant(4, v_fp16=True)
    qt = q.quantize(x, "v")
    assert torch.equal(q.dequantize(qt), x)
    assert qt.effective_bits() == 16.0 and q.nominal_bits("v") == 16.0
    assert q.params()["v_fp16"] is True
    # K is unaffected by the V option
    torch.testing.assert_close(q.roundtrip(x, "k"), PolarQuant(4).roundtrip(x, "k"))


def test_more_bits_less_error_and_16_is_exact() -> None:
    x = _randn(1, 4, 256, 64, seed=9)
    errs = [float(((PolarQuant(b).roundtrip(x, "k") - x) ** 2).mean()) for b in (2, 3, 4, 6)]
    assert errs == sorted(errs, reverse=True)
    assert torch.equal(PolarQuant(16).roundtrip(x, "k"), x)


def test_polar_round_trip_identity() -> None:
    x = _randn(3, 10, 12, dtype=torch.float64)
    torch.testing.assert_close(from_polar(*to_polar(x)), x, rtol=1e-12, atol=1e-12)


def test_bad_options_raise() -> None:
    with pytest.raises(ValueError, match="group_size"):
        PolarQuant(4, group_size=0)
    with pytest.raises(ValueError, match="v_fp16"):
        PolarQuant(4, v_fp16="yes")  # type: ignore[arg-type]
