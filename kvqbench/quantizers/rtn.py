"""Round-to-nearest baselines at three granularities, and the shared grouped-RTN method.

Asymmetric min/max RTN (docs/DESIGN.md §7, "RTN family"): one (scale, zero-point) per whole tensor
(``rtn_tensor``), per token over head_dim (``rtn_token``) or per channel over the sequence
(``rtn_channel``). Classical uniform quantization; no paper-specific deltas. The steps, per group:

1. ``lo = min x``, ``scale = (max x − lo)/(2^b − 1)``;
2. ``q = clamp(round((x − lo)/scale), 0, 2^b − 1)``, packed into ``b`` bits each;
3. decode ``x̂ = q·scale + lo``

(:func:`~kvqbench.numerics.rtn.quantize_packed` / :func:`~kvqbench.numerics.rtn.dequantize_packed`).
"""

from __future__ import annotations

import torch

from kvqbench.numerics.rtn import (
    Granularity,
    PerChannel,
    PerTensor,
    PerToken,
    dequantize_packed,
    quantize_packed,
)
from kvqbench.quantizers.base import Kind, QuantizedTensor, Quantizer, Stored, register

__all__ = ["GroupedRTNQuantizer", "RTNTensor", "RTNToken", "RTNChannel"]

#: benchmark budget for one group's metadata: FP8 scale + FP16 zero-point
AUX_BITS_NOMINAL = 8 + 16
#: as stored: fp16 scale + fp16 zero-point
AUX_BITS_EFFECTIVE = 16 + 16


def _group_elems(gran: Granularity, shape: tuple[int, int, int, int]) -> int:
    b, h, t, d = shape
    if isinstance(gran, PerTensor):  # one group per batch entry (layer)
        return h * t * d
    if isinstance(gran, PerToken):
        return d if gran.group_size is None else min(gran.group_size, d)
    if isinstance(gran, PerChannel):
        return t if gran.group_size is None else min(gran.group_size, t)
    raise TypeError(gran)


class GroupedRTNQuantizer(Quantizer):
    """Asym RTN with one granularity for K and one for V.

    Stores packed ``b``-bit codes, one fp16-billed scale and one fp16-billed zero-point (the float
    group minimum, as KIVI) per group. Nominal bits = ``b + 24 / group_elements``.
    """
    seeded = False  # no randomness

    def granularity(self, kind: Kind) -> Granularity:  # pragma: no cover - abstract-ish
        raise NotImplementedError

    def _view(self, x: torch.Tensor) -> torch.Tensor:
        """The layout the groups are taken in (identity; per-tensor flattens each batch entry)."""
        return x

    def _quantize(self, x: torch.Tensor, kind: Kind, bits: int) -> QuantizedTensor:
        gran = self.granularity(kind)
        xv = self._view(x)
        packed, lo, scale = quantize_packed(xv, bits, gran)  # steps 1–2
        # the granularity (with its group size) travels in meta: any instance of the method decodes it
        qt = self._new_qt(x, kind, bits, granularity=gran)
        qt.add_packed("codes", packed, tuple(xv.shape), bits)
        qt.fields["scale"] = Stored(scale, 16)
        qt.fields["zero"] = Stored(lo, 16)
        return qt

    def _dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
        return dequantize_packed(qt.fields["codes"].tensor, qt.meta["codes.shape"], qt.meta["codes.bits"],
                                 qt["zero"], qt["scale"], qt.meta["granularity"])  # step 3

    def nominal_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        return bits + AUX_BITS_NOMINAL / _group_elems(self.granularity(kind), shape)


@register
class RTNTensor(GroupedRTNQuantizer):
    """RTN with one asymmetric (scale, zero-point) for the whole K (or V) tensor of each batch entry.

    A batch entry's ``(kv_heads, seq_len, head_dim)`` block is one tensor: for real captures the batch
    axis holds the layers, and every layer's cache is its own tensor.
    """

    id = "rtn_tensor"
    name = "RTN per-tensor"
    paper = "Uniform round-to-nearest baseline"
    k_granularity = "per-tensor (per layer / batch entry)"
    v_granularity = "per-tensor (per layer / batch entry)"
    local_stats = True

    def granularity(self, kind: Kind) -> Granularity:
        return PerToken()  # over the flattened (kv_heads·seq_len·head_dim) of each batch entry

    def _view(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], 1, 1, -1)

    def nominal_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        return bits + AUX_BITS_NOMINAL / _group_elems(PerTensor(), shape)


@register
class RTNToken(GroupedRTNQuantizer):
    """RTN with one (scale, zero-point) per token over head_dim, for K and V."""

    id = "rtn_token"
    name = "RTN per-token"
    paper = "Uniform round-to-nearest baseline"
    k_granularity = "per-token"
    v_granularity = "per-token"

    def granularity(self, kind: Kind) -> Granularity:
        return PerToken()


@register
class RTNChannel(GroupedRTNQuantizer):
    """RTN with one (scale, zero-point) per channel over the whole sequence, for K and V."""

    id = "rtn_channel"
    name = "RTN per-channel"
    paper = "Uniform round-to-nearest baseline"
    k_granularity = "per-channel"
    v_granularity = "per-channel"

    def granularity(self, kind: Kind) -> Granularity:
        return PerChannel()
