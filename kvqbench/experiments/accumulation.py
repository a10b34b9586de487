"""Experiment 2 — accumulation of the attention error with context length (docs/DESIGN.md §4).

Attention output ``O = softmax(q·Kᵀ/√D)·V`` is compared with ``Ô`` computed from a method's K̂, V̂ at every
context length ``L`` of a grid up to the full length, in two regimes:

* **static** — the whole prefix ``[0, L)`` is quantized at once (``roundtrip_kv`` on the truncated data);
* **pseudo-decode** — tokens arrive in blocks of ``block`` tokens and are quantized as a cache would,
  with the method's :meth:`~kvqbench.quantizers.base.Quantizer.stream_policy` (fp16 sink / residual
  windows / partly filled tiles, see :mod:`kvqbench.experiments.streaming`); the billed effective bits
  include the fp16 tokens at 16 bits.

Queries: the attention of a prefix of length ``L`` is read by the queries of its **last**
``n_queries`` positions (``q[..., L − n_queries : L, :]``; real data: the captured post-RoPE queries;
synthetic: the generator's queries), each reading the **whole** prefix ``[0, L)`` — no causal mask. The
last positions are the ones a decoder at length ``L`` actually issues, and letting a handful of them also
see the few keys after their own position changes nothing about the quantization error being measured
while keeping the computation one dense matmul. GQA: query head ``h`` reads KV head ``h // (H_q/H_kv)``.

Data-dependent methods are fitted once on the full-length data (calibration) and that state serves both
regimes and every length. Pre-RoPE methods (KVQuant) stream their pre-RoPE keys; their output is rotated
with the captured RoPE, and fp16 tokens are the exact cached keys.

Per length (mean over layers = index of dim 0): MAE, MSE, relative MSE, cosine drift ``1 − cos(O, Ô)``,
the signed output-norm gap ``(‖Ô‖ − ‖O‖)/‖O‖`` (the *signed gap series*), forward/reverse attention KL (nats),
bias² / variance / mean square of the inner-product error ``e = q·k̂ − q·k``, and the attention-weighted K
error ``Σ_t a_t ‖k̂_t − k_t‖²``. Ranked summaries: every metric at the full length plus the accumulation
slopes (least squares against the context length, per 1k tokens) of the relative output MSE and of the
forward KL. Per-length values go to ``series``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kvqbench.data.memory import release_after
from kvqbench.data.types import KVData
from kvqbench.experiments.common import check_positive_ints, fit_method, roundtrip_kv, tally_nonfinite
from kvqbench.experiments.reconstruction import CellResult
from kvqbench.experiments.streaming import StreamResult, simulate_stream
from kvqbench.numerics.attention import (
    AttentionReference,
    attention_error_by_batch,
    attention_reference,
    least_squares_slope,
)
from kvqbench.quantizers.base import Quantizer

__all__ = ["AccumulationConfig", "CONFIG_BY_SIZE", "SeriesCellResult", "context_grid", "run_accumulation", "REGIMES",
           "PER_LENGTH_METRICS"]

EXPERIMENT = "exp2"
REGIMES: tuple[str, str] = ("static", "decode")

#: AttentionError field → metric suffix (the metric name is ``{regime}_{suffix}``)
PER_LENGTH_METRICS: dict[str, str] = {
    "out_mae": "out_mae",
    "out_mse": "out_mse",
    "out_rel_mse": "out_rel_mse",
    "cos_drift": "cos_drift",
    "out_norm_gap": "out_norm_gap",
    "kl_fwd": "attn_kl_fwd_nats",
    "kl_rev": "attn_kl_rev_nats",
    "logit_bias2": "logit_bias2",
    "logit_var": "logit_var",
    "logit_mse": "logit_mse",
    "attn_k_err": "attn_k_err",
    "attn_k_rel_err": "attn_k_rel_err",
}
#: accumulation slopes: metric suffix → the per-length field it is fitted on
SLOPES: dict[str, str] = {"err_slope_per_1k": "out_rel_mse", "kl_slope_per_1k": "kl_fwd"}


@dataclass
class SeriesCellResult(CellResult):
    """A cell's record with per-length (or histogram) ``series`` beside metrics/per_layer/extra."""

    series: dict = field(default_factory=dict)


@dataclass(frozen=True)
class AccumulationConfig:
    """Knobs of experiment 2.

    Attributes:
        n_lengths: points of the context grid (the last is the full length).
        n_queries: queries per prefix (the last ``n_queries`` positions).
        block: tokens per arrival in the pseudo-decode regime; grid lengths are multiples of it.
        regimes: which regimes to run.
    """

    n_lengths: int = 6
    n_queries: int = 32
    block: int = 64
    regimes: tuple[str, ...] = REGIMES

    def __post_init__(self) -> None:
        check_positive_ints(self, "n_lengths", "n_queries", "block")
        bad = [r for r in self.regimes if r not in REGIMES]
        if bad or not self.regimes:
            raise ValueError(f"regimes must be a non-empty subset of {REGIMES}, got {self.regimes!r}")


#: the configuration of the benchmark cells per cell size (see :data:`kvqbench.cells.SIZES`)
CONFIG_BY_SIZE: dict[str, AccumulationConfig] = {
    "smoke": AccumulationConfig(n_lengths=4, n_queries=16, block=32),
    "full": AccumulationConfig(n_lengths=6, n_queries=32, block=64),
}


def context_grid(seq_len: int, n_lengths: int, block: int) -> list[int]:
    """``n_lengths`` context lengths, evenly spaced up to ``seq_len``, each rounded to a multiple of
    ``block`` (at least one block), deduplicated; the last is always ``seq_len``.

    Example: ``context_grid(2048, 6, 64) == [320, 704, 1024, 1344, 1728, 2048]``.
    """
    if seq_len < 1 or n_lengths < 1 or block < 1:
        raise ValueError("seq_len, n_lengths and block must be positive")
    pts = set()
    for i in range(1, n_lengths):
        raw = seq_len * i / n_lengths
        pts.add(min(seq_len, max(block, block * int(raw / block + 0.5))))
    pts.add(seq_len)
    return sorted(pts)


def _queries(q: torch.Tensor, length: int, n_queries: int) -> torch.Tensor:
    nq = min(n_queries, length)
    return q[..., length - nq : length, :]


def _layer_errors(ref: AttentionReference, k_hat: torch.Tensor, v_hat: torch.Tensor) -> list[dict[str, float]]:
    """Per layer (index of dim 0) attention errors of one reconstruction of a prefix."""
    return [e.as_dict() for e in attention_error_by_batch(ref, k_hat, v_hat)]


def _stream_states(method: Quantizer, data: KVData, block: int) -> tuple[StreamResult, StreamResult]:
    pre = method.k_pre_rope and data.k_pre is not None
    sk = simulate_stream(method, data.k_for(method.k_pre_rope), "k", block=block)
    if pre:
        sk = dataclasses.replace(sk, x_hat=data.to_cached_k(sk.x_hat, True))
    sv = simulate_stream(method, data.v, "v", block=block)
    return sk, sv


@release_after  # the cell's temporaries: kvqbench.data.memory
@torch.no_grad()
def run_accumulation(method: Quantizer, data: KVData, config: AccumulationConfig | None = None) -> SeriesCellResult:
    """Run experiment 2 for one method on one data source.

    Args:
        method: a configured quantizer (fitted here on ``data`` if it is data-dependent).
        data: K/V ``(batch|layers, kv_heads, seq_len, head_dim)`` and queries
            ``(batch|layers, q_heads, seq_len, head_dim)``.
        config: grid, queries, block size and regimes (default :class:`AccumulationConfig`).
    Returns:
        :class:`SeriesCellResult`: metrics ``{regime}_{name}`` at the full length and the slopes (ranked,
        see :mod:`kvqbench.metrics`, experiment ``exp2``), per-layer values, ``series`` with one list per
        metric and regime over ``series["context_lengths"]``, and ``extra`` (grid, block, queries,
        stream policies, fp16 tokens held).
    Raises:
        ValueError: bad config, or queries whose batch/head_dim disagree with K.
    """
    cfg = config or AccumulationConfig()
    t = int(data.k.shape[-2])
    block = min(cfg.block, t)
    grid = context_grid(t, cfg.n_lengths, block)
    fit_method(method, data)
    res = SeriesCellResult()
    res.series["context_lengths"] = list(grid)

    # one prefix at a time: its exact side (shared by both regimes, then dropped: the exact sides of every
    # prefix at once would take about as much memory as the data) and the errors of each regime's state
    data.keep_scope("exp2")
    streams = {"decode": _stream_states(method, data, block)} if "decode" in cfg.regimes else {}
    errors: dict[str, list[list[dict[str, float]]]] = {regime: [] for regime in cfg.regimes}  # [length][layer]
    bits: list[float] = []
    fp16_share: list[float] = []
    # the longest prefix first: each shorter prefix's temporaries then fit in the memory the longer one freed
    # (every prefix is computed on its own; the lists are put back in the grid's order below)
    for length in reversed(grid):
        ref = attention_reference(_queries(data.q, length, cfg.n_queries), data.k[..., :length, :],
                                  data.v[..., :length, :])
        # the static reconstruction and its errors: a decode state equal to it (e.g. a method that
        # quantizes every token on its own, or fp16) has the same errors, computed once
        static: tuple[torch.Tensor, torch.Tensor, list[dict[str, float]]] | None = None
        for regime in cfg.regimes:
            if regime == "static":
                rt = roundtrip_kv(method, data.truncate(length), fit=False)
                rt.tally(res.extra)
                errors[regime].append(_layer_errors(ref, rt.k_hat, rt.v_hat))
                static = (rt.k_hat, rt.v_hat, errors[regime][-1])
            else:
                sk, sv = streams[regime]
                k_state, v_state = sk.state(data.k, length), sv.state(data.v, length)
                tally_nonfinite(res.extra, k=k_state, v=v_state)
                if static is not None and torch.equal(k_state, static[0]) and torch.equal(v_state, static[1]):
                    errors[regime].append([dict(ly) for ly in static[2]])
                else:
                    errors[regime].append(_layer_errors(ref, k_state, v_state))
                bits.append(0.5 * (sk.effective_bits(length) + sv.effective_bits(length)))
                fp16_share.append(0.5 * (sk.fp16_tokens(length) + sv.fp16_tokens(length)) / length)
        del ref, static
    for per_len in (*errors.values(), bits, fp16_share):
        per_len.reverse()
    for regime in cfg.regimes:
        per_len = errors[regime]
        if regime == "decode":
            sk, sv = streams[regime]
            res.metrics["decode_k_bits_effective"] = sk.effective_bits(t)
            res.metrics["decode_v_bits_effective"] = sv.effective_bits(t)
            res.metrics["decode_bits_effective"] = 0.5 * (sk.effective_bits(t) + sv.effective_bits(t))
            res.extra["decode"] = {
                "block": block,
                "policy": {"k": dataclasses.asdict(sk.policy), "v": dataclasses.asdict(sv.policy)},
                "fp16_tokens_at_full_length": {"k": sk.fp16_tokens(t), "v": sv.fp16_tokens(t)},
                "segments": {"k": len(sk.segments), "v": len(sv.segments)},
            }
        n_layers = len(per_len[0])
        reg_series: dict[str, list[float]] = {}
        for field_name, suffix in PER_LENGTH_METRICS.items():
            reg_series[suffix] = [sum(ly[field_name] for ly in row) / n_layers for row in per_len]
            res.add(f"{regime}_{suffix}", [ly[field_name] for ly in per_len[-1]])
        if regime == "decode":
            reg_series["bits_effective"] = bits
            reg_series["fp16_token_share"] = fp16_share
        lengths_k = [length / 1000.0 for length in grid]
        for suffix, field_name in SLOPES.items():
            slopes = [least_squares_slope(lengths_k, [row[i][field_name] for row in per_len]) for i in range(n_layers)]
            res.add(f"{regime}_{suffix}", slopes)
        res.series[regime] = reg_series

    res.extra.update({"context_lengths": list(grid), "n_queries": cfg.n_queries,
                      "query_positions": "last n_queries of each prefix, no causal mask",
                      "regimes": list(cfg.regimes)})
    return res
