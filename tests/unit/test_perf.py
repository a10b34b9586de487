"""`kvqbench perf`: its eager-RTN reference against the library's grouped RTN, the ratios it reports,
the JSON it writes, and clear errors. Tiny sizes: this checks the command, not the timings."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvqbench.cli import main
from kvqbench.numerics.rtn import PerToken, rtn_roundtrip
from kvqbench.perf import eager_rtn_roundtrip, format_report, run_perf

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
    text = format_report(res)
    assert "rtn_token" in text and "×clone" in text and "32→64" in text


def test_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "perf.json"
    rc = main(["perf", "--methods", "kivi", "--tokens", "32", "--threads", "1", "--repeats", "1", "--no-peers",
               "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["methods"] == ["kivi"] and doc["config"]["tokens"] == [32]
    assert {r["candidate"] for r in doc["rows"]} == {"clone", "eager_rtn", "kivi"}
    assert "kivi" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "msg"), [
    (["--methods", "nope"], "unknown method id"),
    (["--device", "cuda"], "CUDA is not available"),
])
def test_cli_errors_are_one_line(args: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    rc = main(["perf", "--tokens", "32", "--threads", "1", "--repeats", "1", *args])
    err = capsys.readouterr().err.strip().splitlines()
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
