"""The multi-ended allocator and UnifiedPool: sides, watermarks, holes, errors and compaction."""

import pytest
import torch

from unimem_compile.errors import InvalidFree, PoolExhausted
from unimem_compile.pool import POISON_BYTE, ArenaLayout, LinearStateSpec, MLASpec, PageTables, UnifiedPool

KV = MLASpec(2, 32, 16, torch.float32)  # page_bytes = ps * 2 * 48 * 4
STATE = LinearStateSpec.kda(1, 2, 8, 4, torch.float32)


def make_pool(ps=4, n_pages=10, n_slots=4, **kw):
    return UnifiedPool(ArenaLayout.for_capacity(KV, STATE, ps, n_pages, n_slots), **kw)


def snapshot(pool):
    a = pool.allocator
    return (
        pool.arena.clone(),
        pool.v2p.clone(),
        pool.p2v.clone(),
        pool.s_v2p.clone(),
        pool.s_p2v.clone(),
        a.kv_watermark,
        a.state_watermark,
        sorted(a.kv.hole_set),
        sorted(a.state.hole_set),
    )


def assert_unchanged(before, pool):
    after = snapshot(pool)
    for x, y in zip(before, after):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


def test_pages_grow_down_from_the_top_and_slots_up_from_the_sink():
    pool = make_pool()
    lay = pool.layout
    pages = pool.alloc_pages(3)
    slots = pool.alloc_slots(2)
    assert pool.physical_pages(pages) == [lay.num_pages - 1, lay.num_pages - 2, lay.num_pages - 3]
    assert pool.physical_slots(slots).tolist() == [lay.first_slot, lay.first_slot + 1]
    assert pool.allocator.kv_watermark == lay.num_pages - 3
    assert pool.allocator.state_watermark == lay.first_slot + 2
    assert pages == [1, 2, 3] and slots == [1, 2]  # virtual ids start at 1; 0 is reserved
    assert int(pool.v2p[0]) == 0 and int(pool.s_v2p[0]) == 0


def test_the_sink_is_zero_and_stays_zero_through_alloc_free_compact():
    pool = make_pool(poison=True)
    sink = pool.layout.sink_floor
    pages = pool.alloc_pages(6)
    slots = pool.alloc_slots(3)
    pool.free_pages(pages[::2])
    pool.free_slots(slots[:1])
    pool.compact("both")
    assert int(pool.arena[:sink].count_nonzero()) == 0


def test_free_gap_is_the_bytes_between_the_regions():
    pool = make_pool()
    lay = pool.layout
    pool.alloc_pages(2)
    pool.alloc_slots(1)
    a = pool.allocator
    assert a.free_gap_bytes == (lay.num_pages - 2) * lay.page_bytes - (lay.first_slot + 1) * lay.slot_bytes


def test_freed_holes_are_reused_before_the_gap():
    pool = make_pool()
    pages = pool.alloc_pages(5)
    phys = pool.physical_pages(pages)
    pool.free_pages([pages[1], pages[3]])
    wm = pool.allocator.kv_watermark
    again = pool.alloc_pages(2)
    assert sorted(pool.physical_pages(again)) == sorted([phys[1], phys[3]])
    assert pool.allocator.kv_watermark == wm


def test_freeing_at_the_watermark_returns_bytes_to_the_gap():
    pool = make_pool()
    pages = pool.alloc_pages(4)
    gap = pool.allocator.free_gap_bytes
    pool.free_pages([pages[3], pages[2]])  # the two lowest pages
    assert pool.allocator.free_gap_bytes == gap + 2 * pool.layout.page_bytes
    assert pool.allocator.hole_bytes("kv") == 0


def test_freed_virtual_ids_become_tombstones():
    pool = make_pool()
    pages = pool.alloc_pages(3)
    slots = pool.alloc_slots(2)
    pool.free_pages([pages[1]])
    pool.free_slots([slots[0]])
    assert int(pool.v2p[pages[1]]) == -1 and int(pool.s_v2p[slots[0]]) == -1


@pytest.mark.parametrize(
    "action, match",
    [
        (lambda p, pages, slots: p.free_pages([0]), "virtual page 0: it is the reserved sink"),
        (lambda p, pages, slots: p.free_slots([0]), "virtual slot 0: it is the reserved sink"),
        (lambda p, pages, slots: p.free_pages([pages[0], pages[0]]), f"page {1} appears twice"),
        (lambda p, pages, slots: p.free_pages([7]), "virtual page 7 was never allocated"),
        (lambda p, pages, slots: p.free_slots([3]), "virtual slot 3 was never allocated"),
        (lambda p, pages, slots: p.free_pages([10_000]), r"virtual page 10000 is out of range \[1, "),
        (lambda p, pages, slots: p.free_pages([-1]), r"virtual page -1 is out of range"),
    ],
)
def test_invalid_frees_raise_and_change_nothing(action, match):
    pool = make_pool(poison=True)
    pages = pool.alloc_pages(4)
    slots = pool.alloc_slots(2)
    before = snapshot(pool)
    with pytest.raises(InvalidFree, match=match):
        action(pool, pages, slots)
    assert_unchanged(before, pool)


@pytest.mark.parametrize(
    "action, match",
    [
        (lambda p, pages: p.free_pages([1.9]), "a virtual kv id must be an integer, got float 1.9"),
        (lambda p, pages: p.free_pages([pages[1], "2"]), "a virtual kv id must be an integer, got str '2'"),
        (lambda p, pages: p.free_slots([True]), "a virtual state id must be an integer, got the bool True"),
        (lambda p, pages: p.alloc_pages(True), "the number of kv ids to allocate must be an integer, got the bool"),
        (lambda p, pages: p.alloc_slots(2.0), "the number of state ids to allocate must be an integer, got float"),
        (lambda p, pages: p.compact("kv", [2.5]), "an in-flight physical kv id must be an integer"),
    ],
)
def test_non_integer_ids_and_counts_are_refused_not_truncated(action, match):
    pool = make_pool(poison=True)
    pages = pool.alloc_pages(3)
    pool.alloc_slots(1)
    before = snapshot(pool)
    with pytest.raises(TypeError, match=match):
        action(pool, pages)
    assert_unchanged(before, pool)


def test_compact_both_refuses_a_flat_pin_list_and_out_of_range_pins():
    """A flat list with side="both" used to pin nothing (a running step's pages moved): now refused."""
    from unimem_compile.errors import GeometryError

    pool = make_pool(n_pages=10)
    pages = pool.alloc_pages(5)
    pool.free_pages(pages[:3])  # holes above the two live pages: compaction would move them
    live = [int(pool.v2p[v]) for v in pages[3:]]
    before = snapshot(pool)
    with pytest.raises(GeometryError, match=r"compact\('both'\) takes in_flight as \{'kv'.*flat list of 2 ids"):
        pool.compact("both", live)
    with pytest.raises(GeometryError, match=r"in-flight physical kv id 9999 is out of range \[0, "):
        pool.compact("kv", [9999])
    with pytest.raises(GeometryError, match=r"in_flight keys must be 'kv' and/or 'state', got \['pages'\]"):
        pool.compact("both", {"pages": live})
    assert_unchanged(before, pool)
    pool.compact("both", {"kv": live})
    assert [int(pool.v2p[v]) for v in pages[3:]] == live  # pinned pages stayed
    assert pool.compact("kv")  # unpinned, the same pages do move: the pins above were what held them
    assert [int(pool.v2p[v]) for v in pages[3:]] != live


def test_a_pool_without_a_side_says_so():
    from unimem_compile.errors import GeometryError

    pool = UnifiedPool(ArenaLayout.for_capacity(None, STATE, 4, 0, 2))
    with pytest.raises(GeometryError, match="this pool has no kv side: its layout holds no KV pages"):
        pool.alloc_pages(1)
    with pytest.raises(GeometryError, match="this pool has no kv side"):
        pool.free_pages([1])
    assert pool.alloc_pages(0) == [] and len(pool.alloc_slots(2)) == 2


def test_double_free_is_told_apart_from_never_allocated():
    pool = make_pool()
    pages = pool.alloc_pages(2)
    pool.free_pages([pages[0]])
    before = snapshot(pool)
    with pytest.raises(InvalidFree, match=f"virtual page {pages[0]} was already freed"):
        pool.free_pages([pages[1], pages[0]])  # the good id is not freed either
    assert_unchanged(before, pool)
    pool.free_pages([pages[1]])


def test_exhaustion_raises_with_the_numbers_and_changes_nothing():
    pool = make_pool(ps=4, n_pages=6, n_slots=2)
    lay = pool.layout
    pages = pool.alloc_pages(4)
    pool.alloc_slots(2)
    pool.free_pages([pages[0]])  # one hole at the top
    before = snapshot(pool)
    a = pool.allocator
    gap_pages = a._gap_capacity(a.kv)
    n = 1 + gap_pages + 1
    with pytest.raises(PoolExhausted) as info:
        pool.alloc_pages(n)
    e = info.value
    assert e.side == "kv"
    assert e.requested == n * lay.page_bytes
    assert e.available == a.free_gap_bytes
    assert e.reclaimable == {"kv": lay.page_bytes, "state": 0}
    assert f"asked for {n} pages ({n * lay.page_bytes} bytes)" in str(e)
    assert f"{a.free_gap_bytes} bytes" in str(e)
    assert_unchanged(before, pool)


def test_state_exhaustion_reports_state_side():
    pool = make_pool(ps=4, n_pages=2, n_slots=2)
    pool.alloc_pages(pool.allocator._gap_capacity(pool.allocator.kv))  # fill the gap with pages
    before = snapshot(pool)
    with pytest.raises(PoolExhausted) as info:
        pool.alloc_slots(1)
    assert info.value.side == "state" and info.value.requested == pool.layout.slot_bytes
    assert_unchanged(before, pool)


def test_allocation_compacts_the_other_side_when_that_makes_room():
    pool = make_pool(ps=4, n_pages=4, n_slots=6)
    slots = pool.alloc_slots(pool.allocator._gap_capacity(pool.allocator.state))
    g = torch.Generator().manual_seed(1)
    conv, rec = pool.state_views(0)
    keep = slots[-1]
    value = torch.randn(rec.shape[1:], generator=g)
    rec[pool.physical_slots([keep])[0]] = value
    pool.free_slots(slots[:-1])  # holes below the last live slot: the gap is still closed
    assert not pool.allocator.can_alloc("kv", 2)
    pages = pool.alloc_pages(2)  # must compact the state side first
    assert len(pages) == 2 and pool.compactions == 1
    conv, rec = pool.state_views(0)
    assert torch.equal(rec[pool.physical_slots([keep])[0]], value)
    pool.allocator.check_invariants()


def test_compaction_preserves_every_live_byte_and_skips_in_flight_ids():
    ps = 4
    pool = make_pool(ps=ps, n_pages=10, n_slots=5, poison=True)
    g = torch.Generator().manual_seed(2)
    pages = pool.alloc_pages(8)
    slots = pool.alloc_slots(5)
    locs = {vp: torch.arange(vp * ps, vp * ps + ps) for vp in pages}
    rows = {(vp, layer): torch.randn(ps, 48, generator=g) for vp in pages for layer in range(2)}
    for (vp, layer), r in rows.items():
        pool.write_kv(layer, locs[vp], r)
    states = {}
    for s in slots:
        conv, rec = pool.state_views(0)
        p = int(pool.physical_slots([s])[0])
        states[s] = (torch.randn(conv.shape[1:], generator=g), torch.randn(rec.shape[1:], generator=g))
        conv[p], rec[p] = states[s]
    pool.free_pages(pages[:5:2])
    pool.free_slots(slots[1:4:2])
    live_pages = [p for p in pages if p not in pages[:5:2]]
    live_slots = [s for s in slots if s not in slots[1:4:2]]
    pinned_page = pool.physical_pages([live_pages[-1]])[0]
    pinned_slot = int(pool.physical_slots([live_slots[-1]])[0])
    moves = pool.compact("both", {"kv": [pinned_page], "state": [pinned_slot]})
    assert moves, "the holes should have been closed"
    for m in moves:
        assert m.src != (pinned_page if m.side == "kv" else pinned_slot)
    assert pool.physical_pages([live_pages[-1]])[0] == pinned_page
    assert int(pool.physical_slots([live_slots[-1]])[0]) == pinned_slot
    for vp in live_pages:
        for layer in range(2):
            assert torch.equal(pool.read_kv(layer, locs[vp]), rows[(vp, layer)])
    conv, rec = pool.state_views(0)
    for s in live_slots:
        p = int(pool.physical_slots([s])[0])
        assert torch.equal(conv[p], states[s][0]) and torch.equal(rec[p], states[s][1])
    pool.allocator.check_invariants()


def test_poison_fills_freed_pages_and_slots_but_never_the_sink():
    pool = make_pool(poison=True)
    lay = pool.layout
    pages = pool.alloc_pages(3)
    slots = pool.alloc_slots(2)
    assert int(pool.arena[: lay.sink_floor].count_nonzero()) == 0
    phys_slot = int(pool.physical_slots([slots[1]])[0])
    slot_bytes = pool.arena[phys_slot * lay.slot_bytes : (phys_slot + 1) * lay.slot_bytes]
    assert int(slot_bytes.count_nonzero()) == 0  # allocated slots are zero-filled
    pool.free_slots([slots[1]])
    assert bool((slot_bytes == POISON_BYTE).all())
    p = pool.physical_pages([pages[1]])[0]
    pool.write_kv(0, torch.tensor([pages[1] * lay.page_size]), torch.ones(1, 48))
    pool.free_pages([pages[1]])
    page = pool.arena[p * lay.page_bytes : (p + 1) * lay.page_bytes]
    assert bool((page == POISON_BYTE).all())
    assert torch.isnan(page.view(torch.float32)).all()


def test_page_tables_grow_rows_atomically_and_release_everything():
    pool = make_pool(ps=4, n_pages=6, n_slots=1)
    pt = PageTables(pool, max_batch_size=3, max_pages_per_row=4)
    pt.grow([0, 2], [5, 9])
    assert pt.kv_len.tolist() == [5, 0, 9]
    assert (pt.page_table[0, :2] > 0).all() and (pt.page_table[0, 2:] == -1).all()
    assert (pt.page_table[2, :3] > 0).all() and int(pt.page_table[2, 3]) == -1
    locs = pt.locations(2, 3, 3)
    row_pages = pt.page_table[2].tolist()
    assert locs.tolist() == [row_pages[0] * 4 + 3, row_pages[1] * 4 + 0, row_pages[1] * 4 + 1]
    before = snapshot(pool)
    table = pt.page_table.clone()
    with pytest.raises(PoolExhausted):
        pt.grow([0, 1], [16, 16])  # 2 + 4 more pages: more than the 1 page left
    assert_unchanged(before, pool)
    assert torch.equal(pt.page_table, table)
    pt.release_all()
    assert pool.allocator.pages_used == 0 and (pt.page_table == -1).all() and (pt.kv_len == 0).all()


def test_page_tables_reject_rows_longer_than_the_table():
    from unimem_compile.errors import GeometryError

    pool = make_pool(ps=4, n_pages=6, n_slots=1)
    pt = PageTables(pool, max_batch_size=2, max_pages_per_row=2)
    with pytest.raises(GeometryError, match="would hold 9 tokens, more than max_pages_per_row=2 x page_size=4 = 8"):
        pt.grow([1], [9])
    assert pool.allocator.pages_used == 0


def test_page_tables_refuse_a_row_listed_twice_or_mismatched_lengths_before_allocating():
    """Both used to allocate pages no row recorded (a leak release_all could not free) or shrink a row."""
    from unimem_compile.errors import GeometryError

    pool = make_pool(ps=4, n_pages=6, n_slots=1)
    pt = PageTables(pool, max_batch_size=3, max_pages_per_row=4)
    pt.grow([1], [5])
    before, table, lengths = snapshot(pool), pt.page_table.clone(), pt.kv_len.clone()
    with pytest.raises(GeometryError, match="row 0 is listed twice in one grow"):
        pt.grow([0, 0], [2, 4])
    with pytest.raises(GeometryError, match="row 1 is listed twice in one grow"):
        pt.grow([1, 2, 1], [6, 2, 2])
    with pytest.raises(GeometryError, match="grow\\(\\) got 2 rows but 1 new lengths"):
        pt.grow([0, 2], [4])
    with pytest.raises(GeometryError, match="grow\\(\\) got 3 rows but 2 new lengths"):
        pt.grow([0, 1, 2], [4, 4])
    assert_unchanged(before, pool)
    assert torch.equal(pt.page_table, table) and torch.equal(pt.kv_len, lengths)
    pt.release_all()
    assert pool.allocator.pages_used == 0


def test_python_writes_never_touch_the_sink_even_on_virtual_page_zero():
    ps = 4
    pool = make_pool(ps=ps)
    pages = pool.alloc_pages(2)
    pool.free_pages([pages[1]])
    sink = pool.layout.sink_floor
    locs = torch.tensor([0 * ps + 3, 0 * ps + 1, -1, pages[1] * ps + 2, pages[0] * ps + 1])
    rows = torch.randn(5, 48, generator=torch.Generator().manual_seed(5))
    pool.write_kv(1, locs, rows)
    assert int(pool.arena[:sink].count_nonzero()) == 0
    assert torch.equal(pool.read_kv(1, locs[-1:]), rows[-1:])


def test_token_locations_equal_per_row_locations_on_scattered_pages():
    from unimem_compile.errors import GeometryError

    gen = torch.Generator().manual_seed(11)
    pool = make_pool(ps=4, n_pages=40, n_slots=1)
    pt = PageTables(pool, max_batch_size=5, max_pages_per_row=6)
    # interleave the rows' growth so their pages are scattered, then free a filler to leave holes
    filler = pool.alloc_pages(3)
    for step in range(1, 6):
        pt.grow(range(5), [int(n) for n in torch.randint(step * 3, step * 4 + 1, (5,), generator=gen)])
    pool.free_pages(filler[1:2])
    positions = torch.tensor([int(torch.randint(0, n, (1,), generator=gen)) for n in pt.lengths], dtype=torch.int64)
    want = torch.stack([pt.locations(b, int(positions[b]), 1)[0] for b in range(5)])
    assert pt.token_locations(positions).tolist() == want.tolist()
    assert pt.token_locations(positions[:3]).tolist() == want[:3].tolist()
    before = snapshot(pool)
    beyond = positions.clone()
    beyond[2] = len(pt.rows[2]) * 4
    with pytest.raises(GeometryError, match=rf"row 2: token {int(beyond[2])} lies outside its {len(pt.rows[2])} pages of 4"):
        pt.token_locations(beyond)
    with pytest.raises(GeometryError, match=r"positions must be \[B <= 5\], got \[6\]"):
        pt.token_locations(torch.zeros(6, dtype=torch.int64))
    assert_unchanged(before, pool)


def test_staged_upload_on_the_cpu_is_a_plain_copy_and_checks_its_depth():
    from unimem_compile.pool.staging import StagedUpload

    dst = torch.full((3, 4), -1, dtype=torch.int32)
    upload = StagedUpload(dst)
    src = torch.randint(0, 100, (3, 4), dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    upload(src)
    assert torch.equal(dst, src) and dst.data_ptr() != src.data_ptr()
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        StagedUpload(dst, depth=0)


def test_pool_exhausted_survives_pickling_with_its_numbers():
    # multiprocessing sends a worker's exception back pickled: keyword-only fields must come back by name
    import pickle

    e = PoolExhausted("kv side: asked for 3 pages", requested=3 * 4096, available=4096, side="kv",
                      reclaimable={"kv": 0, "state": 8192})
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is PoolExhausted and str(back) == str(e)
    assert (back.requested, back.available, back.side, back.reclaimable) == (12288, 4096, "kv",
                                                                             {"kv": 0, "state": 8192})
