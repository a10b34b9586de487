"""Experiment 1 additions: the codebook-generalization gap (every method) and group-size sensitivity
(methods with ``grouped = True``, group sizes 32/64/128) — docs/DESIGN.md §4."""

import math

import pytest

from kvqbench.experiments.common import check_roundtrip_finite
from kvqbench.experiments.generalization import GROUP_SIZES, run_codebook_gap, run_group_size


@pytest.mark.kvq(experiment="exp1", bits=(2, 4))
def test_codebook_gap(cell, kvq_method, kvq_run, kvq_record):
    res = kvq_run(run_codebook_gap)
    kvq_record(res)
    check_roundtrip_finite(res, cell.method)
    bad = {k: v for k, v in res.metrics.items() if not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
    if kvq_method.local_stats:
        # the state does not depend on the fit data, so the two round-trips are the same computation
        assert res.metrics["k_codebook_gap"] == 0.0 and res.metrics["v_codebook_gap"] == 0.0


@pytest.mark.kvq(experiment="exp1", bits=(2,), variants={"group_size": GROUP_SIZES}, only="grouped",
                 single_seed=True)
def test_group_size(cell, kvq_method, kvq_data, kvq_record):
    res = run_group_size(kvq_method, kvq_data)
    kvq_record(res)
    check_roundtrip_finite(res, cell.method)
    assert res.extra["group_size"] == cell.variant_dict()["group_size"]
    bad = {k: v for k, v in res.metrics.items() if not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
