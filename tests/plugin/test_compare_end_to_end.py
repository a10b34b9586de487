"""``kvqbench compare`` on real benchmark runs: an unchanged rerun of one method passes when the comparison
is narrowed to it and fails the gate when it is not (it lacks the other method), a method variant whose
bits are lowered (KIVI quantizing at one bit less than its cells ask) fails the threshold."""

import pytest

# torch (and numpy) imported before any in-process pytester run: pytester drops the modules first
# imported inside a run, and neither can be imported twice in one process
import torch  # noqa: F401

from kvqbench.cli import main as cli_main

pytest_plugins = ["pytester"]

CELL_TEST = '''
import pytest
from kvqbench.experiments.reconstruction import run_reconstruction

pytestmark = pytest.mark.kvq(experiment="exp1")

def test_reconstruction(cell, kvq_method, kvq_data, kvq_record):
    kvq_record(run_reconstruction(kvq_method, kvq_data))
'''

DEGRADE = '''
import kvqbench.quantizers.kivi as kivi_mod

_orig = kivi_mod.KIVI.__init__

def _lowered(self, k_bits=2, v_bits=None, **kw):
    v_bits = k_bits if v_bits is None else v_bits
    _orig(self, k_bits - 1 if k_bits < 16 else k_bits, v_bits - 1 if v_bits < 16 else v_bits, **kw)

kivi_mod.KIVI.__init__ = _lowered
'''

ARGS = ["-p", "no:cacheprovider", "-m", "smoke", "--kvq-bits", "3,4,16", "--kvq-seeds", "2", "--kvq-progress", "0"]


def _plugin_args(methods: str = "rtn_token,kivi"):
    from importlib.metadata import entry_points

    args = [*ARGS, "--kvq-methods", methods]
    if any(ep.name == "kvqbench" for ep in entry_points(group="pytest11")):
        return args
    return [*args, "-p", "kvqbench.plugin"]


def test_compare_passes_unchanged_and_fails_lowered_bits(pytester, capsys):
    pytester.makepyfile(test_cells=CELL_TEST)
    pytester.runpytest_subprocess(*_plugin_args(), "--kvq-out", str(pytester.path / "base")).assert_outcomes(passed=12)
    pytester.runpytest_subprocess(*_plugin_args("kivi"), "--kvq-out",
                                  str(pytester.path / "rerun")).assert_outcomes(passed=6)
    pytester.makeconftest(DEGRADE)
    pytester.runpytest_subprocess(*_plugin_args(), "--kvq-out", str(pytester.path / "lowered")).assert_outcomes(passed=12)
    base, rerun, lowered = (str(pytester.path / n) for n in ("base", "rerun", "lowered"))
    capsys.readouterr()
    # the rerun holds KIVI only: a gate on it alone would pass vacuously for rtn_token
    assert cli_main(["compare", base, rerun, "--fail-on", "rel_mse:5"]) == 1
    assert capsys.readouterr().out.startswith("FAILED: NEW lacks ")
    assert cli_main(["compare", base, rerun, "--fail-on", "rel_mse:5", "--methods", "kivi"]) == 0
    assert cli_main(["compare", base, rerun, "--fail-on", "rel_mse:5", "--only-common"]) == 0
    capsys.readouterr()
    assert cli_main(["compare", base, lowered, "--fail-on", "rel_mse:5"]) == 1
    out = capsys.readouterr().out
    assert "FAILED: " in out and "kivi" in out.split("FAILED: ")[1] and "rel_mse" in out


def test_compare_bad_invocations_exit_2(tmp_path):
    with pytest.raises(SystemExit) as ei:
        cli_main(["compare"])
    assert ei.value.code == 2
    assert cli_main(["compare", str(tmp_path / "nope_a"), str(tmp_path / "nope_b")]) == 2
