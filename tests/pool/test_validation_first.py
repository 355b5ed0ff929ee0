"""Bad arguments are refused before anything moves: a compaction never runs for a call that then fails,
and ids / counts / locations that are not integers are refused rather than truncated (cases found by a
randomised adversarial session; each test fails on the code before its fix)."""

import numpy as np
import pytest
import torch

from unimem_compile.errors import GeometryError
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, PageTables, UnifiedPool

from .test_allocator import assert_unchanged, snapshot

KV = MLASpec(2, 32, 16, torch.float32)
STATE = LinearStateSpec.kda(1, 2, 8, 4, torch.float32)


def pool_with_kv_holes(gen):
    """Live pages below two holes (a KV compaction would move them), random rows written."""
    pool = UnifiedPool(ArenaLayout.for_capacity(KV, STATE, 4, 10, 4), poison=True)
    pages = pool.alloc_pages(5)
    pool.alloc_slots(2)
    pool.free_pages(pages[:2])
    for v in pages[2:]:
        pool.write_kv(0, torch.arange(v * 4, v * 4 + 4), torch.randn(4, 48, generator=gen))
    return pool


@pytest.mark.parametrize("bad_pin, error", [([9999], GeometryError), (["x"], TypeError), (3, TypeError)])
def test_compact_both_validates_every_side_before_moving_either(bad_pin, error, gen):
    pool = pool_with_kv_holes(gen)
    before = snapshot(pool)
    with pytest.raises(error):
        pool.compact("both", {"kv": [], "state": bad_pin})
    assert_unchanged(before, pool)
    assert pool.compactions == 0
    assert pool.compact("both", {"kv": [], "state": []})  # the same call with good pins does move pages


def pool_needing_state_compaction():
    """Slots fill the gap; all but the last are freed: a page allocation must compact the state side."""
    pool = UnifiedPool(ArenaLayout.for_capacity(KV, STATE, 4, 4, 6), poison=True)
    slots = pool.alloc_slots(pool.allocator._gap_capacity(pool.allocator.state))
    pool.free_slots(slots[:-1])
    assert not pool.allocator.can_alloc("kv", 2) and pool.allocator.can_alloc_after_compaction("kv", 2)
    return pool


@pytest.mark.parametrize("call, error, message", [
    (lambda p: p.alloc_pages(2.0), TypeError, "number of kv ids to allocate must be an integer, got float 2.0"),
    (lambda p: p.alloc_pages("2"), TypeError, "must be an integer, got str '2'"),
    (lambda p: p.alloc_pages(-1), ValueError, r"negative number of kv ids \(-1\)"),
    (lambda p: p.alloc_pages(2, in_flight_slots=[10**6]), GeometryError, "in-flight physical state id 1000000"),
    (lambda p: p.alloc_pages(2, in_flight_pages=[1.5]), TypeError, "in-flight physical kv id must be an integer"),
])
def test_an_allocation_refused_for_its_arguments_does_not_compact_first(call, error, message):
    pool = pool_needing_state_compaction()
    before = snapshot(pool)
    with pytest.raises(error, match=message):
        call(pool)
    assert_unchanged(before, pool)
    assert pool.compactions == 0
    assert len(pool.alloc_pages(2)) == 2 and pool.compactions == 1  # and the valid call compacts and fits


def test_physical_pages_of_negative_past_table_and_float_ids():
    pool = UnifiedPool(ArenaLayout.for_capacity(KV, STATE, 4, 5, 1))
    pages = pool.alloc_pages(5)
    assert pool.physical_pages([-1, -2]) == [-1, -1]  # not the last pages' (no wrap-around)
    assert pool.physical_pages(np.array(pages)) == [int(pool.v2p[v]) for v in pages]
    n = pool.layout.num_pages
    with pytest.raises(GeometryError, match=f"virtual page {n} is out of range"):
        pool.physical_pages([n])
    with pytest.raises(TypeError, match="virtual page id must be an integer, got float 1.7"):
        pool.physical_pages([1.7])
    with pytest.raises(TypeError, match="virtual slot id must be an integer"):
        pool.physical_slots([1.7])
    assert pool.physical_slots([-1]).tolist() == [0]


def test_kv_rows_need_integer_locations_and_lists_equal_tensors(gen):
    pool = UnifiedPool(ArenaLayout.for_capacity(KV, STATE, 4, 3, 1))
    p = pool.alloc_pages(1)[0]
    rows = torch.randn(1, 48, generator=gen)
    before = snapshot(pool)
    for bad in (torch.tensor([p * 4 + 1.7]), [p * 4 + 1.7], torch.tensor([True])):
        with pytest.raises(TypeError, match="virtual token location must be an integer"):
            pool.write_kv(0, bad, rows)
        with pytest.raises(TypeError, match="virtual token location must be an integer"):
            pool.read_kv(0, bad)
    assert_unchanged(before, pool)
    with pytest.raises(TypeError, match="rows must be torch.float32, got torch.float16"):
        pool.write_kv(0, [p * 4 + 1], rows.half())  # a wrong dtype is a TypeError, as for every op
    assert_unchanged(before, pool)
    pool.write_kv(0, [p * 4 + 1], rows)
    assert torch.equal(pool.read_kv(0, torch.tensor([p * 4 + 1])), rows)
    assert torch.equal(pool.read_kv(0, [p * 4 + 1]), rows)


def test_page_table_rows_and_lengths_must_be_integers_and_distinct(gen):
    pool = UnifiedPool(ArenaLayout.for_capacity(KV, STATE, 4, 8, 1))
    pt = PageTables(pool, 3, 4)
    before = snapshot(pool)
    with pytest.raises(GeometryError, match="row 1 is listed twice"):
        pt.grow(torch.tensor([1, 1]), [4, 8])  # 0-d tensors hash by identity: compared as ints now
    with pytest.raises(TypeError, match="new row length must be an integer, got float 4.9"):
        pt.grow([0], [4.9])
    with pytest.raises(TypeError, match="a row must be an integer, got float 1.0"):
        pt.grow([1.0], [4])
    assert_unchanged(before, pool)
    assert pool.allocator.pages_used == 0 and pt.lengths == [0, 0, 0]
    pt.grow(torch.tensor([2, 0]), [5, 4])  # integer tensors are fine
    assert pt.lengths == [4, 0, 5] and pool.allocator.pages_used == 3
    with pytest.raises(GeometryError, match="count must be >= 0, got -1"):
        pt.locations(0, 0, -1)
    with pytest.raises(GeometryError, match=r"positions must be \[B <= 3\], got \[\]"):
        pt.token_locations(torch.tensor(0))
    with pytest.raises(TypeError, match="positions must be an integer tensor, got torch.float32"):
        pt.token_locations(torch.tensor([0.0, 1.0]))
    pt.release_all()
    assert pool.allocator.pages_used == 0


def test_messages_of_other_wrong_types():
    pool = UnifiedPool(ArenaLayout.for_capacity(KV, STATE, 4, 3, 2))
    with pytest.raises(TypeError, match="virtual kv ids to free must be an iterable of ints, got int 5"):
        pool.free_pages(5)
    with pytest.raises(TypeError, match="state layer must be an integer, got float 0.0"):
        pool.state_views(0.0)
    with pytest.raises(TypeError, match="max_pages_per_row must be an integer, got str '3'"):
        PageTables(pool, 2, "3")
    with pytest.raises(GeometryError, match=r"n_pages \(-5\) and n_slots \(-5\) must be >= 0"):
        ArenaLayout.for_capacity(KV, STATE, 4, -5, -5)
    layout = ArenaLayout.for_capacity(KV, STATE, 4, 3, 2)
    same = ArenaLayout(np.int64(layout.memory_budget), np.int32(4), KV, STATE)
    assert same == layout and type(same.memory_budget) is int and type(same.page_size) is int


def test_exhaustion_after_a_compaction_blocked_by_pins_says_so():
    from unimem_compile.errors import PoolExhausted

    pool = pool_needing_state_compaction()
    live = [v for v in range(pool.layout.num_slots) if int(pool.s_v2p[v]) > 0]
    top = int(pool.physical_slots(live)[0])  # the one live slot, above the holes
    before = snapshot(pool)
    with pytest.raises(PoolExhausted, match=r"compacted already: 0 in-flight pages and 1 in-flight slots stay") as e:
        pool.alloc_pages(2, in_flight_slots=[top])
    assert e.value.side == "kv" and e.value.requested == 2 * pool.layout.page_bytes
    assert_unchanged(before, pool)  # the pinned slot was the only one that could have moved
    with pytest.raises(PoolExhausted, match="compaction could add") as plain:
        UnifiedPool(ArenaLayout.for_capacity(KV, STATE, 4, 1, 1)).alloc_pages(5)
    assert "compacted already" not in str(plain.value)
