"""Deterministic, duration-balanced shards of the cell matrix (``--kvq-shard I/N``). Torch-free.

A run split into N shards runs the same collected matrix N times with a different ``I``; each session
keeps the cells of shard ``I`` and writes its results to its own folder, and ``kvqbench merge`` puts
the folders back together. The split is pytest-split's *least duration* algorithm
(:class:`pytest_split.algorithms.LeastDurationAlgorithm`: longest cell first onto the least loaded
shard, ties broken by name and then by collection order), fed with an estimated duration for every
collected cell:

1. the cell's own duration in the durations file (pytest-split's format: a JSON object node id →
   seconds; the committed default is ``kvqbench/data/durations.json``, made from a fresh-clone
   main job and a smoke run; refresh it with pytest-split's own
   ``--store-durations --durations-path kvqbench/data/durations.json``);
2. else the median duration of the cells of the same *kind* in the file (test function × data source ×
   size, as the progress ETA groups them), so other seeds, bits or models are still balanced;
3. else the median of the whole file (1 s when the file is empty).

Cells that share one computation are scheduled as one unit (``split``'s ``unit``): the plugin keeps every
real-data seed group together (see ``kvqbench.plugin.sharing.shard_unit``), so no two shards compute the same group.

Only collection order, node ids and the file enter the split, so every machine (and every
``PYTHONHASHSEED``) computes the same shards; the N shards partition the matrix (each cell in exactly
one). Everything here works on plain node ids, so it is testable without pytest items.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_DURATIONS", "SHARD_FILE", "parse_shard", "load_durations", "estimate_durations", "split",
           "matrix_digest", "shard_dir_name"]

#: the committed durations file (pytest-split's format)
DEFAULT_DURATIONS = Path(__file__).resolve().parent / "data" / "durations.json"
#: written into a shard's results folder: which shard, the whole matrix and this shard's cells
SHARD_FILE = "shard.json"


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/3"`` → ``(2, 3)`` (1-based shard index, shard count).

    Raises:
        ValueError: not ``I/N`` with integers ``1 <= I <= N``.
    """
    a, sep, b = str(text).strip().partition("/")
    try:
        i, n = int(a), int(b)
        if not sep or n < 1 or not 1 <= i <= n:
            raise ValueError
    except ValueError:
        raise ValueError(f"--kvq-shard expects I/N with 1 <= I <= N (e.g. 2/3); got {text!r}") from None
    return i, n


def shard_dir_name(index: int, count: int) -> str:
    """The folder name of shard ``index`` of ``count`` (``shard-2-of-3``)."""
    return f"shard-{index}-of-{count}"


def load_durations(path: str | Path | None) -> dict[str, float]:
    """Read a durations file (pytest-split's JSON object node id → seconds; its old list-of-pairs form
    is accepted too). ``None`` reads the committed default.

    Raises:
        FileNotFoundError: the file does not exist (names it).
        ValueError: not valid JSON or not node id → non-negative number (names the file).
    """
    p = Path(path) if path is not None else DEFAULT_DURATIONS
    if not p.is_file():
        raise FileNotFoundError(f"durations file {p} not found")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
        if isinstance(doc, list):
            doc = dict(doc)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        out = {str(k): float(v) for k, v in doc.items()}
        if any(not v >= 0 for v in out.values()):
            raise ValueError("a negative or NaN duration")
    except (ValueError, TypeError) as e:
        raise ValueError(f"durations file {p} is not node id → seconds ({e})") from None
    return out


def estimate_durations(nodeids: Sequence[str], durations: dict[str, float],
                       kind: Callable[[str], str]) -> dict[str, float]:
    """An estimated duration (seconds) for every node id: its own, else its kind's median, else the
    median of the file (see the module docstring)."""
    by_kind: dict[str, list[float]] = {}
    for nid, d in durations.items():
        by_kind.setdefault(kind(nid), []).append(d)
    overall = statistics.median(durations.values()) if durations else 1.0
    kind_median = {k: statistics.median(v) for k, v in by_kind.items()}
    return {n: durations[n] if n in durations else kind_median.get(kind(n), overall) for n in nodeids}


@dataclass(frozen=True)
class _Node:
    """What pytest-split's algorithm reads of an item: ``nodeid``, and ``str()`` for its tie-break (the node id)."""

    nodeid: str

    def __str__(self) -> str:
        return self.nodeid


def split(nodeids: Sequence[str], count: int, durations: dict[str, float],
          unit: Callable[[str], str] | None = None) -> list[list[str]]:
    """Partition ``nodeids`` (in collection order) into ``count`` duration-balanced shards.

    ``unit`` maps a node id to the unit it is scheduled with (default: itself). The node ids of one unit
    always land in the same shard, scheduled as one item whose duration is the sum of theirs — for cells
    that share one computation (a real-data seed group: the first cell of the group computes every seed,
    the others read it), so no shard repeats a computation another shard does and the unit's cost is
    charged once, where it is paid.

    Returns one list per shard (shard ``i`` at index ``i - 1``), each in collection order; together
    they hold every node id exactly once. ``durations`` should cover every node id (see
    :func:`estimate_durations`).

    Raises:
        ValueError: ``count < 1`` or repeated node ids.
    """
    from pytest_split.algorithms import LeastDurationAlgorithm

    if count < 1:
        raise ValueError(f"shard count must be >= 1, got {count}")
    if len(set(nodeids)) != len(nodeids):
        raise ValueError("repeated node ids in the matrix")
    unit = unit or (lambda n: n)
    members: dict[str, list[str]] = {}
    for n in nodeids:  # a unit is named by its first node id (in collection order): unique, stable
        members.setdefault(unit(n), []).append(n)
    first = {u: ids[0] for u, ids in members.items()}
    load = {first[u]: sum(float(durations.get(n, 0.0)) for n in ids) for u, ids in members.items()}
    nodes = [_Node(first[u]) for u in members]
    groups = LeastDurationAlgorithm()(count, nodes, load)  # type: ignore[arg-type]
    shard_of = {n: i for i, g in enumerate(groups) for node in g.selected for n in members[unit(node.nodeid)]}
    return [[n for n in nodeids if shard_of[n] == i] for i in range(count)]


def matrix_digest(nodeids: Sequence[str]) -> str:
    """sha256 of the collected matrix (node ids, newline-joined, in collection order)."""
    return hashlib.sha256("\n".join(nodeids).encode("utf-8")).hexdigest()


def shard_doc(index: int, count: int, matrix: Sequence[str], cells: Sequence[str], selected: Sequence[str],
              durations_file: str, estimate_s: float) -> dict[str, Any]:
    """The content of ``shard.json``: which shard, a digest of the whole collected ``matrix`` (every
    test, cells or not), the benchmark ``cells`` of the whole matrix and the cells this shard
    ``selected`` (node ids, collection order), the durations file and the shard's estimated seconds."""
    return {"shard": f"{index}/{count}", "index": index, "count": count, "matrix_sha256": matrix_digest(matrix),
            "matrix_size": len(matrix), "cells": list(cells), "selected": list(selected),
            "durations_file": durations_file, "estimated_s": round(estimate_s, 3)}


__all__.append("shard_doc")


def durations_from_results(*dirs: str | Path) -> dict[str, float]:
    """Node id → seconds from the ``duration_s`` of every cell in the ``exp*_*.json`` files of results
    folders (how ``kvqbench/data/durations.json`` was made from a fresh-clone main job and smoke run:
    ``python -m kvqbench.shard results/ results/smoke/ > kvqbench/data/durations.json``)."""
    out: dict[str, float] = {}
    for d in dirs:
        for f in sorted(Path(d).glob("exp[0-9]*_*.json")):
            for c in json.loads(f.read_text(encoding="utf-8")).get("cells", []):
                if isinstance(c.get("duration_s"), (int, float)) and c.get("nodeid"):
                    out[c["nodeid"]] = round(float(c["duration_s"]), 4)
    return dict(sorted(out.items()))


if __name__ == "__main__":  # pragma: no cover - a maintenance command
    import sys

    print(json.dumps(durations_from_results(*sys.argv[1:]), indent=0, sort_keys=True))
