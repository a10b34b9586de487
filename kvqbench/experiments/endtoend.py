"""Experiment 5 — end-to-end damage on a small real model (docs/DESIGN.md §4): does the tensor error matter?

The real model (``--kvq-model``, SmolLM2-135M by default) reads a window of real prose with a method's
quantize → dequantize applied **inside its KV cache** (:mod:`kvqbench.experiments.kvcache`: the cache
stores exact K/V and hands attention the cache as the method holds it), and its next-token
distributions are compared with the unquantized model's on the same text. This is a validation of the
tensor metrics on one small model, not task accuracy.

**Text.** Window ``i`` (``i`` = the cell's seed, the same text for every method and bits) is tokens
``[i·W, (i+1)·W)`` of the pinned exp5 text (:mod:`kvqbench.data.text`: Python Language Reference topics
read from the standard library's ``pydoc_data``, SHA-256 checked), tokenized without special tokens.
Data-dependent methods (KVQuant's codebooks) are calibrated, per layer, on the first ``W`` tokens of the
shipped ``corpus.txt`` with their Fisher weights (the capture of experiments 1–3), another text: no
scored token is a calibration token.

**Schedule.** Each window is a prompt of its first ``P`` tokens, read by the unquantized model in one
forward call — as a serving engine prefills a prompt at full precision and then keeps its cache — and a
continuation of ``W − P`` tokens read with the quantized cache. The prompt's forward call and its exact
K/V are computed once per window and shared by the reference and every method's cell; each method's
cache receives the prompt's K/V as its first arrival. Regimes (both score the same positions against
the unquantized model run with the *same* schedule, so the fp16 control is bitwise exact):

* **prefill** — the continuation in one forward call; K and V are quantized as each arrival is whole
  (no streaming rules: one round trip of the prompt, one of the continuation, per layer and kind) —
  exp1/exp2-static's view.
* **decode** — the continuation arriving ``block`` tokens per forward call under each method's stream
  policy (exp2's pseudo-decode; fp16 sink / residual / partial-tile tokens exact). ``W − P`` is a
  multiple of ``block``, so no one-token arrival exists. Bits are billed from what is stored (every
  segment's stored bits + 16 bits per fp16 element), never from a nominal formula.

Scored: the positions ``t ∈ [P, W−1)`` the continuation produces (position ``t`` predicts token ``t+1``).
Metrics per regime ``r`` (``e2e_{r}_…``): mean next-token ``KL(p‖p̂)`` in nats over the scored positions
and its p99 over positions, top-1 agreement with the unquantized model, Δ loss (mean next-token
cross-entropy of the true next token, nats/token, minus the unquantized model's on the same positions)
and the bits billed (mean over layers of K and V bits per element at the full window).

Logits are never held for a whole window: the decoder keeps its final hidden states, and the LM head
(:func:`kvqbench.data.capture.lm_logits`) turns them into logits :data:`HEAD_BLOCK` positions at a time
— so a 262k vocabulary (Gemma 3) costs a block of ``(HEAD_BLOCK, vocab)`` logits. A window's
continuations of both regimes go through the head as one stack (prefill's ``W − P`` positions, then
decode's: one matrix product of ``2·(W − P)`` rows, which a CPU computes faster per row than two of
``W − P``), the unquantized run's in the same stack, so the quantized and the unquantized run compute
every logit with the same matrix shapes and the fp16 control stays bitwise exact. The unquantized run's
stack of final hidden states, like the prompt's K/V, is computed once per window and process and shared
by every setting on that window; the unquantized side of the metrics it gives
(:class:`~kvqbench.experiments.nexttoken.ReferenceSide`: the scored positions' logits, their top-1 and
cross-entropy) is computed by the first cell on the window and kept for the last three windows used (a
seed group's: the other settings' cells on them reuse it instead of running the LM head again), and a data-dependent
method's per-layer fit whose seed plays no part is computed once per process and shared by every window.

Sliding-window layers (Gemma 3) need nothing of their own: the cache keeps every token, the model's mask
hides the tokens outside the window; a model with a RoPE table per layer type gives each layer its own.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import inspect
import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvqbench.data.memory import release_after
from kvqbench.data.types import KVData
from kvqbench.experiments.common import check_positive_ints, fit_method, tally_nonfinite
from kvqbench.experiments.kvcache import CacheWriter, KVCacheHook, RowsHook, quantized_cache
from kvqbench.experiments.nexttoken import ReferenceSide, block_metrics, next_token_metrics, reference_side
from kvqbench.experiments.realmodel import RealSource, load_source, model_rope, source_loaded
from kvqbench.experiments.reconstruction import CellResult
from kvqbench.quantizers.base import Quantizer

__all__ = ["prompt_cache", "source_loaded", "EndToEndConfig", "CONFIG_BY_SIZE", "REGIMES", "KVCacheHook", "RealSource", "load_source",
           "quantized_cache", "run_model", "run_endtoend", "next_token_metrics", "reference_side", "CacheWriter",
           "ReferenceSide", "RowsHook", "run_model_rows", "run_endtoend_rows", "run_hidden_rows", "head_blocks",
           "model_rope", "HEAD_BLOCK"]

EXPERIMENT = "exp5"
REGIMES: tuple[str, str] = ("prefill", "decode")


@dataclass(frozen=True)
class EndToEndConfig:
    """Knobs of experiment 5.

    Attributes:
        window: tokens per text window ``W``.
        prompt: tokens ``P`` the unquantized model reads first (``1 ≤ P < W − 1``).
        block: tokens per forward call of the decode regime; ``W − P`` must be a multiple of it.
        regimes: which regimes to run.
    """

    window: int = 256
    prompt: int = 224
    block: int = 16
    regimes: tuple[str, ...] = REGIMES

    def __post_init__(self) -> None:
        check_positive_ints(self, "window", "prompt", "block")
        if not self.prompt < self.window - 1:
            raise ValueError(f"prompt ({self.prompt}) must be shorter than the window ({self.window}) minus one")
        if (self.window - self.prompt) % self.block:
            raise ValueError(f"window − prompt ({self.window - self.prompt}) must be a multiple of block "
                             f"({self.block}): no short (e.g. one-token) last arrival")
        bad = [r for r in self.regimes if r not in REGIMES]
        if bad or not self.regimes:
            raise ValueError(f"regimes must be a non-empty subset of {REGIMES}, got {self.regimes!r}")

    def chunks(self, regime: str) -> list[tuple[int, int]]:
        """The ``[start, stop)`` token spans of the forward calls of ``regime`` after the prompt."""
        if regime == "prefill":
            return [(self.prompt, self.window)]
        return [(a, a + self.block) for a in range(self.prompt, self.window, self.block)]

    def scored(self, regime: str) -> tuple[int, int]:
        """``[first, stop)`` positions whose next-token prediction is scored (the same in both regimes)."""
        return self.prompt, self.window - 1


#: the configuration of the benchmark cells per cell size (see :data:`kvqbench.cells.SIZES`)
CONFIG_BY_SIZE: dict[str, EndToEndConfig] = {
    "smoke": EndToEndConfig(window=64, prompt=48, block=8),
    "full": EndToEndConfig(window=256, prompt=224, block=16),
}


def _cache_kwarg(fn: Any) -> str:
    params = inspect.signature(fn).parameters
    return "cache" if "cache" in params else "past_key_values"  # transformers >= 5 renamed it


#: positions whose logits the LM head computes at a time, in blocks aligned to multiples of it (below
#: about 16 rows a CPU GEMM may take another kernel path, another summation order: every run computes a
#: position's logits in the same block shape, so they are bitwise the same for the same hidden states);
#: the full exp5 cells' stack of both regimes (2 × 64 positions) is one block
HEAD_BLOCK = 128


@torch.no_grad()
def run_hidden_rows(net: Any, rows: Sequence[Sequence[int]], chunks: Sequence[tuple[int, int]],
                    hook: KVCacheHook | RowsHook | None,
                    prompt: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None, *,
                    primed: bool = False) -> torch.Tensor:
    """Run ``net``'s decoder over several token sequences of one length, one batch row each, in forward
    calls of the spans ``chunks``, with a cache that applies ``hook`` (give each row its own hook with
    :class:`RowsHook`). ``prompt``: per decoder layer the exact K/V ``(len(rows), kv_heads, P, head_dim)``
    of the rows' first ``P`` tokens (:func:`prompt_cache`), given to the cache (and ``hook``) as its first
    arrival before the chunks, which then start at ``P``; ``primed``: ``hook`` holds that arrival already
    (:meth:`KVCacheHook.extend`), the cache only stores it.

    On a CPU every row's values are bitwise those of a one-row run of the same sequence and hook (the
    model computes each row's values by the same kernels; checked by ``tests/unit/test_endtoend.py``):
    batching saves time, mostly in the short forward calls of the decode regime, whose matrix products
    are too small to use the CPU well one row at a time.

    Returns:
        The final hidden states (after the model's last norm) of the chunks' positions ``(len(rows),
        Σ chunk lengths, hidden_size)`` in the model's dtype; :func:`head_blocks` turns them into logits.
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
    cache = quantized_cache(None if primed else hook)
    for layer, (k, v) in enumerate(prompt or ()):
        cache.update(k, v, layer)
    cache.kvq_hook = hook
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
    """Logits ``(len(ids) − first, vocab)`` fp32 of positions ``first … len(ids)−1`` (position ``t`` predicts
    token ``t+1``) of ``net`` run over ``ids`` in forward calls of the spans ``chunks`` (from 0) with a
    cache that applies ``hook``; the LM head runs on the blocks holding positions ``≥ first`` only."""
    return run_model_rows(net, [ids], chunks, hook, first=first)[0]


@torch.no_grad()
def run_model_rows(net: Any, rows: Sequence[Sequence[int]], chunks: Sequence[tuple[int, int]],
                   hook: KVCacheHook | RowsHook | None, *, first: int = 0) -> torch.Tensor:
    """:func:`run_model` over several token sequences of one length at once (:func:`run_hidden_rows`):
    logits ``(len(rows), len(row) − first, vocab)`` fp32; holds every logit (tests, small vocabularies).

    Raises:
        ValueError: no rows, or rows of different lengths.
    """
    hidden = run_hidden_rows(net, rows, chunks, hook)
    stop = int(hidden.shape[1])
    return torch.stack([torch.cat([lg for _, _, lg in head_blocks(net, h, first, stop)], 0) for h in hidden])


class _Keep(CacheWriter):
    """A pass-through hook that keeps each layer's arriving K/V (the exact prompt cache)."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, layer, k_new, v_new, k_all, v_all):  # type: ignore[override]
        self.kv[layer] = (k_new, v_new)
        return k_all, v_all


#: per process, least recently used first: each window's exact prompt K/V and reference stack
_CACHE: dict[tuple, Any] = {}
#: the most bytes :data:`_CACHE` keeps (at least one entry is always kept)
_MAX_CACHE_BYTES = 2**30
#: the most entries :data:`_CACHE` keeps: a prompt and a reference stack for each window of the last two
#: window groups (the cells run the window groups in order, so an older window is not read again; on
#: Gemma 3 each window's prompt K/V is 8 MiB, 16 windows' would be kept for nothing)
_MAX_CACHE_ENTRIES = 12
#: per process, least recently used first: each window's :class:`ReferenceSide` per regime (the
#: unquantized logits of its scored positions, their top-1 and cross-entropy), computed from its reference
#: stack by the first cell on the window and reused by the other settings' cells on it
_SIDES: dict[tuple, tuple[ReferenceSide, ...]] = {}
#: windows whose sides :data:`_SIDES` keeps: a seed group's (three windows; each holds its ``2·(W − P)``
#: rows of logits, ``vocab`` fp32 each: 12.6 MB on SmolLM2, 67 MB on Gemma 3), enough for a worker that runs
#: the settings of one window group after another
_MAX_SIDES = 3
#: per process, oldest first: the per-layer fits of data-dependent methods whose seed plays no part
#: (:func:`layer_methods`), by source and method parameters
_FITS: dict[tuple, list[Quantizer]] = {}
#: the most fits :data:`_FITS` keeps
_MAX_FITS = 4


def _nbytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):  # a window's reference stack of final hidden states
        return v.numel() * v.element_size()
    return sum(k.numel() * k.element_size() * 2 for k, _ in v)


def _cached(keys: Sequence[tuple], rows: Sequence[list[int]], compute: Any) -> list[Any]:
    """The values of ``keys`` from :data:`_CACHE`; the missing ones computed together by ``compute(rows
    of the missing keys)`` (one value per row) and kept, least recently used evicted beyond
    :data:`_MAX_CACHE_ENTRIES` or :data:`_MAX_CACHE_BYTES`."""
    got = {k: _CACHE.pop(k) for k in keys if k in _CACHE}
    todo = {k: ids for k, ids in zip(keys, rows) if k not in got}
    if todo:
        got.update(zip(todo, compute(list(todo.values()))))
    for k in keys:
        _CACHE[k] = got[k]  # most recently used last
    while len(_CACHE) > 1 and (len(_CACHE) > _MAX_CACHE_ENTRIES
                               or sum(_nbytes(v) for v in _CACHE.values()) > _MAX_CACHE_BYTES):
        _CACHE.pop(next(iter(_CACHE)))
    return [got[k] for k in keys]


def _key(src: RealSource, ids: list[int], *what: Any) -> tuple:
    return (src.model_name, src.device, hashlib.sha256(json.dumps(ids).encode()).hexdigest()) + what


def prompt_cache(src: RealSource, rows: Sequence[list[int]], prompt: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The exact K/V of the first ``prompt`` tokens of each row, per decoder layer, stacked over the rows
    ``(len(rows), kv_heads, prompt, head_dim)`` (post-RoPE K): one unquantized forward call per window,
    cached per process and shared by the reference and every method's cell on that window."""
    def compute(todo: list[list[int]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        keep = _Keep()
        run_hidden_rows(src.net, todo, [(0, prompt)], keep)
        return [[(k[r:r + 1].clone(), v[r:r + 1].clone()) for _, (k, v) in sorted(keep.kv.items())]
                for r in range(len(todo))]

    per_row = _cached([_key(src, ids, "prompt", prompt) for ids in rows], rows, compute)
    return [(torch.cat([p[i][0] for p in per_row]), torch.cat([p[i][1] for p in per_row]))
            for i in range(len(per_row[0]))]


def _stack(hidden: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per row, the regimes' final hidden states one after the other: ``(rows, Σ positions, hidden_size)``."""
    return hidden[0] if len(hidden) == 1 else torch.cat(list(hidden), 1)


def _logits(net: Any, stack: torch.Tensor) -> torch.Tensor:
    """The logits ``(positions, vocab)`` fp32 of one row's stack of final hidden states (:func:`head_blocks`)."""
    blocks = [lg for _, _, lg in head_blocks(net, stack, 0, int(stack.shape[0]))]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, 0)


def _reference_stacks(src: RealSource, rows: Sequence[list[int]], cfg: EndToEndConfig) -> list[torch.Tensor]:
    """Per window of ``rows``: the unquantized model's stack of final hidden states ``(Σ positions,
    hidden_size)`` fp32 under each regime's schedule (:func:`_stack`, in ``cfg.regimes`` order), cached per
    process like :func:`prompt_cache`: every method's cell on the window reuses it. The windows not cached
    yet run as one batch. The stack, not its logits, is kept: ``hidden_size`` values per position instead
    of ``vocab`` (640 against 262 144 on Gemma 3)."""
    def compute(todo: list[list[int]]) -> list[torch.Tensor]:
        prompt = prompt_cache(src, todo, cfg.prompt)
        stack = _stack([run_hidden_rows(src.net, todo, cfg.chunks(r), None, prompt) for r in cfg.regimes])
        return [h.clone() for h in stack]

    what = tuple((r, tuple(cfg.chunks(r))) for r in cfg.regimes)
    return _cached([_key(src, ids, "reference stack", what) for ids in rows], rows, compute)


def _reference_sides(src: RealSource, stack: torch.Tensor, ids: list[int], cfg: EndToEndConfig) -> tuple[ReferenceSide, ...]:
    """The :class:`ReferenceSide` of a window's scored positions under each regime (in ``cfg.regimes``
    order), its logits computed from the window's reference ``stack`` (:func:`_reference_stacks`) as a
    cell's are from its own (:func:`_logits`, the same matrix shapes)."""
    a, b = cfg.scored(cfg.regimes[0])
    n = cfg.window - cfg.prompt
    logits = _logits(src.net, stack)
    t = torch.tensor(ids[a + 1:b + 1], dtype=torch.long)
    return tuple(reference_side(logits[i * n:i * n + b - a], t) for i in range(len(cfg.regimes)))  # views of one block


def _cached_sides(src: RealSource, stack: torch.Tensor, ids: list[int], cfg: EndToEndConfig) -> tuple[ReferenceSide, ...]:
    """:func:`_reference_sides` of a window, kept in :data:`_SIDES` (the same values, computed once per
    window while it stays among the :data:`_MAX_SIDES` most recently used)."""
    key = _key(src, ids, "reference sides", tuple((r, tuple(cfg.chunks(r))) for r in cfg.regimes))
    sides = _SIDES.pop(key, None)
    if sides is None:
        sides = _reference_sides(src, stack, ids, cfg)
    _SIDES[key] = sides  # most recently used last
    while len(_SIDES) > _MAX_SIDES:
        _SIDES.pop(next(iter(_SIDES)))
    return sides


def _layer(data: KVData, i: int) -> KVData:
    def sel(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[i:i + 1]

    return dataclasses.replace(data, k=data.k[i:i + 1], v=data.v[i:i + 1], q=data.q[i:i + 1], k_pre=sel(data.k_pre),
                               cos=sel(data.cos), sin=sel(data.sin), k_grad2=sel(data.k_grad2), v_grad2=sel(data.v_grad2), calibration=None)


def layer_methods(method: Quantizer, calibration: KVData) -> list[Quantizer]:
    """One copy of ``method`` per decoder layer; a data-dependent one is fitted on that layer's
    calibration tokens (with their Fisher weights), a local one is used as it is."""
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
    """Run experiment 5 for one method on window ``window_index`` of the exp5 text.

    Args:
        method: a configured quantizer (copied per layer; copies of a data-dependent one are fitted on
            ``src.calibration``).
        src: the model and calibration capture (:func:`load_source`); ``src.window`` must equal
            ``config.window``.
        window_index: which text window (see module doc); the cells use their seed.
        config: window, prompt, block, regimes (default :class:`EndToEndConfig`).
    Returns:
        :class:`~kvqbench.experiments.reconstruction.CellResult` with metrics ``e2e_{regime}_kl_nats``,
        ``…_kl_p99_nats``, ``…_top1_agree``, ``…_dloss_nats``, ``…_bits_billed`` and ``extra`` (window,
        schedule, scored positions, reference loss, stream policies, token hash, and the non-finite
        element counts of the cache contents, :data:`~kvqbench.experiments.common.ROUNDTRIP_NONFINITE`).
    Raises:
        ValueError: a config whose window differs from the source's; a window beyond the text.
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
    from kvqbench.data.text import SOURCE, TEXT_SHA256

    cfg = config or EndToEndConfig()
    if cfg.window != src.window:
        raise ValueError(f"config window {cfg.window} != the source's calibration window {src.window}")
    if not methods or len(methods) != len(window_indices):
        raise ValueError(f"one window per method: got {len(methods)} methods and {len(window_indices)} windows")
    rows = [src.text_window_ids(i) for i in window_indices]
    pre_rope = any(m.k_pre_rope for m in methods)
    cos, sin = src.rope(cfg.window) if pre_rope else (None, None)
    shape = (1, *tuple(src.calibration.k.shape)[1:])
    per_row = []
    for m in methods:
        if m.local_stats or m.seeded_for(shape):
            per_row.append(layer_methods(m, src.calibration))
            continue
        # a fit the seed plays no part in: one per process, shared by every row and window (a copy each)
        key = (src.model_name, src.device, src.window, type(m).__name__,
               json.dumps({k: repr(v) for k, v in m.params().items() if k != "seed"}))
        if key not in _FITS:
            _FITS[key] = layer_methods(m, src.calibration)
            while len(_FITS) > _MAX_FITS:
                _FITS.pop(next(iter(_FITS)))
        per_row.append(copy.deepcopy(_FITS[key]))
    a, b = cfg.scored(cfg.regimes[0])
    results = []
    for method, i, ids in zip(methods, window_indices, rows):
        res = CellResult()
        res.extra.update({"window": cfg.window, "window_index": i, "window_tokens": [i * cfg.window, (i + 1) * cfg.window],
                          "text": {"source": SOURCE, "sha256": TEXT_SHA256},
                          "tokens_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
                          "calibration": {"text": "kvqbench/data/corpus.txt", "tokens": [0, cfg.window]},
                          "prompt_tokens": cfg.prompt, "block": cfg.block, "scored_positions": [a, b],
                          "regimes": list(cfg.regimes), "k_pre_rope": bool(method.k_pre_rope)})
        results.append(res)
    prompt = prompt_cache(src, rows, cfg.prompt)
    first = [KVCacheHook(ms, streaming=False, cos=cos, sin=sin) for ms in per_row]  # the prompt's arrival
    for r, hook in enumerate(first):
        for layer, (k, v) in enumerate(prompt):
            hook.extend(layer, k[r:r + 1], v[r:r + 1])
    hidden, held = [], {}  # held: per regime, per row, what the cache held at the end (bits, description)
    for regime in cfg.regimes:  # quantized once for the regimes whose rules are the same (KVCacheHook.fork)
        hs = [hook.fork(streaming=regime == "decode") for hook in first]
        hidden.append(run_hidden_rows(src.net, rows, cfg.chunks(regime), hs[0] if len(hs) == 1 else RowsHook(hs),
                                      prompt, primed=True))
        held[regime] = [(hook.bits_billed(), hook.describe()) for hook in hs]
        for res, hook in zip(results, hs):
            for sk, sv in zip(hook.k, hook.v):  # every token's value as the cache held it at the end
                tally_nonfinite(res.extra, k=sk.result(0).x_hat, v=sv.result(0).x_hat)
        del hs  # the regime's caches: one regime's are held at a time
    del first
    stack = _stack(hidden)
    del hidden
    refs = _reference_stacks(src, rows, cfg)
    n = cfg.window - cfg.prompt
    for r, (res, h, ref, ids) in enumerate(zip(results, stack, refs, rows)):
        sides = _cached_sides(src, ref, ids, cfg)
        logits = _logits(src.net, h)
        targets = torch.tensor(ids[a + 1:b + 1], dtype=torch.long)
        for i, (regime, side) in enumerate(zip(cfg.regimes, sides)):
            m = block_metrics(side, [(0, b - a, logits[i * n:i * n + b - a])], targets)
            bits, described = held[regime][r]
            pre = f"e2e_{regime}_"
            for name in ("kl_nats", "kl_p99_nats", "top1_agree", "dloss_nats"):
                res.metrics[pre + name] = m[name]
            res.metrics[pre + "bits_billed"] = bits
            res.extra[regime] = {"loss_ref_nats": m["loss_ref_nats"], "forward_calls": len(cfg.chunks(regime)),
                                 **described}
        del logits, sides
    return results
