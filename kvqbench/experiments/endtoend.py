"""Experiment 5 — end-to-end damage on a small real model (docs/DESIGN.md §4): does the tensor error matter?

The real model (``--kvq-model``, SmolLM2-135M by default) runs over a window of the shipped corpus with a
method's quantize → dequantize applied **inside its KV cache**, where the model keeps K and V, and its
next-token distributions are compared with the unquantized model's on the same text. This is a
validation of the tensor metrics on one small model, not task accuracy.

The hook (:func:`quantized_cache`) leaves the model alone, like Hugging Face's ``QuantizedCache``: it is a
``transformers.DynamicCache`` whose ``update`` stores the exact K/V as usual and returns, instead of them,
the cache *as the method holds it* — ``(batch, kv_heads, seq_len, head_dim)``, post-RoPE K exactly as the
model caches it. No modeling code is edited, no attention is patched. Per decoder layer the cache keeps
one :class:`~kvqbench.experiments.streaming.Stream` for K and one for V (the rules of exp2's
pseudo-decode: each token is quantized once, when the method's stream policy releases it, and never
re-quantized; fp16 sink / residual / partial-tile tokens are the exact values). A method that quantizes
pre-RoPE keys by design (``k_pre_rope``, KVQuant) is given the keys un-rotated with the model's own RoPE
tables and its output is rotated back, as experiment 1 does with the captured pre-RoPE keys.

Regimes (both score against the unquantized model run with the *same* schedule of forward calls, so the
fp16 control is bitwise exact):

* **prefill** — the window in one forward pass; every layer's K and V are round-tripped as a whole
  (one quantization per layer and kind, no streaming rules: exp1/exp2-static's view) before attention
  uses them. Scored: every position ``t ∈ [0, W−1)`` (its logits predict token ``t+1``).
* **decode** — a prefill of ``P`` tokens, then the rest arriving ``block`` tokens per forward call,
  quantized under each method's stream policy (exp2's pseudo-decode). Scored: the positions a decoder
  produces, ``t ∈ [P−1, W−1)``. ``W − P`` is a multiple of ``block``, so no one-token arrival exists
  (a per-channel group of one token would round-trip losslessly); bits are billed from what is stored
  anyway (every segment's stored bits + 16 bits per fp16 element), never from a nominal formula.

Metrics per regime ``r`` (``e2e_{r}_…``): mean next-token ``KL(p‖p̂)`` in nats over the scored
positions and its p99 over positions, top-1 agreement with the unquantized model, Δ loss (mean
next-token cross-entropy of the true next token, nats/token, minus the unquantized model's on the same
positions) and the bits billed (mean over layers of K and V bits per element at the full window).

Logits are never held for a whole window: the model's decoder runs under the regime's schedule and keeps
its final hidden states, and the LM head (:func:`kvqbench.data.capture.lm_logits`) turns them into
logits :data:`HEAD_BLOCK` positions at a time, each block scored at once — so a 262k vocabulary (Gemma 3)
costs a block of ``(HEAD_BLOCK, vocab)`` logits, not ``(W, vocab)``. Blocks are aligned to absolute
positions, so the quantized and the unquantized run compute every logit with the same matrix shapes and
the fp16 control stays bitwise exact.

Sliding-window layers (Gemma 3's local attention) need nothing of their own: the cache keeps every token
(a plain ``DynamicCache``, never the model's sliding one), the model's mask hides the tokens outside the
window, and the method quantizes what the cache holds. Models with one RoPE table per layer type (Gemma
3's local and global RoPE) give each layer its own table for the pre-RoPE path.

Text: window ``i`` (``i`` = the cell's seed) is tokens ``[(i+1)·W, (i+2)·W)`` of the corpus token stream;
data-dependent methods (KVQuant's codebooks) are calibrated, per layer, on tokens ``[0, W)`` — an
independent part of the same text, with its Fisher weights (a capture with gradients), as experiments
1–3 calibrate on independent tokens. Several seeds = several windows (and seeds of random methods) give
a mean ± 95 % CI per setting.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import inspect
import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvqbench.data.memory import release_after
from kvqbench.data.types import KVData, apply_rope
from kvqbench.experiments.common import check_positive_ints, fit_method, tally_nonfinite
from kvqbench.experiments.reconstruction import CellResult
from kvqbench.experiments.streaming import Stream
from kvqbench.numerics.attention import kl_rows
from kvqbench.quantizers.base import Quantizer, StreamPolicy

__all__ = ["source_loaded", "EndToEndConfig", "CONFIG_BY_SIZE", "REGIMES", "KVCacheHook", "RealSource", "load_source",
           "quantized_cache", "run_model", "run_endtoend", "next_token_metrics", "reference_side",
           "ReferenceSide", "RowsHook", "run_model_rows", "run_endtoend_rows", "run_hidden_rows", "head_blocks",
           "model_rope", "HEAD_BLOCK"]

EXPERIMENT = "exp5"
REGIMES: tuple[str, str] = ("prefill", "decode")


@dataclass(frozen=True)
class EndToEndConfig:
    """Knobs of experiment 5.

    Attributes:
        window: tokens per text window ``W``.
        prefill: tokens of the decode regime's prefill ``P`` (``1 ≤ P < W``).
        block: tokens per forward call after the prefill; ``W − P`` must be a multiple of it.
        regimes: which regimes to run.
    """

    window: int = 256
    prefill: int = 128
    block: int = 32
    regimes: tuple[str, ...] = REGIMES

    def __post_init__(self) -> None:
        check_positive_ints(self, "window", "prefill", "block")
        if not self.prefill < self.window:
            raise ValueError(f"prefill ({self.prefill}) must be shorter than the window ({self.window})")
        if (self.window - self.prefill) % self.block:
            raise ValueError(f"window − prefill ({self.window - self.prefill}) must be a multiple of block "
                             f"({self.block}): no short (e.g. one-token) last arrival")
        bad = [r for r in self.regimes if r not in REGIMES]
        if bad or not self.regimes:
            raise ValueError(f"regimes must be a non-empty subset of {REGIMES}, got {self.regimes!r}")

    def chunks(self, regime: str) -> list[tuple[int, int]]:
        """The ``[start, stop)`` token spans of the forward calls of ``regime``."""
        if regime == "prefill":
            return [(0, self.window)]
        return [(0, self.prefill)] + [(a, a + self.block) for a in range(self.prefill, self.window, self.block)]

    def scored(self, regime: str) -> tuple[int, int]:
        """``[first, stop)`` positions whose next-token prediction is scored."""
        return (0, self.window - 1) if regime == "prefill" else (self.prefill - 1, self.window - 1)


#: the configuration of the benchmark cells per cell size (see :data:`kvqbench.cells.SIZES`)
CONFIG_BY_SIZE: dict[str, EndToEndConfig] = {
    "smoke": EndToEndConfig(window=64, prefill=32, block=16),
    "full": EndToEndConfig(window=256, prefill=128, block=32),
}


# --------------------------------------------------------------------------------------------------
# the cache hook
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
    Raises:
        ValueError: a pre-RoPE method without RoPE tables.
    """

    def __init__(self, methods: Sequence[Quantizer], *, streaming: bool,
                 cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> None:
        self.methods = list(methods)
        self.cos, self.sin = cos, sin
        if any(m.k_pre_rope for m in self.methods) and (cos is None or sin is None):
            raise ValueError("a method quantizes pre-RoPE keys: pass the model's RoPE tables (cos, sin)")
        rules = None if streaming else StreamPolicy()  # None: the method's own stream policy
        self.k = [Stream(m, "k", rules) for m in self.methods]
        self.v = [Stream(m, "v", rules) for m in self.methods]

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
        if layer >= len(self.methods):
            raise ValueError(f"the model has more layers than methods given ({len(self.methods)})")
        length = int(k_out.shape[-2])
        start = length - int(k_new.shape[-2])
        k_in = k_new
        rope = self._rope(layer) if self._pre(layer) else None
        if rope is not None:
            k_in = apply_rope(k_new, rope[0][start:length], -rope[1][start:length])  # RoPE⁻¹
        self.k[layer].extend(k_in)
        self.v[layer].extend(v_new)
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


# --------------------------------------------------------------------------------------------------
# the model side
@dataclass
class RealSource:
    """The model, its tokenizer and the calibration capture of one (model, window) setting."""

    model_name: str
    net: Any
    tokenizer: Any
    calibration: KVData
    window: int
    device: str
    _windows: dict[int, list[int]] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def n_layers(self) -> int:
        return int(self.calibration.k.shape[0])

    def window_ids(self, index: int) -> list[int]:
        """Tokens ``[(index+1)·W, (index+2)·W)`` of the corpus token stream (window ``index``)."""
        from kvqbench.data.capture import _tokens

        if not isinstance(index, int) or index < 0:
            raise ValueError(f"window index must be an int >= 0, got {index!r}")
        if index not in self._windows:  # tokenizing the corpus is the same work for every cell
            w = self.window
            ids, _ = _tokens(self.tokenizer, (index + 2) * w)
            self._windows[index] = ids[(index + 1) * w:(index + 2) * w]
        return list(self._windows[index])

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's RoPE tables per layer ``(layers, length, head_dim)`` fp32 for positions
        ``0 … length−1`` (a model with one table per layer type, e.g. Gemma 3, gives each layer its type's)."""
        return model_rope(self.net, length, self.device)


def model_rope(net: Any, length: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``net``'s RoPE tables per decoder layer ``(layers, length, head_dim)`` fp32 for positions
    ``0 … length−1``, from its own rotary-embedding module (called once per layer type where its config
    has ``layer_types`` and the module takes one)."""
    from kvqbench.data.capture import _decoder

    rotary = _decoder(net).rotary_emb
    pos = torch.arange(length, device=device)[None]
    dummy = torch.zeros(1, length, 1, device=device, dtype=torch.float32)
    n_layers = int(net.config.num_hidden_layers)
    types = getattr(net.config, "layer_types", None)
    if types is None or "layer_type" not in inspect.signature(rotary.forward).parameters:
        cos, sin = rotary(dummy, pos)
        return cos[0].float().expand(n_layers, -1, -1), sin[0].float().expand(n_layers, -1, -1)
    table = {t: rotary(dummy, pos, t) for t in dict.fromkeys(types)}
    return (torch.stack([table[t][0][0].float() for t in types]),
            torch.stack([table[t][1][0].float() for t in types]))


_SOURCES: dict[tuple, RealSource] = {}


def source_loaded(*, model: str, window: int, device: str = "cpu") -> bool:
    """Whether :func:`load_source` already holds this source in this process (no load to pay)."""
    return (model, window, device) in _SOURCES


def load_source(*, model: str, window: int, device: str = "cpu", cache_dir: str | None = None) -> RealSource:
    """The model (loaded once per process, :func:`kvqbench.data.capture.load_model`) and a calibration
    capture of the first ``window`` tokens (all layers, with Fisher weights; disk-cached in
    ``cache_dir``, like a GGUF model's converted weights). Cached per process.

    Raises:
        MissingDependencyError, FileNotFoundError, ValueError: see :func:`kvqbench.data.capture.capture_kv`.
    """
    key = (model, window, device)
    if key not in _SOURCES:
        from kvqbench.data.capture import capture_kv, load_model

        net, tok = load_model(model, device=device, cache_dir=cache_dir)
        cal = capture_kv(model=model, seq_len=window, with_grads=True, device=device, cache_dir=cache_dir)
        _SOURCES[key] = RealSource(model, net, tok, cal, window, device)
    return _SOURCES[key]


def _cache_kwarg(fn: Any) -> str:
    params = inspect.signature(fn).parameters
    return "cache" if "cache" in params else "past_key_values"  # transformers >= 5 renamed it


#: positions whose logits the LM head computes at a time, in blocks aligned to multiples of it (below
#: about 16 rows a CPU GEMM may take another kernel path, another summation order: every run computes a
#: position's logits in the same block shape, so they are bitwise the same for the same hidden states)
HEAD_BLOCK = 64


@torch.no_grad()
def run_hidden_rows(net: Any, rows: Sequence[Sequence[int]], chunks: Sequence[tuple[int, int]],
                    hook: KVCacheHook | RowsHook | None) -> torch.Tensor:
    """Run ``net``'s decoder over several token sequences of one length, one batch row each, in forward
    calls of the spans ``chunks``, with a cache that applies ``hook`` (give each row its own hook with
    :class:`RowsHook`).

    On a CPU every row's values are bitwise those of a one-row run of the same sequence and hook (the
    model computes each row's values by the same kernels; checked by ``tests/unit/test_endtoend.py``):
    batching saves time, mostly in the short forward calls of the decode regime, whose matrix products
    are too small to use the CPU well one row at a time.

    Returns:
        The final hidden states (after the model's last norm) ``(len(rows), len(row), hidden_size)`` in
        the model's dtype; :func:`head_blocks` turns them into logits.
    Raises:
        ValueError: no rows, or rows of different lengths.
    """
    from kvqbench.data.capture import _decoder

    if not rows or len({len(r) for r in rows}) != 1:
        raise ValueError(f"rows must be one or more token sequences of one length, got lengths "
                         f"{[len(r) for r in rows]}")
    decoder = _decoder(net)
    dev = next(net.parameters()).device
    x = torch.tensor([list(r) for r in rows], dtype=torch.long, device=dev)
    n = int(x.shape[0])
    cache = quantized_cache(hook)
    kw = _cache_kwarg(decoder.forward)
    out = []
    for a, b in chunks:
        pos = torch.arange(a, b, device=dev)[None].expand(n, -1)
        out.append(decoder(input_ids=x[:, a:b], position_ids=pos, use_cache=True, **{kw: cache}).last_hidden_state)
    return torch.cat(out, 1)


def head_blocks(net: Any, hidden: torch.Tensor, first: int, stop: int):
    """The logits of positions ``[first, stop)`` of one row's final hidden states ``hidden``
    ``(positions, hidden_size)``, as ``(a, b, logits)`` blocks ``(b − a, vocab)`` fp32 in order; the LM
    head runs on the :data:`HEAD_BLOCK`-aligned blocks that hold them."""
    from kvqbench.data.capture import lm_logits

    length = int(hidden.shape[0])
    for s in range(first - first % HEAD_BLOCK, stop, HEAD_BLOCK):
        e = min(s + HEAD_BLOCK, length)
        a, b = max(s, first), min(e, stop)
        yield a, b, lm_logits(net, hidden[s:e]).float()[a - s:b - s]


@torch.no_grad()
def run_model(net: Any, ids: Sequence[int], chunks: Sequence[tuple[int, int]], hook: KVCacheHook | None,
              *, first: int = 0) -> torch.Tensor:
    """Run ``net`` over ``ids`` in forward calls of the spans ``chunks`` with a cache that applies ``hook``.

    Args:
        first: logits are returned from position ``first`` on (the LM head runs on the blocks that hold
            them only; the KV cache, hence every later logit, is unaffected). ``0``: every position.
    Returns:
        Logits ``(len(ids) − first, vocab)`` fp32 of positions ``first … len(ids)−1`` (position ``t``
        predicts token ``t+1``).
    """
    return run_model_rows(net, [ids], chunks, hook, first=first)[0]


@torch.no_grad()
def run_model_rows(net: Any, rows: Sequence[Sequence[int]], chunks: Sequence[tuple[int, int]],
                   hook: KVCacheHook | RowsHook | None, *, first: int = 0) -> torch.Tensor:
    """:func:`run_model` over several token sequences of one length at once (see
    :func:`run_hidden_rows`); holds every logit, so meant for small vocabularies and tests — the
    experiment scores :func:`head_blocks` one block at a time.

    Returns:
        Logits ``(len(rows), len(row) − first, vocab)`` fp32.
    Raises:
        ValueError: no rows, or rows of different lengths.
    """
    hidden = run_hidden_rows(net, rows, chunks, hook)
    stop = int(hidden.shape[1])
    return torch.stack([torch.cat([lg for _, _, lg in head_blocks(net, h, first, stop)], 0) for h in hidden])


@dataclass(frozen=True)
class ReferenceSide:
    """The unquantized side of :func:`next_token_metrics` for some positions, computed once and shared
    by every method's cell on the same text: the logits ``(positions, vocab)`` fp32, the top-1 tokens
    and the cross-entropy of the true next tokens ``(positions,)`` fp64."""

    logits: torch.Tensor
    top1: torch.Tensor
    nll: torch.Tensor


def reference_side(logits_ref: torch.Tensor, targets: torch.Tensor) -> ReferenceSide:
    """:class:`ReferenceSide` of the unquantized ``logits_ref`` ``(positions, vocab)`` and the true next
    tokens ``targets`` ``(positions,)`` (cross-entropy in float64, :data:`_METRIC_ROWS` rows at a time)."""
    t = targets.to(logits_ref.device).long()[:, None]
    nll = [-torch.log_softmax(logits_ref[r:r + _METRIC_ROWS].double(), -1).gather(-1, t[r:r + _METRIC_ROWS])[:, 0]
           for r in range(0, int(logits_ref.shape[0]), _METRIC_ROWS)]
    nll_all = torch.cat(nll) if nll else torch.zeros(0, dtype=torch.float64)
    return ReferenceSide(logits_ref.float(), logits_ref.argmax(-1), nll_all)


#: rows of :func:`next_token_metrics`' fp64 work at a time (2 × vocab 49 152 × 8 B ≈ 0.8 MB)
_METRIC_ROWS = 2


def next_token_metrics(logits_ref: torch.Tensor | None, logits: torch.Tensor, targets: torch.Tensor, *,
                       reference: ReferenceSide | None = None) -> dict[str, Any]:
    """Next-token damage of ``logits`` against ``logits_ref`` ``(positions, vocab)``.

    ``targets`` ``(positions,)`` are the true next tokens. Computed in float64. Returns ``kl_nats``
    (mean over positions of ``KL(p‖p̂)``, ``p = softmax(logits_ref)``; each term ≥ 0), ``kl_p99_nats``
    (its 99th percentile over positions, linear interpolation), ``top1_agree`` (share of positions whose
    argmax agrees, in ``[0, 1]``), ``dloss_nats`` (mean cross-entropy of ``targets`` under ``logits``
    minus under ``logits_ref``), ``loss_ref_nats`` and the per-position KL list. ``reference``: the
    precomputed :func:`reference_side` of ``(logits_ref, targets)`` (the same values, computed once;
    ``logits_ref`` may then be ``None``).

    Raises:
        ValueError: neither ``logits_ref`` nor ``reference`` given.
    """
    if reference is None and logits_ref is None:
        raise ValueError("next_token_metrics needs logits_ref or reference")
    ref = reference_side(logits_ref, targets) if reference is None else reference
    return _block_metrics(ref, [(0, int(logits.shape[0]), logits)], targets)


def _block_metrics(ref: ReferenceSide, blocks: Any, targets: torch.Tensor) -> dict[str, Any]:
    """:func:`next_token_metrics` from the logits given as ``(a, b, logits[a:b])`` blocks covering the
    reference's positions in order; every value is per position, so the result does not depend on the
    blocking. The fp64 work runs :data:`_METRIC_ROWS` rows at a time (each row's values are the same as
    in one pass, but the temporaries stay small)."""
    t = targets.long()[:, None]
    kls, nlls, agree = [], [], []
    for a, b, lg in blocks:
        agree.append(ref.top1[a:b].to(lg.device) == lg.argmax(-1))
        for r in range(0, b - a, _METRIC_ROWS):
            x, y = a + r, min(a + r + _METRIC_ROWS, b)
            lp = torch.log_softmax(ref.logits[x:y].double(), -1)
            lq = torch.log_softmax(lg[r:r + y - x].double(), -1)
            kls.append(kl_rows(lp, lq.to(lp.device), lp.exp()))
            nlls.append(-lq.gather(-1, t[x:y].to(lq.device))[:, 0].to(lp.device))
    kl, nll = torch.cat(kls), torch.cat(nlls)
    agr = torch.cat(agree).double()
    return {"kl_nats": float(kl.mean()), "kl_p99_nats": float(torch.quantile(kl, 0.99)),
            "top1_agree": float(agr.mean()), "dloss_nats": float((nll - ref.nll.to(nll.device)).mean()),
            "loss_ref_nats": float(ref.nll.mean()), "kl_per_position": [float(v) for v in kl]}


_REFERENCES: dict[tuple, ReferenceSide] = {}
#: the most bytes of reference logits kept per process (at least one reference is always kept)
_MAX_REFERENCE_BYTES = 2**30


def _references(src: RealSource, rows: Sequence[list[int]], regime: str, cfg: EndToEndConfig) -> list[ReferenceSide]:
    """Per window of ``rows``: the :class:`ReferenceSide` of its scored positions (``cfg.scored(regime)``)
    under the regime's forward schedule (cached per process within :data:`_MAX_REFERENCE_BYTES`: every
    method's cell on the same window reuses it). The windows not cached yet run as one batch
    (:func:`run_hidden_rows`)."""
    a, b = cfg.scored(regime)
    keys = [(src.model_name, src.device, hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
             tuple(cfg.chunks(regime)), (a, b)) for ids in rows]
    got = {k: _REFERENCES[k] for k in keys if k in _REFERENCES}
    todo = {k: ids for k, ids in zip(keys, rows) if k not in got}
    if todo:
        hidden = run_hidden_rows(src.net, list(todo.values()), cfg.chunks(regime), None)
        for (key, ids), h in zip(todo.items(), hidden):
            logits = torch.cat([lg for _, _, lg in head_blocks(src.net, h, a, b)], 0)
            got[key] = reference_side(logits, torch.tensor(ids[a + 1:b + 1], dtype=torch.long))
            size = got[key].logits.numel() * 4
            while _REFERENCES and sum(r.logits.numel() * 4 for r in _REFERENCES.values()) + size > _MAX_REFERENCE_BYTES:
                _REFERENCES.pop(next(iter(_REFERENCES)))
            _REFERENCES[key] = got[key]
    return [got[k] for k in keys]


def _layer(data: KVData, i: int) -> KVData:
    def sel(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[i:i + 1]

    return dataclasses.replace(data, k=data.k[i:i + 1], v=data.v[i:i + 1], q=data.q[i:i + 1], k_pre=sel(data.k_pre),
                               cos=sel(data.cos), sin=sel(data.sin), k_grad2=sel(data.k_grad2), v_grad2=sel(data.v_grad2), calibration=None)


def layer_methods(method: Quantizer, calibration: KVData) -> list[Quantizer]:
    """One copy of ``method`` per decoder layer; a data-dependent one is fitted on that layer's
    calibration tokens (with their Fisher weights; pre-RoPE keys un-rotated with the layer's own table,
    the keys the hook hands it), a local one is used as it is."""
    out = []
    for i in range(int(calibration.k.shape[0])):
        m = copy.deepcopy(method)
        if not m.local_stats:
            fit_method(m, _layer(calibration, i))
        out.append(m)
    return out


@torch.no_grad()
def run_endtoend(method: Quantizer, src: RealSource, window_index: int,
                 config: EndToEndConfig | None = None) -> CellResult:
    """Run experiment 5 for one method on window ``window_index`` of the corpus.

    Args:
        method: a configured quantizer (copied per layer; copies of a data-dependent one are fitted on
            ``src.calibration``).
        src: the model and calibration capture (:func:`load_source`); ``src.window`` must equal
            ``config.window``.
        window_index: which text window (see module doc); the cells use their seed.
        config: window, prefill, block, regimes (default :class:`EndToEndConfig`).
    Returns:
        :class:`~kvqbench.experiments.reconstruction.CellResult` with metrics ``e2e_{regime}_kl_nats``,
        ``…_kl_p99_nats``, ``…_top1_agree``, ``…_dloss_nats``, ``…_bits_billed`` and ``extra`` (window,
        schedule, scored positions, reference loss, stream policies, token hash, and the non-finite
        element counts of the cache contents, :data:`~kvqbench.experiments.common.ROUNDTRIP_NONFINITE`).
    Raises:
        ValueError: a config whose window differs from the source's.
    """
    return run_endtoend_rows([method], src, [window_index], config)[0]


@release_after  # the cell's temporaries: kvqbench.data.memory
@torch.no_grad()
def run_endtoend_rows(methods: Sequence[Quantizer], src: RealSource, window_indices: Sequence[int],
                      config: EndToEndConfig | None = None) -> list[CellResult]:
    """:func:`run_endtoend` of several (method, window) pairs at once: pair ``r`` is batch row ``r`` of
    every forward call, with its own per-layer methods and streams (:class:`RowsHook`), so its result is
    the one :func:`run_endtoend` gives it alone (bitwise on a CPU, see :func:`run_model_rows`); the
    cells of one method at several seeds (= windows) run this way.

    Args:
        methods: one configured quantizer per row (e.g. the same method at each row's seed).
        window_indices: one window per row (see module doc), as many as ``methods``.
    Returns:
        One :class:`~kvqbench.experiments.reconstruction.CellResult` per row, as :func:`run_endtoend`'s.
    Raises:
        ValueError: no row, ``methods`` and ``window_indices`` of different lengths, or a config whose
            window differs from the source's.
    """
    cfg = config or EndToEndConfig()
    if cfg.window != src.window:
        raise ValueError(f"config window {cfg.window} != the source's calibration window {src.window}")
    if not methods or len(methods) != len(window_indices):
        raise ValueError(f"one window per method: got {len(methods)} methods and {len(window_indices)} windows")
    rows = [src.window_ids(i) for i in window_indices]
    pre_rope = any(m.k_pre_rope for m in methods)
    cos, sin = src.rope(cfg.window) if pre_rope else (None, None)
    per_row = [layer_methods(m, src.calibration) for m in methods]
    targets = [torch.tensor(ids[1:], dtype=torch.long) for ids in rows]
    results = []
    for method, i, ids in zip(methods, window_indices, rows):
        res = CellResult()
        res.extra.update({"window": cfg.window, "window_index": i,
                          "window_tokens": [(i + 1) * cfg.window, (i + 2) * cfg.window],
                          "calibration_tokens": [0, cfg.window], "prefill_tokens": cfg.prefill,
                          "block": cfg.block, "tokens_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
                          "regimes": list(cfg.regimes), "k_pre_rope": bool(method.k_pre_rope)})
        results.append(res)
    for regime in cfg.regimes:
        hooks = [KVCacheHook(ms, streaming=regime == "decode", cos=cos, sin=sin) for ms in per_row]
        a, b = cfg.scored(regime)
        hidden = run_hidden_rows(src.net, rows, cfg.chunks(regime), hooks[0] if len(hooks) == 1 else RowsHook(hooks))
        refs = _references(src, rows, regime, cfg)
        for res, hook, h, side, tg in zip(results, hooks, hidden, refs, targets):
            blocks = ((x - a, y - a, lg) for x, y, lg in head_blocks(src.net, h, a, b))
            m = _block_metrics(side, blocks, tg[a:b])
            pre = f"e2e_{regime}_"
            for name in ("kl_nats", "kl_p99_nats", "top1_agree", "dloss_nats"):
                res.metrics[pre + name] = m[name]
            res.metrics[pre + "bits_billed"] = hook.bits_billed()
            for sk, sv in zip(hook.k, hook.v):  # every token's value as the cache held it at the end
                tally_nonfinite(res.extra, k=sk.result(0).x_hat, v=sv.result(0).x_hat)
            res.extra[regime] = {"scored_positions": [a, b], "loss_ref_nats": m["loss_ref_nats"],
                                 "forward_calls": len(cfg.chunks(regime)), **hook.describe()}
    return results
