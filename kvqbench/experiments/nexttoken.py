"""Next-token damage of a model's logits against an unquantized reference's (experiments 5 and 6), in
float64, a few rows at a time so a 262k vocabulary costs small temporaries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvqbench.numerics.attention import kl_rows

__all__ = ["ReferenceSide", "reference_side", "next_token_metrics", "block_metrics"]


@dataclass(frozen=True)
class ReferenceSide:
    """The unquantized side of :func:`next_token_metrics` for some positions, computed once and shared
    by every method's cell on the same text: the logits ``(positions, vocab)`` fp32, the top-1 tokens
    and the cross-entropy of the true next tokens ``(positions,)`` fp64."""

    logits: torch.Tensor
    top1: torch.Tensor
    nll: torch.Tensor


def reference_side(logits_ref: torch.Tensor, targets: torch.Tensor) -> ReferenceSide:
    """:class:`ReferenceSide` of the unquantized ``logits_ref`` ``(positions, vocab)`` and the true next
    tokens ``targets`` ``(positions,)`` (cross-entropy in float64, :data:`_METRIC_ROWS` rows at a time)."""
    t = targets.to(logits_ref.device).long()[:, None]
    nll = [-torch.log_softmax(logits_ref[r:r + _METRIC_ROWS].double(), -1).gather(-1, t[r:r + _METRIC_ROWS])[:, 0]
           for r in range(0, int(logits_ref.shape[0]), _METRIC_ROWS)]
    nll_all = torch.cat(nll) if nll else torch.zeros(0, dtype=torch.float64)
    return ReferenceSide(logits_ref.float(), logits_ref.argmax(-1), nll_all)


#: rows of :func:`next_token_metrics`' fp64 work at a time (2 × vocab 49 152 × 8 B ≈ 0.8 MB)
_METRIC_ROWS = 2


def next_token_metrics(logits_ref: torch.Tensor | None, logits: torch.Tensor, targets: torch.Tensor, *,
                       reference: ReferenceSide | None = None) -> dict[str, Any]:
    """Next-token damage of ``logits`` against ``logits_ref`` ``(positions, vocab)``.

    ``targets`` ``(positions,)`` are the true next tokens. Computed in float64. Returns ``kl_nats``
    (mean over positions of ``KL(p‖p̂)``, ``p = softmax(logits_ref)``; each term ≥ 0), ``kl_p99_nats``
    (its 99th percentile over positions, linear interpolation), ``top1_agree`` (share of positions whose
    argmax agrees, in ``[0, 1]``), ``dloss_nats`` (mean cross-entropy of ``targets`` under ``logits``
    minus under ``logits_ref``), ``loss_ref_nats`` and the per-position KL list. ``reference``: the
    precomputed :func:`reference_side` of ``(logits_ref, targets)`` (the same values, computed once;
    ``logits_ref`` may then be ``None``).

    Raises:
        ValueError: neither ``logits_ref`` nor ``reference`` given.
    """
    if reference is None and logits_ref is None:
        raise ValueError("next_token_metrics needs logits_ref or reference")
    ref = reference_side(logits_ref, targets) if reference is None else reference
    return block_metrics(ref, [(0, int(logits.shape[0]), logits)], targets)


def block_metrics(ref: ReferenceSide, blocks: Any, targets: torch.Tensor) -> dict[str, Any]:
    """:func:`next_token_metrics` from the logits given as ``(a, b, logits[a:b])`` blocks covering the
    reference's positions in order; every value is per position, so the result does not depend on the
    blocking. The fp64 work runs :data:`_METRIC_ROWS` rows at a time (each row's values are the same as
    in one pass, but the temporaries stay small)."""
    t = targets.long()[:, None]
    kls, nlls, agree = [], [], []
    for a, b, lg in blocks:
        agree.append(ref.top1[a:b].to(lg.device) == lg.argmax(-1))
        for r in range(0, b - a, _METRIC_ROWS):
            x, y = a + r, min(a + r + _METRIC_ROWS, b)
            lp = torch.log_softmax(ref.logits[x:y].double(), -1)
            lq = torch.log_softmax(lg[r:r + y - x].double(), -1)
            kls.append(kl_rows(lp, lq.to(lp.device), lp.exp()))
            nlls.append(-lq.gather(-1, t[x:y].to(lq.device))[:, 0].to(lp.device))
    kl, nll = torch.cat(kls), torch.cat(nlls)
    agr = torch.cat(agree).double()
    return {"kl_nats": float(kl.mean()), "kl_p99_nats": float(torch.quantile(kl, 0.99)),
            "top1_agree": float(agr.mean()), "dloss_nats": float((nll - ref.nll.to(nll.device)).mean()),
            "loss_ref_nats": float(ref.nll.mean()), "kl_per_position": [float(v) for v in kl]}
