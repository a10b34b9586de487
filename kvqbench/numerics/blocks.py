"""Cache-sized blocks of rows, for fast versions that treat every row (a vector, a token) on its own.

A round trip written as whole-tensor ops allocates a fresh full-size temporary per op: each one streams
through main memory, and from 32 MiB on (glibc's largest mmap threshold) each is a fresh mapping whose
pages fault in on first touch, so the time grows faster than the tensor. Processing ``rows`` in blocks of about
:data:`BLOCK_ELEMS` elements keeps every temporary in the core's cache and reuses the same heap memory
block after block; only the outputs are full size.

Invariant (tested): the blocks are consecutive, non-empty, cover ``range(n_rows)`` exactly once in order,
each holds a whole multiple of ``multiple`` rows except possibly the last, and the last is never shorter
than half a block unless it is the only one (a short tail joins the block before it, so a matrix
product over a block never degenerates to a few rows, where BLAS switches kernels and rounds
differently). A method whose per-row results do not depend on the other rows (row-wise reductions,
elementwise ops, per-row selection, a product with a fixed matrix) gives the same bits blocked or not.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["BLOCK_ELEMS", "row_blocks", "one_cpu_thread", "on_one_cpu_thread"]

F = TypeVar("F", bound=Callable[..., Any])

#: elements per block: 2^18 fp32 values = 1 MiB, so a few temporaries of a block fit a 2–4 MiB L2
BLOCK_ELEMS = 1 << 18


def row_blocks(n_rows: int, row_elems: int, *, multiple: int = 1, target: int | None = None) -> list[slice]:
    """Consecutive slices of ``range(n_rows)`` of about ``target`` elements each (``row_elems`` per row).

    Args:
        n_rows: rows to cover (>= 0).
        row_elems: elements per row (>= 1), e.g. ``batch · row_length``.
        multiple: block sizes are multiples of this many rows (e.g. a group size), except the last.
        target: elements per block (at least one ``multiple`` of rows per block); default
            :data:`BLOCK_ELEMS`, read at call time.
    Returns:
        list of ``slice(start, stop)``; empty for ``n_rows == 0``.
    Raises:
        ValueError: a size below its minimum.
    """
    if target is None:
        target = BLOCK_ELEMS
    if n_rows < 0 or row_elems < 1 or multiple < 1 or target < 1:
        raise ValueError(f"row_blocks needs n_rows >= 0 and positive sizes, got {n_rows}, {row_elems}, "
                         f"{multiple}, {target}")
    per = max(1, target // (row_elems * multiple)) * multiple
    starts = list(range(0, n_rows, per))
    if len(starts) > 1 and n_rows - starts[-1] < per / 2:
        starts.pop()  # the short tail joins the block before it
    return [slice(s, e) for s, e in zip(starts, starts[1:] + [n_rows])]


@contextlib.contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Run the block loop's operations on one CPU thread (torch's intra-op pool restored afterwards).

    A block's operations are cache-sized: splitting each of them across the intra-op pool costs more in
    synchronization than it saves. Results are those of the 1-thread run at every thread count. No-op off
    the CPU or at one thread already."""
    nt = torch.get_num_threads()
    if device.type != "cpu" or nt == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(nt)


def on_one_cpu_thread(fn: F) -> F:
    """Method decorator: ``fn(self, obj, …)`` runs under :func:`one_cpu_thread` ``(obj.device)`` (``obj`` a
    tensor or anything with a ``device``, e.g. a quantized representation)."""

    @functools.wraps(fn)
    def wrapper(self: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        with one_cpu_thread(torch.device(obj.device)):
            return fn(self, obj, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
