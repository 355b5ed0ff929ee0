"""fp8 MLA rows: the e4m3 codec in Triton against torch's own conversions (both formats, bit for bit), the
quantising write and the dequantising gather (Triton interpreter and the plain-torch op) against
``x.to(format).to(float32)``, the error bound of ops/fp8.py, and the decode reference on fp8 rows.

The FNUZ checks are the upstream bug class where the store dtype is silently read as another fp8 format:
every read here is compared with the value torch gives for the format that WROTE it, and the two formats
give different bytes and values for the same inputs, so a read through the wrong one cannot pass."""

import importlib

import pytest
import torch
import triton
import triton.language as tl

from unimem_compile.errors import GeometryError
from unimem_compile.ops import fp8
from unimem_compile.ops.common import latent_rows
from unimem_compile.pool import ArenaLayout, MLASpec, UnifiedPool

mw = importlib.import_module("unimem_compile.ops.mla_write")
mg = importlib.import_module("unimem_compile.ops.mla_gather")
md = importlib.import_module("unimem_compile.ops.mla_decode")

FORMATS = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
L, PS = 3, 16


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, FNUZ: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, fp8.fp8_encode(tl.load(x_ptr + i, mask=i < n), FNUZ).to(tl.uint8), mask=i < n)


@triton.jit
def _decode_kernel(code_ptr, out_ptr, n, FNUZ: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, fp8.fp8_decode(tl.load(code_ptr + i, mask=i < n), FNUZ), mask=i < n)


@triton.jit
def _bf16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, fp8.to_bf16_rne(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


def _launch(kernel, x, out, **kw):
    kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), **kw, BLOCK=1024)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_decodes_to_torchs_value_bit_for_bit(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(fmt).to(torch.float32)
    got = _launch(_decode_kernel, codes, torch.empty(256), FNUZ=fp8.FNUZ[fmt])
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == (1 if fmt is FORMATS[1] else 2)
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))  # -0.0 included


@triton.jit
def _f16_bits_kernel(code_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, fp8.fp8_f16_bits(tl.load(code_ptr + i, mask=i < n)), mask=i < n)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_as_f16_bits_is_its_value_times_a_power_of_two_bit_for_bit(fmt):
    # the Hopper fp8 kernel's integer-only e4m3 -> f16 (f16_values): one path for both formats, the power of
    # two (2^-8 e4m3fn, 2^-7 e4m3fnuz) folded into the scale. Every finite code, subnormals and -0 included,
    # in the interpreter and in plain torch; fp32 holds every f16 and e4m3 value exactly, so the products are
    # exact and compared as bits
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(fmt).to(torch.float32)
    k = fp8.F16_BITS_EXPONENT[fmt]
    got = _launch(_f16_bits_kernel, codes, torch.empty(256, dtype=torch.float16))
    assert torch.equal(got.view(torch.int16), fp8.codes_as_f16(codes).view(torch.int16))
    finite = ~want.isnan()
    assert int(finite.sum()) == (255 if fmt is FORMATS[1] else 254)
    scaled = got.to(torch.float32) * 2.0 ** k
    assert torch.equal(scaled[finite].view(torch.int32), want[finite].view(torch.int32))
    # the NaN codes are not NaN here (the write never stores them for a finite tile): e4m3fn's +-0x7F read as
    # +-480, e4m3fnuz's 0x80 as -0
    nan_reads = {torch.float8_e4m3fn: {127: 480.0, 255: -480.0}, torch.float8_e4m3fnuz: {128: -0.0}}[fmt]
    assert {i: float(scaled[i]) for i in torch.nonzero(~finite).flatten().tolist()} == nan_reads
    # and the wrong power of two (the other format's) is wrong on every nonzero code
    other = fp8.F16_BITS_EXPONENT[FORMATS[1] if fmt is FORMATS[0] else FORMATS[0]]
    nonzero = finite & (want != 0)
    assert not bool((got.to(torch.float32)[nonzero] * 2.0 ** other == want[nonzero]).any())


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_f16_chain_dequantises_within_its_stated_bound_of_the_exact_values(fmt, gen):
    # fp8.dequantize_f16 (the f16 chain's arithmetic: f16 code bits times f16(scale * 2^k), one f16 product)
    # against the exact code x scale: within 2^-10 (1 + 2^-11) relative for tiles whose largest magnitude is
    # above ~1.1e-4 (a normal f16 scale), plus f16's subnormal half step 2^-25 for values below 2^-14 (the
    # subnormal codes of a small tile); tiles spanning 2^-6 .. 2^10 times randn, under f16's 65504
    spec = MLASpec(L, 256, 32, fmt)
    f = spec.row_format
    mag = torch.exp2(torch.randint(-6, 11, (64, 1), generator=gen).float())
    x = torch.randn(64, 256, generator=gen) * mag
    rows = fp8.quantize_rows(x, torch.randn(64, 32, generator=gen), f)
    codes = rows[:, :256].view(fmt).double()
    scale = rows[:, f.scale_offset: f.rope_offset].contiguous().view(torch.float32).double()
    exact = codes * scale.repeat_interleave(128, 1)
    got = fp8.dequantize_f16(rows, f)
    assert got.dtype == torch.float16 and got.shape == (64, 256)
    got = got.double()
    err = (got - exact).abs()
    bound = 2.0 ** -10 * (1 + 2.0 ** -11) * exact.abs() + 2.0 ** -25
    assert bool((err <= bound).all()), float((err - bound).max())
    bf16 = fp8.dequantize_rows(rows, f)[:, :256].double()
    assert float((bf16 - exact).abs().max()) > float(err.max())  # the f16 chain is the closer one here


@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_matches_torch_on_every_value_every_tie_and_random_values(fmt, gen):
    m = torch.finfo(fmt).max
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt).float()
    grid = values[~values.isnan()].unique()
    ties = (grid[1:] + grid[:-1]) / 2  # exactly between two codes: round to the even one
    up, down = torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)
    scales = torch.exp2(torch.randint(-16, 9, (40000,), generator=gen).float())  # subnormal to max range
    rand = (torch.randn(40000, generator=gen) * scales).clamp(-m, m)
    uniform = (torch.rand(40000, generator=gen) * 2 - 1) * m
    signed_zeros = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-45, -1e-45])
    x = torch.cat([grid, -grid, ties, -ties, up, down, rand, uniform, signed_zeros])
    got = _launch(_encode_kernel, x, torch.empty(x.numel(), dtype=torch.uint8), FNUZ=fp8.FNUZ[fmt])
    assert torch.equal(got, x.to(fmt).view(torch.uint8))


def test_the_two_formats_disagree_on_the_same_bytes_and_values():
    # a store read through the other format would move every value by a factor of two (exponent bias 7
    # vs 8) and turn e4m3fnuz's 240 into e4m3fn's NaN: the tests below would see it
    x = torch.tensor([1.0, -3.5, 192.0, 240.0])  # exact in both formats
    fn, fnuz = x.to(FORMATS[0]).view(torch.uint8), x.to(FORMATS[1]).view(torch.uint8)
    assert not torch.equal(fn, fnuz)
    misread = fnuz.view(FORMATS[0]).float()
    assert torch.equal(misread[:3], x[:3] * 2) and bool(misread[3].isnan())


def test_bf16_rounding_is_round_to_nearest_even_like_torch(gen):
    x = torch.cat([torch.randn(20000, generator=gen) * torch.exp2(torch.randint(-30, 30, (20000,), generator=gen)),
                   torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.4e38, -3.4e38, 0.0, -0.0,
                                 float("inf"), float("nan")])])
    got = _launch(_bf16_kernel, x, torch.empty(x.numel(), dtype=torch.bfloat16))
    want = x.to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16)[:-1], want.view(torch.int16)[:-1]) and bool(got[-1].isnan())


# ------------------------------------------------------------------------------------ write and gather
def _pool(fmt, r, dr, n_pages=6):
    pool = UnifiedPool(ArenaLayout.for_capacity(MLASpec(L, r, dr, fmt), None, PS, n_pages + 2, 0))
    return pool, pool.alloc_pages(n_pages)


def _rows_at_max(t, r, m, gen):
    """Random latents in [-m, m] with one value of magnitude exactly m in every 128-value tile: every scale
    is exactly 1, so the stored codes are ``x.to(fmt)`` and a read back is ``x.to(fmt).to(float32)``."""
    x = (torch.rand(t, r, generator=gen) * 2 - 1) * m
    for start in range(0, r, 128):
        width = min(128, r - start)
        col = start + torch.randint(0, width, (t,), generator=gen)
        x[torch.arange(t), col] = torch.where(torch.rand(t, generator=gen) < 0.5, -m, m)
    return x


def _gather_all(pool, pages, n, geometry):
    """``mla_gather`` arguments reading the first ``n`` tokens of ``pages`` as one row of history."""
    table = torch.tensor(pages, dtype=torch.int32)[None]
    return (pool.arena, pool.v2p, table, torch.tensor([n], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), n,
            *geometry)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("r, dr", [(64, 16), (256, 32)])
def test_values_written_through_each_format_read_back_as_torchs_conversion_bit_for_bit(fmt, r, dr, gen):
    pool, pages = _pool(fmt, r, dr)
    n = len(pages) * PS
    loc = torch.tensor(pages)[torch.arange(n) // PS] * PS + torch.arange(n) % PS
    x = _rows_at_max(n, r, torch.finfo(fmt).max, gen)
    rope = torch.randn(n, dr, generator=gen).to(torch.bfloat16)
    geometry = (1, L, PS, r, dr, fmt)
    mw.mla_kv_write_triton(pool.arena, pool.v2p, loc, x, rope, *geometry)
    rows = pool.read_kv(1, loc)
    assert torch.equal(rows[:, :r], x.to(fmt).view(torch.uint8))  # the codes: torch's, for the format written
    fmt_ = pool.layout.kv.row_format
    assert torch.equal(rows[:, fmt_.scale_offset: fmt_.rope_offset].view(torch.float32), torch.ones(n, -(-r // 128)))
    want = x.to(fmt).to(torch.float32)
    args = _gather_all(pool, pages, n, geometry)
    for got in (mg.mla_gather_triton(*args), torch.ops.unimem.mla_gather(*args)):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got[0, :, :r].float().view(torch.int32), want.view(torch.int32))
        assert torch.equal(got[0, :, r:], rope)  # a bf16 rope is stored exactly


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_writes_exactly_the_reference_bytes_and_nothing_else(fmt, gen):
    r, dr = 200, 8  # a partial last tile
    pool, pages = _pool(fmt, r, dr)
    dead = pages[1]
    pool.free_pages([dead])
    live = [p for p in pages if p != dead]
    slots = torch.randperm(len(live) * PS, generator=gen)[:30]
    loc = torch.tensor(live)[slots // PS] * PS + slots % PS
    loc = torch.cat([loc, torch.tensor([-1, dead * PS + 3, PS - 1, pool.v2p.numel() * PS + 2])])
    t = loc.numel()
    proj = torch.randn(t, r + dr, generator=gen) * torch.exp2(torch.randint(-6, 6, (t, 1), generator=gen).float())
    nope, rope = proj[:, :r], proj[:, r:].to(torch.bfloat16).float()  # fp32 input rows, as an fp32 model hands them
    nope[0, :128] = 0.0  # a tile of zeros
    before = pool.arena.clone()
    want = before.clone()
    mw.mla_kv_write_reference(want, pool.v2p, loc, nope, rope, 2, L, PS, r, dr, fmt)
    got = before.clone()
    mw.mla_kv_write_triton(got, pool.v2p, loc, nope, rope, 2, L, PS, r, dr, fmt, block_t=4)
    assert torch.equal(got, want)
    op = before.clone()
    torch.ops.unimem.mla_kv_write(op, pool.v2p, loc, nope, rope, 2, L, PS, r, dr, fmt)
    assert torch.equal(op, want)
    rows, live_lanes = latent_rows(pool.v2p, loc, 2, L, PS)
    assert int(live_lanes.sum()) == 30
    touched = torch.zeros_like(before, dtype=torch.bool)
    row_bytes = pool.layout.kv.entry_bytes
    for row in rows[live_lanes].tolist():
        touched[row * row_bytes: (row + 1) * row_bytes] = True
    assert torch.equal(got[~touched], before[~touched]) and not got[: pool.layout.sink_floor].any()


@pytest.mark.parametrize("r", [64, 256])  # one scale per row, several
def test_a_write_whose_lanes_are_all_dead_changes_nothing(r, gen):
    # the decode runner's steps write every lane with slot -1 once the rows finished: the reference then
    # quantises zero rows (a [0, S] scale tensor, once refused by the byte view of the scales)
    fmt = torch.float8_e4m3fn
    pool, pages = _pool(fmt, r, 16)
    loc = torch.full((3,), -1, dtype=torch.int64)
    before = pool.arena.clone()
    for op in (mw.mla_kv_write_reference, torch.ops.unimem.mla_kv_write):
        op(pool.arena, pool.v2p, loc, torch.randn(3, r, generator=gen), torch.randn(3, 16, generator=gen),
           1, L, PS, r, 16, fmt)
        assert torch.equal(pool.arena, before)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantisation_error_is_within_the_formats_bound_and_zero_tiles_read_zeros(fmt, gen):
    r, dr = 256, 16
    pool, pages = _pool(fmt, r, dr)
    n = 2 * PS
    loc = torch.tensor(pages)[torch.arange(n) // PS] * PS + torch.arange(n) % PS
    # magnitudes over several decades within a tile: small values relative to the tile's max included
    x = torch.randn(n, r, generator=gen) * torch.exp2(torch.randint(-12, 4, (n, r), generator=gen).float())
    x[3, 128:] = 0.0
    rope = torch.randn(n, dr, generator=gen) * 5  # fp32: rounded once to bf16
    geometry = (0, L, PS, r, dr, fmt)
    mw.mla_kv_write_triton(pool.arena, pool.v2p, loc, x, rope, *geometry)
    got = mg.mla_gather_triton(*_gather_all(pool, pages[:2], n, geometry))[0].float()
    tile_max = x.abs().view(n, 2, 128).amax(-1).repeat_interleave(128, 1)
    err = (got[:, :r] - x).abs()
    assert bool((err <= (2**-4 + 2**-8 * (1 + 2**-4)) * tile_max).all())
    big = x.abs() >= 2**-6 * tile_max
    assert bool((err[big] <= (2**-4 + 2**-7) * x.abs()[big]).all())
    assert float(err.max()) > 2**-6 * float(tile_max.max())  # the rounding did happen
    assert not bool(got.isnan().any()) and not got[3, 128:r].any()
    scales = pool.read_kv(0, loc[3:4])[0, pool.layout.kv.row_format.scale_offset:][:8].view(torch.float32)
    assert scales[1] == 0.0 and scales[0] > 0
    assert torch.equal(got[:, r:], rope.to(torch.bfloat16).float())  # the rope: one rounding to bf16


def test_a_tile_with_a_nan_reads_back_as_nan_and_the_next_tile_is_unharmed(gen):
    fmt, r, dr = FORMATS[0], 256, 16
    pool, pages = _pool(fmt, r, dr)
    loc = torch.tensor([pages[0] * PS])
    x = torch.randn(1, r, generator=gen)
    x[0, 5] = float("nan")
    geometry = (0, L, PS, r, dr, fmt)
    for write, gather in ((mw.mla_kv_write_triton, mg.mla_gather_triton),
                          (torch.ops.unimem.mla_kv_write, torch.ops.unimem.mla_gather)):
        write(pool.arena, pool.v2p, loc, x, torch.randn(1, dr, generator=gen), *geometry)
        got = gather(*_gather_all(pool, pages[:1], 1, geometry))[0, 0].float()
        assert bool(got[:128].isnan().all())
        fmt_ = pool.layout.kv.row_format
        want = fp8.dequantize_rows(fp8.quantize_rows(x, torch.zeros(1, dr), fmt_), fmt_)[0, 128:r].float()
        assert torch.equal(got[128:r], want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_fused_rmsnorm_write_quantises_the_normalised_values(fmt, gen):
    r, dr, eps = 64, 16, 1e-6
    pool, pages = _pool(fmt, r, dr)
    loc = torch.tensor(pages[:2])[torch.arange(20) // PS] * PS + torch.arange(20) % PS
    x = torch.randn(20, r, generator=gen).half() * 3 + 1
    rope = torch.randn(20, dr, generator=gen).half()
    weight = (torch.rand(r, generator=gen) + 0.5).half()
    geometry = (2, L, PS, r, dr, fmt)
    want = pool.arena.clone()
    torch.ops.unimem.mla_kv_write(want, pool.v2p, loc, mw.rmsnorm_reference(x, weight, eps), rope, *geometry)
    op = pool.arena.clone()
    torch.ops.unimem.mla_kv_write_rmsnorm(op, pool.v2p, loc, x, rope, weight, eps, *geometry)
    assert torch.equal(op, want)
    got = pool.arena.clone()
    mw.mla_kv_write_rmsnorm_triton(got, pool.v2p, loc, x, rope, weight, eps, *geometry)
    assert torch.equal(got, want)  # fp16 norm: bitwise for these inputs, as the bf16-free write tests


def test_fake_gather_has_the_compute_dtype_and_bad_fp8_geometries_are_refused():
    pool, pages = _pool(FORMATS[1], 64, 16)
    args = _gather_all(pool, pages, 8, (0, L, PS, 64, 16, FORMATS[1]))
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    out = torch.ops.unimem.mla_gather(*meta)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 8, 80)
    with pytest.raises(TypeError, match="kv_dtype must be one of"):
        torch.ops.unimem.mla_gather(*args[:9], 64, 16, torch.float8_e5m2)
    with pytest.raises(GeometryError, match=r"pages of 7680 bytes plus the tail pad need \d+ arena bytes"):
        torch.ops.unimem.mla_gather(*args[:9], 64, 16, torch.bfloat16)  # a bf16 reading of fp8 rows
    view = torch.zeros(pool.arena.numel() + 2, dtype=torch.uint8)[2:]
    with pytest.raises(GeometryError, match="not a multiple of 4 bytes"):
        torch.ops.unimem.mla_gather(view, *args[1:])


# ------------------------------------------------------------------------------------ decode
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_reference_on_fp8_rows_attends_over_the_values_gather_returns(fmt, gen):
    r, dr, h = 64, 16, 4
    pool, pages = _pool(fmt, r, dr)
    n = len(pages) * PS
    loc = torch.tensor(pages)[torch.arange(n) // PS] * PS + torch.arange(n) % PS
    geometry = (1, L, PS, r, dr, fmt)
    nope, rope = torch.randn(n, r, generator=gen), torch.randn(n, dr, generator=gen)
    mw.mla_kv_write_triton(pool.arena, pool.v2p, loc, nope, rope, *geometry)
    table = torch.tensor(pages, dtype=torch.int32).view(2, 3)
    kv_len = torch.tensor([40, 3 * PS], dtype=torch.int32)
    q_nope, q_rope = torch.randn(2, h, r, generator=gen), torch.randn(2, h, dr, generator=gen)
    hist = torch.ops.unimem.mla_gather(pool.arena, pool.v2p, table, kv_len, torch.zeros(2, dtype=torch.int32), 3 * PS,
                                       *geometry).float()
    scores = torch.einsum("bhd,bnd->bhn", torch.cat([q_nope, q_rope], -1), hist) * 0.125
    scores[0, :, 40:] = float("-inf")
    want = torch.einsum("bhn,bnr->bhr", scores.softmax(-1), hist[..., :r])
    args = (q_nope, q_rope, pool.arena, pool.v2p, table, kv_len, 0.125, *geometry)
    # the op's CPU path, the reference: fp32 sums in another order (the split kernel reads the exact
    # code x scale values instead: tests/ops/test_mla_decode_fp8.py)
    torch.testing.assert_close(torch.ops.unimem.mla_decode(*args), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="wgmma kernel needs"):
        md.mla_decode_triton(*args, kernel="wgmma")


# ------------------------------------------------------------------------------------ prefill
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_on_fp8_rows_equals_prefill_on_their_dequantised_values(fmt, gen):
    """The reference and the launcher (its plain-torch fp8 piece gather, then the attention kernel) read fp8
    rows as exactly the bf16 values mla_gather returns: both equal the same op on a bf16 pool holding those
    values, bit for bit, over several workspace pieces."""
    mp = importlib.import_module("unimem_compile.ops.mla_prefill")
    r, dr, h, dn, dv = 64, 16, 2, 16, 16
    lens = [37, 5, 20]
    pools, tables = {}, {}
    for dtype in (fmt, torch.bfloat16):  # the same rows on each pool's own pages
        pools[dtype], pages = _pool(dtype, r, dr, n_pages=9)
        tables[dtype] = torch.tensor(pages, dtype=torch.int32).view(3, 3)

    def locations(dtype, b, n):
        i = torch.arange(n)
        return tables[dtype][b].long()[i // PS] * PS + i % PS

    p8 = pools[fmt]
    for b, n in enumerate(lens):
        rows = torch.randn(n, r + dr, generator=gen)
        mw.mla_kv_write_triton(p8.arena, p8.v2p, locations(fmt, b, n), rows[:, :r], rows[:, r:], 1, L, PS, r, dr, fmt)
        got = mg.mla_gather_triton(p8.arena, p8.v2p, tables[fmt][b:b + 1], torch.tensor([n], dtype=torch.int32),
                                   torch.zeros(1, dtype=torch.int32), n, 1, L, PS, r, dr, fmt)[0]
        pools[torch.bfloat16].write_kv(1, locations(torch.bfloat16, b, n), got)
    kv_len = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, h, 5, dn + dr, generator=gen)
    w = torch.randn(h * (dn + dv), r, generator=gen) / 8
    for fn in (mp.mla_prefill_reference, mp.mla_prefill_triton):
        outs = [fn(q, p.arena, p.v2p, tables[dtype], kv_len, kv_len.clone(), w, 0.2, 16, 1, L, PS, r, dr, dtype)
                for dtype, p in pools.items()]
        assert torch.equal(outs[0], outs[1]) and not bool(outs[0].isnan().any())
