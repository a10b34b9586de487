"""``kvqbench run --ray [ADDRESS]``: a sharded run on a Ray cluster (the ``dist`` extra).

The driver starts a local Ray instance (no ADDRESS) or joins a cluster (``auto``, ``HOST:6379`` or
``ray://HOST:10001``), submits the N shards of the run as Ray tasks — one GPU each with ``--device
cuda`` (Ray sets ``CUDA_VISIBLE_DEVICES`` for the task, so the shard's ``cuda`` is its own GPU), one CPU
otherwise — and prints, per shard, kvqbench's own lines (progress with ETA, the closing line, what was
written) and pytest's summary line, each headed ``shard I/N:``, plus one line per finished shard (Ray
forwards each task's stdout to the driver, prefixed with the task and process, without colours when the
driver's output is not a terminal). Each task runs ``python -m pytest … --kvq-shard I/N`` in a fresh
interpreter, its whole output kept in the shard's ``pytest.log`` (the last :data:`TAIL_LINES` lines of it
are printed too when the shard fails), writes its results into a temporary folder on its node and returns
the files; the driver stores them under ``OUT/shards/shard-I-of-N/`` and merges them into ``OUT`` with
:func:`kvqbench.report.merge.merge_shards`.

Shards on one node share a content-addressed capture cache (``--kvq-capture-cache``; default
``$TMPDIR/kvqbench-capture`` on that node), so the real model is run once per node and not per shard.

Where the code comes from: with no ADDRESS the tasks run in this checkout. When joining a cluster the
checkout is shipped to the workers as Ray's ``runtime_env`` ``working_dir`` (results, virtual
environments, the git folder and figures excluded); kvqbench and its dependencies must be installed
in the workers' Python environment (the same ``pip install -e '.[real,dist]'``).
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_on_ray", "shard_task", "strip_option", "SHIP_EXCLUDES"]

#: never shipped to a remote cluster with the checkout
SHIP_EXCLUDES = [".git", ".venv", "venv", "results", "leaderboard", "*.png", ".pytest_cache", "__pycache__",
                 ".hypothesis", "*.egg-info"]


#: lines of a shard's output that the driver prints (the rest is in the shard's ``pytest.log``): kvqbench's own
#: progress, closing, incomplete-result and written-files lines, and pytest's summary line
FORWARD = re.compile(r"kvqbench: (?:\d+/\d+ tests|finished|incomplete|shard \d+/\d+:|wrote|writing results failed"
                     r"|results went)"
                     r"|(?:=+ )?(?:\d+ (?:passed|failed|errors?|skipped|deselected)|no tests ran)\b.* in [0-9.]+s")
#: lines of a failed shard's output printed at its end
TAIL_LINES = 40
#: the shard's whole pytest output, next to its results
SHARD_LOG = "pytest.log"


def strip_option(args: list[str], name: str, *, has_value: bool = True) -> tuple[list[str], str | None]:
    """Remove ``name VALUE`` / ``name=VALUE`` (or a bare flag) from ``args``; return the rest and the
    (last) value."""
    out: list[str] = []
    value = None
    skip = False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == name:
            if has_value and i + 1 < len(args):
                value, skip = args[i + 1], True
            elif not has_value:
                value = ""
            continue
        if has_value and a.startswith(name + "="):
            value = a.split("=", 1)[1]
            continue
        out.append(a)
    return out, value


def shard_task(index: int, count: int, pytest_args: list[str], cwd: str | None) -> dict[str, Any]:
    """Run shard ``index`` of ``count`` as ``python -m pytest`` in a fresh process and return its files.

    Runs inside a Ray task (it is plain Python, so it can be called directly too). Returns ``{"index",
    "rc" (pytest's exit code), "files" (name → bytes of the shard folder), "seconds", "node"}``."""
    t0 = time.time()
    out = tempfile.mkdtemp(prefix=f"kvqbench-shard-{index}-of-{count}-")
    args = list(pytest_args)
    if not any(a == "--kvq-capture-cache" or a.startswith("--kvq-capture-cache=") for a in args):
        args += ["--kvq-capture-cache", os.path.join(tempfile.gettempdir(), "kvqbench-capture")]
    cmd = [sys.executable, "-m", "pytest", *args, "--kvq-shard", f"{index}/{count}", "--kvq-out", out]
    print(f"kvqbench ray: shard {index}/{count} on {socket.gethostname()}: {' '.join(cmd[1:])}", flush=True)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    with open(os.path.join(out, SHARD_LOG), "w", encoding="utf-8") as fh:
        proc = subprocess.Popen(cmd, cwd=cwd or None, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            fh.flush()
            tail.append(line.rstrip("\n"))
            m = FORWARD.search(line)
            if m:  # from the match on: pytest's progress dots may precede it on the line
                print(f"shard {index}/{count}: {line[m.start():].rstrip()}", flush=True)
        rc = proc.wait()
    if rc not in (0, 5):  # a failure: its last lines (the whole output is in the shard's pytest.log)
        for line in tail:
            print(f"shard {index}/{count} | {line}", flush=True)
    files = {}
    for p in sorted(Path(out).iterdir()) if os.path.isdir(out) else []:
        if p.is_file():
            files[p.name] = p.read_bytes()
    shutil.rmtree(out, ignore_errors=True)
    return {"index": index, "rc": rc, "files": files, "seconds": round(time.time() - t0, 1),
            "node": socket.gethostname()}


def run_on_ray(pytest_args: list[str], *, address: str | None, shards: int | None, cuda: bool, out_dir: Path,
               rootdir: Path, figures: bool = True, log: Callable[[str], None] | None = None) -> int:
    """Run ``pytest_args`` as ``shards`` Ray tasks and merge them into ``out_dir``.

    Args:
        pytest_args: the run's pytest arguments (without ``-n``, ``--kvq-shard``, ``--kvq-out``).
        address: ``None`` for a local Ray instance, else a Ray address to join.
        shards: number of shards (default: the cluster's GPUs with ``cuda``, else its CPUs).
        cuda: one GPU per task (else one CPU).
        out_dir: where the merged result set goes; shard folders go to ``out_dir/shards/``.
        rootdir: the checkout (tasks run there; shipped to a remote cluster).

    Returns an exit code: 2 when Ray is missing or the cluster has no GPU for ``cuda``, else the worst of
    the shards' pytest exit codes and the merge's (0 complete, 1 incomplete).
    """
    log = log or (lambda m: print(m, flush=True))
    # read when Ray is imported / prints: every shard's lines (not "[repeated 2x …]"), and no colour codes
    # in a log file or a pipe
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    try:
        import ray
    except ImportError:
        log("kvqbench run --ray needs Ray: pip install -e '.[dist]' (or pip install 'ray>=2.9')")
        return 2
    from kvqbench.report.merge import MergeError, merge_shards
    from kvqbench.shard import shard_dir_name

    # ERROR: Ray's own start-up notes (token set-up, "started a local instance") are replaced by ours
    init: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "logging_level": logging.ERROR}
    if address:
        init["address"] = address
        init["runtime_env"] = {"working_dir": str(rootdir), "excludes": SHIP_EXCLUDES}
    t0 = time.time()
    ray.init(**init)
    try:
        res = ray.cluster_resources()
        kind = "GPU" if cuda else "CPU"
        have = int(res.get(kind, 0))
        if have < 1:
            log(f"kvqbench run --ray: the cluster has no {kind} (resources: {res}); "
                + ("drop --device cuda" if cuda else "add workers"))
            return 2
        n = shards or have
        log(f"kvqbench ray: {'joined ' + address if address else 'started a local Ray instance'} "
            f"({have} {kind}) in {time.time() - t0:.1f}s; {n} shard(s), one {kind} each")
        task = ray.remote(num_cpus=0 if cuda else 1, num_gpus=1 if cuda else 0, max_retries=0)(shard_task)
        cwd = None if address else str(rootdir)
        pending = {task.remote(i, n, pytest_args, cwd): i for i in range(1, n + 1)}
        rcs: list[int] = []
        folders: list[Path] = []
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            ref = ready[0]
            i = pending.pop(ref)
            try:
                r = ray.get(ref)
            except Exception as e:  # a task that died (node lost, OOM): the merge lists its cells as missing
                log(f"kvqbench ray: shard {i}/{n} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                rcs.append(1)
                continue
            folder = out_dir / "shards" / shard_dir_name(i, n)
            shutil.rmtree(folder, ignore_errors=True)  # never mix with an older run's shard
            folder.mkdir(parents=True)
            for name in sorted(r["files"]):
                (folder / name).write_bytes(r["files"][name])
            if r["files"]:
                folders.append(folder)
            rcs.append(0 if int(r["rc"]) == 5 else int(r["rc"]))  # 5: an empty shard ran no test
            log(f"kvqbench ray: shard {i}/{n} finished on {r['node']} in {r['seconds']}s (pytest exit {r['rc']}); "
                f"{n - len(rcs)} to go, elapsed {time.time() - t0:.0f}s")
    finally:
        ray.shutdown()
    if not folders:
        log("kvqbench ray: no shard wrote results")
        return max(rcs + [1])
    try:
        m = merge_shards(folders, out_dir, figures=figures, log=log)
    except MergeError as e:
        log(f"kvqbench merge: {e}")
        return 2
    log(f"kvqbench ray: merged {len(folders)} shard(s): {m.result.completeness.get('summary')} -> {m.result.out_dir}")
    return max(max(rcs, default=0), 0 if m.complete else 1)
