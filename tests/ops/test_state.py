"""state_gather / state_scatter: the ops (pure-torch reference) and the Triton kernel (interpreter) against
sections read and written through the pool's own per-layer state views, on slots scattered by
alloc/free/compaction in an arena whose pitch is not H*K*V*4."""

import pytest
import torch

from unimem_compile.errors import GeometryError
from unimem_compile.ops import state as st
from unimem_compile.pool import LinearStateSpec, state_views

from .slot_pools import scattered_slot_pool

H, K, V, CONV_K = 2, 8, 8, 4


def _scattered_pool(conv_dtype, gen):
    """Scattered live slots, random bytes everywhere past the sink, one tombstone; returns
    (pool, spec, live virtual ids, the tombstone)."""
    spec = LinearStateSpec.kda(2, H, K, CONV_K, conv_dtype)
    assert spec.slot_bytes != H * K * V * 4
    pool, ids, dead = scattered_slot_pool(spec, gen, 8, slice(0, 5, 2), 2, fill_states=False)
    return pool, spec, ids, dead


def _fill_finite(pool, gen):
    """Random normal values in every section of every slot (random bytes may be NaN, which opcheck's
    comparisons reject); the alignment padding keeps its random bytes."""
    for layer in range(pool.layout.state.layer_num):
        for view in state_views(pool.arena, pool.layout, layer):
            live = view[pool.layout.first_slot:]
            live.copy_(torch.randn(live.shape, generator=gen).to(view.dtype))


def _lanes(ids, dead):
    # live slots in a shuffled order plus every kind of masked lane: -1, another negative, a tombstone, slot 0
    return torch.tensor([ids[3], -1, ids[0], dead, ids[5], 0, ids[1], -5, ids[4], ids[2]])


def _sections(spec):
    """(byte_offset, shape, dtype) of every section of the slot (conv in its dtype, recurrent fp32)."""
    out = []
    for layer in range(spec.layer_num):
        c, r = spec.layers[layer].conv, spec.layers[layer].recurrent
        out.append((spec.conv_offset(layer), list(c.shape), c.dtype))
        out.append((spec.recurrent_offset(layer), list(r.shape), r.dtype))
    return out


def _expected_gather(pool, lanes, layer, which):
    view = state_views(pool.arena, pool.layout, layer)[which]
    rows = []
    for s in lanes.tolist():
        p = int(pool.s_v2p[s]) if 0 <= s < pool.s_v2p.numel() else -1
        rows.append(view[p].clone() if p > 0 else torch.zeros_like(view[0]))
    return torch.stack(rows)


def _bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("conv_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gather_reads_each_lanes_section_by_pitch_and_zeros_for_masked_lanes(conv_dtype, gen):
    pool, spec, ids, dead = _scattered_pool(conv_dtype, gen)
    lanes = _lanes(ids, dead)
    for i, (off, shape, dtype) in enumerate(_sections(spec)):
        want = _expected_gather(pool, lanes, i // 2, i % 2)
        got_op = torch.ops.unimem.state_gather(pool.arena, pool.s_v2p, lanes, off, spec.slot_bytes, shape, dtype)
        got_kernel = st.state_gather_triton(pool.arena, pool.s_v2p, lanes, off, spec.slot_bytes, shape, dtype)
        assert got_op.dtype == dtype and got_op.shape == (lanes.numel(), *shape) and got_op.is_contiguous()
        assert torch.equal(_bits(got_op), _bits(want))
        assert torch.equal(_bits(got_kernel), _bits(want))
        masked = torch.tensor([s < 0 or s in (0, dead) for s in lanes.tolist()])
        assert not bool(_bits(got_kernel[masked]).any())


@pytest.mark.parametrize("conv_dtype", [torch.float16, torch.float32])
def test_scatter_changes_exactly_the_addressed_sections_of_live_lanes(conv_dtype, gen):
    pool, spec, ids, dead = _scattered_pool(conv_dtype, gen)
    lanes = _lanes(ids, dead)
    for i, (off, shape, dtype) in enumerate(_sections(spec)):
        value = torch.randn(lanes.numel(), *shape, generator=gen).to(dtype)
        expected = pool.arena.clone()
        exp_view = state_views(expected, pool.layout, i // 2)[i % 2]
        for b, s in enumerate(lanes.tolist()):
            p = int(pool.s_v2p[s]) if s >= 0 else -1
            if p > 0:
                exp_view[p] = value[b]
        for scatter in (torch.ops.unimem.state_scatter, st.state_scatter_triton):
            arena = pool.arena.clone()
            scatter(arena, pool.s_v2p, lanes, value, off, spec.slot_bytes)
            assert torch.equal(arena, expected), f"section {i} via {scatter}"


def test_an_arena_that_is_a_view_into_a_larger_buffer_is_addressed_from_the_view(gen):
    """The plain-torch path used to address from the start of the whole buffer (as_strided counts from the
    storage): it wrote outside the arena it was given. Both paths now write exactly what they write on a
    standalone arena, inside the view, and nothing in front of it."""
    pool, spec, ids, dead = _scattered_pool(torch.float16, gen)
    lanes = _lanes(ids, dead)
    off, shape, dtype = _sections(spec)[0]
    value = torch.randn(lanes.numel(), *shape, generator=gen).to(dtype)
    expected = pool.arena.clone()
    torch.ops.unimem.state_scatter(expected, pool.s_v2p, lanes, value, off, spec.slot_bytes)
    lead = 4096
    for scatter, gather in ((torch.ops.unimem.state_scatter, torch.ops.unimem.state_gather),
                            (st.state_scatter_triton, st.state_gather_triton)):
        big = torch.randint(0, 256, (lead + pool.arena.numel(),), dtype=torch.uint8, generator=gen)
        big[lead:] = pool.arena
        front = big[:lead].clone()
        scatter(big[lead:], pool.s_v2p, lanes, value, off, spec.slot_bytes)
        assert torch.equal(big[:lead], front), f"{scatter} wrote in front of the arena"
        assert torch.equal(big[lead:], expected), f"{scatter}"
        back = gather(big[lead:], pool.s_v2p, lanes, off, spec.slot_bytes, shape, dtype)
        assert torch.equal(back, gather(expected, pool.s_v2p, lanes, off, spec.slot_bytes, shape, dtype))
    with pytest.raises(GeometryError, match="the arena must start 16-byte aligned; it is a view starting at byte 1"):
        torch.ops.unimem.state_scatter(big[1:], pool.s_v2p, lanes, value, off, spec.slot_bytes)


@pytest.mark.parametrize("shape,dtype,offset", [([3, 3], torch.float16, 16), ([5], torch.uint8, 32),
                                                ([2, 3], torch.bfloat16, 48), ([7], torch.float32, 0)])
def test_sections_of_any_byte_size_round_trip_bit_exactly(shape, dtype, offset, gen):
    pool, spec, ids, dead = _scattered_pool(torch.float16, gen)
    lanes = _lanes(ids, dead)
    value = torch.randint(0, 256, (lanes.numel(), *shape), dtype=torch.uint8, generator=gen)
    value = value.view(dtype) if dtype.itemsize == 1 else torch.randn(lanes.numel(), *shape, generator=gen).to(dtype)
    arena = pool.arena.clone()
    st.state_scatter_triton(arena, pool.s_v2p, lanes, value, offset, spec.slot_bytes)
    ref = pool.arena.clone()
    torch.ops.unimem.state_scatter(ref, pool.s_v2p, lanes, value, offset, spec.slot_bytes)
    assert torch.equal(arena, ref)
    back = st.state_gather_triton(arena, pool.s_v2p, lanes, offset, spec.slot_bytes, shape, dtype)
    live = torch.tensor([s > 0 and s != dead for s in lanes.tolist()])
    assert torch.equal(_bits(back[live]), _bits(value[live]))
    assert not bool(_bits(back[~live]).any())


def test_gather_of_an_empty_batch_is_empty(gen):
    pool, spec, _, _ = _scattered_pool(torch.float16, gen)
    none = torch.empty(0, dtype=torch.int64)
    out = st.state_gather_triton(pool.arena, pool.s_v2p, none, spec.recurrent_offset(0), spec.slot_bytes, [H, K, V],
                                 torch.float32)
    assert out.shape == (0, H, K, V)


def test_bad_geometry_and_ids_raise_errors_with_the_numbers(gen):
    pool, spec, ids, dead = _scattered_pool(torch.float16, gen)
    lanes = _lanes(ids, dead)
    off, sb = spec.recurrent_offset(1), spec.slot_bytes
    for fn in (torch.ops.unimem.state_gather, st.state_gather_triton):
        with pytest.raises(GeometryError, match=f"byte_offset must be a non-negative multiple of 16, got {off + 4}"):
            fn(pool.arena, pool.s_v2p, lanes, off + 4, sb, [H, K, V], torch.float32)
        with pytest.raises(GeometryError, match=rf"\[{off}, {off + 2 * H * K * V * 4}\) does not fit in a slot of {sb}"):
            fn(pool.arena, pool.s_v2p, lanes, off, sb, [2 * H, K, V], torch.float32)
        with pytest.raises(GeometryError, match=f"slots of {sb + 16} bytes need"):
            fn(pool.arena, pool.s_v2p, lanes, off, sb + 16, [H, K, V], torch.float32)
        with pytest.raises(TypeError, match="slot_ids must be torch.int64, got torch.int32"):
            fn(pool.arena, pool.s_v2p, lanes.int(), off, sb, [H, K, V], torch.float32)
        with pytest.raises(ValueError, match=r"shape must be non-empty with positive sizes, got \[2, 0\]"):
            fn(pool.arena, pool.s_v2p, lanes, off, sb, [2, 0], torch.float32)
    value = torch.randn(lanes.numel() - 1, H, K, V, generator=gen)
    for fn in (torch.ops.unimem.state_scatter, st.state_scatter_triton):
        with pytest.raises(ValueError, match=f"slot_ids has {lanes.numel()} lanes but the inputs have batch {lanes.numel() - 1}"):
            fn(pool.arena.clone(), pool.s_v2p, lanes, value, off, sb)


def test_debug_mode_rejects_dead_and_repeated_slots(gen, monkeypatch):
    pool, spec, ids, dead = _scattered_pool(torch.float16, gen)
    off, sb = spec.recurrent_offset(0), spec.slot_bytes
    monkeypatch.setenv("UNIMEM_DEBUG", "1")
    ok = torch.tensor([ids[0], -1, ids[1]])
    st.state_gather_triton(pool.arena, pool.s_v2p, ok, off, sb, [H, K, V], torch.float32)
    with pytest.raises(GeometryError, match=f"lane 1: slot {dead}"):
        st.state_gather_triton(pool.arena, pool.s_v2p, torch.tensor([ids[0], dead]), off, sb, [H, K, V], torch.float32)
    value = torch.randn(3, H, K, V, generator=gen)
    with pytest.raises(ValueError, match=rf"slot ids \[{ids[1]}\] appear in more than one lane"):
        torch.ops.unimem.state_scatter(pool.arena.clone(), pool.s_v2p, torch.tensor([ids[1], ids[0], ids[1]]), value,
                                       off, sb)


def test_opcheck_passes(gen):
    pool, spec, ids, dead = _scattered_pool(torch.float16, gen)
    lanes = _lanes(ids, dead)
    off, sb = spec.conv_offset(1), spec.slot_bytes
    shape = list(spec.layers[1].conv.shape)
    _fill_finite(pool, gen)
    torch.library.opcheck(torch.ops.unimem.state_gather.default,
                          (pool.arena, pool.s_v2p, lanes, off, sb, shape, torch.float16))
    value = torch.randn(lanes.numel(), *shape, generator=gen).half()
    torch.library.opcheck(torch.ops.unimem.state_scatter.default, (pool.arena.clone(), pool.s_v2p, lanes, value, off, sb))


def test_compiled_gather_update_scatter_matches_eager(gen):
    pool, spec, ids, dead = _scattered_pool(torch.float32, gen)
    lanes = _lanes(ids, dead)
    off, sb = spec.recurrent_offset(1), spec.slot_bytes
    _fill_finite(pool, gen)

    def step(arena, s_v2p, slots, delta):
        s = torch.ops.unimem.state_gather(arena, s_v2p, slots, off, sb, [H, K, V], torch.float32)
        s = s * 0.5 + delta
        torch.ops.unimem.state_scatter(arena, s_v2p, slots, s, off, sb)
        return s.sum(-1)

    delta = torch.randn(lanes.numel(), H, K, V, generator=gen)
    eager_arena, compiled_arena = pool.arena.clone(), pool.arena.clone()
    want = step(eager_arena, pool.s_v2p, lanes, delta)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(compiled_arena, pool.s_v2p, lanes, delta)
    assert torch.equal(got, want)
    assert torch.equal(compiled_arena, eager_arena)
