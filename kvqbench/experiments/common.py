"""Shared plumbing of the experiments: round-tripping K and V of a data source through a method.

Pre- vs post-RoPE (SPEC §2): a method with ``k_pre_rope = True`` receives the pre-RoPE keys where the
data source has them, and its output is rotated back with the captured RoPE before being compared
with the cached keys. RoPE is orthogonal per pair, so reconstruction MSE is unaffected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvqbench.data.types import KVData
from kvqbench.quantizers.base import QuantizedTensor, Quantizer

__all__ = ["RoundTrip", "fit_method", "roundtrip_kv"]


@dataclass
class RoundTrip:
    """K̂ (in the cached, post-RoPE space), V̂ and their representations."""

    k_hat: torch.Tensor
    v_hat: torch.Tensor
    k_qt: QuantizedTensor
    v_qt: QuantizedTensor

    @property
    def k_bits_effective(self) -> float:
        return self.k_qt.effective_bits()

    @property
    def v_bits_effective(self) -> float:
        return self.v_qt.effective_bits()


def fit_method(method: Quantizer, data: KVData) -> Quantizer:
    """Fit a method's data-dependent state (codebooks) on ``data.calibration`` — an independent batch
    of the same source — or, when the source has none, on ``data`` itself (in-sample), with the squared
    gradients as Fisher weights where the source has them. A no-op for local methods."""
    if not method.local_stats:
        cal = data.calibration if data.calibration is not None else data
        method.fit(
            k=cal.k_for(method.k_pre_rope),
            v=cal.v,
            k_grad2=cal.k_grad2 if (method.k_pre_rope and cal.k_pre is not None) else None,
            v_grad2=cal.v_grad2,
        )
    return method


@torch.no_grad()
def roundtrip_kv(method: Quantizer, data: KVData, *, fit: bool = True) -> RoundTrip:
    """Quantize and dequantize ``data``'s K and V with ``method``.

    Returns K̂ mapped to the cached-key space (see module doc) and V̂, both
    ``(batch, kv_heads, seq_len, head_dim)`` in the data's dtype.
    """
    if fit:
        fit_method(method, data)
    k_in = data.k_for(method.k_pre_rope)
    k_qt = method.quantize(k_in, "k")
    v_qt = method.quantize(data.v, "v")
    k_hat = data.to_cached_k(method.dequantize(k_qt), method.k_pre_rope)
    v_hat = method.dequantize(v_qt)
    return RoundTrip(k_hat, v_hat, k_qt, v_qt)
