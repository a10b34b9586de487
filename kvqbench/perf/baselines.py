"""The baselines every method is timed against, on the same tensor and in the same rounds.

* ``clone`` — ``x.clone()``: one read and one write of the tensor, the floor (on CUDA a device-to-device
  copy, i.e. the memory bandwidth);
* ``eager_rtn`` — :func:`eager_rtn_roundtrip`, a straightforward eager-torch asymmetric RTN, per token in
  groups of 64 channels, no bit packing: what a method costs when it is written plainly;
* ``hqq_rtn`` (when the ``hqq`` package is installed, extra ``peers``) — HQQ's quantizer without its
  optimizer (plain min/max RTN, group 64, bit-packed), quantize + dequantize.

Torch is imported inside the functions, so that importing this module stays light.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["BASELINES", "EAGER_GROUP", "eager_rtn_roundtrip", "hqq_roundtrip", "hqq_version"]

#: the baselines, in table order (``hqq_rtn`` only when hqq is installed)
BASELINES: tuple[str, ...] = ("clone", "eager_rtn", "hqq_rtn")
#: channels per group of the eager RTN (and of HQQ's)
EAGER_GROUP = 64


def eager_rtn_roundtrip(x, bits: int = 2, group: int = EAGER_GROUP):
    """A plain eager asymmetric RTN round trip of ``x`` ``(…, head_dim)`` per token in groups of ``group``
    channels: ``lo, hi`` per group, ``scale = (hi − lo)/(2^b − 1)``, codes ``clamp(round((x − lo)/scale))``
    as uint8, ``x̂ = q·scale + lo``. The reference the methods are compared with (no packing, no guards)."""
    import torch

    d = x.shape[-1]
    g = group if d % group == 0 else d
    xg = x.reshape(-1, g)
    lo = xg.amin(-1, keepdim=True)
    hi = xg.amax(-1, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    q = torch.clamp(torch.round((xg - lo) / scale), 0, 2**bits - 1).to(torch.uint8)
    return (q * scale + lo).reshape(x.shape)


def hqq_roundtrip(bits: int) -> Callable | None:
    """HQQ's plain RTN (optimizer off, group 64, bit-packed) round trip, or None when hqq is absent."""
    try:
        from hqq.core.quantize import Quantizer as HQQ  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - absent or broken optional peer
        return None

    def rt(x):
        wq, meta = HQQ.quantize(x.reshape(-1, x.shape[-1]), nbits=bits, group_size=EAGER_GROUP, optimize=False,
                                axis=1, bitpack=True, device=str(x.device))
        return HQQ.dequantize(wq, meta).reshape(x.shape)

    return rt


def hqq_version() -> str | None:
    """The installed hqq version, or ``None``."""
    try:
        from importlib.metadata import version

        return version("hqq")
    except Exception:  # noqa: BLE001
        return None
