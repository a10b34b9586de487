"""The long-decode sections of ``LEADERBOARD.md`` (docs/DESIGN.md §4.6), rendered from a source's
``stats`` and its ``long_decode`` entry (:mod:`kvqbench.report.stats.longdecode`). Torch-free."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from kvqbench.cells import is_plain_setting, setting_order
from kvqbench.report.render.text import (
    RANKING_RULE,
    best_text,
    compared_text,
    fmt,
    methods_in,
    plain_settings,
    rank_text,
    rho_text,
    ties_text,
    value_text,
)
from kvqbench.report.stats.longdecode import EXPERIMENT, LONG_PREDICTIVITY_TARGETS, long_decode_points
from kvqbench.report.stats.paired import ALPHA
from kvqbench.report.stats.predictivity import PREDICTIVITY_TARGETS, target_rows
from kvqbench.report.stats.ranking import paired_at_budgets

__all__ = ["markdown_lines"]


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f} %"


def _kl_tables(src: dict[str, Any], board: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    stats6 = src["stats"][EXPERIMENT]
    shares = summary.get("fp16_share_at_T") or {}
    ranking = (src.get("rankings") or {}).get("long_kl_nats", {}).get("by_setting", {})
    out = []
    for s in [s for s in plain_settings(stats6) if ranking.get(s)]:
        rows = []
        for r in ranking[s]:
            e = stats6[r["method"]][s]
            noise = e.get("long_kl_noise_sd_nats")
            rows.append([rank_text(r), f"`{r['method']}`", value_text(e.get("long_kl_nats")),
                         value_text(e.get("long_kl_last_quarter_nats")), value_text(e.get("long_top1_last_quarter")),
                         value_text(e.get("long_kl_slope_per_1k")), value_text(e.get("long_dloss_nats")),
                         value_text(e.get("long_bits_billed")), _pct(shares.get(r["method"], {}).get(s)),
                         fmt(noise["mean"]) if noise else "—", ties_text(r)])
        out += [f"#### {s}", "", tabulate(rows, headers=[
            "rank", "method", "KL nats", "KL last quarter", "top-1 last quarter", "KL slope /1k tokens",
            "Δ loss nats/token", "bits billed at T", "fp16 share at T", "noise floor (sd)",
            "tied with (paired)"], tablefmt="github"), ""]
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
            f"1e-7 (float noise alone). {RANKING_RULE} (texts here).", "", *out]


def _curve_tables(src: dict[str, Any], board: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    curves = summary.get("kl_curve") or {}
    stats6 = src["stats"][EXPERIMENT]
    settings = sorted({s for by in curves.values() for s in by if is_plain_setting(s)}, key=setting_order)
    out = []
    for s in settings:
        ms = [m for m in methods_in(board, curves) if s in curves[m]]
        bins = curves[ms[0]][s]
        rows = []
        for m in ms:
            c = curves[m][s]
            if c["start"] != bins["start"]:
                continue
            slope = stats6.get(m, {}).get(s, {}).get("long_kl_slope_per_1k")
            rows.append([f"`{m}`", *[fmt(v) for v in c["mean"]], value_text(slope)])
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
    settings = plain_settings(stats6)
    rows = [[f"`{m}`", *(value_text(stats6[m].get(s, {}).get(k)) for s in settings
                          for k in ("free_first_divergence_tokens", "free_match_share"))]
            for m in methods_in(board, stats6) if any("free_match_share" in stats6[m].get(s, {}) for s in settings)]
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
    mc = summary.get("passkey_mcnemar") or {}
    rows = []
    for m in methods_in(board, stats6):
        for s in sorted(stats6[m], key=setting_order):
            e = stats6[m][s]
            if "passkey_logp_drop_nats" not in e or not is_plain_setting(s):
                continue
            per_len = (acc.get(m) or {}).get(s) or [None] * len(lengths)
            rows.append([f"`{m}`", s, value_text(e.get("passkey_logp_drop_nats")), value_text(e.get("passkey_rank_worst")),
                         value_text(e.get("passkey_match")), *[_pct(a) for a in per_len],
                         _mcnemar_text((mc.get(s) or {}).get(m))])
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
            f"({ref.get('n_seeds')} seed(s)): {own}; its worst rank: {ranks}. {_mcnemar_caption(mc)}", "",
            tabulate(rows, headers=["method", "bits", "key log-prob drop (nats)", "worst key-token rank",
                                    "exact match (counted prompts)", *[f"exact match {n} tokens" for n in lengths],
                                    "vs unquantized (McNemar)"], tablefmt="github"), ""]


def _mcnemar_text(t: dict[str, Any] | None) -> str:
    """``worse, 5 of 6 lost (Holm p 0.016)`` / ``tied, 1 of 4 lost (Holm p 1)``; ``—`` without counted trials."""
    return (f"{'worse' if t['separated'] else 'tied'}, {t['lost']} of {t['n_trials']} lost (Holm p {t['p_holm']:.2g})"
            if t and t["n_trials"] else "—")


def _mcnemar_caption(mc: dict[str, Any]) -> str:
    """The passkey comparison's rule and, from the trial counts, whether it can separate at all."""
    n = max([t["n_trials"] for by in mc.values() for t in by.values()] or [0])
    can = f"; with {n} trials the smallest attainable p is 0.5^{n} = {0.5 ** n:.2g}" + (
        f" > {ALPHA}, so no method can be separated from it yet" if 0.5 ** n > ALPHA else "")
    return (f"Each method's counted trials are compared with the unquantized model's on the same prompts (seed, "
            f"length, depth; it passes all) by McNemar's exact one-sided test, Holm over the methods of a bit width "
            f"at α = {ALPHA} (docs/METRICS.md){can}." if n else "")


def _rho(row: dict[str, Any] | None) -> str:
    return rho_text(row.get("rho"), row.get("ci95")) if row else "—"


def _predictivity_lines(src: dict[str, Any], board: dict[str, Any], top: int = 6) -> list[str]:
    """Whether the tensor metrics that predict the short-window KL also predict the long-decode KL and
    the passkey log-probability drop (pooled ρ where pooled exists)."""
    targets = (src.get("predictivity") or {}).get("targets") or {}
    short, cols = PREDICTIVITY_TARGETS[0], [t for t in LONG_PREDICTIVITY_TARGETS if targets.get(t)]
    if not cols:
        return []
    by = {t: {r["metric"]: r for r in target_rows(src.get("predictivity"), t)[1]} for t in (short, *cols)}
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
    """The best method at each matched budget of bits billed at T on the long-decode KL, every other method
    compared with it across the texts both decoded (:func:`kvqbench.report.stats.ranking.paired_at_budgets`,
    the first screen's rule), written as on the first screen."""
    stats6 = src["stats"][EXPERIMENT]
    budgets = paired_at_budgets(long_decode_points(stats6))
    if not any(b["method"] for b in budgets):
        return []
    rows = [[f"≤ {b['budget']}", best_text(b), b["setting"] or "—", fmt(b["bits"]),
             value_text(stats6[b["method"]][b["setting"]]["long_kl_nats"] if b["method"] else None),
             compared_text(b, True), compared_text(b, False)] for b in budgets]
    n = sorted({b["n_units"] for b in budgets if b.get("n_units")})
    return ["### Best method at a matched budget over a long decode (long-decode KL vs bits billed at T)", "",
            "Ranked on the long-decode KL, not on the first screen's short-window KL, by the first screen's paired "
            f"rule across the texts every compared setting decoded ({', '.join(map(str, n)) or 'none'}): `=` tied "
            "(not separated by the one-sided paired t-test on log KL, Holm over the row), each compared method's "
            "KL as a multiple of the best's with its paired 95% CI. Bits and KL are the best's.", "",
            tabulate(rows, headers=["budget", "best", "bits", "bits billed at T", "long-decode KL nats",
                                    "tied (× best, 95% CI)", "separated (× best, 95% CI)"], tablefmt="github"), ""]


def markdown_lines(src: dict[str, Any], board: dict[str, Any]) -> list[str]:
    """The long-decode sections of one source in ``LEADERBOARD.md``; none when it did not run."""
    if not (src.get("stats") or {}).get(EXPERIMENT):
        return []
    summary = src.get("long_decode") or {}
    return (_budget_table(src) + _kl_tables(src, board, summary) + _curve_tables(src, board, summary) + _free_table(src, board)
            + _passkey_table(src, board, summary) + _predictivity_lines(src, board))
