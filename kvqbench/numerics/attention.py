"""Attention-level error numerics (docs/DESIGN.md §4): pure tensor functions, no knowledge of methods.

Everything is computed in fp64. Shapes follow the benchmark layout: keys/values
``(batch, kv_heads, seq_len, head_dim)``, queries ``(batch, q_heads, n_queries, head_dim)`` with
``q_heads`` a multiple of ``kv_heads`` (GQA: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``).
No causal mask is applied: every query reads the whole key/value prefix it is given (the accumulation
experiment uses the queries of the last tokens of a prefix, see :mod:`kvqbench.experiments.accumulation`).

Invariants (tested):

* ``logit_bias2 + logit_var == logit_mse`` (the population-variance decomposition, per query);
* ``KL(p‖p̂) >= 0`` with equality exactly when the attention rows are equal (KL is computed from
  ``log_softmax`` so it is stable for large logits and exactly 0 for identical inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "expand_kv",
    "attention_logits",
    "AttentionError",
    "AttentionReference",
    "attention_reference",
    "attention_error",
    "attention_error_by_batch",
    "kl_rows",
    "incoherence",
    "incoherence_of_squares",
    "least_squares_slope",
]


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64)


def expand_kv(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Repeat KV heads for GQA: ``(batch, kv_heads, seq_len, head_dim)`` → ``(batch, q_heads, seq_len,
    head_dim)`` where output head ``h`` is KV head ``h // (q_heads // kv_heads)``.

    Raises:
        ValueError: ``q_heads`` is not a positive multiple of ``kv_heads``.
    """
    kv_heads = int(x.shape[1])
    if q_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a positive multiple of kv_heads ({kv_heads}) for GQA")
    group = q_heads // kv_heads
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a rank-4 tensor, got {getattr(t, 'shape', type(t))}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if v is not None and v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)} on (batch, kv_heads, seq_len)")


def attention_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Scaled logits ``q·kᵀ/√D`` in fp64.

    Args:
        q: ``(batch, q_heads, n_queries, head_dim)``.
        k: ``(batch, kv_heads, seq_len, head_dim)``.
    Returns:
        ``(batch, q_heads, n_queries, seq_len)`` fp64.
    Raises:
        ValueError: shapes that do not fit together (see :func:`expand_kv`).
    """
    _check_qkv(q, k)
    d = int(q.shape[-1])
    kk = expand_kv(_f64(k), int(q.shape[1]))
    return torch.matmul(_f64(q), kk.transpose(-1, -2)) / math.sqrt(d)


def kl_rows(logp: torch.Tensor, logq: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
    """``KL(p‖q) = Σ_t p_t (log p_t − log q_t)`` per row of log-probabilities (nats, last dim summed).

    Terms with ``p_t == 0`` contribute 0. Exactly 0 when ``logp`` equals ``logq``. ``p`` may be passed
    when already computed (``logp.exp()``).
    """
    p = logp.exp() if p is None else p
    diff = logp - logq
    out = (p * diff).sum(-1)
    # a non-finite term (−inf − (−inf) = NaN where p = 0, or an underflowed log q) makes its row's sum
    # non-finite: only then are the rows summed again with the p = 0 terms set to 0 (checking the
    # (rows,) result instead of every (rows × seq_len) term; the same numbers either way)
    if not bool(torch.isfinite(out).all()):
        out = (p * torch.where(p > 0, diff, torch.zeros_like(diff))).sum(-1)
    return out.clamp_min(0.0)


@dataclass
class AttentionError:
    """Attention-level error of one (q, K, V) against (q, K̂, V̂), every field a float averaged over
    (batch, query heads, queries).

    Attributes:
        out_mae, out_mse: ``mean|Ô − O|`` and ``mean (Ô − O)²`` over all output elements (V units, V units²).
        out_rel_mse: ``Σ(Ô − O)² / ΣO²`` (dimensionless).
        cos_drift: mean over query rows of ``1 − cos(O, Ô)`` along head_dim (0 when identical).
        out_norm_gap: mean over query rows of the signed relative norm gap ``(‖Ô‖ − ‖O‖)/‖O‖``.
        kl_fwd, kl_rev: mean over query rows of ``KL(p‖p̂)`` and ``KL(p̂‖p)`` (nats).
        logit_bias2, logit_var, logit_mse: of the inner-product error ``e_t = q·k̂_t − q·k_t`` (unscaled,
            no 1/√D): per query row ``(mean_t e)²``, ``var_t e`` (population) and ``mean_t e²``, averaged
            over rows; ``logit_bias2 + logit_var == logit_mse``.
        attn_k_err: mean over rows of ``Σ_t p_t ‖k̂_t − k_t‖²`` (K units²) with the exact attention ``p``.
        attn_k_rel_err: ``Σ_rows Σ_t p_t‖k̂_t − k_t‖² / Σ_rows Σ_t p_t‖k_t‖²`` (dimensionless).
    """

    out_mae: float
    out_mse: float
    out_rel_mse: float
    cos_drift: float
    out_norm_gap: float
    kl_fwd: float
    kl_rev: float
    logit_bias2: float
    logit_var: float
    logit_mse: float
    attn_k_err: float
    attn_k_rel_err: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class AttentionReference:
    """The exact side of :func:`attention_error` (``q``, ``K``, ``V`` → logits, ``log p``, ``p``, ``O``),
    computed once and reusable against several reconstructions of the same prefix.

    Build it with :func:`attention_reference`. Tensors are fp64, queries grouped by the KV head they read:
    ``qg`` ``(batch, kv_heads, g·n_queries, head_dim)``, ``ip``/``logp``/``p`` ``(batch, kv_heads,
    g·n_queries, seq_len)``, ``o`` ``(batch, kv_heads, g·n_queries, head_dim)``, ``k``/``knorm2`` the keys
    and their squared norms, ``plogp`` ``(batch, kv_heads, g·n_queries)`` the rows' ``Σ_t p_t log p_t``
    (minus the entropy; computed by :func:`attention_reference`, ``None`` elsewhere). The reference
    :func:`attention_reference` returns keeps ``ip`` only (``logp`` and ``p`` are ``None``): each batch
    index's ``log p`` and ``p`` are computed from it again when that index is compared (:func:`_slice`), by
    the same operations on the same values, which saves two ``seq_len``-wide arrays.
    """

    qg: torch.Tensor
    k: torch.Tensor
    ip: torch.Tensor
    logp: torch.Tensor | None
    p: torch.Tensor | None
    o: torch.Tensor
    knorm2: torch.Tensor
    head_dim: int
    w_ref: torch.Tensor | None = None  # (batch, kv_heads, g·n_queries, 1): Σ_t p_t‖k_t‖² (exact side only)
    plogp: torch.Tensor | None = None  # (batch, kv_heads, g·n_queries): Σ_t p_t log p_t (exact side only)


@torch.no_grad()
def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionReference:
    """Exact attention of ``q`` ``(batch, q_heads, n_queries, head_dim)`` over ``k``, ``v``
    ``(batch, kv_heads, seq_len, head_dim)`` in fp64 (no mask).

    Raises:
        ValueError: shapes that do not fit together, or ``q_heads`` not a multiple of ``kv_heads``.
    """
    _check_qkv(q, k, v)
    b, hq, nq, d = (int(s) for s in q.shape)
    hkv = int(k.shape[1])
    if hq % hkv:
        raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hkv}) for GQA")
    # group the queries by the KV head they read (head h → KV head h // g): (B, H_kv, g·nq, D),
    # so K and V are never copied per query head
    qg = _f64(q).reshape(b, hkv, (hq // hkv) * nq, d)
    kf, vf = _f64(k), _f64(v)
    knorm2 = (kf * kf).sum(-1)
    ip = qg.new_empty(b, hkv, int(qg.shape[2]), int(kf.shape[2]))
    o, w_ref, plogp = qg.new_empty(*ip.shape[:3], d), qg.new_empty(*ip.shape[:3], 1), qg.new_empty(ip.shape[:3])
    for i in range(b):  # one batch index at a time keeps the (rows × seq_len) temporaries cache-sized
        one = slice(i, i + 1)
        ip[one] = torch.matmul(qg[one], kf[one].transpose(-1, -2))  # unscaled inner products
        logp, p = _softmax_of(ip[one], d)
        o[one], w_ref[one] = torch.matmul(p, vf[one]), torch.matmul(p, knorm2[one].unsqueeze(-1))
        plogp[one] = _rowdot(p, logp)
    return AttentionReference(qg, kf, ip, None, None, o, knorm2, d, w_ref, plogp)


def _softmax_of(ip: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p, p)`` of the unscaled inner products ``ip``: ``log_softmax(ip/√head_dim)`` and its ``exp``."""
    logp = torch.log_softmax(ip / math.sqrt(head_dim), dim=-1)
    return logp, logp.exp()


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``Σ_t a_t b_t`` along the last dim in one fused reduction (no ``a·b`` temporary). The exact and the
    reconstructed side both go through it, so equal inputs give bit-equal sums."""
    return torch.einsum("...t,...t->...", a, b)


def _sums(ref: AttentionReference, k_hat: torch.Tensor, v_hat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per batch index: sums of every per-element / per-row term and the counts (fp64 ``(batch,)``)."""
    khf, vhf = _f64(k_hat), _f64(v_hat)
    d = ref.head_dim
    ip_hat = torch.matmul(ref.qg, khf.transpose(-1, -2))
    logp_hat, p_hat = _softmax_of(ip_hat, d)
    o, o_hat = ref.o, torch.matmul(p_hat, vhf)
    diff = o_hat - o
    no, nh = o.norm(dim=-1), o_hat.norm(dim=-1)
    # 1 − cos(o, ô) = ½‖o/‖o‖ − ô/‖ô‖‖²: exactly 0 for identical rows, accurate for small drifts;
    # a zero row against a non-zero one counts as drift 1, two zero rows as 0
    u = o / no.clamp_min(1e-300).unsqueeze(-1)
    u_hat = o_hat / nh.clamp_min(1e-300).unsqueeze(-1)
    drift = 0.5 * ((u - u_hat) ** 2).sum(-1)
    drift = torch.where((no > 0) & (nh > 0), drift, torch.where((no == 0) & (nh == 0), 0.0, 1.0))
    gap = torch.where(no > 0, (nh - no) / no.clamp_min(1e-300), torch.zeros_like(no))

    # inner-product error e = q·k̂ − q·k: mean, variance (centred in place) and mean square = bias² + var
    e = ip_hat - ref.ip
    n_t = int(e.shape[-1])
    e_mean = e.mean(-1)
    ec = e.sub_(e_mean.unsqueeze(-1))
    var = _rowdot(ec, ec) / n_t
    dk = khf - ref.k
    kerr = (dk * dk).sum(-1)  # (B, H_kv, T)
    # KL(p‖p̂) = Σ p log p − Σ p log p̂ and KL(p̂‖p) = Σ p̂ log p̂ − Σ p̂ log p: row dot products, the first
    # term of the forward one precomputed with the reference (exactly 0 when p̂ == p: bit-equal sums)
    plogp = ref.plogp if ref.plogp is not None else _rowdot(ref.p, ref.logp)
    kl_fwd = plogp - _rowdot(ref.p, logp_hat)
    kl_rev = _rowdot(p_hat, logp_hat) - _rowdot(p_hat, ref.logp)
    if bool(torch.isfinite(kl_fwd).all() & torch.isfinite(kl_rev).all()):
        kl_fwd, kl_rev = kl_fwd.clamp_min(0.0), kl_rev.clamp_min(0.0)
    else:  # a log p of −inf (p = 0) or a non-finite logit: the term-by-term form, which skips p = 0 terms
        kl_fwd, kl_rev = kl_rows(ref.logp, logp_hat, ref.p), kl_rows(logp_hat, ref.logp, p_hat)

    def per_b(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1).sum(-1)

    return {
        "abs": per_b(diff.abs()),
        "sq": per_b(diff * diff),
        "o2": per_b(o * o),
        "drift": per_b(drift),
        "gap": per_b(gap),
        "kl_fwd": per_b(kl_fwd),
        "kl_rev": per_b(kl_rev),
        "bias2": per_b(e_mean**2),
        "var": per_b(var),
        "msq": per_b(e_mean**2 + var),
        "w_err": per_b(torch.matmul(ref.p, kerr.unsqueeze(-1))),
        "w_ref": per_b(ref.w_ref if ref.w_ref is not None else torch.matmul(ref.p, ref.knorm2.unsqueeze(-1))),
    }


def _finish(s: dict[str, float], n_elems: int, n_rows: int) -> AttentionError:
    return AttentionError(
        out_mae=s["abs"] / n_elems,
        out_mse=s["sq"] / n_elems,
        out_rel_mse=0.0 if s["sq"] == 0.0 else s["sq"] / max(s["o2"], 1e-300),
        cos_drift=s["drift"] / n_rows,
        out_norm_gap=s["gap"] / n_rows,
        kl_fwd=s["kl_fwd"] / n_rows,
        kl_rev=s["kl_rev"] / n_rows,
        logit_bias2=s["bias2"] / n_rows,
        logit_var=s["var"] / n_rows,
        logit_mse=s["msq"] / n_rows,
        attn_k_err=s["w_err"] / n_rows,
        attn_k_rel_err=0.0 if s["w_err"] == 0.0 else s["w_err"] / max(s["w_ref"], 1e-300),
    )


def _check_hat(ref: AttentionReference, k_hat: torch.Tensor, v_hat: torch.Tensor) -> None:
    want = tuple(ref.k.shape)
    for name, a in (("k_hat", k_hat), ("v_hat", v_hat)):
        if tuple(a.shape) != want:
            raise ValueError(f"{name} {tuple(a.shape)} must have the shape of its reference {want}")


@torch.no_grad()
def attention_error(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor
) -> AttentionError:
    """Compare ``O = softmax(q·Kᵀ/√D)·V`` with ``Ô = softmax(q·K̂ᵀ/√D)·V̂`` (docs/DESIGN.md §4), in fp64, pooled over
    the whole batch.

    Args:
        q: queries ``(batch, q_heads, n_queries, head_dim)``.
        k, v: exact keys and values ``(batch, kv_heads, seq_len, head_dim)``.
        k_hat, v_hat: their reconstructions, same shape.
    Returns:
        :class:`AttentionError`. With ``k_hat == k`` and ``v_hat == v`` every field is exactly 0.
    Raises:
        ValueError: mismatched shapes.
    """
    return _reduce(attention_reference(q, k, v), k_hat, v_hat, pooled=True)[0]


@torch.no_grad()
def attention_error_by_batch(reference: AttentionReference, k_hat: torch.Tensor, v_hat: torch.Tensor) -> list[AttentionError]:
    """:func:`attention_error` for each index of dim 0 (a layer of real data) in one vectorized pass,
    against a precomputed exact side (:func:`attention_reference`), e.g. shared by several methods or
    regimes.

    Args:
        reference: the exact attention of ``(q, K, V)``.
        k_hat, v_hat: reconstructions of ``K``, ``V`` ``(batch, kv_heads, seq_len, head_dim)``.
    Returns:
        one :class:`AttentionError` per batch index.
    Raises:
        ValueError: ``k_hat``/``v_hat`` not of the reference keys' shape.
    """
    return _reduce(reference, k_hat, v_hat, pooled=False)


def _slice(ref: AttentionReference, i: int) -> AttentionReference:
    one = slice(i, i + 1)
    logp, p = _softmax_of(ref.ip[one], ref.head_dim) if ref.logp is None else (ref.logp[one], ref.p[one])
    return AttentionReference(ref.qg[one], ref.k[one], ref.ip[one], logp, p, ref.o[one],
                              ref.knorm2[one], ref.head_dim, None if ref.w_ref is None else ref.w_ref[one],
                              None if ref.plogp is None else ref.plogp[one])


def _reduce(ref: AttentionReference, k_hat: torch.Tensor, v_hat: torch.Tensor, *, pooled: bool) -> list[AttentionError]:
    _check_hat(ref, k_hat, v_hat)
    # one batch index at a time keeps the (rows × seq_len) temporaries cache-sized
    parts = [_sums(_slice(ref, i), k_hat[i : i + 1], v_hat[i : i + 1]) for i in range(int(ref.k.shape[0]))]
    sums = {n: torch.cat([pt[n] for pt in parts]) for n in parts[0]}
    b, hkv, rows, d = (int(x) for x in ref.o.shape)
    if pooled:
        return [_finish({n: float(t.sum()) for n, t in sums.items()}, b * hkv * rows * d, b * hkv * rows)]
    cols = {n: t.tolist() for n, t in sums.items()}
    return [_finish({n: cols[n][i] for n in cols}, hkv * rows * d, hkv * rows) for i in range(b)]


def incoherence(x: torch.Tensor) -> torch.Tensor:
    """Per-channel incoherence ``max_c m_c / RMS_c(m)`` where ``m_c`` is the RMS of channel ``c`` over
    the tokens (docs/DESIGN.md §4).

    For a single token (``seq_len == 1``) this is ``max|x| / RMS(x)`` of the vector: ``√D`` for a one-hot
    outlier, 1 for a vector of equal magnitudes (e.g. the Hadamard rotation of a one-hot vector).

    Args:
        x: ``(batch, heads, seq_len, head_dim)``.
    Returns:
        ``(batch, heads)`` fp64, in ``[1, √head_dim]``; 1 for an all-zero (batch, head) slice.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, heads, seq_len, head_dim), got shape {tuple(x.shape)}")
    return incoherence_of_squares(_f64(x).pow(2))


def incoherence_of_squares(x2: torch.Tensor) -> torch.Tensor:
    """:func:`incoherence` from the element-wise squares ``x²`` (fp64, same shape as ``x``), e.g. when the
    caller already holds them; the same values bit for bit."""
    m = x2.mean(-2).sqrt()  # (B, H, D) channel magnitudes
    rms = m.pow(2).mean(-1).sqrt()
    mx = m.amax(-1)
    return torch.where(rms > 0, mx / rms.clamp_min(1e-300), torch.ones_like(rms))


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    """Ordinary least-squares slope of ``ys`` against ``xs`` (``cov(x, y) / var(x)``); 0 for fewer than
    two distinct ``xs``."""
    if len(xs) != len(ys):
        raise ValueError("xs and ys must have the same length")
    n = len(xs)
    if n < 2:
        return 0.0
    mx = math.fsum(xs) / n
    my = math.fsum(ys) / n
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
