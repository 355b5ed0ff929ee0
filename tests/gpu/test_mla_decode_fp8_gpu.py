"""mla_decode's fp8 kernels compiled on the GPU at the real Kimi-Linear geometry (7 layers, 512 + 64, 32
and 16 heads, ragged rows up to 3000 tokens on NaN-poisoned pools: histories ending mid-page leave NaN rows
in their last page, free pages are NaN), both e4m3 formats (e4m3fn through the hardware's fp8 conversion,
e4m3fnuz through the integer decoder), bf16 queries.

The portable fp8 split kernel (``kernel="portable"``; page sizes 64 and 16):

* against float64 attention over the rows' exact values ``fp32(code) * scale`` with the same bf16 queries:
  the kernel rounds each probability-times-scale to bf16 before the value product (relative ``u = 2^-8``
  per weight, so at most ``u x max |v|`` on an output) and its output to bf16 (``u x |out|``): held to
  ``1.1 u (max |v| + |want|)`` plus ``1e-5 max |v|`` for fp32 sums;
* against ``mla_decode_reference`` (bf16-rounded values, fp32 softmax) loosely (the two bounds added);
* captured in a CUDA graph (as the decode runner replays it): a replay after new queries and lengths
  equals the eager call bit for bit;
* with fp32 queries (an fp32 model with fp8 KV: fp32 products, the tiles ``portable_tiles`` fits into the
  H200's shared memory, 64 tokens x 1 stage at page size 64, where 2 stages failed to launch): within
  ``1e-4 max |v|`` of float64 attention over the exact values.

The Hopper fp8 kernel (``kernel="wgmma"``, page size 64, 32 and 16 heads: both head blockings; what
``kernel="auto"`` runs on an H100/H200 at page sizes that are multiples of 64):

* bit for bit the bf16 Hopper kernel's result on a bf16 arena holding the dequantised rows
  (``fp8.dequantize_rows`` of every row, same row indices, same split count): it dequantises exactly those
  values into shared memory and then runs the same products, softmax and merge in the same order;
* against float64 attention over the dequantised values (the bound above: bf16 probabilities and output);
* in a CUDA graph, as above;
* ``kernel="auto"`` is it at page size 64 and the portable fp8 kernel at page size 16;
* its f16 dequantisation chain (``wgmma_fp8_f16=True``, off by default): against float64 attention over the
  exact values, its values within ``2^-10`` of them (``fp8.dequantize_f16``), f16 probabilities, bf16 output.

Run: ``TRITON_INTERPRET=0 python -m pytest -q tests/gpu/test_mla_decode_fp8_gpu.py``."""

import functools
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("run with TRITON_INTERPRET=0: these tests check the compiled kernels", allow_module_level=True)

from unimem_compile.ops import fp8  # noqa: E402
from unimem_compile.ops.geometry import MLAGeometry  # noqa: E402
from unimem_compile.pool import ArenaLayout, MLASpec, UnifiedPool  # noqa: E402

md = importlib.import_module("unimem_compile.ops.mla_decode")

pytestmark = pytest.mark.gpu

L, LAYER, R, DR, SCALE = 7, 2, 512, 64, 0.06
U = 2.0 ** -8
FORMATS = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


class Rows:
    def __init__(self, fmt, ps, lens, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        per_row = [-(-n // ps) for n in lens]
        spec = MLASpec(L, R, DR, fmt)
        self.fmt = spec.row_format
        self.pool = UnifiedPool(ArenaLayout.for_capacity(spec, None, ps, sum(per_row) + 2, 0), "cuda", poison=True)
        pages = self.pool.alloc_pages(sum(per_row))
        pages = torch.tensor(pages)[torch.randperm(len(pages))].tolist()
        self.page_table = torch.full((len(lens), max(per_row)), -1, dtype=torch.int32)
        self.exact, self.dequantised, start = [], [], 0
        for b, n in enumerate(lens):
            mine = pages[start: start + per_row[b]]
            start += per_row[b]
            self.page_table[b, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
            i = torch.arange(n)
            loc = (torch.tensor(mine, dtype=torch.int64)[i // ps] * ps + i % ps).cuda()
            mag = torch.exp2(torch.randint(-4, 4, (n, 1), device="cuda", generator=g).float())
            rows = torch.randn(n, R + DR, device="cuda", generator=g)
            for layer in range(L if n else 0):  # an empty row writes nothing
                torch.ops.unimem.mla_kv_write(self.pool.arena, self.pool.v2p, loc, (rows[:, :R] * mag).bfloat16(),
                                              rows[:, R:].bfloat16(), layer, L, ps, R, DR, fmt)
            stored = self.pool.read_kv(LAYER, loc)
            codes = stored[:, :R].contiguous().view(fmt).double()
            scale = stored[:, self.fmt.scale_offset: self.fmt.rope_offset].contiguous().view(torch.float32).double()
            rope = stored[:, self.fmt.rope_offset: self.fmt.rope_offset + 2 * DR].contiguous().view(torch.bfloat16)
            self.exact.append(torch.cat([codes * scale.repeat_interleave(128, 1), rope.double()], 1))
            self.dequantised.append(fp8.dequantize_rows(stored, self.fmt).double())
        self.page_table = self.page_table.cuda()
        self.kv_len = torch.tensor(lens, dtype=torch.int32, device="cuda")
        self.geometry = (LAYER, L, ps, R, DR, fmt)

    def bf16_arena(self):
        """A bf16 arena of the same page envelope holding every row dequantised (poisoned rows stay NaN)."""
        f = self.fmt
        n_rows = self.pool.arena.numel() // f.row_bytes
        rows = self.pool.arena[: n_rows * f.row_bytes].view(n_rows, f.row_bytes)
        return fp8.dequantize_rows(rows, f).view(torch.uint8).reshape(-1)

    def args(self, q_nope, q_rope, kv_len=None):
        return (q_nope, q_rope, self.pool.arena, self.pool.v2p, self.page_table,
                self.kv_len if kv_len is None else kv_len, SCALE, *self.geometry)


def _exact_rows(got, rows, q_nope, q_rope):
    """Per non-empty row b: (b, exact, want, vmax): the row's unquantised values (``rows.exact``, on the CPU), exact
    float64 softmax attention of the row's queries over them, and the largest |latent value|; an empty row's output
    ``got[b]`` must be all zero (asserted here)."""
    for b, exact in enumerate(rows.exact):
        exact = exact.cpu()
        if exact.shape[0] == 0:
            assert not bool(got[b].any()), b
            continue
        q = torch.cat([q_nope[b], q_rope[b]], -1).double().cpu()
        yield b, exact, torch.softmax(q @ exact.T * SCALE, -1) @ exact[:, :R], float(exact[:, :R].abs().max())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ps, heads, lens", [(64, 32, [3000, 1, 0, 777, 64, 2049]), (16, 16, [1000, 37, 513])])
def test_fp8_kernel_equals_exact_attention_within_its_bf16_roundings(fmt, ps, heads, lens):
    rows = Rows(fmt, ps, lens, seed=ps + heads)
    g = torch.Generator(device="cuda").manual_seed(7)
    q_nope = torch.randn(len(lens), heads, R, device="cuda", generator=g).bfloat16()
    q_rope = torch.randn(len(lens), heads, DR, device="cuda", generator=g).bfloat16()
    got = md.mla_decode_triton(*rows.args(q_nope, q_rope), kernel="portable").double().cpu()
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in rows.args(q_nope, q_rope)]
    ref = md.mla_decode_reference(*cpu).double()
    for b, exact, want, vmax in _exact_rows(got, rows, q_nope, q_rope):
        bound = 1.1 * U * (vmax + want.abs()) + 1e-5 * vmax
        assert bool(((got[b] - want).abs() <= bound).all()), (b, float((got[b] - want).abs().max()))
        d = SCALE * U * (q_nope[b].double().cpu().abs() @ exact[:, :R].abs().T).amax(-1)
        ref_bound = bound + vmax * (U + torch.expm1(2 * d))[:, None] + 2 ** -8 * ref[b].abs()  # ref's bf16 output
        assert bool(((got[b] - ref[b]).abs() <= ref_bound).all()), b


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_kernel_with_fp32_queries_fits_the_shared_memory_and_equals_exact_attention(fmt):
    rows = Rows(fmt, 64, [3000, 1, 777, 64], seed=21)
    g = torch.Generator(device="cuda").manual_seed(22)
    q_nope = torch.randn(4, 32, R, device="cuda", generator=g)
    q_rope = torch.randn(4, 32, DR, device="cuda", generator=g)
    limit = md.device_smem_limit(q_nope.device)
    if limit == 232448:  # an H100/H200: one stage fewer than the default 2
        assert md.portable_tiles(MLAGeometry(*rows.geometry), torch.float32, 32, limit) == (64, 1)
    got = md.mla_decode_triton(*rows.args(q_nope, q_rope), kernel="portable").double().cpu()
    for b, _, want, vmax in _exact_rows(got, rows, q_nope, q_rope):
        assert float((got[b] - want).abs().max()) <= 1e-4 * vmax, b


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_kernel_replays_in_a_cuda_graph(fmt):
    rows = Rows(fmt, 64, [1500, 700, 64, 3], seed=11)
    g = torch.Generator(device="cuda").manual_seed(8)
    q_nope = torch.randn(4, 32, R, device="cuda", generator=g).bfloat16()
    q_rope = torch.randn(4, 32, DR, device="cuda", generator=g).bfloat16()
    kv_len = rows.kv_len.clone()
    run = functools.partial(md.mla_decode_triton, kernel="portable")
    out = run(*rows.args(q_nope, q_rope, kv_len))  # compiles before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(*rows.args(q_nope, q_rope, kv_len))
    q_nope.copy_(torch.randn(4, 32, R, device="cuda", generator=g).bfloat16())
    kv_len.copy_(torch.tensor([1499, 1, 64, 0], dtype=torch.int32))
    graph.replay()
    assert torch.equal(out, run(*rows.args(q_nope, q_rope, kv_len)))


WGMMA_CASES = [(32, [3000, 1, 0, 777, 64, 2049]), (16, [1000, 37, 513, 64])]


def _queries(batch, heads, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(batch, heads, R, device="cuda", generator=g).bfloat16(),
            torch.randn(batch, heads, DR, device="cuda", generator=g).bfloat16())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads, lens", WGMMA_CASES)
def test_wgmma_fp8_kernel_equals_the_bf16_wgmma_kernel_on_the_dequantised_rows(fmt, heads, lens):
    rows = Rows(fmt, 64, lens, seed=heads + 3)
    q_nope, q_rope = _queries(len(lens), heads, seed=9)
    got = md.mla_decode_triton(*rows.args(q_nope, q_rope), kernel="wgmma")
    bf16 = list(rows.args(q_nope, q_rope))
    bf16[2], bf16[-1] = rows.bf16_arena(), torch.bfloat16
    want = md.mla_decode_triton(*bf16, kernel="wgmma")
    assert bool(got.isfinite().all())  # no NaN row past a history's end nor a free page was read
    assert torch.equal(got, want), float((got.float() - want.float()).abs().max())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads, lens", WGMMA_CASES)
def test_wgmma_fp8_kernel_equals_attention_over_the_dequantised_rows_within_its_bf16_roundings(fmt, heads, lens):
    rows = Rows(fmt, 64, lens, seed=heads + 5)
    q_nope, q_rope = _queries(len(lens), heads, seed=10)
    got = md.mla_decode_triton(*rows.args(q_nope, q_rope), kernel="wgmma").double().cpu()
    for b, values in enumerate(rows.dequantised):
        values = values.cpu()
        if values.shape[0] == 0:
            assert not bool(got[b].any())
            continue
        q = torch.cat([q_nope[b], q_rope[b]], -1).double().cpu()
        want = torch.softmax(q @ values.T * SCALE, -1) @ values[:, :R]
        vmax = float(values[:, :R].abs().max())
        bound = 1.1 * U * (vmax + want.abs()) + 1e-5 * vmax  # bf16 probabilities and output, fp32 sums
        assert bool(((got[b] - want).abs() <= bound).all()), (b, float((got[b] - want).abs().max()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_wgmma_fp8_kernel_replays_in_a_cuda_graph(fmt):
    rows = Rows(fmt, 64, [1500, 700, 64, 3], seed=12)
    q_nope, q_rope = _queries(4, 32, seed=11)
    kv_len = rows.kv_len.clone()
    run = functools.partial(md.mla_decode_triton, kernel="wgmma")
    out = run(*rows.args(q_nope, q_rope, kv_len))  # compiles before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(*rows.args(q_nope, q_rope, kv_len))
    q_nope.copy_(_queries(4, 32, seed=13)[0])
    kv_len.copy_(torch.tensor([1499, 1, 64, 0], dtype=torch.int32))
    graph.replay()
    assert torch.equal(out, run(*rows.args(q_nope, q_rope, kv_len)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_takes_the_hopper_fp8_kernel_at_page_size_64_and_the_portable_one_elsewhere(fmt):
    assert md.FP8_AUTO_WGMMA
    for ps, lens, kernel in ((64, [1500, 3, 700], "wgmma"), (16, [1000, 37], "portable")):
        rows = Rows(fmt, ps, lens, seed=ps)
        q_nope, q_rope = _queries(len(lens), 32, seed=14)
        got = torch.ops.unimem.mla_decode(*rows.args(q_nope, q_rope))
        assert torch.equal(got, md.mla_decode_triton(*rows.args(q_nope, q_rope), kernel=kernel)), (ps, kernel)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads, lens", WGMMA_CASES)
def test_wgmma_fp8_f16_chain_equals_exact_attention_within_its_roundings(fmt, heads, lens):
    rows = Rows(fmt, 64, lens, seed=heads + 7)
    q_nope, q_rope = _queries(len(lens), heads, seed=15)
    got = md.mla_decode_triton(*rows.args(q_nope, q_rope), kernel="wgmma", wgmma_fp8_f16=True)
    assert bool(got.isfinite().all())
    got = got.double().cpu()
    for b, exact, want, vmax in _exact_rows(got, rows, q_nope, q_rope):
        # values within 2^-10 relative (their scores within d), f16 probabilities (2^-11), the bf16 output
        d = SCALE * 2.0 ** -10 * (q_nope[b].double().cpu().abs() @ exact[:, :R].abs().T).amax(-1)
        bound = (2.0 ** -10 + 2.0 ** -11) * vmax + U * want.abs() + vmax * torch.expm1(2 * d)[:, None] + 1e-5 * vmax
        assert bool(((got[b] - want).abs() <= bound).all()), (b, float((got[b] - want).abs().max()))
