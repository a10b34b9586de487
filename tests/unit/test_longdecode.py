"""Experiment 6 (long decode, free-running divergence, noise floor, passkey): the schedule, the metrics,
the text cache and the controls.

Tests marked ``real`` load SmolLM2 once per process (shared through ``load_model``'s cache) and run texts
of at most 64 tokens; they are skipped with the reason when the real-model dependencies are missing.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from realmodel import MISSING, Replay, check_decode_cache, real

from kvqbench.experiments import longdecode as LD
from kvqbench.experiments import longtext as LT
from kvqbench.experiments import passkey as PK
from kvqbench.experiments.endtoend import KVCacheHook
from kvqbench.quantizers import create

_MISSING = MISSING


#: the real tests' configuration: a 64-token text, one block after a 32-token prefill, one passkey length
SMALL = LT.LongDecodeConfig(length=64, prompt=16, prefill=32, block=32, bin=32, free_tokens=4, noise_draws=1,
                            passkey_lengths=(64,))


# ------------------------------------------------------------------------------------------------
# no model
def test_config_rejects_a_schedule_with_a_short_last_arrival() -> None:
    with pytest.raises(ValueError, match="multiple of block"):
        LT.LongDecodeConfig(length=100, prompt=16, prefill=32, block=32)
    with pytest.raises(ValueError, match="shorter than the text"):
        LT.LongDecodeConfig(length=64, prompt=64, prefill=32, block=32)
    with pytest.raises(ValueError, match="passkey_depths"):
        LT.LongDecodeConfig(passkey_depths=(0.5, 1.5))
    cfg = LT.LongDecodeConfig(length=128, prompt=16, prefill=64, block=32, free_tokens=8, passkey_lengths=(100,))
    assert cfg.chunks() == [(0, 64), (64, 96), (96, 128)] and cfg.scored() == (63, 127) and cfg.context == 136


def test_the_long_tier_decodes_at_least_2048_tokens_with_two_passkey_lengths_up_to_2048() -> None:
    long = LT.CONFIG_BY_SIZE["long"]
    assert long.length >= 2048 and len(long.passkey_lengths) >= 2 and max(long.passkey_lengths) >= 2048
    assert set(long.passkey_depths) == {0.1, 0.5, 0.9}
    smoke = LT.CONFIG_BY_SIZE["smoke"]
    assert smoke.length <= 512 and max(smoke.passkey_lengths) <= 512


def test_binned_means_are_the_means_of_each_bins_positions() -> None:
    first, width = 5, 4
    values = [float(first + i) for i in range(10)]  # value = position: a bin's mean is its middle position
    got = LD.binned(values, first, width)
    assert got["start"] == [5, 9, 13] and got["stop"] == [9, 13, 15]
    assert got["mean"] == [(a + b - 1) / 2 for a, b in zip(got["start"], got["stop"])]


def test_slope_per_1k_of_a_line_is_its_slope() -> None:
    first = 127
    values = [0.5 + 0.003 * (first + i) for i in range(300)]
    assert LD.slope_per_1k(values, first) == pytest.approx(3.0, rel=1e-9)
    with pytest.raises(ValueError):
        LD.slope_per_1k([1.0], 0)


def test_divergence_counts_tokens_until_the_first_difference() -> None:
    assert LD._divergence(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 9, 4])) == (2, 0.75)
    assert LD._divergence(torch.tensor([1, 2]), torch.tensor([1, 2])) == (2, 1.0)


def test_perturbed_hook_moves_each_element_by_a_fixed_relative_factor() -> None:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 10, 8, generator=g)
    v = torch.randn(1, 2, 10, 8, generator=g)
    rel = 1e-3  # large enough to see; the cells use 1e-7

    def run(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        h = LD.PerturbedHook(None, rel, seed)
        return [h.update(0, k[..., :6, :], v[..., :6, :], k[..., :6, :], v[..., :6, :]),
                h.update(0, k[..., 6:, :], v[..., 6:, :], k, v)]

    (k1, v1), (k2, v2) = run(3)
    assert torch.equal(k2[..., :6, :], k1) and torch.equal(v2[..., :6, :], v1)  # a token keeps its factor
    ratio = torch.cat([(k2 / k).flatten(), (v2 / v).flatten()]) - 1
    assert float(ratio.abs().max()) < 7 * rel and 0.5 * rel < float(ratio.std()) < 2 * rel
    assert torch.equal(run(3)[1][0], k2) and not torch.equal(run(4)[1][0], k2)


class _CharTokenizer:
    """One token per character (its code point): every digit of the text is a token of its own."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) for c in text]}


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_passkey_prompt_holds_its_key_once_at_its_depth_and_the_answer_last(depth) -> None:
    tok = _CharTokenizer()
    p = PK.passkey_prompt(tok, 900, depth, random.Random(1))
    text = "".join(chr(i) for i in p.ids)
    assert p.length == 900 and len(p.key) == 5 and p.key.isdigit()
    assert text.endswith("The pass key is " + p.key) and p.answer_tokens == 6  # " " + 5 digits
    assert text.count(p.key) == 2 and sum(c.isdigit() for c in text) == 10  # key sentence and answer only
    sentence = text.index(" The pass key is " + p.key + ".")
    assert sentence == p.key_at
    intro = len(PK._INTRO)
    filler = 900 - intro - len(" The pass key is " + p.key + ". Remember it.") - len(PK._QUESTION) - 6
    assert abs((p.key_at - intro) - depth * filler) <= max(len(s) for s in PK._FILLER)  # nearest sentence end


def test_passkey_prompts_derive_from_the_seed() -> None:
    tok = _CharTokenizer()
    a = PK.passkey_prompts(tok, 0, (300, 400), (0.1, 0.9))
    assert [p.length for p in a] == [300, 300, 400, 400] and [p.depth for p in a] == [0.1, 0.9, 0.1, 0.9]
    assert a == PK.passkey_prompts(tok, 0, (300, 400), (0.1, 0.9))
    assert [p.key for p in a] != [p.key for p in PK.passkey_prompts(tok, 1, (300, 400), (0.1, 0.9))]
    with pytest.raises(ValueError, match="too short"):
        PK.passkey_prompt(tok, 50, 0.5, random.Random(0))


@pytest.mark.parametrize("n_depths", [1, 2, 3, 5])
def test_consecutive_seeds_score_every_depth_of_every_length(n_depths) -> None:
    # any n_depths consecutive seeds (from any start) take each depth exactly once at each length
    for start in (0, 3, 17):
        for li in range(3):
            got = sorted(PK.scored_depth(s, li, n_depths) for s in range(start, start + n_depths))
            assert got == list(range(n_depths))
    # the long tier's four seeds cover the three depths of both lengths
    long = LT.CONFIG_BY_SIZE["long"]
    nd = len(long.passkey_depths)
    for li in range(len(long.passkey_lengths)):
        assert {PK.scored_depth(s, li, nd) for s in range(4)} == set(range(nd))


def test_answer_scores_are_log_probabilities_and_ranks() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0], [0.0, 2.0, 1.0, 5.0]])
    got = PK.answer_scores(logits, [0, 2])  # token 0 is top-1 in row 0; token 2 ranks behind 3 and 1 in row 1
    lp = torch.log_softmax(logits.double(), -1)
    assert got["ranks"] == [0, 2] and got["match"] is False
    assert got["logp_nats"] == pytest.approx(float(lp[0, 0] + lp[1, 2]), abs=1e-12)
    assert PK.answer_scores(logits, [0, 3])["match"] is True


def test_check_context_is_one_line() -> None:
    with pytest.raises(LT.ContextTooShortError) as e:
        LT.check_context("m", 4096, context=2048)
    assert str(e.value) == "model m has a context of 2048 tokens, shorter than the 4096 tokens the long-decode cells need"
    LT.check_context("m", 2048, context=2048)


# ------------------------------------------------------------------------------------------------
# the real model
@pytest.fixture(scope="module")
def src():
    if _MISSING is not None:
        pytest.skip(_MISSING)
    from kvqbench.experiments.endtoend import load_source

    torch.set_num_threads(1)
    return load_source(model="smollm2", window=64)


@real
def test_model_context_reads_the_models_own_config(src) -> None:
    assert LT.model_context("smollm2") == int(src.net.config.max_position_embeddings) >= 8192


@real
def test_the_text_is_generated_once_and_read_back_byte_identical(src, tmp_path, monkeypatch) -> None:
    cfg = dataclasses.replace(SMALL, length=24, prompt=16, prefill=16, block=8)
    ids = LT.long_text(src, 0, cfg, folder=tmp_path)
    (path,) = tmp_path.glob("text-*-T24-seed0-*.json")
    assert len(ids) == 24 and ids[:16] == src.window_ids(0)[:16]
    assert json.loads(path.read_text())["sha256"] == LT.ids_sha(ids)
    special = set(src.tokenizer.all_special_ids)
    assert not special & set(ids[16:])  # the text runs to T: no end-of-text token
    calls = []
    monkeypatch.setattr(LT, "sample_continuation", lambda *a, **k: calls.append(1) or [])
    assert LT.long_text(src, 0, cfg, folder=tmp_path) == ids and not calls  # read back, not generated
    monkeypatch.undo()
    obj = json.loads(path.read_text())
    obj["ids"][20] += 1  # a file that does not hold what its hash says is generated again: the same text
    path.write_text(json.dumps(obj))
    assert LT.long_text(src, 0, cfg, folder=tmp_path) == ids


@real
def test_the_cache_loops_pass_the_models_current_cache_argument(src) -> None:
    # transformers 5 renamed forward's `past_key_values` to `cache` and warns (removal announced) on the old
    # name: the generation and the teacher-forced loop must pass the name the model's forward declares
    import inspect
    import warnings

    ids = src.window_ids(0)[:8]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        assert len(LT.sample_continuation(src.net, ids, 10, seed=0)) == 10
        LD.decode(src.net, [ids], [(0, 4), (4, 8)], None, score=lambda a, lg: None)
    if "cache" in inspect.signature(src.net.forward).parameters:
        assert LD._cache_kwarg(src.net.forward) == "cache"


@real
def test_fp16_control_is_exact_in_every_regime(src) -> None:
    (res,) = LD.run_longdecode_rows([create("fp16", 16, 16)], src, [0], SMALL)
    m = res.metrics
    assert (m["long_kl_nats"], m["long_kl_last_quarter_nats"], m["long_top1_last_quarter"], m["long_dloss_nats"]) \
        == (0.0, 0.0, 1.0, 0.0)
    assert res.series["kl_curve"]["mean"] == [0.0] * len(res.series["kl_curve"]["mean"])
    assert res.extra["free_running"]["method"] == res.extra["free_running"]["reference"]
    assert m["free_first_divergence_tokens"] == SMALL.free_tokens and m["free_match_share"] == 1.0
    table = res.series["passkey"]
    assert m["passkey_logp_drop_nats"] == 0.0
    for li, j in enumerate(table["scored"]):  # the method scores the reference's prompt at the seed's depth
        assert j == PK.scored_depth(0, li, len(SMALL.passkey_depths))
        assert table["logp_nats"][li] == [table["logp_ref_nats"][li][j]]
        assert len(table["logp_ref_nats"][li]) == len(SMALL.passkey_depths)  # the reference scores every depth
    assert m["long_bits_billed"] == 16.0
    # the noise draw perturbs the exact cache: float noise alone, tiny but not zero
    assert 0.0 < res.extra["noise"]["per_draw"]["long_kl_nats"][0] < 1e-6


@real
def test_a_quantized_method_damages_the_long_decode(src) -> None:
    (res,) = LD.run_longdecode_rows([create("rtn_token", 2, 2)], src, [0], SMALL, passkey=False)
    m = res.metrics
    assert m["long_kl_nats"] > 0.1 and m["long_top1_last_quarter"] < 1.0
    assert m["long_kl_noise_sd_nats"] > 0.0 and "passkey_match" not in m
    assert res.extra["fp16_share_at_T"] == {"k": 0.0, "v": 0.0}


@real
def test_rtn_token_long_decode_equals_one_prefill_on_the_same_cache(src) -> None:
    """Per-token statistics and no fp16 window: the long decode quantizes every token as one prefill of the
    same text does. Checked in parts a rounding near-tie cannot break (the two schedules compute K/V with
    float noise between them):

    1. segment invariance — every layer's decoded cache equals one round trip of the very K/V it received;
    2. the two caches differ per element by at most the inputs' own difference plus one quantization step;
    3. the prefill's quantized cache, replayed through the long decode's schedule, gives the prefill's logits
       up to the schedule's own float noise (the unquantized model's decode-vs-prefill difference)."""
    cfg = SMALL
    ids = LT.long_text(src, 0, cfg)
    n_layers = src.n_layers
    m = create("rtn_token", 4, 4)

    def logits(chunks, hook) -> torch.Tensor:
        parts: list[torch.Tensor] = []
        LD.decode(src.net, [ids], chunks, hook, score=lambda a, lg: parts.append(lg[0]))
        return torch.cat(parts, 0)

    pre_hook = KVCacheHook([m] * n_layers, streaming=False)
    pre = logits([(0, cfg.length)], pre_hook)
    dec_hook = KVCacheHook([m] * n_layers, streaming=True)
    logits(cfg.chunks(), dec_hook)
    check_decode_cache(m, 4, dec_hook, pre_hook, n_layers)  # 1, 2

    replayed = logits(cfg.chunks(), Replay(pre_hook))
    noise = float((logits(cfg.chunks(), None) - logits([(0, cfg.length)], None)).abs().max())
    assert float((replayed - pre).abs().max()) <= 10 * noise + 1e-4  # 3
    assert float((pre - logits([(0, cfg.length)], None)).abs().max()) > 1e-2  # 4 bits does something
    assert [(s.start, s.stop) for s in dec_hook.k[0].segments] == cfg.chunks()


@real
def test_a_short_context_stops_before_any_text_is_generated(src, monkeypatch) -> None:
    monkeypatch.setattr(src.net.config, "max_position_embeddings", 64)
    monkeypatch.setattr(LD, "long_text", lambda *a, **k: pytest.fail("a text was generated"))
    with pytest.raises(LT.ContextTooShortError, match="context of 64 tokens, shorter than the 68 tokens"):
        LD.run_longdecode_rows([create("fp16", 16, 16)], src, [0], SMALL)


@real
def test_the_reference_keeps_hidden_states_and_gives_the_models_own_logits_bitwise(src) -> None:
    # the reference keeps a 32-position call's final hidden states (32 × 576 values, not 32 × 49 152
    # logits) and the 96-token prefill's one scored position as logits (49 152 values, not 96 × 576); the
    # LM head run on them again must give
    # what the model's own forward gives under the same schedule, bit for bit
    from transformers import DynamicCache

    cfg = LT.LongDecodeConfig(length=160, prompt=16, prefill=96, block=32, bin=32, free_tokens=2, noise_draws=0,
                              passkey_lengths=(64,))
    ids = (src.window_ids(0) + src.window_ids(1) + src.window_ids(2))[:cfg.length]
    LD._REFS.clear()
    ref = LD._reference(src, ids, cfg)
    assert {a: kind for a, (kind, _) in ref.parts.items()} == {0: "logits", 96: "hidden", 128: "hidden"}
    cache, kw = DynamicCache(), LD._cache_kwarg(src.net.forward)
    x = torch.tensor([ids])
    a0, b0 = cfg.scored()
    for a, b in cfg.chunks():
        with torch.no_grad():
            lg = src.net(input_ids=x[:, a:b], position_ids=torch.arange(a, b)[None], use_cache=True,
                         **{kw: cache}).logits.float()
        lo, hi = max(a, a0), min(b, b0)
        assert torch.equal(ref.logits(a, lo, hi), lg[0, lo - a:hi - a])
    assert int(ref.free[0]) == int(lg[0, -1].argmax())
