"""Experiment 1 — reconstruction (docs/DESIGN.md §4).

For K and V separately: MSE, relative MSE, the per-token split ``E_T = E_M + E_D`` (magnitude vs
direction) summarized as ``E_M/E_T`` at the p50/p90/p99 of ``E_T``, the signed relative norm bias, and
the nominal/effective bits per element. Every value is computed per layer (index of dim 0; the synthetic
source has one) and summarized as the mean over layers, with the per-layer list kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvqbench.data.memory import release_after
from kvqbench.data.types import KVData
from kvqbench.experiments.common import as_f64, roundtrip_kv
from kvqbench.numerics import metrics as M
from kvqbench.quantizers.base import Quantizer

__all__ = ["CellResult", "run_reconstruction", "input_stats", "token_errors_of"]

EXPERIMENT = "exp1"


@dataclass
class CellResult:
    """What a cell records: summary metrics, per-layer values and extra JSON-able detail."""

    metrics: dict[str, float] = field(default_factory=dict)
    per_layer: dict[str, list[float]] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def add(self, name: str, layer_values: list[float]) -> None:
        self.per_layer[name] = [float(v) for v in layer_values]
        self.metrics[name] = float(sum(layer_values) / len(layer_values))


def input_stats(data: KVData, kv: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``data.<kv>`` in fp64, its token norms and its per-layer energy ``mean(x²)``, computed once per
    data object and shared by every method's cell on it (see :meth:`KVData.cached`)."""
    def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = as_f64(data, kv)
        return x, x.norm(dim=-1), M.energy_per_layer(x)

    return data.cached(("input_stats", kv), build)


def token_errors_of(data: KVData, kv: str, x_hat: torch.Tensor) -> tuple[M.TokenErrors, torch.Tensor]:
    """:func:`~kvqbench.numerics.metrics.token_errors` of a reconstruction of ``data.<kv>`` and the
    input's per-layer energy (the input side from :func:`input_stats`)."""
    x, nx, energy = input_stats(data, kv)
    return M.token_errors(x, x_hat, nx), energy


def _tensor_metrics(res: CellResult, kv: str, data: KVData, x_hat: torch.Tensor) -> None:
    # every metric from one set of per-token terms (one difference, one square, one norm of x̂)
    te, energy = token_errors_of(data, kv, x_hat)
    res.add(f"{kv}_mse", te.mse.tolist())
    res.add(f"{kv}_rel_mse", M.rel_mse_of(te.mse, energy))
    shares = [M.em_share_of_split(te.e_t[i], te.e_m[i]) for i in range(te.e_t.shape[0])]
    for q, tag in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        res.add(f"{kv}_em_share_{tag}", [s[q] for s in shares])
    res.add(f"{kv}_norm_bias", M.norm_bias_of_norms(te.nx, te.ny))


@release_after  # the cell's temporaries: kvqbench.data.memory
@torch.no_grad()
def run_reconstruction(method: Quantizer, data: KVData) -> CellResult:
    """Run experiment 1 for one method on one data source.

    Args:
        method: a configured quantizer (its ``k_bits``/``v_bits`` set the cell's bit-widths).
        data: K/V ``(batch|layers, kv_heads, seq_len, head_dim)``.
    Returns:
        :class:`CellResult` with the metrics named in :mod:`kvqbench.metrics` (experiment ``exp1``).
    """
    rt = roundtrip_kv(method, data)
    res = CellResult()
    rt.tally(res.extra)
    # fp64 once (the input's once per data, shared by every method's cell): the metrics compute in fp64
    _tensor_metrics(res, "k", data, rt.k_hat.to(torch.float64))
    _tensor_metrics(res, "v", data, rt.v_hat.to(torch.float64))
    shape = tuple(data.k.shape)
    res.metrics["k_bits_nominal"] = method.nominal_bits("k", shape)
    res.metrics["v_bits_nominal"] = method.nominal_bits("v", tuple(data.v.shape))
    res.metrics["k_bits_effective"] = rt.k_bits_effective
    res.metrics["v_bits_effective"] = rt.v_bits_effective
    res.metrics["rel_mse"] = 0.5 * (res.metrics["k_rel_mse"] + res.metrics["v_rel_mse"])
    res.per_layer["rel_mse"] = [
        0.5 * (a + b) for a, b in zip(res.per_layer["k_rel_mse"], res.per_layer["v_rel_mse"])
    ]
    res.metrics["bits_effective"] = 0.5 * (rt.k_bits_effective + rt.v_bits_effective)
    res.metrics["bits_nominal"] = 0.5 * (res.metrics["k_bits_nominal"] + res.metrics["v_bits_nominal"])
    return res
