"""Every registered method (built-in or third-party: the registry is iterated, as in
``tests/unit/test_conformance.py``) reconstructs the same tensor with kernels on as with every step's reference
(:func:`kvqbench.steps.disabled`), within a stated tolerance; and every fast version has its own property test.

Stated tolerance (``REL``, ``TOKEN_SHARE``): the two reconstructions are equal within ``REL·max|x|`` plus one
unit in the last place of the output dtype (both are computed in fp32 and rounded to the input's dtype, so values
within ``REL`` may round to neighbouring fp16/bf16 numbers) at every element except in the tokens (rows of head_dim values) where a code flipped by one step at a near-tie — a flip
moves one element of a per-element method and, through an inverse rotation, a whole row of a rotating one — and
such tokens are at most ``max(1, TOKEN_SHARE·n_tokens)``. A method that rejects an input rejects it either way
with the same message. Measured on an AMD EPYC over these examples: no token differs beyond the tolerance; the
reconstructions are bit-identical for every built-in method but KVarN, whose compiled VarN sums in another order
(:mod:`kvqbench.kernels.varn`: its scales agree to ~1e-6 relative, so an fp16/bf16 output may round one ulp apart).
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench import steps
from kvqbench.quantizers import available, create

from .strategies import kv_tensors

METHODS = available()
#: elementwise tolerance, relative to max|x| (fp32 noise of a different summation order)
REL = 1e-5
#: the share of tokens in which the reconstructions may differ beyond REL (a code flipped at a near-tie)
TOKEN_SHARE = 0.01


def _roundtrip(method: str, x: torch.Tensor, kind: str, bits: int):
    q = create(method, bits, bits, seed=1)
    try:
        if not q.local_stats:
            q.fit(k=x * 0.9, v=x * 1.1)
        return q.roundtrip(x, kind)
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=15, deadline=None)
@given(x=kv_tensors(max_tokens=96, head_dims=(16, 32, 64, 96, 128)), kind=st.sampled_from(["k", "v"]),
       bits=st.integers(1, 4), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_kernels_on_and_off_reconstruct_within_the_stated_tolerance(method, x, kind, bits, scale) -> None:
    x = (x.float() * scale).to(x.dtype)
    on = _roundtrip(method, x, kind, bits)
    with steps.disabled():
        off = _roundtrip(method, x, kind, bits)
    if isinstance(on, str) or isinstance(off, str):
        assert on == off
        return
    assert on.shape == off.shape and on.dtype == off.dtype
    a, b = on.double(), off.double()
    big = torch.maximum(on.abs(), off.abs())
    ulp = (torch.nextafter(big, torch.full_like(big, float("inf"))) - big).double()
    tol = REL * float(x.double().abs().max())
    far = ((a - b).abs() > tol + ulp) | (a.isnan() != b.isnan())
    tokens = far.reshape(-1, x.shape[-1]).any(-1)
    n_tokens = tokens.numel()
    assert int(tokens.sum()) <= max(1, math.floor(TOKEN_SHARE * n_tokens)), (
        f"{method}: {int(tokens.sum())} of {n_tokens} tokens differ beyond {tol:g}")


def test_every_fast_version_has_a_property_test_module() -> None:
    """``tests/property/test_kernels_<module>.py`` exists for the module of every registered fast version, and
    reads the tolerance that version declares (``steps.lookup(step).tol``) unless it promises equal results."""
    importlib.import_module("kvqbench.quantizers")  # declares every built-in method's steps
    here = Path(__file__).resolve().parent
    modules = {k.fn.__module__.rsplit(".", 1)[1] for k in steps.registered().values()}
    assert modules, "no fast version registered"
    missing = sorted(m for m in modules if not (here / f"test_kernels_{m}.py").exists())
    assert not missing, f"fast versions without a property test module: {missing}"
    unread = sorted(k.step for k in steps.registered().values() if k.tol and f'lookup("{k.step}").tol' not in
                    (here / f"test_kernels_{k.fn.__module__.rsplit('.', 1)[1]}.py").read_text(encoding="utf-8"))
    assert not unread, f"fast versions whose declared tolerance no property test reads: {unread}"
