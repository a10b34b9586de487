"""Experiment 2 cells: accumulation of the attention error with context length (docs/DESIGN.md §4).

One case per (method × bits × seed × source × size); both regimes (static, pseudo-decode) in each cell.
Bits swept: 2 and 4 (the regime where the error accumulates visibly; exactness at 16 bits is covered by
exp1 and by the fp16 control here).
"""

import math

import pytest

from kvqbench.experiments.accumulation import CONFIG_BY_SIZE, REGIMES, run_accumulation
from kvqbench.experiments.common import check_roundtrip_finite


@pytest.mark.kvq(experiment="exp2", bits=(2, 4))
def test_accumulation(cell, kvq_run, kvq_record):
    res = kvq_run(run_accumulation, CONFIG_BY_SIZE[cell.size])
    kvq_record(res)
    check_roundtrip_finite(res, cell.method)
    bad = {k: v for k, v in res.metrics.items() if not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
    for regime in REGIMES:
        m = res.metrics
        assert m[f"{regime}_attn_kl_fwd_nats"] >= 0 and m[f"{regime}_attn_kl_rev_nats"] >= 0
        total = m[f"{regime}_logit_bias2"] + m[f"{regime}_logit_var"]
        assert math.isclose(total, m[f"{regime}_logit_mse"], rel_tol=1e-9, abs_tol=1e-12)
        if cell.method == "fp16":
            zeros = {k: v for k, v in m.items() if k.startswith(regime) and "bits" not in k and v != 0.0}
            assert not zeros, f"fp16 control must accumulate exactly 0 error: {zeros}"
