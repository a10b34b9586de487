"""Inline SVG charts for the web page: points and lines per method on linear or log axes, each point
carrying its hover text. Torch-free, no plotting library: the page needs scatter and line charts only,
and SVG written here is a few kilobytes where a chart library is megabytes.

Every string that comes from a result file (method names, settings) is escaped here; the page's script
shows a point's ``data-tip`` as text on hover and on keyboard focus.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from markupsafe import Markup, escape

__all__ = ["Series", "chart", "legend", "marker_points"]

#: SVG ``stroke-dasharray`` of each matplotlib line style
DASHES = {"-": "", "--": "5 3", "-.": "6 2 1.5 2", ":": "1.5 2"}
#: plot area inside the SVG's view box (pixels): left, top, right and bottom margins
MARGIN = (64, 12, 12, 44)


@dataclass
class Series:
    """One method's points: ``points`` are ``(x, y, hover text)``; ``color`` a CSS colour, ``marker`` a
    matplotlib marker letter and ``linestyle`` a matplotlib line style (the PNGs' for the method), ``hollow``
    draws the markers as outlines; ``line`` joins the points in x order."""

    name: str
    color: str
    marker: str
    points: list[tuple[float, float, str]] = field(default_factory=list)
    line: bool = True
    linestyle: str = "-"
    hollow: bool = False


def _polygon(n: int, r: float, rot: float, sx: float = 1.0) -> list[tuple[float, float]]:
    return [(sx * r * math.sin(rot + 2 * math.pi * i / n), -r * math.cos(rot + 2 * math.pi * i / n)) for i in range(n)]


def marker_points(marker: str, r: float = 4.5) -> list[tuple[float, float]] | None:
    """The outline of a matplotlib marker as polygon vertices around (0, 0), y down; ``None`` for a
    circle (``"o"`` and any marker not known here)."""
    if marker in ("s",):
        return _polygon(4, r * 1.2, math.pi / 4)
    if marker in ("D", "d"):
        return _polygon(4, r * 1.2, 0.0, 0.65 if marker == "d" else 1.0)
    if marker in ("^", ">", "v", "<"):
        return _polygon(3, r * 1.25, math.pi / 2 * "^>v<".index(marker))
    if marker in ("h", "p", "8"):
        return _polygon({"h": 6, "p": 5, "8": 8}[marker], r * 1.1, 0.0)
    if marker == "*":
        outer, inner = _polygon(5, r * 1.4, 0.0), _polygon(5, r * 0.6, math.pi / 5)
        return [p for pair in zip(outer, inner) for p in pair]
    if marker in ("P", "X"):
        a, b = r * 1.2, r * 0.4
        plus = [(-b, -a), (b, -a), (b, -b), (a, -b), (a, b), (b, b), (b, a), (-b, a), (-b, b), (-a, b), (-a, -b), (-b, -b)]
        if marker == "P":
            return plus
        c = math.cos(math.pi / 4)
        return [((x - y) * c, (x + y) * c) for x, y in plus]
    return None


def _scale(lo: float, hi: float, log: bool) -> tuple[float, float]:
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    pad = 0.04 * (hi - lo)
    return lo - pad, hi + pad


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    """Tick values (data units) inside the padded axis range ``[lo, hi]`` (log10 units when ``log``)."""
    if log:
        decades = list(range(math.ceil(lo), math.floor(hi) + 1))
        if len(decades) >= 2:
            step = max(1, math.ceil(len(decades) / 7))
            return [10.0 ** d for d in decades[::step]]
        return [m * 10.0 ** d for d in range(math.floor(lo), math.ceil(hi) + 1) for m in (1, 2, 5)
                if lo <= math.log10(m * 10.0 ** d) <= hi]
    raw = (hi - lo) / 6
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _tick_text(v: float) -> str:
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 1e4:
        return f"{v:.3g}"
    return f"{v:.0e}".replace("e-0", "e-").replace("e+0", "e")


def chart(series: list[Series], *, xlabel: str, ylabel: str, label: str, xlog: bool = False, ylog: bool = False,
          width: int = 640, height: int = 340) -> Markup:
    """An accessible SVG chart (``role="img"``, ``aria-label`` = ``label``) of ``series``.

    Points with a non-finite coordinate, or a non-positive one on a log axis, are left out (the caption
    says which values cannot show). Returns an empty string when no point remains.
    """
    shown = [replace(s, points=[(x, y, t) for x, y, t in s.points if math.isfinite(x) and math.isfinite(y)
                                and (x > 0 or not xlog) and (y > 0 or not ylog)]) for s in series]
    shown = [s for s in shown if s.points]
    if not shown:
        return Markup("")
    xs = [p[0] for s in shown for p in s.points]
    ys = [p[1] for s in shown for p in s.points]
    x0, x1 = _scale(min(xs), max(xs), xlog)
    y0, y1 = _scale(min(ys), max(ys), ylog)
    left, top, right, bottom = MARGIN
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + pw * ((math.log10(x) if xlog else x) - x0) / (x1 - x0)

    def py(y: float) -> float:
        return top + ph * (1 - ((math.log10(y) if ylog else y) - y0) / (y1 - y0))

    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-label="{escape(label)}">',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="plot"/>']
    for v in _ticks(x0, x1, xlog):
        x = px(v)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + ph}" class="grid"/>'
                   f'<text x="{x:.1f}" y="{top + ph + 14}" class="tick" text-anchor="middle">{_tick_text(v)}</text>')
    for v in _ticks(y0, y1, ylog):
        y = py(v)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{left - 4}" y="{y + 3:.1f}" class="tick" text-anchor="end">{_tick_text(v)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 6}" class="axis" text-anchor="middle">{escape(xlabel)}</text>'
               f'<text transform="translate(13 {top + ph / 2}) rotate(-90)" class="axis" text-anchor="middle">'
               f'{escape(ylabel)}</text>')
    for s in shown:
        if s.line and len(s.points) > 1:
            pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y, _ in sorted(s.points))
            dash = f' stroke-dasharray="{DASHES[s.linestyle]}"' if DASHES.get(s.linestyle) else ""
            out.append(f'<polyline points="{pts}" fill="none" stroke="{escape(s.color)}" stroke-width="1.4"{dash}/>')
    for s in shown:
        for x, y, tip in s.points:
            attrs = f' class="pt" tabindex="0" data-tip="{escape(tip)}" aria-label="{escape(tip)}"/>'
            out.append(_shape(s, px(x), py(y))[:-2] + attrs)
    out.append("</svg>")
    return Markup("".join(out)) + legend(shown)


def _shape(s: Series, cx: float, cy: float, r: float = 4.5) -> str:
    shape = marker_points(s.marker, r)
    paint = (f'fill="#fff" stroke="{escape(s.color)}" stroke-width="1.5"' if s.hollow
             else f'fill="{escape(s.color)}"')
    if shape is None:
        return f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{r}" {paint}/>'
    pts = " ".join(f"{cx + dx:.1f},{cy + dy:.1f}" for dx, dy in shape)
    return f'<polygon points="{pts}" {paint}/>'


def legend(series: list[Series]) -> Markup:
    """The methods of a chart with their colour and marker, as an HTML list (wraps on a narrow screen)."""
    items = "".join(f'<li><svg width="14" height="14" aria-hidden="true">{_shape(s, 7, 7)}</svg>{escape(s.name)}</li>'
                    for s in series)
    return Markup(f'<ul class="legend">{items}</ul>')
