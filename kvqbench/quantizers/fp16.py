"""The fp16 control: a lossless reference that stores the tensor unchanged (billed at 16 bits)."""

from __future__ import annotations

import torch

from kvqbench.quantizers.base import Kind, QuantizedTensor, Quantizer, Stored, register

__all__ = ["FP16"]


@register
class FP16(Quantizer):
    """Lossless control: every bit-width is an exact passthrough billed at 16 bits/element.

    The tensor is held at its own precision (fp32 inputs stay fp32) and billed as fp16, the width a
    KV cache holds it at; the benchmark measures quantization error, so the control must be exact.
    """

    id = "fp16"
    seeded = False  # no randomness
    bits_free = True  # a passthrough at every bit-width
    name = "FP16 (control)"
    paper = "Lossless reference"
    k_granularity = "identity"
    v_granularity = "identity"

    def _quantize(self, x: torch.Tensor, kind: Kind, bits: int) -> QuantizedTensor:
        qt = self._new_qt(x, kind, bits)
        qt.fields["passthrough"] = Stored(x.clone(), 16)
        return qt

    def _dequantize(self, qt: QuantizedTensor) -> torch.Tensor:  # pragma: no cover - base handles it
        return qt["passthrough"].clone()

    def nominal_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        return 16.0
