"""Cache-sized blocks change nothing: KVQuant and KVarN process vectors or tiles in blocks
(:mod:`kvqbench.numerics.blocks`), and so does QuaRot's whole round trip (rotation included); every stored field
and the reconstruction are bit-identical with many small blocks and with one block over the whole tensor
(QuaRot: its whole-tensor path)."""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench.numerics import blocks
from kvqbench.numerics.hadamard import rotation_rows_independent
from kvqbench.quantizers import create
from kvqbench.quantizers import quarot as quarot_mod

from .strategies import kv_tensors

BLOCKED = ("kvquant", "kvarn")


def _roundtrip(method: str, params: dict, x: torch.Tensor, kind: str, bits: int, block_elems: int):
    q = create(method, bits, bits, seed=3, **params)
    with mock.patch.object(blocks, "BLOCK_ELEMS", block_elems):
        if method == "kvquant":
            q.fit(k=x * 0.9, v=x * 1.1)
        qt = q.quantize(x, kind)
        return qt, q.dequantize(qt)


@settings(max_examples=40, deadline=None)
@given(x=kv_tensors(max_tokens=160, head_dims=(8, 16, 32, 64, 96, 128)), method=st.sampled_from(BLOCKED),
       kind=st.sampled_from(["k", "v"]), bits=st.integers(1, 4), small=st.sampled_from([1, 200, 3000]),
       group=st.sampled_from([4, 16, 128]))
def test_blocks_give_the_same_bits_as_one_block(x, method, kind, bits, small, group) -> None:
    params = {"kvquant": {"outlier_frac": 0.05}, "kvarn": {"group_size": group}}[method]
    qt1, rec1 = _roundtrip(method, params, x, kind, bits, 1 << 40)  # one block
    qt2, rec2 = _roundtrip(method, params, x, kind, bits, small)  # many blocks
    assert set(qt1.fields) == set(qt2.fields)
    for name, f in qt1.fields.items():
        assert torch.equal(f.tensor, qt2.fields[name].tensor), name
    assert torch.equal(rec1, rec2)


def _quarot(x: torch.Tensor, kind: str, bits: int, group: int | None, *, whole: bool, block_elems: int):
    """QuaRot's round trip on the whole-tensor path (``whole``) or forced onto the blocked one (its size
    threshold at 0, blocks of ``block_elems`` elements); returns ``(qt, reconstruction, took_blocks)``."""
    q = create("quarot", bits, bits, group_size=group)
    calls = []
    real = quarot_mod.QuaRot._quantize_blocked

    def spy(self, *a, **kw):
        calls.append(1)
        return real(self, *a, **kw)

    with mock.patch.object(quarot_mod, "_WHOLE_MAX_ELEMS", 1 << 62 if whole else 0), \
            mock.patch.object(quarot_mod, "_WHOLE_MAX_ELEMS_THREADED", 1 << 62 if whole else 0), \
            mock.patch.object(blocks, "BLOCK_ELEMS", block_elems), \
            mock.patch.object(quarot_mod.QuaRot, "_quantize_blocked", spy):
        qt = q.quantize(x, kind)
        return qt, q.dequantize(qt), bool(calls)


@settings(max_examples=60, deadline=None)
@given(x=kv_tensors(max_tokens=160, head_dims=(8, 16, 32, 48, 64, 80, 96, 128)), kind=st.sampled_from(["k", "v"]),
       bits=st.integers(1, 8), small=st.sampled_from([1, 200, 3000, 1 << 14]),
       group=st.sampled_from([None, 4, 16, 24, 100]), zeros=st.integers(0, 3))
def test_quarot_blocks_give_the_same_bytes_as_the_whole_tensor(x, kind, bits, small, group, zeros) -> None:
    """QuaRot's round trip in row blocks (rotation included; its size threshold lowered so that small
    inputs take that path) against the whole-tensor ops (the second implementation): every stored field
    and the reconstruction, byte for byte (signed zeros included), over head_dims that are and are not
    powers of two (block-diagonal Hadamard), partial groups, fp32/fp16/bf16 and 1..160 tokens."""
    x = x.clone()
    if zeros:
        x.view(-1)[:: zeros + 1] = 0.0 if zeros % 2 else -0.0
    qt1, rec1, took1 = _quarot(x, kind, bits, group, whole=True, block_elems=small)
    qt2, rec2, took2 = _quarot(x, kind, bits, group, whole=False, block_elems=small)
    d = int(x.shape[-1])
    with mock.patch.object(blocks, "BLOCK_ELEMS", small):
        probe = rotation_rows_independent(d, torch.float32, min_rows=quarot_mod._ROW_MULTIPLE // 2,
                                          block_rows=quarot_mod._block_rows(d))
    assert not took1 and took2 == probe
    assert set(qt1.fields) == set(qt2.fields)
    for name, f in qt1.fields.items():
        a, b = f.tensor, qt2.fields[name].tensor
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), name
    assert rec1.dtype == rec2.dtype and torch.equal(_bits(rec1), _bits(rec2))


@settings(max_examples=30, deadline=None)
@given(shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 64), st.sampled_from([16, 64, 128])),
       dtype=st.sampled_from([torch.float32, torch.float16]), kind=st.sampled_from(["k", "v"]),
       bits=st.integers(1, 4), small=st.sampled_from([200, 3000]), frac=st.sampled_from([1e-3, 0.05, 0.4, 0.999]),
       seed=st.integers(0, 2**31 - 1))
def test_quarot_blocked_decode_saturates_as_the_whole_tensor(shape, dtype, kind, bits, small, frac, seed) -> None:
    """Near the top of the dtype's range the decode ``(scale·(q − z)) @ Q`` leaves the input dtype's range
    (fp16: the fp32 reconstruction beyond 65504; fp32: the product overflows to ±Inf) or the rotation on
    quantize already overflows (``ValueError``). The blocked decode saturates block by block, or skips it
    where the parameters bound the output (:func:`~kvqbench.quantizers.quarot._within`); the whole-tensor
    one saturates after it: the same bytes (±finfo.max where saturated), or the same error."""
    big = float(torch.finfo(dtype).max)
    g = torch.Generator().manual_seed(seed)
    x = ((torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * (big * frac)).to(dtype)
    out = []
    for whole in (True, False):
        try:
            out.append(_quarot(x, kind, bits, None, whole=whole, block_elems=small))
        except ValueError as e:
            out.append(str(e))
    if isinstance(out[0], str) or isinstance(out[1], str):
        assert out[1] == out[0]  # the same ValueError from both paths
    else:
        _same_quarot(x, small, *out[0], *out[1])


def _same_quarot(x, small, qt1, rec1, took1, qt2, rec2, took2) -> None:
    d = int(x.shape[-1])
    with mock.patch.object(blocks, "BLOCK_ELEMS", small):
        probe = rotation_rows_independent(d, torch.float32, min_rows=quarot_mod._ROW_MULTIPLE // 2,
                                          block_rows=quarot_mod._block_rows(d))
    assert not took1 and took2 == probe
    for name, f in qt1.fields.items():
        assert torch.equal(_bits(f.tensor), _bits(qt2.fields[name].tensor)), name
    assert rec1.dtype == rec2.dtype and torch.equal(_bits(rec1), _bits(rec2))
    assert not torch.isinf(rec2).any()  # saturated, never ±Inf


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (so that -0.0 and +0.0 differ)."""
    return t.contiguous().reshape(-1).view(torch.uint8)
