"""Compare every cell's values between two results folders (a baseline and a run after a change).

    python scripts/compare_cells.py BASE_DIR NEW_DIR [--rel 1e-6]

Cells are matched by their pytest node id in every ``*.json`` file with a ``cells`` list. Compared: every
number under ``metrics``, ``per_layer`` and ``extra`` (recursively), and every other value there for
equality; timings (``duration_s``, keys with ``time``/``latency``/``_ms``/``_s`` suffixes) are left out.
Prints how many values are bit-identical, how many differ within ``--rel`` (relative) and lists the
others; exit status 1 when a value differs beyond ``--rel``, a cell is missing, or a value is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterator

SECTIONS = ("metrics", "per_layer", "extra")


def _timing(key: str) -> bool:
    k = key.lower()
    return "time" in k or "latency" in k or k.endswith(("_ms", "_s", "_us")) or k == "duration_s"


def load_cells(folder: Path) -> dict[str, dict[str, Any]]:
    """Node id -> cell record of every results JSON in ``folder``."""
    cells: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("cells"), list):
            for cell in doc["cells"]:
                cells[cell["nodeid"]] = cell
    return cells


def leaves(x: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, value)`` of every leaf of a JSON value, timing keys left out."""
    if isinstance(x, dict):
        for k in sorted(x):
            if not _timing(str(k)):
                yield from leaves(x[k], f"{path}.{k}" if path else str(k))
    elif isinstance(x, list) and x and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in x):
        for i, v in enumerate(x):
            yield f"{path}[{i}]", v
    else:
        yield path, x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rel", type=float, default=1e-6, help="relative tolerance (default 1e-6)")
    args = ap.parse_args(argv)
    base, new = load_cells(args.base), load_cells(args.new)
    if not base:
        print(f"no cells in {args.base}")
        return 1
    bad = 0
    same = close = 0
    worst = 0.0
    for nodeid in sorted(base):
        if nodeid not in new:
            print(f"MISSING cell {nodeid}")
            bad += 1
            continue
        a = dict(leaves({s: base[nodeid].get(s) for s in SECTIONS}))
        b = dict(leaves({s: new[nodeid].get(s) for s in SECTIONS}))
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                print(f"MISSING {nodeid} {key}")
                bad += 1
                continue
            x, y = a[key], b[key]
            if x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)):
                same += 1
                continue
            if isinstance(x, (int, float)) and isinstance(y, (int, float)):
                rel = abs(x - y) / max(abs(x), abs(y))
                worst = max(worst, rel)
                if rel <= args.rel:
                    close += 1
                    continue
            print(f"DIFF {nodeid} {key}: {x!r} -> {y!r}")
            bad += 1
    print(f"{len(base)} cells: {same} values bit-identical, {close} within relative {args.rel:g} "
          f"(worst {worst:.3g}), {bad} beyond or missing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
