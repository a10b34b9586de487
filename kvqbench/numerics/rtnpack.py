"""Compiled asymmetric RTN fused with bit packing, and its decode: the round trip of :mod:`kvqbench.numerics.rtn`
followed by :func:`~kvqbench.numerics.packing.pack_bits`, in one pass per group (``rtnpack.c``, built on first use
by :mod:`kvqbench.numerics.cbuild`) instead of the ~15 whole-block torch operations of the same arithmetic.

Per group ``x`` (METHODS.md "RTN family")::

    lo = min x, hi = max x, scale = (hi − lo) / (2^b − 1)
    q  = clamp(round((x − lo) / s), 0, 2^b − 1)     s = scale, or +inf where scale = 0 (round half to even)
    x̂  = q · scale + lo

each step one fp32 IEEE operation in the order of :func:`~kvqbench.numerics.rtn.rtn_quantize` and
:func:`~kvqbench.numerics.rtn.rtn_dequantize`, so the packed bytes, ``lo``, ``scale`` and ``x̂`` are the same bits
as the torch code's (checked once per process on probe tensors, :func:`compiled_ok`, before either function is
used; and by the property tests).

Scope (otherwise both functions return ``None`` and the caller runs the torch code): a C compiler
(``KVQBENCH_KERNELS`` not ``0``), CPU, fp32 (an fp16/bf16 input is widened first, exactly as the torch code
does), 1..8 bits, :class:`~kvqbench.numerics.rtn.PerToken` groups that tile ``head_dim`` in whole bytes of the
packed stream (a group size that is a multiple of 8 and divides ``head_dim``, or is at least ``head_dim``) or
:class:`~kvqbench.numerics.rtn.PerChannel` groups of any size (``head_dim`` a multiple of 8), not the
``torch.compile`` path (``KVQBENCH_FUSED=1``, :mod:`kvqbench.numerics.fused`). :func:`quantize_pack` also
returns ``None`` where a group holds a NaN or an infinity, its range overflows fp32 (an infinite scale), or its
minimum or maximum is a zero that occurs with both signs (the torch reduction's sign of that zero depends on its
order of comparisons).
"""

from __future__ import annotations

import ctypes

import torch

from kvqbench.kernels import build as cbuild
from kvqbench.numerics import fused
from kvqbench.numerics.packing import pack_bits, packed_nbytes, unpack_bits
from kvqbench.numerics.rtn import Granularity, PerChannel, PerToken, rtn_dequantize, rtn_quantize

__all__ = ["available", "layout", "quantize_pack", "decode", "compiled_ok"]

#: codes per packing piece of the kernel (``PIECE`` in rtnpack.c): the size of its work buffer
_PIECE = 2048


def _lib() -> ctypes.CDLL | None:
    lib = cbuild.load("rtnpack.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        vp, lg, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
        lib.rtn_pack_token.restype = i
        lib.rtn_pack_token.argtypes = [vp, lg, lg, lg, i, vp, vp, vp, vp]
        lib.rtn_pack_channel.restype = i
        lib.rtn_pack_channel.argtypes = [vp, lg, lg, lg, lg, i, vp, vp, vp, vp, vp]
        lib.rtn_decode_token.restype = i
        lib.rtn_decode_token.argtypes = [vp, lg, lg, lg, i, vp, vp, vp, vp]
        lib.rtn_decode_channel.restype = i
        lib.rtn_decode_channel.argtypes = [vp, lg, lg, lg, lg, i, vp, vp, vp, vp]
        lib._kvq_typed = True
    return lib


def available() -> bool:
    """Whether the compiled kernel can be used in this process (:mod:`kvqbench.numerics.cbuild`)."""
    return _lib() is not None


def layout(shape: tuple[int, ...], bits: int, granularity: Granularity) -> tuple[str, int, int, int] | None:
    """``(mode, rows, d, g)`` the kernel takes codes of ``shape`` in (``mode`` ``"token"``: groups of ``g``
    values of each of ``rows`` rows of ``d``; ``"channel"``: groups of ``g`` consecutive tokens of each
    ``(seq_len, d)`` matrix, one per column, the last one partial where ``g`` does not divide seq_len), or
    ``None`` outside its scope (module doc; the device and dtype are checked by the callers). A per-token group
    longer than the row is the row (the torch code pads it with copies of its last value)."""
    if len(shape) < 2 or not 1 <= bits <= 8 or any(int(s) <= 0 for s in shape):
        return None
    d = int(shape[-1])
    rows = 1
    for s in shape[:-1]:
        rows *= int(s)
    if type(granularity) is PerToken:
        g = d if granularity.group_size is None else min(int(granularity.group_size), d)
        return ("token", rows, d, g) if 0 < g and g % 8 == 0 and d % g == 0 else None
    if type(granularity) is PerChannel:
        t = int(shape[-2])
        g = t if granularity.group_size is None else int(granularity.group_size)
        return ("channel", rows, d, g) if 0 < g and d % 8 == 0 else None
    return None


def _usable(device: torch.device, checked: bool) -> bool:
    """On the CPU and, unless unchecked (the check's own probes), not the torch.compile path and the
    once-per-process check passed."""
    return device.type == "cpu" and (not checked or (not fused.enabled(device.type) and compiled_ok()))


def quantize_pack(
    x: torch.Tensor, bits: int, granularity: Granularity, *, _checked: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`~kvqbench.numerics.rtn.rtn_quantize` of ``x`` ``(batch, kv_heads, seq_len, head_dim)`` (any
    leading dims) with its codes packed as :func:`~kvqbench.numerics.packing.pack_bits` packs them.

    Returns:
        ``(packed, lo, scale)``: ``packed`` the flat ``uint8`` stream of ``ceil(numel·bits/8)`` bytes; ``lo`` and
        ``scale`` fp32 with the shapes (and strides) :func:`~kvqbench.numerics.rtn.rtn_quantize` gives; the same
        bits as that function followed by ``pack_bits``. ``None`` outside the kernel's scope, or where it
        declines the data (module doc): the caller runs the torch code, which also raises what it raises.
    """
    lay = layout(tuple(x.shape), bits, granularity)
    if lay is None or x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not _usable(x.device, _checked):
        return None
    mode, rows, d, g = lay
    xf = x.to(torch.float32).contiguous()  # fp16/bf16 widen exactly, as the torch code's .to(fp32)
    lib = _lib()
    packed = torch.empty(packed_nbytes(rows * d, bits), dtype=torch.uint8)
    if mode == "token":
        lo = torch.empty(*x.shape[:-1], d // g, 1)
        scale = torch.empty_like(lo)
        work = torch.empty(_PIECE, dtype=torch.uint8)  # held here while the kernel writes to it
        rc = lib.rtn_pack_token(xf.data_ptr(), rows, d, g, bits, lo.data_ptr(), scale.data_ptr(),
                                packed.data_ptr(), work.data_ptr())
        return (packed, lo, scale) if rc == 0 else None
    t = int(x.shape[-2])
    ng = -(-t // g)
    lo = torch.empty(*x.shape[:-2], ng, 1, d)  # (…, nG, 1, D); returned as (…, D, nG, 1), as the torch code's
    scale = torch.empty_like(lo)
    work, tmp = torch.empty(d, dtype=torch.uint8), torch.empty(d)
    rc = lib.rtn_pack_channel(xf.data_ptr(), rows // t, t, d, g, bits, lo.data_ptr(), scale.data_ptr(),
                              packed.data_ptr(), work.data_ptr(), tmp.data_ptr())
    if rc != 0:
        return None
    lo, scale = lo.movedim(-1, -3), scale.movedim(-1, -3)
    if t % g:  # the torch code's padded path gives them contiguous
        lo, scale = lo.contiguous(), scale.contiguous()
    return packed, lo, scale


def decode(
    packed: torch.Tensor, shape: tuple[int, ...], bits: int, lo: torch.Tensor, scale: torch.Tensor,
    granularity: Granularity, *, _checked: bool = True,
) -> torch.Tensor | None:
    """:func:`~kvqbench.numerics.rtn.rtn_dequantize` of the codes of ``shape`` packed in ``packed`` (the flat
    ``uint8`` stream of :func:`quantize_pack` or ``pack_bits``) with the ``lo``/``scale`` of
    :func:`~kvqbench.numerics.rtn.rtn_quantize`: an fp32 tensor of ``shape``, the same bits as unpacking and that
    function. ``None`` outside the kernel's scope (module doc) or for parameters of another dtype or shape."""
    lay = layout(tuple(shape), bits, granularity)
    if (lay is None or lo.dtype != torch.float32 or scale.dtype != torch.float32 or packed.dtype != torch.uint8
            or not _usable(packed.device, _checked) or lo.device != packed.device or scale.device != packed.device):
        return None
    mode, rows, d, g = lay
    if packed.dim() != 1 or packed.numel() != packed_nbytes(rows * d, bits) or not packed.is_contiguous():
        return None
    lead = tuple(int(s) for s in shape[:-1])
    if mode == "token":
        want = (*lead, d // g, 1)
        if tuple(lo.shape) != want or tuple(scale.shape) != want:
            return None
        lo_c, scale_c, work = lo.contiguous(), scale.contiguous(), torch.empty(_PIECE, dtype=torch.uint8)
        out = torch.empty(shape)
        _lib().rtn_decode_token(packed.data_ptr(), rows, d, g, bits, lo_c.data_ptr(), scale_c.data_ptr(),
                                out.data_ptr(), work.data_ptr())
        return out
    t = int(shape[-2])
    want = (*lead[:-1], d, -(-t // g), 1)
    if tuple(lo.shape) != want or tuple(scale.shape) != want:
        return None
    lo_c, scale_c = lo.movedim(-3, -1).contiguous(), scale.movedim(-3, -1).contiguous()  # (…, nG, 1, D)
    work, out = torch.empty(d, dtype=torch.uint8), torch.empty(shape)
    _lib().rtn_decode_channel(packed.data_ptr(), rows // t, t, d, g, bits, lo_c.data_ptr(), scale_c.data_ptr(),
                              out.data_ptr(), work.data_ptr())
    return out


#: whether the kernel gave the torch code's bits on the probes (checked once per process: :func:`compiled_ok`)
_COMPILED: dict[str, bool] = {}


def probe_tensor(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` (last dim ≥ 8, second-to-last ≥ 8) for :func:`compiled_ok`: Gaussian values over
    six decades of scale per row, with rows and columns that are constant, one-signed, two-valued, half-integer
    ties, subnormal, near the fp32 maximum (a finite range) or hold zeros of one sign at their minimum."""
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(*shape[:-1], 1, generator=gen) * 3)
    rows, d = x.view(-1, shape[-1]), shape[-1]
    edits = (
        lambda r: r.fill_(1.5),                                                # constant
        lambda r: r.copy_(-r.abs() - 0.1),                                     # all negative
        lambda r: r.copy_(torch.tensor([0.75, -0.75]).repeat(d // 2 + 1)[:d]),  # two values
        lambda r: r.copy_(torch.arange(d, dtype=torch.float32).sub(d / 2).mul(0.5).add(0.25)),  # ties
        lambda r: r.copy_(torch.randn(d, generator=gen) * 1e-40),             # subnormal
        lambda r: r.copy_(torch.randn(d, generator=gen).sign() * 1.5e38),     # near the maximum, range finite
        lambda r: r.abs_()[::3].fill_(0.0),                                    # +0 minimum
        lambda r: r.abs_().neg_()[1::3].fill_(-0.0),                           # −0 maximum
    )
    for r, edit in zip(rows[1:], edits):  # row 0 stays Gaussian
        edit(r)
    x[..., 1] = -2.5e-45                                                       # a constant subnormal column
    x[..., 2] = x[..., 2].abs()
    x[..., 0:8:5, 2] = 0.0                                                     # a column with a +0 minimum
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                                                     b.contiguous().reshape(-1).view(torch.uint8))


def _probe() -> bool:
    """:func:`compiled_ok`'s comparisons (the kernel called without the check)."""
    if not available():
        return False
    gen = torch.Generator().manual_seed(2402)
    cases = ((PerToken(), (2, 3, 16, 128)), (PerToken(32), (1, 2, 16, 128)), (PerToken(8), (1, 1, 16, 40)),
             (PerToken(128), (1, 2, 16, 64)), (PerToken(), (2, 1, 1, 5000)), (PerChannel(), (1, 2, 24, 128)),
             (PerChannel(8), (2, 1, 24, 40)), (PerChannel(10), (2, 2, 24, 16)), (PerChannel(32), (1, 1, 24, 8)))
    for gran, shape in cases:
        for bits in range(1, 9):
            x = probe_tensor(gen, shape)
            codes, lo, scale = rtn_quantize(x, bits, gran, codes_dtype=torch.uint8)
            got = quantize_pack(x, bits, gran, _checked=False)
            if got is None or not all(_same_bits(a, b) for a, b in zip(got, (pack_bits(codes, bits), lo, scale))):
                return False
            want = rtn_dequantize(unpack_bits(got[0], bits, codes.numel(), torch.uint8).view(shape), lo, scale, gran)
            dec = decode(got[0], shape, bits, lo, scale, gran, _checked=False)
            if dec is None or not _same_bits(dec, want):
                return False
    return True


def compiled_ok() -> bool:
    """Whether the kernel reproduces :func:`~kvqbench.numerics.rtn.rtn_quantize` + ``pack_bits`` (packed bytes,
    ``lo``, ``scale``) and unpacking + :func:`~kvqbench.numerics.rtn.rtn_dequantize` bit for bit on
    :func:`probe_tensor` data, at every width 1..8, for per-token groups of the whole head_dim, of a part of it and
    longer than it, one group over a whole flattened tensor longer than the kernel's packing piece, and per-channel
    groups of all tokens, of a part of them, with a partial last group and longer than the sequence: checked once
    per process; ``False`` without a compiled kernel."""
    if "ok" not in _COMPILED:
        _COMPILED["ok"] = _probe()  # set once the probes are done (a thread asking meanwhile probes too)
    return _COMPILED["ok"]
