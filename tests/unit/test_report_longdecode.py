"""Experiment 6 in the leaderboard (kvqbench/report/stats/longdecode.py, render/longdecode.py): the long-decode KL on the first screen,
the tables (long-decode KL ranked by the paired rule, KL vs position, free-running divergence,
passkey), predictivity against the long-decode KL and the passkey drop, and the KL-vs-position figure.
Torch-free; hand-built records whose means are known."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
from scipy import stats

from kvqbench.report.board import assemble
from kvqbench.report.render.markdown import render_markdown
from kvqbench.report.stats.intervals import mean_ci
from kvqbench.report.stats.longdecode import summarize
from kvqbench.report.stats.predictivity import PREDICTIVITY_TARGETS, predictivity
from tests.unit.test_report_samples import PROVENANCE, _rec, catalog

METHODS = ("fp16", "a", "b", "c", "d", "e")
SEEDS = (0, 1)
#: short-window (exp5) KL per method at k2v2 (k4v4: 1/16 of it)
E2E = {"fp16": 0.0, "a": 0.9, "b": 0.5, "c": 0.3, "d": 0.2, "e": 0.1}
#: long-decode KL: e and d close (0.2 vs 0.19), a different order from E2E in a/b
LONG = {"fp16": 0.0, "a": 0.6, "b": 0.8, "c": 0.3, "d": 0.2, "e": 0.19}
#: passkey log-prob drop: yet another order
DROP = {"fp16": 0.0, "a": 0.1, "b": 0.2, "c": 0.9, "d": 0.4, "e": 0.3}
#: the noise floor (sd) of each method's long-decode KL at k2v2: e's covers its gap to d
NOISE = {"fp16": 0.0, "a": 1e-4, "b": 1e-4, "c": 1e-4, "d": 1e-4, "e": 0.02}
BINS = ([63, 95, 127], [95, 127, 159])
LENGTHS = [64, 80]


def _jitter(seed: int) -> float:
    return 1.0 + 1e-4 * seed  # CI half-widths far below the gaps between methods


def _long_rec(m: str, bits: int, seed: int) -> dict:
    f = 1.0 if bits == 2 else 1 / 16
    j = _jitter(seed)
    kl = LONG[m] * f * j
    metrics = {"long_kl_nats": kl, "long_kl_last_quarter_nats": 1.5 * kl, "long_top1_last_quarter": 1 - kl / 2,
               "long_kl_slope_per_1k": 0.5 * kl, "long_dloss_nats": kl / 3, "long_bits_billed": 16.0 if m == "fp16" else bits + 0.5,
               "free_first_divergence_tokens": 32.0 if m == "fp16" else float(10 + seed),
               "free_match_share": 1.0 if m == "fp16" else 0.5 + 0.1 * seed,
               "passkey_logp_drop_nats": DROP[m] * f * j, "passkey_rank_worst": 0.0 if m == "fp16" else 1.0 + seed}
    if seed == 0:
        metrics["long_kl_noise_sd_nats"] = NOISE[m] * f
    ref_acc = [1.0, 2 / 3]  # the unquantized model retrieves every 64-token prompt, two of three at 80
    mine = [1.0 if m == "fp16" else (2 / 3 if seed == 0 else 1 / 3), None]
    series = {"kl_curve": {"bin": 32, "start": BINS[0], "stop": BINS[1], "mean": [kl * (i + 1) for i in range(3)]},
              "passkey": {"lengths": LENGTHS, "depths": [0.1, 0.5, 0.9], "ref_accuracy": ref_acc, "accuracy": mine,
                          "logp_ref_nats": [[-1.0] * 3] * 2, "logp_nats": [[-1.0] * 3] * 2,
                          "rank_worst": [[0, 0, 0]] * 2, "rank_worst_ref": [[0, 0, 0], [0, 3, 0]]}}
    r = _rec("exp6", m, bits, seed, "real", metrics, series)
    r["extra"] = {"text_tokens": 160, "prefill_tokens": 64, "fp16_share_at_T": {"k": 0.25 if m == "kivi" else 0.1,
                                                                               "v": 0.3 if m != "fp16" else 1.0},
                  "passkey": {"reference_floor": 0.9}}
    return r


def records() -> list[dict]:
    out = []
    for m in METHODS:
        for bits in (2, 4):
            f = 1.0 if bits == 2 else 1 / 16
            for seed in SEEDS:
                j = _jitter(seed)
                eff = 16.0 if m == "fp16" else bits + 0.25
                # rel_mse ranks like the short-window KL, k_rel_mse like the long-decode KL, v_rel_mse like the drop
                out.append(_rec("exp1", m, bits, seed, "real", {
                    "rel_mse": E2E[m] * f * j, "k_rel_mse": LONG[m] * f * j, "v_rel_mse": DROP[m] * f * j,
                    "bits_effective": eff}))
                out.append(_rec("exp5", m, bits, seed, "real", {"e2e_prefill_kl_nats": E2E[m] * f * j,
                                                               "e2e_decode_kl_nats": E2E[m] * f * j}))
                out.append(_long_rec(m, bits, seed))
    return out


@pytest.fixture(scope="module")
def board() -> dict:
    return assemble(records(), catalog(), copy.deepcopy(PROVENANCE))


@pytest.fixture(scope="module")
def md(board) -> str:
    return render_markdown(board)


def _table(md: str, title: str, setting: str | None = None) -> list[list[str]]:
    """The rows (cells stripped) of the first GitHub table after the heading ``title`` (and after ``#### setting``)."""
    text = md.split(title, 1)[1]
    if setting:
        text = text.split(f"#### {setting}\n", 1)[1]
    lines = text.split("\n|", 1)[1].split("\n\n", 1)[0].split("\n")
    rows = [["|" + ln if i == 0 else ln][0].strip().strip("|").split("|") for i, ln in enumerate(lines)]
    return [[c.strip() for c in row] for row in rows]


def _row(rows: list[list[str]], method: str) -> list[str]:
    return next(r for r in rows if r[0] == f"`{method}`" or (len(r) > 1 and r[1] == f"`{method}`"))


# --------------------------------------------------------------------------------------------------
def test_summary_curves_are_the_means_over_seeds(board):
    summ = board["sources"]["real"]["long_decode"]
    c = summ["kl_curve"]["b"]["k2v2"]
    assert c["start"] == BINS[0] and c["stop"] == BINS[1] and c["n"] == 2
    for i in range(3):
        vals = [LONG["b"] * _jitter(s) * (i + 1) for s in SEEDS]
        assert c["mean"][i] == pytest.approx(math.fsum(vals) / 2, rel=1e-12)
        assert c["ci95"][i] == pytest.approx(mean_ci(vals)[1], rel=1e-12)
    assert summ["fp16_share_at_T"]["a"]["k2v2"] == pytest.approx((0.1 + 0.3) / 2)
    ref = summ["passkey_reference"]
    assert ref["lengths"] == LENGTHS and ref["accuracy"] == pytest.approx([1.0, 2 / 3]) and ref["floor"] == 0.9
    assert ref["rank_worst"] == pytest.approx([0.0, 1.0])  # worst ranks [0, 3, 0] at 80 tokens: mean 1
    assert summ["passkey_accuracy"]["a"]["k2v2"] == [pytest.approx(0.5), None]  # (2/3 + 1/3) / 2; 80: not counted


def test_summary_none_without_exp6():
    assert summarize([r for r in records() if r["experiment"] != "exp6"]) is None


def test_first_screen_has_the_long_decode_kl_of_each_budget_best(board, md):
    rows = board["sources"]["real"]["headline"]
    best = next(r for r in rows if r["budget"] == 2.25)
    assert (best["method"], best["setting"]) == ("e", "k2v2")  # lowest rel_mse at 2.25 bits
    st = board["sources"]["real"]["stats"]["exp6"]["e"]["k2v2"]
    assert best["long_kl"] == st["long_kl_nats"]["mean"] and best["long_bits_billed"] == 2.5
    screen = md.split("# Details", 1)[0]
    assert "long-decode KL (`long_kl_nats`) @ bits billed at T" in screen
    line = next(ln for ln in screen.splitlines() if ln.startswith("| ≤ 2.25"))
    from kvqbench.report.render.text import fmt

    assert f"{fmt(st['long_kl_nats']['mean'], st['long_kl_nats']['ci95'])} @ 2.5 b" in line


def test_first_screen_unchanged_without_exp6():
    b = assemble([r for r in records() if r["experiment"] != "exp6"], catalog(), copy.deepcopy(PROVENANCE))
    assert all("long_kl" not in r for r in b["sources"]["real"]["headline"])
    assert "long_kl_nats" not in render_markdown(b) and "Long decode" not in render_markdown(b)


def test_kl_vs_position_table_equals_the_input_means(md):
    rows = _table(md, "### KL vs decoded position", "k2v2")
    assert rows[0] == ["method", "63–95", "95–127", "127–159", "slope /1k tokens"]
    from kvqbench.report.render.text import fmt

    for m in ("a", "c", "e"):
        row = _row(rows, m)
        want = [math.fsum(LONG[m] * _jitter(s) * (i + 1) for s in SEEDS) / 2 for i in range(3)]
        assert row[1:4] == [fmt(w) for w in want]
        assert row[4].startswith(fmt(math.fsum(0.5 * LONG[m] * _jitter(s) for s in SEEDS) / 2))


def test_long_kl_table_ranks_by_the_paired_rule(board, md):
    rows = _table(md, "### Long decode", "k2v2")
    # every text scales every method by the same jitter: each per-text ratio is constant, so the paired test
    # separates every pair — e (0.19) and d (0.2) too, although e's noise floor (0.02) covers their gap
    assert [r[1] for r in rows[2:]] == ["`fp16`", "`e`", "`d`", "`c`", "`a`", "`b`"]
    assert [r[0] for r in rows[2:]] == ["1", "2", "3", "4", "5", "6"] and all(r[-1] == "" for r in rows[2:])
    ranked = board["sources"]["real"]["rankings"]["long_kl_nats"]["by_setting"]["k2v2"]
    assert [x["rank"] for x in ranked] == [1, 2, 3, 4, 5, 6]
    e = _row(rows, "e")
    assert e[9] == "0.02"  # the noise floor column, shown, not a tie rule
    assert e[8] == "20 %"  # fp16 share at T: (0.1 + 0.3) / 2


def _passkey_recs(lost: dict[str, int], n_seeds: int = 4) -> list[dict]:
    """One counted 64-token trial per seed (80 tokens not counted); method m fails its first lost[m]."""
    out = []
    for m, k in lost.items():
        for seed in range(n_seeds):
            r = _long_rec("fp16" if m == "fp16" else "a", 2, seed)
            r["method"] = m
            r["series"]["passkey"]["accuracy"] = [0.0 if seed < k else 1.0, None]
            out.append(r)
    return out


def test_passkey_exact_match_is_compared_with_the_reference_by_mcnemar():
    summ = summarize(_passkey_recs({"fp16": 0, "p": 3, "q": 0, "r": 4}))
    mc = summ["passkey_mcnemar"]["k2v2"]
    # the unquantized model passes every counted trial: discordant = the method's failures; one-sided exact
    # binomial tail 0.5^lost (hand: 0.125 for 3, 0.0625 for 4), Holm over the 4 methods of the bit width
    assert mc["p"]["p"] == pytest.approx(0.125) == pytest.approx(stats.binomtest(3, 3, 0.5, alternative="greater").pvalue)
    assert mc["r"]["p"] == pytest.approx(0.0625) and mc["q"]["p"] == mc["fp16"]["p"] == 1.0
    assert mc["r"]["p_holm"] == pytest.approx(4 * 0.0625) and mc["p"]["p_holm"] == pytest.approx(3 * 0.125)
    assert (mc["r"]["n_trials"], mc["r"]["lost"], mc["r"]["min_p"]) == (4, 4, 0.0625)
    assert not any(t["separated"] for t in mc.values())  # 0.0625 > 0.025: 4 trials cannot separate
    big = summarize(_passkey_recs({"p": 8, "q": 0}, n_seeds=8))["passkey_mcnemar"]["k2v2"]
    assert big["p"]["p_holm"] == pytest.approx(2 * 0.5 ** 8) and big["p"]["separated"]


def test_passkey_table_shows_the_verdict_and_what_the_trials_can_decide(md):
    pk = _table(md, "### Passkey retrieval")
    assert pk[0][-1] == "vs unquantized (McNemar)"
    assert next(r for r in pk if r[0] == "`fp16`" and r[1] == "k2v2")[-1] == "tied, 0 of 2 lost (Holm p 1)"
    text = md.split("### Passkey retrieval", 1)[1].split("\n|", 1)[0]
    assert "with 2 trials the smallest attainable p is 0.5^2 = 0.25 > 0.025" in text


def test_free_running_and_passkey_tables(md):
    from kvqbench.report.render.text import fmt

    free = _table(md, "### Free-running divergence")
    a = _row(free, "a")
    m, ci = mean_ci([10.0, 11.0])
    assert a[1] == fmt(m, ci) and _row(free, "fp16")[1] == "32"
    pk = _table(md, "### Passkey retrieval")
    assert pk[0][-3:-1] == ["exact match 64 tokens", "exact match 80 tokens"]
    row = next(r for r in pk if r[0] == "`c`" and r[1] == "k2v2")
    m, ci = mean_ci([DROP["c"] * _jitter(s) for s in SEEDS])
    assert row[2] == fmt(m, ci) and row[-3:-1] == ["50 %", "—"]
    text = md.split("### Passkey retrieval", 1)[1].split("\n|", 1)[0]
    assert "64 tokens 100 %, 80 tokens 67 % (not counted)" in text


def test_predictivity_against_the_long_targets_is_one_for_a_monotone_metric(board, md):
    pr = board["sources"]["real"]["predictivity"]["targets"]
    assert set(PREDICTIVITY_TARGETS) >= {"long_kl_nats", "passkey_logp_drop_nats"}
    pooled = {t: {r["metric"]: r["rho"] for r in pr[t]["pooled"]} for t in PREDICTIVITY_TARGETS}
    assert pooled["long_kl_nats"]["k_rel_mse"] == pytest.approx(1.0)
    assert pooled["passkey_logp_drop_nats"]["v_rel_mse"] == pytest.approx(1.0)
    assert pooled["e2e_prefill_kl_nats"]["rel_mse"] == pytest.approx(1.0)
    assert pooled["long_kl_nats"]["rel_mse"] < 1.0  # a/b swapped in the long decode
    text = md.split("### Does the tensor metric", 1)[1]
    assert text.split("\n\n", 2)[1].startswith("`rel_mse`, the best predictor of `e2e_prefill_kl_nats` (ρ = +1.00")


def test_predictivity_from_exp6_alone():
    recs = [r for r in records() if r["experiment"] != "exp5"]
    pr = predictivity(assemble(recs, catalog(), copy.deepcopy(PROVENANCE))["sources"]["real"]["stats"], catalog())
    assert pr is not None and "e2e_prefill_kl_nats" not in pr["targets"]
    assert {r["metric"]: r["rho"] for r in pr["targets"]["long_kl_nats"]["k2v2"]}["k_rel_mse"] == pytest.approx(1.0)


def test_report_rebuilds_the_tables_and_figure_without_torch(tmp_path):
    """``kvqbench report --rebuild`` in a process where importing torch fails: the same Markdown, and the
    KL-vs-position figure."""
    import os
    import subprocess
    import sys

    from tests.unit.test_report_samples import write_results

    # a finder that refuses torch (not ``sys.modules["torch"] = None``, which scipy's spearmanr, used by
    # predictivity, reads as a torch module that lacks ``Tensor``)
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\n\nclass _NoTorch:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n            raise ImportError('torch is blocked')\n\n"
        "sys.meta_path.insert(0, _NoTorch())\n")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), root])}
    assert subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True).returncode != 0
    d = write_results(tmp_path / "run", records())
    before = (d / "LEADERBOARD.md").read_text(encoding="utf-8")
    (d / "LEADERBOARD.md").unlink()
    (d / "leaderboard.json").unlink()  # rebuilt from the exp*_*.json, long_decode entry included
    res = subprocess.run([sys.executable, "-m", "kvqbench.cli", "report", str(d)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    after = (d / "LEADERBOARD.md").read_text(encoding="utf-8")
    assert after == before and "### Passkey retrieval" in after and "### KL vs decoded position" in after
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("figures need matplotlib (Markdown part passed)")
    assert (d / "kl_vs_position_real.png").read_bytes()[:4] == b"\x89PNG"


def test_kl_vs_position_figure_has_one_line_per_method(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="figures need matplotlib (pip install 'kvqbench[plots]')")
    from test_figures_content import _line_labels, keep_figures

    from kvqbench.report.render.figures import write_figures
    from tests.unit.test_report_samples import write_results

    figs = keep_figures(monkeypatch)
    write_results(tmp_path, records())
    write_figures(tmp_path)
    assert (tmp_path / "kl_vs_position_real.png").exists()
    fig = figs["kl_vs_position_real.png"]
    axes = [ax for ax in fig.axes if ax.get_lines()]
    assert [ax.get_title() for ax in axes] == ["k2v2", "k4v4"]
    for ax in axes:
        assert _line_labels(ax) == ["a", "b", "c", "d", "e"]  # fp16: KL exactly 0, named in the note
        assert ax.get_yscale() == "log"
        assert any("fp16" in t.get_text() for t in ax.texts)
    line = next(ln for ln in axes[0].get_lines() if ln.get_label() == "c")
    assert list(line.get_ydata()) == pytest.approx([math.fsum(0.3 * _jitter(s) * (i + 1) for s in SEEDS) / 2
                                                    for i in range(3)])


def test_a_method_short_of_seeds_is_listed_but_not_ranked():
    recs = [r for r in records() if not (r["experiment"] == "exp6" and r["method"] == "b" and r["seed"] == 1)]
    md = render_markdown(assemble(recs, catalog(), copy.deepcopy(PROVENANCE)))
    rows = _table(md, "### Long decode", "k2v2")
    b = _row(rows, "b")
    assert b[0] == "n=1/2" and "(n=1/2)" in b[2] and rows[-1] == b and b[-1] == "not ranked: n=1 of 2 seeds"
    assert _row(rows, "a")[0] == "5"


def test_matched_budget_over_a_long_decode(md):
    rows = _table(md, "### Best method at a matched budget over a long decode")
    by = {r[0]: r for r in rows[1:]}
    assert by["≤ 2.25"][1] == "—"  # every quantizing method bills 2.5 at k2v2, 4.5 at k4v4; fp16 16
    # e is best at k2v2; d has 0.2/0.19 of its KL on both texts (the same jitter), so the paired rule
    # separates them although e's noise floor covers their gap (the per-setting table still ties them)
    ratio = LONG["d"] / LONG["e"]
    assert by["≤ 2.5"][1:4] == ["`e` (rank 1, P(best) 1.00)", "k2v2", "2.5"] and len(rows[0]) == 7
    assert by["≤ 2.5"][5] == "—" and by["≤ 2.5"][6].startswith(f"d {ratio:.3g}× [{ratio:.3g}, {ratio:.3g}]; c ")
    assert by["≤ 8.25"][1:4] == ["`e` (rank 1, P(best) 1.00)", "k4v4", "4.5"]  # the same at k4v4


def test_a_long_tier_alone_ranks_its_first_screen_on_the_long_decode_kl():
    # `kvqbench run --long` writes exp6 alone: no end-to-end and no tensor metric, so the first screen ranks
    # on the long-decode KL at the bits billed at T instead of showing empty rows
    recs = [r for r in records() if r["experiment"] == "exp6"]
    md = render_markdown(assemble(recs, catalog(), copy.deepcopy(PROVENANCE)))
    first = md.split("# Details", 1)[0]
    assert "best method at a matched budget, by long-decode KL" in first
    rows = _table(first, "best method at a matched budget, by long-decode KL")
    by = {r[0]: r for r in rows[1:]}
    # every quantizing method bills 2.5 at k2v2, 4.5 at k4v4: e is the least damaged and d, 0.2/0.19 of it on
    # every text, is separated, as in the long-decode budget table
    ratio = LONG["d"] / LONG["e"]
    assert by["≤ 2.5"][1:4] == ["`e` (rank 1, P(best) 1.00)", "k2v2", "2.5"] and by["≤ 2.25"][1] == "—"
    assert by["≤ 2.5"][-1].startswith(f"d {ratio:.3g}× [{ratio:.3g}, {ratio:.3g}]")
    assert rows[0][3:5] == ["bits billed at T", "long-decode KL (`long_kl_nats`)"]
