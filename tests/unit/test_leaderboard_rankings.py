"""Rankings: shared ranks only for methods that cannot be told apart; directions respected."""

import pytest

from kvqbench.report.stats.intervals import mean_ci
from kvqbench.report.stats.ranking import rankings

CAT = {"m": {"better": "lower", "unit": "1", "experiment": "exp1"},
       "h": {"better": "higher", "unit": "1", "experiment": "exp1"}}


def _stats(values_by_method, name="m"):
    out = {}
    for meth, vals in values_by_method.items():
        mean, ci = mean_ci(vals)
        out[meth] = {"k2v2": {name: {"mean": mean, "ci95": ci, "n": len(vals), "values": vals}}}
    return {"exp1": out}


def test_ties_do_not_chain():
    # a overlaps b, b overlaps c, but a and c are far apart: c must not share a's rank
    st = _stats({"a": [1.0, 1.02, 1.01], "b": [1.03, 1.07, 1.05], "c": [1.09, 1.11, 1.10], "d": [9.0, 9.1, 9.2]})
    r = {x["method"]: x for x in rankings(st, CAT)["m"]["by_setting"]["k2v2"]}
    assert r["a"]["rank"] == 1 and r["b"]["rank"] == 1
    assert r["c"]["rank"] == 2  # only a is significantly better than c
    assert r["d"]["rank"] == 4
    assert set(r["b"]["ties"]) == {"a", "c"} and "c" not in r["a"]["ties"]


def test_single_seed_ranks_by_value_and_exact_ties_share():
    st = _stats({"a": [0.0], "b": [0.0], "c": [2.0]})
    r = {x["method"]: x["rank"] for x in rankings(st, CAT)["m"]["by_setting"]["k2v2"]}
    assert r == {"a": 1, "b": 1, "c": 3}


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
    # "w" has the worst mean and a CI so wide that nothing is significantly better than it
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
