"""Render a leaderboard document as Markdown and as a short terminal table (tabulate). Torch-free.

Rendering is a pure function of the document's *content*: the document is first put in its saved
form (:func:`canonical`: strict JSON with sorted keys), so the Markdown a run writes from the in-memory
board and the one ``kvqbench report DIR`` writes from the saved ``leaderboard.json`` are byte-identical.
"""

from __future__ import annotations

import json
from typing import Any

from tabulate import tabulate

from kvqbench.cells import is_exact_setting, is_plain_setting, setting_order, source_kind
from kvqbench.report.io import to_jsonable
from kvqbench.report.longdecode import markdown_lines as longdecode_lines

__all__ = ["render_markdown", "render_terminal", "fmt", "canonical", "completeness_banner", "headline_lines",
           "headline_screen"]

CELL_STATES = ("passed", "failed", "skipped")


def canonical(board: dict[str, Any]) -> dict[str, Any]:
    """``board`` as it reads back from ``leaderboard.json`` (sorted keys, strict JSON values)."""
    return json.loads(json.dumps(to_jsonable(board), sort_keys=True, allow_nan=False))


def _cells_text(cells: dict[str, Any]) -> str:
    """``passed 10, failed 1, skipped 0`` (+ any other states)."""
    keys = [k for k in CELL_STATES if k in cells] + sorted(k for k in cells if k not in CELL_STATES)
    return ", ".join(f"{k} {cells[k]}" for k in keys)

HEADLINE_BITS_ORDER = ("k2v2", "k3v3", "k4v4", "k8v8", "k16v16")


def fmt(x: Any, ci: Any = None, digits: int = 4) -> str:
    """``1.234e-03 ± 5.6e-05`` style; ``—`` for missing."""
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if x == 0:
        s = "0"
    elif 1e-3 <= abs(x) < 1e4:
        s = f"{x:.{digits}g}"
    else:
        s = f"{x:.{digits - 1}e}"
    if ci:
        s += f" ± {ci:.2g}"
    return s


def _settings(stats_exp1: dict[str, Any]) -> list[str]:
    found = {s for by in stats_exp1.values() for s in by if is_plain_setting(s)}
    return sorted(found, key=setting_order)


def _method_order(src: dict[str, Any], board: dict[str, Any]) -> list[str]:
    order = list(board.get("methods", {}))
    for by in src["stats"].values():
        for m in by:
            if m not in order:
                order.append(m)
    return order


def missing_text(src: dict[str, Any], exp: str, method: str, setting: str) -> str:
    """Why a (method, setting) of ``exp`` has no value: ``failed``, ``skipped`` or ``not run`` (from the
    source's ``setting_cells``); ``—`` when the cells ran but gave no finite value of the metric."""
    c = (src.get("setting_cells") or {}).get(exp, {}).get(method, {}).get(setting)
    if not c:
        return "not run"
    if c.get("failed") and not c.get("passed"):
        return "failed"
    if c.get("skipped") and not c.get("passed"):
        return "skipped"
    return "—"


def value_text(e: dict[str, Any]) -> str:
    """``mean ± ci``, with ``(n=2/3)`` when the entry has fewer seeds than asked."""
    text = fmt(e["mean"], e["ci95"])
    if e.get("n", 0) < e.get("n_asked", 0):
        text += f" (n={e['n']}/{e['n_asked']})"
    return text


def _headline_matrix(src: dict[str, Any], board: dict[str, Any], metric: str) -> str:
    exp1 = src["stats"].get("exp1", {})
    asked = (src.get("setting_cells") or {}).get("exp1", {})
    found = {s for by in asked.values() for s in by if is_plain_setting(s)}
    settings = sorted(set(_settings(exp1)) | found, key=setting_order)
    rows = []
    for m in _method_order(src, board) + [m for m in asked if m not in _method_order(src, board)]:
        if m not in exp1 and m not in asked:
            continue
        fid = board["methods"].get(m, {}).get("fidelity", "")
        row = [f"`{m}`", fid]
        for s in settings:
            e = exp1.get(m, {}).get(s, {}).get(metric)
            row.append(value_text(e) if e else missing_text(src, "exp1", m, s))
        rows.append(row)
    return tabulate(rows, headers=["method", "fidelity", *settings], tablefmt="github")


def _ranking_tables(src: dict[str, Any], settings: list[str]) -> list[str]:
    out = []
    rk = src["rankings"]
    cols = [("rel_mse", "rel. MSE (K,V mean)"), ("k_rel_mse", "K rel. MSE"), ("v_rel_mse", "V rel. MSE"),
            ("bits_nominal", "bits nominal"), ("bits_effective", "bits effective")]
    for s in settings:
        if "rel_mse" not in rk or s not in rk["rel_mse"]["by_setting"]:
            continue
        ranked = rk["rel_mse"]["by_setting"][s]
        rows = []
        for r in ranked:
            row = [r["rank"] if r["rank"] is not None else "—", f"`{r['method']}`"]
            for name, _ in cols:
                e = next((x for x in rk.get(name, {}).get("by_setting", {}).get(s, []) if x["method"] == r["method"]), None)
                row.append(value_text(e) if e else "—")
            row.append(f"not ranked: n={r['n']} of {r['n_asked']} seeds" if r.get("short")
                       else ", ".join(r["ties"]) if r["ties"] else "")
            rows.append(row)
        out.append(f"#### {s}\n\n" + tabulate(rows, headers=["rank", "method", *[c for _, c in cols], "tied with (95% CI)"],
                                              tablefmt="github"))
    return out


def _all_metrics_table(src: dict[str, Any], setting: str) -> str:
    rows = []
    for name, r in sorted(src["rankings"].items(), key=lambda kv: (kv[1]["experiment"], kv[0])):
        ranked = r["by_setting"].get(setting)
        if not ranked:
            continue
        order = " > ".join(f"{x['method']}" + ("=" if x["ties"] else "") for x in ranked if not x.get("short"))
        short = [f"{x['method']} (n={x['n']}/{x['n_asked']})" for x in ranked if x.get("short")]
        if short:
            order += "; not ranked: " + ", ".join(short)
        rows.append([r["experiment"], f"`{name}`", r["unit"], r["better"], order])
    if not rows:
        return ""
    return tabulate(rows, headers=["exp", "metric", "unit", "better", f"ranking at {setting} (best first; = tie)"],
                    tablefmt="github")


def models_lines(board: dict[str, Any]) -> list[str]:
    """The two-model section (``board["models"]``, :func:`kvqbench.report.leaderboard.compare_models`):
    end-to-end ranks on both models and whether the headline metric's choice transfers."""
    from kvqbench.report.models import render_rank_table, render_transfer

    mo = board.get("models")
    if not mo:
        return []
    a, b = mo["sources"]
    return [f"## Two models: {a} and {b}", "",
            "Does a method's end-to-end rank carry over from one model to the other, and does the tensor metric "
            "chosen on one predict the other's damage? (figure `kl_models.png`: KL on one model against the "
            "other, one point per method × bits)", "",
            render_rank_table(mo["rank_table"]), "", render_transfer(mo["transfer"]), ""]


def render_markdown(board: dict[str, Any]) -> str:
    """The full ``LEADERBOARD.md``."""
    board = canonical(board)
    prov = board.get("provenance", {})
    lines = ["# kvqbench leaderboard", ""]
    banner = completeness_banner(board)
    if banner:
        lines += [banner, ""]
    for src_name, src in board.get("sources", {}).items():
        lines += headline_screen(board, src_name, src)
    lines += models_lines(board)
    lines += ["# Details", "", "Lower is better unless a metric says otherwise; `± x` is the 95% Student-t half-width "
              "over seeds. Real and synthetic results are kept apart, and so are the real results of each model (one "
              "section per data source: `real` is SmolLM2's, `real-<model>` another model's). A rank is 1 + the methods whose 95% CI is "
              "wholly better (never lower than the rank above it).", ""]
    for src_name, src in board.get("sources", {}).items():
        data = src.get("data") or {}
        lines += [f"## {src_name}", ""]
        desc = data.get("description") or ", ".join(f"{k}={v}" for k, v in sorted(data.items())
                                                   if isinstance(v, (int, float, str)) and k != "description")
        lines += [f"Data: {desc}", "", f"Sizes: {', '.join(src.get('sizes', []))} · seeds: {src.get('seeds')} · cells: "
                  + _cells_text(src["cells"]), ""]
        lines += _endtoend_tables(src, board)
        lines += longdecode_lines(src, board)
        exp1 = src["stats"].get("exp1", {})
        if exp1:
            lines += ["### Relative MSE (mean of K and V) by bit-width", "", _headline_matrix(src, board, "rel_mse"), ""]
            lines += ["### Effective bits per element (K and V mean)", "", _headline_matrix(src, board, "bits_effective"), ""]
            settings = _settings(exp1)
            lines += ["### Rankings at each bit-width by relative MSE (exp1)", ""]
            for t in _ranking_tables(src, settings):
                lines += [t, ""]
            pf = src.get("pareto", {})
            front = [p for p in pf.get("front") or [] if not is_exact_setting(p["setting"])]
            if front:
                lines += ["### Pareto front (effective bits vs relative MSE)", ""]
                lines += [tabulate([[f"`{p['method']}`", p["setting"], fmt(p["bits_effective"]), fmt(p["rel_mse"])]
                                    for p in front], headers=["method", "bits", "bits effective", "rel. MSE"],
                                   tablefmt="github"), ""]
                if len(front) < len(pf.get("front") or []):
                    lines += ["16-bit settings are exact (relative MSE 0 for every method) and are left out of "
                              "this table.", ""]
            mb = src.get("matched_budget") or []
            if mb:
                lines += ["### Best method at a matched budget by relative MSE alone (exp1 reconstruction; the first "
                          "screen ranks by end-to-end KL where it was measured)", ""]
                lines += [tabulate([[f"≤ {b['budget']}", _tied(b), b["setting"] or "—",
                                     fmt(b["bits_effective"]), fmt(b["rel_mse"])] for b in mb],
                                   headers=["budget", "best (= tied within 95% CI)", "bits", "bits effective", "rel. MSE"],
                                   tablefmt="github"), ""]
            dk = (src.get("pareto_decode_kl") or {}).get("matched_budget") or []
            if any(b["method"] for b in dk):
                lines += ["### Best method at a matched budget by pseudo-decode attention KL alone (exp2 decoding; "
                          "bits billed, fp16 windows at 16)", ""]
                lines += [tabulate([[f"≤ {b['budget']}", _tied(b), b["setting"] or "—",
                                     fmt(b["bits"]), fmt(b["quality"])] for b in dk],
                                   headers=["budget", "best (= tied within 95% CI)", "bits", "bits billed", "KL(p‖p̂) nats"],
                                   tablefmt="github"), ""]
            low = settings[0] if settings else None
            if low:
                t = _all_metrics_table(src, low)
                if t:
                    lines += [f"### Every ranked metric at {low}", "", t, ""]
        dq = src.get("data_quality") or []
        if dq:
            lines += ["### Data-quality flags (sanity checks on the measurement, not verdicts on methods)", ""]
            lines += [tabulate([[d["name"], {True: "ok", False: "FLAGGED", None: "n/a"}[d["ok"]], d["detail"],
                                 _listed(d["offenders"]) + ("; " if d["offenders"] and d.get("noted") else "")
                                 + (f"noted, not flagged: {_listed(d['noted'])}" if d.get("noted") else "")]
                                for d in dq], headers=["flag", "status", "check", "offenders"], tablefmt="github"), ""]
        if src.get("failures"):
            lines += ["### Failed cells", ""]
            lines += [f"- `{f['nodeid']}`: {f['error'].splitlines()[0] if f['error'] else ''}" for f in src["failures"]]
            lines += [""]
    if board.get("methods"):
        lines += ["## Methods", ""]
        rows = [[f"`{m}`", i.get("name", ""), i.get("arxiv") or "—", i.get("fidelity", ""),
                 len(i.get("deltas", []))] for m, i in board["methods"].items()]
        lines += [tabulate(rows, headers=["id", "method", "arXiv", "fidelity", "deltas"], tablefmt="github"), "",
                  "Every delta is listed in `docs/PAPERS.md` and in `leaderboard.json` under `methods`.", ""]
    lines += ["## Provenance", "",
              f"kvqbench {prov.get('kvqbench_version', '?')} · commit `{prov.get('git_commit') or 'unknown'}` · "
              f"torch {prov.get('torch_version', '?')} · device {prov.get('device_name', '?')} · "
              f"seeds {prov.get('seeds', '?')} · started {prov.get('start_time', '?')}", ""]
    if prov.get("command"):
        lines += [f"Command: `{prov['command']}`", ""]
    return "\n".join(lines).rstrip() + "\n"


def _rho_text(rho: Any, ci: Any) -> str:
    if rho is None:
        return "—"
    return f"{rho:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "")


def no_predictivity_reason(board: dict[str, Any]) -> str:
    """Why no tensor metric was picked by predictivity (the headline is relative MSE), as a clause: no
    end-to-end run at all; an end-to-end run over too few methods with a non-zero KL (a ``-k kvarn`` run:
    fp16 and 16-bit settings are exact, and ρ needs :data:`~kvqbench.report.leaderboard.PREDICTIVITY_MIN_METHODS`);
    or no tensor metric of experiments 1–3 beside it for the same methods and settings."""
    from kvqbench.report.leaderboard import PREDICTIVITY_MIN_METHODS, PREDICTIVITY_TARGETS

    target = PREDICTIVITY_TARGETS[0]
    damaged: list[str] = []  # the methods of the source with the most of them
    ran = False
    for src in (board.get("sources") or {}).values():
        e2e = (src.get("stats") or {}).get("exp5") or {}
        ran = ran or bool(e2e)
        ms = sorted(m for m, by in e2e.items()
                    if any(is_plain_setting(s) and (e.get(target) or {}).get("mean") not in (None, 0)
                           for s, e in by.items()))
        damaged = ms if len(ms) > len(damaged) else damaged
    if not ran:
        return "this result set has no end-to-end run"
    if len(damaged) < PREDICTIVITY_MIN_METHODS:
        n = len(damaged)
        return (f"the end-to-end run in this result set has {n} method{'' if n == 1 else 's'} with a non-zero KL"
                + (f" ({', '.join(damaged)})" if damaged else "")
                + f", and ranking tensor metrics against it takes at least {PREDICTIVITY_MIN_METHODS}")
    return "the end-to-end run in this result set has no tensor metric of experiments 1–3 beside it for the same methods and settings"


def _rule_lines(board: dict[str, Any]) -> str:
    """The headline-metric rule and how it came out on this board (:mod:`kvqbench.report.headline`)."""
    from kvqbench.report.headline import RULE_TEXT
    from kvqbench.report.leaderboard import PREDICTIVITY_BOOTSTRAP, PREDICTIVITY_SEED

    h = board.get("headline") or {}
    metric = h.get("metric", "rel_mse")
    default = h.get("default")
    if not h.get("from_predictivity"):
        return (f"Headline tensor metric `{metric}`: {no_predictivity_reason(board)}, so which tensor metric predicts "
                "model damage is unknown here (that takes the end-to-end experiment and the tensor experiments 1–3 on "
                "the same source for at least 4 methods; the main job, `kvqbench run`, has them).")
    where = "pooled over bit widths" if h.get("group") == "pooled" else f"at {h.get('group')}"
    model = ((board.get("sources", {}).get(h.get("source"), {}).get("data") or {}).get("model")) or "the real model"
    text = (f"Headline tensor metric `{metric}` ({h.get('experiment')}): Spearman ρ = {_rho_text(h.get('rho'), h.get('ci95'))} "
            f"(95% bootstrap CI over methods) against the end-to-end next-token KL of {model}, {where}.")
    if default is None:
        return text
    rule = RULE_TEXT.format(default=default, n_boot=h.get("n_boot") or PREDICTIVITY_BOOTSTRAP,
                            seed=h.get("seed", PREDICTIVITY_SEED) if h.get("seed") is not None else PREDICTIVITY_SEED)
    c = h.get("challenger")
    if not h.get("default_measured", True):
        outcome = "the default was not measured on this data, so the scale-free metric with the highest ρ stands in"
    elif c is None:
        outcome = "no other scale-free metric was measured beside it, so the default stays"
    else:
        diff = f"ρ(`{c['metric']}`) − ρ(`{default}`) = {_rho_text(c['diff'], c.get('diff_ci95'))}"
        outcome = (f"`{c['metric']}` replaces it ({diff})" if h.get("replaced_default")
                   else f"the default stays: its strongest challenger gives {diff}")
    return f"{text} Rule: {rule}; here {outcome}."


def headline_lines(board: dict[str, Any], src_name: str, src: dict[str, Any]) -> tuple[str, list[list[str]], list[str]]:
    """The headline of one source: the sentences naming the ranking criterion and the headline metric with
    its rule, the matched-budget rows and their headers. Shared by ``LEADERBOARD.md`` and the README
    digest. A source with an end-to-end run ranks on its KL (bits billed by the same cells), the headline
    tensor metric of the same setting beside it; one without ranks on the headline tensor metric. Methods
    whose 95% CI overlaps the best's are ties, written ``a = b``."""
    from kvqbench.report.leaderboard import PREDICTIVITY_TARGETS

    h = board.get("headline") or {}
    metric = h.get("metric", "rel_mse")
    target = h.get("target", PREDICTIVITY_TARGETS[0])
    rows_in = src.get("headline") or []
    e2e = any(str(b.get("criterion", "")).startswith("e2e_") for b in rows_in)
    long_only = any(b.get("criterion") == "long_kl_nats" for b in rows_in)
    if long_only:
        crit = ("Ranked on measured long-decode damage: next-token KL `long_kl_nats` over the decoded text (mean "
                "± 95% CI over texts) at the bits per element billed at T (no end-to-end or tensor experiment "
                "in this result set); here the ties' CIs are widened by each method's noise floor.")
    elif e2e:
        crit = (f"Ranked on measured end-to-end damage: next-token KL `{target}` (mean ± 95% CI over text windows) at "
                f"the bits per element the same cells billed; the headline tensor metric of the same setting beside it.")
    else:
        crit = (f"Ranked on the headline tensor metric `{metric}` (no end-to-end run on this data), at experiment 1's "
                "effective bits per element.")
    chosen_here = h.get("source") in (None, src_name) or h.get("source") not in (board.get("sources") or {})
    rule = _rule_lines(board) if chosen_here else (
        f"Headline tensor metric `{metric}` ({h.get('experiment')}), chosen on the {h.get('source')} data by the rule "
        "stated there.")
    sentence = f"{crit} Methods whose 95% CI overlaps the best's are ties (`a = b`), best mean first. {rule}"
    rows = []
    long = any("long_kl" in b for b in rows_in) and not long_only  # exp6 ran: its KL beside the ranking
    for b in rows_in:
        ties = b.get("ties") or []
        best = " = ".join(f"`{m}`" for m in [b["method"], *(t["method"] for t in ties)]) if b["method"] else "—"
        value = b.get("value", b.get("quality"))
        row = [f"≤ {b['budget']}", best, b["setting"] or "—", fmt(b["bits"]), fmt(value, b.get("ci95"))]
        if e2e:
            row.append(fmt(b.get("quality"), b.get("quality_ci95")))
        if long:
            row.append(fmt(b["long_kl"], b.get("long_kl_ci95")) + (f" @ {b['long_bits_billed']:.3g} b" if
                       b.get("long_bits_billed") is not None else "") if b.get("long_kl") is not None else "—")
        row.append("; ".join(f"{t['method']} {t['setting']}: {fmt(t['value'], t.get('ci95'))} @ {fmt(t['bits'])} b"
                             for t in ties) or "—")
        rows.append(row)
    long_col = ["long-decode KL (`long_kl_nats`) @ bits billed at T"] if long else []
    headers = (["budget (bits/elt)", "best", "bits", "bits billed at T", "long-decode KL (`long_kl_nats`)",
                "tied (value @ bits)"] if long_only else
               ["budget (bits/elt)", "best", "bits", "bits billed", f"end-to-end KL (`{target}`)", metric, *long_col,
                "tied (value @ bits)"] if e2e else
               ["budget (bits/elt)", "best", "bits", "bits effective", metric, *long_col, "tied (value @ bits)"])
    return sentence, rows, headers


def headline_screen(board: dict[str, Any], src_name: str, src: dict[str, Any]) -> list[str]:
    """One screen per source: the best method at each matched budget — by end-to-end KL where it was
    measured, else by the headline tensor metric — with its ties, and the rule that names the metric."""
    sentence, rows, headers = headline_lines(board, src_name, src)
    data = src.get("data") or {}
    what = f" ({data.get('model')})" if source_kind(src_name) == "real" and data.get("model") else ""
    crits = {str(b.get("criterion", "")) for b in src.get("headline") or []}
    by = "end-to-end KL" if any(c.startswith("e2e_") for c in crits) else "long-decode KL" \
        if "long_kl_nats" in crits else f"`{(board.get('headline') or {}).get('metric', 'rel_mse')}`"
    out = [f"## {src_name}{what}: best method at a matched budget, by {by}", "", sentence, ""]
    if rows:
        out += [tabulate(rows, headers=headers, tablefmt="github"), ""]
    out += [f"Cells: {_cells_text(src.get('cells', {}))} · seeds {src.get('seeds')} · sizes "
            f"{', '.join(src.get('sizes', []))}. 16-bit settings are exact and are not budget points.", ""]
    return out


def _endtoend_tables(src: dict[str, Any], board: dict[str, Any]) -> list[str]:
    """End-to-end KL per method × bits (both regimes) and the predictivity table, where exp5 ran."""
    e2e = src["stats"].get("exp5", {})
    if not e2e:
        return []
    from kvqbench.report.leaderboard import PREDICTIVITY_TARGETS

    settings = sorted({s for by in e2e.values() for s in by if is_plain_setting(s)}, key=setting_order)
    cols = [(s, r) for r in ("prefill", "decode") for s in settings]
    rows = []
    for m in _method_order(src, board):
        if m not in e2e:
            continue
        row = [f"`{m}`"]
        for s, r in cols:
            e = e2e[m].get(s, {}).get(f"e2e_{r}_kl_nats")
            b = e2e[m].get(s, {}).get(f"e2e_{r}_bits_billed") if r == "decode" else None
            row.append((fmt(e["mean"], e["ci95"]) if e else "—") + (f" @ {b['mean']:.3g} b" if e and b else ""))
        rows.append(row)
    out = ["### End-to-end damage: next-token KL(p‖p̂) in nats against the unquantized model", "",
           "Each method's quantize → dequantize inside the model's KV cache; prefill = the text in one pass, "
           "decode = a prefill then blocks under the method's streaming rules. Decode cells give the bits billed "
           "per element (`@ … b`, `e2e_decode_bits_billed`): tokens a method keeps in fp16 windows count at 16 bits, "
           "so a low decode KL at high billed bits is the fp16 window, not the quantizer (exactly 0 at 16 b: the "
           "whole window stayed in fp16). Mean ± 95% CI over seeds (text windows).", "",
           tabulate(rows, headers=["method", *[f"{r} {s}" for s, r in cols]], tablefmt="github"), ""]
    pr = src.get("predictivity") or {}
    groups = pr.get("groups") or []
    tables = pr.get("targets") or {}
    main = tables.get(PREDICTIVITY_TARGETS[0]) or {}
    if main:
        order = main.get("pooled") or main.get(groups[0] if groups else "", [])
        by = {g: {r["metric"]: r for r in main.get(g, [])} for g in groups}
        others = [t for t in PREDICTIVITY_TARGETS[1:] if tables.get(t)]
        rows = []
        for r in order:
            row = [f"`{r['metric']}`", r["experiment"]]
            row += [_rho_text(by[g].get(r["metric"], {}).get("rho"), by[g].get(r["metric"], {}).get("ci95")) for g in groups]
            for t in others:
                tg = "pooled" if "pooled" in tables[t] else next(iter(tables[t]))
                o = next((x for x in tables[t][tg] if x["metric"] == r["metric"]), {})
                row.append(_rho_text(o.get("rho"), None))
            rows.append(row)
        heads = ["metric", "exp", *[f"ρ {g}" for g in groups], *[f"ρ vs `{t}`" for t in others]]
        out += ["### Which tensor metrics predict model damage", "",
                f"Spearman ρ across methods between each tensor metric (as badness: lower is better) and "
                f"`{PREDICTIVITY_TARGETS[0]}`, within each bit width and pooled, with a {pr.get('n_boot')}-resample "
                f"bootstrap 95% CI over methods; best first. Left out: {pr.get('excluded')}.", "",
                tabulate(rows, headers=heads, tablefmt="github"), ""]
    return out


def _tied(b: dict[str, Any]) -> str:
    """The best method and its ties as ``a = b`` (method ids in backticks); ``—`` when no point fits."""
    if not b.get("method"):
        return "—"
    return " = ".join(f"`{m}`" for m in [b["method"], *(t["method"] for t in b.get("ties") or [])])


def completeness_banner(board: dict[str, Any]) -> str | None:
    """``**INCOMPLETE** — incomplete: 78 of 435 cells finished, interrupted …`` for a partial result set
    (``board["completeness"]``, see :func:`kvqbench.report.results.completeness`), else ``None``."""
    comp = board.get("completeness") or {}
    if not comp or comp.get("complete", True):
        return None
    return (f"**INCOMPLETE RESULT SET** — {comp.get('summary', 'incomplete')}. Settings with fewer seeds than "
            "asked are marked with their n and are not ranked; compare with care.")


def _listed(items: list, n: int = 5) -> str:
    return "; ".join(map(str, items[:n])) + (" …" if len(items) > n else "")


def render_terminal(board: dict[str, Any], max_rows: int = 12) -> str:
    """A short table per source at the lowest bit-width that ran: methods ranked by the end-to-end KL where
    exp5 measured it (as the first screen of ``LEADERBOARD.md``), else by the board's headline tensor metric
    (``board["headline"]``; relative MSE when that source did not record it), with the headline metric and
    effective bits beside."""
    board = canonical(board)
    out = []
    comp = board.get("completeness") or {}
    if comp and not comp.get("complete", True):
        out.append(f"kvqbench: {comp.get('summary', 'incomplete')}")
    head = board.get("headline") or {}
    for src_name, src in board.get("sources", {}).items():
        metric = head.get("metric") if head.get("metric") in src["rankings"] else "rel_mse"
        rk = src["rankings"].get(metric)
        if not rk:
            continue
        settings = [s for s in sorted(rk["by_setting"], key=setting_order) if is_plain_setting(s)]
        if not settings:
            continue
        s = settings[0]

        target = head.get("target") or "e2e_prefill_kl_nats"
        eff, e2e, tensor = ({x["method"]: x for x in src["rankings"].get(name, {}).get("by_setting", {}).get(s, [])}
                            for name in ("bits_effective", target, metric))
        # where the end-to-end KL was measured the table ranks on it, like the first screen of LEADERBOARD.md
        ranked = src["rankings"][target]["by_setting"][s] if e2e else rk["by_setting"][s]
        rows = [[r["rank"] if r["rank"] is not None else f"n={r['n']}/{r['n_asked']}", r["method"],
                 *([fmt(r["mean"], r["ci95"])] if e2e else []),
                 fmt(tensor.get(r["method"], {}).get("mean"), tensor.get(r["method"], {}).get("ci95")),
                 fmt(eff.get(r["method"], {}).get("mean"))]
                for r in ranked[:max_rows]]
        flagged = [d["name"] for d in src.get("data_quality", []) if d["ok"] is False]
        label = f"headline {metric}" if metric == head.get("metric") else metric
        why = f"{rk.get('experiment', '?')}"
        if metric == head.get("metric") and head.get("from_predictivity") and head.get("rho") is not None:
            on = f" on {head['source']}" if head.get("source") and head["source"] != src_name else ""
            why += f"; Spearman rho {head['rho']:.2f} with {head.get('target')}{on}"
        by = f"ranked by end-to-end KL ({target}), {label} ({why}) beside it" if e2e else f"{label} ({why})"
        out.append(f"kvqbench [{src_name}] {by} at {s} (cells: {_cells_text(src['cells'])})"
                   + (f"  FLAGS: {', '.join(flagged)}" if flagged else ""))
        if not head.get("from_predictivity"):  # docs/DESIGN.md §4: the headline follows predictivity, which needs exp5
            out.append(f"  (relative MSE: {no_predictivity_reason(board)}, so it cannot pick the tensor metric that "
                       "predicts model damage; the main job, `kvqbench run`, ranks on that metric)")
        out.append(tabulate(rows, headers=["rank", "method", *(["e2e KL (nats)"] if e2e else []), metric, "bits eff."],
                            tablefmt="simple"))
    return "\n".join(out)
