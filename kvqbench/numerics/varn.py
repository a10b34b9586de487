"""VarN — alternating row/column variance normalization of a tile (KVarN, arXiv:2606.03458, §3, step 2).

Invariant (tested): the returned scales never leave the tile more imbalanced than it was —
``imbalance(tile / s_col / s_row) <= imbalance(tile)`` — because the identity state is the first
candidate of the best-so-far rule.

Algorithm, per tile ``X`` of shape ``[R, C]`` (rows = the rounding axis), all in fp32, log domain::

    log_s_col = 0 [1, C];  log_s_row = 0 [R, 1]
    best = identity state, best_imbalance = imbalance(X)
    repeat n_iter times:
        B = X / exp(log_s_col) / exp(log_s_row)
        log_s_col = clip(log_s_col + log(clamp(std_unbiased(B, over rows), 1e-3, 1e3)), -0.3, 10)
        B = X / exp(log_s_col) / exp(log_s_row)
        log_s_row = clip(log_s_row + log(clamp(std_unbiased(B, over cols), 1e-3, 1e3)), -0.3, 10)
        B = X / exp(log_s_col) / exp(log_s_row)
        imb = max/min(column stds of B) + max/min(row stds of B)     (min floored at 1e-8)
        if imb <= best_imbalance: best = (log_s_col, log_s_row)       (ties go to the later iterate)

No mean is subtracted. A standard deviation over a single sample (a 1-token partial tile) is
undefined; it is taken as 1 (no rescaling along that axis) instead of NaN.
"""

from __future__ import annotations

import ctypes
import math
import os
from typing import Callable, NamedTuple

import torch

from kvqbench.kernels import build as cbuild

__all__ = ["VarNResult", "varn", "imbalance", "transposed", "balanced_rtn_rows", "STD_CLAMP", "LOG_SCALE_CLIP",
           "MIN_FLOOR", "DEFAULT_ITERS"]

STD_CLAMP = (1e-3, 1e3)
LOG_SCALE_CLIP = (-0.3, 10.0)
MIN_FLOOR = 1e-8
DEFAULT_ITERS = 16


class VarNResult(NamedTuple):
    """Scales of the best iterate, batched like the input tiles ``[..., R, C]``.

    Attributes:
        s_row: ``[..., R, 1]`` row scales (``exp(log_s_row)``), fp32.
        s_col: ``[..., 1, C]`` column scales, fp32.
        imbalance: ``[...]`` imbalance of ``tile / s_col / s_row``.
        imbalance_init: ``[...]`` imbalance of the input tile (the identity state).
        best_iter: ``[...]`` int64, the iteration the scales come from (0 = identity, 1..n_iter).
    """

    s_row: torch.Tensor
    s_col: torch.Tensor
    imbalance: torch.Tensor
    imbalance_init: torch.Tensor
    best_iter: torch.Tensor


def _std(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased std over ``dim`` (keepdim); 1 where the axis has a single sample."""
    if x.shape[dim] < 2:
        return torch.ones_like(x.narrow(dim, 0, 1))
    return x.std(dim=dim, unbiased=True, keepdim=True)


def imbalance(tile: torch.Tensor) -> torch.Tensor:
    """``max/min`` of the column stds plus ``max/min`` of the row stds of ``tile`` ``[..., R, C]``
    (unbiased stds, each min floored at 1e-8). Returns ``[...]`` in the tile's dtype."""
    col = _std(tile, -2).squeeze(-2)  # [..., C]
    row = _std(tile, -1).squeeze(-1)  # [..., R]
    return col.amax(-1) / col.amin(-1).clamp_min(MIN_FLOOR) + row.amax(-1) / row.amin(-1).clamp_min(MIN_FLOOR)


#: the granularity of the two-pass fallback (:func:`_std_from_sums`): groups of ``max(1, 512 KiB // tile
#: bytes)`` consecutive tiles (counted from the first tile of the call). When any std of a group would lose
#: digits to cancellation, the stds of the whole group are recomputed two-pass. This grouping is part of the
#: numerics (it decides which stds are one-pass and which two-pass), kept fixed so that results are
#: reproducible bit for bit; it no longer sets how many tiles are processed together
_GROUP_BYTES = 1 << 19
#: at most this many bytes of tiles are processed together: enough that the ~50 small per-iteration
#: operations on the scale vectors cost little beside the sums over the chunk (a multiple of the
#: fallback group), few enough that the chunk's four layouts (x, x², and both transposed, 4× the chunk)
#: stay in the cache a core gets: measured on the shared 2-core host (1 thread, 256 and 1024 tiles of
#: 128×128, CPU time, medians of 5), 8 MiB took 0.84× the time of 16 MiB, and 4, 6 and 12 MiB more than 8
#: (with the row sums as a matrix product, :func:`_row_sums`: 8 MiB against 4 and 16 MiB, same ranking)
_CHUNK_BYTES = 1 << 23
#: the same for the compiled half-steps (:func:`_c_iterations`; the smaller of the two), which keep only the
#: tiles and their transposes (2× the chunk) and make a dozen small torch operations per iteration: 1 MiB
#: (both layouts in a 2 MiB L2) took 0.93–0.99× the time of 1.5, 2, 4 and 8 MiB (1 thread, 64, 256 and 1024
#: tiles of 128×128, CPU time, medians of 7, shared 2-core host)
_C_CHUNK_BYTES = 1 << 20
#: … and for the one-call iterations (MKL's vector math available, :func:`_vml`): one fallback group, 512 KiB,
#: took 0.86–0.90× the time of 1 MiB and 0.69–0.70× that of 2 MiB (same measurement)
_C1_CHUNK_BYTES = 1 << 19


@torch.no_grad()
def varn(tiles: torch.Tensor, n_iter: int = DEFAULT_ITERS, *, tiles_t: torch.Tensor | None = None) -> VarNResult:
    """Run VarN on a batch of tiles.

    Everything is fp32, as the recipe. Per iteration, two mat-vecs and one matrix product give the sums and the
    sums of squares of the rescaled tile along both axes (one-pass stds); the balanced tile is never
    materialized (see :func:`_varn_chunk`). On the CPU, where a C compiler exists, compiled kernels
    (``varn_sums.c``, :func:`_c_iterations`) run the iterations with one pass over the tiles per half-step,
    with the same bits (checked once per tile shape against the torch products, tested against the torch
    loop); ``KVQBENCH_KERNELS=0`` keeps the torch path. Stds that would lose digits to cancellation are
    recomputed
    two-pass, per group of tiles (:data:`_GROUP_BYTES`), so every std is accurate to fp32 rounding.
    The result of a tile depends only on the tile and on whether a tile of its group needed the two-pass
    fallback; it is bit for bit the same at every thread count.

    Args:
        tiles: ``[..., R, C]`` floating tensor (computed in fp32); every leading index is an
            independent tile (e.g. ``[n_tiles, D, G]`` for KVarN's K, ``[n_tiles, G, D]`` for V).
        n_iter: iterations (paper: 16; later reference code: 8). ``0`` returns the identity.
        tiles_t: optional, the same tiles transposed and contiguous, ``[..., C, R]`` (``tiles`` is then
            typically a transposed copy of it, e.g. KVarN's K, whose tiles are token-major): saves one
            transposing copy. Same values, same results.

    Returns:
        :class:`VarNResult`; the balanced tile is ``tiles / s_col / s_row``.

    Raises:
        ValueError: ``tiles`` has rank < 2, ``n_iter`` is negative or ``tiles_t`` does not hold as many
            ``[C, R]`` tiles as ``tiles``.
    """
    if tiles.dim() < 2:
        raise ValueError(f"tiles must have shape [..., R, C], got {tuple(tiles.shape)}")
    if not isinstance(n_iter, int) or isinstance(n_iter, bool) or n_iter < 0:
        raise ValueError(f"n_iter must be an int >= 0, got {n_iter!r}")
    lead = tiles.shape[:-2]
    r, c = tiles.shape[-2:]
    x = tiles.to(torch.float32).reshape(-1, r, c)
    xt = None
    if tiles_t is not None:
        if tiles_t.numel() != x.numel() or tuple(tiles_t.shape[-2:]) != (c, r):
            raise ValueError(f"tiles_t must hold the tiles transposed, [..., {c}, {r}], got {tuple(tiles_t.shape)}")
        xt = tiles_t.to(torch.float32).reshape(-1, c, r)
    tile_bytes = max(1, r * c * 4)
    group = max(1, _GROUP_BYTES // tile_bytes)
    n = x.shape[0]
    # On the CPU every operation runs on one thread: the kernels, hence the results, are then the same at
    # every thread count, and splitting such operations across the intra-op pool cost more than it saved.
    # (Spreading the chunks over a pool of Python threads was tried: on the shared 2-core machine it was
    # slower at 2 threads, the threads contending for the GIL and the cores.)
    nt = torch.get_num_threads()
    single = x.device.type == "cpu" and nt > 1
    if single:
        torch.set_num_threads(1)
    try:
        compiled = _c_kernels_for(2, r, c, x.device) is not None
        chunk_bytes = _CHUNK_BYTES
        if compiled:
            chunk_bytes = min(chunk_bytes, _C_CHUNK_BYTES if _vml() is None else _C1_CHUNK_BYTES)
        chunk = group * max(1, chunk_bytes // (group * tile_bytes)) if group > 1 else 1
        spans = [(i, min(i + chunk, n)) for i in range(0, n, chunk)]
        if spans and spans[-1][1] - spans[-1][0] > 1 and (spans[-1][1] - spans[-1][0]) % group == 1:
            # a group of one tile is a batch of one (torch runs its mat-vecs with other kernels, which round
            # differently): keep it one
            i, j = spans.pop()
            spans += [(i, j - 1), (j - 1, j)]
        parts = [_varn_chunk(x[i:j].contiguous(), n_iter, group, None if xt is None else xt[i:j])
                 for i, j in spans]
    finally:
        if single:
            torch.set_num_threads(nt)
    if not parts:  # no tiles
        parts = [_varn_chunk(x, n_iter, group)]
    out = [torch.cat(p) if len(p) > 1 else p[0] for p in zip(*parts)]
    s_row, s_col, imb, imb0, best_iter = out
    return VarNResult(s_row.reshape(*lead, r, 1), s_col.reshape(*lead, 1, c), imb.reshape(lead),
                      imb0.reshape(lead), best_iter.reshape(lead))


def _scaled_std(x: torch.Tensor, scale: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased std of ``x·scale`` over ``dim`` (keepdim), two-pass (mean, then the norm of the
    deviations); 1 where the axis has a single sample."""
    n = x.shape[dim]
    if n < 2:
        return torch.ones_like(x.narrow(dim, 0, 1))
    z = torch.mul(x, scale, out=torch.empty_like(x))
    z.sub_(z.mean(dim, keepdim=True))
    return torch.linalg.vector_norm(z, dim=dim, keepdim=True) / math.sqrt(n - 1)


#: per tile shape ``(R, C)``: whether :func:`_row_sums` gives torch's batched mat-vec bits here
_GEMM_MATCHES: dict[tuple[int, int], bool] = {}


def _row_sums(st: torch.Tensor, ic: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row sums ``x·icᵀ`` and ``x²·(ic²)ᵀ`` of tiles ``x`` ``[n, R, C]`` from their transposes laid side
    by side, ``st`` ``[n, C, 2R]`` (``st[t] = [x[t]ᵀ, (x[t]²)ᵀ]``), as one batched matrix product of the two
    rows ``[ic; ic²]`` (``w``, an ``[n, 2, C]`` buffer, overwritten) with ``st``: ``(s1, s2)``, views
    ``[n, R, 1]`` (the two cross terms of the product are computed and not used).

    With two or more rows on the left, torch runs its matrix-matrix kernel, which (on this class of CPU,
    for the tile shapes :func:`_row_sums_match` checks) accumulates every output in column order with one
    fused multiply-add per term: the bits of the mat-vec ``torch.matmul(x, icᵀ)``, which runs one scalar
    chain per row and is several times slower."""
    r = st.shape[-1] // 2
    w[:, :1].copy_(ic)
    torch.mul(ic, ic, out=w[:, 1:])
    o = torch.matmul(w, st)  # [n, 2, 2R]
    return o[:, 0, :r].unsqueeze(-1), o[:, 1, r:].unsqueeze(-1)


def _row_sums_match(r: int, c: int) -> bool:
    """Whether :func:`_row_sums` reproduces ``torch.matmul(x, vᵀ)`` and ``torch.matmul(x², (v²)ᵀ)`` bit for
    bit on tiles ``[R, C]`` (CPU, the caller's thread count — VarN's one —, a batch of three random tiles with
    an offset): checked once per shape and process."""
    key = (r, c)
    if key not in _GEMM_MATCHES:
        g = torch.Generator().manual_seed(r * 7919 + c)
        x = torch.randn(3, r, c, generator=g) * 3.0 + 1.0
        v = torch.rand(3, 1, c, generator=g) + 0.5
        st = torch.cat((x, x * x), 1).transpose(-1, -2).contiguous()
        s1, s2 = _row_sums(st, v, torch.empty(3, 2, c))
        _GEMM_MATCHES[key] = torch.equal(s1, torch.matmul(x, v.transpose(-1, -2))) and \
            torch.equal(s2, torch.matmul(x * x, (v * v).transpose(-1, -2)))
    return _GEMM_MATCHES[key]


def transposed(tiles: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tiles ``[..., R, C]`` transposed, ``[..., C, R]``, contiguous (written to ``out`` when given, a
    contiguous tensor of that shape and dtype): a copy, so exactly the same values. For contiguous fp32 CPU
    tiles the compiled blocked transpose of ``varn_sums.c`` (several times faster than torch's strided copy)
    when available, else torch's copy."""
    r, c = tiles.shape[-2:]
    shape = (*tiles.shape[:-2], c, r)
    if out is None:
        out = tiles.new_empty(shape)
    elif tuple(out.shape) != shape or out.dtype != tiles.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tiles.dtype} tensor of shape {shape}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    lib = _c_kernels() if tiles.device.type == "cpu" and tiles.dtype == torch.float32 \
        and tiles.is_contiguous() and out.device.type == "cpu" else None
    if lib is None or tiles.numel() == 0:
        return out.copy_(tiles.transpose(-1, -2))
    lib.varn_transpose(tiles.data_ptr(), tiles.numel() // max(1, r * c), r, c, out.data_ptr())
    return out


def balanced_rtn_rows(tiles: torch.Tensor, s_col: torch.Tensor, s_row: torch.Tensor, bits: int,
                      floor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Compiled: ``b = tiles / s_col / s_row``, then asymmetric RTN of ``b`` per row — ``lo``/``hi`` the row's
    min/max, ``scale = max((hi − lo)/(2^bits − 1), floor)``, codes ``clamp(round_half_even((b − lo)/scale), 0,
    2^bits − 1)`` — in one pass per row (``tiles`` is not modified). ``tiles`` ``[..., R, C]``, ``s_col``
    ``[..., 1, C]``, ``s_row`` ``[..., R, 1]``, all contiguous fp32 on the CPU; ``bits`` 1..8.
    Returns ``(codes uint8 [..., R, C], lo [..., R, 1], scale [..., R, 1])``, or ``None`` where the compiled
    kernels are not available, the inputs are not as above, or some ``b`` is exactly zero (the sign of a zero
    minimum depends on the order of the comparisons: the caller's torch code decides) or not finite. The caller checks its
    bits against its torch code (the same IEEE operations in the same order)."""
    r, c = tiles.shape[-2:]
    ok = (tiles.device.type == "cpu" and 1 <= bits <= 8 and c >= 1 and all(
        t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in (tiles, s_col, s_row))
        and s_col.numel() * r == tiles.numel() and s_row.numel() * c == tiles.numel())
    lib = _c_kernels() if ok else None
    if lib is None:
        return None
    lead = tiles.shape[:-2]
    q = torch.empty(tiles.shape, dtype=torch.uint8)
    lo, scale = tiles.new_empty(*lead, r, 1), tiles.new_empty(*lead, r, 1)
    work = tiles.new_empty(c)  # held here while the kernel writes to it
    if lib.balanced_rtn_rows(tiles.data_ptr(), s_col.data_ptr(), s_row.data_ptr(), tiles.numel() // max(1, r * c),
                             r, c, ctypes.c_float(2**bits - 1), ctypes.c_float(floor), q.data_ptr(), lo.data_ptr(),
                             scale.data_ptr(), work.data_ptr()):
        return None
    return q, lo, scale


#: per tile shape ``(R, C)``: whether the compiled sums (:func:`_c_kernels`) give the torch products' bits
_C_MATCHES: dict[tuple[int, int], bool] = {}


def _c_kernels() -> ctypes.CDLL | None:
    """The compiled one-pass sums of ``varn_sums.c`` (:mod:`kvqbench.numerics.cbuild`), or ``None``."""
    lib = cbuild.load("varn_sums.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        for fn in (lib.varn_col_sums, lib.varn_row_sums):
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                           ctypes.c_void_p, ctypes.c_void_p]
        vp, lg, fl = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
        lib.varn_row_half.restype = lib.varn_col_half.restype = ctypes.c_int
        lib.varn_row_half.argtypes = [vp, vp, lg, lg, lg, fl, vp, vp, vp, vp]
        lib.varn_col_half.argtypes = [vp, vp, vp, lg, lg, lg, fl, vp, vp, vp, vp, vp]
        lib.varn_transpose.restype = None
        lib.varn_transpose.argtypes = [vp, lg, lg, lg, vp]
        lib.varn_iterate.restype = ctypes.c_long
        lib.varn_iterate.argtypes = [vp, vp, lg, lg, lg, lg, lg, lg, fl, fl, fl, fl, fl, fl, vp, vp, vp,
                                     ctypes.c_longlong] + [vp] * 16
        lib.balanced_rtn_rows.restype = ctypes.c_int
        lib.balanced_rtn_rows.argtypes = [vp, vp, vp, lg, lg, lg, fl, fl, vp, vp, vp, vp]
        lib.varn_track.restype = None
        lib.varn_track.argtypes = [lg, lg, lg, fl, fl, fl, lg, vp, vp, vp, vp, vp, vp, vp, vp, vp]
        lib._kvq_typed = True
    return lib


def _c_col_sums(lib: ctypes.CDLL, x: torch.Tensor, ir: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(irᵀ·x, (ir²)ᵀ·x²)`` ``[n, 1, C]`` of contiguous fp32 CPU tiles ``x`` ``[n, R, C]`` and row weights
    ``ir`` ``[n, R, 1]``, one pass over ``x`` (``R`` a multiple of 8)."""
    n, r, c = x.shape
    ir = ir.contiguous()
    s1, s2 = x.new_empty(n, 1, c), x.new_empty(n, 1, c)
    lib.varn_col_sums(x.data_ptr(), ir.data_ptr(), n, r, c, s1.data_ptr(), s2.data_ptr())
    return s1, s2


def _c_row_sums(lib: ctypes.CDLL, xt: torch.Tensor, ic: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x·icᵀ, x²·(ic²)ᵀ)`` ``[n, R, 1]`` from the contiguous fp32 CPU transposed tiles ``xt`` ``[n, C, R]``
    and column weights ``ic`` ``[n, 1, C]``, one pass over ``xt``."""
    n, c, r = xt.shape
    ic = ic.contiguous()
    s1, s2 = xt.new_empty(n, r, 1), xt.new_empty(n, r, 1)
    lib.varn_row_sums(xt.data_ptr(), ic.data_ptr(), n, r, c, s1.data_ptr(), s2.data_ptr())
    return s1, s2


def _c_kernels_for(n: int, r: int, c: int, device: torch.device) -> ctypes.CDLL | None:
    """The compiled sums when they may replace the torch products of a chunk of ``n`` tiles ``[R, C]``:
    on the CPU, for a batch of several tiles (a batch of one runs other torch kernels), ``R`` a multiple of 8,
    and where a once-per-shape check on random tiles gives torch's bits (:func:`_c_matches`); else ``None``."""
    if device.type != "cpu" or n < 2 or r < 8 or r % 8 or c < 2:
        return None
    lib = _c_kernels()
    if lib is None or not _c_matches(lib, r, c):
        return None
    return lib


#: ``(exp, log, sqrt, mode)``: MKL's vector math entry points torch's CPU exp/log/sqrt run (fp32), or ``None``
_VML: dict[str, tuple[int, int, int, int] | None] = {}
#: MKL's VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE (torch's mode)
_VML_MODE = 0x2 | 0x140000 | 0x100


def _vml() -> tuple[int, int, int, int] | None:
    """The addresses of ``vmsExp``, ``vmsLn``, ``vmsSqrt`` (Fortran entry points of the MKL linked into
    torch) and torch's mode, when they give torch's fp32 ``exp``, ``log`` and ``sqrt`` bit for bit (checked
    once per process on random data of several lengths, in place and not, at one thread); else ``None``
    (another BLAS, platform or torch build)."""
    if "fns" not in _VML:
        _VML["fns"] = None
        try:
            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
            fns = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in ("VMSEXP_", "VMSLN_",
                                                                                     "VMSSQRT_")]
        except (OSError, AttributeError):
            return None
        proto = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        mode = ctypes.c_longlong(_VML_MODE)
        g = torch.Generator().manual_seed(2606)
        nt = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for fn, ref, lo, hi in zip(fns, (torch.exp, torch.log, torch.sqrt), (-12.0, -9.0, -9.0), (12.0, 9.0, 9.0)):
                call = proto(fn)
                for size in (1, 15, 16, 17, 2053, 65536 + 7):
                    a = torch.rand(size, generator=g) * (hi - lo) + lo
                    if ref is not torch.exp:
                        a = torch.exp(a)
                    n = ctypes.c_longlong(size)
                    y = torch.empty_like(a)
                    call(ctypes.byref(n), a.data_ptr(), y.data_ptr(), ctypes.byref(mode))
                    want = ref(a)
                    b = a.clone()
                    call(ctypes.byref(n), b.data_ptr(), b.data_ptr(), ctypes.byref(mode))
                    if not (torch.equal(y, want) and torch.equal(b, want)):
                        return None
        finally:
            torch.set_num_threads(nt)
        _VML["fns"] = (*fns, _VML_MODE)
    return _VML["fns"]


def _c_matches(lib: ctypes.CDLL, r: int, c: int) -> bool:
    """Whether the compiled sums reproduce, bit for bit, the torch products VarN runs otherwise —
    ``torch.matmul(irᵀ, x)``, ``torch.matmul(ir²ᵀ, x²)``, ``torch.matmul(x, icᵀ)``, ``torch.matmul(x², ic²ᵀ)``
    — on batches of random tiles ``[R, C]`` with an offset (CPU, the caller's thread count — VarN's one):
    checked once per shape and process. The column sums follow the summation order of the CPU's BLAS
    (``varn_sums.c``); on another BLAS or CPU this check fails and VarN keeps the torch products."""
    key = (r, c)
    if key not in _C_MATCHES:
        ok = True
        for n in (2, 3, 17):
            g = torch.Generator().manual_seed(r * 7919 + c * 31 + n)
            x = torch.randn(n, r, c, generator=g) * 3.0 + 1.0
            ir = torch.rand(n, r, 1, generator=g) + 0.5
            ic = torch.rand(n, 1, c, generator=g) + 0.5
            x2, irt, ict = x * x, ir.transpose(-1, -2), ic.transpose(-1, -2)
            c1, c2 = _c_col_sums(lib, x, ir)
            r1, r2 = _c_row_sums(lib, x.transpose(-1, -2).contiguous(), ic)
            ok = ok and torch.equal(c1, torch.matmul(irt, x)) and torch.equal(c2, torch.matmul(irt * irt, x2)) \
                and torch.equal(r1, torch.matmul(x, ict)) and torch.equal(r2, torch.matmul(x2, ict * ict))
        _C_MATCHES[key] = ok
    return _C_MATCHES[key]


#: one-pass variances ``(Σz² − (Σz)²/n)/(n − 1)`` are trusted while ``mean² ≤ CANCEL·var`` (fp32 keeps
#: ~6 significant digits there); past it the group's stds are recomputed two-pass
_CANCEL = 15.0


def _std_from_sums(s1: torch.Tensor, s2: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Unbiased std from ``Σz``, ``Σz²`` over ``n`` samples (``s1``, ``s2`` ``[t, a, b]``, consumed), and
    ``None`` or, when some value lost too many digits to cancellation, the ``[t]`` mask of those tiles."""
    mean2 = torch.div(s1, n)
    mean2.mul_(mean2)
    var = s2.sub_(s1.mul_(s1).div_(n)).div_(n - 1).clamp_min_(0.0)
    bad = mean2.gt_(var * _CANCEL)
    if not bool(bad.any()):
        return var.sqrt_(), None
    return var.sqrt_(), bad.flatten(1).any(1)


def _imb(cs: torch.Tensor, rs: torch.Tensor) -> torch.Tensor:
    cs, rs = cs.flatten(-2), rs.flatten(-2)
    return cs.amax(-1) / cs.amin(-1).clamp_min(MIN_FLOOR) + rs.amax(-1) / rs.amin(-1).clamp_min(MIN_FLOOR)


def _varn_chunk(x: torch.Tensor, n_iter: int, group: int,
                xt: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """VarN on ``x`` ``[n, R, C]`` (contiguous fp32; its first tile starts a fallback group of ``group``
    tiles; ``xt``: optional, its tiles transposed ``[n, C, R]``): ``(s_row, s_col, imbalance,
    imbalance_init, best_iter)``.

    Stds of the rebalanced tile without materializing it: with ``ir = 1/exp(log_s_row)``, ``ic =
    1/exp(log_s_col)``, its column sums are ``ic ⊙ (irᵀ·x)`` and its row sums ``ir ⊙ (x·ic)`` (and the same
    with ``x²``, ``ir²``, ``ic²`` for the sums of squares): two fp32 mat-vecs (the column sums) and one
    matrix product over the transposed tiles (both row sums, :func:`_row_sums`) per iteration. Where the
    one-pass formula would cancel (a mean large against the std) the stds of the tile's group are
    recomputed two-pass on the materialized scaled tile.
    """
    n, r, c = x.shape
    lo_clip, hi_clip = LOG_SCALE_CLIP
    lo_std, hi_std = STD_CLAMP
    # the compiled one-pass sums (x² formed on the fly: no x² and no side-by-side copy), where they give
    # the torch products' bits (:func:`_c_kernels_for`)
    lib = _c_kernels_for(n, r, c, x.device)
    if lib is not None:
        xt_c = transposed(x) if xt is None else xt.contiguous()
    x2 = x * x if lib is None else None

    def fallback(sd: torch.Tensor, bad: torch.Tensor | None, scale: torch.Tensor, dim: int) -> torch.Tensor:
        if bad is not None:
            groups = torch.nonzero(_group_any(bad, group)).flatten().tolist()
            for g in groups:
                sl = slice(g * group, (g + 1) * group)
                sd[sl] = _scaled_std(x[sl], scale[sl], dim)
        return sd

    def col_std(ir: torch.Tensor, ic: torch.Tensor) -> torch.Tensor:  # [n, 1, C]: stds over rows of x·ir·ic
        if r < 2:
            return x.new_ones(n, 1, c)
        if lib is not None:
            s1, s2 = _c_col_sums(lib, x, ir)
        else:
            irt = ir.transpose(-1, -2)
            s1, s2 = torch.matmul(irt, x), torch.matmul(irt * irt, x2)
        sd, bad = _std_from_sums(s1, s2, r)
        return fallback(sd, bad, ir, -2).mul_(ic)

    # The row sums ``x·icᵀ`` and ``x²·(ic²)ᵀ``: torch's batched mat-vec accumulates every row's dot product
    # in column order with one fused multiply-add per term, slowly (one scalar chain per row); a matrix
    # product over the transposed tiles gives the same bits faster where a once-per-shape check says so
    # (:func:`_row_sums`); elsewhere (other kernels: small tiles, a batch of one tile, another CPU) the
    # mat-vec is kept.
    gemm = lib is None and n > 1 and c >= 2 and x.device.type == "cpu" and _row_sums_match(r, c)
    if gemm:
        # st[t] = [x[t]ᵀ, (x[t]²)ᵀ], [n, C, 2R] (a transposing copy that moves whole rows)
        st = torch.empty(n, c, 2 * r, dtype=x.dtype, device=x.device)
        st[..., :r].copy_(x.transpose(-1, -2) if xt is None else xt)
        torch.mul(st[..., :r], st[..., :r], out=st[..., r:])
        w = torch.empty(n, 2, c, dtype=x.dtype, device=x.device)

    def row_std_unscaled(ic: torch.Tensor) -> torch.Tensor:  # [n, R, 1]: stds over columns of x·ic
        if c < 2:
            return x.new_ones(n, r, 1)
        if lib is not None:
            s1, s2 = _c_row_sums(lib, xt_c, ic)
        elif gemm:
            s1, s2 = _row_sums(st, ic, w)
        else:
            ict = ic.transpose(-1, -2)
            s1, s2 = torch.matmul(x, ict), torch.matmul(x2, ict * ict)
        sd, bad = _std_from_sums(s1, s2, c)
        return fallback(sd, bad, ic, -1)

    log_col = x.new_zeros(n, 1, c)
    log_row = x.new_zeros(n, r, 1)
    best_col, best_row = log_col.clone(), log_row.clone()
    ones_c, ones_r = x.new_ones(n, 1, c), x.new_ones(n, r, 1)
    cs, rs = col_std(ones_r, ones_c), row_std_unscaled(ones_c)
    best_imb = _imb(cs, rs)
    imb0 = best_imb.clone()
    best_iter = torch.zeros(n, dtype=torch.int64, device=x.device)
    e_row = torch.ones_like(log_row)  # exp(log_row)
    if lib is not None:
        _c_iterations(lib, x, xt_c, n_iter, cs, e_row=e_row, log_col=log_col, log_row=log_row,
                      best=(best_imb, best_col, best_row, best_iter), fallback=fallback)
        return torch.exp(best_row), torch.exp(best_col), best_imb, imb0, best_iter
    for it in range(1, n_iter + 1):
        log_col = log_col.add_(cs.clamp_(lo_std, hi_std).log_()).clamp_(lo_clip, hi_clip)
        ic = torch.exp(log_col).reciprocal_()
        rz = row_std_unscaled(ic)  # row stds of tile·ic
        rs_before = rz / e_row
        log_row = log_row.add_(rs_before.clamp_(lo_std, hi_std).log_()).clamp_(lo_clip, hi_clip)
        e_row = torch.exp(log_row)
        ir = torch.reciprocal(e_row)
        rs = rz.mul_(ir)
        cs = col_std(ir, ic)  # also the column stds the next iteration starts from
        cur = _imb(cs, rs)
        better = cur <= best_imb  # ties go to the later iterate
        torch.where(better, cur, best_imb, out=best_imb)
        mask = better[..., None, None]
        torch.where(mask, log_col, best_col, out=best_col)
        torch.where(mask, log_row, best_row, out=best_row)
        best_iter.masked_fill_(better, it)
    return torch.exp(best_row), torch.exp(best_col), best_imb, imb0, best_iter


def _c_iterations(lib: ctypes.CDLL, x: torch.Tensor, xt: torch.Tensor, n_iter: int, cs: torch.Tensor, *,
                  e_row: torch.Tensor, log_col: torch.Tensor, log_row: torch.Tensor,
                  best: tuple[torch.Tensor, ...], fallback: Callable[..., torch.Tensor]) -> None:
    """The iterations of :func:`_varn_chunk`, compiled (``varn_sums.c``), with the same IEEE operations in
    the same order as the torch loop (bit for bit, tested). Where torch's fp32 exp, log and sqrt are MKL's
    vector math (:func:`_vml`), one call runs every iteration, calling those same functions, and returns
    only when a half-step flags tiles for the two-pass fallback (run here in torch, then the call resumes).
    Elsewhere, per iteration, torch takes the two logs, exps and square roots and three calls do the rest —
    row sums and variances, column sums and variances, imbalance and best-so-far — in one pass over the
    tiles each. ``cs``: the initial column stds (clamped here, in place); the state tensors are updated in
    place."""
    n, r, c = x.shape
    lo_clip, hi_clip = LOG_SCALE_CLIP
    lo_std, hi_std = STD_CLAMP
    best_imb, best_col, best_row, best_iter = best
    ic, csd, e_col = x.new_empty(n, 1, c), x.new_empty(n, 1, c), x.new_empty(n, 1, c)
    rz, rsb, ir, rs = (x.new_empty(n, r, 1) for _ in range(4))
    bad = torch.empty(n, dtype=torch.uint8)
    work = x.new_empty(max(r, c))
    f = ctypes.c_float
    lo, hi, cancel, floor = f(lo_std), f(hi_std), f(_CANCEL), f(MIN_FLOOR)
    p = {k: t.data_ptr() for k, t in dict(x=x, xt=xt, ic=ic, csd=csd, e_col=e_col, rz=rz, rsb=rsb, ir=ir, rs=rs,
                                           bad=bad, work=work, e_row=e_row, log_col=log_col, log_row=log_row,
                                           best_imb=best_imb, best_col=best_col, best_row=best_row,
                                           best_iter=best_iter).items()}
    cs.clamp_(lo_std, hi_std)
    vml = _vml()
    if vml is not None:  # every iteration in one call; back here only for a two-pass fallback
        csd.copy_(cs)
        args = (p["x"], p["xt"], n, r, c)
        rest = (n_iter, lo, hi, f(lo_clip), f(hi_clip), cancel, floor, *vml, p["log_col"], p["log_row"],
                p["e_col"], p["e_row"], p["ic"], p["rz"], p["rsb"], p["ir"], p["rs"], p["csd"], p["bad"], p["work"],
                p["best_imb"], p["best_col"], p["best_row"], p["best_iter"])
        at = lib.varn_iterate(*args, 1, 0, *rest)
        while at >= 0:
            it, phase = divmod(at, 3)
            if phase == 1:
                fallback(rz, bad.bool(), ic, -1)
            else:
                fallback(csd, bad.bool(), ir, -2)
            at = lib.varn_iterate(*args, it, phase, *rest)
        return
    for it in range(1, n_iter + 1):
        log_col.add_(cs.log_()).clamp_(lo_clip, hi_clip)
        torch.exp(log_col, out=e_col)
        flagged = lib.varn_row_half(p["xt"], p["e_col"], n, r, c, cancel, p["ic"], p["rz"], p["bad"], p["work"])
        rz.sqrt_()
        if flagged:
            fallback(rz, bad.bool(), ic, -1)
        log_row.add_(torch.div(rz, e_row, out=rsb).clamp_(lo_std, hi_std).log_()).clamp_(lo_clip, hi_clip)
        torch.exp(log_row, out=e_row)
        flagged = lib.varn_col_half(p["x"], p["e_row"], p["rz"], n, r, c, cancel, p["ir"], p["rs"], p["csd"],
                                    p["bad"], p["work"])
        csd.sqrt_()
        if flagged:
            fallback(csd, bad.bool(), ir, -2)
        lib.varn_track(n, r, c, floor, lo, hi, it, p["csd"], p["ic"], p["rs"], p["log_col"], p["log_row"],
                       p["best_imb"], p["best_col"], p["best_row"], p["best_iter"])
        cs = csd


def _group_any(bad: torch.Tensor, group: int) -> torch.Tensor:
    """``[ceil(n / group)]``: whether any tile of each group of ``group`` consecutive tiles is flagged."""
    n = bad.shape[0]
    pad = -n % group
    if pad:
        bad = torch.cat([bad, bad.new_zeros(pad)])
    return bad.view(-1, group).any(1)
