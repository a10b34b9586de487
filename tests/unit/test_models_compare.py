"""Two models side by side (kvqbench/report/stats/models.py, render/models.py, render/figures/models.py): end-to-end KL ranks and their
rank correlation, the headline metric's predictivity out of sample, and the KL-vs-KL figure. Torch-free;
synthetic statistics with known rank relations."""

from __future__ import annotations

import copy

import pytest

from kvqbench.report.board import assemble
from kvqbench.report.render.models import render_rank_table, render_transfer
from kvqbench.report.stats.headline import HEADLINE_DEFAULT
from kvqbench.report.stats.models import predictivity_transfer, rank_table
from tests.unit.test_report_samples import PROVENANCE, _rec, catalog

KL_A = {"fp16": 0.0, "a": 1.6, "b": 1.3, "c": 1.0, "d": 0.8, "e": 0.6, "f": 0.45, "g": 0.3, "h": 0.2}
KL_B = dict(KL_A, c=0.7, d=1.1)  # model B swaps c and d: one adjacent swap


def _stats(kl: dict[str, float], *, k4_factor: float = 1 / 16) -> dict:
    """One model's stats: exp5 KL at k2v2 and k4v4 (two seeds, 95% CI), fp16 exact."""
    e2e: dict = {}
    for m, v in kl.items():
        for s, f in (("k2v2", 1.0), ("k4v4", k4_factor)):
            e2e.setdefault(m, {})[s] = {"e2e_prefill_kl_nats": {"mean": v * f, "ci95": 0.01 * v * f, "n": 2, "n_asked": 2}}
    return {"exp5": e2e}


def test_rank_table_ranks_and_rho_between_models():
    t = rank_table({"A": _stats(KL_A), "B": _stats(KL_B)})
    assert t["models"] == ["A", "B"] and t["settings"] == ["k2v2", "k4v4"]
    rows = {r["method"]: r for r in t["rows"]}
    assert "fp16" not in rows  # exact: KL 0 on both, not ranked
    by_kl_a = sorted((v, m) for m, v in KL_A.items() if v)
    for i, (_, m) in enumerate(by_kl_a):
        assert rows[m]["A"]["k2v2"]["rank"] == i + 1 == rows[m]["A"]["k4v4"]["rank"]
    assert (rows["c"]["B"]["k2v2"]["rank"], rows["d"]["B"]["k2v2"]["rank"]) == (rows["d"]["A"]["k2v2"]["rank"],
                                                                               rows["c"]["A"]["k2v2"]["rank"])
    # one adjacent swap among n = 8: ρ = 1 − 6·Σd²/(n(n²−1)) = 1 − 12/504
    for s in ("k2v2", "k4v4"):
        assert t["rho"][s]["rho"] == pytest.approx(1 - 12 / 504) and t["rho"][s]["n_methods"] == 8
    assert [r["method"] for r in t["rows"]] == [m for _, m in by_kl_a]  # model A's order
    md = render_rank_table(t)
    assert "k2v2: ρ = +0.98 over 8 methods" in md and "| `h`" in md
    with pytest.raises(ValueError, match="exactly two"):
        rank_table({"A": _stats(KL_A), "B": _stats(KL_B), "C": _stats(KL_A)})


def test_rank_table_skips_methods_one_model_lacks():
    b = _stats({m: v for m, v in KL_B.items() if m != "h"})
    t = rank_table({"A": _stats(KL_A), "B": b})
    rows = {r["method"]: r for r in t["rows"]}
    assert rows["h"]["B"] == {} and rows["h"]["A"]["k2v2"]["rank"] == 1
    assert t["rho"]["k2v2"]["n_methods"] == 7


def _model_records(kl: dict[str, float], tensor: dict[str, dict[str, float]]) -> list[dict]:
    out = []
    for m, v in kl.items():
        for bits, f in ((2, 1.0), (4, 1 / 16)):
            for seed in (0, 1):
                j = 1 + 0.01 * seed
                out.append(_rec("exp1", m, bits, seed, "real", {"bits_effective": bits + 0.25}))
                out.append(_rec("exp2", m, bits, seed, "real", {name: vals[m] * f * j for name, vals in tensor.items()}))
                out.append(_rec("exp5", m, bits, seed, "real", {"e2e_prefill_kl_nats": v * f * j}))
    return out


def _model(kl: dict[str, float], tensor: dict[str, dict[str, float]]) -> dict:
    src = assemble(_model_records(kl, tensor), catalog(), copy.deepcopy(PROVENANCE))["sources"]["real"]
    return {"stats": src["stats"], "predictivity": src["predictivity"]}


def test_predictivity_transfer_both_ways():
    """On A the declared default ranks methods as A's KL does; on B another metric does and the default is
    scrambled: the choice made on A does not transfer to B, and B's choice (the other metric) transfers
    to A only if it predicts A too — here it is scrambled on A."""
    kl = {m: v for m, v in KL_A.items() if m != "fp16"}
    scrambled = dict(zip(kl, [0.5, 0.2, 0.9, 0.3, 1.1, 0.4, 0.8, 0.6]))
    d, other = HEADLINE_DEFAULT["metric"], "static_out_rel_mse"
    a = _model(kl, {d: kl, other: scrambled})
    b = _model(kl, {d: scrambled, other: kl})
    tr = predictivity_transfer({"A": a, "B": b}, catalog())
    ab, ba = tr["directions"]
    assert (ab["from"], ab["metric"], ab["transfers"], ab["best_on_to"]) == ("A", d, False, other)
    assert (ba["from"], ba["metric"], ba["transfers"], ba["best_on_to"]) == ("B", other, False, d)
    assert ab["rho_from"] == pytest.approx(1.0) and ab["rho_to"] < ab["rho_from"]
    rows = {r["metric"]: r for r in tr["metrics"]}
    assert rows[d]["A"]["rho"] == pytest.approx(1.0) and rows[d]["B"]["rho"] == ab["rho_to"]
    same = predictivity_transfer({"A": a, "B": _model(kl, {d: kl, other: scrambled})}, catalog())
    assert all(x["transfers"] for x in same["directions"])
    text = render_transfer(tr)
    assert f"Chosen on A: `{d}`" in text and f"it does not transfer: on B the rule picks `{other}`" in text


def test_kl_models_figure_one_point_per_method_and_bits(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="figures need matplotlib (pip install 'kvqbench[plots]')")
    from kvqbench.report.render.figures import save
    from kvqbench.report.render.figures.models import FILE, draw_models

    figs: dict = {}
    orig = save.finish
    monkeypatch.setattr(save, "finish", lambda fig, path: figs.setdefault(path.name, fig) and orig(fig, path))
    path = draw_models({"A": _stats(KL_A), "B": _stats(KL_B)}, tmp_path)
    assert path == tmp_path / FILE and path.stat().st_size > 0
    ax = figs[FILE].axes[0]
    pts = sorted(tuple(map(float, c.get_offsets()[0])) for c in ax.collections)
    want = sorted((KL_A[m] * f, KL_B[m] * f) for m in KL_A if KL_A[m] for f in (1.0, 1 / 16))
    assert [v for p in pts for v in p] == pytest.approx([v for p in want for v in p])  # 8 methods × 2 bit widths; fp16 (KL 0) has no place on log axes
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert draw_models({"A": {}, "B": {}}, tmp_path) is None


def test_a_board_with_two_models_has_their_section_and_figure(tmp_path):
    """Two real sources with an end-to-end run (``real`` and ``real-other``) in one set of records: the
    board's ``models`` holds the same rank table :func:`rank_table` gives on their stats, the Markdown a
    section naming both, and the figures include ``kl_models.png``."""
    import json

    from kvqbench.report.render.figures import write_figures
    from kvqbench.report.render.markdown import render_markdown

    tensor = {HEADLINE_DEFAULT["metric"]: KL_A}
    recs = _model_records(KL_A, tensor)
    for r in _model_records(KL_B, tensor):
        r["source"] = "real-other"
        r["nodeid"] = r["nodeid"].replace("-real", "-real-other")
        recs.append(r)
    board = assemble(recs, catalog(), copy.deepcopy(PROVENANCE))
    assert set(board["sources"]) >= {"real", "real-other"}
    pair = board["models"]["sources"]
    assert list(pair.values()) == ["real", "real-other"]
    want = rank_table({m: board["sources"][s]["stats"] for m, s in pair.items()})
    assert board["models"]["rank_table"] == want
    assert want["rho"]["k2v2"]["rho"] == pytest.approx(1 - 12 / 504)
    md = render_markdown(board)
    assert "## Two models: " in md and render_rank_table(want) in md
    (tmp_path / "leaderboard.json").write_text(json.dumps(board))
    written = write_figures(tmp_path, log=lambda m: None)
    assert tmp_path / "kl_models.png" in written
    one = assemble(_model_records(KL_A, tensor), catalog(), copy.deepcopy(PROVENANCE))
    assert one["models"] is None and "## Two models" not in render_markdown(one)


def test_kl_models_colours_are_the_other_figures_and_the_pages(tmp_path, monkeypatch):
    """One method, one colour: ``kl_models.png`` colours each method as the predictivity figure of the same
    run and the web page do (the board's method order). Here fp16 sorts between f and g, so colours taken
    over the sorted methods without fp16 would shift g and h against the other figures."""
    pytest.importorskip("matplotlib", reason="figures need matplotlib (pip install 'kvqbench[plots]')")
    import json

    from matplotlib.colors import to_hex

    from kvqbench.report.render.figures import save, write_figures
    from kvqbench.report.render.html import page_data

    tensor = {HEADLINE_DEFAULT["metric"]: KL_A}
    recs = _model_records(KL_A, tensor)
    for r in _model_records(KL_B, tensor):
        r["source"], r["nodeid"] = "real-other", r["nodeid"].replace("-real", "-real-other")
        recs.append(r)
    board = assemble(recs, catalog(), copy.deepcopy(PROVENANCE))
    (tmp_path / "leaderboard.json").write_text(json.dumps(board, sort_keys=True))  # as a run saves it
    figs: dict = {}
    orig = save.finish
    monkeypatch.setattr(save, "finish", lambda fig, path: figs.setdefault(path.name, fig) and orig(fig, path))
    write_figures(tmp_path, log=lambda m: None, jobs=1)

    def colours(name: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for ax in figs[name].axes:
            for c in ax.collections:
                if c.get_label() and not c.get_label().startswith("_"):
                    out.setdefault(c.get_label().split()[0], to_hex(c.get_edgecolor()[0]))
        return out

    on_models, on_predictivity = colours("kl_models.png"), colours("predictivity_real.png")
    on_page = {m["id"]: m["color"].lower() for m in page_data(board)["methods"]}
    assert set(on_models) == set(KL_A) - {"fp16"} and set(on_predictivity) >= set(on_models)
    assert {m: on_predictivity[m] for m in on_models} == on_models == {m: on_page[m] for m in on_models}
    assert len(set(on_models.values())) == len(on_models)  # eight methods, eight colours
