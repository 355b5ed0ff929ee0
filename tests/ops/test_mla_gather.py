"""mla_gather: the custom op (plain-torch default impl) and the Triton kernel (interpreter) against a
per-row reference built from UnifiedPool.read_kv, with ragged rows, left pads, -1 / tombstoned pages and
pages scattered by compaction."""

import importlib

import pytest
import torch

from unimem_compile.errors import GeometryError
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, UnifiedPool

mg = importlib.import_module("unimem_compile.ops.mla_gather")

L, R, DR = 3, 32, 16
D = R + DR


def _filled_pool(page_size, dtype, lens, p_cols, gen, compact=False):
    """A pool whose rows ``b`` own ``ceil(lens[b] / ps)`` pages (interleaved with a freed page per row, so
    compaction has holes to fill), every layer's rows written with random values through
    ``UnifiedPool.write_kv``. Returns the pool and an int32 page table ``[B, p_cols]`` (-1 padded)."""
    kv = MLASpec(L, R, DR, dtype)
    st = LinearStateSpec.kda(1, 2, 8, 4, torch.float32)
    need = [-(-n // page_size) for n in lens]
    pool = UnifiedPool(ArenaLayout.for_capacity(kv, st, page_size, sum(need) + len(lens), 2))
    table = torch.full((len(lens), p_cols), -1, dtype=torch.int32)
    spare = []
    for b, k in enumerate(need):
        pages = pool.alloc_pages(k + 1)
        spare.append(pages[0])
        table[b, :k] = torch.tensor(pages[1:], dtype=torch.int32)
    pool.free_pages(spare)
    if compact:
        assert pool.compact("kv")
    for b, n in enumerate(lens):
        loc = _row_locations(table[b], n, page_size)
        for layer in range(L):
            pool.write_kv(layer, loc, torch.randn(n, D, generator=gen).to(dtype))
    return pool, table


def _row_locations(pages, n, ps):
    i = torch.arange(n)
    return pages.long()[i // ps] * ps + i % ps


def _expected(pool, table, lens, offsets, max_len, layer, dtype):
    """Row by row through UnifiedPool.read_kv, clipped at max_len."""
    ps = pool.layout.page_size
    out = torch.zeros(len(lens), max_len, D, dtype=dtype)
    for b, (n, off) in enumerate(zip(lens, offsets)):
        rows = pool.read_kv(layer, _row_locations(table[b], n, ps))
        keep = min(n, max(0, max_len - off))
        out[b, off: off + keep] = rows[:keep]
    return out


def _args(pool, table, lens, offsets, max_len, layer, dtype):
    return (pool.arena, pool.v2p, table, torch.tensor(lens, dtype=torch.int32),
            torch.tensor(offsets, dtype=torch.int32), max_len, layer, L, pool.layout.page_size, R, DR, dtype)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_and_op_gather_ragged_left_padded_rows_like_the_pool(page_size, dtype, gen):
    lens = {1: [5, 0, 9], 16: [37, 3, 16], 64: [70, 1, 64]}[page_size]
    offsets = [2, 4, 0]
    max_len = max(n + o for n, o in zip(lens, offsets)) + 3
    p_cols = max(-(-n // page_size) for n in lens) + 1
    pool, table = _filled_pool(page_size, dtype, lens, p_cols, gen)
    want = _expected(pool, table, lens, offsets, max_len, 1, dtype)
    args = _args(pool, table, lens, offsets, max_len, 1, dtype)
    got_op = torch.ops.unimem.mla_gather(*args)
    got_kernel = mg.mla_gather_triton(*args)
    for got in (got_op, got_kernel):
        assert got.shape == (3, max_len, D) and got.is_contiguous()
        assert torch.equal(got, want)
    assert want[0, offsets[0]].abs().sum() > 0  # the rows are not zeros


def test_gather_follows_pages_scattered_by_compaction(gen):
    lens, offsets = [40, 21], [0, 5]
    pool, table = _filled_pool(16, torch.float32, lens, 4, gen, compact=True)
    phys = pool.physical_pages(table[table >= 0].tolist())
    assert phys != sorted(phys, reverse=True)  # compaction moved pages out of allocation order
    want = _expected(pool, table, lens, offsets, 48, 2, torch.float32)
    got = mg.mla_gather_triton(*_args(pool, table, lens, offsets, 48, 2, torch.float32), block_n=8)
    assert torch.equal(got, want)


def test_missing_and_tombstoned_pages_read_as_zeros(gen):
    lens, offsets = [48, 30], [0, 1]
    pool, table = _filled_pool(16, torch.float32, lens, 3, gen)
    want = _expected(pool, table, lens, offsets, 40, 0, torch.float32)
    table = table.clone()
    table[0, 1] = -1  # positions 16..31 of row 0
    pool.free_pages([int(table[1, 0])])  # positions 1..16 of row 1
    want[0, 16:32] = 0
    want[1, 1:17] = 0
    for fn in (torch.ops.unimem.mla_gather, mg.mla_gather_triton):
        assert torch.equal(fn(*_args(pool, table, lens, offsets, 40, 0, torch.float32)), want)


def test_positions_past_max_len_are_dropped_and_raise_in_debug_mode(monkeypatch, gen):
    lens, offsets = [20, 9], [6, 0]
    pool, table = _filled_pool(16, torch.float16, lens, 2, gen)
    max_len = 18  # row 0 ends at 26
    want = _expected(pool, table, lens, offsets, max_len, 1, torch.float16)
    args = _args(pool, table, lens, offsets, max_len, 1, torch.float16)
    assert torch.equal(torch.ops.unimem.mla_gather(*args), want)
    assert torch.equal(mg.mla_gather_triton(*args), want)
    monkeypatch.setenv("UNIMEM_DEBUG", "1")
    for fn in (torch.ops.unimem.mla_gather, mg.mla_gather_triton):
        with pytest.raises(GeometryError, match="max_len 18: row 0: out_offset 6 \\+ kv_len 20"):
            fn(*args)


def test_debug_mode_rejects_holes_and_dead_pages_inside_kv_len(monkeypatch, gen):
    lens, offsets = [40, 10], [0, 0]
    pool, table = _filled_pool(16, torch.float32, lens, 3, gen)
    monkeypatch.setenv("UNIMEM_DEBUG", "1")
    mg.mla_gather_triton(*_args(pool, table, lens, offsets, 40, 0, torch.float32))
    holed = table.clone()
    holed[0, 1] = -1
    with pytest.raises(GeometryError, match="-1 inside kv_len: row 0 page 1"):
        mg.mla_gather_triton(*_args(pool, holed, lens, offsets, 40, 0, torch.float32))
    with pytest.raises(GeometryError, match="page_table has 3 columns: row 0: kv_len 49 needs 4 pages"):
        mg.mla_gather_triton(*_args(pool, table, [49, 10], offsets, 49, 0, torch.float32))
    dead = int(table[1, 0])
    pool.free_pages([dead])
    with pytest.raises(GeometryError, match=f"1 pages inside kv_len are not live: row 1 page slot 0: virtual page {dead}$"):
        torch.ops.unimem.mla_gather(*_args(pool, table, lens, offsets, 40, 0, torch.float32))


def test_non_contiguous_metadata_is_read_through_its_strides(gen):
    lens, offsets = [33, 12], [1, 3]
    pool, table = _filled_pool(16, torch.float32, lens, 3, gen)
    want = _expected(pool, table, lens, offsets, 36, 2, torch.float32)
    wide = torch.full((3, 2), -1, dtype=torch.int32)
    wide[:, 0] = table[0]
    wide[:, 1] = table[1]
    strided_table = wide.t()  # [2, 3] with strides (1, 2)
    meta = torch.tensor([[lens[0], offsets[0]], [lens[1], offsets[1]]], dtype=torch.int32)
    args = (pool.arena, pool.v2p, strided_table, meta[:, 0], meta[:, 1], 36, 2, L, 16, R, DR, torch.float32)
    assert not strided_table.is_contiguous() and meta[:, 0].stride() == (2,)
    assert torch.equal(mg.mla_gather_triton(*args), want)
    assert torch.equal(torch.ops.unimem.mla_gather(*args), want)


def test_opcheck_passes(gen):
    lens, offsets = [20, 7], [0, 2]
    pool, table = _filled_pool(16, torch.float32, lens, 2, gen)
    torch.library.opcheck(torch.ops.unimem.mla_gather.default, _args(pool, table, lens, offsets, 24, 1, torch.float32))


def test_compiled_write_then_gather_matches_eager(gen):
    """A write followed by a gather of the same layer in one fullgraph aot_eager graph."""
    lens, offsets = [20, 7], [0, 2]
    pool, table = _filled_pool(16, torch.float32, lens, 2, gen)
    loc = torch.cat([_row_locations(table[0], 3, 16) + 17, torch.tensor([-1])])
    new = torch.randn(4, D, generator=gen)
    kv_len = torch.tensor(lens, dtype=torch.int32)
    off = torch.tensor(offsets, dtype=torch.int32)

    def f(arena, v2p, table, kv_len, off, loc, new):
        torch.ops.unimem.mla_kv_write(arena, v2p, loc, new[:, :R], new[:, R:], 1, L, 16, R, DR, torch.float32)
        hist = torch.ops.unimem.mla_gather(arena, v2p, table, kv_len, off, 24, 1, L, 16, R, DR, torch.float32)
        return hist[..., :R].unsqueeze(1), hist[..., R:].unsqueeze(1)

    eager_arena, comp_arena = pool.arena.clone(), pool.arena.clone()
    want = f(eager_arena, pool.v2p, table, kv_len, off, loc, new)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(comp_arena, pool.v2p, table, kv_len, off, loc, new)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(want[0][0, 0, 17:20], new[:3, :R])
    assert torch.equal(comp_arena, eager_arena)


def test_bad_inputs_raise_errors_that_name_the_numbers(gen):
    lens, offsets = [20, 7], [0, 2]
    pool, table = _filled_pool(16, torch.float32, lens, 2, gen)
    args = list(_args(pool, table, lens, offsets, 24, 1, torch.float32))
    for fn in (torch.ops.unimem.mla_gather, mg.mla_gather_triton):
        with pytest.raises(TypeError, match="page_table must be torch.int32, got torch.int64"):
            fn(*args[:2], table.long(), *args[3:])
        with pytest.raises(GeometryError, match=r"kv_len must have shape \[2\], got \[3\]"):
            fn(*args[:3], torch.zeros(3, dtype=torch.int32), *args[4:])
        with pytest.raises(GeometryError, match=r"page_table must have 2 dimensions, got shape \(4,\)"):
            fn(*args[:2], table.reshape(-1), *args[3:])
        with pytest.raises(ValueError, match="max_len must be >= 0, got -1"):
            fn(*args[:5], -1, *args[6:])
        with pytest.raises(GeometryError, match=r"layer 5 is outside \[0, 3\)"):
            fn(*args[:6], 5, *args[7:])
    with pytest.raises(ValueError, match="block_n must be a power of two, got 6"):
        mg.mla_gather_triton(*args, block_n=6)
    empty = mg.mla_gather_triton(*args[:5], 0, *args[6:])
    assert empty.shape == (2, 0, D)


def test_a_page_table_without_columns_gathers_zeros(gen):
    pool, _ = _filled_pool(16, torch.float32, [5], 1, gen)
    empty = torch.zeros(2, 0, dtype=torch.int32)
    n = torch.tensor([3, 0], dtype=torch.int32)
    args = (pool.arena, pool.v2p, empty, n, torch.zeros(2, dtype=torch.int32), 7, 0, L, 16, R, DR, torch.float32)
    for out in (mg.mla_gather_triton(*args), torch.ops.unimem.mla_gather(*args)):
        assert out.shape == (2, 7, D) and out.dtype == torch.float32 and not out.any()
    torch.library.opcheck(torch.ops.unimem.mla_gather.default, args)
