"""Words on the figures that more than one figure uses: axis labels, regime titles, metric labels."""

from __future__ import annotations

from typing import Any

__all__ = ["CONTEXT_AXIS", "ERROR_AXIS", "REGIME_TITLE", "metric_label"]

#: x axis of every figure drawn against the context length
CONTEXT_AXIS = "context length (tokens)"

#: y axis of the attention figures, per kind of error (keys of :func:`series.error_kind`)
ERROR_AXIS = {"rel_mse": "attention-output relative MSE Σ(Ô−O)²/ΣO²", "mse": "attention-output MSE",
              "mae": "attention-output MAE", "cos": "cosine drift 1−cos(O, Ô)",
              "kl": "attention KL(p‖p̂) [nats]", "kl_rev": "reverse attention KL(p̂‖p) [nats]"}

#: panel title per regime of exp2 (keys of :func:`series.regime`)
REGIME_TITLE = {"static": "static (whole prefix quantized at once)",
                "pseudo-decode": "pseudo-decode (quantized block by block as it arrives)"}


def metric_label(name: str, catalog: dict[str, Any]) -> str:
    """``"name [unit]"`` with the unit from the leaderboard's metrics catalog, or the bare name."""
    unit = catalog.get(name, {}).get("unit", "")
    return f"{name} [{unit}]" if unit else name
