"""Op ``unimem::mla_prefill``: MLA prefill attention over the paged latent history, cost following the tokens
present (not ``max_seq_len``).

A step brings ``T`` new tokens per row (a whole prompt, one chunk of a chunked prefill, or a continuation of
a conversation), and the cache has already written their latent rows to the pages, so ``kv_len[b]`` counts
them. The ``T`` queries of row ``b`` are the row's last ``T`` stored-or-padded tokens: query ``t`` has stored
index ``kv_len[b] - T + t``; a negative index is a left pad (its output is zeros). Each query attends to the
row's stored tokens with index ``<=`` its own (causal by stored index; the chunk itself included), keys and
values expanded from the latent rows through ``kv_b_proj`` exactly as transformers' MLA does (``expand_kv``):
``[k_nope | v] = latent @ W^T`` per head, ``k = [k_nope | k_rot]`` with ``k_rot`` shared by the heads.

Algorithm (the way vLLM's chunked MLA prefill computes a request's cached context,
``vllm/v1/attention/backends/mla/common.py`` ``_compute_prefill_context`` with ``merge_attn_states``): the
history of all rows is laid end to end (row ``b``'s tokens at packed positions ``cu[b] + i``) and processed in
pieces of at most ``workspace_tokens`` packed tokens. Per piece:

1. gather the piece's latent rows from the pages into a dense ``[n, R + Dr]`` workspace (one Triton launch;
   the row of each packed position is found by a binary search over ``cu`` inside the kernel);
2. expand them with one matmul: ``E = workspace[:, :R] @ W^T`` -> ``[n, H * (dn + dv)]`` (cuBLAS);
3. run our flash-attention forward kernel (Dao et al., FlashAttention-2, 2023: online softmax in fp32, base
   2) of every row's queries over that row's keys in the piece, masked causally by stored index;
4. merge with the pieces before by log-sum-exp, inside the same kernel: a program starts its online softmax
   from the previous pieces' normalised output and LSE (the split-KV combine of FlashAttention's
   ``flash_fwd_splitkv_combine_kernel`` and of flash decoding, done incrementally), so no merge launch and
   no per-piece partial buffers exist. The last piece writes the output in q's dtype.

Split-K (off by default: :data:`SPLIT_K_AUTO`): a short chunk over a long history launches too few programs
of step 3 to fill the GPU (``B x H x ceil(T / block_m)``), each walking the whole piece. With ``S > 1``
splits step 3 runs ``S`` programs per (query block, head, row), each over its run of the block's key tiles
(the unsplit tiles), writing a normalised partial output and its log-sum-exp, and one merge launch
(:func:`_merge_splits_kernel`) folds them into the pieces before with the same combine (flash decoding's
stage 2). :func:`mla_prefill_num_splits` picks ``S`` per piece from the program count and the SM count.

Memory is bounded by the workspace: ``workspace_tokens x (R + Dr + H * (dn + dv)) x itemsize`` (8192 tokens
at Kimi-Linear's geometry, bf16: 9 MiB + 128 MiB), plus, when there is more than one piece, an fp32 running
output ``[B, T, H, dv]`` and LSE ``[B, H, T]``; never the history's expanded size.

How many pieces: ``ceil(sum_b min(kv_len[b], P * ps) / workspace_tokens)``, from the host copy
``kv_len_host`` of the lengths (the cache knows them on the host: no device sync). Without it the launcher
copies ``kv_len`` to the host: one device synchronisation per call (the host waits for every queued kernel,
and the GPU then idles while the host enqueues this op's launches). Kernels read the lengths from the device
``kv_len`` and never touch memory outside the piece's workspace, so a host copy that disagrees with the
device is wrong results, never a wild access (``UNIMEM_DEBUG=1`` checks that they agree).

Counting (benchmarks/bench_mla_prefill.py reports these): with ``N = sum_b kv_len[b]`` history tokens, the
expansion is ``2 N R H (dn + dv)`` FLOPs; the attention ``2 H (dn + Dr + dv) x pairs`` FLOPs where ``pairs``
counts the (query, key) pairs the causal mask admits, ``sum_b sum_{t: s_t >= 0} (s_t + 1)`` with ``s_t``
query ``t``'s stored index (masked-out work is not counted, as FlashAttention's causal numbers do not).
Bytes: the latent rows ``N (R + Dr)`` x kv itemsize read and written to the workspace, ``E`` (``N H (dn + dv)``
x itemsize) written once and read by every query block of its row (from L2 while the blocks of one head run
together), the weight once per piece, queries and output once, and per piece after the first a read and a
write of the fp32 running output. Per key and head the attention does ``2 T (dn + Dr + dv)`` FLOPs on
``(dn + dv) x itemsize`` bytes of ``E``: about ``1.25 T`` FLOP/byte at Kimi-Linear's geometry in bf16, so a
chunk of more than ~200 queries is compute bound even if every read came from HBM.

Reference: :func:`mla_prefill_reference` (plain torch, the same pieces and merge), also the default
implementation (CPU tensors run it); CUDA tensors run :func:`mla_prefill_triton`.

fp8 rows (an fp8 ``kv_dtype``: :class:`~unimem_compile.pool.specs.MLARowFormat`) are read as the bf16 values
``mla_gather`` returns (:func:`.fp8.dequantize_rows`), rounded to q's dtype: by the reference, and in the
launcher by a plain-torch gather of each piece into the workspace (:func:`_gather_piece_fp8`) in place of the
Triton gather kernel, which reads rows of ``kv_dtype`` values; the expansion and the attention kernel are
the same.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from unimem_compile import env
from unimem_compile.errors import GeometryError

from . import fp8
from .common import (COMPUTE_DTYPES, arena_rows, check_kernel_device, check_knob, check_live_page_table,
                     check_mla_geometry, check_same_device, check_tensor, device_sms, latent_rows, typed_rows)
from .common import HOST_PLANNED
from .geometry import MLAGeometry
from .step_context import host_copy

# The op object is ``torch.ops.unimem.mla_prefill`` (or ``unimem_compile.ops.mla_prefill.mla_prefill``):
# exporting it from the package would shadow this module.
__all__ = ["mla_prefill_reference", "mla_prefill_triton", "mla_prefill_plan", "mla_prefill_flops",
           "mla_prefill_tiles", "mla_prefill_num_splits", "WORKSPACE_TOKENS", "SPLIT_K_AUTO"]

#: Default piece size in packed history tokens (the op takes it as an argument; this is what callers pass
#: when they have no memory budget of their own): 137 MiB of workspace at Kimi-Linear's geometry in bf16.
WORKSPACE_TOKENS = 8192

_LOG2E = 1.4426950408889634

#: Split-K of a piece's keys (:func:`mla_prefill_num_splits`) when the launcher is given no ``num_splits``:
#: off until a GPU run has timed it (benchmarks/bench_mla_prefill.py --short); the one-line switch.
SPLIT_K_AUTO = False
#: Attention programs resident per SM that the split rule fills (one wave): the sm_90 tiles take 168 KiB of
#: the 227 KiB of shared memory, so one.
SPLIT_PROGRAMS_PER_SM = 1
#: Fewest key tiles (``block_n`` keys each) a split gets: a split loads its queries and stores an fp32
#: partial output, so it must walk enough keys to pay for both.
MIN_SPLIT_TILES = 4
#: Stand-in SM count when the kernels run in the interpreter (CPU tensors), so CPU tests take the rule's
#: split branch at small shapes.
INTERPRETER_SMS = 32


# ---------------------------------------------------------------------------------------------- planning
def mla_prefill_plan(kv_len_host: torch.Tensor, max_tokens: int, workspace_tokens: int) -> tuple[list[int], int, int]:
    """Host-side plan of a call: ``(lengths, total, pieces)``.

    ``lengths[b] = clamp(kv_len_host[b], 0, max_tokens)`` (``max_tokens = P * page_size``, what the kernels
    also clamp to), ``total = sum(lengths)`` packed history tokens, ``pieces = ceil(total / workspace_tokens)``.
    """
    lengths = [min(max(int(n), 0), max_tokens) for n in kv_len_host.tolist()]
    total = sum(lengths)
    return lengths, total, -(-total // workspace_tokens)


def mla_prefill_flops(lengths: list[int], T: int, heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                      v_head_dim: int, kv_lora_rank: int) -> dict[str, int]:
    """FLOPs of one call, counted as the module docstring says: ``{"expand", "attention", "pairs"}``.

    ``lengths``: tokens stored per row (this chunk included); ``T``: queries per row."""
    pairs = 0
    for n in lengths:
        first = n - T  # stored index of query 0; queries with a negative index are pads
        lo = max(first, 0)
        # sum over stored query indices s in [lo, n) of (s + 1)
        pairs += (n * (n + 1) - lo * (lo + 1)) // 2
    expand = 2 * sum(lengths) * kv_lora_rank * heads * (qk_nope_head_dim + v_head_dim)
    attention = 2 * heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim) * pairs
    return {"expand": expand, "attention": attention, "pairs": pairs}


def mla_prefill_num_splits(programs: int, key_tiles: int, sms: int, *,
                           programs_per_sm: int = SPLIT_PROGRAMS_PER_SM, min_split_tiles: int = MIN_SPLIT_TILES) -> int:
    """Split count of one piece's attention launch: ``programs`` = ``B x H x ceil(T / block_m)`` programs of
    the unsplit grid, ``key_tiles`` = ``ceil(keys / block_n)`` for the row with the most keys in the piece,
    ``sms`` = the device's SM count.

    ``1`` (no split) when the programs fill a wave (``programs >= programs_per_sm x sms``, split-K would only
    add partial outputs and a merge); else the most splits that keep ``programs x splits`` within that wave,
    at most one per ``min_split_tiles`` key tiles, at least 1. At 32 heads, one row, a chunk of 128 queries
    and 132 SMs: 32 programs, 4 splits (given 16 or more key tiles); 5 rows of 128: 160 programs, 1."""
    target = programs_per_sm * sms
    if programs >= target:
        return 1
    return max(1, min(target // max(programs, 1), key_tiles // min_split_tiles))


def _device_sms(device: torch.device) -> int:
    return device_sms(device, INTERPRETER_SMS)


def _row_keys_in_pieces(lengths: list[int], pieces: int, workspace_tokens: int) -> list[int]:
    # per piece, the most keys any one row has in it (host integers: the plan's lengths)
    most = [0] * pieces
    start = 0
    for n in lengths:
        for p in range(start // workspace_tokens, -(-(start + n) // workspace_tokens)):
            lo, hi = max(start, p * workspace_tokens), min(start + n, (p + 1) * workspace_tokens)
            most[p] = max(most[p], hi - lo)
        start += n
    return most


def _dims(q: torch.Tensor, w_kv_b: torch.Tensor, qk_rope_head_dim: int) -> tuple[int, int, int, int, int]:
    B, H, T, dq = q.shape
    dn = dq - qk_rope_head_dim
    return B, H, T, dn, w_kv_b.shape[0] // H - dn


# ---------------------------------------------------------------------------------------------- reference
def mla_prefill_reference(
    q: torch.Tensor, arena: torch.Tensor, v2p: torch.Tensor, page_table: torch.Tensor, kv_len: torch.Tensor,
    kv_len_host: torch.Tensor | None, w_kv_b: torch.Tensor, sm_scale: float, workspace_tokens: int, *geometry,
) -> torch.Tensor:
    """Plain-torch :func:`mla_prefill` (same contract, ``geometry``: the six values of
    :class:`~.geometry.MLAGeometry`; no input checks), by the kernels' algorithm: the same
    pieces of the packed history, the expansion in q's dtype, fp32 scores, and the same log-sum-exp merge
    across pieces, so CPU runs exercise the merge. Tokens on tombstoned or -1 pages inside ``kv_len`` read as
    zero rows; bytes past ``kv_len`` are never used. Lengths come from ``kv_len_host`` (``kv_len`` copied to
    the host when None). fp8 rows are dequantised (:func:`.fp8.dequantize_rows`) before the cast to q's dtype."""
    g = MLAGeometry(*geometry)
    B, H, T, dn, dv = _dims(q, w_kv_b, g.qk_rope_head_dim)
    R, ps = g.kv_lora_rank, g.page_size
    dev = q.device
    lengths, total, pieces = mla_prefill_plan(kv_len_host if kv_len_host is not None else kv_len.cpu(),
                                              page_table.shape[1] * ps, workspace_tokens)
    out = torch.zeros(B, T, H, dv, dtype=torch.float32, device=dev)
    lse = torch.full((B, T, H), float("-inf"), dtype=torch.float32, device=dev)
    starts = [sum(lengths[:b]) for b in range(B)]
    stored = arena_rows(arena, g)
    w = w_kv_b.reshape(H, dn + dv, R)
    t = torch.arange(T, device=dev)
    for p in range(pieces):
        p_lo, p_hi = p * workspace_tokens, min((p + 1) * workspace_tokens, total)
        for b in range(B):
            lo, hi = max(p_lo - starts[b], 0), min(p_hi - starts[b], lengths[b])
            if lo >= hi:
                continue
            i = torch.arange(lo, hi, device=dev)
            loc = page_table[b].long()[i // ps]
            loc = torch.where(loc >= 0, loc * ps + i % ps, -1)
            rows, live = latent_rows(v2p, loc, g.layer, g.layer_num, ps)
            values = fp8.dequantize_rows(stored[rows], g.row_format) if g.quantized else stored[rows]
            lat = torch.where(live[:, None], values.to(q.dtype), torch.zeros((), dtype=q.dtype, device=dev))
            kv = torch.einsum("nr,hcr->nhc", lat[:, :R], w)  # [n, H, dn + dv] in q's dtype, as F.linear rounds
            k_nope, v = kv[..., :dn].float(), kv[..., dn:].float()
            k_rot = lat[:, R:].float()
            qb = q[b].float()  # [H, T, dq]
            s = (torch.einsum("htd,nhd->thn", qb[..., :dn], k_nope)
                 + torch.einsum("htd,nd->thn", qb[..., dn:], k_rot)) * sm_scale
            q_pos = lengths[b] - T + t
            s = s.masked_fill(i[None, None, :] > q_pos[:, None, None], float("-inf"))
            piece_lse = torch.logsumexp(s, -1)  # [T, H]; -inf where no key is visible
            probs = torch.exp(s - torch.where(piece_lse.isfinite(), piece_lse, 0.0)[..., None])
            o = torch.einsum("thn,nhc->thc", probs, v)
            new_lse = torch.logaddexp(lse[b], piece_lse)
            safe = torch.where(new_lse.isfinite(), new_lse, 0.0)
            out[b] = (out[b] * torch.exp(lse[b] - safe)[..., None] + o * torch.exp(piece_lse - safe)[..., None])
            lse[b] = new_lse
    return out.to(q.dtype).transpose(1, 2)


# ---------------------------------------------------------------------------------------------- kernels
# Triton specialises int arguments that are 1 or multiples of 16. The piece bounds, the chunk length and the
# first / last piece flags vary from call to call (the flags are uniform per launch: their branches cost
# nothing at run time), and specialising them would compile up to four more variants per tile configuration.
@triton.jit(do_not_specialize=["piece_start", "piece_len"])
def _gather_piece_kernel(
    ws_ptr,  # [>= n, R + DR] workspace, q's dtype, contiguous
    kv_ptr,  # the arena as kv_dtype elements (a typed view from byte 0)
    v2p_ptr, pt_ptr, cu_ptr,  # cu: int32 [B + 1] packed start of each row, cu[B] = total
    piece_start, piece_len, B, num_pages, pt_stride_b, pt_stride_p, layer, layer_num, page_size,
    R: tl.constexpr, DR: tl.constexpr, R_P2: tl.constexpr, DR_P2: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # program i owns workspace rows [i*BLOCK, (i+1)*BLOCK) of the piece (packed positions piece_start + j),
    # whole latent rows as a [BLOCK, R_P2] and a [BLOCK, DR_P2] tile, and writes every one of them (zeros
    # for a position past the device total, a -1 or dead page): the attention never reads stale bytes
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_piece = j < piece_len
    x = (piece_start + j).to(tl.int32)
    # row of x: the largest b with cu[b] <= x (rows of zero length are skipped because a later row starts at
    # the same position); binary search over [0, B)
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.zeros([BLOCK], tl.int32) + B
    for _ in tl.static_range(SEARCH_STEPS):
        active = hi - lo > 1
        mid = (lo + hi) // 2
        c = tl.load(cu_ptr + mid, mask=active, other=0)
        right = c <= x
        lo = tl.where(active & right, mid, lo)
        hi = tl.where(active & ~right, mid, hi)
    start = tl.load(cu_ptr + lo)
    total = tl.load(cu_ptr + B)
    i = x - start  # stored index within the row
    live = in_piece & (x < total) & (i >= 0)
    i = tl.where(live, i, 0)
    col = i // page_size
    vpage = tl.load(pt_ptr + lo.to(tl.int64) * pt_stride_b + col * pt_stride_p, mask=live, other=-1).to(tl.int64)
    live = live & (vpage >= 0) & (vpage < num_pages)
    ppage = tl.load(v2p_ptr + vpage, mask=live, other=0)  # masked before indexing the table
    live = live & (ppage > 0)  # tombstones and the sink read as zeros
    row = (ppage * layer_num + layer) * page_size + (i - col * page_size)
    src = row * (R + DR)
    dst = j * (R + DR)
    out_ty = ws_ptr.dtype.element_ty
    cols = tl.arange(0, R_P2)
    a = tl.load(kv_ptr + src[:, None] + cols[None, :], mask=live[:, None] & (cols < R)[None, :], other=0.0)
    tl.store(ws_ptr + dst[:, None] + cols[None, :], a.to(out_ty), mask=in_piece[:, None] & (cols < R)[None, :])
    rcols = tl.arange(0, DR_P2)
    r = tl.load(kv_ptr + src[:, None] + R + rcols[None, :], mask=live[:, None] & (rcols < DR)[None, :], other=0.0)
    tl.store(ws_ptr + dst[:, None] + R + rcols[None, :], r.to(out_ty),
             mask=in_piece[:, None] & (rcols < DR)[None, :])


def _gather_piece_fp8(ws: torch.Tensor, arena: torch.Tensor, v2p: torch.Tensor, page_table: torch.Tensor,
                      cu: torch.Tensor, start: int, n: int, g: MLAGeometry) -> None:
    """:func:`_gather_piece_kernel` for fp8 rows, in plain torch: workspace rows ``[0, n)`` = the dequantised
    latent rows of packed positions ``[start, start + n)`` in q's dtype (zeros for a position past the
    total, a -1 or dead page), each position's row found as the kernel finds it (the largest ``b`` with
    ``cu[b] <= position``)."""
    B = page_table.shape[0]
    cu = cu.long()
    x = torch.arange(start, start + n, device=ws.device)
    b = (torch.searchsorted(cu, x, right=True) - 1).clamp(0, B - 1)
    i = x - cu[b]
    live = (x < cu[B]) & (i >= 0)
    i = torch.where(live, i, 0)
    vpage = page_table.long()[b, i // g.page_size]
    loc = torch.where(live & (vpage >= 0), vpage * g.page_size + i % g.page_size, -1)
    rows, ok = latent_rows(v2p, loc, g.layer, g.layer_num, g.page_size)
    values = fp8.dequantize_rows(arena_rows(arena, g)[rows], g.row_format)
    ws[:n] = torch.where(ok[:, None], values, torch.zeros((), dtype=values.dtype, device=ws.device))


@triton.jit
def _attend(acc, l_i, m_i, q_n, q_r, e_ptr, ws_ptr, k_start, k_end, ws_row0, q_pos, stride_e, e_col, qk_scale,
            R: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_DN: tl.constexpr,
            BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    # keys with stored indices [k_start, k_end) (workspace rows ws_row0 + index), in tiles of BLOCK_N. The
    # unmasked form runs only over whole tiles every query of the block may see; the masked one applies the
    # range end and the causal mask (and handles rows with no visible key yet: m_i = -inf)
    offs_n = tl.arange(0, BLOCK_N)
    cn = tl.arange(0, BLOCK_DN)
    cr = tl.arange(0, BLOCK_DR)
    cv = tl.arange(0, BLOCK_DV)
    D: tl.constexpr = R + DR
    for k0 in range(k_start, k_end, BLOCK_N):
        k = k0 + offs_n
        w = (ws_row0 + k).to(tl.int64)
        if MASKED:
            k_ok = k < k_end
        else:
            k_ok = offs_n < BLOCK_N
        e_row = e_ptr + w[:, None] * stride_e + e_col
        kn = tl.load(e_row + cn[None, :], mask=k_ok[:, None] & (cn < DN)[None, :], other=0.0)
        kr = tl.load(ws_ptr + w[:, None] * D + R + cr[None, :], mask=k_ok[:, None] & (cr < DR)[None, :],
                     other=0.0)
        v = tl.load(e_row + DN + cv[None, :], mask=k_ok[:, None] & (cv < DV)[None, :], other=0.0)
        s = tl.dot(q_n, tl.trans(kn), input_precision=DOT_PRECISION)
        s = tl.dot(q_r, tl.trans(kr), s, input_precision=DOT_PRECISION)
        s = s * qk_scale  # base-2 scores: qk_scale carries log2(e)
        if MASKED:
            s = tl.where(k_ok[None, :] & (k[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: keep zeros, not NaN
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _running_start(acc_ptr, lse_ptr, o_off, o_mask, lse_off, row_ok, first, ROWS: tl.constexpr,
                   BLOCK_DV: tl.constexpr):
    # (acc, l, m) an online softmax starts from: nothing (the first piece), else the pieces before: their
    # normalised output with weight 1 at the running maximum lse (FlashAttention's split-KV combine)
    if first != 0:
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
    else:
        m_i = tl.load(lse_ptr + lse_off, mask=row_ok, other=float("-inf")).to(tl.float32)
        seen = m_i > float("-inf")
        l_i = tl.where(seen, 1.0, 0.0)
        # the running output may be the 16-bit result buffer (one piece per launch); accumulate in fp32
        acc = tl.load(acc_ptr + o_off, mask=o_mask, other=0.0).to(tl.float32)
        acc = tl.where(seen[:, None], acc, 0.0)  # never-written rows of the buffer hold garbage
    return acc, l_i, m_i


@triton.jit
def _running_store(acc, l_i, m_i, out_ptr, acc_ptr, lse_ptr, o_off, o_mask, lse_off, row_ok, last):
    # the normalised output: in q's dtype after the last piece, else with its lse for the next one
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # a pad (or a row with no key yet): zeros
    o = acc / l_safe[:, None]
    if last != 0:
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(acc_ptr + o_off, o, mask=o_mask)
        tl.store(lse_ptr + lse_off, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=row_ok)


@triton.jit(do_not_specialize=["T", "piece_start", "piece_end", "first", "last", "num_splits"])
def _mla_prefill_attn_kernel(
    q_ptr, e_ptr, ws_ptr, cu_ptr, out_ptr, acc_ptr, lse_ptr,
    qk_scale, T, H, piece_start, piece_end, first, last, num_splits,
    stride_qb, stride_qh, stride_qt, stride_e,
    R: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # program (query block, head h, row b): queries [m*BLOCK_M, (m+1)*BLOCK_M) of row b, head h, against row
    # b's keys inside this piece. Query blocks run last-first: the late blocks see the most keys, and starting
    # them first keeps the tail of the grid short. The m blocks of one (row, head) are adjacent in the grid,
    # so they read the same K/V tiles while those are in L2.
    # SPLIT (split-K): axis 0 is (split s, query block) and the program takes only split s of those keys, the
    # s-th run of split_len (whole BLOCK_N tiles, so the tiles are the unsplit ones); it starts a fresh online
    # softmax and stores its normalised output and log-sum-exp into slice s of acc / lse (zeros and -inf for
    # a split without keys), which _merge_splits_kernel folds into the pieces before; the launcher passes
    # first = 1, last = 0.
    if SPLIT:
        num_m = tl.cdiv(T, BLOCK_M)
        s = tl.program_id(0) // num_m
        m = num_m - 1 - tl.program_id(0) % num_m
    else:
        m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    row_start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - row_start
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < T
    q_pos = n - T + offs_m  # stored index of each query; < 0: a left pad
    q_first = n - T + m * BLOCK_M
    q_end = n - T + tl.minimum(m * BLOCK_M + BLOCK_M, T)  # one past the block's last query
    # this piece's keys of row b that some query of the block may see, as stored indices [lo, hi)
    lo = tl.maximum(piece_start - row_start, 0)
    hi = tl.minimum(tl.minimum(piece_end - row_start, n), q_end)
    if SPLIT:
        split_len = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), num_splits), BLOCK_N) * BLOCK_N
        lo = lo + s * split_len
        hi = tl.minimum(hi, lo + split_len)  # an unused split: hi <= lo, both loops empty
    elif lo >= hi:
        if last == 0:
            return  # nothing to add: the running output of the pieces before stays as it is

    # whole tiles that every query of the block may see: stored index <= q_first
    full_end = lo + tl.maximum(tl.minimum(hi, q_first + 1) - lo, 0) // BLOCK_N * BLOCK_N

    cn = tl.arange(0, BLOCK_DN)
    cr = tl.arange(0, BLOCK_DR)
    cv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    q_row = q_ptr + b64 * stride_qb + h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qt
    q_n = tl.load(q_row + cn[None, :], mask=m_ok[:, None] & (cn < DN)[None, :], other=0.0)
    q_r = tl.load(q_row + DN + cr[None, :], mask=m_ok[:, None] & (cr < DR)[None, :], other=0.0)

    # out / acc: [B, T, H, DV]; lse: [B, H, T]
    o_off = ((b64 * T + offs_m) * H + h)[:, None] * DV + cv[None, :]
    o_mask = m_ok[:, None] & (cv < DV)[None, :]
    lse_off = (b64 * H + h) * T + offs_m
    if SPLIT:
        # slice s of the partial buffers [num_splits, B, T, H, DV] and [num_splits, B, H, T]
        rows = tl.num_programs(2).to(tl.int64) * T * H
        o_off += s * rows * DV
        lse_off += s * rows
    acc, l_i, m_i = _running_start(acc_ptr, lse_ptr, o_off, o_mask, lse_off, m_ok, first, BLOCK_M, BLOCK_DV)

    ws_row0 = row_start - piece_start  # workspace row of stored index 0 of this row
    e_col = h * (DN + DV)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q_n, q_r, e_ptr, ws_ptr, lo, full_end, ws_row0, q_pos, stride_e, e_col,
                            qk_scale, R, DN, DR, DV, BLOCK_DN, BLOCK_DR, BLOCK_DV, BLOCK_N, False, DOT_PRECISION)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q_n, q_r, e_ptr, ws_ptr, full_end, hi, ws_row0, q_pos, stride_e, e_col,
                            qk_scale, R, DN, DR, DV, BLOCK_DN, BLOCK_DR, BLOCK_DV, BLOCK_N, True, DOT_PRECISION)

    _running_store(acc, l_i, m_i, out_ptr, acc_ptr, lse_ptr, o_off, o_mask, lse_off, m_ok, last)


@triton.jit(do_not_specialize=["rows", "T", "H", "num_splits", "first", "last"])
def _merge_splits_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, acc_ptr, lse_ptr, rows, T, H, num_splits, first, last,
    DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # program i: output rows r in [i*BLOCK_R, (i+1)*BLOCK_R) of the rows = B*T*H (row r = (b*T + t)*H + h,
    # DV values each). Folds the piece's num_splits partial outputs (normalised, with their base-2
    # log-sum-exp) into the running output of the pieces before, the same combine the attention kernel starts
    # from (FlashAttention's split-KV combine), one split after another; then stores as that kernel's end does.
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    h = r % H
    t = (r // H) % T
    b = r // (H * T)
    cv = tl.arange(0, BLOCK_DV)
    o_off = r[:, None] * DV + cv[None, :]
    o_mask = r_ok[:, None] & (cv < DV)[None, :]
    lse_off = (b * H + h) * T + t
    acc, l_i, m_i = _running_start(acc_ptr, lse_ptr, o_off, o_mask, lse_off, r_ok, first, BLOCK_R, BLOCK_DV)
    # one split's slice at a time: the pointers step by a slice (rows x DV values), so no split index is
    # multiplied in 32 bits
    po = part_o_ptr + o_off
    pl = part_lse_ptr + lse_off
    for _ in range(num_splits):
        lse_s = tl.load(pl, mask=r_ok, other=float("-inf"))
        o_s = tl.load(po, mask=o_mask, other=0.0)
        po += rows * DV
        pl += rows
        m_new = tl.maximum(m_i, lse_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        beta = tl.exp2(lse_s - m_use)
        acc = acc * alpha[:, None] + o_s * beta[:, None]
        l_i = l_i * alpha + beta
        m_i = m_new
    _running_store(acc, l_i, m_i, out_ptr, acc_ptr, lse_ptr, o_off, o_mask, lse_off, r_ok, last)


# ---------------------------------------------------------------------------------------------- launcher
#: Output rows (of dv values) per merge program: 16 x 128 fp32 accumulators per program at dv 128.
_MERGE_ROWS = 16


def mla_prefill_tiles(device: torch.device, T: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Default attention tiles for q's ``dtype``: ``{"block_m", "block_n", "num_warps", "num_stages"}``.

    Chosen from sm_90 / sm_80 compiles at Kimi-Linear's head dims (dn 128, Dr 64, dv 128), checked with
    Triton 3.9's ahead-of-time compiler and cuobjdump (register use and spill stack):

    - sm_90, bf16/fp16: 128 x 64 tiles, 8 warps, 3 stages. Triton emits wgmma at BLOCK_M 128 with two
      warpgroups; bf16 takes 168 KiB of shared memory (q 48 KiB + 3 stages of 40 KiB K/V tiles) and 227
      registers per thread without spills (CI compiles it: tests/ops/test_mla_prefill.py). 4 warps at
      BLOCK_M 128 spill.
    - other GPUs, bf16/fp16: 64 x 64, 8 warps, 2 stages (mma.sync; 56 KiB, 170 registers on sm_80; 4 warps
      spill).
    - fp32 (IEEE products, a correctness path): 32 x 32, 4 warps, 2 stages; it spills at these head dims
      whatever the tiles (the least of the tiles tried).
    - the interpreter (CPU): 16 x 16.

    BLOCK_M shrinks to ``max(16, next_pow2(T))`` for short chunks.
    """
    if device.type != "cuda":
        return _tiles(None, T, dtype)
    major, minor = torch.cuda.get_device_capability(device)
    return _tiles(10 * major + minor, T, dtype)


def _tiles(arch: int | None, T: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    # arch: 10 * major + minor of the CUDA compute capability, None for the interpreter
    if arch is None:
        tiles = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
    elif dtype == torch.float32:
        tiles = {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 2}
    elif arch == 90:
        tiles = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}
    else:
        tiles = {"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 2}
    tiles["block_m"] = min(tiles["block_m"], max(16, triton.next_power_of_2(max(T, 1))))
    return tiles


def _check(op, q, arena, v2p, page_table, kv_len, kv_len_host, w_kv_b, sm_scale, workspace_tokens,
           g: MLAGeometry) -> None:
    check_tensor(op, "q", q, dtype=COMPUTE_DTYPES, dim=4)
    B, H, T, dq = q.shape
    kv_lora_rank, qk_rope_head_dim = g.kv_lora_rank, g.qk_rope_head_dim
    if dq <= qk_rope_head_dim:
        raise GeometryError(f"{op}: q's last dimension {dq} must be qk_nope_head_dim + qk_rope_head_dim with "
                            f"qk_nope_head_dim >= 1; qk_rope_head_dim is {qk_rope_head_dim}")
    check_tensor(op, "w_kv_b", w_kv_b, dtype=q.dtype, dim=2)
    check_tensor(op, "w_kv_b", w_kv_b, shape=(None, kv_lora_rank))
    dn = dq - qk_rope_head_dim
    if H == 0 or w_kv_b.shape[0] % H or w_kv_b.shape[0] // H <= dn:
        raise GeometryError(f"{op}: w_kv_b has {w_kv_b.shape[0]} rows, not heads {H} x (qk_nope_head_dim {dn} + "
                            "v_head_dim) with v_head_dim >= 1")
    check_tensor(op, "page_table", page_table, dtype=torch.int32, dim=2)
    check_tensor(op, "page_table", page_table, shape=(B, None))
    check_tensor(op, "kv_len", kv_len, dtype=torch.int32, shape=(B,))
    if kv_len_host is not None:
        check_tensor(op, "kv_len_host", kv_len_host, dtype=torch.int32, shape=(B,))
        if kv_len_host.device.type != "cpu":
            raise ValueError(f"{op}: kv_len_host must be a CPU tensor (the host copy of kv_len), got "
                             f"{kv_len_host.device}")
    if isinstance(workspace_tokens, bool) or not isinstance(workspace_tokens, int) or workspace_tokens < 1:
        raise ValueError(f"{op}: workspace_tokens must be an int >= 1, got {workspace_tokens!r}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"{op}: sm_scale must be finite, got {sm_scale}")
    check_mla_geometry(op, arena, v2p, g)
    check_same_device(op, q=q, arena=arena, v2p=v2p, page_table=page_table, kv_len=kv_len, w_kv_b=w_kv_b)
    if env.debug():
        check_live_page_table(op, v2p, page_table, kv_len, g.page_size)
        if kv_len_host is not None:
            device_lens = kv_len.cpu()
            bad = torch.nonzero(device_lens != kv_len_host).reshape(-1)[:8].tolist()
            if bad:
                detail = ", ".join(f"row {b}: kv_len {int(device_lens[b])}, kv_len_host {int(kv_len_host[b])}"
                                   for b in bad)
                raise GeometryError(f"{op}: kv_len_host disagrees with kv_len: {detail}")


def mla_prefill_triton(
    q: torch.Tensor, arena: torch.Tensor, v2p: torch.Tensor, page_table: torch.Tensor, kv_len: torch.Tensor,
    kv_len_host: torch.Tensor | None, w_kv_b: torch.Tensor, sm_scale: float, workspace_tokens: int, *geometry,
    block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, gather_block: int = 16, num_splits: int | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`mla_prefill`: per piece one gather launch, one matmul, one attention launch.

    Args: as :func:`mla_prefill` (``geometry``: its six geometry values, :class:`~.geometry.MLAGeometry`),
    plus keyword-only tuning knobs (defaults: :func:`mla_prefill_tiles`):
        block_m: queries per program (a power of two >= 16).
        block_n: keys per tile (a power of two >= 16).
        num_warps, num_stages: Triton launch options of the attention kernel.
        gather_block: workspace rows per gather program (a power of two).
        num_splits: split-K of every piece's keys over this many programs per (query block, head, row),
            merged exactly by log-sum-exp (``1``: the unsplit kernel). None: :func:`mla_prefill_num_splits`
            per piece when :data:`SPLIT_K_AUTO` is set (the device's SM count; :data:`INTERPRETER_SMS` in the
            interpreter), else 1.

    Returns / Raises: as :func:`mla_prefill`; also ValueError for a knob out of its range (with the value),
    or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    op = "mla_prefill"
    g = MLAGeometry(*geometry)
    _check(op, q, arena, v2p, page_table, kv_len, kv_len_host, w_kv_b, sm_scale, workspace_tokens, g)
    check_kernel_device(op, q.device)
    layer, layer_num, page_size = g.layer, g.layer_num, g.page_size
    B, H, T, dn, dv = _dims(q, w_kv_b, g.qk_rope_head_dim)
    tiles = mla_prefill_tiles(q.device, T, q.dtype)
    block_m = tiles["block_m"] if block_m is None else block_m
    block_n = tiles["block_n"] if block_n is None else block_n
    num_warps = tiles["num_warps"] if num_warps is None else num_warps
    num_stages = tiles["num_stages"] if num_stages is None else num_stages
    for name, value, low in (("block_m", block_m, 16), ("block_n", block_n, 16), ("num_warps", num_warps, 1),
                             ("gather_block", gather_block, 1)):
        check_knob(op, name, value, low=low, power_of_two=True)
    check_knob(op, "num_stages", num_stages)
    if num_splits is not None:
        check_knob(op, "num_splits", num_splits)

    R, Dr = g.kv_lora_rank, g.qk_rope_head_dim
    P = page_table.shape[1]
    out = torch.empty((B, T, H, dv), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out.transpose(1, 2)
    lengths, total, pieces = mla_prefill_plan(kv_len_host if kv_len_host is not None else kv_len.cpu(),
                                              P * page_size, workspace_tokens)
    if pieces == 0:  # no row holds a token: every query is a pad
        return out.zero_().transpose(1, 2)
    if q.stride(-1) != 1:
        q = q.contiguous()
    lens = kv_len.clamp(0, P * page_size)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(lens, 0, dtype=torch.int32, out=cu[1:])
    n_ws = min(workspace_tokens, total)
    ws = torch.empty((n_ws, R + Dr), dtype=q.dtype, device=q.device)
    e = torch.empty((n_ws, H * (dn + dv)), dtype=q.dtype, device=q.device)
    if pieces > 1:
        acc = torch.empty((B, T, H, dv), dtype=torch.float32, device=q.device)
        lse = torch.full((B, H, T), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        acc = lse = out  # never read or written with one piece (first and last)
    kv = None if g.quantized else typed_rows(arena, g.kv_dtype, R + Dr)
    w_t = w_kv_b.t()
    r_p2, dr_p2 = triton.next_power_of_2(R), triton.next_power_of_2(Dr)
    steps = max(1, (B - 1).bit_length())
    grid = (triton.cdiv(T, block_m), H, B)
    if num_splits is not None:
        splits = [num_splits] * pieces
    elif SPLIT_K_AUTO:
        sms = _device_sms(q.device)
        splits = [mla_prefill_num_splits(grid[0] * H * B, triton.cdiv(keys, block_n), sms)
                  for keys in _row_keys_in_pieces(lengths, pieces, workspace_tokens)]
    else:
        splits = [1] * pieces
    s_max = max(splits)
    if s_max > 1:  # partial outputs of one piece's splits: [S, B, T, H, dv] and their lse [S, B, H, T], fp32
        part_o = torch.empty((s_max, B, T, H, dv), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((s_max, B, H, T), dtype=torch.float32, device=q.device)
    attn_consts = dict(R=R, DN=dn, DR=Dr, DV=dv, BLOCK_DN=max(16, triton.next_power_of_2(dn)),
                       BLOCK_DR=max(16, triton.next_power_of_2(Dr)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
                       BLOCK_M=block_m, BLOCK_N=block_n,
                       DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                       num_warps=num_warps, num_stages=num_stages)
    for p in range(pieces):
        start = p * workspace_tokens
        n = min(workspace_tokens, total - start)
        if g.quantized:
            _gather_piece_fp8(ws, arena, v2p, page_table, cu, start, n, g)
        else:
            _gather_piece_kernel[(triton.cdiv(n, gather_block),)](
                ws, kv, v2p, page_table, cu, start, n, B, v2p.numel(), page_table.stride(0), page_table.stride(1),
                layer, layer_num, page_size, R=R, DR=Dr, R_P2=r_p2, DR_P2=dr_p2, SEARCH_STEPS=steps,
                BLOCK=gather_block, num_warps=4,
            )
        torch.mm(ws[:n, :R], w_t, out=e[:n])
        first, last, S = int(p == 0), int(p == pieces - 1), splits[p]
        if S == 1:
            _mla_prefill_attn_kernel[grid](
                q, e, ws, cu, out, acc, lse, sm_scale * _LOG2E, T, H, start, start + n, first, last, 1,
                q.stride(0), q.stride(1), q.stride(2), e.stride(0), SPLIT=False, **attn_consts,
            )
            continue
        # split-K: S programs per (query block, head, row) write partials, one merge folds them in
        _mla_prefill_attn_kernel[(grid[0] * S, H, B)](
            q, e, ws, cu, out, part_o, part_lse, sm_scale * _LOG2E, T, H, start, start + n, 1, 0, S,
            q.stride(0), q.stride(1), q.stride(2), e.stride(0), SPLIT=True, **attn_consts,
        )
        rows = B * T * H
        _merge_splits_kernel[(triton.cdiv(rows, _MERGE_ROWS),)](
            part_o, part_lse, out, acc, lse, rows, T, H, S, first, last,
            DV=dv, BLOCK_R=_MERGE_ROWS, BLOCK_DV=max(16, triton.next_power_of_2(dv)), num_warps=4,
        )
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------- declaration
@torch.library.custom_op("unimem::mla_prefill", mutates_args=(), tags=HOST_PLANNED)
def mla_prefill(
    q: torch.Tensor, arena: torch.Tensor, v2p: torch.Tensor, page_table: torch.Tensor, kv_len: torch.Tensor,
    kv_len_host: torch.Tensor | None, w_kv_b: torch.Tensor, sm_scale: float, workspace_tokens: int, layer: int,
    layer_num: int, page_size: int, kv_lora_rank: int, qk_rope_head_dim: int, kv_dtype: torch.dtype,
) -> torch.Tensor:
    """Causal MLA attention of a chunk of ``T`` new tokens per row over the row's paged latent history.

    A drop-in for the attention node of transformers' MLA prefill (``scaled_dot_product_attention(q, k, v,
    mask, scale)`` after ``expand_kv``): same query, same result layout; keys and values come from the pages.

    Args:
        q: ``[B, H, T, dn + Dr]`` bf16/fp16/fp32, the query as transformers hands it to attention (any
            strides; a last-dimension stride other than 1 is copied). Head dims: ``dn`` = qk_nope_head_dim,
            ``Dr`` = qk_rope_head_dim (the rotary part, already rotated where the model uses RoPE).
        arena: uint8 ``[memory_budget]``, read only.
        v2p: int64 ``[num_pages]``, virtual -> physical page (-1 = tombstone).
        page_table: int32 ``[B, P]`` virtual pages of each row (-1 = none).
        kv_len: int32 ``[B]`` tokens stored per row, THIS chunk included (the cache wrote the chunk's
            latent rows before attention runs); at most ``P * page_size``. Query ``t`` of row ``b`` has
            stored index ``kv_len[b] - T + t``: a negative index is a left pad.
        kv_len_host: None or a CPU int32 ``[B]`` copy of ``kv_len`` (it sizes the piece loop without a device
            sync). None: the copy the running forward published for ``kv_len`` (``ops/step_context.py``: a
            generate() or engine step publishes its cache's lengths), else ``kv_len`` is read back (one sync).
        w_kv_b: ``[H * (dn + dv), R]`` in q's dtype, ``kv_b_proj.weight`` (pass the parameter or a view of it:
            it is read, never copied or cached).
        sm_scale: softmax scale of ``q . k`` (transformers: ``(dn + Dr) ** -0.5``, times DeepSeek's mscale^2).
        workspace_tokens: packed history tokens per piece (>= 1; :data:`WORKSPACE_TOKENS` is the default
            callers use): bounds the op's memory, see the module docstring.
        layer, layer_num, page_size, kv_lora_rank, qk_rope_head_dim, kv_dtype: the MLA geometry (kv_dtype
            bf16, fp16, fp32, or e4m3fn / e4m3fnuz: scaled fp8 rows, read as their dequantised bf16 values).

    Returns:
        ``[B, H, T, dv]`` in q's dtype, a fresh tensor laid out as a contiguous ``[B, T, H, dv]`` (strides
        ``(T*H*dv, dv, H*dv, 1)``, what flash-attention SDPA returns: ``.transpose(1, 2)`` is contiguous).
        Query ``t`` of row ``b``: ``softmax(sm_scale * q . k_j) @ v_j`` over the row's stored tokens ``j <=``
        its stored index; zeros for a left pad. Tokens at or past ``kv_len`` are never read; a tombstoned
        or -1 page inside ``kv_len`` is a caller bug: its tokens read as zero rows (``UNIMEM_DEBUG=1``
        raises instead).

    Raises:
        TypeError: a dtype (q, w_kv_b in q's dtype, int32 tables, kv_dtype). GeometryError (a ValueError):
        ranks, sizes, head dims that do not fit ``w_kv_b``, geometry that does not fit the arena; under
        ``UNIMEM_DEBUG=1`` a kv_len outside the table, a page inside kv_len that is not live, or a
        ``kv_len_host`` that disagrees with ``kv_len``. ValueError: devices (``kv_len_host`` must be on the
        CPU), a workspace < 1, a non-finite scale.
    """
    g = MLAGeometry(layer, layer_num, page_size, kv_lora_rank, qk_rope_head_dim, kv_dtype)
    kv_len_host = _published(kv_len, kv_len_host)
    _check("mla_prefill", q, arena, v2p, page_table, kv_len, kv_len_host, w_kv_b, sm_scale, workspace_tokens, g)
    return mla_prefill_reference(q, arena, v2p, page_table, kv_len, kv_len_host, w_kv_b, sm_scale,
                                 workspace_tokens, *g.args())


@mla_prefill.register_kernel("cuda")
def _(q, arena, v2p, page_table, kv_len, kv_len_host, w_kv_b, sm_scale, workspace_tokens, *geometry):
    return mla_prefill_triton(q, arena, v2p, page_table, kv_len, _published(kv_len, kv_len_host), w_kv_b, sm_scale,
                              workspace_tokens, *geometry)


def _published(kv_len: torch.Tensor, kv_len_host: torch.Tensor | None) -> torch.Tensor | None:
    """``kv_len_host`` as given, else the host copy of ``kv_len`` the running forward published
    (ops/step_context.py), else None (the launcher reads ``kv_len`` back: a device sync)."""
    return kv_len_host if kv_len_host is not None else host_copy(kv_len)


@mla_prefill.register_fake
def _(q, arena, v2p, page_table, kv_len, kv_len_host, w_kv_b, sm_scale, workspace_tokens, *geometry):
    check_same_device("mla_prefill", q=q, arena=arena, v2p=v2p, page_table=page_table, kv_len=kv_len, w_kv_b=w_kv_b)
    if kv_len_host is not None and kv_len_host.device.type != "cpu":  # e.g. a meta tensor among real ones
        raise ValueError(f"mla_prefill: kv_len_host must be a CPU tensor (the host copy of kv_len), got "
                         f"{kv_len_host.device}")
    B, H, T, dn, dv = _dims(q, w_kv_b, MLAGeometry(*geometry).qk_rope_head_dim)
    return q.new_empty((B, T, H, dv)).transpose(1, 2)
