"""QuaRot — Walsh–Hadamard rotation of K and V followed by groupwise asymmetric RTN.

Based on Ashkboos et al., "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs", arXiv:2404.00456:
§4 (an online Hadamard on the KV cache, Fig. 4) and §4.2 "KV cache quantization" (asymmetric groupwise
RTN, group = head_dim, clip ratio 0.95), as its public reference simulation does it (fake-quant of K/V
after the rotation; K forces 0 into the range). The steps, per token of one head:

1. rotate: ``xr = x Q`` with ``Q`` the normalized Hadamard of order head_dim (§4, applied by butterflies,
   :func:`kvqbench.numerics.hadamard.fwht`, as the reference applies its online Hadamard with a fast kernel);
2. per group ``x`` of ``xr`` (§4.2)::

       lo = min x, hi = max x             (K: lo = min(lo, 0), hi = max(hi, 0))
       lo, hi = 0.95·lo, 0.95·hi          (clip ratio)
       scale = (hi − lo) / (2^b − 1)
       z = round(−lo / scale)             (integer zero-point)
       q = clamp(round(x / scale) + z, 0, 2^b − 1)

3. decode ``x̂r = scale · (q − z)`` and rotate back (the normalized Hadamard is its own inverse).

Stored per group: one scale and one integer zero-point, both billed fp16 (16 + 16 bits); codes packed.
Effective bits = ``b + 32/G`` (``b + 0.25`` at G = head_dim = 128); nominal (FP8 scale, FP16 zero)
= ``b + 24/G``.

Steps 2 and 3 are groupwise asymmetric RTN with a clip ratio and an integer zero-point, a general numeric step
(:mod:`kvqbench.numerics.zpoint`, with a fast version in :mod:`kvqbench.kernels.zpoint`); this file holds what
is QuaRot's own: the rotation, the clip ratio 0.95, 0 kept in K's range, the group over head_dim.
"""

from __future__ import annotations

from typing import Any

import torch

from kvqbench.numerics import hadamard
from kvqbench.numerics.zpoint import dequantize_groups, quantize_groups
from kvqbench.quantizers.base import Kind, QuantizedTensor, Quantizer, Stored, register

__all__ = ["QuaRot", "CLIP_RATIO"]

CLIP_RATIO = 0.95


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
        ValueError: bad ``group_size``/``clip_ratio``, or bit widths 9..15; in :meth:`quantize`, NaN/Inf.
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

    def _quantize(self, x: torch.Tensor, kind: Kind, bits: int) -> QuantizedTensor:
        g = self._group(int(x.shape[-1]))
        xr = hadamard.fwht(x)  # 1. rotate (§4)
        packed, scale, zero = quantize_groups(xr, g, bits, include_zero=(kind == "k"),  # 2. RTN (§4.2)
                                              clip_ratio=self.clip_ratio)
        qt = self._new_qt(x, kind, bits, group_size=g)
        qt.add_packed("codes", packed, tuple(x.shape), bits)
        qt.fields["scale"] = Stored(scale, 16)
        qt.fields["zero"] = Stored(zero, 16)
        return qt

    def _dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
        xr = dequantize_groups(qt.fields["codes"].tensor, tuple(qt.shape), qt.meta["group_size"],
                               qt.meta["codes.bits"], qt["scale"], qt["zero"])  # 3. decode (§4.2)
        return hadamard.fwht(xr, out=xr if xr.is_contiguous() else None)  # and rotate back (Q Q = I)

    def nominal_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        d = shape[-1]
        n_groups = -(-d // self._group(d))
        return bits + n_groups * (8 + 16) / d
