"""translate_kv_loc(_dense)(_out): custom ops and the Triton kernel against the pool's formulas."""

import pytest
import torch

from unimem_compile.ops import translate as tr
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, UnifiedPool


def _pool_with_pages(page_size, n_pages, layer_num=3, free_some=True):
    kv = MLASpec(layer_num, 32, 16, torch.float32)
    st = LinearStateSpec.kda(1, 2, 8, 4, torch.float32)
    pool = UnifiedPool(ArenaLayout.for_capacity(kv, st, page_size, n_pages + 4, 2))
    pages = pool.alloc_pages(n_pages)
    if free_some:
        pool.free_pages(pages[1::3])  # tombstones in the middle
    return pool, pages


def _random_locs(pool, pages, n, gen):
    ps = pool.layout.page_size
    vp = torch.tensor(pages)[torch.randint(0, len(pages), (n,), generator=gen)]
    loc = vp * ps + torch.randint(0, ps, (n,), generator=gen)
    loc[torch.rand(n, generator=gen) < 0.2] = -1
    loc[0] = -7  # a negative id other than -1
    return loc


def _expected(pool, loc, mult):
    ps = pool.layout.page_size
    out = []
    for t in loc.tolist():
        if t < 0:
            out.append(0)
            continue
        p = int(pool.v2p[t // ps])
        out.append(0 if p < 0 else p * ps * mult + t % ps)
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_ops_and_kernel_match_the_formula_with_negatives_and_tombstones(page_size, gen):
    pool, pages = _pool_with_pages(page_size, 9)
    loc = _random_locs(pool, pages, 300, gen)
    L = pool.layout.layer_num
    for mult in (1, L):
        want = _expected(pool, loc, mult)
        assert torch.equal(torch.ops.unimem.translate_kv_loc_dense(pool.v2p, loc, page_size, mult), want)
        assert torch.equal(tr.translate_kv_loc_dense_triton(pool.v2p, loc, page_size, mult), want)
    assert torch.equal(torch.ops.unimem.translate_kv_loc(pool.v2p, loc, page_size), _expected(pool, loc, 1))


def test_locations_past_the_table_give_the_sink_on_both_paths():
    """The plain-torch op used to raise IndexError (not a library error) where the kernel gives the sink."""
    pool, pages = _pool_with_pages(4, 3)
    live = pages[0] * 4 + 1
    loc = torch.tensor([live, pool.v2p.numel() * 4, pool.v2p.numel() * 4 + 7, -1], dtype=torch.int64)
    want = torch.tensor([int(pool.v2p[pages[0]]) * 4 + 1, 0, 0, 0])
    assert torch.equal(torch.ops.unimem.translate_kv_loc(pool.v2p, loc, 4), want)
    assert torch.equal(tr.translate_kv_loc_dense_triton(pool.v2p, loc, 4, 1), want)
    out = loc.clone()
    torch.ops.unimem.translate_kv_loc_out(pool.v2p, out, 4, out)
    assert torch.equal(out, want)


@pytest.mark.parametrize("page_size", [1, 16])
def test_out_variants_may_alias_the_input_and_keep_its_address(page_size, gen):
    pool, pages = _pool_with_pages(page_size, 7)
    loc = _random_locs(pool, pages, 100, gen)
    L = pool.layout.layer_num
    want = _expected(pool, loc, L)
    for fn in (torch.ops.unimem.translate_kv_loc_dense_out,
               lambda v2p, v, ps, m, out: tr.translate_kv_loc_dense_triton(v2p, v, ps, m, out=out)):
        buf = loc.clone()
        ptr = buf.data_ptr()
        fn(pool.v2p, buf, page_size, L, buf)
        assert buf.data_ptr() == ptr and torch.equal(buf, want)
    out = torch.empty_like(loc)
    torch.ops.unimem.translate_kv_loc_out(pool.v2p, loc, page_size, out)
    assert torch.equal(out, _expected(pool, loc, 1))


def test_kernel_handles_non_contiguous_and_multidimensional_input(gen):
    pool, pages = _pool_with_pages(4, 6)
    loc = _random_locs(pool, pages, 64, gen).view(8, 8).t()
    want = _expected(pool, loc.reshape(-1), 3).view(8, 8)
    assert torch.equal(tr.translate_kv_loc_dense_triton(pool.v2p, loc, 4, 3).view(8, 8), want)


def test_opcheck_passes(gen):
    pool, pages = _pool_with_pages(16, 5)
    loc = _random_locs(pool, pages, 32, gen)
    torch.library.opcheck(torch.ops.unimem.translate_kv_loc_dense.default, (pool.v2p, loc, 16, 3))
    torch.library.opcheck(torch.ops.unimem.translate_kv_loc.default, (pool.v2p, loc, 16))
    torch.library.opcheck(torch.ops.unimem.translate_kv_loc_dense_out.default, (pool.v2p, loc, 16, 3, torch.empty_like(loc)))
    torch.library.opcheck(torch.ops.unimem.translate_kv_loc_out.default, (pool.v2p, loc, 16, torch.empty_like(loc)))


def test_bad_inputs_raise_specific_errors(gen):
    pool, pages = _pool_with_pages(16, 5)
    loc = _random_locs(pool, pages, 8, gen)
    with pytest.raises(TypeError, match="int64"):
        torch.ops.unimem.translate_kv_loc(pool.v2p, loc.int(), 16)
    with pytest.raises(ValueError, match=r"shape \[8\]"):
        torch.ops.unimem.translate_kv_loc_out(pool.v2p, loc, 16, torch.empty(7, dtype=torch.int64))
    with pytest.raises(ValueError, match="page_size"):
        tr.translate_kv_loc_dense_triton(pool.v2p, loc, 0, 1)


def test_debug_mode_rejects_locations_on_dead_pages(monkeypatch, gen):
    from unimem_compile.errors import GeometryError

    pool, pages = _pool_with_pages(16, 6)
    dead = pages[1]  # freed by _pool_with_pages
    loc = torch.tensor([pages[0] * 16 + 3, -1, dead * 16 + 5])
    tr.translate_kv_loc_dense_triton(pool.v2p, loc, 16, 3)  # no debug: masked to the sink
    monkeypatch.setenv("UNIMEM_DEBUG", "1")
    with pytest.raises(GeometryError, match=f"lane 2: location {dead * 16 + 5}"):
        tr.translate_kv_loc_dense_triton(pool.v2p, loc, 16, 3)


def test_compiled_graph_calls_the_op(gen):
    pool, pages = _pool_with_pages(16, 5)
    loc = _random_locs(pool, pages, 32, gen)

    def f(v2p, loc):
        return torch.ops.unimem.translate_kv_loc_dense(v2p, loc + 0, 16, 3) * 2

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(pool.v2p, loc)
    assert torch.equal(got, _expected(pool, loc, 3) * 2)
