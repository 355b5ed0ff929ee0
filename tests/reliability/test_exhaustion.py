"""PoolExhausted carries the free gap and what compacting each side would reclaim, and those numbers are
true: compacting both sides adds exactly ``sum(reclaimable)`` bytes to the gap. In-flight ids that block
compaction make an allocation fail even though it would fit otherwise; then every live byte is still
readable at its virtual id and the pinned ids did not move.

(Double and invalid frees, the sink, and an exhaustion without holes are in tests/pool/test_allocator.py.)
"""

import pytest
import torch

from unimem_compile.errors import PoolExhausted
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, PageTables, UnifiedPool

KV = MLASpec(2, 32, 16, torch.float32)  # 4-token pages of 1536 bytes
STATE = LinearStateSpec.kda(2, 2, 8, 4, torch.float32)  # slots of 2560 bytes
PS = 4


def _pool() -> UnifiedPool:
    return UnifiedPool(ArenaLayout.for_capacity(KV, STATE, PS, 12, 5), poison=True)


def _fill(pool, gen):
    """Random rows in every token of every live page and random states in every live slot; returns the
    expected contents by virtual id."""
    rows, states = {}, {}
    for vp in pool.allocator.live_virtual("kv"):
        loc = torch.arange(vp * PS, (vp + 1) * PS)
        for layer in range(KV.layer_num):
            rows[vp, layer] = torch.randn(PS, KV.kv_cache_dim, generator=gen)
            pool.write_kv(layer, loc, rows[vp, layer])
    for vs in pool.allocator.live_virtual("state"):
        p = int(pool.physical_slots([vs])[0])
        states[vs] = [torch.randn(v.shape[1:], generator=gen) for layer in range(2) for v in pool.state_views(layer)]
        for i, view in enumerate(v for layer in range(2) for v in pool.state_views(layer)):
            view[p] = states[vs][i]
    return rows, states


def _assert_contents(pool, rows, states):
    for (vp, layer), want in rows.items():
        assert torch.equal(pool.read_kv(layer, torch.arange(vp * PS, (vp + 1) * PS)), want)
    for vs, want in states.items():
        p = int(pool.physical_slots([vs])[0])
        views = [v for layer in range(2) for v in pool.state_views(layer)]
        assert all(torch.equal(view[p], w) for view, w in zip(views, want))


def _holes(slot_hole: bool = True):
    """A pool whose free gap is closed by pages, with two interior page holes (and one slot hole)."""
    pool = _pool()
    slots = pool.alloc_slots(3)
    pages = pool.alloc_pages(pool.allocator._gap_capacity(pool.allocator.kv))
    pool.free_pages(pages[1:3])  # interior: the watermark page stays live
    if slot_hole:
        pool.free_slots(slots[:1])
    return pool


@pytest.mark.parametrize("side", ["kv", "state"])
def test_exhaustion_reports_the_gap_and_what_compaction_of_each_side_reclaims(side, gen):
    pool = _holes()
    lay, a = pool.layout, pool.allocator
    rows, states = _fill(pool, gen)
    n = next(n for n in range(1, 64) if not a.can_alloc_after_compaction(side, n))
    before = (pool.arena.clone(), pool.v2p.clone(), pool.s_v2p.clone(), a.kv_watermark, a.state_watermark)
    with pytest.raises(PoolExhausted) as info:
        (pool.alloc_pages if side == "kv" else pool.alloc_slots)(n)
    e = info.value
    unit = lay.page_bytes if side == "kv" else lay.slot_bytes
    assert (e.side, e.requested, e.available) == (side, n * unit, a.free_gap_bytes)
    assert e.reclaimable == {"kv": 2 * lay.page_bytes, "state": lay.slot_bytes}
    assert (f"{e.requested} bytes" in str(e) and f"{e.available} bytes" in str(e)
            and f"{2 * lay.page_bytes} bytes (kv) + {lay.slot_bytes} bytes (state)" in str(e))
    after = (pool.arena, pool.v2p, pool.s_v2p, a.kv_watermark, a.state_watermark)
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(before, after))
    # the numbers are true: compaction adds exactly what was reported, and then n - 1 fit
    pool.compact("both")
    assert a.free_gap_bytes == e.available + sum(e.reclaimable.values())
    (pool.alloc_pages if side == "kv" else pool.alloc_slots)(n - 1)
    _assert_contents(pool, rows, states)
    a.check_invariants()


def test_in_flight_ids_that_block_compaction_make_an_allocation_fail_with_every_byte_kept(gen):
    pool = _holes(slot_hole=False)
    a = pool.allocator
    rows, states = _fill(pool, gen)
    assert not a.can_alloc("state", 1) and a.can_alloc_after_compaction("state", 1)
    # the page at the watermark is in flight: the live pages above it can fill the holes, but the holes
    # they leave are not at the watermark, so the gap does not grow
    pinned = a.kv_watermark
    pinned_virtual = int(a.kv.p2v[pinned])
    with pytest.raises(PoolExhausted) as info:
        pool.alloc_slots(1, in_flight_pages=[pinned])
    assert pool.compactions == 1  # it tried
    assert info.value.reclaimable["kv"] == 2 * pool.layout.page_bytes  # the holes are still there
    assert pool.physical_pages([pinned_virtual]) == [pinned]
    _assert_contents(pool, rows, states)
    a.check_invariants()
    # without the pin the same allocation succeeds
    (slot,) = pool.alloc_slots(1)
    assert pool.physical_pages([pinned_virtual]) != [pinned]
    _assert_contents(pool, rows, states)
    assert not pool.arena[int(pool.physical_slots([slot])[0]) * pool.layout.slot_bytes:][:pool.layout.slot_bytes].any()


@pytest.mark.parametrize("entry", ["pool", "page_tables"])
def test_in_flight_slots_are_kept_when_a_page_allocation_compacts_the_state_side(entry, gen):
    pool = _pool()
    a = pool.allocator
    slots = pool.alloc_slots(a._gap_capacity(a.state))
    pool.free_slots(slots[1:3])  # interior holes; the top slot stays live
    rows, states = _fill(pool, gen)
    assert not a.can_alloc("kv", 1) and a.can_alloc_after_compaction("kv", 1)
    top = a.state_watermark - 1
    table = PageTables(pool, 1, 2)
    with pytest.raises(PoolExhausted):
        if entry == "pool":
            pool.alloc_pages(1, in_flight_slots=[top])
        else:
            table.grow([0], [PS], in_flight_slots=[top])
    assert int(a.state.v2p[slots[-1]]) == top
    _assert_contents(pool, rows, states)
    pool.alloc_pages(1)
    _assert_contents(pool, rows, states)
    a.check_invariants()
