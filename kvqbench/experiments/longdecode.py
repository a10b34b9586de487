"""Experiment 6 — long decode on the real model (docs/DESIGN.md §4): damage that builds up over
thousands of decoded tokens, and retrieval from far back (:mod:`kvqbench.experiments.passkey`).

The model, its cache hook and the stream policies are experiment 5's
(:mod:`kvqbench.experiments.endtoend`: :class:`~kvqbench.experiments.endtoend.KVCacheHook`, one
:class:`~kvqbench.experiments.streaming.Stream` per layer and kind, K/V ``(batch, kv_heads, seq_len,
head_dim)`` exactly as the model caches them); what changes is the length of the text and what is scored.

**The text** (:func:`long_text`): the unquantized model writes a continuation of a corpus prompt (the
first ``prompt`` tokens of corpus window ``seed``, :meth:`RealSource.window_ids`) up to ``length`` = T
tokens in all, by seeded sampling — temperature 1, top-k 50, special tokens (end of text) excluded so the
text runs to T. Sampling, not greedy: a 135M model's greedy continuation falls into a loop (one sentence
repeated tens of times), which is not text a model decodes in use, while tempered top-k sampling keeps
producing new text; temperature 1 keeps the model's own distribution within its top 50 tokens. The
text is generated once per (model, prompt, seed, T, sampling) and kept on disk with its sha256 in
``kvqbench.privdir.user_cache_dir("longtext")``, under a lock per file (the first process generates, the
others wait and read it), so every run and worker on a machine decodes the very same tokens.

**Teacher-forced long decode** (:func:`run_longdecode_rows`): a prefill of ``P`` tokens, then the rest of
the text in blocks of ``block`` tokens, each method under its stream policy; scored at the positions a
decoder produces, ``t ∈ [P−1, T−1)``, against the unquantized model under the same forward schedule (so
the fp16 control is bitwise exact). Metrics: the next-token ``KL(p‖p̂)`` per position (nats) as a curve of
consecutive bins of ``bin`` decoded positions (``series["kl_curve"]``), its least-squares slope per 1 000
positions, its mean over every scored position and over the last quarter, top-1 agreement over the last
quarter, Δ loss,
and the bits billed at T (every segment's stored bits + 16 bits per fp16 element, mean over layers; the
share of fp16 tokens at T is in ``extra``: at T in the thousands a method's fp16 windows are a few percent
of the cache).

**Free-running divergence**: after the teacher-forced text, each model continues greedily for
``free_tokens`` = G tokens with its own cache (new tokens enter it one per forward call under the stream
policy). Metrics: tokens until the first one that differs from the unquantized model's greedy
continuation (G when none does) and the share of the G positions whose tokens agree. A method without a
stream policy quantizes each one-token arrival by itself (per-channel statistics of one token are
exact): for it the G new tokens are near lossless and the metric measures the damage of its quantized
prefix.

**Noise floor**: ``noise_draws`` more teacher-forced decodes of chosen rows with every K/V entering the
cache multiplied by ``1 + noise_rel·z`` (``z`` standard normal, seeded per draw, drawn once per token and
element; relative 1e-7, fp32 rounding level) before the method sees it. The spread of the mean and
last-quarter KL over the unperturbed run and the draws is what float noise alone moves the metric by;
differences between methods below it are ties.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kvqbench.experiments.accumulation import SeriesCellResult
from kvqbench.experiments.common import check_positive_ints, tally_nonfinite
from kvqbench.experiments.endtoend import (
    CacheWriter,
    KVCacheHook,
    RealSource,
    RowsHook,
    _cache_kwarg,
    layer_methods,
    next_token_metrics,
    quantized_cache,
)
from kvqbench.quantizers.base import Quantizer

__all__ = ["LongDecodeConfig", "CONFIG_BY_SIZE", "ContextTooShortError", "check_context", "model_context",
           "long_text", "sample_continuation", "decode", "PerturbedHook", "binned", "slope_per_1k",
           "LongDecodeResult", "run_longdecode_rows"]

EXPERIMENT = "exp6"


@dataclass(frozen=True)
class LongDecodeConfig:
    """Knobs of experiment 6.

    Attributes:
        length: tokens of the long text ``T`` (prompt + continuation).
        prompt: corpus tokens the continuation follows (at most the source's window).
        prefill: tokens of the prefill ``P`` (``1 ≤ P < T``).
        block: tokens per forward call after the prefill; ``T − P`` must be a multiple of it.
        bin: positions per bin of the KL curve.
        free_tokens: greedy tokens ``G`` of the free-running continuation (0: none).
        noise_draws: perturbed decodes of each noise row (0: no noise floor).
        noise_rel: relative size of the perturbation.
        temperature, top_k: the sampling of the long text.
        passkey_lengths: token lengths of the passkey prompts (key answer included).
        passkey_depths: where in the filler the key sits, as shares of it.
    Raises:
        ValueError: on values that break the schedule (see each check's message).
    """

    length: int = 2048
    prompt: int = 128
    prefill: int = 256
    block: int = 64
    bin: int = 256
    free_tokens: int = 32
    noise_draws: int = 2
    noise_rel: float = 1e-7
    temperature: float = 1.0
    top_k: int = 50
    passkey_lengths: tuple[int, ...] = (512, 2048)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)

    def __post_init__(self) -> None:
        check_positive_ints(self, "length", "prompt", "prefill", "block", "bin", "top_k")
        if self.free_tokens < 0 or self.noise_draws < 0:
            raise ValueError("free_tokens and noise_draws must be >= 0")
        if not self.prompt < self.length or not self.prefill < self.length:
            raise ValueError(f"prompt ({self.prompt}) and prefill ({self.prefill}) must be shorter than the text "
                             f"({self.length})")
        if (self.length - self.prefill) % self.block:
            raise ValueError(f"length − prefill ({self.length - self.prefill}) must be a multiple of block "
                             f"({self.block}): no short (e.g. one-token) last arrival")
        if not self.temperature > 0 or not self.noise_rel >= 0:
            raise ValueError("temperature must be > 0 and noise_rel >= 0")
        if any(not 0.0 <= d <= 1.0 for d in self.passkey_depths) or not self.passkey_depths:
            raise ValueError(f"passkey_depths must be shares in [0, 1], got {self.passkey_depths!r}")

    def chunks(self) -> list[tuple[int, int]]:
        """The ``[start, stop)`` token spans of the teacher-forced forward calls."""
        return [(0, self.prefill)] + [(a, a + self.block) for a in range(self.prefill, self.length, self.block)]

    def scored(self) -> tuple[int, int]:
        """``[first, stop)`` positions whose next-token prediction is scored."""
        return self.prefill - 1, self.length - 1

    @property
    def context(self) -> int:
        """The longest sequence the model sees: the text plus its free-running continuation, or the longest
        passkey prompt."""
        return max(self.length + self.free_tokens, *self.passkey_lengths)


#: the configuration of the cells per cell size (``smoke``: the test suite, every regime on the fewest
#: tokens — one passkey depth, as the passkey prompts are most of a smoke cell's tokens; ``long``: the
#: long tier)
CONFIG_BY_SIZE: dict[str, LongDecodeConfig] = {
    "smoke": LongDecodeConfig(length=64, prompt=16, prefill=32, block=32, bin=16, free_tokens=3, noise_draws=1,
                              passkey_lengths=(64, 80), passkey_depths=(0.5,)),
    "long": LongDecodeConfig(),
}


# --------------------------------------------------------------------------------------------------
# the model's context
class ContextTooShortError(ValueError):
    """The model's context is shorter than the longest sequence a configuration needs."""


def model_context(model: str) -> int | None:
    """The context length (``max_position_embeddings``) of ``model`` (``"smollm2"``, an HF id, a local
    folder or ``.gguf`` file), read from its config or GGUF metadata without loading the weights;
    ``None`` when it does not say."""
    from kvqbench.data.capture.models import _resolve

    ref = _resolve(model)
    if ref.gguf_file is not None:
        return _gguf_context(Path(ref.source) / ref.gguf_file)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ref.source, local_files_only=ref.local)
    n = getattr(cfg, "max_position_embeddings", None)
    return None if n is None else int(n)


#: GGUF metadata value types of a fixed size → their size in bytes (8: string, 9: array)
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_INTS = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def _gguf_context(path: Path) -> int | None:
    """The ``<arch>.context_length`` of a GGUF file (format 2 or 3), read from its header alone: the
    metadata pairs in order, skipping every other value (the tokenizer's arrays among them)."""
    import struct

    with open(path, "rb") as f:
        def unpack(fmt: str) -> Any:
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def skip(kind: int) -> None:
            if kind == 8:
                f.seek(unpack("<Q"), 1)
            elif kind == 9:
                inner, n = unpack("<I"), unpack("<Q")
                if inner in _GGUF_SIZES:
                    f.seek(n * _GGUF_SIZES[inner], 1)
                else:
                    for _ in range(n):
                        skip(inner)
            else:
                f.seek(_GGUF_SIZES[kind], 1)

        if f.read(4) != b"GGUF" or unpack("<I") < 2:
            return None
        unpack("<Q")  # tensors
        for _ in range(unpack("<Q")):
            key = f.read(unpack("<Q")).decode("utf-8", "replace")
            kind = unpack("<I")
            if key.endswith(".context_length") and kind in _GGUF_INTS:
                return int(unpack(_GGUF_INTS[kind]))
            skip(kind)
    return None


def check_context(model: str, tokens: int, context: int | None = None) -> None:
    """Raise :class:`ContextTooShortError` (one line) when ``model``'s context (``context``, else
    :func:`model_context`) is shorter than ``tokens``."""
    n = model_context(model) if context is None else context
    if n is not None and n < tokens:
        raise ContextTooShortError(f"model {model} has a context of {n} tokens, shorter than the {tokens} "
                                   "tokens the long-decode cells need")


# --------------------------------------------------------------------------------------------------
# the text
def _lock(path: Path) -> Any:
    from kvqbench.data.capture.store import _capture_lock

    return _capture_lock(path)


def _text_dir() -> Path:
    from kvqbench.privdir import fallback_dir, user_cache_dir

    try:
        return user_cache_dir("longtext")
    except OSError:
        return fallback_dir("longtext")


def _ids_sha(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()


@torch.no_grad()
def sample_continuation(net: Any, prompt: Sequence[int], length: int, *, seed: int, temperature: float = 1.0,
                        top_k: int = 50, banned: Sequence[int] = ()) -> list[int]:
    """``prompt`` continued by ``net`` to ``length`` tokens, one token per forward call, each drawn from
    the ``top_k`` most likely next tokens (``banned`` ids excluded) with probabilities
    ``softmax(logits / temperature)`` renormalized over them (fp64), by a ``torch.Generator`` seeded
    with ``seed``.

    Raises:
        ValueError: ``length`` not longer than the prompt.
    """
    if length <= len(prompt):
        raise ValueError(f"length ({length}) must exceed the prompt ({len(prompt)} tokens)")
    dev = next(net.parameters()).device
    cache, kw = quantized_cache(None), _cache_kwarg(net.forward)
    gen = torch.Generator().manual_seed(int(seed))
    ids = [int(i) for i in prompt]
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    logits = net(input_ids=x, position_ids=torch.arange(len(ids), device=dev)[None], use_cache=True,
                 **{kw: cache}).logits[0, -1]
    ban = torch.tensor(sorted(set(int(b) for b in banned)), dtype=torch.long)
    while True:
        lg = logits.detach().double().cpu() / temperature
        if ban.numel():
            lg[ban] = -math.inf
        top = torch.topk(lg, min(top_k, int(lg.numel())))
        pick = int(torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen))
        ids.append(int(top.indices[pick]))
        if len(ids) == length:
            return ids
        t = len(ids) - 1
        logits = net(input_ids=torch.tensor([[ids[-1]]], device=dev), position_ids=torch.tensor([[t]], device=dev),
                     use_cache=True, **{kw: cache}).logits[0, -1]


def long_text(src: RealSource, seed: int, config: LongDecodeConfig, *, folder: Path | None = None) -> list[int]:
    """The long text of seed ``seed`` (see module doc): ``config.length`` token ids, read from the disk
    cache or generated (under a lock) and stored with its sha256. A cached file that does not hold what
    its name says (length, prompt, hash) is generated again.

    Raises:
        ValueError: ``config.prompt`` longer than the source's window.
    """
    from kvqbench.data.capture.models import _resolve
    from kvqbench.data.corpus import corpus_sha256

    if config.prompt > src.window:
        raise ValueError(f"prompt ({config.prompt}) longer than the source's window ({src.window})")
    prompt = src.window_ids(seed)[:config.prompt]
    import transformers

    key = {"format": 1, "model": _resolve(src.model_name).fingerprint, "prompt_sha256": _ids_sha(prompt),
           "corpus_sha256": corpus_sha256(), "seed": seed, "length": config.length, "temperature": config.temperature,
           "top_k": config.top_k, "device_type": torch.device(src.device).type,
           "transformers": transformers.__version__, "torch": torch.__version__}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", src.model_name)[:48]
    path = (folder or _text_dir()) / f"text-{slug}-T{config.length}-seed{seed}-{digest}.json"

    def cached() -> list[int] | None:
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
            ids = [int(i) for i in obj["ids"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        ok = obj.get("key") == key and len(ids) == config.length and ids[:config.prompt] == prompt
        return ids if ok and obj.get("sha256") == _ids_sha(ids) else None

    with _lock(path):
        ids = cached()
        if ids is None:
            ids = sample_continuation(src.net, prompt, config.length, seed=seed, temperature=config.temperature,
                                      top_k=config.top_k, banned=getattr(src.tokenizer, "all_special_ids", ()))
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "ids": ids, "sha256": _ids_sha(ids)}), encoding="utf-8")
            tmp.replace(path)
    return ids


# --------------------------------------------------------------------------------------------------
# the forward schedule
@torch.no_grad()
def decode(net: Any, rows: Sequence[Sequence[int]], chunks: Sequence[tuple[int, int]], hook: Any, *,
           score: Callable[[int, torch.Tensor], None], free_tokens: int = 0) -> torch.Tensor:
    """Run ``net`` teacher-forced over ``rows`` (token sequences of one length, one batch row each) in
    forward calls of the spans ``chunks`` with a cache whose ``update`` applies ``hook``
    (:class:`~kvqbench.experiments.endtoend.KVCacheHook`, :class:`RowsHook`, ``None`` for the plain cache),
    then continue every row greedily for ``free_tokens`` tokens, one per forward call.

    Args:
        score: called after each teacher-forced call with ``(a, logits)``: the call's first position and
            its logits ``(len(rows), b − a, vocab)`` fp32 (position ``t`` predicts token ``t+1``); the
            logits are not kept.
    Returns:
        The greedy tokens ``(len(rows), free_tokens)`` int64: the argmax after the last teacher-forced
        position, then after each greedy token in turn.
    Raises:
        ValueError: no rows, rows of different lengths, or chunks that do not tile ``[0, len(row))``.
    """
    if not rows or len({len(r) for r in rows}) != 1:
        raise ValueError(f"rows must be one or more token sequences of one length, got lengths "
                         f"{[len(r) for r in rows]}")
    if [a for a, _ in chunks] != [0] + [b for _, b in chunks[:-1]] or chunks[-1][1] != len(rows[0]):
        raise ValueError(f"chunks {list(chunks)} must tile [0, {len(rows[0])})")
    dev = next(net.parameters()).device
    x = torch.tensor([list(r) for r in rows], dtype=torch.long, device=dev)
    n = int(x.shape[0])
    cache, kw = quantized_cache(hook), _cache_kwarg(net.forward)

    def call(tokens: torch.Tensor, a: int) -> torch.Tensor:
        pos = torch.arange(a, a + int(tokens.shape[1]), device=dev)[None].expand(n, -1)
        return net(input_ids=tokens, position_ids=pos, use_cache=True, **{kw: cache}).logits.float()

    last = None
    for a, b in chunks:
        last = call(x[:, a:b], a)
        score(a, last)
    out = torch.empty(n, free_tokens, dtype=torch.long)
    t = int(x.shape[1])
    for g in range(free_tokens):
        nxt = last[:, -1].argmax(-1)
        out[:, g] = nxt.cpu()
        if g + 1 < free_tokens:
            last = call(nxt[:, None], t + g)
    return out


class PerturbedHook(CacheWriter):
    """A hook that multiplies every K and V element entering the cache by ``1 + rel·z`` (``z`` standard
    normal from a generator seeded with ``seed``, drawn once per arriving token and element, in call
    order) and hands the perturbed cache to ``hook``; a ``None`` hook returns the perturbed cache itself.

    Args:
        hook: the :class:`~kvqbench.experiments.endtoend.KVCacheHook` the perturbed K/V go to (``None``: none).
        rel: relative size of the perturbation (1e-7: fp32 rounding level).
        seed: the draw.
    """

    def __init__(self, hook: Any, rel: float, seed: int) -> None:
        self.hook, self.rel = hook, float(rel)
        self.gen = torch.Generator().manual_seed(int(seed))
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def _factors(self, store: dict[int, torch.Tensor], layer: int, new: torch.Tensor) -> torch.Tensor:
        z = torch.randn(tuple(new.shape), generator=self.gen, dtype=torch.float32)
        f = (1.0 + self.rel * z).to(new.device, new.dtype)
        store[layer] = f if layer not in store else torch.cat([store[layer], f], -2)
        return store[layer]

    @torch.no_grad()
    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, k_out: torch.Tensor,
              v_out: torch.Tensor) -> None:
        """:meth:`update` in place (as :meth:`KVCacheHook.write`, so that :class:`RowsHook` takes it): perturb
        ``k_out`` / ``v_out`` and let ``hook`` overwrite their quantized tokens."""
        n = int(k_new.shape[-2])
        k_out.mul_(self._factors(self.k, layer, k_new))
        v_out.mul_(self._factors(self.v, layer, v_new))
        if self.hook is not None:
            self.hook.write(layer, k_out[..., -n:, :].clone(), v_out[..., -n:, :].clone(), k_out, v_out)


# --------------------------------------------------------------------------------------------------
# metrics
def binned(values: Sequence[float], first: int, width: int) -> dict[str, list[float]]:
    """Means of per-position ``values`` (the first at position ``first``) over consecutive bins of ``width``
    positions from ``first`` on, ``[first + j·width, first + (j+1)·width)``; returns ``{"start": [...],
    "stop": [...], "mean": [...]}`` with each bin's positions (the last bin may be partial)."""
    out: dict[str, list[float]] = {"start": [], "stop": [], "mean": []}
    for i in range(0, len(values), width):
        part = values[i:i + width]
        out["start"].append(first + i)
        out["stop"].append(first + i + len(part))
        out["mean"].append(math.fsum(part) / len(part))
    return out


def slope_per_1k(values: Sequence[float], first: int) -> float:
    """Least-squares slope of per-position ``values`` (the first at position ``first``) against the
    position, per 1 000 positions (fp64). Raises ``ValueError`` for fewer than two values."""
    if len(values) < 2:
        raise ValueError("a slope needs at least two values")
    y = torch.tensor(values, dtype=torch.float64)
    t = torch.arange(first, first + len(values), dtype=torch.float64)
    tc = t - t.mean()
    return float((tc * (y - y.mean())).sum() / (tc * tc).sum()) * 1000.0


def _divergence(tokens: torch.Tensor, ref: torch.Tensor) -> tuple[int, float]:
    same = (tokens == ref).tolist()
    first = next((i for i, s in enumerate(same) if not s), len(same))
    return first, (sum(same) / len(same) if same else 1.0)


#: a cell's record of experiment 6: metrics, ``series`` (the KL curve, the passkey table) and ``extra``
LongDecodeResult = SeriesCellResult


# --------------------------------------------------------------------------------------------------
# the reference side, once per text and process
_REFS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
#: the most texts whose unquantized logits a process keeps (each ``(T − P) × vocab`` fp32)
_MAX_REFS = 4


def _reference(src: RealSource, ids: list[int], cfg: LongDecodeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The unquantized model's logits of the scored positions ``(T − P, vocab)`` fp32 under the decode
    schedule, and its greedy continuation ``(G,)`` (cached per process)."""
    key = (src.model_name, src.device, _ids_sha(ids), tuple(cfg.chunks()), cfg.free_tokens)
    if key not in _REFS:
        a0, b0 = cfg.scored()
        parts: list[torch.Tensor] = []

        def keep(a: int, lg: torch.Tensor) -> None:
            lo, hi = max(a, a0), min(a + int(lg.shape[1]), b0)
            if hi > lo:
                parts.append(lg[0, lo - a:hi - a].clone())

        free = decode(src.net, [ids], cfg.chunks(), None, score=keep, free_tokens=cfg.free_tokens)[0]
        while len(_REFS) >= _MAX_REFS:
            _REFS.pop(next(iter(_REFS)))
        _REFS[key] = (torch.cat(parts, 0), free)
    return _REFS[key]


class _Scorer:
    """Per-position next-token KL and top-1 agreement of each row against its reference logits, and the
    Δ loss, accumulated call by call."""

    def __init__(self, refs: Sequence[torch.Tensor], rows: Sequence[list[int]], scored: tuple[int, int],
                 hooks: Sequence[KVCacheHook] = ()) -> None:
        self.refs, self.rows, (self.a0, self.b0), self.hooks = refs, rows, scored, list(hooks)
        self.at_end: list[tuple[float, dict]] = []  # per hook: bits billed and its state at the text's end
        self.kl: list[list[float]] = [[] for _ in rows]
        self.agree: list[list[float]] = [[] for _ in rows]
        self.dloss: list[list[float]] = [[] for _ in rows]

    def __call__(self, a: int, logits: torch.Tensor) -> None:
        if a + int(logits.shape[1]) == len(self.rows[0]):
            self.at_end = [(h.bits_billed(), h.describe()) for h in self.hooks]
        lo, hi = max(a, self.a0), min(a + int(logits.shape[1]), self.b0)
        if hi <= lo:
            return
        for r, (ref, ids) in enumerate(zip(self.refs, self.rows)):
            lg = logits[r, lo - a:hi - a]
            rf = ref[lo - self.a0:hi - self.a0]
            m = next_token_metrics(rf, lg, torch.tensor(ids[lo + 1:hi + 1], dtype=torch.long))
            self.kl[r] += m["kl_per_position"]
            self.agree[r] += (rf.argmax(-1) == lg.argmax(-1)).double().tolist()
            self.dloss[r].append(m["dloss_nats"] * (hi - lo))


def _curve_metrics(kl: list[float], agree: list[float], dloss: list[float], cfg: LongDecodeConfig) -> dict:
    a0, _ = cfg.scored()
    q = len(kl) - len(kl) // 4  # the last quarter of the scored positions
    return {"long_kl_nats": math.fsum(kl) / len(kl),
            "long_kl_last_quarter_nats": math.fsum(kl[q:]) / len(kl[q:]),
            "long_top1_last_quarter": math.fsum(agree[q:]) / len(agree[q:]),
            "long_kl_slope_per_1k": slope_per_1k(kl, a0),
            "long_dloss_nats": math.fsum(dloss) / len(kl)}


@torch.no_grad()
def run_longdecode_rows(methods: Sequence[Quantizer], src: RealSource, seeds: Sequence[int],
                        config: LongDecodeConfig | None = None, *, noise_rows: Sequence[int] = (0,),
                        passkey: bool = True) -> list[LongDecodeResult]:
    """Experiment 6 for several (method, seed) pairs at once, pair ``r`` batch row ``r`` with its own
    per-layer methods and streams (:class:`~kvqbench.experiments.endtoend.RowsHook`): the long text of
    each seed decoded teacher-forced, its free-running continuation, the noise draws of the rows
    ``noise_rows`` and (``passkey``) the passkey prompts of each seed
    (:func:`kvqbench.experiments.passkey.run_passkey_rows`).

    Args:
        methods: one configured quantizer per row (copied per layer; a data-dependent one fitted on
            ``src.calibration``, as in experiment 5).
        src: the model and calibration capture (:func:`kvqbench.experiments.endtoend.load_source`).
        seeds: one seed per row: its long text (:func:`long_text`), its passkey prompts.
        config: default :class:`LongDecodeConfig`.
        noise_rows: the rows that get ``config.noise_draws`` perturbed decodes.
    Returns:
        One :class:`LongDecodeResult` per row: metrics ``long_*``, ``free_*``, ``passkey_*``,
        ``series["kl_curve"]`` (bins of positions with their mean KL) and ``series["passkey"]``, ``extra``
        (text hash and prompt, schedule, fp16 share at T, free-running tokens, noise draws).
    Raises:
        ContextTooShortError: the model's context is shorter than ``config.context``.
        ValueError: no row, or ``methods`` and ``seeds`` of different lengths.
    """
    cfg = config or LongDecodeConfig()
    if not methods or len(methods) != len(seeds):
        raise ValueError(f"one seed per method: got {len(methods)} methods and {len(seeds)} seeds")
    check_context(src.model_name, cfg.context, getattr(src.net.config, "max_position_embeddings", None))
    rows = [long_text(src, s, cfg) for s in seeds]
    per_row = [layer_methods(m, src.calibration) for m in methods]
    pre_rope = any(m.k_pre_rope for ms in per_row for m in ms)
    cos, sin = src.rope(cfg.context) if pre_rope else (None, None)

    def hooks_of(rows_idx: Sequence[int]) -> list[KVCacheHook]:
        return [KVCacheHook(per_row[r], streaming=True, cos=cos, sin=sin) for r in rows_idx]

    refs = [_reference(src, ids, cfg) for ids in rows]
    hooks = hooks_of(range(len(rows)))
    scorer = _Scorer([r[0] for r in refs], rows, cfg.scored(), hooks)
    free = decode(src.net, rows, cfg.chunks(), hooks[0] if len(hooks) == 1 else RowsHook(hooks), score=scorer,
                  free_tokens=cfg.free_tokens)
    results = []
    a0, b0 = cfg.scored()
    for r, (method, seed, ids, hook) in enumerate(zip(methods, seeds, rows, hooks)):
        res = LongDecodeResult()
        res.metrics.update(_curve_metrics(scorer.kl[r], scorer.agree[r], scorer.dloss[r], cfg))
        res.metrics["long_bits_billed"], desc = scorer.at_end[r]
        res.series["kl_curve"] = {"bin": cfg.bin, **binned(scorer.kl[r], a0, cfg.bin)}
        res.series["top1_curve"] = {"bin": cfg.bin, **binned(scorer.agree[r], a0, cfg.bin)}
        res.extra.update({"text_tokens": cfg.length, "text_seed": seed, "text_sha256": _ids_sha(ids),
                          "prompt_tokens": cfg.prompt, "prompt_window": seed, "prefill_tokens": cfg.prefill,
                          "block": cfg.block, "scored_positions": [a0, b0], "forward_calls": len(cfg.chunks()),
                          "sampling": {"temperature": cfg.temperature, "top_k": cfg.top_k, "special_tokens": "excluded"},
                          "fp16_share_at_T": {kind: desc["fp16_tokens"][kind] / cfg.length for kind in ("k", "v")},
                          "k_pre_rope": bool(method.k_pre_rope), **desc})
        for sk, sv in zip(hook.k, hook.v):
            tally_nonfinite(res.extra, k=sk.result(0).x_hat, v=sv.result(0).x_hat)
        if cfg.free_tokens:
            first, share = _divergence(free[r], refs[r][1])
            res.metrics["free_first_divergence_tokens"] = float(first)
            res.metrics["free_match_share"] = share
            res.extra["free_running"] = {"tokens": cfg.free_tokens, "method": free[r].tolist(),
                                         "reference": refs[r][1].tolist()}
        results.append(res)
    if cfg.noise_draws:
        _noise_floor(src, cfg, rows, seeds, refs, [r for r in noise_rows if r < len(rows)], hooks_of, results)
    if passkey:
        from kvqbench.experiments.passkey import run_passkey_rows

        for res, pk in zip(results, run_passkey_rows(per_row, src, seeds, cfg, cos=cos, sin=sin)):
            res.metrics.update(pk.metrics)
            res.series.update(pk.series)
            res.extra.update(pk.extra)
    return results


def _noise_floor(src: RealSource, cfg: LongDecodeConfig, rows: list[list[int]], seeds: Sequence[int], refs: list,
                 noise_rows: list[int],
                 hooks_of: Callable[[Sequence[int]], list[KVCacheHook]], results: list[LongDecodeResult]) -> None:
    """The noise draws of ``noise_rows`` (see module doc), batched as rows; results in ``extra["noise"]`` and
    the metrics ``long_kl_noise_sd_nats`` / ``long_kl_last_quarter_noise_sd_nats`` (sample standard deviation
    over the unperturbed run and the draws)."""
    if not noise_rows:
        return
    draws: dict[int, list[dict]] = {r: [] for r in noise_rows}
    for d in range(cfg.noise_draws):
        hooks = hooks_of(noise_rows)
        pert = [PerturbedHook(h, cfg.noise_rel, seed=1_000_003 * (d + 1) + seeds[r]) for h, r in zip(hooks, noise_rows)]
        sub = [rows[r] for r in noise_rows]
        scorer = _Scorer([refs[r][0] for r in noise_rows], sub, cfg.scored())
        decode(src.net, sub, cfg.chunks(), pert[0] if len(pert) == 1 else RowsHook(pert), score=scorer)
        for i, r in enumerate(noise_rows):
            draws[r].append(_curve_metrics(scorer.kl[i], scorer.agree[i], scorer.dloss[i], cfg))
    for r in noise_rows:
        res = results[r]
        for name in ("long_kl_nats", "long_kl_last_quarter_nats"):
            vals = [res.metrics[name]] + [d[name] for d in draws[r]]
            mean = math.fsum(vals) / len(vals)
            sd = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
            res.metrics[name.removesuffix("_nats") + "_noise_sd_nats"] = sd
        res.extra["noise"] = {"rel": cfg.noise_rel, "draws": cfg.noise_draws,
                              "per_draw": {name: [d[name] for d in draws[r]]
                                           for name in ("long_kl_nats", "long_kl_last_quarter_nats",
                                                        "long_top1_last_quarter", "long_kl_slope_per_1k")}}
