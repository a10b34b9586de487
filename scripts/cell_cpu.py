#!/usr/bin/env python3
"""Per-cell CPU seconds of a benchmark run, and a side-by-side table of two runs.

Wall durations of cells are meaningless on a shared machine; the CPU time a cell's process spends in the
test call is not (much). As a pytest plugin it appends one line per test to ``$CELL_CPU_OUT/<pid>.tsv``
(one file per xdist worker): the node id, the CPU seconds of the call and of the setup, the process's
peak resident memory (``VmHWM``, kB) during the setup and during the call (the peak is reset before each
through Linux's ``/proc/self/clear_refs``; empty elsewhere) and the wall clock (Unix seconds) at the
setup's start and the call's end, tab-separated, so a run's per-worker schedule can be read from them.
The reset also resets what ``/usr/bin/time`` reports as the largest process's maximum resident set size
(the kernel's high-water mark): take the largest per-cell figure instead::

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
    _SETUP: dict[str, tuple[float, float, str]] = {}

    def _reset_peak() -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def _peak_kb() -> str:
        try:
            with open("/proc/self/status") as f:
                return next((line.split()[1] for line in f if line.startswith("VmHWM:")), "")
        except OSError:
            return ""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(item):
        _reset_peak()
        w, t = time.time(), time.process_time()
        yield
        _SETUP[item.nodeid] = (w, time.process_time() - t, _peak_kb())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        _reset_peak()
        t = time.process_time()
        yield
        cpu = time.process_time() - t
        out = os.environ.get("CELL_CPU_OUT")
        if out:
            w0, setup_cpu, setup_kb = _SETUP.pop(item.nodeid, (time.time(), 0.0, ""))
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, f"{os.getpid()}.tsv"), "a") as f:
                f.write(f"{item.nodeid}\t{cpu:.4f}\t{setup_cpu:.4f}\t{setup_kb}\t{_peak_kb()}\t{w0:.3f}\t{time.time():.3f}\n")


def load(folder: str) -> dict[str, float]:
    """node id → CPU seconds from every ``*.tsv`` of ``folder``."""
    res: dict[str, float] = {}
    for path in Path(folder).glob("*.tsv"):
        for line in path.read_text().splitlines():
            node, sec = line.split("\t")[:2]
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
