"""The fast scalar-codebook steps (:mod:`kvqbench.kernels.lloyd_max`, C) against their plain-torch references
(:func:`kvqbench.numerics.lloyd_max.nearest_centroid`, :func:`~kvqbench.numerics.lloyd_max.reconstruct`,
``.reference``).

Stated tolerance: comparisons and table reads only, so codes and centroids are **equal** for every non-NaN value
(measured share of differing codes over these examples: 0), including values exactly on a threshold.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench import steps
from kvqbench.kernels import build
from kvqbench.kernels import lloyd_max as fast_lm
from kvqbench.numerics.lloyd_max import lloyd_max, nearest_centroid, reconstruct

pytestmark = pytest.mark.skipif(build.load("lloyd_max.c") is None, reason="no C compiler (or KVQBENCH_KERNELS=0)")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 3000), st.integers(0, 2**31 - 1), st.booleans())
def test_codes_and_centroids_equal_the_reference(bits, n, seed, on_thresholds):
    cent, thr = lloyd_max("gaussian", bits, (0.09,)).tensors(dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 0.12
    if on_thresholds:  # values exactly on a threshold go to the lower cell
        x[::2] = thr[torch.randint(0, thr.numel(), (x[::2].numel(),), generator=gen)]
    x[::7] = x[::7] * 1e30  # beyond every threshold
    ref = nearest_centroid.reference(x, thr, dtype=torch.uint8)
    got = fast_lm.nearest_centroid(x, thr, dtype=torch.uint8)
    assert got is not steps.DECLINED and got.dtype == torch.uint8
    assert torch.equal(got, ref)
    assert torch.equal(fast_lm.reconstruct(cent, ref), reconstruct.reference(cent, ref))


def test_outside_scope_declines():
    cent, thr = lloyd_max("gaussian", 2, (1.0,)).tensors(dtype=torch.float32)
    x = torch.randn(10)
    assert fast_lm.nearest_centroid(x, thr) is steps.DECLINED  # int64 codes
    assert fast_lm.nearest_centroid(x.double(), thr, dtype=torch.uint8) is steps.DECLINED
    assert fast_lm.reconstruct(cent, torch.tensor([0, 4], dtype=torch.uint8)) is steps.DECLINED  # beyond the table
    with pytest.raises(IndexError):
        reconstruct(cent, torch.tensor([0, 4], dtype=torch.uint8))
