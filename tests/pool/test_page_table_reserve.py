"""PageTables for a writer that advances the lengths on the device (the decode runner): ``reserve`` allocates
pages ahead without touching the stored lengths, all rows or none; ``set_length`` takes in what the device
wrote and frees the pages past it."""

import pytest

from unimem_compile.errors import GeometryError, PoolExhausted
from unimem_compile.pool import PageTables

from .test_allocator import assert_unchanged, make_pool, snapshot


def test_reserve_allocates_ahead_and_leaves_the_lengths_alone():
    pool = make_pool(ps=4, n_pages=8, n_slots=1)
    pt = PageTables(pool, max_batch_size=3, max_pages_per_row=4)
    pt.grow([0, 1], [3, 6])
    lengths, kv_len = list(pt.lengths), pt.kv_len.tolist()
    assert pt.reserve([0, 1, 2], [9, 8, 1]) == 2 + 0 + 1  # row 0: 1 -> 3 pages, row 1 holds 8 already, row 2: 1
    assert pt.lengths == lengths and pt.kv_len.tolist() == kv_len
    assert [len(r) for r in pt.rows] == [3, 2, 1]
    assert pt.host_table[0, :3].tolist() == pt.rows[0] and int(pt.host_table[0, 3]) == -1
    assert pt.reserve([0], [5]) == 0  # a smaller capacity never shrinks a row
    before, rows = snapshot(pool), [list(r) for r in pt.rows]
    with pytest.raises(PoolExhausted):
        pt.reserve([1, 2], [16, 16])  # 2 + 3 more pages: more than the 2 left
    assert_unchanged(before, pool)
    assert pt.rows == rows
    with pytest.raises(GeometryError, match="row 1 is listed twice in one reserve"):
        pt.reserve([1, 1], [4, 4])
    with pytest.raises(GeometryError, match="would hold 17 tokens, more than max_pages_per_row=4"):
        pt.reserve([2], [17])


def test_set_length_takes_in_the_device_length_and_frees_the_pages_past_it():
    pool = make_pool(ps=4, n_pages=8, n_slots=1)
    pt = PageTables(pool, max_batch_size=2, max_pages_per_row=4)
    pt.grow([0, 1], [2, 2])
    pt.reserve([0, 1], [16, 12])
    used = pool.allocator.pages_used
    kept = pt.rows[0][:2]
    assert pt.set_length(0, 7) == 2  # 7 tokens: 2 pages kept, 2 freed
    assert pt.rows[0] == kept and pt.lengths[0] == 7 and int(pt.kv_len[0]) == 7
    assert pt.host_table[0].tolist() == kept + [-1, -1]
    assert pool.allocator.pages_used == used - 2
    assert pt.set_length(1, 12) == 0 and pt.lengths[1] == 12  # exactly what its 3 pages hold
    assert pt.set_length(1, 0) == 3 and pt.rows[1] == []
    with pytest.raises(GeometryError, match="row 0: a length of 9 tokens does not fit its 2 pages of 4 tokens"):
        pt.set_length(0, 9)
    pool.allocator.check_invariants()
