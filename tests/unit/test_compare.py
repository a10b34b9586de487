"""``kvqbench compare``: deltas by better-direction, CI significance, --fail-on thresholds, one-sided
methods/settings, timing metrics ignored unless named. Torch-free inputs built by hand."""

from __future__ import annotations

import copy
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from test_report_samples import _rec, board, records, write_results

from kvqbench.metrics import is_timing
from kvqbench.results.compare import Change, compare_boards, main, parse_fail_on


def _run(base, new, *rules, **kw):
    buf = io.StringIO()
    rc = main(base, new, list(rules), out=buf, **kw)
    return rc, buf.getvalue()


@pytest.fixture
def base_dir(tmp_path):
    return write_results(tmp_path / "base")


def test_identical_sets_exit_zero_and_report_no_change(base_dir):
    rc, text = _run(base_dir, base_dir, "rel_mse:5", "any:0")
    assert rc == 0
    assert " 0 worse, 0 better" in text
    assert "OK: no --fail-on threshold crossed" in text


def test_degraded_method_fails_past_threshold(tmp_path, base_dir):
    new = write_results(tmp_path / "new", records(degrade={"kivi": 1.2}))
    rc, text = _run(base_dir, new, "rel_mse:5")
    assert rc == 1
    assert "FAILED" in text and "kivi" in text and "rel_mse" in text
    # the degradation is +20 %: a looser threshold passes, a file path works as well as a folder
    rc2, _ = _run(base_dir / "leaderboard.json", new / "leaderboard.json", "rel_mse:25")
    assert rc2 == 0


#: Student-t 0.975 quantile with 2 degrees of freedom, closed form: (2p − 1) / √(2p(1 − p))
T975_DF2 = (2 * 0.975 - 1) / math.sqrt(2 * 0.975 * 0.025)
#: the published leaderboard's three seeds of real/rtn_channel/k4v4 e2e_prefill_dloss_nats
DLOSS = (0.09594631956752754, 0.03896555294576439, -0.01015457835434303)


def _half_width_3(vals):
    m = sum(vals) / 3
    return T975_DF2 * math.sqrt(sum((v - m) ** 2 for v in vals) / 2 / 3)


def _e2e_records(dloss, rel_mse):
    """exp5 and exp1 cells of one method and setting, seeds 0–2 (end-to-end and a deterministic metric)."""
    out = []
    for seed, (d, e) in enumerate(zip(dloss, rel_mse)):
        out.append(_rec("exp5", "rtn_channel", 4, seed, "real", {"e2e_prefill_dloss_nats": d}))
        out.append(_rec("exp1", "rtn_channel", 4, seed, "real", {"rel_mse": e}))
    return out


def test_end_to_end_values_fail_only_beyond_the_ci_spread(tmp_path):
    """The published leaderboard's Δ loss moved +51 % in a fresh run, well within its seeds' CI: noise."""
    err = (0.010, 0.011, 0.012)
    base = write_results(tmp_path / "base", _e2e_records(DLOSS, err))
    shift = 0.0628 - sum(DLOSS) / 3  # the fresh run's mean was 0.0628 (+51 %)
    noisy = tuple(d + shift for d in DLOSS)
    spread = 2 * _half_width_3(DLOSS)  # the same seed-to-seed scatter on both sides
    assert abs(shift) < spread  # the premise, from the closed form
    rc, text = _run(base, write_results(tmp_path / "noisy", _e2e_records(noisy, err)), "any:5")
    assert rc == 0, text
    # Δ loss can be negative (no ratio scale): judged by the CI spread
    line = next(ln for ln in text.split("within noise: ")[1].splitlines() if "e2e_prefill_dloss_nats" in ln)
    assert "+51.01 %" in line and f"≤ CI spread {spread:.4g}" in line
    # beyond the spread (and the threshold): fails, naming the spread it exceeded
    far = tuple(d + 1.01 * spread for d in DLOSS)
    rc, text = _run(base, write_results(tmp_path / "far", _e2e_records(far, err)), "any:5")
    assert rc == 1
    failed = text.split("FAILED: ")[1]
    assert "real/rtn_channel/k4v4 e2e_prefill_dloss_nats" in failed and f"> CI spread {spread:.4g}" in failed
    # beyond the spread but within the threshold: passes
    assert _run(base, write_results(tmp_path / "far2", _e2e_records(far, err)), "any:10000")[0] == 0
    # a deterministic metric is judged by the threshold alone, however wide its seeds' CI (+20 % here,
    # against a CI half-width of ~25 % of the mean on each side)
    worse = tuple(e * 1.2 for e in err)
    assert 0.2 * sum(err) / 3 < _half_width_3(err) + _half_width_3(worse)
    rc, text = _run(base, write_results(tmp_path / "det", _e2e_records(DLOSS, worse)), "rel_mse:5")
    assert rc == 1 and "real/rtn_channel/k4v4 rel_mse" in text.split("FAILED: ")[1]


#: end-to-end KL of one cell on 8 text windows (window difficulty spans 6×)
KL_WINDOWS = (0.41, 0.92, 0.55, 2.4, 0.73, 1.31, 0.62, 1.05)


def _kl_records(kl):
    return [_rec("exp5", "kivi", 2, seed, "real", {"e2e_prefill_kl_nats": v}) for seed, v in enumerate(kl)]


def test_end_to_end_kl_is_paired_by_window_and_a_failure_names_the_cell_with_its_ratio(tmp_path):
    """NEW 1.2× BASE's KL on every window (±3 %): the marginal CI spread is far wider than the change, but
    paired by window the ratio's CI lies above 1, so the gate fails and names the cell with its ratio.
    The same +20 % mean from windows that move both ways (NEW/BASE from 0.7× to 1.8×) passes as noise."""
    from scipy import stats

    base = write_results(tmp_path / "base", _kl_records(KL_WINDOWS))
    wobble = (1.03, 0.98, 1.01, 0.97, 1.02, 0.99, 1.0, 1.01)
    worse = tuple(1.2 * v * w for v, w in zip(KL_WINDOWS, wobble))
    rc, text = _run(base, write_results(tmp_path / "worse", _kl_records(worse)), "e2e_prefill_kl_nats:5")
    assert rc == 1, text
    ci = stats.ttest_rel([math.log(v) for v in worse], [math.log(v) for v in KL_WINDOWS]).confidence_interval(0.95)
    lo, hi = math.exp(ci.low), math.exp(ci.high)
    ratio = math.exp(sum(math.log(a / b) for a, b in zip(worse, KL_WINDOWS)) / len(worse))
    assert lo > 1.0  # the premise, from scipy on the same numbers
    failed = text.split("FAILED: ")[1]
    assert ("real/kivi/k2v2 e2e_prefill_kl_nats" in failed
            and f"paired over 8 windows: {ratio:.3g}× [{lo:.3g}, {hi:.3g}], wholly above 1" in failed)
    # the overlap of marginal intervals would have called it noise: the spread is larger than the change
    spread = sum(stats.t.ppf(0.975, 7) * stats.sem(v) for v in (KL_WINDOWS, worse))
    assert sum(worse) / 8 - sum(KL_WINDOWS) / 8 < spread
    # the same mean change, windows moving both ways: the paired CI includes 1, noise
    factors = (0.7, 1.8, 0.8, 1.25, 0.9, 1.6, 0.75, 1.5)
    mixed = tuple(v * f for v, f in zip(KL_WINDOWS, factors))
    rc, text = _run(base, write_results(tmp_path / "mixed", _kl_records(mixed)), "e2e_prefill_kl_nats:5")
    ci = stats.ttest_rel([math.log(v) for v in mixed], [math.log(v) for v in KL_WINDOWS]).confidence_interval(0.95)
    assert ci.low < 0 < ci.high and sum(mixed) > 1.05 * sum(KL_WINDOWS)  # the premise
    assert rc == 0, text
    assert "real/kivi/k2v2 e2e_prefill_kl_nats" in text.split("within noise: ")[1] and "not wholly above 1" in text


def test_improvement_never_fails(tmp_path, base_dir):
    new = write_results(tmp_path / "new", records(degrade={"kvarn": 0.5}))
    rc, text = _run(base_dir, new, "any:1")
    assert rc == 0
    assert "Improvements" in text and "kvarn" in text.split("Improvements")[1]


def test_any_rule_catches_other_metrics_and_skips_timing():
    b = board()
    n = copy.deepcopy(b)
    stats = n["sources"]["synthetic"]["stats"]
    stats["exp1"]["kivi"]["k4v4"]["k_rel_mse"]["mean"] *= 1.5
    stats["exp4"]["kivi"]["k2v2"]["quantize_ms"]["mean"] *= 10
    cmp = compare_boards(b, n)
    from kvqbench.results.compare import violations

    cat = b["metrics_catalog"]
    hits = violations(cmp, parse_fail_on(["any:10"]), cat)
    assert [(c.method, c.setting, c.metric) for _, c in hits] == [("kivi", "k4v4", "k_rel_mse")]
    named = violations(cmp, parse_fail_on(["quantize_ms:50"]), cat)
    assert [(c.metric, round(c.worsening_pct)) for _, c in named] == [("quantize_ms", 900)]


def test_better_direction_from_catalog():
    higher = Change("s", "e", "m", "k2v2", "x", "higher", 1.0, 0.9, None, None, 1, 1)
    lower = Change("s", "e", "m", "k2v2", "x", "lower", 1.0, 0.9, None, None, 1, 1)
    zero = Change("s", "e", "m", "k2v2", "x", "zero", -0.1, 0.2, None, None, 1, 1)
    assert higher.status == "regressed" and higher.worsening_pct == pytest.approx(10.0)
    assert lower.status == "improved" and lower.worsening_pct == pytest.approx(-10.0)
    assert zero.status == "regressed" and zero.worsening_pct == pytest.approx(100.0)
    from_zero = Change("s", "e", "m", "k2v2", "x", "lower", 0.0, 1e-6, None, None, 1, 1)
    assert math.isinf(from_zero.worsening_pct) and from_zero.status == "regressed"


def test_higher_is_better_metric_regresses_when_it_drops(tmp_path):
    b = board()
    n = copy.deepcopy(b)
    n["sources"]["synthetic"]["stats"]["exp2"]["kvarn"]["k2v2"]["attn_cos_gain"]["mean"] *= 0.5
    (tmp_path / "b.json").write_text(json.dumps(b))
    (tmp_path / "n.json").write_text(json.dumps(n))
    rc, text = _run(tmp_path / "b.json", tmp_path / "n.json", "attn_cos_gain:5")
    assert rc == 1 and "attn_cos_gain" in text


def test_ci_spread_adds_the_half_widths_of_the_sides_that_have_one():
    wide = Change("s", "e", "m", "k2v2", "x", "lower", 1.0, 1.1, 0.2, 0.2, 3, 3)
    apart = Change("s", "e", "m", "k2v2", "x", "lower", 1.0, 2.0, 0.1, 0.1, 3, 3)
    single = Change("s", "e", "m", "k2v2", "x", "lower", 1.0, 2.0, None, None, 1, 1)
    assert wide.outside_ci is False and apart.outside_ci is True and single.outside_ci is None
    assert wide.spread == pytest.approx(0.4) and single.spread is None
    # one side with seeds: its half-width alone is the spread
    one = Change("s", "e", "m", "k2v2", "x", "lower", 1.0, 1.3, 0.25, None, 3, 1)
    assert one.spread == 0.25 and one.outside_ci is True
    # identical seeds (a deterministic value) have a 0 half-width: the threshold alone decides
    exact = Change("s", "e", "m", "k2v2", "x", "lower", 1.0, 1.0001, 0.0, 0.0, 3, 3)
    assert exact.outside_ci is True


def test_missing_methods_settings_and_sources_are_reported(tmp_path, base_dir):
    recs = [r for r in records(sources=("synthetic", "real")) if r["method"] != "kvarn"
            and not (r["method"] == "kivi" and r["k_bits"] == 4)]
    new = write_results(tmp_path / "new", recs)
    rc, text = _run(base_dir, new, "rel_mse:5", only_common=True)
    assert rc == 0
    assert "only in BASE" in text and "synthetic/exp1/kvarn" in text and "synthetic/exp1/kivi/k4v4" in text
    assert "only in NEW" in text and "source real" in text
    assert "(--only-common)" in text.splitlines()[0]


def test_a_gate_fails_when_new_lacks_a_method_unless_narrowed(tmp_path, base_dir):
    """HEAD run with -k kvarn against a complete BASE: the gate would judge one method of four."""
    new = write_results(tmp_path / "new", [r for r in records() if r["method"] == "kvarn"])
    rc, text = _run(base_dir, new, "rel_mse:5")
    assert rc == 1
    first, last = text.splitlines()[0], text.splitlines()[-1]
    assert first.startswith("FAILED: NEW lacks ") and "(methods fp16, kivi, rtn_token)" in first
    assert "--methods ID,… or --only-common" in first and last == first
    assert "OK:" not in text
    # narrowed on purpose: to the method NEW ran, or to what both hold
    assert _run(base_dir, new, "rel_mse:5", methods=["kvarn"])[0] == 0
    rc, text = _run(base_dir, new, "rel_mse:5", only_common=True)
    assert rc == 0 and "FAILED" not in text
    # --methods keeps the check for what it names: kivi is in BASE only
    rc, text = _run(base_dir, new, "rel_mse:5", methods=["kvarn", "kivi"])
    assert rc == 1 and text.splitlines()[0].startswith("FAILED: NEW lacks ") and "(method kivi)" in text
    # without a gate it is a warning, first
    rc, text = _run(base_dir, new)
    assert rc == 0 and text.splitlines()[0].startswith("kvqbench compare: warning: NEW lacks ")


def test_a_gate_fails_when_new_lacks_a_seed_a_metric_or_a_finite_value(tmp_path, base_dir):
    no_seed = write_results(tmp_path / "seed", [r for r in records()
                                                if not (r["method"] == "kivi" and r["k_bits"] == 2 and r["seed"] == 1)])
    rc, text = _run(base_dir, no_seed, "rel_mse:5")
    assert rc == 1 and "synthetic/exp1/kivi/k2v2 seed 1" in text
    recs = records()
    for r in recs:
        if r["method"] == "kivi" and r["experiment"] == "exp1":
            r["metrics"].pop("k_mse")
    no_metric = write_results(tmp_path / "metric", recs)
    rc, text = _run(base_dir, no_metric, "rel_mse:5")
    assert rc == 1 and "synthetic/exp1/kivi/k2v2 k_mse" in text
    # a non-finite value in NEW (the mean is over the other seed)
    recs = records()
    for r in recs:
        if r["method"] == "kivi" and r["experiment"] == "exp1" and r["k_bits"] == 2 and r["seed"] == 1:
            r["metrics"]["rel_mse"] = math.nan
    nan = write_results(tmp_path / "nan", recs)
    rc, text = _run(base_dir, nan, "rel_mse:5")
    assert rc == 1 and "synthetic/exp1/kivi/k2v2 finite values of rel_mse" in text.split("only in BASE")[1]
    # what only NEW has is listed, never a failure
    rc, text = _run(no_metric, base_dir, "rel_mse:5")
    assert rc == 0 and "only in NEW" in text and "synthetic/exp1/kivi/k2v2 k_mse" in text


def test_unknown_method_exits_2_naming_the_closest(base_dir, capsys):
    from kvqbench.cli import main as cli

    assert cli(["compare", str(base_dir), str(base_dir), "--fail-on", "rel_mse:5", "--methods", "kvarn,kivj"]) == 2
    assert capsys.readouterr().err.strip() == ("kvqbench compare: --methods: neither set holds a value of method "
                                               "'kivj'; did you mean 'kivi'?")
    assert cli(["compare", str(base_dir), str(base_dir), "--fail-on", "rel_mse:5", "--methods", "kvarn,kivi"]) == 0


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("degrade, verdict", [(1.0, 0), (1.2, 1)], ids=["passes", "fails"])
def test_output_cut_short_by_the_reader_is_quiet(tmp_path, base_dir, degrade, verdict, unbuffered, monkeypatch):
    """`kvqbench compare … | head`: the reader goes away before the output ends; no traceback, and the exit
    status is still the gate's verdict (stdout buffered as in a pipe, or unbuffered as CI runners set it)."""
    if unbuffered:
        monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    else:
        monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)

    new = write_results(tmp_path / "new", records(degrade={"kivi": degrade}))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "kvqbench.cli", "compare", str(base_dir), str(new),
                             "--fail-on", "rel_mse:5"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command writes its first line: every write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == verdict
    assert err == ""


def test_bad_inputs_exit_two(tmp_path, base_dir, capsys):
    assert main(base_dir, tmp_path / "nope", []) == 2
    assert "not found" in capsys.readouterr().err
    assert main(base_dir, base_dir, ["rel_mse"]) == 2
    assert "METRIC:PERCENT" in capsys.readouterr().err
    (tmp_path / "x.json").write_text("{}")
    assert main(base_dir, tmp_path / "x.json", []) == 2


def test_parse_fail_on_and_timing_detection():
    assert [(r.metric, r.percent) for r in parse_fail_on(["rel_mse:5", "any:2.5%"])] == [("rel_mse", 5.0),
                                                                                         ("any", 2.5)]
    with pytest.raises(ValueError, match="METRIC:PERCENT"):
        parse_fail_on(["rel_mse:-1"])
    # as the catalog declares, or as a saved record says for a metric the catalog does not hold
    assert is_timing("quant_latency_ms") and is_timing("dequant_latency_x_clone") and is_timing("peak_mem_mib")
    assert is_timing("quantize_ms", {"unit": "ms", "varies": "timing"}) and not is_timing("quantize_ms", {"unit": "ms"})
    assert not is_timing("k_mse", {"unit": "1"}) and not is_timing("bits_effective", {"unit": "bits/element"})
    assert not is_timing("e2e_prefill_kl_nats")


def test_cli_compare_uses_the_same_exit_codes(tmp_path, base_dir):
    from kvqbench.cli import main as cli_main

    new = write_results(tmp_path / "new", records(degrade={"rtn_token": 1.3}))
    assert cli_main(["compare", str(base_dir), str(base_dir), "--fail-on", "rel_mse:5"]) == 0
    assert cli_main(["compare", str(base_dir), str(new), "--fail-on", "rel_mse:5", "--fail-on", "any:50"]) == 1


def test_unknown_fail_on_metric_exits_2_naming_the_closest(base_dir, capsys):
    """A typo must not disable a CI gate (issue 9): exit 2, naming the closest known metric."""
    from kvqbench.cli import main as cli

    assert cli(["compare", str(base_dir), str(base_dir), "--fail-on", "rel_mes:5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvqbench compare: --fail-on rel_mes:5: unknown metric 'rel_mes'; did you mean 'rel_mse'?"]
    rc, _ = _run(base_dir, base_dir, "rel_mse:5", "bogus_metric:5")
    assert rc == 2
    # a metric of the catalog that neither set recorded is known, but a gate on it would always pass:
    # exit 2, naming it
    rc, text = _run(base_dir, base_dir, "attn_kl_fwd:5", "decode_attn_kl_fwd_nats:5")
    assert rc == 2
    assert "--fail-on decode_attn_kl_fwd_nats:5 compared nothing: no setting has 'decode_attn_kl_fwd_nats' in both sets" in text
    assert "attn_kl_fwd:5 compared nothing" not in text
    assert _run(base_dir, base_dir, "attn_kl_fwd:5")[0] == 0


def test_a_metric_recorded_on_one_side_only_is_reported_not_failed(base_dir, tmp_path):
    """A method new in NEW (a method PR adding one, compared with --methods) has nothing in BASE to gate
    against."""
    only_new = write_results(tmp_path / "new", [r for r in records() if r["method"] == "kivi"])
    only_base = write_results(tmp_path / "old", [r for r in records() if r["method"] == "rtn_token"])
    rc, text = _run(only_base, only_new, "rel_mse:5", methods=["kivi"])
    assert rc == 0 and "--fail-on rel_mse:5 compared nothing: no setting has 'rel_mse' in both sets" in text
    assert _run(only_base, only_new, "rel_mse:5")[0] == 1  # NEW lacks rtn_token


def test_a_gate_on_an_incomplete_new_set_fails(tmp_path, base_dir):
    new = tmp_path / "partial"
    new.mkdir()
    doc = json.loads((base_dir / "leaderboard.json").read_text())
    doc["completeness"] = {"complete": False, "summary": "incomplete: 7 of 9 cells finished, 2 failed"}
    (new / "leaderboard.json").write_text(json.dumps(doc))
    rc, text = _run(base_dir, new, "rel_mse:5")  # identical values: only the missing cells can fail it
    assert rc == 1
    assert "warning: NEW is incomplete: 7 of 9 cells finished" in text
    assert "FAILED: NEW is incomplete: 7 of 9 cells finished, 2 failed" in text
    rc, text = _run(base_dir, new)  # no gate: a warning, exit 0
    assert rc == 0 and "FAILED" not in text
    rc, text = _run(new, base_dir, "rel_mse:5")  # an incomplete BASE only warns
    assert rc == 0 and "warning: BASE is incomplete" in text
