"""mla_kv_write / mla_kv_write_rmsnorm: the custom ops (plain-torch default impl) and the Triton kernel
(interpreter) against a per-token reference built from the pool's layout offsets, byte for byte over the
whole arena."""

import importlib

import pytest
import torch

from unimem_compile.errors import GeometryError
from unimem_compile.ops.common import latent_rows
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, UnifiedPool

mw = importlib.import_module("unimem_compile.ops.mla_write")

L, R, DR = 3, 32, 16
D = R + DR


def _pool(page_size, dtype, n_pages=10, free=(1, 4), compact=False):
    """A pool with ``n_pages`` allocated pages, some freed (tombstones); after ``compact`` the live pages are
    scattered: their physical order no longer follows the virtual one."""
    kv = MLASpec(L, R, DR, dtype)
    st = LinearStateSpec.kda(1, 2, 8, 4, torch.float32)
    pool = UnifiedPool(ArenaLayout.for_capacity(kv, st, page_size, n_pages + 2, 2))
    pages = pool.alloc_pages(n_pages)
    dead = [pages[i] for i in free]
    pool.free_pages(dead)
    live = [p for p in pages if p not in dead]
    if compact:
        assert pool.compact("kv")
    return pool, live, dead


def _locations(pool, live, dead, n, gen):
    """``n`` distinct live locations, then every kind of lane that must write nothing: -1, another negative
    id, a tombstoned page, virtual page 0 (the sink) and a page past the table. Shuffled."""
    ps = pool.layout.page_size
    slots = torch.randperm(len(live) * ps, generator=gen)[:n]
    loc = torch.tensor(live)[slots // ps] * ps + slots % ps
    masked = torch.tensor([-1, -5, dead[0] * ps + ps // 2, ps - 1, pool.v2p.numel() * ps + 3])
    loc = torch.cat([loc, masked])
    return loc[torch.randperm(loc.numel(), generator=gen)]


def _expected_arena(pool, before, loc, layer, rows):
    """Per-token reference: copy each live lane's row bytes to ``layout.kv_row_offset``; nothing else."""
    lay, ps = pool.layout, pool.layout.page_size
    out = before.clone()
    raw = rows.contiguous().view(torch.uint8).view(rows.shape[0], -1)
    for lane, t in enumerate(loc.tolist()):
        if t < 0 or t // ps >= pool.v2p.numel():
            continue
        p = int(pool.v2p[t // ps])
        if p <= 0:
            continue
        off = lay.kv_row_offset(p, layer, t % ps)
        out[off: off + raw.shape[1]] = raw[lane]
    return out


def _inputs(t, in_dtype, gen):
    """kv_nope and k_rope as the two halves of one [T, R + Dr] tensor, as transformers splits them."""
    both = torch.randn(t, D, generator=gen).to(in_dtype)
    return both[:, :R], both[:, R:]


def _assert_untouched_outside(pool, before, after, loc, layer):
    """The sink is still zero and bytes outside the live lanes' rows are unchanged."""
    assert not after[: pool.layout.sink_floor].any()
    mask = torch.ones_like(before, dtype=torch.bool)
    rows, live = latent_rows(pool.v2p, loc, layer, L, pool.layout.page_size)
    row_bytes = D * pool.layout.kv.itemsize
    for r in rows[live].tolist():
        mask[r * row_bytes: (r + 1) * row_bytes] = False
    assert torch.equal(after[mask], before[mask])


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_and_op_write_exactly_the_per_token_reference_bytes(page_size, dtype, gen):
    pool, live, dead = _pool(page_size, dtype)
    loc = _locations(pool, live, dead, 13, gen)
    nope, rope = _inputs(loc.numel(), dtype, gen)
    layer = 2
    before = pool.arena.clone()
    want = _expected_arena(pool, before, loc, layer, torch.cat([nope, rope], 1))

    got_op = before.clone()
    torch.ops.unimem.mla_kv_write(got_op, pool.v2p, loc, nope, rope, layer, L, page_size, R, DR, dtype)
    assert torch.equal(got_op, want)
    got_kernel = before.clone()
    mw.mla_kv_write_triton(got_kernel, pool.v2p, loc, nope, rope, layer, L, page_size, R, DR, dtype, block_t=4)
    assert torch.equal(got_kernel, want)
    _assert_untouched_outside(pool, before, got_kernel, loc, layer)

    pool.arena.copy_(got_kernel)
    keep = loc >= 0
    keep &= torch.tensor([0 <= t // page_size < pool.v2p.numel() and int(pool.v2p[t // page_size]) > 0
                          for t in loc.tolist()])
    assert torch.equal(pool.read_kv(layer, loc[keep]), torch.cat([nope, rope], 1)[keep])


def test_input_dtypes_are_cast_at_the_store(gen):
    pool, live, dead = _pool(16, torch.float16)
    loc = _locations(pool, live, dead, 9, gen)
    nope = torch.randn(loc.numel(), R, generator=gen)  # fp32 input into an fp16 cache
    rope = torch.randn(loc.numel(), DR, generator=gen).half()
    want = _expected_arena(pool, pool.arena, loc, 0, torch.cat([nope.half(), rope], 1))
    got = pool.arena.clone()
    mw.mla_kv_write_triton(got, pool.v2p, loc, nope, rope, 0, L, 16, R, DR, torch.float16)
    assert torch.equal(got, want)


def test_lanes_that_must_not_write_leave_the_arena_unchanged(gen):
    pool, live, dead = _pool(4, torch.float32)
    ps = 4
    loc = torch.tensor([-1, -9, dead[0] * ps, dead[1] * ps + 3, 0, 3, pool.v2p.numel() * ps, 10**12])
    nope, rope = _inputs(loc.numel(), torch.float32, gen)
    before = pool.arena.clone()
    mw.mla_kv_write_triton(pool.arena, pool.v2p, loc, nope, rope, 1, L, ps, R, DR, torch.float32)
    torch.ops.unimem.mla_kv_write(pool.arena, pool.v2p, loc, nope, rope, 1, L, ps, R, DR, torch.float32)
    assert torch.equal(pool.arena, before)


def test_writes_follow_pages_scattered_by_compaction(gen):
    pool, live, dead = _pool(16, torch.float32, n_pages=8, free=(0, 2, 5), compact=True)
    phys = pool.physical_pages(live)
    assert phys != sorted(phys, reverse=True)  # no longer in allocation order
    loc = _locations(pool, live, dead, 20, gen)
    nope, rope = _inputs(loc.numel(), torch.float32, gen)
    want = _expected_arena(pool, pool.arena, loc, 1, torch.cat([nope, rope], 1))
    mw.mla_kv_write_triton(pool.arena, pool.v2p, loc, nope, rope, 1, L, 16, R, DR, torch.float32, block_t=8)
    assert torch.equal(pool.arena, want)


def test_rows_survive_a_later_compaction(gen):
    pool, live, dead = _pool(16, torch.float16, n_pages=8, free=(0,))
    loc = _locations(pool, live, dead, 40, gen)
    nope, rope = _inputs(loc.numel(), torch.float16, gen)
    mw.mla_kv_write_triton(pool.arena, pool.v2p, loc, nope, rope, 0, L, 16, R, DR, torch.float16, block_t=8)
    pool.free_pages([live[0]])
    assert pool.compact("kv")
    vpage = torch.div(loc, 16, rounding_mode="floor")
    keep = torch.isin(vpage, torch.tensor(live[1:]))
    assert torch.equal(pool.read_kv(0, loc[keep]), torch.cat([nope, rope], 1)[keep])


def _hf_rmsnorm(weight, eps):
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNorm

    norm = KimiLinearRMSNorm(weight.numel(), eps=eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rmsnorm_write_equals_the_transformers_module_then_a_plain_write(dtype, gen):
    """The op (plain torch) is bitwise the module + write. The kernel under the interpreter reduces the
    mean of squares in another order than torch's CPU sum: fp32 within 4 ulp; fp16 bitwise for these inputs
    (a 1-ulp fp32 difference rarely moves an fp16 rounding)."""
    ps, layer, eps = 16, 1, 1e-6
    pool, live, dead = _pool(ps, dtype)
    loc = _locations(pool, live, dead, 15, gen)
    x, rope = _inputs(loc.numel(), dtype, gen)
    x = x * 3 + 0.5  # a scale and offset the norm must remove
    weight = (torch.rand(R, generator=gen) + 0.5).to(dtype)
    with torch.no_grad():
        normed = _hf_rmsnorm(weight, eps)(x)
    want = pool.arena.clone()
    torch.ops.unimem.mla_kv_write(want, pool.v2p, loc, normed, rope, layer, L, ps, R, DR, dtype)

    got_op = pool.arena.clone()
    torch.ops.unimem.mla_kv_write_rmsnorm(got_op, pool.v2p, loc, x, rope, weight, eps, layer, L, ps, R, DR, dtype)
    assert torch.equal(got_op, want)

    got = pool.arena.clone()
    mw.mla_kv_write_rmsnorm_triton(got, pool.v2p, loc, x, rope, weight, eps, layer, L, ps, R, DR, dtype, block_t=2)
    _assert_untouched_outside(pool, pool.arena, got, loc, layer)
    if dtype == torch.float16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.view(dtype), want.view(dtype), rtol=4 * 2.0**-23, atol=0)
        assert not torch.equal(got.view(dtype), pool.arena.view(dtype))


def test_rmsnorm_promotes_like_torch_when_weight_and_input_dtypes_differ(gen):
    """fp16 input, fp32 weight: y is rounded to fp16, weight * y is fp32, then stored as fp16."""
    pool, live, dead = _pool(16, torch.float16)
    loc = _locations(pool, live, dead, 10, gen)
    x, rope = _inputs(loc.numel(), torch.float16, gen)
    weight = torch.rand(R, generator=gen) * 2 + 0.1
    want = pool.arena.clone()
    torch.ops.unimem.mla_kv_write(want, pool.v2p, loc, mw.rmsnorm_reference(x, weight, 1e-5), rope, 0, L, 16, R, DR,
                                  torch.float16)
    got = pool.arena.clone()
    mw.mla_kv_write_rmsnorm_triton(got, pool.v2p, loc, x, rope, weight, 1e-5, 0, L, 16, R, DR, torch.float16)
    assert torch.equal(got, want)


def test_opcheck_passes(gen):
    pool, live, dead = _pool(16, torch.float32)
    loc = _locations(pool, live, dead, 8, gen)
    nope, rope = _inputs(loc.numel(), torch.float32, gen)
    weight = torch.rand(R, generator=gen) + 0.5
    torch.library.opcheck(torch.ops.unimem.mla_kv_write.default,
                          (pool.arena.clone(), pool.v2p, loc, nope, rope, 1, L, 16, R, DR, torch.float32))
    torch.library.opcheck(torch.ops.unimem.mla_kv_write_rmsnorm.default,
                          (pool.arena.clone(), pool.v2p, loc, nope, rope, weight, 1e-6, 1, L, 16, R, DR, torch.float32))


def test_compiled_function_calling_the_ops_matches_eager(gen):
    pool, live, dead = _pool(16, torch.float32)
    loc = _locations(pool, live, dead, 8, gen)
    x, rope = _inputs(loc.numel(), torch.float32, gen)
    weight = torch.rand(R, generator=gen) + 0.5

    def f(arena, v2p, loc, x, rope, weight):
        torch.ops.unimem.mla_kv_write(arena, v2p, loc, x * 2, rope, 0, L, 16, R, DR, torch.float32)
        torch.ops.unimem.mla_kv_write_rmsnorm(arena, v2p, loc, x, rope + 1, weight, 1e-6, 2, L, 16, R, DR,
                                              torch.float32)
        return arena.view(torch.float32).sum()

    eager, compiled = pool.arena.clone(), pool.arena.clone()
    s_eager = f(eager, pool.v2p, loc, x, rope, weight)
    s_comp = torch.compile(f, backend="aot_eager", fullgraph=True)(compiled, pool.v2p, loc, x, rope, weight)
    assert torch.equal(compiled, eager) and not torch.equal(eager, pool.arena)
    assert torch.equal(s_comp, s_eager)


def test_bad_inputs_raise_errors_that_name_the_numbers(gen):
    pool, live, dead = _pool(16, torch.float32)
    loc = _locations(pool, live, dead, 6, gen)
    t = loc.numel()
    nope, rope = _inputs(t, torch.float32, gen)
    a, v = pool.arena, pool.v2p
    for fn in (torch.ops.unimem.mla_kv_write, mw.mla_kv_write_triton):
        with pytest.raises(TypeError, match="virt_loc must be torch.int64, got torch.int32"):
            fn(a, v, loc.int(), nope, rope, 0, L, 16, R, DR, torch.float32)
        with pytest.raises(GeometryError, match=rf"kv_nope must have shape \[{t}, {R}\], got \[{t - 1}, {R}\]"):
            fn(a, v, loc, nope[1:], rope, 0, L, 16, R, DR, torch.float32)
        with pytest.raises(GeometryError, match=rf"k_rope must have shape \[{t}, {DR}\], got \[{t}, 8\]"):
            fn(a, v, loc, nope, rope[:, :8], 0, L, 16, R, DR, torch.float32)
        with pytest.raises(GeometryError, match=rf"last-dimension stride of 1, got strides \(1, {t + 3}\)"):
            fn(a, v, loc, nope, torch.randn(DR, t + 3, generator=gen)[:, :t].t(), 0, L, 16, R, DR, torch.float32)
        with pytest.raises(GeometryError, match=rf"layer {L} is outside \[0, {L}\)"):
            fn(a, v, loc, nope, rope, L, L, 16, R, DR, torch.float32)
        with pytest.raises(GeometryError, match="arena bytes, the arena has"):
            fn(a[:1000], v, loc, nope, rope, 0, L, 16, R, DR, torch.float32)
        with pytest.raises(TypeError, match="kv_dtype"):
            fn(a, v, loc, nope, rope, 0, L, 16, R, DR, torch.int32)
    with pytest.raises(GeometryError, match=rf"norm_weight must have shape \[{R}\], got \[{R + 1}\]"):
        mw.mla_kv_write_rmsnorm_triton(a, v, loc, nope, rope, torch.ones(R + 1), 1e-6, 0, L, 16, R, DR, torch.float32)
    with pytest.raises(ValueError, match="eps must be a non-negative float, got -1.0"):
        torch.ops.unimem.mla_kv_write_rmsnorm(a, v, loc, nope, rope, torch.ones(R), -1.0, 0, L, 16, R, DR,
                                              torch.float32)
    with pytest.raises(ValueError, match="v2p is on meta but arena is on cpu"):
        mw.mla_kv_write_triton(a, v.to("meta"), loc, nope, rope, 0, L, 16, R, DR, torch.float32)
    with pytest.raises(ValueError, match="block_t must be a power of two, got 3"):
        mw.mla_kv_write_triton(a, v, loc, nope, rope, 0, L, 16, R, DR, torch.float32, block_t=3)


def test_debug_mode_rejects_locations_on_dead_pages(monkeypatch, gen):
    pool, live, dead = _pool(16, torch.float32)
    loc = torch.tensor([live[0] * 16 + 2, -1, dead[0] * 16 + 5])
    nope, rope = _inputs(3, torch.float32, gen)
    before = pool.arena.clone()
    monkeypatch.setenv("UNIMEM_DEBUG", "1")
    for fn in (torch.ops.unimem.mla_kv_write, mw.mla_kv_write_triton):
        with pytest.raises(GeometryError, match=f"lane 2: location {dead[0] * 16 + 5}"):
            fn(pool.arena, pool.v2p, loc, nope, rope, 0, L, 16, R, DR, torch.float32)
    assert torch.equal(pool.arena, before)


def test_empty_write_is_a_no_op(gen):
    pool, _, _ = _pool(16, torch.float32)
    before = pool.arena.clone()
    empty = torch.empty(0, dtype=torch.int64)
    mw.mla_kv_write_triton(pool.arena, pool.v2p, empty, torch.empty(0, R), torch.empty(0, DR), 0, L, 16, R, DR,
                           torch.float32)
    assert torch.equal(pool.arena, before)


def test_inputs_read_from_the_arena_itself_are_read_before_any_store(gen):
    """Rows copied between locations of the same page (source and destination overlap): the kernel gives
    the reference's result, every input read before anything is stored (it copies such inputs first)."""
    results, values = [], torch.randn(16, D, generator=gen)
    for fn in (torch.ops.unimem.mla_kv_write, mw.mla_kv_write_triton):
        pool, live, _ = _pool(16, torch.float32)
        loc = torch.arange(live[0] * 16, live[0] * 16 + 16)
        pool.write_kv(1, loc, values)
        before = pool.read_kv(1, loc)
        rows = pool.kv_views()[1][:, 0]  # [dense rows, D] of layer 1, a view of the arena
        first = int(pool.dense_rows(loc[:1])[0])
        src = rows[first: first + 15]  # tokens 0..14 of the page, written to tokens 1..15
        assert src.untyped_storage().data_ptr() == pool.arena.untyped_storage().data_ptr()
        fn(pool.arena, pool.v2p, loc[1:], src[:, :R], src[:, R:], 1, L, 16, R, DR, torch.float32)
        after = pool.read_kv(1, loc)
        assert torch.equal(after[1:], before[:15]) and torch.equal(after[0], before[0])
        results.append(pool.arena.clone())
        # the same bytes through a tensor with a storage of its own (DLPack): undone, then done again
        pool.write_kv(1, loc, values)
        alias = torch.from_dlpack(rows[first: first + 15])
        assert alias.untyped_storage().data_ptr() != pool.arena.untyped_storage().data_ptr()
        fn(pool.arena, pool.v2p, loc[1:], alias[:, :R], alias[:, R:], 1, L, 16, R, DR, torch.float32)
        assert torch.equal(pool.arena, results[-1])
    assert torch.equal(results[0], results[1])


def test_an_arena_view_that_cannot_be_read_as_kv_dtype_rows_is_refused(gen):
    pool, live, _ = _pool(16, torch.float32)
    nope, rope = _inputs(2, torch.float32, gen)
    loc = torch.tensor([live[0] * 16, live[0] * 16 + 1])
    shifted = torch.zeros(pool.arena.numel() + 16, dtype=torch.uint8)
    for fn in (torch.ops.unimem.mla_kv_write, mw.mla_kv_write_triton):
        view = shifted[2: 2 + pool.arena.numel()]
        before = shifted.clone()
        with pytest.raises(GeometryError, match="starts at byte 2 of its storage, not a multiple of 4 bytes"):
            fn(view, pool.v2p, loc, nope, rope, 0, L, 16, R, DR, torch.float32)
        assert torch.equal(shifted, before)
    # a 4-byte offset can be read as fp32 rows: the write lands at the same bytes, shifted by 4
    view = shifted[4: 4 + pool.arena.numel()]
    mw.mla_kv_write_triton(view, pool.v2p, loc, nope, rope, 0, L, 16, R, DR, torch.float32)
    torch.ops.unimem.mla_kv_write(pool.arena, pool.v2p, loc, nope, rope, 0, L, 16, R, DR, torch.float32)
    assert torch.equal(shifted[4: 4 + pool.arena.numel()], pool.arena)


def _unspecialised(kernel) -> set[str]:
    """The arguments a Triton kernel takes unspecialised: a compiled JITFunction's params, or the decorator's
    arguments the interpreter keeps."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return {p.name for p in params if p.do_not_specialize}
    return set(kernel.kwargs.get("do_not_specialize") or ())


@pytest.mark.parametrize("kernel", [mw._mla_kv_write_kernel, mw._mla_kv_write_fp8_kernel])
def test_write_kernels_compile_one_variant_whatever_the_token_count(kernel):
    """T only bounds the lanes: specialised (Triton's == 1 and % 16 classes) it made a serving run compile a
    new variant per block size as chunk lengths varied (benchmarks/bench_serving.py's warm-up relies on this)."""
    assert "T" in _unspecialised(kernel)
