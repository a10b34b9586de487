"""The compiled zero-point RTN + packing (:mod:`kvqbench.numerics.zpoint`) against QuaRot's torch block steps
(:func:`kvqbench.quantizers.quarot._quantize_block`, :func:`~kvqbench.quantizers.quarot._decode_block`, the
second implementation): where the kernel accepts a block, every stored value (group minima and maxima, scale,
zero-point), every packed byte and every decoded value are bit-identical (signed zeros included); it declines
exactly the blocks it documents (a group whose minimum or maximum is a zero, a NaN or an infinity)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench.numerics import zpoint
from kvqbench.numerics.packing import packed_nbytes
from kvqbench.quantizers import quarot as quarot_mod

pytestmark = pytest.mark.skipif(not zpoint.available(), reason="no C compiler (or KVQBENCH_KERNELS=0)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@st.composite
def blocks_(draw):
    """``(x [rows, d], g, bits, kind, clip)``: rows of groups drawn from one of several families."""
    d = draw(st.sampled_from([8, 16, 24, 40, 64, 128]))
    g = draw(st.sampled_from([k for k in (8, 16, 24, 32, 40, 64, 128) if d % k == 0] + [d]))
    rows, bits = draw(st.integers(1, 24)), draw(st.integers(1, 8))
    kind = draw(st.sampled_from(["k", "v"]))
    clip = draw(st.sampled_from([quarot_mod.CLIP_RATIO, 1.0, 0.5, 0.8125]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    family = draw(st.sampled_from(["gauss", "grid", "ties", "constant", "tiny", "huge", "zeros", "nonfinite"]))
    levels = 2**bits - 1
    if family == "gauss":  # groups over many decades of scale, some one-signed
        x = torch.randn(rows, d, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen) * 4)
        x += draw(st.sampled_from([0.0, 3.0, -3.0])) * x.abs().amax()
    elif family == "grid":  # a coarse grid: many exact ties of x/scale and of −lo·clip/scale
        x = torch.randint(-6, 7, (rows, d), generator=gen).float() * 2.0 ** draw(st.integers(-8, 8)) / 4
    elif family == "ties":  # clip 1: scale = 2^e exactly, x/scale = j + 1/2 (round half to even), lo = −z·2^e
        clip = 1.0
        e, z = draw(st.integers(-10, 10)), draw(st.integers(0, levels))
        x = (torch.randint(-z, levels - z, (rows, d), generator=gen).float() + 0.5) * 2.0**e
        x.view(rows, d // g, g)[..., 0] = -z * 2.0**e if z else 2.0**e * 0.5
        x.view(rows, d // g, g)[..., 1 % g] = (levels - z) * 2.0**e
    elif family == "constant":  # constant groups (V: the degenerate-scale guard), mixed with others
        x = torch.randn(rows, d, generator=gen)
        x.view(rows, d // g, g)[::2] = torch.randn(1, generator=gen).item()
    elif family == "tiny":  # subnormal values: clipped ranges that round to zero
        x = torch.randint(-3, 4, (rows, d), generator=gen).float() * 1.4e-45
        x[x == 0] = 1.4e-45
    elif family == "huge":  # ranges whose clipped width overflows (an infinite scale)
        x = torch.randn(rows, d, generator=gen).sign() * 3.3e38
    else:  # signed zeros, or a NaN/inf: the kernel declines these blocks
        x = torch.randn(rows, d, generator=gen)
        at = draw(st.integers(0, rows * d - 1))
        v = draw(st.sampled_from([0.0, -0.0] if family == "zeros" else [float("nan"), float("inf"), -float("inf")]))
        if family == "zeros" and draw(st.booleans()):  # make it the group's minimum (or maximum)
            x.view(-1, g)[at // g].abs_().mul_(draw(st.sampled_from([1.0, -1.0])))
        x.view(-1)[at] = v
    return x.contiguous(), g, bits, kind, clip


@settings(max_examples=300, deadline=None)
@given(case=blocks_())
def test_compiled_block_gives_the_torch_bits(case) -> None:
    x, g, bits, kind, clip = case
    rows, d = x.shape
    ng = d // g
    want = [torch.empty(rows, ng, 1) for _ in range(4)] + [torch.empty(packed_nbytes(rows * d, bits), dtype=torch.uint8)]
    got = [torch.full_like(t, 7) for t in want]
    with torch.no_grad():
        quarot_mod._quantize_block(x.clone(), kind, bits, g, clip, *want)
    ok = zpoint.quantize_pack_rows(x, g, bits, include_zero=(kind == "k"), clip=clip, lo=got[0], hi=got[1],
                                   scale=got[2], zero=got[3], packed=got[4])
    xg = x.view(rows, ng, g)
    declines = bool(((xg.amin(-1) == 0) | (xg.amax(-1) == 0)).any()) or not bool(torch.isfinite(x).all())
    assert ok == (not declines)
    if not ok:
        return
    for a, b, name in zip(got, want, ("lo", "hi", "scale", "zero", "packed")):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), name
    dec_want = quarot_mod._decode_block(want[4], g, bits, want[2], want[3], torch.empty(rows, d))
    dec_got = torch.full((rows, d), 7.0)
    assert zpoint.decode_rows(want[4], g, bits, want[2], want[3], dec_got)
    assert torch.equal(_bits(dec_got), _bits(dec_want))


def test_the_once_per_process_check_passes_and_scope() -> None:
    """The quantizer's own check (its probe rows: constant, one-signed, ties, subnormal, huge groups, every width)
    accepts the kernel on this host; the kernel's scope is fp32 CPU rows of a multiple of 8 in whole groups."""
    assert quarot_mod._compiled_ok()
    cpu = torch.device("cpu")
    assert zpoint.supports(128, 128, 2, torch.float32, cpu) and zpoint.supports(40, 8, 8, torch.float32, cpu)
    assert not zpoint.supports(96, 64, 2, torch.float32, cpu)  # a partial last group: torch
    assert not zpoint.supports(36, 36, 2, torch.float32, cpu)  # groups not whole bytes at every width
    assert not zpoint.supports(64, 4, 2, torch.float32, cpu)
    assert not zpoint.supports(128, 128, 2, torch.float64, cpu)
    assert not zpoint.supports(128, 128, 9, torch.float32, cpu)
