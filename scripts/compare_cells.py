"""Compare every metric of every cell of two result folders (``exp*_*.json`` of two runs), e.g. before and
after a change that must not move any metric.

    python scripts/compare_cells.py BASE_DIR NEW_DIR [--rel 1e-6]

For each cell (matched by node id) the ``metrics``, ``per_layer`` and ``series`` values are compared, timing
metrics (:data:`kvqbench.metrics.NONDETERMINISTIC_METRICS`) left out. Prints, per experiment and metric, how
many values are bit-identical and the largest relative difference; exits 1 when a cell is missing on one
side, a value is missing, or a relative difference exceeds ``--rel``. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from kvqbench.metrics import NONDETERMINISTIC_METRICS


def _cells(folder: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for path in sorted(folder.glob("exp*_*.json")):
        for cell in json.loads(path.read_text()).get("cells", []):
            out[cell["nodeid"]] = cell
    return out


def _walk(a, b, where: str, emit) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in NONDETERMINISTIC_METRICS:
                continue
            if k not in a or k not in b:
                emit(where, k, None)
            else:
                _walk(a[k], b[k], f"{where}.{k}" if where else k, emit)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for x, y in zip(a, b):
            _walk(x, y, where, emit)
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)):
            emit(where, None, 0.0)
        else:
            emit(where, None, abs(a - b) / max(abs(a), abs(b)))
    elif a != b:
        emit(where, None, math.inf)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rel", type=float, default=1e-6, help="largest relative difference allowed (default 1e-6)")
    args = ap.parse_args(argv)
    base, new = _cells(args.base), _cells(args.new)
    bad = 0
    for nid in sorted(set(base) ^ set(new)):
        print(f"only in {'base' if nid in base else 'new'}: {nid}")
        bad += 1
    stats: dict[tuple[str, str], list] = {}  # (experiment, field) -> [n, identical, worst, worst cell]
    for nid in sorted(set(base) & set(new)):
        a, b = base[nid], new[nid]
        exp = a.get("experiment", "?")

        def emit(where: str, missing: str | None, rel: float | None, nid=nid, exp=exp) -> None:
            nonlocal bad
            if rel is None:
                print(f"{nid}: {where}.{missing} on one side only")
                bad += 1
                return
            s = stats.setdefault((exp, where), [0, 0, 0.0, ""])
            s[0] += 1
            s[1] += rel == 0.0
            if rel > s[2]:
                s[2], s[3] = rel, nid
        for part in ("metrics", "per_layer", "series"):
            if part in a or part in b:
                _walk(a.get(part, {}), b.get(part, {}), part, emit)
    worst = 0.0
    for (exp, field), (n, same, w, where) in sorted(stats.items()):
        if same < n:
            print(f"{exp} {field}: {same}/{n} bit-identical, max rel diff {w:.2e} ({where})")
        worst = max(worst, w)
    n_all = sum(s[0] for s in stats.values())
    n_same = sum(s[1] for s in stats.values())
    print(f"{len(set(base) & set(new))} cells, {n_all} values: {n_same} bit-identical, max rel diff {worst:.2e}")
    if worst > args.rel:
        bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
