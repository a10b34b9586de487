"""KVQuant (Hooper et al., arXiv:2401.18079): pre-RoPE per-channel K (§3.1, §3.2), per-token V, per-layer
non-uniform codebooks (§3.3) and per-vector dense-and-sparse outliers (§3.4).

A *vector* is one K channel over the tokens or one V token over head_dim. Per vector
(:func:`kvqbench.numerics.dense_sparse.quantize`): the ``round(outlier_frac/2 · n)`` smallest and largest
entries are kept exactly (§3.4); the rest's range ``[lo, hi]`` gives ``m = (hi + lo)/2``, ``r = (hi − lo)/2``,
``y = clamp((x − m)/r, −1, 1)``, which snaps to the nearest of the layer codebook's ``2^b`` levels (§3.3);
decode ``x̂ = c[q]·r + m`` and write the outliers back. Codebooks: 1-D k-means per layer on normalized dense
calibration values, Fisher-weighted when :meth:`KVQuant.fit` gets squared gradients (bits: docs/DESIGN.md §7.5).
"""

from __future__ import annotations

from typing import Any

import torch

from kvqbench.numerics import dense_sparse
from kvqbench.numerics.dense_sparse import outlier_count_per_tail
from kvqbench.numerics.kmeans import distinct_levels, kmeans_sorted
from kvqbench.quantizers.base import (
    Kind,
    QuantizedTensor,
    Quantizer,
    Stored,
    StreamPolicy,
    register,
    validate_kv,
)

__all__ = ["KVQuant", "outlier_count_per_tail", "distinct_levels"]

POINTER_BITS = 32
VALUE_BITS = 16


def _index_bits(n: int) -> int:
    return 16 if n <= 1 << 16 else 32


@register
class KVQuant(Quantizer):
    """KVQuant (arXiv:2401.18079): NUQ codebooks + per-vector dense-and-sparse outliers.

    Shapes: ``quantize(x, kind)`` takes ``(batch, kv_heads, seq_len, head_dim)`` fp32/fp16/bf16, the batch axis
    being the layer axis (one codebook per index of dim 0); computes in fp32; ``dequantize`` returns the input's
    shape, dtype and device. K is pre-RoPE (``k_pre_rope``: the harness supplies it and re-applies RoPE after).

    Args:
        k_bits, v_bits: code widths (1..8; >= 16 = exact passthrough). Default 3 (nuq3).
        outlier_frac: fraction of each vector kept as sparse outliers, half per tail (paper: 1 %); 0: none.
        attention_sink: keep the first token fp16 for K and V (paper's attention-sink-aware variant).
        kmeans_iters: maximum Lloyd iterations for the codebooks.
        calib_samples: per layer, at most this many normalized values feed k-means; ``None`` = all.
        seed: seed of the k-means subsample (``torch.Generator().manual_seed(seed)``).

    Raises:
        ValueError: bad parameters, bits 9..15; in :meth:`quantize`, a fitted codebook's layer count ≠ dim 0.
    """

    id = "kvquant"
    name = "KVQuant"
    paper = ("Hooper et al., KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache "
             "Quantization (NeurIPS 2024)")
    arxiv = "2401.18079"
    k_granularity = "per-channel (pre-RoPE) NUQ codebook per layer + 1% sparse outliers per channel"
    v_granularity = "per-token NUQ codebook per layer + 1% sparse outliers per token"
    rotation = False
    fidelity = "approximate"
    k_pre_rope = True
    local_stats = False
    deltas = (
        "Without squared gradients passed to fit() (synthetic data) the k-means is unweighted, not Fisher-weighted.",
        "Codebooks are fitted on an independent batch of the same source (synthetic: another seed; real: the "
        "next seq_len tokens, with their Fisher weights), not on a separate calibration corpus; a kind never "
        "fitted is fitted in-sample (unweighted) on the tensor being quantized.",
        "K's per-channel outliers and dense ranges are computed on the tensor being quantized, not calibrated "
        "offline; outliers are chosen by count (round(0.5% · n) per tail), not by a value threshold.",
        "Outlier values and normalization parameters are billed as fp16; outliers reconstruct exactly.",
        "k-means: weighted-quantile initialization, a seeded subsample of at most calib_samples values per "
        "layer, Lloyd iterations to convergence; zero or constant vectors get weight 0, and missing distinct "
        "levels are made by halving the widest gaps of [−1, 1].",
        "Q-Norm is not implemented; the attention-sink fp16 first token is an option, off by default.",
    )

    def __init__(self, k_bits: int = 3, v_bits: int | None = None, *, seed: int = 0, outlier_frac: float = 0.01,
                 attention_sink: bool = False, kmeans_iters: int = 100, calib_samples: int | None = 1 << 18) -> None:
        super().__init__(k_bits, v_bits, seed=seed)
        for ok, nm, val, want in (
            (isinstance(outlier_frac, (int, float)) and 0 <= float(outlier_frac) < 1, "outlier_frac", outlier_frac,
             "in [0, 1)"),
            (isinstance(attention_sink, bool), "attention_sink", attention_sink, "a bool"),
            (isinstance(kmeans_iters, int) and kmeans_iters >= 0, "kmeans_iters", kmeans_iters, "an int >= 0"),
            (calib_samples is None or (isinstance(calib_samples, int) and calib_samples >= 1), "calib_samples",
             calib_samples, "a positive int or None"),
        ):
            if not ok:
                raise ValueError(f"{nm} must be {want}, got {val!r}")
        self.outlier_frac, self.attention_sink = float(outlier_frac), attention_sink
        self.kmeans_iters, self.calib_samples = kmeans_iters, calib_samples
        self._codebooks: dict[str, torch.Tensor] = {}
        self._fisher: dict[str, bool] = {}

    def params(self) -> dict[str, Any]:
        return {**super().params(), **{nm: getattr(self, nm) for nm in
                                       ("outlier_frac", "attention_sink", "kmeans_iters", "calib_samples")}}

    def stream_policy(self, kind: Kind) -> StreamPolicy:
        """The first token stays fp16 when ``attention_sink`` is on; nothing else."""
        return StreamPolicy(sink_tokens=1 if self.attention_sink else 0)

    @property
    def fisher_weighted(self) -> dict[str, bool]:
        """kind → whether its fitted codebook used squared gradients."""
        return dict(self._fisher)

    def codebook(self, kind: Kind) -> torch.Tensor | None:
        """The fitted codebook ``[layers, 2^b]`` for ``kind`` (sorted), or ``None``."""
        return self._codebooks.get(kind)

    # --- layout --------------------------------------------------------------------------------
    def _body(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens that are quantized (drops the fp16 sink token)."""
        return x[:, :, 1:, :] if self.attention_sink else x

    @staticmethod
    def _vectors(x: torch.Tensor, kind: str) -> torch.Tensor:
        """``[B, n_vec, n]``: K channels over tokens (§3.1, a transposed copy), or V tokens over head_dim (§3.4)."""
        b_, h, t, d = x.shape
        return x.transpose(-1, -2).reshape(b_, h * d, t) if kind == "k" else x.reshape(b_, h * t, d)

    @staticmethod
    def _unvectors(vec: torch.Tensor, kind: str, shape: tuple[int, int, int, int]) -> torch.Tensor:
        b_, h, t, d = shape
        return vec.reshape(b_, h, d, t).transpose(-1, -2) if kind == "k" else vec.reshape(b_, h, t, d)

    # --- calibration -------------------------------------------------------------------------
    def _subsampled(self, shape: tuple[int, ...], kind: str) -> bool:
        """Whether k-means subsamples the dense values of a calibration tensor of ``shape``."""
        _, h, t, d = shape
        t -= int(self.attention_sink)
        n_vec, n = (h * d, t) if kind == "k" else (h * t, d)
        dense = n_vec * (n - 2 * outlier_count_per_tail(n, self.outlier_frac))
        return self.calib_samples is not None and dense > self.calib_samples

    def seeded_for(self, shape: tuple[int, ...]) -> bool:
        """``False`` for ``shape`` (or fewer tokens) if the K/V k-means read all dense values: no seeded subsample."""
        return len(shape) != 4 or any(self.bits_for(kind) < 16 and self._subsampled(tuple(shape), kind)
                                      for kind in ("k", "v"))  # type: ignore[arg-type]

    def _fit_codebook(self, x: torch.Tensor, kind: str, bits: int, grad2: torch.Tensor | None) -> torch.Tensor:
        """Per-layer codebook ``[B, 2^b]`` (§3.3), strictly increasing (:func:`distinct_levels`): k-means on the
        normalized dense values of ``x``, weighted by ``grad2`` (:func:`dense_sparse.calibration_samples`)."""
        vec = self._vectors(self._body(x).to(torch.float32), kind)
        w = None if grad2 is None else self._vectors(self._body(grad2).to(torch.float32), kind)
        samples = dense_sparse.calibration_samples(
            vec, outlier_count_per_tail(vec.shape[-1], self.outlier_frac), w,
            max_samples=self.calib_samples, generator=torch.Generator().manual_seed(self.seed))
        return distinct_levels(kmeans_sorted(samples, 2**bits, n_iter=self.kmeans_iters))

    @torch.no_grad()
    def fit(self, k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
            k_grad2: torch.Tensor | None = None, v_grad2: torch.Tensor | None = None, **calib: Any) -> "KVQuant":
        """Fit one codebook per layer (§3.3) for K (pre-RoPE) and/or V on calibration tensors ``(layers, kv_heads,
        seq_len, head_dim)`` (None: skipped), Fisher-weighted by squared gradients ``k_grad2``/``v_grad2`` (same
        shapes) if given; other ``calib`` is ignored. Returns ``self``; TypeError / ValueError: invalid input."""
        for kind, x, g in (("k", k, k_grad2), ("v", v, v_grad2)):
            if x is None:
                continue
            validate_kv(x, name=kind.upper())
            if g is not None:
                validate_kv(g, name=f"{kind}_grad2")
                if g.shape != x.shape:
                    raise ValueError(f"{kind}_grad2 shape {tuple(g.shape)} != {kind} shape {tuple(x.shape)}")
                g = g.abs()
            bits = self.bits_for(kind)  # type: ignore[arg-type]
            if bits >= 16 or (self.attention_sink and x.shape[2] < 2):
                continue
            self._codebooks[kind] = self._fit_codebook(x, kind, bits, g)
            self._fisher[kind] = g is not None
        return self

    # --- quantize / dequantize ----------------------------------------------------------------
    def _quantize(self, x: torch.Tensor, kind: Kind, bits: int) -> QuantizedTensor:
        qt = self._new_qt(x, kind, bits)
        xf = x.to(torch.float32)
        sink = (xf[:, :, :1, :].clone(),) if self.attention_sink else ()  # the attention sink stays fp16
        if sink:
            qt.fields["sink"] = Stored(sink[0], 16)
        body = self._body(xf)
        qt.meta["body_shape"] = tuple(body.shape)
        if body.shape[2] == 0:
            return qt
        cb = self._codebooks.get(kind)  # the layer codebooks (§3.3)
        qt.meta["codebook"] = "in-sample" if cb is None else "fisher" if self._fisher.get(kind) else "calibrated"
        if cb is None:
            cb = self._fit_codebook(x, kind, bits, None)
        cb = cb.to(device=x.device, dtype=torch.float32)
        if cb.shape[-1] != 2**bits or cb.shape[0] not in (1, x.shape[0]):
            raise ValueError(f"{kind} codebook {tuple(cb.shape)} needs {2**bits} levels for each of the tensor's "
                             f"{x.shape[0]} layers (dim 0 is the layer axis); fit on tensors like this one")
        cb = cb.expand(x.shape[0], -1)
        vec = self._vectors(body, kind)  # K per channel (§3.1), V per token
        n_vec, n = vec.shape[1:]
        codes, out_idx, mid, half, outlier_value = dense_sparse.quantize(  # outliers, normalize, snap (§3.4)
            vec, outlier_count_per_tail(n, self.outlier_frac), cb)
        qt.add_codes("codes", codes, bits)
        qt.fields.update(mid=Stored(mid, 16), half=Stored(half, 16), codebook=Stored(cb.clone(), 16))
        if out_idx.shape[-1]:  # the sparse store, CSR: values, indices inside the vector, pointers
            qt.fields["outlier_value"] = Stored(outlier_value.reshape(-1), VALUE_BITS)
            qt.fields["outlier_index"] = Stored(out_idx.reshape(-1).to(torch.int32), _index_bits(n))
            ptr = torch.arange(vec.shape[0] * n_vec + 1, device=x.device, dtype=torch.int64) * out_idx.shape[-1]
            qt.fields["outlier_ptr"] = Stored(ptr, POINTER_BITS)
        return qt

    def _dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
        parts = [qt["sink"]] if "sink" in qt.fields else []
        body_shape = qt.meta["body_shape"]
        if body_shape[2] > 0:
            codes = qt.codes("codes", torch.int64)  # [B, n_vec, n]
            levels = qt["codebook"].unsqueeze(1) * qt["half"] + qt["mid"]  # c·r + m per vector: [B, n_vec, 2^b]
            out = torch.gather(levels, -1, codes)  # x̂ = c[q]·r + m
            if "outlier_ptr" in qt.fields:  # the outliers written back exactly (every vector holds as many)
                idx = qt["outlier_index"].to(torch.int64).view(*codes.shape[:2], -1)
                out.scatter_(-1, idx, qt["outlier_value"].to(out.dtype).view(idx.shape))
            parts.append(self._unvectors(out, qt.kind, body_shape))
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    def nominal_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        """Codes ``b`` + per vector FP8 half-range + FP16 midpoint + per outlier (fp16 value + index)
        + 32-bit CSR pointers + the fp16 codebook + the fp16 sink token, over all elements."""
        b_, h, t, d = shape
        tb = t - 1 if self.attention_sink else t
        bits_sum = float(b_ * h * d * 16) if self.attention_sink else 0.0  # the fp16 sink token
        if tb > 0:
            n_vec, n = (h * d, tb) if kind == "k" else (h * tb, d)
            n_tail = outlier_count_per_tail(n, self.outlier_frac)
            bits_sum += b_ * n_vec * n * bits  # codes
            bits_sum += b_ * n_vec * (8 + 16)  # half-range (scale, FP8) + midpoint (zero, FP16)
            bits_sum += b_ * 2**bits * 16  # codebook
            if n_tail:
                bits_sum += b_ * n_vec * 2 * n_tail * (VALUE_BITS + _index_bits(n))
                bits_sum += (b_ * n_vec + 1) * POINTER_BITS
        return bits_sum / (b_ * h * t * d)
