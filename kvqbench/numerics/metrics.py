"""Tensor-level error metrics (torch). Pure functions on ``(batch, kv_heads, seq_len, head_dim)``.

Invariant (tested): per token, ``E_T = ‖x̂−x‖² = E_M + E_D`` with ``E_M = (‖x̂‖−‖x‖)²`` and
``E_D = 2‖x‖‖x̂‖(1−cos θ)`` — an exact identity (law of cosines).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["mse", "rel_mse", "error_split", "em_share_at_quantiles", "norm_bias", "per_layer", "TokenErrors",
           "token_errors", "em_share_of_split", "rel_mse_of", "norm_bias_of_norms"]


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


def mse_layers(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """:func:`mse` of every index of dim 0, fp64 ``(batch,)``."""
    return ((_f64(x_hat) - _f64(x)) ** 2).mean(dim=_dims(x))


_mse_layers = mse_layers


def mse_per_layer(x: torch.Tensor, x_hat: torch.Tensor) -> list[float]:
    """:func:`mse` of every index of dim 0, as a list."""
    return _mse_layers(x, x_hat).tolist()


def rel_mse_per_layer(x: torch.Tensor, x_hat: torch.Tensor) -> list[float]:
    """:func:`rel_mse` of every index of dim 0, as a list (0 where the error is 0)."""
    return rel_mse_of(_mse_layers(x, x_hat), energy_per_layer(x))


def energy_per_layer(x: torch.Tensor) -> torch.Tensor:
    """``mean(x²)`` of every index of dim 0, fp64 ``(batch,)`` (the denominator of :func:`rel_mse`)."""
    return (_f64(x) ** 2).mean(dim=_dims(x))


def rel_mse_of(num: torch.Tensor, den: torch.Tensor) -> list[float]:
    """``num / den`` per layer as a list, 0 where ``num`` is 0 (per-layer MSEs and :func:`energy_per_layer`)."""
    return torch.where(num == 0, torch.zeros_like(num), num / den.clamp_min(1e-300)).tolist()


def norm_bias_per_layer(x: torch.Tensor, x_hat: torch.Tensor) -> list[float]:
    """:func:`norm_bias` of every index of dim 0, as a list (0 for a layer without a non-zero token)."""
    return norm_bias_of_norms(_f64(x).norm(dim=-1), _f64(x_hat).norm(dim=-1))


def norm_bias_of_norms(nx: torch.Tensor, ny: torch.Tensor) -> list[float]:
    """:func:`norm_bias_per_layer` from the token norms ``nx`` (input) and ``ny`` (reconstruction),
    ``(batch, kv_heads, seq_len)`` fp64."""
    nx, ny = nx.flatten(1), ny.flatten(1)
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
    return em_share_of_split(e_t, e_m, quantiles)


def em_share_of_split(e_t: torch.Tensor, e_m: torch.Tensor,
                      quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[float, float]:
    """:func:`em_share_at_quantiles` from the per-token ``E_T`` and ``E_M`` (any shape, pooled)."""
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


@dataclass
class TokenErrors:
    """The error terms of one reconstruction that several metrics share, each computed once (fp64).

    Attributes:
        mse: ``(batch,)`` mean squared error per index of dim 0 (as :func:`mse_per_layer`).
        e_t: ``(batch, kv_heads, seq_len)`` per-token ``E_T = ‖x̂ − x‖²`` (as :func:`error_split`).
        e_m: same shape, ``E_M = (‖x̂‖ − ‖x‖)²``.
        nx, ny: same shape, the token norms ``‖x‖`` and ``‖x̂‖``.
        diff: ``x̂ − x`` ``(batch, kv_heads, seq_len, head_dim)``.
        sq: its element-wise square ``(x̂ − x)²``.
    """

    mse: torch.Tensor
    e_t: torch.Tensor
    e_m: torch.Tensor
    nx: torch.Tensor
    ny: torch.Tensor
    diff: torch.Tensor
    sq: torch.Tensor


def token_errors(x: torch.Tensor, x_hat: torch.Tensor, nx: torch.Tensor | None = None) -> TokenErrors:
    """:class:`TokenErrors` of ``x_hat`` against ``x`` ``(batch, kv_heads, seq_len, head_dim)``: one
    difference, one square and one norm of ``x_hat`` for all of them (the values of :func:`mse_per_layer`,
    :func:`error_split`, :func:`norm_bias_per_layer`, bit for bit). ``nx``: ``x``'s token norms when
    already computed (e.g. shared by every method's cell on the same data)."""
    xf, yf = _f64(x), _f64(x_hat)
    diff = yf - xf
    sq = diff * diff
    nx = xf.norm(dim=-1) if nx is None else nx
    ny = yf.norm(dim=-1)
    return TokenErrors(sq.mean(dim=_dims(x)), sq.sum(-1), (ny - nx) ** 2, nx, ny, diff, sq)


_BATCHED = {mse: mse_per_layer, rel_mse: rel_mse_per_layer, norm_bias: norm_bias_per_layer}
__all__ += ["mse_per_layer", "rel_mse_per_layer", "norm_bias_per_layer", "energy_per_layer", "mse_layers"]
