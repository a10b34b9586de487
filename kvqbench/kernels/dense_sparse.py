"""Fast version of ``dense_sparse.quantize`` (:func:`kvqbench.numerics.dense_sparse.quantize`, KVQuant's
per-vector outliers and non-uniform codes, arXiv:2401.18079 §3.4).

Per vector (``c/dense_sparse.c``): the two tails from the column extremes of the vector read as a matrix and
a second look at the few columns that can hold them, then one pass that normalizes and counts the thresholds
below; instead of two ``topk`` selections, three scatters, a sort, a normalization and one comparison pass per
threshold. The same IEEE fp32 operations per element. A vector whose tails tie at their boundary (which index
is the outlier would depend on the selection algorithm), or that holds a NaN or an infinity, is declined by the
kernel and given to the reference, on its own (every step is per vector).
Agreement with the reference: ``tests/property/test_kernels_dense_sparse.py``.
"""

from __future__ import annotations

import ctypes

import torch

from kvqbench import steps
from kvqbench.kernels import build
from kvqbench.numerics import dense_sparse

#: agreement with the reference: outliers equal; midpoints and half-ranges within relative ``rtol``; a code may
#: differ by one where the reference's normalized value lies within ``tie_ulps`` fp32 ulps of a threshold;
#: decoded values within ``|Δlevel|·half + rtol·|value|``
TOL = {"tie_ulps": 4, "rtol": 1e-6}


def _lib() -> ctypes.CDLL | None:
    lib = build.load("dense_sparse.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        vp, lg = ctypes.c_void_p, ctypes.c_long
        lib.ds_quantize.restype = ctypes.c_long
        lib.ds_quantize.argtypes = [vp, lg, lg, lg, lg, lg, vp, ctypes.c_int, vp, lg, vp, vp, vp, vp, vp, vp, vp]
        lib._kvq_typed = True
    return lib


@steps.fast("dense_sparse.quantize", when="CPU, fp32 vectors [B, N, n], k ≥ 1 outliers per tail, n ≥ 2k + 1, "
            "2..256 levels, the C kernel loads; vectors with tied tails, a NaN or an infinity go to the reference",
            tol=TOL)
def quantize(vec: torch.Tensor, k: int, codebook: torch.Tensor):
    if (vec.dim() != 3 or vec.dtype != torch.float32 or vec.device.type != "cpu" or k < 1
            or codebook.dim() != 2 or codebook.device.type != "cpu" or not 2 <= codebook.shape[1] <= 256):
        return steps.DECLINED
    b_, rows, n = (int(s) for s in vec.shape)
    if int(codebook.shape[0]) != b_ or n < 2 * k + 1 or b_ * rows == 0:
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    x = vec.contiguous()
    cb = codebook.to(torch.float32)
    mids = ((cb[:, 1:] + cb[:, :-1]) / 2).contiguous()  # as kvqbench.numerics.kmeans.assign_nearest
    codes = torch.empty(b_, rows, n, dtype=torch.uint8)
    idx = torch.empty(b_, rows, 2 * k, dtype=torch.int64)
    val = torch.empty(b_, rows, 2 * k, dtype=torch.float32)
    lo, mid, half = (torch.empty(b_, rows, 1, dtype=torch.float32) for _ in range(3))
    declined = torch.empty(b_, rows, dtype=torch.uint8)
    work = torch.empty(2 * (k + 1) + 2 * n, dtype=torch.float32)
    rc = lib.ds_quantize(x.data_ptr(), b_, rows * n, rows, n, k, mids.data_ptr(), int(mids.shape[1]),
                         codes.data_ptr(), rows * n, idx.data_ptr(), val.data_ptr(), lo.data_ptr(), mid.data_ptr(),
                         half.data_ptr(), declined.data_ptr(), work.data_ptr())
    if rc < 0:
        return steps.DECLINED
    out = (codes, idx, mid, half, val)
    if rc:  # the declined vectors, each as a layer of its own with its layer's codebook
        b, r = declined.bool().nonzero(as_tuple=True)
        redone = dense_sparse.quantize.reference(x[b, r].unsqueeze(1), k, cb[b])
        for into, got in zip(out, redone, strict=True):
            into[b, r] = got[:, 0]
    return out
