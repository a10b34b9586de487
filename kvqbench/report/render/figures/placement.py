"""Labels beside scatter points that overlap nothing: no other label, no marker, no line, no other
leader; where words fit nowhere near their point, a number explained in a key (the Pareto figure's
front points).

Pure geometry in display pixels after one draw; the segment/box tests are exact (Liang–Barsky
clipping, orientation signs) and vectorised: every candidate spot of a label is tested at once.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["CORE_RADIUS", "place_labels", "seg_box_hits", "segs_cross"]

#: where a label may go around its point: directions (degrees, tried in this order: right, then up/down
#: right, left …) at growing distances (points from the point to the label's near corner); from
#: :data:`_LEADER_FROM` points on a thin grey leader line joins label and point
_LABEL_ANGLES = (0, 30, -30, 180, 150, -150, 60, -60, 120, -120, 90, -90, 15, -15, 165, -165, 45, -45, 135, -135,
                 75, -75, 105, -105)
_LABEL_RADII = (4.0, 8.0, 12.0, 16.0, 21.0, 27.0, 34.0, 42.0, 52.0, 64.0, 78.0, 94.0, 114.0)
_LEADER_FROM = 6.0
#: radius (points) of a method's filled marker; a front ring around it is larger
CORE_RADIUS = 3.6
#: white space kept between a label and anything else (pixels)
_LABEL_GAP = 1.5
#: a label (words or number, not the last-resort number) is at least this much (points) nearer its own
#: marker than any other marker, and a word label's leader passes no other marker closer than this
_LABEL_CLEAR = 5.0
#: the farthest (points from the marker's edge) a label in words may sit from its point; a point
#: whose words fit nowhere that near becomes a number explained in the key
_WORD_REACH = 16.0
#: font size (points) of the labels and the key
_FONTSIZE = 7.0


def seg_box_hits(segs: Any, boxes: Any) -> Any:
    """``(n, m)`` bools: does segment ``i`` (rows ``x0, y0, x1, y1``) pass through box ``j`` (rows
    ``x0, y0, x1, y1``)? Liang–Barsky clipping."""
    import numpy as np

    S = np.asarray(segs, dtype=float).reshape(-1, 1, 4)
    B = np.asarray(boxes, dtype=float).reshape(1, -1, 4)
    x0, y0, dx, dy = S[..., 0], S[..., 1], S[..., 2] - S[..., 0], S[..., 3] - S[..., 1]
    t0 = np.zeros(np.broadcast_shapes(S.shape[:2], B.shape[:2]))
    t1 = np.ones_like(t0)
    ok = np.ones(t0.shape, dtype=bool)
    for p, q in ((-dx, x0 - B[..., 0]), (dx, B[..., 2] - x0), (-dy, y0 - B[..., 1]), (dy, B[..., 3] - y0)):
        p = np.broadcast_to(p, t0.shape)
        q = np.broadcast_to(q, t0.shape)
        zero = p == 0
        ok &= ~(zero & (q < 0))
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(zero, 0.0, q / np.where(zero, 1.0, p))
        t0 = np.where(~zero & (p < 0), np.maximum(t0, t), t0)
        t1 = np.where(~zero & (p > 0), np.minimum(t1, t), t1)
    return ok & (t0 <= t1)


def segs_cross(a: Any, b: Any) -> Any:
    """``(n, m)`` bools: does segment ``i`` of ``a`` cross segment ``j`` of ``b`` (rows ``x0, y0, x1,
    y1``; touching ends do not count)?"""
    import numpy as np

    A = np.asarray(a, dtype=float).reshape(-1, 1, 4)
    B = np.asarray(b, dtype=float).reshape(1, -1, 4)

    def orient(s: Any, x: Any, y: Any) -> Any:  # > 0: the point lies left of segment s
        return (s[..., 2] - s[..., 0]) * (y - s[..., 1]) - (s[..., 3] - s[..., 1]) * (x - s[..., 0])

    d1, d2 = orient(B, A[..., 0], A[..., 1]), orient(B, A[..., 2], A[..., 3])
    d3, d4 = orient(A, B[..., 0], B[..., 1]), orient(A, B[..., 2], B[..., 3])
    return ((d1 > 0) != (d2 > 0)) & ((d3 > 0) != (d4 > 0))


def _label_spots(cx: float, cy: float, w: float, h: float, radius: float, pt: float
                 ) -> list[tuple[tuple[float, float, float, float], float, float, str, str]]:
    """Candidate boxes of a ``w``×``h`` pixel label around the point ``(cx, cy)`` whose marker has
    ``radius`` pixels, nearest first: ``(box, dx, dy, ha, va)`` with the offset in points from the point
    to the text anchor (``ha``/``va``: the anchor's alignment)."""
    out = []
    for r in _LABEL_RADII:
        angles = _LABEL_ANGLES + (tuple(a + 7.5 for a in _LABEL_ANGLES) if r >= 24 else ())
        for deg in angles:
            c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
            ha = "left" if c > 0.3 else "right" if c < -0.3 else "center"
            va = "bottom" if s > 0.3 else "top" if s < -0.3 else "center"
            ax_ = cx + c * (radius + r * pt)
            ay_ = cy + s * (radius + r * pt)
            x0 = ax_ if ha == "left" else ax_ - w if ha == "right" else ax_ - w / 2
            y0 = ay_ if va == "bottom" else ay_ - h if va == "top" else ay_ - h / 2
            out.append(((x0, y0, x0 + w, y0 + h), (ax_ - cx) / pt, (ay_ - cy) / pt, ha, va))
    return out


def place_labels(fig: Any, ax: Any, texts: list[tuple[float, float, str]],
                 markers: list[tuple[float, float, float]],
                 lines: list[Any] | None = None) -> None:
    """Label points so that no label overlaps another label, a marker, a line of ``lines`` or leaves
    the axes, and no leader line runs through a marker, a label or another leader line.

    ``texts``: ``(x, y, text)`` in data coordinates; ``markers``: ``(x, y, radius in points)`` of every
    marker drawn, the labelled points among them; ``lines``: ``(xs, ys)`` polylines labels must not
    cover (the Pareto step). Each label takes the nearest free spot (:func:`_label_spots`, measured in
    display space after one draw); several label orders are tried and the one that places the most
    labels as words is kept. A label that finds no free spot is replaced by a number, placed by the same
    rules except that its leader may cross the front ring (not the marker) of a neighbour — or, where
    markers overlap so that no line leaves the cluster without crossing one, any marker — and the
    numbers are explained in a key below the legend — so a dense cluster reads as numbers while the
    labels around it stay words."""
    import numpy as np

    if not texts:
        return
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ab = ax.get_window_extent(renderer)
    pt = fig.dpi / 72.0
    gap = _LABEL_GAP

    def px(x: float, y: float) -> tuple[float, float]:
        u, v = ax.transData.transform((x, y))
        return float(u), float(v)

    def around(c: Any, r: Any, pad: float) -> Any:
        """Boxes (rows x0, y0, x1, y1) reaching ``r + pad`` from the centres ``c`` on each side."""
        return np.column_stack([c - r[:, None] - pad, c + r[:, None] + pad])

    centres = np.array([px(x, y) for x, y, _ in markers]).reshape(-1, 2)
    radii = np.array([r for *_, r in markers], dtype=float) * pt
    full_boxes = around(centres, radii, gap)
    core_boxes = around(centres, np.minimum(radii, CORE_RADIUS * pt), gap)
    clear_boxes = around(centres, radii + _LABEL_CLEAR * pt, 0.0)  # a word label's leader keeps out of these
    notes = np.array([(b.x0 - gap, b.y0 - gap, b.x1 + gap, b.y1 + gap)  # notes already on the axes
                      for b in (t.get_window_extent(renderer) for t in ax.texts)]).reshape(-1, 4)
    line_segs = []
    for xs, ys in lines or []:
        pts = [px(x, y) for x, y in zip(xs, ys, strict=False)]
        line_segs += [(*a, *b) for a, b in zip(pts, pts[1:], strict=False)]

    def size(text: str) -> tuple[float, float]:
        t = ax.text(0, 0, text, fontsize=_FONTSIZE, transform=None)
        b = t.get_window_extent(renderer)
        t.remove()
        return b.width, b.height

    def meets(boxes: Any, others: Any) -> Any:
        """``(n,)``: box ``i`` overlaps any of ``others``."""
        A, O = boxes[:, None, :], others[None, :, :]
        return ((A[..., 0] < O[..., 2]) & (A[..., 2] > O[..., 0]) & (A[..., 1] < O[..., 3])
                & (A[..., 3] > O[..., 1])).any(1)

    # every label's candidate spots that nothing fixed gets in the way of, nearest first, as words, as a
    # number, as a number whose leader may cross markers: (boxes, leader segments, has a leader, (dx, dy,
    # ha, va, leader) per spot)
    wide = size("8" * len(str(len(texts))))  # a number is placed as the widest one (digits are equally wide)
    inset = {"left": gap, "bottom": gap, "right": -gap, "top": -gap, "center": 0.0}
    own_of = []
    free = []
    for x, y, text in texts:
        cx, cy = px(x, y)
        own = (np.abs(centres[:, 0] - cx) < 0.5) & (np.abs(centres[:, 1] - cy) < 0.5)
        own_of.append(own)
        rad = float(radii[own].max())
        per_alt = []
        for k, (w, h) in enumerate((size(text), wide, wide)):
            spots = _label_spots(cx, cy, w + 2 * gap, h + 2 * gap, rad, pt)
            boxes = np.array([sp[0] for sp in spots], dtype=float)
            ok = (boxes[:, 0] >= ab.x0) & (boxes[:, 2] <= ab.x1) & (boxes[:, 1] >= ab.y0) & (boxes[:, 3] <= ab.y1)
            ok &= ~meets(boxes, full_boxes) & ~meets(boxes, notes) & ~seg_box_hits(line_segs, boxes).any(0)
            dxy = np.array([(sp[1], sp[2]) for sp in spots])
            reach = np.hypot(dxy[:, 0], dxy[:, 1])  # points from the point to the label's anchor
            lead = reach > _LEADER_FROM
            mid = np.column_stack([(boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2])
            d = np.maximum(np.hypot(mid[:, 0] - cx, mid[:, 1] - cy), 1e-9)
            start = np.column_stack([cx + (mid[:, 0] - cx) * rad / d, cy + (mid[:, 1] - cy) * rad / d])
            segs = np.column_stack([start, mid])  # from the marker's edge to the label's centre
            # a number's leader (the last resort, inside a dense cluster) may cross a neighbour's front
            # ring, not a method's marker — unless the markers themselves overlap so that no line gets
            # out of the cluster without crossing one (the third try)
            obstacles = clear_boxes[~own] if k == 0 else core_boxes[~own] if k == 1 else full_boxes[:0]
            ok &= ~(lead & (seg_box_hits(segs, obstacles).any(1) | seg_box_hits(segs, notes).any(1)))
            if k < 2 and (~own).any():  # unambiguous: the label is nearer its own marker than any other
                ddx = np.maximum(np.maximum(boxes[:, None, 0] - centres[None, :, 0], 0.0),
                                 centres[None, :, 0] - boxes[:, None, 2])
                ddy = np.maximum(np.maximum(boxes[:, None, 1] - centres[None, :, 1], 0.0),
                                 centres[None, :, 1] - boxes[:, None, 3])
                dist = np.hypot(ddx, ddy) - radii[None, :]
                own_d = dist[:, own].min(1)
                ok &= dist[:, ~own].min(1) >= np.maximum(own_d + _LABEL_CLEAR * pt, _LABEL_CLEAR * pt)
            if k == 0:  # words sit near their point: a long leader into a cluster reads as someone else's
                ok &= reach <= _WORD_REACH
            keep = np.flatnonzero(ok)
            per_alt.append((boxes[keep], segs[keep], lead[keep],  # the anchor sits ``gap`` inside the box
                            [(spots[j][1] + inset[spots[j][3]] / pt, spots[j][2] + inset[spots[j][4]] / pt,
                              spots[j][3], spots[j][4], bool(lead[j])) for j in keep]))
        free.append(per_alt)

    def place(order: list[int]) -> dict[int, tuple[int, tuple]]:
        """Greedy, in the given order, each label as words if they fit anywhere, else as a number:
        ``{index: (0 words / 1 number / 2 number whose leader crosses markers, (dx, dy, ha, va,
        leader))}`` of the labels that fit."""
        boxes, leaders = np.zeros((0, 4)), np.zeros((0, 4))
        got = {}
        for i in order:
            for k, (cand, segs, lead, spots) in enumerate(free[i]):
                ok = ~meets(cand, boxes) & ~seg_box_hits(leaders, cand).any(0)
                ok &= ~(lead & (seg_box_hits(segs, boxes).any(1) | segs_cross(segs, leaders).any(1)))
                if ok.any():
                    j = int(np.argmax(ok))
                    boxes = np.vstack([boxes, cand[j]])
                    if lead[j]:
                        leaders = np.vstack([leaders, segs[j]])
                    got[i] = (k, spots[j])
                    break
        return got

    def score(got: dict[int, tuple[int, tuple]]) -> tuple[int, int, int]:
        # unplaced, then numbered, then leaders through markers
        return (len(texts) - len(got), sum(k > 0 for k, _ in got.values()), sum(k == 2 for k, _ in got.values()))

    ys = [px(x, y)[1] for x, y, _ in texts]
    n = len(texts)
    orders = [list(range(n)), list(range(n))[::-1], sorted(range(n), key=lambda i: ys[i]),
              sorted(range(n), key=lambda i: -ys[i]),
              sorted(range(n), key=lambda i: len(free[i][0][3]))]  # the most constrained first
    best: dict[int, tuple[int, tuple]] = {}
    for order in orders:
        got = place(order)
        if not best or score(got) < score(best):
            best = got
        if score(best) == (0, 0, 0):
            break
    as_number = [i for i in range(n) if best.get(i, (1, None))[0] >= 1]
    numbered = {i: str(j + 1) for j, i in enumerate(as_number)}
    for i, (x, y, text) in enumerate(texts):
        # not even a number fits anywhere: beside its point (the key still names it)
        k, (dx, dy, ha, va, leader) = best.get(i, (1, (4.0, 2.0, "left", "bottom", False)))
        ax.annotate(numbered[i] if k >= 1 else text, (x, y), textcoords="offset points", xytext=(dx, dy),
                    fontsize=_FONTSIZE, ha=ha, va=va, zorder=5,
                    arrowprops={"arrowstyle": "-", "color": "grey", "linewidth": 0.6, "shrinkA": 0,
                                "shrinkB": float(radii[own_of[i]].max()) / pt} if leader else None)
    if not numbered:
        return
    key = "\n".join(f"{numbered[i]}  {texts[i][2]}" for i in as_number)
    legend = ax.get_legend()
    top = 1.0
    if legend is not None:  # the key goes below the legend
        top = ax.transAxes.inverted().transform((0, legend.get_window_extent(renderer).y0))[1] - 0.03
    ax.text(1.01, top, "Pareto front points:\n" + key, transform=ax.transAxes, fontsize=_FONTSIZE, va="top",
            ha="left")
