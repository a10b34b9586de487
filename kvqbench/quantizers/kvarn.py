"""KVarN — Hadamard rotation, variance normalization (VarN), per-row RTN and scale absorption.

Based on Müller et al., arXiv:2606.03458, §3 (tiles of G tokens per KV head; steps 1–4 below) and
its reference vLLM fork (runtime policy: 128 fp16 sink tokens, a partly filled tile stays fp16).

Per KV head, the sequence is cut into tiles of ``G`` tokens. The K tile is laid out ``[D, G]``
(rows = channels), the V tile ``[G, D]`` (rows = tokens); rows are always the rounding axis.

1. Sylvester Hadamard along head_dim, scaled 1/√D, no random signs (self-inverse).
2. VarN (:func:`kvqbench.numerics.varn.varn`, 16 iterations): row scales ``s_row`` and column
   scales ``s_col`` with the tile ≈ ``B · s_row · s_col`` and ``B`` balanced.
3. Asym RTN of ``B`` per row over the whole tile width: ``lo, hi`` per row,
   ``scale = max((hi − lo)/(2^b − 1), 1e-10)``, ``q = clamp(round((B − lo)/scale), 0, 2^b − 1)``.
4. Scale absorption — three vectors per tile, all billed fp16: per row ``a = s_row·scale`` and
   ``z = s_row·lo``, per column ``t = s_col``; decode ``x̂[r, c] = (q[r, c]·a[r] + z[r])·t[c]``.
   For K the rows are channels (``a``, ``z`` per channel, ``t`` per token); for V the rows are tokens
   (``a``, ``z`` per token, ``t`` = ``s_chan`` per channel).

Bits at k2v2, G = 128, D = 128: effective ``2 + (2·128 + 128)·16 / 128² = 2.375``; nominal (the
per-row scale and per-column scale billed FP8, the per-row zero FP16) ``2 + (128·24 + 128·8)/128² = 2.25``.

Static tensors whose length is not a multiple of G: the last ``T mod G`` tokens form one shorter tile
(``[D, T mod G]`` for K, ``[T mod G, D]`` for V) that goes through the same steps (VarN, RTN,
absorption) and is billed for its own three vectors. In the pseudo-decode regime the reference keeps
such a partly filled tile in fp16 instead (:meth:`KVarN.stream_policy`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvqbench.numerics import blocks
from kvqbench.numerics.hadamard import hadamard_matrix, hadamard_transform, rotation_rows_independent
from kvqbench.numerics.scale import pow2_floor, pow2_window
from kvqbench.numerics.varn import DEFAULT_ITERS, balanced_rtn_rows, transposed, varn
from kvqbench.quantizers.base import (
    Kind,
    QuantizedTensor,
    Quantizer,
    Stored,
    StreamPolicy,
    check_finite,
    register,
)

__all__ = ["KVarN", "rtn_rows", "tile_absmax", "tile_window", "SCALE_FLOOR", "SINK_TOKENS", "WINDOW"]

SCALE_FLOOR = 1e-10
#: per kind, the exponents ``(lo, hi)`` of the tile-RMS window ``[2^lo, 2^(hi+1))`` the reference
#: numerics run in (:func:`tile_window`). K: VarN balances columns only down to std e^−0.3 ≈ 0.74, so
#: below RMS 2^−1 K's error would depend on the scale; V's error does not depend on it, its window only
#: keeps the absolute floors away. Every real (SmolLM2-135M: K tile RMS ≥ 0.96, V ≥ 0.036) and synthetic
#: tile lies inside.
WINDOW = {"k": (-1, 12), "v": (-6, 12)}
#: fp16 attention-sink tokens of the reference runtime (pseudo-decode regime)
SINK_TOKENS = 128
#: bytes of tiles per slice of :func:`tile_window`'s mean-square pass (stays in the core's cache)
_SLICE_BYTES = 1 << 20


def rtn_rows(b: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asym RTN of ``b`` ``[..., R, C]`` per row over the last dim (KVarN step 3).

    Returns ``(codes int64 [..., R, C], lo [..., R, 1], scale [..., R, 1])`` with
    ``scale = max((hi − lo)/(2^b − 1), 1e-10)`` (a constant row gets codes 0 and decodes to ``lo``).
    """
    lo = b.amin(-1, keepdim=True)
    hi = b.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(SCALE_FLOOR)
    q = torch.clamp(torch.round((b - lo) / scale), 0, 2**bits - 1).to(torch.int64)
    return q, lo, scale


def _rtn_rows_inplace(b: torch.Tensor, bits: int,
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rtn_rows` with uint8 codes, overwriting ``b`` (same arithmetic, no temporaries); ``out``: a
    uint8 tensor of ``b``'s shape the codes are written to."""
    lo = b.amin(-1, keepdim=True)  # (torch.aminmax is not vectorized on the CPU: two passes are faster)
    hi = b.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(SCALE_FLOOR)
    b.sub_(lo).div_(scale).round_().clamp_(0, 2**bits - 1)
    q = b.to(torch.uint8) if out is None else out.copy_(b)
    return q, lo, scale


def _tile_blocks(n_tiles: int, rows: int, cols: int, device: torch.device) -> list[slice]:
    """Cache-sized blocks of consecutive tiles on the CPU (:func:`kvqbench.numerics.blocks.row_blocks`), one
    block elsewhere: the elementwise steps and the exact per-row minima/maxima of the tiles give the same
    bits blocked or not, and a block's temporaries stay in the core's cache (one pass over memory instead
    of one per operation)."""
    if device.type != "cpu":
        return [slice(0, n_tiles)]
    return blocks.row_blocks(n_tiles, rows * cols)


#: whether the compiled balance + RTN (:func:`kvqbench.numerics.varn.balanced_rtn_rows`) gave this torch code's
#: bits on random tiles (checked once per process, every bit width 1..8)
_C_BALANCE: dict[str, bool] = {}


def _c_balance_ok() -> bool:
    if "ok" not in _C_BALANCE:
        _C_BALANCE["ok"] = False
        g = torch.Generator().manual_seed(2606)
        for bits in range(1, 9):
            x = torch.randn(3, 16, 40, generator=g) * torch.exp(torch.randn(3, 16, 1, generator=g))
            x[0, 0] = 1.5  # a constant row (scale floor)
            sc, sr = torch.rand(3, 1, 40, generator=g) + 0.5, torch.rand(3, 16, 1, generator=g) + 0.5
            got = balanced_rtn_rows(x.clone(), sc, sr, bits, SCALE_FLOOR)
            want = _balance_rtn_torch(x.clone(), sc, sr, bits)
            if got is None or not all(torch.equal(a, b) for a, b in zip(got, want)):
                return False
        _C_BALANCE["ok"] = True
    return _C_BALANCE["ok"]


def _fused_rotation_exact(qt: QuantizedTensor) -> bool:
    """Whether :meth:`KVarN._dequantize_fused` may rotate ``qt``'s single span block by block of tiles: the
    rotation's row blocks (one tile, ``G`` rows, up to a cache-sized block of tiles, on one thread) give
    the whole product's bits here (:func:`~kvqbench.numerics.hadamard.rotation_rows_independent`, as
    QuaRot's blocked path asks); otherwise the whole-tensor rotation is used."""
    (name, _start, _n), = qt.meta["spans"]
    shape = qt.meta[f"{name}.codes.shape"]
    rows, cols, d = shape[-2], shape[-1], int(qt.shape[-1])
    tile_rows = max(1, rows * cols // d)  # output rows (tokens) per tile
    most = max(sl.stop - sl.start for sl in _tile_blocks(math.prod(shape[:-2]), rows, cols, qt.device))
    return rotation_rows_independent(d, qt[f"{name}.row_scale"].dtype, min_rows=tile_rows,
                                     block_rows=most * tile_rows)


def _balance_rtn(tiles: torch.Tensor, s_col: torch.Tensor, s_row: torch.Tensor,
                 bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_rtn_rows_inplace` of the balanced tiles ``tiles / s_col / s_row`` (``tiles`` ``[..., R, C]``
    contiguous, overwritten): compiled in one pass per row where that gives this torch code's bits
    (:func:`_c_balance_ok`), else block by block of tiles (:func:`_tile_blocks`); the same arithmetic."""
    if tiles.device.type == "cpu" and bits <= 8 and _c_balance_ok():
        res = balanced_rtn_rows(tiles, s_col.contiguous(), s_row.contiguous(), bits, SCALE_FLOOR)
        if res is not None:
            return res
    return _balance_rtn_torch(tiles, s_col, s_row, bits)


def _balance_rtn_torch(tiles: torch.Tensor, s_col: torch.Tensor, s_row: torch.Tensor,
                       bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_balance_rtn` in torch, block by block of tiles."""
    rows, cols = tiles.shape[-2:]
    t3 = tiles.view(-1, rows, cols)
    sc3, sr3 = s_col.reshape(-1, 1, cols), s_row.reshape(-1, rows, 1)
    q = torch.empty(t3.shape, dtype=torch.uint8, device=tiles.device)
    lo = torch.empty(t3.shape[0], rows, 1, dtype=tiles.dtype, device=tiles.device)
    scale = torch.empty_like(lo)
    with blocks.one_cpu_thread(tiles.device):
        for sl in _tile_blocks(t3.shape[0], rows, cols, tiles.device):
            _, lo[sl], scale[sl] = _rtn_rows_inplace(t3[sl].div_(sc3[sl]).div_(sr3[sl]), bits, out=q[sl])
    lead = tiles.shape[:-2]
    return q.view(tiles.shape), lo.view(*lead, rows, 1), scale.view(*lead, rows, 1)


def tile_absmax(tiles: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over the last two dims of ``tiles`` ``[..., R, C]`` (keepdim), as ``max(max x, −min x)``
    (no full-size ``|x|``); NaN when the tile holds a NaN, +Inf for an Inf (so it also proves finiteness)."""
    if tiles.stride(-2) != tiles.shape[-1] * tiles.stride(-1):  # e.g. K's transposed view: its transpose is
        tiles = tiles.transpose(-1, -2)  # the same elements with mergeable last dims
    flat = tiles.flatten(-2)
    return torch.maximum(flat.amax(-1, keepdim=True), flat.amin(-1, keepdim=True).neg_()).unsqueeze(-1)


def tile_window(tiles: torch.Tensor, kind: str, absmax: torch.Tensor | None = None) -> torch.Tensor:
    """The power of two ``c`` ``[..., 1, 1]`` that brings each tile's RMS into KVarN's window
    (:data:`WINDOW`); 1 for a tile already inside it (and for an all-zero tile). ``absmax``: the tiles'
    :func:`tile_absmax`, when already computed.

    VarN's constants (std clamp ``[1e-3, 1e3]``, log-scale clip ``[−0.3, 10]``, imbalance floor 1e-8) and
    the RTN scale floor 1e-10 are absolute and assume tiles of roughly unit scale: far below it VarN stops
    balancing (K's error rises ≈2.1–2.6×) and the floor collapses every row to its minimum; far above it
    the log-scale clip saturates. Dividing a tile by ``c`` (exact) and absorbing ``c`` into the stored row
    vectors (exact) runs the reference numerics in their regime at every input scale; inside the window
    nothing changes, bit for bit. The RMS is taken after an exact power-of-two prescale, so it neither
    under- nor overflows.
    """
    p = pow2_floor(tile_absmax(tiles) if absmax is None else absmax)
    # the mean square tile by tile in cache-sized slices (no full-size temporary; a tile's mean is the same
    # reduction of the same values whatever the slice)
    # [outer, n, R, C]: the tile axis next to the tile stays a view even when the tiles are a strided slice
    t4 = tiles.reshape(-1, *tiles.shape[-3:]) if tiles.dim() >= 3 else tiles.reshape(1, 1, *tiles.shape)
    p4 = p.reshape(t4.shape[0], t4.shape[1], 1, 1)
    step = max(1, _SLICE_BYTES // max(1, t4.shape[-2] * t4.shape[-1] * 4))
    ms = torch.empty_like(p4)
    nt = torch.get_num_threads()
    single = tiles.device.type == "cpu" and nt > 1  # cache-sized operations: one thread (as VarN's)
    if single:
        torch.set_num_threads(1)
    try:
        for o in range(t4.shape[0]):
            for i in range(0, t4.shape[1], step):
                sq = t4[o, i : i + step] / p4[o, i : i + step]
                torch.mean(sq.mul_(sq), dim=(-2, -1), keepdim=True, out=ms[o, i : i + step])
    finally:
        if single:
            torch.set_num_threads(nt)
    rms = torch.sqrt(ms.reshape(p.shape)) * p
    lo_exp, hi_exp = WINDOW[kind]
    return pow2_window(rms, lo_exp, hi_exp)


@register
class KVarN(Quantizer):
    """KVarN (arXiv:2606.03458 §3): Hadamard → VarN → per-row RTN → scale absorption, per tile of G tokens.

    Shapes: ``quantize(x, kind)`` takes ``(batch, kv_heads, seq_len, head_dim)`` fp32/fp16/bf16;
    computation in fp32; ``dequantize`` returns the input's shape, dtype and device.

    Args:
        k_bits, v_bits: code widths (1..8; >= 16 = exact passthrough). Default 2 (k2v2).
        group_size: G, tokens per tile (paper: 128; 64 also used). Any positive int is accepted.
        varn_iters: VarN iterations (paper: 16; later reference code: 8).
        sink_tokens: fp16 sink tokens of the pseudo-decode regime (reference: 128).
        seed: unused (the method is deterministic); recorded.

    Raises:
        ValueError: bad ``group_size``/``varn_iters``/``sink_tokens``, or bit widths 9..15.
    """

    id = "kvarn"
    seeded = False  # no randomness
    name = "KVarN"
    paper = "Müller et al., KVarN (arXiv 2606.03458)"
    arxiv = "2606.03458"
    k_granularity = "Hadamard → VarN on [D, G] tiles → per-channel RTN over G tokens, per-token scale"
    v_granularity = "Hadamard → VarN on [G, D] tiles → per-token RTN over head_dim, per-channel scale"
    rotation = True
    grouped = True
    fidelity = "faithful"
    finite_check = "stats"  # the tiles' max |x| (the scale window's statistic) covers every element
    deltas = (
        "The three absorbed scale vectors are held at working precision (fp32) and billed as fp16; the "
        "reference rounds them to fp16.",
        "Static tensors: a last tile of T mod G tokens is quantized as a shorter tile (its own VarN, RTN "
        "and three vectors); the reference runtime keeps a partly filled tile fp16 (pseudo-decode).",
        "Static cells quantize every token; the 128 fp16 sink tokens of the reference runtime apply in "
        "the pseudo-decode regime only (stream_policy).",
        "VarN: a standard deviation over a single sample (a 1-token tile) is taken as 1 instead of NaN.",
        "head_dim not a power of two: block-diagonal Sylvester Hadamard (binary decomposition of D).",
        "Scale window: a tile whose RMS lies outside [2^-1, 2^13) (K) / [2^-6, 2^13) (V) is divided by a power "
        "of two into it before VarN and the factor is absorbed into the row vectors (exact); VarN's absolute "
        "clamps and the 1e-10 scale floor otherwise collapse tiny tiles (every row to its minimum) and make "
        "the error depend on the input scale. Tiles inside the window: the reference numerics, bit for bit.",
    )

    def __init__(
        self,
        k_bits: int = 2,
        v_bits: int | None = None,
        *,
        seed: int = 0,
        group_size: int = 128,
        varn_iters: int = DEFAULT_ITERS,
        sink_tokens: int = SINK_TOKENS,
    ) -> None:
        super().__init__(k_bits, v_bits, seed=seed)
        for nm, val, lo in (("group_size", group_size, 1), ("varn_iters", varn_iters, 0), ("sink_tokens", sink_tokens, 0)):
            if not isinstance(val, int) or isinstance(val, bool) or val < lo:
                raise ValueError(f"{nm} must be an int >= {lo}, got {val!r}")
        self.group_size = group_size
        self.varn_iters = varn_iters
        self.sink_tokens = sink_tokens

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "group_size": self.group_size,
            "varn_iters": self.varn_iters,
            "sink_tokens": self.sink_tokens,
        }

    def stream_policy(self, kind: Kind) -> StreamPolicy:
        """The reference runtime: ``sink_tokens`` fp16 sink tokens; a partly filled tile of G tokens
        stays fp16 until it is full."""
        return StreamPolicy(sink_tokens=self.sink_tokens, tile_tokens=self.group_size)

    # ------------------------------------------------------------------------------------------
    def _spans(self, t: int) -> list[tuple[str, int, int]]:
        """``(name, start, n_tokens)`` of the full-tile block and the partial tile, if any."""
        g = self.group_size
        n_full = t // g
        spans = []
        if n_full:
            spans.append(("full", 0, n_full * g))
        if t % g:
            spans.append(("tail", n_full * g, t % g))
        return spans

    def _quantize(self, x: torch.Tensor, kind: Kind, bits: int) -> QuantizedTensor:
        b_, h, t, d = x.shape
        xr = hadamard_transform(x.to(torch.float32))
        qt = self._new_qt(x, kind, bits)
        spans = self._spans(t)
        qt.meta["spans"] = spans
        for name, start, n in spans:
            g = min(self.group_size, n)
            blk = xr[:, :, start : start + n, :].reshape(b_, h, n // g, g, d)  # [B, H, nt, G, D]
            tiles = blk.transpose(-1, -2) if kind == "k" else blk  # rows: K channels, V tokens
            absmax = tile_absmax(blk)
            # finite_check "stats": a NaN/Inf of x spreads over its token's rotated row, so its tile's max |x|
            # is not finite (and a finite x whose rotation overflows is told apart by check_finite)
            check_finite(x, absmax, name=kind.upper())
            c = tile_window(tiles, kind, absmax)  # 1 for every tile of normal scale
            unit = bool((c == 1).all())  # then dividing by c changes nothing: skipped
            # a contiguous buffer of our own (xr is ours; K's transpose is copied once, divided by c on the
            # way), scaled and balanced in place
            if kind == "k":
                buf = torch.empty(b_, h, n // g, d, g, dtype=xr.dtype, device=xr.device)
                tiles = transposed(blk, out=buf) if unit else torch.div(tiles, c, out=buf)
            else:
                tiles = tiles.contiguous() if unit else tiles.contiguous().div_(c)
            # K: the token-major tiles (blk) are the transposed tiles VarN lays out anyway (one copy fewer)
            res = varn(tiles, self.varn_iters, tiles_t=blk if kind == "k" and unit else None)
            q, lo, scale = _balance_rtn(tiles, res.s_col, res.s_row, bits)
            qt.add_codes(f"{name}.codes", q, bits)
            qt.fields[f"{name}.row_scale"] = Stored((res.s_row * scale * c).squeeze(-1), 16)
            qt.fields[f"{name}.row_zero"] = Stored((res.s_row * lo * c).squeeze(-1), 16)
            qt.fields[f"{name}.col_scale"] = Stored(res.s_col.squeeze(-2), 16)
        return qt

    def _dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
        b_, h, t, d = qt.shape
        if len(qt.meta["spans"]) == 1 and qt.device.type == "cpu" and _fused_rotation_exact(qt):
            return self._dequantize_fused(qt)
        parts = []
        for name, _start, n in qt.meta["spans"]:
            q = qt.codes(f"{name}.codes", torch.uint8)
            a = qt[f"{name}.row_scale"].unsqueeze(-1)
            z = qt[f"{name}.row_zero"].unsqueeze(-1)
            c = qt[f"{name}.col_scale"].unsqueeze(-2)
            # (q·a + z)·c in one buffer; K's is decoded straight into the token-major layout (no
            # transposing copy)
            nt_, rows, cols = q.shape[-3:]
            shape = (b_, h, nt_, cols, rows) if qt.kind == "k" else q.shape
            blk = torch.empty(shape, dtype=a.dtype, device=a.device)  # [B, H, nt, G, D]
            tiles = blk.transpose(-1, -2) if qt.kind == "k" else blk
            q3, t3 = q.reshape(-1, rows, cols), tiles.view(-1, rows, cols)
            a3, z3, c3 = a.reshape(-1, rows, 1), z.reshape(-1, rows, 1), c.reshape(-1, 1, cols)
            with blocks.one_cpu_thread(a.device):  # block by block of tiles: one pass over memory
                for sl in _tile_blocks(t3.shape[0], rows, cols, a.device):
                    t3[sl].copy_(q3[sl]).mul_(a3[sl]).add_(z3[sl]).mul_(c3[sl])
            parts.append(blk.reshape(b_, h, n, d))
        xr = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        return hadamard_transform(xr)

    def _dequantize_fused(self, qt: QuantizedTensor) -> torch.Tensor:
        """:meth:`_dequantize` of a single span (every tile of the same shape) with the inverse rotation
        applied block by block of tiles: each block is decoded into a cache-sized buffer and rotated from
        there into the output (no full-size rotated intermediate). A tile block is a run of whole
        consecutive rows of the output; a row's product with the fixed rotation does not depend on the
        other rows of the product (blocks of at least half a block, :func:`_tile_blocks`), so the bits are
        those of :func:`hadamard_transform` on the whole tensor."""
        b_, h, t, d = qt.shape
        (name, _start, _n), = qt.meta["spans"]
        q = qt.codes(f"{name}.codes", torch.uint8)
        a = qt[f"{name}.row_scale"].unsqueeze(-1)
        z = qt[f"{name}.row_zero"].unsqueeze(-1)
        c = qt[f"{name}.col_scale"].unsqueeze(-2)
        rows, cols = q.shape[-2:]
        q3 = q.reshape(-1, rows, cols)
        a3, z3, c3 = a.reshape(-1, rows, 1), z.reshape(-1, rows, 1), c.reshape(-1, 1, cols)
        qm = hadamard_matrix(d, dtype=a.dtype, device=a.device)
        out = torch.empty(b_ * h * t, d, dtype=a.dtype, device=a.device)
        tile_rows = rows * cols // d  # output rows (tokens) per tile
        sls = _tile_blocks(q3.shape[0], rows, cols, a.device)
        buf = torch.empty(max(sl.stop - sl.start for sl in sls), rows * cols, dtype=a.dtype, device=a.device)
        with blocks.one_cpu_thread(a.device):
            for sl in sls:
                nb = sl.stop - sl.start
                blk = buf[:nb].view(nb, tile_rows, d)  # token-major tiles [nb, G, D]
                tiles = blk.transpose(-1, -2) if qt.kind == "k" else blk
                tiles.copy_(q3[sl]).mul_(a3[sl]).add_(z3[sl]).mul_(c3[sl])
                torch.mm(blk.view(-1, d), qm, out=out[sl.start * tile_rows : sl.stop * tile_rows])
        return out.view(b_, h, t, d)

    def nominal_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        """``b`` + per tile (rows·(8 + 16) + cols·8) bits / elements: FP8 absorbed scales, FP16 zero."""
        b_, h, t, d = shape
        aux = 0
        for _name, _start, n in self._spans(t):
            g = min(self.group_size, n)
            rows, cols = (d, g) if kind == "k" else (g, d)
            aux += (n // g) * (rows * (8 + 16) + cols * 8)
        return bits + aux / (t * d)
