"""Experiment 1 additions (docs/DESIGN.md §4): codebook-generalization gap and group-size sensitivity.

**Codebook-generalization gap.** A method's data-dependent state (codebooks, calibration statistics) is
fitted with :meth:`~kvqbench.quantizers.base.Quantizer.fit` on a *fit* batch A and applied to an
independent *evaluation* batch B with shifted statistics; it is compared with the same method fitted on B
itself (in-sample). For K and V separately::

    gap = rel_MSE(B | fitted on A) − rel_MSE(B | fitted on B)

(relative MSE = MSE / mean(x²) of B, so the gap is the MSE difference in units of B's energy).
``fit`` is called for every method, local or not, on a fresh copy of the configured instance — no
special case: a method whose statistics are local to the tensor it quantizes (``local_stats = True``)
ignores the fit data, so both round-trips are the same computation and the gap is exactly 0.

Batches:

* synthetic — A is the cell's data (seed ``s``); B is drawn with seed ``s + EVAL_SEED_OFFSET`` and
  shifted statistics (:data:`SYNTHETIC_SHIFT`: a lighter norm tail σ = 0.25 instead of 1.0, outlier-channel
  gain 5 instead of 10, and, through the different seed, different outlier channels). A lighter tail
  moves B's normalized values (each vector scaled to [−1, 1]) away from 0, where a codebook fitted on the
  heavy-tailed A has few centroids — a shift that a fitted codebook measurably does not follow (a
  *heavier* tail for B mostly moves mass to where A's centroids already are and gives gaps of either
  sign, within the noise of the in-sample fit);
* real — the same layers, tokens split in halves: A = the first half ``[0, T/2)``, B = the second half
  ``[T/2, T)`` (statistics drift along the text). Pre-RoPE keys, squared gradients and RoPE tables are
  split with them.

**Group-size sensitivity.** For methods with ``grouped = True``, the reconstruction MSE / relative MSE of K
and V at group sizes 32/64/128 (one cell per group size, the ``group_size`` variant axis).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from kvqbench.data.memory import release_after
from kvqbench.data.synthetic import make_synthetic
from kvqbench.data.types import KVData
from kvqbench.experiments.common import roundtrip_kv
from kvqbench.experiments.reconstruction import CellResult, input_stats
from kvqbench.numerics import metrics as M
from kvqbench.quantizers.base import Quantizer

__all__ = [
    "EVAL_SEED_OFFSET",
    "SYNTHETIC_SHIFT",
    "GROUP_SIZES",
    "fit_eval_batches",
    "fit_on",
    "codebook_gap",
    "run_codebook_gap",
    "run_group_size",
]

EXPERIMENT = "exp1"
#: the evaluation batch of a synthetic cell with seed s is drawn with seed s + this offset
EVAL_SEED_OFFSET = 1_000_003
#: generator arguments that shift the evaluation batch's statistics (synthetic)
SYNTHETIC_SHIFT: dict[str, float] = {"norm_sigma": 0.25, "channel_gain": 5.0}
#: group sizes of the sensitivity sweep
GROUP_SIZES: tuple[int, ...] = (32, 64, 128)


def _split_tokens(data: KVData, start: int, stop: int) -> KVData:
    t = slice(start, stop)

    def cut(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[..., t, :].contiguous()

    meta = {**data.meta, "token_range": [start, stop]}
    return dataclasses.replace(
        data, k=cut(data.k), v=cut(data.v), q=cut(data.q), k_pre=cut(data.k_pre),
        cos=cut(data.cos), sin=cut(data.sin),
        k_grad2=cut(data.k_grad2), v_grad2=cut(data.v_grad2), meta=meta,
    )


def fit_eval_batches(data: KVData) -> tuple[KVData, KVData]:
    """The (fit batch A, evaluation batch B) of a data source (see module doc).

    Raises:
        ValueError: a real source with fewer than 2 tokens, or synthetic data without its generator
            parameters in ``meta``.
    """
    if data.source == "synthetic":
        keys = ("batch", "kv_heads", "q_heads", "seq_len", "head_dim", "n_outlier_channels")
        if any(k not in data.meta for k in keys) or "seed" not in data.meta:
            raise ValueError("synthetic data lacks its generator parameters in meta; use make_synthetic")
        spec = {k: data.meta[k] for k in keys}
        shifted = make_synthetic(seed=int(data.meta["seed"]) + EVAL_SEED_OFFSET, device=data.k.device,
                                 **spec, **SYNTHETIC_SHIFT)
        return data, shifted
    t = int(data.k.shape[-2])
    if t < 2:
        raise ValueError(f"the token-halves split needs at least 2 tokens, got {t}")
    h = t // 2
    return _split_tokens(data, 0, h), _split_tokens(data, h, t)


def fit_on(method: Quantizer, data: KVData) -> Quantizer:
    """A fresh copy of ``method`` with :meth:`~kvqbench.quantizers.base.Quantizer.fit` called on
    ``data`` (pre-RoPE keys and Fisher weights where the method and the source have them). Called for
    every method; a local method's ``fit`` is a no-op."""
    m = copy.deepcopy(method)
    pre = m.k_pre_rope and data.k_pre is not None
    m.fit(k=data.k_for(m.k_pre_rope), v=data.v, k_grad2=data.k_grad2 if pre else None, v_grad2=data.v_grad2)
    return m


@torch.no_grad()
def codebook_gap(method: Quantizer, fit_batch: KVData, eval_batch: KVData) -> dict[str, float]:
    """Cross minus in-sample relative MSE on ``eval_batch`` for K and V.

    Returns:
        ``{"k_codebook_gap", "v_codebook_gap", "codebook_gap" (mean of K and V), "k_rel_mse_cross",
        "k_rel_mse_in", "v_rel_mse_cross", "v_rel_mse_in"}`` — dimensionless.
    """
    cross = roundtrip_kv(fit_on(method, fit_batch), eval_batch, fit=False)
    within = roundtrip_kv(fit_on(method, eval_batch), eval_batch, fit=False)
    out: dict[str, float] = {}
    for kv, x, xc, xi in (("k", eval_batch.k, cross.k_hat, within.k_hat), ("v", eval_batch.v, cross.v_hat, within.v_hat)):
        c, i = M.rel_mse(x, xc), M.rel_mse(x, xi)
        out[f"{kv}_rel_mse_cross"] = c
        out[f"{kv}_rel_mse_in"] = i
        out[f"{kv}_codebook_gap"] = c - i
    out["codebook_gap"] = 0.5 * (out["k_codebook_gap"] + out["v_codebook_gap"])
    return out


def _describe(batch: KVData) -> dict:
    if "token_range" in batch.meta:
        return {"token_range": list(batch.meta["token_range"])}
    return {"seed": batch.meta.get("seed"), "norm_sigma": batch.meta.get("norm_sigma"),
            "channel_gain": batch.meta.get("channel_gain")}


@release_after  # the cell's temporaries: kvqbench.data.memory
@torch.no_grad()
def run_codebook_gap(method: Quantizer, data: KVData) -> CellResult:
    """The codebook-generalization gap cell (experiment ``exp1``), per layer for real data.

    Args:
        method: a configured quantizer (not modified: fits happen on copies).
        data: the cell's data ``(batch|layers, kv_heads, seq_len, head_dim)``.
    Returns:
        :class:`~kvqbench.experiments.reconstruction.CellResult` with ``k_codebook_gap``,
        ``v_codebook_gap``, ``codebook_gap`` (per-layer lists for real data) and the cross / in-sample
        relative MSEs in ``extra``. Exactly 0 for methods whose ``fit`` is a no-op.
    """
    fit_b, eval_b = data.cached("exp1_fit_eval_batches", lambda: fit_eval_batches(data), scope="exp1_codebook_gap")
    res = CellResult()
    # one codebook per layer (index of dim 0): fit on all layers at once, then read the error per layer
    cross = roundtrip_kv(fit_on(method, fit_b), eval_b, fit=False)
    within = roundtrip_kv(fit_on(method, eval_b), eval_b, fit=False)
    cross.tally(res.extra)
    within.tally(res.extra)
    for kv, xc, xi in (("k", cross.k_hat, within.k_hat), ("v", cross.v_hat, within.v_hat)):
        x, _, energy = input_stats(eval_b, kv)  # fp64 and its energy once per data (shared by every method)
        c = M.rel_mse_of(M.mse_layers(x, xc), energy)
        i = M.rel_mse_of(M.mse_layers(x, xi), energy)
        res.add(f"{kv}_codebook_gap", [a - b for a, b in zip(c, i)])
        res.extra[f"{kv}_rel_mse_cross"] = sum(c) / len(c)
        res.extra[f"{kv}_rel_mse_in"] = sum(i) / len(i)
    res.add("codebook_gap", [0.5 * (a + b) for a, b in zip(res.per_layer["k_codebook_gap"],
                                                           res.per_layer["v_codebook_gap"])])
    res.extra["fit_batch"] = _describe(fit_b)
    res.extra["eval_batch"] = _describe(eval_b)
    res.extra["local_stats"] = bool(method.local_stats)
    return res


@release_after  # the cell's temporaries: kvqbench.data.memory
@torch.no_grad()
def run_group_size(method: Quantizer, data: KVData) -> CellResult:
    """The group-size sensitivity cell: reconstruction error of ``method`` (configured with its
    ``group_size``) on ``data``.

    Returns:
        :class:`CellResult` with ``gs_k_rel_mse``, ``gs_v_rel_mse``, ``gs_rel_mse`` (mean of K and V),
        ``gs_k_mse``, ``gs_v_mse`` and ``gs_bits_effective`` (experiment ``exp1``), per layer.
    Raises:
        ValueError: the method has no ``group_size`` (``grouped`` is False).
    """
    if not getattr(method, "grouped", False) or not hasattr(method, "group_size"):
        raise ValueError(f"{method.id} is not a grouped method (no group_size to sweep)")
    rt = roundtrip_kv(method, data)
    res = CellResult()
    rt.tally(res.extra)
    for kv, x_hat in (("k", rt.k_hat), ("v", rt.v_hat)):
        x, _, energy = input_stats(data, kv)  # fp64 and its energy once per data (shared by every method)
        mse = M.mse_layers(x, x_hat.to(torch.float64))
        res.add(f"gs_{kv}_mse", mse.tolist())
        res.add(f"gs_{kv}_rel_mse", M.rel_mse_of(mse, energy))
    res.add("gs_rel_mse", [0.5 * (a + b) for a, b in zip(res.per_layer["gs_k_rel_mse"], res.per_layer["gs_v_rel_mse"])])
    res.metrics["gs_bits_effective"] = 0.5 * (rt.k_bits_effective + rt.v_bits_effective)
    res.extra["group_size"] = int(method.group_size)
    return res
