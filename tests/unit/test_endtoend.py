"""Experiment 5 (end-to-end on the real model): the KV-cache hook, the regimes and the metrics.

Tests marked ``real`` load SmolLM2 once per process (shared with test_capture through
``load_model``'s cache) and run windows of at most 64 tokens; they are skipped with the reason when the
real-model dependencies are missing. The metric and config tests need no model.
"""

from __future__ import annotations

import math

import pytest
import torch
from realmodel import MISSING, Replay, check_decode_cache, real

from kvqbench.experiments import endtoend as E
from kvqbench.quantizers import create
from kvqbench.quantizers.fp16 import FP16

_MISSING = MISSING

W = 48  # tokens of the hook tests' text
P = 32


@pytest.fixture(scope="module")
def model():
    if _MISSING is not None:
        pytest.skip(_MISSING)
    from kvqbench.data.capture import _tokens, load_model

    torch.set_num_threads(1)
    net, tok = load_model()
    ids, _ = _tokens(tok, W)
    return net, ids, int(net.config.num_hidden_layers)


def _decode_chunks(block: int) -> list[tuple[int, int]]:
    return [(0, P)] + [(a, min(a + block, W)) for a in range(P, W, block)]


_PLAIN: dict[tuple, torch.Tensor] = {}


def _plain(net, ids, chunks) -> torch.Tensor:
    """Unquantized logits under a forward schedule (memoized: several tests compare with them)."""
    key = tuple(chunks)
    if key not in _PLAIN:
        _PLAIN[key] = E.run_model(net, ids, chunks, None)
    return _PLAIN[key]


class _PreRopeIdentity(FP16):
    """A pass-through that declares pre-RoPE keys, so the hook un-rotates and re-rotates them."""

    k_pre_rope = True


# ------------------------------------------------------------------------------------------------
# no model
def test_config_rejects_a_short_last_arrival() -> None:
    with pytest.raises(ValueError, match="multiple of block"):
        E.EndToEndConfig(window=64, prompt=31, block=8)
    with pytest.raises(ValueError, match="shorter than the window"):
        E.EndToEndConfig(window=64, prompt=63, block=1)
    cfg = E.EndToEndConfig(window=64, prompt=32, block=16)
    assert cfg.chunks("decode") == [(32, 48), (48, 64)]  # after the prompt, which every regime shares
    assert cfg.chunks("prefill") == [(32, 64)]
    assert cfg.scored("prefill") == cfg.scored("decode") == (32, 63)


def test_next_token_metrics_match_closed_forms() -> None:
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(50, 11, generator=gen)
    other = ref + 0.5 * torch.randn(50, 11, generator=gen)
    targets = torch.randint(0, 11, (50,), generator=gen)
    m = E.next_token_metrics(ref, other, targets)
    p = torch.softmax(ref.double(), -1)
    kl = (p * (torch.log_softmax(ref.double(), -1) - torch.log_softmax(other.double(), -1))).sum(-1)
    assert math.isclose(m["kl_nats"], float(kl.mean()), rel_tol=1e-12)
    assert math.isclose(m["kl_p99_nats"], float(torch.quantile(kl, 0.99)), rel_tol=1e-12)
    assert m["kl_nats"] >= 0 and 0.0 <= m["top1_agree"] <= 1.0
    ce = torch.nn.functional.cross_entropy
    dloss = float(ce(other.double(), targets) - ce(ref.double(), targets))
    assert math.isclose(m["dloss_nats"], dloss, rel_tol=1e-9, abs_tol=1e-12)
    same = E.next_token_metrics(ref, ref.clone(), targets)
    assert (same["kl_nats"], same["kl_p99_nats"], same["top1_agree"], same["dloss_nats"]) == (0.0, 0.0, 1.0, 0.0)
    # the unquantized side computed once (shared by every method's cell) gives the very same values
    assert E.next_token_metrics(ref, other, targets, reference=E.reference_side(ref, targets)) == m
    # computed a few rows at a time (50 rows > E._METRIC_ROWS): bit-identical to one pass over all rows
    from kvqbench.numerics.attention import kl_rows

    lp = torch.log_softmax(ref.double(), -1)
    assert m["kl_per_position"] == [float(v) for v in kl_rows(lp, torch.log_softmax(other.double(), -1), lp.exp())]


# ------------------------------------------------------------------------------------------------
# the real model
@real
@pytest.mark.parametrize("regime", ["prefill", "decode"])
def test_pass_through_hook_leaves_logits_bitwise_unchanged(model, regime) -> None:
    net, ids, n_layers = model
    chunks = [(0, W)] if regime == "prefill" else _decode_chunks(8)
    plain = _plain(net, ids, chunks)  # the model's own DynamicCache behaviour
    hooked = E.run_model(net, ids, chunks, E.KVCacheHook([FP16(16)] * n_layers, streaming=regime == "decode"))
    assert torch.equal(hooked, plain)
    if regime == "prefill":  # and the one-pass logits are those of the model called without any cache
        with torch.no_grad():
            bare = net(input_ids=torch.tensor([ids])).logits[0].float()
        assert torch.equal(hooked, bare)


@real
@pytest.mark.parametrize("first", [P - 1, 40])
def test_logits_from_a_position_on_are_the_full_runs_rows(model, first) -> None:
    """``run_model(first=…)`` skips the LM head on rows nobody scores (a call wholly before ``first``,
    or all but its last rows): the logits it returns are bitwise those of the full run from ``first`` on."""
    net, ids, _ = model
    chunks = [(0, P), (P, 40), (40, W)]
    got = E.run_model(net, ids, chunks, None, first=first)
    assert got.shape[0] == W - first
    assert torch.equal(got, _plain(net, ids, chunks)[first:])


@real
def test_pre_rope_path_inverts_the_model_rope(model) -> None:
    """A pre-RoPE pass-through sees K un-rotated and hands it back rotated: the logits equal the plain
    model's up to the float error of RoPE⁻¹ ∘ RoPE (not bitwise: two rotations round)."""
    net, ids, n_layers = model
    from kvqbench.data.capture import _decoder

    pos = torch.arange(W)[None]
    cos, sin = _decoder(net).rotary_emb(torch.zeros(1, W, 1), pos)
    hook = E.KVCacheHook([_PreRopeIdentity(16)] * n_layers, streaming=True, cos=cos[0], sin=sin[0])
    got = E.run_model(net, ids, _decode_chunks(8), hook)
    torch.testing.assert_close(got, _plain(net, ids, _decode_chunks(8)), atol=2e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="RoPE tables"):
        E.KVCacheHook([_PreRopeIdentity(16)], streaming=True)


@real
@pytest.mark.parametrize("block", [1, 5, 16])
def test_rtn_token_decode_equals_prefill_for_any_block(model, block) -> None:
    """Per-token statistics and no fp16 window: decode quantizes every token as prefill does. Checked in
    parts that a rounding near-tie cannot break (decode and prefill compute K/V by different forward
    schedules, so their inputs differ by float noise and a value next to a rounding boundary may take the
    neighbouring code):

    1. segment invariance — every layer's decoded cache equals one round trip of the very K/V it received,
       quantized all at once (identical inputs: identical codes, exactly);
    2. the two caches differ per element by at most the inputs' own difference plus one quantization step
       (a code flipped at a near-tie) — the step bounded by the token's range / (2^b − 1);
    3. plumbing — prefill's quantized cache replayed through the decode schedule gives prefill's logits up
       to the schedule's own float noise (the unquantized model's decode-vs-prefill difference)."""
    net, ids, n_layers = model
    m = create("rtn_token", 4, 4)
    pre_hook = E.KVCacheHook([m] * n_layers, streaming=False)
    pre = E.run_model(net, ids, [(0, W)], pre_hook)
    dec_hook = E.KVCacheHook([m] * n_layers, streaming=True)
    E.run_model(net, ids, _decode_chunks(block), dec_hook)
    check_decode_cache(m, 4, dec_hook, pre_hook, n_layers, length=W)  # 1, 2

    replayed = E.run_model(net, ids, _decode_chunks(block), Replay(pre_hook))
    noise = float((_plain(net, ids, _decode_chunks(block)) - _plain(net, ids, [(0, W)])).abs().max())
    assert float((replayed - pre).abs().max()) <= 10 * noise + 1e-4  # 3
    assert float((pre - _plain(net, ids, [(0, W)])).abs().max()) > 1e-2  # 4 bits does something
    # every token was quantized exactly once, one segment per arrival
    assert [(s.start, s.stop) for s in dec_hook.k[0].segments] == _decode_chunks(block)


@real
def test_one_token_per_channel_groups_are_billed_as_stored(model) -> None:
    """A per-channel group of one token round-trips losslessly but stores a scale and a zero per
    element: the bits billed count them (far above b bits), never the nominal b."""
    net, ids, n_layers = model
    hook = E.KVCacheHook([create("rtn_channel", 2, 2)] * n_layers, streaming=True)
    E.run_model(net, ids, [(a, a + 1) for a in range(8)], hook)
    seg = hook.k[0].segments
    assert len(seg) == 8 and all(s.stop - s.start == 1 for s in seg)
    assert hook.bits_billed() > 16.0


@real
def test_smoke_cells_fp16_exact_and_kvquant_calibrated(model) -> None:
    """The smoke configuration end to end (the real-model path of the exp5 cells): the fp16 control has
    KL exactly 0 and agreement exactly 1 in both regimes; KVQuant (pre-RoPE, calibrated per layer on
    independent tokens) damages the model at 2 bits within the metric ranges."""
    cfg = E.CONFIG_BY_SIZE["smoke"]
    src = E.load_source(model="smollm2", window=cfg.window)
    ctl = E.run_endtoend(create("fp16", 2, 2), src, 0, cfg)
    for regime in E.REGIMES:
        got = tuple(ctl.metrics[f"e2e_{regime}_{n}"] for n in ("kl_nats", "kl_p99_nats", "top1_agree", "dloss_nats"))
        assert got == (0.0, 0.0, 1.0, 0.0), regime
        assert ctl.metrics[f"e2e_{regime}_bits_billed"] == 16.0
    kvq = E.run_endtoend(create("kvquant", 2, 2), src, 0, cfg)
    assert ctl.extra["tokens_sha256"] == kvq.extra["tokens_sha256"]
    assert kvq.extra["window_tokens"] == [0, cfg.window]  # of the exp5 text; calibration is corpus.txt's
    assert kvq.extra["calibration"] == {"text": "kvqbench/data/corpus.txt", "tokens": [0, cfg.window]}
    assert src.text_window_ids(0) != src.window_ids(0)
    assert kvq.extra["roundtrip_nonfinite"] == {"k": 0, "v": 0}
    for regime in E.REGIMES:
        assert kvq.metrics[f"e2e_{regime}_kl_nats"] > 0
        assert 0.0 <= kvq.metrics[f"e2e_{regime}_top1_agree"] <= 1.0
        assert 2.0 < kvq.metrics[f"e2e_{regime}_bits_billed"] < 16.0


@real
def test_batch_rows_give_each_window_the_values_it_gets_alone(model) -> None:
    """Several (method, window) pairs as the rows of one batch (run_endtoend_rows): each row's metrics and
    details equal a one-row run of the same pair, bitwise — per-tensor statistics (rtn_tensor) never see
    another row, a pre-RoPE calibrated method (kvquant) and a seeded one (turboquant at its own seed) keep
    their own methods, and the unquantized references of several windows run as one batch too."""
    cfg = E.CONFIG_BY_SIZE["smoke"]
    src = E.load_source(model="smollm2", window=cfg.window)
    pairs = [(create("rtn_tensor", 2, 2), 2), (create("kvquant", 2, 2, seed=1), 0), (create("turboquant", 2, 2, seed=2), 1)]
    E._CACHE.clear()  # references of the three windows computed in one batch here
    rows = E.run_endtoend_rows([m for m, _ in pairs], src, [w for _, w in pairs], cfg)
    E._CACHE.clear()  # … and one window at a time here
    alone = [E.run_endtoend(m, src, w, cfg) for m, w in pairs]
    for r, a, (_, w) in zip(rows, alone, pairs):
        assert r.metrics == a.metrics and r.extra == a.extra
        assert r.extra["window_index"] == w and r.metrics["e2e_prefill_kl_nats"] > 0
    with pytest.raises(ValueError, match="one window per method"):
        E.run_endtoend_rows([create("fp16", 2, 2)], src, [0, 1], cfg)
    with pytest.raises(ValueError, match="one length"):
        E.run_model_rows(src.net, [[1, 2, 3], [1, 2]], [(0, 2)], None)


def test_rows_hook_feeds_each_row_to_its_own_hook_only() -> None:
    """Row r of an arrival reaches hooks[r] alone, with its own methods and streams: each row of the
    result equals a one-row hook's, here with a different method per row (2 and 4 bits, per-tensor RTN),
    through a prefill and a streamed arrival."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 16)
    x[1] *= 100.0
    bits = (2, 4)
    hooks = [E.KVCacheHook([create("rtn_tensor", b, b)], streaming=True) for b in bits]
    alone = [E.KVCacheHook([create("rtn_tensor", b, b)], streaming=True) for b in bits]
    for a, b in ((0, 8), (8, 12)):
        k_hat, v_hat = E.RowsHook(hooks).update(0, x[..., a:b, :], x[..., a:b, :] * 2, x[..., :b, :], x[..., :b, :] * 2)
        for r in range(2):
            xr = x[r:r + 1]
            k1, v1 = alone[r].update(0, xr[..., a:b, :], xr[..., a:b, :] * 2, xr[..., :b, :], xr[..., :b, :] * 2)
            assert torch.equal(k_hat[r:r + 1], k1) and torch.equal(v_hat[r:r + 1], v1)
            assert not torch.equal(k1, xr[..., :b, :])  # quantized
    assert [h.bits_billed() for h in hooks] == [h.bits_billed() for h in alone]
    with pytest.raises(ValueError, match="2 hooks"):
        E.RowsHook(hooks).update(0, x[:1], x[:1], x[:1], x[:1])


def test_exp5_text_is_the_pinned_pydoc_topics_and_a_change_is_one_line() -> None:
    """The text is the listed topics of this Python's ``pydoc_data.topics`` (hashed here independently with
    hashlib), and any edit of it stops with one line naming the Python."""
    import hashlib
    from pydoc_data.topics import topics

    from kvqbench.data import text as T

    joined = "\n\n".join(topics[t].strip() for t in T.TOPICS)
    assert hashlib.sha256(joined.encode("utf-8")).hexdigest() == T.TEXT_SHA256 == hashlib.sha256(
        T.load_text().encode()).hexdigest()
    with pytest.raises(T.TextMismatchError) as err:
        T.check_text(joined.replace("assert", "assure", 1), {t: topics[t] for t in T.TOPICS[1:]})
    msg = str(err.value)
    assert "\n" not in msg and "'assert' is missing" in msg and T.TEXT_SHA256[:16] in msg


@real
def test_windows_tile_the_text_and_share_one_exact_prompt(model) -> None:
    """Window i is tokens [i·W, (i+1)·W) of the text; the prompt cache of a window is the unquantized
    model's own cache after reading the prompt (equal to a fresh one-row run), whatever batch computed it."""
    cfg = E.CONFIG_BY_SIZE["smoke"]
    src = E.load_source(model="smollm2", window=cfg.window)
    ids = src.text_ids()
    assert src.text_window_ids(1) == ids[cfg.window:2 * cfg.window]
    with pytest.raises(ValueError, match="windows of 64"):
        src.text_window_ids(len(ids) // cfg.window)
    E._CACHE.clear()
    both = E.prompt_cache(src, [src.text_window_ids(0), src.text_window_ids(1)], cfg.prompt)
    keep = E._Keep()
    E.run_hidden_rows(src.net, [src.text_window_ids(1)], [(0, cfg.prompt)], keep)
    for (k, v), (k1, v1) in zip(both, (keep.kv[i] for i in sorted(keep.kv))):
        assert k.shape[0] == 2 and k.shape[-2] == cfg.prompt
        assert torch.equal(k[1:], k1) and torch.equal(v[1:], v1)


@real
def test_reference_is_kept_as_hidden_states_and_gives_the_uncached_values(model) -> None:
    """A window's cached reference is the unquantized stack of final hidden states, ``(2·(W − P),
    hidden_size)`` fp32 — not ``vocab`` logits per position — and a cell that reuses it, and the
    unquantized side of the metrics kept from it, gets the values of a cell that computes both afresh,
    bitwise."""
    cfg = E.CONFIG_BY_SIZE["smoke"]
    src = E.load_source(model="smollm2", window=cfg.window)
    E._CACHE.clear()
    E._SIDES.clear()
    cold = E.run_endtoend(create("rtn_token", 2, 2), src, 1, cfg)
    (sides,) = E._SIDES.values()
    assert [tuple(s.logits.shape) for s in sides] == [(cfg.window - 1 - cfg.prompt, src.net.config.vocab_size)] * 2
    stacks = [v for k, v in E._CACHE.items() if "reference stack" in k]
    hidden = int(src.net.config.hidden_size)
    assert [tuple(s.shape) for s in stacks] == [(len(cfg.regimes) * (cfg.window - cfg.prompt), hidden)]
    assert stacks[0].dtype == torch.float32
    warm = E.run_endtoend(create("rtn_token", 2, 2), src, 1, cfg)
    assert warm.metrics == cold.metrics and warm.extra == cold.extra
