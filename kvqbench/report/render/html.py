"""The leaderboard as one self-contained web page, ``index.html``, beside ``LEADERBOARD.md``. Torch-free.

The page is a pure function of the assembled board (the content of ``leaderboard.json``) and the PNG
figures in the same folder: the same result set gives the same bytes whether a run, ``kvqbench report``
(with or without ``--rebuild``) or ``kvqbench publish`` writes it. It works from ``file://`` and from
any web server with no network: the data is embedded as JSON, the script and styles are inline, the
charts are inline SVG and the other figures are embedded PNGs. Nothing is fetched.

Every string that comes from a result file (method names, deltas, commands, paths, model ids) is data:
the Jinja2 template escapes it, the script only ever sets ``textContent``, and the embedded JSON has
``<``, ``>``, ``&`` and U+2028/U+2029 written as ``\\u`` escapes so it cannot end its ``<script>`` element.

What the page shows, and why it is built this way: docs/DESIGN.md, "The web page".
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable

from markupsafe import Markup, escape

from kvqbench.cells import Setting, is_plain_setting, setting_order, source_kind
from kvqbench.metrics import experiment_of
from kvqbench.report.io import write_text_atomic
from kvqbench.report.render.figures.style import Style, method_order
from kvqbench.report.render.headline import headline_lines
from kvqbench.report.render.svg import Series, chart
from kvqbench.report.render.text import canonical, completeness_banner, fmt, standing_text, value_text

__all__ = ["render_html", "write_html", "page_data", "embed_json", "PAGE", "METRIC_COLUMNS"]

#: the page's file name, beside LEADERBOARD.md
PAGE = "index.html"
#: the metric table's columns (one row per source × experiment × method × setting × metric)
METRIC_COLUMNS = ("source", "experiment", "method", "fidelity", "bits", "metric", "value (mean ± 95% CI)", "n", "rank")
#: PNG figures that the page draws itself as interactive charts (from the board), so their PNG is not embedded
DRAWN = ("pareto", "kl_vs_position", "kl_models")
#: what each PNG figure shows, by file-name stem (a figure not listed here is captioned by its file name)
CAPTIONS = {
    "mse_vs_bits": "Relative MSE of K and V against the bit width (experiment 1), one line per method.",
    "attn_error_vs_context": "Attention output error against the context length (experiment 2), static and "
                             "pseudo-decode.",
    "attn_kl_vs_context": "Attention KL(p‖p̂) against the context length (experiment 2), static and pseudo-decode.",
    "norm_diff_density": "Densities of the key-norm difference ‖k̂‖ − ‖k‖ per method (experiment 3).",
    "cost": "Quantize and dequantize latency and the bits per element billed (experiment 4).",
    "predictivity": "The tensor metrics that best predict end-to-end KL, against it (experiment 5).",
}
#: palette size of the embedded PNGs (re-encoded with Pillow when it is installed; else embedded as they are)
PNG_COLOURS = 128

Log = Callable[[str], None]


def embed_json(obj: Any) -> str:
    """``obj`` as JSON that is safe inside a ``<script>`` element: ``<``, ``>``, ``&``, U+2028 and U+2029 are
    written as ``\\u`` escapes (still valid JSON, parsed back to the same strings)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for ch in ("<", ">", "&", "\u2028", "\u2029"):
        text = text.replace(ch, f"\\u{ord(ch):04x}")
    return text


def _short(x: float | None) -> float | None:
    """A sort key: ``x`` to 6 significant digits (the page shows 4), ``None`` when missing or not finite."""
    if x is None or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(f"{x:.6g}")


def _metric_table(board: dict[str, Any], methods: list[str]) -> dict[str, Any]:
    """Every per-setting statistic of every source as compact rows ``[source, experiment, method, setting,
    metric, mean, text, n, rank]`` (the first five as indices into the lists returned beside them)."""
    names: dict[str, dict[str, int]] = {"sources": {}, "experiments": {}, "settings": {}, "metrics": {}}

    def index(kind: str, name: str) -> int:
        return names[kind].setdefault(name, len(names[kind]))

    rows = []
    for src_name, src in board["sources"].items():
        ranks = {(metric, s, x["method"]): x.get("rank") for metric, r in src["rankings"].items()
                 for s, xs in r["by_setting"].items() for x in xs}
        for exp in sorted(src["stats"]):
            by_method = src["stats"][exp]
            for m in [m for m in methods if m in by_method]:
                for s in sorted(by_method[m], key=setting_order):
                    for metric in sorted(by_method[m][s]):
                        e = by_method[m][s][metric]
                        rows.append([index("sources", src_name), index("experiments", exp), methods.index(m),
                                     index("settings", s), index("metrics", metric), _short(e.get("mean")),
                                     value_text(e) if "mean" in e else "—", e.get("n"), ranks.get((metric, s, m))])
    lists = {k: list(v) for k, v in names.items()}
    order = sorted(range(len(lists["settings"])), key=lambda i: setting_order(lists["settings"][i]))
    return {**lists, "setting_order": order, "rows": rows}


def _headlines(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Per source: the first screen (:func:`kvqbench.report.render.headline.headline_lines`, the same rows as
    LEADERBOARD.md) and, where the board has them, the paired comparisons of each budget row."""
    out = []
    for src_name, src in board["sources"].items():
        sentence, rows, headers = headline_lines(board, src_name, src)
        paired = []
        for b in src.get("headline") or []:
            comps = [{"method": c.get("method"), "setting": c.get("setting"), "bits": fmt(c.get("bits")),
                      "value": fmt(c.get("value"), c.get("ci95")), "tied": bool(c.get("tied")),
                      "ratio": (f"{c['ratio']:.3g}×" + (f" [{c['ratio_ci95'][0]:.3g}, {c['ratio_ci95'][1]:.3g}]"
                                                       if c.get("ratio_ci95") else "")) if c.get("ratio") else "—",
                      "p_holm": fmt(c.get("p_holm")),
                      "rank": (f"{c['rank_interval'][0]}–{c['rank_interval'][1]}" if c.get("rank_interval") else "—")}
                     for c in b.get("comparisons") or []]
            paired.append({"budget": b.get("budget"), "best": standing_text(b), "unit": b.get("unit"),
                           "n_units": b.get("n_units"), "comparisons": comps})
        model = (src.get("data") or {}).get("model") if source_kind(src_name) == "real" else None
        out.append({"name": src_name, "model": model, "sentence": sentence, "headers": headers, "rows": rows,
                    "paired": paired if any(p["best"] or p["comparisons"] for p in paired) else [],
                    "cells": src.get("cells") or {}, "seeds": src.get("seeds"), "sizes": src.get("sizes") or []})
    return out


def _charts(board: dict[str, Any], style: Style) -> dict[str, list[dict[str, Any]]]:
    """Interactive charts drawn from the board, per source (key ``""``: across sources): ``{"title",
    "caption", "svg"}``."""
    out: dict[str, list[dict[str, Any]]] = {}

    def series(m: str, pts: list[tuple[float, float, str]], line: bool = True) -> Series:
        st = style(m)
        return Series(m, st["color"], st["marker"], pts, line, st["linestyle"], st["facecolor"] != st["color"])

    for src_name, src in board["sources"].items():
        figs = out.setdefault(src_name, [])
        pts = (src.get("pareto") or {}).get("points") or []
        if pts:
            by: dict[str, list] = {}
            for p in pts:
                by.setdefault(p["method"], []).append(
                    (p["bits_effective"], p["rel_mse"], f"{p['method']} {p['setting']}: {fmt(p['bits_effective'])} "
                     f"bits/elt, rel. MSE {fmt(p['rel_mse'], p.get('ci95'))}" + (" (on the front)" if p.get("on_front") else "")))
            figs.append({"title": "Pareto front: relative MSE against effective bits",
                         "caption": "Each point a method at one setting (experiment 1, mean over seeds); lower "
                                    "left is better. Settings with relative MSE 0 (16 bits) cannot show on the log axis.",
                         "svg": chart([series(m, by[m]) for m in style.in_order(by)], xlabel="effective bits per element",
                                      ylabel="relative MSE (K,V mean)", ylog=True, label=f"Pareto front, {src_name}")})
        e2e = src["stats"].get(experiment_of("e2e_prefill_kl_nats")) or {}
        if e2e:
            by = {}
            for m in style.in_order(e2e):
                for s, mets in e2e[m].items():
                    kl, bits = mets.get("e2e_prefill_kl_nats"), mets.get("e2e_prefill_bits_billed")
                    if is_plain_setting(s) and kl and bits and kl.get("mean") is not None:
                        by.setdefault(m, []).append((bits["mean"], kl["mean"], f"{m} {s}: {fmt(bits['mean'])} bits "
                                                     f"billed, end-to-end KL {fmt(kl['mean'], kl.get('ci95'))} nats"))
            if by:
                figs.append({"title": "Damage against bits: end-to-end KL against the bits billed",
                             "caption": "Next-token KL(p‖p̂) of the quantized model against the unquantized one "
                                        "(prefill, experiment 5, mean over text windows) at the bits per element the "
                                        "same cells billed. KL exactly 0 cannot show on the log axis.",
                             "svg": chart([series(m, by[m]) for m in by], xlabel="bits billed per element",
                                          ylabel="end-to-end KL, nats", ylog=True, label=f"KL against bits, {src_name}")})
        curves = (src.get("long_decode") or {}).get("kl_curve") or {}
        settings = sorted({s for c in curves.values() for s in c
                           if is_plain_setting(s) and Setting.parse(s).k_bits < 16}, key=setting_order)
        for s in settings:
            lines = []
            for m in style.in_order(curves):
                c = curves[m].get(s)
                if c:
                    lines.append(series(m, [((a + b - 1) / 2, y, f"{m} {s}: tokens {a}–{b}, KL {fmt(y, ci)} nats")
                                            for a, b, y, ci in zip(c["start"], c["stop"], c["mean"], c["ci95"])]))
            figs.append({"title": f"KL against the decoded position, {s}",
                         "caption": "Long decode (experiment 6): next-token KL(p‖p̂) per bin of decoded positions, "
                                    "mean over texts. A bin exactly 0 (the fp16 control) cannot show on the log axis.",
                         "svg": chart(lines, xlabel="decoded position (tokens; bin centre)", ylabel="KL, nats",
                                      ylog=True, label=f"KL against position, {src_name} {s}")})
    rt = (board.get("models") or {}).get("rank_table") or {}
    if rt.get("rows") and len(rt.get("models") or []) == 2:
        a, b = rt["models"]
        by = {}
        for r in rt["rows"]:
            for s in rt.get("settings") or []:
                pa, pb = (r.get(a) or {}).get(s), (r.get(b) or {}).get(s)
                if pa and pb and pa.get("kl") is not None and pb.get("kl") is not None:
                    by.setdefault(r["method"], []).append((pa["kl"], pb["kl"], f"{r['method']} {s}: {a} KL "
                                                           f"{fmt(pa['kl'])}, {b} KL {fmt(pb['kl'])} nats"))
        if by:
            out.setdefault("", []).append({
                "title": f"Model against model: end-to-end KL on {a} and {b}",
                "caption": f"One point per method and setting ({rt.get('target')}); a method on the diagonal is "
                           "damaged alike on both models.",
                "svg": chart([series(m, by[m], line=False) for m in style.in_order(by)], xlabel=f"{a}: KL, nats",
                             ylabel=f"{b}: KL, nats", xlog=True, ylog=True, label=f"{a} against {b}")})
    return out


def _png(path: Path) -> str:
    """``path`` as a ``data:`` URI, re-encoded as a palette PNG when Pillow is installed and that is smaller."""
    data = path.read_bytes()
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as im:
            buf = io.BytesIO()
            im.convert("RGB").quantize(colors=PNG_COLOURS).save(buf, "PNG", optimize=True)
        data = min(data, buf.getvalue(), key=len)
    except ImportError:
        pass
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _pngs(board: dict[str, Any], folder: Path) -> dict[str, list[dict[str, str]]]:
    """The folder's PNG figures that the page does not draw itself, per source (``""``: across sources)."""
    out: dict[str, list[dict[str, str]]] = {}
    sources = sorted(board["sources"], key=len, reverse=True)  # "real-gemma3-270m" before "real"
    for p in sorted(folder.glob("*.png")) if folder.is_dir() else []:
        src = next((s for s in sources if p.stem.endswith("_" + s)), "")
        stem = p.stem[:-len(src) - 1] if src else p.stem
        if stem in DRAWN:
            continue
        out.setdefault(src, []).append({"title": p.name, "caption": CAPTIONS.get(stem, p.name), "src": _png(p),
                                        "file": p.name})
    return out


def _provenance(board: dict[str, Any]) -> list[tuple[str, str]]:
    prov = board.get("provenance") or {}
    comp = board.get("completeness") or {}
    tf = sorted({str((s.get("data") or {}).get("transformers_version")) for s in board["sources"].values()
                 if (s.get("data") or {}).get("transformers_version")})
    items = [("kvqbench", prov.get("kvqbench_version")), ("commit", prov.get("git_commit") or "unknown"),
             ("started", prov.get("start_time")), ("CPU / device", prov.get("device_name") or prov.get("device")),
             ("threads", prov.get("threads")), ("python", prov.get("python_version")),
             ("torch", prov.get("torch_version")), ("transformers", ", ".join(tf) or None),
             ("seeds", prov.get("seeds")), ("bits", prov.get("bits")),
             ("sizes", "; ".join(f"{n}: {', '.join(s.get('sizes') or [])}" for n, s in board["sources"].items())),
             ("completeness", comp.get("summary")), ("command", prov.get("command"))]
    items += [(f"run {i + 1}", f"{r.get('model', '')} · {r.get('start_time', '')} · commit {r.get('git_commit', '')} · "
               f"{r.get('command', '')}") for i, r in enumerate(prov.get("runs") or [])]
    return [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in items if v not in (None, "", [])]


def page_data(board: dict[str, Any], folder: str | Path | None = None) -> dict[str, Any]:
    """Everything the template shows, from ``board`` (any in-memory or saved leaderboard document) and the
    PNG figures in ``folder`` (none when ``None``): ``title``, ``banner``, ``headlines``, ``charts``,
    ``pngs``, ``methods``, ``provenance``, ``quality`` and ``table`` (the embedded JSON of the metric table)."""
    board = canonical(board)
    extra = {m for s in board["sources"].values() for by in s["stats"].values() for m in by}
    order = method_order(board, extra)
    style = Style(order)
    meta = board.get("methods") or {}
    catalog = board.get("metrics_catalog") or {}
    table = _metric_table(board, order)
    table.update(methods=order, fidelity=[meta.get(m, {}).get("fidelity") or "—" for m in order],
                 colors=[style(m)["color"] for m in order],
                 catalog={m: {k: catalog[m].get(k) for k in ("unit", "better", "description")}
                          for m in table["metrics"] if m in catalog}, columns=list(METRIC_COLUMNS))
    methods = []
    for m in order:
        i = meta.get(m, {})
        fields = [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in sorted(i.items())
                  if k not in ("id", "name", "paper", "arxiv", "fidelity", "deltas")]
        methods.append({"id": m, "name": i.get("name", ""), "paper": i.get("paper") or "", "arxiv": i.get("arxiv") or "",
                        "fidelity": i.get("fidelity") or "—", "deltas": [str(d) for d in i.get("deltas") or []],
                        "fields": fields, "color": style(m)["color"], "listed": m in meta})
    quality = [{"source": n, "name": d.get("name"), "status": {True: "ok", False: "FLAGGED", None: "n/a"}.get(d.get("ok")),
                "detail": d.get("detail", "")} for n, s in board["sources"].items() for d in s.get("data_quality") or []]
    return {"title": "kvqbench leaderboard", "banner": completeness_banner(board), "headlines": _headlines(board),
            "charts": _charts(board, style), "pngs": _pngs(board, Path(folder)) if folder is not None else {},
            "sources": list(board["sources"]), "methods": methods, "provenance": _provenance(board),
            "quality": quality, "table": embed_json(table), "n_rows": len(table["rows"])}


def render_html(board: dict[str, Any], folder: str | Path | None = None) -> str:
    """The page (see the module docstring) as text; ``folder`` holds the PNG figures to embed."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("kvqbench.report.render", "templates"),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["ticks"] = _ticks
    return env.get_template("index.html.j2").render(**page_data(board, folder))


def _ticks(text: str) -> Any:
    """Escape ``text`` and show its ```code``` spans as ``<code>``."""
    return Markup(re.sub(r"`([^`]*)`", r"<code>\1</code>", str(escape(text))))


def write_html(board: dict[str, Any], folder: str | Path, *, log: Log | None = None) -> Path | None:
    """Write ``folder/index.html`` for ``board`` (PNG figures taken from ``folder``); the written path.

    Never raises for a rendering problem: the page is a view of the results, so a failure is one line on
    ``log`` (default stderr) and returns ``None``; the result files stay as written.
    """
    try:
        return write_text_atomic(Path(folder) / PAGE, render_html(board, folder))
    except Exception as e:  # the page never costs the results
        (log or (lambda msg: print(msg, file=sys.stderr)))(f"kvqbench: {PAGE} skipped: {type(e).__name__}: {e}")
        return None
