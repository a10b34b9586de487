"""Inherent behaviours of methods (docs/PAPERS.md, "Inherent behaviours"): not bugs, pinned so that a change
in them is noticed. Each test states the mechanism with a closed form or a comparison method.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvqbench.numerics.hadamard import hadamard_transform
from kvqbench.quantizers import create


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _dev_err(y: torch.Tensor, x: torch.Tensor, offset: float) -> float:
    """Error relative to the deviation from the offset (reconstructing the offset alone scores 1)."""
    return float((y.double() - x.double()).norm() / (x.double() - offset).norm())


# --- rotation methods and a large common offset across channels --------------------------------------
def test_hadamard_concentrates_a_common_offset_in_one_coordinate():
    d, c = 64, 100.0
    rotated = hadamard_transform(torch.full((1, 1, 1, d), c))
    want = torch.zeros(d)
    want[0] = c * math.sqrt(d)  # first row of the Sylvester matrix is all ones
    torch.testing.assert_close(rotated.reshape(-1), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("method_id", "kind"),
                         [("quarot", "k"), ("quarot", "v"), ("turboquant", "k"), ("turboquant", "v"), ("kvarn", "v")])
def test_rotation_methods_lose_the_deviation_under_a_large_common_offset(method_id, kind):
    """x = 100 + N(0, 1): after the rotation one coordinate holds 100·√D and sets each token's range (or
    dominates its norm), so the other coordinates, which carry the deviation, are quantized on a grid
    that is far too coarse: at 4 bits the error exceeds the deviation itself. A method without rotation
    that quantizes per token (rtn_token: range ≈ 100 ± 3) keeps the deviation."""
    x = 100.0 + _randn(1, 2, 128, 64, seed=1)
    rotated = create(method_id, 4, 4).roundtrip(x, kind)
    plain = create("rtn_token", 4, 4).roundtrip(x, kind)
    assert _dev_err(rotated, x, 100.0) > 1.0
    assert _dev_err(plain, x, 100.0) < 0.15


@pytest.mark.parametrize("variant", ["mse", "prod"])
def test_turboquant_hadamard_keeps_a_constant_token_in_one_coordinate(variant):
    """A constant token is pure offset: H/√D maps its unit vector to (1, 0, …, 0), far beyond the
    largest centroid of the Lloyd–Max codebook for N(0, 1/D) (≈ 0.5 at D = 64, 7–8 bits), so even at
    8 bits most of it is lost; the default Haar rotation spreads it over every coordinate."""
    x = torch.full((1, 1, 8, 64), 0.75)
    cent, _ = create("turboquant", 8, 8)._codebook({"codebook": "gaussian"}, 8, 64, "cpu", torch.float64)
    assert float(cent.max()) < 0.6
    had = create("turboquant", 8, 8, rotation="hadamard", variant=variant).roundtrip(x, "v")
    rnd = create("turboquant", 8, 8, variant=variant).roundtrip(x, "v")
    assert float((had - x).norm() / x.norm()) > 0.3
    assert float((rnd - x).norm() / x.norm()) < 0.05


def test_kvarn_keys_keep_the_deviation_under_a_common_offset():
    """KVarN's K tile has the rotated channels as rows and rounds each row over its tokens: the
    concentrated coordinate is a row of its own (≈ 100·√D ± noise), so the offset costs nothing there."""
    x = 100.0 + _randn(1, 2, 128, 64, seed=1)
    assert _dev_err(create("kvarn", 4, 4).roundtrip(x, "k"), x, 100.0) < 0.15


# --- QuaRot's 0.95 clip -------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_quarot_clip_puts_a_floor_under_the_error(bits, kind):
    """A constant token rotates to (c·√D, 0, …, 0); the clipped range tops out at 0.95·c·√D, which is
    what the top code decodes to, so the error is exactly 5 % of the token at every bit width. Without
    the clip (clip_ratio = 1) the same token round-trips exactly."""
    x = torch.full((1, 1, 4, 64), 0.75)
    err = float((create("quarot", bits, bits).roundtrip(x, kind) - x).norm() / x.norm())
    assert err == pytest.approx(1 - 0.95, rel=1e-5)
    exact = create("quarot", bits, bits, clip_ratio=1.0).roundtrip(x, kind)
    torch.testing.assert_close(exact, x, rtol=0, atol=1e-6)


def test_quarot_error_floor_on_random_data():
    """On Gaussian data the clip costs every token its largest rotated coordinate's top 5 %: from 6 bits
    on the error stops falling like 2^-b (clip_ratio = 1 keeps falling)."""
    x = _randn(1, 2, 256, 64, seed=2)
    err = {(b, r): float((create("quarot", b, b, clip_ratio=r).roundtrip(x, "v") - x).norm() / x.norm())
           for b in (6, 8) for r in (0.95, 1.0)}
    assert err[(8, 1.0)] < err[(6, 1.0)] / 3  # unclipped: ≈ 4× per 2 bits
    assert err[(8, 0.95)] > err[(6, 0.95)] / 2  # clipped: the floor dominates
    assert err[(8, 0.95)] > 3 * err[(8, 1.0)]


# --- rtn_tensor with one channel 100× larger --------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rtn_tensor_one_large_channel_sets_the_whole_grid(bits):
    """One (scale, zero) for the whole tensor: a channel 100× larger sets the range, the step
    (max − min)/(2^b − 1) is far above the other channels' spread and they decode to one or two grid
    levels — an error larger than the channels themselves. Per-channel RTN is unaffected."""
    x = _randn(1, 2, 128, 64, seed=3)
    x[..., 5] *= 100.0
    q = create("rtn_tensor", bits, bits)
    qt = q.quantize(x, "k")
    assert float(qt["scale"].reshape(-1)[0]) == pytest.approx(float(x.max() - x.min()) / (2**bits - 1), rel=1e-6)
    rest = [c for c in range(64) if c != 5]
    y = q.dequantize(qt)
    err_rest = float((y[..., rest] - x[..., rest]).norm() / x[..., rest].norm())
    assert err_rest > 1.0
    # per channel, the large channel changes nothing for the others (bit for bit)
    x0 = x.clone()
    x0[..., 5] /= 100.0
    rtn_ch = create("rtn_channel", bits, bits)
    assert torch.equal(rtn_ch.roundtrip(x, "k")[..., rest], rtn_ch.roundtrip(x0, "k")[..., rest])
