"""One computation for the cells that are the same computation.

A benchmark cell is ``experiment(method(bits, seed), data)``. Real data does not depend on the cell's seed
(it is one capture), and a method that draws no randomness (its class says ``seeded = False``; checked for
every registered method by ``tests/property/test_gates.py``) gives the same bits at every seed. So the
real-data cells of such a method at seeds 0, 1, 2 are one computation three times. The harness computes
it once and hands every seed its own copy of the result; the tests still check each cell, and the
records are byte-identical to what three computations give.

:class:`ResultMemo` is the store: a dict in the process, and, under pytest-xdist, a folder shared by the
workers of one session (one pickle per key, written atomically), so a worker reuses what another
computed. The folder lives for one session only (the controller makes and removes it), so a result
never outlives the code that made it. Plain Python: no torch, no pytest.
"""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["ResultMemo"]


class ResultMemo:
    """Results by key, in this process and (optionally) in a folder shared with other processes.

    Args:
        folder: a folder shared by the processes of one session, or ``None`` (this process only).
    """

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self.folder = Path(folder) if folder else None
        self._local: dict[str, Any] = {}
        self.hits = 0
        self.misses = 0

    @staticmethod
    def digest(key: Any) -> str:
        """A file-name-safe digest of a key made of str/int/float/bool/None/tuples (its ``repr``)."""
        return hashlib.sha256(repr(key).encode()).hexdigest()[:32]

    def get(self, key: Any) -> tuple[bool, Any]:
        """``(True, a private copy of the value)`` when ``key`` was stored here or by another process
        sharing the folder, else ``(False, None)``. A file that cannot be read counts as absent."""
        d = self.digest(key)
        if d in self._local:
            return True, copy.deepcopy(self._local[d])
        if self.folder is not None:
            path = self.folder / f"{d}.pkl"
            try:
                with open(path, "rb") as f:
                    value = pickle.load(f)
            except (OSError, EOFError, pickle.UnpicklingError):
                return False, None
            self._local[d] = value
            return True, copy.deepcopy(value)
        return False, None

    def put(self, key: Any, value: Any) -> None:
        """Store a private copy of ``value`` (picklable) under ``key``; the shared file is written to a
        temporary name and renamed, so a reader never sees half of it. A folder that cannot be written
        only loses the sharing."""
        d = self.digest(key)
        self._local[d] = copy.deepcopy(value)
        if self.folder is None:
            return
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{d}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self.folder / f"{d}.pkl")
        except OSError:
            pass

    def compute(self, key: Any, fn: Callable[[], Any]) -> Any:
        """The stored value of ``key``, or ``fn()`` stored under it (``key=None``: always ``fn()``,
        nothing stored)."""
        if key is None:
            return fn()
        hit, value = self.get(key)
        if hit:
            self.hits += 1
            return value
        self.misses += 1
        value = fn()
        self.put(key, value)
        return value

    def claim(self, key: Any) -> bool:
        """Claim the computation of ``key`` for this process: ``True`` when no other process sharing the
        folder claimed it first (always ``True`` without a folder, or when the folder cannot be written).
        The claimant stores the result, or calls :meth:`release` when it cannot."""
        if self.folder is None:
            return True
        try:
            os.close(os.open(self.folder / f"{self.digest(key)}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError:
            return True
        return True

    def release(self, key: Any) -> None:
        """Withdraw a :meth:`claim` (the claimant failed: another process may compute it)."""
        if self.folder is not None:
            try:
                os.remove(self.folder / f"{self.digest(key)}.claim")
            except OSError:
                pass

    def wait(self, key: Any, claim: Any, *, timeout: float = 600.0, poll: float = 0.1) -> tuple[bool, Any]:
        """Wait for another process to store ``key`` while it holds ``claim``: :meth:`get`'s answer as soon
        as the value is there, ``(False, None)`` when the claim is released or after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        path = None if self.folder is None else self.folder / f"{self.digest(claim)}.claim"
        while True:
            hit, value = self.get(key)
            if hit or path is None or not path.exists() or time.monotonic() > end:
                return hit, value
            time.sleep(poll)
