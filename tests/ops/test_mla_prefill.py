"""unimem::mla_prefill: the reference (the op's CPU implementation) and the Triton kernels (interpreter, fp32 /
fp16) against a float64 dense causal attention over the latent rows the test wrote, and against transformers'
own ``expand_kv`` + SDPA on today's gathered history (what a rewritten prefill graph must equal). Every chunk
is written to the pages with ``mla_kv_write`` first, then attended, on a pool whose free and unwritten bytes
are NaN. Geometry: the tiny Kimi-Linear's MLA (4 heads, 64 + 16, dn 32, dv 32), page size 16."""

import math

import pytest
import torch

from unimem_compile.errors import GeometryError
from unimem_compile.hf.models import model_config
from unimem_compile.ops import mla_prefill as mp
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, UnifiedPool

from .. import sm90_compiles

CFG = model_config("kimi-linear-tiny")
H, R, DR = CFG.num_attention_heads, CFG.kv_lora_rank, CFG.qk_rope_head_dim
DN, DV = CFG.qk_nope_head_dim, CFG.v_head_dim
L, LAYER, PS = 3, 1, 16
SCALE = (DN + DR) ** -0.5
# fp32: the kernels' fp32 products and the float64 reference differ by rounding only. fp16: the expanded
# K/V and the probabilities are rounded to fp16 (2^-11 relative), the outputs are O(1) averages of values.
TOL = {torch.float32: 2e-5, torch.float16: 5e-3}


class Rows:
    """A padded batch on a poisoned pool: row ``b`` has ``pads[b]`` left pads, then tokens up to the common
    logical length ``total``. All of a row's pages are allocated up front (their unwritten bytes stay NaN);
    :meth:`write` stores the next chunk's latent rows with ``mla_kv_write`` in every layer (the attended
    layer's rows are kept as the ground truth)."""

    def __init__(self, pads, total, dtype, gen, *, extra_pages=1):
        self.dtype, self.pads, self.total = dtype, list(pads), total
        self.B = len(pads)
        need = [-(-(total - p) // PS) + extra_pages for p in pads]
        layout = ArenaLayout.for_capacity(MLASpec(L, R, DR, dtype), LinearStateSpec.kda(1, 2, 8, 4, torch.float32),
                                          PS, sum(need) + 2, 2)
        self.pool = UnifiedPool(layout, poison=True)
        self.page_table = torch.full((self.B, max(need)), -1, dtype=torch.int32)
        for b, k in enumerate(need):
            self.page_table[b, :k] = torch.tensor(self.pool.alloc_pages(k), dtype=torch.int32)
        self.truth = [torch.zeros(0, R + DR, dtype=dtype) for _ in range(self.B)]
        self.logical = 0
        self.gen = gen

    @property
    def kv_len(self) -> torch.Tensor:
        return torch.tensor([t.shape[0] for t in self.truth], dtype=torch.int32)

    def write(self, T: int) -> None:
        """Store the next ``T`` logical positions of every row (the pad positions among them are skipped)."""
        for b in range(self.B):
            new = max(0, self.logical + T - max(self.pads[b], self.logical))
            new = min(new, T)
            have = self.truth[b].shape[0]
            i = torch.arange(have, have + new)
            loc = self.page_table[b].long()[i // PS] * PS + i % PS
            for layer in range(L):
                x = torch.randn(new, R + DR, generator=self.gen).to(self.dtype)
                torch.ops.unimem.mla_kv_write(self.pool.arena, self.pool.v2p, loc, x[:, :R], x[:, R:], layer, L, PS,
                                              R, DR, self.dtype)
                if layer == LAYER:
                    self.truth[b] = torch.cat([self.truth[b], x])
        self.logical += T

    def args(self, q, w, workspace, kv_len_host="same"):
        kv_len = self.kv_len
        host = kv_len.clone() if kv_len_host == "same" else kv_len_host
        return (q, self.pool.arena, self.pool.v2p, self.page_table, kv_len, host, w, SCALE, workspace, LAYER, L, PS,
                R, DR, self.dtype)


def weight(gen, dtype):
    return (torch.randn(H * (DN + DV), R, generator=gen) / math.sqrt(R)).to(dtype)


def queries(gen, B, T, dtype):
    # the layout transformers hands to attention: [B, T, H, dq] projected, viewed as [B, H, T, dq]
    return torch.randn(B, T, H, DN + DR, generator=gen).to(dtype).transpose(1, 2)


def dense(q, w, truth, T):
    """float64 causal attention by stored index over the latent rows ``truth[b]`` (row b's kv_len tokens)."""
    B = q.shape[0]
    wk = w.double().view(H, DN + DV, R)
    out = torch.zeros(B, H, T, DV, dtype=torch.float64)
    for b in range(B):
        x = truth[b].double()
        n = x.shape[0]
        kv = torch.einsum("nr,hcr->hnc", x[:, :R], wk)
        k = torch.cat([kv[..., :DN], x[None, :, R:].expand(H, n, DR)], -1)
        s = torch.einsum("htd,hnd->htn", q[b].double(), k) * SCALE
        q_pos = n - T + torch.arange(T)
        s = s.masked_fill(torch.arange(n)[None, None, :] > q_pos[None, :, None], float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)  # a pad sees no key: zeros
        out[b] = p @ kv[..., DN:]
    return out


def check(got, want, dtype, T, B):
    assert got.dtype == dtype and got.shape == (B, H, T, DV)
    assert got.stride() == (T * H * DV, DV, H * DV, 1)  # a contiguous [B, T, H, dv] seen as [B, H, T, dv]
    assert got.isfinite().all()
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def run_chunks(rows, chunks, w, gen, workspaces, kernel=True):
    """Write and attend chunk by chunk; every chunk's result from the op (reference) and, when ``kernel``,
    the Triton launcher, for each workspace size, against the float64 reference."""
    for T in chunks:
        rows.write(T)
        q = queries(gen, rows.B, T, rows.dtype)
        want = dense(q, w, rows.truth, T)
        for ws in workspaces:
            outs = [torch.ops.unimem.mla_prefill(*rows.args(q, w, ws))]
            if kernel:
                outs.append(mp.mla_prefill_triton(*rows.args(q, w, ws)))
            for got in outs:
                check(got, want, rows.dtype, T, rows.B)
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chunks", [[29], [13, 16], [9, 9, 9, 2]], ids=["1 chunk", "2 chunks", "4 chunks"])
def test_chunked_prefill_of_left_padded_rows_equals_dense_causal_attention(dtype, chunks, gen):
    # rows of 29, 22 and 8 tokens after 0, 7 and 21 pads: histories ending mid-page; in the 4-chunk split row
    # 2's first two chunks are pads only (kv_len 0) and its third starts with pads
    rows = Rows([0, 7, 21], sum(chunks), dtype, gen)
    w = weight(gen, dtype)
    # workspace 40: one piece for the first chunks, several later; 7: pieces that cut rows in the middle
    run_chunks(rows, chunks, w, gen, [40, 7] if chunks == [13, 16] else [40])


@pytest.mark.parametrize("workspace", [1, 5, 16, 33, 200])
def test_pieces_of_any_size_merge_to_the_same_result(workspace, gen):
    # ragged histories continuing with a chunk of 6 tokens: 50 + 6, 0 + 6, 17 + 6 stored tokens; a workspace
    # of 1 token is 85 pieces of one key each (checked on the reference only: the kernel would take 170
    # interpreted launches), 16 cuts the first row at its page boundaries
    rows = Rows([0, 50, 33], 56, torch.float32, gen)
    rows.write(50)
    w = weight(gen, torch.float32)
    run_chunks(rows, [6], w, gen, [workspace], kernel=workspace != 1)


def test_equals_transformers_expand_kv_and_sdpa_on_todays_gathered_history(gen):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    torch.manual_seed(0)
    attn = KimiLinearAttention(CFG, layer_idx=1).eval()
    w = attn.kv_b_proj.weight.detach()
    pads = [0, 5, 12]
    rows = Rows(pads, 30, torch.float32, gen)
    rows.write(6)  # row 2 is still all pads
    T = 24
    rows.write(T)
    q = queries(gen, rows.B, T, torch.float32)
    kv_len = rows.kv_len
    out_offset = torch.tensor(pads, dtype=torch.int32)
    # today's path: the history at logical positions (left pads included), expanded by transformers, SDPA
    # under the mask the unimem cache implies (left padding + causal)
    max_len = 40
    full = torch.ops.unimem.mla_gather(rows.pool.arena, rows.pool.v2p, rows.page_table, kv_len, out_offset,
                                       max_len, LAYER, L, PS, R, DR, torch.float32)
    with torch.no_grad():
        k, v = attn.expand_kv(full[:, None, :, :R], full[:, None, :, R:])
        j = torch.arange(max_len)
        pos = rows.logical - T + torch.arange(T)
        mask = (j[None, None, :] <= pos[None, :, None]) & (j[None, None, :] >= out_offset[:, None, None].long())
        theirs, _ = sdpa_attention_forward(attn, q, k, v, mask[:, None], scaling=attn.scaling)  # [B, T, H, dv]
    for got in (torch.ops.unimem.mla_prefill(*rows.args(q, w, 16)), mp.mla_prefill_triton(*rows.args(q, w, 16))):
        got = got.transpose(1, 2)
        real = torch.arange(T)[None, :] >= (torch.tensor(pads) - (rows.logical - T))[:, None]  # not a pad query
        torch.testing.assert_close(got[real], theirs[real], atol=2e-5, rtol=2e-5)
        assert torch.equal(got[~real], torch.zeros_like(got[~real]))
    assert (~real).any() and real.any()


def test_every_offset_of_the_causal_diagonal_within_a_tile(gen):
    # 16 queries after histories of 13..17 and 30 tokens: the first query of the block sits at every position
    # of a 16-key tile, so the split between whole unmasked tiles and masked ones is checked at each offset
    offsets = [13, 14, 15, 16, 17, 30]
    rows = Rows([30 - o for o in offsets], 46, torch.float32, gen)
    rows.write(30)
    w = weight(gen, torch.float32)
    run_chunks(rows, [16], w, gen, [1000])


def test_a_tombstoned_page_inside_kv_len_reads_zero_rows_and_debug_mode_raises(monkeypatch, gen):
    rows = Rows([0, 0], 40, torch.float32, gen)
    rows.write(40)
    dead = int(rows.page_table[1, 1])
    rows.pool.free_pages([dead])  # tokens 16..31 of row 1: NaN bytes behind a tombstone
    rows.truth[1][16:32] = 0.0
    w = weight(gen, torch.float32)
    q = queries(gen, 2, 40, torch.float32)
    want = dense(q, w, rows.truth, 40)
    for got in (torch.ops.unimem.mla_prefill(*rows.args(q, w, 24)), mp.mla_prefill_triton(*rows.args(q, w, 24))):
        check(got, want, torch.float32, 40, 2)
    monkeypatch.setenv("UNIMEM_DEBUG", "1")
    with pytest.raises(GeometryError, match=f"row 1 page slot 1: virtual page {dead}"):
        mp.mla_prefill_triton(*rows.args(q, w, 24))


def test_pages_and_tokens_past_kv_len_are_never_read(gen):
    # each row's last page is part-written (its tail NaN), one more allocated page holds only NaN, and the table
    # continues with a freed (tombstoned, NaN) page
    rows = Rows([0, 9], 25, torch.float32, gen, extra_pages=2)
    rows.write(25)
    pool = rows.pool
    freed = pool.alloc_pages(1)[0]
    pool.free_pages([freed])
    table = torch.cat([rows.page_table, torch.full((2, 1), freed, dtype=torch.int32)], 1)
    assert pool.read_kv(LAYER, torch.tensor([int(rows.page_table[0, 2]) * PS])).isnan().all()
    w = weight(gen, torch.float32)
    q = queries(gen, 2, 25, torch.float32)
    want = dense(q, w, rows.truth, 25)
    args = list(rows.args(q, w, 8))
    args[3] = table
    for got in (torch.ops.unimem.mla_prefill(*args), mp.mla_prefill_triton(*args)):
        check(got, want, torch.float32, 25, 2)


def test_rows_without_tokens_give_zeros_and_empty_batches_are_shaped(gen):
    rows = Rows([6, 6], 6, torch.float32, gen)
    rows.write(6)  # pads only
    w = weight(gen, torch.float32)
    q = queries(gen, 2, 6, torch.float32)
    for got in (torch.ops.unimem.mla_prefill(*rows.args(q, w, 8)), mp.mla_prefill_triton(*rows.args(q, w, 8))):
        assert torch.equal(got, torch.zeros(2, H, 6, DV))
    empty = queries(gen, 2, 0, torch.float32)
    assert mp.mla_prefill_triton(*rows.args(empty, w, 8)).shape == (2, H, 0, DV)


def test_without_a_host_copy_the_lengths_are_read_from_the_device(gen):
    rows = Rows([0, 3], 20, torch.float32, gen)
    rows.write(20)
    w = weight(gen, torch.float32)
    q = queries(gen, 2, 20, torch.float32)
    want = torch.ops.unimem.mla_prefill(*rows.args(q, w, 8))
    args = rows.args(q, w, 8, None)
    for got in (torch.ops.unimem.mla_prefill(*args), mp.mla_prefill_triton(*args)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_tile_knobs_do_not_change_the_result(gen):
    rows = Rows([0, 4], 40, torch.float16, gen)
    rows.write(40)
    w = weight(gen, torch.float16)
    q = queries(gen, 2, 40, torch.float16)
    want = dense(q, w, rows.truth, 40)
    for kw in ({"block_m": 32}, {"block_n": 32}, {"block_m": 64, "block_n": 16, "gather_block": 4}):
        check(mp.mla_prefill_triton(*rows.args(q, w, 24), **kw), want, torch.float16, 40, 2)


def _short_chunk_over_history(gen, T):
    # ragged rows after 0, 23 and 61 pads: 123, 100 and 62 history tokens (ending mid-page: page size 16),
    # then a chunk of T tokens in every row; free pages and the tails of the last pages are NaN
    rows = Rows([0, 23, 61], 123 + T, torch.float32, gen)
    rows.write(123)
    rows.write(T)
    w = weight(gen, torch.float32)
    q = queries(gen, 3, T, torch.float32)
    return rows, w, q, dense(q, w, rows.truth, T)


# (chunk length, ((workspace, splits), ...)): splits 2, 3 and 7 of each piece's keys (7: more splits than a short
# row has tiles, so some are empty); workspace 512: one piece; 50: pieces that cut rows in the middle (and a piece
# holding two rows' ends). Not the full product: each interpreted call costs 3-12 s of CI (T = 33 the most); the
# rule's test below covers chunks of 7 and the other lengths once more
SPLIT_CASES = [(1, ((512, (2, 7)), (50, (3,)))), (16, ((50, (2, 7)),)), (33, ((512, (3,)),))]


@pytest.mark.parametrize("T, cases", SPLIT_CASES, ids=[f"T{c[0]}" for c in SPLIT_CASES])
def test_split_k_equals_the_unsplit_kernel_and_the_float64_reference(T, cases, gen):
    rows, w, q, want = _short_chunk_over_history(gen, T)
    for ws, split_counts in cases:
        unsplit = mp.mla_prefill_triton(*rows.args(q, w, ws), num_splits=1)
        check(unsplit, want, torch.float32, T, 3)
        for splits in split_counts:
            got = mp.mla_prefill_triton(*rows.args(q, w, ws), num_splits=splits)
            check(got, want, torch.float32, T, 3)
            # the same tiles in a different association of the log-sum-exp merge: fp32 rounding apart
            torch.testing.assert_close(got, unsplit, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("T", [1, 7, 16, 33])
def test_the_split_rule_when_switched_on_splits_short_chunks_and_keeps_the_result(T, monkeypatch, gen):
    # one row (at 4 heads the rule splits every chunk here) and three ragged rows (the rule splits chunks of
    # at most 16 queries: 12 programs of the unsplit grid on the interpreter's 32 stand-in SMs)
    counts = []
    rule = mp.mla_prefill_num_splits

    def spy(*a, **k):
        counts.append(rule(*a, **k))
        return counts[-1]

    monkeypatch.setattr(mp, "mla_prefill_num_splits", spy)
    monkeypatch.setattr(mp, "SPLIT_K_AUTO", True)
    rows, w, q, want = _short_chunk_over_history(gen, T)
    check(mp.mla_prefill_triton(*rows.args(q, w, 512)), want, torch.float32, T, 3)
    assert counts == [2 if T <= 16 else 1]  # 32 // 12 = 2; T = 33: 36 programs, no split
    # one row of 300 history tokens: 4 programs (12 at T = 33); in one piece of 300 + T keys (19-21 tiles of
    # 16) and in pieces of 200 and 100 + T keys
    one = Rows([0], 300 + T, torch.float32, gen)
    one.write(300 + T)
    q1 = queries(gen, 1, T, torch.float32)
    want1 = dense(q1, w, one.truth, T)
    expected = {1: ([4], [3, 1]), 7: ([5], [3, 1]), 16: ([5], [3, 2]), 33: ([2], [2, 2])}[T]
    for ws, want_counts in zip((512, 200), expected):
        counts.clear()
        check(mp.mla_prefill_triton(*one.args(q1, w, ws)), want1, torch.float32, T, 1)
        assert counts == want_counts


def test_split_rule_counts():
    # 32 heads, one row, 128 queries on an H200's 132 SMs: 32 programs, 4 splits
    assert mp.mla_prefill_num_splits(32, 512, 132) == 4
    assert mp.mla_prefill_num_splits(32, 10, 132) == 2  # few keys: one split per 4 tiles
    assert mp.mla_prefill_num_splits(32, 3, 132) == 1
    assert mp.mla_prefill_num_splits(1, 10_000, 132) == 132
    assert mp.mla_prefill_num_splits(66, 512, 132) == 2
    assert mp.mla_prefill_num_splits(67, 512, 132) == 1  # more than half a wave: 2 splits would spill over
    assert mp.mla_prefill_num_splits(132, 512, 132) == 1  # a full wave: off
    assert mp.mla_prefill_num_splits(5000, 512, 132) == 1
    assert mp.mla_prefill_num_splits(32, 512, 132, programs_per_sm=2) == 8
    assert mp.mla_prefill_num_splits(32, 512, 132, min_split_tiles=256) == 2
    assert mp.SPLIT_K_AUTO is False  # off by default until a GPU run has timed it
    # per piece, the most keys of one row: rows of 5, 0, 70 tokens in pieces of 16 (packed 0-4 | 5-74)
    assert mp._row_keys_in_pieces([5, 0, 70], 5, 16) == [11, 16, 16, 16, 11]
    assert mp._row_keys_in_pieces([40], 1, 64) == [40]


def test_opcheck_and_compiled_graph(gen):
    rows = Rows([0, 2], 12, torch.float32, gen)
    rows.write(12)
    w = weight(gen, torch.float32)
    q = queries(gen, 2, 12, torch.float32)
    for host in ("same", None):
        torch.library.opcheck(torch.ops.unimem.mla_prefill.default, rows.args(q, w, 5, host))
    args = rows.args(q, w, 5)
    compiled = torch.compile(lambda *a: torch.ops.unimem.mla_prefill(*a) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), torch.ops.unimem.mla_prefill(*args) * 2)


def test_plan_and_flop_count():
    assert mp.mla_prefill_plan(torch.tensor([5, -1, 70, 0], dtype=torch.int32), 64, 16) == ([5, 0, 64, 0], 69, 5)
    assert mp.mla_prefill_plan(torch.tensor([0, 0], dtype=torch.int32), 64, 16) == ([0, 0], 0, 0)
    # row 0: 3 stored tokens after 1 pad in a chunk of 4 -> pairs 1 + 2 + 3; row 1: 10 tokens, the last 4 new
    # -> pairs 7 + 8 + 9 + 10
    f = mp.mla_prefill_flops([3, 10], 4, 2, 8, 4, 8, 16)
    assert f["pairs"] == 6 + 34
    assert f["attention"] == 2 * 2 * (8 + 4 + 8) * 40
    assert f["expand"] == 2 * 13 * 16 * 2 * (8 + 8)


def _bad(args, i, value):
    args = list(args)
    args[i] = value
    return args


def test_bad_inputs_raise_with_the_numbers(gen):
    rows = Rows([0, 2], 12, torch.float32, gen)
    rows.write(12)
    w = weight(gen, torch.float32)
    q = queries(gen, 2, 12, torch.float32)
    args = rows.args(q, w, 8)
    cases = [
        (_bad(args, 0, q.to(torch.int32)), TypeError, "q must be"),
        (_bad(args, 0, q[..., :DR]), GeometryError, f"q's last dimension {DR}"),
        (_bad(args, 6, w.half()), TypeError, "w_kv_b must be torch.float32"),
        (_bad(args, 6, w[:, :R - 1]), GeometryError, f"w_kv_b must have shape [*, {R}]"),
        (_bad(args, 6, w[: H * DN]), GeometryError,
         f"w_kv_b has {H * DN} rows, not heads {H} x (qk_nope_head_dim {DN}"),
        (_bad(args, 3, rows.page_table[:1]), GeometryError, "page_table must have shape [2, *]"),
        (_bad(args, 4, rows.kv_len.long()), TypeError, "kv_len must be torch.int32"),
        (_bad(args, 5, rows.kv_len[:1]), GeometryError, "kv_len_host must have shape [2]"),
        (_bad(args, 5, torch.tensor([12, 10], device="meta", dtype=torch.int32)), ValueError,
         "kv_len_host must be a CPU tensor"),
        (_bad(args, 8, 0), ValueError, "workspace_tokens must be an int >= 1, got 0"),
        (_bad(args, 7, float("nan")), ValueError, "sm_scale must be finite"),
        (_bad(args, 11, 32), GeometryError, "pages"),
    ]
    for bad, exc, text in cases:
        for fn in (torch.ops.unimem.mla_prefill, mp.mla_prefill_triton):
            with pytest.raises(exc, match=text.replace("[", r"\[").replace("*", r"\*").replace("(", r"\(")):
                fn(*bad)
    for knob, value in (("block_m", 8), ("block_n", 48), ("num_warps", 3), ("num_stages", 0), ("num_splits", 0)):
        with pytest.raises(ValueError, match=f"{knob} must be"):
            mp.mla_prefill_triton(*args, **{knob: value})


def test_debug_mode_checks_the_host_copy_against_the_device_lengths(monkeypatch, gen):
    rows = Rows([0, 2], 12, torch.float32, gen)
    rows.write(12)
    w = weight(gen, torch.float32)
    q = queries(gen, 2, 12, torch.float32)
    monkeypatch.setenv("UNIMEM_DEBUG", "1")
    stale = torch.tensor([12, 9], dtype=torch.int32)
    for fn in (torch.ops.unimem.mla_prefill, mp.mla_prefill_triton):
        with pytest.raises(GeometryError, match="row 1: kv_len 10, kv_len_host 9"):
            fn(*rows.args(q, w, 8, stale))


_HOPPER_CHILD = r'''
import json, os, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from unimem_compile.ops import mla_prefill as mp

kern = mp._mla_prefill_attn_kernel
t = mp._tiles(90, 4096)
consts = dict(R=512, DN=128, DR=64, DV=128, BLOCK_DN=128, BLOCK_DR=64, BLOCK_DV=128, BLOCK_M=t["block_m"],
              BLOCK_N=t["block_n"], DOT_PRECISION="tf32")
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
# several pieces: fp32 running output and lse buffers; one piece: both are the bf16 result (never read, but
# compiled: the branch that reads them must type-check too); split-K: the fp32 partial buffers
for running, split in (("*fp32", False), ("*bf16", False), ("*fp32", True)):
    consts["SPLIT"] = split
    types = dict(q_ptr="*bf16", e_ptr="*bf16", ws_ptr="*bf16", cu_ptr="*i32", out_ptr="*bf16", acc_ptr=running,
                 lse_ptr=running, qk_scale="fp32")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kern.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names)
             if sig[n].startswith("*") or n.startswith("stride")}
    src = ASTSource(kern, sig, constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=t["num_warps"], num_stages=t["num_stages"]))
    ptx = k.asm["ptx"]
    stack = None
    if os.path.exists(tool):
        with tempfile.TemporaryDirectory() as d:
            open(os.path.join(d, "k.cubin"), "wb").write(k.asm["cubin"])
            usage = subprocess.run([tool, "--dump-resource-usage", os.path.join(d, "k.cubin")], capture_output=True,
                                   text=True).stdout
        found = re.search(r"STACK:(\d+)", usage)
        stack = int(found.group(1)) if found else None
    print("RESULT " + json.dumps({"running": running, "split": split, "wgmma": ptx.count("wgmma.mma_async"),
                                  "mma_sync": ptx.count("mma.sync"), "shared": k.metadata.shared, "stack": stack,
                                  "tiles": t}), flush=True)
'''


sm90_compiles.register("mla_prefill_hopper", _HOPPER_CHILD)


def test_hopper_default_tiles_compile_to_wgmma_in_shared_memory_without_spills():
    # CI has no GPU: compile the attention kernel for sm_90 ahead of time (no driver needed) with the tiles
    # the launcher picks on an H100/H200, bf16 at Kimi-Linear's geometry, unsplit and split-K. A child process, because this test
    # process runs Triton in the interpreter (the session's one launch of such compiles: tests/sm90_compiles.py).
    out = sm90_compiles.results("mla_prefill_hopper")
    assert len(out) == 3, f"the compile script printed {len(out)} RESULT lines, not 3"
    assert [k["split"] for k in out] == [False, False, True]
    for k in out:
        _check_hopper_compile(k)


def _check_hopper_compile(k: dict) -> None:
    assert k["tiles"] == {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}
    assert k["wgmma"] > 0 and k["mma_sync"] == 0  # every product on the Hopper tensor-core path
    assert k["shared"] <= 227 * 1024  # an H100/H200 block's shared-memory limit
    assert k["stack"] in (0, None)  # no register spills (None: this Triton ships no cuobjdump)
