"""Rankings by the paired rule: shared ranks only for methods the paired test cannot tell apart; directions
respected."""

import math

import numpy as np
import pytest
from scipy import stats

from kvqbench.report.stats.intervals import mean_ci
from kvqbench.report.stats.ranking import rankings

CAT = {"m": {"better": "lower", "unit": "1", "experiment": "exp1", "ratio_scale": True},
       "h": {"better": "higher", "unit": "1", "experiment": "exp1", "ratio_scale": True}}


def _stats(values_by_method, name="m"):
    out = {}
    for meth, vals in values_by_method.items():
        mean, ci = mean_ci(vals)
        out[meth] = {"k2v2": {name: {"mean": mean, "ci95": ci, "n": len(vals), "seeds": list(range(len(vals))),
                                     "values": vals}}}
    return {"exp1": out}


def test_ties_do_not_chain():
    # per seed log(b/a) = 0.1 + e and log(c/b) = 0.1 − e with e = ±0.3, ±0.2, ±0.1 (paired t ≈ 1.1 on 5 df:
    # tied), so log(c/a) = 0.2 on every seed (zero variance: separated); d = 10 a (separated from all).
    e = [0.3, -0.3, 0.2, -0.2, 0.1, -0.1]
    a = [1.0, 2.0, 4.0, 0.5, 3.0, 1.5]
    b = [x * math.exp(0.1 + d) for x, d in zip(a, e)]
    c = [x * math.exp(0.1 - d) for x, d in zip(b, e)]
    st = _stats({"a": a, "b": b, "c": c, "d": [10 * x for x in a]})
    r = {x["method"]: x for x in rankings(st, CAT)["m"]["by_setting"]["k2v2"]}
    p_ab = stats.ttest_rel(np.log(b), np.log(a), alternative="greater").pvalue
    assert p_ab > 0.025  # tied before any correction
    assert r["a"]["rank"] == r["b"]["rank"] == 1 and r["c"]["rank"] == 2 and r["d"]["rank"] == 4
    assert set(r["b"]["ties"]) == {"a", "c"} and r["a"]["ties"] == ["b"] and r["d"]["ties"] == []


def test_single_seed_gives_no_verdict():
    st = _stats({"a": [0.0], "b": [0.0], "c": [2.0]})
    ranked = rankings(st, CAT)["m"]["by_setting"]["k2v2"]
    assert [x["method"] for x in ranked] == ["a", "b", "c"]  # listed by value; nothing claimed
    assert all(x["rank"] is None and x["ties"] == [] and "one shared unit" in x["no_verdict"] for x in ranked)


def test_higher_is_better_direction():
    st = _stats({"a": [1.0, 1.01], "b": [5.0, 5.01]}, name="h")
    ranked = rankings(st, CAT)["h"]["by_setting"]["k2v2"]
    assert [x["method"] for x in ranked] == ["b", "a"] and [x["rank"] for x in ranked] == [1, 2]


def test_mean_ci_closed_form():
    m, ci = mean_ci([1.0, 3.0])
    assert m == 2.0 and ci == pytest.approx(12.706204736174703 * 2 ** 0.5 / 2 ** 0.5)
    assert mean_ci([4.0, 4.0, 4.0]) == (4.0, 0.0)
    assert mean_ci([4.0]) == (4.0, None)


def test_wide_interval_never_jumps_to_rank_one():
    # "w" has the worst mean and ratios to b so uneven (1, 50, 300) that the paired test cannot separate
    # them; "a" is exact (0 on every seed), separated from both without a test
    st = _stats({"a": [0.0, 0.0, 0.0], "b": [1.0, 1.01, 1.02], "w": [1.0, 50.0, 300.0]})
    ranked = rankings(st, CAT)["m"]["by_setting"]["k2v2"]
    assert [x["method"] for x in ranked] == ["a", "b", "w"]
    assert [x["rank"] for x in ranked] == [1, 2, 2]


@pytest.mark.parametrize("vals", [[1.0, 3.0], [0.1, 0.25, 0.2], [1e-9, 3e-9, 2e-9, 7e-9, 5e-9], [5.0, -1.0] * 6])
def test_mean_ci_matches_scipy_stats_t_bit_for_bit(vals):
    """``mean_ci`` takes the quantile from ``scipy.special.stdtrit`` (cheap to import); the result equals,
    to the bit, the half-width computed with ``scipy.stats.t.ppf``."""
    import math

    from scipy.stats import t

    m, ci = mean_ci(vals)
    n = len(vals)
    var = math.fsum((v - m) ** 2 for v in vals) / (n - 1)
    assert ci == float(t.ppf(0.975, n - 1) * math.sqrt(var / n))
    assert mean_ci(vals, 0.9)[1] == float(t.ppf(0.95, n - 1) * math.sqrt(var / n))
