"""Predictivity (which tensor metrics predict the end-to-end KL of exp5), the headline it chooses, and the
leaderboard/README that lead with it. Torch-free; hand-built records with known rank relations."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import spearmanr

from kvqbench.report.board import assemble
from kvqbench.report.render.markdown import render_markdown
from kvqbench.report.stats.headline import choose_headline
from kvqbench.report.stats.predictivity import PREDICTIVITY_TARGETS, predictivity, spearman_rows
from kvqbench.results.publish import render_digest
from tests.unit.test_report_samples import PROVENANCE, _rec, catalog

METHODS = ("fp16", "a", "b", "c", "d", "e")
#: end-to-end KL per method at k2v2 (k4v4 is 1/16 of it); fp16 exact
KL = {"fp16": 0.0, "a": 0.9, "b": 0.5, "c": 0.3, "d": 0.2, "e": 0.1}
#: a tensor metric that ranks methods differently: swaps a/b and d/e
SHUFFLED = {"fp16": 0.0, "a": 0.4, "b": 0.6, "c": 0.3, "d": 0.1, "e": 0.15}


def _records() -> list[dict]:
    out = []
    for m in METHODS:
        for bits, f in ((2, 1.0), (4, 1 / 16), (16, 0.0)):
            for seed in (0, 1):
                j = 1 + 0.01 * seed
                kl = KL[m] * f * j
                eff = 16.0 if m == "fp16" or bits == 16 else bits + 0.25
                # rel_mse: monotone in KL (a perfect predictor); k_rel_mse: the shuffled order
                out.append(_rec("exp1", m, bits, seed, "real", {
                    "rel_mse": kl / 3, "k_rel_mse": SHUFFLED[m] * f, "v_rel_mse": kl / 2, "bits_effective": eff,
                    "k_norm_bias": -kl, "k_mse": kl * 5}))
                if bits < 16:
                    out.append(_rec("exp5", m, bits, seed, "real", {
                        "e2e_prefill_kl_nats": kl, "e2e_decode_kl_nats": kl * 1.1, "e2e_prefill_top1_agree": 1 - kl}))
                out.append(_rec("exp1", m, bits, seed, "synthetic", {"rel_mse": kl, "bits_effective": eff}))
    return out


@pytest.fixture(scope="module")
def board() -> dict:
    return assemble(_records(), catalog(), copy.deepcopy(PROVENANCE))


@given(st.lists(st.tuples(st.integers(-3, 3), st.floats(-5, 5, allow_nan=False, width=32)), min_size=3, max_size=12))
def test_spearman_rows_equals_scipy(pairs) -> None:
    x = np.array([p[0] for p in pairs], dtype=float)  # small integers: many ties
    y = np.array([p[1] for p in pairs], dtype=float)
    got = float(spearman_rows(x[None], y[None])[0])
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        assert np.isnan(got)
    else:
        assert got == pytest.approx(float(spearmanr(x, y).statistic), abs=1e-12)


def test_rho_equals_scipy_on_the_same_vectors(board) -> None:
    pr = board["sources"]["real"]["predictivity"]
    rows = pr["targets"]["e2e_prefill_kl_nats"]
    assert pr["groups"] == ["k2v2", "k4v4", "pooled"]
    st_ = board["sources"]["real"]["stats"]
    methods = [m for m in METHODS if m != "fp16"]  # exact points are left out
    for group, settings in (("k2v2", ["k2v2"]), ("pooled", ["k2v2", "k4v4"])):
        row = next(r for r in rows[group] if r["metric"] == "k_rel_mse")
        x = [st_["exp1"][m][s]["k_rel_mse"]["mean"] for m in methods for s in settings]
        y = [st_["exp5"][m][s]["e2e_prefill_kl_nats"]["mean"] for m in methods for s in settings]
        assert row["rho"] == float(spearmanr(x, y).statistic)
        assert row["n_methods"] == 5 and row["n_points"] == 5 * len(settings)
        assert row["ci95"][0] <= row["rho"] <= row["ci95"][1]


def test_perfect_predictor_first_with_degenerate_ci_and_directions(board) -> None:
    k2 = {r["metric"]: r for r in board["sources"]["real"]["predictivity"]["targets"]["e2e_prefill_kl_nats"]["k2v2"]}
    # rel_mse is monotone in KL: ρ = 1 in every resample
    assert k2["rel_mse"]["rho"] == pytest.approx(1.0, abs=1e-12)
    assert k2["rel_mse"]["ci95"] == pytest.approx([1.0, 1.0], abs=1e-12)
    # a 'zero' metric is taken by magnitude: |−KL| predicts KL perfectly too
    assert k2["k_norm_bias"]["rho"] == pytest.approx(1.0, abs=1e-12)
    # shuffled order: 1 − 6·Σd²/(n(n²−1)) with two swapped pairs (d² = 1 each, four times) → 1 − 24/120
    assert k2["k_rel_mse"]["rho"] == pytest.approx(0.8)
    assert "bits_effective" not in k2  # budgets are not errors
    order = [r["metric"] for r in board["sources"]["real"]["predictivity"]["targets"]["e2e_prefill_kl_nats"]["k2v2"]]
    assert order.index("k_rel_mse") > order.index("rel_mse")


def test_bootstrap_is_seeded_and_deterministic(board) -> None:
    st_ = board["sources"]["real"]["stats"]
    cat = catalog()
    assert predictivity(st_, cat) == predictivity(st_, cat)
    assert predictivity(st_, cat, seed=1) != predictivity(st_, cat, seed=0)  # the CIs move with the seed
    assert predictivity(board["sources"]["synthetic"]["stats"], cat) is None  # no exp5 there


def test_headline_is_the_best_pooled_metric_with_its_e2e_kl(board) -> None:
    h = board["headline"]
    assert h["from_predictivity"] and h["group"] == "pooled" and h["target"] == PREDICTIVITY_TARGETS[0]
    # four perfect predictors tie at ρ = 1; ties go by name, and a scale-dependent metric (k_mse, in
    # squared units of K) is never the headline
    pooled = {r["metric"]: r for r in board["sources"]["real"]["predictivity"]["targets"][h["target"]]["pooled"]}
    assert pooled["k_mse"]["rho"] == pytest.approx(1.0, abs=1e-12)
    assert h["metric"] == "k_norm_bias" and h["rho"] == pytest.approx(1.0, abs=1e-12)
    real = board["sources"]["real"]["headline"]
    b25 = next(r for r in real if r["budget"] == 2.25)
    assert (b25["method"], b25["setting"]) == ("e", "k2v2")
    assert b25["e2e_kl"] == pytest.approx(KL["e"] * 1.005)
    assert all(r["setting"] != "k16v16" for r in real)
    syn = board["sources"]["synthetic"]["headline"]  # same metric on the other source, no e2e there
    assert all(r["e2e_kl"] is None for r in syn)
    assert choose_headline({"synthetic": {"predictivity": None}})["metric"] == "rel_mse"


def test_markdown_leads_with_the_answer_and_ends_with_provenance(board) -> None:
    md = render_markdown(board)
    lines = md.splitlines()
    assert lines[2].startswith("## real") and "best method at a matched budget" in lines[2]
    assert "Spearman ρ = +1.00" in md.split("# Details")[0]
    assert md.index("## synthetic") < md.index("# Details")
    assert md.index("### Which tensor metrics predict model damage") > md.index("# Details")
    assert md.rstrip().splitlines()[-3] == "## Provenance" or "## Provenance" in md.split("## Methods")[-1]
    assert md.index("## Provenance") > md.index("## Methods")
    pareto = md.split("### Pareto front")[1].split("###")[0]
    assert "k16v16" not in pareto and "16-bit settings are exact" in pareto


def test_readme_digest_comes_from_the_same_headline(board) -> None:
    digest = render_digest(board)
    assert "end-to-end KL" in digest  # ranked on the measured damage, the headline metric beside it
    assert "k_norm_bias" in digest


def test_predictivity_figure_only_where_exp5_ran(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from kvqbench.report.render.figures import write_figures
    from tests.unit.test_report_samples import write_results

    out = write_results(tmp_path / "r", _records())
    logs: list[str] = []
    names = {p.name for p in write_figures(out, log=logs.append)}
    assert "predictivity_real.png" in names and "predictivity_synthetic.png" not in names, logs
    data = (out / "predictivity_real.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_predictivity_figure_panels_hold_the_best_metrics_and_every_point(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    from kvqbench.report.render.figures import save, write_figures
    from tests.unit.test_report_samples import write_results

    got = {}
    orig = save.finish
    monkeypatch.setattr(save, "finish", lambda fig, path: got.setdefault(path.name, fig) and orig(fig, path))
    out = write_results(tmp_path / "r", _records())
    write_figures(out, log=lambda m: None)
    fig = got["predictivity_real.png"]
    board = assemble(_records(), catalog(), copy.deepcopy(PROVENANCE))
    rows = board["sources"]["real"]["predictivity"]["targets"][PREDICTIVITY_TARGETS[0]]["pooled"][:4]
    axes = [ax for ax in fig.axes if ax.get_xlabel()]
    assert len(axes) == len(rows) and "k_norm_bias" in [r["metric"] for r in rows]
    for ax, r in zip(axes, rows):
        assert r["metric"] in ax.get_xlabel() and f"{r['rho']:+.2f}" in ax.get_title()
        # a signed metric (k_norm_bias = −KL here) is drawn by magnitude, and the axis says so
        assert ax.get_xlabel().startswith(f"|{r['metric']}|") == (r["metric"] == "k_norm_bias")
        assert len(ax.collections) == 2 * (len(METHODS) - 1)  # every method × bits but fp16 (KL exactly 0)
    legend = {t.get_text() for t in axes[-1].get_legend().get_texts()}
    assert legend == {f"{m} {s}" for m in METHODS if m != "fp16" for s in ("k2v2", "k4v4")}


def test_fp16_endtoend_flag(board) -> None:
    flags = {d["name"]: d for d in board["sources"]["real"]["data_quality"]}
    assert flags["fp16_endtoend_exact"]["ok"] is True
    bad = _records()
    for r in bad:
        if r["experiment"] == "exp5" and r["method"] == "fp16":
            r["metrics"]["e2e_prefill_kl_nats"] = 1e-9
    flags = {d["name"]: d for d in assemble(bad, catalog(), copy.deepcopy(PROVENANCE))["sources"]["real"]["data_quality"]}
    assert flags["fp16_endtoend_exact"]["ok"] is False and flags["fp16_endtoend_exact"]["offenders"]
