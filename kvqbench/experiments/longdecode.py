"""Experiment 6 — long decode on the real model (docs/DESIGN.md §4): damage that builds up over
thousands of decoded tokens, and retrieval from far back (:mod:`kvqbench.experiments.passkey`).

The model, its cache hook and the stream policies are experiment 5's
(:mod:`kvqbench.experiments.endtoend`: :class:`~kvqbench.experiments.endtoend.KVCacheHook`, one
:class:`~kvqbench.experiments.streaming.Stream` per layer and kind, K/V ``(batch, kv_heads, seq_len,
head_dim)`` exactly as the model caches them); what changes is the length of the text and what is scored.

**The text** (:func:`kvqbench.experiments.longtext.long_text`): the unquantized model's seeded continuation
of a corpus prompt, ``length`` = T tokens in all, the same on every run and worker of a machine.

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

import math
from typing import Any, Callable, Sequence

import torch

from kvqbench.data.memory import release_after, release_if_grown
from kvqbench.experiments.accumulation import SeriesCellResult
from kvqbench.experiments.common import tally_nonfinite
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
from kvqbench.experiments.longtext import LongDecodeConfig, check_context, ids_sha, long_text
from kvqbench.quantizers.base import Quantizer

__all__ = ["decode", "PerturbedHook", "binned", "slope_per_1k", "LongDecodeResult", "run_longdecode_rows"]

EXPERIMENT = "exp6"


# --------------------------------------------------------------------------------------------------
# the forward schedule
@torch.no_grad()
def decode(net: Any, rows: Sequence[Sequence[int]], chunks: Sequence[tuple[int, int]], hook: Any, *,
           score: Callable[[int, torch.Tensor], None], free_tokens: int = 0,
           hidden: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Run ``net`` teacher-forced over ``rows`` (token sequences of one length, one batch row each) in
    forward calls of the spans ``chunks`` with a cache whose ``update`` applies ``hook``
    (:class:`~kvqbench.experiments.endtoend.KVCacheHook`, :class:`RowsHook`, ``None`` for the plain cache),
    then continue every row greedily for ``free_tokens`` tokens, one per forward call.

    Args:
        score: called after each teacher-forced call with ``(a, logits)``: the call's first position and
            its logits ``(len(rows), b − a, vocab)`` fp32 (position ``t`` predicts token ``t+1``); the
            logits are not kept.
        hidden: called before ``score`` with ``(a, h)``: the call's final hidden states ``(len(rows), b − a,
            hidden_size)`` in the model's dtype; ``lm_logits(net, h)`` (:func:`kvqbench.data.capture.lm_logits`)
            gives the call's logits again, bitwise (the same product of the same shape).
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
    from kvqbench.data.capture import _decoder, lm_logits

    dev = next(net.parameters()).device
    x = torch.tensor([list(r) for r in rows], dtype=torch.long, device=dev)
    n = int(x.shape[0])
    decoder = _decoder(net)
    cache, kw = quantized_cache(hook), _cache_kwarg(decoder.forward)

    def call(tokens: torch.Tensor, a: int) -> torch.Tensor:  # the model's forward: decoder, then LM head
        pos = torch.arange(a, a + int(tokens.shape[1]), device=dev)[None].expand(n, -1)
        h = decoder(input_ids=tokens, position_ids=pos, use_cache=True, **{kw: cache}).last_hidden_state
        if hidden is not None:
            hidden(a, h)
        return lm_logits(net, h).float()

    last = torch.empty(0)
    for a, b in chunks:
        last = call(x[:, a:b], a)
        score(a, last)
        last = last[:, -1:].clone()  # all the greedy continuation needs; the call's logits are freed
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
class _Reference:
    """The unquantized model's side of one text under the decode schedule: per teacher-forced call that holds
    scored positions the smaller of its scored logits and its final hidden states (a call of 64 positions:
    64 × hidden_size values instead of 64 × vocab; :meth:`logits` runs the LM head on them again, the same
    product of the same shape, so bitwise the logits the call gave), and the greedy continuation ``free``
    ``(G,)`` int64."""

    def __init__(self, net: Any, scored: tuple[int, int]) -> None:
        self.net, (self.a0, self.b0) = net, scored
        self.parts: dict[int, tuple[str, torch.Tensor]] = {}  # call start → ("logits" | "hidden", values)
        self.free = torch.empty(0, dtype=torch.long)
        self._h: torch.Tensor | None = None

    def keep_hidden(self, a: int, h: torch.Tensor) -> None:
        self._h = h

    def keep(self, a: int, lg: torch.Tensor) -> None:
        lo, hi = max(a, self.a0), min(a + int(lg.shape[1]), self.b0)
        if hi > lo:
            assert self._h is not None
            h = self._h[0:1]
            self.parts[a] = (("logits", lg[0, lo - a:hi - a].clone()) if (hi - lo) * lg.shape[-1] <= h.numel()
                             else ("hidden", h.clone()))
        self._h = None

    def logits(self, a: int, lo: int, hi: int) -> torch.Tensor:
        """The logits ``(hi − lo, vocab)`` fp32 of the scored positions ``[lo, hi)`` of the call at ``a``."""
        from kvqbench.data.capture import lm_logits

        what, val = self.parts[a]
        if what == "logits":
            return val
        return lm_logits(self.net, val).float()[0, lo - a:hi - a]


_REFS: dict[tuple, _Reference] = {}
#: the most texts whose reference a process keeps (each ≈ 5 MB for SmolLM2 at T = 2048)
_MAX_REFS = 8


def _reference(src: RealSource, ids: list[int], cfg: LongDecodeConfig) -> _Reference:
    """The unquantized model's :class:`_Reference` of ``ids`` under the decode schedule (cached per
    process)."""
    key = (src.model_name, src.device, ids_sha(ids), tuple(cfg.chunks()), cfg.free_tokens)
    if key not in _REFS:
        ref = _Reference(src.net, cfg.scored())
        ref.free = decode(src.net, [ids], cfg.chunks(), None, score=ref.keep, free_tokens=cfg.free_tokens,
                          hidden=ref.keep_hidden)[0]
        while len(_REFS) >= _MAX_REFS:
            _REFS.pop(next(iter(_REFS)))
        _REFS[key] = ref
        release_if_grown()  # the decode's temporaries (kvqbench.data.memory)
    return _REFS[key]


class _Scorer:
    """Per-position next-token KL and top-1 agreement of each row against its reference logits, and the
    Δ loss, accumulated call by call."""

    def __init__(self, refs: Sequence[_Reference], rows: Sequence[list[int]], scored: tuple[int, int],
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
            rf = ref.logits(a, lo, hi)
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


@release_after  # the group's temporaries: kvqbench.data.memory
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
    release_if_grown()  # a data-dependent fit's temporaries
    pre_rope = any(m.k_pre_rope for ms in per_row for m in ms)
    cos, sin = src.rope(cfg.context) if pre_rope else (None, None)

    def hooks_of(rows_idx: Sequence[int]) -> list[KVCacheHook]:
        return [KVCacheHook(per_row[r], streaming=True, cos=cos, sin=sin, capacity=cfg.length + cfg.free_tokens)
                for r in rows_idx]

    refs = [_reference(src, ids, cfg) for ids in rows]
    hooks = hooks_of(range(len(rows)))
    scorer = _Scorer(refs, rows, cfg.scored(), hooks)
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
        res.extra.update({"text_tokens": cfg.length, "text_seed": seed, "text_sha256": ids_sha(ids),
                          "prompt_tokens": cfg.prompt, "prompt_window": seed, "prefill_tokens": cfg.prefill,
                          "block": cfg.block, "scored_positions": [a0, b0], "forward_calls": len(cfg.chunks()),
                          "sampling": {"temperature": cfg.temperature, "top_k": cfg.top_k, "special_tokens": "excluded"},
                          "fp16_share_at_T": {kind: desc["fp16_tokens"][kind] / cfg.length for kind in ("k", "v")},
                          "k_pre_rope": bool(method.k_pre_rope), **desc})
        for sk, sv in zip(hook.k, hook.v):
            tally_nonfinite(res.extra, k=sk.result(0).x_hat, v=sv.result(0).x_hat)
        if cfg.free_tokens:
            first, share = _divergence(free[r], refs[r].free)
            res.metrics["free_first_divergence_tokens"] = float(first)
            res.metrics["free_match_share"] = share
            res.extra["free_running"] = {"tokens": cfg.free_tokens, "method": free[r].tolist(),
                                         "reference": refs[r].free.tolist()}
        results.append(res)
    del hooks, hook, scorer  # the caches of the rows (the noise draws and the passkey prompts build their own)
    release_if_grown()
    if cfg.noise_draws:
        _noise_floor(src, cfg, rows, seeds, refs, [r for r in noise_rows if r < len(rows)], hooks_of, results)
        release_if_grown()
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
        scorer = _Scorer([refs[r] for r in noise_rows], sub, cfg.scored())
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
