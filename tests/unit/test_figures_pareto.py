"""The Pareto figure's labels: in a crowded front no label overlaps another label or a marker, no leader
line crosses a marker, a label or another leader; the geometry tests they rely on."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("matplotlib", reason="figures need matplotlib (pip install 'kvqbench[plots]')")


def meets(seg, box) -> bool:
    """Whether one segment ``(x0, y0, x1, y1)`` passes through one box ``(x0, y0, x1, y1)``."""
    from kvqbench.report.render.figures import placement

    return bool(placement.seg_box_hits([seg], [box])[0, 0])


def text_extent(a, renderer):
    """The window extent (pixels) of the text of annotation ``a`` where the annotation puts it."""
    from matplotlib.text import Text

    a.update_positions(renderer)
    return Text.get_window_extent(a, renderer)


@pytest.mark.parametrize("dense", [False, True])
def test_pareto_labels_never_overlap_labels_or_markers(tmp_path, monkeypatch, dense):
    """A crowded front (12 points between 2 and 3 bits, each with a neighbour): every label's text box
    is clear of every other label and of every marker; a leader line passes through no other marker,
    no label and no other leader. Dense (the 12 points' markers overlap, far from one more point):
    numbers stand in for names, each explained in the key, still clear of markers and of each other."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from kvqbench.report.render.figures import pareto, placement, save
    from kvqbench.report.render.figures.data import Source
    from kvqbench.report.render.figures.style import Style

    got = {}
    monkeypatch.setattr(save, "finish", lambda fig, path: got.setdefault("fig", fig))
    methods = [f"m{i}" for i in range(12)]
    step, ratio = (0.012, 0.96) if dense else (0.08, 0.85)
    front = [{"method": m, "setting": "k2v2", "bits_effective": 2.0 + step * i, "rel_mse": 0.1 * ratio ** i}
             for i, m in enumerate(methods)]
    others = [{"method": m, "setting": "k3v3", "bits_effective": p["bits_effective"] + step * 0.4,
               "rel_mse": p["rel_mse"] * (1.03 if dense else 1.3)} for m, p in zip(methods, front)]
    if dense:  # one more point far away stretches the axes: the 12 markers overlap
        front.append({"method": "m0", "setting": "k8v8", "bits_effective": 8.0, "rel_mse": 1e-4})
    pareto.draw(plt, Source("synthetic", {"pareto": {"points": front + others, "front": front}}, Style(methods),
                            {}, {}), tmp_path)
    fig = got["fig"]
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    wanted = {f"{p['method']} {p['setting']}" for p in front} | {str(i + 1) for i in range(len(front))}
    labels = [t for t in ax.texts if t.get_text() in wanted]
    assert len(labels) == len(front)
    assert any(t.get_text().isdigit() for t in labels) == dense
    boxes = [text_extent(t, renderer) for t in labels]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
    pad = 3.0 * fig.dpi / 72.0
    for p in front + others:
        x, y = ax.transData.transform((p["bits_effective"], p["rel_mse"]))
        for b in boxes:
            assert not (b.x0 < x + pad and b.x1 > x - pad and b.y0 < y + pad and b.y1 > y - pad), (p, b)
    # leader lines (the drawn arrow paths, in pixels) pass through no other point's marker, no label and
    # cross no other leader line
    leaders = []
    for t in labels:
        if t.arrow_patch is None:
            continue
        v = t.arrow_patch.get_transform().transform(t.arrow_patch.get_path().vertices)
        seg = (*v[0], *v[-1])
        leaders.append(seg)
        own = ax.transData.transform(t.xy)
        for p in ([] if dense else front + others):  # dense: no line leaves overlapping markers clear of them
            x, y = ax.transData.transform((p["bits_effective"], p["rel_mse"]))
            if abs(x - own[0]) < 0.5 and abs(y - own[1]) < 0.5:
                continue
            assert not meets(seg, (x - pad, y - pad, x + pad, y + pad)), (t.get_text(), p)
        for other, ob in zip(labels, boxes):
            if other is not t:
                assert not meets(seg, (ob.x0, ob.y0, ob.x1, ob.y1)), (t.get_text(), other.get_text())
    for i, a in enumerate(leaders):
        for b in leaders[i + 1:]:
            assert not placement.segs_cross(a, b)[0, 0], (a, b)
    # unambiguous: each label's box is nearer its own marker than any other point's (not in the dense
    # case, where the markers themselves overlap)
    if not dense:
        for t, b in zip(labels, boxes):
            own = ax.transData.transform(t.xy)

            def dist(x, y, b=b):
                return math.hypot(max(b.x0 - x, 0.0, x - b.x1), max(b.y0 - y, 0.0, y - b.y1))

            d_own = dist(*own)
            for p in front + others:
                x, y = ax.transData.transform((p["bits_effective"], p["rel_mse"]))
                if abs(x - own[0]) > 0.5 or abs(y - own[1]) > 0.5:
                    assert dist(x, y) > d_own, (t.get_text(), p)
    # a label is the point's name, or a number that the key below the legend explains
    key = " ".join(t.get_text() for t in ax.texts if t.get_text().startswith("Pareto front points"))
    for t in labels:
        if t.get_text().isdigit():
            assert f"{t.get_text()}  " in key, (t.get_text(), key)
    plt.close(fig)


def test_label_geometry_helpers():
    """The segment/box tests the label placer relies on, against hand-worked cases."""
    from kvqbench.report.render.figures import placement

    box = (0.0, 0.0, 1.0, 1.0)
    assert meets((-1.0, 0.5, 2.0, 0.5), box)  # straight through
    assert not meets((-1.0, 2.0, 2.0, 2.0), box)  # above
    assert not meets((2.0, 2.0, 3.0, -1.0), box)  # beside it
    assert meets((0.5, 0.5, 0.6, 0.6), box)  # inside
    hits = placement.seg_box_hits([(-1.0, 0.5, 2.0, 0.5), (-1.0, 2.0, 2.0, 2.0)], [box, (5.0, 0.0, 6.0, 1.0)])
    assert hits.tolist() == [[True, False], [False, False]]
    crossing = placement.segs_cross([(0.0, 0.0, 1.0, 1.0)], [(0.0, 1.0, 1.0, 0.0), (2.0, 2.0, 3.0, 0.0),
                                                             (1.0, 1.0, 2.0, 0.0)])
    assert crossing.tolist() == [[True, False, False]]  # an X; apart; touching ends only
