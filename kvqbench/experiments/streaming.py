"""Pseudo-decode simulator: a KV cache that receives tokens in blocks and quantizes them by a method's
streaming rules (docs/DESIGN.md §4 *pseudo-decode*, §7 runtime policies of KIVI, KVarN, Kitty).

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

__all__ = ["Segment", "Stream", "StreamResult", "release_point", "quantized_boundary", "simulate_stream"]

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


class Stream:
    """The incremental form of :func:`simulate_stream`: a cache for one K or V tensor that receives
    tokens through :meth:`extend` and quantizes them by the rules of the module doc, each segment once.

    Used by the pseudo-decode of experiment 2 (through :func:`simulate_stream`) and by the KV cache of
    the real model in experiment 5 (:mod:`kvqbench.experiments.endtoend`), so both follow one rule.

    Args:
        method: a configured (and, if data-dependent, already fitted) quantizer.
        kind: ``"k"`` or ``"v"``.
        policy: the rules; default ``method.stream_policy(kind)``.
        capacity: tokens to reserve room for at once (e.g. the whole sequence when it is known); the
            buffers grow by doubling beyond it. Only a performance hint.
    """

    def __init__(self, method: Quantizer, kind: Kind, policy: StreamPolicy | None = None, *,
                 capacity: int = 0) -> None:
        self.method = method
        self.kind = kind
        self.policy = method.stream_policy(kind) if policy is None else policy
        pol = self.policy
        self._unit = pol.tile_tokens if pol.tile_tokens > 0 else (
            pol.residual_tokens if pol.residual_mode == "chunk" else 0)
        # tokens live in preallocated buffers (grown by doubling) so that an arrival copies only its own
        # tokens, not the whole prefix again; ``capacity`` = the tokens expected in all (0: grow as needed)
        self._capacity = max(0, int(capacity))
        self._x: torch.Tensor | None = None
        self._x_hat: torch.Tensor | None = None
        self._len = 0
        self.segments: list[Segment] = []
        self.lengths: list[int] = []
        self.boundaries: dict[int, int] = {}
        self._done = pol.sink_tokens  # tokens [sink, done) are quantized

    @property
    def length(self) -> int:
        return self._len

    @property
    def x(self) -> torch.Tensor | None:
        """The exact tokens so far ``(batch, kv_heads, length, head_dim)`` (a view; ``None`` before any)."""
        return None if self._x is None else self._x[..., : self._len, :]

    @property
    def x_hat(self) -> torch.Tensor | None:
        """The tokens as the cache holds them so far (a view, updated in place by later arrivals)."""
        return None if self._x_hat is None else self._x_hat[..., : self._len, :]

    def _reserve(self, x_new: torch.Tensor, need: int) -> None:
        if self._x is not None and need <= int(self._x.shape[-2]):
            return
        cap = max(need, self._capacity, 2 * (0 if self._x is None else int(self._x.shape[-2])))
        b, h, _, d = x_new.shape
        x = torch.empty((b, h, cap, d), dtype=x_new.dtype, device=x_new.device)
        x_hat = torch.empty((b, h, cap, d), dtype=x_new.dtype if self._x_hat is None else self._x_hat.dtype,
                            device=x_new.device)
        if self._x is not None:
            x[..., : self._len, :] = self._x[..., : self._len, :]
            x_hat[..., : self._len, :] = self._x_hat[..., : self._len, :]
        self._x, self._x_hat = x, x_hat

    @torch.no_grad()
    def extend(self, x_new: torch.Tensor) -> int:
        """Append ``x_new`` ``(batch, kv_heads, n, head_dim)`` (``n ≥ 1``), quantize what the rules
        release at the new length, and return that length.

        Raises:
            ValueError: ``x_new`` is not rank 4, is empty, or disagrees with earlier tokens in
                batch/heads/head_dim.
        """
        if x_new.dim() != 4 or x_new.shape[-2] < 1:
            raise ValueError(f"x_new must be (batch, kv_heads, n>=1, head_dim), got shape {tuple(x_new.shape)}")
        if self._x is not None and (self._x.shape[:2] != x_new.shape[:2] or self._x.shape[-1] != x_new.shape[-1]):
            raise ValueError(f"x_new of shape {tuple(x_new.shape)} does not extend {tuple(self.x.shape)}")
        start = self._len
        length = start + int(x_new.shape[-2])
        self._reserve(x_new, length)
        self._x[..., start:length, :] = x_new
        self._x_hat[..., start:length, :] = x_new
        self._len = length
        q = quantized_boundary(self.policy, length)
        if q > self._done:
            for a, b in _split(self._done, q, self._unit, self.policy.sink_tokens):
                qt = self.method.quantize(self._x[..., a:b, :].contiguous(), self.kind)
                self._x_hat[..., a:b, :] = self.method.dequantize(qt).to(self._x_hat.dtype)
                self.segments.append(Segment(a, b, length, int(qt.stored_bits())))
            self._done = q
        self.boundaries[length] = min(self._done, length)
        self.lengths.append(length)
        return length

    @torch.no_grad()
    def fork(self, policy: StreamPolicy | None = None) -> "Stream":
        """A new stream of the same method and kind under ``policy`` (default the method's own) that holds
        what it would hold had it received this stream's arrivals so far: a copy where the rules are this
        stream's (the same quantize calls on the same tokens; methods quantize as pure functions), else the
        arrivals replayed through the new rules. Later arrivals to either stream leave the other as it is."""
        new = Stream(self.method, self.kind, policy, capacity=self._capacity)
        if self._x is None or self._x_hat is None:
            return new
        if new.policy == self.policy:
            new._x, new._x_hat = self._x.clone(), self._x_hat.clone()
            new._len, new._done = self._len, self._done
            new.segments, new.lengths, new.boundaries = list(self.segments), list(self.lengths), dict(self.boundaries)
            return new
        start = 0
        for length in self.lengths:
            new.extend(self._x[..., start:length, :])
            start = length
        return new

    def result(self, block: int) -> StreamResult:
        """The :class:`StreamResult` so far (``block`` is recorded as the arrival block size). Its
        ``x_hat`` is a view of the stream's buffer: later arrivals update it."""
        if self._x is None or self._x_hat is None:
            raise ValueError("no token has arrived yet")
        elems = int(self._x.shape[0] * self._x.shape[1] * self._x.shape[-1])
        return StreamResult(self.x_hat, self.segments, self.policy, block, list(self.lengths), elems,
                            dict(self.boundaries))


@torch.no_grad()
def simulate_stream(method: Quantizer, x: torch.Tensor, kind: Kind, *, block: int,
                    policy: StreamPolicy | None = None) -> StreamResult:
    """Stream ``x`` through ``method`` as a cache would (see module doc): a :class:`Stream` fed
    ``block`` tokens at a time.

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
    t = int(x.shape[-2])
    stream = Stream(method, kind, policy, capacity=t)
    start = 0
    for length in list(range(block, t, block)) + [t]:
        stream.extend(x[..., start:length, :])
        start = length
    return stream.result(block)
