"""The metric catalog: every metric is one record (name, unit, better-direction, description).

Torch-free, so reports can be rendered without torch. Experiments import the records they emit; the
renderer never hard-codes which way is better — it reads ``better`` from here (or from the catalog
copy saved in every results file).

``better``:
  * ``"lower"`` / ``"higher"`` — ranked ascending / descending;
  * ``"zero"`` — a signed quantity ranked by its distance from 0 (e.g. a bias).

``ratio_scale`` — whether a metric is ratio-scale (strictly positive, where "× the best's" makes sense:
KL, MSE, error norms, bits, latencies): paired comparisons then use per-unit log differences; a signed,
count or share-of-trials metric (Δ loss, slopes, top-1 agreement, exact match) uses the raw paired
difference (docs/METRICS.md, "Paired comparisons"). ``better="zero"`` metrics are never ratio-scale.

``varies`` — how a metric's value moves between two runs of the same seeds:
  * ``"deterministic"`` — a function of its seeds' data: it does not move;
  * ``"float_noise"`` — computed through a model's forward passes, whose float reductions move it
    (experiments 5 and 6);
  * ``"timing"`` — wall-clock timing: it moves from run to run;
  * ``"memory"`` — peak memory: fixed on a CPU, moves with the allocator on CUDA.

Every other module reads these facts from here: the experiment a metric belongs to
(:func:`experiment_of`), how it varies (:func:`varies`) and its scale (:func:`is_ratio_scale`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Literal

__all__ = ["Metric", "CATALOG", "register_metric", "get_metric", "rank_key", "catalog_dict", "did_you_mean", "experiment_of",
           "varies", "is_ratio_scale", "is_timing", "NONDETERMINISTIC_METRICS", "markdown_table"]

Better = Literal["lower", "higher", "zero"]
Varies = Literal["deterministic", "float_noise", "timing", "memory"]
_VARIES = ("deterministic", "float_noise", "timing", "memory")


@dataclass(frozen=True)
class Metric:
    """One metric's record.

    Attributes:
        name: unique id used in results (units in the name where ambiguous).
        unit: unit string (``"1"`` for dimensionless ratios).
        better: ranking direction (see module doc).
        description: one line a reader of the leaderboard understands.
        experiment: the experiment that emits it (``exp1`` … ``exp6``).
        scale_free: comparable across layers/models (ranked on the mean over layers for real data).
        headline: shown in the summary tables.
        varies: how the value moves between runs of the same seeds (see module doc).
        ratio_scale: compared on the log scale (see module doc); default: ``better != "zero"``.
    """

    name: str
    unit: str
    better: Better
    description: str
    experiment: str
    scale_free: bool = True
    headline: bool = False
    varies: Varies = "deterministic"
    ratio_scale: bool | None = None

    def __post_init__(self) -> None:
        if self.better not in ("lower", "higher", "zero"):
            raise ValueError(f"metric {self.name}: better must be lower/higher/zero, got {self.better!r}")
        if self.varies not in _VARIES:
            raise ValueError(f"metric {self.name}: varies must be one of {', '.join(_VARIES)}, got {self.varies!r}")
        if self.ratio_scale is None:
            object.__setattr__(self, "ratio_scale", self.better != "zero")
        elif self.better == "zero" and self.ratio_scale:
            raise ValueError(f"metric {self.name}: a signed metric (better='zero') is not ratio-scale")


CATALOG: dict[str, Metric] = {}


def register_metric(m: Metric) -> Metric:
    """Add a metric to the catalog (error on a conflicting duplicate)."""
    prev = CATALOG.get(m.name)
    if prev is not None and prev != m:
        raise ValueError(f"metric {m.name!r} already registered with a different record")
    CATALOG[m.name] = m
    return m


def get_metric(name: str) -> Metric:
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}; known: {', '.join(sorted(CATALOG))}") from None


def rank_key(better: str, value: float) -> float:
    """Sort key so that ascending order = best first."""
    if better == "higher":
        return -value
    if better == "zero":
        return abs(value)
    return value


def experiment_of(name: str) -> str:
    """The experiment that emits metric ``name`` (``"exp5"`` for ``"e2e_prefill_kl_nats"``).

    Raises:
        KeyError: ``name`` is not in the catalog.
    """
    return get_metric(name).experiment


def varies(name: str, spec: dict | None = None) -> str:
    """How metric ``name`` moves between runs of the same seeds (module doc): as ``spec`` (its record in
    a saved catalog, :func:`catalog_dict`) says, else as this catalog says; ``"deterministic"`` for a
    name neither holds."""
    if spec and spec.get("varies") in _VARIES:
        return spec["varies"]
    m = CATALOG.get(name)
    return m.varies if m is not None else "deterministic"


def is_ratio_scale(name: str, spec: dict | None = None) -> bool:
    """Whether metric ``name`` is ratio-scale (module doc): as ``spec`` (its record in a saved catalog)
    says, else as this catalog says; ``False`` for a name neither holds."""
    if spec and isinstance(spec.get("ratio_scale"), bool):
        return spec["ratio_scale"]
    m = CATALOG.get(name)
    return bool(m.ratio_scale) if m is not None else False


def is_timing(name: str, spec: dict | None = None) -> bool:
    """Whether ``name`` is a timing or memory metric (:func:`varies`): its value depends on the
    machine's load."""
    return varies(name, spec) in ("timing", "memory")


def did_you_mean(name: str, known: Iterable[str], n: int = 3) -> str:
    """``"; did you mean 'a', 'b' or 'c'?"`` naming up to ``n`` of ``known`` that ``name`` (a metric or
    method id) was likely meant as: the names holding every ``_``-separated word of ``name``, shortest
    first, else the one :func:`difflib.get_close_matches` finds closest (a typo; ratio ≥ 0.6); ``""`` when
    none is close."""
    import difflib

    words = set(name.lower().split("_")) - {""}
    names = sorted(set(known))
    close = sorted((k for k in names if words <= set(k.lower().split("_"))), key=lambda k: (len(k), k))[:n] \
        or difflib.get_close_matches(name, names, n=1)
    if not close:
        return ""
    quoted = [f"'{c}'" for c in close]
    return "; did you mean " + (", ".join(quoted[:-1]) + " or " if len(quoted) > 1 else "") + quoted[-1] + "?"


def catalog_dict() -> dict[str, dict]:
    """The catalog as JSON-able dicts (saved into every results file)."""
    return {k: asdict(v) for k, v in sorted(CATALOG.items())}


# ------------------------------------------------------------------------------------------------
# Experiment 1 — reconstruction (docs/DESIGN.md §4); emitted for K and V separately.
for _kv, _KV in (("k", "K"), ("v", "V")):
    register_metric(Metric(f"{_kv}_mse", "1 (squared units of the input)", "lower",
                           f"{_KV} mean squared error E[(x̂−x)²]", "exp1", scale_free=False))
    register_metric(Metric(f"{_kv}_rel_mse", "1", "lower",
                           f"{_KV} relative MSE: MSE / mean(x²)", "exp1", headline=True))
    for _q in ("p50", "p90", "p99"):
        register_metric(Metric(
            f"{_kv}_em_share_{_q}", "1", "lower",
            f"{_KV}: magnitude share E_M/E_T of the per-token error, at the {_q} of E_T "
            "(lower = the error is mostly direction, not norm)", "exp1"))
    register_metric(Metric(f"{_kv}_norm_bias", "1", "zero",
                           f"{_KV} signed relative norm shift mean((‖x̂‖−‖x‖)/‖x‖) (0 = unbiased)", "exp1"))
    register_metric(Metric(f"{_kv}_bits_nominal", "bits/element", "lower",
                           f"{_KV} nominal bits per element (FP8 scales, FP16 zero-points)", "exp1"))
    register_metric(Metric(f"{_kv}_bits_effective", "bits/element", "lower",
                           f"{_KV} effective bits per element as stored", "exp1"))
register_metric(Metric("rel_mse", "1", "lower", "mean of K and V relative MSE (headline quality)",
                       "exp1", headline=True))
register_metric(Metric("bits_effective", "bits/element", "lower",
                       "mean of K and V effective bits per element", "exp1", headline=True))
register_metric(Metric("bits_nominal", "bits/element", "lower",
                       "mean of K and V nominal bits per element", "exp1", headline=True))


# ------------------------------------------------------------------------------------------------
# Experiment 1 additions — codebook generalization and group-size sensitivity (docs/DESIGN.md §4);
# kvqbench/experiments/generalization.py. Separate cells from the reconstruction sweep.
for _kv, _KV in (("k", "K"), ("v", "V")):
    register_metric(Metric(
        f"{_kv}_codebook_gap", "1 (relative MSE)", "lower",
        f"{_KV} codebook-generalization gap: relative MSE on an independent shifted batch with state fitted "
        "on another batch minus fitted on itself (exactly 0 for local per-group statistics)", "exp1", ratio_scale=False))
    register_metric(Metric(f"gs_{_kv}_mse", "1 (squared units of the input)", "lower",
                           f"{_KV} MSE at this group size (group-size sensitivity sweep 32/64/128)", "exp1",
                           scale_free=False))
    register_metric(Metric(f"gs_{_kv}_rel_mse", "1", "lower",
                           f"{_KV} relative MSE at this group size (group-size sensitivity sweep 32/64/128)",
                           "exp1"))
register_metric(Metric("codebook_gap", "1 (relative MSE)", "lower",
                       "mean of the K and V codebook-generalization gaps", "exp1",
                       ratio_scale=False))
register_metric(Metric("gs_rel_mse", "1", "lower",
                       "mean of K and V relative MSE at this group size (group-size sensitivity)", "exp1"))
register_metric(Metric("gs_bits_effective", "bits/element", "lower",
                       "mean of K and V effective bits per element at this group size", "exp1"))


# ------------------------------------------------------------------------------------------------
# Experiment 2 — accumulation of the attention error with context length (docs/DESIGN.md §4);
# kvqbench/experiments/accumulation.py. Every metric exists for both regimes: ``static_*`` (the whole
# prefix quantized at once) and ``decode_*`` (pseudo-decode: blocks quantized as they arrive under the
# method's streaming rules). Values are at the full context length unless named a slope.
for _r, _R in (("static", "static"), ("decode", "pseudo-decode")):
    register_metric(Metric(f"{_r}_out_mae", "1 (units of V)", "lower",
                           f"{_R}: mean |Ô − O| of the attention output", "exp2", scale_free=False))
    register_metric(Metric(f"{_r}_out_mse", "1 (squared units of V)", "lower",
                           f"{_R}: mean (Ô − O)² of the attention output", "exp2", scale_free=False))
    register_metric(Metric(f"{_r}_out_rel_mse", "1", "lower",
                           f"{_R}: relative MSE of the attention output Σ(Ô−O)²/ΣO²", "exp2"))
    register_metric(Metric(f"{_r}_cos_drift", "1", "lower",
                           f"{_R}: cosine drift 1 − cos(O, Ô) per query, averaged", "exp2",
                           headline=_r == "decode"))
    register_metric(Metric(f"{_r}_out_norm_gap", "1", "zero",
                           f"{_R}: signed output-norm gap (‖Ô‖ − ‖O‖)/‖O‖ per query, averaged (0 = no shrink/grow)",
                           "exp2"))
    register_metric(Metric(f"{_r}_attn_kl_fwd_nats", "nats", "lower",
                           f"{_R}: forward attention KL(p‖p̂), p = softmax(q·Kᵀ/√D), per query averaged", "exp2",
                           headline=_r == "decode"))
    register_metric(Metric(f"{_r}_attn_kl_rev_nats", "nats", "lower",
                           f"{_R}: reverse attention KL(p̂‖p), per query averaged", "exp2"))
    register_metric(Metric(f"{_r}_logit_bias2", "(q·k units)²", "lower",
                           f"{_R}: squared mean of the inner-product error e = q·k̂ − q·k over a query's tokens "
                           "(softmax-invariant part), averaged over queries", "exp2", scale_free=False))
    register_metric(Metric(f"{_r}_logit_var", "(q·k units)²", "lower",
                           f"{_R}: variance of the inner-product error e = q·k̂ − q·k over a query's tokens, "
                           "averaged over queries (bias² + variance = mean e²)", "exp2", scale_free=False))
    register_metric(Metric(f"{_r}_logit_mse", "(q·k units)²", "lower",
                           f"{_R}: mean squared inner-product error mean(e²), e = q·k̂ − q·k", "exp2",
                           scale_free=False))
    register_metric(Metric(f"{_r}_attn_k_err", "1 (squared units of K)", "lower",
                           f"{_R}: attention-weighted K error Σ_t a_t‖k̂_t − k_t‖² (a = exact attention), "
                           "averaged over queries", "exp2", scale_free=False))
    register_metric(Metric(f"{_r}_attn_k_rel_err", "1", "lower",
                           f"{_R}: attention-weighted K error relative to Σ_t a_t‖k_t‖²", "exp2"))
    # ranked by |slope|: a flat curve (the error does not drift with context) is best; a negative slope
    # usually means a large error at short context, not a virtue, so "lower" would reward it
    register_metric(Metric(f"{_r}_err_slope_per_1k", "1 per 1k tokens", "zero",
                           f"{_R}: accumulation slope — least-squares slope of the output relative MSE "
                           "against context length (0 = no drift)", "exp2"))
    register_metric(Metric(f"{_r}_kl_slope_per_1k", "nats per 1k tokens", "zero",
                           f"{_R}: least-squares slope of the forward attention KL against context length "
                           "(0 = no drift)", "exp2"))
for _kv, _KV in (("k_", "K "), ("v_", "V "), ("", "")):
    register_metric(Metric(f"decode_{_kv}bits_effective", "bits/element", "lower",
                           f"pseudo-decode: {_KV}effective bits per element at the full length as billed, "
                           "fp16 sink/residual/partial-tile tokens at 16 bits" + (" (mean of K and V)" if not _kv else ""),
                           "exp2"))


# ------------------------------------------------------------------------------------------------
# Experiment 3 — outliers (docs/DESIGN.md §4); kvqbench/experiments/outliers.py. τ = 0.1; the
# norm-difference densities (fixed edges) are series, not metrics.
for _kv, _KV in (("k", "K"), ("v", "V")):
    register_metric(Metric(f"{_kv}_offdiag_mass", "1", "lower",
                           f"{_KV}: off-diagonal mass of the (‖x‖, ‖x̂‖) joint density — share of tokens with "
                           "|‖x̂‖/‖x‖ − 1| > 0.1", "exp3"))
    for _q, _Q in (("p99", "p99"), ("p999", "p99.9")):
        register_metric(Metric(f"{_kv}_tail_em_share_{_q}", "1", "lower",
                               f"{_KV}: magnitude share ΣE_M/ΣE_T over the tokens at or above the {_Q} of the "
                               "per-token error E_T", "exp3"))
    register_metric(Metric(f"{_kv}_err_incoherence", "1", "lower",
                           f"{_KV}: per-channel incoherence of the error x̂ − x (max channel RMS / RMS over "
                           "channels; 1 = spread evenly, √D = one channel)", "exp3"))
    register_metric(Metric(f"{_kv}_err_incoherence_hadamard", "1", "lower",
                           f"{_KV}: per-channel incoherence of the error after a normalized Hadamard rotation "
                           "along head_dim", "exp3"))
register_metric(Metric("offdiag_mass", "1", "lower", "mean of the K and V off-diagonal masses (τ = 0.1)",
                       "exp3", headline=True))
register_metric(Metric("k_incoherence_shift", "1", "zero",
                       "incoherence(K̂)/incoherence(K) − 1: whether the reconstruction keeps the key "
                       "outlier-channel structure (0 = kept)", "exp3"))


# ------------------------------------------------------------------------------------------------
# Experiment 4 — cost (docs/DESIGN.md §4); kvqbench/experiments/cost.py. Latency and throughput vary run to
# run (``varies="timing"``), peak memory on CUDA (``"memory"``).
register_metric(Metric("quant_latency_ms", "ms", "lower",
                       "quantize latency of K + V (median of repeats after warm-up; CPU: unreliable_timing)",
                       "exp4", scale_free=False, varies="timing"))
register_metric(Metric("dequant_latency_ms", "ms", "lower",
                       "dequantize latency of K + V (median of repeats after warm-up; CPU: unreliable_timing)",
                       "exp4", scale_free=False, varies="timing"))
register_metric(Metric("roundtrip_latency_ms", "ms", "lower",
                       "round-trip latency (quantize + dequantize) of K + V: pytest-benchmark's median over its "
                       "calibrated rounds in a serial run, else the median of repeats (CPU: unreliable_timing)",
                       "exp4", scale_free=False, varies="timing"))
for _op, _what in (("quant", "quantize"), ("dequant", "dequantize"), ("roundtrip", "round trip")):
    register_metric(Metric(f"{_op}_latency_x_clone", "×", "lower",
                           f"{_what} latency of K + V as a multiple of x.clone() of K + V timed in the same cell "
                           "(the memory-bound floor; comparable across CPU and GPU runs)", "exp4",
                           varies="timing"))
register_metric(Metric("quant_throughput_gbps", "GB/s", "higher",
                       "quantize throughput in GB/s (10⁹ B) of fp16 input", "exp4", scale_free=False,
                       varies="timing"))
register_metric(Metric("dequant_throughput_gbps", "GB/s", "higher",
                       "dequantize throughput in GB/s (10⁹ B) of fp16 output-equivalent input", "exp4",
                       scale_free=False, varies="timing"))
register_metric(Metric("cost_bits_nominal", "bits/element", "lower",
                       "mean of K and V nominal bits per element (FP8 scales, FP16 zero-points)", "exp4"))
register_metric(Metric("cost_bits_effective", "bits/element", "lower",
                       "mean of K and V effective bits per element as stored", "exp4"))
register_metric(Metric("compression_ratio", "×", "higher",
                       "compression vs fp16: 16 / effective bits per element", "exp4", headline=True))
register_metric(Metric("peak_mem_mib", "MiB", "lower",
                       "peak memory of quantize + dequantize of K and V incl. the input (CUDA: "
                       "max_memory_allocated; CPU: input + representation as held + output)", "exp4",
                       scale_free=False, varies="memory"))

# ------------------------------------------------------------------------------------------------
# Experiment 5 — end-to-end damage on a small real model (docs/DESIGN.md §4);
# kvqbench/experiments/endtoend.py.
# ``prefill``: the window in one forward pass, K/V round-tripped as a whole; ``decode``: a prefill then
# blocks under each method's stream policy. p = the unquantized model's next-token distribution.
for _r, _R in (("prefill", "prefill"), ("decode", "decode")):
    register_metric(Metric(f"e2e_{_r}_kl_nats", "nats", "lower",
                           f"end-to-end, {_R}: mean over positions of the next-token KL(p‖p̂) against the "
                           "unquantized model on the same text", "exp5", headline=True, varies="float_noise"))
    register_metric(Metric(f"e2e_{_r}_kl_p99_nats", "nats", "lower",
                           f"end-to-end, {_R}: 99th percentile over positions of the next-token KL(p‖p̂)", "exp5", varies="float_noise"))
    register_metric(Metric(f"e2e_{_r}_top1_agree", "1", "higher",
                           f"end-to-end, {_R}: share of positions whose top-1 next token agrees with the "
                           "unquantized model's", "exp5", varies="float_noise", ratio_scale=False))
    register_metric(Metric(f"e2e_{_r}_dloss_nats", "nats/token", "lower",
                           f"end-to-end, {_R}: Δ loss — mean next-token cross-entropy of the true text minus the "
                           "unquantized model's on the same positions", "exp5", varies="float_noise",
                           ratio_scale=False))
    register_metric(Metric(f"e2e_{_r}_bits_billed", "bits/element", "lower",
                           f"end-to-end, {_R}: K and V bits per element the cache holds at the end of the window "
                           "(stored segments + fp16 tokens at 16 bits), mean over layers", "exp5", varies="float_noise"))


# ------------------------------------------------------------------------------------------------
# Experiment 6 — long decode and retrieval on the real model (docs/DESIGN.md §4);
# kvqbench/experiments/longdecode.py, kvqbench/experiments/passkey.py. p = the unquantized model's
# next-token distribution on the same long text under the same forward schedule.
register_metric(Metric("long_kl_nats", "nats", "lower",
                       "long decode: mean over the decoded positions of the next-token KL(p‖p̂), teacher-forced "
                       "on the model's own sampled text", "exp6", varies="float_noise"))
register_metric(Metric("long_kl_last_quarter_nats", "nats", "lower",
                       "long decode: mean next-token KL(p‖p̂) over the last quarter of the decoded positions "
                       "(every token attends to thousands of cached ones)", "exp6", varies="float_noise"))
register_metric(Metric("long_top1_last_quarter", "1", "higher",
                       "long decode: share of the last quarter's positions whose top-1 next token agrees with "
                       "the unquantized model's", "exp6", varies="float_noise", ratio_scale=False))
register_metric(Metric("long_kl_slope_per_1k", "nats/1k tokens", "lower",
                       "long decode: least-squares slope of the per-position KL against the position, per 1 000 "
                       "positions (> 0: damage builds up)", "exp6", varies="float_noise", ratio_scale=False))
register_metric(Metric("long_dloss_nats", "nats/token", "lower",
                       "long decode: Δ loss — mean next-token cross-entropy of the text minus the unquantized "
                       "model's", "exp6", varies="float_noise", ratio_scale=False))
register_metric(Metric("long_bits_billed", "bits/element", "lower",
                       "long decode: K and V bits per element the cache holds at the end of the text (stored "
                       "segments + fp16 tokens at 16 bits), mean over layers", "exp6", varies="float_noise"))
register_metric(Metric("long_kl_noise_sd_nats", "nats", "lower",
                       "long decode: standard deviation of long_kl_nats over the run and its draws with the "
                       "cached K/V perturbed at relative 1e-7 (the spread float noise alone causes)", "exp6", varies="float_noise"))
register_metric(Metric("long_kl_last_quarter_noise_sd_nats", "nats", "lower",
                       "long decode: standard deviation of long_kl_last_quarter_nats over the run and its "
                       "perturbed draws (float noise alone)", "exp6", varies="float_noise"))
register_metric(Metric("free_first_divergence_tokens", "tokens", "higher",
                       "free-running: greedy tokens after the long text until the first that differs from the "
                       "unquantized model's greedy continuation (all of them when none does)", "exp6", varies="float_noise",
                       ratio_scale=False))
register_metric(Metric("free_match_share", "1", "higher",
                       "free-running: share of the greedy continuation's positions whose token equals the "
                       "unquantized model's", "exp6", varies="float_noise", ratio_scale=False))
register_metric(Metric("passkey_logp_drop_nats", "nats", "lower",
                       "passkey: the unquantized model's log-probability of the key's tokens minus the "
                       "method's, mean over the prompts the method scores (one per length, at the seed's depth)", "exp6",
                       varies="float_noise", ratio_scale=False))
register_metric(Metric("passkey_rank_worst", "1", "lower",
                       "passkey: worst rank among the key's tokens (0 = each is the top-1 token), mean over "
                       "the prompts the method scores", "exp6", varies="float_noise", ratio_scale=False))
register_metric(Metric("passkey_match", "1", "higher",
                       "passkey: exact-match share (every key token top-1) over the scored prompts the "
                       "unquantized model retrieves, at lengths where it retrieves ≥ 90 % of the seed's depths",
                       "exp6", varies="float_noise", ratio_scale=False))


#: the wall-clock timing metrics (``varies="timing"``); determinism checks leave them out. Each exp4
#: record also lists its own in ``extra["nondeterministic_metrics"]``.
NONDETERMINISTIC_METRICS: frozenset[str] = frozenset(n for n, m in CATALOG.items() if m.varies == "timing")


# ------------------------------------------------------------------------------------------------
def markdown_table() -> str:
    """The metric table of docs/METRICS.md (GitHub Markdown), generated from the catalog
    (``tests/unit/test_metrics_doc.py`` keeps the file in sync)."""
    from tabulate import tabulate

    better = {"lower": "lower", "higher": "higher", "zero": "closest to 0"}
    rows = [[m.experiment, f"`{m.name}`", m.unit, better[m.better], "log" if m.ratio_scale else "raw", m.description]
            for m in sorted(CATALOG.values(), key=lambda m: (m.experiment, m.name))]
    return tabulate(rows, headers=["exp", "metric", "unit", "better", "compared", "meaning"], tablefmt="github")
