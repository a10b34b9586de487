"""What each figure holds (axes, series by label, notes), read from the matplotlib figure before it is
closed, against the records it was drawn from; the helpers behind what a figure says (the fp16 note,
density bins and range, coinciding curves)."""

from __future__ import annotations

import pytest
from test_report_samples import records, write_results

from kvqbench.report.render.figures import save, write_figures

pytest.importorskip("matplotlib", reason="figures need matplotlib (pip install 'kvqbench[plots]')")

ALL = ("pareto", "mse_vs_bits", "attn_error_vs_context", "attn_kl_vs_context", "norm_diff_density", "cost")


def keep_figures(monkeypatch) -> dict:
    """``{file name: Figure}`` of every figure saved from now on (each still written), read before it
    is closed."""
    figs = {}
    orig = save.finish
    monkeypatch.setattr(save, "finish", lambda fig, path: figs.setdefault(path.name, fig) and orig(fig, path))
    return figs


def _bars(ax) -> list:
    from matplotlib.container import BarContainer

    return [b for c in ax.containers if isinstance(c, BarContainer) for b in c]


def _bar_labels(ax) -> list[str]:
    from matplotlib.container import BarContainer

    return sorted(c.get_label() for c in ax.containers if isinstance(c, BarContainer))


def _line_labels(ax) -> list[str]:
    return [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")]


def _rich_records():
    """The sample records plus what the figures must explain: a pseudo-decode billed-bits series
    that changes with the length for kvarn only, a norm-difference histogram with a wide tail
    (rtn_token K), one with 30 % of its tokens past its last bin (kivi K, exp3's flat layout with under-
    and overflow), and cost bits of 2.0 (kivi) and 2.7 (kvarn) beside fp16's 16."""
    from test_report_samples import CTX

    recs = records()
    for r in recs:
        if r["experiment"] == "exp2":
            flat = 16.0 if r["method"] == "fp16" else r["k_bits"] + 0.25
            r["series"]["pseudo_decode"]["bits_effective"] = (
                [16.0, 8.0, 5.0, 6.0] if r["method"] == "kvarn" and r["k_bits"] == 2 else [flat] * len(CTX))
            if r["method"] == "kvarn" and r["k_bits"] == 2:
                # 32 sink tokens; every token fp16 at 64, the newest 64, 0 and 64 tokens fp16 at 128, 256, 512
                r["series"]["pseudo_decode"]["fp16_token_share"] = [1.0, 96 / 128, 32 / 256, 96 / 512]
                pol = {"sink_tokens": 32, "tile_tokens": 64, "residual_tokens": 0, "residual_mode": "none"}
                r["extra"] = {"decode": {"policy": {"k": pol, "v": pol}}}
                dec = r["series"]["pseudo_decode"]  # exactly 0 where every token is fp16; small where the
                dec["attn_kl"] = [0.0, 1e-4, dec["attn_kl"][2], 1e-4]  # newest are, large where they are not
                dec["attn_mse"] = [0.0, 1e-4, dec["attn_mse"][2], 1e-4]
        if r["experiment"] == "exp3" and r["method"] == "rtn_token":
            edges = [-2.0 + 0.25 * i for i in range(17)] + [4.0, 8.0, 16.0]
            counts = [0.0] * 8 + [120.0, 40.0, 15.0, 8.0, 5.0, 3.0, 2.0, 2.0, 2.0, 2.0, 1.6]  # a tail out to 16
            r["series"]["k_norm_diff"] = {"edges": edges, "counts": counts}
        if r["experiment"] == "exp3" and r["method"] == "kivi":  # the flat layout of exp3: 30 % of K past 4.0
            edges = [-1.0 + 0.25 * i for i in range(21)]
            k = [0.0] + [0.7 / 20] * 20 + [0.3]  # [underflow, 20 bins, overflow], shares of tokens
            v = [0.0] + [1.0 / 20] * 20 + [0.0]
            r["series"] = {"norm_diff_edges": edges, "k_norm_diff_density": k, "v_norm_diff_density": v}
        if r["experiment"] == "exp4" and r["k_bits"] == 2 and r["method"] in ("kvarn", "kivi"):
            r["metrics"]["cost_bits_effective"] = 2.7 if r["method"] == "kvarn" else 2.0
    return recs


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """Every figure of the rich sample, rendered once: ``(records, {file name: Figure}, written names)``."""
    recs = _rich_records()
    with pytest.MonkeyPatch.context() as mp:
        got = keep_figures(mp)
        names = {p.name for p in write_figures(write_results(tmp_path_factory.mktemp("rich"), recs))}
    return recs, got, names


def test_figure_axes_hold_the_expected_series(rendered):
    from test_report_samples import METHODS

    _, figs, names = rendered
    assert names == {f"{n}_synthetic.png" for n in ALL} == set(figs)
    compressed = [m for m in METHODS if m != "fp16"]

    # pareto: one scatter per method plus the front
    ax = figs["pareto_synthetic.png"].axes[0]
    assert {t.get_text() for t in ax.get_legend().get_texts()} == set(METHODS) | {"Pareto front"}

    # mse vs bits: K and V panels, one errorbar series per method with a non-zero error
    for ax in figs["mse_vs_bits_synthetic.png"].axes[:2]:
        assert sorted(c.get_label() for c in ax.containers) == sorted(compressed)

    # attention error / KL vs context: static and pseudo-decode panels with every method (fp16, exactly
    # 0, is either a line or named in the "exactly 0" note), and the fp16 panel below holding exactly the
    # method whose fp16 share changes with length: its newest fp16 tokens, its billed bits on a twin axis
    for name in ("attn_error_vs_context_synthetic.png", "attn_kl_vs_context_synthetic.png"):
        axes = {ax.get_title().split(" ")[0]: ax for ax in figs[name].axes
                if ax.get_title().startswith(("static (", "pseudo-decode ("))}
        for reg in ("static", "pseudo-decode"):
            labels = set(_line_labels(axes[reg]))
            noted = " ".join(t.get_text() for t in axes[reg].texts)
            assert set(compressed) <= labels and ("fp16" in labels or "fp16" in noted), (name, reg)
        fp16_ax = next(ax for ax in figs[name].axes if ax.get_title().startswith("pseudo-decode fp16"))
        assert _line_labels(fp16_ax) == ["kvarn"]  # the newest tokens in fp16: share · L − 32 sink tokens,
        assert list(fp16_ax.get_lines()[0].get_ydata()) == [64.0, 64.0, 0.0, 64.0]  # all 64 where all are fp16
        bits_ax = next(ax for ax in figs[name].axes if "kvarn billed bits" in _line_labels(ax))
        assert bits_ax is not fp16_ax and bits_ax.get_shared_x_axes().joined(bits_ax, fp16_ax)  # a twin axis
        assert list(bits_ax.get_lines()[0].get_ydata()) == [16.0, 8.0, 5.0, 6.0]
        assert bits_ax.yaxis.get_label_position() == "right"
        notes = " ".join(t.get_text().replace("\n", " ") for ax in figs[name].axes for t in ax.texts)
        assert "kvarn: every token fp16 at 64" in notes and "the newest 64 fp16 at 128, 512" in notes
        assert "none at 256, where the length fills its last tile" in notes
        assert "The panel to the right of this note (below the pseudo-decode curves)" in notes
        # kvarn's 0 at 64 tokens cannot sit on the log axis: a ▽ on the x axis and a note say so
        decode = axes["pseudo-decode"]
        assert decode.get_yscale() == "log"
        zero = [ln for ln in decode.get_lines() if ln.get_label() == "_exactly 0: kvarn"]
        assert len(zero) == 1 and list(zero[0].get_xdata()) == [64]
        foot = " ".join(t.get_text() for t in decode.texts)
        assert "▽ kvarn at 64 tokens: exactly 0 (every token still fp16)" in foot
        # the note is about this data: it names the source and, the error being far lower wherever the
        # newest tokens are fp16 (1e-4 against the quantized length's), says the fp16 share explains it
        what = "KL" if "kl" in name else "error"
        assert f"So on this synthetic data the {what} is" in notes and "the fp16 share explains the jumps" in notes
        assert "real model" not in notes
        # the notes at the foot of the panel cover no point of any curve
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(figs[name])
        figs[name].canvas.draw()
        r = figs[name].canvas.get_renderer()
        # the ▽ is whole inside the axes: not cut by the x axis or by the panel below
        box = decode.get_window_extent(r)
        mark = zero[0].get_window_extent(r)
        assert mark.y0 >= box.y0 - 0.5 and mark.height > 5, (mark, box)
        for ax in (axes["static"], decode):
            top = max(t.get_window_extent(r).y1 for t in ax.texts)
            pts = [ax.transData.transform(xy)[1] for ln in ax.get_lines() if not ln.get_label().startswith("_")
                   for xy in ln.get_xydata()]
            assert pts and min(pts) > top, (name, min(pts), top)

    # norm-difference density: one panel per method, K and V drawn
    panels = {ax.get_title(): ax for ax in figs["norm_diff_density_synthetic.png"].axes if ax.get_title()}
    assert set(panels) == set(METHODS)
    for m, ax in panels.items():
        assert sorted(p.get_label() for p in ax.patches if p.get_label() and not p.get_label().startswith("_")) == ["K", "V"], m

    # cost: latency and bits panels, bars labelled by metric
    lat_ax, bits_ax = figs["cost_synthetic.png"].axes
    assert _bar_labels(lat_ax) == ["dequantize_ms [ms]", "quantize_ms [ms]"]
    assert _bar_labels(bits_ax) == ["cost_bits_effective [bits/element]"]


def test_fp16_panel_without_a_policy_shows_the_billed_bits(tmp_path, monkeypatch):
    """Results that record no fp16 share or streaming policy (an older run, a third-party method): the
    panel under the pseudo-decode curves holds the billed bits alone, on its own axis."""
    recs = _rich_records()
    for r in recs:
        if r["experiment"] == "exp2":
            r["series"]["pseudo_decode"].pop("fp16_token_share", None)
            r.pop("extra", None)
    figs = keep_figures(monkeypatch)
    write_figures(write_results(tmp_path / "r", [r for r in recs if r["experiment"] in ("exp1", "exp2")]))
    fig = figs["attn_kl_vs_context_synthetic.png"]
    bits_ax = next(ax for ax in fig.axes if ax.get_title().startswith("billed bits in pseudo-decode"))
    assert _line_labels(bits_ax) == ["kvarn"] and list(bits_ax.get_lines()[0].get_ydata()) == [16.0, 8.0, 5.0, 6.0]
    assert not any(ax.get_title().startswith("pseudo-decode fp16") for ax in fig.axes)


def test_density_x_range_is_chosen_from_the_data_and_off_scale_share_is_shown(rendered):
    recs, figs, _ = rendered
    panels = {ax.get_title(): ax for ax in figs["norm_diff_density_synthetic.png"].axes if ax.get_title()}
    # the wide rtn_token K histogram (k2v2, both seeds alike): share of tokens inside the drawn range,
    # computed from the record's own edges and counts
    rec = next(r for r in recs if r["experiment"] == "exp3" and r["method"] == "rtn_token" and r["k_bits"] == 2)
    edges, counts = rec["series"]["k_norm_diff"]["edges"], rec["series"]["k_norm_diff"]["counts"]
    lo, hi = panels["rtn_token"].get_xlim()
    inside = sum(c * max(0.0, min(b, hi) - max(a, lo)) / (b - a) for a, b, c in zip(edges, edges[1:], counts))
    share_in = inside / sum(counts)
    assert share_in >= 0.98  # the range holds ≥ 98 % of the tokens …
    assert 2.0 < hi < 16.0  # … reaches into the tail, yet not to its end
    texts = " ".join(t.get_text() for t in panels["rtn_token"].texts)
    assert f"K {1 - share_in:.0%}" in texts or (1 - share_in < 0.01 and "K <1%" in texts), texts
    # a narrow method's range is narrower than the wide one's
    k_lo, k_hi = panels["kvarn"].get_xlim()
    assert k_hi - k_lo < hi - lo


def _in_view(edges, shares, lo, hi):
    """Share of tokens inside [lo, hi] from a record's bins (shares per bin, pro rata for a partial bin)."""
    return sum(c * max(0.0, min(b, hi) - max(a, lo)) / (b - a) for a, b, c in zip(edges, edges[1:], shares))


def test_density_title_claim_holds_in_every_panel(rendered):
    """The title says each x-range holds the central 98 % of the tokens inside the histogram's bins
    (tokens past the last bin do not stretch it): checked in every panel against the records' own bins
    (mean over the seeds), and every share off scale, past the last bin included, is named in its panel."""
    recs, figs, _ = rendered
    fig = figs["norm_diff_density_synthetic.png"]
    assert "central 98 %" in fig._suptitle.get_text() and "inside the histogram's bins" in fig._suptitle.get_text()
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    for m, ax in panels.items():
        lo, hi = ax.get_xlim()
        note = " ".join(t.get_text() for t in ax.texts)
        for kv in ("k", "v"):
            cells = [r for r in recs if r["experiment"] == "exp3" and r["method"] == m and r["k_bits"] == 2]
            views, overs = [], []
            for r in cells:
                ser = r["series"]
                if "norm_diff_edges" in ser:  # [underflow, bins…, overflow]
                    edges, vals = ser["norm_diff_edges"], ser[f"{kv}_norm_diff_density"]
                    tot = sum(vals)
                    views.append(_in_view(edges, [v / tot for v in vals[1:-1]], lo, hi))
                    overs.append(vals[-1] / tot)
                else:
                    edges, counts = ser[f"{kv}_norm_diff"]["edges"], ser[f"{kv}_norm_diff"]["counts"]
                    views.append(_in_view(edges, [c / sum(counts) for c in counts], lo, hi))
                    overs.append(0.0)
            view, over = sum(views) / len(views), sum(overs) / len(overs)
            assert view >= 0.98 * (1 - over) - 1e-9, (m, kv, view, over, hi)
            if 1 - view >= 0.01:
                assert f"{kv.upper()} {1 - view:.0%}" in note, (m, kv, note)
            if over >= 0.01:
                assert f"{over:.0%} > {edges[-1]:g}" in note, (m, kv, note)
    # kivi K: 30 % of its tokens past the last edge (4.0) stretch nothing, and are named
    assert "(30% > 4, past the last bin)" in " ".join(t.get_text() for t in panels["kivi"].texts)
    assert panels["kivi"].get_xlim()[1] < 4.0 + 0.05 * 5


def test_cost_bits_scale_separates_2_from_2_7_bits(rendered):
    _, figs, _ = rendered
    ax = figs["cost_synthetic.png"].axes[1]
    bottom, top = ax.get_ylim()
    assert bottom == 0 and top < 16.0  # fp16's 16 bits do not set the scale
    assert (2.7 - 2.0) / (top - bottom) >= 0.15  # 0.7 bits span ≥ 15 % of the axis height
    heights = {round(float(b.get_height()), 6) for b in _bars(ax) if not b.get_hatch()}
    assert {2.0, 2.7} <= heights
    cut = [b for b in _bars(ax) if b.get_hatch()]
    assert len(cut) == 1 and cut[0].get_height() <= top  # fp16, cut at the top, hatched …
    assert any(t.get_text().startswith("16 ") for t in ax.texts)  # … its value written on it
    # the note on the cut bars sits above the axes (over no bar and no value), the legend over no value
    fig = figs["cost_synthetic.png"]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    note = [t for t in ax.texts if t.get_text().startswith("hatched bars (")]
    assert len(note) == 1 and note[0].get_window_extent(r).y0 >= ax.get_window_extent(r).y1 - 0.5
    # it names what is cut and the axis actually drawn (not a threshold the axis does not show)
    assert "fp16 16 bits" in note[0].get_text() and f"0–{top:.2g}-bit axis" in note[0].get_text()
    # every value label is readable (≥ 8 points), not squeezed to a few pixels
    assert all(t.get_fontsize() >= 8 for t in ax.texts)
    assert note[0].get_window_extent(r).y1 <= ax.title.get_window_extent(r).y0 + 0.5  # under the title
    legend = ax.get_legend().get_window_extent(r)
    values = [t.get_window_extent(r) for t in ax.texts if t not in note]
    assert values and not any(legend.overlaps(v) for v in values)


def test_mse_vs_bits_ci_reaching_zero_ends_in_a_marker_not_decades_down(tmp_path, monkeypatch):
    """A 95 % CI whose lower end is ≤ 0 (two seeds 100× apart) cannot be drawn on the log axis: its
    whisker stops at mean / 3 and a ▼ marks it, a note under the figure says so; every other whisker
    is the CI itself (mean − CI .. mean + CI, from the leaderboard's stats)."""
    recs = records(experiments=("exp1",))
    for r in recs:
        if r["method"] == "rtn_token" and r["k_bits"] == 2 and r["seed"] == 1:
            r["metrics"]["k_rel_mse"] *= 100.0
    figs = keep_figures(monkeypatch)
    out = write_results(tmp_path / "r", recs)
    write_figures(out)
    import json

    stats = json.loads((out / "leaderboard.json").read_text())["sources"]["synthetic"]["stats"]["exp1"]
    fig = figs["mse_vs_bits_synthetic.png"]
    k_ax, v_ax = fig.axes[:2]
    e = stats["rtn_token"]["k2v2"]["k_rel_mse"]
    assert e["mean"] - e["ci95"] <= 0  # the case under test
    marks = [ln for ln in k_ax.get_lines() if ln.get_label() == "_CI reaches 0: rtn_token"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [2] and marks[0].get_marker() == "v"
    assert marks[0].get_ydata()[0] == pytest.approx(e["mean"] / 3)
    assert not any(ln.get_label().startswith("_CI reaches 0") for ln in v_ax.get_lines())
    # whiskers: the errorbar containers' vertical segments, per method
    for ax, kv in ((k_ax, "k"), (v_ax, "v")):
        for c in ax.containers:
            m = c.get_label()
            segs = c.lines[2][0].get_segments()
            for seg in segs:
                x, (lo, hi) = seg[0][0], sorted((seg[0][1], seg[1][1]))
                st = stats[m][f"k{int(x)}v{int(x)}"][f"{kv}_rel_mse"]
                assert hi == pytest.approx(st["mean"] + st["ci95"])
                want = st["mean"] / 3 if st["mean"] - st["ci95"] <= 0 else st["mean"] - st["ci95"]
                assert lo == pytest.approx(want), (m, x, lo, want)
    assert any("▼" in t.get_text() and "mean / 3" in t.get_text() for t in fig.texts)


def test_fp16_note_says_what_the_data_show():
    """The pseudo-decode note: where the error with the newest tokens fp16 overlaps the error without,
    it says the share does not explain the curve; the source is named; nothing about a real model."""
    from kvqbench.report.render.figures.decode_fp16 import fp16_note

    info = {"x": [64.0, 128.0, 256.0], "share": [0.75, 32 / 256, 0.6], "newest": [16.0, 0.0, 64.0], "bits": []}
    curves = {"kvarn": ([64.0, 128.0, 256.0], [3.0, 2.0, 10.0])}
    paras = fp16_note({"kvarn": info}, ["kvarn"], curves, "kl", "synthetic")
    text = " ".join(paras)
    assert "none at 128" in text and "(KL 2)" in text and "(KL 3)" in text and "(KL 10)" in text
    assert "on this synthetic data the KL is no higher where none of the newest tokens are fp16" in text
    assert "real model" not in text
    curves = {"kvarn": ([64.0, 128.0, 256.0], [3.0, 5.0, 10.0])}  # 5 lies between 3 and 10
    text = " ".join(fp16_note({"kvarn": info}, ["kvarn"], curves, "kl", "synthetic"))
    assert "on this synthetic data the two ranges overlap: the fp16 share does not explain" in text
    curves = {"kvarn": ([64.0, 128.0, 256.0], [0.1, 0.5, 0.2])}
    text = " ".join(fp16_note({"kvarn": info}, ["kvarn"], curves, "rel_mse", "real"))
    assert "on this real data the error is 2.5–5× higher wherever none of the newest tokens are fp16" in text


def test_density_bins_merged_only_where_they_zig_zag():
    """Merging keeps each bin's mass and the edge at 0, leaves bins of another width alone; a density
    that alternates high/low bin by bin is merged in pairs, a smooth one is not."""
    from kvqbench.report.render.figures.norm_diff_density import mass_range, merge_bins, merge_factor

    edges = [-8.0, -0.4, -0.3, -0.2, -0.1, 0.0, 0.1, 0.2, 0.3, 0.4, 8.0]
    zig = [0.01, 1.0, 0.2, 3.0, 0.5, 3.0, 0.5, 1.0, 0.2, 0.01]
    e2, d2 = merge_bins(edges, zig, 2)
    assert e2 == [-8.0, -0.4, -0.2, 0.0, 0.2, 0.4, 8.0]
    mass = sum(d * (b - a) for a, b, d in zip(edges, edges[1:], zig))
    assert sum(d * (b - a) for a, b, d in zip(e2, e2[1:], d2)) == pytest.approx(mass)
    assert d2[1] == pytest.approx((1.0 + 0.2) / 2) and d2[2] == pytest.approx((3.0 + 0.5) / 2)
    assert merge_factor(edges, zig, -0.45, 0.45) == 2
    smooth = [0.0005, 0.5, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.5, 0.0005]
    assert merge_factor(edges, smooth, -0.45, 0.45) == 1
    # the x-range: the central 98 % of the tokens in the bins, interpolated inside a bin — a wide last
    # bin holding 1 % (8 units wide) does not stretch the axis to its far edge
    lo, hi = mass_range([(edges, smooth)])
    assert -1.0 < lo < 0.0 < hi < 1.0


def test_density_panel_merges_zig_zagging_bins_and_says_so(tmp_path, monkeypatch):
    """A method whose fine bins alternate high/low (kvarn K here) is drawn with its bins merged in pairs —
    the same mass per merged bin as the record's two bins — and its panel says so; a smooth method's
    panel (rtn_token) is drawn on the record's own bins."""
    recs = records(experiments=("exp1", "exp3"))
    edges = [-1.0 + 0.125 * i for i in range(17)]
    zig = [1.0, 1.0, 2.0, 1.0, 6.0, 2.0, 9.0, 3.0, 9.0, 3.0, 6.0, 2.0, 2.0, 1.0, 1.0, 1.0]
    for r in recs:
        if r["experiment"] == "exp3" and r["method"] == "kvarn":
            r["series"]["k_norm_diff"] = {"edges": edges, "counts": zig}
    figs = keep_figures(monkeypatch)
    write_figures(write_results(tmp_path / "r", recs))
    panels = {ax.get_title(): ax for ax in figs["norm_diff_density_synthetic.png"].axes if ax.get_title()}
    assert "bins merged ×2" in " ".join(t.get_text() for t in panels["kvarn"].texts)
    assert not any("merged" in t.get_text() for t in panels["rtn_token"].texts)
    k = [p for p in panels["kvarn"].patches if p.get_label() == "K"][0]
    vals, drawn_edges, _ = k.get_data()
    assert list(drawn_edges) == pytest.approx(edges[::2])  # pairs, 0 still an edge
    total = sum(zig)
    for i, v in enumerate(vals):  # each merged bin: the two record bins' share over their joint width
        assert v == pytest.approx((zig[2 * i] + zig[2 * i + 1]) / total / 0.25)


def test_coinciding_names_curves_drawn_over_one_another():
    """Curves with the same x values and every y within 2 % (of the larger) are one group; a curve 2.4 % off at
    one point, or with another x, is not (each compared with its group's first curve); groups are sorted, in order of their first name."""
    from kvqbench.report.render.figures.mse_vs_bits import coinciding

    base = [(2, 1.0), (3, 0.1), (4, 0.01)]
    curves = {"b": base, "a": [(x, y * 1.015) for x, y in base], "c": [(2, 1.0), (3, 0.104), (4, 0.01)],
              "d": base[:2], "e": [(2, 5.0)], "f": [(2, 5.05)]}
    assert coinciding(curves) == [["a", "b"], ["e", "f"]]
    assert coinciding(curves, rel=0.05) == [["a", "b", "c"], ["e", "f"]]
    assert coinciding({"x": base}) == []


def test_figures_name_what_they_cannot_show(rendered):
    """mse_vs_bits names the methods whose curves lie on top of each other in a panel (only the last one drawn
    shows); the density panel of a method whose tokens all fall in one bin says which bin (the bar beside 0
    is the bin [0, w), not a difference of w/2)."""
    from kvqbench.report.render.figures.mse_vs_bits import coinciding

    _, figs, _ = rendered
    for ax in figs["mse_vs_bits_synthetic.png"].axes[:2]:
        curves = {c.get_label(): list(zip(c.lines[0].get_xdata(), c.lines[0].get_ydata(), strict=True))
                  for c in ax.containers}
        notes = sorted(t.get_text() for t in ax.texts if t.get_text().startswith("on top of each other: "))
        assert notes == sorted("on top of each other: " + ", ".join(g) for g in coinciding(curves))
    dens = {ax.get_title(): ax for ax in figs["norm_diff_density_synthetic.png"].axes if ax.get_title()}
    assert "fp16" in dens
    for m, ax in dens.items():
        one = [t.get_text() for t in ax.texts if "all tokens in [" in t.get_text()]
        stairs = [p.get_data() for p in ax.patches if hasattr(p, "get_data")]
        in_one = {(float(d.edges[i]), float(d.edges[i + 1])) for d in stairs for i in range(len(d.values))
                  if d.values[i] * (d.edges[i + 1] - d.edges[i]) >= 0.995}
        assert bool(one) == bool(in_one), (m, one, in_one)
        for a, b in in_one:
            assert any(f"all tokens in [{a:g}, {b:g})" in t for t in one)
