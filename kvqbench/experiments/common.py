"""Shared plumbing of the experiments: round-tripping K and V of a data source through a method.

Pre- vs post-RoPE (docs/DESIGN.md §2): a method with ``k_pre_rope = True`` receives the pre-RoPE keys
where the data source has them, and its output is rotated back with the captured RoPE before being
compared with the cached keys. RoPE is orthogonal per pair, so reconstruction MSE is unaffected.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import torch

from kvqbench.data.types import KVData
from kvqbench.quantizers.base import QuantizedTensor, Quantizer

__all__ = ["RoundTrip", "as_f64", "check_positive_ints", "fit_method", "roundtrip_kv", "count_nonfinite", "tally_nonfinite", "check_roundtrip_finite",
           "NonFiniteRoundTrip", "ROUNDTRIP_NONFINITE"]

#: ``extra`` key of every experiment's result: ``{"k": n, "v": n}`` — non-finite (NaN/±inf) elements in the
#: reconstructions the experiment computed (summed over every round trip it made)
ROUNDTRIP_NONFINITE = "roundtrip_nonfinite"


class NonFiniteRoundTrip(ValueError):
    """A method's reconstruction K̂ or V̂ holds NaN or ±inf (see :func:`check_roundtrip_finite`)."""


def check_positive_ints(config: object, *names: str) -> None:
    """Validate an experiment config's integer knobs.

    Raises:
        ValueError: ``"NAME must be a positive int, got VALUE"`` for the first attribute of ``config`` in
            ``names`` that is not an ``int`` ≥ 1 (``bool`` is refused).
    """
    for name in names:
        v = getattr(config, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def count_nonfinite(x: torch.Tensor) -> int:
    """Number of NaN/±inf elements of ``x`` (any shape, any dtype).

    Fast path: one sum of ``x`` (in its own dtype; fp32 for 16-bit floats). A NaN or ±inf element makes
    the sum NaN or ±inf, so a finite sum means no non-finite element; a non-finite sum (a non-finite
    element, or finite ones whose sum overflows) falls back to the exact element count: one vectorized
    reduction instead of building ``isfinite``'s boolean mask.
    """
    if x.numel() == 0 or not (x.is_floating_point() or x.is_complex()):
        return 0
    wide = torch.float32 if x.is_floating_point() and x.element_size() < 4 else None
    if bool(torch.isfinite(x.sum(dtype=wide))):
        return 0
    return int(x.numel() - int(torch.isfinite(x).sum()))


def tally_nonfinite(extra: dict, *, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> None:
    """Add the non-finite element counts of reconstructions ``k``/``v`` to ``extra[ROUNDTRIP_NONFINITE]``."""
    d = extra.setdefault(ROUNDTRIP_NONFINITE, {"k": 0, "v": 0})
    if k is not None:
        d["k"] += count_nonfinite(k)
    if v is not None:
        d["v"] += count_nonfinite(v)


def check_roundtrip_finite(result, method_id: str) -> None:
    """Raise when an experiment's round trips were not finite.

    Args:
        result: an experiment's result (``extra`` holding :data:`ROUNDTRIP_NONFINITE`).
        method_id: named in the message.
    Raises:
        NonFiniteRoundTrip: K̂ or V̂ held NaN/±inf, e.g. ``"kivi: non-finite round trip (K̂: 12 NaN/inf
            elements, V̂: 0)"``.
        ValueError: the result does not say (the experiment did not tally its round trips).
    """
    d = (getattr(result, "extra", None) or {}).get(ROUNDTRIP_NONFINITE)
    if d is None:
        raise ValueError(f"{method_id}: the experiment did not record whether its round trip is finite")
    if d.get("k") or d.get("v"):
        raise NonFiniteRoundTrip(f"{method_id}: non-finite round trip (K̂: {d.get('k', 0)} NaN/inf elements, "
                                 f"V̂: {d.get('v', 0)})")



@dataclass
class RoundTrip:
    """K̂ (in the cached, post-RoPE space), V̂ and their representations."""

    k_hat: torch.Tensor
    v_hat: torch.Tensor
    k_qt: QuantizedTensor
    v_qt: QuantizedTensor

    def tally(self, extra: dict) -> None:
        """Add the non-finite counts of the round trip to ``extra`` (:func:`tally_nonfinite`)."""
        tally_nonfinite(extra, k=self.k_hat, v=self.v_hat)

    @property
    def k_bits_effective(self) -> float:
        return self.k_qt.effective_bits()

    @property
    def v_bits_effective(self) -> float:
        return self.v_qt.effective_bits()


def as_f64(data: KVData, name: str) -> torch.Tensor:
    """``data.<name>`` (e.g. ``"k"``, ``"v"``) in fp64, converted once per data object and shared by every
    method's cell on it (see :meth:`KVData.cached`; do not modify it in place). The fp64 metrics
    convert their inputs anyway; handing them fp64 tensors makes those conversions no-ops."""
    return data.cached(("fp64", name), lambda: getattr(data, name).to(torch.float64))


def fit_method(method: Quantizer, data: KVData, *, reuse: bool = True) -> Quantizer:
    """Fit a method's data-dependent state (codebooks) on ``data.calibration`` — an independent batch
    of the same source — or, when the source has none, on ``data`` itself (in-sample), with the squared
    gradients as Fisher weights where the source has them. A no-op for local methods.

    A fit is a deterministic function of the method's id and :meth:`~kvqbench.quantizers.base.Quantizer.params`
    and of the calibration batch, so its state is kept with that batch (:meth:`KVData.cached`) and copied
    into every later instance with the same id and parameters (e.g. the cells of the other experiments on
    the same data) instead of fitting again; ``reuse=False`` fits anyway (a timed fit) and keeps the state.
    """
    if not method.local_stats:
        cal = data.calibration if data.calibration is not None else data
        key = ("fitted_state", method.id, json.dumps(method.params(), sort_keys=True, default=str))
        state = cal.cache.get(key) if reuse else None
        if state is None:
            method.fit(
                k=cal.k_for(method.k_pre_rope),
                v=cal.v,
                k_grad2=cal.k_grad2 if (method.k_pre_rope and cal.k_pre is not None) else None,
                v_grad2=cal.v_grad2,
            )
            cal.cache[key] = copy.deepcopy(vars(method))
        else:
            vars(method).update(copy.deepcopy(state))
    return method


@torch.no_grad()
def roundtrip_kv(method: Quantizer, data: KVData, *, fit: bool = True) -> RoundTrip:
    """Quantize and dequantize ``data``'s K and V with ``method``.

    Returns K̂ mapped to the cached-key space (see module doc) and V̂, both
    ``(batch, kv_heads, seq_len, head_dim)`` in the data's dtype.
    """
    if fit:
        fit_method(method, data)
    k_in = data.k_for(method.k_pre_rope)
    k_qt = method.quantize(k_in, "k")
    v_qt = method.quantize(data.v, "v")
    k_hat = data.to_cached_k(method.dequantize(k_qt), method.k_pre_rope)
    v_hat = method.dequantize(v_qt)
    return RoundTrip(k_hat, v_hat, k_qt, v_qt)
