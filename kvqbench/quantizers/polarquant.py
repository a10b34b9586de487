"""PolarQuant — keys quantized in polar coordinates, one (radius, angle) per RoPE pair.

Based on Wu et al., "PolarQuant: Leveraging Polar Transformation for Efficient Key Cache Quantization
and Decoding Acceleration", arXiv:2502.00527 (§3: the polar view of RoPE's rotated pairs, §4: the
quantizer). Not the recursive-polar method of Han et al. (arXiv:2502.02617), which shares the name.

Keys (post-RoPE, ``(batch, kv_heads, seq_len, head_dim)``) are split into RoPE's rotate-half pairs
``(x_j, x_{j+D/2})``, ``j < D/2``. Each pair becomes a radius ``ρ = ‖pair‖`` and an angle
``φ = atan2(x_{j+D/2}, x_j)`` mapped to ``[0, 2π)``. For every pair and every group of ``G``
consecutive tokens the min and max of ``ρ`` and of ``φ`` are stored (billed fp16), and

    s = (max − min) / 2**b,   idx = clamp(floor((v − min) / s), 0, 2**b − 1),   v̂ = min + (idx + ½)·s

(decode at the bin midpoint). ``k_bits = b`` means ``b`` bits of radius and ``b`` bits of angle per
pair, i.e. ``b`` bits per element; the paper's default r4t4 at G = 128 holds 4 + 4·16/(2·128) = 4.25
bits/element. Values are quantized per token over head_dim with asym RTN so that the method joins the
bit-width sweep; ``v_fp16=True`` keeps them in fp16 as the paper does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvqbench import steps
from kvqbench.numerics.rtn import PerToken, compute_dtype, dequantize_packed, quantize_packed
from kvqbench.quantizers.base import Kind, QuantizedTensor, Quantizer, Stored, check_group_size, register

__all__ = ["PolarQuant", "to_polar", "from_polar", "wrap_angle", "group_codes", "midpoints"]

TWO_PI = 2.0 * math.pi
#: benchmark budget of one (min, max) pair: the min is a zero-point (FP16), the range a scale (FP8)
_AUX_NOMINAL = 16 + 8
_AUX_EFFECTIVE = 16 + 16
MAX_BITS = 8


def to_polar(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """§3: rotate-half pairs of ``x`` ``(…, D)`` (D even) → ``(rho, phi)``, each ``(…, D/2)``.

    ``phi`` lies in ``[0, 2π)``: atan2's ``(−π, π]`` is shifted by 2π where negative, so the ±π seam
    of atan2 falls inside the range (both ``atan2(+0, −1) = π`` and ``atan2(−0, −1) = −π`` give π), and
    a value that rounds up to 2π is folded back to 0. A zero pair gives ``rho = 0, phi = 0``.
    """
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    rho = torch.hypot(a, b)
    return rho, wrap_angle(torch.atan2(b, a))


@steps.reference("polarquant.wrap_angle")
def wrap_angle(phi: torch.Tensor) -> torch.Tensor:
    """§3: atan2's angles ``(−π, π]`` (any shape) folded into ``[0, 2π)``: ``+2π`` where negative, then ``0``
    where that rounds to ``2π``. ``phi`` is consumed: its storage may hold the result."""
    phi = torch.where(phi < 0, phi + TWO_PI, phi)
    return phi.masked_fill_(phi >= TWO_PI, 0.0)


def from_polar(rho: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """§3: the inverse of :func:`to_polar`: ``(…, P)``, ``(…, P)`` → ``(…, 2P)`` (``rho = 0`` gives exactly 0)."""
    p = phi.shape[-1]
    out = torch.empty(*phi.shape[:-1], 2 * p, dtype=phi.dtype, device=phi.device)
    torch.mul(rho, torch.cos(phi), out=out[..., :p])
    torch.mul(rho, torch.sin(phi), out=out[..., p:])
    return out


def _floor_quantize(v: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, bits: int) -> torch.Tensor:
    """§4: ``clamp(floor((v − mn)/s), 0, 2**b − 1)`` as ``uint8`` with ``s = (mx − mn)/2**b``; a constant group
    (``s = 0``) divides by ``+inf`` and gets code 0."""
    s = (mx - mn) / (1 << bits)
    safe = torch.where(s > 0, s, torch.full_like(s, math.inf))
    return torch.clamp(torch.floor((v - mn) / safe), 0, (1 << bits) - 1).to(torch.uint8)


def _token_groups(v: torch.Tensor, g: int) -> torch.Tensor:
    """``(B, H, T, P)`` → ``(B, H, nG, G, P)``: consecutive groups of ``g`` tokens, a partial last group padded
    by repeating its last token (so its min/max are unchanged)."""
    pad = (-v.shape[-2]) % g
    if pad:
        v = torch.cat([v, v[..., -1:, :].expand(*v.shape[:-2], pad, v.shape[-1])], dim=-2)
    return v.reshape(*v.shape[:-2], -1, g, v.shape[-1])


@steps.reference("polarquant.group_codes")
def group_codes(v: torch.Tensor, g: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """§4 for one polar component ``v`` ``(B, H, T, P)`` (fp32 or fp64): the min and max of every pair over
    each group of ``g`` consecutive tokens, ``(B, H, nG, 1, P)`` in ``v``'s dtype, and every value's code
    ``(B, H, T, P)`` ``uint8`` in ``[0, 2**bits)`` (:func:`_floor_quantize`)."""
    vg = _token_groups(v, g)
    mn = vg.amin(dim=-2, keepdim=True)
    mx = vg.amax(dim=-2, keepdim=True)
    codes = _floor_quantize(vg, mn, mx, bits).reshape(*v.shape[:-2], -1, v.shape[-1])[..., : v.shape[-2], :]
    return codes, mn, mx


@steps.reference("polarquant.midpoints")
def midpoints(codes: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, g: int, bits: int) -> torch.Tensor:
    """§4, decoding: every code ``(B, H, T, P)`` (integer) to its bin's midpoint ``mn + (idx + ½)·s``,
    ``s = (mx − mn)/2**bits``, with ``mn``, ``mx`` ``(B, H, nG, 1, P)`` per group of ``g`` consecutive tokens;
    ``(B, H, T, P)`` in ``mn``'s dtype."""
    t = codes.shape[-2]
    cg = _token_groups(codes, g)
    s = (mx - mn) / (1 << bits)
    mid = (cg.to(mn.dtype) + 0.5) * s + mn
    return mid.reshape(*cg.shape[:-3], -1, cg.shape[-1])[..., :t, :]


@register
class PolarQuant(Quantizer):
    """PolarQuant (arXiv:2502.00527, §4): per-pair (radius, angle) min/max quantization of K in groups
    of ``group_size`` tokens; V per-token asym RTN (or fp16).

    Args:
        k_bits: ``b`` — bits of radius and bits of angle per pair (so ``b`` bits/element); 1..8.
        v_bits: V's per-token RTN width (ignored when ``v_fp16``).
        group_size: G, tokens per (min, max) group (paper: 128).
        v_fp16: keep V in fp16 (the published method; billed 16 bits/element).

    Raises (from :meth:`quantize`):
        ValueError: odd head_dim (no rotate-half pairs), or ``bits`` in 9..15.
    """

    id = "polarquant"
    seeded = False  # no randomness
    name = "PolarQuant"
    paper = (
        "Wu et al., PolarQuant: Leveraging Polar Transformation for Efficient Key Cache Quantization "
        "and Decoding Acceleration (2025)"
    )
    arxiv = "2502.00527"
    k_granularity = "per rotate-half pair: radius + angle, min/max per group of G tokens"
    v_granularity = "per-token asym RTN over head_dim (or fp16 with v_fp16=True)"
    rotation = False
    fidelity = "faithful"
    grouped = True
    local_stats = True
    deltas = (
        "V is quantized per token (asym RTN over head_dim, float minimum as zero-point) so the method "
        "joins the bit-width sweep; the paper keeps V in fp16 (v_fp16=True restores that).",
        "k_bits = b means b radius bits + b angle bits per pair (paper notation r{b}t{b}); "
        "asymmetric splits (e.g. r4t3) are not exposed.",
        "Group minima/maxima are held at working precision and billed as fp16.",
        "Decoding reconstructs K (ρ̂cos φ̂, ρ̂sin φ̂); the paper's table-lookup q·k kernel is a speed "
        "optimization with the same numerics and is not modelled.",
    )

    def __init__(
        self,
        k_bits: int = 4,
        v_bits: int | None = None,
        *,
        seed: int = 0,
        group_size: int = 128,
        v_fp16: bool = False,
    ) -> None:
        super().__init__(k_bits, v_bits, seed=seed)
        self.group_size = check_group_size(group_size)
        if not isinstance(v_fp16, bool):
            raise ValueError(f"v_fp16 must be a bool, got {v_fp16!r}")
        self.v_fp16 = v_fp16

    def params(self) -> dict[str, Any]:
        return {**super().params(), "group_size": self.group_size, "v_fp16": self.v_fp16}

    # ------------------------------------------------------------------------------------------
    def _quantize(self, x: torch.Tensor, kind: Kind, bits: int) -> QuantizedTensor:
        if bits > MAX_BITS:
            raise ValueError(f"polarquant supports 1..{MAX_BITS} bits (or >= 16 for fp16), got {bits}")
        if kind == "v":
            return self._quantize_v(x, bits)
        d = x.shape[-1]
        if d % 2:
            raise ValueError(
                f"polarquant pairs channels (j, j + D/2) as RoPE does and needs an even head_dim, got {d}"
            )
        qt = self._new_qt(x, kind, bits, group_size=self.group_size)
        rho, phi = to_polar(x.to(compute_dtype(x.dtype)))  # §3: (B, H, T, P), one (ρ, φ) per RoPE pair
        for name, v in (("rho", rho), ("phi", phi)):
            codes, mn, mx = group_codes(v, self.group_size, bits)  # §4: min/max per group of G tokens, codes
            qt.add_codes(f"{name}_codes", codes, bits)
            qt.fields[f"{name}_min"] = Stored(mn.movedim(-1, -3), 16)  # (B, H, P, nG, 1)
            qt.fields[f"{name}_max"] = Stored(mx.movedim(-1, -3), 16)
        return qt

    def _quantize_v(self, x: torch.Tensor, bits: int) -> QuantizedTensor:
        qt = self._new_qt(x, "v", bits)
        if self.v_fp16:
            qt.fields["passthrough"] = Stored(x.clone(), 16)
            return qt
        packed, lo, scale = quantize_packed(x, bits, PerToken())  # not in the paper: asym RTN per token
        qt.add_packed("codes", packed, tuple(x.shape), bits)
        qt.fields["scale"] = Stored(scale, 16)
        qt.fields["zero"] = Stored(lo, 16)
        return qt

    def _dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
        if qt.kind == "v":
            return dequantize_packed(qt["codes"], qt.meta["codes.shape"], qt.meta["codes.bits"], qt["zero"],
                                     qt["scale"], PerToken())
        polar = []
        for name in ("rho", "phi"):  # §4: every code decodes to its bin's midpoint
            mn, mx = qt[f"{name}_min"].movedim(-3, -1), qt[f"{name}_max"].movedim(-3, -1)  # (B, H, nG, 1, P)
            polar.append(midpoints(qt.codes(f"{name}_codes", torch.uint8), mn, mx, qt.meta["group_size"], qt.bits))
        return from_polar(*polar)  # §3: back to the rotate-half pairs

    def nominal_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        """K: ``b + 2·n_groups·(D/2)·24 / (T·D)`` (per pair and group: min as FP16 zero-point, range as
        FP8 scale, for radius and angle) — ``b + 24/G`` when G divides T. V: ``b + 24/D`` per-token
        RTN, or 16 with ``v_fp16``."""
        _, _, t, d = shape
        if kind == "v":
            return 16.0 if self.v_fp16 else bits + _AUX_NOMINAL / d
        n_groups = math.ceil(t / self.group_size)
        return bits + 2 * n_groups * (d // 2) * _AUX_NOMINAL / (t * d)

    def effective_bits_for(self, kind: Kind, bits: int, shape: tuple[int, int, int, int]) -> float:
        """What :meth:`quantize` stores, as a formula (fp16 min and max): K ``b + 32/G`` when G
        divides T (4.25 at r4t4, G = 128); V ``b + 32/D`` or 16."""
        _, _, t, d = shape
        if kind == "v":
            return 16.0 if self.v_fp16 else bits + _AUX_EFFECTIVE / d
        n_groups = math.ceil(t / self.group_size)
        return bits + 2 * n_groups * (d // 2) * _AUX_EFFECTIVE / (t * d)
