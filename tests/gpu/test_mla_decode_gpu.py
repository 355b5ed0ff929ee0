"""unimem::mla_decode on CUDA at the real Kimi-Linear MLA geometry (32 heads, 512 + 64, 7 layers, bf16):
parity with the fp32 reference, with transformers' own attention (expand through kv_b_proj + SDPA) after
absorbing W_UK / W_UV, and a CUDA-graph replay that follows a growing context."""

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from unimem_compile import env  # noqa: E402
from unimem_compile.ops import mla_decode as md  # noqa: E402
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, UnifiedPool  # noqa: E402


pytestmark = pytest.mark.gpu
H, R, DR, L = 32, 512, 64, 7
DN = DV = 128
SCALE = (DN + DR) ** -0.5


class Paged:
    """A poisoned CUDA pool with ragged rows of random bf16 latent KV written through the pool."""

    def __init__(self, page_size, lens, gen, width=None):
        kv = MLASpec(L, R, DR, torch.bfloat16)
        st = LinearStateSpec.kda(1, 2, 8, 4, torch.float32)
        n_pages = sum(-(-n // page_size) for n in lens)
        self.pool = UnifiedPool(ArenaLayout.for_capacity(kv, st, page_size, n_pages, 2), "cuda", poison=True)
        self.ps = page_size
        self.P = width or max(-(-n // page_size) for n in lens)
        self.page_table = torch.full((len(lens), self.P), -1, dtype=torch.int32)
        self.truth = []
        for b, n in enumerate(lens):
            pages = self.pool.alloc_pages(-(-n // page_size))
            self.page_table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            loc = torch.tensor([pages[i // page_size] * page_size + i % page_size for i in range(n)])
            rows = torch.randn(n, R + DR, generator=gen).to(torch.bfloat16)
            for layer in range(L):
                self.pool.write_kv(layer, loc, rows if layer == 2 else torch.randn_like(rows, dtype=torch.float32)
                                   .to(torch.bfloat16))
            self.truth.append(rows.cuda())
        self.page_table = self.page_table.cuda()
        self.kv_len = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def args(self, q_nope, q_rope, sm_scale=SCALE):
        return (q_nope, q_rope, self.pool.arena, self.pool.v2p, self.page_table, self.kv_len, sm_scale, 2, L,
                self.ps, R, DR, torch.bfloat16)


def _assert_close(got, want, tol):
    got, want = got.float(), want.float()
    assert got.isfinite().all()
    rel = (got - want).norm() / want.norm()
    assert rel < tol, f"relative error {rel:.2e} >= {tol}"
    torch.testing.assert_close(got, want, atol=5 * tol, rtol=5 * tol)


HOPPER = md.wgmma_supported(torch.device("cuda"), torch.bfloat16, 64, R, DR)
KERNELS = ["portable"] + (["wgmma"] if HOPPER else [])


@pytest.mark.parametrize("page_size", [1, 64])
def test_bf16_matches_the_fp32_reference_at_kimi_geometry(page_size, gen):
    # poisoned pool: the rows past kv_len inside a row's last page hold NaN (the wgmma kernel loads them)
    paged = Paged(page_size, [1, 63, 64, 1000, 3001], gen)
    q_nope = torch.randn(5, H, R, generator=gen).to(torch.bfloat16).cuda()
    q_rope = torch.randn(5, H, DR, generator=gen).to(torch.bfloat16).cuda()
    args = paged.args(q_nope, q_rope)
    want = md.mla_decode_reference(*args)
    _assert_close(torch.ops.unimem.mla_decode(*args), want, 1e-2)
    for kw in ({"num_splits": 1}, {"num_splits": 7}, {"block_h": 16}, {"num_warps": 8, "num_stages": 3},
               {"partial_dtype": torch.float32}):
        _assert_close(md.mla_decode_triton(*args, kernel="portable", **kw), want, 1e-2)
    if page_size % 64 == 0 and HOPPER:
        for kw in ({}, {"num_splits": 1}, {"num_splits": 2}, {"num_splits": 7}, {"block_h": 16},
                   {"partial_dtype": torch.bfloat16}, {"num_splits": 132, "merge_block_r": 128, "merge_block_s": 16}):
            _assert_close(md.mla_decode_triton(*args, kernel="wgmma", **kw), want, 1e-2)


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("heads", [8, 16, 40, 64])
def test_wgmma_kernel_head_counts_and_fp16(heads, gen):
    paged = Paged(64, [64, 65, 700, 1], gen)
    for dtype in (torch.bfloat16, torch.float16):
        q_nope = torch.randn(4, heads, R, generator=gen).to(dtype).cuda()
        q_rope = torch.randn(4, heads, DR, generator=gen).to(dtype).cuda()
        args = paged.args(q_nope, q_rope)
        want = md.mla_decode_reference(*args)
        got = md.mla_decode_triton(*args, kernel="wgmma")
        assert got.dtype == dtype
        _assert_close(got, want, 1e-2)


def test_absorbed_decode_matches_transformers_expand_and_sdpa(gen):
    sdpa = pytest.importorskip("transformers.integrations.sdpa_attention")
    lens = [17, 700, 2048]
    paged = Paged(64, lens, gen)
    B = len(lens)
    w_kv_b = (torch.randn(H * (DN + DV), R, generator=gen) / math.sqrt(R)).cuda()  # kv_b_proj.weight
    w = w_kv_b.view(H, DN + DV, R)
    w_uk, w_uv = w[:, :DN], w[:, DN:]  # [H, dn, R], [H, dv, R]
    q = torch.randn(B, H, DN + DR, generator=gen).cuda()

    class Module:  # what sdpa_attention_forward reads from the attention module
        is_causal = True
        num_key_value_groups = 1

    want = []
    for b, n in enumerate(lens):
        c = paged.truth[b].float()  # [n, R + Dr]
        kv = torch.nn.functional.linear(c[:, :R], w_kv_b).view(n, H, DN + DV).transpose(0, 1)
        k_nope, v = kv.split([DN, DV], -1)
        key = torch.cat([k_nope, c[None, :, R:].expand(H, n, DR)], -1)
        out, _ = sdpa.sdpa_attention_forward(Module(), q[b, :, None][None], key[None], v[None], None,
                                             scaling=SCALE)
        want.append(out[0, 0])  # [H, dv]
    want = torch.stack(want)

    q_nope = torch.einsum("bhd,hdr->bhr", q[..., :DN], w_uk).to(torch.bfloat16)  # absorb W_UK
    q_rope = q[..., DN:].to(torch.bfloat16)
    latent = torch.ops.unimem.mla_decode(*paged.args(q_nope, q_rope))
    got = torch.einsum("bhr,hvr->bhv", latent.float(), w_uv)  # apply W_UV
    _assert_close(got, want, 2e-2)


@pytest.mark.parametrize("kernel", KERNELS)
def test_cuda_graph_replay_follows_a_growing_context(kernel, gen, monkeypatch):
    monkeypatch.setenv(env.MLA_DECODE_KERNEL, kernel)
    paged = Paged(64, [100, 130], gen, width=4)
    q_nope = torch.randn(2, H, R, generator=gen).to(torch.bfloat16).cuda()
    q_rope = torch.randn(2, H, DR, generator=gen).to(torch.bfloat16).cuda()
    args = paged.args(q_nope, q_rope)
    paged.kv_len.copy_(torch.tensor([1, 64], dtype=torch.int32))
    torch.ops.unimem.mla_decode(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.unimem.mla_decode(*args)
    for lens in ([1, 64], [65, 65], [100, 130]):
        paged.kv_len.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        _assert_close(out, md.mla_decode_reference(*args), 1e-2)


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_an_arena_view_off_16_byte_alignment_falls_back_to_the_portable_kernel(gen):
    paged = Paged(64, [70, 3], gen)
    q_nope = torch.randn(2, H, R, generator=gen).to(torch.bfloat16).cuda()
    q_rope = torch.randn(2, H, DR, generator=gen).to(torch.bfloat16).cuda()
    args = list(paged.args(q_nope, q_rope))
    shifted = torch.empty(args[2].numel() + 8, dtype=torch.uint8, device="cuda")[8:]  # same bytes, base + 8
    shifted.copy_(args[2])
    args[2] = shifted
    want = md.mla_decode_reference(*args)
    _assert_close(md.mla_decode_triton(*args), want, 1e-2)  # auto: portable
    with pytest.raises(ValueError, match="16-byte aligned arena"):
        md.mla_decode_triton(*args, kernel="wgmma")
