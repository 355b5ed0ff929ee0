"""unimem::mla_decode: the reference and the Triton kernel (interpreter) against an independent dense
softmax computed in float64 from the rows the test wrote, over the pool's real page tables."""

import math

import pytest
import torch

from unimem_compile import env
from unimem_compile.errors import GeometryError
from unimem_compile.ops import mla_decode as md
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, UnifiedPool


L, R, DR, H = 3, 32, 16, 4
LAYER = 1
SCALE = 0.7 / math.sqrt(R + DR)


class Paged:
    """A poisoned pool (free and unwritten bytes are NaN) holding ragged rows of random latent KV, with
    the rows each layer received kept on the side as the ground truth."""

    def __init__(self, page_size, lens, dtype, gen, *, spare_pages=0, width=None):
        self.ps, self.dtype = page_size, dtype
        n_pages = sum(-(-n // page_size) for n in lens) + spare_pages
        kv = MLASpec(L, R, DR, dtype)
        st = LinearStateSpec.kda(1, 2, 8, 4, torch.float32)
        self.pool = UnifiedPool(ArenaLayout.for_capacity(kv, st, page_size, n_pages, 2), poison=True)
        self.P = width or max(1, max(-(-n // page_size) for n in lens))
        self.page_table = torch.full((len(lens), self.P), -1, dtype=torch.int32)
        self.kv_len = torch.tensor(lens, dtype=torch.int32)
        self.truth = []
        for b, n in enumerate(lens):
            pages = self.pool.alloc_pages(-(-n // page_size))
            self.page_table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            loc = torch.tensor([pages[i // page_size] * page_size + i % page_size for i in range(n)], dtype=torch.int64)
            rows = []
            for layer in range(L):
                x = torch.randn(n, R + DR, generator=gen).to(dtype)
                self.pool.write_kv(layer, loc, x)
                rows.append(x)
            self.truth.append(rows)

    def queries(self, gen, q_dtype=None):
        B = len(self.truth)
        dt = q_dtype or self.dtype
        return (torch.randn(B, H, R, generator=gen).to(dt), torch.randn(B, H, DR, generator=gen).to(dt))

    def args(self, q_nope, q_rope, layer=LAYER):
        return (q_nope, q_rope, self.pool.arena, self.pool.v2p, self.page_table, self.kv_len, SCALE, layer, L,
                self.ps, R, DR, self.dtype)


def dense_attention(q_nope, q_rope, truth, layer=LAYER, kv_len=None):
    """float64 softmax attention per row over the rows written for ``layer`` (zeros for empty rows)."""
    out = torch.zeros(q_nope.shape, dtype=torch.float64)
    for b, rows in enumerate(truth):
        kv = rows[layer].double()
        if kv_len is not None:
            kv = kv[: int(kv_len[b])]
        if kv.shape[0] == 0:
            continue
        q = torch.cat([q_nope[b], q_rope[b]], -1).double()
        p = torch.softmax(q @ kv.T * SCALE, -1)
        out[b] = p @ kv[:, :R]
    return out


TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


@pytest.mark.parametrize("page_size,lens", [(1, [37, 1, 0, 20]), (16, [37, 1, 0, 64]), (64, [130, 1, 0, 64])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_and_reference_equal_dense_softmax_on_ragged_rows(page_size, lens, dtype, gen):
    paged = Paged(page_size, lens, dtype, gen)
    qn, qr = paged.queries(gen)
    want = dense_attention(qn, qr, paged.truth)
    ref = torch.ops.unimem.mla_decode(*paged.args(qn, qr))
    got = md.mla_decode_triton(*paged.args(qn, qr), num_splits=2)
    for out in (ref, got):
        assert out.dtype == dtype and out.shape == (len(lens), H, R) and out.is_contiguous()
        torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # kv_len 0


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_split_count_does_not_change_the_result(num_splits, gen):
    # block_n 16 over rows of 0..70 tokens: 8 splits leave some splits of every row empty
    paged = Paged(16, [70, 17, 5, 48], torch.float32, gen, spare_pages=2, width=6)
    qn, qr = paged.queries(gen)
    got = md.mla_decode_triton(*paged.args(qn, qr), num_splits=num_splits, block_n=16)
    torch.testing.assert_close(got.double(), dense_attention(qn, qr, paged.truth), atol=2e-5, rtol=2e-5)


def test_many_splits_of_one_tile_each(gen):
    # 12 splits of 16-token tiles: rows of 192 and 190 tokens use all 12 (row 1's last tile partial), the
    # 37-token row 3 of them (16 tokens each, the last 5): the merge combines up to 12 partials per head
    paged = Paged(16, [192, 37, 190], torch.float32, gen, spare_pages=2)
    qn, qr = paged.queries(gen)
    got = md.mla_decode_triton(*paged.args(qn, qr), num_splits=12, block_n=16)
    torch.testing.assert_close(got.double(), dense_attention(qn, qr, paged.truth), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("merge_block_r, merge_block_s", [(16, 4), (64, 16)])
def test_merge_tiles_over_columns_and_split_chunks_do_not_change_the_result(merge_block_r, merge_block_s, gen):
    # 12 used splits read 4 at a time (three chunks) and R split over column programs: every partial of every
    # column must be weighted by its own log-sum-exp exactly once
    paged = Paged(16, [192, 37, 190], torch.float32, gen, spare_pages=2)
    qn, qr = paged.queries(gen)
    got = md.mla_decode_triton(*paged.args(qn, qr), num_splits=12, block_n=16, merge_block_r=merge_block_r,
                               merge_block_s=merge_block_s)
    torch.testing.assert_close(got.double(), dense_attention(qn, qr, paged.truth), atol=2e-5, rtol=2e-5)


def test_tiles_spanning_several_small_pages_and_multiple_tiles_per_split(gen):
    paged = Paged(4, [61, 9, 33], torch.float16, gen)
    qn, qr = paged.queries(gen)
    got = md.mla_decode_triton(*paged.args(qn, qr), num_splits=2, block_n=16)
    torch.testing.assert_close(got.double(), dense_attention(qn, qr, paged.truth), atol=4e-3, rtol=4e-3)


def test_rows_scattered_by_compaction_are_read_at_their_new_pages(gen):
    paged = Paged(16, [40, 40, 40, 40], torch.float32, gen)
    pool = paged.pool
    # free two rows, so the remaining rows' pages sit below holes and move up when compacted
    for b in (0, 2):
        pool.free_pages(int(v) for v in paged.page_table[b] if v >= 0)
    keep = [1, 3]
    vpages = [int(v) for b in keep for v in paged.page_table[b] if v >= 0]
    before = pool.physical_pages(vpages)
    assert pool.compact("kv")
    assert pool.physical_pages(vpages) != before
    qn, qr = paged.queries(gen)
    args = list(paged.args(qn[keep], qr[keep]))
    args[4], args[5] = paged.page_table[keep], paged.kv_len[keep]
    want = dense_attention(qn[keep], qr[keep], [paged.truth[b] for b in keep])
    for out in (torch.ops.unimem.mla_decode(*args), md.mla_decode_triton(*args, num_splits=2)):
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_pages_and_tokens_past_kv_len_are_never_read(gen):
    # row 0 stops mid-page (the rest of its page is NaN); its table continues with a freed page (tombstone,
    # NaN bytes) and a live page holding NaN; row 1's kv_len ends exactly at a page end
    paged = Paged(16, [21, 32], torch.float32, gen, spare_pages=2, width=4)
    pool = paged.pool
    freed, nan_page = pool.alloc_pages(2)
    pool.free_pages([freed])
    paged.page_table[0, 2:] = torch.tensor([freed, nan_page], dtype=torch.int32)
    paged.page_table[1, 2] = nan_page
    assert pool.read_kv(LAYER, torch.tensor([nan_page * 16])).isnan().all()
    qn, qr = paged.queries(gen)
    want = dense_attention(qn, qr, paged.truth)
    ref = torch.ops.unimem.mla_decode(*paged.args(qn, qr))
    for splits in (1, 2):
        got = md.mla_decode_triton(*paged.args(qn, qr), num_splits=splits, block_n=16)
        assert got.isfinite().all()
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ref.double(), want, atol=2e-5, rtol=2e-5)


def test_tombstone_inside_kv_len_reads_zero_rows_and_debug_mode_raises(monkeypatch, gen):
    paged = Paged(16, [40, 20], torch.float32, gen)
    dead = int(paged.page_table[0, 1])
    paged.pool.free_pages([dead])  # tokens 16..31 of row 0 now read as zero rows
    qn, qr = paged.queries(gen)
    paged.truth[0] = [rows.clone() for rows in paged.truth[0]]
    for rows in paged.truth[0]:
        rows[16:32] = 0
    want = dense_attention(qn, qr, paged.truth)
    # the arena as a view into a larger buffer whose bytes before it are NaN: a read through v2p = -1
    # would land there
    arena = paged.pool.arena
    padded = torch.full((arena.numel() + 4096,), 0xFF, dtype=torch.uint8)
    padded[4096:] = arena
    args = list(paged.args(qn, qr))
    args[2] = padded[4096:]
    for out in (torch.ops.unimem.mla_decode(*args), md.mla_decode_triton(*args)):
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    monkeypatch.setenv("UNIMEM_DEBUG", "1")
    for fn in (torch.ops.unimem.mla_decode, md.mla_decode_triton):
        with pytest.raises(GeometryError, match=f"row 0 page slot 1: virtual page {dead}"):
            fn(*paged.args(qn, qr))
    args = list(paged.args(qn, qr))
    args[5] = torch.tensor([3, 20 * 16], dtype=torch.int32)
    with pytest.raises(GeometryError, match=r"kv_len\[1\] = 320"):
        md.mla_decode_triton(*args)


def test_head_groups_strided_queries_and_fp32_queries_over_fp16_kv(gen):
    paged = Paged(16, [33, 7], torch.float16, gen)
    heads = 20  # two groups of 16 heads, the second one partly padded
    qn = torch.randn(heads, 2, R, generator=gen).transpose(0, 1)  # [B, H, R], last dim contiguous
    qr = torch.randn(2, heads, DR, generator=gen)
    assert not qn.is_contiguous()
    got = md.mla_decode_triton(*paged.args(qn, qr), num_splits=2, block_h=16)
    assert got.dtype == torch.float32
    # the kernel rounds q to the KV dtype for the fp16 products
    want = dense_attention(qn.half().float(), qr.half().float(), paged.truth)
    torch.testing.assert_close(got.double(), want, atol=4e-3, rtol=4e-3)


def test_each_layer_reads_its_own_rows(gen):
    paged = Paged(16, [25, 9], torch.float32, gen)
    qn, qr = paged.queries(gen)
    for layer in (0, L - 1):
        got = md.mla_decode_triton(*paged.args(qn, qr, layer=layer))
        torch.testing.assert_close(got.double(), dense_attention(qn, qr, paged.truth, layer), atol=2e-5, rtol=2e-5)


def test_default_split_count_fills_one_wave_and_ignores_kv_len():
    cpu = torch.device("cpu")
    wave = md.BLOCKS_PER_SM * md.INTERPRETER_SMS
    assert md.mla_decode_num_splits(1, 100, 32, 64, cpu) == wave
    assert md.mla_decode_num_splits(2, 100, 32, 64, cpu) == wave // 2
    assert md.mla_decode_num_splits(1, 100, 64, 64, cpu) == wave // 2  # two head groups
    assert md.mla_decode_num_splits(1, 1, 32, 64, cpu) == 1  # never more splits than tiles of a full row
    assert md.mla_decode_num_splits(4 * wave, 100, 32, 64, cpu) == 1


def test_opcheck_passes(gen):
    paged = Paged(16, [20, 0, 3], torch.float32, gen)
    qn, qr = paged.queries(gen)
    torch.library.opcheck(torch.ops.unimem.mla_decode.default, paged.args(qn, qr))


def test_compiled_graph_calls_the_op(gen):
    paged = Paged(16, [20, 5], torch.float32, gen)
    qn, qr = paged.queries(gen)
    args = paged.args(qn, qr)

    def f(qn, qr, arena, v2p, pt, kv_len):
        return torch.ops.unimem.mla_decode(qn * 1, qr, arena, v2p, pt, kv_len, *args[6:]) + 1

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(*args[:6])
    torch.testing.assert_close(got.double(), dense_attention(qn, qr, paged.truth) + 1, atol=2e-5, rtol=2e-5)


def test_bad_inputs_raise_specific_errors(gen):
    paged = Paged(16, [20, 5], torch.float32, gen)
    qn, qr = paged.queries(gen)
    args = list(paged.args(qn, qr))

    def call(**changes):
        a = list(args)
        for i, v in changes.items():
            a[int(i[1:])] = v
        return torch.ops.unimem.mla_decode(*a)

    with pytest.raises(TypeError, match="page_table must be torch.int32"):
        call(a4=paged.page_table.long())
    with pytest.raises(TypeError, match="q_rope must be torch.float32"):
        call(a1=qr.half())
    with pytest.raises(GeometryError, match=r"q_rope must have shape \[2, 4, 16\]"):
        call(a1=qr[:, :, :8])
    with pytest.raises(GeometryError, match=r"kv_len must have shape \[2\]"):
        call(a5=paged.kv_len[:1])
    with pytest.raises(GeometryError, match="layer 3 is outside"):
        call(a7=3)
    with pytest.raises(ValueError, match="block_n"):
        md.mla_decode_triton(*args, block_n=24)


def test_kernel_choice_portable_on_cpu_and_explicit_wgmma_refused_where_it_does_not_apply(gen, monkeypatch):
    paged = Paged(16, [20, 5], torch.float32, gen)
    qn, qr = paged.queries(gen)
    args = paged.args(qn, qr)
    assert not md.wgmma_supported(torch.device("cpu"), torch.bfloat16, 64, 512, 64)
    want = md.mla_decode_triton(*args, kernel="portable")
    torch.testing.assert_close(md.mla_decode_triton(*args), want, atol=0, rtol=0)  # auto -> portable here
    monkeypatch.setenv(env.MLA_DECODE_KERNEL, "portable")
    torch.testing.assert_close(md.mla_decode_triton(*args), want, atol=0, rtol=0)
    with pytest.raises(ValueError, match=rf"wgmma kernel needs an sm_90 GPU.*got device cpu, torch.float32, "
                                         rf"page_size 16, kv_lora_rank {R}, qk_rope_head_dim {DR}"):
        md.mla_decode_triton(*args, kernel="wgmma")
    monkeypatch.setenv(env.MLA_DECODE_KERNEL, "fastest")
    with pytest.raises(ValueError, match=r"kernel must be one of \('auto', 'portable', 'wgmma'\), got 'fastest'"):
        md.mla_decode_triton(*args)


@pytest.mark.parametrize("knob, value, message", [
    ("num_splits", 0, "num_splits must be an int >= 1, got 0"),
    ("num_splits", 2.0, "num_splits must be an int >= 1, got 2.0"),
    ("block_h", 3, "block_h must be a power of two >= 16, got 3"),
    ("block_h", 8, "block_h must be a power of two >= 16, got 8"),
    ("num_warps", 3, "num_warps must be a power of two >= 1, got 3"),
    ("num_stages", 0, "num_stages must be an int >= 1, got 0"),
    ("merge_block_r", 48, "merge_block_r must be a power of two >= 1, got 48"),
    ("merge_block_s", 0, "merge_block_s must be a power of two >= 1, got 0"),
    ("partial_dtype", torch.int32, "partial_dtype must be torch.float32, torch.bfloat16 or torch.float16, got torch.int32"),
    ("partial_dtype", torch.uint8, "partial_dtype must be torch.float32, torch.bfloat16 or torch.float16, got torch.uint8"),
])
def test_tuning_knobs_out_of_range_raise_instead_of_computing_garbage(knob, value, message, gen):
    paged = Paged(16, [20, 5], torch.float32, gen)
    qn, qr = paged.queries(gen)
    with pytest.raises(ValueError, match=f"mla_decode: {message}$"):
        md.mla_decode_triton(*paged.args(qn, qr), **{knob: value})


def test_auto_falls_back_to_the_portable_kernel_when_gluon_cannot_compile_the_hopper_one(gen, monkeypatch):
    # Gluon is experimental: a Triton whose Gluon rejects the Hopper kernel must cost speed, not the call
    import triton.compiler.errors

    from unimem_compile.ops import mla_decode_hopper as hop

    paged = Paged(16, [20, 5], torch.float32, gen)
    qn, qr = paged.queries(gen)
    args = paged.args(qn, qr)
    want = md.mla_decode_triton(*args, kernel="portable")
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise triton.compiler.errors.CompilationError(None, None, "async_copy_global_to_shared has been removed")

    monkeypatch.setattr(hop, "WGMMA_DISABLED", None)
    monkeypatch.setattr(md, "wgmma_supported", lambda *a: hop.WGMMA_DISABLED is None)
    monkeypatch.setattr(md, "mla_decode_stage1_wgmma", broken)
    with pytest.raises(triton.compiler.errors.CompilationError):  # asked for by name: the error stands
        md.mla_decode_triton(*args, kernel="wgmma")
    with pytest.warns(RuntimeWarning, match="does not compile with triton .*async_copy_global_to_shared has been "
                                            "removed.*portable Triton kernel from now on"):
        got = md.mla_decode_triton(*args)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert hop.WGMMA_DISABLED is not None and len(calls) == 2
    torch.testing.assert_close(md.mla_decode_triton(*args), want, atol=0, rtol=0)  # no retry, no new warning
    assert len(calls) == 2
