"""Thread count does not change a method's numbers (the plugin still fixes it: --kvq-threads)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("method", ["kvquant", "turboquant", "kitty", "polarquant"])
def test_same_bits_at_two_threads_and_the_pool_restored(method: str) -> None:
    """The result at 2 threads is the 1-thread result, bit for bit (each group, vector or page is reduced on
    one thread whatever the pool), and torch's thread count is left as it was set."""
    import torch

    from kvqbench.quantizers import create

    x = torch.randn(1, 2, 640, 64, generator=torch.Generator().manual_seed(11)) * 2
    nt = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            q = create(method, 2, 2, seed=0)
            outs.append([q.roundtrip(x, kind) for kind in ("k", "v")])
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(nt)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
