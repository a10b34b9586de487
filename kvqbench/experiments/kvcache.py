"""The KV-cache hook of the real-model experiments (exp5, exp6): a ``transformers.DynamicCache`` whose
``update`` stores the exact K/V as usual and returns, instead of them, the cache *as a method holds it*.

``(batch, kv_heads, seq_len, head_dim)``, post-RoPE K exactly as the model caches it. No modeling code is
edited, no attention is patched. Per decoder layer the hook keeps one
:class:`~kvqbench.experiments.streaming.Stream` for K and one for V (the rules of exp2's pseudo-decode:
each token is quantized once, when the method's stream policy releases it, and never re-quantized; fp16
sink / residual / partial-tile tokens are the exact values). A method that quantizes pre-RoPE keys by
design (``k_pre_rope``, KVQuant) is given the keys un-rotated with the model's own RoPE tables and its
output is rotated back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import torch

from kvqbench.data.types import apply_rope
from kvqbench.experiments.streaming import Stream
from kvqbench.quantizers.base import Quantizer, StreamPolicy

__all__ = ["CacheWriter", "KVCacheHook", "RowsHook", "quantized_cache"]


class CacheWriter:
    """A cache hook whose :meth:`update` is its in-place :meth:`write` on a copy of the exact cache."""

    @torch.no_grad()
    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, k_all: torch.Tensor,
               v_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the new tokens of ``layer`` and return its K and V as the hook holds them.

        Args:
            k_new, v_new: the arriving tokens ``(batch, kv_heads, n, head_dim)`` (K post-RoPE).
            k_all, v_all: the exact cache after the arrival ``(batch, kv_heads, L, head_dim)``.
        Returns:
            ``(K̂, V̂)`` of ``k_all``'s shape: quantized tokens dequantized (K rotated back to post-RoPE for
            a pre-RoPE method), fp16 tokens exact.
        Raises:
            ValueError: ``layer`` beyond the methods given.
        """
        k_out, v_out = k_all.clone(), v_all.clone()
        self.write(layer, k_new, v_new, k_out, v_out)
        return k_out, v_out

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, k_out: torch.Tensor,
              v_out: torch.Tensor) -> None:
        """Feed the new tokens and overwrite ``k_out`` / ``v_out`` (a copy of the exact cache) in place."""
        raise NotImplementedError


class KVCacheHook(CacheWriter):
    """The quantized view of a model's KV cache: per layer a :class:`Stream` for K and one for V.

    Args:
        methods: one configured (and fitted) quantizer per decoder layer.
        streaming: ``True`` — each method's stream policy (decode); ``False`` — no rules, every arrival
            quantized as a whole (prefill in one call = one round trip per layer and kind).
        cos, sin: the model's RoPE tables for every position the cache will see, ``(positions,
            head_dim)`` for every layer or ``(layers, positions, head_dim)`` per layer; needed when a
            method quantizes pre-RoPE keys.
        capacity: tokens each stream reserves room for at once (the whole sequence when it is known; the
            streams' buffers grow by doubling beyond it, see :class:`Stream`).
    Raises:
        ValueError: a pre-RoPE method without RoPE tables.
    """

    def __init__(self, methods: Sequence[Quantizer], *, streaming: bool,
                 cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, capacity: int = 0) -> None:
        self.methods = list(methods)
        self.cos, self.sin = cos, sin
        if any(m.k_pre_rope for m in self.methods) and (cos is None or sin is None):
            raise ValueError("a method quantizes pre-RoPE keys: pass the model's RoPE tables (cos, sin)")
        rules = None if streaming else StreamPolicy()  # None: the method's own stream policy
        self.k = [Stream(m, "k", rules, capacity=capacity) for m in self.methods]
        self.v = [Stream(m, "v", rules, capacity=capacity) for m in self.methods]

    def fork(self, *, streaming: bool) -> "KVCacheHook":
        """A hook of the same methods and RoPE tables under the rules ``streaming`` selects, holding what it
        would hold had it received this hook's arrivals so far (:meth:`Stream.fork`: a copy of each stream
        whose rules are the same, so a prompt both regimes share is quantized once)."""
        new = KVCacheHook(self.methods, streaming=streaming, cos=self.cos, sin=self.sin)
        new.k = [s.fork(n.policy) for s, n in zip(self.k, new.k)]
        new.v = [s.fork(n.policy) for s, n in zip(self.v, new.v)]
        return new

    @torch.no_grad()
    def extend(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Feed the new tokens of ``layer`` (``(batch, kv_heads, n, head_dim)``, K post-RoPE, following the
        tokens fed so far) to its streams, without building the view :meth:`write` builds.

        Raises:
            ValueError: ``layer`` beyond the methods given.
        """
        if layer >= len(self.methods):
            raise ValueError(f"the model has more layers than methods given ({len(self.methods)})")
        start = self.k[layer].length
        stop = start + int(k_new.shape[-2])
        rope = self._rope(layer) if self._pre(layer) else None
        if rope is not None:
            k_new = apply_rope(k_new, rope[0][start:stop], -rope[1][start:stop])  # RoPE⁻¹
        self.k[layer].extend(k_new)
        self.v[layer].extend(v_new)

    def _pre(self, layer: int) -> bool:
        return self.methods[layer].k_pre_rope

    def _rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s RoPE tables ``(positions, head_dim)``."""
        assert self.cos is not None and self.sin is not None
        if self.cos.dim() == 3:
            return self.cos[layer], self.sin[layer]
        return self.cos, self.sin

    @torch.no_grad()
    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, k_out: torch.Tensor,
              v_out: torch.Tensor) -> None:
        """:meth:`update` in place: feed the new tokens and overwrite the quantized tokens of ``k_out`` /
        ``v_out`` (the exact cache after the arrival, ``(batch, kv_heads, L, head_dim)``, e.g. a copy of
        it or one batch row of a copy) with their dequantized values."""
        self.extend(layer, k_new, v_new)
        rope = self._rope(layer) if self._pre(layer) else None
        self._state(self.k[layer], k_out, rope)
        self._state(self.v[layer], v_out, None)

    def _state(self, stream: Stream, out: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        res = stream.result(0)
        s, q = res.boundary(stream.length)
        if q > s:
            xh = res.x_hat[..., s:q, :]
            if rope is not None:
                xh = apply_rope(xh, rope[0][s:q], rope[1][s:q])
            out[..., s:q, :] = xh.to(out.dtype)

    def bits_billed(self) -> float:
        """Mean over layers of the K and V bits per element billed at the current length."""
        vals = []
        for sk, sv in zip(self.k, self.v):
            n = sk.length
            vals.append(0.5 * (sk.result(0).effective_bits(n) + sv.result(0).effective_bits(n)))
        return math.fsum(vals) / len(vals)

    def describe(self) -> dict[str, Any]:
        """Policies, fp16 tokens at the current length and segment counts (layer 0; every layer alike)."""
        sk, sv = self.k[0], self.v[0]
        return {"policy": {"k": dataclasses.asdict(sk.policy), "v": dataclasses.asdict(sv.policy)},
                "fp16_tokens": {"k": sk.result(0).fp16_tokens(sk.length), "v": sv.result(0).fp16_tokens(sv.length)},
                "segments": {"k": len(sk.segments), "v": len(sv.segments)}}


class RowsHook:
    """Independent :class:`KVCacheHook` s, one per batch row: row ``r`` of every arrival goes to
    ``hooks[r]`` alone, so each row's streams (and any per-tensor statistics) see exactly the tokens a
    one-row run of the same window would, and never another row's.

    Args:
        hooks: one hook per batch row (each with its own methods, e.g. differently seeded).
    Raises:
        ValueError: no hook.
    """

    def __init__(self, hooks: Sequence[KVCacheHook]) -> None:
        self.hooks = list(hooks)
        if not self.hooks:
            raise ValueError("RowsHook needs at least one hook")

    @torch.no_grad()
    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, k_all: torch.Tensor,
               v_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`KVCacheHook.update` row by row (shapes as there, ``batch`` = the number of hooks).

        Raises:
            ValueError: a batch of another size than the hooks.
        """
        if int(k_all.shape[0]) != len(self.hooks):
            raise ValueError(f"batch of {int(k_all.shape[0])} rows for {len(self.hooks)} hooks")
        k_out, v_out = k_all.clone(), v_all.clone()
        for r, hook in enumerate(self.hooks):
            hook.write(layer, k_new[r:r + 1], v_new[r:r + 1], k_out[r:r + 1], v_out[r:r + 1])
        return k_out, v_out


@functools.lru_cache(maxsize=1)
def _cache_class() -> type:
    from transformers import DynamicCache

    class QuantizedKVCache(DynamicCache):
        """A ``DynamicCache`` that stores exact K/V and hands attention the quantized view of
        :class:`KVCacheHook` (``None``: a pass-through, the plain cache)."""

        def __init__(self, hook: KVCacheHook | None) -> None:
            super().__init__()
            self.kvq_hook = hook

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[override]
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            if self.kvq_hook is None:
                return keys, values
            return self.kvq_hook.update(layer_idx, key_states, value_states, keys, values)

    return QuantizedKVCache


def quantized_cache(hook: KVCacheHook | None) -> Any:
    """A ``transformers.DynamicCache`` subclass instance whose ``update`` returns ``hook``'s quantized view
    (``None``: a plain cache). Pass it to the model as its cache."""
    return _cache_class()(hook)
