"""``kvqbench merge``: join the folders of a sharded run (``--kvq-shard I/N``) into one result set.
Torch-free.

Each shard folder holds a result set of its own cells and a ``shard.json`` (which shard, the digest of
the whole collected matrix, every cell of the matrix, the cells it selected, and the run's provenance).
:func:`merge_shards` checks that the folders belong to one run — the same commit, versions,
configuration (seeds, bits, threads, device type, capture dtype, model, shard count, cell matrix) and
data (the real capture's model, text and tokens) — reads their records back and writes them with the
same :func:`~kvqbench.results.write.write_result_set` a session uses, so the merged files are those a
single session would have written (provenance and timings aside). Cells of the matrix that no folder
holds are listed and the merged set is stamped incomplete, as a partial run is.

Shards of runs on different models (``--kvq-model``) merge into one result set with one real source per
model (:func:`kvqbench.cells.real_source`): the shards of each model must form one run as above, and the
runs agree on everything else checked. Their synthetic cells (the same node ids, a function of the seeds
alone) are taken from the first model's run (the default model first, then by name).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvqbench.cells import DEFAULT_MODEL, parse_nodeid, source_kind
from kvqbench.report.io import read_json, write_json_atomic
from kvqbench.results.read import load_result_set
from kvqbench.results.write import BENCHMARK_JSON, ResultSet, UpdateBoard, WriteExtra, write_result_set

__all__ = ["MergeError", "Shard", "read_shard", "by_model", "check_compatible", "merged_provenance", "merge_shards",
           "MergeResult", "CHECKED", "merge_benchmark_json", "missing_cells_note"]

#: provenance fields every shard must agree on, with the words the error uses
CHECKED: tuple[tuple[str, str], ...] = (
    ("git_commit", "git commit"),
    ("kvqbench_version", "kvqbench version"),
    ("torch_version", "torch version"),
    ("seeds", "seeds"),
    ("bits", "bits"),
    ("threads", "torch threads (--kvq-threads)"),
    ("model", "model (--kvq-model)"),
    ("capture_dtype", "capture dtype (--kvq-dtype)"),
)
#: fields of a real cell's data description that identify the captured data
REAL_DATA_KEYS = ("model", "model_file", "corpus_sha256", "tokens_sha256", "capture_dtype", "transformers_version")


class MergeError(ValueError):
    """The folders cannot be merged; the message is one line naming the folders and the difference."""


@dataclass
class Shard:
    """One shard folder as read back: ``doc`` is its ``shard.json``; ``records`` its cell records."""

    path: Path
    doc: dict[str, Any]
    records: list[dict[str, Any]]

    @property
    def label(self) -> str:
        return f"{self.path} (shard {self.doc.get('shard', '?')})"

    @property
    def provenance(self) -> dict[str, Any]:
        return self.doc.get("provenance") or {}


def read_shard(folder: str | os.PathLike) -> Shard:
    """Read a shard folder: its ``shard.json`` and the records of its ``exp*_*.json`` (none for a shard
    that got no cell).

    Raises:
        MergeError: not a folder, no ``shard.json`` (not written by ``--kvq-shard``), or unreadable files.
    """
    d = Path(folder)
    if not d.is_dir():
        raise MergeError(f"{d} is not a folder")
    sf = d / "shard.json"
    if not sf.is_file():
        raise MergeError(f"{d} has no shard.json: not a shard folder (run with --kvq-shard I/N or kvqbench run --shard)")
    try:
        doc = read_json(sf)
    except ValueError as e:
        raise MergeError(f"{sf} is not valid JSON ({e})") from None
    need = ("index", "count", "matrix_sha256", "cells", "selected", "provenance")
    if not isinstance(doc, dict) or any(k not in doc for k in need):
        raise MergeError(f"{sf} is not a kvqbench shard description (needs {', '.join(need)})")
    records: list[dict[str, Any]] = []
    if any(d.glob("exp[0-9]*_*.json")):
        try:
            records = load_result_set(d)[0]
        except (FileNotFoundError, ValueError) as e:
            raise MergeError(str(e)) from None
    return Shard(d, doc, records)


def _device_type(prov: dict[str, Any]) -> str:
    return str(prov.get("device") or "?").split(":")[0]


def _real_data(sh: Shard) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in sh.records:
        if source_kind(str(r.get("source"))) == "real" and r.get("data"):
            key = r.get("size", "")
            out.setdefault(key, {k: r["data"].get(k) for k in REAL_DATA_KEYS})
    return out


def _short(v: Any) -> str:
    s = str(v)
    return s if len(s) <= 40 else s[:37] + "…"


def _model(sh: Shard) -> str:
    return str(sh.provenance.get("model") or DEFAULT_MODEL)


def by_model(shards: list[Shard]) -> list[list[Shard]]:
    """The shards grouped by the model of their run (``provenance.model``), the default model's group
    first, then by name; each group in the order given."""
    groups: dict[str, list[Shard]] = {}
    for sh in shards:
        groups.setdefault(_model(sh), []).append(sh)
    return [groups[m] for m in sorted(groups, key=lambda m: (m != DEFAULT_MODEL, m))]


def check_compatible(shards: list[Shard]) -> None:
    """Raise :class:`MergeError` (one line) unless the shards of each model come from one run and the runs
    differ in their model alone.

    Checked against the first shard: the fields of :data:`CHECKED` (the model within a model's shards
    only), the device type (cpu/cuda); within a model's shards, the shard count, the cell matrix (its
    digest: the same -k/-m/--kvq-methods/sizes/real selection) and the real data each folder captured;
    then that no shard index is given twice for a model."""
    first = shards[0]
    p0 = first.provenance
    for sh in shards[1:]:
        p = sh.provenance
        for key, words in CHECKED:
            if key != "model" and p.get(key) != p0.get(key):
                raise MergeError(f"{sh.label} and {first.label} differ in {words}: "
                                 f"{_short(p.get(key))} vs {_short(p0.get(key))}")
        if _device_type(p) != _device_type(p0):
            raise MergeError(f"{sh.label} and {first.label} differ in device type: "
                             f"{_device_type(p)} vs {_device_type(p0)}")
    for group in by_model(shards):
        _check_one_run(group)


def _check_one_run(shards: list[Shard]) -> None:
    """The checks of :func:`check_compatible` among the shards of one model's run."""
    first = shards[0]
    for sh in shards[1:]:
        if sh.doc["count"] != first.doc["count"]:
            raise MergeError(f"{sh.label} and {first.label} differ in shard count: "
                             f"{sh.doc['count']} vs {first.doc['count']}")
        if sh.doc["matrix_sha256"] != first.doc["matrix_sha256"]:
            raise MergeError(f"{sh.label} and {first.label} differ in the cell matrix "
                             f"({sh.doc.get('matrix_size')} vs {first.doc.get('matrix_size')} collected tests: "
                             "different -k/-m/--kvq-methods/--kvq-real or test files)")
        d, d0 = _real_data(sh), _real_data(first)
        for size in sorted(set(d) & set(d0)):
            for k in REAL_DATA_KEYS:
                if d[size].get(k) != d0[size].get(k):
                    raise MergeError(f"{sh.label} and {first.label} differ in real data source ({size} {k}): "
                                     f"{_short(d[size].get(k))} vs {_short(d0[size].get(k))}")
    seen: dict[int, Shard] = {}
    for sh in shards:
        i = sh.doc["index"]
        if i in seen:
            raise MergeError(f"shard {sh.doc['shard']} given twice: {seen[i].path} and {sh.path}")
        seen[i] = sh


def _strip_shard_args(command: str) -> str:
    try:
        toks = shlex.split(command)
    except ValueError:  # not shell-quoted: split into words
        toks = command.split()
    out, skip = [], False
    for t in toks:
        if skip:
            skip = False
            continue
        if t in ("--kvq-shard", "--kvq-out"):
            skip = True
            continue
        if t.startswith(("--kvq-shard=", "--kvq-out=")):
            continue
        out.append(t)
    return shlex.join(out)


def merged_provenance(shards: list[Shard]) -> dict[str, Any]:
    """The provenance of the merged set: the shards' common fields; the earliest start time; the shape
    list of all shards; device names joined when the shards ran on different hardware; the shard
    command without ``--kvq-shard``/``--kvq-out``; and ``merged``: the shard count and folders. Shards of
    several models: ``model`` lists them joined by `` + `` (the default model first), the command and
    shard count are the first model's."""
    groups = by_model(shards)
    shards = [sh for g in groups for sh in sorted(g, key=lambda s: s.doc["index"])]
    provs = [sh.provenance for sh in shards]
    out = {k: v for k, v in provs[0].items() if k != "shard"}
    shapes = {(s["source"], s["size"], tuple(s.get("k", ()))) for p in provs for s in p.get("shapes") or []}
    out["shapes"] = [{"source": a, "size": b, "k": list(c)} for a, b, c in sorted(shapes)]
    starts = [p.get("start_time") for p in provs if p.get("start_time")]
    if starts:
        out["start_time"] = min(starts)
    names: list[str] = []
    for p in provs:
        if p.get("device_name") and p["device_name"] not in names:
            names.append(p["device_name"])
    if names:
        out["device_name"] = " + ".join(names)
    if out.get("command"):
        out["command"] = _strip_shard_args(out["command"])
    if len(groups) > 1:
        out["model"] = " + ".join(_model(g[0]) for g in groups)
    out["merged"] = {"shards": shards[0].doc["count"], "folders": [sh.path.name for sh in shards]}
    return out


def merge_benchmark_json(shards: list[Shard], out_dir: Path) -> Path | None:
    """Join the shards' pytest-benchmark files (``benchmark_exp4.json``: exp4's timed round trips, written
    by serial shard sessions) into one in ``out_dir``, so ``--benchmark-compare`` and
    ``pytest-benchmark compare`` see every timed cell of the run.

    The ``benchmarks`` lists are concatenated in node-id order; ``machine_info``, ``commit_info`` and
    ``version`` are the first shard's (the shards share the commit: :func:`check_compatible`), the
    ``datetime`` the earliest. A stale file in ``out_dir`` is removed when no shard has one.

    Returns the path written, or ``None`` when no shard had a benchmark file.

    Raises:
        MergeError: a shard's benchmark file is not valid JSON or has no ``benchmarks`` list.
    """
    docs = []
    for sh in sorted(shards, key=lambda s: s.doc["index"]):
        f = sh.path / BENCHMARK_JSON
        if f.is_file():
            try:
                doc = read_json(f)
            except ValueError as e:
                raise MergeError(f"{f} is not valid JSON ({e})") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), list):
                raise MergeError(f"{f} is not a pytest-benchmark file (no benchmarks list)")
            docs.append(doc)
    dest = out_dir / BENCHMARK_JSON
    if not docs:
        if dest.is_file():
            dest.unlink()
        return None
    merged = {k: v for k, v in docs[0].items() if k != "benchmarks"}
    stamps = [d["datetime"] for d in docs if d.get("datetime")]
    if stamps:
        merged["datetime"] = min(stamps)
    merged["benchmarks"] = sorted((b for d in docs for b in d["benchmarks"]),
                                  key=lambda b: (str(b.get("fullname", "")), str(b.get("name", ""))))
    write_json_atomic(dest, merged)
    return dest


@dataclass
class MergeResult:
    """What :func:`merge_shards` did: the written :class:`ResultSet`, the cells of the matrix no folder
    held (``missing``) and the shard indices not given (``missing_shards``)."""

    result: ResultSet
    missing: list[str] = field(default_factory=list)
    missing_shards: list[int] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return bool(self.result.completeness.get("complete"))


def merge_shards(folders: list[str | os.PathLike], out_dir: str | os.PathLike, *, figures: bool = True,
                 log: Callable[[str], None] | None = None, update_board: UpdateBoard | None = None,
                 write_extra: WriteExtra | None = None) -> MergeResult:
    """Merge shard folders into one result set in ``out_dir``.

    Args:
        folders: shard folders (each written by a ``--kvq-shard I/N`` session), any order.
        out_dir: destination (the rules of :func:`~kvqbench.results.write.write_result_set` apply: an
            incomplete merge never replaces a complete result set there).
        figures: render the PNG figures too.
        log: one-line messages (default stderr).
        update_board, write_extra: callbacks passed on to
            :func:`~kvqbench.results.write.write_result_set` (the pytest hooks are not called: see docs/HOOKS.md).

    Returns a :class:`MergeResult`.

    Raises:
        MergeError: no folder, a folder that is not a shard, shards of different runs (one line naming
            the difference), a shard given twice, cells held by more than one folder (listed), or a
            shard's ``benchmark_exp4.json`` that cannot be read.
    """
    log = log or (lambda m: print(m, file=sys.stderr))
    if not folders:
        raise MergeError("no shard folders given")
    shards = [read_shard(f) for f in folders]
    check_compatible(shards)
    groups = by_model(shards)
    owner: dict[str, Path] = {}
    dups: list[str] = []
    records: list[dict[str, Any]] = []
    cells: list[str] = []
    missing_shards: list[int] = []
    for group in groups:
        taken = set(owner)  # node ids of an earlier model's run: its synthetic cells
        for sh in group:
            for r in sh.records:
                nid = r.get("nodeid", "")
                if nid in taken and r.get("source") == "synthetic":
                    continue
                if nid in owner:
                    dups.append(f"{nid} ({owner[nid]} and {sh.path})")
                owner.setdefault(nid, sh.path)
                records.append(r)
        cells += [c for c in group[0].doc["cells"] if c not in taken]
        given = {sh.doc["index"] for sh in group}
        missing_shards += [i for i in range(1, group[0].doc["count"] + 1) if i not in given]
    if dups:
        raise MergeError(f"{len(dups)} cell(s) appear in more than one folder: " + "; ".join(dups[:5])
                         + (" …" if len(dups) > 5 else ""))
    cells = list(dict.fromkeys(cells))
    missing = [c for c in cells if c not in owner]
    reason = None
    if missing_shards:
        reason = (f"merged {len(shards)} of {sum(g[0].doc['count'] for g in groups)} shards, missing shard(s) "
                  f"{', '.join(map(str, missing_shards))}")
    res = write_result_set(records, merged_provenance(shards), out_dir, expected=cells, reason=reason,
                           figures=figures, log=log, update_board=update_board, write_extra=write_extra)
    if res.out_dir is not None:
        bench = merge_benchmark_json(shards, res.out_dir)
        if bench is not None:
            res.paths.append(str(bench))
    if missing:
        log(missing_cells_note(missing, len(cells)))
    return MergeResult(res, missing, missing_shards)


def missing_cells_note(missing: list[str], total: int, show: int = 10) -> str:
    """The lines that name a merge's missing cells: how many, per test function, then the first ``show`` node
    ids one per line (the full list is the result's ``completeness.not_run_ids``)."""
    per_test = Counter(parse_nodeid(n).name for n in missing)
    lines = [f"kvqbench merge: {len(missing)} of {total} cells missing ("
             + ", ".join(f"{fn} ×{k}" for fn, k in per_test.items()) + "):"]
    lines += [f"  {n}" for n in missing[:show]]
    if len(missing) > show:
        lines.append(f"  … and {len(missing) - show} more (all in leaderboard.json: completeness.not_run_ids)")
    return "\n".join(lines)
