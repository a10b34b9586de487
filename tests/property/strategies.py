"""Hypothesis strategies (nouns, keyword-only options)."""

from __future__ import annotations

import hypothesis.strategies as st
import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@st.composite
def kv_tensors(draw, *, max_batch: int = 2, max_heads: int = 3, max_tokens: int = 48,
               head_dims: tuple[int, ...] = (8, 16, 32, 64, 128), dtypes: tuple = DTYPES,
               heavy_tail: bool = True) -> torch.Tensor:
    """A small K/V tensor ``(batch, kv_heads, seq_len, head_dim)``: random shape, dtype, scale and
    (optionally) heavy-tailed token norms and an outlier channel; generated from a drawn seed."""
    b = draw(st.integers(1, max_batch))
    h = draw(st.integers(1, max_heads))
    t = draw(st.integers(1, max_tokens))
    d = draw(st.sampled_from(head_dims))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-2, 1.0, 30.0]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
    if heavy_tail and draw(st.booleans()):
        x = x * torch.exp(torch.randn(b, h, t, 1, generator=g, dtype=torch.float64))
    if draw(st.booleans()):
        x[..., draw(st.integers(0, d - 1))] *= 10.0
    return (x * scale).to(dtype)
