"""Tensor-level error metrics (torch). Pure functions on ``(batch, kv_heads, seq_len, head_dim)``.

Invariant (tested): per token, ``E_T = ‖x̂−x‖² = E_M + E_D`` with ``E_M = (‖x̂‖−‖x‖)²`` and
``E_D = 2‖x‖‖x̂‖(1−cos θ)`` — an exact identity (law of cosines).
"""

from __future__ import annotations

import torch

__all__ = ["mse", "rel_mse", "error_split", "em_share_at_quantiles", "norm_bias", "per_layer"]


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64)


def per_layer(fn, x: torch.Tensor, x_hat: torch.Tensor) -> list[float]:
    """Apply a scalar metric ``fn(x, x_hat)`` to each index of dim 0 (layers for real data).

    :func:`mse`, :func:`rel_mse` and :func:`norm_bias` are computed for every layer at once (one reduction
    and one transfer to Python for all layers); any other ``fn`` is applied layer by layer."""
    batched = _BATCHED.get(fn)
    if batched is not None:
        return batched(x, x_hat)
    return [float(fn(x[i : i + 1], x_hat[i : i + 1])) for i in range(x.shape[0])]


def _dims(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(1, x.dim()))


def _mse_layers(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    return ((_f64(x_hat) - _f64(x)) ** 2).mean(dim=_dims(x))


def mse_per_layer(x: torch.Tensor, x_hat: torch.Tensor) -> list[float]:
    """:func:`mse` of every index of dim 0, as a list."""
    return _mse_layers(x, x_hat).tolist()


def rel_mse_per_layer(x: torch.Tensor, x_hat: torch.Tensor) -> list[float]:
    """:func:`rel_mse` of every index of dim 0, as a list (0 where the error is 0)."""
    num = _mse_layers(x, x_hat)
    den = (_f64(x) ** 2).mean(dim=_dims(x))
    return torch.where(num == 0, torch.zeros_like(num), num / den.clamp_min(1e-300)).tolist()


def norm_bias_per_layer(x: torch.Tensor, x_hat: torch.Tensor) -> list[float]:
    """:func:`norm_bias` of every index of dim 0, as a list (0 for a layer without a non-zero token)."""
    nx = _f64(x).norm(dim=-1).flatten(1)
    ny = _f64(x_hat).norm(dim=-1).flatten(1)
    keep = nx > 0
    rel = torch.where(keep, (ny - nx) / nx.clamp_min(1e-300), torch.zeros_like(nx))
    cnt = keep.sum(-1)
    return torch.where(cnt > 0, rel.sum(-1) / cnt.clamp_min(1), torch.zeros_like(rel[:, 0])).tolist()


def mse(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Mean squared error ``mean((x̂ − x)²)`` in fp64 (squared input units)."""
    return float(((_f64(x_hat) - _f64(x)) ** 2).mean())


def rel_mse(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """``MSE / mean(x²)`` (dimensionless); 0 when both are 0."""
    den = float((_f64(x) ** 2).mean())
    num = mse(x, x_hat)
    return 0.0 if num == 0.0 else num / max(den, 1e-300)


def error_split(x: torch.Tensor, x_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(E_T, E_M, E_D)``, each of shape ``(batch, kv_heads, seq_len)`` fp64.

    ``E_D`` is computed as ``2(‖x‖‖x̂‖ − x·x̂)`` (equal to ``2‖x‖‖x̂‖(1−cos θ)`` and well defined for zero
    vectors), so ``E_M + E_D == E_T`` up to float rounding.
    """
    xf, yf = _f64(x), _f64(x_hat)
    nx = xf.norm(dim=-1)
    ny = yf.norm(dim=-1)
    e_t = ((yf - xf) ** 2).sum(-1)
    e_m = (ny - nx) ** 2
    e_d = 2.0 * (nx * ny - (xf * yf).sum(-1))
    return e_t, e_m, e_d


def em_share_at_quantiles(
    x: torch.Tensor, x_hat: torch.Tensor, quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)
) -> dict[float, float]:
    """``E_M/E_T`` of the token at each quantile of ``E_T`` (mean share over tokens whose ``E_T`` lies in
    the 1%-wide band ending at that quantile, for stability). 0 when there is no error at all."""
    e_t, e_m, _ = error_split(x, x_hat)
    e_t, e_m = e_t.reshape(-1), e_m.reshape(-1)
    out: dict[float, float] = {}
    if float(e_t.max()) == 0.0:
        return {q: 0.0 for q in quantiles}
    order = torch.argsort(e_t)
    n = e_t.numel()
    for q in quantiles:
        hi = min(n, max(1, int(round(q * n))))
        lo = max(0, hi - max(1, n // 100))
        idx = order[lo:hi]
        t = e_t[idx]
        share = torch.where(t > 0, e_m[idx] / torch.clamp(t, min=1e-300), torch.zeros_like(t))
        out[q] = float(share.mean())
    return out


def norm_bias(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Mean signed relative norm shift ``(‖x̂‖ − ‖x‖)/‖x‖`` over tokens with ``‖x‖ > 0``."""
    nx = _f64(x).norm(dim=-1)
    ny = _f64(x_hat).norm(dim=-1)
    keep = nx > 0
    if not bool(keep.any()):
        return 0.0
    return float(((ny - nx)[keep] / nx[keep]).mean())


_BATCHED = {mse: mse_per_layer, rel_mse: rel_mse_per_layer, norm_bias: norm_bias_per_layer}
__all__ += ["mse_per_layer", "rel_mse_per_layer", "norm_bias_per_layer"]
