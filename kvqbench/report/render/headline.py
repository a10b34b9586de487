"""The first screen of ``LEADERBOARD.md`` and of the README digest: per source the best method at each
matched budget, and the sentences that say how it was ranked and why the headline metric is the one it
is. Torch-free."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from kvqbench.cells import is_plain_setting, source_kind
from kvqbench.metrics import experiment_of
from kvqbench.report.render.text import best_text, cells_text, compared_text, fmt, rho_text, seeds_text
from kvqbench.report.stats.paired import PAIRED_TEST
from kvqbench.report.stats.predictivity import (
    PREDICTIVITY_BOOTSTRAP,
    PREDICTIVITY_MIN_METHODS,
    PREDICTIVITY_SEED,
    PREDICTIVITY_TARGETS,
)

__all__ = ["RULE_TEXT", "PAIRED_RULE_TEXT", "no_predictivity_reason", "headline_lines", "headline_screen",
           "paired_rule"]


#: the headline rule in words (:func:`kvqbench.report.stats.headline.headline_rule`)
RULE_TEXT = ("the declared default `{default}` stays the headline unless another scale-free metric's Spearman ρ "
             "with end-to-end KL beats it by more than the bootstrap: the paired {n_boot}-resample bootstrap 95% "
             "CI over methods (seed {seed}) of ρ(other) − ρ(default) lies wholly above 0")


#: the budget rows' rule in words (:func:`kvqbench.report.stats.ranking.paired_at_budgets`)
PAIRED_RULE_TEXT = ("Settings are compared {unit} by {unit} on the {unit}s they share ({n}): the best has the lowest mean "
                    "log damage, and each other method — its best setting within the budget — is tied with it (`=`) "
                    "unless a {test} separates them, {correction}-corrected over the row at one-sided α = {alpha:g} "
                    "(the two-sided {level:g} % level, so a separated method's 95% ratio CI lies above 1; after Holm a "
                    "tied one's may too). Beside each: its damage as a multiple of the best's (geometric mean over "
                    "{unit}s, paired {conf:g}% CI; its setting named where it is not the best's); the "
                    "best's {conf:g}% rank interval and P(best) come from a {n_boot}-resample paired bootstrap over "
                    "{unit}s (seed {seed}).")


def paired_rule(board: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """:data:`PAIRED_RULE_TEXT` filled from ``board["paired_test"]`` and the rows' unit and unit counts."""
    t = {**PAIRED_TEST, **(board.get("paired_test") or {})}
    unit = next((r["unit"] for r in rows if r.get("unit")), "seed")
    counts = sorted({r["n_units"] for r in rows if r.get("n_units")})
    n = (f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}" if counts else "none") + " here"
    return PAIRED_RULE_TEXT.format(unit=unit, n=n, test="one-sided " + str(t["test"]).replace("one-sided ", ""),
                                   correction=t["correction"], alpha=t["alpha"], level=200 * t["alpha"],
                                   conf=100 * t["confidence"], n_boot=t["bootstrap"], seed=t["bootstrap_seed"])


def no_predictivity_reason(board: dict[str, Any]) -> str:
    """Why no tensor metric was picked by predictivity (the headline is relative MSE), as a clause: no
    end-to-end run at all; an end-to-end run over too few methods with a non-zero KL (a ``-k kvarn`` run:
    fp16 and 16-bit settings are exact, and ρ needs :data:`~kvqbench.report.stats.predictivity.PREDICTIVITY_MIN_METHODS`);
    or no tensor metric of experiments 1–3 beside it for the same methods and settings."""
    target = PREDICTIVITY_TARGETS[0]
    damaged: list[str] = []  # the methods of the source with the most of them
    ran = False
    for src in (board.get("sources") or {}).values():
        e2e = (src.get("stats") or {}).get(experiment_of(target)) or {}
        ran = ran or bool(e2e)
        ms = sorted(m for m, by in e2e.items()
                    if any(is_plain_setting(s) and (e.get(target) or {}).get("mean") not in (None, 0)
                           for s, e in by.items()))
        damaged = ms if len(ms) > len(damaged) else damaged
    if not ran:
        return "this result set has no end-to-end run"
    if len(damaged) < PREDICTIVITY_MIN_METHODS:
        n = len(damaged)
        return (f"the end-to-end run in this result set has {n} method{'' if n == 1 else 's'} with a non-zero KL"
                + (f" ({', '.join(damaged)})" if damaged else "")
                + f", and ranking tensor metrics against it takes at least {PREDICTIVITY_MIN_METHODS}")
    return "the end-to-end run in this result set has no tensor metric of experiments 1–3 beside it for the same methods and settings"


def _rule_lines(board: dict[str, Any]) -> str:
    """The headline-metric rule and how it came out on this board (:mod:`kvqbench.report.stats.headline`)."""
    h = board.get("headline") or {}
    metric = h.get("metric", "rel_mse")
    default = h.get("default")
    if not h.get("from_predictivity"):
        return (f"Headline tensor metric `{metric}`: {no_predictivity_reason(board)}, so which tensor metric predicts "
                "model damage is unknown here (that takes the end-to-end experiment and the tensor experiments 1–3 on "
                "the same source for at least 4 methods; the main job, `kvqbench run`, has them).")
    where = "pooled over bit widths" if h.get("group") == "pooled" else f"at {h.get('group')}"
    model = ((board.get("sources", {}).get(h.get("source"), {}).get("data") or {}).get("model")) or "the real model"
    text = (f"Headline tensor metric `{metric}` ({h.get('experiment')}): Spearman ρ = {rho_text(h.get('rho'), h.get('ci95'))} "
            f"(95% bootstrap CI over methods) against the end-to-end next-token KL of {model}, {where}.")
    if default is None:
        return text
    rule = RULE_TEXT.format(default=default, n_boot=h.get("n_boot") or PREDICTIVITY_BOOTSTRAP,
                            seed=h["seed"] if h.get("seed") is not None else PREDICTIVITY_SEED)
    c = h.get("challenger")
    if not h.get("default_measured", True):
        outcome = "the default was not measured on this data, so the scale-free metric with the highest ρ stands in"
    elif c is None:
        outcome = "no other scale-free metric was measured beside it, so the default stays"
    else:
        diff = f"ρ(`{c['metric']}`) − ρ(`{default}`) = {rho_text(c['diff'], c.get('diff_ci95'))}"
        outcome = (f"`{c['metric']}` replaces it ({diff})" if h.get("replaced_default")
                   else f"the default stays: its strongest challenger gives {diff}")
    return f"{text} Rule: {rule}; here {outcome}."


def headline_lines(board: dict[str, Any], src_name: str, src: dict[str, Any]) -> tuple[str, list[list[str]], list[str]]:
    """The headline of one source, shared by ``LEADERBOARD.md``, the web page and the README digest:
    ``(sentence, rows, headers)``, the sentences naming the ranking criterion, the paired rule
    (:func:`paired_rule`) and the headline metric with its rule, then the matched-budget table."""
    h = board.get("headline") or {}
    metric = h.get("metric", "rel_mse")
    target = h.get("target", PREDICTIVITY_TARGETS[0])
    rows_in = src.get("headline") or []
    e2e = any(str(b.get("criterion", "")).startswith("e2e_") for b in rows_in)
    long_only = any(b.get("criterion") == "long_kl_nats" for b in rows_in)
    if long_only:
        crit = ("Ranked on measured long-decode damage: next-token KL `long_kl_nats` over the decoded text (mean "
                "± 95% CI over texts) at the bits per element billed at T (no end-to-end or tensor experiment "
                "in this result set).")
    elif e2e:
        crit = (f"Ranked on measured end-to-end damage: next-token KL `{target}` (mean ± 95% CI over text windows) at "
                f"the bits per element the same cells billed; the headline tensor metric of the same setting beside it.")
    else:
        crit = (f"Ranked on the headline tensor metric `{metric}` (no end-to-end run on this data), at experiment 1's "
                "effective bits per element.")
    chosen_here = h.get("source") in (None, src_name) or h.get("source") not in (board.get("sources") or {})
    rule = _rule_lines(board) if chosen_here else (
        f"Headline tensor metric `{metric}` ({h.get('experiment')}), chosen on the {h.get('source')} data by the rule "
        "stated there.")
    sentence = f"{crit} {paired_rule(board, rows_in)} {rule}"
    rows = []
    long = any("long_kl" in b for b in rows_in) and not long_only  # exp6 ran: its KL beside the ranking
    for b in rows_in:
        value = b.get("value", b.get("quality"))
        row = [f"≤ {b['budget']}", best_text(b), b["setting"] or "—", fmt(b["bits"]), fmt(value, b.get("ci95"))]
        if e2e:
            row.append(fmt(b.get("quality"), b.get("quality_ci95")))
        if long:
            row.append(fmt(b["long_kl"], b.get("long_kl_ci95")) + (f" @ {b['long_bits_billed']:.3g} b" if
                       b.get("long_bits_billed") is not None else "") if b.get("long_kl") is not None else "—")
        row += [compared_text(b, True), compared_text(b, False)]
        rows.append(row)
    long_col = ["long-decode KL (`long_kl_nats`) @ bits billed at T"] if long else []
    compared = ["tied (× best, 95% CI)", "separated (× best, 95% CI)"]
    headers = (["budget (bits/elt)", "best", "bits", "bits billed at T", "long-decode KL (`long_kl_nats`)",
                *compared] if long_only else
               ["budget (bits/elt)", "best", "bits", "bits billed", f"end-to-end KL (`{target}`)", metric, *long_col,
                *compared] if e2e else
               ["budget (bits/elt)", "best", "bits", "bits effective", metric, *long_col, *compared])
    return sentence, rows, headers


def headline_screen(board: dict[str, Any], src_name: str, src: dict[str, Any]) -> list[str]:
    """One screen per source: the best method at each matched budget — by end-to-end KL where it was
    measured, else by the headline tensor metric — with its ties, and the rule that names the metric."""
    sentence, rows, headers = headline_lines(board, src_name, src)
    data = src.get("data") or {}
    what = f" ({data.get('model')})" if source_kind(src_name) == "real" and data.get("model") else ""
    crits = {str(b.get("criterion", "")) for b in src.get("headline") or []}
    by = "end-to-end KL" if any(c.startswith("e2e_") for c in crits) else "long-decode KL" \
        if "long_kl_nats" in crits else f"`{(board.get('headline') or {}).get('metric', 'rel_mse')}`"
    out = [f"## {src_name}{what}: best method at a matched budget, by {by}", "", sentence, ""]
    if rows:
        out += [tabulate(rows, headers=headers, tablefmt="github"), ""]
    out += [f"Cells: {cells_text(src.get('cells', {}))} · {seeds_text(src)} · sizes "
            f"{', '.join(src.get('sizes', []))}. 16-bit settings are exact and are not budget points.", ""]
    return out
