"""fp8 MLA KV on CUDA at the real Kimi-Linear geometry (7 layers, 512 + 64): the compiled write and gather
kernels against the plain-torch references byte for byte (both e4m3 formats; on sm_90 Triton has no
e4m3fnuz type, the kernels encode its bits with integer ops), mla_decode on fp8 rows (what ``auto`` runs: on an
H100/H200 at page size 64 the Hopper fp8 kernel, else the fp8 split kernel; tests/gpu/test_mla_decode_fp8_gpu.py
holds each to exact attention), mla_prefill on fp8 rows (its plain-torch piece gather, then
its attention kernel), and the 4-layer real-geometry model's teacher-forced logits with fp8 KV:

* dense-MLP variant in fp32 (``build_model(dense_mlp=True)``), held to the linear-response bounds of
  ``unimem_compile.demo.fp8_tolerance`` derived from a bf16-KV run of the same weights (16x the bf16-KV
  errors, 256x its KL divergences, a factor 2 / 4 for sampling noise; tests/hf/test_fp8_kv.py says why
  the MoE preset cannot be held to them);
* the MoE preset in bf16 (what the demo runs), held to ``fp8_sanity_bound`` against stock transformers.

Run with compiled kernels: ``TRITON_INTERPRET=0 python -m pytest -q -s tests/gpu/test_fp8_gpu.py`` (``-s``
prints the figures)."""

import copy
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("run with TRITON_INTERPRET=0: these tests check the compiled kernels", allow_module_level=True)

import unimem_compile  # noqa: E402
from unimem_compile.demo import compare_logits, fp8_sanity_bound, fp8_tolerance, teacher_forced_logits  # noqa: E402
from unimem_compile.hf.models import build_model  # noqa: E402
from unimem_compile.pool import ArenaLayout, MLASpec, UnifiedPool  # noqa: E402

from ..prompts import left_padded  # noqa: E402

mw = importlib.import_module("unimem_compile.ops.mla_write")
mg = importlib.import_module("unimem_compile.ops.mla_gather")
md = importlib.import_module("unimem_compile.ops.mla_decode")

pytestmark = pytest.mark.gpu

L, R, DR, PS = 7, 512, 64, 64
FORMATS = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


def _pool(fmt, n_pages):
    pool = UnifiedPool(ArenaLayout.for_capacity(MLASpec(L, R, DR, fmt), None, PS, n_pages + 2, 0), "cuda")
    pages = pool.alloc_pages(n_pages)
    return pool, torch.tensor(pages)[torch.randperm(n_pages)].tolist()


def _locations(pages, n):
    i = torch.arange(n)
    return (torch.tensor(pages)[i // PS] * PS + i % PS).cuda()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_write_kernel_bytes_equal_the_reference(fmt, in_dtype, t):
    g = torch.Generator(device="cuda").manual_seed(t)
    pool, pages = _pool(fmt, -(-t // PS))
    loc = _locations(pages, t)
    proj = (torch.randn(t, R + DR, device="cuda", generator=g) * 4).to(in_dtype)  # fp32 rope: rounded to bf16
    proj[0, :128] = 0  # a tile of zeros
    want = pool.arena.clone()
    mw.mla_kv_write_reference(want, pool.v2p, loc, proj[:, :R], proj[:, R:], 3, L, PS, R, DR, fmt)
    torch.ops.unimem.mla_kv_write(pool.arena, pool.v2p, loc, proj[:, :R], proj[:, R:], 3, L, PS, R, DR, fmt)
    assert torch.equal(pool.arena, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_norm_write_is_within_the_format_bound_of_the_norm(fmt):
    g = torch.Generator(device="cuda").manual_seed(1)
    t = 256
    pool, pages = _pool(fmt, t // PS)
    loc = _locations(pages, t)
    x = (torch.randn(t, R, device="cuda", generator=g) * 3 + 1).to(torch.bfloat16)
    rope = torch.randn(t, DR, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.rand(R, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    torch.ops.unimem.mla_kv_write_rmsnorm(pool.arena, pool.v2p, loc, x, rope, weight, 1e-6, 0, L, PS, R, DR, fmt)
    table = torch.tensor(pages, dtype=torch.int32, device="cuda")[None]
    got = torch.ops.unimem.mla_gather(pool.arena, pool.v2p, table, torch.tensor([t], dtype=torch.int32, device="cuda"),
                                      torch.zeros(1, dtype=torch.int32, device="cuda"), t, 0, L, PS, R, DR, fmt)[0]
    normed = mw.rmsnorm_reference(x, weight, 1e-6).float()
    tile_max = normed.abs().view(t, 4, 128).amax(-1).repeat_interleave(128, 1)
    # the format's bound plus one bf16 ulp of the normalised value (the kernel's fp32 sum order differs from
    # torch's, which can move a rounding of the norm, and with it the tile's max, by one ulp)
    assert bool(((got[:, :R].float() - normed).abs() <= (2**-4 + 2**-8 * (1 + 2**-4)) * tile_max * (1 + 2**-7)
                 + 2**-7 * normed.abs()).all())
    assert torch.equal(got[:, R:], rope)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_kernel_equals_the_reference_and_decode_attends_over_it(fmt):
    g = torch.Generator(device="cuda").manual_seed(2)
    batch, ctx, heads = 4, 1000, 32
    per_row = -(-ctx // PS)
    pool, pages = _pool(fmt, batch * per_row)
    loc = _locations(pages, batch * per_row * PS)
    rows = torch.randn(loc.numel(), R + DR, device="cuda", generator=g)
    torch.ops.unimem.mla_kv_write(pool.arena, pool.v2p, loc, rows[:, :R], rows[:, R:], 2, L, PS, R, DR, fmt)
    table = torch.tensor(pages, dtype=torch.int32, device="cuda").view(batch, per_row)
    kv_len = torch.tensor([ctx, 1, 513, 64], dtype=torch.int32, device="cuda")
    off = torch.tensor([0, 3, 7, 0], dtype=torch.int32, device="cuda")
    args = (pool.arena, pool.v2p, table, kv_len, off, ctx + 8, 2, L, PS, R, DR, fmt)
    got = torch.ops.unimem.mla_gather(*args)
    assert got.dtype == torch.bfloat16 and torch.equal(got, mg.mla_gather_reference(*args))
    q_nope = torch.randn(batch, heads, R, device="cuda", generator=g).to(torch.bfloat16)
    q_rope = torch.randn(batch, heads, DR, device="cuda", generator=g).to(torch.bfloat16)
    dargs = (q_nope, q_rope, pool.arena, pool.v2p, table, kv_len, 0.06, 2, L, PS, R, DR, fmt)
    out = torch.ops.unimem.mla_decode(*dargs)
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in dargs]
    torch.testing.assert_close(out.cpu(), md.mla_decode_reference(*cpu), rtol=2e-2, atol=2e-2)  # bf16 output


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_on_fp8_rows_equals_prefill_on_their_dequantised_values(fmt):
    mp = importlib.import_module("unimem_compile.ops.mla_prefill")
    g = torch.Generator(device="cuda").manual_seed(3)
    lens, heads, dn, dv, t = [700, 64, 1500], 32, 128, 128, 64
    per_row = -(-max(lens) // PS)
    pools, tables = {}, {}
    for dtype in (fmt, torch.bfloat16):  # the same rows on each pool's own pages
        pools[dtype], pages = _pool(dtype, 3 * per_row)
        tables[dtype] = torch.tensor(pages, dtype=torch.int32, device="cuda").view(3, per_row)
    for b, n in enumerate(lens):
        rows = torch.randn(n, R + DR, device="cuda", generator=g)
        locs = {dtype: (tables[dtype][b].long()[torch.arange(n, device="cuda") // PS] * PS
                        + torch.arange(n, device="cuda") % PS) for dtype in pools}
        p8 = pools[fmt]
        torch.ops.unimem.mla_kv_write(p8.arena, p8.v2p, locs[fmt], rows[:, :R], rows[:, R:], 1, L, PS, R, DR, fmt)
        got = torch.ops.unimem.mla_gather(p8.arena, p8.v2p, tables[fmt][b:b + 1],
                                          torch.tensor([n], dtype=torch.int32, device="cuda"),
                                          torch.zeros(1, dtype=torch.int32, device="cuda"), n, 1, L, PS, R, DR, fmt)[0]
        pools[torch.bfloat16].write_kv(1, locs[torch.bfloat16], got)
    kv_len = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(3, heads, t, dn + DR, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(heads * (dn + dv), R, device="cuda", generator=g) / 23).to(torch.bfloat16)
    outs = [torch.ops.unimem.mla_prefill(q, p.arena, p.v2p, tables[dtype], kv_len, kv_len.cpu(), w, 0.07, 1024, 1, L,
                                         PS, R, DR, dtype) for dtype, p in pools.items()]
    assert torch.equal(outs[0], outs[1]) and not bool(outs[0].isnan().any())  # 3 workspace pieces


def _teacher_forced(name, dtype, dense, kv_dtypes, new=64, prompt=24):
    stock = build_model(name, dtype=dtype, device="cuda", dense_mlp=dense)
    ids, mask = left_padded([prompt, prompt - 7], torch.Generator().manual_seed(5), vocab=32000)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        greedy = stock.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    forced = greedy[:, prompt:]
    logits = {"stock": teacher_forced_logits(stock, ids, mask, forced)}
    for kv_dtype in kv_dtypes:
        model = copy.deepcopy(stock)
        # aot_eager: the ops' CUDA kernels run as under Inductor; minutes of Inductor compiles are not the point
        unimem_compile.compile(model, max_batch_size=2, max_seq_len=prompt + new, page_size=64, kv_dtype=kv_dtype,
                               backend="aot_eager")
        logits[kv_dtype] = teacher_forced_logits(model, ids, mask, forced)
        del model
        torch.cuda.empty_cache()
    return logits


def _line(name, got, bound):
    return (f"\n{name}: " + ", ".join(f"{k} {got[k]:.3g}" + (f" (bound {bound[k]:.3g})" if k in bound else "")
                                      for k in ("mean_abs", "max_abs", "median_position", "kl_mean", "kl_median"))
            + f", top-1 agreement {got['top1_agreement']:.3f} over {got['positions']} positions")


def test_real_geometry_dense_model_fp8_logits_within_the_bounds_derived_from_bf16_kv():
    logits = _teacher_forced("kimi-linear-48b-4l", torch.float32, True, ("bf16", "fp8_e4m3", "fp8_e4m3fnuz"))
    scale = compare_logits(logits["bf16"], logits["stock"])
    for kv_dtype, fmt in (("fp8_e4m3", FORMATS[0]), ("fp8_e4m3fnuz", FORMATS[1])):
        got = compare_logits(logits[kv_dtype], logits["stock"])
        bound = fp8_tolerance(fmt, torch.bfloat16, scale)
        print(_line(f"kimi-linear-48b-4l dense fp32, {kv_dtype} vs fp32 KV", got, bound)
              + _line("  bf16 KV vs fp32 KV", scale, {}))
        for key in ("mean_abs", "max_abs", "median_position", "kl_mean", "kl_median"):
            assert got[key] <= bound[key], key
        assert got["median_position"] > 4 * scale["median_position"]


def test_real_geometry_moe_model_in_bf16_fp8_logits_within_the_demo_bound():
    logits = _teacher_forced("kimi-linear-48b-4l", torch.bfloat16, False, ("fp8_e4m3",))
    got = compare_logits(logits["fp8_e4m3"], logits["stock"])
    bound = fp8_sanity_bound(FORMATS[0], logits["stock"])
    print(_line("kimi-linear-48b-4l bf16 (MoE), fp8_e4m3 vs bf16 KV (stock)", got, bound))
    assert got["median_position"] <= bound["median_position"]
