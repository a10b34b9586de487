"""Cache-sized blocks change nothing: TurboQuant, Kitty and PolarQuant process tokens, pages or token
groups in blocks (:mod:`kvqbench.numerics.blocks`), and so does the grouped RTN of the RTN family, KIVI and
PolarQuant's V (:mod:`kvqbench.numerics.rtn`); every stored field and the reconstruction are bit-identical
with many small blocks and with one block over the whole tensor."""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench.numerics import blocks
from kvqbench.numerics.rtn import PerChannel, PerToken, rtn_dequantize, rtn_quantize
from kvqbench.quantizers import create

from .strategies import kv_tensors

BLOCKED = ("turboquant", "kitty", "polarquant")


def _roundtrip(method: str, params: dict, x: torch.Tensor, kind: str, bits: int, block_elems: int):
    q = create(method, bits, bits, seed=3, **params)
    with mock.patch.object(blocks, "BLOCK_ELEMS", block_elems):
        qt = q.quantize(x, kind)
        return qt, q.dequantize(qt)


@settings(max_examples=40, deadline=None)
@given(x=kv_tensors(max_tokens=160, head_dims=(8, 16, 32, 64, 96, 128)), method=st.sampled_from(BLOCKED),
       kind=st.sampled_from(["k", "v"]), bits=st.integers(1, 4), small=st.sampled_from([1, 200, 3000]),
       variant=st.sampled_from(["mse", "prod"]), group=st.sampled_from([4, 16, 128]))
def test_blocks_give_the_same_bits_as_one_block(x, method, kind, bits, small, variant, group) -> None:
    params = {"turboquant": {"variant": variant}, "kitty": {"group_size": group},
              "polarquant": {"group_size": group}}[method]
    qt1, rec1 = _roundtrip(method, params, x, kind, bits, 1 << 40)  # one block
    qt2, rec2 = _roundtrip(method, params, x, kind, bits, small)  # many blocks
    assert set(qt1.fields) == set(qt2.fields)
    for name, f in qt1.fields.items():
        assert torch.equal(f.tensor, qt2.fields[name].tensor), name
    assert torch.equal(rec1, rec2)


RTN_BLOCKED = ("rtn_tensor", "rtn_token", "rtn_channel", "kivi", "polarquant")


@settings(max_examples=50, deadline=None)
@given(x=kv_tensors(max_tokens=160, head_dims=(8, 16, 32, 64, 96, 128)), method=st.sampled_from(RTN_BLOCKED),
       kind=st.sampled_from(["k", "v"]), bits=st.integers(1, 4), small=st.sampled_from([64, 200, 3000]),
       group=st.sampled_from([4, 16, 32, 100, 128]))
def test_grouped_rtn_blocks_give_the_same_bits_as_one_block(x, method, kind, bits, small, group) -> None:
    params = {"kivi": {"group_size": group}}.get(method, {})
    qt1, rec1 = _roundtrip(method, params, x, kind, bits, 1 << 40)  # one block: the whole-tensor ops
    qt2, rec2 = _roundtrip(method, params, x, kind, bits, small)  # many blocks (partial ones included)
    assert set(qt1.fields) == set(qt2.fields)
    for name, f in qt1.fields.items():
        assert torch.equal(f.tensor, qt2.fields[name].tensor), name
    assert torch.equal(rec1, rec2)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (so that -0.0 and +0.0 differ)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


@settings(max_examples=60, deadline=None)
@given(x=kv_tensors(max_tokens=160, head_dims=(8, 16, 64, 96, 128)),
       gran=st.sampled_from([PerToken(), PerToken(16), PerToken(100), PerChannel(), PerChannel(16), PerChannel(7)]),
       flat=st.booleans(), bits=st.integers(1, 8), small=st.sampled_from([64, 200, 3000]),
       zeros=st.integers(0, 3))
def test_rtn_blocks_give_the_same_bytes(x, gran, flat, bits, small, zeros) -> None:
    """rtn_quantize/rtn_dequantize byte for byte (signed zeros included), per token, per channel and per
    tensor (``flat``: one group over each batch entry, longer than a block)."""
    if flat:
        x, gran = x.reshape(x.shape[0], 1, 1, -1), PerToken()
    x = x.clone()
    if zeros:
        x.view(-1)[:: zeros + 1] = 0.0 if zeros % 2 else -0.0
    out = []
    for elems in (1 << 40, small):
        with mock.patch.object(blocks, "BLOCK_ELEMS", elems):
            codes, lo, scale = rtn_quantize(x, bits, gran, codes_dtype=torch.uint8)
            out.append((codes, lo, scale, rtn_dequantize(codes, lo, scale, gran)))
    for a, b in zip(*out):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(_bits(a), _bits(b))
