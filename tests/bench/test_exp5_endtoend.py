"""Experiment 5 cells: end-to-end damage on the real model (docs/DESIGN.md §4).

One case per (method × bits × window) on the real source only (``--kvq-real``); the seed is the window of
the exp5 text (the same text for every setting; full cells sweep ``--kvq-windows``, 16 by default) and
seeds random methods. Bits swept by default: 2 and 4, like experiment 2 (16 bits is exact
for every method), and 8 for the methods whose 8-bit cache fits the largest matched budget (8.25 bits per
element; :func:`kvqbench.plugin.collection.fits_largest_budget`), so that budget ranks on a measured
8-bit KL; ``--kvq-bits`` overrides all of it. The cells of one method and bits at the seeds of a group
(``kvq_seed_rows``: runs of three windows) run as the rows of one batch, each row with its own method and
cache (:func:`~kvqbench.experiments.endtoend.run_endtoend_rows`), computed by whichever of them runs
first: the values are those of one window at a time, in less time.
"""

import math

import pytest

from kvqbench.experiments.common import check_roundtrip_finite
from kvqbench.experiments.endtoend import CONFIG_BY_SIZE, REGIMES, run_endtoend_rows


@pytest.mark.kvq(experiment="exp5", bits=(2, 4), budget_bits=(8,), sources=("real",))
def test_endtoend(cell, kvq_model, kvq_record, kvq_seed_rows):
    def windows(methods, seeds):  # window i = seed i
        return run_endtoend_rows(methods, kvq_model, seeds, CONFIG_BY_SIZE[cell.size])

    res = kvq_seed_rows(windows)
    kvq_record(res)
    check_roundtrip_finite(res, cell.method)
    assert res.extra["window_index"] == cell.seed
    bad = {k: v for k, v in res.metrics.items() if not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
    for regime in REGIMES:
        m = {k.removeprefix(f"e2e_{regime}_"): v for k, v in res.metrics.items() if k.startswith(f"e2e_{regime}_")}
        assert m["kl_nats"] >= 0 and m["kl_p99_nats"] >= 0
        assert 0.0 <= m["top1_agree"] <= 1.0
        if cell.method == "fp16":
            assert (m["kl_nats"], m["kl_p99_nats"], m["top1_agree"], m["dloss_nats"]) == (0.0, 0.0, 1.0, 0.0)
