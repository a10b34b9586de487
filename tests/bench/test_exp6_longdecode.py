"""Experiment 6 cells: long decode, free-running divergence, noise floor and passkey retrieval on the real
model (docs/DESIGN.md §4; :mod:`kvqbench.experiments.longdecode`).

Real source only (``--kvq-real``). Two tiers:

* ``long`` (``kvqbench run --long``, or ``pytest -m long --kvq-real``): one case per method × bits {2, 4}
  × seed; the seed picks the corpus prompt of the long text (and seeds random methods). The cells of one
  method and bits at the seeds of a group (``kvq_seed_rows``) run as the rows of one batch; the session's
  first seed also gets the noise-floor draws (one row per setting: they measure float noise, not texts).
* ``smoke`` (the test suite with ``--kvq-real``): the same computation on a text of 64 tokens (one passkey depth),
  one case per method at 2 bits and the first seed.
"""

import math

import pytest

from kvqbench.experiments.common import check_roundtrip_finite
from kvqbench.experiments.longdecode import run_longdecode_rows
from kvqbench.experiments.longtext import CONFIG_BY_SIZE


def _check(res, cell, cfg) -> None:
    check_roundtrip_finite(res, cell.method)
    bad = {k: v for k, v in res.metrics.items() if not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
    m = res.metrics
    assert m["long_kl_nats"] >= 0 and m["long_kl_last_quarter_nats"] >= 0
    assert 0.0 <= m["long_top1_last_quarter"] <= 1.0 and 0.0 <= m["free_match_share"] <= 1.0
    assert 0 <= m["free_first_divergence_tokens"] <= cfg.free_tokens
    curve = res.series["kl_curve"]
    assert curve["start"][0] == cfg.prefill - 1 and curve["stop"][-1] == cfg.length - 1
    if cell.method == "fp16":  # the control: bitwise the unquantized model under the same schedule
        assert (m["long_kl_nats"], m["long_kl_last_quarter_nats"], m["long_top1_last_quarter"]) == (0.0, 0.0, 1.0)
        assert m["free_first_divergence_tokens"] == cfg.free_tokens and m["free_match_share"] == 1.0
        assert m["passkey_logp_drop_nats"] == 0.0
        table = res.series["passkey"]
        for li, j in enumerate(table["scored"]):  # the method's prompt of each length is the reference's at its depth
            assert table["logp_nats"][li] == [table["logp_ref_nats"][li][j]]
            assert table["rank_worst"][li] == [table["rank_worst_ref"][li][j]]


@pytest.mark.kvq(experiment="exp6", bits=(2, 4), sources=("real",), sizes=("long",))
def test_longdecode(cell, kvq_model, kvq_record, kvq_seed_rows, kvq_settings):
    cfg = CONFIG_BY_SIZE[cell.size]

    def texts(methods, seeds):  # text i = seed i; the session's first seed gets the noise draws
        first = seeds[0] == min(kvq_settings.seeds)
        return run_longdecode_rows(methods, kvq_model, seeds, cfg, noise_rows=(0,) if first else ())

    res = kvq_seed_rows(texts)
    kvq_record(res)
    assert res.extra["text_seed"] == cell.seed
    _check(res, cell, cfg)


@pytest.mark.kvq(experiment="exp6", bits=(2,), sources=("real",), sizes=("smoke",), single_seed=True)
def test_longdecode_smoke(cell, kvq_method, kvq_model, kvq_record):
    cfg = CONFIG_BY_SIZE[cell.size]
    res = run_longdecode_rows([kvq_method], kvq_model, [cell.seed], cfg)[0]
    kvq_record(res)
    _check(res, cell, cfg)
    assert "long_kl_noise_sd_nats" in res.metrics
