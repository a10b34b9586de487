#!/usr/bin/env python3
"""Do two versions of the quantizers store the same bytes? For checking that a speed-up of a method's
numerics changed no code, scale or reconstruction.

Usage::

    python scripts/same_codes.py save OUT.pt [--methods a,b]   # run on the code before the change
    python scripts/same_codes.py check OUT.pt [--methods a,b]  # run after it: exit 1 on any difference
    python scripts/same_codes.py save OUT.pt --real [--methods a,b]  # also real K/V (needs the real extra)

For every method (default: every registered one), kind (K, V), and a fixed set of inputs (shapes with
and without partial groups/tiles, head_dims that are and are not powers of two, fp32/fp16/bf16,
different scales, batch > 1, a non-contiguous input), it stores every field of the quantized
representation (packed codes, scales, zero-points, …), the unpacked-on-decode reconstruction and the
representation's meta (as text), and compares them byte for byte (``torch.equal`` on tensors of equal
dtype and shape; NaN never expected). Fitted methods are fitted on an independent batch first.
With ``--real``, the inputs also include real K/V of SmolLM2-135M (every layer, :data:`REAL_TOKENS` tokens of
the corpus, fp32, and a 300-token prefix: a partial tile; offline, ``HF_HUB_OFFLINE=1``), fitted on a
capture of another length.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# the checkout this script belongs to, not whichever kvqbench is installed (a script's own folder comes first)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: (batch, kv_heads, seq_len, head_dim, dtype, scale, seed)
CASES = [
    (1, 8, 4096, 128, torch.float32, 1.0, 0),
    (1, 2, 1000, 128, torch.float32, 1.0, 1),
    (2, 3, 333, 64, torch.float32, 3.0, 2),
    (1, 2, 300, 96, torch.float16, 1.0, 3),
    (1, 2, 257, 128, torch.bfloat16, 0.01, 4),
    (1, 1, 17, 80, torch.float32, 100.0, 5),
    (3, 2, 129, 32, torch.float32, 1e-3, 6),
    (1, 4, 2048, 128, torch.float32, 7.0, 7),
    (1, 8, 4160, 128, torch.float16, 1.0, 8),  # more than 2^22 elements (QuaRot's blocked path)
]


#: tokens of the real capture (``--real``)
REAL_TOKENS = 2048


def _real_inputs():
    from kvqbench.data.capture import capture_kv

    data = capture_kv(seq_len=REAL_TOKENS)
    data.calibration = capture_kv(seq_len=512)
    yield f"real/{REAL_TOKENS}", data, torch.float32, 1.0
    cut = capture_kv(seq_len=300)
    cut.calibration = data.calibration
    yield "real/300", cut, torch.float32, 1.0


def _inputs(real: bool = False):
    from kvqbench.data.synthetic import make_synthetic

    if real:
        yield from _real_inputs()

    for b, h, t, d, dt, sc, seed in CASES:
        data = make_synthetic(seed=seed, batch=b, kv_heads=h, seq_len=t, head_dim=d)
        calib = make_synthetic(seed=seed + 1000, batch=b, kv_heads=h, seq_len=t, head_dim=d)
        data.calibration = calib
        yield f"{b}x{h}x{t}x{d}/{dt}/{sc}/{seed}", data, dt, sc


def snapshot(methods: list[str], real: bool = False) -> dict[str, object]:
    from kvqbench.experiments.common import fit_method
    from kvqbench.quantizers import create

    out: dict[str, object] = {}
    for case, data, dt, sc in _inputs(real):
        for mid in methods:
            m = create(mid, 2, 2, seed=0)
            fit_method(m, data)
            for kind in ("k", "v"):
                x = (getattr(data, kind) * sc).to(dt)
                for variant, xin in (("contig", x), ("strided", x.transpose(1, 2).contiguous().transpose(1, 2))):
                    if variant == "strided" and case != "1x2x1000x128/torch.float32/1.0/1":
                        continue
                    qt = m.quantize(xin, kind)
                    key = f"{mid}/{kind}/{case}/{variant}"
                    for name, st in qt.fields.items():
                        out[f"{key}/field/{name}"] = st.tensor.detach().clone()
                    out[f"{key}/meta"] = repr(sorted((k, repr(v)) for k, v in qt.meta.items()))
                    out[f"{key}/recon"] = m.dequantize(qt).clone()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("save", "check"))
    p.add_argument("path")
    p.add_argument("--methods", default="all")
    p.add_argument("--real", action="store_true", help="also real K/V of SmolLM2-135M (needs the real extra)")
    a = p.parse_args(argv)
    from kvqbench.quantizers import available

    methods = available() if a.methods == "all" else a.methods.split(",")
    snap = snapshot(methods, a.real)
    if a.mode == "save":
        torch.save(snap, a.path)
        print(f"saved {len(snap)} entries to {a.path}")
        return 0
    base = torch.load(a.path)
    bad = []
    for k in sorted(set(base) | set(snap)):
        if k not in base or k not in snap:
            if any(k.startswith(f"{m}/") for m in methods):
                bad.append(f"{k}: missing on one side")
            continue
        u, v = base[k], snap[k]
        if isinstance(u, torch.Tensor):
            same = isinstance(v, torch.Tensor) and u.dtype == v.dtype and u.shape == v.shape and torch.equal(u, v)
        else:
            same = u == v
        if not same:
            bad.append(k)
    n = sum(1 for k in snap if any(k.startswith(f"{m}/") for m in methods))
    for k in bad:
        print("DIFFERENT", k)
    print(f"{n} entries compared, {len(bad)} different")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
