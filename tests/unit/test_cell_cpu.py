"""scripts/cell_cpu.py: per-cell CPU seconds of two runs, summed per test and method, side by side."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cell_cpu.py"


def _module():
    spec = importlib.util.spec_from_file_location("cell_cpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sums_per_test_and_method_with_ratio(tmp_path, capsys):
    mod = _module()
    base, new = tmp_path / "base", tmp_path / "new"
    base.mkdir(), new.mkdir()
    (base / "1.tsv").write_text("t.py::test_a[kivi-k2v2-seed0-real-full]\t2.0\nt.py::test_a[fp16-k2v2-seed0-real-full]\t1.0\n")
    (base / "2.tsv").write_text("t.py::test_a[kivi-k2v2-seed1-real-full]\t2.0\nt.py::only_base\t9.0\n")
    (new / "1.tsv").write_text("t.py::test_a[kivi-k2v2-seed0-real-full]\t1.0\nt.py::test_a[kivi-k2v2-seed1-real-full]\t0.0\n"
                               "t.py::test_a[fp16-k2v2-seed0-real-full]\t1.0\n")
    assert mod.load(str(base))["t.py::only_base"] == 9.0
    assert mod.main([str(base), str(new)]) == 0
    rows = {tuple(ln.split()[:2]): ln.split()[2:] for ln in capsys.readouterr().out.splitlines()}
    assert rows[("test_a", "kivi")] == ["2", "4.0", "1.0", "0.25"]
    assert rows[("test_a", "*")] == ["3", "5.0", "2.0", "0.40"]
    assert rows[("total", "3")] == ["5.0", "2.0", "0.40"]
