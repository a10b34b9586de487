"""Experiment 3 cells: outliers — norm-difference density, off-diagonal mass, tail magnitude share,
per-channel incoherence of the error (docs/DESIGN.md §4). Every method joins, so the metrics are ranked."""

import math

import pytest

from kvqbench.experiments.common import check_roundtrip_finite
from kvqbench.experiments.outliers import run_outliers


@pytest.mark.kvq(experiment="exp3", bits=(2, 4))
def test_outliers(cell, kvq_run, kvq_record):
    res = kvq_run(run_outliers)
    kvq_record(res)
    check_roundtrip_finite(res, cell.method)
    bad = {k: v for k, v in res.metrics.items() if not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
    for kv in ("k", "v"):
        assert math.isclose(sum(res.series[f"{kv}_norm_diff_density"]), 1.0, rel_tol=1e-9)
        assert 0.0 <= res.metrics[f"{kv}_offdiag_mass"] <= 1.0
    if cell.method == "fp16":
        assert res.metrics["offdiag_mass"] == 0.0
