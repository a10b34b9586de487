"""Where a Ray shard task keeps captures when the run names no ``--kvq-capture-cache``: the user's own
cache folder on the node, never a folder another user could write (kvqbench.dist.node_capture_cache)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvqbench import dist


def test_the_default_is_the_users_own_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQBENCH_CACHE_DIR", str(tmp_path / "cache"))
    folder = Path(dist.node_capture_cache())
    assert folder == tmp_path / "cache" / "capture" and folder.is_dir()
    st = folder.stat()
    assert stat.S_IMODE(st.st_mode) & 0o077 == 0 and st.st_uid == os.getuid()


def test_a_cache_folder_another_user_could_write_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    planted = tmp_path / "shared"
    planted.mkdir()
    planted.chmod(0o777)
    monkeypatch.setenv("KVQBENCH_CACHE_DIR", str(planted))
    folder = Path(dist.node_capture_cache())
    out = capsys.readouterr().out.splitlines()
    assert not folder.is_relative_to(planted) and folder.is_dir()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    assert len(out) == 1 and "writable by group or others" in out[0] and str(folder) in out[0]


def test_a_shard_task_is_given_the_default_unless_the_run_names_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVQBENCH_CACHE_DIR", str(tmp_path / "cache"))
    root = Path(__file__).resolve().parents[2]
    # a usage error ends the shard before any cell runs: only the command line it was given matters here
    dist.shard_task(1, 1, ["tests/bench", "--kvq-bits", "2,,4", "-p", "no:cacheprovider"], str(root))
    first = capsys.readouterr().out.splitlines()[0]
    assert f"--kvq-capture-cache {tmp_path / 'cache' / 'capture'} " in first
    dist.shard_task(1, 1, ["tests/bench", "--kvq-bits", "2,,4", "--kvq-capture-cache", str(tmp_path / "mine")], str(root))
    first = capsys.readouterr().out.splitlines()[0]
    assert first.count("--kvq-capture-cache") == 1 and str(tmp_path / "mine") in first
