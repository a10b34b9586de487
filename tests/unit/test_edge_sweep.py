"""The edge-case sweep script runs and counts (scripts/edge_sweep.py, issue 9 "Measure")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "edge_sweep.py"


def test_sweep_counts_a_small_slice_clean():
    cmd = [sys.executable, str(SCRIPT), "--methods", "kivi", "kitty", "--cases", "zero", "tiny", "len129",
           "--dtypes", "float32", "float16", "--bits", "2", "--all-layouts"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    # 4 variants (kivi, kivi[alt0], kitty, kitty[alt0]) × 3 cases × 2 dtypes × 1 bits × 2 kinds
    assert "edge sweep: 48 cells" in out.stdout
    assert "ok 48  nan 0  wrong 0  crash 0" in out.stdout


def test_sweep_rejects_unknown_names():
    out = subprocess.run([sys.executable, str(SCRIPT), "--methods", "nope"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "unknown method ids" in out.stderr
