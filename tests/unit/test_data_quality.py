"""The ``mse_monotone_in_bits`` data-quality flag: it flags an MSE that grows from b to m·b bits (the
b-bit min/max grid is nested in the m·b-bit one, so that is never legitimate) and only notes growth
between non-nested widths, which a per-tensor RTN really shows on heavy-tailed keys."""

from __future__ import annotations

from kvqbench.data.synthetic import make_synthetic
from kvqbench.quantizers import create
from kvqbench.report.stats.quality import data_quality

BITS = (2, 3, 4, 8)


def _records(method: str, k_mse: dict[int, float]) -> list[dict]:
    return [{"experiment": "exp1", "method": method, "k_bits": b, "v_bits": b, "seed": 2, "source": "synthetic",
             "variant": {}, "status": "passed", "nodeid": f"{method}-k{b}v{b}",
             "metrics": {"k_mse": e, "v_mse": 0.0}} for b, e in k_mse.items()]


def _flag(records: list[dict]) -> dict:
    return {f["name"]: f for f in data_quality(records)}["mse_monotone_in_bits"]


def test_per_tensor_rtn_on_heavy_tailed_keys_is_noted_not_flagged():
    # synthetic keys with 10x outlier channels (the full synthetic shape, seed 2): per-tensor min/max RTN
    k = make_synthetic(seed=2, kv_heads=4, q_heads=8, seq_len=2048).k
    mse = {b: float(((create("rtn_tensor", b, b).roundtrip(k, "k").double() - k.double()) ** 2).mean()) for b in BITS}
    assert mse[3] > mse[2]  # the level nearest 0 moves away from 0 at 3 bits: a real, expected increase
    assert mse[4] <= mse[2] and mse[8] <= mse[4]  # nested grids: never worse
    f = _flag(_records("rtn_tensor", mse))
    assert f["ok"] is True and f["offenders"] == []
    assert any("rtn_tensor/k/seed2: 2→3 bits" in n for n in f["noted"])


def test_growth_between_nested_widths_is_flagged():
    f = _flag(_records("broken", {2: 1.0, 3: 0.5, 4: 2.0, 8: 0.1}))  # 2 → 4 bits got worse
    assert f["ok"] is False
    assert f["offenders"] == ["synthetic/broken/k/seed2: 2→4 bits MSE 1→2"]
    assert any("3→4" in n for n in f["noted"])  # adjacent, not nested: noted
    assert _flag(_records("fine", {2: 4.0, 3: 2.0, 4: 1.0, 8: 0.0}))["ok"] is True
    assert "noted" not in _flag(_records("fine", {2: 4.0, 3: 2.0, 4: 1.0, 8: 0.0}))
