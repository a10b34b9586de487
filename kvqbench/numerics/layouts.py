"""The same values in other memory layouts — for checking that a result depends only on the values
(docs/DESIGN.md §6: a quantizer's result never depends on memory layout).

Invariant: every tensor returned by :func:`layout_variants` equals its input element for element
(``torch.equal``); only strides and storage offset differ.
"""

from __future__ import annotations

import torch

__all__ = ["layout_variants"]


def layout_variants(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of copies of ``x`` with the same values in other layouts.

    Args:
        x: ``(batch, kv_heads, seq_len, head_dim)``, any dtype and device.

    Returns:
        name → tensor of ``x``'s shape, dtype and device: ``"transposed back"`` (last two dims stored
        transposed), ``"heads last"`` (heads stored innermost), ``"strided slice"`` (every other token of
        a wider buffer, offset by one channel) and ``"storage offset"`` (contiguous, storage offset 1).
    """
    b, h, t, d = x.shape
    big = torch.zeros(b, h, 2 * t, d + 3, dtype=x.dtype, device=x.device)
    big[:, :, ::2, 1 : d + 1] = x
    flat = torch.zeros(x.numel() + 1, dtype=x.dtype, device=x.device)
    flat[1:] = x.reshape(-1)
    return {
        "transposed back": x.transpose(-1, -2).contiguous().transpose(-1, -2),
        "heads last": x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2),
        "strided slice": big[:, :, ::2, 1 : d + 1],
        "storage offset": flat[1:].view(x.shape),
    }
