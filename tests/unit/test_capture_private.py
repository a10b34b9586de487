"""Captures are loaded only from where no other user can write (issue 22, item 5): a capture cache
folder or capture file that is another user's, or group/world-writable, is refused in one warning line
and the capture is run again, never read from it; locks live in the cache folder's own ``locks/``.
No model needed: the capture itself is replaced by a stand-in whose every run gives new values."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from kvqbench import privdir
from kvqbench.data import KVData
from kvqbench.data import capture as cap
from kvqbench.data.capture import CaptureCacheWarning, models, store

T = 8
NOBODY = 65534


def sample(fill: float) -> KVData:
    x = torch.full((2, 3, T, 4), fill)
    return KVData("real", x + 1, x + 2, x + 3, k_pre=x, cos=torch.ones(2, T, 4), sin=torch.zeros(2, T, 4),
                  meta={"fill": fill})


@pytest.fixture
def fake_model(monkeypatch, tmp_path):
    """capture_kv with a stand-in model: run ``n`` gives a capture filled with ``n``; a fresh fallback
    folder (made under ``tmp_path``) for each test."""
    state = {"runs": 0}
    monkeypatch.setattr(privdir, "_FALLBACK", {})
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(cap, "_resolve", lambda model: models._ModelRef("fake", "fake", None, True, "fake"))
    monkeypatch.setattr(cap, "_require_real_deps", lambda **kw: None)
    monkeypatch.setattr(cap, "_cache_path", lambda d, *a: d / "kv-fake.pt")

    def run(ref, seq_len, layers, with_grads, dev, dtype="float32", cache_dir=None):
        state["runs"] += 1
        return sample(float(state["runs"]))

    monkeypatch.setattr(cap, "_run_capture", run)
    return state


def _one_warning(record) -> str:
    msgs = [str(w.message) for w in record if issubclass(w.category, CaptureCacheWarning)]
    assert len(msgs) == 1, msgs
    assert "\n" not in msgs[0]
    return msgs[0]


def _planted(folder, fill: float = 99.0):
    """A valid capture (its content hash matches) that the run must not use."""
    store._save_atomic(sample(fill), folder / "kv-fake.pt")
    return folder / "kv-fake.pt"


def test_own_private_cache_is_reused_and_holds_locks_beside_it(tmp_path, fake_model):
    first = cap.capture_kv(model="fake", seq_len=T, cache_dir=tmp_path / "c")
    again = cap.capture_kv(model="fake", seq_len=T, cache_dir=tmp_path / "c")
    assert fake_model["runs"] == 1 and torch.equal(again.k, first.k)
    assert stat.S_IMODE(os.stat(tmp_path / "c").st_mode) == 0o700  # created private
    assert stat.S_IMODE(os.stat(tmp_path / "c" / "kv-fake.pt").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "c" / "locks").st_mode) == 0o700
    assert [p.name for p in (tmp_path / "c" / "locks").iterdir()] == ["kv-fake.pt.lock"]


def test_a_world_writable_cache_folder_is_refused_in_one_line(tmp_path, fake_model):
    folder = tmp_path / "shared"
    folder.mkdir()
    planted = _planted(folder)
    folder.chmod(0o777)
    with pytest.warns(CaptureCacheWarning) as record:
        got = cap.capture_kv(model="fake", seq_len=T, cache_dir=folder)
    msg = _one_warning(record)
    assert str(folder) in msg and "writable by group or others" in msg
    assert fake_model["runs"] == 1 and torch.equal(got.k_pre, torch.full((2, 3, T, 4), 1.0))  # not the plant
    assert sorted(p.name for p in folder.iterdir()) == ["kv-fake.pt"]  # nothing written or locked there
    assert torch.equal(store._load_cached(planted).k_pre, torch.full((2, 3, T, 4), 99.0))  # left alone
    fallback = privdir.fallback_dir("capture")
    assert str(fallback) in msg and (fallback / "kv-fake.pt").is_file()
    assert stat.S_IMODE(os.stat(fallback).st_mode) == 0o700
    assert fallback in store._REMOVE_AT_EXIT


def test_the_fallback_folder_is_removed_when_the_process_exits(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    code = (
        "import sys, tempfile, warnings\n"
        f"tempfile.tempdir = {str(tmp_path)!r}\n"
        "from kvqbench.data.capture import store\n"
        "warnings.simplefilter('ignore')\n"
        f"d = store._trusted_dir({str(shared)!r})\n"
        "(d / 'kv-x.pt').write_bytes(b'x')\n"
        "print(d)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    fallback = Path(out.stdout.strip())
    assert fallback.parent == tmp_path and fallback != shared and not fallback.exists()


def test_a_group_writable_capture_file_is_not_loaded(tmp_path, fake_model):
    folder = privdir.private_dir(tmp_path / "c")
    planted = _planted(folder)
    planted.chmod(0o666)
    with pytest.warns(CaptureCacheWarning) as record:
        got = cap.capture_kv(model="fake", seq_len=T, cache_dir=folder)
    msg = _one_warning(record)
    assert str(planted) in msg and "is refused" in msg and "mode 666" in msg and msg.endswith("re-capturing")
    assert fake_model["runs"] == 1 and torch.equal(got.k_pre, torch.full((2, 3, T, 4), 1.0))
    # the fresh capture replaced it, private this time, and is what the next call loads
    assert stat.S_IMODE(os.stat(planted).st_mode) == 0o600
    assert torch.equal(cap.capture_kv(model="fake", seq_len=T, cache_dir=folder).k_pre, got.k_pre)
    assert fake_model["runs"] == 1


def test_load_cached_refuses_a_writable_file_unread(tmp_path, monkeypatch):
    p = _planted(privdir.private_dir(tmp_path / "c"))
    p.chmod(0o606)

    def no_load(*a, **kw):  # pragma: no cover - failing here is the bug
        raise AssertionError("a refused file was read")

    monkeypatch.setattr(store.torch, "load", no_load)
    with pytest.warns(CaptureCacheWarning) as record:
        assert store._load_cached(p, seq_len=T) is None
    assert "writable by group or others" in _one_warning(record)


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                    reason="giving a folder to another user (uid 65534) needs root")
def test_another_users_cache_folder_and_file_are_refused(tmp_path, fake_model):
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o755)
    _planted(foreign)
    os.chown(foreign / "kv-fake.pt", NOBODY, NOBODY)
    os.chown(foreign, NOBODY, NOBODY)
    with pytest.warns(CaptureCacheWarning) as record:
        got = cap.capture_kv(model="fake", seq_len=T, cache_dir=foreign)
    msg = _one_warning(record)
    assert str(foreign) in msg and "belongs to another user (uid 65534" in msg
    assert fake_model["runs"] == 1 and torch.equal(got.k_pre, torch.full((2, 3, T, 4), 1.0))
    assert sorted(p.name for p in foreign.iterdir()) == ["kv-fake.pt"]

    mine = privdir.private_dir(tmp_path / "mine")  # this user's folder, another user's file in it
    planted = _planted(mine)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.warns(CaptureCacheWarning) as record:
        got = cap.capture_kv(model="fake", seq_len=T, cache_dir=mine)
    assert "belongs to another user (uid 65534" in _one_warning(record)
    assert fake_model["runs"] == 2 and torch.equal(got.k_pre, torch.full((2, 3, T, 4), 2.0))
    assert os.stat(planted).st_uid == os.getuid()  # replaced by this user's capture


def test_a_refused_converted_model_folder_is_not_loaded(tmp_path):
    pytest.importorskip("transformers", reason="the converted-model loader imports transformers")
    from kvqbench.data.capture import loading

    folder = privdir.private_dir(tmp_path / "model-x")
    (folder / loading._CONVERTED_MARK).write_text('{"weights_bytes": 0, "format": 1}')
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "model.safetensors").chmod(0o666)
    with pytest.warns(CaptureCacheWarning) as record:
        assert loading._load_converted(folder, torch.float32) is None
    msg = _one_warning(record)
    assert "model-x not loaded" in msg and "writable by group or others" in msg
