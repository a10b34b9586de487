"""Experiment 1 cells: reconstruction of K and V (docs/DESIGN.md §4).

One case per (method × bits × seed × source × size); the plugin parametrizes ``cell``.
"""

import math

import pytest

from kvqbench.experiments.common import check_roundtrip_finite
from kvqbench.experiments.reconstruction import run_reconstruction

pytestmark = pytest.mark.kvq(experiment="exp1")


def test_reconstruction(cell, kvq_run, kvq_record):
    res = kvq_run(run_reconstruction)
    kvq_record(res)
    check_roundtrip_finite(res, cell.method)
    bad = {k: v for k, v in res.metrics.items() if not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
    if cell.k_bits >= 16 and cell.v_bits >= 16:
        assert res.metrics["k_mse"] == 0.0 and res.metrics["v_mse"] == 0.0
    # the magnitude/direction split is an identity, so shares lie in [0, 1]
    for name, v in res.metrics.items():
        if "_em_share_" in name:
            assert -1e-9 <= v <= 1 + 1e-9, (name, v)
