"""What keeps a worker's memory bounded (issue 22, item 4): scoped derived values of a data object are
dropped when another experiment's are asked for (and rebuilt, the same, on demand); freed heap memory
goes back to the operating system; a capture does not keep the model it loaded; the end-to-end
references keep ``log p`` only."""

from __future__ import annotations

import platform
import sys

import pytest
import torch

from kvqbench.data import KVData, memory


def _data() -> KVData:
    x = torch.arange(2 * 3 * 4 * 2, dtype=torch.float32).reshape(2, 3, 4, 2)
    return KVData("synthetic", x, x + 1, x + 2)


def test_a_scoped_value_is_dropped_when_another_scope_is_asked_for():
    d = _data()
    builds: list[str] = []

    def build(tag):
        def f():
            builds.append(tag)
            return d.k.double() + len(builds)
        return f

    shared = d.cached("shared", build("shared"))
    a = d.cached("a", build("a"), scope="exp2")
    assert d.cached("a", build("a"), scope="exp2") is a and builds == ["shared", "a"]  # kept within its scope
    b = d.cached("b", build("b"), scope="exp3")
    assert "a" not in d.cache and set(d.cache) == {"shared", "b"} and d.cache_scopes == {"b": "exp3"}
    assert d.cached("shared", build("shared")) is shared  # unscoped values stay
    assert d.cached("b", build("b"), scope="exp3") is b
    a2 = d.cached("a", build("a"), scope="exp2")  # asked for again: built again, "b" dropped
    assert builds == ["shared", "a", "b", "a"] and set(d.cache) == {"shared", "a"}
    assert torch.equal(a2 - 4, a - 2)  # the same build function (each build adds its own count here)


def test_window_and_replace_start_with_an_empty_cache():
    d = _data()
    d.cached("a", lambda: 1, scope="exp2")
    w = d.window(0, 2)
    assert w.cache == {} and w.cache_scopes == {}


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"),
                    reason="malloc_trim is glibc's")
def test_release_freed_returns_freed_heap_pages_to_the_os():
    def rss_mib() -> float:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024

    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    m_trim_threshold, m_mmap_threshold = -1, -3
    # what the workers' tunables do: big buffers from the heap, freed memory kept
    assert libc.mallopt(m_mmap_threshold, 1 << 30) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    memory.release_freed()
    keep = torch.ones(1000)  # a live buffer allocated after the big ones, so the heap top stays busy
    big = [torch.ones(4 << 20) for _ in range(16)]  # 16 × 16 MiB
    keep2 = torch.ones(1000)
    before = rss_mib()
    del big
    kept = rss_mib()
    assert kept > before - 64  # glibc kept the freed 256 MiB
    assert memory.release_freed() is True
    assert rss_mib() < kept - 200
    assert keep.sum() == 1000 and keep2.sum() == 1000


def test_release_freed_is_a_no_op_without_malloc_trim(monkeypatch):
    monkeypatch.setattr(memory, "_TRIM", [None])
    assert memory.release_freed() is False


def test_next_token_metrics_needs_logits_or_a_reference():
    from kvqbench.experiments import endtoend as E

    g = torch.Generator().manual_seed(0)
    ref, other = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    targets = torch.tensor([1, 2, 3, 4, 5])
    side = E.reference_side(ref, targets)
    assert not hasattr(side, "p") and not hasattr(side, "logp")  # taken from the logits where they are used
    assert side.logits is ref
    m = E.next_token_metrics(ref, other, targets)
    assert E.next_token_metrics(None, other, targets, reference=side) == m
    p = torch.softmax(ref.double(), -1)
    kl = (p * (torch.log_softmax(ref.double(), -1) - torch.log_softmax(other.double(), -1))).sum(-1)
    torch.testing.assert_close(torch.tensor(m["kl_per_position"], dtype=torch.float64), kl)
    with pytest.raises(ValueError, match="needs logits_ref or reference"):
        E.next_token_metrics(None, other, targets)


def test_a_capture_does_not_keep_a_model_it_loaded(monkeypatch):
    from kvqbench.data.capture import loading, models

    ref = models._ModelRef("fake", "fake", None, True, "fake")
    made: list[object] = []

    def fresh(r, device, dtype, cache_dir):
        made.append(object())
        return made[-1], "tok"

    monkeypatch.setattr(loading, "_load_fresh", fresh)
    monkeypatch.setattr(loading, "_MODELS", {})
    net, _ = loading._model_for_capture(ref, "cpu", torch.float32)
    assert loading._MODELS == {} and net is made[0]  # not kept
    held, _ = loading._load_resolved(ref, "cpu", torch.float32)  # what load_model keeps …
    assert loading._model_for_capture(ref, "cpu", torch.float32)[0] is held  # … a capture uses
    assert len(made) == 2


def test_release_if_grown_releases_only_past_the_step(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(memory, "_TRIM", [lambda pad: calls.append(pad) or 1])
    resident = [1000]
    monkeypatch.setattr(memory, "_resident", lambda: resident[0])
    monkeypatch.setattr(memory, "_AFTER_LAST", [1000])
    resident[0] = 1000 + 100
    assert memory.release_if_grown(step=100) is False and calls == []  # grew by the step, not more
    resident[0] = 1000 + 101
    assert memory.release_if_grown(step=100) is True and calls == [0]
    assert memory._AFTER_LAST == [1101]  # the next step counts from here
    assert memory.release_if_grown(step=100) is False and calls == [0]


def test_release_after_releases_also_when_the_call_raises(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(memory, "release_if_grown", lambda: seen.append("released") or True)

    @memory.release_after
    def cell(x):
        """doc"""
        if x < 0:
            raise ValueError("negative")
        seen.append("ran")
        return 2 * x

    assert cell(3) == 6 and seen == ["ran", "released"] and cell.__doc__ == "doc"
    with pytest.raises(ValueError, match="negative"):
        cell(-1)
    assert seen == ["ran", "released", "released"]
