"""One computation for the cells that are the same computation.

A benchmark cell is ``experiment(method(bits, seed), data)``. Real data does not depend on the cell's seed
(it is one capture), and a method that draws no randomness (its class says ``seeded = False``, or its
``seeded_for(shape)`` says so for the cell's shapes; checked for every registered method by
``tests/property/test_gates.py``) gives the same bits at every seed. So the
real-data cells of such a method at seeds 0, 1, 2 are one computation three times. The harness computes
it once and hands every seed its own copy of the result; the tests still check each cell, and the
records are byte-identical to what three computations give.

:class:`ResultMemo` is the store: a dict in the process, and, under pytest-xdist, a folder shared by the
workers of one session (one pickle per key, written atomically), so a worker reuses what another
computed. The folder lives for one session only (the controller makes and removes it), so a result
never outlives the code that made it. Plain Python: no torch, no pytest.

Two workers may reach the same key at once (xdist hands each worker a queue of cells, so the seed-1 copy
of a cell can start while the seed-0 copy is still running on the other worker). The first to miss
*claims* the key (a ``<digest>.claim`` file made with ``O_EXCL``, holding its pid); the others wait for
its result instead of computing it a second time — never longer than a second computation would take,
since the claimant started first. A claim whose process is gone, or that is released without a result
(the computation raised), is not waited for: the waiter computes the value itself.

Results are unpickled, so nothing is read from where another user could write: the shared folder must be
the user's own and writable by no one else (the controller makes it with ``tempfile.mkdtemp``: mode 0700,
an unpredictable name), and so must every result file in it (:mod:`kvqbench.privdir`). A folder or file
that is not is refused with one ``RuntimeWarning`` line and its results are computed here instead.
"""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from kvqbench import privdir

__all__ = ["ResultMemo"]


def _is_zombie(pid: int) -> bool:
    """Whether ``pid`` has exited but was not reaped yet (Linux: state ``Z`` in ``/proc/PID/stat``): a
    crashed xdist worker stays such a zombie until the controller reaps it, and ``os.kill(pid, 0)`` still
    finds it. ``False`` where ``/proc`` cannot tell (another OS)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return False
    return stat[stat.rfind(")") + 2: stat.rfind(")") + 3] == "Z"  # the state follows "(command) "


class ResultMemo:
    """Results by key, in this process and (optionally) in a folder shared with other processes.

    Args:
        folder: a folder shared by the processes of one session, or ``None`` (this process only). A folder
            another user could write (not the user's own, or group/world-writable) is refused with one
            ``RuntimeWarning`` line: the store then keeps to this process.
    """

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self.folder = Path(folder) if folder else None
        if self.folder is not None:
            try:
                privdir.private_dir(self.folder)
            except OSError as e:  # UnsafePathError: another user could write it
                warnings.warn(f"kvqbench: result memo not shared ({e}); this process computes its own results",
                              RuntimeWarning, stacklevel=2)
                self.folder = None
        self._local: dict[str, Any] = {}
        self.hits = 0
        self.misses = 0
        self.waited = 0  # hits that waited for another process's computation
        self._refused = False  # a result file was refused (said once)

    @staticmethod
    def digest(key: Any) -> str:
        """A file-name-safe digest of a key made of str/int/float/bool/None/tuples (its ``repr``)."""
        return hashlib.sha256(repr(key).encode()).hexdigest()[:32]

    def get(self, key: Any) -> tuple[bool, Any]:
        """``(True, a private copy of the value)`` when ``key`` was stored here or by another process
        sharing the folder, else ``(False, None)``. A file that cannot be read counts as absent, and so does
        one another user could write (refused with one ``RuntimeWarning`` line, the first time)."""
        d = self.digest(key)
        if d in self._local:
            return True, copy.deepcopy(self._local[d])
        if self.folder is not None:
            path = self.folder / f"{d}.pkl"
            try:
                privdir.check_private_file(path)
                with open(path, "rb") as f:
                    value = pickle.load(f)
            except privdir.UnsafePathError as e:
                if not self._refused:
                    self._refused = True
                    warnings.warn(f"kvqbench: result memo file refused ({e}); its result is computed here",
                                  RuntimeWarning, stacklevel=2)
                return False, None
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
        nothing stored). With a shared folder, a key that another process is computing right now (it
        holds the key's claim) is waited for rather than computed again (see the module doc)."""
        if key is None:
            return fn()
        hit, value = self.get(key)
        if hit:
            self.hits += 1
            return value
        mine = self.claim(key)
        if not mine:  # another live process is computing it: take its result
            hit, value = self.wait(key, key)
            if hit:
                self.hits += 1
                self.waited += 1
                return value
        self.misses += 1
        try:
            value = fn()
            self.put(key, value)
        finally:
            if mine:
                self.release(key)
        return value

    #: seconds between two looks at a claimed key's result
    POLL_S = 0.02

    def _claim_path(self, key: Any) -> Path:
        return Path(self.folder or ".") / f"{self.digest(key)}.claim"  # only called with a folder

    def _claim(self, key: Any) -> Path | None:
        """Claim ``key`` for this process: the claim file's path, or ``None`` when a live process holds it.
        A claim that cannot be made (an unwritable folder) or a stale one (its process is gone) is no
        obstacle: the path is returned and this process computes."""
        path = self._claim_path(key)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._holder_alive(path):
                    return None
                try:  # stale: its process died without releasing it
                    os.unlink(path)
                except OSError:
                    pass
                continue
            except OSError:
                return path
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            return path
        return path

    @staticmethod
    def _holder_alive(path: Path) -> bool:
        """Whether the process named in a claim file still runs (a file still being written, or gone, counts
        as alive resp. not)."""
        try:
            text = path.read_text().strip()
        except OSError:
            return False
        if not text:
            return True  # just created, its pid not written yet
        try:
            os.kill(int(text), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, ValueError, OverflowError):
            return True
        return not _is_zombie(int(text))

    def claim(self, key: Any) -> bool:
        """Claim the computation of ``key`` for this process (what :meth:`compute` does for its own key,
        for a caller that stores several results itself): ``False`` when a live process sharing the folder
        holds it; ``True`` otherwise (always without a folder, or when the folder cannot be written). The
        claimant stores its results, or calls :meth:`release` when it cannot."""
        return self.folder is None or self._claim(key) is not None

    def release(self, key: Any) -> None:
        """Withdraw a :meth:`claim` (done, or failed: another process may then compute it)."""
        if self.folder is not None:
            try:
                os.unlink(self._claim_path(key))
            except OSError:
                pass

    def wait(self, key: Any, claim: Any) -> tuple[bool, Any]:
        """Wait for ``key``'s result while another process holds ``claim``'s claim: ``(True, value)`` once
        it is stored, :meth:`get`'s answer once the claim goes away (released, with a result or without:
        the computation raised) or its process dies."""
        if self.folder is None:
            return self.get(key)
        path = self._claim_path(claim)
        while True:
            hit, value = self.get(key)
            if hit:
                return True, value
            if not path.exists() or not self._holder_alive(path):
                return self.get(key)  # released: with a result, or without (the computation raised)
            time.sleep(self.POLL_S)
