"""numerics.blocks.row_blocks: a partition of the rows into consecutive cache-sized blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench.numerics.blocks import row_blocks


@settings(max_examples=200, deadline=None)
@given(n_rows=st.integers(0, 5000), row_elems=st.integers(1, 300), multiple=st.integers(1, 16),
       target=st.integers(1, 20000))
def test_blocks_partition_the_rows_in_order(n_rows: int, row_elems: int, multiple: int, target: int) -> None:
    blocks = row_blocks(n_rows, row_elems, multiple=multiple, target=target)
    covered = [i for b in blocks for i in range(b.start, b.stop)]
    assert covered == list(range(n_rows))  # consecutive, in order, each row once
    assert all(b.stop > b.start for b in blocks)
    per = max(1, target // (row_elems * multiple)) * multiple
    assert all((b.stop - b.start) % multiple == 0 for b in blocks[:-1])
    assert all(per <= b.stop - b.start < 2 * per for b in blocks[:-1])
    if len(blocks) > 1:  # no short tail: it joined the block before
        assert blocks[-1].stop - blocks[-1].start >= per / 2


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError, match="positive sizes"):
        row_blocks(10, 0)


@pytest.mark.parametrize("method", ["kvquant", "turboquant", "kitty", "polarquant"])
def test_blocked_methods_same_bits_at_two_threads_and_restore_the_pool(method: str) -> None:
    """The result at 2 threads is the 1-thread result, bit for bit (KVQuant's block loops run on one CPU thread,
    one_cpu_thread; the others' whole-tensor ops reduce each group on one thread either way), and torch's
    thread count is restored afterwards."""
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
