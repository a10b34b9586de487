"""Cache-sized blocks change nothing: KVQuant, TurboQuant, Kitty and PolarQuant process vectors, tokens,
pages or token groups in blocks (:mod:`kvqbench.numerics.blocks`); every stored field and the
reconstruction are bit-identical with many small blocks and with one block over the whole tensor."""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench.numerics import blocks
from kvqbench.quantizers import create

from .strategies import kv_tensors

BLOCKED = ("kvquant", "turboquant", "kitty", "polarquant")


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
       variant=st.sampled_from(["mse", "prod"]), group=st.sampled_from([4, 16, 128]))
def test_blocks_give_the_same_bits_as_one_block(x, method, kind, bits, small, variant, group) -> None:
    params = {"turboquant": {"variant": variant}, "kitty": {"group_size": group},
              "polarquant": {"group_size": group}, "kvquant": {"outlier_frac": 0.05}}[method]
    qt1, rec1 = _roundtrip(method, params, x, kind, bits, 1 << 40)  # one block
    qt2, rec2 = _roundtrip(method, params, x, kind, bits, small)  # many blocks
    assert set(qt1.fields) == set(qt2.fields)
    for name, f in qt1.fields.items():
        assert torch.equal(f.tensor, qt2.fields[name].tensor), name
    assert torch.equal(rec1, rec2)
