"""KVQuant — pre-RoPE per-channel keys, per-token values, non-uniform codebooks, dense-and-sparse outliers.

Based on Hooper et al., arXiv:2401.18079: §3.1 per-channel keys, §3.2 pre-RoPE keys, §3.3 non-uniform
codebooks (sensitivity-weighted k-means, one per layer), §3.4 per-vector dense-and-sparse quantization.

A *vector* is one K channel over the tokens or one V token over head_dim. Per vector (the reference step
:func:`kvqbench.numerics.dense_sparse.quantize`):

1. outliers: the ``n_tail = round(outlier_frac/2 · n)`` smallest and largest entries are kept exactly in a
   sparse side store (§3.4);
2. the dense range ``[lo, hi]`` of the rest gives ``m = (hi + lo)/2``, ``r = (hi − lo)/2`` and
   ``y = clamp((x − m)/r, −1, 1)``;
3. ``y`` snaps to the nearest of the ``2^b`` levels of the layer's codebook (§3.3); decode ``x̂ = c[q]·r + m``,
   then the outliers are written back.

Codebooks: weighted 1-D k-means on each layer's normalized dense calibration values, weighted by Fisher
information when :meth:`KVQuant.fit` gets ``k_grad2``/``v_grad2``, else unweighted; a kind never fitted is
fitted in-sample for that call only. Storage and bits (≈ 2.33 effective bits for K at nuq2, 1 %):
docs/DESIGN.md §7.5.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvqbench.numerics import dense_sparse
from kvqbench.numerics.kmeans import SortedSamples, distinct_levels, kmeans_sorted
from kvqbench.quantizers.base import (
    Kind,
    QuantizedTensor,
    Quantizer,
    Stored,
    StreamPolicy,
    check_finite,
    register,
    reuse,
    validate_kv,
)

__all__ = ["KVQuant", "outlier_count_per_tail", "distinct_levels"]

POINTER_BITS = 32
VALUE_BITS = 16


def outlier_count_per_tail(n: int, outlier_frac: float) -> int:
    """Outliers kept per tail of a vector of ``n`` entries: ``round_half_up(outlier_frac/2 · n)``,
    capped so at least one dense entry remains (``2·n_tail <= n − 1``)."""
    if n <= 0:
        return 0
    return max(0, min(int(math.floor(outlier_frac / 2 * n + 0.5)), (n - 1) // 2))


def _index_bits(n: int) -> int:
    return 16 if n <= 1 << 16 else 32


@register
class KVQuant(Quantizer):
    """KVQuant (arXiv:2401.18079): NUQ codebooks + per-vector dense-and-sparse outliers.

    Shapes: ``quantize(x, kind)`` takes ``(batch, kv_heads, seq_len, head_dim)`` fp32/fp16/bf16; the
    batch axis is the layer axis (one codebook per index of dim 0); computation in fp32;
    ``dequantize`` returns the input's shape, dtype and device. K is expected pre-RoPE
    (``k_pre_rope = True``: the harness supplies pre-RoPE K and re-applies RoPE to the output).

    Args:
        k_bits, v_bits: code widths (1..8; >= 16 = exact passthrough). Default 3 (nuq3).
        outlier_frac: fraction of each vector kept as sparse outliers, split evenly between the two
            tails (paper: 1 %). 0 disables the sparse store.
        attention_sink: keep the first token fp16 for K and V (paper's attention-sink-aware variant).
        kmeans_iters: maximum Lloyd iterations for the codebooks.
        calib_samples: per layer, at most this many normalized values feed k-means (a seeded
            subsample, ``torch.Generator().manual_seed(seed)``); ``None`` = all.
        seed: seed of the k-means subsample.

    Raises:
        ValueError: bad parameters, bit widths 9..15; in :meth:`quantize`, a fitted codebook whose
            layer count does not match dim 0 of the tensor.
    """

    id = "kvquant"
    name = "KVQuant"
    paper = (
        "Hooper et al., KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache "
        "Quantization (NeurIPS 2024)"
    )
    arxiv = "2401.18079"
    k_granularity = "per-channel (pre-RoPE) NUQ codebook per layer + 1% sparse outliers per channel"
    v_granularity = "per-token NUQ codebook per layer + 1% sparse outliers per token"
    rotation = False
    fidelity = "approximate"
    k_pre_rope = True
    local_stats = False
    finite_check = "stats"  # every element is a sparse outlier or inside its vector's dense [lo, hi]
    deltas = (
        "Without squared gradients passed to fit() (synthetic data), the codebooks come from unweighted "
        "k-means instead of Fisher-weighted k-means.",
        "Calibration set: the benchmark fits the codebooks on an independent batch of the same source "
        "(synthetic: the generator at another seed; real: the next seq_len tokens of the same text, with "
        "their Fisher weights), not on the paper's separate calibration corpus; the scored tensor is "
        "never the one the codebook was fitted on.",
        "If quantize() is called for a kind that was never fitted, the codebook is fitted in-sample "
        "(unweighted) on the tensor being quantized.",
        "K's per-channel outlier thresholds and dense ranges are computed on the tensor being quantized "
        "(the paper calibrates K's per-channel thresholds offline); outliers are chosen by count "
        "(round(0.5% · n) per tail, by rank) rather than by a value threshold, so each vector holds "
        "exactly the outliers it is billed for.",
        "Outlier values and normalization parameters are held at working precision and billed as fp16; "
        "outlier positions therefore reconstruct the input exactly.",
        "k-means: weighted-quantile initialization, at most calib_samples values per layer (seeded "
        "subsample), Lloyd iterations to convergence.",
        "Q-Norm (re-normalizing the dequantized distribution) is not implemented.",
        "Zero or constant vectors (half-range 0, decoded exactly by any codebook) get weight 0 in k-means, "
        "and a layer whose data hold fewer distinct values than levels gets the missing levels by halving "
        "the widest gaps of [−1, 1]: the codebook never repeats a level.",
        "Attention-sink fp16 first token is an option, off by default.",
    )

    def __init__(
        self,
        k_bits: int = 3,
        v_bits: int | None = None,
        *,
        seed: int = 0,
        outlier_frac: float = 0.01,
        attention_sink: bool = False,
        kmeans_iters: int = 100,
        calib_samples: int | None = 1 << 18,
    ) -> None:
        super().__init__(k_bits, v_bits, seed=seed)
        if not isinstance(outlier_frac, (int, float)) or not 0 <= float(outlier_frac) < 1:
            raise ValueError(f"outlier_frac must be in [0, 1), got {outlier_frac!r}")
        if not isinstance(attention_sink, bool):
            raise ValueError(f"attention_sink must be a bool, got {attention_sink!r}")
        if not isinstance(kmeans_iters, int) or kmeans_iters < 0:
            raise ValueError(f"kmeans_iters must be an int >= 0, got {kmeans_iters!r}")
        if calib_samples is not None and (not isinstance(calib_samples, int) or calib_samples < 1):
            raise ValueError(f"calib_samples must be a positive int or None, got {calib_samples!r}")
        self.outlier_frac = float(outlier_frac)
        self.attention_sink = attention_sink
        self.kmeans_iters = kmeans_iters
        self.calib_samples = calib_samples
        self._codebooks: dict[str, torch.Tensor] = {}
        self._fisher: dict[str, bool] = {}

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "outlier_frac": self.outlier_frac,
            "attention_sink": self.attention_sink,
            "kmeans_iters": self.kmeans_iters,
            "calib_samples": self.calib_samples,
        }

    def stream_policy(self, kind: Kind) -> StreamPolicy:
        """The first token stays fp16 when ``attention_sink`` is on; nothing else."""
        return StreamPolicy(sink_tokens=1 if self.attention_sink else 0)

    @property
    def fitted(self) -> dict[str, bool]:
        """kind → whether a codebook was fitted (value: Fisher-weighted or not is in ``fisher_weighted``)."""
        return {k: k in self._codebooks for k in ("k", "v")}

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
    def _samples(self, x: torch.Tensor, kind: str, grad2: torch.Tensor | None) -> SortedSamples:
        """The k-means data of every layer of the calibration tensor ``x`` (§3.3): its normalized dense values,
        weighted by ``grad2`` (:func:`kvqbench.numerics.dense_sparse.calibration_samples`; seeded subsample)."""
        vec = self._vectors(self._body(x).to(torch.float32), kind)
        w = None if grad2 is None else self._vectors(self._body(grad2).to(torch.float32), kind)
        return dense_sparse.calibration_samples(vec, outlier_count_per_tail(vec.shape[-1], self.outlier_frac), w,
                                                max_samples=self.calib_samples,
                                                generator=torch.Generator().manual_seed(self.seed))

    def _subsampled(self, shape: tuple[int, ...], kind: str) -> bool:
        """Whether k-means subsamples the dense values of a calibration tensor of ``shape`` (then the
        samples depend on the seed)."""
        if self.calib_samples is None:
            return False
        _, h, t, d = shape
        t = t - 1 if self.attention_sink else t
        n_vec, n = (h * d, t) if kind == "k" else (h * t, d)
        return n_vec * (n - 2 * outlier_count_per_tail(n, self.outlier_frac)) > self.calib_samples

    def seeded_for(self, shape: tuple[int, ...]) -> bool:
        """The seed enters only through k-means' subsample (:meth:`_subsampled`): ``False`` for tensors of
        ``shape`` (and any with fewer tokens: the dense count grows with the tokens) whose K and V codebooks
        are fitted on all their dense values."""
        if len(shape) != 4:
            return True
        return any(self.bits_for(kind) < 16 and self._subsampled(tuple(shape), kind)  # type: ignore[arg-type]
                   for kind in ("k", "v"))

    def _fit_codebook(self, x: torch.Tensor, kind: str, bits: int, grad2: torch.Tensor | None,
                      scratch: dict | None = None, grad2_src: torch.Tensor | None = None) -> torch.Tensor:
        """Per-layer codebook ``[B, 2^b]`` (§3.3) from the calibration tensor ``x`` (Fisher weights ``grad2``),
        its levels strictly increasing (:func:`distinct_levels`). The sorted k-means data depend neither on
        the bit width nor, without subsampling, on the seed: shared through ``scratch`` (:func:`reuse`)."""
        key = ("kvquant_kmeans_samples", kind, self.outlier_frac, self.attention_sink, self.calib_samples,
               self.seed if self._subsampled(x.shape, kind) else None, grad2 is not None)
        samples = reuse(scratch, key, (x, grad2_src), lambda: self._samples(x, kind, grad2))
        return distinct_levels(kmeans_sorted(samples, 2**bits, n_iter=self.kmeans_iters))

    @torch.no_grad()
    def fit(
        self,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        k_grad2: torch.Tensor | None = None,
        v_grad2: torch.Tensor | None = None,
        scratch: dict | None = None,
        **calib: Any,
    ) -> "KVQuant":
        """Fit one codebook per layer for K (pre-RoPE) and/or V on calibration tensors.

        Args:
            k, v: ``(layers, kv_heads, seq_len, head_dim)`` calibration tensors (either may be None).
            k_grad2, v_grad2: squared gradients of the loss w.r.t. ``k``/``v`` (Fisher information),
                same shapes; when given, k-means is weighted by them (arXiv:2401.18079 §3.3).
            scratch: optional dict that lives as long as these calibration tensors (e.g. the calibration
                batch's :attr:`~kvqbench.data.types.KVData.cache`): the sorted k-means data, which depend
                neither on the bit width nor (without subsampling) on the seed, are kept there and reused
                by later fits on the same tensor objects (checked by identity and in-place version), so
                the fits of every bit width and seed sort the data once. The codebooks are the same, bit
                for bit, as without it.
            **calib: other calibration data is ignored.
        Returns:
            ``self``.
        Raises:
            TypeError / ValueError: invalid tensors, or a gradient whose shape differs from its tensor.
        """
        for kind, x, g in (("k", k, k_grad2), ("v", v, v_grad2)):
            if x is None:
                continue
            validate_kv(x, name=kind.upper())
            g_src = g
            if g is not None:
                validate_kv(g, name=f"{kind}_grad2")
                if g.shape != x.shape:
                    raise ValueError(f"{kind}_grad2 shape {tuple(g.shape)} != {kind} shape {tuple(x.shape)}")
                g = g.abs()
            bits = self.bits_for(kind)  # type: ignore[arg-type]
            if bits >= 16 or (self.attention_sink and x.shape[2] < 2):
                continue
            self._codebooks[kind] = self._fit_codebook(x, kind, bits, g, scratch, g_src)
            self._fisher[kind] = g is not None
        return self

    # --- quantize / dequantize ----------------------------------------------------------------
    def _quantize(self, x: torch.Tensor, kind: Kind, bits: int) -> QuantizedTensor:
        qt = self._new_qt(x, kind, bits)
        xf = x.to(torch.float32)
        sink: tuple[torch.Tensor, ...] = ()
        if self.attention_sink:  # the attention sink stays fp16
            sink = (xf[:, :, :1, :].clone(),)
            qt.fields["sink"] = Stored(sink[0], 16)
        body = self._body(xf)
        qt.meta["body_shape"] = tuple(body.shape)
        if body.shape[2] == 0:
            check_finite(x, name=kind.upper())
            return qt
        cb = self._codebooks.get(kind)  # the layer codebooks (§3.3)
        if cb is None:
            check_finite(x, name=kind.upper())  # in-sample k-means reads every value: reject NaN/Inf first
            cb = self._fit_codebook(x, kind, bits, None)
            qt.meta["codebook"] = "in-sample"
        else:
            qt.meta["codebook"] = "fisher" if self._fisher.get(kind) else "calibrated"
        cb = cb.to(device=x.device, dtype=torch.float32)
        if cb.shape[-1] != 2**bits:
            raise ValueError(f"fitted {kind} codebook has {cb.shape[-1]} centroids, need {2**bits}; refit")
        if cb.shape[0] == 1 and x.shape[0] > 1:
            cb = cb.expand(x.shape[0], -1)
        if cb.shape[0] != x.shape[0]:
            raise ValueError(
                f"{kind} codebook was fitted on {cb.shape[0]} layers but the tensor has {x.shape[0]} "
                "(dim 0 is the layer axis); fit on tensors with the same number of layers"
            )
        vec = self._vectors(body, kind)  # K per channel (§3.1), V per token
        n_vec, n = vec.shape[1:]
        codes, out_idx, mid, half, outlier_value = dense_sparse.quantize(  # outliers, normalize, snap (§3.4)
            vec, outlier_count_per_tail(n, self.outlier_frac), cb)
        # every element is the sink, an outlier or inside its vector's dense [lo, hi]: those see any NaN/Inf
        check_finite(x, *sink, mid, outlier_value, name=kind.upper())
        qt.add_codes("codes", codes, bits)
        qt.fields["mid"] = Stored(mid, 16)
        qt.fields["half"] = Stored(half, 16)
        qt.fields["codebook"] = Stored(cb.clone(), 16)
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
        total = b_ * h * t * d
        tb = t - 1 if self.attention_sink else t
        bits_sum = 0.0
        if self.attention_sink:
            bits_sum += b_ * h * d * 16
        if tb > 0:
            n_vec, n = (h * d, tb) if kind == "k" else (h * tb, d)
            n_tail = outlier_count_per_tail(n, self.outlier_frac)
            bits_sum += b_ * n_vec * n * bits  # codes
            bits_sum += b_ * n_vec * (8 + 16)  # half-range (scale, FP8) + midpoint (zero, FP16)
            bits_sum += b_ * 2**bits * 16  # codebook
            if n_tail:
                bits_sum += b_ * n_vec * 2 * n_tail * (VALUE_BITS + _index_bits(n))
                bits_sum += (b_ * n_vec + 1) * POINTER_BITS
        return bits_sum / total
