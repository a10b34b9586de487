"""Compare every metric value of two ``kvqbench run`` result folders exactly (timing values skipped).

Usage: ``python scripts/compare_metrics.py BASE_DIR NEW_DIR`` — walks every ``*.json`` under both folders,
compares each numeric leaf whose key path holds no timing word (time, latency, throughput, …) for exact
equality (NaN equals NaN), prints the first differences and exits 1 when any value differs or a file is
missing on one side. For checking that a speed change leaves metrics bit-identical.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Iterator

#: key fragments of timing values (exempt from the comparison)
TIMING = ("throughput", "time", "latency", "_ms", "seconds", "duration", "elapsed", "benchmark", "wall",
          "started", "finished", "host", "date")


def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """``(key path, number)`` of every numeric leaf of ``obj`` outside timing keys."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not any(s in str(k).lower() for s in TIMING):
                yield from leaves(v, f"{path}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    a, b = Path(argv[0]), Path(argv[1])
    fa = {p.relative_to(a) for p in a.rglob("*.json") if not any(s in p.name.lower() for s in TIMING)}
    fb = {p.relative_to(b) for p in b.rglob("*.json") if not any(s in p.name.lower() for s in TIMING)}
    n = diff = 0
    for rel in sorted(fa & fb):
        va = dict(leaves(json.loads((a / rel).read_text())))
        vb = dict(leaves(json.loads((b / rel).read_text())))
        for k in sorted(va.keys() | vb.keys()):
            n += 1
            x, y = va.get(k), vb.get(k)
            if x != y and not (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)):
                diff += 1
                if diff <= 20:
                    print(f"DIFF {rel}{k}: {x!r} -> {y!r}")
    for rel in sorted(fa ^ fb):
        print(f"only in {'base' if rel in fa else 'new'}: {rel}")
    print(f"{len(fa & fb)} files, {n} values compared, {diff} differ")
    return 1 if diff or fa ^ fb else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
