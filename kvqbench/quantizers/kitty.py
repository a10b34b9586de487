"""Kitty — 2-bit KV cache with a dynamic channel-wise precision boost for keys.

Based on Xia et al., "Kitty: Accurate and Efficient 2-bit KV Cache Quantization with Dynamic
Channel-wise Precision Boost", arXiv:2511.18643 (§3: channel-wise sensitivity and the boost, §4: the
paged layout with a low-bit plane, a high-bit plane and a per-page channel index), and its reference
code (MIT), whose storage layout and rounding this module follows.

Keys (post-RoPE) are cut into pages of ``group_size`` (default 128) tokens. Per page, head and channel:
asym RTN over the page's tokens, ``scale = max(hi − lo, eps)/(2**bits − 1)`` (``eps`` = 1e-6, relative to
the data below magnitude 1), ``q = clamp(floor((x − lo)/scale + ½), 0, 2**bits − 1)`` (round half up, as
the reference), ``x̂ = q·scale + lo``. Per page and head, the ``n_boost = floor(boost_fraction·D + 1e-6)``
channels with the largest mean ``|K|`` over the page get ``b + 2`` bits instead of ``b``. Stored: the low
plane (``b`` bits of every element: a plain channel's full code, a boosted one's low ``b`` bits); the high
plane (the top 2 bits of every boosted element); per page, head and channel a uint8 channel map (the
channel's slot in the high plane, or ``n_boost`` for a plain one), an fp16 scale and an fp16 minimum.
At D = G = 128, 25 % boost, k2: ``2 + 2·0.25 + (16 + 16 + 8)/128 = 2.8125`` bits/element.
Values: per token over head_dim, ``b``-bit asym with the same rounding: ``b + 32/D`` (2.25 at k2v2).

Streaming (pseudo-decode, :meth:`Kitty.stream_policy`): the first 32 tokens stay fp16 (attention
sink) for K and V; K's partly filled page stays fp16 until full; V keeps a sliding fp16 window of the
newest 128 tokens, and tokens leaving it wait fp16 in a partial page until it is full.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvqbench.numerics.rtn import compute_dtype
from kvqbench.numerics.scale import pow2_floor
from kvqbench.quantizers.base import (
    Kind,
    QuantizedTensor,
    Quantizer,
    Stored,
    StreamPolicy,
    check_group_size,
    register,
)

__all__ = ["Kitty", "boost_count"]

#: the reference's scale floor (avoids dividing by zero on a constant channel)
EPS = 1e-6
BOOST_EXTRA_BITS = 2
MAX_BITS = 8
SINK_TOKENS = 32
V_WINDOW = 128
_AUX_NOMINAL = 8 + 16  # FP8 scale + FP16 zero-point
_AUX_EFFECTIVE = 16 + 16
_INDEX_BITS = 8


def boost_count(head_dim: int, boost_fraction: float) -> int:
    """Channels boosted per page and head: ``floor(boost_fraction·head_dim + 1e-6)`` (the reference's
    rounding: 25 % of 128 → 32, 15 % of 128 → 19)."""
    return int(math.floor(boost_fraction * head_dim + 1e-6))


def _asym_codes(x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor | int,
                dtype: torch.dtype) -> torch.Tensor:
    """``clamp(floor((x − lo)/scale + ½), 0, levels)`` as ``dtype`` (round half up, as the reference code;
    ``scale > 0`` always, by the range floor)."""
    q = torch.clamp(torch.floor((x - lo) / scale + 0.5), min=0)
    q = torch.minimum(q, levels.to(q.dtype)) if isinstance(levels, torch.Tensor) else q.clamp(max=levels)
    return q.to(dtype)


def _scale(lo: torch.Tensor, hi: torch.Tensor, levels: torch.Tensor | int) -> torch.Tensor:
    """``max(hi − lo, floor)/levels`` from every group's min and max (the floor applies to the range,
    as in the reference), ``floor = EPS·min(1, 2^⌊log2 max|x|⌋)``: the reference's absolute ``EPS`` scaled to
    the tensor's magnitude (an exact power of two), so data far below magnitude 1 is not collapsed to its
    group minima; ``EPS`` itself for ``max|x| >= 1``. A constant group gets ``floor/levels > 0``: codes 0,
    round trip to ``lo``."""
    abs_max = torch.maximum(lo.amin().neg(), hi.amax())  # the groups cover every element
    return torch.clamp(hi - lo, min=EPS * torch.clamp(pow2_floor(abs_max), max=1.0)) / levels


@register
class Kitty(Quantizer):
    """Kitty (arXiv:2511.18643): K per channel within pages of ``group_size`` tokens, the top
    ``boost_fraction`` of channels (by mean |K| over the page) at ``b + 2`` bits; V per token at ``b``.

    Shapes: ``quantize(x, kind)`` takes ``(batch, kv_heads, seq_len, head_dim)`` fp32/fp16/bf16; computes in
    fp32 (fp64 for fp64 input); ``dequantize`` returns the input's shape, dtype and device.

    Args:
        k_bits, v_bits: ``b`` (paper: 2); 1..8 (>= 16 = exact passthrough).
        group_size: page size in tokens (paper: 128).
        boost_fraction: share of channels boosted per page and head, in [0, 1] (reference system
            code: 0.25; the paper's simulator explores 0.1–0.2).

    Raises:
        ValueError: bad option; from :meth:`quantize`, bits in 9..15, or more than 255 boosted
            channels (the channel map is uint8).
    """

    id = "kitty"
    seeded = False  # no randomness
    name = "Kitty"
    paper = (
        "Xia et al., Kitty: Accurate and Efficient 2-bit KV Cache Quantization with Dynamic "
        "Channel-wise Precision Boost (2025)"
    )
    arxiv = "2511.18643"
    k_granularity = "per-channel within pages of G tokens; top channels by mean |K| boosted to b+2 bits"
    v_granularity = "per-token asym over head_dim"
    rotation = False
    fidelity = "faithful"
    grouped = True
    local_stats = True
    deltas = (
        "Static cells quantize every token (no fp16 sink or partial page); the 32-token sink, the "
        "fp16 partial page and V's 128-token window apply in the pseudo-decode regime (stream_policy).",
        "Bit widths other than 2 generalize the scheme: b-bit low plane, boosted channels at b + 2 bits "
        "(the paper and reference fix 2 → 4).",
        "Scales and minima are held at working precision and billed as fp16 (reference stores fp16).",
        "Range floor relative to the data: max(hi − lo, 1e-6·min(1, 2^⌊log2 max|x|⌋)) instead of the "
        "reference's absolute 1e-6, which collapses tensors of magnitude ≪ 1e-6 to their group minima "
        "(identical to the reference for max|x| >= 1).",
        "Channel map billed as the reference stores it: one uint8 per channel per page and head "
        "(0.0625 bits/element at D = G = 128), not one index per boosted channel.",
    )

    def __init__(self, k_bits: int = 2, v_bits: int | None = None, *, seed: int = 0, group_size: int = 128,
                 boost_fraction: float = 0.25) -> None:
        super().__init__(k_bits, v_bits, seed=seed)
        self.group_size = check_group_size(group_size)
        if (isinstance(boost_fraction, bool) or not isinstance(boost_fraction, (int, float))
                or not 0.0 <= float(boost_fraction) <= 1.0):
            raise ValueError(f"boost_fraction must be a number in [0, 1], got {boost_fraction!r}")
        self.boost_fraction = float(boost_fraction)

    def params(self) -> dict[str, Any]:
        return {**super().params(), "group_size": self.group_size, "boost_fraction": self.boost_fraction}

    def stream_policy(self, kind: Kind) -> StreamPolicy:
        """K: 32 fp16 sink tokens, the partly filled page (``group_size``) fp16 until full. V: 32 sink
        tokens, a sliding fp16 window of the newest 128 tokens, and tokens that left the window wait
        fp16 in a partial page until it is full (reference ``quantize_prefill``/``update``)."""
        if kind == "k":
            return StreamPolicy(sink_tokens=SINK_TOKENS, tile_tokens=self.group_size)
        return StreamPolicy(sink_tokens=SINK_TOKENS, residual_tokens=V_WINDOW, residual_mode="sliding",
                            tile_tokens=self.group_size)

    def _quantize(self, x: torch.Tensor, kind: Kind, bits: int) -> QuantizedTensor:
        if bits > MAX_BITS:
            raise ValueError(f"kitty supports 1..{MAX_BITS} bits (or >= 16 for fp16), got {bits}")
        xf = x.to(compute_dtype(x.dtype))
        if kind == "k":
            return self._quantize_k(x, xf, bits)
        # V (§3): b-bit asym per token over head_dim, the reference's rounding
        lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
        levels = (1 << bits) - 1
        scale = _scale(lo, hi, levels)
        qt = self._new_qt(x, kind, bits)
        qt.add_codes("codes", _asym_codes(xf, lo, scale, levels, torch.uint8), bits)
        qt.fields.update(scale=Stored(scale, 16), zero=Stored(lo, 16))
        return qt

    def _quantize_k(self, x: torch.Tensor, xf: torch.Tensor, bits: int) -> QuantizedTensor:
        b, h, t, d = x.shape
        g = self.group_size
        n_boost = boost_count(d, self.boost_fraction)
        if n_boost > 255:
            raise ValueError(f"{n_boost} boosted channels do not fit the uint8 channel map; lower boost_fraction")
        # §4: pages of G tokens, (B·H·nP, G, D) token-major; a partial last page padded with its last token
        n_pages = math.ceil(t / g)
        pad = n_pages * g - t
        xp = torch.cat([xf, xf[:, :, -1:].expand(b, h, pad, d)], dim=2) if pad else xf
        pf = xp.reshape(-1, g, d)  # page channels are its columns
        # §3: per page and head, the n_boost channels of largest mean |K| over the page's real tokens
        if pad:
            valid = (torch.arange(n_pages * g, device=x.device) < t).reshape(n_pages, g).to(pf.dtype)
            vmask = valid.repeat(b * h, 1)  # (B·H·nP, G)
            score = (pf.abs() * vmask[:, :, None]).sum(1) / vmask.sum(-1)[:, None]
        else:
            score = pf.abs().sum(1) / g  # (B·H·nP, D)
        top = torch.topk(score, n_boost, dim=-1).indices  # slot j = j-th largest mean |K|
        cmap = torch.full(score.shape, n_boost, dtype=torch.int64, device=x.device)
        cmap.scatter_(-1, top, torch.arange(n_boost, device=x.device).expand_as(top))
        # §3: asym RTN per page channel, b + 2 bits for a boosted channel, b for the others
        lo, hi = pf.amin(1, keepdim=True), pf.amax(1, keepdim=True)  # (B·H·nP, 1, D)
        levels = torch.where((cmap < n_boost).unsqueeze(1), (1 << (bits + BOOST_EXTRA_BITS)) - 1,
                             (1 << bits) - 1).to(pf.dtype)
        scale = _scale(lo, hi, levels)
        q = _asym_codes(pf, lo, scale, levels, torch.uint8 if bits + BOOST_EXTRA_BITS <= 8 else torch.int16)
        # §4: low plane (b bits of every element, token-major), high plane (boosted top 2 bits, slot order)
        low = (q & ((1 << bits) - 1)).to(torch.uint8)  # (B·H·nP, G, D)
        high = (torch.gather(q, 2, top.unsqueeze(1).expand(-1, g, -1)) >> bits).to(torch.uint8)  # (…, G, n_boost)
        qt = self._new_qt(x, "k", bits, group_size=g, n_boost=n_boost)
        qt.add_codes("low", low.reshape(b, h, n_pages * g, d)[:, :, :t], bits)
        high = high.view(b, h, n_pages, g, n_boost).permute(0, 1, 4, 2, 3).reshape(b, h, n_boost, n_pages * g)
        qt.add_codes("high", high[..., :t], BOOST_EXTRA_BITS)
        qt.add_codes("channel_map", cmap.view(b, h, n_pages, d), _INDEX_BITS)
        scale, lo = scale.view(b, h, n_pages, d), lo.view(b, h, n_pages, d)
        qt.fields.update(scale=Stored(scale, 16), zero=Stored(lo, 16))
        return qt

    def _dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
        scale, lo = qt["scale"], qt["zero"]
        if qt.kind == "v":
            return qt.codes("codes").to(lo.dtype) * scale + lo
        b, h, t, d = qt.shape
        g, n_boost, bits = qt.meta["group_size"], qt.meta["n_boost"], qt.bits
        n_pages = scale.shape[2]
        pad = n_pages * g - t
        # the code of every element: the low plane, plus the high plane's top bits in boosted channels
        code = torch.uint8 if bits + BOOST_EXTRA_BITS <= 8 else torch.int16  # holds every full code
        low = qt.codes("low", code)
        q = (torch.nn.functional.pad(low, (0, 0, 0, pad)) if pad else low).view(-1, g, d)  # (B·H·nP, G, D)
        if n_boost:
            cmap = qt.codes("channel_map").view(-1, d)  # slot, or n_boost for a plain channel
            high = qt.codes("high", code)
            high = torch.nn.functional.pad(high, (0, pad)) if pad else high  # (B, H, n_boost, nP·G)
            high = high.view(b, h, n_boost, n_pages, g).permute(0, 1, 3, 4, 2).reshape(-1, g, n_boost)
            # slot → channel (plain channels all land on the dropped slot n_boost)
            chan = torch.empty(cmap.shape[0], n_boost + 1, dtype=torch.int64, device=cmap.device)
            chan.scatter_(-1, cmap, torch.arange(d, device=cmap.device).expand_as(cmap))
            q = q.scatter_add(2, chan[:, :n_boost].unsqueeze(1).expand(-1, g, -1), high << bits)
        xq = q.to(scale.dtype) * scale.reshape(-1, 1, d) + lo.reshape(-1, 1, d)  # §3: x̂ = q·scale + lo
        return xq.view(b, h, n_pages * g, d)[:, :, :t]

    def _k_bits(self, bits: int, shape: tuple[int, int, int, int], aux: int) -> float:
        _, _, t, d = shape
        n_pages = math.ceil(t / self.group_size)
        n_boost = boost_count(d, self.boost_fraction)
        per_head = bits * t * d + BOOST_EXTRA_BITS * n_boost * t + n_pages * d * (aux + _INDEX_BITS)
        return per_head / (t * d)

    def nominal_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        """K: ``b + 2·n_boost/D + (24 + 8)·n_pages/T`` (low plane, high plane, FP8 scale + FP16 zero and
        the uint8 map per channel and page) — 2.75 at k2, D = G = 128, 25 %. V: ``b + 24/D``."""
        return bits + _AUX_NOMINAL / shape[-1] if kind == "v" else self._k_bits(bits, shape, _AUX_NOMINAL)

    def effective_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        """What :meth:`quantize` stores, as a formula (fp16 scale and zero): K 2.8125, V 2.25 at k2v2,
        D = G = 128, 25 %."""
        return bits + _AUX_EFFECTIVE / shape[-1] if kind == "v" else self._k_bits(bits, shape, _AUX_EFFECTIVE)
