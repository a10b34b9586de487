"""The ``real`` marker of unit tests that need the real model: skipped, with the reason, when its
dependencies (the ``real`` extra and the default model's package) are missing."""

from __future__ import annotations

import pytest


def missing() -> str | None:
    """Why the real model cannot be loaded here (one line), or ``None``."""
    from kvqbench.data.capture import MissingDependencyError, _require_real_deps, default_model_path

    try:
        _require_real_deps(gguf=True, default_model=True)
        default_model_path()
    except MissingDependencyError as e:
        return str(e)
    return None


MISSING = missing()


def real(fn):
    """Mark a test as needing the real model; skip it with the reason when the deps are missing."""
    return pytest.mark.real(pytest.mark.skipif(MISSING is not None, reason=str(MISSING))(fn))


def check_decode_cache(m, bits: int, dec_hook, pre_hook, n_layers: int, length: int | None = None) -> None:
    """For a method with per-token statistics and no fp16 window, the decode-side cache against the prefill's
    (the first ``length`` positions, all when ``None``), in two checks a rounding near-tie cannot break:

    1. segment invariance — every layer's decoded cache equals one round trip of the very K/V it received,
       quantized all at once (identical inputs: identical codes, exactly);
    2. the two caches differ per element by at most the inputs' own difference plus one quantization step
       (a code flipped at a near-tie), the step bounded by the token's range / (2^bits − 1)."""
    import torch

    cut = slice(None) if length is None else slice(0, length)
    for layer in range(n_layers):
        for kind, d, p in (("k", dec_hook.k[layer], pre_hook.k[layer]), ("v", dec_hook.v[layer], pre_hook.v[layer])):
            x_dec, xh_dec = d.x[..., cut, :], d.x_hat[..., cut, :]
            x_pre, xh_pre = p.x[..., cut, :], p.x_hat[..., cut, :]
            assert torch.equal(xh_dec, m.dequantize(m.quantize(x_dec, kind))), (layer, kind)  # 1
            rng = torch.maximum(x_dec.amax(-1, keepdim=True) - x_dec.amin(-1, keepdim=True),
                                x_pre.amax(-1, keepdim=True) - x_pre.amin(-1, keepdim=True))
            bound = (x_dec - x_pre).abs() + rng / (2**bits - 1) * (1 + 1e-5) + 1e-6
            assert bool(((xh_dec - xh_pre).abs() <= bound).all()), (layer, kind)  # 2


class Replay:
    """A hook handing out ``pre_hook``'s quantized cache position by position, as a decode asks for it (the
    same quantized cache fed through another forward schedule)."""

    def __init__(self, pre_hook) -> None:
        self.pre_hook = pre_hook

    def update(self, layer, k_new, v_new, k_all, v_all):
        n = int(k_all.shape[-2])
        return (self.pre_hook.k[layer].x_hat[..., :n, :].to(k_all.dtype),
                self.pre_hook.v[layer].x_hat[..., :n, :].to(v_all.dtype))
