"""kvqbench.report.stats.paired against independent values: scipy's one-sample t-test on the differences
and the closed-form t interval, Holm and McNemar computed by hand, simulations with known effects (rank
intervals cover the known order; the rule's power matches the noncentral-t power)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy import stats

from kvqbench.report.stats.paired import (
    ALPHA,
    PAIRED_TEST,
    aligned,
    budget_verdict,
    compare_gate,
    holm,
    log_differences,
    mcnemar_exact,
    paired_ranking,
    paired_ratio,
    rank_intervals,
    shared_units,
)

#: per-window sd of log(KL_a / KL_b) between two methods at the same bit width, estimated from the
#: published exp5 values (3 windows): root mean square over the 93 same-bit-width method pairs, 0.21 on
#: SmolLM2 and 0.32 on Gemma (medians 0.17 and 0.20). The simulations use Gemma's, the larger.
SD_LOG_DIFF = 0.32
TRUE_RATIO = 1.3


def _positive(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.exp(rng.normal(0.0, 1.0, n))


# ------------------------------------------------------------------ paired ratio


def test_paired_ratio_is_scipys_one_sample_t_on_log_differences():
    rng = np.random.default_rng(3)
    best = _positive(rng, 16)
    other = best * np.exp(0.2 + 0.3 * rng.standard_normal(16))
    got = paired_ratio(best, other)
    d = np.log(other) - np.log(best)
    n, mean, sd = d.size, d.mean(), d.std(ddof=1)
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)  # closed-form Student-t interval
    assert got["n_units"] == 16
    assert got["ratio"] == pytest.approx(stats.gmean(other) / stats.gmean(best), rel=1e-12)
    assert got["ratio_ci95"] == pytest.approx([math.exp(mean - half), math.exp(mean + half)], rel=1e-12)
    assert got["p"] == pytest.approx(stats.ttest_1samp(d, 0.0, alternative="greater").pvalue, rel=1e-10)


def test_paired_ratio_degenerate_cases():
    assert paired_ratio([2.0], [3.0]) == {"n_units": 1, "ratio": pytest.approx(1.5), "ratio_ci95": None, "p": None}
    # a deterministic method on data that does not change with the seed: the same values on every unit,
    # so every log difference is the same float (zero variance; the t statistic's limit decides)
    same = paired_ratio([1.5, 1.5, 1.5], [3.0, 3.0, 3.0])
    assert same["ratio"] == pytest.approx(2.0) and same["ratio_ci95"] == [same["ratio"], same["ratio"]]
    assert same["p"] == 0.0
    assert paired_ratio([3.0, 3.0, 3.0], [1.5, 1.5, 1.5])["p"] == 1.0
    assert paired_ratio([1.0, 2.0], [1.0, 2.0])["p"] == 1.0


def test_exact_zeros_on_both_sides_are_a_zero_difference_and_one_sided_zero_raises():
    assert log_differences([0.0, 1.0], [0.0, math.e]).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="positive"):
        log_differences([0.0, 1.0], [0.5, 1.0])
    with pytest.raises(ValueError, match="finite"):
        log_differences([math.nan, 1.0], [1.0, 1.0])
    # a unit exact on both sides adds a zero difference to the t-test (scipy on the same differences)
    got = paired_ratio([0.0, 1.0, 2.0, 3.0], [0.0, 1.5, 2.5, 4.0])
    d = [0.0, math.log(1.5), math.log(2.5 / 2), math.log(4 / 3)]
    assert got["p"] == pytest.approx(stats.ttest_1samp(d, 0.0, alternative="greater").pvalue, rel=1e-10)


positive_lists = st.lists(st.floats(1e-6, 1e6), min_size=2, max_size=20)


@settings(max_examples=60, deadline=None)
@given(positive_lists, st.data())
def test_ratio_ci_contains_the_ratio_and_swapping_roles_inverts_it(best, data):
    factors = data.draw(st.lists(st.floats(0.05, 20.0), min_size=len(best), max_size=len(best)))
    other = [b * f for b, f in zip(best, factors)]
    d = log_differences(best, other)
    assume(np.ptp(d) > 1e-6)  # a spread the t-test resolves (zero variance has its own rule)
    fwd, back = paired_ratio(best, other), paired_ratio(other, best)
    lo, hi = fwd["ratio_ci95"]
    assert lo <= fwd["ratio"] * (1 + 1e-12) and fwd["ratio"] <= hi * (1 + 1e-12)
    assert back["ratio"] == pytest.approx(1 / fwd["ratio"], rel=1e-9)
    assert back["ratio_ci95"] == pytest.approx([1 / hi, 1 / lo], rel=1e-9)
    assert back["p"] == pytest.approx(1 - fwd["p"], abs=1e-12)  # the two one-sided tails of one t statistic


# ------------------------------------------------------------------ Holm


def test_holm_on_a_hand_computed_example():
    # m = 4 raw p-values 0.01, 0.04, 0.03, 0.005. Sorted: 0.005, 0.01, 0.03, 0.04, multiplied by
    # m, m-1, m-2, m-3 = 4, 3, 2, 1: 0.020, 0.030, 0.060, 0.040; running maximum: 0.020, 0.030, 0.060,
    # 0.060. Back in input order: 0.03, 0.06, 0.06, 0.02. At α = 0.05 Holm rejects 0.005 (≤ 0.05/4) and
    # 0.01 (≤ 0.05/3), then stops at 0.03 (> 0.05/2), so 0.04 is kept too although 0.04 ≤ 0.05/1.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)
    assert holm([0.5, None]) == [1.0, None]  # an undefined test counts in m as p = 1
    assert holm([0.4, 0.6]) == pytest.approx([0.8, 0.8])  # capped monotone, ≤ 1
    assert holm([]) == []


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12), st.sampled_from([0.01, 0.05, 0.1]))
def test_holm_rejects_exactly_what_the_sequential_procedure_rejects(p, alpha):
    # Holm's procedure as he states it: walk up the sorted p-values, reject p_(i) while p_(i) ≤ α/(m−i+1)
    m, rejected = len(p), set()
    for i, j in enumerate(sorted(range(m), key=lambda k: p[k])):
        if p[j] > alpha / (m - i):
            break
        rejected.add(j)
    adj = holm(p)
    assert {j for j in range(m) if adj[j] <= alpha} == rejected
    assert all(a >= q for a, q in zip(adj, p))


# ------------------------------------------------------------------ McNemar


def test_mcnemar_exact_against_a_hand_computed_binomial_tail():
    # 10 discordant trials: best alone passes 8, other alone passes 2; plus 5 both pass, 3 both fail.
    # One-sided p = P(X ≥ 8), X ~ Binomial(10, 1/2) = (C(10,8) + C(10,9) + C(10,10)) / 2^10 = 56/1024;
    # two-sided = 2 · 56/1024 (the distribution is symmetric).
    best = [True] * 8 + [False] * 2 + [True] * 5 + [False] * 3
    other = [False] * 8 + [True] * 2 + [True] * 5 + [False] * 3
    got = mcnemar_exact(best, other)
    assert (got["n_trials"], got["best_only"], got["other_only"]) == (18, 8, 2)
    assert got["p"] == pytest.approx(56 / 1024, rel=1e-12)
    assert mcnemar_exact(best, other, alternative="two-sided")["p"] == pytest.approx(112 / 1024, rel=1e-12)
    assert mcnemar_exact([True, False], [True, False])["p"] == 1.0  # nothing discordant
    with pytest.raises(ValueError):
        mcnemar_exact([True], [True, False])


# ------------------------------------------------------------------ alignment


def test_shared_units_and_alignment():
    per = {"a": {0: 1.0, 1: 2.0, 2: 3.0}, "b": {2: 6.0, 1: 5.0, 3: 1.0}, "c": {1: 7.0, 2: math.nan, 0: 1.0}}
    assert shared_units(per) == [1]
    assert shared_units({"a": per["a"], "b": per["b"]}) == [1, 2]
    assert aligned({"a": per["a"], "b": per["b"]}).tolist() == [[2.0, 3.0], [5.0, 6.0]]
    assert shared_units({}) == []


# ------------------------------------------------------------------ rank intervals (bootstrap)


def test_rank_intervals_are_degenerate_for_methods_well_separated_under_pairing():
    # window effects (sd 2) dwarf the method offsets (0.3 apart) so marginal intervals overlap, but
    # every window orders the methods the same way: the paired bootstrap gives exact ranks
    rng = np.random.default_rng(5)
    w = rng.normal(0.0, 2.0, 16)
    x = w + np.array([0.0, 0.3, 0.6, 0.9])[:, None] + 0.05 * rng.standard_normal((4, 16))
    iv, p_best = rank_intervals(x)
    assert iv == [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert p_best == [1.0, 0.0, 0.0, 0.0]
    assert rank_intervals(x, seed=0) == rank_intervals(x, seed=0)


def test_rank_intervals_cover_a_known_order_and_are_wide_for_identical_methods():
    rng = np.random.default_rng(11)
    reps, offsets = 200, np.array([0.0, 0.1, 0.2, 0.3])
    covered, widths, p_best_sum = np.zeros(4), [], np.zeros(4)
    for r in range(reps):
        w = rng.normal(0.0, 1.0, 16)
        iv, _ = rank_intervals(w + offsets[:, None] + 0.3 * rng.standard_normal((4, 16)), n_boot=500, seed=r)
        covered += [lo <= k + 1 <= hi for k, (lo, hi) in enumerate(iv)]
        iv, p = rank_intervals(w + 0.3 * rng.standard_normal((4, 16)), n_boot=500, seed=r)  # exchangeable
        widths += [hi - lo for lo, hi in iv]
        p_best_sum += p
    assert np.all(covered / reps >= 0.95)  # the true rank lies in the 95% interval
    assert np.median(widths) >= 2  # identical methods: most intervals span 3 or 4 of the 4 ranks
    # by symmetry each of four exchangeable methods ranks first a quarter of the time
    assert np.all(np.abs(p_best_sum / reps - 0.25) < 4 * math.sqrt(0.25 * 0.75 / reps))


# ------------------------------------------------------------------ the budget verdict


def test_budget_verdict_tests_every_candidate_one_sided_against_the_lowest_mean_log():
    rng = np.random.default_rng(2)
    w = rng.normal(0.0, 0.5, 16)
    true = {"a": 0.0, "b": 0.05, "c": math.log(1.6), "d": math.log(3.0)}
    cand = {k: dict(enumerate(np.exp(w + m + 0.3 * rng.standard_normal(16)))) for k, m in true.items()}
    v = budget_verdict(cand, n_boot=500)
    logs = {k: np.log([cand[k][u] for u in range(16)]) for k in cand}
    order = sorted(logs, key=lambda k: logs[k].mean())
    assert v["best"] == order[0] and [c["key"] for c in v["comparisons"]] == order[1:]
    ps = [stats.ttest_1samp(logs[k] - logs[order[0]], 0.0, alternative="greater").pvalue for k in order[1:]]
    assert [c["p"] for c in v["comparisons"]] == pytest.approx(ps, rel=1e-10)
    assert [c["p_holm"] for c in v["comparisons"]] == pytest.approx(holm(ps), rel=1e-10)
    assert [c["tied"] for c in v["comparisons"]] == [p > ALPHA for p in holm(ps)]
    assert v["n_units"] == 16 and v["units"] == list(range(16))
    assert v["rank_interval"][0] == 1 and 0.0 <= v["p_best"] <= 1.0


def test_paired_verdict_separates_what_overlapping_marginal_intervals_call_tied():
    # a 1.66× ratio on every window, windows differing by up to 3×: the marginal 95% t intervals overlap
    w = np.array([0.40, 0.60, 0.46, 1.20, 0.75, 0.52])
    wobble = np.array([1.02, 0.97, 1.01, 0.99, 1.03, 0.98])
    cand = {"a": dict(enumerate(w)), "b": dict(enumerate(1.66 * w * wobble))}

    def interval(v):
        return stats.t.interval(0.95, len(v) - 1, loc=np.mean(v), scale=stats.sem(v))

    assert interval(1.66 * w * wobble)[0] < interval(w)[1]  # the old overlap rule would call them tied
    v = budget_verdict(cand, n_boot=200)
    assert v["best"] == "a" and v["comparisons"][0]["tied"] is False
    assert v["comparisons"][0]["ratio_ci95"][0] > 1.0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 20), st.floats(0.0, 1.0))
def test_a_separated_comparison_always_has_its_95_ratio_interval_above_1(seed, n, effect):
    # α = 0.025 one-sided is the two-sided 5 % level: Holm-adjusted p ≤ α implies raw p ≤ α, which for a
    # t statistic is exactly "the two-sided 95 % t interval lies above 0" (scipy's interval, independent)
    rng = np.random.default_rng(seed)
    w = rng.normal(0.0, 1.0, n)
    cand = {k: dict(enumerate(np.exp(w + m + 0.3 * rng.standard_normal(n))))
            for k, m in {"a": 0.0, "b": effect, "c": 2 * effect}.items()}
    for c in budget_verdict(cand, n_boot=20)["comparisons"]:
        if not c["tied"]:
            assert c["ratio_ci95"][0] > 1.0
    assert ALPHA == 0.025


def test_budget_verdict_edge_cases():
    one = budget_verdict({"a": {0: 1.0, 1: 2.0}})
    assert one["comparisons"] == [] and one["rank_interval"] == [1, 1] and one["p_best"] == 1.0
    single_unit = budget_verdict({"a": {0: 1.0}, "b": {0: 5.0}})
    assert single_unit["comparisons"][0]["p"] is None and single_unit["comparisons"][0]["tied"] is True
    with pytest.raises(ValueError, match="share no unit"):
        budget_verdict({"a": {0: 1.0}, "b": {1: 1.0}})
    with pytest.raises(ValueError, match="positive"):
        budget_verdict({"a": {0: 0.0, 1: 1.0}, "b": {0: 1.0, 1: 2.0}})
    with pytest.raises(ValueError):
        budget_verdict({})
    assert PAIRED_TEST["alpha"] == ALPHA and PAIRED_TEST["correction"] == "Holm"


# ------------------------------------------------------------------ power


def _separation_rate(n_windows: int, draws: int, seed: int) -> float:
    """Fraction of simulated draws in which the rule names the truly better method best and not tied."""
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(draws):
        kl_best = np.exp(rng.normal(-0.5, 0.5, n_windows))  # window difficulty, shared
        kl_other = kl_best * np.exp(math.log(TRUE_RATIO) + SD_LOG_DIFF * rng.standard_normal(n_windows))
        v = budget_verdict({"best": dict(enumerate(kl_best)), "other": dict(enumerate(kl_other))}, n_boot=50)
        hits += v["best"] == "best" and not v["comparisons"][0]["tied"]
    return hits / draws


def _t_power(n_windows: int) -> float:
    """Power of the one-sided paired t-test at level α: the noncentral t distribution (second route)."""
    df = n_windows - 1
    nc = math.log(TRUE_RATIO) * math.sqrt(n_windows) / SD_LOG_DIFF
    return float(stats.nct.sf(stats.t.ppf(1 - ALPHA, df), df, nc))


@pytest.mark.parametrize("n_windows", [16, 3])
def test_power_at_a_true_ratio_of_1_3(n_windows):
    draws = 600
    rate = _separation_rate(n_windows, draws, seed=n_windows)
    power = _t_power(n_windows)
    assert abs(rate - power) < 4 * math.sqrt(power * (1 - power) / draws)
    if n_windows == 16:
        # 16 windows: the 1.3× method is separated in most draws (analytic 0.87 at one-sided α = 0.025)
        assert power > 0.85 and rate > 0.8
    else:
        assert rate < 0.35  # 3 windows: a 1.3× difference is missed in most draws (analytic 0.14)


def test_two_identical_methods_are_separated_at_twice_alpha():
    # the best is chosen by the data (the lower mean), so the one-sided test against it rejects whenever
    # |t| > t_(1-α): under "no difference" that happens with probability exactly 2α (t is symmetric)
    rng, draws, n = np.random.default_rng(21), 1000, 16
    false = 0
    for _ in range(draws):
        kl = np.exp(rng.normal(-0.5, 0.5, n))
        twin = kl * np.exp(SD_LOG_DIFF * rng.standard_normal(n))
        v = budget_verdict({"a": dict(enumerate(kl)), "b": dict(enumerate(twin))}, n_boot=20)
        false += not v["comparisons"][0]["tied"]
    expected = float(2 * stats.t.sf(stats.t.ppf(1 - ALPHA, n - 1), n - 1))
    assert expected == pytest.approx(2 * ALPHA)
    assert abs(false / draws - expected) < 4 * math.sqrt(expected * (1 - expected) / draws)


# ------------------------------------------------------------------ the compare gate


def test_compare_gate_fails_only_beyond_the_paired_interval():
    rng = np.random.default_rng(9)
    base = _positive(rng, 16)
    noisy = base * np.exp(0.05 * rng.standard_normal(16))  # run-to-run noise, no change
    worse = base * np.exp(math.log(1.2) + 0.05 * rng.standard_normal(16))
    for new in (noisy, worse):
        got = compare_gate(dict(enumerate(base)), dict(enumerate(new)))
        want = paired_ratio(base, new)
        assert got["ratio"] == pytest.approx(want["ratio"]) and got["ratio_ci95"] == pytest.approx(want["ratio_ci95"])
        assert got["worse"] is (want["ratio_ci95"][0] > 1.0)
    assert compare_gate(dict(enumerate(base)), dict(enumerate(worse)))["worse"] is True


def test_compare_gate_exact_zeros():
    fp16 = {0: 0.0, 1: 0.0, 2: 0.0}
    same = compare_gate(fp16, fp16)
    assert same["ratio"] == 1.0 and same["ratio_ci95"] == [1.0, 1.0] and same["worse"] is False
    lost = compare_gate(fp16, {0: 0.0, 1: 1e-9, 2: 0.0})
    assert lost["worse"] is True and lost["ratio"] == math.inf and lost["exact_lost"] == [1]
    gained = compare_gate({0: 1.0, 1: 2.0}, {0: 0.0, 1: 0.0})
    assert gained["worse"] is False and gained["ratio"] == 0.0
    assert compare_gate({0: 1.0}, {0: 3.0})["worse"] is None  # one unit: no interval, the threshold decides


# ------------------------------------------------------------------ ranking tables


def _sequential_holm_separated(p: dict, alpha: float) -> set:
    """Holm's procedure as the textbook states it: sort ascending, reject while p_(i) ≤ α / (m − i + 1)."""
    out, m = set(), len(p)
    for i, (pair, v) in enumerate(sorted(p.items(), key=lambda kv: kv[1])):
        if v > alpha / (m - i):
            break
        out.add(pair)
    return out


def test_paired_ranking_hand_example():
    # a = [1, 2, 4]; b = 2a on every seed (log ratio 0.693, zero variance: separated, p = 0) although
    # their marginal 95 % intervals overlap widely; c = a × [1.5, 0.7, 1.2] (mean log ratio 0.077: tied
    # with a). Listed by mean log: a, c, b. c–b: log(2 / [1.5, 0.7, 1.2]) has t ≈ 2.7 on 2 df, one-sided
    # p ≈ 0.06: not separated after Holm over the 3 pairs. Ranks: a 1, c 1, b 1 + 1 (only a is separated
    # from it and better).
    a = np.array([1.0, 2.0, 4.0])
    vals = {"b": 2 * a, "a": a, "c": a * np.array([1.5, 0.7, 1.2])}
    r = paired_ranking({k: dict(enumerate(v)) for k, v in vals.items()}, ratio_scale=True)
    assert r["n_units"] == 3 and r["no_verdict"] is None
    assert [(x["key"], x["rank"], sorted(x["ties"])) for x in r["rows"]] == [
        ("a", 1, ["c"]), ("c", 1, ["a", "b"]), ("b", 2, ["c"])]
    p_cb = stats.ttest_rel(np.log(vals["b"]), np.log(vals["c"]), alternative="greater").pvalue
    assert 0.025 / 2 < p_cb < 0.1  # not separated even before Holm's smallest step, 0.025 / 3
    ci = [stats.t.interval(0.95, 2, loc=np.mean(v), scale=stats.sem(v)) for v in (vals["a"], vals["b"])]
    assert ci[1][0] < ci[0][1]  # the overlap rule would have called a and b tied


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(3, 12), st.integers(2, 6), st.sampled_from(["lower", "higher"]))
def test_paired_ranking_is_scipys_paired_t_with_holm_over_every_pair(seed, n, k, better):
    rng = np.random.default_rng(seed)
    unit = rng.normal(0.0, 1.0, n)  # shared difficulty: cancels in the pairs
    effects = rng.normal(0.0, 0.3, k)
    logs = {f"m{i}": unit + effects[i] + rng.normal(0.0, 0.2, n) for i in range(k)}
    r = paired_ranking({m: dict(enumerate(np.exp(v))) for m, v in logs.items()}, ratio_scale=True, better=better)
    bad = {m: (-v if better == "higher" else v) for m, v in logs.items()}
    order = sorted(bad, key=lambda m: (np.mean(bad[m]), m))
    assert [x["key"] for x in r["rows"]] == order
    p = {(a, b): stats.ttest_rel(bad[b], bad[a], alternative="greater").pvalue
         for j, b in enumerate(order) for a in order[:j]}
    sep = _sequential_holm_separated(p, ALPHA)
    for j, x in enumerate(r["rows"]):
        m = x["key"]
        assert set(x["ties"]) == {o for o in order if o != m and (o, m) not in sep and (m, o) not in sep}
        want = 1 + sum((o, m) in sep for o in order[:j])
        assert x["rank"] == max([want] + [y["rank"] for y in r["rows"][:j]])


def test_paired_ranking_raw_scale_exact_rows_and_no_verdict():
    # raw scale (a signed metric, better "zero": |value|): d = |x_b| − |x_a| per unit, scipy's paired t
    sgn = {"a": [0.1, -0.12, 0.11, -0.09], "b": [0.5, -0.7, 0.52, 0.61]}
    r = paired_ranking({k: dict(enumerate(v)) for k, v in sgn.items()}, ratio_scale=False, better="zero")
    p = stats.ttest_rel(np.abs(sgn["b"]), np.abs(sgn["a"]), alternative="greater").pvalue
    assert p < 0.025 and [(x["key"], x["rank"], x["ties"]) for x in r["rows"]] == [("a", 1, []), ("b", 2, [])]
    # exact rows (0 at every unit) on a ratio-scale damage metric: separated from the rest, tied together,
    # never tested (a raw test of 0 against a noisy positive method would call them tied)
    ex = {"fp16": [0.0, 0.0, 0.0], "z": [0.0, 0.0, 0.0], "w": [1.0, 50.0, 300.0]}
    r = paired_ranking({k: dict(enumerate(v)) for k, v in ex.items()}, ratio_scale=True)
    assert [(x["key"], x["rank"], x["ties"]) for x in r["rows"]] == [("fp16", 1, ["z"]), ("z", 1, ["fp16"]),
                                                                     ("w", 3, [])]
    # one shared unit: no verdict, no rank
    r = paired_ranking({"a": {0: 1.0, 1: 2.0}, "b": {0: 3.0}}, ratio_scale=True)
    assert r["n_units"] == 1 and "one shared unit" in r["no_verdict"]
    assert [(x["key"], x["rank"], x["ties"]) for x in r["rows"]] == [("a", None, []), ("b", None, [])]


def test_the_statistics_import_neither_torch_nor_the_rest_of_the_report():
    code = ("import sys, kvqbench.report.stats.paired; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvqbench.report')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(["kvqbench.report", "kvqbench.report.stats", "kvqbench.report.stats.paired"])
