"""The pseudo-decode simulator: streaming rules, fp16 windows and their billing (independent counts)."""

import pytest
import torch

from kvqbench.data.synthetic import make_synthetic
from kvqbench.experiments.accumulation import AccumulationConfig, run_accumulation
from kvqbench.experiments.streaming import Stream, quantized_boundary, simulate_stream
from kvqbench.quantizers import create
from kvqbench.quantizers.base import StreamPolicy


def _x(t=256, seed=0, b=1, h=2, d=32):
    return torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("block", [16, 24, 64])
def test_kivi_keeps_at_most_r_fp16_tokens_and_is_billed_for_them(block):
    r, g, d = 64, 32, 32
    x = _x(t=256, d=d)
    m = create("kivi", 2, 2, group_size=g, residual_tokens=r)
    elems = x.shape[0] * x.shape[1] * d
    for kind in ("k", "v"):
        s = simulate_stream(m, x, kind, block=block)
        for length in s.lengths:
            fp16 = s.fp16_tokens(length)
            assert fp16 <= r
            assert fp16 == (min(length, r) if kind == "v" else (length - 1) % r + 1)
            n_q = length - fp16
            # KIVI k2 at group G: 2-bit codes + an fp16 scale and an fp16 zero per group of G values
            expected = n_q * elems * (2 + 32 / g) + fp16 * elems * 16
            assert s.stored_bits(length) == pytest.approx(expected, rel=1e-12)
            st = s.state(x, length)
            assert torch.equal(st[..., n_q:, :], x[..., n_q:length, :])  # the window is exact fp16
            if n_q:
                assert not torch.equal(st[..., :n_q, :], x[..., :n_q, :])


def test_kivi_at_t_le_r_equals_fp16_exactly():
    r = 128
    data = make_synthetic(seed=0, batch=1, kv_heads=2, q_heads=4, seq_len=r, head_dim=32)
    m = create("kivi", 2, 2, group_size=32, residual_tokens=r)
    for kind, x in (("k", data.k), ("v", data.v)):
        s = simulate_stream(m, x, kind, block=32)
        for length in s.lengths:
            assert torch.equal(s.state(x, length), x[..., :length, :])
            assert s.effective_bits(length) == 16.0
        assert not s.segments
    res = run_accumulation(m, data, AccumulationConfig(n_lengths=4, n_queries=8, block=32, regimes=("decode",)))
    assert all(v == 0.0 for k, v in res.metrics.items() if "bits" not in k)
    assert res.metrics["decode_bits_effective"] == 16.0


def test_default_policy_quantizes_each_arriving_block():
    x = _x(t=100)
    m = create("rtn_token", 3, 3)
    s = simulate_stream(m, x, "k", block=32)
    assert s.lengths == [32, 64, 96, 100]
    assert [(sg.start, sg.stop) for sg in s.segments] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    for sg in s.segments:
        ref = m.roundtrip(x[..., sg.start : sg.stop, :].contiguous(), "k")
        assert torch.equal(s.x_hat[..., sg.start : sg.stop, :], ref)
    assert all(s.fp16_tokens(length) == 0 for length in s.lengths)


def test_per_channel_blocks_differ_from_static():
    # a per-channel method quantizes each block with the block's own statistics
    x = _x(t=128)
    m = create("rtn_channel", 2, 2)
    s = simulate_stream(m, x, "k", block=32)
    assert not torch.equal(s.state(x, 128), m.roundtrip(x, "k"))


def test_tiles_and_sink_kvarn_policy():
    x = _x(t=384, d=32)
    m = create("kvarn", 2, 2)
    pol = m.stream_policy("k")
    assert pol.sink_tokens == 128 and pol.tile_tokens == m.group_size
    s = simulate_stream(m, x, "k", block=48)
    for length in s.lengths:
        sink = min(128, length)
        partial = (length - sink) % pol.tile_tokens if length > sink else 0
        assert s.fp16_tokens(length) == sink + partial
    for sg in s.segments:
        assert sg.stop - sg.start == pol.tile_tokens and (sg.start - 128) % pol.tile_tokens == 0


def test_sliding_window_with_tiles_and_sink():
    pol = StreamPolicy(sink_tokens=8, residual_tokens=16, residual_mode="sliding", tile_tokens=32)
    # released tokens [8, L−16) are quantized whole tiles at a time, tiles aligned at the sink
    assert quantized_boundary(pol, 8) == 8
    assert quantized_boundary(pol, 40) == 8  # released 24 < one tile
    assert quantized_boundary(pol, 56) == 40
    assert quantized_boundary(pol, 100) == 72
    m = create("rtn_token", 2, 2)
    x = _x(t=120)
    s = simulate_stream(m, x, "v", block=8, policy=pol)
    assert [(sg.start, sg.stop) for sg in s.segments] == [(8, 40), (40, 72), (72, 104)]
    assert s.fp16_tokens(120) == 8 + 120 - 104


def test_chunk_mode_releases_after_the_next_token():
    pol = StreamPolicy(residual_tokens=64, residual_mode="chunk")
    assert [quantized_boundary(pol, n) for n in (1, 64, 65, 128, 129, 200)] == [0, 0, 64, 64, 128, 192]


def test_errors():
    m = create("rtn_token", 2, 2)
    x = _x(t=64)
    with pytest.raises(ValueError, match="block"):
        simulate_stream(m, x, "k", block=0)
    s = simulate_stream(m, x, "k", block=16)
    with pytest.raises(ValueError, match="arrival"):
        s.boundary(10)


@pytest.mark.parametrize("policy", [StreamPolicy(), StreamPolicy(sink_tokens=4, residual_tokens=8, residual_mode="sliding"),
                                    StreamPolicy(tile_tokens=16)])
def test_fork_holds_what_a_stream_fed_the_same_arrivals_holds(policy) -> None:
    """A fork of a no-rules stream after its first arrival, fed the later arrivals, equals a stream under the
    fork's rules that received every arrival itself (a copy where the rules are the same, a replay where they
    differ; per-tensor RTN, so each segment's boundaries show in its values), and the original stays as it was."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 40, 8)
    m = create("rtn_tensor", 2, 2)
    first = Stream(m, "k", StreamPolicy())
    first.extend(x[..., :24, :])
    before = first.x_hat.clone()
    fork, alone = first.fork(policy), Stream(m, "k", policy)
    alone.extend(x[..., :24, :])
    for a, b in ((24, 32), (32, 40)):
        fork.extend(x[..., a:b, :])
        alone.extend(x[..., a:b, :])
    assert torch.equal(fork.x_hat, alone.x_hat) and not torch.equal(fork.x_hat, x)
    assert (fork.segments, fork.boundaries, fork.lengths) == (alone.segments, alone.boundaries, alone.lengths)
    assert first.length == 24 and torch.equal(first.x_hat, before)
