"""`kvqbench perf`: its eager-RTN reference against the library's grouped RTN, the ratios it reports,
the JSON it writes, and clear errors. Tiny sizes: this checks the command, not the timings."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvqbench.cli import main
from kvqbench.numerics.rtn import PerToken, rtn_roundtrip
from kvqbench.perf import (
    CHILD_MARK,
    PROCESS_MARK,
    STEADY_TUNABLES,
    add_arguments,
    cold_copies,
    cpu_model,
    eager_rtn_roundtrip,
    format_report,
    is_glibc_linux,
    last_level_cache_bytes,
    merge_processes,
    rerun_command,
    run_perf,
    steady_env,
)
from kvqbench.perf.timing import _Rotation

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("bits", [2, 4])
def test_eager_rtn_equals_grouped_rtn(bits: int) -> None:
    # two implementations of per-token RTN in groups of 64 channels: same arithmetic, same bits
    x = torch.randn(1, 2, 33, 128, generator=torch.Generator().manual_seed(bits))
    assert torch.equal(eager_rtn_roundtrip(x, bits), rtn_roundtrip(x, bits, PerToken(64)))


def test_ratios_are_medians_over_the_baselines() -> None:
    res = run_perf(["fp16", "rtn_token"], tokens=[32, 64], threads=["1"], repeats=2, peers=False)
    rows = res["rows"]
    clone = {r["tokens"]: r for r in rows if r["candidate"] == "clone"}
    rtn = {r["tokens"]: r for r in rows if r["candidate"] == "eager_rtn"}
    assert {(r["candidate"], r["kind"]) for r in rows if r["tokens"] == 32} == {
        ("clone", None), ("eager_rtn", None), ("fp16", "k"), ("fp16", "v"), ("rtn_token", "k"), ("rtn_token", "v")}
    for r in rows:
        assert len(r["all_ms"]) == 2 and r["min_ms"] <= r["median_ms"]
        assert math.isclose(r["x_clone"], r["median_ms"] / clone[r["tokens"]]["median_ms"])
        assert math.isclose(r["x_eager_rtn"], r["median_ms"] / rtn[r["tokens"]]["median_ms"])
        assert r["x_hqq_rtn"] is None
    assert all(clone[t]["x_clone"] == 1.0 for t in clone)
    sc = {(s["candidate"], s["kind"]): s for s in res["scaling"]}
    s = sc[("rtn_token", "k")]
    want = [r for r in rows if r["candidate"] == "rtn_token" and r["kind"] == "k"]
    by_t = {r["tokens"]: r["median_ms"] for r in want}
    assert s["token_ratio"] == 2 and math.isclose(s["time_ratio"], by_t[64] / by_t[32])
    mins = {r["tokens"]: r["min_ms"] for r in want}
    assert math.isclose(s["min_time_ratio"], mins[64] / mins[32])
    cpus = {r["tokens"]: r["median_cpu_ms"] for r in want}
    assert math.isclose(s["cpu_time_ratio"], cpus[64] / cpus[32])
    for r in rows:
        assert len(r["all_cpu_ms"]) == 2 and r["median_cpu_ms"] == statistics.median(r["all_cpu_ms"])
        assert math.isclose(r["x_eager_rtn_cpu"], r["median_cpu_ms"] / rtn[r["tokens"]]["median_cpu_ms"])
    text = format_report(res)
    assert "rtn_token" in text and "×clone" in text and "32→64" in text


def test_cli_writes_json(tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # the default (steady allocator) re-runs the command once in a child with the glibc tunables set; the
    # child's own probe (a 64 MiB malloc served from the heap, not a fresh mapping) says whether they took
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(CHILD_MARK, raising=False)
    out = tmp_path / "perf.json"
    rc = main(["perf", "--methods", "kivi", "--tokens", "32", "--threads", "1", "--repeats", "1", "--no-peers",
               "--processes", "1", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["methods"] == ["kivi"] and doc["config"]["tokens"] == [32]
    assert {r["candidate"] for r in doc["rows"]} == {"clone", "eager_rtn", "kivi"}
    printed = capfd.readouterr().out
    assert "kivi" in printed
    # the CPU model, as lscpu (or /proc/cpuinfo) names it, in the JSON and in the printed report
    assert doc["environment"]["cpu_model"] == cpu_model()
    assert f"CPU model: {doc['environment']['cpu_model'] or 'unknown'}" in printed.splitlines()
    if is_glibc_linux():
        assert doc["environment"]["allocator"] == "steady"
        tun = dict(kv.split("=") for kv in doc["environment"]["glibc_tunables"].split(":"))
        assert tun == STEADY_TUNABLES


def test_allocator_default_runs_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(CHILD_MARK, raising=False)
    args = ["perf", "--methods", "fp16", "--tokens", "16", "--threads", "1", "--repeats", "1", "--no-peers",
            "--allocator", "default", "--cache", "warm", "--processes", "1"]
    from kvqbench.cli import build_parser

    assert rerun_command(build_parser().parse_args(args), args) is None
    out = tmp_path / "perf.json"
    assert main([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    # this process was started without the tunables: glibc maps a 64 MiB buffer afresh
    assert doc["environment"]["glibc_tunables"] is None
    if is_glibc_linux():
        assert doc["environment"]["allocator"] == "default"
    assert doc["config"]["cache"] == "warm" and doc["config"]["input_copies"] == {"16": 1}


def test_steady_env_is_built_right() -> None:
    want = ":".join(f"{k}={v}" for k, v in STEADY_TUNABLES.items())
    env = steady_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": want, CHILD_MARK: "1"}
    # the user's own tunables are kept (and win over ours)
    user = "glibc.malloc.arena_max=2:glibc.malloc.trim_threshold=7"
    env = steady_env({"GLIBC_TUNABLES": user})
    assert env is not None
    assert env["GLIBC_TUNABLES"] == f"{user}:glibc.malloc.mmap_threshold={STEADY_TUNABLES['glibc.malloc.mmap_threshold']}"
    # nothing to do: both thresholds set already, or this process is the re-run
    assert steady_env({"GLIBC_TUNABLES": want}) is None
    assert steady_env({CHILD_MARK: "1"}) is None


def test_rerun_command_only_for_steady_cpu() -> None:
    from kvqbench.cli import build_parser

    parse = build_parser().parse_args
    base = ["perf", "--tokens", "16"]
    assert rerun_command(parse([*base, "--allocator", "default"]), base, {}) is None
    assert rerun_command(parse([*base, "--device", "cuda"]), base, {}) is None
    assert rerun_command(parse(base), None, {}) is None  # nothing to repeat
    got = rerun_command(parse(base), base, {"HOME": "/h"})
    if not is_glibc_linux():
        assert got is None
        return
    assert got is not None
    cmd, env = got
    assert cmd[0] == sys.executable and cmd[-3:] == base
    assert env["HOME"] == "/h" and env[CHILD_MARK] == "1" and "glibc.malloc.mmap_threshold=" in env["GLIBC_TUNABLES"]


def test_last_level_cache_from_sysfs(tmp_path: Path) -> None:
    for idx, level, kind, size in [(0, 1, "Data", "48K"), (1, 1, "Instruction", "64K"), (2, 2, "Unified", "2048K"),
                                   (3, 3, "Unified", "491520K")]:
        d = tmp_path / f"index{idx}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(tmp_path) == 491520 * 1024
    assert last_level_cache_bytes(tmp_path / "absent") is None


def test_cold_copies_exceed_the_cache() -> None:
    mib = 1 << 20
    assert cold_copies(16 * mib, 480 * mib) == 31  # 30 copies fill the cache, one more exceeds it
    assert cold_copies(64 * mib, 480 * mib) == 9
    assert cold_copies(64 * mib, 0) == 2  # always at least two
    assert cold_copies(64 * mib, 480 * mib, max_bytes=200 * mib) == 3  # memory cap
    assert cold_copies(64 * mib, 480 * mib, max_bytes=mib) == 1
    with pytest.raises(ValueError):
        cold_copies(0, mib)


def test_rotation_cycles_through_distinct_copies() -> None:
    x = torch.arange(6.0)
    rot = _Rotation(x, 3)
    got = [rot.next() for _ in range(7)]
    assert got[0] is x and got[3] is x and got[6] is x
    assert len({t.data_ptr() for t in got[:3]}) == 3 and all(torch.equal(t, x) for t in got)


def test_cold_inputs_recorded_and_bad_cache_rejected() -> None:
    res = run_perf(["fp16"], tokens=[8], threads=["1"], repeats=1, peers=False, cache="cold")
    cache = res["environment"]["cache_bytes"]
    assert res["config"]["input_copies"] == {8: cold_copies(8 * 8 * 128 * 4, cache if cache else 64 << 20)}
    with pytest.raises(ValueError, match="cache"):
        run_perf(["fp16"], tokens=[8], threads=["1"], repeats=1, peers=False, cache="hot")


@pytest.mark.parametrize(("args", "msg"), [
    (["--methods", "nope"], "unknown method id"),
    (["--device", "cuda"], "CUDA is not available"),
])
def test_cli_errors_are_one_line(args: list[str], msg: str, capfd: pytest.CaptureFixture[str]) -> None:
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    rc = main(["perf", "--tokens", "32", "--threads", "1", "--repeats", "1", "--allocator", "default", *args])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2 and err and err[-1].startswith("kvqbench perf: ") and msg in err[-1]


def test_gpu_check_fails_clearly_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the script would run the real check")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "/nonexistent/out"], cwd=REPO,
                          capture_output=True, text=True, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("gpu_check: CUDA is not available")
    assert proc.stdout == ""


def _fake_result(scale: float, eager: float) -> dict:
    """A :func:`run_perf`-shaped result of one process: clone 1 ms, eager RTN ``eager`` ms, kivi K/V ``scale``·2
    and ``scale``·3 ms, at T = 32 and 64 (twice the time)."""
    rows = []
    for t, f in ((32, 1.0), (64, 2.0)):
        base = {"clone": 1.0 * f, "eager_rtn": eager * f}
        for cand, kind, ms in (("clone", None, 1.0), ("eager_rtn", None, eager), ("kivi", "k", 2 * scale),
                               ("kivi", "v", 3 * scale)):
            ms *= f
            row = {"threads": 1, "tokens": t, "candidate": cand, "kind": kind, "median_ms": ms, "min_ms": ms * 0.9,
                   "all_ms": [ms * 0.9, ms, ms * 1.1], "peak_bytes": int(ms), "median_cpu_ms": ms,
                   "all_cpu_ms": [ms], "x_clone": ms / base["clone"], "x_eager_rtn": ms / base["eager_rtn"],
                   "x_clone_cpu": ms / base["clone"], "x_eager_rtn_cpu": ms / base["eager_rtn"],
                   "x_hqq_rtn": None, "x_hqq_rtn_cpu": None}
            if cand == "clone":
                row["bandwidth_gbps"] = 10.0 / ms
            rows.append(row)
    scaling = [{"threads": 1, "candidate": c, "kind": k, "from_tokens": 32, "to_tokens": 64, "time_ratio": 2.0 * scale,
                "min_time_ratio": 2.0, "cpu_time_ratio": 2.0 * scale, "token_ratio": 2.0}
               for c, k in (("clone", None), ("eager_rtn", None), ("kivi", "k"), ("kivi", "v"))]
    cfg = {"methods": ["kivi"], "tokens": [32, 64], "threads": [1], "repeats": 3, "input_copies": {"32": 9},
           "shape": [1, 8, "T", 128], "bits": 2}
    return {"config": cfg, "environment": {"device": "cpu"}, "rows": rows, "scaling": scaling}


def test_merge_processes_takes_medians_of_each_process() -> None:
    # three processes: the eager RTN 4, 5 and 8 ms (a process-wide placement effect), kivi 1×, 1.5×, 1.2× slower
    res = merge_processes([_fake_result(1.0, 4.0), _fake_result(1.5, 5.0), _fake_result(1.2, 8.0)])
    assert res["config"]["processes"] == 3 and res["config"]["repeats"] == 3
    by = {(r["tokens"], r["candidate"], r["kind"]): r for r in res["rows"]}
    k = by[(32, "kivi", "k")]
    assert k["median_ms"] == statistics.median([2.0, 3.0, 2.4])
    # the ratio is the median of each process's own ratio (2/4, 3/5, 2.4/8), not a ratio of medians
    assert k["x_eager_rtn"] == statistics.median([2 / 4, 3 / 5, 2.4 / 8]) == 0.5
    assert k["x_eager_rtn_cpu"] == 0.5 and k["x_hqq_rtn"] is None
    assert k["per_process"]["x_eager_rtn"] == [2 / 4, 3 / 5, 2.4 / 8]
    assert k["min_ms"] == 2.0 * 0.9 and len(k["all_ms"]) == 9 and k["peak_bytes"] == 3
    assert by[(64, "clone", None)]["bandwidth_gbps"] == 5.0
    sc = {(s["candidate"], s["kind"]): s for s in res["scaling"]}
    assert sc[("kivi", "v")]["time_ratio"] == statistics.median([2.0, 3.0, 2.4])
    assert "median over 3 processes of medians of 3 interleaved rounds" in format_report(
        {**res, "environment": {"device": "cpu", "torch": "x", "cpu_count": 2, "default_threads": 2, "timer": "t",
                                "hqq": None}})
    with pytest.raises(ValueError, match="configuration"):
        other = _fake_result(1.0, 4.0)
        other["config"]["repeats"] = 5
        merge_processes([_fake_result(1.0, 4.0), other])
    with pytest.raises(ValueError, match="no results"):
        merge_processes([])


def test_cli_in_two_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(CHILD_MARK, raising=False)
    out = tmp_path / "perf.json"
    assert main(["perf", "--methods", "fp16", "--tokens", "16", "--threads", "1", "--repeats", "2", "--no-peers",
                 "--processes", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["processes"] == 2 and doc["config"]["repeats"] == 2
    for r in doc["rows"]:
        assert len(r["all_ms"]) == 4 and len(r["per_process"]["median_ms"]) == 2
        assert r["median_ms"] == statistics.median(r["per_process"]["median_ms"])
    if is_glibc_linux():  # each process ran with the steady allocator
        assert doc["environment"]["allocator"] == "steady"


@pytest.mark.parametrize(("args", "msg"), [
    (["--methods", "nope"], "unknown method id"),
    (["--bits", "12"], "1..8 bits"),
    (["--device", "gpu"], "unknown device 'gpu'"),
    (["--json", "/dev/null/sub/p.json"], "/dev/null is a file, not a folder"),
    (["--json", "."], "is a folder"),
])
def test_cli_errors_with_several_processes_are_one_line_before_any_process(
        args: list[str], msg: str, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROCESS_MARK, raising=False)
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail("a process was started"))
    rc = main(["perf", "--tokens", "32", "--threads", "1", "--repeats", "1", "--processes", "3", *args])
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvqbench perf: ") and msg in err[0]


def test_an_interrupt_reports_the_processes_that_finished(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROCESS_MARK, raising=False)
    calls = []

    def call(cmd, **kw):  # the first process finishes (writes its JSON), Ctrl-C during the second
        calls.append(cmd)
        if len(calls) == 2:
            raise KeyboardInterrupt
        res = _fake_result(1.0, 4.0)
        res["environment"] = {"device": "cpu", "torch": "x", "cpu_count": 2, "default_threads": 2, "timer": "t",
                              "hqq": None}
        Path(cmd[len(cmd) - cmd[::-1].index("--json")]).write_text(json.dumps(res))  # the last --json
        return 0

    monkeypatch.setattr(subprocess, "call", call)
    out = tmp_path / "p.json"
    rc = main(["perf", "--methods", "kivi", "--tokens", "32", "--threads", "1", "--repeats", "1", "--processes", "3",
               "--no-peers", "--json", str(out)])
    cap = capfd.readouterr()
    assert rc == 130 and len(calls) == 2
    assert "interrupted; the 1 finished process(es) of 3" in cap.err
    assert "kivi" in cap.out and json.loads(out.read_text())["config"]["processes"] == 1


LSCPU = """Architecture:                            x86_64
CPU(s):                                  2
Vendor ID:                               AuthenticAMD
Model name:                              AMD EPYC 9654 96-Core Processor
BIOS Model name:                         pc-q35-8.2
"""


def test_cpu_model_from_lscpu_then_cpuinfo_then_platform(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import platform

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Gold 6338\n\n"
                    "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Gold 6338\n")
    assert cpu_model(LSCPU, info) == "AMD EPYC 9654 96-Core Processor"  # lscpu first; "BIOS Model name" is not it
    assert cpu_model("Architecture: aarch64\n", info) == "Intel(R) Xeon(R) Gold 6338"  # no Model name line
    monkeypatch.setattr(platform, "processor", lambda: "x86_64")
    assert cpu_model("", tmp_path / "absent") == "x86_64"
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert cpu_model("", tmp_path / "absent") is None


def test_cpu_model_is_lscpus_model_name() -> None:
    """On this machine: the first "Model name:" line of ``lscpu`` itself, read here independently."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, env={"LC_ALL": "C", "PATH":
                             "/usr/bin:/bin"}).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("lscpu cannot run here")
    lines = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name:")]
    if not lines:
        pytest.skip("lscpu names no model here")
    assert cpu_model() == lines[0]


def test_help_names_no_fused_path_and_no_timings() -> None:
    import argparse
    import re

    p = argparse.ArgumentParser()
    add_arguments(p)
    text = p.format_help()
    assert "--fused" not in text and "torch.compile" not in text
    assert not re.search(r"\d\s*(ms|s|%)(\W|$)|~\s*\d", text), text
