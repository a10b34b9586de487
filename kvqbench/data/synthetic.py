"""Seeded synthetic K/V/Q with heavy-tailed token norms and persistent key outlier channels (docs/DESIGN.md §2).

Generative model (every tensor ``(batch, heads, seq_len, head_dim)``, fp32):

* every token vector is ``norm · direction``: ``direction`` uniform on the unit sphere (a standard
  normal vector divided by its length) and ``norm = √head_dim · exp(norm_sigma · z)``, ``z ~ N(0, 1)``
  — lognormal with ``σ = norm_sigma`` and median ``√head_dim``, so a median token has element RMS 1;
* **K** additionally multiplies a fixed set of ``n_outlier_channels`` channels by ``channel_gain``.
  The channels are drawn from the seed once and are the same for every batch entry, head and token
  (the persistent per-channel outliers seen in real keys); K's token norms therefore exceed the
  lognormal draw by the outlier energy;
* **V** has no channel outliers;
* **Q** (queries for the attention experiments) is drawn like K *without* outliers, with ``q_heads``
  heads (GQA: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``).

Draw order from one ``torch.Generator`` seeded with ``seed``: outlier channels, K directions, K norms,
V directions, V norms, Q directions, Q norms. So K and V do not depend on ``q_heads``. Numbers are
generated on the CPU and then moved to ``device``, so they are identical on every device. No global RNG
is touched. Synthetic data has no RoPE (``k_pre``, ``cos``, ``sin`` are ``None``).
"""

from __future__ import annotations

import math

import torch

from kvqbench.data.types import KVData

__all__ = ["make_synthetic"]

_GENERATION_ORDER = ("outlier_channels", "k_dir", "k_norm", "v_dir", "v_norm", "q_dir", "q_norm")


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _finite_float(name: str, value: object, *, minimum: float, strict: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < minimum or (strict and v == minimum):
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return v


def _token_vectors(
    g: torch.Generator, shape: tuple[int, int, int, int], sigma: float
) -> torch.Tensor:
    """``norm · direction`` per token: uniform unit directions, lognormal norms of median √D."""
    direction = torch.randn(shape, generator=g, dtype=torch.float32)
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    z = torch.randn((*shape[:-1], 1), generator=g, dtype=torch.float32)
    norm = math.sqrt(shape[-1]) * torch.exp(sigma * z)
    return direction * norm


def make_synthetic(
    *,
    seed: int,
    batch: int = 1,
    kv_heads: int = 2,
    q_heads: int | None = None,
    seq_len: int = 256,
    head_dim: int = 128,
    norm_sigma: float = 1.0,
    n_outlier_channels: int = 4,
    channel_gain: float = 10.0,
    device: torch.device | str = "cpu",
) -> KVData:
    """Draw a synthetic :class:`~kvqbench.data.types.KVData` (``source="synthetic"``).

    Args:
        seed: seed of the one ``torch.Generator`` every number comes from, ``0 <= seed < 2**63``.
        batch, kv_heads, seq_len, head_dim: K/V shape ``(batch, kv_heads, seq_len, head_dim)``.
        q_heads: query heads; default ``2 * kv_heads`` (GQA with 2 query heads per KV head). Must be a
            multiple of ``kv_heads``.
        norm_sigma: σ of the lognormal per-token norms (dimensionless; 0 = every norm is √head_dim).
        n_outlier_channels: how many of K's ``head_dim`` channels are persistent outliers
            (``0 <= n <= head_dim``; 0 = no outliers). Default 4 (≈3% of a D=128 head).
        channel_gain: factor applied to K's outlier channels (> 0). Default 10, the ~10× channel
            magnitude seen in real keys (e.g. SmolLM2's).
        device: where the returned tensors live; values are generated on the CPU first.

    Returns:
        KVData with ``k``, ``v`` ``(batch, kv_heads, seq_len, head_dim)`` and ``q``
        ``(batch, q_heads, seq_len, head_dim)``, all fp32; ``meta`` records every generator
        parameter, the outlier channel indices and the draw order.

    Raises:
        ValueError: a non-positive or non-integer size, a bad seed, ``q_heads`` not a multiple of
            ``kv_heads``, ``n_outlier_channels`` outside ``[0, head_dim]``, a negative/non-finite
            ``norm_sigma``, a non-positive/non-finite ``channel_gain``, or an unknown ``device``.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    batch = _positive_int("batch", batch)
    kv_heads = _positive_int("kv_heads", kv_heads)
    seq_len = _positive_int("seq_len", seq_len)
    head_dim = _positive_int("head_dim", head_dim)
    q_heads = 2 * kv_heads if q_heads is None else _positive_int("q_heads", q_heads)
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}) for GQA")
    sigma = _finite_float("norm_sigma", norm_sigma, minimum=0.0, strict=False)
    gain = _finite_float("channel_gain", channel_gain, minimum=0.0, strict=True)
    if (
        not isinstance(n_outlier_channels, int)
        or isinstance(n_outlier_channels, bool)
        or not 0 <= n_outlier_channels <= head_dim
    ):
        raise ValueError(
            f"n_outlier_channels must be an int in [0, head_dim={head_dim}], got {n_outlier_channels!r}"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: {e}") from e

    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    channels = torch.randperm(head_dim, generator=g)[:n_outlier_channels].sort().values
    kv_shape = (batch, kv_heads, seq_len, head_dim)
    k = _token_vectors(g, kv_shape, sigma)
    v = _token_vectors(g, kv_shape, sigma)
    q = _token_vectors(g, (batch, q_heads, seq_len, head_dim), sigma)
    if n_outlier_channels:
        gains = torch.ones(head_dim, dtype=torch.float32)
        gains[channels] = gain
        k = k * gains

    meta = {
        "generator": "kvqbench.data.synthetic.make_synthetic",
        "seed": seed,
        "batch": batch,
        "kv_heads": kv_heads,
        "q_heads": q_heads,
        "seq_len": seq_len,
        "head_dim": head_dim,
        "norm_distribution": "lognormal",
        "norm_sigma": sigma,
        "norm_median": math.sqrt(head_dim),
        "n_outlier_channels": n_outlier_channels,
        "channel_gain": gain,
        "outlier_channels": [int(c) for c in channels],
        "generation_order": list(_GENERATION_ORDER),
        "rope": None,
        "dtype": "float32",
    }
    return KVData("synthetic", k.to(dev), v.to(dev), q.to(dev), meta=meta)
