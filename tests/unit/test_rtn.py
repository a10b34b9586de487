"""Asym RTN numerics and the RTN family / KIVI against closed forms."""

import pytest
import torch

from kvqbench.numerics.rtn import PerChannel, PerTensor, PerToken, rtn_quantize, rtn_roundtrip, to_groups
from kvqbench.quantizers import create


def test_uniform_data_mse_matches_scale_squared_over_12():
    # data uniform within each group: the rounding error is uniform on [-s/2, s/2] → MSE = s²/12
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1, 4, 4096, 64, generator=g, dtype=torch.float64) * 3.0 - 1.0
    for bits in (2, 3, 4, 6):
        codes, lo, scale = rtn_quantize(x, bits, PerToken())
        xh = rtn_roundtrip(x, bits, PerToken())
        expected = float((scale**2).mean()) / 12.0
        got = float(((xh - x) ** 2).mean())
        assert got == pytest.approx(expected, rel=0.05), bits


def test_two_valued_group_roundtrips_exactly():
    x = torch.tensor([0.25, -1.5, 0.25, 0.25, -1.5, -1.5, 0.25, -1.5]).view(1, 1, 1, 8)
    for bits in (1, 2, 3, 4, 8):
        assert torch.equal(rtn_roundtrip(x, bits, PerToken()), x)


@pytest.mark.parametrize("value", [0.0, 0.1, -3.7, 1e-8])
def test_constant_group_roundtrips_exactly_without_nan(value):
    x = torch.full((1, 2, 16, 8), value)
    for gran in (PerTensor(), PerToken(), PerChannel(), PerChannel(4)):
        y = rtn_roundtrip(x, 2, gran)
        assert torch.equal(y, x)


def test_error_bounded_by_half_scale():
    x = torch.randn(2, 3, 50, 32, generator=torch.Generator().manual_seed(1))
    codes, lo, scale = rtn_quantize(x, 3, PerChannel(16))
    xh = rtn_roundtrip(x, 3, PerChannel(16))
    xg, restore = to_groups(x, -2, 16)
    half = restore((scale / 2).expand_as(xg))
    assert bool(((xh - x).abs() <= half + 1e-6).all())
    assert int(codes.min()) >= 0 and int(codes.max()) <= 7


def test_to_groups_partial_group_restores_layout():
    x = torch.arange(2 * 3 * 10 * 4, dtype=torch.float32).view(2, 3, 10, 4)
    xg, restore = to_groups(x, -2, 4)
    assert xg.shape == (2, 3, 4, 3, 4)  # (B, H, D, n_groups, G)
    assert torch.equal(restore(xg), x)


def test_kivi_bits_accounting_g128():
    q = create("kivi", 2, 2, group_size=128)
    shape = (1, 2, 512, 128)
    assert q.nominal_bits("k", shape) == pytest.approx(2.1875)
    assert q.nominal_bits("v", shape) == pytest.approx(2.1875)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    assert q.quantize(x, "k").effective_bits() == pytest.approx(2.25)
    assert q.quantize(x, "v").effective_bits() == pytest.approx(2.25)


def test_kivi_g32_effective_is_3_bits():
    q = create("kivi", 2, 2, group_size=32)
    x = torch.randn(1, 1, 256, 128, generator=torch.Generator().manual_seed(0))
    assert q.quantize(x, "k").effective_bits() == pytest.approx(3.0)


def test_kivi_matches_loop_reference():
    # second implementation: explicit loops over (channel, token group) for K, (token, channel group) for V
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1, 64, 16, generator=g, dtype=torch.float64)
    q = create("kivi", 3, 3, group_size=16)
    ref_k = torch.empty_like(x)
    for c in range(16):
        for t0 in range(0, 64, 16):
            grp = x[0, 0, t0 : t0 + 16, c]
            lo, hi = grp.min(), grp.max()
            s = (hi - lo) / 7
            ref_k[0, 0, t0 : t0 + 16, c] = torch.clamp(torch.round((grp - lo) / s), 0, 7) * s + lo
    assert torch.allclose(q.roundtrip(x, "k"), ref_k, atol=1e-12)
    ref_v = torch.empty_like(x)
    for t in range(64):
        grp = x[0, 0, t]
        lo, hi = grp.min(), grp.max()
        s = (hi - lo) / 7
        ref_v[0, 0, t] = torch.clamp(torch.round((grp - lo) / s), 0, 7) * s + lo
    assert torch.allclose(q.roundtrip(x, "v"), ref_v, atol=1e-12)


def test_fp16_is_billed_16_bits_and_exact():
    q = create("fp16", 2, 2)
    x = torch.randn(1, 2, 32, 64)
    qt = q.quantize(x, "k")
    assert qt.effective_bits() == 16.0 and q.nominal_bits("k") == 16.0
    assert torch.equal(q.dequantize(qt), x)


@pytest.mark.parametrize("kind", ["k", "v"])
def test_kivi_representation_decodes_with_a_default_instance(kind: str) -> None:
    """Issue 9: the group size travels in the representation; a default KIVI (G = 128) decodes a G = 32
    representation like its maker, equal to per-group RTN computed directly."""
    from kvqbench.quantizers.kivi import KIVI

    x = torch.randn(1, 2, 129, 64, generator=torch.Generator().manual_seed(2))
    qt = KIVI(2, group_size=32).quantize(x, kind)
    gran = PerChannel(32) if kind == "k" else PerToken(32)
    assert torch.equal(KIVI().dequantize(qt), KIVI(2, group_size=32).dequantize(qt))
    assert torch.equal(KIVI().dequantize(qt), rtn_roundtrip(x, 2, gran))
