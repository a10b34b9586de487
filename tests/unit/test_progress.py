"""Progress/ETA bookkeeping (kvqbench/progress.py) and the ETA scorer (scripts/eta_error.py).

Closed forms on hand-built sessions, and a simulated two-worker session on a fake clock whose true end
is known: from 20 % of the run on the ETA must be within ±30 % of the truth."""

from __future__ import annotations

import importlib.util
import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench.eta_tables import HISTORY_NEW, HISTORY_VERSION, coarse_kind_of, kind_of, run_scale
from kvqbench.progress import Progress, hms

ROOT = Path(__file__).resolve().parents[2]


def _eta_script():
    spec = importlib.util.spec_from_file_location("eta_error", ROOT / "scripts" / "eta_error.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_hms_and_line_format():
    assert (hms(3725), hms(95), hms(7), hms(-1)) == ("1h02m05s", "1m35s", "7s", "0s")
    assert Progress(total=5, t0=0.0).line(3725.0) == ("kvqbench: 0/5 tests, elapsed 1h02m05s, ETA ? (no recorded "
                                                      "duration for these tests yet: an estimate follows the first "
                                                      "to finish)")


@settings(max_examples=200, deadline=None)
@given(interval=st.sampled_from([0.5, 2.0, 10.0]),
       gaps=st.lists(st.floats(min_value=0.0, max_value=40.0), min_size=1, max_size=80))
def test_progress_lines_come_at_a_steady_interval_whatever_the_reports_do(interval, gaps):
    """The printer (a clock ticking every ``tick`` s) and the test reports (at arbitrary times) share
    :meth:`Progress.line_due`: lines are never closer than the interval, never further apart than
    ``LATE_FACTOR`` intervals plus a tick, and the printer never speaks within the quiet window after a
    report (pytest's dots)."""
    from kvqbench.progress import LATE_FACTOR, QUIET_S
    tick = min(0.5, interval / 4)
    reports, t = [], 0.0
    for g in gaps:
        t += g * interval / 10
        reports.append(t)
    end = reports[-1] + 3 * interval
    p = Progress(interval_s=interval, total=1, t0=0.0)
    p.last = 0.0  # the first line
    lines, events = [0.0], sorted([(r, 0) for r in reports] + [(k * tick, 1) for k in range(1, int(end / tick) + 1)])
    for now, clock in events:
        if not clock:
            p.last_report = now
        if p.line_due(now, at_report=not clock):
            assert clock == 0 or now - p.last_report >= min(QUIET_S, interval / 2) - 1e-9
            p.last = now
            lines.append(now)
    gaps_out = [b - a for a, b in zip(lines, lines[1:])]
    assert all(g >= interval - 1e-9 for g in gaps_out)
    assert all(g <= LATE_FACTOR * interval + tick + 1e-9 for g in gaps_out), gaps_out
    assert end - lines[-1] <= LATE_FACTOR * interval + tick + 1e-9
    assert not Progress(interval_s=0.0, total=1).line_due(100.0, at_report=True)


def test_kinds_separate_method_and_data_size():
    cell = "tests/bench/t.py::test_a[kivi-k2v2-seed0-real-full]"
    assert kind_of(cell) == "tests/bench/t.py::test_a|kivi|real-full"
    assert coarse_kind_of(cell) == "tests/bench/t.py::test_a|real-full"
    assert kind_of("tests/unit/t.py::test_b[3-x]") == "tests/unit/t.py::test_b"


def test_weighted_median_and_schedule_closed_forms():
    from kvqbench.eta_tables import weighted_median
    from kvqbench.progress import schedule_end

    assert weighted_median([3.0, 1.0, 2.0], [1.0, 1.0, 1.0]) == 2.0
    assert weighted_median([1.0, 10.0], [1.0, 3.0]) == 10.0  # the heavy value holds most of the weight
    with pytest.raises(ValueError):
        weighted_median([], [])
    assert schedule_end([], [1.0, 2.0, 3.0], 1) == 6.0  # serial: the sum
    assert schedule_end([], [1.0] * 10 + [20.0], 2) == 25.0  # the tail: one worker runs the last long test
    assert schedule_end([3.0], [1.0] * 4, 2) == 4.0  # one worker busy 3 s: the other takes three, then one more
    assert schedule_end([5.0, 1.0], [], 2) == 5.0  # nothing pending: the longest running test
    with pytest.raises(ValueError):
        schedule_end([], [1.0], 0)


def test_without_any_table_pending_tests_are_charged_their_kinds_median():
    ids = [f"t.py::test_a[m-k2v2-seed{i}-synthetic-full]" for i in range(10)] + \
          [f"t.py::test_a[m-k2v2-seed{i}-real-full]" for i in range(10)]
    p = Progress(interval_s=0, t0=0.0, t_run=0.0, workers=1, trace_path=None)
    p.collected(ids)
    assert p.total == 20 and p.expected_steps == {"capture|real-full": 1, "report|real-full,synthetic-full": 1}
    assert p.eta(0.0) is None  # nothing to go on
    for i in range(10):  # the synthetic cells ran first: 1 s each
        p.finished(ids[i], 1.0)
    # the real cells: this run's median of everything (1 s) each; the capture: nothing known yet
    assert p.eta(10.0) == pytest.approx(10 * 1.0)
    p.step("capture|real-full", 30.0)  # paid inside the first real cell, not part of its 9 s
    p.finished(ids[10], 9.0)
    assert p.eta(49.0) == pytest.approx(9 * 9.0)  # the kind's median now; the only capture is done


def test_prior_on_a_constant_speed_machine_gives_the_exact_eta():
    """A machine 2× slower than the prior, serial: after the first test the ETA is the exact rest."""
    ids = [f"t.py::test_{c}[{i}]" for c in "abc" for i in range(5)]
    cost = {n: {"a": 0.5, "b": 3.0, "c": 12.0}[n[11]] for n in ids}
    prior = {"version": 1, "tests": dict(cost), "kinds": {}, "steps": {"report|no-cells": 4.0}}
    p = Progress(interval_s=0, t0=0.0, t_run=0.0, workers=1, prior=prior, trace_path=None)
    p.collected(ids)
    assert p.eta(0.0) == pytest.approx(sum(cost.values()) + 4.0)  # the prior alone before any test
    now, truth_end = 0.0, 2.0 * sum(cost.values()) + 2.0 * 4.0
    for n in ids:
        p.started(n, now)
        now += 2.0 * cost[n]
        p.finished(n, 2.0 * cost[n], now)
        assert p.eta(now) == pytest.approx(truth_end - now)
    assert p.speed() == pytest.approx(2.0)


def test_two_workers_constant_speed_eta_is_exact_mid_test_and_in_the_tail():
    """Two workers dealt tests in collection order as they free up (xdist's load scheduling), a machine
    1.5× slower than the prior and a last long test: the ETA sampled at any instant is the true rest."""
    ids = [f"t.py::test_x[{i}]" for i in range(12)] + ["t.py::test_long"]
    cost = {n: (1.0 + (i % 3)) for i, n in enumerate(ids)}
    cost["t.py::test_long"] = 20.0
    prior = {"version": 1, "tests": dict(cost), "kinds": {}, "steps": {}}
    c = 1.5
    free, events = [0.0, 0.0], []
    for n in ids:
        w = min(range(2), key=lambda i: free[i])
        events.append((free[w], "start", n))
        free[w] += c * cost[n]
        events.append((free[w], "end", n))
    end = max(free)
    p = Progress(interval_s=0, t0=0.0, t_run=0.0, workers=2, prior=prior, trace_path=None)
    p.collected(ids)
    events.sort(key=lambda e: (e[0], e[1] == "start"))
    t, checked = 0.25, 0
    for at, what, n in events:
        while t < at:
            if p.done >= 1:
                assert p.eta(t) == pytest.approx(end - t), (t, p.debug)
                checked += 1
            t += 0.5
        if what == "start":
            p.started(n, at)
        else:
            p.finished(n, c * cost[n], at)
    assert checked > 20


def test_tests_already_sent_to_a_worker_stay_there():
    """xdist has sent worker A two more 3 s tests behind its running one (5 s left); worker B is idle and
    only a 1 s test is unsent: A finishes at 5 + 3 + 3, whatever B does."""
    ids = ["t.py::test_r", "t.py::test_a", "t.py::test_b", "t.py::test_c"]
    prior = {"version": 1, "tests": {"t.py::test_r": 8.0, "t.py::test_a": 3.0, "t.py::test_b": 3.0,
                                     "t.py::test_c": 1.0}, "kinds": {}, "steps": {}}
    p = Progress(interval_s=0, workers=2, prior=prior, trace_path=None)
    p.collected(ids)
    p.started(ids[0], 0.0)
    assert p.eta(3.0) == pytest.approx(5.0 + 1.0)  # not knowing the queues: a, b, c dealt to both workers
    p.set_queues([ids[:3], []], 3.0)
    assert p.eta(3.0) == pytest.approx(5.0 + 3.0 + 3.0)
    p.set_queues(None)
    assert p.eta(3.0) == pytest.approx(6.0)


def test_a_running_test_the_queues_do_not_list_runs_on_the_worker_whose_queue_ran_dry():
    """The queues were read before r was sent: worker A's listed work (x) is done and it runs r (4 s);
    B runs b (2 s of its 3 s left) then c (3 s); the unsent d (6 s) goes to A when r ends: 1 + 4 + 6 —
    not to a third, imaginary worker (which would give 1 + 6)."""
    cost = {"t.py::test_r": 4.0, "t.py::test_b": 3.0, "t.py::test_c": 3.0, "t.py::test_d": 6.0,
            "t.py::test_x": 1.0}
    prior = {"version": 1, "tests": cost, "kinds": {}, "steps": {}}
    p = Progress(interval_s=0, workers=2, prior=prior, trace_path=None)
    p.collected(list(cost))
    p.started("t.py::test_x", 0.0)
    p.started("t.py::test_b", 0.0)
    p.set_queues([["t.py::test_x"], ["t.py::test_b", "t.py::test_c"]], 0.0)
    p.finished("t.py::test_x", 1.0, 1.0)
    p.started("t.py::test_r", 1.0)
    assert p.eta(1.0) == pytest.approx(4.0 + 6.0)


def test_report_step_scales_with_the_cells_and_the_runs_speed():
    """The table's report took 10 s for 100 cells; this run has 50 cells and runs 2× slower: 10 s.
    A report kind the table lacks is charged the table's seconds per cell: 0.1 × 50 × 2."""
    ids = [f"t.py::test_a[m-k2v2-seed{i}-real-full]" for i in range(50)]
    for kind, expected in (("report|real-full", 10.0), ("report|other-sources", 10.0)):
        prior = {"version": 1, "tests": {n: 1.0 for n in ids}, "kinds": {},
                 "steps": {kind: 10.0}, "step_cells": {kind: 100}}
        p = Progress(interval_s=0, t0=0.0, t_run=0.0, workers=1, prior=prior, trace_path=None)
        p.collected(ids)
        assert p.cells == 50
        p.finished(ids[0], 2.0, 2.0)
        assert p.eta(2.0) == pytest.approx(49 * 2.0 + expected)
    assert p.updated_history()["step_cells"] == {}  # no report measured yet
    p.step("report|real-full", 12.0)
    assert p.updated_history()["step_cells"] == {}  # a run that did not finish its tests keeps no report
    for n in ids[1:]:
        p.finished(n, 2.0)
    assert p.updated_history()["step_cells"]["report|real-full"] == 50


def test_plugin_reads_the_xdist_queues_and_falls_back_to_none():
    from types import SimpleNamespace

    from kvqbench.plugin.progress import xdist_queues

    sched = SimpleNamespace(collection=["a", "b", "c", "d"], node2pending={"gw0": [0, 2], "gw1": [3]})
    pm = SimpleNamespace(get_plugin=lambda name: SimpleNamespace(sched=sched) if name == "dsession" else None)
    assert xdist_queues(SimpleNamespace(pluginmanager=pm)) == [["a", "c"], ["d"]]
    serial = SimpleNamespace(pluginmanager=SimpleNamespace(get_plugin=lambda name: None))
    assert xdist_queues(serial) is None


def test_history_overrides_the_prior_and_unknown_tests_fall_back_to_their_file():
    prior = {"version": 1, "tests": {"t.py::test_a": 10.0, "t.py::test_b": 2.0, "u.py::test_c": 7.0},
             "kinds": {"v.py::test_d": 3.0}, "steps": {}}
    hist = {"version": 1, "tests": {"t.py::test_a": 4.0}, "kinds": {}, "steps": {}}
    p = Progress(prior=prior, history=hist, trace_path=None)
    assert p.base("t.py::test_a") == 4.0  # this machine's history first
    assert p.base("t.py::test_b") == 2.0  # the prior for what the history lacks
    assert p.base("v.py::test_d[3]") == 3.0  # the kind's median
    assert p.base("t.py::test_new") == pytest.approx(3.0)  # median of its file (history 4, prior 2)
    assert p.base("w.py::test_e") is None


def test_a_method_the_tables_lack_is_charged_its_functions_median_at_its_data_size():
    """A third-party method's cells: the median over the methods the tables know of the same test function
    and data source/size — not the file's median, which mixes smoke cells with full ones."""
    f = "tests/bench/x.py::test_a"
    kinds = {f"{f}|kivi|real-full": 6.0, f"{f}|rtn_token|real-full": 2.0, f"{f}|quarot|real-full": 3.0,
             f"{f}|kivi|synthetic-smoke": 0.01, f"{f}|quarot|synthetic-smoke": 0.03}
    prior = {"version": 1, "tests": {f"{f}[kivi-k2v2-seed0-synthetic-smoke]": 0.01}, "kinds": kinds, "steps": {}}
    p = Progress(prior=prior, trace_path=None)
    assert p.base(f"{f}[mine-k2v2-seed0-real-full]") == 3.0
    assert p.base(f"{f}[mine-k2v2-seed0-synthetic-smoke]") == pytest.approx(0.02)
    assert p.base(f"{f}[mine-k2v2-seed0-real-smoke]") == 0.01  # no such data size there: the file's median


def test_a_kind_whose_table_entry_is_off_by_2x_is_corrected_after_a_few_of_its_tests():
    """Two kinds in two files of one folder, alternating; the table says 1 s for both, a takes 1 s and b
    2 s (its code got slower). Each file's and kind's recent speed is its own ratio exactly (its first
    test sets it, the rest agree); the run's and the folder's lie between (log 1 .. log 2), and with n
    tests of each the file and the kind weigh n / (n + 2) each over them, so each charge is within a
    factor 2^((2 / (n + 2))²) of its truth, on the side of the other kind."""
    from kvqbench.progress import SHRINK_N

    ids = [f"d/{c}.py::test_{c}[{i}]" for i in range(8) for c in "ab"]
    prior = {"version": 1, "tests": {n: 1.0 for n in ids}, "kinds": {}, "steps": {}}
    p = Progress(interval_s=0, workers=1, prior=prior, trace_path=None)
    p.collected(ids)
    n = 6
    for node in ids[:2 * n]:
        p.finished(node, 2.0 if "test_b" in node else 1.0)
    tol = 2.0 ** ((SHRINK_N / (n + SHRINK_N)) ** 2)
    pa, pb = p.predict("d/a.py::test_a[7]"), p.predict("d/b.py::test_b[7]")
    assert 1.0 <= pa <= tol and 2.0 / tol <= pb <= 2.0, (pa, pb)
    assert pb / pa > 1.8  # the old single-speed estimate charged both about the same


def test_a_phase_of_cheap_kinds_does_not_drag_the_remaining_expensive_kind():
    """10 tests of x (folder d) run 1.5× their table, then 40 tests of y (folder e) exactly as the table:
    the run's recent speed falls towards 1, but x's pending tests keep their own 1.5 — the run's speed
    weighs (2 / 12)³ at most once x's folder, file and kind each have 10 tests."""
    xs = [f"d/x.py::test_x[{i}]" for i in range(12)]
    ys = [f"e/y.py::test_y[{i}]" for i in range(40)]
    prior = {"version": 1, "tests": {n: 1.0 for n in xs + ys}, "kinds": {}, "steps": {}}
    p = Progress(interval_s=0, workers=1, prior=prior, trace_path=None)
    p.collected(xs + ys)
    for n in xs[:10]:
        p.finished(n, 1.5)
    for n in ys:
        p.finished(n, 1.0)
    assert p.speed() < 1.1  # the run's recent speed followed y
    assert 1.5 * 1.5 ** (-(2 / 12) ** 3) <= p.predict(xs[10]) <= 1.5


def test_a_first_cell_outlier_moves_its_group_by_at_most_2x_and_then_averages_out():
    """A new file whose first test pays a one-off 10× (a model load), then runs as its table. The outlier
    moves each group by log 2 at most (its gap is clipped), and a group's first tests are averaged
    (weight 1 / n): the run and the folder (5 tests before) end at r = log 2 / 6; the new file starts
    there and ends at r + log 2, weighing 1 / 3; the new kind starts at r + log 2 / 3 and ends log 2
    above, weighing 1 / 3: the charge is 2^(1/6 + 2/3) ≤ 2× the table. After 9 more tests each group is
    at most its start plus log 2 (≤ 1.5 log 2) over 10."""
    ids = [f"d/a.py::test_a[{i}]" for i in range(5)] + [f"d/b.py::test_b[{i}]" for i in range(12)]
    prior = {"version": 1, "tests": {n: 1.0 for n in ids}, "kinds": {}, "steps": {}}
    p = Progress(interval_s=0, workers=1, prior=prior, trace_path=None)
    p.collected(ids)
    for n in ids[:5]:
        p.finished(n, 1.0)
    p.finished(ids[5], 10.0)
    assert p.predict(ids[-1]) == pytest.approx(2.0 ** (1 / 6 + 2 / 3))
    for n in ids[6:15]:
        p.finished(n, 1.0)
    assert 1.0 < p.predict(ids[-1]) <= 2.0 ** 0.2


def test_history_predicts_unseen_tests_scaled_by_this_runs_speed():
    ids = [f"t.py::test_{c}[{i}]" for c in "ab" for i in range(4)]
    hist = {"version": 1, "tests": {n: (2.0 if "test_a" in n else 10.0) for n in ids},
            "kinds": {}, "steps": {}}
    p = Progress(interval_s=0, t0=0.0, t_run=0.0, workers=1, history=hist, trace_path=None)
    p.collected(ids)
    assert p.eta(0.0) == pytest.approx(4 * 2.0 + 4 * 10.0)  # before any test: the history alone
    for n in ids[:4]:
        p.finished(n, 3.0)  # this run is 1.5× slower than the history
    assert p.speed() == pytest.approx(1.5)
    assert p.eta(12.0) == pytest.approx(4 * 10.0 * 1.5)
    p.started(ids[4], 12.0)  # running for 5 s of its predicted 15 s
    assert p.eta(17.0) == pytest.approx(10.0 + 3 * 15.0)
    assert p.eta(32.0) == pytest.approx(0.25 * 5.0 + 3 * 15.0)  # overran by 5 s: a quarter of that again


def test_report_step_is_added_once_and_counts_down_after_the_last_test():
    ids = ["t.py::test_a[m-k2v2-seed0-synthetic-smoke]"]
    hist = {"version": 1, "tests": {ids[0]: 4.0}, "kinds": {}, "steps": {"report|synthetic-smoke": 6.0}}
    p = Progress(interval_s=0, t0=0.0, t_run=0.0, history=hist, trace_path=None)
    p.collected(ids)
    assert p.eta(0.0) == pytest.approx(4.0 + 6.0)
    p.finished(ids[0], 4.0, now=4.0)
    assert p.eta(5.0) == pytest.approx(6.0 - 1.0)
    assert p.eta(14.0) == pytest.approx(0.25 * (10.0 - 6.0))  # overran by 4 s: a quarter of that again
    p.step("report|synthetic-smoke", 7.0)
    h = p.updated_history()
    # the run ran at the history's speed (4 s for 4 s): the new report seconds blended with the kept ones
    w = HISTORY_NEW
    assert h["tests"] == {ids[0]: 4.0}
    assert h["steps"] == {"report|synthetic-smoke": pytest.approx(math.exp(w * math.log(7.0) + (1 - w) * math.log(6.0)),
                                                                  abs=1e-4)}
    assert h["kinds"] == {"t.py::test_a|m|synthetic-smoke": 4.0}


def test_history_keeps_a_slower_runs_seconds_on_the_tables_scale_blended_with_what_it_had():
    """A run 2× slower than the tables (a busy machine) keeps its tests' relative durations at the tables'
    speed: the next run, quiet, is not charged the busy run's seconds for some tests and the prior's for others.
    An entry the history already had moves towards the new value by HISTORY_NEW in the log."""
    a, b, c = "t.py::test_a[1]", "t.py::test_a[2]", "t.py::test_b"
    prior = {"version": 1, "tests": {a: 1.0, b: 3.0, c: 10.0}, "kinds": {}, "steps": {"capture|real-full": 5.0}}
    p = Progress(interval_s=0, t0=0.0, t_run=0.0, prior=prior, trace_path=None)
    p.collected([a, b, c])
    p.step("capture|real-full", 10.0, 0.0, a)
    p.finished(a, 2.0, 12.0)
    p.finished(b, 6.0, 18.0)  # interrupted before c
    assert run_scale(p.observed) == pytest.approx(2.0)
    h = p.updated_history()
    assert h["version"] == HISTORY_VERSION
    assert h["tests"] == {a: pytest.approx(1.0), b: pytest.approx(3.0)}
    assert h["steps"] == {"capture|real-full": pytest.approx(5.0)}
    # the next run reads a history where a took 4 s; a has become 2× faster, b and c run as the tables say:
    # the run's scale is 1 (the median of measured/base weighted by base seconds), a's entry moves half-way
    q = Progress(interval_s=0, t0=0.0, t_run=0.0, prior=prior, history={**h, "tests": {a: 4.0, b: 3.0}},
                 trace_path=None)
    q.collected([a, b, c])
    for n, d in ((a, 2.0), (b, 3.0), (c, 10.0)):
        q.finished(n, d)
    assert run_scale(q.observed) == pytest.approx(1.0)
    w = HISTORY_NEW
    assert q.updated_history()["tests"] == {a: pytest.approx(math.exp(w * math.log(2.0) + (1 - w) * math.log(4.0)),
                                                             abs=1e-4), b: 3.0, c: 10.0}


def test_a_suites_report_is_a_step_of_its_own_and_falls_back_to_the_cells_alone():
    """The test suite ends differently from a cells-only run with the same cells: its report step is
    ``|+tests``; a table without that kind charges the cells-only report."""
    ids = ["t.py::test_a[m-k2v2-seed0-synthetic-smoke]", "u.py::test_unit"]
    assert Progress.report_kind(["synthetic-smoke"], True) == "report|synthetic-smoke|+tests"
    assert Progress.report_kind([], True) == "report|no-cells"
    for steps, expected in (({"report|synthetic-smoke": 2.0}, 2.0),
                            ({"report|synthetic-smoke": 2.0, "report|synthetic-smoke|+tests": 5.0}, 5.0)):
        prior = {"version": 1, "tests": {ids[0]: 1.0, ids[1]: 1.0}, "kinds": {}, "steps": steps}
        p = Progress(interval_s=0, t0=0.0, t_run=0.0, prior=prior, trace_path=None)
        p.collected(ids)
        assert "report|synthetic-smoke|+tests" in p.expected_steps
        assert p.eta(0.0) == pytest.approx(2.0 + expected)


def test_pending_capture_is_charged_to_the_first_real_cell_of_each_worker():
    ids = [f"t.py::test_a[m-k2v2-seed{i}-real-full]" for i in range(4)]
    prior = {"version": 1, "tests": {n: 1.0 for n in ids}, "kinds": {},
             "steps": {"capture|real-full": 30.0, "report|real-full": 5.0}}
    p = Progress(interval_s=0, workers=2, prior=prior, trace_path=None)
    p.collected(ids)
    assert p.expected_steps["capture|real-full"] == 2
    assert p.eta(0.0) == pytest.approx(31.0 + 1.0 + 5.0)  # both workers capture, then two cells each
    p.started(ids[0], 0.0)
    p.started(ids[1], 0.0)
    p.step("capture|real-full", 30.0, 30.0, ids[0])  # the clocks of the two cells restart after it
    p.step("capture|real-full", 30.0, 30.0, ids[1])
    assert p.eta(30.0) == pytest.approx(1.0 + 1.0 + 5.0)


def test_the_first_capture_does_the_work_and_the_later_ones_read_its_cache():
    # a table that knows both: the run's first capture 30 s, a later one (a disk-cache read) 2 s
    ids = [f"t.py::test_a[m-k2v2-seed{i}-real-full]" for i in range(4)]
    prior = {"version": 1, "tests": {n: 1.0 for n in ids}, "kinds": {},
             "steps": {"capture|real-full": 30.0, "capture|real-full|again": 2.0, "report|real-full": 5.0}}
    p = Progress(interval_s=0, workers=2, prior=prior, trace_path=None)
    p.collected(ids)
    # worker 1: capture 30 + its cell; worker 2: a cache read 2 + its cell, then the other two cells (free
    # first) → ends at 5; worker 1 ends at 31; then the report
    assert p.eta(0.0) == pytest.approx(31.0 + 5.0)
    p.started(ids[0], 0.0)
    p.step("capture|real-full", 30.0, 30.0, ids[0])
    p.finished(ids[0], 1.0, 31.0)
    # the first capture is done: the other worker's is still charged a cache read, not another 30 s
    charged = p._per_worker_steps("capture|real-full", 1, 1.0)
    assert charged == [2.0]
    p.step("capture|real-full", 3.0, 31.0, ids[1])
    hist = p.updated_history()  # the run's seconds (at the prior's speed) blended with the prior's
    w = HISTORY_NEW
    assert hist["steps"]["capture|real-full"] == 30.0
    assert hist["steps"]["capture|real-full|again"] == pytest.approx(3.0**w * 2.0 ** (1 - w), abs=1e-4)
    # an old table without the later value: every capture charged as the first, as before
    old = Progress(interval_s=0, workers=2, prior={**prior, "steps": {"capture|real-full": 30.0}}, trace_path=None)
    old.collected(ids)
    assert old._per_worker_steps("capture|real-full", 2, 1.0) == [30.0, 30.0]


def test_pending_model_load_is_charged_to_the_first_end_to_end_cell_of_each_worker():
    e2e = [f"t.py::test_endtoend[m-k2v2-seed{i}-real-full]" for i in range(4)]
    other = [f"t.py::test_a[m-k2v2-seed{i}-real-full]" for i in range(2)]
    prior = {"version": 1, "tests": {n: 1.0 for n in e2e + other}, "kinds": {},
             "steps": {"model|real-full": 20.0, "report|real-full": 5.0}}
    p = Progress(interval_s=0, workers=2, prior=prior, trace_path=None)
    p.collected(other + e2e)
    assert p.expected_steps["model|real-full"] == 2
    # each worker: one other cell, then its first end-to-end cell loads the model, then one more
    assert p.eta(0.0) == pytest.approx(1.0 + 21.0 + 1.0 + 5.0)
    for n in other:
        p.started(n, 0.0)
        p.finished(n, 1.0, 1.0)
    p.started(e2e[0], 1.0)
    p.started(e2e[1], 1.0)
    p.step("model|real-full", 20.0, 21.0, e2e[0])  # the clocks of the two cells restart after it
    p.step("model|real-full", 20.0, 21.0, e2e[1])
    assert p.expected_steps["model|real-full"] == 0
    assert p.eta(21.0) == pytest.approx(1.0 + 1.0 + 5.0)
    for n in e2e:  # with no end-to-end cell left, no load is expected any more
        p.pending.pop(n)
    p._close_capture_steps()
    assert p.expected_steps["model|real-full"] == 0


def test_a_model_load_of_a_data_size_the_tables_lack_is_charged_as_the_sizes_they_have():
    """``kvqbench run --smoke --kvq-real -k endtoend`` on tables made without it: its model load is charged
    the tables' loads at the other sizes (first and later ones apart), not nothing; a capture is charged at
    the other sizes' seconds too, scaled by the run's speed."""
    e2e = [f"t.py::test_endtoend[m-k2v2-seed{i}-real-smoke]" for i in range(2)]
    prior = {"version": 1, "tests": {n: 1.0 for n in e2e}, "kinds": {},
             "steps": {"model|real-full": 20.0, "model|real-full|again": 2.0, "model|real-big": 30.0,
                       "capture|real-full": 8.0}}
    p = Progress(interval_s=0, workers=1, prior=prior, trace_path=None)
    p.collected(e2e)
    # end-to-end cells take no capture of their own (the model load holds its calibration capture): one model
    # load per worker, the first one, median(20, 30)
    assert "capture|real-smoke" not in p.expected_steps
    assert p.eta(0.0) == pytest.approx(2 * 1.0 + 25.0)
    assert p._step_prediction("model|real-smoke|again", 1.0) == 2.0
    assert p._step_prediction("capture|real-smoke", 1.5) == 12.0  # scaled by the run's speed


def _simulate(history: dict | None, speed: float, seed: int, prior: dict | None = None,
              trace: str | None = None) -> tuple[list[tuple[float, float | None]], float, Progress]:
    """Two workers pulling from one queue on a fake clock (like xdist's load scheduling); the base
    cost of a test depends on its kind, with ±20 % noise, times ``speed``. Returns (now, ETA) samples
    every 5 s, the true end and the progress object."""
    rng = random.Random(seed)
    cost = {"syn": 1.0, "real": 4.0}
    ids = [f"t.py::test_{e}[{m}-k2v2-seed{s}-{src}-full]" for e in ("x", "y") for src in ("synthetic", "real")
           for m in ("m1", "m2", "m3") for s in range(8)]
    base = {n: cost["real" if "-real-" in n else "syn"] * (1.0 + ("test_y" in n)) * (1 + 0.5 * ("m3" in n))
            for n in ids}
    p = Progress(interval_s=0, t0=0.0, history=history or {}, prior=prior or {}, trace_path=trace)
    p.workers = 2
    p.t_run = 2.0
    p.collected(ids)
    free = [2.0, 2.0]
    events = []  # (end time, nodeid, duration, capture seconds)
    captured = [False, False]
    for n in ids:
        w = min(range(2), key=lambda i: free[i])
        start = free[w]
        cap = 0.0
        if "-real-" in n and not captured[w]:
            cap, captured[w] = 20.0 * speed, True
        d = base[n] * speed * rng.uniform(0.8, 1.2)
        free[w] = start + cap + d
        events.append((start, free[w], n, d, cap))
    end_tests = max(free)
    report = 6.0 * speed
    end = end_tests + report
    samples = []
    t = 5.0
    done_events = sorted(events, key=lambda e: e[1])
    i = 0
    started = sorted(events, key=lambda e: e[0])
    j = 0
    while t < end:
        while j < len(started) and started[j][0] <= t:
            p.started(started[j][2], started[j][0])
            j += 1
        while i < len(done_events) and done_events[i][1] <= t:
            _, fin, n, d, cap = done_events[i]
            if cap:
                p.step("capture|real-full", cap, None, n)
            p.finished(n, d, now=fin)
            i += 1
        samples.append((t, p.eta(t)))
        t += 5.0
    for k in [k for k in p.expected_steps if k.startswith("report|")]:
        p.step(k, report, end)
    return samples, end, p


def test_simulated_session_eta_is_within_30_percent_from_20_percent_on():
    _, _, first = _simulate(None, speed=1.0, seed=1)  # the run that fills the cache
    history = first.updated_history()
    samples, end, _ = _simulate(history, speed=1.6, seed=2)  # a busier machine next time
    errs = [abs(eta - (end - t)) / (end - t) for t, eta in samples if t >= 0.2 * end and end - t >= 5.0]
    assert errs and max(errs) <= 0.30, [round(e, 2) for e in errs]


def test_first_run_with_the_prior_of_another_machine_is_within_30_percent_from_20_percent_on():
    """No history (a fresh clone): the prior was measured on a machine 2.3× faster than this one, and
    each test's time varies ±20 % between the two runs — so the last test alone may be 1.5× off and the
    last few lines, with little time left, may miss: at least 90 % of the lines from 20 % on are within
    ±30 %, the median within ±10 %."""
    _, _, reference = _simulate(None, speed=1.0, seed=3)
    samples, end, _ = _simulate(None, speed=2.3, seed=4, prior=reference.updated_history())
    errs = sorted(abs(eta - (end - t)) / (end - t) for t, eta in samples if t >= 0.2 * end)
    assert len(errs) > 50
    assert sum(e <= 0.3 for e in errs) >= 0.9 * len(errs) and errs[len(errs) // 2] <= 0.10, errs


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_a_kind_whose_prior_is_off_by_a_large_factor_converges_once_it_runs(tmp_path, factor):
    """The prior of another machine, with one test function's entries (test_y, half of the work, run
    second) off by ``factor``: once ten of its tests have finished (the ETA cannot know before any of
    them ran), at least 90 % of the lines are within ±30 % of the truth while 15 % of the run or more
    is left. The last lines are not held to it: there a few cells remain, each of whose prior and run
    times vary ±20 % independently, and the report is scaled by the run's recent speed — which
    test_y's off prior sets, as a faster machine would (from the events alone the two cannot be told
    apart)."""
    mod = _eta_script()
    _, _, reference = _simulate(None, speed=1.0, seed=7)
    prior = mod.scaled(reference.updated_history(), "test_y", factor)
    assert prior["tests"]["t.py::test_y[m1-k2v2-seed0-real-full]"] == pytest.approx(
        factor * reference.updated_history()["tests"]["t.py::test_y[m1-k2v2-seed0-real-full]"])
    trace = tmp_path / "run.trace"
    samples, end, _ = _simulate(None, speed=1.4, seed=8, prior=prior, trace=str(trace))
    ys = sorted(e[-1] for e in map(json.loads, trace.read_text().splitlines())
                if e[1] == "finished" and "test_y" in e[2])
    errs = [abs(eta - (end - t)) / (end - t) for t, eta in samples if ys[9] <= t <= 0.85 * end]
    assert len(errs) >= 10 and sum(e <= 0.3 for e in errs) >= 0.9 * len(errs), [round(e, 2) for e in errs]


def test_an_entry_new_to_the_history_starts_from_the_prior():
    """One run where a test took 4× the prior's seconds (the rest as the prior says) does not make the
    history say 4×: the entry moves from the prior's value by HISTORY_NEW in the log."""
    a, b = "t.py::test_a[1]", "t.py::test_a[2]"
    prior = {"version": 1, "tests": {a: 2.0, b: 2.0}, "kinds": {}, "steps": {}}
    p = Progress(interval_s=0, t0=0.0, t_run=0.0, prior=prior, trace_path=None)
    p.collected([a, b])
    p.finished(a, 2.0)
    p.finished(b, 8.0)
    assert run_scale(p.observed) == 1.0  # the base-weighted median of 1 and 4: the lower one
    w = HISTORY_NEW
    assert p.updated_history()["tests"] == {a: 2.0, b: pytest.approx(8.0**w * 2.0 ** (1 - w), abs=1e-4)}


def test_eta_after_a_busy_interrupted_run_stays_within_30_percent():
    """A run on a machine 3× busier than the prior's, interrupted after its first 30 % of tests, keeps those
    tests' durations on the prior's scale: the next (quiet) run is not charged 3× for them and 1× for the
    others — with the raw seconds kept, its speed learned on the first tests (measured 1, history 3) would
    make every later, prior-based test 3× too cheap."""
    _, _, reference = _simulate(None, speed=1.0, seed=11)
    prior = reference.updated_history()
    p = Progress(interval_s=0, t0=0.0, t_run=0.0, workers=2, prior=prior, trace_path=None)
    p.collected(list(prior["tests"]))
    t = 0.0
    for n in list(prior["tests"])[: int(0.3 * len(prior["tests"]))]:
        t += 3.0 * prior["tests"][n]
        p.finished(n, 3.0 * prior["tests"][n], now=t)
    assert run_scale(p.observed) == pytest.approx(3.0, rel=1e-3)
    history = p.updated_history()
    samples, end, _ = _simulate(history, speed=1.0, seed=12, prior=prior)
    errs = [abs(eta - (end - t)) / (end - t) for t, eta in samples if t >= 0.2 * end and end - t >= 5.0]
    assert errs and max(errs) <= 0.30, [round(e, 2) for e in errs]


def test_history_after_chains_traced_sessions_as_the_plugin_does(tmp_path):
    """scripts/eta_error.py --after: replaying sessions one after the other keeps the history the plugin
    would have kept (each Progress.updated_history over the previous one)."""
    _, _, reference = _simulate(None, speed=1.0, seed=5)
    prior = reference.updated_history()
    traces = []
    for i, speed in enumerate((2.0, 1.3)):
        trace = tmp_path / f"run{i}.trace"
        _simulate(None if i == 0 else traces[-1][1], speed=speed, seed=20 + i, prior=prior, trace=str(trace))
        events = [json.loads(ln) for ln in trace.read_text().splitlines()]
        live = _eta_script().history_after([events], traces[-1][1] if traces else {}, prior)
        traces.append((events, live))
    chained = _eta_script().history_after([e for e, _ in traces], {}, prior)
    assert chained == traces[-1][1]
    assert chained["tests"] and all(v > 0 for v in chained["tests"].values())


def test_replaying_a_trace_gives_the_live_etas(tmp_path):
    """scripts/eta_error.py --replay feeds a recorded session to a new Progress: same ETAs as live."""
    _, _, reference = _simulate(None, speed=1.0, seed=5)
    prior = reference.updated_history()
    trace = tmp_path / "run.trace"
    samples, end, _ = _simulate(None, speed=1.7, seed=6, prior=prior, trace=str(trace))
    rows, rend = _eta_script().replay([json.loads(ln) for ln in trace.read_text().splitlines()],
                                      history={}, prior=prior, every=5.0)
    assert rend == pytest.approx(end)
    assert [r[2] for r in rows] == pytest.approx([t for t, _ in samples[:len(rows)]])
    assert [r[3] for r in rows] == pytest.approx([e for _, e in samples[:len(rows)]])
    assert len(rows) >= len(samples) - 1


def test_eta_prior_merges_histories_and_recomputes_kinds(tmp_path):
    spec = importlib.util.spec_from_file_location("eta_prior", ROOT / "scripts" / "eta_prior.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a = {"version": 1, "tests": {"t.py::test_a[1]": 1.0, "t.py::test_a[2]": 3.0}, "kinds": {"x": 9.0},
         "steps": {"report|no-cells": 5.0, "report|real-full": 8.0}, "step_cells": {"report|real-full": 40}}
    b = {"version": 1, "tests": {"t.py::test_a[2]": 5.0}, "kinds": {}, "steps": {"capture|real-full": 20.0},
         "step_cells": {"report|real-full": 60, "report|gone": 3}}
    for i, d in enumerate((a, b)):
        (tmp_path / f"h{i}").write_text(json.dumps(d))
    assert mod.main([str(tmp_path / "h0"), str(tmp_path / "h1"), "-o", str(tmp_path / "prior.json")]) == 0
    prior = json.loads((tmp_path / "prior.json").read_text())
    assert prior["tests"] == {"t.py::test_a[1]": 1.0, "t.py::test_a[2]": 5.0}  # the later file wins
    assert prior["kinds"] == {"t.py::test_a": 3.0}  # median of 1 and 5, the stale kind is gone
    assert prior["steps"] == {"capture|real-full": 20.0, "report|no-cells": 5.0, "report|real-full": 8.0}
    assert prior["step_cells"] == {"report|real-full": 60}  # the later file wins; only steps it has
    assert mod.main([str(tmp_path / "missing")]) == 2


def test_eta_prior_median_of_runs_rescales_each_run_and_drops_an_odd_one(tmp_path):
    spec = importlib.util.spec_from_file_location("eta_prior", ROOT / "scripts" / "eta_prior.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    base = {"t.py::x[1]": 1.0, "t.py::x[2]": 2.0, "t.py::x[3]": 4.0}
    runs = [  # a quiet run; the same at half the speed; a run where one test and the report ran oddly
        {"tests": base, "steps": {"capture|real-full": 10.0, "report|real-full": 20.0},
         "step_cells": {"report|real-full": 10}},
        {"tests": {k: 2 * v for k, v in base.items()}, "steps": {"capture|real-full": 20.0, "report|real-full": 40.0},
         "step_cells": {"report|real-full": 10}},
        {"tests": {**base, "t.py::x[3]": 40.0}, "steps": {"capture|real-full": 10.0, "report|real-full": 60.0},
         "step_cells": {"report|real-full": 30}},
    ]
    for i, d in enumerate(runs):
        (tmp_path / f"h{i}").write_text(json.dumps({"version": 1, "kinds": {}, **d}))
    paths = [str(tmp_path / f"h{i}") for i in range(3)]
    assert mod.main([*paths, "--median", "-o", str(tmp_path / "prior.json")]) == 0
    prior = json.loads((tmp_path / "prior.json").read_text())
    # the slow run is rescaled by 1/2, the odd test value is out-voted: the quiet run's values
    assert prior["tests"] == base
    assert prior["kinds"] == {"t.py::x": 2.0}
    # steps: the median of the rescaled runs; the report per cell (2 s/cell in all three) × the last cells
    assert prior["steps"] == {"capture|real-full": 10.0, "report|real-full": 60.0}
    assert prior["step_cells"] == {"report|real-full": 30}


def test_the_committed_prior_covers_the_test_suite_the_main_job_and_the_smoke_commands():
    from kvqbench.eta_tables import load_prior

    prior = load_prior()
    tests = prior["tests"]
    assert any(n.startswith("tests/unit/") for n in tests) and any(n.startswith("tests/plugin/") for n in tests)
    assert any(n.endswith("-real-full]") for n in tests) and any(n.endswith("-synthetic-smoke]") for n in tests)
    assert any(n.endswith("-real-smoke]") and "test_endtoend" in n for n in tests)  # --smoke --kvq-real
    assert {"capture|real-full", "report|real-full,synthetic-full", "report|synthetic-smoke", "model|real-smoke",
            "report|real-smoke,synthetic-smoke"} <= set(prior["steps"])
    assert load_prior(ROOT / "no-such-file.json") == {}


def test_eta_script_scores_a_logged_run(tmp_path):
    mod = _eta_script()
    log = tmp_path / "run.log"
    log.write_text("\n".join([
        "kvqbench: 1/10 tests, elapsed 10s, ETA 1m30s",   # before 20 % of 100 s: not scored
        "....",
        "kvqbench: 5/10 tests, elapsed 50s, ETA 40s",     # truth 50 → −20 %
        "kvqbench: 8/10 tests, elapsed 1m20s, ETA 30s",   # truth 20 → +50 %
        "kvqbench: 9/10 tests, elapsed 1m30s, ETA ?",
        "kvqbench: finished 10/10 tests, elapsed 1m40s",
        "==== 10 passed in 101.00s ====",
    ]))
    rows, end = mod.parse(log.read_text())
    assert end == 100.0 and len(rows) == 4 and rows[1] == (5, 10, 50.0, 40.0)
    res = mod.score(rows, end, 0.2, floor_s=10.0)
    assert res["scored"] == 3 and res["unknown"] == 1
    assert res["max_abs_err"] == pytest.approx(0.5) and res["median_abs_err"] == pytest.approx(0.35)
    assert res["within_30"] == pytest.approx(1 / 3)
    assert res["within_30_or_floor"] == pytest.approx(2 / 3)  # |30 − 20| = 10 s ≤ the 10 s floor
    assert mod.main([str(log), "-q"]) == 0
    assert mod.main([str(tmp_path / "missing.log")]) == 2


def test_eta_prior_reads_a_trace_as_that_sessions_own_seconds(tmp_path):
    """scripts/eta_prior.py takes a session's trace: its tests' and steps' own seconds, not rescaled or
    blended with any table (a history would be: Progress.updated_history)."""
    spec = importlib.util.spec_from_file_location("eta_prior", ROOT / "scripts" / "eta_prior.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _, _, reference = _simulate(None, speed=1.0, seed=5)
    trace = tmp_path / "run.trace"
    _, _, live = _simulate(None, speed=1.7, seed=6, prior=reference.updated_history(), trace=str(trace))
    run = mod.load_run(trace)
    assert run["tests"] == {k: pytest.approx(v, abs=1e-4) for k, v in live.measured.items()}
    assert run["steps"]["capture|real-full"] == pytest.approx(live.steps["capture|real-full"][0], abs=1e-4)
    (tmp_path / "bad").write_text("not json\n")
    with pytest.raises(ValueError, match="neither a durations history nor a progress trace"):
        mod.load_run(tmp_path / "bad")
    assert mod.main([str(trace), "-o", str(tmp_path / "prior.json")]) == 0
    assert json.loads((tmp_path / "prior.json").read_text())["tests"] == {
        k: pytest.approx(v, abs=1e-3) for k, v in live.measured.items()}


def test_the_long_tier_expects_a_model_load_per_worker_and_no_capture():
    # exp6 cells load the model (kvq_model) and take no capture: no "capture pending" note for a step that
    # never comes, and the ETA charges each worker's first cell the model load
    cells = [f"t.py::test_longdecode[m-k2v2-seed{i}-real-long]" for i in range(4)]
    prior = {"version": 1, "tests": {n: 10.0 for n in cells}, "kinds": {}, "steps": {"model|real-long": 6.0}}
    p = Progress(interval_s=0, workers=2, prior=prior, trace_path=None)
    p.collected(cells)
    assert p.expected_steps["model|real-long"] == 2 and not any(k.startswith("capture|") for k in p.expected_steps)
    assert "capture pending" not in p.line(0.0)
    assert p.eta(0.0) == pytest.approx(2 * 10.0 + 6.0)


def test_a_long_tier_prior_from_a_result_file_gives_an_eta_before_any_cell_finishes(tmp_path):
    """Tables without the long tier give no ETA until a long cell finishes (the line says why); a prior that
    scripts/eta_prior.py made from a result file's ``duration_s`` gives one from the start: 4 cells of 80 s
    on 2 workers, no step the tables know, so 160 s."""
    spec = importlib.util.spec_from_file_location("eta_prior", ROOT / "scripts" / "eta_prior.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cells = [f"tests/bench/test_exp6_longdecode.py::test_longdecode[kivi-k2v2-seed{i}-real-long]" for i in range(4)]
    bare = Progress(interval_s=0, workers=2, prior={"version": 1, "tests": {"t.py::test_a": 1.0}}, trace_path=None)
    bare.collected(cells)
    assert bare.eta(30.0) is None and "ETA ? (no recorded duration for these tests yet" in bare.line(30.0)
    result = tmp_path / "exp6_real.json"
    result.write_text(json.dumps({"experiment": "exp6", "cells": [{"nodeid": n, "duration_s": 80.0} for n in cells]}))
    prior = mod.merge([mod.load_run(result)])
    assert prior["tests"] == {n: 80.0 for n in cells}
    p = Progress(interval_s=0, workers=2, prior=prior, trace_path=None)
    p.collected(cells)
    assert p.eta(0.0) == pytest.approx(160.0)
    assert p.line(0.0).endswith("ETA 2m40s")
