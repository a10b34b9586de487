"""Experiment 3 — outliers: where in the distribution of tokens and channels a method's error sits
(docs/DESIGN.md §4). Swept over every method and bit-width, ranked like the others.

For K and V separately (a token = one ``head_dim`` vector of one (layer, head, position)):

* **norm-difference density** — histogram of the per-token norm difference ``‖x̂‖ − ‖x‖``, expressed in
  units of the RMS token norm of its layer (``d = (‖x̂‖ − ‖x‖) / RMS_t ‖x_t‖``) so one fixed set of bin
  edges serves every model and layer: :data:`NORM_DIFF_EDGES` = 40 equal bins on ``[−0.2, 0.2]`` and, on
  each side, 16 bins growing by √2 out to ±51.2 (a 2-bit method can move a norm by many RMS units), plus
  an underflow and an overflow bin. Stored in ``series`` as shares of tokens (summing to 1); the
  figure chooses its x-range from the data.
* **off-diagonal mass** of the joint density of ``(‖x‖, ‖x̂‖)``: the share of tokens with
  ``|‖x̂‖/‖x‖ − 1| > τ``, :data:`TAU` = 0.1 (a 10 % norm change; tokens with ``‖x‖ = 0`` count when
  ``‖x̂‖ > 0``).
* **tail magnitude share** ``E_M/E_T`` at the top error quantiles p99 and p99.9: over the tokens whose
  ``E_T = ‖x̂ − x‖²`` is at or above that quantile, ``Σ E_M / Σ E_T`` with ``E_M = (‖x̂‖ − ‖x‖)²``
  (0 when those tokens carry no error) — is the worst error a norm error or a direction error?
* **per-channel incoherence** (``max_c m_c / RMS_c m``, ``m_c`` the RMS of channel ``c`` over tokens; see
  :func:`kvqbench.numerics.attention.incoherence`) of the **error** ``x̂ − x`` before and after a
  normalized Hadamard rotation along head_dim (:mod:`kvqbench.numerics.hadamard`): does a method's error
  pile up in a few channels, and would a rotation spread it? The incoherence of the input itself (before
  and after the rotation) is the same for every method, so it goes to ``extra["input_incoherence"]``
  rather than into the ranking. Mean over (layer, head).
* ``k_incoherence_shift`` — ``incoherence(K̂)/incoherence(K) − 1``: whether the reconstruction keeps the
  key outlier-channel structure (0 = kept).

Everything is computed in fp64, per layer (index of dim 0) and averaged.
"""

from __future__ import annotations

import torch

from kvqbench.data.memory import release_after
from kvqbench.data.types import KVData
from kvqbench.experiments.accumulation import SeriesCellResult
from kvqbench.experiments.common import roundtrip_kv
from kvqbench.experiments.reconstruction import input_stats
from kvqbench.numerics.attention import incoherence, incoherence_of_squares
from kvqbench.numerics.hadamard import hadamard_transform
from kvqbench.numerics.metrics import error_split, token_errors
from kvqbench.quantizers.base import Quantizer

__all__ = ["TAU", "NORM_DIFF_EDGES", "TAIL_QUANTILES", "norm_diff_density", "offdiag_mass",
           "tail_em_share", "run_outliers"]

EXPERIMENT = "exp3"
#: relative norm change beyond which a token is off the diagonal of the (‖x‖, ‖x̂‖) joint density
TAU = 0.1
#: fixed bin edges of the norm-difference density, in units of the layer's RMS token norm
_NORM_DIFF_TAIL = tuple(round(0.2 * 2 ** (i / 2), 10) for i in range(1, 17))  # 0.283 … 51.2
NORM_DIFF_EDGES: tuple[float, ...] = (tuple(-t for t in reversed(_NORM_DIFF_TAIL))
                                      + tuple(round(-0.2 + 0.01 * i, 10) for i in range(41)) + _NORM_DIFF_TAIL)
#: top error quantiles of the tail magnitude share (name → quantile)
TAIL_QUANTILES: dict[str, float] = {"p99": 0.99, "p999": 0.999}


def _norms(x: torch.Tensor, x_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.to(torch.float64).norm(dim=-1).reshape(-1), x_hat.to(torch.float64).norm(dim=-1).reshape(-1)


def norm_diff_density(x: torch.Tensor, x_hat: torch.Tensor,
                      edges: tuple[float, ...] = NORM_DIFF_EDGES) -> list[float]:
    """Shares of tokens per bin of ``(‖x̂‖ − ‖x‖)/RMS_t‖x_t‖``: ``[underflow, bin_0 … bin_{n−1}, overflow]``.

    Bins are ``[e_i, e_{i+1})`` (the last one closed). Sums to 1. ``x``, ``x_hat``:
    ``(batch, heads, seq_len, head_dim)``; all tokens pooled.
    """
    return _density_of_norms(*_norms(x, x_hat), edges)


def _density_of_norms(nx: torch.Tensor, ny: torch.Tensor, edges: tuple[float, ...]) -> list[float]:
    """:func:`norm_diff_density` from the flat fp64 token norms ``nx`` (input) and ``ny`` (reconstruction)."""
    rms = float(nx.pow(2).mean().sqrt())
    d = (ny - nx) / (rms if rms > 0 else 1.0)
    e = torch.tensor(edges, dtype=torch.float64, device=d.device)
    n = d.numel()
    under = int((d < e[0]).sum())
    over = int((d > e[-1]).sum())
    inside = d[(d >= e[0]) & (d <= e[-1])]
    idx = torch.bucketize(inside, e, right=True) - 1
    idx = idx.clamp(0, len(edges) - 2)  # the right edge belongs to the last bin
    counts = torch.bincount(idx, minlength=len(edges) - 1).tolist()
    return [c / n for c in [under, *counts, over]]


def offdiag_mass(x: torch.Tensor, x_hat: torch.Tensor, tau: float = TAU) -> float:
    """Share of tokens with ``|‖x̂‖/‖x‖ − 1| > tau`` (a token with ``‖x‖ = 0`` counts iff ``‖x̂‖ > 0``)."""
    return _offdiag_of_norms(*_norms(x, x_hat), tau)


def _offdiag_of_norms(nx: torch.Tensor, ny: torch.Tensor, tau: float) -> float:
    pos = nx > 0
    ratio_off = torch.where(pos, ((ny / nx.clamp_min(1e-300)) - 1.0).abs() > tau, ny > 0)
    return float(ratio_off.to(torch.float64).mean())


def tail_em_share(x: torch.Tensor, x_hat: torch.Tensor, quantile: float) -> float:
    """``Σ E_M / Σ E_T`` over the tokens whose ``E_T`` is at or above the ``quantile`` of ``E_T``
    (the top ``⌈(1 − quantile)·n⌉`` tokens, at least one); 0 when they carry no error."""
    _check_quantile(quantile)
    e_t, e_m, _ = error_split(x, x_hat)
    return _tail_share_of_split(e_t.reshape(-1), e_m.reshape(-1), quantile)


def _check_quantile(quantile: float) -> None:
    if not 0.0 <= quantile < 1.0:
        raise ValueError(f"quantile must be in [0, 1), got {quantile!r}")


def _tail_share_of_split(e_t: torch.Tensor, e_m: torch.Tensor, quantile: float) -> float:
    """:func:`tail_em_share` from the flat per-token ``E_T`` and ``E_M`` (:func:`error_split`)."""
    n = e_t.numel()
    k = max(1, n - int(quantile * n))
    top = torch.topk(e_t, k, sorted=False).indices
    tot = float(e_t[top].sum())
    return 0.0 if tot == 0.0 else float(e_m[top].sum()) / tot


def _mean_incoherence(x: torch.Tensor) -> float:
    return float(incoherence(x).mean())


def _incoherence_per_layer(x: torch.Tensor) -> list[float]:
    """:func:`_mean_incoherence` of every index of dim 0 (mean over heads), for all layers at once."""
    return incoherence(x).mean(-1).tolist()


@release_after  # the cell's temporaries: kvqbench.data.memory
@torch.no_grad()
def run_outliers(method: Quantizer, data: KVData) -> SeriesCellResult:
    """Run experiment 3 for one method on one data source.

    Args:
        method: a configured quantizer (fitted in-sample on ``data`` if data-dependent).
        data: K/V ``(batch|layers, kv_heads, seq_len, head_dim)``.
    Returns:
        :class:`~kvqbench.experiments.accumulation.SeriesCellResult` with the ``exp3`` metrics of
        :mod:`kvqbench.metrics` (per layer), the norm-difference densities in ``series`` and the input's
        incoherence in ``extra``.
    Raises:
        ValueError: a head_dim the Hadamard rotation cannot take (see :mod:`kvqbench.numerics.hadamard`).
    """
    rt = roundtrip_kv(method, data)
    res = SeriesCellResult()
    rt.tally(res.extra)
    layers = range(data.k.shape[0])
    res.series["norm_diff_edges"] = list(NORM_DIFF_EDGES)
    res.series["norm_diff_bins"] = "[underflow, one share per [e_i, e_i+1) bin, overflow]"
    inp: dict[str, float] = {}
    k_hat64 = rt.k_hat.to(torch.float64)
    for kv, x_hat in (("k", k_hat64), ("v", rt.v_hat)):
        # per layer, the token norms, the error split, the error x̂ − x and its square are computed once
        # (token_errors, in fp64) and shared by every metric; the input's fp64 copy and norms once per data
        x, nx_all, _ = input_stats(data, kv)
        dens, off, err_inc, err_inc_h = [], [], [], []
        tails: dict[str, list[float]] = {tag: [] for tag in TAIL_QUANTILES}
        for i in layers:  # layer by layer: the temporaries stay cache-sized
            te = token_errors(x[i : i + 1], x_hat[i : i + 1], nx_all[i : i + 1])
            nx, ny = te.nx.reshape(-1), te.ny.reshape(-1)
            dens.append(_density_of_norms(nx, ny, NORM_DIFF_EDGES))
            off.append(_offdiag_of_norms(nx, ny, TAU))
            e_t, e_m = te.e_t.reshape(-1), te.e_m.reshape(-1)
            for tag, q in TAIL_QUANTILES.items():
                tails[tag].append(_tail_share_of_split(e_t, e_m, q))
            err_inc.append(float(incoherence_of_squares(te.sq).mean()))
            err_inc_h.append(_mean_incoherence(hadamard_transform(te.diff)))
        res.series[f"{kv}_norm_diff_density"] = [sum(col) / len(dens) for col in zip(*dens)]
        res.add(f"{kv}_offdiag_mass", off)
        for tag in TAIL_QUANTILES:
            res.add(f"{kv}_tail_em_share_{tag}", tails[tag])
        res.add(f"{kv}_err_incoherence", err_inc)
        res.add(f"{kv}_err_incoherence_hadamard", err_inc_h)
        x_in = getattr(data, kv)  # the input's own dtype: its Hadamard rotation runs in that dtype
        inp.update(data.cached(("exp3_input_incoherence", kv), lambda x_in=x_in, kv=kv: {
            f"{kv}_incoherence": sum(_mean_incoherence(x_in[i : i + 1]) for i in layers) / len(layers),
            f"{kv}_incoherence_hadamard": sum(_mean_incoherence(hadamard_transform(x_in[i : i + 1]))
                                              for i in layers) / len(layers),
        }, scope="exp3"))
    k_inc = data.cached("exp3_k_incoherence_per_layer",
                        lambda: [_mean_incoherence(data.k[i : i + 1]) for i in layers], scope="exp3")
    res.add("k_incoherence_shift", [
        a / max(b, 1e-300) - 1.0 for a, b in zip(_incoherence_per_layer(k_hat64), k_inc)
    ])
    res.metrics["offdiag_mass"] = 0.5 * (res.metrics["k_offdiag_mass"] + res.metrics["v_offdiag_mass"])
    res.per_layer["offdiag_mass"] = [0.5 * (a + b) for a, b in zip(res.per_layer["k_offdiag_mass"],
                                                                    res.per_layer["v_offdiag_mass"])]
    res.extra["input_incoherence"] = inp
    res.extra["tau"] = TAU
    return res
