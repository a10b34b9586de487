"""QuaRot — Walsh–Hadamard rotation of K and V followed by groupwise asymmetric RTN.

Based on Ashkboos et al., "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs", arXiv:2404.00456,
§4 (online Hadamard on the KV cache, Fig. 4 / §4.2 "KV cache quantization": asymmetric groupwise
quantization, group = head_dim, clip ratio 0.95) and its public reference simulation (fake-quant of
K/V after the rotation; K forces 0 into the range).

Per group ``x`` of the rotated head (one group = one token of one head by default)::

    lo = min x, hi = max x             (K: lo = min(lo, 0), hi = max(hi, 0))
    lo, hi = 0.95·lo, 0.95·hi          (clip ratio)
    scale = (hi − lo) / (2^b − 1)
    z = round(−lo / scale)             (integer zero-point)
    q = clamp(round(x / scale) + z, 0, 2^b − 1)
    x̂ = scale · (q − z)

then the inverse rotation (the normalized Hadamard is its own inverse). Both rotations are applied by
butterflies (:func:`kvqbench.numerics.hadamard.fwht`, the fast Walsh–Hadamard transform, as the reference
applies its online Hadamard with a fast kernel): ``d·log₂d`` additions per token instead of a ``d × d``
matrix product. Until this change they were matrix products (``x @ Q``); the two round differently, so
stored codes and metric values move within float noise (main job: see the README's performance notes).

Stored per group: one scale and one integer zero-point, both billed fp16 (16 + 16 bits); codes packed.
Effective bits = ``b + 32/G`` (``b + 0.25`` at G = head_dim = 128); nominal (FP8 scale, FP16 zero)
= ``b + 24/G``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvqbench.numerics import blocks, zpoint
from kvqbench.numerics.hadamard import fwht
from kvqbench.numerics.packing import pack_float_codes, packed_nbytes, unpack_bits
from kvqbench.numerics.rtn import broadcast_shape, compute_dtype, to_groups
from kvqbench.quantizers.base import (
    Kind,
    QuantizedTensor,
    Quantizer,
    Stored,
    check_finite,
    register,
    saturate_,
)

__all__ = ["QuaRot", "quarot_qparams", "quarot_quantize", "quarot_dequantize", "CLIP_RATIO"]

CLIP_RATIO = 0.95


#: QuaRot's round trip runs in row blocks (:meth:`QuaRot._quantize_blocked`, fused: rotation, parameters,
#: codes and bit packing per block) for CPU tensors of more than this many elements; smaller ones (fewer
#: than 512 tokens·heads at head_dim 128) take the whole-tensor ops. Measured on the shared 2-core host,
#: 1 thread, steady allocator, cold inputs, (1, 8, T, 128) fp32, 2 bits, round trip as a multiple of the
#: eager RTN, paired in one process (interleaved medians, CPU time, load 2.2–2.7): T = 16384 blocked
#: 1.03–1.04, whole 1.44; T = 4096 blocked 1.14–1.27, whole 1.48–1.57; T = 1024 blocked 1.58–1.68, whole
#: 1.74–1.76; T = 256 blocked 2.35, whole 2.52 (the two 128×128 products alone take 0.65–0.8 of the eager
#: RTN). ``kvqbench perf --threads 1`` at load 3–4, K/V: 1.30–1.44 (1k), 1.49–1.64 (4k), 1.10–1.15 (16k),
#: against 1.60–1.81, 1.61–1.87, 1.26–1.35 for the previous code in the same conditions.
_WHOLE_MAX_ELEMS = 1 << 16

#: :data:`_WHOLE_MAX_ELEMS` at more than one torch thread: the blocked path runs on one thread (a block's
#: operations are cache-sized), the whole-tensor products use them all, so up to 2^22 elements the whole
#: path is faster in wall time (``kvqbench perf --threads default``, 2 threads, load 1.4–1.8: T = 1024
#: whole 4.9–5.1 ms, blocked 7.1–7.3; T = 4096 whole 17–18, blocked 24–27; T = 16384 whole 110, blocked
#: 97–100), though it costs more CPU time
_WHOLE_MAX_ELEMS_THREADED = 1 << 22

#: QuaRot's blocks hold this many times :data:`~kvqbench.numerics.blocks.BLOCK_ELEMS` elements (2 MiB of
#: fp32, 4096 rows at head_dim 128): taller blocks make fewer small per-block operations, shorter ones keep
#: the block's passes in a core's L2 (same host: 2048 rows 1.30–1.43 at T = 4096, 4096 rows 1.14–1.35,
#: 8192 rows 1.17–1.36)
_BLOCK_FACTOR = 2

#: block starts are multiples of this many rows: 64-byte aligned for any head_dim (the alignment
#: :func:`~kvqbench.quantizers.base._canonical_layout` gives the whole tensor), and no block of a
#: several-block tensor has fewer than half as many rows (a one-row product is a mat-vec, another kernel)
_ROW_MULTIPLE = 16


def _block_rows(d: int) -> int:
    """Rows per block for head_dim ``d`` (before :func:`~kvqbench.numerics.blocks.row_blocks` merges a
    short tail)."""
    return max(1, blocks.BLOCK_ELEMS * _BLOCK_FACTOR // (d * _ROW_MULTIPLE)) * _ROW_MULTIPLE


def _spans(n: int, d: int) -> list[slice]:
    """The row blocks of ``n`` rows of ``d`` elements (:func:`~kvqbench.numerics.blocks.row_blocks`)."""
    return blocks.row_blocks(n, d, multiple=_ROW_MULTIPLE, target=blocks.BLOCK_ELEMS * _BLOCK_FACTOR)


def _blocked(device: torch.device, numel: int, d: int, dtype: torch.dtype) -> bool:
    """Whether QuaRot's round trip of a tensor of ``numel`` elements, head_dim ``d``, runs in row blocks
    (:meth:`QuaRot._quantize_blocked`): on the CPU, for more than :data:`_WHOLE_MAX_ELEMS` elements at one
    torch thread (:data:`_WHOLE_MAX_ELEMS_THREADED` at more; one block or more, :func:`_spans`). The
    rotation (:func:`~kvqbench.numerics.hadamard.fwht`) works on each row on its own, so its row blocks give
    the whole tensor's bits."""
    limit = _WHOLE_MAX_ELEMS if torch.get_num_threads() == 1 else max(_WHOLE_MAX_ELEMS, _WHOLE_MAX_ELEMS_THREADED)
    return device.type == "cpu" and numel > limit


def quarot_qparams(
    xg: torch.Tensor, bits: int, *, include_zero: bool, clip_ratio: float = CLIP_RATIO,
    lo_hi: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """QuaRot's asymmetric parameters over the last dim of ``xg`` ``[..., G]`` (fp32); ``lo_hi`` — the
    group minima and maxima when the caller already has them.

    Returns ``(scale, zero)``, each ``[..., 1]``; ``zero`` holds integers (as floats).

    Constant-group guard (the reference clamps the scale at 1e-5 and then saturates): a group whose
    clipped range is 0 (possible only when ``include_zero`` is False, or for an all-zero K group)
    gets ``scale = |c|`` and ``zero = 1`` if ``c < 0`` else ``0``, so that ``x̂ = c`` exactly; an
    all-zero group gets ``scale = 0`` and decodes to 0. Never NaN.
    """
    lo, hi = (xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)) if lo_hi is None else lo_hi
    if include_zero:
        lo = lo.clamp(max=0.0)
        hi = hi.clamp(min=0.0)
    lo_c, hi_c = lo * clip_ratio, hi * clip_ratio
    scale = (hi_c - lo_c) / (2**bits - 1)
    degenerate = scale <= 0
    if not bool(degenerate.any()):  # no constant group (the usual case): the guard below changes nothing
        return scale, torch.round(-lo_c / scale)
    safe = torch.where(degenerate, torch.ones_like(scale), scale)
    zero = torch.round(-lo_c / safe)
    # constant group: lo == hi == c (raw, unclipped value)
    scale = torch.where(degenerate, lo.abs(), scale)
    zero = torch.where(degenerate, (lo < 0).to(zero.dtype), zero)
    return scale, zero


def quarot_quantize(
    xg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype: torch.dtype = torch.int64,
    *, inplace: bool = False, out: torch.Tensor | None = None, positive: bool = False,
) -> torch.Tensor:
    """Codes ``clamp(round(x/scale) + z, 0, 2^b − 1)`` as ``dtype`` (default int64); a zero scale gives
    code ``z``. ``inplace=True`` reuses ``xg``'s buffer (the caller no longer needs it); ``out`` (``xg``'s
    shape, of ``dtype``) receives the codes instead of a new tensor (the same cast). A zero scale
    divides by ``+inf`` (``x/inf = 0`` for finite ``x``), so no full-size mask is built; ``positive=True``
    declares every scale ``> 0`` (or NaN) and skips that guard."""
    safe = scale if positive else torch.where(scale > 0, scale, torch.full_like(scale, math.inf))
    q = xg.div_(safe) if inplace else torch.div(xg, safe)
    q.round_().add_(zero).clamp_(0, 2**bits - 1)
    return q.to(dtype) if out is None else out.copy_(q)


def quarot_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``scale · (q − z)`` in ``scale``'s dtype (one output buffer, shifted and scaled in place)."""
    if tuple(codes.shape) != tuple(broadcast_shape(codes.shape, scale.shape, zero.shape)):
        return scale * (codes.to(scale.dtype) - zero)
    return codes.to(scale.dtype, copy=True).sub_(zero).mul_(scale)


def _within(scale: torch.Tensor, zero: torch.Tensor, bits: int, d: int, dtype: torch.dtype) -> bool:
    """Whether every output of the decode ``(scale · (q − z)) @ Q`` (codes ``0 ≤ q < 2^b``, ``Q`` the
    normalized rotation of order ``d``, ``|Q_ij| ≤ 1``) lies strictly inside ``dtype``'s finite range, so
    that saturating it changes nothing: each decoded value is at most ``m = max scale·max(|z|, |2^b − 1 − z|)``
    in magnitude (times ``1 + ε``), each output a sum of ``d`` such values times entries of ``Q``, and every
    partial sum of a rounded fp32/fp64 accumulation of ``d ≤ 2^20`` terms stays below ``2·d·m``; the test
    is ``d·m < max/4``. ``False`` (then the caller checks the output) for non-finite parameters."""
    m = (scale.abs() * torch.maximum(zero.abs(), (zero - (2**bits - 1)).abs())).amax()
    return d <= 1 << 20 and bool(m * d < torch.finfo(dtype).max / 4)


def _byte_span(rows: slice, d: int, bits: int) -> slice:
    """The bytes of the packed codes (:func:`~kvqbench.numerics.packing.pack_bits`) of ``rows`` of ``d``
    codes: whole bytes, as every block of :func:`_spans` but the last ends at a multiple of
    :data:`_ROW_MULTIPLE` rows (8 codes of any width fill whole bytes)."""
    return slice(rows.start * d * bits // 8, packed_nbytes(rows.stop * d, bits))


def _quantize_block(xr: torch.Tensor, kind: Kind, bits: int, g: int, clip_ratio: float, lo: torch.Tensor,
                    hi: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, packed: torch.Tensor) -> None:
    """One block of :meth:`QuaRot._quantize_blocked` in torch: the rotated rows ``xr`` ``[r, d]`` (overwritten)
    → their group minima ``lo`` and maxima ``hi``, ``scale``, ``zero`` (``[r, ng, 1]``) and the packed codes
    (``packed``, the block's bytes)."""
    xg, restore = to_groups(xr, -1, g)  # a view (a padded copy for a partial last group)
    torch.amin(xg, -1, keepdim=True, out=lo)
    torch.amax(xg, -1, keepdim=True, out=hi)
    sc, ze = quarot_qparams(xg, bits, include_zero=(kind == "k"), clip_ratio=clip_ratio, lo_hi=(lo, hi))
    scale.copy_(sc)
    zero.copy_(ze)
    codes = restore(quarot_quantize(xg, sc, ze, bits, xr.dtype, inplace=True,
                                    positive=not bool((sc <= 0).any())))  # as floats
    pack_float_codes(codes, bits, out=packed)


def _decode_block(packed: torch.Tensor, g: int, bits: int, scale: torch.Tensor, zero: torch.Tensor,
                  buf: torch.Tensor) -> torch.Tensor:
    """One block of :meth:`QuaRot._dequantize_blocked` in torch: ``scale · (q − z)`` ``[r, d]`` of the codes
    unpacked from ``packed`` (the block's bytes) into ``buf`` ``[r, d]`` (returned when the groups tile
    head_dim, else a new tensor)."""
    r, d = buf.shape
    cb = unpack_bits(packed, bits, r * d, out=buf).view(r, d)  # as floats
    cg, restore = to_groups(cb, -1, g)
    if cg.data_ptr() == cb.data_ptr():  # groups tile head_dim: decoded in the block buffer
        cg.sub_(zero).mul_(scale)  # quarot_dequantize (the codes are exact as floats)
        return cb
    return restore(quarot_dequantize(cg, scale, zero))


#: whether the compiled block steps (:mod:`kvqbench.numerics.zpoint`) gave :func:`_quantize_block`'s and
#: :func:`_decode_block`'s bits (checked once per process: :func:`_compiled_ok`)
_COMPILED: dict[str, bool] = {}


def _probe_rows(gen: torch.Generator, rows: int, d: int, g: int) -> torch.Tensor:
    """Rows ``[rows, d]`` for :func:`_compiled_ok`: Gaussian groups over six decades of scale, plus groups
    that are constant, all negative, all positive, of one value and its negation, with ties (half-integer
    multiples), tiny (subnormal) and huge (``(hi − lo)·clip`` overflows) values."""
    x = torch.randn(rows, d, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen) * 3)
    xg = x.view(rows, d // g, g)
    xg[0] = 1.5                                   # constant groups
    xg[1] = -xg[1].abs() - 0.1                    # all negative
    xg[2] = xg[2].abs() + 0.1                     # all positive
    xg[3] = torch.tensor([0.75, -0.75]).repeat(g // 2 + 1)[:g]
    xg[4] = torch.arange(g, dtype=torch.float32).sub(g / 2).mul(0.5).add(0.25)   # ties
    xg[5] = torch.randn(d // g, g, generator=gen) * 1e-40   # subnormal
    xg[6] = torch.randn(d // g, g, generator=gen).sign() * 3e38  # huge: an infinite scale
    xg[7] = -2.5e-45                              # constant subnormal
    return x


def _compiled_ok() -> bool:
    """Whether :func:`~kvqbench.numerics.zpoint.quantize_pack_rows` and
    :func:`~kvqbench.numerics.zpoint.decode_rows` reproduce :func:`_quantize_block` and :func:`_decode_block`
    bit for bit (stored parameters, packed bytes, decoded values) on :func:`_probe_rows`, for K and V, every
    width 1..8, groups of the whole row and of a part of it, and the default and another clip ratio: checked
    once per process (then the blocked path uses them for fp32 blocks they support); ``False`` without a
    compiled kernel."""
    if "ok" not in _COMPILED:
        _COMPILED["ok"] = False
        if not zpoint.available():
            return False
        gen = torch.Generator().manual_seed(2404)
        for d, g in ((128, 128), (40, 8)):
            for bits in range(1, 9):
                for kind, clip in (("k", CLIP_RATIO), ("v", CLIP_RATIO), ("v", 1.0)):
                    x, n, ng = _probe_rows(gen, 24, d, g), 24, d // g
                    want = [torch.empty(n, ng, 1) for _ in range(4)] + [torch.empty(packed_nbytes(n * d, bits),
                                                                                   dtype=torch.uint8)]
                    got = [torch.full_like(t, 7) for t in want]
                    _quantize_block(x.clone(), kind, bits, g, clip, *want)
                    if not zpoint.quantize_pack_rows(x, g, bits, include_zero=(kind == "k"), clip=clip, lo=got[0],
                                                     hi=got[1], scale=got[2], zero=got[3], packed=got[4]):
                        return False
                    if not all(a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                               for a, b in zip(got, want)):
                        return False
                    dec_want = _decode_block(want[4], g, bits, want[2], want[3], torch.empty(n, d))
                    dec_got = torch.full((n, d), 7.0)
                    if not (zpoint.decode_rows(want[4], g, bits, want[2], want[3], dec_got)
                            and torch.equal(dec_got.view(torch.int32), dec_want.view(torch.int32))):
                        return False
        _COMPILED["ok"] = True
    return _COMPILED["ok"]


@register
class QuaRot(Quantizer):
    """QuaRot (arXiv:2404.00456 §4): Hadamard(head_dim) on K and V → asym groupwise RTN over head_dim.

    Shapes: ``quantize(x, kind)`` takes ``(batch, kv_heads, seq_len, head_dim)`` fp32/fp16/bf16;
    computation in fp32 (fp64 inputs stay fp64); ``dequantize`` returns the input's shape, dtype and device.

    Args:
        k_bits, v_bits: code widths (1..8; >= 16 = exact passthrough). Default 4 (the paper's KV4).
        group_size: channels per group along the rotated head_dim; ``None`` (default) = the whole
            head_dim (the paper's setting). A partial last group is allowed.
        clip_ratio: range multiplier before computing the scale (paper: 0.95).
        seed: unused (the rotation is deterministic); recorded.

    Raises:
        ValueError: bad ``group_size``/``clip_ratio``, or bit widths 9..15.
    """

    id = "quarot"
    seeded = False  # no randomness
    name = "QuaRot"
    paper = "Ashkboos et al., QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs (NeurIPS 2024)"
    arxiv = "2404.00456"
    k_granularity = "Hadamard(head_dim) → per-token groups over head_dim, asym, clip 0.95, 0 in range"
    v_granularity = "Hadamard(head_dim) → per-token groups over head_dim, asym, clip 0.95"
    rotation = True
    grouped = True
    fidelity = "faithful"
    deltas = (
        "The query-side Hadamard that cancels K's rotation inside q·kᵀ is not modelled; K is "
        "dequantized and rotated back instead (mathematically equivalent at tensor level).",
        "V's rotation is applied to the V tensor and undone after dequantization instead of being "
        "fused offline into v_proj/o_proj (numerically equivalent up to rounding).",
        "K is quantized in whatever space the harness provides (post-RoPE for real captures, as QuaRot).",
        "Constant-group guard: a group with zero clipped range is stored with scale = |c| and an exact "
        "zero-point (reference: scale clamped at 1e-5, which saturates); no NaN.",
        "Scale and integer zero-point are held at working precision and billed as fp16 (16 + 16 bits per "
        "group; the zero-point is an integer and is not clamped to [0, 2^b − 1], as in the reference).",
        "head_dim not a power of two: block-diagonal Sylvester Hadamard (binary decomposition of D, e.g. "
        "96 = 64 + 32) instead of the reference's non-Sylvester Hadamard matrices.",
    )

    def __init__(
        self,
        k_bits: int = 4,
        v_bits: int | None = None,
        *,
        seed: int = 0,
        group_size: int | None = None,
        clip_ratio: float = CLIP_RATIO,
    ) -> None:
        super().__init__(k_bits, v_bits, seed=seed)
        if group_size is not None and (
            not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0
        ):
            raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
        if not isinstance(clip_ratio, (int, float)) or not 0 < float(clip_ratio) <= 1:
            raise ValueError(f"clip_ratio must be in (0, 1], got {clip_ratio!r}")
        self.group_size = group_size
        self.clip_ratio = float(clip_ratio)

    def params(self) -> dict[str, Any]:
        return {**super().params(), "group_size": self.group_size, "clip_ratio": self.clip_ratio}

    def _group(self, d: int) -> int:
        return d if self.group_size is None else self.group_size

    finite_check = "stats"  # the rotation spreads a NaN/Inf over its token's row: the group min/max see it

    def _quantize(self, x: torch.Tensor, kind: Kind, bits: int) -> QuantizedTensor:
        d = int(x.shape[-1])
        g = self._group(d)
        if _blocked(x.device, x.numel(), d, compute_dtype(x.dtype)):
            return self._quantize_blocked(x, kind, bits, g)
        xr = fwht(x)  # a fresh buffer in the compute dtype, quantized in place
        xg, restore = to_groups(xr, -1, g)
        lo = xg.amin(-1, keepdim=True)
        hi = xg.amax(-1, keepdim=True)
        check_finite(x, lo, hi, name=kind.upper())
        scale, zero = quarot_qparams(xg, bits, include_zero=(kind == "k"), clip_ratio=self.clip_ratio,
                                     lo_hi=(lo, hi))
        codes = restore(quarot_quantize(xg, scale, zero, bits, torch.uint8, inplace=xg.data_ptr() != x.data_ptr()))
        qt = self._new_qt(x, kind, bits, group_size=g)
        qt.add_codes("codes", codes, bits)
        qt.fields["scale"] = Stored(scale, 16)
        qt.fields["zero"] = Stored(zero, 16)
        return qt

    def _quantize_blocked(self, x: torch.Tensor, kind: Kind, bits: int, g: int) -> QuantizedTensor:
        """:meth:`_quantize` in blocks of rows (one row = one token of one head) of about
        :data:`~kvqbench.numerics.blocks.BLOCK_ELEMS` · :data:`_BLOCK_FACTOR` elements, on one CPU thread
        (:func:`_blocked`).

        Why: written as whole-tensor operations the round trip makes a pass over memory per operation
        (rotation, minima, maxima, divide, round, shift, clamp, cast, bit packing), each with a full-size
        temporary. Here each block is rotated into one cache-sized buffer and quantized there (group minima
        and maxima, parameters, codes, kept as floats), and its codes are packed straight into their bytes
        of the packed output (:func:`~kvqbench.numerics.packing.pack_float_codes`; a block starts at a row
        multiple of :data:`_ROW_MULTIPLE`: a whole number of bytes) before the next block is read: the
        input is read once and only the packed codes and the per-group parameters are written. For fp32
        blocks in whole groups of a multiple of 8 (e.g. the default group = head_dim), everything after the
        rotation runs compiled in one pass per row (:func:`~kvqbench.numerics.zpoint.quantize_pack_rows`,
        the same IEEE operations in the same order) where :func:`_compiled_ok` found the torch steps'
        (:func:`_quantize_block`) bits once per process; a block it declines (a zero group minimum or
        maximum, a NaN or an infinity) takes the torch steps. Measured (``kvqbench perf --threads 1``, 2
        bits, (1, 8, T, 128), 3 runs alternating with the torch steps, load 1.6–1.8): round trip 21–25 %
        shorter at T = 1k/4k/16k; as a multiple of the eager RTN of the same run, K/V medians 1.13/1.06
        (1k, runs 1.07–1.26), 1.05/0.98 (4k, 0.93–1.28), 0.79/0.78 (16k), against 1.45/1.36, 1.30/1.29,
        1.00/0.99 before.

        Guarantee: the stored fields are those of the whole-tensor path, bit for bit. The rotation of a
        block is the rotation of its rows (:func:`_blocked` takes this path only where the product's row
        blocks give the whole product's bits), every later step is per group (exact minima and maxima,
        elementwise arithmetic; a partial last group is padded per block as on the whole tensor) and the
        packing of a block is its slice of the whole packing. NaN/Inf raise the same ``ValueError``: the
        group minima and maxima of every block are kept and checked after the loop, as in the whole-tensor
        path (a NaN spoils only its own codes, never returned).
        """
        cd, dev, d = compute_dtype(x.dtype), x.device, int(x.shape[-1])
        n, ng = x.numel() // d, -(-d // g)
        rows = x.reshape(n, d)
        spans = _spans(n, d)
        most = max(sl.stop - sl.start for sl in spans)
        buf = torch.empty(most, d, dtype=cd, device=dev)
        packed = torch.empty(packed_nbytes(n * d, bits), dtype=torch.uint8, device=dev)
        lo, hi, scale, zero = (torch.empty(n, ng, 1, dtype=cd, device=dev) for _ in range(4))
        with blocks.one_cpu_thread(dev):
            compiled = zpoint.supports(d, g, bits, cd, dev) and _compiled_ok()
            for sl in spans:
                r = sl.stop - sl.start
                xr = fwht(rows[sl], out=buf[:r])
                outs = (lo[sl], hi[sl], scale[sl], zero[sl], packed[_byte_span(sl, d, bits)])
                if not (compiled and zpoint.quantize_pack_rows(xr, g, bits, include_zero=(kind == "k"),
                                                               clip=self.clip_ratio, lo=outs[0], hi=outs[1],
                                                               scale=outs[2], zero=outs[3], packed=outs[4])):
                    _quantize_block(xr, kind, bits, g, self.clip_ratio, *outs)
        check_finite(x, lo, hi, name=kind.upper())
        lead = tuple(x.shape[:-1])
        qt = self._new_qt(x, kind, bits, group_size=g)
        qt.add_packed("codes", packed, tuple(x.shape), bits)
        qt.fields["scale"] = Stored(scale.view(*lead, ng, 1), 16)
        qt.fields["zero"] = Stored(zero.view(*lead, ng, 1), 16)
        return qt

    def _decodes_blocked(self, qt: QuantizedTensor) -> bool:
        """Whether ``qt`` (of this method) decodes in row blocks (:func:`_blocked`; per-group parameters)."""
        g, scale, zero, d = qt.meta["group_size"], qt["scale"], qt["zero"], int(qt.shape[-1])
        per_group = (*qt.shape[:-1], -(-d // g), 1)
        return (tuple(scale.shape) == per_group and tuple(zero.shape) == per_group
                and qt.meta.get("codes.shape") == tuple(qt.shape)
                and _blocked(scale.device, math.prod(qt.shape), d, scale.dtype))

    @torch.no_grad()
    def dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
        """:meth:`Quantizer.dequantize <kvqbench.quantizers.base.Quantizer.dequantize>`; the blocked decode
        saturates each block while it is in cache instead of a pass over the whole output after it (the
        same values)."""
        if "passthrough" in qt.fields or not self._decodes_blocked(qt):
            return super().dequantize(qt)
        out = self._dequantize_blocked(qt, qt.meta["group_size"], saturate=qt.dtype)
        return out.to(dtype=qt.dtype, device=qt.device).reshape(qt.shape)

    def _dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
        g, scale, zero = qt.meta["group_size"], qt["scale"], qt["zero"]
        if self._decodes_blocked(qt):
            return self._dequantize_blocked(qt, g)
        cg, restore = to_groups(qt.codes("codes", torch.uint8), -1, g)
        xr = restore(quarot_dequantize(cg, scale, zero))
        return fwht(xr, out=xr) if xr.is_contiguous() and xr.dtype in (torch.float32, torch.float64) else fwht(xr)

    def _dequantize_blocked(self, qt: QuantizedTensor, g: int, saturate: torch.dtype | None = None) -> torch.Tensor:
        """:meth:`_dequantize` in the row blocks of :meth:`_quantize_blocked` (same reasons, same
        guarantee): each block's codes are unpacked from their bytes of the packed field (a cache-sized
        temporary), decoded (``scale · (q − z)``) into a block buffer (compiled, from the bytes:
        :func:`~kvqbench.numerics.zpoint.decode_rows`, under :func:`_compiled_ok`) and rotated back straight
        into the output; with ``saturate`` (a dtype) each block is then saturated to its finite range while in cache
        (:func:`~kvqbench.quantizers.base.saturate_`, what :meth:`dequantize` does to the whole output),
        unless the parameters bound every output well inside that range (:func:`_within`)."""
        scale, d = qt["scale"], int(qt.shape[-1])
        n, ng, bits = math.prod(qt.shape) // d, -(-d // g), qt.meta["codes.bits"]
        packed = qt.fields["codes"].tensor
        sc, ze = scale.reshape(n, ng, 1), qt["zero"].reshape(n, ng, 1)
        out = torch.empty(n, d, dtype=scale.dtype, device=scale.device)
        spans = _spans(n, d)
        most = max(sl.stop - sl.start for sl in spans)
        buf = torch.empty(most, d, dtype=scale.dtype, device=scale.device)
        if saturate is not None and _within(sc, ze, qt.meta["codes.bits"], d, saturate):
            saturate = None  # every output is provably finite and within the dtype's range: nothing to clamp
        compiled = zpoint.supports(d, g, bits, scale.dtype, scale.device) and _compiled_ok()
        with blocks.one_cpu_thread(scale.device):
            for sl in spans:
                r = sl.stop - sl.start
                if compiled and zpoint.decode_rows(packed[_byte_span(sl, d, bits)], g, bits, sc[sl], ze[sl],
                                                   buf[:r]):
                    xr = buf[:r]
                else:
                    xr = _decode_block(packed[_byte_span(sl, d, bits)], g, bits, sc[sl], ze[sl], buf[:r])
                fwht(xr, out=out[sl])
                if saturate is not None:
                    saturate_(out[sl], saturate)
        return out.view(qt.shape)

    def nominal_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        d = shape[-1]
        n_groups = -(-d // self._group(d))
        return bits + n_groups * (8 + 16) / d
