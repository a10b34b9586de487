"""What ``kvqbench perf`` prints and writes: the tables (:func:`format_report`) and the JSON (:func:`emit`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["format_report", "emit"]


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def format_report(result: dict[str, Any]) -> str:
    """The tables ``kvqbench perf`` prints: per (threads, tokens) one row per method with the K and V
    median times and ratios, then the 4× token scaling of every candidate."""
    from tabulate import tabulate

    rows = result["rows"]
    has_hqq = any(r.get("x_hqq_rtn") is not None for r in rows)
    out: list[str] = []
    cuda = str(result["environment"]["device"]).startswith("cuda")
    nproc_all = result["config"].get("processes", 1)
    out.append("K ms / V ms: median wall time of a method's K and V round trip (quantize + dequantize); ×clone, "
               "×eager_rtn" + (", ×hqq_rtn" if has_hqq else "") + ": that time as a multiple of the baseline's median "
               "in the same rounds" + ("" if cuda else "; ×eager_rtn cpu: the same ratio of CPU times "
                                       "(time.process_time)") + ". The baselines (clone, eager_rtn"
               + (", hqq_rtn" if has_hqq else "") + ") time one tensor (K), so their V columns are empty."
               + (f" Timed in {nproc_all} processes: every median time and ratio is the median over the processes of "
                  "that process's own (a ratio is taken within its process's rounds, so it need not equal the ratio "
                  "of the printed medians)." if nproc_all > 1 else "") + "\n")
    for nt in result["config"]["threads"]:
        for t in result["config"]["tokens"]:
            sel = [r for r in rows if r["threads"] == nt and r["tokens"] == t]
            if not sel:
                continue
            by = {(r["candidate"], r["kind"]): r for r in sel}
            table = []
            for cand in dict.fromkeys(r["candidate"] for r in sel):
                if (cand, None) in by:
                    r = by[(cand, None)]
                    line = [cand, f"{r['median_ms']:.3f}", "", _fmt(r["x_clone"]), "", _fmt(r["x_eager_rtn"]), ""]
                    if has_hqq:
                        line += [_fmt(r["x_hqq_rtn"]), ""]
                    if cuda:
                        line += [f"{r['peak_bytes'] / 2**20:.1f}"]
                    else:
                        line += [_fmt(r.get("x_eager_rtn_cpu")), ""]
                    table.append(line)
                    continue
                rk, rv = by.get((cand, "k")), by.get((cand, "v"))
                line = [cand, f"{rk['median_ms']:.3f}", f"{rv['median_ms']:.3f}", _fmt(rk["x_clone"]),
                        _fmt(rv["x_clone"]), _fmt(rk["x_eager_rtn"]), _fmt(rv["x_eager_rtn"])]
                if has_hqq:
                    line += [_fmt(rk["x_hqq_rtn"]), _fmt(rv["x_hqq_rtn"])]
                if cuda:
                    line += [f"{max(rk['peak_bytes'], rv['peak_bytes']) / 2**20:.1f}"]
                else:
                    line += [_fmt(rk.get("x_eager_rtn_cpu")), _fmt(rv.get("x_eager_rtn_cpu"))]
                table.append(line)
            headers = ["candidate", "K ms", "V ms", "K ×clone", "V ×clone", "K ×eager_rtn", "V ×eager_rtn"]
            if has_hqq:
                headers += ["K ×hqq_rtn", "V ×hqq_rtn"]
            headers += ["peak MiB"] if cuda else ["K ×eager_rtn cpu", "V ×eager_rtn cpu"]
            shape = result["config"]["shape"]
            rounds = (f"median over {nproc_all} processes of medians of {result['config']['repeats']} interleaved "
                      "rounds" if nproc_all > 1 else f"median of {result['config']['repeats']} interleaved rounds")
            out.append(f"threads={nt}  T={t}  x=({shape[0]}, {shape[1]}, {t}, {shape[3]}) fp32  "
                       f"{result['config']['bits']} bits  {rounds}")
            out.append(tabulate(table, headers=headers, disable_numparse=True))
            bw = by.get(("clone", None), {}).get("bandwidth_gbps")
            if bw:
                out.append(f"clone moves {bw:.1f} GB/s (read + write)")
            out.append("")
    sc = result.get("scaling") or []
    if sc:
        steps = sorted({(s["from_tokens"], s["to_tokens"]) for s in sc})
        table = []
        keys = list(dict.fromkeys((s["threads"], s["candidate"], s["kind"]) for s in sc))
        for nt, cand, kind in keys:
            vals = {(s["from_tokens"], s["to_tokens"]): s for s in sc
                    if (s["threads"], s["candidate"], s["kind"]) == (nt, cand, kind)}
            table.append([nt, cand + (f"/{kind}" if kind else "")]
                         + [_fmt(vals[st]["time_ratio"]) if st in vals else "—" for st in steps]
                         + ([_fmt(vals[st].get("cpu_time_ratio")) if st in vals else "—" for st in steps]
                            if not cuda else []))
        out.append("time ratio between token counts: of the median wall times" + ("" if cuda else " and of the "
                   "median CPU times") + " (a memory-bound round trip scales like the token ratio; the JSON also "
                   "has the ratio of the fastest calls)")
        out.append(tabulate(table, headers=["threads", "candidate"] + [f"{a}→{b} (×{b / a:g})" for a, b in steps]
                            + ([] if cuda else [f"cpu {a}→{b}" for a, b in steps]), disable_numparse=True))
    env = result["environment"]
    out.append(f"\nCPU model: {env.get('cpu_model') or 'unknown'}")
    out.append(f"torch {env['torch']} · {env['device']}{' ' + env['cuda_device'] if env.get('cuda_device') else ''}"
               f" · {env['cpu_count']} CPUs (default threads {env['default_threads']}) · timer {env['timer']} · "
               f"hqq {env['hqq'] or 'not installed (pip install -e .[peers])'}")
    cfg = result["config"]
    if "cache" in cfg:
        n = ", ".join(f"T={t}: {c}" for t, c in cfg.get("input_copies", {}).items())
        llc = env.get("cache_bytes")
        out.append(f"allocator {env.get('allocator', '?')} · inputs {cfg['cache']}"
                   + (f" ({n} copies round-robin; cache {llc / 2**20:.0f} MiB, {env.get('cache_bytes_source')})"
                      if cfg["cache"] == "cold" and llc else ""))
    return "\n".join(out)


def emit(result: dict[str, Any], path: Path | None) -> None:
    """Write the JSON (first, so that nothing measured is lost; a write that fails anyway is reported in one
    line after the table) and print the tables."""
    err = None
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1) + "\n")
        except OSError as e:
            err = f"kvqbench perf: could not write {path}: {e.strerror or e}"
    print(format_report(result))
    if path is not None and err is None:
        print(f"wrote {path}")
    if err:
        print(err, file=sys.stderr)
