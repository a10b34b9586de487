"""Atomic result writing: complete files, strict JSON, normal permissions, no temp files left."""

import json
import math
import os

import pytest

from kvqbench.report.io import write_json_atomic, write_text_atomic


def test_atomic_json_is_strict_sorted_and_world_readable(tmp_path):
    p = write_json_atomic(tmp_path / "sub" / "a.json", {"b": 1.0, "a": [math.nan, math.inf], "t": (1, 2)})
    text = p.read_text()
    assert json.loads(text) == {"a": ["nan", "inf"], "b": 1.0, "t": [1, 2]}
    assert text.index('"a"') < text.index('"b"')
    umask = os.umask(0)
    os.umask(umask)
    assert (p.stat().st_mode & 0o777) == (0o666 & ~umask)
    assert [x.name for x in p.parent.iterdir()] == ["a.json"]


def test_failed_write_leaves_old_file_and_no_temp(tmp_path):
    p = write_text_atomic(tmp_path / "x.md", "old\n")

    class Boom:
        def __str__(self):
            raise RuntimeError("boom")

    with pytest.raises(TypeError):
        write_json_atomic(p.with_suffix(".json"), {"x": Boom()})
    assert p.read_text() == "old\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["x.md"]
