#!/usr/bin/env python3
"""Are two result folders the same, metric for metric? For checking that a change meant to be
numerics-neutral (a speed-up) changed no value.

Usage::

    python scripts/same_metrics.py BASE NEW [--rel 1e-6]

Compares every cell of every ``exp*_*.json`` (matched by node id): status, each value under ``metrics``,
``per_layer`` and ``series`` — bit-identical, or with ``--rel`` within that relative tolerance (reported
separately) — and the ranking / statistics part of ``leaderboard.json`` and ``summary.json`` (everything
except provenance and timings). Timing metrics (latency, throughput, memory; see
:func:`kvqbench.metrics.is_timing`), per-cell durations and the ``extra`` detail are skipped.
Exit status 0 when everything compared is identical (or within ``--rel``), 1 otherwise. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterator

# the checkout this script belongs to, not whichever kvqbench is installed (a script's own folder comes first)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvqbench.metrics import is_timing  # noqa: E402

#: keys whose values are allowed to differ between two runs of the same cells
VOLATILE = {"provenance", "duration_s", "extra", "start_time", "git_commit", "timings", "benchmark", "fit_ms",
            "nodeid_durations"}


def _leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            if k in VOLATILE or is_timing(str(k)):
                continue
            yield from _leaves(obj[k], f"{path}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, obj


def _same(a: Any, b: Any, rel: float) -> str:
    """"" identical, "near" within rel, "diff" otherwise."""
    if a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
        return ""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and rel > 0:
        if math.isclose(a, b, rel_tol=rel, abs_tol=0.0):
            return "near"
    return "diff"


def _valued(cell: dict) -> dict:
    """The cell's fields that hold values; a field absent, ``None`` or empty holds none (a published,
    slimmed record drops an empty ``per_layer`` that a run's record keeps as ``{}``)."""
    return {k: cell[k] for k in ("status", "metrics", "per_layer", "series") if cell.get(k) not in (None, {}, [])}


def compare(base: Path, new: Path, rel: float = 0.0) -> tuple[int, list[str], list[str]]:
    """(values compared, differing paths, paths within ``rel`` only)."""
    n, diff, near = 0, [], []
    names = sorted({p.name for p in base.glob("exp*_*.json")} | {p.name for p in new.glob("exp*_*.json")})
    for name in names:
        if not (base / name).is_file() or not (new / name).is_file():
            diff.append(f"{name}: only in {'NEW' if not (base / name).is_file() else 'BASE'}")
            continue
        cb = {c["nodeid"]: c for c in json.loads((base / name).read_text())["cells"]}
        cn = {c["nodeid"]: c for c in json.loads((new / name).read_text())["cells"]}
        for nid in sorted(set(cb) | set(cn)):
            if nid not in cb or nid not in cn:
                diff.append(f"{name} {nid}: only in {'NEW' if nid not in cb else 'BASE'}")
                continue
            a, b = dict(_leaves(_valued(cb[nid]))), dict(_leaves(_valued(cn[nid])))
            for key in sorted(set(a) | set(b)):
                n += 1
                s = _same(a.get(key, "<missing>"), b.get(key, "<missing>"), rel)
                if s:
                    (near if s == "near" else diff).append(f"{name} {nid} {key}: {a.get(key)} vs {b.get(key)}")
    for name in ("leaderboard.json", "summary.json"):
        if not (base / name).is_file() or not (new / name).is_file():
            continue
        a = dict(_leaves(json.loads((base / name).read_text())))
        b = dict(_leaves(json.loads((new / name).read_text())))
        for key in sorted(set(a) | set(b)):
            n += 1
            s = _same(a.get(key, "<missing>"), b.get(key, "<missing>"), rel)
            if s:
                (near if s == "near" else diff).append(f"{name} {key}: {a.get(key)} vs {b.get(key)}")
    return n, diff, near


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rel", type=float, default=0.0, help="relative tolerance (default 0: bit-identical)")
    args = ap.parse_args(argv)
    n, diff, near = compare(args.base, args.new, args.rel)
    for line in diff[:50]:
        print("DIFF", line)
    for line in near[:20]:
        print("NEAR", line)
    print(f"{n} values compared: {n - len(diff) - len(near)} identical, {len(near)} within rel {args.rel}, "
          f"{len(diff)} different")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
