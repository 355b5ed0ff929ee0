"""MLA write path on CUDA at the real Kimi-Linear MLA geometry (7 layers, kv_lora_rank 512 + rope 64, bf16):
the Triton kernels against a plain contiguous latent cache, byte for byte.

Run with compiled kernels: ``TRITON_INTERPRET=0 python -m pytest -q tests/gpu/test_mla_write_gpu.py``
(tests/conftest.py turns the interpreter on unless the variable is set).
"""

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("run with TRITON_INTERPRET=0: these tests time the compiled kernels' results at full size",
                allow_module_level=True)

from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, UnifiedPool  # noqa: E402
from unimem_compile.profiling import cuda_kernels  # noqa: E402

mw = importlib.import_module("unimem_compile.ops.mla_write")
mg = importlib.import_module("unimem_compile.ops.mla_gather")

pytestmark = pytest.mark.gpu

L, R, DR = 7, 512, 64
D = R + DR
BF16 = torch.bfloat16


class Batch:
    """A left-padded batch of rows in a pool on the GPU, with pages scattered by frees and compaction, and
    the same history in a plain contiguous latent cache ``[L, B, max_len, D]`` (HF's StaticCache layout:
    position j is logical position j, left pads included)."""

    def __init__(self, page_size, lens, extra, gen):
        self.ps, self.lens, self.gen = page_size, list(lens), gen
        self.max_len = max(lens) + extra
        self.pads = [max(lens) - n for n in lens]
        kv = MLASpec(L, R, DR, BF16)
        st = LinearStateSpec.kda(2, 4, 32, 4, BF16)
        per_row = -(-(max(lens) + extra) // page_size)
        self.pool = UnifiedPool(ArenaLayout.for_capacity(kv, st, page_size, 2 * per_row * len(lens) + 2, 2), "cuda")
        self.pages = []
        spare = []
        for _ in lens:  # each row's pages interleaved with pages freed afterwards: compaction scatters them
            got = self.pool.alloc_pages(2 * per_row)
            self.pages.append(got[0::2])
            spare += got[1::2]
        self.pool.free_pages(spare)
        assert self.pool.compact("kv")
        self.cache = torch.zeros(L, len(lens), self.max_len, D, dtype=BF16, device="cuda")
        self.filled = [0] * len(lens)  # tokens stored per row

    def locations(self, b, start, n):
        i = torch.arange(start, start + n)
        pages = torch.tensor(self.pages[b])
        return (pages[i // self.ps] * self.ps + i % self.ps).cuda()

    def page_table(self):
        width = max(len(p) for p in self.pages)
        table = torch.full((len(self.pages), width), -1, dtype=torch.int32)
        for b, p in enumerate(self.pages):
            table[b, : len(p)] = torch.tensor(p, dtype=torch.int32)
        return table.cuda()

    def step_locations(self, s):
        """[B, s] locations of the next s positions of every row; left pads (prefill only) get -1."""
        rows = []
        for b, n in enumerate(self.lens):
            if self.filled[b] == 0:
                pad = s - n
                rows.append(torch.cat([torch.full((pad,), -1, device="cuda"), self.locations(b, 0, n)]))
            else:
                rows.append(self.locations(b, self.filled[b], s))
        return torch.stack(rows)

    def record(self, layer, compressed):
        """Store a forward's [B, s, D] latents into the contiguous cache at their logical positions."""
        s = compressed.shape[1]
        for b in range(len(self.lens)):
            start = self.pads[b] if self.filled[b] == 0 else self.pads[b] + self.filled[b]
            first = s - self.lens[b] if self.filled[b] == 0 else 0
            self.cache[layer, b, start: start + s - first] = compressed[b, first:]

    def advance(self, s):
        self.filled = [n if f == 0 else f + s for f, n in zip(self.filled, self.lens)]


def _write_steps(batch, write, decode_steps=3):
    """A prefill then decode steps, every layer, inputs shaped as transformers hands them: kv_nope and
    k_rot are slices of one [B, s, R + Dr] projection (row stride R + Dr, not copied). Checks after every
    call that the arena equals the plain-torch reference write (so no byte outside the rows changed)."""
    s = max(batch.lens)
    for _ in range(1 + decode_steps):
        loc = batch.step_locations(s)
        for layer in range(L):
            compressed = torch.randn(len(batch.lens), s, D, generator=batch.gen, device="cuda").to(BF16)
            kv_nope, k_rot = torch.split(compressed, [R, DR], dim=-1)
            want = batch.pool.arena.clone()
            mw.mla_kv_write_reference(want, batch.pool.v2p, loc.reshape(-1), kv_nope.reshape(-1, R),
                                      k_rot.reshape(-1, DR), layer, L, batch.ps, R, DR, BF16)
            write(batch.pool.arena, batch.pool.v2p, loc.reshape(-1), kv_nope.reshape(-1, R), k_rot.reshape(-1, DR),
                  layer, L, batch.ps, R, DR, BF16)
            assert torch.equal(batch.pool.arena, want)
            batch.record(layer, compressed)
        batch.advance(s)
        s = 1


@pytest.fixture
def gen():
    return torch.Generator(device="cuda").manual_seed(7)


@pytest.mark.parametrize("page_size", [1, 64])
def test_writes_match_a_contiguous_latent_cache_byte_for_byte(page_size, gen):
    batch = Batch(page_size, [300, 77, 1, 129], extra=4, gen=gen)
    _write_steps(batch, torch.ops.unimem.mla_kv_write)
    assert not batch.pool.arena[: batch.pool.layout.sink_floor].any()
    for layer in range(L):
        for b, n in enumerate(batch.filled):
            got = batch.pool.read_kv(layer, batch.locations(b, 0, n))
            want = batch.cache[layer, b, batch.pads[b]: batch.pads[b] + n]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (layer, b)


@pytest.mark.parametrize("page_size", [1, 64])
def test_gather_matches_the_contiguous_cache_byte_for_byte(page_size, gen):
    batch = Batch(page_size, [200, 64, 3], extra=2, gen=gen)
    _write_steps(batch, torch.ops.unimem.mla_kv_write, decode_steps=2)
    table = batch.page_table()
    kv_len = torch.tensor(batch.filled, dtype=torch.int32, device="cuda")
    pads = torch.tensor(batch.pads, dtype=torch.int32, device="cuda")
    for layer in range(L):
        got = torch.ops.unimem.mla_gather(batch.pool.arena, batch.pool.v2p, table, kv_len, pads, batch.max_len,
                                          layer, L, page_size, R, DR, BF16)
        assert torch.equal(got.view(torch.int16), batch.cache[layer].view(torch.int16)), layer


def test_fp32_inputs_are_rounded_to_bf16_like_torch(gen):
    batch = Batch(64, [700], extra=0, gen=gen)
    loc = batch.step_locations(700).reshape(-1)
    x = torch.randn(700, D, generator=gen, device="cuda") * 100  # fp32: every value needs a rounding
    want = batch.pool.arena.clone()
    mw.mla_kv_write_reference(want, batch.pool.v2p, loc, x[:, :R], x[:, R:], 5, L, 64, R, DR, BF16)
    torch.ops.unimem.mla_kv_write(batch.pool.arena, batch.pool.v2p, loc, x[:, :R], x[:, R:], 5, L, 64, R, DR, BF16)
    assert torch.equal(batch.pool.arena, want)
    assert torch.equal(batch.pool.read_kv(5, loc), x.to(BF16))


def test_rmsnorm_write_matches_the_transformers_module_within_one_bf16_ulp(gen):
    """Same bytes as kv_a_layernorm + a plain write, except where the fp32 mean of squares (summed in
    another order than torch's CUDA reduction) moves a rounding: at most 1 bf16 ulp on at most 0.1% of values."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    batch = Batch(64, [500, 33], extra=0, gen=gen)
    norm = DeepseekV3RMSNorm(R, eps=1e-6).to("cuda", BF16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(R, generator=gen, device="cuda") + 0.5)
    loc = batch.step_locations(500).reshape(-1)
    x = (torch.randn(2, 500, D, generator=gen, device="cuda") * 3 + 0.25).to(BF16)
    kv_nope, k_rot = torch.split(x, [R, DR], dim=-1)
    want = batch.pool.arena.clone()
    with torch.no_grad():
        mw.mla_kv_write_triton(want, batch.pool.v2p, loc, norm(kv_nope).reshape(-1, R), k_rot.reshape(-1, DR), 3, L,
                               64, R, DR, BF16)
    got = batch.pool.arena.clone()
    torch.ops.unimem.mla_kv_write_rmsnorm(got, batch.pool.v2p, loc, kv_nope.reshape(-1, R), k_rot.reshape(-1, DR),
                                          norm.weight.detach(), 1e-6, 3, L, 64, R, DR, BF16)
    g, w = got.view(torch.int16), want.view(torch.int16)
    diff = (g.int() - w.int()).abs()
    written = (500 + 33) * D
    assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= 1e-3 * written
    assert int((g != batch.pool.arena.view(torch.int16)).sum()) > 0.9 * written  # the write happened


def test_compiled_write_and_gather_with_inductor_match_eager(gen):
    batch = Batch(64, [90, 40], extra=1, gen=gen)
    _write_steps(batch, torch.ops.unimem.mla_kv_write, decode_steps=0)
    table = batch.page_table()
    kv_len = torch.tensor([n + 1 for n in batch.filled], dtype=torch.int32, device="cuda")
    pads = torch.tensor(batch.pads, dtype=torch.int32, device="cuda")
    loc = batch.step_locations(1).reshape(-1)
    weight = torch.rand(R, generator=gen, device="cuda").to(BF16) + 0.5

    def step(arena, v2p, loc, x, weight):
        kv_nope, k_rot = torch.split(x, [R, DR], dim=-1)
        torch.ops.unimem.mla_kv_write_rmsnorm(arena, v2p, loc, kv_nope, k_rot, weight, 1e-6, 2, L, 64, R, DR, BF16)
        hist = torch.ops.unimem.mla_gather(arena, v2p, table, kv_len, pads, batch.max_len, 2, L, 64, R, DR, BF16)
        return hist[..., :R].unsqueeze(1) * 2, hist[..., R:].unsqueeze(1)

    x = torch.randn(2, D, generator=gen, device="cuda").to(BF16)
    eager_arena, comp_arena = batch.pool.arena.clone(), batch.pool.arena.clone()
    want = step(eager_arena, batch.pool.v2p, loc, x, weight)
    got = torch.compile(step, backend="inductor", fullgraph=True)(comp_arena, batch.pool.v2p, loc, x, weight)
    assert torch.equal(comp_arena, eager_arena)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])




def test_each_op_call_is_exactly_one_kernel_launch(gen):
    """The virtual -> dense translation, the norm and the zero fill of the gather add no launch."""
    batch = Batch(64, [128, 64], extra=0, gen=gen)
    pool = batch.pool
    loc = batch.step_locations(128).reshape(-1)
    x = torch.randn(256, D, generator=gen, device="cuda").to(BF16)
    weight = torch.rand(R, generator=gen, device="cuda").to(BF16)
    table = batch.page_table()
    kv_len = torch.tensor(batch.lens, dtype=torch.int32, device="cuda")
    pads = torch.tensor(batch.pads, dtype=torch.int32, device="cuda")
    calls = {
        "mla_kv_write": lambda: torch.ops.unimem.mla_kv_write(pool.arena, pool.v2p, loc, x[:, :R], x[:, R:], 0, L,
                                                              64, R, DR, BF16),
        "mla_kv_write_rmsnorm": lambda: torch.ops.unimem.mla_kv_write_rmsnorm(
            pool.arena, pool.v2p, loc, x[:, :R], x[:, R:], weight, 1e-6, 0, L, 64, R, DR, BF16),
        "mla_gather": lambda: torch.ops.unimem.mla_gather(pool.arena, pool.v2p, table, kv_len, pads, 128, 0, L, 64,
                                                          R, DR, BF16),
    }
    for name, fn in calls.items():
        kernels = cuda_kernels(fn)
        assert len(kernels) == 1, (name, kernels)


def test_rows_copied_within_the_arena_are_read_before_any_store(gen):
    """kv_nope / k_rope as views of the arena whose rows overlap the rows written (a shift by one token
    over 1,024 tokens, many programs in flight): the result is the reference's, read-then-store."""
    kv = MLASpec(L, R, DR, BF16)
    st = LinearStateSpec.kda(2, 4, 32, 4, BF16)
    pool = UnifiedPool(ArenaLayout.for_capacity(kv, st, 64, 20, 2), "cuda")
    pages = pool.alloc_pages(16)
    loc = torch.cat([torch.arange(p * 64, p * 64 + 64) for p in pages]).cuda()
    pool.write_kv(3, loc, torch.randn(loc.numel(), D, generator=gen, device="cuda").to(BF16))
    before = pool.read_kv(3, loc)
    rows = pool.kv_views()[3][:, 0]
    dense = pool.dense_rows(loc)
    # one page's rows are contiguous in the layer view: shift the first page's tokens 0..62 to 1..63
    first = int(dense[0])
    assert torch.equal(dense[:64].cpu(), torch.arange(first, first + 64))
    src = rows[first: first + 63]
    mw.mla_kv_write_triton(pool.arena, pool.v2p, loc[1:64], src[:, :R], src[:, R:], 3, L, 64, R, DR, BF16)
    after = pool.read_kv(3, loc)
    assert torch.equal(after[1:64], before[:63]) and torch.equal(after[0], before[0])
    assert torch.equal(after[64:], before[64:])
