"""Linear-attention state ops on CUDA at Kimi-Linear geometry (32 heads, 128 x 128 fp32 states, a conv over
3*32*128 channels with kernel 4, bf16 activations) against the pure-torch references.

The kernels must compile, not run in the interpreter: tests/conftest.py leaves TRITON_INTERPRET unset where
CUDA exists, and these tests skip if it is set to 1."""

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1 would run the kernels in the interpreter"),
]

from unimem_compile.ops import conv as cv  # noqa: E402
from unimem_compile.ops import kda  # noqa: E402
from unimem_compile.ops import state as st  # noqa: E402
from unimem_compile.pool import ArenaLayout, LinearStateSpec, UnifiedPool, state_views  # noqa: E402

H, D, CONV_K = 32, 128, 4
C = 3 * H * D
SCALE = D ** -0.5
LAYER = 1
DEV = "cuda"


@pytest.fixture(scope="module")
def pool():
    """Two KDA layers per slot (pitch 2 x (2 MiB + 96 KiB), not 2 MiB); live slots scattered by
    alloc/free/compaction; random finite states, random bytes in the padding, one tombstone."""
    gen = torch.Generator(device=DEV).manual_seed(7)
    spec = LinearStateSpec.kda(2, H, D, CONV_K, torch.bfloat16)
    p = UnifiedPool(ArenaLayout.for_capacity(None, spec, 64, 0, 40), DEV)
    ids = p.alloc_slots(30)
    p.free_slots(ids[0:20:3])
    p.compact("state")
    ids = [s for s in ids if s not in ids[0:20:3]] + p.alloc_slots(6)
    floor = p.layout.sink_floor
    p.arena[floor:] = torch.randint(0, 256, (p.arena.numel() - floor,), dtype=torch.uint8, device=DEV, generator=gen)
    for layer in range(spec.layer_num):
        for view in state_views(p.arena, p.layout, layer):
            live = view[p.layout.first_slot:]
            live.copy_((torch.randn(live.shape, device=DEV, generator=gen) * 0.5).to(view.dtype))
    dead = ids.pop(5)
    p.free_slots([dead])
    p.test_ids, p.test_dead, p.test_spec = ids, dead, spec
    return p


def _lanes(pool, n_live):
    ids = pool.test_ids
    lanes = ids[:n_live][::-1] + [-1, pool.test_dead, 0]
    return torch.tensor(lanes, device=DEV)


def _inputs(b, t, gen):
    q = torch.randn(b, t, H, D, device=DEV, generator=gen).bfloat16()
    k = torch.randn(b, t, H, D, device=DEV, generator=gen).bfloat16()
    v = torch.randn(b, t, H, D, device=DEV, generator=gen).bfloat16()
    g = -torch.rand(b, t, H, D, device=DEV, generator=gen) * 1.5 - 0.01
    beta = torch.rand(b, t, H, device=DEV, generator=gen).bfloat16()
    return q, k, v, g, beta


def _live_mask(pool, lanes):
    return torch.tensor([s >= 0 and s not in (0, pool.test_dead) for s in lanes.tolist()], device=DEV)


def test_gather_and_scatter_are_bit_exact_against_the_reference(pool):
    spec, lanes = pool.test_spec, _lanes(pool, 20)
    for off, shape, dtype in ((spec.recurrent_offset(LAYER), [H, D, D], torch.float32),
                              (spec.conv_offset(LAYER), [C, CONV_K], torch.bfloat16)):
        got = torch.ops.unimem.state_gather(pool.arena, pool.s_v2p, lanes, off, spec.slot_bytes, shape, dtype)
        want = st.gather_sections(pool.arena, pool.s_v2p, lanes, off, spec.slot_bytes, shape, dtype)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        value = torch.randn(got.shape, device=DEV).to(dtype)
        a_kernel, a_ref = pool.arena.clone(), pool.arena.clone()
        torch.ops.unimem.state_scatter(a_kernel, pool.s_v2p, lanes, value, off, spec.slot_bytes)
        st.scatter_sections(a_ref, pool.s_v2p, lanes, value, off, spec.slot_bytes)
        assert torch.equal(a_kernel, a_ref)


def test_kda_decode_bf16_matches_the_fp32_reference_and_touches_only_live_states(pool):
    gen = torch.Generator(device=DEV).manual_seed(1)
    spec, lanes = pool.test_spec, _lanes(pool, 24)
    q, k, v, g, beta = (t[:, 0] for t in _inputs(lanes.numel(), 1, gen))
    off = spec.recurrent_offset(LAYER)
    init = st.gather_sections(pool.arena, pool.s_v2p, lanes, off, spec.slot_bytes, [H, D, D], torch.float32)
    want_o, want_s = kda.kda_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], init, SCALE, True)
    arena = pool.arena.clone()
    out = torch.ops.unimem.kda_decode(q, k, v, g, beta, arena, pool.s_v2p, lanes, off, spec.slot_bytes, SCALE, True)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want_o[:, 0].float(), atol=2e-2, rtol=2e-2)
    got_s = st.gather_sections(arena, pool.s_v2p, lanes, off, spec.slot_bytes, [H, D, D], torch.float32)
    live = _live_mask(pool, lanes)
    torch.testing.assert_close(got_s[live], want_s[live], atol=1e-4, rtol=1e-4)
    # everything else in the arena is byte-identical: rebuild the expectation by scattering the new states
    expected = pool.arena.clone()
    st.scatter_sections(expected, pool.s_v2p, lanes, got_s, off, spec.slot_bytes)
    assert torch.equal(arena, expected)


def test_conv_update_bf16_matches_transformers(pool):
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    gen = torch.Generator(device=DEV).manual_seed(2)
    spec, lanes = pool.test_spec, _lanes(pool, 24)
    x = torch.randn(lanes.numel(), C, device=DEV, generator=gen).bfloat16()
    w = (torch.randn(C, CONV_K, device=DEV, generator=gen) * 0.5).bfloat16()
    b = torch.randn(C, device=DEV, generator=gen).bfloat16()
    off = spec.conv_offset(LAYER)
    state = st.gather_sections(pool.arena, pool.s_v2p, lanes, off, spec.slot_bytes, [C, CONV_K], torch.bfloat16)
    want = hf.causal_conv1d_update(x[:, :, None], state.clone(), w, b, "silu")[:, :, 0]
    ref_out, ref_state = cv.causal_conv1d_step(x, state, w, b, "silu")
    arena = pool.arena.clone()
    out = torch.ops.unimem.causal_conv1d_update(x, arena, pool.s_v2p, lanes, off, spec.slot_bytes, w, b, "silu")
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    expected = pool.arena.clone()
    st.scatter_sections(expected, pool.s_v2p, lanes, ref_state, off, spec.slot_bytes)
    assert torch.equal(arena, expected)


@pytest.mark.parametrize("use_fla", [False, True])
def test_prefill_then_decode_matches_the_recurrence(pool, use_fla):
    if use_fla and kda.fla_chunk_kda() is None:
        pytest.skip("flash-linear-attention is not installed")
    gen = torch.Generator(device=DEV).manual_seed(3)
    spec = pool.test_spec
    lanes = _lanes(pool, 4)
    prompt, steps = 300, 4
    q, k, v, g, beta = _inputs(lanes.numel(), prompt + steps, gen)
    off = spec.recurrent_offset(LAYER)
    init = st.gather_sections(pool.arena, pool.s_v2p, lanes, off, spec.slot_bytes, [H, D, D], torch.float32)
    want_o, want_s = kda.kda_recurrent(q, k, v, g, beta, init, SCALE, True)
    arena = pool.arena.clone()
    args = (arena, pool.s_v2p, lanes, off, spec.slot_bytes, SCALE, True)
    head = kda.kda_prefill_cuda(q[:, :prompt], k[:, :prompt], v[:, :prompt], g[:, :prompt], beta[:, :prompt], *args,
                                use_fla=use_fla)
    tail = [torch.ops.unimem.kda_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], *args)
            for t in range(prompt, prompt + steps)]
    live = _live_mask(pool, lanes)
    got = torch.cat([head, torch.stack(tail, 1)], 1)
    # fla's chunk kernels run their matmuls on bf16 operands; a misplaced state would be off by O(1)
    tol_o = dict(atol=5e-2, rtol=5e-2) if use_fla else dict(atol=2e-2, rtol=2e-2)
    tol_s = dict(atol=5e-2, rtol=5e-2) if use_fla else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got[live].float(), want_o[live].float(), **tol_o)
    got_s = st.gather_sections(arena, pool.s_v2p, lanes, off, spec.slot_bytes, [H, D, D], torch.float32)
    torch.testing.assert_close(got_s[live], want_s[live], **tol_s)


def test_graphed_fla_chunk_matches_eager_fla_for_calls_of_any_length(monkeypatch):
    """ops/kda_graphs: every call (long then short, so stale buffer tails must be zeroed; two batch sizes)
    against fla run eagerly on the same inputs; a graph pads with a zero tail, which fla's masked last chunk
    reads as zeros too, so the two agree to fla's own run-to-run rounding."""
    from unimem_compile.ops.kda_graphs import ChunkKDAGraphs

    chunk = kda.fla_chunk_kda()
    if chunk is None:
        pytest.skip("flash-linear-attention is not installed")
    graphs = ChunkKDAGraphs()
    gen = torch.Generator(device=DEV).manual_seed(11)
    calls = [(1, 1000), (1, 300), (1, 1024), (1, 37), (2, 1000), (1, 1000), (2, 64), (1, 4096)]
    worst_o = worst_s = 0.0
    for b, t in calls:
        q, k, v, g, beta = _inputs(b, t, gen)
        state = torch.randn(b, H, D, D, device=DEV, generator=gen) * 0.5
        before = state.clone()
        o, final = graphs(chunk, q, k, v, g, beta, state, SCALE, True)
        want_o, want_s = chunk(q, k, v, g, beta, scale=SCALE, initial_state=state, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
        assert o.shape == want_o.shape and final.shape == want_s.shape
        worst_o = max(worst_o, (o.float() - want_o.float()).abs().max().item())
        worst_s = max(worst_s, (final.float() - want_s.float()).abs().max().item())
        assert torch.equal(state, before)
    # a state misplaced or a stale tail read would be off by O(1); bf16 outputs round at ~1e-2
    assert worst_o <= 2e-2 and worst_s <= 1e-3, (worst_o, worst_s)
    # one graph per (rows, bucket): (1, 1024) (1, 512) (1, 64) (2, 1024) (2, 64) (1, 4096)
    assert graphs.captures == len(graphs) == 6 and graphs.replays == len(calls)
    monkeypatch.setenv("UNIMEM_KDA_GRAPHS", "0")
    assert graphs(chunk, q, k, v, g, beta, state, SCALE, True) is None  # switched off: the caller runs fla
    graphs.clear()


def test_decode_and_conv_compile_with_inductor(pool):
    gen = torch.Generator(device=DEV).manual_seed(4)
    spec, lanes = pool.test_spec, _lanes(pool, 8)
    w = (torch.randn(C, CONV_K, device=DEV, generator=gen) * 0.5).bfloat16()
    g = -torch.rand(lanes.numel(), H, D, device=DEV, generator=gen)
    beta = torch.rand(lanes.numel(), H, device=DEV, generator=gen).bfloat16()
    x = torch.randn(lanes.numel(), C, device=DEV, generator=gen).bfloat16()

    def step(arena, s_v2p, slots, x, g, beta):
        mixed = torch.ops.unimem.causal_conv1d_update(x, arena, s_v2p, slots, spec.conv_offset(LAYER), spec.slot_bytes,
                                                      w, None, "silu")
        q, k, v = (t.reshape(-1, H, D) for t in mixed.split([H * D] * 3, -1))
        return torch.ops.unimem.kda_decode(q, k, v, g, beta, arena, s_v2p, slots, spec.recurrent_offset(LAYER),
                                           spec.slot_bytes, SCALE, True)

    eager_arena, compiled_arena = pool.arena.clone(), pool.arena.clone()
    want = step(eager_arena, pool.s_v2p, lanes, x, g, beta)
    got = torch.compile(step, fullgraph=True)(compiled_arena, pool.s_v2p, lanes, x, g, beta)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(compiled_arena, eager_arena)
