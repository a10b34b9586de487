"""Processes: the re-run under the steady allocator, and several processes merged by medians.

Where a process's memory lands moves the eager RTN's time for the whole process more than the methods'
times, so one process's ratios to it move with the process. ``kvqbench perf`` on the CPU therefore runs the
whole measurement in ``--processes`` fresh processes one after another (:func:`in_processes`), each with the
steady allocator's environment (:func:`kvqbench.perf.machine.steady_env`), and reports per candidate the
median over the processes of each process's own median time and ratios (:func:`merge_processes`; a ratio is
taken within its process's rounds). ``per_process`` in the JSON keeps each process's median time and ratios
to the eager RTN (wall and CPU). On CUDA one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvqbench.perf.machine import is_glibc_linux, steady_env
from kvqbench.perf.report import emit

__all__ = ["PROCESS_MARK", "DEFAULT_PROCESSES", "rerun_command", "in_processes", "merge_processes"]

#: processes (CPU) by default
DEFAULT_PROCESSES = 3
#: set in the environment of the processes a multi-process ``kvqbench perf`` starts
PROCESS_MARK = "KVQBENCH_PERF_PROCESS"
#: what the re-run executes: ``kvqbench.cli.main`` on the same arguments
_RERUN = "import sys; from kvqbench.cli import main; sys.exit(main(sys.argv[1:]))"


def rerun_command(args: argparse.Namespace, argv: list[str] | None,
                  environ: dict[str, str] | os._Environ[str] | None = None) -> tuple[list[str], dict[str, str]] | None:
    """``(command, environment)`` to re-run ``kvqbench perf`` with the steady allocator, or ``None`` to run
    in this process: ``--allocator default``, a CUDA device, not Linux/glibc, no ``argv`` to repeat, or
    the tunables already set (:func:`steady_env`)."""
    if args.allocator != "steady" or args.device.startswith("cuda") or argv is None or not is_glibc_linux():
        return None
    env = steady_env(os.environ if environ is None else environ)
    if env is None:
        return None
    return [sys.executable, "-c", _RERUN, *argv], env


def in_processes(args: argparse.Namespace, argv: list[str]) -> int:
    """Run ``kvqbench perf`` (``argv``, from ``perf`` on) in ``args.processes`` processes one after another,
    each with ``--processes 1`` and the steady allocator's environment where asked (:func:`steady_env`), and
    print (and write) :func:`merge_processes` of their results. A failing process (its error printed) stops it
    with its status; an interrupt (Ctrl-C) reports the processes that finished, then exits 130."""
    n = args.processes
    env = dict(os.environ)
    if args.allocator == "steady" and is_glibc_linux():
        env = steady_env(env) or env
    env[PROCESS_MARK] = "1"
    results: list[dict[str, Any]] = []
    status = 0
    with tempfile.TemporaryDirectory(prefix="kvqbench-perf-") as tmp:
        for i in range(n):
            print(f"kvqbench perf: process {i + 1}/{n}", file=sys.stderr, flush=True)
            path = Path(tmp) / f"process{i}.json"
            cmd = [sys.executable, "-c", _RERUN, *argv, "--processes", "1", "--json", str(path)]
            try:
                rc = subprocess.call(cmd, env=env, stdout=subprocess.DEVNULL)
            except KeyboardInterrupt:
                rc = 130
            if rc != 0:  # a failure's own error line is the last one printed
                status = rc
                break
            results.append(json.loads(path.read_text()))
    if status == 130 and results:
        print(f"kvqbench perf: interrupted; the {len(results)} finished process(es) of {n}:", file=sys.stderr)
    elif status:
        return status
    if results:
        emit(merge_processes(results), args.json)
    return status


def _median_of(vals: list[Any]) -> float | None:
    got = [v for v in vals if v is not None]
    return statistics.median(got) if got else None


def merge_processes(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the :func:`run_perf` results of several processes (same configuration): per candidate,
    token count and thread count, the median over the processes of each process's median time, CPU time,
    ratios to the baselines (each taken within its own process, as in one run) and clone bandwidth; the
    fastest call of all; every call's time (``all_ms``, ``all_cpu_ms``, process after process); the largest
    peak; and ``per_process`` with each process's median time and ratio to the eager RTN (wall and CPU). The
    token scaling: the median of the processes' ratios. ``config["processes"]`` = their number.

    Raises:
        ValueError: no results, or results of different configurations or rows.
    """
    if not results:
        raise ValueError("no results to merge")
    skip = ("input_copies", "processes")
    cfg0 = {k: v for k, v in results[0]["config"].items() if k not in skip}
    if any({k: v for k, v in r["config"].items() if k not in skip} != cfg0 for r in results[1:]):
        raise ValueError("the processes' results differ in configuration")

    def key(r: dict[str, Any]) -> tuple:
        return r["threads"], r["tokens"], r["candidate"], r["kind"]

    keys = [key(r) for r in results[0]["rows"]]
    by = [{key(r): r for r in res["rows"]} for res in results]
    if any(set(b) != set(keys) for b in by):
        raise ValueError("the processes' results differ in their rows")
    rows = []
    for k in keys:
        rs = [b[k] for b in by]
        row = dict(rs[0])
        row["median_ms"] = statistics.median(r["median_ms"] for r in rs)
        row["min_ms"] = min(r["min_ms"] for r in rs)
        row["all_ms"] = [v for r in rs for v in r["all_ms"]]
        row["median_cpu_ms"] = _median_of([r.get("median_cpu_ms") for r in rs])
        row["all_cpu_ms"] = [v for r in rs for v in (r.get("all_cpu_ms") or [])] or None
        row["peak_bytes"] = max(r.get("peak_bytes", 0) for r in rs)
        for f in [f for f in rs[0] if f.startswith("x_")] + (["bandwidth_gbps"] if "bandwidth_gbps" in rs[0] else []):
            row[f] = _median_of([r.get(f) for r in rs])
        row["per_process"] = {"median_ms": [r["median_ms"] for r in rs],
                              "x_eager_rtn": [r.get("x_eager_rtn") for r in rs],
                              "x_eager_rtn_cpu": [r.get("x_eager_rtn_cpu") for r in rs]}
        rows.append(row)

    def skey(s: dict[str, Any]) -> tuple:
        return s["threads"], s["candidate"], s["kind"], s["from_tokens"], s["to_tokens"]

    sby = [{skey(s): s for s in res.get("scaling") or []} for res in results]
    scaling = []
    for k in [skey(s) for s in results[0].get("scaling") or []]:
        ss = [b[k] for b in sby if k in b]
        sc = dict(ss[0])
        for f in ("time_ratio", "min_time_ratio", "cpu_time_ratio"):
            sc[f] = _median_of([x.get(f) for x in ss])
        scaling.append(sc)
    cfg = dict(results[0]["config"], processes=len(results))
    return {"config": cfg, "environment": results[0]["environment"], "rows": rows, "scaling": scaling}
