"""``kvqbench run``: from the command line to pytest — the plugin's options shown in ``--help`` and checked
before pytest starts, the long tier's defaults, the environment the xdist workers inherit, the Ray launcher,
and an output stream that survives a closed pipe. :func:`run` is what ``kvqbench run`` calls."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator

__all__ = ["run", "plugin_options", "plugin_options_help", "check_plugin_options", "steady_allocator_for_workers",
           "UntilReaderGone", "LONG_SEEDS"]


class _OptionRecorder:
    """Stands in for pytest's ``Parser``/``OptionGroup``: records every ``addoption`` call so the
    plugin's own option definitions can be shown in ``kvqbench run --help`` (one source, no drift)."""

    def __init__(self) -> None:
        self.options: list[tuple[tuple[str, ...], dict]] = []

    def getgroup(self, *args: object, **kwargs: object) -> _OptionRecorder:
        return self

    def addoption(self, *names: str, **kwargs: object) -> None:
        self.options.append((names, dict(kwargs)))

    def addini(self, *args: object, **kwargs: object) -> None:  # ini values are not command-line options
        return None


def plugin_options() -> list[tuple[tuple[str, ...], dict]]:
    """Every command-line option the kvqbench pytest plugin defines, as ``(flags, addoption kwargs)``,
    read by running each plugin module's ``pytest_addoption``, in registration order, against a recorder
    (imports pytest, not torch)."""
    from kvqbench.plugin import MODULES

    rec = _OptionRecorder()
    for mod in MODULES:
        addoption = getattr(mod, "pytest_addoption", None)
        if addoption is not None:
            addoption(rec)  # type: ignore[arg-type]
    return rec.options


def plugin_options_help() -> str:
    """The ``kvqbench (pytest plugin) options`` section of ``kvqbench run --help``: each option with
    its help text and its default, formatted by argparse from the plugin's definitions."""
    helper = argparse.ArgumentParser(prog="kvqbench run", add_help=False,
                                     formatter_class=argparse.HelpFormatter)
    group = helper.add_argument_group("kvqbench options (passed to pytest; defaults shown)")
    for names, kw in plugin_options():
        kw = {k: v for k, v in kw.items() if k in ("action", "default", "metavar", "help", "choices", "nargs")}
        default = kw.get("default")
        shown = "off" if kw.get("action") == "store_true" else ("none" if default is None else str(default))
        text = str(kw.get("help") or "").replace("%", "%%")
        if "(default" not in text:
            text += f" (default {shown})"
        kw["help"] = text
        group.add_argument(*names, **kw)
    body = helper.format_help().split("\n\n", 1)[-1]  # drop the usage line
    return (body + "\nAny other pytest option works too (pytest --help). Selecting: -k kivi (a method id), "
            "-k reconstruction (an experiment's test name); a selection that matches no cell lists both.")


def check_plugin_options(extra: list[str]) -> str | None:
    """The first error in the kvqbench plugin options among ``extra`` (``kvqbench run``'s pytest arguments),
    as one line, or ``None``: each option parsed with the plugin's own definition (its type and choices), so
    a bad value stops the run before pytest starts, with one line and exit status 2 like the other usage
    errors of ``kvqbench run`` (pytest's parser would print its usage and ini lines and exit 4). Other
    arguments are left to pytest."""
    parser = argparse.ArgumentParser(prog="kvqbench run", add_help=False, exit_on_error=False, allow_abbrev=False)
    for names, kw in plugin_options():
        parser.add_argument(*names, **{k: v for k, v in kw.items()
                                       if k in ("action", "default", "metavar", "choices", "nargs", "type")})
    try:
        parser.parse_known_args(extra)
    except argparse.ArgumentError as e:
        return str(e)
    return None


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """``kvqbench run`` with its parsed ``args`` and the arguments meant for pytest (``extra``); the exit status."""
    bad = check_plugin_options(extra)
    if bad:
        print(f"kvqbench run: {bad}", file=sys.stderr)
        return 2
    tests = Path(args.tests)
    if not tests.exists():
        print(f"kvqbench run: {tests}/ not found — run from the kvqbench repository root, or pass --tests DIR",
              file=sys.stderr)
        return 2
    cmd = [str(tests), "-m", "smoke" if args.smoke else "long" if args.long else "full"]
    if args.long:
        if args.no_real:
            print("kvqbench run --long: the long tier runs on the real model only (long decodes and passkey "
                  "retrieval need its text and attention); drop --no-real", file=sys.stderr)
            return 2
        problem = _long_tier_problem(extra)
        if problem:
            print(f"kvqbench run --long: {problem}", file=sys.stderr)
            return 2
        extra = _long_tier_defaults(extra)
    if not args.no_real and not args.smoke and "--kvq-real" not in extra:  # --smoke: synthetic unless asked
        cmd.append("--kvq-real")
    if args.shard is not None or args.ray is not None or args.shards is not None:
        from kvqbench.shard import parse_shard

        try:
            if args.shard is not None:
                parse_shard(args.shard)
                if args.ray is not None:
                    raise ValueError("--shard and --ray exclude each other (--ray runs every shard)")
            if args.shards is not None and (args.ray is None or args.shards < 1):
                raise ValueError("--shards N needs --ray and N >= 1")
        except ValueError as e:
            print(f"kvqbench run: {str(e).replace('--kvq-shard', '--shard')}", file=sys.stderr)
            return 2
    if args.smoke and not any(a in ("--benchmark-quiet", "--benchmark-verbose") for a in extra):
        # smoke cells' timings are a quick look, not a measurement: no wide pytest-benchmark table at the
        # end (its JSON is still written beside the results; --benchmark-verbose brings the table back)
        cmd.append("--benchmark-quiet")
    if args.ray is not None:
        return _run_ray(args, cmd, extra)
    if args.shard is not None:
        cmd += ["--kvq-shard", args.shard]
    if not args.smoke and not any(a == "-n" or a.startswith("-n") or a.startswith("--numprocesses") for a in extra):
        # one torch thread per worker (see --kvq-threads); xdist uses the cores. Smoke runs serially: its
        # cells take seconds in all, less than starting workers that each import torch and collect
        cmd += ["-n", "auto"]
    cmd += extra
    steady_allocator_for_workers(os.environ)
    out = UntilReaderGone(sys.stdout)
    with _stdout_as(out), _sigterm_as_interrupt():
        print("kvqbench run: pytest " + shlex.join(cmd), flush=True)
        rc = _pytest_main(cmd)
        out.flush()
    if out.gone:  # pytest's output capture gave the descriptor back: the pipe again
        out.to_devnull()
    return rc


@contextlib.contextmanager
def _stdout_as(stream) -> Iterator[None]:
    """``sys.stdout`` is ``stream`` inside the block."""
    saved, sys.stdout = sys.stdout, stream
    try:
        yield
    finally:
        sys.stdout = saved


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (``kill``, a job scheduler's time limit) ends the block as Ctrl-C does: a ``KeyboardInterrupt``
    in the main thread, so pytest stops the cells and the run writes what finished as an incomplete set,
    stamped "interrupted". Only in the main thread (elsewhere signal handlers cannot be set); the
    previous handler is restored after the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: the long tier's seeds when ``--kvq-seeds`` is not given
LONG_SEEDS = "4"


def _option_value(extra: list[str], name: str) -> str | None:
    """The value of ``name`` among pytest arguments (``--name V`` or ``--name=V``; the last one wins)."""
    value = None
    for i, a in enumerate(extra):
        if a == name and i + 1 < len(extra):
            value = extra[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _long_tier_defaults(extra: list[str]) -> list[str]:
    """``extra`` with the long tier's results folder (``results/long``) and seeds (:data:`LONG_SEEDS`)
    where not given."""
    out = list(extra)
    if _option_value(out, "--kvq-out") is None:
        out += ["--kvq-out", "results/long"]
    if _option_value(out, "--kvq-seeds") is None:
        out += ["--kvq-seeds", LONG_SEEDS]
    return out


def _long_tier_problem(extra: list[str]) -> str | None:
    """One line when the model of ``--kvq-model`` (default smollm2) has a shorter context than the long
    tier's cells need, or cannot be read; ``None`` otherwise."""
    from kvqbench.experiments.longtext import CONFIG_BY_SIZE, check_context

    model = _option_value(extra, "--kvq-model") or "smollm2"
    try:
        check_context(model, CONFIG_BY_SIZE["long"].context)
    except (ImportError, OSError, ValueError) as e:
        return f"--kvq-model {model}: {e}"
    return None


def _pytest_main(cmd: list[str]) -> int:
    """``pytest.main(cmd)``, with usage errors headed ``kvqbench run`` rather than ``pytest.main()`` (pytest's
    internal ``_main`` takes the program name; ``pytest.main`` where that entry point is missing)."""
    import inspect

    import pytest

    try:
        from _pytest.config import _main
    except ImportError:
        _main = None
    if _main is not None and {"args", "prog"} <= set(inspect.signature(_main).parameters):
        return int(_main(args=cmd, prog="kvqbench run"))
    return int(pytest.main(cmd))


def steady_allocator_for_workers(environ: "os._Environ[str] | dict[str, str]") -> None:
    """Add glibc's steady-allocator tunables (:data:`kvqbench.perf.STEADY_TUNABLES`, the ones ``kvqbench
    perf`` times with) to ``environ["GLIBC_TUNABLES"]``, keeping (and letting win) any tunable already set.

    ``kvqbench run`` calls it before pytest starts, so the pytest-xdist workers it spawns (they inherit the
    environment) take every tensor buffer from the heap and keep freed memory instead of mapping each large
    buffer afresh and faulting its pages in again on every call (the cells' temporaries of a few MiB: exp2's
    attention rows, exp1/exp3's fp64 copies). The arithmetic is unchanged (torch
    aligns its buffers either way), so are the metrics. The process that calls it is not affected (glibc
    reads tunables at start), nor is anything off glibc (the variable is ignored there)."""
    from kvqbench.perf import CHILD_MARK, steady_env

    env = steady_env({k: v for k, v in environ.items() if k != CHILD_MARK})
    if env is not None:
        environ["GLIBC_TUNABLES"] = env["GLIBC_TUNABLES"]


def _run_ray(args: argparse.Namespace, cmd: list[str], extra: list[str]) -> int:
    """``kvqbench run --ray``: shards as Ray tasks (see :mod:`kvqbench.dist`)."""
    from kvqbench.dist import run_on_ray, strip_option

    rest, out = strip_option(extra, "--kvq-out")
    for opt in ("-n", "--numprocesses"):  # one CPU or GPU per shard: each shard runs serially
        rest, _ = strip_option(rest, opt)
    rest = [a for a in rest if not (a.startswith("-n") and a[2:].isdigit() or a in ("-nauto", "-nlogical"))]
    rest, device = strip_option(rest, "--device")
    cuda = bool(device and device.startswith("cuda"))
    if device:
        rest += ["--device", "cuda" if cuda else device]  # a task sees only its own GPU: cuda:0
    out_dir = Path(out) if out else Path("results/smoke" if args.smoke else "results")
    _, fig = strip_option(rest, "--kvq-figures")  # the merge draws like one session would (auto: not for smoke)
    figures = fig == "on" or (fig != "off" and not args.smoke)
    return run_on_ray([*cmd, *rest, "-n", "0"], address=args.ray or None, shards=args.shards, cuda=cuda,
                      out_dir=out_dir.resolve(), rootdir=Path.cwd(), figures=figures,
                      banner=f"kvqbench run --ray: pytest {shlex.join([*cmd, *rest])} in shards -> {out_dir}")


class UntilReaderGone:
    """A text stream that writes to ``stream`` until its reader closes the pipe (``kvqbench compare … |
    head``, ``kvqbench run … | head``), then discards the rest, so the command ends without a traceback and
    with its own verdict (a run still writes its results). Anything else (``fileno``, ``isatty``,
    ``encoding`` …) is the stream's."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.gone = False

    def __getattr__(self, name: str):
        return getattr(self.stream, name)

    def _reader_gone(self) -> None:
        self.gone = True
        self.to_devnull()

    def to_devnull(self) -> None:
        """Point the stream's file descriptor at /dev/null: what the stream (or a copy of it) still buffers
        goes there when the interpreter flushes it at exit."""
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                self.stream.write(text)
            except BrokenPipeError:
                self._reader_gone()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._reader_gone()
