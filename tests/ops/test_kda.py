"""kda_decode / kda_prefill on arena slots: the references against transformers' Kimi-Linear
recurrent_kimi_delta_attention / chunk_kimi_delta_attention, and the ops (pure torch) and launchers (Triton
under the interpreter) against them, on slots scattered in an arena whose pitch is not H*K*V*4."""

import warnings

import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as hf

from unimem_compile.errors import GeometryError
from unimem_compile.ops import kda
from unimem_compile.pool import LinearStateSpec, state_views

from .slot_pools import physical_slot, scattered_slot_pool

H, K, V = 2, 16, 8
LAYER = 1
SCALE = K ** -0.5  # transformers' functions always use 1/sqrt(K)
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}

DECODE = {"op": torch.ops.unimem.kda_decode, "triton": kda.kda_decode_triton}
PREFILL = {"op": torch.ops.unimem.kda_prefill, "launcher": kda.kda_prefill_cuda}


def _inputs(b, t, gen, dtype=torch.float32):
    """Random KDA inputs ``[B, T, H, *]`` as Kimi-Linear produces them: log-decays g < 0, beta in (0, 1)."""
    q = torch.randn(b, t, H, K, generator=gen).to(dtype)
    k = torch.randn(b, t, H, K, generator=gen).to(dtype)
    v = torch.randn(b, t, H, V, generator=gen).to(dtype)
    g = -torch.rand(b, t, H, K, generator=gen) * 1.5 - 0.01
    beta = torch.rand(b, t, H, generator=gen).to(dtype)
    return q, k, v, g, beta


def _pool(gen):
    """Scattered live slots, a pitch that is not H*K*V*4; returns (pool, spec, live virtual ids, a tombstone)."""
    spec = LinearStateSpec.kda(2, H, K, 4, torch.float16, v_head_dim=V)
    assert spec.slot_bytes != H * K * V * 4
    pool, ids, dead = scattered_slot_pool(spec, gen, 8, slice(0, 5, 2), 3)
    return pool, spec, ids, dead


def _states(arena, pool):
    return state_views(arena, pool.layout, LAYER)[1]


def _section_mask(pool, spec, lanes):
    """True on the arena bytes of the live lanes' recurrent sections in LAYER."""
    mask = torch.zeros(pool.arena.numel(), dtype=torch.bool)
    for s in lanes.tolist():
        p = physical_slot(pool, s)
        if p > 0:
            start = p * spec.slot_bytes + spec.recurrent_offset(LAYER)
            mask[start:start + H * K * V * 4] = True
    return mask


# ---------------------------------------------------------------------------- references
@pytest.mark.parametrize("use_l2", [True, False])
def test_references_match_transformers_recurrent_and_chunked(use_l2, gen):
    q, k, v, g, beta = _inputs(2, 83, gen)  # two 64-token chunks, the second partial
    if not use_l2:
        k = k * K ** -0.5  # unit-size keys keep the delta rule contractive, as the l2norm does
    s0 = torch.randn(2, H, K, V, generator=gen)
    want_o, want_s = hf.recurrent_kimi_delta_attention(q, k, v, g, beta, s0.clone(), True, use_qk_l2norm_in_kernel=use_l2)
    chunk_o, chunk_s = hf.chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=s0.clone(), output_final_state=True,
                                                     use_qk_l2norm_in_kernel=use_l2)
    for o, s in (kda.kda_recurrent(q, k, v, g, beta, s0, SCALE, use_l2), kda.kda_chunked(q, k, v, g, beta, s0, SCALE, use_l2),
                 (chunk_o, chunk_s)):
        torch.testing.assert_close(o, want_o, **TOL[torch.float32])
        torch.testing.assert_close(s, want_s, **TOL[torch.float32])


def test_chunked_reference_matches_recurrence_for_any_scale_chunk_and_strong_decay(gen):
    q, k, v, g, beta = _inputs(1, 40, gen)
    g = g * 30  # per-token decays down to exp(-45): a factorised exp(G_t) * exp(-G_s) would overflow
    s0 = torch.randn(1, H, K, V, generator=gen)
    want_o, want_s = kda.kda_recurrent(q, k, v, g, beta, s0, 0.37, True)
    for chunk in (1, 7, 16, 64):
        o, s = kda.kda_chunked(q, k, v, g, beta, s0, 0.37, True, chunk_size=chunk)
        assert torch.isfinite(o).all()
        torch.testing.assert_close(o, want_o, **TOL[torch.float32])
        torch.testing.assert_close(s, want_s, **TOL[torch.float32])


# ---------------------------------------------------------------------------- decode
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("impl", ["op", "triton"])
def test_decode_matches_transformers_step_and_updates_only_live_sections(impl, dtype, gen):
    pool, spec, ids, dead = _pool(gen)
    lanes = torch.tensor([ids[4], -1, ids[0], dead, ids[2], 0, ids[5]])
    q, k, v, g, beta = _inputs(lanes.numel(), 1, gen, dtype)
    before = _states(pool.arena, pool)
    init = torch.stack([before[physical_slot(pool, s)] if physical_slot(pool, s) > 0 else torch.zeros(H, K, V) for s in lanes.tolist()])
    want_o, want_s = hf.recurrent_kimi_delta_attention(q, k, v, g, beta, init.clone(), True, use_qk_l2norm_in_kernel=True)

    arena = pool.arena.clone()
    out = DECODE[impl](q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], arena, pool.s_v2p, lanes,
                       spec.recurrent_offset(LAYER), spec.slot_bytes, SCALE, True)
    assert out.dtype == dtype and out.shape == (lanes.numel(), H, V)
    torch.testing.assert_close(out, want_o[:, 0], **TOL[dtype])
    after = _states(arena, pool)
    for b, s in enumerate(lanes.tolist()):
        if physical_slot(pool, s) > 0:
            torch.testing.assert_close(after[physical_slot(pool, s)], want_s[b], **TOL[torch.float32])
    outside = ~_section_mask(pool, spec, lanes)
    assert torch.equal(arena[outside], pool.arena[outside])
    assert not torch.equal(arena, pool.arena)


def test_decode_kernel_takes_heads_split_out_of_one_projection(gen):
    pool, spec, ids, _ = _pool(gen)
    lanes = torch.tensor(ids[:3])
    qkv = torch.randn(3, H * (2 * K + V), generator=gen)
    q, k, v = (t.view(3, H, -1) for t in qkv.split([H * K, H * K, H * V], -1))
    assert not q.is_contiguous()
    g = -torch.rand(3, H, K, generator=gen)
    beta = torch.rand(3, H, generator=gen)
    a_ref, a_tri = pool.arena.clone(), pool.arena.clone()
    args = (spec.recurrent_offset(LAYER), spec.slot_bytes, SCALE, True)
    want = torch.ops.unimem.kda_decode(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, a_ref, pool.s_v2p, lanes, *args)
    got = kda.kda_decode_triton(q, k, v, g, beta, a_tri, pool.s_v2p, lanes, *args, block_v=4)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(_states(a_tri, pool), _states(a_ref, pool), **TOL[torch.float32])


# ---------------------------------------------------------------------------- prefill
@pytest.mark.parametrize("impl", ["op", "launcher"])
def test_prefill_then_decode_equals_prefill_of_the_whole_sequence_and_transformers(impl, gen):
    pool, spec, ids, dead = _pool(gen)
    first, second = torch.tensor([ids[1], dead, ids[3]]), torch.tensor([ids[0], -1, ids[5]])
    prompt, steps = 70, 3
    q, k, v, g, beta = _inputs(3, prompt + steps, gen)
    arena = pool.arena.clone()
    init = _states(arena, pool)[[physical_slot(pool, s) for s in (ids[1], ids[3])]].clone()
    for s_a, s_b in ((ids[1], ids[0]), (ids[3], ids[5])):  # both slot sets start from the same states
        _states(arena, pool)[physical_slot(pool, s_b)] = _states(arena, pool)[physical_slot(pool, s_a)]
    args = (spec.recurrent_offset(LAYER), spec.slot_bytes, SCALE, True)
    decode = DECODE["op" if impl == "op" else "triton"]

    whole = PREFILL[impl](q, k, v, g, beta, arena, pool.s_v2p, first, *args)
    part = PREFILL[impl](q[:, :prompt], k[:, :prompt], v[:, :prompt], g[:, :prompt], beta[:, :prompt], arena,
                         pool.s_v2p, second, *args)
    tail = [decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], arena, pool.s_v2p, second, *args)
            for t in range(prompt, prompt + steps)]
    stepped = torch.cat([part, torch.stack(tail, 1)], 1)
    live = [0, 2]  # lane 1 is masked in both sets: its state is never kept, so its decode steps restart from zero
    torch.testing.assert_close(stepped[live], whole[live], **TOL[torch.float32])

    want_o, want_s = hf.recurrent_kimi_delta_attention(q[live], k[live], v[live], g[live], beta[live], init, True,
                                                       use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(whole[live], want_o, **TOL[torch.float32])
    states = _states(arena, pool)
    for j, (s_a, s_b) in enumerate(((ids[1], ids[0]), (ids[3], ids[5]))):
        torch.testing.assert_close(states[physical_slot(pool, s_a)], want_s[j], **TOL[torch.float32])
        torch.testing.assert_close(states[physical_slot(pool, s_b)], want_s[j], **TOL[torch.float32])
    # masked lanes ran from a zero state and wrote nothing
    zero_o, _ = hf.recurrent_kimi_delta_attention(q[1:2], k[1:2], v[1:2], g[1:2], beta[1:2], None, False,
                                                  use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(whole[1:2], zero_o, **TOL[torch.float32])
    touched = _section_mask(pool, spec, torch.cat([first, second]))
    assert torch.equal(arena[~touched], pool.arena[~touched])


def test_prefill_launcher_refuses_fla_where_it_is_missing(gen):
    pool, spec, ids, _ = _pool(gen)
    q, k, v, g, beta = _inputs(1, 4, gen)
    with pytest.raises(RuntimeError, match="chunk_kda is not importable"):
        kda.kda_prefill_cuda(q, k, v, g, beta, pool.arena.clone(), pool.s_v2p, torch.tensor(ids[:1]),
                             spec.recurrent_offset(LAYER), spec.slot_bytes, SCALE, True, use_fla=True)


def test_prefill_backend_names_the_import_error_and_the_cuda_fallback_warns_once(monkeypatch):
    def no_fla(name):
        raise ImportError(f"No module named {name!r} (test)")

    kda._import_fla_chunk_kda.cache_clear()
    monkeypatch.setattr(kda.importlib, "import_module", no_fla)
    monkeypatch.setattr(kda, "_warned_reference_on_cuda", False)
    try:
        assert kda.fla_chunk_kda() is None
        assert kda.kda_prefill_backend() == {"backend": "reference",
                                             "reason": "ImportError: No module named 'fla.ops.kda' (test)"}
        with pytest.warns(RuntimeWarning, match=r"kda_chunk: CUDA prefill runs the pure-torch .*No module named"):
            kda.warn_reference_on_cuda("kda_chunk")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second warning would raise here
            kda.warn_reference_on_cuda("kda_prefill")
    finally:
        kda._import_fla_chunk_kda.cache_clear()  # the next caller imports for real


# ---------------------------------------------------------------------------- contract
@pytest.mark.parametrize("impl", ["op", "triton"])
def test_bad_inputs_raise_errors_with_the_numbers(impl, gen):
    pool, spec, ids, _ = _pool(gen)
    fn = DECODE[impl]
    lanes = torch.tensor(ids[:2])
    q, k, v, g, beta = (t[:, 0] for t in _inputs(2, 1, gen))
    off, sb = spec.recurrent_offset(LAYER), spec.slot_bytes
    with pytest.raises(TypeError, match="g must be torch.float32, got torch.float16"):
        fn(q, k, v, g.half(), beta, pool.arena, pool.s_v2p, lanes, off, sb, SCALE, True)
    with pytest.raises(GeometryError, match=rf"v must have shape \[2, {H}, \*\], got \[2, {H + 1}, {V}\]"):
        fn(q, k, torch.randn(2, H + 1, V), g, beta, pool.arena, pool.s_v2p, lanes, off, sb, SCALE, True)
    with pytest.raises(GeometryError, match=rf"k must have shape \[2, {H}, {K}\], got \[2, {H}, {K - 1}\]"):
        fn(q, k[..., 1:], v, g, beta, pool.arena, pool.s_v2p, lanes, off, sb, SCALE, True)
    with pytest.raises(GeometryError, match=rf"\[{sb - 16}, {sb - 16 + H * K * V * 4}\) does not fit in a slot of {sb}"):
        fn(q, k, v, g, beta, pool.arena, pool.s_v2p, lanes, sb - 16, sb, SCALE, True)
    with pytest.raises(ValueError, match="slot_ids has 1 lanes but the inputs have batch 2"):
        fn(q, k, v, g, beta, pool.arena, pool.s_v2p, lanes[:1], off, sb, SCALE, True)
    with pytest.raises(GeometryError, match=r"q must have 3 dimensions, got shape \(2, 1, 2, 16\)"):
        fn(q[:, None], k, v, g, beta, pool.arena, pool.s_v2p, lanes, off, sb, SCALE, True)


def test_opcheck_passes(gen):
    pool, spec, ids, dead = _pool(gen)
    lanes = torch.tensor([ids[1], -1, dead, ids[0]])
    args = (spec.recurrent_offset(LAYER), spec.slot_bytes, SCALE, True)
    q, k, v, g, beta = _inputs(4, 5, gen)
    torch.library.opcheck(torch.ops.unimem.kda_prefill.default,
                          (q, k, v, g, beta, pool.arena.clone(), pool.s_v2p, lanes, *args))
    torch.library.opcheck(torch.ops.unimem.kda_decode.default,
                          (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pool.arena.clone(), pool.s_v2p, lanes, *args))


def test_compiled_conv_then_decode_step_matches_eager(gen):
    pool, spec, ids, dead = _pool(gen)
    lanes = torch.tensor([ids[2], dead, ids[0]])
    conv_dim = spec.layers[LAYER].conv.shape[0]
    weight = torch.randn(conv_dim, 4, generator=gen).half()
    g = -torch.rand(3, H, K, generator=gen)
    beta = torch.rand(3, H, generator=gen)
    x = torch.randn(3, conv_dim, generator=gen).half()

    def step(arena, s_v2p, slots, x, g, beta):
        mixed = torch.ops.unimem.causal_conv1d_update(x, arena, s_v2p, slots, spec.conv_offset(LAYER), spec.slot_bytes,
                                                      weight, None, "silu")
        q, k, v = (t.reshape(3, H, -1) for t in mixed.float().split([H * K, H * K, H * V], -1))
        o = torch.ops.unimem.kda_decode(q, k, v, g, beta, arena, s_v2p, slots, spec.recurrent_offset(LAYER),
                                        spec.slot_bytes, SCALE, True)
        return o * 2

    eager_arena, compiled_arena = pool.arena.clone(), pool.arena.clone()
    want = step(eager_arena, pool.s_v2p, lanes, x, g, beta)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(compiled_arena, pool.s_v2p, lanes, x, g, beta)
    assert torch.equal(got, want)
    assert torch.equal(compiled_arena, eager_arena)


@pytest.mark.parametrize("knob, value", [("block_v", 3), ("block_v", 0), ("num_warps", 6)])
def test_decode_launcher_refuses_bad_tuning_knobs_before_touching_the_arena(knob, value, gen):
    pool, spec, ids, _ = _pool(gen)
    lanes = torch.tensor(ids[:2])
    q, k = torch.randn(2, H, K, generator=gen), torch.randn(2, H, K, generator=gen)
    v, g = torch.randn(2, H, V, generator=gen), -torch.rand(2, H, K, generator=gen)
    beta = torch.rand(2, H, generator=gen)
    arena = pool.arena.clone()
    with pytest.raises(ValueError, match=rf"kda_decode: {knob} must be a power of two >= 1, got {value}$"):
        kda.kda_decode_triton(q, k, v, g, beta, arena, pool.s_v2p, lanes, spec.recurrent_offset(LAYER),
                              spec.slot_bytes, SCALE, True, **{knob: value})
    assert torch.equal(arena, pool.arena)
