"""ops/kda_graphs.py on the CPU: the buckets, the zero tail the graphs pad with (a no-op on the reference
math), and the static-buffer handling (``capture=False`` runs the same copies and padding without a CUDA
graph) against unpadded calls. The captured graphs themselves run in tests/gpu/test_state_gpu.py."""

import os

import pytest
import torch

from unimem_compile.ops import kda
from unimem_compile.ops import kda_graphs
from unimem_compile.ops.kda_graphs import BUCKETS, GRAPHS, MAX_GRAPH_TOKENS, ChunkKDAGraphs, bucket_for

H, K, V = 2, 16, 8
SCALE = K ** -0.5
TOL = dict(atol=1e-5, rtol=1e-5)  # fp32 reference math; padding changes the chunk layout only past T


def _inputs(b, t, gen):
    """Kimi-Linear-like KDA inputs: log-decays g < 0, beta in (0, 1), a non-zero initial state."""
    q = torch.randn(b, t, H, K, generator=gen)
    k = torch.randn(b, t, H, K, generator=gen)
    v = torch.randn(b, t, H, V, generator=gen)
    g = -torch.rand(b, t, H, K, generator=gen) * 1.5 - 0.01
    beta = torch.rand(b, t, H, generator=gen)
    state = torch.randn(b, H, K, V, generator=gen)
    return q, k, v, g, beta, state


def _fla_like(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    """The reference behind fla's ``chunk_kda`` keyword signature (what the graphs call)."""
    assert output_final_state
    return kda.kda_chunked(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel)


def test_buckets_are_whole_fla_chunks_and_the_smallest_that_holds_the_call():
    assert all(b % 64 == 0 for b in BUCKETS) and list(BUCKETS) == sorted(BUCKETS)
    assert [bucket_for(1, t) for t in (1, 64, 65, 1000, 1024, 1025, 4096)] == [64, 64, 128, 1024, 1024, 2048, 4096]
    assert bucket_for(1, 4097) is None  # longer than every bucket
    assert bucket_for(2, 2048) == 2048 and bucket_for(3, 2048) is None  # 3 x 2048 > MAX_GRAPH_TOKENS
    assert bucket_for(MAX_GRAPH_TOKENS // 64, 10) == 64 and bucket_for(MAX_GRAPH_TOKENS // 64 + 1, 10) is None
    assert bucket_for(0, 10) is None and bucket_for(1, 0) is None


@pytest.mark.parametrize("t,tb", [(1, 64), (37, 64), (100, 128), (130, 256)])
@pytest.mark.parametrize("l2norm", [True, False])
def test_a_zero_tail_leaves_outputs_and_final_state_unchanged(t, tb, l2norm):
    gen = torch.Generator().manual_seed(t * 7 + l2norm)
    q, k, v, g, beta, state = _inputs(2, t, gen)
    want_o, want_s = kda.kda_chunked(q, k, v, g, beta, state, SCALE, l2norm)
    pad = [torch.cat([x, x.new_zeros((2, tb - t, *x.shape[2:]))], 1) for x in (q, k, v, g, beta)]
    got_o, got_s = kda.kda_chunked(*pad, state, SCALE, l2norm)
    torch.testing.assert_close(got_o[:, :t], want_o, **TOL)
    torch.testing.assert_close(got_s, want_s, **TOL)
    assert not torch.equal(want_s, state)  # the real tokens moved the state: the check can fail


def test_static_buffers_serve_calls_of_any_length_in_any_order():
    graphs = ChunkKDAGraphs(capture=False)
    gen = torch.Generator().manual_seed(3)
    calls = [(1, 100), (1, 30), (1, 128), (1, 1), (2, 100), (1, 100), (2, 7), (2, 64)]
    for b, t in calls:  # a long call then a shorter one: stale inputs past T must be zeroed
        q, k, v, g, beta, state = _inputs(b, t, gen)
        before = state.clone()
        got = graphs(_fla_like, q, k, v, g, beta, state, SCALE, True)
        assert got is not None
        want_o, want_s = kda.kda_chunked(q, k, v, g, beta, state, SCALE, True)
        torch.testing.assert_close(got[0], want_o, **TOL)
        torch.testing.assert_close(got[1], want_s, **TOL)
        assert torch.equal(state, before)  # the caller's state is not modified
    # one entry per (rows, bucket): (1, 128) (1, 64) (2, 128) (2, 64)
    assert len(graphs) == 4 and graphs.replays == len(calls) and graphs.captures == 0
    # inputs q k g v beta and the output o per token, two states per row; all fp32 here
    assert graphs.nbytes() == sum(4 * b * tb * H * (3 * K + 2 * V + 1) + 2 * 4 * b * H * K * V
                                  for b, tb in [(1, 128), (1, 64), (2, 128), (2, 64)])
    graphs.clear()
    assert len(graphs) == 0


def test_outputs_are_fresh_tensors_not_views_of_the_buffers():
    graphs = ChunkKDAGraphs(capture=False)
    gen = torch.Generator().manual_seed(4)
    first = _inputs(1, 64, gen)
    o1, s1 = graphs(_fla_like, *first, SCALE, True)
    keep_o, keep_s = o1.clone(), s1.clone()
    graphs(_fla_like, *_inputs(1, 64, gen), SCALE, True)  # the same entry, other values
    assert torch.equal(o1, keep_o) and torch.equal(s1, keep_s)


def test_calls_that_take_the_eager_path():
    graphs = ChunkKDAGraphs(capture=False)
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta, state = _inputs(1, 4097, gen)  # past the largest bucket
    assert graphs(_fla_like, q, k, v, g, beta, state, SCALE, True) is None
    q, k, v, g, beta, state = _inputs(1, 16, gen)
    q.requires_grad_(True)
    assert graphs.eligible(q, k, v, g, beta, state) is None  # autograd records: never through a graph
    with torch.no_grad():
        assert graphs.eligible(q, k, v, g, beta, state) == 64
    assert GRAPHS.eligible(q.detach(), k) is None  # the process's graphs capture: CPU tensors run eagerly
    assert len(graphs) == 0


def test_a_capture_that_raises_leaves_its_shape_eager_and_is_not_retried(monkeypatch, caplog):
    graphs = ChunkKDAGraphs(capture=False)
    tries = []

    def failing_build(*args):
        tries.append(args[3])  # the bucket
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(graphs, "_build", failing_build)
    gen = torch.Generator().manual_seed(6)
    with caplog.at_level("WARNING", logger="unimem_compile.ops.kda_graphs"):
        assert graphs(_fla_like, *_inputs(1, 40, gen), SCALE, True) is None
        assert graphs(_fla_like, *_inputs(1, 50, gen), SCALE, True) is None  # same key: not captured again
    assert tries == [64] and len(graphs) == 0 and graphs.replays == 0
    assert "1 rows x 64 tokens failed" in caplog.text and "simulated" in caplog.text


def test_buffers_made_under_inference_mode_serve_a_later_call_outside_it():
    graphs = ChunkKDAGraphs(capture=False)
    gen = torch.Generator().manual_seed(7)
    first, second = _inputs(1, 40, gen), _inputs(1, 50, gen)
    with torch.inference_mode():  # the engine keeps its caller's mode: the first prefill may build the buffers here
        graphs(_fla_like, *first, SCALE, True)
    with torch.no_grad():
        o, final = graphs(_fla_like, *second, SCALE, True)
    want_o, want_s = kda.kda_chunked(*second, SCALE, True)
    torch.testing.assert_close(o, want_o, **TOL)
    torch.testing.assert_close(final, want_s, **TOL)
    assert graphs.replays == 2 and len(graphs) == 1


def test_a_graph_past_the_byte_cap_is_not_built(monkeypatch):
    graphs = ChunkKDAGraphs(capture=False)
    gen = torch.Generator().manual_seed(8)
    graphs(_fla_like, *_inputs(1, 64, gen), SCALE, True)
    held = graphs.nbytes()
    one_more = 4 * 128 * H * (3 * K + 2 * V + 1) + 2 * 4 * H * K * V  # the (1, 128) graph
    monkeypatch.setattr(kda_graphs, "MAX_GRAPH_BYTES", held + one_more - 1)
    assert graphs(_fla_like, *_inputs(1, 100, gen), SCALE, True) is None  # would pass the cap by one byte
    assert graphs(_fla_like, *_inputs(1, 30, gen), SCALE, True) is not None  # a graph it holds still serves
    monkeypatch.setattr(kda_graphs, "MAX_GRAPH_BYTES", held + one_more)
    assert graphs(_fla_like, *_inputs(1, 100, gen), SCALE, True) is not None
    assert graphs.nbytes() == held + one_more and len(graphs) == 2


def test_an_override_of_the_switch_puts_back_what_the_caller_had(monkeypatch):
    """env.overridden (the benchmarks' A/B columns): inside the block the graphs are off; after it, an unset
    variable is unset again and a set one keeps its value, also when the block raises."""
    from unimem_compile import env

    monkeypatch.delenv(env.KDA_GRAPHS, raising=False)
    with env.overridden(env.KDA_GRAPHS, "0"):
        assert not env.kda_graphs()
    assert env.KDA_GRAPHS not in os.environ and env.kda_graphs()
    monkeypatch.setenv(env.KDA_GRAPHS, "0")
    with pytest.raises(RuntimeError, match="inside"):
        with env.overridden(env.KDA_GRAPHS, "1"):
            assert env.kda_graphs()
            raise RuntimeError("inside")
    assert os.environ[env.KDA_GRAPHS] == "0" and not env.kda_graphs()
