"""Pseudo-decode simulator: a KV cache that receives tokens in blocks and quantizes them by a method's
streaming rules (SPEC §4.2 *pseudo-decode*; METHODS.md runtime policies of KIVI, KVarN, Kitty).

Tokens ``0 … T−1`` arrive in blocks of ``block`` tokens (the last block may be shorter). After each
arrival the cache holds some tokens in fp16 (exact) and the rest as quantized *segments*; a segment is
quantized once, by ``method.quantize`` on exactly its tokens, when the rules release it, and never again.
The state at context length ``L`` (a block boundary) is the one an attention step at that length reads.
With :class:`~kvqbench.quantizers.base.StreamPolicy` ``(S = sink_tokens, R = residual_tokens,
mode = residual_mode, G = tile_tokens)`` and ``n = L − S`` post-sink tokens:

* **sink** — tokens ``[0, S)`` stay fp16 for good;
* **release point** ``P`` (tokens before ``P`` have left every fp16 window):
    - ``"none"``: ``P = L`` — every arriving block is released at once;
    - ``"sliding"``: ``P = max(S, L − R)`` — the newest ``R`` tokens stay fp16 (KIVI's V, Kitty's V);
    - ``"chunk"``: ``P = S + R·⌊(n − 1)/R⌋`` (``S`` when ``n ≤ 0``) — the fp16 tail holds 1…R tokens.
      KIVI's reference attends the token that completes an R-token chunk in fp16 and quantizes the
      chunk right after, so a chunk is released only when the next token arrives (KIVI's K);
* **tiles** (``G > 0``, tiles aligned at ``S``): released tokens are quantized a whole tile at a time;
  a partly filled tile stays fp16 (KVarN tiles, Kitty pages): quantized boundary
  ``Q = S + G·⌊(P − S)/G⌋``; otherwise ``Q = P``.

Segments: a tile (``G > 0``), else a chunk of ``R`` tokens (``"chunk"``), else whatever was released by
one arrival (``"none"``/``"sliding"``: the block that arrived, or the tokens that left the window).
Billing at length ``L``: the stored bits of every segment created so far plus 16 bits per element of
every fp16 token (sink, window, partial tile), divided by the elements of the ``L`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvqbench.quantizers.base import Kind, Quantizer, StreamPolicy

__all__ = ["Segment", "StreamResult", "release_point", "quantized_boundary", "simulate_stream"]

FP16_BITS = 16


def release_point(policy: StreamPolicy, length: int) -> int:
    """Tokens ``[0, P)`` have left every fp16 window (sink excluded) at context length ``length``."""
    s = min(policy.sink_tokens, length)
    n = length - s
    r = policy.residual_tokens
    if n <= 0:
        return s
    if policy.residual_mode == "sliding" and r > 0:
        return max(s, length - r)
    if policy.residual_mode == "chunk" and r > 0:
        return s + r * ((n - 1) // r)
    return length


def quantized_boundary(policy: StreamPolicy, length: int) -> int:
    """``Q``: tokens ``[sink, Q)`` are quantized at context length ``length`` (see module doc)."""
    s = min(policy.sink_tokens, length)
    p = release_point(policy, length)
    g = policy.tile_tokens
    if g > 0:
        return s + g * ((p - s) // g)
    return p


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, stop)`` quantized as one unit, created when the cache reached ``created_at``."""

    start: int
    stop: int
    created_at: int
    stored_bits: int


@dataclass
class StreamResult:
    """The outcome of :func:`simulate_stream` for one K or V tensor.

    Attributes:
        x_hat: ``(batch, heads, seq_len, head_dim)``: every token ever quantized holds its dequantized
            value; the others hold the exact input (fp16 tokens). Valid for any prefix length ``L`` in
            ``lengths`` together with :meth:`boundary`.
        segments: every quantized segment in creation order.
        policy: the rules applied.
        block: the arrival block size.
        lengths: the arrival lengths (block boundaries and ``seq_len``).
        elems_per_token: ``batch · heads · head_dim``.
    """

    x_hat: torch.Tensor
    segments: list[Segment]
    policy: StreamPolicy
    block: int
    lengths: list[int]
    elems_per_token: int
    _boundaries: dict[int, int] = field(default_factory=dict)

    def boundary(self, length: int) -> tuple[int, int]:
        """``(sink, Q)``: at context length ``length`` tokens ``[sink, Q)`` are quantized, the rest fp16."""
        self._check(length)
        return min(self.policy.sink_tokens, length), self._boundaries[length]

    def state(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """The cache content at context length ``length``: ``(batch, heads, length, head_dim)``,
        quantized tokens from ``x_hat`` and fp16 tokens exact from ``x`` (the tensor that was streamed,
        or any tensor aligned with it, e.g. the post-RoPE keys of a pre-RoPE method)."""
        s, q = self.boundary(length)
        out = x[..., :length, :].clone()
        if q > s:
            out[..., s:q, :] = self.x_hat[..., s:q, :].to(out.dtype)
        return out

    def fp16_tokens(self, length: int) -> int:
        """How many of the first ``length`` tokens are held in fp16 (sink + windows + partial tile)."""
        s, q = self.boundary(length)
        return length - (q - s)

    def stored_bits(self, length: int) -> int:
        """Billed bits at context length ``length``: segments created so far + 16 bits per fp16 element."""
        self._check(length)
        seg = sum(sg.stored_bits for sg in self.segments if sg.created_at <= length)
        return seg + FP16_BITS * self.fp16_tokens(length) * self.elems_per_token

    def effective_bits(self, length: int) -> float:
        """Billed bits per element of the first ``length`` tokens (fp16 tokens at 16 bits)."""
        return self.stored_bits(length) / (length * self.elems_per_token)

    def _check(self, length: int) -> None:
        if length not in self._boundaries:
            raise ValueError(
                f"context length {length} is not an arrival point of this stream (block {self.block}); "
                f"known: {self.lengths[:4]}…{self.lengths[-2:]}"
            )


def _split(start: int, stop: int, unit: int, origin: int) -> list[tuple[int, int]]:
    """Split ``[start, stop)`` at multiples of ``unit`` counted from ``origin``."""
    if unit <= 0:
        return [(start, stop)]
    cuts = [start]
    nxt = origin + unit * ((start - origin) // unit + 1)
    while nxt < stop:
        cuts.append(nxt)
        nxt += unit
    cuts.append(stop)
    return list(zip(cuts, cuts[1:]))


@torch.no_grad()
def simulate_stream(method: Quantizer, x: torch.Tensor, kind: Kind, *, block: int,
                    policy: StreamPolicy | None = None) -> StreamResult:
    """Stream ``x`` through ``method`` as a cache would (see module doc).

    Args:
        method: a configured (and, if data-dependent, already fitted) quantizer.
        x: the tensor the method quantizes, ``(batch, kv_heads, seq_len, head_dim)``.
        kind: ``"k"`` or ``"v"``.
        block: tokens per arrival (> 0).
        policy: the rules; default ``method.stream_policy(kind)``.
    Returns:
        :class:`StreamResult`; query it at any arrival length ``L`` (multiples of ``block`` and
        ``seq_len``).
    Raises:
        ValueError: ``block`` < 1, or a malformed ``x`` (see :func:`~kvqbench.quantizers.base.validate_kv`).
    """
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, kv_heads, seq_len, head_dim), got shape {tuple(x.shape)}")
    pol = method.stream_policy(kind) if policy is None else policy
    t = int(x.shape[-2])
    lengths = list(range(block, t, block)) + [t]
    x_hat = x.clone()
    segments: list[Segment] = []
    boundaries: dict[int, int] = {}
    unit = pol.tile_tokens if pol.tile_tokens > 0 else (
        pol.residual_tokens if pol.residual_mode == "chunk" else 0)
    done = pol.sink_tokens  # tokens [sink, done) are quantized
    for length in lengths:
        q = quantized_boundary(pol, length)
        if q > done:
            for a, b in _split(done, q, unit, pol.sink_tokens):
                qt = method.quantize(x[..., a:b, :].contiguous(), kind)
                x_hat[..., a:b, :] = method.dequantize(qt).to(x_hat.dtype)
                segments.append(Segment(a, b, length, int(qt.stored_bits())))
            done = q
        boundaries[length] = min(done, length)
    elems = int(x.shape[0] * x.shape[1] * x.shape[-1])
    return StreamResult(x_hat, segments, pol, block, lengths, elems, boundaries)
