"""TurboQuant — random rotation, then an optimal scalar codebook per coordinate. Based on Zandieh et al.,
"TurboQuant: Online Vector Quantization with Near-optimal Distortion Rate", arXiv:2504.19874 — §3.1 (MSE-optimal
quantizer, Algorithm 1) and §3.2 (inner-product quantizer, Algorithm 2: an MSE stage of ``b − 1`` bits plus a
1-bit QJL sketch of the residual).

Every token's head vector ``x`` (``head_dim = D``) is handled on its own:

* ``variant="mse"`` — store ``‖x‖`` (billed fp16); rotate the unit vector ``u = x/‖x‖`` by a random orthogonal
  ``Π``: ``y = Π u``, whose coordinates are (nearly) ``N(0, 1/D)``; snap each coordinate to the nearest centroid
  of the ``b``-bit Lloyd–Max codebook for ``N(0, 1/D)`` (:mod:`kvqbench.numerics.lloyd_max`); decode
  ``x̂ = ‖x‖ Πᵀ c[idx]``. Per unit vector, ``E‖x̂ − x‖²`` is Max's 0.3634 / 0.1175 / 0.03454 / 0.009497 (b = 1..4).
* ``variant="prod"`` — the MSE stage at ``b − 1`` bits (none at b = 1), then the residual
  ``r = u − ũ`` is sketched with a Gaussian ``S`` (``D × D``): store ``sign(S r)`` (1 bit/coordinate) and
  ``‖r‖`` (billed fp16); decode ``ũ + √(π/2)/D · ‖r‖ · Sᵀ sign(S r)``, times ``‖x‖``. The estimate of
  ``⟨y, x⟩`` is unbiased for any fixed ``y``; its variance is ``≈ (π/2)·D_mse(b−1)·‖y‖²/D``.

``Π`` is the Q factor of a seeded standard Gaussian matrix with the signs of R's diagonal moved into Q (a proper
Haar draw); ``S`` is the next ``D × D`` standard Gaussian draw of the same generator. Both are drawn on the CPU
from ``torch.Generator().manual_seed(generator_seed(seed))`` (CPU and CUDA see the same numbers) and are
*regenerated from the seed stored in* ``qt.meta`` when decoding: a seed, not data, so not billed.
``rotation="hadamard"`` (an option, not the paper's method) replaces ``Π`` with the deterministic normalized
Walsh–Hadamard matrix ``H/√D`` of :mod:`kvqbench.numerics.hadamard` (for a head_dim that is not a power of
two, its block-diagonal of Sylvester blocks, e.g. 96 = 64 + 32).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Literal

import torch

from kvqbench import steps
from kvqbench.numerics.hadamard import hadamard_matrix
from kvqbench.numerics.lloyd_max import lloyd_max, nearest_centroid, reconstruct
from kvqbench.numerics.rtn import compute_dtype
from kvqbench.numerics.scale import pow2_floor
from kvqbench.quantizers.base import Kind, QuantizedTensor, Quantizer, Stored, register

__all__ = ["TurboQuant", "generator_seed", "haar_orthogonal", "qjl_matrix", "unit_rows", "encode", "decode"]

MAX_BITS = 8
VARIANTS = ("mse", "prod")
ROTATIONS = ("random", "hadamard")
CODEBOOKS = ("gaussian", "beta")
_NORM_NOMINAL, _NORM_EFFECTIVE = 8, 16  # a per-token norm: billed FP8 in the benchmark budget, stored fp16
#: odd 64-bit constants that mix the user seed into the generator seed (see :func:`generator_seed`)
_MIX_MUL = 0x9E3779B97F4A7C15
_MIX_ADD = 0x7475726271756E74  # "turbquant"


def generator_seed(seed: int) -> int:
    """The seed of the CPU ``torch.Generator`` that draws ``Π`` and ``S`` for a method ``seed``:
    ``(seed·0x9E3779B97F4A7C15 + 0x7475726271756E74) mod 2^63``. A fixed mix instead of ``seed`` itself: data
    drawn with ``torch.Generator().manual_seed(seed)`` would otherwise contain the rotation's own Gaussian draw
    (the first D rows of a ``randn(…, T, D)`` would be the matrix whose QR gives ``Π``), a pathological input."""
    return (int(seed) * _MIX_MUL + _MIX_ADD) % (1 << 63)


@lru_cache(maxsize=32)
def _draws(seed: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(generator_seed(seed))
    a = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    s = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    sign = torch.sign(torch.diagonal(r))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return q * sign, s


def haar_orthogonal(seed: int, dim: int) -> torch.Tensor:
    """The seeded random rotation ``Π`` ``(dim, dim)``, float64 on the CPU: ``Q·diag(sign(diag R))`` for ``QR = A``,
    ``A`` the first ``dim × dim`` standard Gaussian draw of ``Generator().manual_seed(generator_seed(seed))``
    (Haar-distributed; ``Π Πᵀ = I``). A fresh copy."""
    return _draws(seed, dim)[0].clone()


def qjl_matrix(seed: int, dim: int) -> torch.Tensor:
    """The seeded QJL matrix ``S`` ``(dim, dim)`` of i.i.d. N(0, 1): the second draw of the same
    generator as :func:`haar_orthogonal`. A fresh copy (float64, CPU)."""
    return _draws(seed, dim)[1].clone()


def unit_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """§3 (unit vectors, norms stored apart): every row of ``x`` ``(n, D)`` (fp32/fp64) as ``u = x/‖x‖`` ``(n, D)``
    (a zero row stays 0), its norm ``‖x‖`` ``(n, 1)`` and ``max|x|`` ``(n, 1)`` (which holds any NaN/Inf of the row).
    Both come from ``x / 2^⌊log2 max|x|⌋`` (exact), so the sum of squares neither overflows nor underflows."""
    amax = torch.maximum(x.amin(-1, keepdim=True).neg(), x.amax(-1, keepdim=True))
    p = pow2_floor(amax)
    u = x / p
    norm = torch.linalg.vector_norm(u, dim=-1, keepdim=True)
    u.div_(torch.where(norm > 0, norm, torch.ones_like(norm)))
    return u, norm * p, amax


@steps.reference("turboquant.encode")
def encode(x: torch.Tensor, pi_t: torch.Tensor, thresholds: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """§3.1, Algorithm 1 (quantize): the unit rows ``u`` of ``x`` ``(n, D)`` (:func:`unit_rows`), rotated,
    ``y = u Πᵀ`` (``pi_t`` is ``Πᵀ``, ``(D, D)`` contiguous, ``x``'s dtype), and every coordinate's nearest
    centroid (``thresholds`` ``(L − 1,)`` ascending): ``(codes uint8 (n, D), ‖x‖ (n, 1), max|x| (n, 1))``."""
    u, norm, amax = unit_rows(x)
    return nearest_centroid(u @ pi_t, thresholds, dtype=torch.uint8), norm, amax


@steps.reference("turboquant.decode")
def decode(codes: torch.Tensor, norm: torch.Tensor, pi: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """§3.1, Algorithm 1 (dequantize): ``x̂ = ‖x‖ · c[idx] Π`` for ``codes`` ``(n, D)`` uint8, ``norm`` ``(n, 1)``,
    ``pi`` ``(D, D)`` and ``centroids`` ``(L,)`` in the working dtype; ``(n, D)`` in that dtype."""
    return (reconstruct(centroids, codes) @ pi).mul_(norm)


@register
class TurboQuant(Quantizer):
    """TurboQuant (arXiv:2504.19874, §3.1 / §3.2): per-token norm + random rotation + per-coordinate
    Lloyd–Max codebook (MSE variant), optionally with a 1-bit QJL residual sketch (prod variant).

    Shapes: ``quantize(x, kind)`` takes ``(batch, kv_heads, seq_len, head_dim)`` fp32/fp16/bf16, one row per
    token; computation in fp32; ``dequantize`` returns the input's shape, dtype and device.

    Args:
        k_bits, v_bits: total bits per coordinate, 1..8 (prod: ``b − 1`` MSE bits + 1 QJL bit).
        seed: seed of ``Π`` and ``S`` (stored in every representation's meta).
        variant: ``"mse"`` (default) or ``"prod"`` (unbiased inner products).
        rotation: ``"random"`` (default, Haar ``Π``) or ``"hadamard"`` (``H/√D``; Sylvester blocks if D ≠ 2^k).
        codebook: ``"gaussian"`` (default, Lloyd–Max for N(0, 1/D)) or ``"beta"`` (the exact coordinate density
            of a uniform unit vector in R^D).

    Raises:
        ValueError: unknown option; from :meth:`quantize`, bits in 9..15.
    """

    id = "turboquant"
    name = "TurboQuant"
    paper = "Zandieh et al., TurboQuant: Online Vector Quantization with Near-optimal Distortion Rate (2025)"
    arxiv = "2504.19874"
    k_granularity = "per-token vector: fp16 norm + rotated per-coordinate Lloyd–Max codebook"
    v_granularity = "same as K"
    rotation = True
    fidelity = "faithful"
    local_stats = True  # the codebook depends only on (bits, D), never on data
    deltas = (
        "Codebook: Lloyd–Max for the N(0, 1/D) limit of the coordinate density (the paper's Algorithm 1 "
        "solves it for the exact scaled-Beta density); codebook='beta' selects the exact one. At D = 128 "
        "the realized distortions of the two differ by < 0.03% (both ≈ 0.361 / 0.116 / 0.0341 / 0.00936 "
        "for b = 1..4, 0.7–1.5% below Max's Gaussian values).",
        "The per-token norm ‖x‖ (and ‖r‖ in the prod variant) is held at working precision and billed "
        "as fp16; the paper assumes unit vectors and stores norms separately.",
        "One Π (and S) per seed and head_dim, shared by every layer, head and by K and V.",
        "No outlier-channel split: the paper's fractional KV settings (2.5 / 3.5 bits) give a subset of "
        "channels more bits; here every coordinate gets the same b.",
        "Π and S are regenerated from the stored seed and not billed.",
        "rotation='hadamard' (deterministic H/√D; block-diagonal Sylvester blocks for head_dims that are "
        "not powers of two) is an option outside the paper (default: random).",
    )

    def __init__(self, k_bits: int = 4, v_bits: int | None = None, *, seed: int = 0,
                 variant: Literal["mse", "prod"] = "mse", rotation: Literal["random", "hadamard"] = "random",
                 codebook: Literal["gaussian", "beta"] = "gaussian") -> None:
        super().__init__(k_bits, v_bits, seed=seed)
        for nm, val, allowed in (("variant", variant, VARIANTS), ("rotation", rotation, ROTATIONS),
                                 ("codebook", codebook, CODEBOOKS)):
            if val not in allowed:
                raise ValueError(f"{nm} must be one of {allowed}, got {val!r}")
        self.variant = variant
        self.rotation_kind = rotation
        self.codebook = codebook

    def params(self) -> dict[str, Any]:
        return {**super().params(), "variant": self.variant, "rotation": self.rotation_kind,
                "codebook": self.codebook}

    # ------------------------------------------------------------------------------------------
    def _mse_bits(self, bits: int, variant: str) -> int:
        return bits - 1 if variant == "prod" else bits

    @staticmethod
    def _rotation_matrix(meta: dict[str, Any], dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        hadamard = meta["rotation"] == "hadamard"
        pi = hadamard_matrix(dim, dtype=torch.float64) if hadamard else _draws(meta["seed"], dim)[0]
        return pi.to(device=device, dtype=dtype)

    @staticmethod
    def _codebook(meta: dict[str, Any], bits: int, dim: int, device: torch.device, dtype: torch.dtype):
        beta = meta["codebook"] == "beta"
        cb = lloyd_max("sphere", bits, (int(dim),)) if beta else lloyd_max("gaussian", bits, (1.0 / math.sqrt(dim),))
        return cb.tensors(device=device, dtype=dtype)

    def _quantize(self, x: torch.Tensor, kind: Kind, bits: int) -> QuantizedTensor:
        if bits > MAX_BITS:
            raise ValueError(f"turboquant supports 1..{MAX_BITS} bits (or >= 16 for fp16), got {bits}")
        d = x.shape[-1]
        meta = {"seed": self.seed, "variant": self.variant, "rotation": self.rotation_kind, "codebook": self.codebook}
        qt = self._new_qt(x, kind, bits, **meta)
        cdt = compute_dtype(x.dtype)
        xf = x.to(cdt).reshape(-1, d)  # one row per token
        mse_bits = self._mse_bits(bits, self.variant)
        if self.variant == "mse":  # §3.1, Algorithm 1: unit rows, y = Π u, nearest Lloyd–Max centroids
            pi = self._rotation_matrix(meta, d, x.device, cdt)
            _, thr = self._codebook(meta, mse_bits, d, x.device, cdt)
            idx, norm, _ = encode(xf, pi.T.contiguous(), thr)
            qt.fields["norm"] = Stored(norm.reshape(*x.shape[:-1], 1), 16)
            qt.add_codes("codes", idx.reshape(x.shape), mse_bits)
            return qt
        u, norm, _ = unit_rows(xf)  # prod: the same steps one by one, as the residual needs u
        qt.fields["norm"] = Stored(norm.reshape(*x.shape[:-1], 1), 16)
        u_hat = None  # ũ, the MSE stage's reconstruction (none at b = 1 of the prod variant)
        if mse_bits > 0:  # §3.1: y = Π u, each coordinate to its nearest Lloyd–Max centroid
            pi = self._rotation_matrix(meta, d, x.device, cdt)
            cent, thr = self._codebook(meta, mse_bits, d, x.device, cdt)
            idx = nearest_centroid(u @ pi.T.contiguous(), thr, dtype=torch.uint8)  # Πᵀ laid out for the product
            qt.add_codes("codes", idx.reshape(x.shape), mse_bits)
            u_hat = reconstruct(cent, idx) @ pi  # ũ = Πᵀ c[idx], needed only for the residual
        s = _draws(self.seed, d)[1].to(device=x.device, dtype=cdt)  # §3.2, Algorithm 2: r = u − ũ, sign(S r), ‖r‖
        r = u if u_hat is None else u - u_hat
        qt.add_codes("qjl", (r @ s.T.contiguous() >= 0).to(torch.uint8).reshape(x.shape), 1)
        qt.fields["res_norm"] = Stored(torch.linalg.vector_norm(r, dim=-1, keepdim=True).reshape(*x.shape[:-1], 1), 16)
        return qt

    def _dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
        meta = qt.meta
        norm = qt["norm"].reshape(-1, 1)
        cdt, dev, d = norm.dtype, norm.device, qt.shape[-1]
        mse_bits = self._mse_bits(qt.bits, meta["variant"])
        if mse_bits > 0:  # the MSE stage's codes, Π and centroids (§3.1)
            codes = qt.codes("codes", torch.uint8).to(dev).reshape(-1, d)
            pi = self._rotation_matrix(meta, d, dev, cdt)
            cent, _ = self._codebook(meta, mse_bits, d, dev, cdt)
        if meta["variant"] == "mse":  # §3.1: x̂ = ‖x‖ Πᵀ c[idx]
            return decode(codes, norm, pi, cent).reshape(qt.shape)
        # prod, §3.1 then §3.2: ũ = Πᵀ c[idx] (0 at b = 1), plus √(π/2)/D · ‖r‖ · Sᵀ sign(S r)
        u_hat = reconstruct(cent, codes) @ pi if mse_bits > 0 else norm.new_zeros(norm.shape[0], d)
        s = _draws(meta["seed"], d)[1].to(device=dev, dtype=cdt)
        signs = qt.codes("qjl", torch.uint8).to(dev).reshape(-1, d).to(cdt) * 2 - 1
        u_hat.add_((math.sqrt(math.pi / 2) / d) * qt["res_norm"].reshape(-1, 1) * (signs @ s))
        return u_hat.mul_(norm).reshape(qt.shape)  # times ‖x‖

    # ------------------------------------------------------------------------------------------
    def nominal_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        """``b + 8/D`` (mse) or ``b + 16/D`` (prod): the codes plus one norm per token (two in prod),
        each billed as an FP8 scale under the benchmark budget."""
        return bits + (2 if self.variant == "prod" else 1) * _NORM_NOMINAL / shape[-1]

    def effective_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        """What :meth:`quantize` stores, as a formula: ``b + 16/D`` (mse) or ``b + 32/D`` (prod)."""
        return bits + (2 if self.variant == "prod" else 1) * _NORM_EFFECTIVE / shape[-1]
