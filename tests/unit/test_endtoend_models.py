"""Experiment 5 on a second architecture: sliding-window layers, one RoPE table per layer type, a large
vocabulary scored a block at a time.

The hook tests build a tiny random Gemma 3 (3 layers, window 4) from its config — no download. The
``real`` test loads Gemma 3 270M from its registry packages and is skipped, with the reason, when they or
the real-model dependencies are missing.
"""

from __future__ import annotations

import pytest
import torch

from kvqbench.experiments import endtoend as E
from kvqbench.quantizers.fp16 import FP16

W = 24  # tokens: six sliding windows of 4


@pytest.fixture(scope="module")
def tiny_gemma():
    transformers = pytest.importorskip("transformers", reason="needs transformers (kvqbench[real])")
    if not hasattr(transformers, "Gemma3ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 3")
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], max_position_embeddings=128)
    net = transformers.Gemma3ForCausalLM(cfg).eval()
    net.requires_grad_(False)
    ids = torch.randint(0, 64, (W,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        own = net(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    return net, ids, own


DECODE = [(0, 8)] + [(a, a + 4) for a in range(8, W, 4)]


def test_sliding_window_layers_give_the_models_own_logits_past_the_window(tiny_gemma) -> None:
    """The plain cache keeps every token and the model's mask applies the window: prefill and decode
    (arrivals of 4 tokens, the window's length) give the logits of the model's own cache-free forward,
    although the window changes them (the same weights with an unbounded window differ)."""
    import transformers

    net, ids, own = tiny_gemma
    torch.testing.assert_close(E.run_model(net, ids, [(0, W)], None), own, rtol=0, atol=1e-6)
    torch.testing.assert_close(E.run_model(net, ids, DECODE, None), own, rtol=1e-5, atol=1e-5)
    wide = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**net.config.to_dict(), "sliding_window": 1000}))
    wide.load_state_dict(net.state_dict())
    with torch.no_grad():
        unbounded = wide.eval()(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    assert float((unbounded - own).abs().max()) > 1e-2


class _PreRopeIdentity(FP16):
    """A pass-through that declares pre-RoPE keys, so the hook un-rotates and re-rotates them."""

    k_pre_rope = True


def test_pre_rope_keys_are_unrotated_with_each_layers_own_table(tiny_gemma) -> None:
    """Local (θ = 10⁴) and global (θ = 10⁶) layers have different RoPE tables (model_rope gives each layer
    its type's); the keys a pre-RoPE method receives equal the model's own pre-RoPE keys (its k_norm
    output) on every layer, and the logits are the plain model's."""
    net, ids, own = tiny_gemma
    cos, sin = E.model_rope(net, W)
    assert cos.shape == (3, W, 16) and torch.equal(cos[0], cos[1])
    assert float((cos[0] - cos[2]).abs().max()) > 0.1
    seen: dict[int, torch.Tensor] = {}
    layers = net.model.layers
    handles = [layers[i].self_attn.k_norm.register_forward_hook(
        lambda m, a, out, i=i: seen.setdefault(i, out.detach().clone())) for i in range(3)]
    try:
        hook = E.KVCacheHook([_PreRopeIdentity(16)] * 3, streaming=False, cos=cos, sin=sin)
        got = E.run_model(net, ids, [(0, W)], hook)
    finally:
        for h in handles:
            h.remove()
    for i in range(3):
        torch.testing.assert_close(hook.k[i].result(0).x_hat, seen[i], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, own, rtol=1e-4, atol=1e-4)


def test_logits_come_in_aligned_blocks(tiny_gemma, monkeypatch) -> None:
    """head_blocks covers [first, stop) in order with HEAD_BLOCK-aligned blocks whose logits are the
    model's."""
    net, ids, own = tiny_gemma
    monkeypatch.setattr(E, "HEAD_BLOCK", 16)
    hidden = E.run_hidden_rows(net, [ids], [(0, W)], None)[0]
    blocks = list(E.head_blocks(net, hidden, 5, 21))
    assert [(a, b) for a, b, _ in blocks] == [(5, 16), (16, 21)]
    torch.testing.assert_close(torch.cat([lg for _, _, lg in blocks]), own[5:21], rtol=0, atol=1e-6)


def _gemma_missing() -> str | None:
    from kvqbench.data.capture import MissingDependencyError, _require_real_deps, registry

    try:
        _require_real_deps(gguf=True, default_model=False)
        registry.model_file("gemma3-270m")
    except (MissingDependencyError, ValueError, OSError) as e:
        return str(e)
    return None


@pytest.mark.real
def test_gemma3_270m_smoke_fp16_control_is_exact(pytestconfig) -> None:
    """Gemma 3 270M (262k vocabulary, 1 KV head of 256, sliding-window layers) at the smoke window:
    the fp16 control has KL exactly 0 and agreement exactly 1 in both regimes, and a 2-bit method
    damages it within the metric ranges (the smoke benchmark cells run every method on it)."""
    missing = _gemma_missing()
    if missing is not None:
        pytest.skip(missing)
    from kvqbench.plugin.fixtures import capture_cache_dir
    from kvqbench.quantizers import create

    cfg = E.CONFIG_BY_SIZE["smoke"]
    # the benchmark cells' capture cache: the converted model and the calibration capture are shared
    src = E.load_source(model="gemma3-270m", window=cfg.window,
                        cache_dir=capture_cache_dir(pytestconfig))
    assert tuple(src.calibration.k.shape) == (18, 1, cfg.window, 256)
    ctl = E.run_endtoend(create("fp16", 2, 2), src, 0, cfg)
    for regime in E.REGIMES:
        got = tuple(ctl.metrics[f"e2e_{regime}_{n}"] for n in ("kl_nats", "kl_p99_nats", "top1_agree", "dloss_nats"))
        assert got == (0.0, 0.0, 1.0, 0.0), regime
    rtn = E.run_endtoend(create("rtn_token", 2, 2), src, 0, cfg)
    for regime in E.REGIMES:
        assert rtn.metrics[f"e2e_{regime}_kl_nats"] > 0
        assert 2.0 < rtn.metrics[f"e2e_{regime}_bits_billed"] < 16.0


def test_capture_keeps_each_layers_own_rope_table(tiny_gemma, monkeypatch) -> None:
    """A capture of a model with one RoPE table per layer type stores the tables per layer, each layer's
    the model's own (model_rope, a second implementation), k_pre is the model's own k_norm output on every
    layer, and apply_rope(k_pre, cos, sin) gives the cached keys; windowing and layer selection keep the
    tables aligned with the layers and tokens."""
    from kvqbench.data.capture import forward
    from kvqbench.data.capture.models import _ModelRef
    from kvqbench.data.types import apply_rope
    from kvqbench.plugin.fixtures import _select_layers

    net, ids, _ = tiny_gemma

    def tokenizer(text: str) -> dict:
        return {"input_ids": (ids * (len(text) // len(ids) + 1))[:max(len(text), W)]}

    monkeypatch.setattr(forward, "_model_for_capture", lambda *a, **k: (net, tokenizer))
    seen: dict[int, torch.Tensor] = {}
    layers = net.model.layers
    handles = [layers[i].self_attn.k_norm.register_forward_hook(
        lambda m, a, out, i=i: seen.setdefault(i, out.detach().clone())) for i in range(3)]
    try:
        data = forward._run_capture(_ModelRef("tiny", "tiny", None, False, "tiny"), W, None, False,
                                    torch.device("cpu"))
    finally:
        for h in handles:
            h.remove()
    cos, sin = E.model_rope(net, W)
    assert data.cos.shape == data.sin.shape == (3, W, 16)
    torch.testing.assert_close(data.cos, cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(data.sin, sin, rtol=0, atol=1e-6)
    for i in range(3):
        torch.testing.assert_close(data.k_pre[i], seen[i][0], rtol=0, atol=0)
    torch.testing.assert_close(apply_rope(data.k_pre, data.cos, data.sin), data.k, rtol=1e-5, atol=1e-5)
    part = _select_layers(data, [0, 2]).window(5, 13)
    assert part.meta["layer_types"] == ["sliding_attention", "full_attention"]
    assert torch.equal(part.cos, data.cos[[0, 2], 5:13]) and torch.equal(part.k_pre, data.k_pre[[0, 2], :, 5:13])
    torch.testing.assert_close(apply_rope(part.k_pre, part.cos, part.sin), part.k, rtol=1e-5, atol=1e-5)
