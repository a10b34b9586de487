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

Everything here is plain torch; the rotation, VarN and the balanced RTN are reference steps with compiled
versions in :mod:`kvqbench.kernels` (agreement within a stated tolerance, docs/DESIGN.md §7).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvqbench.numerics.hadamard import fwht
from kvqbench.numerics.scale import pow2_floor, pow2_window
from kvqbench.numerics.varn import DEFAULT_ITERS, balanced_rtn_rows, varn
from kvqbench.quantizers.base import (
    Kind,
    QuantizedTensor,
    Quantizer,
    Stored,
    StreamPolicy,
    register,
)

__all__ = ["KVarN", "tile_window", "SCALE_FLOOR", "SINK_TOKENS", "WINDOW"]

#: the least RTN step of step 3
SCALE_FLOOR = 1e-10
#: per kind, the exponents ``(lo, hi)`` of the tile-RMS window ``[2^lo, 2^(hi+1))`` the reference
#: numerics run in (:func:`tile_window`). K: VarN balances columns only down to std e^−0.3 ≈ 0.74, so
#: below RMS 2^−1 K's error would depend on the scale; V's error does not depend on it, its window only
#: keeps the absolute floors away. Every real (SmolLM2-135M: K tile RMS ≥ 0.96, V ≥ 0.036) and synthetic
#: tile lies inside.
WINDOW = {"k": (-1, 12), "v": (-6, 12)}
#: fp16 attention-sink tokens of the reference runtime (pseudo-decode regime)
SINK_TOKENS = 128


def tile_window(tiles: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The power of two ``c`` ``[..., 1, 1]`` that brings each tile's RMS into KVarN's window
    (:data:`WINDOW`; 1 for a tile already inside it and for an all-zero tile), and the tiles' ``max |x|``
    ``[..., 1, 1]`` (NaN or +Inf when a tile holds a NaN or an Inf).

    VarN's constants (std clamp ``[1e-3, 1e3]``, log-scale clip ``[−0.3, 10]``, imbalance floor 1e-8) and
    the RTN scale floor 1e-10 are absolute and assume tiles of roughly unit scale: far below it VarN stops
    balancing (K's error rises ≈2.1–2.6×) and the floor collapses every row to its minimum; far above it
    the log-scale clip saturates. Dividing a tile by ``c`` (exact) and absorbing ``c`` into the stored row
    vectors (exact) runs the numerics in their regime at every input scale. The RMS is taken after an exact
    power-of-two prescale (``pow2_floor(max |x|)``), so it neither under- nor overflows.

    Args:
        tiles: ``[..., R, C]`` fp32 tiles, the last two dims mergeable (either orientation: the RMS is the
            same).
        kind: ``"k"`` or ``"v"``.
    """
    flat = tiles.flatten(-2)
    absmax = torch.maximum(flat.amax(-1, keepdim=True), flat.amin(-1, keepdim=True).neg_())
    p = pow2_floor(absmax)
    rms = torch.linalg.vector_norm(flat / p, dim=-1, keepdim=True) * p / math.sqrt(flat.shape[-1])
    return pow2_window(rms, *WINDOW[kind]).unsqueeze(-1), absmax.unsqueeze(-1)


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
        ValueError: bad ``group_size``/``varn_iters``/``sink_tokens``, bit widths 9..15, or a NaN/Inf in
            the input.
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
        "the error depend on the input scale. Tiles inside the window are quantized as the paper's steps.",
        "Compiled VarN (CPU): one-pass stds (fp32 sums shifted by the tile's first sample) of the balanced "
        "tile without materializing it, scales updated without exp/log; scales and codes agree with the "
        "plain-torch steps within the tolerance tests/property/test_kernels_varn.py states.",
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
        """``(name, start, n_tokens)`` of the block of full tiles and of the partial tile, if any."""
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
        xr = fwht(x)  # §3 step 1: Hadamard along head_dim, H/√D (fp32)
        qt = self._new_qt(x, kind, bits)
        qt.meta["spans"] = spans = self._spans(t)
        for name, start, n in spans:
            g = min(self.group_size, n)
            blk = xr[:, :, start : start + n, :].reshape(b_, h, n // g, g, d)  # [B, H, nt, G, D]
            tiles = blk.transpose(-1, -2) if kind == "k" else blk  # rows: K channels [D, G], V tokens [G, D]
            # scale window (exact powers of two; a tile's RMS is that of its token-major block)
            c, _ = tile_window(blk, kind)
            tiles = tiles / c
            res = varn(tiles, self.varn_iters)  # §3 step 2: VarN, tiles ≈ B · s_row · s_col
            # §3 step 3: asymmetric RTN of B = tiles / s_col / s_row per row
            q, lo, scale = balanced_rtn_rows(tiles, res.s_col, res.s_row, bits, SCALE_FLOOR)
            # §3 step 4: scale absorption — a = s_row·scale, z = s_row·lo per row (times c), t = s_col per column
            qt.add_codes(f"{name}.codes", q, bits)
            qt.fields[f"{name}.row_scale"] = Stored((res.s_row * scale * c).squeeze(-1), 16)
            qt.fields[f"{name}.row_zero"] = Stored((res.s_row * lo * c).squeeze(-1), 16)
            qt.fields[f"{name}.col_scale"] = Stored(res.s_col.squeeze(-2), 16)
        return qt

    def _dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
        b_, h, t, d = qt.shape
        parts = []
        for name, _start, n in qt.meta["spans"]:
            q = qt.codes(f"{name}.codes", torch.uint8)  # [B, H, nt, R, C]
            a = qt[f"{name}.row_scale"].unsqueeze(-1)
            z = qt[f"{name}.row_zero"].unsqueeze(-1)
            col = qt[f"{name}.col_scale"].unsqueeze(-2)
            nt, rows, cols = q.shape[-3:]
            blk = a.new_empty(b_, h, nt, n // nt, d)  # token-major [B, H, nt, G, D]
            tiles = blk.transpose(-1, -2) if qt.kind == "k" else blk  # rows: K channels, V tokens
            torch.mul(q, a, out=tiles).add_(z).mul_(col)  # §3 step 4: x̂[r, c] = (q·a[r] + z[r])·t[c]
            parts.append(blk.view(b_, h, n, d))
        xr = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        return fwht(xr)  # inverse of step 1: H/√D is its own inverse

    def nominal_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        """``b`` + per tile (rows·(8 + 16) + cols·8) bits / elements: FP8 absorbed scales, FP16 zero."""
        b_, h, t, d = shape
        aux = 0
        for _name, _start, n in self._spans(t):
            g = min(self.group_size, n)
            rows, cols = (d, g) if kind == "k" else (g, d)
            aux += (n // g) * (rows * (8 + 16) + cols * 8)
        return bits + aux / (t * d)
