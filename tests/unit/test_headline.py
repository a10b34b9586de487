"""The first screen (kvqbench/report/stats/headline.py): a headline metric that float noise cannot flip, real
data ranked on measured end-to-end KL at the bits billed, ties printed as ties, and every other "best"
table naming its criterion. Torch-free; hand-built records with known rank relations."""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest
from scipy import stats
from scipy.stats import spearmanr

from kvqbench.report.board import assemble
from kvqbench.report.render.markdown import render_markdown
from kvqbench.report.stats.headline import HEADLINE_DEFAULT, choose_headline, paired_rho_difference
from kvqbench.report.stats.intervals import mean_ci
from kvqbench.report.stats.ranking import pareto
from tests.unit.test_report_samples import PROVENANCE, _rec, catalog

DEFAULT = HEADLINE_DEFAULT["metric"]
CHALLENGER = "static_out_rel_mse"
#: end-to-end KL at k2v2 (k4v4: /16); distinct, well apart
KL = {"a": 1.6, "b": 1.3, "c": 1.0, "d": 0.8, "e": 0.6, "f": 0.45, "g": 0.3, "h": 0.2}
OVERHEAD = {"a": 0.0, "b": 0.5, "c": 0.25, "d": 0.25, "e": 0.5, "f": 0.125, "g": 0.5, "h": 0.625}


def _records(default: dict[str, float], challenger: dict[str, float], *, jitter: float = 0.01,
             kl: dict[str, float] | None = None) -> list[dict]:
    """exp1 bits, exp2 (default, challenger) and exp5 (KL, bits billed) on the real source, two seeds;
    synthetic exp1/exp2 beside it. ``default``/``challenger``: each method's metric at k2v2 (k4v4: /16)."""
    kl = kl or KL
    out = []
    for m in KL:
        for bits, f in ((2, 1.0), (4, 1 / 16)):
            for seed in (0, 1):
                j = 1 + jitter * (seed - 0.5)
                eff = bits + OVERHEAD[m]
                # rel_mse (a candidate too) ranks as the default does
                out.append(_rec("exp1", m, bits, seed, "real", {"rel_mse": default[m] * f, "bits_effective": eff}))
                out.append(_rec("exp2", m, bits, seed, "real", {DEFAULT: default[m] * f * j, CHALLENGER: challenger[m] * f * j}))
                out.append(_rec("exp5", m, bits, seed, "real", {"e2e_prefill_kl_nats": kl[m] * f * j,
                                                                "e2e_prefill_bits_billed": eff}))
                out.append(_rec("exp1", m, bits, seed, "synthetic", {"rel_mse": kl[m] * f, "bits_effective": eff}))
                out.append(_rec("exp2", m, bits, seed, "synthetic", {DEFAULT: default[m] * f * j,
                                                                     CHALLENGER: challenger[m] * f * j}))
    return out


def _board(recs: list[dict]) -> dict:
    return assemble(recs, catalog(), copy.deepcopy(PROVENANCE))


def test_a_metric_better_only_by_float_noise_never_takes_the_headline():
    """The published leaderboard's failure: two metrics at ρ ≈ 0.99, float noise picks one. Here the
    challenger ranks methods exactly as the KL does; the default does too, except that e and f are 1e-7
    apart, so a 1e-6 relative perturbation swaps them or not. The challenger's ρ is then higher than the
    default's in some draws (the old highest-ρ rule switched), yet it never takes over."""
    perfect = {m: v / 3 for m, v in KL.items()}
    near = dict(perfect, e=0.5, f=0.5 + 1e-7)  # e, f nearly tied (the true order: e worse than f)
    rng = random.Random(0)
    seen_rho = set()
    for _ in range(12):
        eps = {m: 1 + 1e-6 * rng.uniform(-1, 1) for m in KL}
        recs = _records({m: v * eps[m] for m, v in near.items()}, {m: v * eps[m] for m, v in perfect.items()})
        h = _board(recs)["headline"]
        assert h["metric"] == DEFAULT and not h["replaced_default"]
        assert h["challenger"]["metric"] == CHALLENGER
        seen_rho.add(round(h["default_rho"], 9))
        assert h["challenger"]["diff_ci95"][0] <= 0.0 <= h["challenger"]["diff_ci95"][1]
    assert len(seen_rho) == 2  # the perturbation did move the default's ρ below the challenger's and back


def test_a_clearly_better_metric_takes_over_and_the_screen_says_so():
    """The default ranks the methods nearly at random; the challenger ranks them as the KL does: the paired
    bootstrap CI of ρ(challenger) − ρ(default) lies above 0 and the challenger is the headline."""
    perfect = {m: v / 3 for m, v in KL.items()}
    scrambled = dict(zip(KL, [0.5, 0.2, 0.9, 0.3, 1.1, 0.4, 0.8, 0.6]))
    b = _board(_records(scrambled, perfect))
    h = b["headline"]
    assert h["metric"] == CHALLENGER and h["replaced_default"] and h["challenger"]["diff_ci95"][0] > 0
    md = render_markdown(b)
    first = md.split("# Details")[0]
    assert f"Rule: the declared default `{DEFAULT}` stays the headline unless" in first
    assert f"`{CHALLENGER}` replaces it (ρ(`{CHALLENGER}`) − ρ(`{DEFAULT}`) = +" in first


def test_paired_difference_is_zero_for_identical_rankings_and_seeded():
    x = [[5.0, 1.0], [4.0, 0.5], [3.0, 0.2], [2.0, 0.1], [1.0, 0.05]]
    y = [[v * 2 for v in r] for r in x]
    diff, ci = paired_rho_difference(x, [[v + 1 for v in r] for r in x], y)  # same ranks → 0 in every resample
    assert diff == 0.0 and ci == [0.0, 0.0]
    z = [[5.0, 0.1], [1.0, 0.5], [3.0, 0.2], [2.0, 1.0], [4.0, 0.05]]
    diff, ci = paired_rho_difference(z, x, y)
    flat = [v for r in z for v in r], [v for r in x for v in r], [v for r in y for v in r]
    assert diff == pytest.approx(spearmanr(flat[1], flat[2]).statistic - spearmanr(flat[0], flat[2]).statistic, abs=1e-12)
    assert ci[0] <= diff <= ci[1] and (diff, ci) == paired_rho_difference(z, x, y)  # seeded: the same every call


def test_without_end_to_end_the_fallback_is_relative_mse():
    assert choose_headline({"synthetic": {"predictivity": None, "stats": {}}})["metric"] == "rel_mse"


def test_real_budgets_rank_on_end_to_end_kl_at_bits_billed():
    """The tensor metric prefers h at ≤ 2.25 bits; the measured KL prefers f (h bills 2.625 bits and is
    not a point there). Each budget's best is the lowest KL among points billed within it, independent of
    the tensor metric; synthetic ranks on the tensor metric, with no KL."""
    perfect = {m: v / 3 for m, v in KL.items()}
    tensor = dict(perfect, f=0.9)  # the tensor metric says f is worse than c, d, e; the KL says it is better
    b = _board(_records(tensor, tensor))
    real = {r["budget"]: r for r in b["sources"]["real"]["headline"]}
    for budget, r in real.items():  # closed form: the lowest k2v2/k4v4 KL among settings billed ≤ budget
        pts = [(KL[m] * f, m) for m in KL for bits, f in ((2, 1.0), (4, 1 / 16)) if bits + OVERHEAD[m] <= budget]
        assert r["method"] == min(pts)[1] and r["criterion"] == "e2e_prefill_kl_nats"
    assert real[2.25]["method"] == "f" and real[2.25]["bits"] == 2.125
    assert real[2.25]["quality"] == pytest.approx(0.9)  # the tensor metric of the same setting, beside it
    syn = {r["budget"]: r for r in b["sources"]["synthetic"]["headline"]}
    assert syn[2.25]["criterion"] == DEFAULT and syn[2.25]["e2e_kl"] is None
    syn_pts = [(tensor[m], m) for m in KL if 2 + OVERHEAD[m] <= 2.25]  # closed form on the tensor metric
    assert syn[2.25]["method"] == min(syn_pts)[1] != real[2.25]["method"]
    assert real[8.25]["setting"] == "k4v4"


#: per-window end-to-end KL of the best setting (window difficulty spans 3×) and two others' wobble around a
#: fixed ratio: g 1.66× on every window (±3 %), h 1.02× with ±30 % window to window
WINDOWS = (0.40, 0.60, 0.46, 1.20, 0.75, 0.52)
WOBBLE_G = (1.02, 0.97, 1.01, 0.99, 1.03, 0.98)
WOBBLE_H = (1.3, 0.75, 1.2, 0.8, 1.1, 0.95)


def _paired_records() -> list[dict]:
    """exp5 cells on 6 windows of three methods billed within ≤ 3.0 bits: f best, g 1.66×, h ≈ 1×."""
    kl = {"f": WINDOWS, "g": tuple(1.66 * w * j for w, j in zip(WINDOWS, WOBBLE_G)),
          "h": tuple(1.02 * w * j for w, j in zip(WINDOWS, WOBBLE_H))}
    return [_rec("exp5", m, 2, seed, "real", {"e2e_prefill_kl_nats": v, "e2e_prefill_bits_billed": 2.5})
            for m, vals in kl.items() for seed, v in enumerate(vals)]


def test_budget_rows_are_the_paired_test_on_the_shared_windows():
    """Each comparison of a budget row is scipy's paired t-test on the log KL of the same windows, Holm over
    the row; g's marginal 95 % CI overlaps f's (the old rule's tie) yet the paired rule separates it."""
    import numpy as np
    from scipy import stats

    b = _board(_paired_records())
    row = next(r for r in b["sources"]["real"]["headline"] if r["budget"] == 3.0)
    assert b["paired_test"]["alpha"] == 0.025 and b["paired_test"]["correction"] == "Holm"
    assert (row["method"], row["unit"], row["n_units"]) == ("f", "window", 6)
    logs = {c["method"]: np.log([r["metrics"]["e2e_prefill_kl_nats"] for r in _paired_records() if r["method"] == c["method"]])
            for c in row["comparisons"]}
    f = np.log(WINDOWS)
    ps = [stats.ttest_rel(logs[c["method"]], f, alternative="greater").pvalue for c in row["comparisons"]]
    for c, p in zip(row["comparisons"], ps):
        ci = stats.ttest_rel(logs[c["method"]], f).confidence_interval(0.95)
        assert c["ratio"] == pytest.approx(math.exp(np.mean(logs[c["method"]] - f)), rel=1e-12)
        assert c["ratio_ci95"] == pytest.approx([math.exp(ci.low), math.exp(ci.high)], rel=1e-10)
        assert c["p"] == pytest.approx(p, rel=1e-10)
    # Holm over m = 2 by hand: the smaller p times 2, the larger max(that, itself)
    lo, hi = sorted(ps)
    holm = {lo: min(1, 2 * lo), hi: min(1, max(2 * lo, hi))}
    assert [c["p_holm"] for c in row["comparisons"]] == pytest.approx([holm[p] for p in ps], rel=1e-10)
    by = {c["method"]: c for c in row["comparisons"]}
    assert by["g"]["tied"] is False and by["h"]["tied"] is True
    assert [t["method"] for t in row["ties"]] == ["h"] and row["runner_up"] == row["comparisons"][0]["method"]
    g = [r["metrics"]["e2e_prefill_kl_nats"] for r in _paired_records() if r["method"] == "g"]
    iv = [stats.t.interval(0.95, 5, loc=np.mean(v), scale=stats.sem(v)) for v in (WINDOWS, g)]
    assert iv[1][0] < iv[0][1]  # the marginal intervals overlap: the old rule called g tied
    assert row["rank_interval"][0] == 1 and 0 < row["p_best"] <= 1


def test_the_first_screen_writes_the_rank_interval_ratios_and_ties():
    """The best with its rank interval and P(best) and its ties (``=``); each compared method as
    ``g 1.66× [lo, hi]`` in the tied or the separated column; the lead-in states the paired rule; every
    other heading that names a best method says by which criterion it ranks."""
    b = _board(_paired_records())
    row = next(r for r in b["sources"]["real"]["headline"] if r["budget"] == 3.0)
    md = render_markdown(b)
    first = md.split("# Details")[0]
    lo, hi = row["rank_interval"]
    rank = f"rank {lo}" if lo == hi else f"rank {lo}–{hi}"
    by = {c["method"]: c for c in row["comparisons"]}
    g, h = by["g"], by["h"]
    line = next(ln for ln in first.splitlines() if ln.startswith("| ≤ 3.0 "))
    assert f"`f` ({rank}, P(best) {row['p_best']:.2f}) = `h`" in line
    assert f"| g {g['ratio']:.3g}× [{g['ratio_ci95'][0]:.3g}, {g['ratio_ci95'][1]:.3g}]" in line
    assert f"| h {h['ratio']:.3g}× [{h['ratio_ci95'][0]:.3g}, {h['ratio_ci95'][1]:.3g}]" in line
    assert "unless a one-sided paired t-test on log values separates them, Holm-corrected" in first
    assert "α = 0.025" in first and "overlap" not in first
    assert "runner-up" not in md
    for ln in md.splitlines():
        if ln.startswith("#") and "best" in ln.lower():
            assert " by " in ln, ln


def test_a_row_without_a_ratio_scale_states_why():
    recs = _paired_records()
    for r in recs:
        if r["method"] == "h" and r["seed"] == 2:
            r["metrics"]["e2e_prefill_kl_nats"] = 0.0  # an exact window: no log ratio
    row = next(r for r in _board(recs)["sources"]["real"]["headline"] if r["budget"] == 3.0)
    assert row["comparisons"] == [] and "positive" in row["no_verdict"] and row["method"] == "h"
    assert "no paired verdict: " in render_markdown(_board(recs)).split("# Details")[0]


def test_detail_budget_tables_follow_the_paired_rule():
    """exp1's matched budget (relative MSE alone) compares every method's best setting with the best over
    the seeds they share: the one-sided paired t-test on log values (scipy), Holm over the row."""
    x = [0.1, 0.2, 0.4]
    vals = {"x": x, "y": [1.1 * v * w for v, w in zip(x, (1.0, 1.01, 0.99))],  # 1.1× on every seed
            "z": [v * w for v, w in zip(x, (1.5, 0.7, 1.2))]}  # as good on average, noisy

    def entry(v):
        m, ci = mean_ci(v)
        return {"mean": m, "ci95": ci, "n": 3, "seeds": [0, 1, 2], "values": v}

    st = {"exp1": {m: {"k2v2": {"rel_mse": entry(v), "bits_effective": entry([2.0] * 3)}} for m, v in vals.items()}}
    row = next(r for r in pareto(st, (2.25,))[1])
    p = {m: stats.ttest_rel(np.log(vals[m]), np.log(x), alternative="greater").pvalue for m in ("y", "z")}
    assert row["method"] == "x" and p["y"] * 2 <= 0.025 < p["z"]  # Holm over 2: y separated, z not
    assert [t["method"] for t in row["ties"]] == ["z"]
    assert {c["method"]: c["tied"] for c in row["comparisons"]} == {"y": False, "z": True}


def test_a_width_run_for_a_few_methods_joins_the_budgets_not_the_pooled_predictivity():
    """exp5 at 8 bits for three lean methods only (their 8-bit cache fits 8.25 bits): the ≤ 8.25 budget
    ranks on their measured 8-bit KL, while predictivity stays pooled over the widths every method ran."""
    perfect = {m: v / 3 for m, v in KL.items()}
    recs = _records(perfect, perfect)
    lean = ("a", "c", "f")  # overheads 0, 0.25, 0.125 bits
    for m in lean:
        for seed in (0, 1):
            recs.append(_rec("exp5", m, 8, seed, "real", {"e2e_prefill_kl_nats": KL[m] / 256 * (1 + 0.01 * seed),
                                                          "e2e_prefill_bits_billed": 8 + OVERHEAD[m]}))
    b = _board(recs)
    pr = b["sources"]["real"]["predictivity"]
    assert pr["pooled_settings"] == ["k2v2", "k4v4"] and "k8v8" not in pr["groups"]
    row = next(r for r in b["sources"]["real"]["headline"] if r["budget"] == 8.25)
    assert (row["method"], row["setting"]) == ("f", "k8v8")  # the lowest 8-bit KL of the three
    assert b["headline"]["metric"] == DEFAULT


def test_budget_bits_run_only_where_they_can_be_a_budget_point():
    """exp5's marker adds 8 bits for the methods whose 8-bit cache fits 8.25 bits/element: per-tensor RTN
    (two parameters per tensor) does; per-token RTN (fp16 parameters for every 64-element token) and the
    fp16 control do not."""
    pytest.importorskip("torch")
    from kvqbench.plugin.collection import BUDGET_SHAPE, fits_largest_budget

    assert BUDGET_SHAPE[-1] == 64
    assert fits_largest_budget("rtn_tensor", 8)
    assert not fits_largest_budget("rtn_token", 8) and not fits_largest_budget("fp16", 8)
    assert fits_largest_budget("rtn_token", 4)  # 4 bits + its overhead is well within 8.25


def test_terminal_table_ranks_real_data_as_the_first_screen_does():
    """The table printed after a run ranks real data on the measured KL (f before c, d, e), not on the
    tensor metric that disagrees with it, and shows that metric beside it."""
    from kvqbench.report.render.terminal import render_terminal

    perfect = {m: v / 3 for m, v in KL.items()}
    tensor = dict(perfect, f=0.9)
    text = render_terminal(_board(_records(tensor, tensor)))
    real = text.split("kvqbench [synthetic]")[0].splitlines()
    assert "ranked by end-to-end KL (e2e_prefill_kl_nats)" in real[0] and DEFAULT in real[1]
    order = [ln.split()[1] for ln in real[3:]]
    assert order == sorted(KL, key=KL.get)  # lowest KL first
