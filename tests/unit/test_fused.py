"""The optional fused RTN kernels: off by default, and bit-identical to eager when compiled."""

from __future__ import annotations

import math

import pytest
import torch

from kvqbench.numerics import fused
from kvqbench.numerics.rtn import PerChannel, PerToken, rtn_roundtrip


def _case(seed: int, bits: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 40, 64, generator=g) * torch.exp(torch.randn(1, 1, 1, 64, generator=g))
    x[0, 0, :, 5] = 1.25  # a constant group: zero scale
    xg = x.reshape(2, 3, 40, 2, 32)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    safe = torch.where(scale > 0, scale, torch.full_like(scale, math.inf))
    return xg, lo, scale, safe


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fused.ENV, raising=False)
    fused.set_enabled(None)
    assert fused.enabled("cpu") is False


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_eager_core_matches_rtn_arithmetic(bits: int) -> None:
    # the kernels' eager bodies are the quantizer arithmetic written plainly
    xg, lo, scale, safe = _case(bits, bits)
    q = fused.quantize_codes(xg, lo, safe, 2**bits - 1, fused=False)
    want = torch.where(scale > 0, torch.round((xg - lo) / torch.where(scale > 0, scale, 1.0)), 0.0)
    assert torch.equal(q, want.clamp(0, 2**bits - 1).to(torch.uint8))
    assert torch.equal(fused.dequantize_codes(q, lo, scale, fused=False), q.float() * scale + lo)


@pytest.mark.slow
def test_compiled_is_bit_identical_to_eager() -> None:
    if not fused.compiler_available("cpu"):
        pytest.skip("no C++ compiler for torch.compile on this machine")
    x = _case(0, 2)[0].reshape(2, 3, 40, 64)
    try:
        fused.set_enabled(False)
        eager = {(b, g): rtn_roundtrip(x, b, g) for b in (2, 4) for g in (PerToken(32), PerChannel(8))}
        fused.set_enabled(True)
        comp = {(b, g): rtn_roundtrip(x, b, g) for b in (2, 4) for g in (PerToken(32), PerChannel(8))}
        assert not fused._STATE["broken"], "the compiled kernels failed and fell back to eager"
    finally:
        fused.set_enabled(None)
    for key, y in eager.items():
        assert torch.equal(comp[key], y), key
