"""The metric catalog: every metric is one record (name, unit, better-direction, description).

Torch-free, so reports can be rendered without torch. Experiments import the records they emit; the
renderer never hard-codes which way is better — it reads ``better`` from here (or from the catalog
copy saved in every results file).

``better``:
  * ``"lower"`` / ``"higher"`` — ranked ascending / descending;
  * ``"zero"`` — a signed quantity ranked by its distance from 0 (e.g. a bias).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

__all__ = ["Metric", "CATALOG", "register_metric", "get_metric", "rank_key", "catalog_dict"]

Better = Literal["lower", "higher", "zero"]


@dataclass(frozen=True)
class Metric:
    """One metric's record.

    Attributes:
        name: unique id used in results (units in the name where ambiguous).
        unit: unit string (``"1"`` for dimensionless ratios).
        better: ranking direction (see module doc).
        description: one line a reader of the leaderboard understands.
        experiment: the experiment that emits it (``exp1`` … ``exp4``).
        scale_free: comparable across layers/models (ranked on the mean over layers for real data).
        headline: shown in the summary tables.
    """

    name: str
    unit: str
    better: Better
    description: str
    experiment: str
    scale_free: bool = True
    headline: bool = False

    def __post_init__(self) -> None:
        if self.better not in ("lower", "higher", "zero"):
            raise ValueError(f"metric {self.name}: better must be lower/higher/zero, got {self.better!r}")


CATALOG: dict[str, Metric] = {}


def register_metric(m: Metric) -> Metric:
    """Add a metric to the catalog (error on a conflicting duplicate)."""
    prev = CATALOG.get(m.name)
    if prev is not None and prev != m:
        raise ValueError(f"metric {m.name!r} already registered with a different record")
    CATALOG[m.name] = m
    return m


def get_metric(name: str) -> Metric:
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}; known: {', '.join(sorted(CATALOG))}") from None


def rank_key(better: str, value: float) -> float:
    """Sort key so that ascending order = best first."""
    if better == "higher":
        return -value
    if better == "zero":
        return abs(value)
    return value


def catalog_dict() -> dict[str, dict]:
    """The catalog as JSON-able dicts (saved into every results file)."""
    return {k: asdict(v) for k, v in sorted(CATALOG.items())}


# ------------------------------------------------------------------------------------------------
# Experiment 1 — reconstruction (SPEC §4.1); emitted for K and V separately.
for _kv, _KV in (("k", "K"), ("v", "V")):
    register_metric(Metric(f"{_kv}_mse", "1 (squared units of the input)", "lower",
                           f"{_KV} mean squared error E[(x̂−x)²]", "exp1", scale_free=False))
    register_metric(Metric(f"{_kv}_rel_mse", "1", "lower",
                           f"{_KV} relative MSE: MSE / mean(x²)", "exp1", headline=True))
    for _q in ("p50", "p90", "p99"):
        register_metric(Metric(
            f"{_kv}_em_share_{_q}", "1", "lower",
            f"{_KV}: magnitude share E_M/E_T of the per-token error, at the {_q} of E_T "
            "(lower = the error is mostly direction, not norm)", "exp1"))
    register_metric(Metric(f"{_kv}_norm_bias", "1", "zero",
                           f"{_KV} signed relative norm shift mean((‖x̂‖−‖x‖)/‖x‖) (0 = unbiased)", "exp1"))
    register_metric(Metric(f"{_kv}_bits_nominal", "bits/element", "lower",
                           f"{_KV} nominal bits per element (FP8 scales, FP16 zero-points)", "exp1"))
    register_metric(Metric(f"{_kv}_bits_effective", "bits/element", "lower",
                           f"{_KV} effective bits per element as stored", "exp1"))
register_metric(Metric("rel_mse", "1", "lower", "mean of K and V relative MSE (headline quality)",
                       "exp1", headline=True))
register_metric(Metric("bits_effective", "bits/element", "lower",
                       "mean of K and V effective bits per element", "exp1", headline=True))
register_metric(Metric("bits_nominal", "bits/element", "lower",
                       "mean of K and V nominal bits per element", "exp1", headline=True))
