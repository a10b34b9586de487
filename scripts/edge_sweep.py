#!/usr/bin/env python
"""Edge-case sweep: every registered method × edge case × dtype × bits × K/V, with independent checks.

Usage::

    python scripts/edge_sweep.py                      # everything (bits 2..8, fp32/fp16/bf16)
    python scripts/edge_sweep.py --bits 2 4 --methods kivi kvarn --details 20

Every cell (method variant, case, dtype, bits, kind) ends in exactly one status:

* ``ok``        — every check below passed;
* ``nan``       — the round trip holds NaN or ±Inf (in the input's dtype);
* ``wrong``     — finite, but an independent check failed (listed with ``--details``);
* ``crash``     — an unexpected exception;
* ``rejected``  — a clear ``ValueError`` naming an unsupported ``head_dim`` (a documented limit);
* ``inherent``  — a check failed in a (method, case) pair that ``docs/PAPERS.md`` documents as an
  inherent behaviour of the method (see ``INHERENT``), not a bug.

Checks (each independent of the method's own numerics):

* shape and dtype of the output equal the input's; output finite;
* zero input → exactly zero output;
* layout: the same values as a transposed-back view, a heads-last view, a strided slice or a view with a
  storage offset give bitwise the same output (one layout per cell, cycling; ``--all-layouts`` for all);
* self-describing: a default-constructed instance of the method decodes the representation bitwise
  like the instance that made it;
* scale (cases ``tiny``/``huge``): the relative error at input scale ``s`` is within 2× of its value at
  ``s = 1`` (± a few ulps of the dtype), and a non-zero input never decodes to all zeros;
* informative (4 bits and more): the relative error is below 1 (the all-zero reconstruction scores
  exactly 1); for the ``offset`` case it is measured against the deviation from the common offset;
* converges (cases ``random`` and ``constant`` at 8 bits): relative error at most 2 %;
* codebooks (a representation field named ``codebook``): strictly increasing levels (no duplicates).

Exit status: 0 when there is no ``nan``, ``crash`` or ``wrong`` cell, 1 otherwise.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from collections import Counter, defaultdict
from typing import Callable

import torch

from kvqbench.numerics.layouts import layout_variants
from kvqbench.quantizers import available, get

ALL_LAYOUTS = False
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BASE_SHAPE = (1, 2, 128, 64)

#: alternative constructor arguments per built-in method (third-party methods run with defaults);
#: a non-default configuration is what the self-describing check needs
ALT_PARAMS: dict[str, list[dict]] = {
    "kivi": [{"group_size": 32}],
    "quarot": [{"group_size": 32}],
    "kvquant": [{"outlier_frac": 0.05, "attention_sink": True}],
    "kvarn": [{"group_size": 48, "varn_iters": 8}],
    "polarquant": [{"group_size": 32}],
    "turboquant": [{"variant": "prod", "rotation": "hadamard", "codebook": "beta", "seed": 3}],
    "kitty": [{"group_size": 48, "boost_fraction": 0.1}],
}

#: (method id, case) → the docs/PAPERS.md section that documents why the ``informative`` check fails
INHERENT: dict[tuple[str, str], str] = {
    ("rtn_tensor", "outlier_channel"): "rtn_tensor: one channel 100x larger sets the whole tensor's range",
    ("rtn_tensor", "heavy_tail"): "rtn_tensor: a few large tokens set the whole tensor's range",
    ("quarot", "offset"): "rotation concentrates a common offset in one coordinate",
    ("quarot", "constant"): "quarot: the 0.95 clip puts a floor under the error at every bit width",
    ("quarot", "random"): "quarot: the 0.95 clip puts a floor under the error at every bit width",
    ("kvarn", "offset"): "rotation concentrates a common offset in one coordinate",
    ("turboquant", "offset"): "rotation concentrates a common offset in one coordinate",
    ("turboquant", "constant"): "rotation='hadamard' keeps a constant token (all offset) in one coordinate",
}

#: input scales of the ``tiny``/``huge`` cases per dtype (fp16's normal range is 6.1e-5 … 65504; the
#: base data reach |x| ≈ 40, so 1e3 keeps the input finite)
SCALES = {
    torch.float32: {"tiny": (1e-10, 1e-20, 1e-30), "huge": (1e10, 1e20, 1e30)},
    torch.bfloat16: {"tiny": (1e-10, 1e-20, 1e-30), "huge": (1e10, 1e20, 1e30)},
    torch.float16: {"tiny": (1e-2, 1e-3, 1e-4), "huge": (1e2, 1e3)},
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape, seed) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64)


def _base(shape=BASE_SHAPE, seed=0) -> torch.Tensor:
    """Random K/V-like data: Gaussian, channel scales spanning 2x."""
    return _randn(shape, seed) * torch.logspace(-0.15, 0.15, shape[-1], dtype=torch.float64)


def _heavy(shape=BASE_SHAPE, seed=0) -> torch.Tensor:
    """Heavy-tailed token norms (lognormal, sigma 1) on top of :func:`_base`."""
    g = _gen(seed + 1)
    return _base(shape, seed) * torch.exp(torch.randn(*shape[:-1], 1, generator=g, dtype=torch.float64))


def _case_fns() -> dict[str, Callable[[int], torch.Tensor]]:
    """case name → seed → fp64 tensor ``(batch, kv_heads, seq_len, head_dim)``."""

    def zero_head(seed):
        x = _base(seed=seed)
        x[:, 0] = 0.0
        return x

    def constant_group(seed):
        x = _base(seed=seed)
        x[:, :, :64, 5] = 1.25  # one channel constant over a 64-token group (K-side groups)
        x[:, :, 7, :] = -0.5  # one token constant over head_dim (V-side groups)
        return x

    def outlier_channel(seed):
        x = _base(seed=seed)
        x[..., 3] *= 100.0
        return x

    def one_sign(seed):
        return _base(seed=seed).abs() + 0.01

    def ties(seed):
        return torch.randint(-2, 3, BASE_SHAPE, generator=_gen(seed)).to(torch.float64) * 0.5

    def offset(seed):
        return _base(seed=seed) + 100.0

    cases: dict[str, Callable[[int], torch.Tensor]] = {
        "random": lambda s: _base(seed=s),
        "heavy_tail": lambda s: _heavy(seed=s),
        "tiny": lambda s: _base(seed=s),  # scaled by SCALES in the check
        "huge": lambda s: _base(seed=s),
        "constant": lambda s: torch.full(BASE_SHAPE, 0.75, dtype=torch.float64),
        "zero": lambda s: torch.zeros(BASE_SHAPE, dtype=torch.float64),
        "zero_head": zero_head,
        "constant_group": constant_group,
        "outlier_channel": outlier_channel,
        "one_sign": one_sign,
        "negative": lambda s: -one_sign(s),
        "ties": ties,
        "offset": offset,
        "odd_packing": lambda s: _base((1, 3, 5, 12), seed=s),  # 180 codes: not a multiple of 8
        "batch3": lambda s: _base((3, 1, 40, 32), seed=s),
    }
    for t in (1, 2, 3, 31, 127, 128, 129):
        cases[f"len{t}"] = (lambda t_: lambda s: _base((1, 2, t_, 64), seed=s))(t)
    for d in (12, 15, 24, 48, 80, 96, 100, 112, 160, 192, 256):  # 15: odd (PolarQuant's K rejects it)
        cases[f"dim{d}"] = (lambda d_: lambda s: _base((1, 1, 40, d_), seed=s))(d)
    return cases


def _variants(method_ids: list[str]) -> list[tuple[str, str, dict]]:
    out = []
    for mid in method_ids:
        cls = get(mid)
        accepted = set(inspect.signature(cls.__init__).parameters)
        out.append((mid, mid, {}))
        for i, p in enumerate(ALT_PARAMS.get(mid, [])):
            if set(p) <= accepted:
                out.append((mid, f"{mid}[alt{i}]", p))
    return out


def _relerr(y: torch.Tensor, x: torch.Tensor, ref: torch.Tensor | None = None) -> float:
    xd = x.double()
    den = float(torch.linalg.vector_norm(xd if ref is None else xd - ref))
    num = float(torch.linalg.vector_norm(y.double() - xd))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den




class Cell:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def fail(self, what: str) -> None:
        self.failures.append(what)


def _make(cls, bits: int, params: dict, calib: torch.Tensor | None):
    q = cls(bits, bits, **params)
    if not q.local_stats and calib is not None:
        q.fit(k=calib, v=calib)
    return q


def run_cell(mid: str, params: dict, case: str, x64: torch.Tensor, calib64: torch.Tensor, dtype: torch.dtype,
             bits: int, kind: str) -> tuple[str, list[str]]:
    cls = get(mid)
    x = x64.to(dtype)
    cal = calib64.to(dtype)
    cell = Cell()
    try:
        q = _make(cls, bits, params, cal)
        qt = q.quantize(x, kind)
        y = q.dequantize(qt)
    except ValueError as e:
        if "head_dim" in str(e):
            return "rejected", [f"{type(e).__name__}: {e}"]
        return "crash", [f"{type(e).__name__}: {e}"]
    except Exception as e:  # noqa: BLE001 - the sweep counts every unexpected exception
        return "crash", [f"{type(e).__name__}: {e}"]
    try:
        if y.shape != x.shape or y.dtype != x.dtype:
            cell.fail(f"shape/dtype {tuple(y.shape)} {y.dtype}")
        if not bool(torch.isfinite(y).all()):
            n_bad = int((~torch.isfinite(y)).sum())
            return "nan", [f"{n_bad} non-finite of {y.numel()}"]
        if case == "zero" and bool((y != 0).any()):
            cell.fail("zero input did not decode to zeros")
        # layouts (one per cell, cycling, unless --all-layouts)
        layouts = list(layout_variants(x).items())
        if not ALL_LAYOUTS:
            pick = (bits + (kind == "v") + len(case)) % len(layouts)
            layouts = layouts[pick : pick + 1]
        for name, xl in layouts:
            yl = q.dequantize(q.quantize(xl, kind))
            if not torch.equal(yl, y):
                diff = int((yl != y).sum())
                cell.fail(f"layout {name}: {diff} elements differ")
        # self-describing
        y0 = cls().dequantize(qt)
        if not torch.equal(y0, y):
            cell.fail(f"default instance decodes differently (max |Δ| {float((y0.double() - y.double()).abs().max()):.3g})")
        # codebooks
        for fname, f in qt.fields.items():
            if fname.split(".")[-1] == "codebook":
                cb = f.tensor.reshape(-1, f.tensor.shape[-1])
                if bool((cb[:, 1:] <= cb[:, :-1]).any()):
                    cell.fail(f"codebook {fname} has duplicate or unsorted levels")
        # informative (from 4 bits up)
        ref = torch.tensor(100.0, dtype=torch.float64) if case == "offset" else None
        if case != "zero" and bits >= 4:
            e1 = _relerr(y, x, ref)
            if not e1 < 1.0:
                cell.fail(f"relative error {e1:.3g} >= 1 (worse than all zeros)")
        if case in ("random", "constant") and bits == 8:
            e8 = _relerr(y, x)
            if not e8 <= 0.02 + 8 * torch.finfo(dtype).eps:
                cell.fail(f"relative error {e8:.3g} > 2% at 8 bits")
        # scale
        if case in ("tiny", "huge"):
            e1 = _relerr(y, x)
            eps = torch.finfo(dtype).eps
            for s in SCALES[dtype][case]:
                xs = (x64 * s).to(dtype)
                qs = _make(cls, bits, params, (calib64 * s).to(dtype))
                ys = qs.roundtrip(xs, kind)
                if not bool(torch.isfinite(ys).all()):
                    return "nan", [f"scale {s:g}: {int((~torch.isfinite(ys)).sum())} non-finite"]
                if bool((ys == 0).all()):
                    cell.fail(f"scale {s:g}: all-zero output")
                    continue
                es = _relerr(ys, xs)
                if not (e1 / 2 - 8 * eps <= es <= 2 * e1 + 8 * eps):
                    cell.fail(f"scale {s:g}: relative error {es:.4g} vs {e1:.4g} at s=1")
    except Exception as e:  # noqa: BLE001
        return "crash", [f"{type(e).__name__} in checks: {e}"]
    if not cell.failures:
        return "ok", []
    if (mid, case) in INHERENT:
        return "inherent", [INHERENT[(mid, case)]] + cell.failures
    return "wrong", cell.failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="*", default=None, help="method ids (default: every registered one)")
    ap.add_argument("--cases", nargs="*", default=None, help="case names (default: all)")
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--bits", nargs="*", type=int, default=list(range(2, 9)))
    ap.add_argument("--kinds", nargs="*", default=["k", "v"], choices=["k", "v"])
    ap.add_argument("--all-layouts", action="store_true",
                    help="check every layout in every cell (default: one layout per cell, cycling)")
    ap.add_argument("--no-alt", action="store_true", help="default constructor arguments only")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--details", type=int, default=10, help="print up to this many non-ok cells per status")
    args = ap.parse_args(argv)

    global ALL_LAYOUTS
    ALL_LAYOUTS = args.all_layouts
    methods = args.methods or available()
    unknown = [m for m in methods if m not in available()]
    if unknown:
        ap.error(f"unknown method ids {unknown}; registered: {', '.join(available())}")
    cases = _case_fns()
    case_names = args.cases or list(cases)
    bad = [c for c in case_names if c not in cases]
    if bad:
        ap.error(f"unknown cases {bad}; known: {', '.join(cases)}")
    variants = _variants(methods)
    if args.no_alt:
        variants = [v for v in variants if not v[2]]

    torch.set_num_threads(args.threads)
    counts: Counter[str] = Counter()
    by_method: dict[str, Counter[str]] = defaultdict(Counter)
    by_case: dict[str, Counter[str]] = defaultdict(Counter)
    examples: dict[str, list[str]] = defaultdict(list)
    t0 = time.time()
    for mid, label, params in variants:
        for case in case_names:
            x64 = cases[case](0)
            calib = cases[case](1)
            for dname in args.dtypes:
                for bits in args.bits:
                    for kind in args.kinds:
                        status, why = run_cell(mid, params, case, x64, calib, DTYPES[dname], bits, kind)
                        counts[status] += 1
                        by_method[label][status] += 1
                        by_case[case][status] += 1
                        if status != "ok" and len(examples[status]) < args.details:
                            examples[status].append(f"{label} {case} {dname} b{bits} {kind}: {'; '.join(why)}")
    statuses = ["ok", "nan", "wrong", "crash", "rejected", "inherent"]
    print(f"edge sweep: {sum(counts.values())} cells in {time.time() - t0:.0f} s")
    print("  " + "  ".join(f"{s} {counts[s]}" for s in statuses))
    print("\nby method:")
    for label, c in by_method.items():
        print(f"  {label:24s} " + "  ".join(f"{s} {c[s]}" for s in statuses if c[s]))
    print("\nby case (cells that are not ok):")
    for case, c in by_case.items():
        rest = {s: c[s] for s in statuses[1:] if c[s]}
        if rest:
            print(f"  {case:16s} " + "  ".join(f"{s} {n}" for s, n in rest.items()))
    for status in statuses[1:]:
        if examples[status]:
            print(f"\n{status} (first {len(examples[status])}):")
            for line in examples[status]:
                print("  " + line)
    return 1 if counts["nan"] or counts["crash"] or counts["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
