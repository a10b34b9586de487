"""Experiment 4 cells: cost — latency, throughput, bits, peak memory, compression (docs/DESIGN.md §4).

One seed (the cost does not depend on the data draw). Latency/throughput vary run to run (CPU timings
are flagged ``unreliable_timing``); see :data:`kvqbench.metrics.NONDETERMINISTIC_METRICS`. The round trip
is timed with pytest-benchmark's ``benchmark`` fixture (serial runs; it disables itself under xdist).
"""

import math

import pytest

from kvqbench.experiments.common import check_roundtrip_finite
from kvqbench.experiments.cost import CONFIG_BY_SIZE, run_cost


@pytest.mark.kvq(experiment="exp4", bits=(2, 4), single_seed=True)
def test_cost(cell, kvq_method, kvq_data, kvq_record, benchmark):
    benchmark.group = f"exp4-{cell.source}-{cell.size}-{cell.bits_tag}"
    benchmark.extra_info.update({"method": cell.method, "bits": cell.bits_tag, "source": cell.source})
    res = run_cost(kvq_method, kvq_data, CONFIG_BY_SIZE[cell.size], benchmark=benchmark)
    kvq_record(res)
    check_roundtrip_finite(res, cell.method)
    bad = {k: v for k, v in res.metrics.items() if not math.isfinite(v) or v < 0}
    assert not bad, f"non-finite or negative metrics: {bad}"
    assert math.isclose(res.metrics["compression_ratio"] * res.metrics["cost_bits_effective"], 16.0)
    if kvq_data.k.device.type == "cpu":
        assert res.extra["unreliable_timing"] is True
    # a round trip is a quantize then a dequantize: the three latencies share the clone denominator
    assert math.isclose(res.metrics["quant_latency_x_clone"] / res.metrics["quant_latency_ms"],
                        res.metrics["roundtrip_latency_x_clone"] / res.metrics["roundtrip_latency_ms"])
    assert res.extra["roundtrip_timer"] == ("median of repeats" if benchmark.disabled else "pytest-benchmark")
