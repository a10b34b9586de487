"""The container every data source returns.

All tensors use the layout ``(batch, kv_heads, seq_len, head_dim)``; for real captures the batch axis
holds the model's layers (``[L, H_kv, T, D]``, queries ``[L, H_q, T, D]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvqbench.data.memory import release_freed

__all__ = ["KVData", "apply_rope", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split at ``head_dim/2`` (the Llama/NeoX RoPE convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary position embedding: ``x·cos + rotate_half(x)·sin``.

    Args:
        x: ``(batch, heads, seq_len, head_dim)``.
        cos, sin: the tables for the positions of ``x``'s tokens: ``(seq_len, head_dim)`` shared by every
            batch row, or ``(batch, seq_len, head_dim)`` per row (for a capture: per layer).
    Returns:
        Tensor of ``x``'s shape and dtype. RoPE is orthogonal per rotate-half pair, so
        ``‖apply_rope(a) − apply_rope(b)‖ == ‖a − b‖`` per token.
    """
    c = cos.to(device=x.device, dtype=torch.float32)
    s = sin.to(device=x.device, dtype=torch.float32)
    if c.dim() == 3:  # per batch row: broadcast over the heads
        c, s = c[:, None], s[:, None]
    xf = x.to(torch.float32)
    return (xf * c + rotate_half(xf) * s).to(x.dtype)


@dataclass
class KVData:
    """K/V/Q tensors of one data source.

    Attributes:
        source: ``"synthetic"`` or ``"real"``.
        k: keys as cached (post-RoPE for real data), ``(batch, kv_heads, seq_len, head_dim)`` fp32.
        v: values, same shape.
        q: queries (post-RoPE), ``(batch, q_heads, seq_len, head_dim)``; ``q_heads`` is a multiple of
            ``kv_heads`` (GQA: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``).
        k_pre: pre-RoPE keys (from ``k_proj``) or ``None`` (synthetic: no RoPE, ``k`` is used).
        cos, sin: RoPE tables per layer ``(batch, seq_len, head_dim)`` for the captured positions (a model
            with one table per layer type, e.g. Gemma 3's sliding-window and full layers, gives each layer
            its type's), so that ``apply_rope(k_pre, cos, sin) == k``; ``None`` without RoPE.
        k_grad2, v_grad2: squared gradients of the LM loss w.r.t. pre-RoPE K and V (Fisher
            information, KVQuant), same shapes as ``k_pre``/``v``, or ``None``.
        meta: provenance (model file, layers, text, seed, generator parameters …), JSON-able.
        calibration: an independent batch of the same source (synthetic: another seed; real: the next
            tokens of the text) on which data-dependent methods fit their state (KVQuant's codebooks),
            so that no method is scored on the tensor it was calibrated on; ``None`` = fit in-sample.
        cache: memoized derived values (see :meth:`cached`).
        cache_scopes: the scope of each value of ``cache`` that has one (see :meth:`cached`).
    """

    source: str
    k: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor
    k_pre: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    k_grad2: torch.Tensor | None = None
    v_grad2: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    calibration: "KVData | None" = None
    #: derived values that depend only on this data (exact-attention references, evaluation batches,
    #: input statistics), memoized by the experiments so that every method's cell on the same data
    #: reuses them (see :meth:`cached`); never copied by :meth:`window`/:meth:`to`, never compared.
    cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    cache_scopes: dict[Any, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def cached(self, key: Any, build: Any, *, scope: str | None = None) -> Any:
        """``build()`` the first time ``key`` is asked for on this object, the stored value afterwards.
        The tensors must not be modified in place — they are shared by every caller.

        ``scope``: the one experiment that uses the value (e.g. ``"exp2"``). The object keeps the scoped
        values of one scope at a time: asking for a value of another scope drops them (and hands their
        memory back, :func:`kvqbench.data.memory.release_freed`); asked for again, a dropped value is
        built again — the same value, ``build`` being a function of this data only. Values without a
        scope (shared by several experiments) are kept."""
        if scope is not None:
            self.keep_scope(scope)
        if key not in self.cache:
            self.cache[key] = build()
            if scope is not None:
                self.cache_scopes[key] = scope
        return self.cache[key]

    def keep_scope(self, scope: str) -> None:
        """Drop the cached values of every scope but ``scope`` (see :meth:`cached`) and hand their memory
        back; an experiment that caches nothing calls it so that it does not run beside the values of
        the one before."""
        stale = [k for k, s in self.cache_scopes.items() if s != scope]
        if stale:
            for k in stale:
                del self.cache[k], self.cache_scopes[k]
            release_freed()

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.k.shape)  # type: ignore[return-value]

    @property
    def has_rope(self) -> bool:
        return self.cos is not None and self.sin is not None

    def k_for(self, pre_rope: bool) -> torch.Tensor:
        """The keys a method quantizes: pre-RoPE when it asks and the source has them, else cached K."""
        if pre_rope and self.k_pre is not None:
            return self.k_pre
        return self.k

    def to_cached_k(self, k_hat: torch.Tensor, pre_rope: bool) -> torch.Tensor:
        """Map a method's K output back to the cached (post-RoPE) space for comparison with ``k``."""
        if pre_rope and self.k_pre is not None and self.has_rope:
            return apply_rope(k_hat, self.cos, self.sin)  # type: ignore[arg-type]
        return k_hat

    def truncate(self, seq_len: int) -> "KVData":
        """The first ``seq_len`` tokens of every tensor (for context-length sweeps); the calibration
        batch is kept as it is."""
        return self.window(0, seq_len)

    def window(self, start: int, stop: int) -> "KVData":
        """Tokens ``[start, stop)`` of every tensor (RoPE tables included); calibration kept."""
        t = slice(start, stop)

        def cut(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[..., t, :]

        return KVData(
            self.source,
            self.k[..., t, :],
            self.v[..., t, :],
            self.q[..., t, :],
            cut(self.k_pre),
            cut(self.cos),
            cut(self.sin),
            cut(self.k_grad2),
            cut(self.v_grad2),
            dict(self.meta),
            self.calibration,
        )

    def to(self, device: torch.device | str) -> "KVData":
        def mv(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(device)

        return KVData(
            self.source, mv(self.k), mv(self.v), mv(self.q), mv(self.k_pre), mv(self.cos),  # type: ignore[arg-type]
            mv(self.sin), mv(self.k_grad2), mv(self.v_grad2), dict(self.meta),
            None if self.calibration is None else self.calibration.to(device),
        )
