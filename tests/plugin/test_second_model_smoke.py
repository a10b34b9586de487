"""The second model's smoke cells in the test suite (issue: every real experiment runs on either model):
``kvqbench run --smoke --kvq-real --kvq-model gemma3-270m`` for the fp16 control and KVQuant (the method
whose pre-RoPE keys need each layer's own RoPE table) across experiments 1–6, in a subprocess.

Independent checks: the fp16 control's reconstruction error and model damage are exactly 0 (an identity:
the control leaves the cache as the model wrote it), and the results are filed under the model's own
source."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gemma_smoke_cells_run_every_experiment_and_keep_their_own_source(tmp_path):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("needs kvqbench[real]")
    from kvqbench.data.capture import registry

    try:
        registry.model_file("gemma3-270m")
    except Exception as e:  # noqa: BLE001 — not installed here: the one-line error names the packages
        pytest.skip(f"gemma3-270m not installed: {e}")
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "kvqbench.cli", "run", "--smoke", "--kvq-real", "--kvq-model",
                           "gemma3-270m", "-k", "real and (fp16 or kvquant)", "-n", "0", "--kvq-out", str(out),
                           "--kvq-figures", "off"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    src = "real-gemma3-270m"
    files = sorted(p.name for p in out.glob(f"exp*_{src}.json"))
    assert files == [f"exp{i}_{src}.json" for i in range(1, 7)], files
    assert not list(out.glob("exp*_real.json"))  # nothing filed under SmolLM2's source
    board = json.loads((out / "leaderboard.json").read_text())
    assert src in board["sources"] and "real" not in board["sources"]
    exact = {"exp1": ("k_mse", "v_mse"), "exp5": ("e2e_prefill_kl_nats", "e2e_decode_kl_nats"),
             "exp6": ("long_kl_nats", "passkey_logp_drop_nats")}
    checked = 0
    for f in files:
        for cell in json.loads((out / f).read_text())["cells"]:
            assert cell["status"] == "passed", cell["nodeid"]
            assert cell["nodeid"].endswith(f"-{src}-smoke]"), cell["nodeid"]
            if cell["method"] == "fp16":
                for name in exact.get(cell["experiment"], ()):
                    if name in cell["metrics"]:
                        assert cell["metrics"][name] == 0.0, (cell["nodeid"], name)
                        checked += 1
    assert checked >= 5
