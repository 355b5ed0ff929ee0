"""unimem::mla_prefill on CUDA at the real Kimi-Linear MLA geometry (32 heads, 512 + 64, dn 128, dv 128, a
7-layer page envelope, page size 64, bf16): chunked prefills of ragged, left-padded rows on a NaN-poisoned pool
against a float64 dense causal reference and the op's own reference, tile knobs, and the workspace bound on
memory."""

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from unimem_compile.ops import mla_prefill as mp  # noqa: E402
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, UnifiedPool  # noqa: E402

pytestmark = pytest.mark.gpu
H, R, DR, DN, DV, L, LAYER, PS = 32, 512, 64, 128, 128, 7, 2, 64
SCALE = (DN + DR) ** -0.5
DT = torch.bfloat16


class Rows:
    """Ragged rows on a poisoned CUDA pool: row ``b`` gets ``lens[b]`` tokens over the chunks; all its pages
    are allocated up front (unwritten bytes NaN); ``write(counts)`` stores ``counts[b]`` new latent rows of
    every layer with ``mla_kv_write`` and keeps the attended layer's as the ground truth."""

    def __init__(self, lens, gen):
        need = [-(-n // PS) + 1 for n in lens]
        layout = ArenaLayout.for_capacity(MLASpec(L, R, DR, DT), LinearStateSpec.kda(1, 2, 8, 4, torch.float32), PS,
                                          sum(need) + 2, 2)
        self.pool = UnifiedPool(layout, "cuda", poison=True)
        self.page_table = torch.full((len(lens), max(need)), -1, dtype=torch.int32)
        for b, k in enumerate(need):
            self.page_table[b, :k] = torch.tensor(self.pool.alloc_pages(k), dtype=torch.int32)
        self.page_table = self.page_table.cuda()
        self.truth = [torch.zeros(0, R + DR, dtype=DT, device="cuda") for _ in lens]
        self.gen = gen

    @property
    def kv_len(self):
        return torch.tensor([t.shape[0] for t in self.truth], dtype=torch.int32)

    def write(self, counts):
        for b, new in enumerate(counts):
            have = self.truth[b].shape[0]
            i = torch.arange(have, have + new, device="cuda")
            loc = self.page_table[b].long()[i // PS] * PS + i % PS
            for layer in range(L):
                x = torch.randn(new, R + DR, generator=self.gen).to(DT).cuda()
                torch.ops.unimem.mla_kv_write(self.pool.arena, self.pool.v2p, loc, x[:, :R], x[:, R:], layer, L, PS,
                                              R, DR, DT)
                if layer == LAYER:
                    self.truth[b] = torch.cat([self.truth[b], x])

    def args(self, q, w, workspace, host=True):
        kv_len = self.kv_len
        return (q, self.pool.arena, self.pool.v2p, self.page_table, kv_len.cuda(), kv_len if host else None, w, SCALE,
                workspace, LAYER, L, PS, R, DR, DT)


def dense(q, w, truth, T):
    """float64 causal attention by stored index (zeros for pad queries)."""
    wk = w.double().view(H, DN + DV, R)
    out = torch.zeros(q.shape[0], H, T, DV, dtype=torch.float64, device="cuda")
    for b, x in enumerate(truth):
        x = x.double()
        n = x.shape[0]
        if n == 0:
            continue
        kv = torch.einsum("nr,hcr->hnc", x[:, :R], wk)
        k = torch.cat([kv[..., :DN], x[None, :, R:].expand(H, n, DR)], -1)
        s = torch.einsum("htd,hnd->htn", q[b].double(), k) * SCALE
        q_pos = n - T + torch.arange(T, device="cuda")
        s = s.masked_fill(torch.arange(n, device="cuda")[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[b] = torch.softmax(s, -1).nan_to_num(0.0) @ kv[..., DN:]
    return out


def _assert_close(got, want, tol):
    assert got.isfinite().all()
    got, want = got.double(), want.double()
    rel = (got - want).norm() / want.norm()
    assert rel < tol, f"relative error {rel:.2e} >= {tol}"
    torch.testing.assert_close(got, want, atol=5 * tol, rtol=5 * tol)


def _queries(gen, B, T):
    return torch.randn(B, T, H, DN + DR, generator=gen).to(DT).cuda().transpose(1, 2)


def test_chunked_prefill_of_ragged_padded_rows_matches_float64(gen):
    # a padded batch prefilled in chunks of 512, 512, 977: row totals 2001, 1950 (51 pads), 700 (1301 pads:
    # its first two chunks are pads only) and 1 (the last token of the last chunk); then a continuation of 64
    w = (torch.randn(H * (DN + DV), R, generator=gen) / math.sqrt(R)).to(DT).cuda()
    pads = [0, 51, 1301, 2000]
    rows = Rows([2001 - p + 64 for p in pads], gen)
    logical = 0
    for T in (512, 512, 977, 64):
        rows.write([max(0, logical + T - max(p, logical)) for p in pads])
        logical += T
        q = _queries(gen, len(pads), T)
        want = dense(q, w, rows.truth, T)
        ref = mp.mla_prefill_reference(*rows.args(q, w, 8192))
        for ws in (8192, 1000):  # one piece; pieces cutting rows in the middle
            got = torch.ops.unimem.mla_prefill(*rows.args(q, w, ws))
            assert got.shape == (4, H, T, DV) and got.transpose(1, 2).is_contiguous()
            _assert_close(got, want, 1e-2)
            _assert_close(got, ref, 1e-2)
        first_real = torch.tensor(pads, device="cuda") - (logical - T)  # chunk position of each row's first token
        pad_rows = torch.arange(T, device="cuda")[None, :] < first_real[:, None]
        assert torch.equal(got.transpose(1, 2)[pad_rows], torch.zeros_like(got.transpose(1, 2)[pad_rows]))


@pytest.mark.parametrize("kw", [{"block_m": 64, "num_warps": 4, "num_stages": 2}, {"block_n": 32},
                                {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}])
def test_tile_knobs_and_the_synchronising_form_match_float64(kw, gen):
    w = (torch.randn(H * (DN + DV), R, generator=gen) / math.sqrt(R)).to(DT).cuda()
    rows = Rows([3001, 700], gen)
    rows.write([2500, 300])
    rows.write([501, 400])
    q = _queries(gen, 2, 501)
    want = dense(q, w, rows.truth, 501)
    _assert_close(mp.mla_prefill_triton(*rows.args(q, w, 2048), **kw), want, 1e-2)
    _assert_close(mp.mla_prefill_triton(*rows.args(q, w, 2048, host=False), **kw), want, 1e-2)


@pytest.mark.parametrize("T", [1, 16, 100])
def test_split_k_on_short_chunks_matches_the_unsplit_kernel_and_float64(T, monkeypatch, gen):
    # bf16 at Kimi-Linear's geometry: two ragged rows with 3000 and 700 history tokens, a short chunk; forced
    # splits and the rule switched on (this GPU's SM count), one piece and pieces of 2048
    w = (torch.randn(H * (DN + DV), R, generator=gen) / math.sqrt(R)).to(DT).cuda()
    rows = Rows([3000 + T, 700 + T], gen)
    rows.write([3000, 700])
    rows.write([T, T])
    q = _queries(gen, 2, T)
    want = dense(q, w, rows.truth, T)
    monkeypatch.setattr(mp, "SPLIT_K_AUTO", True)
    for ws in (8192, 2048):
        unsplit = mp.mla_prefill_triton(*rows.args(q, w, ws), num_splits=1)
        _assert_close(unsplit, want, 1e-2)
        for kw in ({"num_splits": 3}, {"num_splits": 16}, {}):
            got = mp.mla_prefill_triton(*rows.args(q, w, ws), **kw)
            _assert_close(got, want, 1e-2)
            _assert_close(got, unsplit, 1e-2)


def test_memory_is_bounded_by_the_workspace_not_the_history(gen):
    # one row of 65536 tokens, a chunk of 1024: the expanded history would be 65536 x 32 x 256 x 2 = 1 GiB
    w = (torch.randn(H * (DN + DV), R, generator=gen) / math.sqrt(R)).to(DT).cuda()
    rows = Rows([65536], gen)
    rows.write([65536])
    T, ws = 1024, 4096
    q = _queries(gen, 1, T)
    args = rows.args(q, w, ws)
    torch.ops.unimem.mla_prefill(*args)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = torch.ops.unimem.mla_prefill(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bound = (ws * (R + DR + H * (DN + DV)) * 2  # latent + expanded workspace
             + T * H * DV * (2 + 4) + H * T * 4  # output, fp32 running output and LSE
             + 2 * 2**20)  # the allocator's rounding and the packed row starts
    assert peak <= bound, f"peak {peak} bytes > bound {bound}"
    assert peak < 65536 * H * (DN + DV) * 2 / 8
    last = 128  # the float64 reference of the chunk's last 128 queries (all 1024 would take 17 GB)
    _assert_close(out[:, :, -last:], dense(q[:, :, -last:], w, rows.truth, last), 1e-2)
