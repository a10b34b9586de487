"""Kitty (arXiv:2511.18643): paged per-channel K with a top-|K| channel boost, per-token V, the
two-plane storage and its bits, stream policy."""

from __future__ import annotations

import pytest
import torch

from kvqbench.quantizers import StreamPolicy, get
from kvqbench.quantizers.kitty import Kitty, boost_count


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _ramped(b: int, h: int, t: int, d: int, *, seed: int = 0) -> torch.Tensor:
    """Channel c has magnitude ∝ (1 + c) (a known ranking), with a random channel order per head."""
    x = _randn(b, h, t, d, seed=seed).abs() + 0.5
    scale = torch.arange(1, d + 1, dtype=torch.float32)
    perm = torch.stack([torch.randperm(d, generator=torch.Generator().manual_seed(seed + i)) for i in range(h)])
    return x * scale[perm][None, :, None, :] * torch.where(_randn(b, h, t, d, seed=seed + 99) > 0, 1.0, -1.0)


def test_registered_with_metadata() -> None:
    cls = get("kitty")
    assert cls is Kitty and cls.arxiv == "2511.18643" and cls.grouped and not cls.rotation
    assert Kitty().params() == {
        "k_bits": 2, "v_bits": 2, "seed": 0, "group_size": 128, "boost_fraction": 0.25,
    }
    assert len(cls.deltas) >= 3


def test_k2v2_bits_at_d128() -> None:
    q = Kitty(2)
    x = _randn(1, 4, 512, 128)
    k_qt, v_qt = q.quantize(x, "k"), q.quantize(x, "v")
    # K: 2 (low plane) + 2·32/128 (high plane) + (16 + 16)/128 (scale, min) + 8/128 (uint8 map)
    assert k_qt.effective_bits() == pytest.approx(2.8125)
    # V: 2 + (16 + 16)/128
    assert v_qt.effective_bits() == pytest.approx(2.25)
    assert q.nominal_bits("k", (1, 4, 512, 128)) == pytest.approx(2.75)
    assert q.nominal_bits("v", (1, 4, 512, 128)) == pytest.approx(2.1875)
    for kind, qt in (("k", k_qt), ("v", v_qt)):
        assert q.effective_bits_for(kind, 2, tuple(x.shape)) == pytest.approx(qt.effective_bits())


@pytest.mark.parametrize(
    ("fraction", "expected"), [(0.0, 0), (0.1, 12), (0.15, 19), (0.2, 25), (0.25, 32), (0.5, 64), (1.0, 128)]
)
def test_boosts_exactly_the_fraction_asked(fraction: float, expected: int) -> None:
    assert boost_count(128, fraction) == expected
    x = _randn(2, 3, 300, 128, seed=1)  # 3 pages, the last partial
    qt = Kitty(2, boost_fraction=fraction).quantize(x, "k")
    cmap = qt.codes("channel_map")  # (B, H, pages, D)
    assert cmap.shape == (2, 3, 3, 128)
    boosted = cmap < expected
    assert bool((boosted.sum(-1) == expected).all())
    # every page's boosted channels occupy slots 0..n-1 exactly once
    slots = torch.sort(torch.where(boosted, cmap, torch.full_like(cmap, 10**6)), dim=-1).values[..., :expected]
    assert torch.equal(slots, torch.arange(expected).expand_as(slots))
    assert qt.meta["high.numel"] == 2 * 3 * expected * 300
    eff = 2 + 2 * expected / 128 + 3 * 128 * (32 + 8) / (300 * 128)
    assert qt.effective_bits() == pytest.approx(eff)


def test_boosted_channels_are_the_largest_mean_abs() -> None:
    x = _ramped(1, 4, 256, 64, seed=3)
    qt = Kitty(2, boost_fraction=0.25).quantize(x, "k")
    cmap = qt.codes("channel_map")
    score = x.abs().reshape(1, 4, 2, 128, 64).mean(3)  # mean |K| per page and channel
    expected = torch.zeros_like(cmap, dtype=torch.bool).scatter_(-1, score.topk(16, dim=-1).indices, True)
    assert torch.equal(cmap < 16, expected)
    # slot j holds the j-th largest channel
    order = score.argsort(dim=-1, descending=True)[..., :16]
    assert torch.equal(torch.gather(cmap, -1, order), torch.arange(16).expand(1, 4, 2, 16))


def test_partial_page_scores_only_real_tokens() -> None:
    # the last page has 10 tokens; channel 5 is huge only there — it must be boosted in page 1
    x = _randn(1, 1, 138, 32, seed=4) * 0.1
    x[0, 0, 128:, 5] = 50.0
    cmap = Kitty(2, boost_fraction=1 / 32).quantize(x, "k").codes("channel_map")
    assert int(cmap[0, 0, 1, 5]) == 0


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_error_bounds_per_channel_precision(bits: int) -> None:
    x = _randn(1, 2, 256, 64, seed=5)
    q = Kitty(bits, boost_fraction=0.25)
    qt = q.quantize(x, "k")
    x_hat = q.dequantize(qt)
    pages = x.reshape(1, 2, 2, 128, 64)
    rng = pages.amax(3) - pages.amin(3)  # (B, H, pages, D)
    boosted = qt.codes("channel_map") < 16
    levels = torch.where(boosted, 2 ** (bits + 2) - 1, 2**bits - 1)
    half_step = (rng / levels / 2)[:, :, :, None, :]
    err = (x_hat - x).abs().reshape(1, 2, 2, 128, 64)
    assert bool((err <= half_step * (1 + 1e-5) + 1e-6).all())


def test_boost_reduces_error_on_outlier_channels() -> None:
    x = _ramped(1, 4, 256, 128, seed=6)
    e = {f: float(((Kitty(2, boost_fraction=f).roundtrip(x, "k") - x) ** 2).mean()) for f in (0.0, 0.1, 0.25)}
    assert e[0.25] < e[0.1] < e[0.0]


def test_zero_boost_and_full_boost() -> None:
    x = _randn(1, 2, 128, 16, seed=7)
    plain = Kitty(2, boost_fraction=0.0)
    qt = plain.quantize(x, "k")
    assert qt.meta["high.numel"] == 0
    # with no boost every channel is plain 2-bit per page: compare with an explicit per-channel RTN
    lo, hi = x.amin(2, keepdim=True), x.amax(2, keepdim=True)
    scale = (hi - lo) / 3
    ref = torch.floor((x - lo) / scale + 0.5).clamp(0, 3) * scale + lo
    torch.testing.assert_close(plain.dequantize(qt), ref, rtol=1e-6, atol=1e-6)
    full = Kitty(2, boost_fraction=1.0).roundtrip(x, "k")
    scale4 = (hi - lo) / 15
    ref4 = torch.floor((x - lo) / scale4 + 0.5).clamp(0, 15) * scale4 + lo
    torch.testing.assert_close(full, ref4, rtol=1e-6, atol=1e-6)


def test_v_is_per_token_asym() -> None:
    x = _randn(2, 2, 40, 32, seed=8)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (hi - lo) / 3
    ref = torch.floor((x - lo) / scale + 0.5).clamp(0, 3) * scale + lo
    torch.testing.assert_close(Kitty(2).roundtrip(x, "v"), ref, rtol=1e-6, atol=1e-6)


def test_constant_zero_and_one_sign_inputs() -> None:
    q = Kitty(2)
    for x in (torch.zeros(1, 2, 130, 32), torch.full((1, 2, 130, 32), 3.25), _randn(1, 2, 130, 32).abs() + 1):
        for kind in ("k", "v"):
            x_hat = q.roundtrip(x, kind)
            assert torch.isfinite(x_hat).all()
            if bool((x == x.flatten()[0]).all()):
                assert torch.equal(x_hat, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtype_and_shape_preserved(dtype: torch.dtype) -> None:
    x = _randn(2, 3, 200, 64, dtype=dtype)
    for kind in ("k", "v"):
        x_hat = Kitty(2).roundtrip(x, kind)
        assert x_hat.dtype == dtype and x_hat.shape == x.shape


def test_more_bits_less_error_and_16_is_exact() -> None:
    x = _randn(1, 2, 256, 64, seed=9)
    errs = [float(((Kitty(b).roundtrip(x, "k") - x) ** 2).mean()) for b in (1, 2, 3, 4, 8)]
    assert errs == sorted(errs, reverse=True)
    assert torch.equal(Kitty(16).roundtrip(x, "k"), x)


def test_stream_policy() -> None:
    q = Kitty(2, group_size=128)
    assert q.stream_policy("k") == StreamPolicy(sink_tokens=32, tile_tokens=128)
    assert q.stream_policy("v") == StreamPolicy(
        sink_tokens=32, residual_tokens=128, residual_mode="sliding", tile_tokens=128
    )


def test_group_size_is_page_size() -> None:
    x = _randn(1, 1, 64, 128, seed=10)
    qt = Kitty(2, group_size=32).quantize(x, "k")
    assert qt.codes("channel_map").shape == (1, 1, 2, 128)
    assert qt.effective_bits() == pytest.approx(2 + 0.5 + 40 / 32)


def test_bad_options_raise() -> None:
    for kw in ({"boost_fraction": -0.1}, {"boost_fraction": 1.5}, {"boost_fraction": "x"}, {"group_size": 0}):
        with pytest.raises(ValueError):
            Kitty(2, **kw)
    with pytest.raises(ValueError, match="uint8"):
        Kitty(2, boost_fraction=1.0).quantize(torch.ones(1, 1, 4, 512), "k")
    with pytest.raises(ValueError, match="1..8"):
        Kitty(12).quantize(torch.ones(1, 1, 4, 8), "k")


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_scale_is_floored_range_over_levels(bits: int) -> None:
    """docs/DESIGN.md §7 / reference: ``scale = max(hi − lo, eps)/(2^b − 1)`` — the floor is on the range. A
    group whose range lies between eps and eps·(2^b − 1) tells it apart from ``max(range/levels, eps)``
    (which would give exactly eps there), and a two-valued such group then round-trips to both values."""
    from kvqbench.quantizers.kitty import EPS

    levels = (1 << bits) - 1
    spread = EPS * (1.0 + 0.8 * (levels - 1)) if levels > 1 else EPS * 0.5  # 1-bit: below eps → floored
    t, d = 128, 8
    lo = torch.linspace(-1.0, 1.0, d)
    pattern = (torch.arange(t) % 2).to(torch.float32)[:, None]  # two values per channel / per token
    xk = (lo[None, :] + spread * pattern)[None, None]  # (1, 1, T, D): per-channel range = spread
    q = Kitty(bits, boost_fraction=0.0)
    qt = q.quantize(xk, "k")
    rng = xk.amax(2) - xk.amin(2)  # (1, 1, D) actual fp32 ranges
    expected = torch.clamp(rng, min=EPS) / levels
    torch.testing.assert_close(qt["scale"].reshape(expected.shape), expected, rtol=1e-6, atol=0)
    if levels > 1:
        assert bool((rng > EPS).all() and (rng < EPS * levels).all())
        assert not torch.allclose(qt["scale"].reshape(expected.shape), torch.full_like(expected, EPS))
        torch.testing.assert_close(q.dequantize(qt), xk, rtol=0, atol=1.5e-7)
    # V: per token over head_dim, same closed form (data of magnitude >= 1, where the floor is the
    # reference's absolute EPS; below magnitude 1 it scales with the data, see test_range_floor_is_relative)
    xv = (1.0 + torch.linspace(0.0, spread, 16)).repeat(1, 2, 40, 1)
    qv = Kitty(bits).quantize(xv, "v")
    rv = xv.amax(-1, keepdim=True) - xv.amin(-1, keepdim=True)
    torch.testing.assert_close(qv["scale"], torch.clamp(rv, min=EPS) / levels, rtol=1e-6, atol=0)
    # boosted channels (b + 2 bits) use the same form with their own level count
    boosted = Kitty(bits, boost_fraction=1.0).quantize(xk, "k")
    torch.testing.assert_close(
        boosted["scale"].reshape(expected.shape),
        torch.clamp(rng, min=EPS) / ((1 << (bits + 2)) - 1), rtol=1e-6, atol=0,
    )
    # constant groups still round-trip exactly and never produce NaN
    const = torch.full((1, 1, 128, 8), 0.375)
    for kind in ("k", "v"):
        assert torch.equal(Kitty(bits, boost_fraction=0.25).roundtrip(const, kind), const)


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("exp", [-100, -40, -20, 0, 20, 60])
def test_range_floor_is_relative(kind: str, exp: int) -> None:
    """At any power-of-two scale 2^exp the round trip is exactly 2^exp times the round trip at scale 1
    (the floor scales with the data below magnitude 1): tiny data do not collapse to group minima."""
    x = torch.randn(1, 2, 160, 32, generator=torch.Generator().manual_seed(5))
    x = x / x.abs().amax() * 1.5  # magnitude in [1, 2): the reference's EPS applies at scale 1
    s = 2.0**exp
    y1 = Kitty(2).roundtrip(x, kind)
    ys = Kitty(2).roundtrip(x * s, kind)
    assert torch.equal(ys, y1 * s)
    assert ((y1 - x).norm() / x.norm()).item() < 0.6
