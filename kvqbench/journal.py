"""The run journal: every cell's values, written to the results folder the moment they exist, so an
interrupted run loses no finished work and a rerun of the same code and settings computes only the rest.

One file per results folder, ``<folder>/.kvqbench-journal.jsonl``, append-only JSON lines. Each line is one
cell, written by whichever process computed it (a pytest-xdist worker, or the serial session), with one
``os.write`` of the whole line under an exclusive ``flock`` and the file opened ``O_APPEND``, so concurrent
writers never interleave and a kill leaves at most one unreadable last line (skipped when read)::

    {"format": 1, "session": "<this run>", "context": "<digest>", "key": "<digest>", "nodeid": "...",
     "record": {...}}          # a cell whose test passed: its whole record, as the result files hold it
    {..., "result": {...}}     # values computed for a cell whose own test has not run yet (a seed group's
                               # other seeds, the other seeds of a seed-free computation): metrics,
                               # per_layer, series, extra

A line's ``key`` is a digest of everything that determines its values (:func:`cell_key`): the run
*context* (:func:`context_digest` of the code — :func:`source_digest` of the installed ``kvqbench``
package —, library versions, device, dtype, threads, seeds, …), the test file's bytes, the data's identity
and the cell's node id. A changed method, test, setting or model gives other keys, so nothing stale is
ever reused. A session reads only the lines of earlier sessions (``session`` differs), so what it sees does
not depend on when it looks.

Plain Python: no torch, no pytest (the plugin, :mod:`kvqbench.plugin.resume`, decides what to reuse).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["JOURNAL_NAME", "Journal", "source_digest", "file_digest", "context_digest", "cell_key"]

#: the journal's file name inside a results folder (hidden; not part of a result set, never moved with one)
JOURNAL_NAME = ".kvqbench-journal.jsonl"
#: the line format
FORMAT = 1

_DIGESTS: dict[str, str] = {}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file's bytes, remembered per path in this process; ``"missing"`` when unreadable."""
    p = str(path)
    if p not in _DIGESTS:
        try:
            _DIGESTS[p] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
        except OSError:
            _DIGESTS[p] = "missing"
    return _DIGESTS[p]


def source_digest(root: str | os.PathLike | None = None) -> str:
    """SHA-256 (hex) over every file of the ``kvqbench`` package (``root``, default the package folder):
    its relative path and bytes, in sorted order, ``__pycache__`` left out. Any edit to the code, the C
    kernels, the corpus or a data table changes it. Remembered in this process."""
    base = Path(root) if root is not None else Path(__file__).resolve().parent
    memo = f"tree:{base}"
    if memo not in _DIGESTS:
        h = hashlib.sha256()
        for p in sorted(base.rglob("*")):
            if "__pycache__" in p.parts or not p.is_file():
                continue
            h.update(p.relative_to(base).as_posix().encode() + b"\0")
            h.update(hashlib.sha256(p.read_bytes()).digest())
        _DIGESTS[memo] = h.hexdigest()
    return _DIGESTS[memo]


def context_digest(context: dict[str, Any]) -> str:
    """Digest of a run context (a JSON-able dict: code digest, versions, settings …)."""
    return _sha(json.dumps(context, sort_keys=True, default=str))


def cell_key(context: str, test_file: str, data: str, nodeid: str) -> str:
    """The reuse key of one cell: the run ``context`` digest, the test file's digest, the identity of the
    cell's data (``"synthetic"``, or the real model's fingerprint) and its node id."""
    return _sha("\0".join((context, test_file, data, nodeid)))


class Journal:
    """The journal of ``folder`` for a session whose run context digest is ``context`` and whose own lines
    carry ``session``.

    :meth:`load` reads the lines of earlier sessions; :meth:`record` / :meth:`result` answer by key. Writing
    never raises: a folder that cannot be written only loses the journal (said once, in :attr:`problem`).
    """

    def __init__(self, folder: str | os.PathLike, context: str, session: str) -> None:
        self.path = Path(folder) / JOURNAL_NAME
        self.context = context
        self.session = session
        self.records: dict[str, dict[str, Any]] = {}
        self.results: dict[str, dict[str, Any]] = {}
        #: node ids earlier sessions journaled, under any run context
        self.nodeids: set[str] = set()
        self.problem: str | None = None

    def load(self, keys: set[str] | None = None) -> "Journal":
        """Read the lines earlier sessions wrote under this context (unreadable lines are skipped), keeping
        only those of ``keys`` when given (the cells a session collected); returns self."""
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return self
        for line in text.splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("session") == self.session:
                continue
            self.nodeids.add(str(doc.get("nodeid")))
            if doc.get("context") != self.context or (keys is not None and doc.get("key") not in keys):
                continue
            if isinstance(doc.get("record"), dict):
                self.records[str(doc.get("key"))] = doc["record"]
            elif isinstance(doc.get("result"), dict):
                self.results[str(doc.get("key"))] = doc["result"]
        return self

    def record(self, key: str) -> dict[str, Any] | None:
        """The stored record of a cell whose test passed, or ``None``."""
        return self.records.get(key)

    def result(self, key: str) -> dict[str, Any] | None:
        """The stored values of a cell whose own test had not run, or ``None``."""
        return self.results.get(key)

    def add(self, key: str, nodeid: str, *, record: dict[str, Any] | None = None,
            result: dict[str, Any] | None = None) -> None:
        """Append one line (a ``record`` or a ``result``, plain JSON types) and hand it to the kernel at once."""
        doc = {"format": FORMAT, "session": self.session, "context": self.context, "key": key, "nodeid": nodeid,
               **({"record": record} if record is not None else {"result": result})}
        data = (json.dumps(doc, allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                _lock(fd)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)  # closing releases the lock
        except OSError as e:
            self.problem = self.problem or f"{self.path}: {e.strerror or e}"

    def remove(self) -> None:
        """Delete the journal (its run's result set is complete)."""
        try:
            self.path.unlink()
        except OSError:
            pass


def _lock(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: O_APPEND alone
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
