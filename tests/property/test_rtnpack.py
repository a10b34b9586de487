"""The compiled RTN + packing (:mod:`kvqbench.numerics.rtnpack`) against the torch code it replaces
(:func:`kvqbench.numerics.rtn.rtn_quantize` + :func:`~kvqbench.numerics.packing.pack_bits`, unpacking +
:func:`~kvqbench.numerics.rtn.rtn_dequantize`: the second implementation): where the kernel accepts a tensor,
every packed byte, group minimum, scale and decoded value is bit-identical (signed zeros included); it declines
exactly the tensors it documents (a group holding a NaN or an infinity, a range that overflows fp32, a zero of
both signs at a group's minimum or maximum); and the RTN-family quantizers store and decode the same bytes with
and without it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench.numerics import rtnpack
from kvqbench.numerics.packing import pack_bits, unpack_bits
from kvqbench.numerics.rtn import PerChannel, PerTensor, PerToken, rtn_dequantize, rtn_quantize, to_groups
from kvqbench.quantizers import create

pytestmark = pytest.mark.skipif(not rtnpack.available(), reason="no C compiler (or KVQBENCH_KERNELS=0)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _values(draw, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` from one of several families (ties, zeros and non-finite values included)."""
    family = draw(st.sampled_from(["gauss", "grid", "constant", "tiny", "huge", "overflow", "zeros", "nonfinite"]))
    if family == "gauss":  # rows over many decades of scale, some one-signed
        x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(*shape[:-1], 1, generator=gen) * 4)
        x += draw(st.sampled_from([0.0, 3.0, -3.0])) * x.abs().amax()
    elif family == "grid":  # a coarse grid: exact ties of (x − lo)/scale, and exact zeros of one sign
        x = torch.randint(-6, 7, shape, generator=gen).float() * 2.0 ** draw(st.integers(-8, 8)) / 4
    elif family == "constant":  # constant rows and columns mixed with others
        x = torch.randn(shape, generator=gen)
        x.view(-1, shape[-1])[::2] = torch.randn(1, generator=gen).item()
        x[..., ::3] = torch.randn(1, generator=gen).item()
    elif family == "tiny":  # subnormal values and scales
        x = torch.randint(-3, 4, shape, generator=gen).float() * 1.4e-45
        x[x == 0] = 1.4e-45
    elif family == "huge":  # near the fp32 maximum, ranges that still fit
        x = torch.rand(shape, generator=gen) * 3.3e38 - 1.6e38
    elif family == "overflow":  # hi − lo overflows: an infinite scale
        x = torch.randn(shape, generator=gen).sign() * 3.3e38
    else:  # signed zeros at a group's extreme, or a NaN/inf
        x = torch.randn(shape, generator=gen)
        if family == "zeros":
            if draw(st.booleans()):
                x.abs_()  # all ≥ 0: a zero is every group's minimum
            else:
                x.abs_().neg_()  # a zero is the maximum
            x.view(-1)[torch.randperm(x.numel(), generator=gen)[: max(1, x.numel() // 7)]] = 0.0
            x.view(-1)[torch.randperm(x.numel(), generator=gen)[: draw(st.integers(0, 4))]] = -0.0
        else:
            x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(
                st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    return x.contiguous()


@st.composite
def cases(draw):
    """``(x, bits, granularity)`` within the kernel's scope."""
    d = draw(st.sampled_from([8, 16, 40, 64, 128]))
    t = draw(st.sampled_from([1, 3, 8, 24, 64]))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), t, d)
    if draw(st.booleans()):
        g = draw(st.sampled_from([None, 256] + [k for k in (8, 16, 32, 40, 64, 128) if d % k == 0]))
        gran = PerToken(g)  # 256: longer than every row (one padded group per row in the torch code)
    else:
        gran = PerChannel(draw(st.sampled_from([None, 1, 2, 5, 8, 24, 100])))  # partial last groups too
    if draw(st.booleans()):  # one group per flattened tensor, as rtn_tensor (rows longer than a packing piece)
        shape, gran = (shape[0], 1, 1, draw(st.sampled_from([8, 2048, 4104]))), PerToken()
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return _values(draw, gen, shape), draw(st.integers(1, 8)), gran


def _groups(x: torch.Tensor, gran) -> torch.Tensor:
    """``[n_groups, G]``: every group's values (independent of the kernel's traversal)."""
    xg, _ = to_groups(x if isinstance(gran, PerToken) else x.transpose(-1, -2), -1, gran.group_size)
    return xg.reshape(-1, xg.shape[-1])  # (padded with copies of a group's last value: the same extremes)


def _declines(x: torch.Tensor, bits: int, gran) -> bool:
    """Whether the kernel must decline ``x``: from each group's sorted values and signs (module doc)."""
    g = _groups(x, gran)
    if not bool(torch.isfinite(g).all()):
        return True
    s = g.sort(-1).values
    lo, hi = s[:, 0], s[:, -1]
    if not bool(torch.isfinite((hi - lo) / (2**bits - 1)).all()):
        return True
    zero = g == 0
    both = (zero & torch.signbit(g)).any(-1) & (zero & ~torch.signbit(g)).any(-1)
    return bool((both & ((lo == 0) | (hi == 0))).any())


@settings(max_examples=300, deadline=None)
@given(case=cases())
def test_compiled_rtn_gives_the_torch_bits(case) -> None:
    x, bits, gran = case
    assert rtnpack.compiled_ok()
    got = rtnpack.quantize_pack(x, bits, gran)
    assert (got is None) == _declines(x, bits, gran)
    if got is None:
        return
    codes, lo, scale = rtn_quantize(x, bits, gran, codes_dtype=torch.uint8)
    for a, b, name in zip(got, (pack_bits(codes, bits), lo, scale), ("packed", "lo", "scale"), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(_bits(a), _bits(b)), name
    want = rtn_dequantize(unpack_bits(got[0], bits, x.numel(), torch.uint8).view(x.shape), lo, scale, gran)
    dec = rtnpack.decode(got[0], tuple(x.shape), bits, lo, scale, gran)
    assert dec is not None and torch.equal(_bits(dec), _bits(want))


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_rtn_quantizers_with_the_kernel_equal_their_torch_steps(data) -> None:
    """Whole round trips of every RTN-family method (K and V, fp32/fp16/bf16 inputs, declined tensors included)
    store the same bytes and decode the same values with and without the kernel; NaN/Inf raise the same error."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    shape = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)),
             data.draw(st.sampled_from([1, 7, 32, 96, 300])), data.draw(st.sampled_from([16, 64, 96, 128])))
    x = _values(data.draw, gen, shape).to(data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])))
    method, kind, bits = (data.draw(st.sampled_from(["rtn_token", "rtn_channel", "rtn_tensor", "kivi"])),
                          data.draw(st.sampled_from(["k", "v"])), data.draw(st.integers(1, 8)))
    params = {"group_size": data.draw(st.sampled_from([16, 32, 128]))} if method == "kivi" else {}
    results = []
    assert rtnpack.compiled_ok()
    try:
        for compiled in (True, False):
            rtnpack._COMPILED["ok"] = compiled
            q = create(method, bits, **params)
            try:
                qt = q.quantize(x, kind)
            except ValueError as e:
                results.append(("error", str(e)))
                continue
            results.append(({name: _bits(f.tensor) for name, f in qt.fields.items()}, dict(qt.meta),
                             _bits(q.dequantize(qt))))
    finally:
        rtnpack._COMPILED["ok"] = True
    a, b = results
    if a[0] == "error":
        assert a == b
        return
    assert a[0].keys() == b[0].keys() and a[1] == b[1]
    for name in a[0]:
        assert torch.equal(a[0][name], b[0][name]), name
    assert torch.equal(a[2], b[2])


def test_the_once_per_process_check_passes_and_scope() -> None:
    """The check on the probe tensors (every width, per-token groups of the whole and a part of head_dim, a
    flattened tensor longer than a packing piece, per-channel groups of all and some tokens) accepts the kernel
    on this host; its scope is whole-byte per-token groups that divide head_dim and per-channel groups that
    divide head_dim or are longer than it, and per-channel groups of any size with head_dim a multiple of 8,
    fp32/fp16/bf16 on the CPU, 1..8 bits."""
    assert rtnpack.compiled_ok()
    assert rtnpack.layout((2, 8, 16, 128), 2, PerToken()) == ("token", 256, 128, 128)
    assert rtnpack.layout((2, 8, 16, 128), 2, PerChannel(8)) == ("channel", 256, 128, 8)
    assert rtnpack.layout((1, 1, 16, 96), 2, PerToken(64)) is None  # a partial last group: torch
    assert rtnpack.layout((1, 1, 16, 36), 2, PerToken()) is None  # groups not whole bytes at every width
    assert rtnpack.layout((1, 1, 16, 128), 2, PerChannel(5)) == ("channel", 16, 128, 5)  # a partial last group
    assert rtnpack.layout((1, 1, 16, 64), 2, PerToken(128)) == ("token", 16, 64, 64)  # one group per row
    assert rtnpack.layout((1, 1, 16, 36), 2, PerChannel()) is None  # rows not whole bytes
    assert rtnpack.layout((1, 1, 16, 128), 9, PerToken()) is None
    assert rtnpack.layout((1, 1, 16, 128), 2, PerTensor()) is None
    x = torch.randn(1, 2, 16, 128)
    assert rtnpack.quantize_pack(x.double(), 2, PerToken()) is None
    assert rtnpack.quantize_pack(x.half(), 2, PerToken()) is not None


def test_the_check_is_answered_only_once_its_probes_are_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the once-per-process check runs, asking it again (another thread) does not see a premature yes: the
    answer is stored only once every probe has been compared, and the probes call the kernel without it."""
    seen = []
    real = rtnpack._probe

    def probe() -> bool:
        seen.append(dict(rtnpack._COMPILED))
        return real()

    monkeypatch.setattr(rtnpack, "_probe", probe)
    monkeypatch.setattr(rtnpack, "_COMPILED", {})
    assert rtnpack.compiled_ok() and seen == [{}] and rtnpack._COMPILED == {"ok": True}
