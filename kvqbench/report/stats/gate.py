"""The compare gate's statistics (``kvqbench compare``, :mod:`kvqbench.results.compare`): a metric's BASE and
NEW values paired seed by seed. Torch-free."""

from __future__ import annotations

from typing import Any

from kvqbench.metrics import varies
from kvqbench.report.stats.headline import unit_of
from kvqbench.report.stats.intervals import units_of
from kvqbench.report.stats.paired import compare_gate
from kvqbench.report.stats.ranking import damage

__all__ = ["paired_change"]


def paired_change(name: str, spec: dict[str, Any], base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any] | None:
    """BASE and NEW of a ``float_noise`` metric paired seed by seed (:func:`~kvqbench.report.stats.paired.compare_gate`
    on the damage: the value, or ``|value|`` where 0 is best), with ``"unit"`` (:func:`~kvqbench.report.stats.headline.unit_of`);
    ``None`` for any other metric, a higher-is-better one, or one the ratio cannot take (a value below 0, no
    seed in common)."""
    better = spec.get("better", "lower")
    if varies(name, spec) != "float_noise" or better not in ("lower", "zero"):
        return None
    try:
        return {**compare_gate(damage(units_of(base), better), damage(units_of(new), better)), "unit": unit_of(name)}
    except ValueError:
        return None
