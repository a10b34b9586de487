#!/usr/bin/env python3
"""Per-cell peak resident memory of a benchmark run (Linux only).

As a pytest plugin it resets the process's high-water mark (``VmHWM`` in ``/proc/self/status``, reset to
the current resident size by writing ``5`` to ``/proc/self/clear_refs``) before each test's setup and
before its call, and appends ``<node id>\\t<phase>\\t<VmHWM MiB>\\t<VmRSS MiB after>`` for both phases to
``$CELL_PEAK_OUT/<pid>.tsv`` (one file per xdist worker)::

    PYTHONPATH=scripts CELL_PEAK_OUT=/tmp/peak kvqbench run --long -n 0 -k "kivi and k2v2" -p cell_peak

As a script it prints the largest peaks of such a folder::

    python scripts/cell_peak.py /tmp/peak

:func:`mark` does the same from inside a computation (``reset=True`` first), for a phase-by-phase look.
Torch-free.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

try:
    import pytest
except ImportError:  # the summary needs no pytest
    pytest = None


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0  # kB
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset() -> None:
    """Reset ``VmHWM`` to the current resident size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def mark(label: str, reset_after: bool = True) -> float:
    """Print ``label``, the peak (MiB) since the last reset and the current RSS to stderr; then reset."""
    hwm, rss = _status_mib("VmHWM"), _status_mib("VmRSS")
    print(f"[peak] {label}: hwm {hwm:.0f} MiB, rss {rss:.0f} MiB", file=sys.stderr, flush=True)
    if reset_after:
        reset()
    return hwm


def _write(nodeid: str, phase: str) -> None:
    out = os.environ.get("CELL_PEAK_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{os.getpid()}.tsv"), "a") as f:
            f.write(f"{nodeid}\t{phase}\t{_status_mib('VmHWM'):.0f}\t{_status_mib('VmRSS'):.0f}\n")


if pytest is not None:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(item):
        reset()
        yield
        _write(item.nodeid, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        reset()
        yield
        _write(item.nodeid, "call")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    rows = []
    for path in Path(argv[0]).glob("*.tsv"):
        for line in path.read_text().splitlines():
            node, phase, hwm, rss = line.split("\t")
            rows.append((float(hwm), float(rss), phase, node, path.stem))
    for hwm, rss, phase, node, pid in sorted(rows, reverse=True)[:40]:
        print(f"{hwm / 1024:6.2f} GiB peak  {rss / 1024:6.2f} GiB after  {phase:5s}  {pid}  {node}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
