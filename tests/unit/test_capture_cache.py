"""The real-KV capture cache is validated on load (issue 9, item 6): shapes, dtypes, token count and a
content hash; a bad file is re-captured after one warning line naming it; non-finite Q/K/V give one error
naming the model and the file. No model needed: the capture itself is replaced by a stand-in."""

from __future__ import annotations

import pytest
import torch

from kvqbench.data import KVData
from kvqbench.data import capture as cap
from kvqbench.data.capture import CaptureCacheWarning, NonFiniteCaptureError, models, store

T = 8


def sample(t: int = T, *, grads: bool = False, fill: float = 0.5) -> KVData:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, t, 4, generator=g) * fill
    extra = {"k_grad2": x.square(), "v_grad2": x.square()} if grads else {}
    return KVData("real", x + 1, x + 2, torch.randn(2, 6, t, 4, generator=g), k_pre=x, cos=torch.ones(2, t, 4),
                  sin=torch.zeros(2, t, 4), meta={"seq_len": t}, **extra)


def _obj(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _resave(path, obj):
    torch.save(obj, path)


def test_a_valid_file_loads_identically(tmp_path):
    p = tmp_path / "kv.pt"
    d = sample(grads=True)
    store._save_atomic(d, p)
    got = store._load_cached(p, seq_len=T, with_grads=True)
    for name in ("k", "v", "q", "k_pre", "cos", "sin", "k_grad2", "v_grad2"):
        assert torch.equal(getattr(got, name), getattr(d, name)), name
    assert got.meta == d.meta


def _corruptions():
    def tokens(o):  # K on fewer tokens than V (the case)
        o["k"] = o["k"][..., :5, :].contiguous()

    def missing(o):
        del o["q"]

    def dtype(o):
        o["v"] = o["v"].half()

    def content(o):
        o["v"] = o["v"] + 1.0

    def fmt(o):
        o["format"] = 1

    def rope(o):  # one table for every layer, not one per layer
        o["cos"] = o["cos"][0].contiguous()
        o["shapes"]["cos"] = list(o["cos"].shape)

    return {"tokens": (tokens, "'k' of shape"), "missing tensor": (missing, "has no 'q' tensor"),
            "dtype": (dtype, "'v' as torch.float16"), "content": (content, "content hash"),
            "format": (fmt, "cache format"), "rope per layer": (rope, "'cos' of shape")}


@pytest.mark.parametrize("case", sorted(_corruptions()))
def test_a_mismatched_file_is_rejected_with_one_line_naming_it(tmp_path, case):
    change, phrase = _corruptions()[case]
    p = tmp_path / "kv.pt"
    store._save_atomic(sample(), p)
    o = _obj(p)
    change(o)
    _resave(p, o)
    with pytest.warns(CaptureCacheWarning) as w:
        assert store._load_cached(p, seq_len=T, with_grads=False) is None
    (msg,) = [str(x.message) for x in w]
    assert str(p) in msg and phrase in msg and msg.endswith("re-capturing") and "\n" not in msg


def test_wrong_token_count_and_truncated_file_are_rejected(tmp_path):
    p = tmp_path / "kv.pt"
    store._save_atomic(sample(), p)
    with pytest.warns(CaptureCacheWarning, match="holds 8 tokens, expected 16"):
        assert store._load_cached(p, seq_len=16) is None
    with pytest.warns(CaptureCacheWarning, match="has no 'k_grad2' tensor"):
        assert store._load_cached(p, seq_len=T, with_grads=True) is None
    p.write_bytes(p.read_bytes()[:100])
    with pytest.warns(CaptureCacheWarning, match="is unreadable"):
        assert store._load_cached(p, seq_len=T) is None


@pytest.fixture
def fake_model(monkeypatch, tmp_path):
    """capture_kv with a stand-in model: counts captures, returns ``state['data']``."""
    state = {"runs": 0, "data": None}
    monkeypatch.setattr(cap, "_resolve", lambda model: models._ModelRef("fake", "fake", None, True, "fake"))
    monkeypatch.setattr(cap, "_require_real_deps", lambda **kw: None)
    monkeypatch.setattr(cap, "_cache_path", lambda d, *a: d / "kv-fake.pt")

    def run(ref, seq_len, layers, with_grads, dev, dtype="float32", cache_dir=None):
        state["runs"] += 1
        return state["data"] if state["data"] is not None else sample(seq_len)

    monkeypatch.setattr(cap, "_run_capture", run)
    return state


def test_capture_kv_recaptures_a_corrupt_cache_file(tmp_path, fake_model):
    first = cap.capture_kv(model="fake", seq_len=T, cache_dir=tmp_path)
    cap.capture_kv(model="fake", seq_len=T, cache_dir=tmp_path)
    assert fake_model["runs"] == 1  # served from the cache
    o = _obj(tmp_path / "kv-fake.pt")
    o["k"] = o["k"][..., :5, :].contiguous()
    _resave(tmp_path / "kv-fake.pt", o)
    with pytest.warns(CaptureCacheWarning, match="kv-fake.pt"):
        again = cap.capture_kv(model="fake", seq_len=T, cache_dir=tmp_path)
    assert fake_model["runs"] == 2 and torch.equal(again.k, first.k)
    assert store._load_cached(tmp_path / "kv-fake.pt", seq_len=T) is not None  # rewritten valid


def test_non_finite_capture_is_one_error_naming_model_and_file(tmp_path, fake_model):
    bad = sample()
    bad.q[0, 0, 0, 0] = float("nan")
    fake_model["data"] = bad
    with pytest.raises(NonFiniteCaptureError, match=r"model 'fake' holds 1 non-finite value\(s\) in 'q' \(a fresh"):
        cap.capture_kv(model="fake", seq_len=T, cache_dir=tmp_path)
    assert not (tmp_path / "kv-fake.pt").exists()  # never cached
    store._save_atomic(bad, tmp_path / "kv-fake.pt")  # a file holding NaN with a valid hash
    with pytest.raises(NonFiniteCaptureError, match=f"cache file {tmp_path / 'kv-fake.pt'}"):
        cap.capture_kv(model="fake", seq_len=T, cache_dir=tmp_path)


def test_the_plugin_finds_a_capture_cache_folder_without_pytests_cache(tmp_path, monkeypatch) -> None:
    """``--kvq-capture-cache`` first, then pytest's cache folder; without pytest's cache plugin (``-p
    no:cacheprovider``) or with its folder unwritable (a read-only checkout), the user's cache folder."""
    from types import SimpleNamespace

    from kvqbench.plugin.fixtures import capture_cache_dir
    from kvqbench.plugin.state import SETTINGS_KEY, Settings

    monkeypatch.setenv("KVQBENCH_CACHE_DIR", str(tmp_path / "user"))

    class Cache:
        def __init__(self, ok: bool) -> None:
            self.ok = ok

        def mkdir(self, name: str):
            if not self.ok:
                raise PermissionError(13, "Read-only file system", name)
            return tmp_path / "pytest-cache" / name

    def config(cache=None, capture_cache=None):
        stash = {SETTINGS_KEY: Settings(capture_cache=capture_cache)}
        return SimpleNamespace(stash=stash, **({"cache": cache} if cache is not None else {}))

    assert capture_cache_dir(config(Cache(True), capture_cache="/given")) == "/given"
    assert capture_cache_dir(config(Cache(True))) == str(tmp_path / "pytest-cache" / "kvqbench_capture")
    for no_pytest_cache in (config(), config(Cache(False))):
        got = capture_cache_dir(no_pytest_cache)
        assert got == str(tmp_path / "user" / "capture") and (tmp_path / "user" / "capture").is_dir()


def test_a_worker_moving_to_real_cells_drops_the_synthetic_data_only(monkeypatch) -> None:
    """``evict_data("synthetic")`` removes every synthetic entry of the per-process data cache and keeps the real
    captures; with nothing synthetic left it drops nothing."""
    from kvqbench.plugin import fixtures

    cache = {("synthetic", "full", 0, "cpu", "smollm2", "float32"): object(),
             ("synthetic", "full", 1, "cpu", "smollm2", "float32"): object(),
             ("real", "full", None, "cpu", "smollm2", "float32"): object(),
             ("real-gemma3-270m", "full", None, "cpu", "gemma3-270m", "float32"): object()}
    monkeypatch.setattr(fixtures, "_DATA_CACHE", dict(cache))
    assert fixtures.evict_data("synthetic") is True
    assert sorted(fixtures._DATA_CACHE, key=str) == sorted((k for k in cache if k[0] != "synthetic"), key=str)
    assert fixtures.evict_data("synthetic") is False


def test_a_worker_moving_to_model_cells_drops_the_real_captures_only(monkeypatch) -> None:
    """``evict_data("real")`` (a worker's model cells when they come after every cell reading the capture)
    drops the captures and keeps any synthetic data."""
    from kvqbench.plugin import fixtures

    syn = ("synthetic", "full", 0, "cpu", "gemma3-270m", "float32")
    cache = {syn: object(), ("real-gemma3-270m", "full", None, "cpu", "gemma3-270m", "float32"): object()}
    monkeypatch.setattr(fixtures, "_DATA_CACHE", dict(cache))
    assert fixtures.evict_data("real") is True
    assert fixtures._DATA_CACHE == {syn: cache[syn]}
    assert fixtures.evict_data("real") is False
