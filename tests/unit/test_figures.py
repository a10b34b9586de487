"""Figures, the entry point: every figure the data supports is a valid PNG of sane size, one set per
source, missing experiments are skipped, output is deterministic (serial = parallel), a missing
matplotlib never fails; how series are found in a record; the one-draw cropped save."""

from __future__ import annotations

import struct
import sys

import pytest
from test_report_samples import records, write_results

from kvqbench.report.render.figures import FIGURES, write_figures
from kvqbench.report.render.figures.series import histograms, iter_curves

pytest.importorskip("matplotlib", reason="figures need matplotlib (pip install 'kvqbench[plots]')")

ALL = ("pareto", "mse_vs_bits", "attn_error_vs_context", "attn_kl_vs_context", "norm_diff_density", "cost")


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_every_figure_for_every_source(tmp_path):
    out = write_results(tmp_path / "r", records(sources=("synthetic", "real")))
    logs = []
    written = write_figures(out, log=logs.append)
    names = sorted(p.name for p in written)
    assert names == sorted(f"{n}_{s}.png" for n in ALL for s in ("real", "synthetic")), logs
    for p in written:
        w, h = png_size(p)
        assert 400 <= w <= 2500 and 250 <= h <= 2000, (p.name, w, h)
        assert 10_000 < p.stat().st_size < 1_500_000, p.name
    assert not logs


def test_missing_experiments_are_skipped_not_failed(tmp_path):
    out = write_results(tmp_path / "r", records(experiments=("exp1",)))
    logs = []
    names = sorted(p.name for p in write_figures(out, log=logs.append))
    assert names == ["mse_vs_bits_synthetic.png", "pareto_synthetic.png"]
    assert not logs


def test_figures_are_deterministic(tmp_path):
    out = write_results(tmp_path / "r")
    first = {p.name: p.read_bytes() for p in write_figures(out)}
    second = {p.name: p.read_bytes() for p in write_figures(out, tmp_path / "again")}
    assert first == second


def test_no_leaderboard_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="leaderboard.json"):
        write_figures(tmp_path)


def test_missing_matplotlib_logs_one_line_and_skips(tmp_path, monkeypatch):
    out = write_results(tmp_path / "r", records(experiments=("exp1",)))
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    logs = []
    assert write_figures(out, log=logs.append) == []
    assert len(logs) == 1 and "matplotlib" in logs[0]
    assert not list(out.glob("*.png"))


def test_one_broken_figure_does_not_block_the_rest(tmp_path):
    recs = records(experiments=("exp1", "exp2"))
    for r in recs:
        if r["experiment"] == "exp2":  # x and y disagree in length → that curve is ignored, not a crash
            r["series"]["static"]["attn_mse"] = [1.0]
    out = write_results(tmp_path / "r", recs)
    names = {p.name for p in write_figures(out)}
    assert {"pareto_synthetic.png", "mse_vs_bits_synthetic.png", "attn_kl_vs_context_synthetic.png"} <= names


def test_series_discovery():
    series = {"context_len": [1, 2, 3], "static": {"attn_mse": [0.1, 0.2, 0.3], "label": "x"},
              "pseudo_decode": {"attn_kl": [[1, 2, 3], [3, 4, 5]]}, "other": {"x": [1, 2], "y": [5, 6]},
              "too_short": [1, 2]}
    got = {"/".join(p): (x, y) for p, x, y in iter_curves(series)}
    assert got == {"static/attn_mse": ([1, 2, 3], [0.1, 0.2, 0.3]),
                   "pseudo_decode/attn_kl": ([1, 2, 3], [2.0, 3.0, 4.0]),  # mean over layers
                   "other/y": ([1, 2], [5, 6])}
    hists = list(histograms({"k_norm_diff": {"edges": [0, 1, 2], "counts": [3, 1]}}))
    assert hists == [(("k_norm_diff", "counts"), [0.0, 1.0, 2.0], [0.75, 0.25], (0.0, 0.0))]


def test_figure_names_cover_every_kind():
    assert [name for name, *_ in FIGURES] == [*ALL, "predictivity", "kl_vs_position"]  # exp5, exp6 only


def test_flat_histogram_layout_with_under_and_overflow():
    series = {"norm_diff_edges": [0.0, 1.0, 2.0], "k_norm_diff_density": [0.1, 0.3, 0.4, 0.2],
              "norm_diff_bins": "[underflow, bins, overflow]"}
    got = list(histograms(series))
    # the tails are not drawn, their shares kept; the bins not renormalised
    assert got == [(("k_norm_diff_density",), [0.0, 1.0, 2.0], [0.3, 0.4], (0.1, 0.2))]



def test_exp2_series_names_are_classified():
    from kvqbench.report.render.figures.series import error_kind, regime

    assert error_kind("static/out_rel_mse") == "rel_mse"
    assert error_kind("static/out_mse") == "mse" and error_kind("decode/cos_drift") == "cos"
    assert error_kind("decode/attn_kl_fwd_nats") == "kl" and error_kind("decode/attn_kl_rev_nats") == "kl_rev"
    for ignored in ("static/logit_mse", "static/out_norm_gap", "static/attn_k_rel_err", "decode/bits_effective"):
        assert error_kind(ignored) is None, ignored
    assert regime("decode/out_mse") == "pseudo-decode" and regime("static/out_mse") == "static"



def test_parallel_figures_are_the_same_files_as_serial(tmp_path):
    """jobs=2 (forked workers) writes the same PNG bytes, and returns the same paths in the same order, as
    a serial draw."""
    out = write_results(tmp_path / "r", records(sources=("synthetic", "real")))
    serial = write_figures(out, tmp_path / "serial", jobs=1)
    parallel = write_figures(out, tmp_path / "parallel", jobs=2)
    assert [p.name for p in parallel] == [p.name for p in serial] and len(serial) == 2 * len(ALL)
    assert {p.name: p.read_bytes() for p in parallel} == {p.name: p.read_bytes() for p in serial}


@pytest.mark.parametrize("far", [False, True])
def test_one_draw_save_crops_like_tight(tmp_path, far):
    """``save.finish`` paints once and crops to the drawing: the same picture as ``bbox_inches="tight"``
    (sizes within a few pixels: sub-pixel placement), a legend outside the axes kept whole; a text far
    outside the figure (beyond the painted margin) falls back to ``"tight"`` and is kept too."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from kvqbench.report.render.figures import save
    from kvqbench.report.render.figures.style import DPI

    def draw():
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.plot([1, 2, 3], [3, 1, 2], label="a long legend label for the outside legend")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        if far:
            ax.text(4.0, 0.5, "far away", transform=ax.transAxes)
        return fig

    ours = save.finish(draw(), tmp_path / "ours.png")
    fig = draw()
    fig.savefig(tmp_path / "tight.png", dpi=DPI, metadata={"Software": None}, bbox_inches="tight")
    plt.close(fig)
    (w1, h1), (w2, h2) = png_size(ours), png_size(tmp_path / "tight.png")
    assert abs(w1 - w2) <= 6 and abs(h1 - h2) <= 6, ((w1, h1), (w2, h2))
    assert w1 > 5 * DPI  # wider than the figure itself: the outside legend is in the picture

