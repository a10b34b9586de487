"""Where a complete result set goes when a later complete set takes its folder: ``DEST/previous/<id>/``, one
folder per displaced set, never overwritten. Torch-free.

``<id>`` is ``<UTC start of that set's run>-<first 8 hex digits of the SHA-256 of its leaderboard.json>``,
e.g. ``previous/20261203T140210Z-1a2b3c4d/``: the names sort oldest first, so ``ls -r`` lists the newest
first. ``previous/`` keeps the newest :data:`DEFAULT_KEEP` sets (``--kvq-keep N`` or ``KVQBENCH_KEEP=N``
change it; ``0`` keeps none); when a displaced set brings it over that count, the oldest go, each named in
one line. Nothing else in ``previous/`` is touched: only folders named like ``<id>`` count and are removed.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Mapping

from kvqbench.report.io import read_json

__all__ = ["PREVIOUS_DIR", "DEFAULT_KEEP", "KEEP_ENV", "parse_keep", "keep_count", "keep_displaced_set", "kept_sets"]

#: the subfolder of a results folder that holds the complete sets later complete runs displaced
PREVIOUS_DIR = "previous"
#: how many displaced complete sets ``previous/`` keeps unless ``--kvq-keep`` or :data:`KEEP_ENV` says otherwise
DEFAULT_KEEP = 5
#: the environment variable giving that count (for ``kvqbench merge`` and ``--ray`` as for ``kvqbench run``)
KEEP_ENV = "KVQBENCH_KEEP"

#: the name of one kept set's folder: ``<YYYYmmddTHHMMSSZ>-<8 hex>`` (``-2``, ``-3``… on a clash)
_KEPT_NAME = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{8}(-\d+)?$")

Log = Callable[[str], None]


def parse_keep(text: str, where: str = "--kvq-keep") -> int:
    """The retention count in ``text``: an int >= 0.

    Raises:
        ValueError: anything else (one line naming ``where``).
    """
    try:
        n = int(str(text).strip())
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{where} expects a count >= 0 of kept result sets; got {text!r}")
    return n


def keep_count(keep: int | None = None, environ: Mapping[str, str] | None = None) -> int:
    """How many displaced sets ``previous/`` keeps: ``keep`` when given, else :data:`KEEP_ENV`, else
    :data:`DEFAULT_KEEP`.

    Raises:
        ValueError: :data:`KEEP_ENV` is set to something other than a count >= 0 (names it).
    """
    if keep is not None:
        return parse_keep(str(keep))
    env = os.environ if environ is None else environ
    text = env.get(KEEP_ENV, "").strip()
    return parse_keep(text, KEEP_ENV) if text else DEFAULT_KEEP


def kept_sets(dest: str | os.PathLike) -> list[Path]:
    """The kept sets of the results folder ``dest`` (the folders of ``dest/previous/`` named like a kept
    set), newest first."""
    prev = Path(dest) / PREVIOUS_DIR
    if not prev.is_dir():
        return []
    return sorted((p for p in prev.iterdir() if p.is_dir() and _KEPT_NAME.match(p.name)),
                  key=lambda p: p.name, reverse=True)


def _describe(folder: Path) -> tuple[str, str]:
    """``(what, stamp)`` of the set in ``folder``: ``"complete set of 400 cells (run 2026-12-03 14:02 UTC)"``
    and its ``YYYYmmddTHHMMSSZ`` start (the provenance's ``start_time``, else the leaderboard's mtime)."""
    lb = folder / "leaderboard.json"
    try:
        doc = read_json(lb)
    except (OSError, ValueError):
        doc = {}
    doc = doc if isinstance(doc, dict) else {}
    comp = doc.get("completeness") if isinstance(doc.get("completeness"), dict) else {}
    prov = doc.get("provenance") if isinstance(doc.get("provenance"), dict) else {}
    try:
        start = _dt.datetime.fromisoformat(str(prov.get("start_time")))
        if start.tzinfo is None:
            start = start.replace(tzinfo=_dt.timezone.utc)
    except ValueError:
        start = None
    if start is None:
        try:
            start = _dt.datetime.fromtimestamp(lb.stat().st_mtime, _dt.timezone.utc)
        except OSError:
            start = _dt.datetime.now(_dt.timezone.utc)
    start = start.astimezone(_dt.timezone.utc)
    n = comp.get("expected") or comp.get("finished")
    if comp.get("shard_done"):
        what = f"set of shard {comp['shard_done']} ({comp.get('finished')} cells)"
    else:
        what = f"complete set of {n} cells" if n else "complete set"
    what += f" (run {start:%Y-%m-%d %H:%M} UTC)"
    return what, start.strftime("%Y%m%dT%H%M%SZ")


def _free_name(prev: Path, base: str) -> Path:
    target, i = prev / base, 1
    while target.exists():
        i += 1
        target = prev / f"{base}-{i}"
    return target


def _move_set(src: Path, prev: Path, patterns: tuple[str, ...]) -> Path:
    """Move the files of the set in ``src`` matching ``patterns`` into a new folder of ``prev`` (named by
    :func:`_describe`'s stamp and the leaderboard's digest); every file moves back if one cannot."""
    _, stamp = _describe(src)
    lb = src / "leaderboard.json"
    digest = hashlib.sha256(lb.read_bytes()).hexdigest()[:8] if lb.is_file() else "00000000"
    prev.mkdir(parents=True, exist_ok=True)
    target = _free_name(prev, f"{stamp}-{digest}")
    target.mkdir()
    moved: list[Path] = []
    try:
        for pattern in patterns:
            for p in sorted(src.glob(pattern)):
                if p.is_file():
                    os.replace(p, target / p.name)
                    moved.append(p)
    except OSError:
        for p in moved:
            os.replace(target / p.name, p)
        target.rmdir()
        raise
    return target


def keep_displaced_set(dest: Path, patterns: tuple[str, ...], keep: int, log: Log) -> list[str]:
    """Move the complete set in ``dest`` (its files matching ``patterns``) into ``dest/previous/<id>/``,
    then remove the oldest kept sets beyond ``keep``; one line per move or removal, each also logged.

    A set kept flat in ``dest/previous/`` itself (files, no ``<id>`` folder) moves into an ``<id>`` folder
    first. Raises ``OSError`` when the set cannot be moved (its files are then back in ``dest``).
    """
    prev = dest / PREVIOUS_DIR
    lines: list[str] = []
    if (prev / "leaderboard.json").is_file():  # a set kept flat in previous/: into a folder of its own
        what, _ = _describe(prev)
        target = _move_set(prev, prev, patterns)
        lines.append(f"kvqbench: the {what} kept in {prev} moved to {target}")
    what, _ = _describe(dest)
    target = _move_set(dest, prev, patterns)
    lines.append(f"kvqbench: the {what} that was in {dest} is kept in {target}")
    for old in kept_sets(dest)[keep:]:
        what, _ = _describe(old)
        shutil.rmtree(old)
        lines.append(f"kvqbench: removed {old}, the {what}: {prev} keeps the newest {keep} "
                     f"(--kvq-keep N or {KEEP_ENV}=N to keep more)")
    for line in lines:
        log(line)
    return lines

