#!/usr/bin/env python3
"""Per-cell CPU seconds of a benchmark run, and a side-by-side table of two runs.

Wall durations of cells are meaningless on a shared machine; the CPU time a cell's process spends in the
test call is not (much). As a pytest plugin it appends ``<node id>\\t<CPU seconds of the call>`` for every
test to ``$CELL_CPU_OUT/<pid>.tsv`` (one file per xdist worker)::

    PYTHONPATH=scripts CELL_CPU_OUT=/tmp/cpu_new kvqbench run -p cell_cpu -k "real and not endtoend" ...

As a script it compares two such folders, summed per test and per (test, method), with the ratio::

    python scripts/cell_cpu.py /tmp/cpu_base /tmp/cpu_new

Only the call is timed (not fixture setup: data loading, the model capture). Torch-free.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import time
from pathlib import Path

try:
    import pytest
except ImportError:  # the comparison needs no pytest
    pytest = None


if pytest is not None:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        t = time.process_time()
        yield
        out = os.environ.get("CELL_CPU_OUT")
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, f"{os.getpid()}.tsv"), "a") as f:
                f.write(f"{item.nodeid}\t{time.process_time() - t:.4f}\n")


def load(folder: str) -> dict[str, float]:
    """node id → CPU seconds from every ``*.tsv`` of ``folder``."""
    res: dict[str, float] = {}
    for path in Path(folder).glob("*.tsv"):
        for line in path.read_text().splitlines():
            node, _, sec = line.rpartition("\t")
            res[node] = float(sec)
    return res


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    a, b = load(argv[0]), load(argv[1])
    both = sorted(set(a) & set(b))
    groups: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for node in both:
        m = re.match(r".*::(\w+)\[([\w.]+?)-", node)
        test, method = (m.group(1), m.group(2)) if m else (node, "")
        for key in ((test, "*"), (test, method)):
            g = groups[key]
            g[0] += a[node]
            g[1] += b[node]
            g[2] += 1
    print(f"{'test':24} {'method':12} {'cells':>5} {'base CPU-s':>10} {'new CPU-s':>10} {'ratio':>6}")
    for (test, method), (x, y, n) in sorted(groups.items()):
        print(f"{test:24} {method:12} {n:5d} {x:10.1f} {y:10.1f} {y / max(x, 1e-9):6.2f}")
    ta, tb = sum(a[n] for n in both), sum(b[n] for n in both)
    print(f"{'total':24} {'':12} {len(both):5d} {ta:10.1f} {tb:10.1f} {tb / max(ta, 1e-9):6.2f}")
    if set(a) ^ set(b):
        print(f"(only in the first: {len(set(a) - set(b))}, only in the second: {len(set(b) - set(a))})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
