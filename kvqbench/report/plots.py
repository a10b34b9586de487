"""Figures rendered from saved JSON only (``leaderboard.json`` + ``exp*_*.json``). Torch-free.

One set of PNGs per data source, written next to the JSON (real and synthetic never share a figure):

==========================================  ====================================================
``pareto_{source}.png``                     rel. MSE vs effective bits/element, one marker per
                                            method, the non-dominated front drawn as a black step;
                                            front points labelled in words near their own marker,
                                            or by a number explained in a key in a crowded cluster
``mse_vs_bits_{source}.png``                K and V relative MSE vs bit-width, one line per method;
                                            a 95 % CI reaching 0 (no end on the log axis) stops at
                                            mean / 3 in a ▼, explained under the figure
``attn_error_vs_context_{source}.png``      exp2: attention-output error vs context length,
                                            panels *static* and *pseudo-decode*; under the latter,
                                            for methods whose fp16 share changes with the length,
                                            the newest tokens held fp16 and the billed bits, and a
                                            note that says from the data (source named) whether the
                                            fp16 share explains their curves' jumps
``attn_kl_vs_context_{source}.png``         exp2: attention KL(p‖p̂) vs context length, same panels
``norm_diff_density_{source}.png``          exp3: density of ‖k̂‖−‖k‖ per method (small multiples),
                                            x-range from quantiles of the data, any share off scale
                                            named, zig-zagging fine bins merged (and said so)
``cost_{source}.png``                       exp4: latency bars and bits/element bars per method
                                            (bits axis fitted to the compressed methods, fp16 cut)
``predictivity_{source}.png``               exp5: the best-predicting tensor metrics against the
                                            end-to-end KL, one point per method × bits, log axes
==========================================  ====================================================

A figure whose data is absent (an experiment that did not run) is simply not drawn. matplotlib is
optional: without it :func:`write_figures` logs one line and returns ``[]``; it never raises for a
rendering problem of one figure either (that figure is skipped with one line of explanation).

How experiment series are found (so experiments need not register anything here). A cell record's
``series`` is walked recursively:

* a *curve* is a list of numbers under a dict that also holds an x list named one of
  :data:`X_KEYS` (``context_len``, ``context``, ``ctx`` …; inherited by nested dicts), or a dict
  ``{"x": [...], "y": [...]}``. Per-layer curves (list of lists) are averaged over layers.
* a *histogram* is a dict holding ``edges``/``bin_edges``/``bins`` and ``density``/``counts``/``hist``
  with one value fewer than edges (or ``centers`` with as many values).

The joined path of names (``series`` keys, lower-cased) classifies a curve: ``kl`` → attention KL
(``rev``/``reverse`` → reverse KL, drawn only when no forward KL exists); otherwise the first of
``mse``, ``mae``, ``cos`` is the attention error; ``decode``/``pseudo``/``stream`` → pseudo-decode
regime, else static. Histogram paths containing ``norm`` are norm-difference densities, ``v_``/``v``
segments select the V panel. Scalar metrics named ``<name>_ctx<N>`` in an experiment's stats are
read as curve points too. Seeds are averaged; the headline setting is the lowest ``kXvX`` bit-width
that ran (k2v2 in the default sweep). Output is deterministic (Agg backend, fixed DPI, no timestamp
or version metadata in the PNG).
"""

from __future__ import annotations

import math
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable

from kvqbench.report.io import read_json

__all__ = ["write_figures", "figure_names", "iter_curves", "iter_histograms", "iter_histogram_bins", "X_KEYS",
           "DPI"]

X_KEYS: tuple[str, ...] = ("context_len", "context_lens", "context_length", "context_lengths", "context",
                           "ctx_len", "ctx", "lengths", "tokens", "positions", "seq_lens", "x")
EDGE_KEYS = ("edges", "bin_edges", "bins")
VALUE_KEYS = ("density", "counts", "hist", "values")
DPI = 110
TIME_UNITS = {"s", "ms", "us", "µs", "ns"}

_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#393b79", "#ad494a", "#637939", "#843c39"]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*", "p", "8", "d"]

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# series discovery (pure, testable without matplotlib)
def _is_num_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                      for x in v)


def _is_nested_num_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(_is_num_list(x) for x in v) \
        and len({len(x) for x in v}) == 1


def _as_curve(v: Any) -> list[float] | None:
    if _is_num_list(v):
        return [float(x) for x in v]
    if _is_nested_num_list(v):  # per layer → mean over layers
        return [math.fsum(col) / len(col) for col in zip(*v, strict=False)]
    return None


def iter_curves(series: Any, path: tuple[str, ...] = (), x: list[float] | None = None
                ) -> Iterable[tuple[tuple[str, ...], list[float], list[float]]]:
    """Yield ``(path, x, y)`` for every curve in a record's ``series`` (see module doc)."""
    if not isinstance(series, dict):
        return
    if _is_num_list(series.get("x")) and _as_curve(series.get("y")) is not None:
        y = _as_curve(series["y"])
        if y is not None and len(y) == len(series["x"]):
            yield path, [float(v) for v in series["x"]], y
        return
    here = next((series[k] for k in X_KEYS if k in series and _is_num_list(series[k])), None)
    xs = [float(v) for v in here] if here is not None else x
    for key in sorted(series):
        if key in X_KEYS:
            continue
        val = series[key]
        if isinstance(val, dict):
            yield from iter_curves(val, path + (str(key),), xs)
            continue
        y = _as_curve(val)
        if xs is not None and y is not None and len(y) == len(xs):
            yield path + (str(key),), xs, y


def iter_histograms(series: Any, path: tuple[str, ...] = ()
                    ) -> Iterable[tuple[tuple[str, ...], list[float], list[float]]]:
    """Yield ``(path, centers, density)`` for every histogram in ``series`` (see module doc).

    Counts are normalised to a density (count / total / bin width: integral 1, bins of unequal width
    allowed) so seeds and methods are comparable; values named ``density`` are rescaled to integral 1;
    shares that already sum to 1 are divided by the bin width. A flat layout is read too: an ``…edges`` list beside ``…density`` lists with one
    value fewer than the edges, or two more (an underflow and an overflow bin, not drawn).
    """
    for p, edges, dens in iter_histogram_bins(series, path):
        yield p, [(a + b) / 2 for a, b in zip(edges, edges[1:], strict=False)], dens


def iter_histogram_bins(series: Any, path: tuple[str, ...] = ()
                        ) -> Iterable[tuple[tuple[str, ...], list[float], list[float]]]:
    """Like :func:`iter_histograms` but yields the bin ``edges`` (one more than the densities), so
    bins of unequal width (e.g. fine near 0, wider in the tails) keep their true extent."""
    for p, e, dens, _tails in _histograms(series, path):
        yield p, e, dens


def _histograms(series: Any, path: tuple[str, ...] = ()
                ) -> Iterable[tuple[tuple[str, ...], list[float], list[float], tuple[float, float]]]:
    """:func:`iter_histogram_bins` plus ``(under, over)``: the shares of tokens in a flat layout's
    underflow and overflow bins (below the first edge, above the last; not drawn), ``(0, 0)`` when
    the layout has none."""
    if not isinstance(series, dict):
        return
    edges = next((series[k] for k in EDGE_KEYS if _is_num_list(series.get(k))), None)
    vkey = next((k for k in VALUE_KEYS if k in series and _as_curve(series[k])), None)
    vals = _as_curve(series[vkey]) if vkey is not None else None
    centers = series.get("centers") if _is_num_list(series.get("centers")) else None
    if vals is not None and (edges is not None or centers is not None):
        if edges is not None and len(edges) == len(vals) + 1:
            e = [float(v) for v in edges]
        elif centers is not None and len(centers) == len(vals):
            c = [float(v) for v in centers]
            step = (c[-1] - c[0]) / max(len(c) - 1, 1) or 1.0
            e = [x - step / 2 for x in c] + [c[-1] + step / 2]
        else:
            e = None
        if e is not None:
            widths = [b - a for a, b in zip(e, e[1:], strict=False)]
            if vkey == "density":  # already per unit x: rescale to integral 1
                area = math.fsum(v * w for v, w in zip(vals, widths, strict=False))
                yield path, e, [v / area if area > 0 else 0.0 for v in vals], (0.0, 0.0)
            else:  # counts per bin: divide by the total and by each bin's own width
                total = math.fsum(vals)
                yield (path, e, [v / total / w if total > 0 else 0.0 for v, w in zip(vals, widths, strict=False)],
                       (0.0, 0.0))
            return
    flat_edges = [k for k in sorted(series) if str(k).endswith("edges") and _is_num_list(series[k])]
    if flat_edges:
        e = [float(v) for v in series[flat_edges[0]]]
        widths = [b - a for a, b in zip(e, e[1:], strict=False)]
        found = False
        for key in sorted(series):
            vals = _as_curve(series[key]) if any(w in str(key) for w in ("density", "counts", "hist")) else None
            if vals is None or len(vals) not in (len(e) - 1, len(e) + 1):
                continue
            total = math.fsum(vals)
            tails = (vals[0] / total, vals[-1] / total) if len(vals) == len(e) + 1 and total > 0 else (0.0, 0.0)
            inner = vals[1:-1] if len(vals) == len(e) + 1 else vals
            if total > 0:
                yield path + (str(key),), e, [v / total / w for v, w in zip(inner, widths, strict=True)], tails
                found = True
        if found:
            return
    for key in sorted(series):
        if isinstance(series[key], dict):
            yield from _histograms(series[key], path + (str(key),))


def _regime(name: str) -> str:
    return "pseudo-decode" if any(w in name for w in ("decode", "pseudo", "stream")) else "static"


def _error_kind(name: str) -> str | None:
    if "kl" in re.split(r"[^a-z0-9]+", name) or re.search(r"(^|[^a-z])kl([^a-z]|$)", name):
        return "kl_rev" if re.search(r"rev", name) else "kl"
    if any(w in name for w in ("signed", "gap", "bias", "var", "slope", "weighted", "logit", "attn_k")):
        return None
    if "rel_mse" in name:
        return "rel_mse"
    for w in ("mse", "mae", "cos"):
        if w in name:
            return w
    return None


_CTX_METRIC = re.compile(r"^(?P<name>.+?)_(?:ctx|context|T)(?P<n>\d+)$")


# ------------------------------------------------------------------------------------------------
# loading
def _load_dir(d: Path) -> tuple[dict[str, Any] | None, dict[tuple[str, str], dict[str, Any]]]:
    board = read_json(d / "leaderboard.json") if (d / "leaderboard.json").exists() else None
    exps: dict[tuple[str, str], dict[str, Any]] = {}
    for p in sorted(d.glob("exp*_*.json")):
        m = re.match(r"^(exp\d+)_(\w+)\.json$", p.name)
        if not m:
            continue
        try:
            exps[(m.group(1), m.group(2))] = read_json(p)
        except (OSError, ValueError):
            continue
    return board, exps


def _setting_bits(setting: str) -> tuple[int, int] | None:
    m = re.fullmatch(r"k(\d+)v(\d+)", setting)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _headline_setting(settings: Iterable[str]) -> str | None:
    sym = sorted({s for s in settings if (b := _setting_bits(s)) and b[0] == b[1] and b[0] < 16},
                 key=lambda s: _setting_bits(s))
    return sym[0] if sym else None


def _method_order(board: dict[str, Any] | None, extra: Iterable[str]) -> list[str]:
    order = list((board or {}).get("methods", {}))
    for m in sorted(set(extra)):
        if m not in order:
            order.append(m)
    return order


class _Style:
    def __init__(self, methods: list[str]) -> None:
        self.idx = {m: i for i, m in enumerate(methods)}

    def __call__(self, m: str) -> dict[str, Any]:
        i = self.idx.setdefault(m, len(self.idx))
        if m == "fp16":
            return {"color": "black", "marker": "o", "linestyle": "--"}
        return {"color": _COLORS[i % len(_COLORS)], "marker": _MARKERS[i % len(_MARKERS)], "linestyle": "-"}


def _mean_curves(cells: list[dict[str, Any]], setting: str, kind: Callable[[str], Any],
                 hist: bool = False) -> dict[tuple[str, Any], tuple[list[float], list[float]]]:
    """``{(method, key): (x, mean y over seeds)}`` for cells at ``setting`` (key from ``kind(path)``)."""
    from kvqbench.report.leaderboard import setting_key

    acc: dict[tuple[str, Any], list[tuple[list[float], list[float]]]] = defaultdict(list)
    for c in cells:
        if c.get("status") != "passed" or setting_key(c) != setting:
            continue
        found: dict[Any, tuple[list[float], list[float]]] = {}
        walker = iter_histogram_bins if hist else iter_curves  # histograms: x = the bin edges
        for path, xs, ys in walker(c.get("series") or {}):
            key = kind("/".join(path).lower())
            if key is not None and key not in found:
                found[key] = (xs, ys)
        for key, xy in found.items():
            acc[(c["method"], key)].append(xy)
    out = {}
    for k, xys in acc.items():
        xs = xys[0][0]
        same = [ys for x, ys in xys if x == xs]
        out[k] = (xs, [math.fsum(col) / len(col) for col in zip(*same, strict=False)])
    return out


def _mean_tails(cells: list[dict[str, Any]], setting: str, kind: Callable[[str], Any]
                ) -> dict[tuple[str, Any], tuple[float, float]]:
    """``{(method, key): (under, over)}``: the histograms' underflow and overflow shares (see
    :func:`_histograms`), mean over the seeds at ``setting`` — the same cells and keys as
    :func:`_mean_curves` with ``hist=True``."""
    from kvqbench.report.leaderboard import setting_key

    acc: dict[tuple[str, Any], list[tuple[float, float]]] = defaultdict(list)
    for c in cells:
        if c.get("status") != "passed" or setting_key(c) != setting:
            continue
        found: dict[Any, tuple[float, float]] = {}
        for path, _e, _d, tails in _histograms(c.get("series") or {}):
            key = kind("/".join(path).lower())
            if key is not None and key not in found:
                found[key] = tails
        for key, t in found.items():
            acc[(c["method"], key)].append(t)
    return {k: (math.fsum(u for u, _ in v) / len(v), math.fsum(o for _, o in v) / len(v)) for k, v in acc.items()}


def _ctx_metric_curves(stats_exp: dict[str, Any], setting: str, kind: Callable[[str], Any]
                       ) -> dict[tuple[str, Any], tuple[list[float], list[float]]]:
    pts: dict[tuple[str, Any], dict[float, float]] = defaultdict(dict)
    for meth, by_setting in stats_exp.items():
        for name, e in (by_setting.get(setting) or {}).items():
            m = _CTX_METRIC.match(name)
            if not m:
                continue
            key = kind(m.group("name").lower())
            if key is not None:
                pts[(meth, key)][float(m.group("n"))] = e["mean"]
    return {k: (sorted(v), [v[x] for x in sorted(v)]) for k, v in pts.items() if len(v) >= 2}


# ------------------------------------------------------------------------------------------------
# drawing helpers
def _span_decades(vals: Iterable[float]) -> float:
    pos = [v for v in vals if v > 0 and math.isfinite(v)]
    if len(pos) < 2:
        return 0.0
    return math.log10(max(pos) / min(pos))


#: room drawn around the figure (inches: left, bottom, right, top) so that what sticks out of it (a
#: legend or key beside the last axes) is on the canvas; the PNG is then cropped to what was drawn
_MARGIN_IN = (0.5, 0.5, 3.0, 0.5)
#: white space kept around the drawing (inches; matplotlib's ``savefig.pad_inches`` default)
_PAD_IN = 0.1


def _finish(fig: Any, path: Path) -> Path:
    """Save ``fig`` cropped to its drawing plus :data:`_PAD_IN` — what ``bbox_inches="tight"`` gives — in
    ONE draw: ``"tight"`` draws the figure twice (once to measure, once to paint), a third of the time
    of every figure. Here the figure is painted once onto a canvas :data:`_MARGIN_IN` larger on each
    side, and the pixels that differ from the background decide the crop. When the drawing reaches the
    canvas edge (something far outside the figure) it falls back to ``"tight"``."""
    import matplotlib.pyplot as plt

    try:
        if not _save_cropped(fig, path):
            fig.savefig(path, dpi=DPI, metadata={"Software": None}, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def _save_cropped(fig: Any, path: Path) -> bool:
    import io

    import numpy as np
    from matplotlib.image import imsave
    from matplotlib.transforms import Bbox

    w, h = fig.get_size_inches()
    left, bottom, right, top = _MARGIN_IN
    buf = io.BytesIO()
    fig.savefig(buf, format="rgba", dpi=DPI, bbox_inches=Bbox.from_extents(-left, -bottom, w + right, h + top))
    r = fig.canvas.renderer  # the one that painted the larger canvas
    width, height = int(r.width), int(r.height)
    raw = buf.getbuffer()
    if width * height * 4 != raw.nbytes:
        return False
    img = np.frombuffer(raw, dtype=np.uint8).reshape(height, width, 4)
    px = img.view(np.uint32).reshape(height, width)  # one RGBA pixel per word: one comparison each
    ink = px != px[0, 0]
    rows, cols = np.flatnonzero(ink.any(1)), np.flatnonzero(ink.any(0))
    if not rows.size or rows[0] == 0 or cols[0] == 0 or rows[-1] == height - 1 or cols[-1] == width - 1:
        return False
    pad = int(round(_PAD_IN * DPI))
    crop = img[max(rows[0] - pad, 0):rows[-1] + 1 + pad, max(cols[0] - pad, 0):cols[-1] + 1 + pad]
    imsave(path, np.ascontiguousarray(crop), format="png", dpi=DPI, metadata={"Software": None})
    return True


def _legend_outside(ax: Any, **kw: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False, **kw)


def _bits_axis(ax: Any, ticks: list[float]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}" for t in ticks])
    ax.minorticks_off()


# ------------------------------------------------------------------------------------------------
# figures
def _fig_pareto(plt: Any, src: str, sd: dict[str, Any], style: _Style, out: Path) -> Path | None:
    pf = sd.get("pareto") or {}
    pts = [p for p in pf.get("points", []) if p.get("bits_effective") is not None and p.get("rel_mse") is not None]
    if not pts:
        return None
    pos = [p["rel_mse"] for p in pts if p["rel_mse"] > 0]
    floor = (min(pos) / 4) if pos else 1e-6
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    by_m: dict[str, list[dict]] = defaultdict(list)
    for p in pts:
        by_m[p["method"]].append(p)
    for m in sorted(by_m, key=lambda m: style.idx.get(m, 99)):
        ps = sorted(by_m[m], key=lambda p: p["bits_effective"])
        st = style(m)
        xs = [p["bits_effective"] for p in ps]
        ys = [p["rel_mse"] if p["rel_mse"] > 0 else floor for p in ps]
        ax.plot(xs, ys, color=st["color"], linestyle=":", linewidth=0.8, alpha=0.6)
        ax.scatter(xs, ys, color=st["color"], marker=st["marker"], s=42, label=m, zorder=3)
    front = sorted(pf.get("front", []), key=lambda p: p["bits_effective"])
    if front:
        fx = [p["bits_effective"] for p in front]
        fy = [p["rel_mse"] if p["rel_mse"] > 0 else floor for p in front]
        ax.step(fx, fy, where="post", color="black", linewidth=1.6, label="Pareto front", zorder=2)
        ax.scatter(fx, fy, s=150, facecolors="none", edgecolors="black", linewidths=1.4, zorder=4)
        # one label per distinct front point (identical points, e.g. every method exact at 16 bits, merged)
        labels: dict[tuple[float, float], list[str]] = {}
        for p, y in zip(front, fy, strict=False):
            labels.setdefault((round(p["bits_effective"], 6), y), []).append(f"{p['method']} {p['setting']}")
        texts = [(x, y, names[0] if len(names) == 1 else f"exact ({len(names)} points)" if y == floor else
                  f"{names[0]} +{len(names) - 1}") for (x, y), names in sorted(labels.items())]
    else:
        texts = []
    ax.set_yscale("log")
    if not all(p["rel_mse"] > 0 for p in pts):
        ax.axhline(floor, color="grey", linewidth=0.6, linestyle="--")
        ax.annotate("MSE = 0 (exact) drawn on this line", (min(p["bits_effective"] for p in pts), floor),
                    textcoords="offset points", xytext=(2, -11), fontsize=7, color="grey")
    lo, hi = min(p["bits_effective"] for p in pts), max(p["bits_effective"] for p in pts)
    _bits_axis(ax, [t for t in (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32) if lo * 0.9 <= t <= hi * 1.1])
    ax.set_xlabel("effective bits per element (K and V mean, log₂ scale)")
    ax.set_ylabel("relative MSE, K and V mean (log scale)")
    ax.set_title(f"Quality vs bits — Pareto front ({src})")
    ax.grid(True, which="major", alpha=0.3)
    _legend_outside(ax)
    # marker radii in points: a scatter marker of size s (points²) spans √s points; the front's rings
    # (s=150, edge 1.4) are larger than the methods' markers (s=42)
    markers = [(p["bits_effective"], p["rel_mse"] if p["rel_mse"] > 0 else floor, _CORE_RADIUS) for p in pts]
    markers += [(x, y, 6.9) for x, y, _ in texts]
    step = _step_polyline(fx, fy) if front else []
    _place_labels(fig, ax, texts, markers, lines=[step] if step else None)
    return _finish(fig, out / f"pareto_{src}.png")


def _step_polyline(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """The vertices of ``ax.step(xs, ys, where="post")``: across to the next x, then down or up."""
    px, py = [xs[0]], [ys[0]]
    for x, y in zip(xs[1:], ys[1:], strict=False):
        px += [x, x]
        py += [py[-1], y]
    return px, py


#: where a label may go around its point: directions (degrees, tried in this order: right, then up/down
#: right, left …) at growing distances (points from the point to the label's near corner); from
#: :data:`_LEADER_FROM` points on a thin grey leader line joins label and point
_LABEL_ANGLES = (0, 30, -30, 180, 150, -150, 60, -60, 120, -120, 90, -90, 15, -15, 165, -165, 45, -45, 135, -135,
                 75, -75, 105, -105)
_LABEL_RADII = (4.0, 8.0, 12.0, 16.0, 21.0, 27.0, 34.0, 42.0, 52.0, 64.0, 78.0, 94.0, 114.0)
_LEADER_FROM = 6.0
#: radius (points) of a method's filled marker; a front ring around it is larger
_CORE_RADIUS = 3.6
#: white space kept between a label and anything else (pixels)
_LABEL_GAP = 1.5
#: a label (words or number, not the last-resort number) is at least this much (points) nearer its own
#: marker than any other marker, and a word label's leader passes no other marker closer than this
_LABEL_CLEAR = 5.0
#: the farthest (points from the marker's edge) a label in words may sit from its point; a point
#: whose words fit nowhere that near becomes a number explained in the key
_WORD_REACH = 16.0


def log_debug(msg: str) -> None:
    import os

    if os.environ.get("KVQBENCH_PLOTS_DEBUG"):
        print(msg, file=sys.stderr)


def _text_extent(a: Any, renderer: Any) -> Any:
    from matplotlib.text import Text

    a.update_positions(renderer)  # place the text where the annotation puts it
    return Text.get_window_extent(a, renderer)


def _seg_box_hits(segs: Any, boxes: Any) -> Any:
    """``(n, m)`` bools: does segment ``i`` (rows ``x0, y0, x1, y1``) pass through box ``j`` (rows
    ``x0, y0, x1, y1``)? Liang–Barsky clipping, vectorised."""
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


def _seg_meets_box(seg: tuple[float, float, float, float], b: tuple) -> bool:
    """:func:`_seg_box_hits` for one segment and one box (plain floats: cheaper for one pair)."""
    x0, y0 = seg[0], seg[1]
    dx, dy = seg[2] - x0, seg[3] - y0
    t0, t1 = 0.0, 1.0
    for p, q in ((-dx, x0 - b[0]), (dx, b[2] - x0), (-dy, y0 - b[1]), (dy, b[3] - y0)):
        if p == 0:
            if q < 0:
                return False
            continue
        t = q / p
        if p < 0:
            t0 = max(t0, t)
        else:
            t1 = min(t1, t)
        if t0 > t1:
            return False
    return True


def _segs_cross(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    """Whether two segments ``(x0, y0, x1, y1)`` cross (touching ends do not count)."""
    def orient(px: float, py: float, qx: float, qy: float, rx: float, ry: float) -> float:
        return (qx - px) * (ry - py) - (qy - py) * (rx - px)

    d1, d2 = orient(*b, a[0], a[1]), orient(*b, a[2], a[3])
    d3, d4 = orient(*a, b[0], b[1]), orient(*a, b[2], b[3])
    return (d1 > 0) != (d2 > 0) and (d3 > 0) != (d4 > 0)


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


def _place_labels(fig: Any, ax: Any, texts: list[tuple[float, float, str]],
                  markers: list[tuple[float, float, float]], fontsize: float = 7.0,
                  lines: list[tuple[list[float], list[float]]] | None = None, key_title: str = "Pareto front points"
                  ) -> None:
    """Label points so that no label overlaps another label, a marker, a line of ``lines`` or leaves
    the axes, and no leader line runs through a marker, a label or another leader line.

    ``texts``: ``(x, y, text)`` in data coordinates; ``markers``: ``(x, y, radius in points)`` of every
    marker drawn (the labelled points among them); ``lines``: ``(xs, ys)`` polylines labels must not
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

    centres = np.array([px(x, y) for x, y, _ in markers]).reshape(-1, 2)
    radii = np.array([r for *_, r in markers], dtype=float) * pt
    core = np.minimum(radii, _CORE_RADIUS * pt)
    full_boxes = np.column_stack([centres - radii[:, None] - gap, centres + radii[:, None] + gap])
    core_boxes = np.column_stack([centres - core[:, None] - gap, centres + core[:, None] + gap])
    clear = radii + _LABEL_CLEAR * pt  # a word label's leader keeps this far from other markers
    clear_boxes = np.column_stack([centres - clear[:, None], centres + clear[:, None]])
    notes = []
    for t in ax.texts:  # notes already on the axes
        b = t.get_window_extent(renderer)
        notes.append((b.x0 - gap, b.y0 - gap, b.x1 + gap, b.y1 + gap))
    notes_a = np.array(notes, dtype=float).reshape(-1, 4)
    line_segs = []
    for xs, ys in lines or []:
        pts = [px(x, y) for x, y in zip(xs, ys, strict=False)]
        line_segs += [(*a, *b) for a, b in zip(pts, pts[1:], strict=False)]
    line_a = np.array(line_segs, dtype=float).reshape(-1, 4)

    def size(text: str) -> tuple[float, float]:
        t = ax.text(0, 0, text, fontsize=fontsize, transform=None)
        b = t.get_window_extent(renderer)
        t.remove()
        return b.width, b.height

    def meets(boxes: Any, others: Any) -> Any:
        """``(n,)``: box ``i`` overlaps any of ``others``."""
        if not len(others) or not len(boxes):
            return np.zeros(len(boxes), dtype=bool)
        A, O = boxes[:, None, :], others[None, :, :]
        return ((A[..., 0] < O[..., 2]) & (A[..., 2] > O[..., 0]) & (A[..., 1] < O[..., 3])
                & (A[..., 3] > O[..., 1])).any(1)

    def crossed(segs: Any, boxes: Any) -> Any:
        if not len(segs) or not len(boxes):
            return np.zeros(len(segs), dtype=bool)
        return _seg_box_hits(segs, boxes).any(1)

    # every label's (words, number) candidate spots that nothing fixed gets in the way of, nearest first:
    # (box, leader segment or None, (dx, dy, ha, va, leader))
    wide = "8" * len(str(len(texts)))  # a number is placed as the widest one (digits are equally wide)
    free: list[list[list[tuple[Any, Any, tuple]]]] = []
    for x, y, text in texts:
        cx, cy = px(x, y)
        own = (np.abs(centres[:, 0] - cx) < 0.5) & (np.abs(centres[:, 1] - cy) < 0.5)
        rad = float(radii[own].max()) if own.any() else _CORE_RADIUS * pt
        per_alt = []
        for k, alt in enumerate((text, wide, wide)):
            w, h = size(alt)
            spots = _label_spots(cx, cy, w + 2 * gap, h + 2 * gap, rad, pt)
            boxes = np.array([sp[0] for sp in spots], dtype=float)
            ok = (boxes[:, 0] >= ab.x0) & (boxes[:, 2] <= ab.x1) & (boxes[:, 1] >= ab.y0) & (boxes[:, 3] <= ab.y1)
            ok &= ~meets(boxes, full_boxes) & ~meets(boxes, notes_a)
            if len(line_a):
                ok &= ~_seg_box_hits(line_a, boxes).any(0)
            dxy = np.array([(sp[1], sp[2]) for sp in spots])
            lead = np.hypot(dxy[:, 0], dxy[:, 1]) > _LEADER_FROM
            mid = np.column_stack([(boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2])
            d = np.maximum(np.hypot(mid[:, 0] - cx, mid[:, 1] - cy), 1e-9)
            start = np.column_stack([cx + (mid[:, 0] - cx) * rad / d, cy + (mid[:, 1] - cy) * rad / d])
            segs = np.column_stack([start, mid])  # from the marker's edge to the label's centre
            # a number's leader (the last resort, inside a dense cluster) may cross a neighbour's front
            # ring, not a method's marker — unless the markers themselves overlap so that no line gets
            # out of the cluster without crossing one (the third try)
            obstacles = clear_boxes[~own] if k == 0 else core_boxes[~own] if k == 1 else full_boxes[:0]
            ok &= ~(lead & (crossed(segs, obstacles) | crossed(segs, notes_a)))
            if k < 2 and (~own).any():  # unambiguous: the label is nearer its own marker than any other
                ddx = np.maximum(np.maximum(boxes[:, None, 0] - centres[None, :, 0], 0.0),
                                 centres[None, :, 0] - boxes[:, None, 2])
                ddy = np.maximum(np.maximum(boxes[:, None, 1] - centres[None, :, 1], 0.0),
                                 centres[None, :, 1] - boxes[:, None, 3])
                dist = np.hypot(ddx, ddy) - radii[None, :]
                own_d = dist[:, own].min(1) if own.any() else np.hypot(mid[:, 0] - cx, mid[:, 1] - cy)
                ok &= dist[:, ~own].min(1) >= np.maximum(own_d + _LABEL_CLEAR * pt, _LABEL_CLEAR * pt)
            if k == 0:  # words sit near their point: a long leader into a cluster reads as someone else's
                ok &= np.hypot(dxy[:, 0], dxy[:, 1]) <= _WORD_REACH
            sx = {"left": gap, "right": -gap, "center": 0.0}  # the anchor sits ``gap`` inside the box
            sy = {"bottom": gap, "top": -gap, "center": 0.0}
            per_alt.append([(tuple(boxes[j]), tuple(segs[j]) if lead[j] else None,
                             (spots[j][1] + sx[spots[j][3]] / pt, spots[j][2] + sy[spots[j][4]] / pt,
                              spots[j][3], spots[j][4], bool(lead[j]))) for j in np.flatnonzero(ok)])
        free.append(per_alt)

    def overlap(a: tuple, b: tuple) -> bool:
        return a[0] < b[2] and a[2] > b[0] and a[1] < b[3] and a[3] > b[1]

    def place(order: list[int]) -> dict[int, tuple[int, tuple]]:
        """Greedy, in the given order, each label as words if they fit anywhere, else as a number:
        ``{index: (0 words / 1 number / 2 number whose leader crosses markers, (dx, dy, ha, va,
        leader))}`` of the labels that fit."""
        boxes: list[tuple] = []
        leaders: list[tuple] = []
        got = {}
        for i in order:
            for k in (0, 1, 2):
                for box, seg, spot in free[i][k]:
                    if any(overlap(box, o) for o in boxes) or any(_seg_meets_box(o, box) for o in leaders):
                        continue
                    if seg is not None and (any(_seg_meets_box(seg, o) for o in boxes)
                                            or any(_segs_cross(seg, o) for o in leaders)):
                        continue
                    boxes.append(box)
                    if seg is not None:
                        leaders.append(seg)
                    got[i] = (k, spot)
                    break
                if i in got:
                    break
        return got

    def score(got: dict[int, tuple[int, tuple]]) -> tuple[int, int, int]:
        # unplaced, then numbered, then leaders through markers
        return (len(texts) - len(got), sum(k > 0 for k, _ in got.values()), sum(k == 2 for k, _ in got.values()))

    ys = [px(x, y)[1] for x, y, _ in texts]
    n = len(texts)
    orders = [list(range(n)), list(range(n))[::-1], sorted(range(n), key=lambda i: ys[i]),
              sorted(range(n), key=lambda i: -ys[i]),
              sorted(range(n), key=lambda i: len(free[i][0]))]  # the most constrained first
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
        k, spot = best.get(i, (1, None))
        if spot is None:  # not even a number fits anywhere: beside its point (the key still names it)
            log_debug(f"no free spot for label {text!r}")
            spot = (4.0, 2.0, "left", "bottom", False)
        dx, dy, ha, va, leader = spot
        own = (np.abs(centres[:, 0] - px(x, y)[0]) < 0.5) & (np.abs(centres[:, 1] - px(x, y)[1]) < 0.5)
        shrink = float(radii[own].max()) / pt if own.any() else _CORE_RADIUS
        ax.annotate(numbered[i] if k >= 1 else text, (x, y), textcoords="offset points", xytext=(dx, dy),
                    fontsize=fontsize, ha=ha, va=va, zorder=5,
                    arrowprops={"arrowstyle": "-", "color": "grey", "linewidth": 0.6, "shrinkA": 0,
                                "shrinkB": shrink} if leader else None)
    if not numbered:
        return
    key = "\n".join(f"{numbered[i]}  {texts[i][2]}" for i in as_number)
    legend = ax.get_legend()
    top = 1.0
    if legend is not None:  # the key goes below the legend
        top = ax.transAxes.inverted().transform((0, legend.get_window_extent(renderer).y0))[1] - 0.03
    ax.text(1.01, top, f"{key_title}:\n" + key, transform=ax.transAxes, fontsize=fontsize, va="top", ha="left")


#: two curves of ``mse_vs_bits`` whose points all differ by less than this share lie on top of each other
#: (a 2 % step is about a line width on its log axis spanning 7 decades)
COINCIDE_REL = 0.02


def _fig_mse_vs_bits(plt: Any, src: str, sd: dict[str, Any], style: _Style, out: Path) -> Path | None:
    exp1 = (sd.get("stats") or {}).get("exp1") or {}
    panels = [("k", "K"), ("v", "V")]
    data: dict[str, dict[str, list[tuple[int, float, float]]]] = {kv: {} for kv, _ in panels}
    for m, by in exp1.items():
        for setting, metrics in by.items():
            b = _setting_bits(setting)
            if not b or b[0] != b[1]:
                continue
            for kv, _ in panels:
                e = metrics.get(f"{kv}_rel_mse")
                if e is not None:
                    data[kv].setdefault(m, []).append((b[0], e["mean"], e.get("ci95") or 0.0))
    if not any(data[kv] for kv, _ in panels):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    bits = sorted({b for kv, _ in panels for pts in data[kv].values() for b, y, _ in pts if y > 0})
    zero_note = open_note = False
    for ax, (kv, KV) in zip(axes, panels, strict=False):
        for m in sorted(data[kv], key=lambda m: style.idx.get(m, 99)):
            pts = sorted(p for p in data[kv][m] if p[1] > 0)
            zero_note |= len(pts) < len(data[kv][m])
            if not pts:
                continue
            st = style(m)
            # a 95 % CI reaching 0 or below (mean − CI ≤ 0: seeds that differ by orders of magnitude) has no
            # lower end on a log axis: its whisker stops at mean / _CI_CUT and ends in a ▾, not in a cap
            # several decades down that would read as a huge error
            open_lo = [p[1] - p[2] <= 0 for p in pts]
            lower = [p[1] * (1 - 1 / _CI_CUT) if o else p[2] for p, o in zip(pts, open_lo, strict=True)]
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[lower, [p[2] for p in pts]],
                        label=m, color=st["color"], marker=st["marker"], linestyle=st["linestyle"],
                        markersize=5, capsize=2, linewidth=1.2)
            cut = [(p[0], p[1] / _CI_CUT) for p, o in zip(pts, open_lo, strict=True) if o]
            if cut:
                open_note = True
                ax.plot([c[0] for c in cut], [c[1] for c in cut], linestyle="none", marker="v", markersize=5,
                        color=st["color"], label=f"_CI reaches 0: {m}", zorder=4)
        ax.set_yscale("log")
        for i, group in enumerate(coinciding({m: [(b, y) for b, y, _ in pts if y > 0]
                                              for m, pts in data[kv].items()})):
            # curves drawn over one another: only the last one drawn shows, so the others are named
            ax.text(0.02, 0.02 + 0.06 * i, "on top of each other: " + ", ".join(group), transform=ax.transAxes,
                    ha="left", va="bottom", fontsize=8, color="dimgrey")
        _bits_axis(ax, [float(b) for b in bits])
        ax.set_xlabel("bits per element (nominal bit-width of the setting)")
        ax.set_title(f"{KV} reconstruction")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("relative MSE = MSE / mean(x²) (log scale)")
    _legend_outside(axes[1])
    fig.suptitle(f"Reconstruction error vs bit-width ({src}; mean ± 95% CI over seeds"
                 + ("; exact 0 not drawn" if zero_note else "") + ")", fontsize=11)
    if open_note:
        fig.text(0.5, -0.01, f"▼ at a whisker's end: that 95% CI reaches 0 or below (mean − CI ≤ 0: the seeds spread "
                 f"wider than their mean), which a log axis cannot draw;\nits whisker stops at mean / {_CI_CUT:g} "
                 f"and the ▼ says the CI goes on down", ha="center", va="top", fontsize=8, color="dimgrey")
    return _finish(fig, out / f"mse_vs_bits_{src}.png")


def coinciding(curves: dict[str, list[tuple[float, float]]], rel: float = COINCIDE_REL) -> list[list[str]]:
    """Groups (two or more, sorted; groups in order of their first name) of the curves ``{name: [(x, y)]}`` that
    lie on top of each other: the same x values and every y within ``rel`` of the other's (relative to the
    larger). Each curve joins the first group whose first curve it matches."""
    groups: list[list[str]] = []
    pts = {m: sorted(v) for m, v in curves.items() if v}
    for m in sorted(pts):
        for g in groups:
            a, b = pts[g[0]], pts[m]
            if [x for x, _ in a] == [x for x, _ in b] and all(
                    abs(ya - yb) <= rel * max(abs(ya), abs(yb)) for (_, ya), (_, yb) in zip(a, b, strict=True)):
                g.append(m)
                break
        else:
            groups.append([m])
    return [g for g in groups if len(g) > 1]


#: where the lower whisker of a CI that reaches 0 stops on the log axis of ``mse_vs_bits`` (mean / this)
_CI_CUT = 3.0


def _exp2_curves(sd: dict[str, Any], exp2: dict[str, Any] | None, quantity: str
                 ) -> tuple[str | None, str | None, dict[tuple[str, str], tuple[list[float], list[float]]]]:
    """``(setting, kind, {(method, regime): (x, y)})`` for one exp2 quantity (``"err"`` or ``"kl"``)."""
    stats_exp = (sd.get("stats") or {}).get("exp2") or {}
    cells = (exp2 or {}).get("cells") or []
    from kvqbench.report.leaderboard import setting_key

    settings = {setting_key(c) for c in cells if c.get("status") == "passed"} | {
        s for by in stats_exp.values() for s in by}
    setting = _headline_setting(settings)
    if setting is None:
        return None, None, {}

    def kind(name: str) -> Any:
        k = _error_kind(name)
        if k is None:
            return None
        if quantity == "kl" and k in ("kl", "kl_rev"):
            return (_regime(name), k)
        if quantity == "err" and k in ("rel_mse", "mse", "mae", "cos"):
            return (_regime(name), k)
        return None

    curves = _mean_curves(cells, setting, kind)
    for k, v in _ctx_metric_curves(stats_exp, setting, kind).items():
        curves.setdefault(k, v)
    # one quantity per figure: the preferred kind that exists
    prefs = ("kl", "kl_rev") if quantity == "kl" else ("rel_mse", "mse", "mae", "cos")
    chosen = next((p for p in prefs if any(key[1] == p for _, key in curves)), None)
    return setting, chosen, {(m, key[0]): xy for (m, key), xy in curves.items() if key[1] == chosen}


_ERR_LABEL = {"rel_mse": "attention-output relative MSE Σ(Ô−O)²/ΣO²", "mse": "attention-output MSE", "mae": "attention-output MAE", "cos": "cosine drift 1−cos(O, Ô)",
              "kl": "attention KL(p‖p̂) [nats]", "kl_rev": "reverse attention KL(p̂‖p) [nats]"}


def _fig_vs_context(plt: Any, src: str, sd: dict[str, Any], exp2: dict[str, Any] | None, style: _Style,
                    out: Path, quantity: str) -> Path | None:
    from matplotlib.transforms import blended_transform_factory, offset_copy

    setting, kind, curves = _exp2_curves(sd, exp2, quantity)
    if not curves or kind is None:
        return None
    regimes = [r for r in ("static", "pseudo-decode") if any(k[1] == r for k in curves)]
    fp16 = _decode_fp16(exp2, setting) if "pseudo-decode" in regimes else {}
    if fp16:  # a second row: the fp16 tokens and billed bits under the pseudo-decode panel
        fig, grid = plt.subplots(2, len(regimes), figsize=(6 * len(regimes) + 1.5, 7.0), squeeze=False,
                                 gridspec_kw={"height_ratios": [3, 1.5]}, sharex="col")
        axes = grid[:1]
        for ax in grid[0][1:]:
            ax.sharey(grid[0][0])
    else:
        fig, axes = plt.subplots(1, len(regimes), figsize=(6 * len(regimes) + 1.5, 4.6), sharey=True,
                                 squeeze=False)
    allv = [y for xs, ys in curves.values() for y in ys]
    log = _span_decades(allv) >= 1.5
    handles: dict[str, Any] = {}
    zeros: dict[str, list[tuple[str, list[float]]]] = {}  # regime → (method, lengths where exactly 0)
    n_lines = 0  # the most lines of notes at the foot of a panel
    n_zero_rows = 0  # whether a panel has a row of ▽ (exact 0) under its notes
    for ax, reg in zip(axes[0], regimes, strict=False):
        zero_methods: list[str] = []
        for (m, r), (xs, ys) in sorted(curves.items(), key=lambda kv: style.idx.get(kv[0][0], 99)):
            if r != reg:
                continue
            pts = [(x, y) for x, y in zip(xs, ys, strict=False) if (y > 0 or not log)]
            if not pts:
                zero_methods.append(m)
                continue
            if len(pts) < len(ys):
                zeros.setdefault(reg, []).append((m, [x for x, y in zip(xs, ys, strict=False) if not y > 0]))
            st = style(m)
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=m, color=st["color"],
                              marker=st["marker"], linestyle=st["linestyle"], markersize=4, linewidth=1.3)
            handles.setdefault(m, line)
        notes = []
        foot = blended_transform_factory(ax.transData, ax.transAxes)
        at_x: dict[float, int] = defaultdict(int)  # ▽ already drawn at a length: the next one beside it
        for m, xs0 in zeros.get(reg, []):  # a point at exactly 0 has no place on a log axis: ▽ on its x axis
            st = style(m)
            for x in xs0:
                # inside the axes: the marker's tip (and its edge) stays above the x axis, never cut by it
                shift = offset_copy(foot, fig=fig, x=7.0 * at_x[x], y=_ZERO_MARK_Y, units="points")
                at_x[x] += 1
                ax.plot([x], [0.0], transform=shift, linestyle="none", marker="v", markersize=7,
                        markerfacecolor="white", markeredgewidth=1.3, color=st["color"], clip_on=False, zorder=5,
                        label=f"_exactly 0: {m}")
            why = _all_fp16_at(fp16.get(m), xs0) if reg == "pseudo-decode" else []
            at = ", ".join(f"{x:g}" for x in xs0)
            notes.append(f"▽ {m} at {at} tokens: exactly 0" + (" (every token still fp16)" if why else ""))
        if zero_methods:
            notes.append("exactly 0 at every length (not drawn): " + ", ".join(zero_methods))
        if log:
            ax.set_yscale("log")
        if notes:  # above the row of ▽ where there is one
            lift = 2 * _ZERO_MARK_Y if zeros.get(reg) else 0.0
            ax.text(0.01, 0.02, "\n".join(notes), fontsize=7, color="dimgrey", va="bottom", zorder=6,
                    transform=offset_copy(ax.transAxes, fig=fig, y=lift, units="points"))
            n_lines = max(n_lines, len(notes))
            n_zero_rows = max(n_zero_rows, 1 if zeros.get(reg) else 0)
        xs_all = sorted({x for (m, r), (xs, _) in curves.items() if r == reg for x in xs})
        if xs_all and xs_all[0] > 0 and xs_all[-1] / xs_all[0] >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_title(f"{reg}" + (" (whole prefix quantized at once)" if reg == "static" else
                                  " (quantized block by block as it arrives)"), fontsize=10)
        ax.grid(True, alpha=0.3)
    if n_lines:  # an empty band at the foot of the (shared) y axis for the notes: they cover no curve
        height_pt = axes[0][0].get_position().height * fig.get_size_inches()[1] * 72.0
        _foot_room(axes[0][0], 0.045 * n_lines + 0.03 + n_zero_rows * 2 * _ZERO_MARK_Y / height_pt)
    axes[0][0].set_ylabel(_ERR_LABEL.get(kind, kind) + (" (log scale)" if log else ""))
    order = sorted(handles, key=lambda m: style.idx.get(m, 99))  # every method drawn in any panel
    if order:
        axes[0][-1].legend([handles[m] for m in order], order, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                           fontsize=8, frameon=False)
    if fp16:
        _draw_fp16_panel(grid, regimes, fp16, style, axes, {m: xy for (m, r), xy in curves.items()
                                                             if r == "pseudo-decode"}, kind, src)
    what = "Attention KL" if quantity == "kl" else "Attention error"
    fig.suptitle(f"{what} vs context length at {setting} ({src}; mean over seeds)", fontsize=11)
    name = "attn_kl_vs_context" if quantity == "kl" else "attn_error_vs_context"
    return _finish(fig, out / f"{name}_{src}.png")


#: height (points) above the x axis of the centre of a ▽ that marks an exact 0 on a log axis: the whole
#: marker (7 points, edge 1.3) stays inside the axes
_ZERO_MARK_Y = 6.0


def _foot_room(ax: Any, frac: float) -> None:
    """Lower the y axis so that the bottom ``frac`` of its height holds no data (log or linear)."""
    ax.autoscale_view()
    lo, hi = ax.get_ylim()
    if ax.get_yscale() == "log" and lo > 0:
        span = math.log10(hi / lo)
        ax.set_ylim(lo / 10 ** (span * frac / (1 - frac)), hi)
    else:
        ax.set_ylim(lo - (hi - lo) * frac / (1 - frac), hi)


def _decode_fp16(exp2: dict[str, Any] | None, setting: str | None) -> dict[str, dict[str, Any]]:
    """What pseudo-decode holds in fp16, per method whose billed bits change with the length by more
    than 5 % (its fp16 share — attention sinks, a recent window, a partly filled last tile — changes
    with it): ``{method: {"x": lengths, "bits": billed bits/element, "share": share of the tokens in
    fp16 or None, "newest": the newest tokens held in fp16 (mean of K and V) or None}}``. The newest
    are the fp16 tokens that are not sink tokens: ``share · L − sink`` (sinks from the cells'
    ``extra.decode.policy``; None where a cell records no policy), all ``L`` where every token is fp16.
    Empty when no method qualifies."""
    if setting is None:
        return {}
    from kvqbench.report.leaderboard import setting_key

    def kind(name: str) -> Any:
        last = name.split("/")[-1]
        if _regime(name) != "pseudo-decode":
            return None
        return "bits" if last in ("bits_effective", "bits") else "share" if last == "fp16_token_share" else None

    cells = (exp2 or {}).get("cells") or []
    mean = _mean_curves(cells, setting, kind)
    out: dict[str, dict[str, Any]] = {}
    for (m, key), (xs, ys) in mean.items():
        lo, hi = min(ys), max(ys)
        if key != "bits" or not (lo > 0 and (hi - lo) / lo > 0.05):
            continue
        share = mean.get((m, "share"))
        share_y = share[1] if share is not None and share[0] == xs else None
        sinks = None
        for c in cells:
            pol = ((c.get("extra") or {}).get("decode") or {}).get("policy") or {}
            if c.get("method") == m and c.get("status") == "passed" and setting_key(c) == setting and pol:
                sinks = [p.get("sink_tokens", 0) for p in pol.values()]
                break
        newest = None
        if share_y is not None and sinks:  # every token fp16 (nothing quantized yet): all L are the newest
            newest = [float(x) if f >= 1.0 - 1e-9 else
                      max(0.0, round(2 * (f * x - math.fsum(min(sk, x) for sk in sinks) / len(sinks))) / 2)
                      for x, f in zip(xs, share_y, strict=False)]
        out[m] = {"x": xs, "bits": ys, "share": share_y, "newest": newest}
    return out


def _all_fp16_at(info: dict[str, Any] | None, xs0: list[float]) -> bool:
    """Whether every token is fp16 at each of the lengths ``xs0`` (fp16 share 1 there)."""
    if not info or info.get("share") is None:
        return False
    at = dict(zip(info["x"], info["share"], strict=False))
    return all(x in at and at[x] >= 1.0 - 1e-9 for x in xs0)


def _draw_fp16_panel(grid: Any, regimes: list[str], fp16: dict[str, dict[str, Any]], style: _Style,
                     top_axes: Any, decode_curves: dict[str, tuple[list[float], list[float]]], kind: str,
                     src: str = "") -> None:
    """Under the pseudo-decode panel: per method whose fp16 share changes with the length, the newest
    tokens still in fp16 (solid, left axis) and the billed bits/element (dashed, right axis); beside it,
    a note that says, from the data, why those curves jump between neighbouring lengths."""
    from matplotlib.lines import Line2D

    ax = grid[1][regimes.index("pseudo-decode")]
    methods = sorted(fp16, key=lambda m: style.idx.get(m, 99))
    with_newest = [m for m in methods if fp16[m]["newest"] is not None]
    bits_ax = ax.twinx() if with_newest else ax
    if with_newest:
        bits_ax.spines["right"].set_visible(True)
    for m in methods:
        st = style(m)
        info = fp16[m]
        if info["newest"] is not None:
            ax.plot(info["x"], info["newest"], color=st["color"], marker=st["marker"], linestyle="-", markersize=4,
                    linewidth=1.3, label=m)
        bits_ax.plot(info["x"], info["bits"], color=st["color"], marker=st["marker"], markersize=4,
                     linestyle="--" if with_newest else "-", linewidth=0.9 if with_newest else 1.3,
                     markerfacecolor="white" if with_newest else st["color"],
                     label=f"{m} billed bits" if with_newest else m)
    ax.set_xlabel("context length (tokens)")
    ax.grid(True, alpha=0.3)
    bits_ax.set_ylabel("billed bits/element" + (" (dashed)" if with_newest else ""), fontsize=8)
    if with_newest:
        ax.set_ylabel("newest tokens in fp16\n(solid)", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.set_title("pseudo-decode fp16: the newest tokens still fp16 (solid, left) and the billed bits "
                     "(dashed, right)", fontsize=8)
        handles = [Line2D([], [], color=style(m)["color"], marker=style(m)["marker"], markersize=4) for m in methods]
        handles += [Line2D([], [], color="black", linestyle="-"), Line2D([], [], color="black", linestyle="--",
                                                                          marker="o", markerfacecolor="white",
                                                                          markersize=4)]
        labels = methods + ["newest tokens in fp16", "billed bits/element"]
        ax.legend(handles, labels, fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.12, 1.0))
    else:
        ax.set_title("billed bits in pseudo-decode (fp16 sink / residual / partial-tile tokens at 16 bits)",
                     fontsize=8)
        ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    top_axes[0][regimes.index("pseudo-decode")].set_xlabel("")
    note = _fp16_note(fp16, methods, decode_curves, kind, src)
    for i, reg in enumerate(regimes):
        if reg != "pseudo-decode":
            a = grid[1][i]
            a.axis("off")
            top_axes[0][i].tick_params(labelbottom=True)  # its lower neighbour is a note, not an axis
            top_axes[0][i].set_xlabel("context length (tokens)")
            a.text(0.0, 0.95, "\n".join(line for para in note for line in (_wrap(para, 82) or [""])),
                   transform=a.transAxes, fontsize=8, va="top")


def _fp16_note(fp16: dict[str, dict[str, Any]], methods: list[str],
               decode_curves: dict[str, tuple[list[float], list[float]]], kind: str, src: str = "") -> list[str]:
    """The note beside the fp16 panel, as paragraphs, every claim from the data: what changes with the
    length (which tokens stay fp16), then, for each method whose newest tokens are all fp16 at some
    lengths and all quantized at others, the lengths of each case with its error there and what the
    data say about it: lower wherever the newest tokens are fp16 (the fp16 share explains the jumps),
    or ranges that overlap (it does not). ``src`` (``synthetic``/``real``) names the data."""
    what = "KL" if kind in ("kl", "kl_rev") else "error"
    data = f"this {src} data" if src else "this data"
    paras = [f"Pseudo-decode, {', '.join(methods)}: which tokens stay fp16 (attention sinks, a recent window, "
             "a partly filled last tile) changes with the length, and so do the bits billed. The panel to the "
             "right of this note (below the pseudo-decode curves) shows, at each length, the newest tokens "
             "still fp16 and the bits billed."]

    def rng(vals: list[float]) -> str:
        if not vals:
            return ""
        lo, hi = f"{min(vals):.2g}", f"{max(vals):.2g}"
        return f"{what} {lo}" if lo == hi else f"{what} {lo}–{hi}"

    for m in methods:
        info = fp16[m]
        if info["newest"] is None:
            continue
        ys = dict(zip(*decode_curves[m], strict=False)) if m in decode_curves else {}
        every = [x for x in info["x"] if _all_fp16_at(info, [x])]
        some: dict[float, list[float]] = {}
        none = []
        for x, n in zip(info["x"], info["newest"], strict=False):
            if x in every:
                continue
            if n > 0:
                some.setdefault(n, []).append(x)
            else:
                none.append(x)
        if not none or not (some or every):
            continue  # the newest tokens are fp16 at every length (or at none): no jump to explain
        parts = []
        if every:
            parts.append(f"every token fp16 at {', '.join(f'{x:g}' for x in every)} ({what} exactly 0)")
        for n, xs in sorted(some.items(), key=lambda kv: -kv[0]):
            parts.append(f"the newest {n:g} fp16 at {', '.join(f'{x:g}' for x in xs)} "
                         f"({rng([ys[x] for x in xs if x in ys])})")
        parts.append(f"none at {', '.join(f'{x:g}' for x in none)}, where the length fills its last tile "
                     f"({rng([ys[x] for x in none if x in ys])})")
        with_fp16 = [ys[x] for xs in some.values() for x in xs if x in ys]
        without = [ys[x] for x in none if x in ys]
        if with_fp16 and without and max(with_fp16) < min(without):
            verdict = (f"on {data} the {what} is {min(without) / max(with_fp16):.2g}–"
                       f"{max(without) / min(with_fp16):.2g}× higher wherever none of the newest tokens are "
                       f"fp16: the fp16 share explains the jumps")
        elif with_fp16 and without and max(without) <= min(with_fp16):
            verdict = (f"on {data} the {what} is no higher where none of the newest tokens are fp16: the fp16 "
                       f"share does not explain the curve's shape")
        elif with_fp16 and without:
            verdict = (f"on {data} the two ranges overlap: the fp16 share does not explain the curve's shape")
        else:
            verdict = ""
        paras.append(f"{m}: " + "; ".join(parts) + (f". So {verdict}." if verdict else "."))
    return paras


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


def _fig_norm_density(plt: Any, src: str, sd: dict[str, Any], exp3: dict[str, Any] | None, style: _Style,
                      out: Path) -> Path | None:
    cells = (exp3 or {}).get("cells") or []
    from kvqbench.report.leaderboard import setting_key

    setting = _headline_setting({setting_key(c) for c in cells if c.get("status") == "passed"})
    if setting is None:
        return None

    def kind(name: str) -> Any:
        if "norm" not in name and "diff" not in name:
            return None
        segs = re.split(r"[^a-z0-9]+", name)
        return "V" if ("v" in segs or any(s.startswith("v_") for s in name.split("/")) or name.startswith("v_")) else "K"

    curves = _mean_curves(cells, setting, kind, hist=True)
    if not curves:
        return None
    tails = _mean_tails(cells, setting, kind)
    methods = sorted({m for m, _ in curves}, key=lambda m: style.idx.get(m, 99))
    kvs = [kv for kv in ("K", "V") if any(k == kv for _, k in curves)]
    ncol = min(4, len(methods))
    nrow = math.ceil(len(methods) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol + 0.5, 2.5 * nrow + 0.8), squeeze=False)
    for i, m in enumerate(methods):
        ax = axes[i // ncol][i % ncol]
        st = style(m)
        drawn = {kv: curves[(m, kv)] for kv in kvs if (m, kv) in curves}
        lo, hi = _mass_range([d for d in drawn.values()])
        outside = []
        merged = set()
        one_bin: dict[tuple[float, float], list[str]] = {}  # a density all in one bin: below the resolution
        for kv, (edges, dens) in drawn.items():
            shares = [d * (b - a) for a, b, d in zip(edges, edges[1:], dens, strict=False)]
            top = max(range(len(shares)), key=shares.__getitem__, default=None)
            if top is not None and shares[top] >= 0.995:
                one_bin.setdefault((edges[top], edges[top + 1]), []).append(kv)
            # the drawn density integrates to the share inside the bins: the rest is under/overflow
            share_out = 1.0 - _mass_within(edges, dens, lo, hi)
            if share_out > 0.005:
                under, over = tails.get((m, kv), (0.0, 0.0))
                beyond = [f"{v:.0%} {sign} {edge:g}" if v >= 0.01 else f"<1% {sign} {edge:g}"
                          for v, sign, edge in ((under, "<", edges[0]), (over, ">", edges[-1])) if v > 0.005]
                outside.append((f"{kv} {share_out:.0%}" if share_out >= 0.01 else f"{kv} <1%")
                               + (f" ({', '.join(beyond)}, past the last bin)" if beyond else ""))
            k = _merge_factor(edges, dens, lo, hi)
            if k > 1:
                merged.add(k)
                edges, dens = _merge_bins(edges, dens, k)
            ax.stairs(dens, edges, fill=True, alpha=0.35 if kv == "K" else 0.15, color=st["color"])
            ax.stairs(dens, edges, color=st["color"], linewidth=1.0, linestyle="-" if kv == "K" else "--", label=kv)
        ax.set_xlim(lo, hi)
        ax.xaxis.set_major_locator(plt.MaxNLocator(5))
        ax.axvline(0, color="grey", linewidth=0.6)
        lines = [f"{', '.join(kvs_)}: all tokens in [{a:g}, {b:g})" for (a, b), kvs_ in one_bin.items()]
        if outside:
            line = ", ".join(outside)
            lines += ["off scale: " + line] if len(line) <= 28 else ["off scale: " + outside[0], *outside[1:]]
        if merged:
            lines.append(f"bins merged ×{max(merged)} (fine bins zig-zag)")
        if lines:  # in the upper corner where the drawn densities are lower, above the highest bin
            text = "\n".join(lines)
            ax.set_ylim(0, ax.get_ylim()[1] * (1 + 0.12 * len(lines)))
            third = (hi - lo) / 3
            left = max((d for e, ds in drawn.values() for a, d in zip(e, ds, strict=False) if a < lo + third),
                       default=0.0)
            right = max((d for e, ds in drawn.values() for a, b, d in zip(e, e[1:], ds, strict=False)
                         if b > hi - third), default=0.0)
            x_note, ha = (0.02, "left") if left <= right else (0.98, "right")
            ax.text(x_note, 0.97, text, transform=ax.transAxes, fontsize=7, va="top", ha=ha, color="dimgrey",
                    zorder=5, bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none",
                                    "alpha": 0.8})
        ax.set_title(m, fontsize=9, color=st["color"])
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.25)
        if len(kvs) > 1 and i == 0:
            ax.legend(fontsize=7, frameon=False, loc="upper right")
    for j in range(len(methods), nrow * ncol):
        axes[j // ncol][j % ncol].axis("off")
    for j in range(ncol):  # the x label on the lowest drawn panel of each column
        col = [axes[r][j] for r in range(nrow) if r * ncol + j < len(methods)]
        if col:
            col[-1].set_xlabel("(‖x̂‖ − ‖x‖) / RMS token norm", fontsize=8)
    for row in axes:
        row[0].set_ylabel("density", fontsize=8)
    fig.suptitle(f"Per-token norm-difference density at {setting} ({src}; K solid, V dashed; 0 = norm preserved)\n"
                 "x-range per method: the central 98 % of its tokens inside the histogram's bins (quantiles "
                 "from the data); a panel names any share off scale, bins included", fontsize=11)
    fig.tight_layout()
    return _finish(fig, out / f"norm_diff_density_{src}.png")


def _mass_within(edges: list[float], dens: list[float], lo: float, hi: float) -> float:
    """Share of a density (on ``edges``) inside ``[lo, hi]`` (partial bins pro rata)."""
    tot = 0.0
    for a, b, d in zip(edges, edges[1:], dens, strict=False):
        overlap = max(0.0, min(b, hi) - max(a, lo))
        tot += d * overlap
    return tot


def _quantile(edges: list[float], mass: list[float], q: float) -> float:
    """The ``q`` quantile of a histogram (``mass`` per bin on ``edges``; uniform inside each bin)."""
    total = math.fsum(mass)
    target, acc = q * total, 0.0
    for a, b, w in zip(edges, edges[1:], mass, strict=False):
        if w > 0 and acc + w >= target:
            return a + (b - a) * max(0.0, target - acc) / w
        acc += w
    return edges[-1]


def _mass_range(hists: list[tuple[list[float], list[float]]], keep: float = 0.98, min_span: float = 0.1
                ) -> tuple[float, float]:
    """An x-range chosen from the data: from the ``(1 − keep) / 2`` to the ``(1 + keep) / 2`` quantile of
    the tokens inside each histogram's bins (the widest over the histograms; quantiles interpolated
    inside a bin, so one wide tail bin does not stretch the axis to its far edge), always including 0,
    at least ``min_span`` wide, padded by 5 %. Tokens past the first or last edge (under/overflow) are
    not in the bins and do not stretch it either: the figure names their share. Falls back to the
    edges' span."""
    los, his = [], []
    for edges, dens in hists:
        mass = [d * (b - a) for a, b, d in zip(edges, edges[1:], dens, strict=False)]
        if math.fsum(mass) <= 0:
            continue
        los.append(_quantile(edges, mass, (1.0 - keep) / 2))
        his.append(_quantile(edges, mass, (1.0 + keep) / 2))
    if not los:
        e = hists[0][0] if hists else [-1.0, 1.0]
        return e[0], e[-1]
    lo, hi = min(min(los), 0.0), max(max(his), 0.0)
    if hi - lo < min_span:  # e.g. everything in the bin at 0 (fp16): show some room around it
        mid = (hi + lo) / 2
        lo, hi = min(lo, mid - min_span / 2), max(hi, mid + min_span / 2)
    pad = 0.05 * (hi - lo)
    return lo - pad, hi + pad


def _merge_factor(edges: list[float], dens: list[float], lo: float, hi: float, most: int = 4) -> int:
    """How many neighbouring bins to merge (1 = none) so that the density inside ``[lo, hi]`` reads as a
    curve. A turn is a rise then a fall, or a fall then a rise, each step over 10 % of the peak; a
    smooth curve with up to three modes has at most 3. Where the fine bins make more (sampling noise,
    or bins finer than the values' own grain), the smallest factor up to ``most`` that brings them to 3
    or fewer, else the one with the fewest turns — but only a factor that removes turns: where they
    come from bins that cannot merge (a wider tail), none."""
    def turns(k: int) -> int:
        e, d = _merge_bins(edges, dens, k) if k > 1 else (edges, dens)
        seen = [v for a, b, v in zip(e, e[1:], d, strict=False) if b > lo and a < hi]
        if len(seen) < 4:
            return 0
        peak = max(seen)
        steps = [b - a for a, b in zip(seen, seen[1:], strict=False) if abs(b - a) > 0.1 * peak]
        return sum((a > 0) != (b > 0) for a, b in zip(steps, steps[1:], strict=False))

    counts = {k: turns(k) for k in range(1, most + 1)}
    if counts[1] <= 3:
        return 1
    enough = [k for k in counts if counts[k] <= 3]
    best = enough[0] if enough else min(counts, key=lambda k: (counts[k], k))
    return best if counts[best] < counts[1] else 1


def _merge_bins(edges: list[float], dens: list[float], k: int) -> tuple[list[float], list[float]]:
    """Merge runs of ``k`` neighbouring bins of equal width into one (density = their mass over their
    width, so the mass is kept); runs are aligned on the edge nearest 0 so that 0 stays an edge; bins
    of another width (a wider tail) are kept as they are."""
    z = min(range(len(edges)), key=lambda i: abs(edges[i]))
    ne, nd = [edges[0]], []
    i, n = 0, len(dens)
    while i < n:
        w = edges[i + 1] - edges[i]
        run = i + k <= n and (i - z) % k == 0 and all(
            abs((edges[j + 1] - edges[j]) - w) <= 1e-9 * max(abs(w), 1.0) for j in range(i, i + k))
        if run:
            ne.append(edges[i + k])
            nd.append(math.fsum(dens[j] * (edges[j + 1] - edges[j]) for j in range(i, i + k)) / (edges[i + k] - edges[i]))
            i += k
        else:
            ne.append(edges[i + 1])
            nd.append(dens[i])
            i += 1
    return ne, nd


def _fig_cost(plt: Any, src: str, sd: dict[str, Any], catalog: dict[str, Any], style: _Style,
              out: Path, exp4_doc: dict[str, Any] | None = None) -> Path | None:
    stats = sd.get("stats") or {}
    exp4 = stats.get("exp4") or {}
    if not exp4:
        return None
    settings = {s for by in exp4.values() for s in by}
    setting = _headline_setting(settings) or (sorted(settings)[0] if settings else None)
    if setting is None:
        return None
    names = sorted({n for by in exp4.values() for n in (by.get(setting) or {})})
    lat = [n for n in names if (catalog.get(n, {}).get("unit") in TIME_UNITS) or re.search(r"(latency|_ms$|_s$)", n)]
    lat = sorted((n for n in lat if "throughput" not in n and not n.endswith("_x_clone")),
                 key=lambda n: ("dequant" in n, n))
    bit_names = sorted((n for n in names if "bits" in n and n not in lat), key=lambda n: ("effective" in n, n))
    bit_src = exp4
    if not bit_names:  # fall back to the reconstruction experiment's bits accounting
        bit_src = stats.get("exp1") or {}
        bit_names = [n for n in ("bits_nominal", "bits_effective") if any(n in (by.get(setting) or {})
                                                                          for by in bit_src.values())]
    methods = [m for m in style.idx if m in exp4] + sorted(m for m in exp4 if m not in style.idx)
    panels = [p for p in (("latency", lat), ("bits", bit_names)) if p[1]]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels) + 1, 4.8), squeeze=False)
    unreliable = any((c.get("extra") or {}).get("unreliable_timing") for c in (exp4_doc or {}).get("cells", []))
    for ax, (kind, metric_names) in zip(axes[0], panels, strict=False):
        w = 0.8 / len(metric_names)
        drawn_bits: list[tuple[Any, list[float], list[float]]] = []
        vals_all = []
        for j, n in enumerate(metric_names):
            xs, ys, es = [], [], []
            src_stats = exp4 if kind == "latency" else bit_src
            for i, m in enumerate(methods):
                e = ((src_stats.get(m) or {}).get(setting) or {}).get(n)
                if e is None:
                    continue
                xs.append(i + (j - (len(metric_names) - 1) / 2) * w)
                ys.append(e["mean"])
                es.append(e.get("ci95") or 0.0)
            vals_all += ys
            unit = catalog.get(n, {}).get("unit", "")
            bars = ax.bar(xs, ys, width=w, yerr=es, capsize=2, label=f"{n} [{unit}]" if unit else n,
                          color=_COLORS[j % len(_COLORS)], alpha=0.85)
            if kind == "bits":
                drawn_bits.append((bars, ys, es))
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels(methods, rotation=35, ha="right", fontsize=8)
        if kind == "latency":
            if _span_decades(vals_all) >= 1.5:
                ax.set_yscale("log")
            units = sorted({catalog.get(n, {}).get("unit", "") for n in metric_names} - {""})
            ax.set_ylabel(f"latency [{', '.join(units) or 'time'}]" + (" (log scale)" if ax.get_yscale() == "log" else ""))
            ax.set_title("Quantize / dequantize latency (median of repeats)"
                         + ("\nCPU timing: indicative only (unreliable_timing)" if unreliable else ""), fontsize=10)
        else:
            ax.set_ylabel("bits per element (value on each bar)")
            ax.set_title("Bits per element (nominal vs effective)", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, frameon=False)
        if kind == "bits" and drawn_bits:  # after the legend, whose swatches stay plain
            _clip_tall_bars(ax, drawn_bits, methods)
    fig.suptitle(f"Cost at {setting} ({src}; mean ± 95% CI over seeds)", fontsize=11)
    fig.tight_layout()
    return _finish(fig, out / f"cost_{src}.png")


def _clip_tall_bars(ax: Any, drawn: list[tuple[Any, list[float], list[float]]],
                    methods: list[str] | None = None) -> None:
    """Bits bars on a linear scale fitted to the compressed methods: a bar taller than 2.5× the
    median (fp16's 16 bits beside ~2-bit methods) is cut at the top of the axis, hatched, and keeps
    its value as a label; every bar carries its value (8 points, upright along the bar), so 2.0 vs 2.7
    bits reads at a glance. The line under the title says what is cut and where the axis ends.
    ``methods``: the x tick names (bar ``i`` of a series is at tick ``round(x)``), to name the cut bars."""
    vals = [y for _, ys, _ in drawn for y in ys]
    if not vals:
        return
    med = sorted(vals)[len(vals) // 2]
    tall = [y > 2.5 * med for y in vals]
    rest = [y + e for _, ys, es in drawn for y, e in zip(ys, es, strict=False) if not y > 2.5 * med]
    top = 1.4 * max(rest) if any(tall) and rest else None  # headroom: values above the bars, the legend
    cut: dict[str, float] = {}
    for bars, ys, _ in drawn:
        for bar, y in zip(bars, ys, strict=False):
            x = bar.get_x() + bar.get_width() / 2
            if top is not None and y > 2.5 * med:
                bar.set_height(top * 0.93)
                bar.set_hatch("//")
                i = int(round(x))
                cut[methods[i] if methods and 0 <= i < len(methods) else f"{y:.3g}"] = y
                ax.annotate(f"{y:.3g} ↑", (x, top * 0.93), textcoords="offset points", xytext=(0, -3),
                            ha="center", va="top", fontsize=8, fontweight="bold", rotation=90,
                            bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none",
                                  "alpha": 0.85})
            else:
                ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 2), ha="center",
                            va="bottom", fontsize=8, rotation=90)
    if top is not None:
        ax.set_ylim(0, top)
        # between the title and the axes, where no bar, value or legend can be
        ax.set_title(ax.get_title(), fontsize=ax.title.get_fontsize(), pad=16)
        names = ", ".join(f"{m} {v:.3g}" for m, v in cut.items())
        ax.annotate(f"hatched bars ({names} bits) are cut at the top of this 0–{top:.2g}-bit axis, their value "
                    f"written on them", (0.5, 1.0), xycoords="axes fraction", xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8, color="dimgrey")


def _fig_predictivity(plt: Any, src: str, sd: dict[str, Any], style: _Style, out: Path, top: int = 4
                      ) -> Path | None:
    """The best-predicting tensor metrics against the end-to-end KL: one panel per metric, one point per
    method × bits (means over seeds), log axes; ρ in each panel's title."""
    from kvqbench.report.leaderboard import PREDICTIVITY_TARGETS

    pr = sd.get("predictivity") or {}
    target = PREDICTIVITY_TARGETS[0]
    by_group = (pr.get("targets") or {}).get(target) or {}
    group = "pooled" if "pooled" in by_group else next(iter(by_group), None)
    rows = [r for r in by_group.get(group, []) if r["rho"] is not None][:top] if group else []
    stats = sd.get("stats") or {}
    e2e = stats.get("exp5") or {}
    if not rows or not e2e:
        return None
    fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows) + 1.6, 3.8), squeeze=False)
    shapes = ["o", "s", "^", "D", "v"]
    for ax, r in zip(axes[0], rows, strict=False):
        negative = False  # a signed metric (a slope, a bias) is drawn as |value| on the log axis: say so
        for m in sorted(e2e, key=lambda m: style.idx.get(m, 99)):
            for setting, metrics in sorted(e2e[m].items()):
                x = (stats.get(r["experiment"], {}).get(m, {}).get(setting, {}).get(r["metric"]) or {}).get("mean")
                y = (metrics.get(target) or {}).get("mean")
                if x is None or y is None or not (abs(x) > 0 and y > 0):
                    continue
                b = _setting_bits(setting)
                negative |= x < 0
                ax.scatter([abs(x)], [y], color=style(m)["color"], s=28,
                           marker=shapes[(b[0] if b else 0) % len(shapes)],
                           label=f"{m} {setting}" if ax is axes[0][-1] else None)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"|{r['metric']}| ({r['experiment']}; negative values drawn by magnitude)" if negative
                      else f"{r['metric']} ({r['experiment']})", fontsize=9 if negative else None)
        ci = f" [{r['ci95'][0]:+.2f}, {r['ci95'][1]:+.2f}]" if r.get("ci95") else ""
        ax.set_title(f"ρ = {r['rho']:+.2f}{ci}", fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel(f"end-to-end KL(p‖p̂), nats ({target})")
    _legend_outside(axes[0][-1], ncol=2)
    fig.suptitle(f"Which tensor metrics predict model damage ({src}; one point per method × bits, "
                 f"Spearman ρ {group})", fontsize=11)
    return _finish(fig, out / f"predictivity_{src}.png")


def figure_names(source: str) -> list[str]:
    """Every figure file name this module may write for ``source``."""
    return [f"{n}_{source}.png" for n in ("pareto", "mse_vs_bits", "attn_error_vs_context", "attn_kl_vs_context",
                                          "norm_diff_density", "cost", "predictivity")]


#: rough relative cost of each figure (CPU-seconds on the main job's data): the parallel pool starts the
#: dearest first so that the last one to finish is a cheap one
_COST_RANK = {"norm_diff_density": 0, "attn_kl_vs_context": 1, "attn_error_vs_context": 2, "predictivity": 3,
              "cost": 4, "pareto": 5, "mse_vs_bits": 6}

#: the figure jobs of the running :func:`write_figures`, read by the forked pool workers (they inherit
#: it, so neither the data nor matplotlib objects are pickled)
_JOBS: list[tuple[str, Callable[..., Path | None], tuple]] = []


def default_jobs() -> int:
    """How many processes draw figures when the caller asks for ``jobs=0`` (automatic): the CPUs this
    process may run on (``os.sched_getaffinity``), at most 8."""
    import os

    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def _run_job(i: int) -> tuple[Path | None, str | None]:
    """Draw figure ``i`` of :data:`_JOBS`; ``(path or None, one-line message or None)``, never raises."""
    import matplotlib.pyplot as plt

    name, fig_fn, fig_args = _JOBS[i]
    try:
        return fig_fn(*fig_args), None
    except Exception as e:  # one broken figure never blocks the others or the run
        plt.close("all")
        return None, f"kvqbench: figure {name} skipped: {type(e).__name__}: {e}"


def _run_parallel(n_jobs: int) -> list[tuple[Path | None, str | None]] | None:
    """Every job of :data:`_JOBS` drawn by ``n_jobs`` forked processes (results in job order), or
    ``None`` when no process pool can be had here (no ``fork`` start method, a pool that broke): the
    caller then draws serially. Forked workers inherit the loaded JSON and the rc settings; each PNG
    is the same file, byte for byte, as a serial draw writes."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    if "fork" not in mp.get_all_start_methods():
        return None
    order = sorted(range(len(_JOBS)), key=lambda i: (_COST_RANK.get(_JOBS[i][0].rsplit("_", 1)[0], 9), i))
    try:
        with ProcessPoolExecutor(max_workers=n_jobs, mp_context=mp.get_context("fork")) as pool:
            done = dict(zip(order, pool.map(_run_job, order), strict=True))
    except Exception:  # BrokenProcessPool, OSError (no processes left): draw serially instead
        return None
    return [done[i] for i in range(len(_JOBS))]


def write_figures(results_dir: str | Path, out_dir: str | Path | None = None, *, log: Log | None = None,
                  jobs: int = 1) -> list[Path]:
    """Render every figure that the saved JSON in ``results_dir`` supports; return the written paths.

    Args:
        results_dir: a folder holding ``leaderboard.json`` and optionally ``exp*_{source}.json``.
        out_dir: where the PNGs go (default ``results_dir``).
        log: one-line messages (missing matplotlib, a figure that failed); default stderr.
        jobs: processes drawing figures side by side (forked, so the JSON is read once); ``0`` = one per
            available CPU (:func:`default_jobs`); ``1`` (default) draws in this process. The PNGs are the
            same bytes either way; where ``fork`` is unavailable the figures are drawn serially.

    Never raises for a missing matplotlib or a figure that fails to render; raises
    ``FileNotFoundError`` only when ``results_dir`` has no ``leaderboard.json``.
    """
    log = log or _stderr
    d = Path(results_dir)
    out = Path(out_dir) if out_dir is not None else d
    if not (d / "leaderboard.json").exists():
        raise FileNotFoundError(f"{d / 'leaderboard.json'} not found; point at a folder written by a kvqbench run")
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except Exception as e:  # ImportError, or a broken install
        log(f"kvqbench: figures skipped — matplotlib unavailable ({type(e).__name__}); pip install 'kvqbench[plots]'")
        return []
    board, exps = _load_dir(d)
    assert board is not None
    catalog = board.get("metrics_catalog") or {}
    out.mkdir(parents=True, exist_ok=True)
    rc = {"font.size": 9, "axes.titlesize": 10, "figure.dpi": DPI, "savefig.dpi": DPI, "path.simplify": False,
          "svg.hashsalt": "kvqbench", "axes.spines.top": False, "axes.spines.right": False}
    jobs_list: list[tuple[str, Callable[..., Path | None], tuple]] = []
    for src, sd in sorted((board.get("sources") or {}).items()):
        extra_methods = {m for exp in (sd.get("stats") or {}).values() for m in exp}
        style = _Style(_method_order(board, extra_methods))
        jobs_list += [
            (f"pareto_{src}.png", _fig_pareto, (plt, src, sd, style, out)),
            (f"mse_vs_bits_{src}.png", _fig_mse_vs_bits, (plt, src, sd, style, out)),
            (f"attn_error_vs_context_{src}.png", _fig_vs_context,
             (plt, src, sd, exps.get(("exp2", src)), style, out, "err")),
            (f"attn_kl_vs_context_{src}.png", _fig_vs_context,
             (plt, src, sd, exps.get(("exp2", src)), style, out, "kl")),
            (f"norm_diff_density_{src}.png", _fig_norm_density, (plt, src, sd, exps.get(("exp3", src)), style, out)),
            (f"cost_{src}.png", _fig_cost, (plt, src, sd, catalog, style, out, exps.get(("exp4", src)))),
            (f"predictivity_{src}.png", _fig_predictivity, (plt, src, sd, style, out)),
        ]
    n_jobs = min(default_jobs() if jobs == 0 else max(1, jobs), len(jobs_list))
    with matplotlib.rc_context(rc):
        _JOBS[:] = jobs_list
        try:
            results = _run_parallel(n_jobs) if n_jobs > 1 else None
            if results is None:
                results = [_run_job(i) for i in range(len(jobs_list))]
        finally:
            _JOBS.clear()
    written: list[Path] = []
    for p, msg in results:
        if msg is not None:
            log(msg)
        if p is not None:
            written.append(p)
    return written
