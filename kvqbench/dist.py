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
:func:`kvqbench.results.merge.merge_shards`.

Shards on one node share a content-addressed capture cache (``--kvq-capture-cache``; default the
user's own cache folder on that node, :func:`kvqbench.privdir.user_cache_dir` ``("capture")``), so the
real model is run once per node and not per shard.

Joining is checked before Ray is asked (:func:`join_problem`): ``ray://`` needs Ray Client (``grpcio``,
what ``ray[client]`` adds; the ``dist`` extra declares it), ``auto`` needs a cluster started on this
machine, and the address's port must accept a TCP connection within :data:`PROBE_TIMEOUT_S` seconds.
Each failure is one line saying what to do, exit code 2. While joining, Ctrl-C and SIGTERM end the
process at once (nothing is written before the cluster answers); a join that Ray refuses (e.g. a cluster
with token authentication joined by address without ``RAY_AUTH_MODE=token``) is one line too, Ray's own
per-attempt log lines held back.

Where the code comes from: with no ADDRESS the tasks run in this checkout. When joining a cluster the
checkout is shipped to the workers as Ray's ``runtime_env`` ``working_dir`` (results, virtual
environments, the git folder and figures excluded); kvqbench and its dependencies must be installed
in the workers' Python environment (the same ``pip install -e '.[real,dist]'``).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_on_ray", "shard_task", "strip_option", "join_problem", "node_capture_cache", "SHIP_EXCLUDES",
           "PROBE_TIMEOUT_S"]

#: never shipped to a remote cluster with the checkout (gitignore patterns: every ``results`` folder but
#: the package ``kvqbench/results``)
SHIP_EXCLUDES = [".git", ".venv", "venv", "results", "!kvqbench/results", "!kvqbench/results/**", "leaderboard",
                 "*.png", ".pytest_cache", "__pycache__", ".hypothesis", "*.egg-info"]


#: lines of a shard's output that the driver prints (the rest is in the shard's ``pytest.log``): kvqbench's own
#: progress, closing, incomplete-result and written-files lines, and pytest's summary line
FORWARD = re.compile(r"kvqbench: (?:\d+/\d+ tests|finished|incomplete|shard \d+/\d+:|wrote|writing results failed"
                     r"|results went)"
                     r"|(?:=+ )?(?:\d+ (?:passed|failed|errors?|skipped|deselected)|no tests ran)\b.* in [0-9.]+s")
#: lines of a failed shard's output printed at its end
TAIL_LINES = 40
#: the shard's whole pytest output, next to its results
SHARD_LOG = "pytest.log"
#: seconds the driver waits for a cluster's port to accept a TCP connection before it gives up
PROBE_TIMEOUT_S = 5.0
#: seconds a join may take once the address's port answers (``$KVQBENCH_RAY_JOIN_TIMEOUT`` overrides): past
#: them the run stops with one line — a port that accepts connections but is not a Ray head keeps Ray's
#: native client retrying for minutes
JOIN_TIMEOUT_S = 60.0


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


def _split_host_port(text: str) -> tuple[str, int] | None:
    """``"HOST:PORT"`` (``[v6]:PORT`` too) → ``(host, port)``, or ``None`` when it is not that."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def _probe(host: str, port: int, timeout: float) -> str | None:
    """Why nothing accepts a TCP connection at ``host:port`` within ``timeout`` seconds (a phrase), or
    ``None`` when something does."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except socket.gaierror:
        return f"the host {host!r} is unknown"
    except (socket.timeout, TimeoutError):
        return f"nothing answered at {host}:{port} within {timeout:g} s"
    except ConnectionRefusedError:
        return f"nothing listens at {host}:{port} (connection refused)"
    except OSError as e:
        return f"{host}:{port} cannot be reached ({e.strerror or e})"
    return None


def _local_cluster_address() -> str | None:
    """The address ``ray.init(address="auto")`` would join (``$RAY_ADDRESS``, else the cluster that
    ``ray start`` last started on this machine, else a running one found there), or ``None`` when there is
    none. Uses Ray's own lookup (``ray._private.services``); where that is missing, ``$RAY_ADDRESS`` only."""
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return env
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:
        return None
    try:
        return canonicalize_bootstrap_address("auto")
    except (ConnectionError, ValueError):
        return None


def join_problem(address: str, *, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """What stands in the way of joining the Ray cluster at ``address`` (``auto``, ``HOST:PORT`` or
    ``ray://HOST:PORT``), as one line that says what to do, or ``None`` when its port answers.

    Checks, in this order: that ``ray://`` has Ray Client installed (``grpcio``, from ``ray[client]``);
    that ``auto`` finds a cluster on this machine; that the address is ``HOST:PORT``; that its port
    accepts a TCP connection within ``timeout`` seconds. Needs Ray installed (for ``auto``)."""
    what = f"kvqbench run --ray {address}"
    target = address
    if address == "auto":
        found = _local_cluster_address()
        if not found:
            return (f"{what}: no Ray cluster runs on this machine: start one (`ray start --head`), give a cluster's "
                    "address (HOST:6379 or ray://HOST:10001), or use --ray alone for a local Ray instance")
        target = found
    client = target.startswith("ray://")
    if client and importlib.util.find_spec("grpc") is None:
        return (f"{what}: a ray:// address needs Ray Client: pip install 'ray[client]' "
                "(or the dist extra: pip install -e '.[dist]')")
    hostport = _split_host_port(target[len("ray://"):] if client else target)
    if hostport is None:
        return f"{what}: {target!r} is not HOST:PORT (e.g. head:6379, ray://head:10001 or auto)"
    why = _probe(*hostport, timeout)
    if why:
        server = "the head's Ray Client server (`ray start --head` starts it on port 10001)" if client else \
            f"the cluster's head (`ray start --head --port {hostport[1]}`)"
        return f"{what}: {why}: is {server} running there, and the address right?"
    return None


@contextlib.contextmanager
def _joining() -> Iterator[None]:
    """The block that joins a cluster: Ctrl-C (SIGINT) and SIGTERM end the process at once (their default
    action; Ray's connection retries run in native code that does not return to Python for a handler to
    run), and what is written to stderr (file descriptor 2: Ray's native client logs each failed attempt)
    is held back — replayed after a join that succeeds, dropped after one that fails (its one line says
    why). Handlers and stderr are restored after it; handlers are left alone outside the main thread."""
    main = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    sys.stderr.flush()
    saved = os.dup(2)
    held = tempfile.TemporaryFile()
    os.dup2(held.fileno(), 2)
    joined = False
    try:
        yield
        joined = True
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if joined:
            held.seek(0)
            sys.stderr.buffer.write(held.read())
            sys.stderr.flush()
        held.close()
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _join_timeout() -> float:
    try:
        return max(0.1, float(os.environ.get("KVQBENCH_RAY_JOIN_TIMEOUT", JOIN_TIMEOUT_S)))
    except ValueError:
        return JOIN_TIMEOUT_S


def _give_up(address: str, log: Callable[[str], None]) -> None:
    """The join took longer than :func:`_join_timeout`: one line, exit 2 (Ray's retries run in native code
    that a Python exception would not stop)."""
    log(f"kvqbench run --ray {address}: the port answers but no Ray cluster joined within {_join_timeout():g} s: "
        "is the address a Ray head's GCS port (`ray start --head`, default 6379) or, with ray://, its Ray "
        "Client server (10001)?")
    sys.stdout.flush()
    os._exit(2)


def _refusal(address: str, e: BaseException) -> str:
    """One line for a join that ``ray.init`` refused with ``e``."""
    chain, cur = [], e
    while cur is not None and len(chain) < 10:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    what = f"kvqbench run --ray {address}"
    token = "RAY_AUTH_MODE=token, with the cluster's token in ~/.ray/auth_token, $RAY_AUTH_TOKEN_PATH or $RAY_AUTH_TOKEN"
    if any(type(x).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(x) for x in chain):
        return f"{what}: the cluster uses Ray's token authentication: set {token}"
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    hint = ""
    if address.startswith("ray://") and os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        hint = f"; a cluster with token authentication (Ray's default for `ray start`) needs {token}"
    return f"{what}: Ray could not join the cluster ({type(e).__name__}: {first}){hint}"


def node_capture_cache() -> str:
    """The capture cache a shard task uses when the run names none: the user's own cache folder on the
    node (:func:`kvqbench.privdir.user_cache_dir` ``("capture")``, shared by the shards there), else a
    folder of this process (:func:`kvqbench.privdir.fallback_dir`, with one line saying why)."""
    from kvqbench import privdir

    try:
        return str(privdir.user_cache_dir("capture"))
    except OSError as e:  # UnsafePathError included: another user could write it
        folder = privdir.fallback_dir("capture")
        print(f"kvqbench ray: capture cache in {folder} for this task only ({e})", flush=True)
        return str(folder)


def shard_task(index: int, count: int, pytest_args: list[str], cwd: str | None) -> dict[str, Any]:
    """Run shard ``index`` of ``count`` as ``python -m pytest`` in a fresh process and return its files.

    Runs inside a Ray task (it is plain Python, so it can be called directly too). Returns ``{"index",
    "rc" (pytest's exit code), "files" (name → bytes of the shard folder), "seconds", "node"}``."""
    t0 = time.time()
    out = tempfile.mkdtemp(prefix=f"kvqbench-shard-{index}-of-{count}-")
    args = list(pytest_args)
    if not any(a == "--kvq-capture-cache" or a.startswith("--kvq-capture-cache=") for a in args):
        args += ["--kvq-capture-cache", node_capture_cache()]
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
               rootdir: Path, figures: bool = True, log: Callable[[str], None] | None = None,
               banner: str | None = None) -> int:
    """Run ``pytest_args`` as ``shards`` Ray tasks and merge them into ``out_dir``.

    Args:
        pytest_args: the run's pytest arguments (without ``-n``, ``--kvq-shard``, ``--kvq-out``).
        address: ``None`` for a local Ray instance, else a Ray address to join.
        shards: number of shards (default: the cluster's GPUs with ``cuda``, else its CPUs).
        cuda: one GPU per task (else one CPU).
        out_dir: where the merged result set goes; shard folders go to ``out_dir/shards/``.
        rootdir: the checkout (tasks run there; shipped to a remote cluster).
        banner: a line logged once Ray has started or joined the cluster (what runs, where results go).

    Returns an exit code: 2 when Ray is missing, the cluster cannot be joined (one line saying what to do,
    see :func:`join_problem`) or has no GPU for ``cuda``; 130 when interrupted (Ctrl-C) while the shards
    run; else the worst of the shards' pytest exit codes and the merge's (0 complete, 1 incomplete).
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
        log("kvqbench run --ray needs Ray: pip install -e '.[dist]' (or pip install 'ray[client]>=2.9')")
        return 2
    from kvqbench.results.merge import MergeError, merge_shards
    from kvqbench.shard import shard_dir_name

    # ERROR: Ray's own start-up notes (token set-up, "started a local instance") are replaced by ours
    init: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "logging_level": logging.ERROR}
    if address:
        problem = join_problem(address)
        if problem:
            log(problem)
            return 2
        init["address"] = address
        init["runtime_env"] = {"working_dir": str(rootdir), "excludes": SHIP_EXCLUDES}
    t0 = time.time()
    try:
        with _joining() if address else contextlib.nullcontext():
            watchdog = None
            if address:
                watchdog = threading.Timer(_join_timeout(), _give_up, args=(address, log))
                watchdog.daemon = True
                watchdog.start()
            try:
                ray.init(**init)
            finally:
                if watchdog is not None:
                    watchdog.cancel()
    except Exception as e:  # a join Ray refuses (ConnectionError, RuntimeError, its AuthenticationError …)
        if not address:
            raise
        log(_refusal(address, e))
        return 2
    if banner:
        log(banner)
    rcs: list[int] = []
    folders: list[Path] = []
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
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)  # back in Python: Ctrl-C works
            if not ready:
                continue
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
    except KeyboardInterrupt:  # Ctrl-C while the shards run: one line, no traceback
        log(f"kvqbench ray: interrupted; {len(folders)} finished shard folder(s) in {out_dir / 'shards'}, "
            "nothing merged")
        return 130
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
