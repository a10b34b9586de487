"""``LEADERBOARD.md``: the first screen per source (:mod:`.headline`), the two-model section
(:mod:`.models`), then per source the details — end-to-end damage and predictivity, the long decode
(:mod:`.longdecode`), reconstruction tables, rankings, Pareto front, budgets, data-quality flags —,
the methods and the provenance. A function of the leaderboard document alone. Torch-free."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from kvqbench.cells import is_exact_setting, setting_order
from kvqbench.metrics import experiment_of
from kvqbench.report.render.headline import headline_screen
from kvqbench.report.render.longdecode import markdown_lines as longdecode_lines
from kvqbench.report.render.models import models_lines
from kvqbench.report.render.text import (
    RANKING_RULE,
    canonical,
    cells_text,
    completeness_banner,
    fmt,
    listed,
    methods_in,
    missing_text,
    plain_settings,
    rank_text,
    rho_text,
    seeds_text,
    ties_text,
    value_text,
)
from kvqbench.report.stats.predictivity import PREDICTIVITY_TARGETS, target_rows

__all__ = ["render_markdown"]

_RECONSTRUCTION = experiment_of("rel_mse")


def _budget_table(rows: list[dict[str, Any]], bits_key: str, value_key: str, last_headers: list[str]) -> str:
    """A detail table of best-at-budget rows (the first screen's paired rule over seeds): budget, best and
    its ties, bits, the bits and the value under ``bits_key`` / ``value_key``."""
    return tabulate([[f"≤ {b['budget']}", " = ".join(f"`{m}`" for m in [b["method"], *(t["method"] for t in b["ties"])])
                      + (" (no paired verdict)" if b.get("no_verdict") else "") if b.get("method") else "—",
                      b["setting"] or "—", fmt(b[bits_key]), fmt(b[value_key])] for b in rows],
                    headers=["budget", "best (= tied: not separated, paired over seeds)", "bits", *last_headers],
                    tablefmt="github")


def _headline_matrix(src: dict[str, Any], board: dict[str, Any], metric: str) -> str:
    exp1 = src["stats"].get(_RECONSTRUCTION, {})
    asked = (src.get("setting_cells") or {}).get(_RECONSTRUCTION, {})
    settings = sorted(set(plain_settings(exp1)) | set(plain_settings(asked)), key=setting_order)
    rows = []
    for m in methods_in(board, set(exp1) | set(asked)):
        fid = board["methods"].get(m, {}).get("fidelity", "")
        row = [f"`{m}`", fid]
        for s in settings:
            e = exp1.get(m, {}).get(s, {}).get(metric)
            row.append(value_text(e) if e else missing_text(src, _RECONSTRUCTION, m, s))
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
        by = {name: {x["method"]: x for x in rk.get(name, {}).get("by_setting", {}).get(s, [])} for name, _ in cols}
        rows = [[rank_text(r), f"`{r['method']}`", *(value_text(by[name].get(r["method"])) for name, _ in cols),
                 ties_text(r)] for r in rk["rel_mse"]["by_setting"][s]]
        out.append(f"#### {s}\n\n" + tabulate(rows, headers=["rank", "method", *[c for _, c in cols], "tied with (paired)"],
                                              tablefmt="github"))
    return out


def _all_metrics_table(src: dict[str, Any], setting: str) -> str:
    rows = []
    for name, r in sorted(src["rankings"].items(), key=lambda kv: (kv[1]["experiment"], kv[0])):
        ranked = r["by_setting"].get(setting)
        if not ranked:
            continue
        order = " > ".join(f"{x['method']}" + ("=" if x["ties"] else "") for x in ranked if not x.get("short"))
        order = (f"no verdict ({ranked[0]['no_verdict']}): " if ranked[0].get("no_verdict") else "") + order
        short = [f"{x['method']} (n={x['n']}/{x['n_asked']})" for x in ranked if x.get("short")]
        if short:
            order += "; not ranked: " + ", ".join(short)
        rows.append([r["experiment"], f"`{name}`", r["unit"], r["better"], order])
    if not rows:
        return ""
    return tabulate(rows, headers=["exp", "metric", "unit", "better",
                                   f"ranking at {setting} (best first; = tied with another, paired rule)"],
                    tablefmt="github")


def _endtoend_tables(src: dict[str, Any], board: dict[str, Any]) -> list[str]:
    """End-to-end KL per method × bits (both regimes) and the predictivity table, where the end-to-end
    experiment ran."""
    e2e = src["stats"].get(experiment_of(PREDICTIVITY_TARGETS[0]), {})
    if not e2e:
        return []
    settings = plain_settings(e2e)
    cols = [(s, r) for r in ("prefill", "decode") for s in settings]
    def cell(by: dict[str, Any], r: str) -> str:  # the KL, and the bits billed where they can differ
        e, b = by.get(f"e2e_{r}_kl_nats"), by.get(f"e2e_{r}_bits_billed") if r == "decode" else None
        return (fmt(e["mean"], e["ci95"]) if e else "—") + (f" @ {b['mean']:.3g} b" if e and b else "")

    rows = [[f"`{m}`", *(cell(e2e[m].get(s, {}), r) for s, r in cols)] for m in methods_in(board, e2e)]
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
            row += [rho_text(by[g].get(r["metric"], {}).get("rho"), by[g].get(r["metric"], {}).get("ci95")) for g in groups]
            for t in others:
                o = next((x for x in target_rows(pr, t)[1] if x["metric"] == r["metric"]), {})
                row.append(rho_text(o.get("rho"), None))
            rows.append(row)
        heads = ["metric", "exp", *[f"ρ {g}" for g in groups], *[f"ρ vs `{t}`" for t in others]]
        out += ["### Which tensor metrics predict model damage", "",
                f"Spearman ρ across methods between each tensor metric (as badness: lower is better) and "
                f"`{PREDICTIVITY_TARGETS[0]}`, within each bit width and pooled, with a {pr.get('n_boot')}-resample "
                f"bootstrap 95% CI over methods; best first. Left out: {pr.get('excluded')}.", "",
                tabulate(rows, headers=heads, tablefmt="github"), ""]
    return out


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
              "section per data source: `real` is SmolLM2's, `real-<model>` another model's). Every ranking table: "
              f"{RANKING_RULE}. The units are what the compared settings share, named per experiment under each source. Every best-at-budget "
              "table: the first screen's rule.", ""]
    for src_name, src in board.get("sources", {}).items():
        data = src.get("data") or {}
        desc = data.get("description") or ", ".join(f"{k}={v}" for k, v in sorted(data.items())
                                                   if isinstance(v, (int, float, str)) and k != "description")
        lines += [f"## {src_name}", "", f"Data: {desc}", "",
                  f"Sizes: {', '.join(src.get('sizes', []))} · {seeds_text(src)} · cells: {cells_text(src['cells'])}", ""]
        lines += _endtoend_tables(src, board)
        lines += longdecode_lines(src, board)
        exp1 = src["stats"].get(_RECONSTRUCTION, {})
        if exp1:
            lines += ["### Relative MSE (mean of K and V) by bit-width", "", _headline_matrix(src, board, "rel_mse"), ""]
            lines += ["### Effective bits per element (K and V mean)", "", _headline_matrix(src, board, "bits_effective"), ""]
            settings = plain_settings(exp1)
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
                lines += [_budget_table(mb, "bits_effective", "rel_mse", ["bits effective", "rel. MSE"]), ""]
            dk = (src.get("pareto_decode_kl") or {}).get("matched_budget") or []
            if any(b["method"] for b in dk):
                lines += ["### Best method at a matched budget by pseudo-decode attention KL alone (exp2 decoding; "
                          "bits billed, fp16 windows at 16)", ""]
                lines += [_budget_table(dk, "bits", "quality", ["bits billed", "KL(p‖p̂) nats"]), ""]
            t = _all_metrics_table(src, settings[0]) if settings else ""
            if t:
                lines += [f"### Every ranked metric at {settings[0]}", "", t, ""]
        dq = src.get("data_quality") or []
        if dq:
            lines += ["### Data-quality flags (sanity checks on the measurement, not verdicts on methods)", ""]
            lines += [tabulate([[d["name"], {True: "ok", False: "FLAGGED", None: "n/a"}[d["ok"]], d["detail"],
                                 listed(d["offenders"]) + ("; " if d["offenders"] and d.get("noted") else "")
                                 + (f"noted, not flagged: {listed(d['noted'])}" if d.get("noted") else "")]
                                for d in dq], headers=["flag", "status", "check", "offenders"], tablefmt="github"), ""]
        if src.get("failures"):
            lines += ["### Failed cells", "", *(f"- `{f['nodeid']}`: {f['error'].splitlines()[0] if f['error'] else ''}"
                                                for f in src["failures"]), ""]
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
