"""Experiment 6 in the leaderboard (docs/DESIGN.md §4.6, §5): long decode, KL against the decoded
position, free-running divergence, passkey retrieval, the noise floor, and whether the tensor metric
that predicts short-window damage also predicts long decode and retrieval. Torch-free.

:func:`summarize` condenses a source's exp6 records into the ``long_decode`` entry of the leaderboard
(the KL curves per method and setting as means over seeds, the fp16 share at T, the passkey accuracies
per length); :func:`markdown_lines` renders its tables from that entry and the source's ``stats``, so
``kvqbench report`` rebuilds them from ``leaderboard.json`` alone.

Ties: two methods' long-decode KL is a tie when their 95 % CIs over seeds overlap or when their means
differ by no more than the larger of their noise floors (``long_kl_noise_sd_nats``: the standard
deviation float noise alone causes, measured on the first seed of each seed group).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

from tabulate import tabulate

from kvqbench.cells import is_plain_setting, setting_order
from kvqbench.report.leaderboard import best_at_budgets, is_short, mean_ci, setting_key

__all__ = ["EXPERIMENT", "summarize", "ranked_with_floor", "markdown_lines", "NOISE_OF", "LONG_PREDICTIVITY_TARGETS",
           "CI_SHARE_TARGET"]

EXPERIMENT = "exp6"
#: the metric whose noise-floor metric decides ties (``name → its noise standard deviation``)
NOISE_OF = {"long_kl_nats": "long_kl_noise_sd_nats",
            "long_kl_last_quarter_nats": "long_kl_last_quarter_noise_sd_nats"}
#: the predictivity targets this module reports beside the short-window KL (see
#: :data:`kvqbench.report.leaderboard.PREDICTIVITY_TARGETS`)
LONG_PREDICTIVITY_TARGETS = ("long_kl_nats", "passkey_logp_drop_nats")


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs)


def summarize(records: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``long_decode`` entry of one source from its exp6 records (``None`` when none passed).

    Returns ``{"kl_curve": {method: {setting: {"start", "stop", "mean", "ci95", "n"}}}, "fp16_share_at_T":
    {method: {setting: share}}, "passkey_reference": {"lengths", "depths", "accuracy", "rank_worst", "n_seeds", "floor"},
    "passkey_accuracy": {method: {setting: [share or None per length]}}, "text_tokens", "prefill_tokens",
    "bin"}``: the KL curve's bins (decoded positions ``[start, stop)``) with the mean over seeds of each
    bin's mean KL and its 95 % half-width (seeds whose bins differ from the first seed's are left out);
    the share of the cache held in fp16 at T (mean of K and V, mean over seeds); the unquantized model's
    exact-match share per passkey length and its worst key-token rank (means over seeds); a method's
    exact-match share per length over the prompts the unquantized model retrieves, mean over the seeds
    where that length counts (``None``: it counts at no seed).
    """
    recs = sorted((r for r in records if r.get("experiment") == EXPERIMENT and r.get("status") == "passed"),
                  key=lambda r: (r["method"], setting_key(r), r["seed"]))
    if not recs:
        return None
    curves: dict[tuple[str, str], list[dict]] = defaultdict(list)
    shares: dict[tuple[str, str], list[float]] = defaultdict(list)
    acc: dict[tuple[str, str], list[list]] = defaultdict(list)
    ref_acc: dict[int, list[list[float]]] = defaultdict(list)
    ref_rank: dict[int, list[list[float]]] = defaultdict(list)
    lengths: list[int] | None = None
    floor: float | None = None
    depths: list[float] = []
    for r in recs:
        key = (r["method"], setting_key(r))
        series, extra = r.get("series") or {}, r.get("extra") or {}
        c = series.get("kl_curve")
        if c and c.get("mean"):
            curves[key].append(c)
        fs = extra.get("fp16_share_at_T")
        if isinstance(fs, dict) and fs:
            shares[key].append(_mean([float(v) for v in fs.values()]))
        pk = series.get("passkey")
        if pk and pk.get("lengths"):
            lengths, depths = lengths or list(pk["lengths"]), depths or list(pk.get("depths") or [])
            if list(pk["lengths"]) == lengths:
                acc[key].append(list(pk.get("accuracy") or [None] * len(lengths)))
                ref_acc[r["seed"]].append([float(a) for a in pk["ref_accuracy"]])
                ref_rank[r["seed"]].append([_mean([float(x) for x in row]) for row in pk["rank_worst_ref"]])
                floor = (extra.get("passkey") or {}).get("reference_floor", floor)
    out: dict[str, Any] = {"kl_curve": {}, "fp16_share_at_T": {}, "passkey_accuracy": {}}
    for (m, s), cs in curves.items():
        same = [c for c in cs if c["start"] == cs[0]["start"] and c["stop"] == cs[0]["stop"]]
        cols = [mean_ci([float(c["mean"][i]) for c in same]) for i in range(len(same[0]["mean"]))]
        out["kl_curve"].setdefault(m, {})[s] = {"start": list(same[0]["start"]), "stop": list(same[0]["stop"]),
                                                "mean": [c[0] for c in cols], "ci95": [c[1] for c in cols],
                                                "n": len(same)}
    for (m, s), v in shares.items():
        out["fp16_share_at_T"].setdefault(m, {})[s] = _mean(v)
    for (m, s), rows in acc.items():
        per_len = [[row[i] for row in rows if row[i] is not None] for i in range(len(lengths or []))]
        out["passkey_accuracy"].setdefault(m, {})[s] = [_mean(v) if v else None for v in per_len]
    if lengths:
        seeds = sorted(ref_acc)
        per_seed = [[_mean(col) for col in zip(*ref_acc[sd])] for sd in seeds]  # every record of a seed
        per_seed_rank = [[_mean(col) for col in zip(*ref_rank[sd])] for sd in seeds]  # scores the same prompts
        out["passkey_reference"] = {"lengths": lengths, "accuracy": [_mean(list(c)) for c in zip(*per_seed)],
                                    "rank_worst": [_mean(list(c)) for c in zip(*per_seed_rank)],
                                    "n_seeds": len(seeds), "floor": floor, "depths": depths}
    first = recs[0].get("extra") or {}
    out["text_tokens"] = first.get("text_tokens")
    out["prefill_tokens"] = first.get("prefill_tokens")
    out["bin"] = ((recs[0].get("series") or {}).get("kl_curve") or {}).get("bin")
    return out


# --------------------------------------------------------------------------------------------------
# ties against the noise floor
def ranked_with_floor(entries: dict[str, tuple[float, float | None, float | None]]) -> list[dict[str, Any]]:
    """Methods ranked by a lower-is-better mean, with ties from the CIs and the noise floor.

    Args:
        entries: ``method → (mean, 95 % half-width or None, noise standard deviation or None)``.
    Returns:
        Rows best mean first, ``{"method", "mean", "rank", "ties"}``: two methods tie when their intervals
        ``mean ± half-width`` overlap or ``|Δ mean|`` is at most the larger of their noise floors;
        ``rank`` = 1 + the methods better than this one without a tie, never lower than the rank above.
    """
    def tie(a: str, b: str) -> bool:
        (ma, ca, na), (mb, cb, nb) = entries[a], entries[b]
        if abs(ma - mb) <= max(na or 0.0, nb or 0.0):
            return True
        return not (ma + (ca or 0.0) < mb - (cb or 0.0) or mb + (cb or 0.0) < ma - (ca or 0.0))

    order = sorted(entries, key=lambda m: (entries[m][0], m))
    rows: list[dict[str, Any]] = []
    for m in order:
        rank = 1 + sum(1 for o in order if entries[o][0] < entries[m][0] and not tie(o, m))
        if rows:
            rank = max(rank, rows[-1]["rank"])
        rows.append({"method": m, "mean": entries[m][0], "rank": rank,
                     "ties": [o for o in order if o != m and tie(o, m)]})
    return rows


def _noise(stats6: dict[str, Any], method: str, setting: str, metric: str) -> float | None:
    e = stats6.get(method, {}).get(setting, {}).get(NOISE_OF.get(metric, ""))
    return e["mean"] if e else None


# --------------------------------------------------------------------------------------------------
# rendering
def _fmt(x: Any, ci: Any = None) -> str:
    from kvqbench.report.markdown import fmt

    return fmt(x, ci)


def _val(e: dict[str, Any] | None) -> str:
    if not e:
        return "—"
    from kvqbench.report.markdown import value_text

    return value_text(e)


def _settings(stats6: dict[str, Any]) -> list[str]:
    return sorted({s for by in stats6.values() for s in by if is_plain_setting(s)}, key=setting_order)


def _methods(stats6: dict[str, Any], board: dict[str, Any]) -> list[str]:
    order = [m for m in board.get("methods", {}) if m in stats6]
    return order + sorted(m for m in stats6 if m not in order)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f} %"


def _kl_tables(src: dict[str, Any], board: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    stats6 = src["stats"][EXPERIMENT]
    shares = summary.get("fp16_share_at_T") or {}
    out = []
    for s in _settings(stats6):
        have = {m: by[s] for m, by in stats6.items() if "long_kl_nats" in by.get(s, {})}
        if not have:
            continue
        short = sorted(m for m, e in have.items() if is_short(e["long_kl_nats"]))  # fewer seeds than asked:
        ranked = ranked_with_floor({m: (e["long_kl_nats"]["mean"], e["long_kl_nats"]["ci95"],  # not ranked
                                        _noise(stats6, m, s, "long_kl_nats")) for m, e in have.items()
                                    if m not in short})
        ranked += [{"method": m, "rank": "—", "ties": []} for m in short]
        rows = []
        for r in ranked:
            e = have[r["method"]]
            noise = e.get("long_kl_noise_sd_nats")
            rows.append([r["rank"], f"`{r['method']}`", _val(e.get("long_kl_nats")),
                         _val(e.get("long_kl_last_quarter_nats")), _val(e.get("long_top1_last_quarter")),
                         _val(e.get("long_kl_slope_per_1k")), _val(e.get("long_dloss_nats")),
                         _val(e.get("long_bits_billed")), _pct(shares.get(r["method"], {}).get(s)),
                         _fmt(noise["mean"]) if noise else "—", ", ".join(r["ties"])])
        out += [f"#### {s}", "", tabulate(rows, headers=[
            "rank", "method", "KL nats", "KL last quarter", "top-1 last quarter", "KL slope /1k tokens",
            "Δ loss nats/token", "bits billed at T", "fp16 share at T", "noise floor (sd)",
            "tied with (CI or noise floor)"], tablefmt="github"), ""]
        out += _ci_line(have)
    if not out:
        return []
    t, p = summary.get("text_tokens"), summary.get("prefill_tokens")
    text = f"T = {t} tokens, a {p}-token prefill, " if t and p else ""
    return ["### Long decode: next-token KL(p‖p̂) in nats over the model's own text", "",
            f"Teacher-forced on the unquantized model's sampled continuation ({text}then blocks under each "
            "method's stream policy), scored at every decoded position against the unquantized model under the "
            "same schedule; mean ± 95% CI over seeds (texts). Bits billed at T count a method's fp16 windows at "
            "16 bits; the fp16 share at T is how much of the cache they hold then. The noise floor is the "
            "standard deviation of the KL over the run and its draws with the cached K/V perturbed at relative "
            "1e-7 (float noise alone); methods whose KL differs by less than it, or whose CIs overlap, are "
            "ties and share a rank.", "", *out]


#: the largest 95 % half-width over seeds, as a share of the mean, at which a long-decode KL is precise
#: enough to compare methods
CI_SHARE_TARGET = 0.25


def _ci_line(have: dict[str, dict[str, Any]]) -> list[str]:
    """One line under a setting's long-decode table: which methods' KL has a 95 % half-width over
    :data:`CI_SHARE_TARGET` of its mean (none without two seeds; exact zeros are left out)."""
    shares = {m: e["long_kl_nats"]["ci95"] / e["long_kl_nats"]["mean"] for m, e in have.items()
              if e["long_kl_nats"].get("ci95") is not None and e["long_kl_nats"]["mean"] > 0}
    if not shares:
        return []
    wide = [f"`{m}` {100 * v:.0f} %" for m, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v > CI_SHARE_TARGET]
    head = (f"95% half-width over seeds ≤ {100 * CI_SHARE_TARGET:.0f} % of the mean KL for "
            f"{len(shares) - len(wide)} of {len(shares)} methods")
    return [head + (f"; wider: {', '.join(wide)}." if wide else "."), ""]


def _curve_tables(src: dict[str, Any], board: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    curves = summary.get("kl_curve") or {}
    stats6 = src["stats"][EXPERIMENT]
    settings = sorted({s for by in curves.values() for s in by if is_plain_setting(s)}, key=setting_order)
    out = []
    for s in settings:
        ms = [m for m in _methods({m: by for m, by in curves.items()}, board) if s in curves[m]]
        bins = curves[ms[0]][s]
        rows = []
        for m in ms:
            c = curves[m][s]
            if c["start"] != bins["start"]:
                continue
            slope = stats6.get(m, {}).get(s, {}).get("long_kl_slope_per_1k")
            rows.append([f"`{m}`", *[_fmt(v) for v in c["mean"]], _val(slope)])
        heads = [f"{a}–{b}" for a, b in zip(bins["start"], bins["stop"])]
        out += [f"#### {s}", "", tabulate(rows, headers=["method", *heads, "slope /1k tokens"], tablefmt="github"), ""]
    if not out:
        return []
    return ["### KL vs decoded position", "",
            f"Mean next-token KL (nats) in bins of {summary.get('bin')} decoded positions `[start, stop)`, mean "
            "over seeds; the slope is the least-squares slope of the per-position KL per 1 000 positions "
            "(> 0: damage builds up). Figure: `kl_vs_position_<source>.png`.", "", *out]


def _free_table(src: dict[str, Any], board: dict[str, Any]) -> list[str]:
    stats6 = src["stats"][EXPERIMENT]
    settings = _settings(stats6)
    rows = []
    for m in _methods(stats6, board):
        if not any("free_match_share" in stats6[m].get(s, {}) for s in settings):
            continue
        row = [f"`{m}`"]
        for s in settings:
            e = stats6[m].get(s, {})
            row += [_val(e.get("free_first_divergence_tokens")), _val(e.get("free_match_share"))]
        rows.append(row)
    if not rows:
        return []
    heads = [h for s in settings for h in (f"first divergence {s}", f"matching share {s}")]
    return ["### Free-running divergence", "",
            "After the long text each model continues greedily with its own cache (new tokens enter it under the "
            "stream policy): tokens until the first that differs from the unquantized model's continuation (all "
            "of them when none does), and the share of positions that agree. Mean ± 95% CI over seeds.", "",
            tabulate(rows, headers=["method", *heads], tablefmt="github"), ""]


def _passkey_table(src: dict[str, Any], board: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    stats6 = src["stats"][EXPERIMENT]
    ref = summary.get("passkey_reference")
    if not ref:
        return []
    floor = ref.get("floor")
    lengths = ref["lengths"]
    acc = summary.get("passkey_accuracy") or {}
    rows = []
    for m in _methods(stats6, board):
        for s in sorted(stats6[m], key=setting_order):
            e = stats6[m][s]
            if "passkey_logp_drop_nats" not in e or not is_plain_setting(s):
                continue
            per_len = (acc.get(m) or {}).get(s) or [None] * len(lengths)
            rows.append([f"`{m}`", s, _val(e.get("passkey_logp_drop_nats")), _val(e.get("passkey_rank_worst")),
                         _val(e.get("passkey_match")), *[_pct(a) for a in per_len]])
    if not rows:
        return []
    own = ", ".join(f"{n} tokens {_pct(a)}" + ("" if floor is None or a >= floor else " (not counted)")
                    for n, a in zip(lengths, ref["accuracy"]))
    ranks = ", ".join(f"{n} tokens {r:.2g}" for n, r in zip(lengths, ref["rank_worst"]))
    floor_text = f"≥ {_pct(floor)}" if floor is not None else "high enough"
    at = ", ".join(_pct(d) for d in ref.get("depths") or [])
    return ["### Passkey retrieval", "",
            f"A 5-digit key in filler at depth {at or '—'} of it, then the question; scored teacher-forced "
            "after one prefill of the prompt under each method's stream policy, the unquantized model at every "
            "depth, a method at one depth per length and seed (the seeds take the depths in turn). The "
            "log-probability drop is the "
            "unquantized model's log-probability of the key's tokens minus the method's (nats, mean over prompts); "
            "the worst rank is the largest rank among the key's tokens (0: each is the top-1 token), mean over "
            f"prompts. Exact match counts only the prompts the unquantized model retrieves, at lengths where it "
            f"retrieves {floor_text} of them. The unquantized model's own exact-match accuracy "
            f"({ref.get('n_seeds')} seed(s)): {own}; its worst rank: {ranks}.", "",
            tabulate(rows, headers=["method", "bits", "key log-prob drop (nats)", "worst key-token rank",
                                    "exact match (counted prompts)", *[f"exact match {n} tokens" for n in lengths]],
                     tablefmt="github"), ""]


def _rho(row: dict[str, Any] | None) -> str:
    if not row or row.get("rho") is None:
        return "—"
    ci = row.get("ci95")
    return f"{row['rho']:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "")


def _predictivity_lines(src: dict[str, Any], board: dict[str, Any], top: int = 6) -> list[str]:
    """Whether the tensor metrics that predict the short-window KL also predict the long-decode KL and
    the passkey log-probability drop (pooled ρ where pooled exists)."""
    from kvqbench.report.leaderboard import PREDICTIVITY_TARGETS

    targets = (src.get("predictivity") or {}).get("targets") or {}

    def group_rows(t: str) -> dict[str, dict]:
        by = targets.get(t) or {}
        g = "pooled" if "pooled" in by else next(iter(by), None)
        return {r["metric"]: r for r in by.get(g, [])} if g else {}

    short, cols = PREDICTIVITY_TARGETS[0], [t for t in LONG_PREDICTIVITY_TARGETS if targets.get(t)]
    if not cols:
        return []
    by = {t: group_rows(t) for t in (short, *cols)}
    lead = short if by[short] else cols[0]
    order = [m for m in by[lead]][:top]
    rows = [[f"`{m}`", by[lead][m]["experiment"], *[_rho(by[t].get(m)) for t in (short, *cols)]] for m in order]
    out = ["### Does the tensor metric that predicts short-window damage also predict long decode and retrieval?", ""]
    if by[short] and order:
        best = order[0]
        says = "; ".join(f"against `{t}` ρ = {_rho(by[t].get(best))}" for t in cols)
        out += [f"`{best}`, the best predictor of `{short}` (ρ = {_rho(by[short][best])}): {says}.", ""]
    out += [f"Spearman ρ across methods (pooled over bit widths where more than one ran; 95% bootstrap CI over "
            f"methods), the {len(order)} best predictors of `{lead}`; each target's exact points (KL or drop "
            "exactly 0) are left out.", "",
            tabulate(rows, headers=["metric", "exp", *[f"ρ vs `{t}`" for t in (short, *cols)]], tablefmt="github"), ""]
    return out


def _budget_table(src: dict[str, Any]) -> list[str]:
    """The best method at each matched budget of bits billed at T on the long-decode KL, with its ties
    (:func:`kvqbench.report.leaderboard.best_at_budgets`: the methods whose 95% CI, widened by their noise
    floor where one was measured, overlaps the best's), written ``a = b`` as on the first screen."""
    from kvqbench.report.headline import long_decode_points

    stats6 = src["stats"][EXPERIMENT]
    pts = long_decode_points(stats6)
    budgets = best_at_budgets(pts)
    if not any(b["method"] for b in budgets):
        return []
    rows = [[f"≤ {b['budget']}", " = ".join(f"`{m}`" for m in [b["method"], *(t["method"] for t in b["ties"])])
             if b["method"] else "—", b["setting"] or "—", _fmt(b["bits"]),
             _val(stats6[b["method"]][b["setting"]]["long_kl_nats"]) if b["method"] else "—"] for b in budgets]
    return ["### Best method at a matched budget over a long decode (long-decode KL vs bits billed at T)", "",
            "Ranked on the long-decode KL, not on the first screen's short-window KL; `a = b`: tied (95% CIs, "
            "widened by each method's noise floor, overlap). Bits and KL are the best's.", "",
            tabulate(rows, headers=["budget", "best", "bits", "bits billed at T", "long-decode KL nats"],
                     tablefmt="github"), ""]


def markdown_lines(src: dict[str, Any], board: dict[str, Any]) -> list[str]:
    """The exp6 sections of one source in ``LEADERBOARD.md`` (none when exp6 did not run): the best
    method at each budget of bits billed at T, long-decode KL with the noise floor and ties, KL vs decoded position with slopes, free-running divergence, passkey
    retrieval, and predictivity against the long-decode KL and the passkey drop."""
    if not (src.get("stats") or {}).get(EXPERIMENT):
        return []
    summary = src.get("long_decode") or {}
    return (_budget_table(src) + _kl_tables(src, board, summary) + _curve_tables(src, board, summary) + _free_table(src, board)
            + _passkey_table(src, board, summary) + _predictivity_lines(src, board))
