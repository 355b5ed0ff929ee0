"""Op ``unimem::mla_decode``: paged MLA decode attention over latent pages (split-K flash decoding).

One query token per row attends over that row's first ``kv_len[b]`` cached latent rows, read straight
from the arena through ``page_table -> v2p`` (docs/design.md section 3: token ``i`` of row ``b`` lies on
virtual page ``page_table[b, i // ps]`` at offset ``i % ps``; its row in layer ``l`` is
``v2p[vpage] * ps * L + l * ps + i % ps``, ``D = R + Dr`` elements of ``kv_dtype`` wide). Queries are
absorbed (``q_nope`` already multiplied by W_UK), so keys are whole rows and values are their first ``R``
columns; the result stays in the latent space (the caller applies W_UV).

Algorithm: flash decoding (Dao et al., "Flash-Decoding for long-context inference", 2023) on the paged
layout, as FlashMLA and the Triton MLA decode kernels of serving engines do it. Stage 1: program
``(head group, row, split)`` walks its split's tokens in tiles of ``BLOCK_N``, all of the group's heads
sharing each loaded tile (``tl.dot [H, D] x [D, BLOCK_N]``), with an fp32 online softmax; it writes a
normalised partial output and its log-sum-exp. Stage 2 merges the splits of each (row, head). The split
count is a function of static sizes only (batch, page-table width, heads and the device's SM count), so
a growing context never recompiles and the launch can be captured in a CUDA graph; the split LENGTH is
computed inside the kernel from ``kv_len``.

Scaled fp8 rows (an fp8 ``kv_dtype``, :class:`~unimem_compile.pool.specs.MLARowFormat`) have a split kernel
of their own (:func:`_mla_decode_split_fp8_kernel`: the same grid, tiles, tile loop, online softmax and
merge, through the helpers both split kernels call): it reads the codes, the fp32 scale of each 128-value
tile and the bf16 rope, converts the codes exactly and applies the scales after the products they factor
out of, never rounding a dequantised value. On an sm_90 GPU at Kimi-Linear's / DeepSeek's geometry fp8 rows
take the Hopper fp8 kernel instead (:func:`~.mla_decode_hopper.mla_decode_stage1_wgmma_fp8`, about 2x the
portable one); both are slower than bf16 rows today (fp8 KV buys 1.76x the tokens, not speed).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.compiler.errors
import triton.language as tl

from unimem_compile import env
from unimem_compile.errors import GeometryError

from . import fp8
from .common import (COMPUTE_DTYPES, check_knob, check_live_page_table, check_mla_geometry, check_same_device,
                     check_tensor, device_sms)
from unimem_compile.pool.specs import FP8_TILE

from .geometry import MLAGeometry
from .mla_decode_hopper import (FP8_F16_VALUES, WGMMA_BLOCK_N, WGMMA_EARLY_REFILL, WGMMA_STAGES, disable_wgmma, mla_decode_stage1_wgmma, mla_decode_stage1_wgmma_fp8, wgmma_supported)

# The op object ``mla_decode`` is reached as ``torch.ops.unimem.mla_decode`` (or through this module):
# exporting it from the package would shadow the module ``unimem_compile.ops.mla_decode``.
__all__ = ["mla_decode_reference", "mla_decode_triton", "mla_decode_num_splits", "fp8_hw_conversion",
           "portable_smem_bytes", "portable_tiles", "device_smem_limit"]

#: Resident stage-1 blocks per SM that the default split count fills (one wave): measured on an H200
#: with BLOCK_N 64, 4 warps, 2 stages (benchmarks/results/mla_decode_2026-11-29.json).
BLOCKS_PER_SM = 2
#: Heads per program: 32 x R fp32 accumulators are what 4 warps hold in registers.
MAX_BLOCK_H = 32
#: Stand-in SM count when the kernels run in the interpreter (CPU tensors).
INTERPRETER_SMS = 4
#: Most fp32 scales per fp8 row the fp8 split kernel holds accumulators for (R <= 512); wider latents run
#: :func:`mla_decode_reference` on the device.
FP8_MAX_SCALE_TILES = 4
#: Stage-1 forms: "wgmma" (Hopper, TMA + wgmma, :mod:`.mla_decode_hopper`) where it applies, else "portable".
KERNELS = ("auto", "portable", "wgmma")
#: Whether ``kernel="auto"`` takes the Hopper kernel for fp8 rows too (:func:`~.mla_decode_hopper.
#: mla_decode_stage1_wgmma_fp8`) where it applies: True since the thirteenth session's H200 run, where it
#: passed the GPU tests (tests/gpu/test_mla_decode_fp8_gpu.py) and measured 0.65-0.76x the bf16 kernel, about
#: 2x the portable fp8 kernel's 0.32-0.46x (benchmarks/results/mla_decode_2026-12-02_fp8_wgmma_ab.json,
#: mla_decode_2026-12-01_fp8.json). False sends fp8 rows to the portable fp8 kernel unless ``kernel="wgmma"``.
FP8_AUTO_WGMMA = True

_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------- reference
def mla_decode_reference(
    q_nope: torch.Tensor, q_rope: torch.Tensor, arena: torch.Tensor, v2p: torch.Tensor, page_table: torch.Tensor,
    kv_len: torch.Tensor, sm_scale: float, *geometry,
) -> torch.Tensor:
    """Plain-torch paged MLA decode: gather every row's tokens through the tables, fp32 softmax.

    Same contract as :func:`mla_decode` (``geometry``: the six values of :class:`~.geometry.MLAGeometry`;
    no input checks). Tokens on tombstoned pages (or page-table entries < 0 / past ``v2p``) inside
    ``kv_len`` read as zero rows; tokens at or past ``kv_len`` are never used (their bytes may be NaN).
    fp8 rows are dequantised first (:func:`.fp8.dequantize_rows`: the bf16 values ``mla_gather`` returns).
    Memory: ``B * P * page_size * D`` fp32 values.
    """
    g = MLAGeometry(*geometry)
    layer, layer_num, kv_dtype = g.layer, g.layer_num, g.kv_dtype
    B, H, R = q_nope.shape
    D = g.row_width
    ps, P = g.page_size, page_table.shape[1]
    dev = q_nope.device
    t = torch.arange(P * ps, device=dev)
    length = kv_len.to(torch.int64).clamp(0, P * ps)
    live = t[None, :] < length[:, None]  # [B, n]
    vpage = page_table.to(torch.int64)[:, t // ps]
    ok = live & (vpage >= 0) & (vpage < v2p.numel())
    ppage = v2p[vpage.clamp(0, v2p.numel() - 1)]
    ok = ok & (ppage >= 0)
    rows = torch.where(ok, ppage * (ps * layer_num) + layer * ps + t % ps, 0)
    row_bytes = g.row_bytes
    if g.quantized:
        values = fp8.dequantize_rows(arena[: arena.numel() // row_bytes * row_bytes].view(-1, row_bytes)[rows],
                                     g.row_format)
    else:
        values = arena[: arena.numel() // row_bytes * row_bytes].view(kv_dtype).view(-1, D)[rows]
    kv = torch.where(ok[..., None], values.float(), 0.0)  # [B, n, D]; where() drops NaN bytes
    q = torch.cat([q_nope, q_rope], dim=-1).float()
    scores = torch.einsum("bhd,bnd->bhn", q, kv) * sm_scale
    scores = scores.masked_fill(~live[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with kv_len 0 has no finite score
    out = torch.einsum("bhn,bnr->bhr", probs, kv[..., :R])
    return torch.where(length[:, None, None] > 0, out, 0.0).to(q_nope.dtype).contiguous()


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _split_bounds(kv_len_ptr, b, s, num_splits, max_tokens, BLOCK_N: tl.constexpr):
    # every split of a row gets the same number of whole tiles; the last used one may be shorter
    n = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), max_tokens)
    split_len = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    start = s * split_len
    return n, split_len, start, tl.maximum(tl.minimum(start + split_len, n), start)  # unused split: end = start


@triton.jit
def _tile_rows(pt_row_ptr, v2p_ptr, t0, end, num_pages, layer_rows, PS: tl.constexpr, L: tl.constexpr,
               BLOCK_N: tl.constexpr, PAGE_TILE: tl.constexpr):
    # Arena rows of tokens [t0, t0 + BLOCK_N). With PAGE_TILE (ps a multiple of BLOCK_N) the tile lies in
    # one page: one scalar lookup, and the caller adds arange(BLOCK_N). Otherwise one lookup per token.
    # A tombstone (v2p = -1) or an out-of-range entry becomes physical page 0, the all-zero sink, so the
    # token reads zeros without a mask; tokens >= end are masked by the caller and never read.
    if PAGE_TILE:
        t = t0
        in_range = t0 < end
    else:
        t = t0 + tl.arange(0, BLOCK_N)
        in_range = t < end
    vpage = tl.load(pt_row_ptr + t // PS, mask=in_range, other=-1).to(tl.int64)
    ok = in_range & (vpage >= 0) & (vpage < num_pages)
    ppage = tl.load(v2p_ptr + tl.where(ok, vpage, 0), mask=ok, other=0)
    ppage = tl.maximum(ppage, 0)
    return ppage * (PS * L) + layer_rows + t % PS


@triton.jit
def _tile_step(rows, offs_n, pt_row_ptr, v2p_ptr, t0, end, num_pages, layer_rows, PS: tl.constexpr,
               L: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_TILE: tl.constexpr, STRIDE: tl.constexpr):
    # One iteration of a split kernel's tile loop: from `rows` (_tile_rows of tokens [t0, t0 + BLOCK_N)), each
    # of the tile's tokens' arena row times STRIDE (its first element when a row is STRIDE elements; STRIDE 1:
    # the row index) and their mask (< end), and the next tile's lookup, issued one iteration ahead so its
    # two dependent table loads overlap the current tile's KV load instead of stalling in front of it.
    # offs_n (arange(BLOCK_N)) comes from the kernel's prologue: made here, it changes the sm_90 schedule.
    rows_next = _tile_rows(pt_row_ptr, v2p_ptr, t0 + BLOCK_N, end, num_pages, layer_rows, PS, L, BLOCK_N, PAGE_TILE)
    t_ok = (t0 + offs_n) < end
    if PAGE_TILE:
        # one page: a contiguous run of BLOCK_N rows. Scaled as two terms: (rows + offs_n) * STRIDE compiles
        # the bf16 kernel (STRIDE 576) with 248 bytes of stack instead of 160 (sm_90, BLOCK_N 64, Triton 3.9)
        off = rows * STRIDE + offs_n * STRIDE
    else:
        off = rows * STRIDE
    return off, t_ok, rows_next


@triton.jit
def _rope_query(q_rope_ptr, b, offs_h, h_ok, stride_qr_b, stride_qr_h, DR: tl.constexpr, BLOCK_DR: tl.constexpr):
    # row b's rope queries [BLOCK_H, BLOCK_DR] for heads offs_h (padded heads and columns load zeros: finite
    # scores, outputs never stored), with the rope columns and their mask, which the key loads use too
    cr = tl.arange(0, BLOCK_DR)
    cr_ok = cr < DR
    qr = tl.load(q_rope_ptr + b.to(tl.int64) * stride_qr_b + offs_h[:, None] * stride_qr_h + cr[None, :],
                 mask=h_ok[:, None] & cr_ok[None, :], other=0.0)
    return qr, cr, cr_ok


@triton.jit
def _softmax_step(qk, t_ok, qk_scale, m_i, l_i):
    # one tile of the online softmax over raw scores qk [BLOCK_H, BLOCK_N] (tokens not t_ok excluded), in base
    # 2 (qk_scale carries log2(e)): the tile's unnormalised probabilities, the factor that rescales what was
    # accumulated before, and the new running max and sum
    qk = tl.where(t_ok[None, :], qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _mla_decode_split_kernel(
    q_nope_ptr, q_rope_ptr, kv_ptr, v2p_ptr, page_table_ptr, kv_len_ptr, part_o_ptr, part_lse_ptr, out_ptr,
    qk_scale, num_pages, max_tokens, layer_rows, H, num_splits,
    stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h, stride_pt_b,
    R: tl.constexpr, DR: tl.constexpr, PS: tl.constexpr, L: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, R_HALF: tl.constexpr, BLOCK_DR: tl.constexpr,
    SPLIT: tl.constexpr, PAGE_TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # program (head group g, row b, split s): tokens [start, end) of row b for heads g*BLOCK_H + [0, BLOCK_H).
    # The latent columns go as two halves (queries, tile loads, accumulators), so the first half's score
    # product can start while the second half is still arriving: whole [BLOCK_N, R] tiles measured
    # 3.2 TB/s against 3.3-3.5 at batch 256, context 4k on an H200 (separate runs:
    # benchmarks/results/mla_decode_2026-11-29.json).
    g = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.program_id(2)
    D: tl.constexpr = R + DR
    n, split_len, start, end = _split_bounds(kv_len_ptr, b, s, num_splits, max_tokens, BLOCK_N)

    offs_h = g * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    c0 = tl.arange(0, R_HALF)
    c1 = R_HALF + c0
    h_ok = offs_h < H
    c0_ok = c0 < R
    c1_ok = c1 < R
    kv_ty = kv_ptr.dtype.element_ty
    # padded heads load zero queries: finite scores, outputs never stored
    qn_row = q_nope_ptr + b.to(tl.int64) * stride_qn_b + offs_h[:, None] * stride_qn_h
    q0 = tl.load(qn_row + c0[None, :], mask=h_ok[:, None] & c0_ok[None, :], other=0.0).to(kv_ty)
    q1 = tl.load(qn_row + c1[None, :], mask=h_ok[:, None] & c1_ok[None, :], other=0.0).to(kv_ty)
    qr, cr, cr_ok = _rope_query(q_rope_ptr, b, offs_h, h_ok, stride_qr_b, stride_qr_h, DR, BLOCK_DR)
    qr = qr.to(kv_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, R_HALF], tl.float32)
    acc1 = tl.zeros([BLOCK_H, R_HALF], tl.float32)
    pt_row_ptr = page_table_ptr + b.to(tl.int64) * stride_pt_b
    rows_next = _tile_rows(pt_row_ptr, v2p_ptr, start, end, num_pages, layer_rows, PS, L, BLOCK_N, PAGE_TILE)
    for t0 in range(start, end, BLOCK_N):
        row_off, t_ok, rows_next = _tile_step(rows_next, offs_n, pt_row_ptr, v2p_ptr, t0, end, num_pages, layer_rows,
                                              PS, L, BLOCK_N, PAGE_TILE, D)
        base = kv_ptr + row_off[:, None]
        k0 = tl.load(base + c0[None, :], mask=t_ok[:, None] & c0_ok[None, :], other=0.0)
        k1 = tl.load(base + c1[None, :], mask=t_ok[:, None] & c1_ok[None, :], other=0.0)
        kr = tl.load(base + R + cr[None, :], mask=t_ok[:, None] & cr_ok[None, :], other=0.0)
        qk = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)
        qk = tl.dot(q1, tl.trans(k1), qk, input_precision=DOT_PRECISION)
        qk = tl.dot(qr, tl.trans(kr), qk, input_precision=DOT_PRECISION)
        p, alpha, m_i, l_i = _softmax_step(qk, t_ok, qk_scale, m_i, l_i)
        pk = p.to(kv_ty)
        acc0 = tl.dot(pk, k0, acc0 * alpha[:, None], input_precision=DOT_PRECISION)
        acc1 = tl.dot(pk, k1, acc1 * alpha[:, None], input_precision=DOT_PRECISION)

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # kv_len 0: no tile ran, the output is zeros
    o0 = acc0 / l_safe[:, None]
    o1 = acc1 / l_safe[:, None]
    ok0 = h_ok[:, None] & c0_ok[None, :]
    ok1 = h_ok[:, None] & c1_ok[None, :]
    if SPLIT:
        # an unused split (start >= end) stores nothing: the merge reads only the splits holding tokens
        if start < end:
            slot = (b.to(tl.int64) * num_splits + s) * H + offs_h
            dst = part_o_ptr + slot[:, None] * R
            tl.store(dst + c0[None, :], o0.to(part_o_ptr.dtype.element_ty), mask=ok0)
            tl.store(dst + c1[None, :], o1.to(part_o_ptr.dtype.element_ty), mask=ok1)
            tl.store(part_lse_ptr + slot, m_i + tl.log2(l_safe), mask=h_ok)
    else:
        dst = out_ptr + (b.to(tl.int64) * H + offs_h[:, None]) * R
        tl.store(dst + c0[None, :], o0.to(out_ptr.dtype.element_ty), mask=ok0)
        tl.store(dst + c1[None, :], o1.to(out_ptr.dtype.element_ty), mask=ok1)


# fp8 rows: the scaled row of MLARowFormat (codes, fp32 scales per 128 values, bf16 rope), read in registers
@triton.jit
def _fp8_codes(code_ptr, row, t_ok, J: tl.constexpr, R: tl.constexpr, ROW_BYTES: tl.constexpr,
               SCALE_TILE: tl.constexpr, TILE_C: tl.constexpr, HW_FP8: tl.constexpr, FNUZ: tl.constexpr,
               DOT_TY: tl.constexpr):
    # latent columns [J * SCALE_TILE, + TILE_C) of a tile's rows as DOT_TY values of their e4m3 codes, without
    # the scale: exact, every e4m3 value is a bf16 and an fp32 value. Masked lanes load code 0 (0.0).
    c = J * SCALE_TILE + tl.arange(0, TILE_C)
    codes = tl.load(code_ptr + tl.multiple_of(row * ROW_BYTES, 16)[:, None] + c[None, :],
                    mask=t_ok[:, None] & (c < R)[None, :], other=0)
    if HW_FP8:
        return codes.to(tl.float8e4nv, bitcast=True).to(DOT_TY)  # one cvt per pair of codes
    return fp8.fp8_decode(codes, FNUZ).to(DOT_TY)


@triton.jit
def _fp8_scale(scale_ptr, row, t_ok, J: tl.constexpr, ROW_BYTES: tl.constexpr, SCALE_OFFSET: tl.constexpr):
    # the fp32 scale of columns [J * 128, + 128) of each token of the tile (0 for masked tokens)
    return tl.load(scale_ptr + row * (ROW_BYTES // 4) + (SCALE_OFFSET // 4 + J), mask=t_ok, other=0.0)


@triton.jit
def _fp8_query(qn_row, h_ok, J: tl.constexpr, R: tl.constexpr, SCALE_TILE: tl.constexpr, TILE_C: tl.constexpr,
               DOT_TY: tl.constexpr):
    c = J * SCALE_TILE + tl.arange(0, TILE_C)
    return tl.load(qn_row + c[None, :], mask=h_ok[:, None] & (c < R)[None, :], other=0.0).to(DOT_TY)


@triton.jit
def _fp8_store(dst_row, o, h_ok, J: tl.constexpr, R: tl.constexpr, SCALE_TILE: tl.constexpr,
               TILE_C: tl.constexpr):
    c = J * SCALE_TILE + tl.arange(0, TILE_C)
    tl.store(dst_row + c[None, :], o.to(dst_row.dtype.element_ty), mask=h_ok[:, None] & (c < R)[None, :])


@triton.jit
def _mla_decode_split_fp8_kernel(
    q_nope_ptr, q_rope_ptr, code_ptr, scale_ptr, rope_ptr, v2p_ptr, page_table_ptr, kv_len_ptr, part_o_ptr,
    part_lse_ptr, out_ptr,
    qk_scale, num_pages, max_tokens, layer_rows, H, num_splits,
    stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h, stride_pt_b,
    R: tl.constexpr, DR: tl.constexpr, PS: tl.constexpr, L: tl.constexpr,
    ROW_BYTES: tl.constexpr, SCALE_OFFSET: tl.constexpr, ROPE_OFFSET: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_TILE: tl.constexpr, TILE_C: tl.constexpr,
    NT: tl.constexpr, BLOCK_DR: tl.constexpr, SPLIT: tl.constexpr, PAGE_TILE: tl.constexpr,
    HW_FP8: tl.constexpr, FNUZ: tl.constexpr, DOT_TY: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # _mla_decode_split_kernel on scaled fp8 rows. The latent goes as NT (<= 4) column tiles of one scale
    # each. A token's scale s_j multiplies every value of its tile j, so it factors out of both products
    # over that tile: q . k = sum_j s_j (q_j . codes_j) (the score dot per tile on the raw codes, then one
    # multiply per (head, token)), and sum_n p_n s_nj codes_nj = (p * s_j) . codes_j (the probabilities
    # scaled per token before the value dot). The codes are only converted, never multiplied: the bytes
    # read are 656 per token instead of 1152, and the extra work is O(heads x tokens) per tile.
    g = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.program_id(2)
    n, split_len, start, end = _split_bounds(kv_len_ptr, b, s, num_splits, max_tokens, BLOCK_N)

    offs_h = g * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    qn_row = q_nope_ptr + b.to(tl.int64) * stride_qn_b + offs_h[:, None] * stride_qn_h
    q0 = _fp8_query(qn_row, h_ok, 0, R, SCALE_TILE, TILE_C, DOT_TY)
    if NT > 1:
        q1 = _fp8_query(qn_row, h_ok, 1, R, SCALE_TILE, TILE_C, DOT_TY)
    if NT > 2:
        q2 = _fp8_query(qn_row, h_ok, 2, R, SCALE_TILE, TILE_C, DOT_TY)
    if NT > 3:
        q3 = _fp8_query(qn_row, h_ok, 3, R, SCALE_TILE, TILE_C, DOT_TY)
    qr, cr, cr_ok = _rope_query(q_rope_ptr, b, offs_h, h_ok, stride_qr_b, stride_qr_h, DR, BLOCK_DR)
    qr = qr.to(DOT_TY)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, TILE_C], tl.float32)
    acc1 = tl.zeros([BLOCK_H, TILE_C], tl.float32)
    acc2 = tl.zeros([BLOCK_H, TILE_C], tl.float32)
    acc3 = tl.zeros([BLOCK_H, TILE_C], tl.float32)
    pt_row_ptr = page_table_ptr + b.to(tl.int64) * stride_pt_b
    rows_next = _tile_rows(pt_row_ptr, v2p_ptr, start, end, num_pages, layer_rows, PS, L, BLOCK_N, PAGE_TILE)
    for t0 in range(start, end, BLOCK_N):
        row, t_ok, rows_next = _tile_step(rows_next, offs_n, pt_row_ptr, v2p_ptr, t0, end, num_pages, layer_rows, PS,
                                          L, BLOCK_N, PAGE_TILE, 1)
        kr = tl.load(rope_ptr + (row * (ROW_BYTES // 2) + ROPE_OFFSET // 2)[:, None] + cr[None, :],
                     mask=t_ok[:, None] & cr_ok[None, :], other=0.0).to(DOT_TY)
        qk = tl.dot(qr, tl.trans(kr), input_precision=DOT_PRECISION)
        k0 = _fp8_codes(code_ptr, row, t_ok, 0, R, ROW_BYTES, SCALE_TILE, TILE_C, HW_FP8, FNUZ, DOT_TY)
        s0 = _fp8_scale(scale_ptr, row, t_ok, 0, ROW_BYTES, SCALE_OFFSET)
        qk += tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION) * s0[None, :]
        if NT > 1:
            k1 = _fp8_codes(code_ptr, row, t_ok, 1, R, ROW_BYTES, SCALE_TILE, TILE_C, HW_FP8, FNUZ, DOT_TY)
            s1 = _fp8_scale(scale_ptr, row, t_ok, 1, ROW_BYTES, SCALE_OFFSET)
            qk += tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION) * s1[None, :]
        if NT > 2:
            k2 = _fp8_codes(code_ptr, row, t_ok, 2, R, ROW_BYTES, SCALE_TILE, TILE_C, HW_FP8, FNUZ, DOT_TY)
            s2 = _fp8_scale(scale_ptr, row, t_ok, 2, ROW_BYTES, SCALE_OFFSET)
            qk += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION) * s2[None, :]
        if NT > 3:
            k3 = _fp8_codes(code_ptr, row, t_ok, 3, R, ROW_BYTES, SCALE_TILE, TILE_C, HW_FP8, FNUZ, DOT_TY)
            s3 = _fp8_scale(scale_ptr, row, t_ok, 3, ROW_BYTES, SCALE_OFFSET)
            qk += tl.dot(q3, tl.trans(k3), input_precision=DOT_PRECISION) * s3[None, :]
        p, alpha, m_i, l_i = _softmax_step(qk, t_ok, qk_scale, m_i, l_i)
        acc0 = tl.dot((p * s0[None, :]).to(DOT_TY), k0, acc0 * alpha[:, None], input_precision=DOT_PRECISION)
        if NT > 1:
            acc1 = tl.dot((p * s1[None, :]).to(DOT_TY), k1, acc1 * alpha[:, None], input_precision=DOT_PRECISION)
        if NT > 2:
            acc2 = tl.dot((p * s2[None, :]).to(DOT_TY), k2, acc2 * alpha[:, None], input_precision=DOT_PRECISION)
        if NT > 3:
            acc3 = tl.dot((p * s3[None, :]).to(DOT_TY), k3, acc3 * alpha[:, None], input_precision=DOT_PRECISION)

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # kv_len 0: no tile ran, the output is zeros
    if SPLIT:
        # an unused split (start >= end) stores nothing: the merge reads only the splits holding tokens
        slot = (b.to(tl.int64) * num_splits + s) * H + offs_h
        dst = part_o_ptr + slot[:, None] * R
        keep = h_ok & (tl.zeros_like(offs_h) + start < end)
        tl.store(part_lse_ptr + slot, m_i + tl.log2(l_safe), mask=keep)
    else:
        dst = out_ptr + (b.to(tl.int64) * H + offs_h[:, None]) * R
        keep = h_ok
    _fp8_store(dst, acc0 / l_safe[:, None], keep, 0, R, SCALE_TILE, TILE_C)
    if NT > 1:
        _fp8_store(dst, acc1 / l_safe[:, None], keep, 1, R, SCALE_TILE, TILE_C)
    if NT > 2:
        _fp8_store(dst, acc2 / l_safe[:, None], keep, 2, R, SCALE_TILE, TILE_C)
    if NT > 3:
        _fp8_store(dst, acc3 / l_safe[:, None], keep, 3, R, SCALE_TILE, TILE_C)


@triton.jit
def _mla_decode_merge_kernel(
    part_o_ptr, part_lse_ptr, kv_len_ptr, out_ptr, max_tokens, H, num_splits,
    R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # program (row b, head h, value columns c*BLOCK_R + [0, BLOCK_R)): log-sum-exp merge of the used splits'
    # normalised partial outputs. The columns are split over programs and the splits are read BLOCK_S at a
    # time as one [BLOCK_S, BLOCK_R] tile (independent loads, not a chain of one split after another), so a
    # small batch with many splits (batch 1: B x H = 32 programs over up to 132 splits) still spreads the
    # partials' bytes over the whole GPU.
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    n, split_len, _start, _end = _split_bounds(kv_len_ptr, b, 0, num_splits, max_tokens, BLOCK_N)
    used = tl.cdiv(n, tl.maximum(split_len, 1))
    offs_r = c * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    offs_s = tl.arange(0, BLOCK_S)
    row = b.to(tl.int64) * num_splits
    # pass 1: the largest log-sum-exp of the row's used splits (a few hundred bytes, L2-resident)
    m = tl.full([], float("-inf"), tl.float32)
    for s0 in range(0, used, BLOCK_S):
        s_ok = (s0 + offs_s) < used
        lse = tl.load(part_lse_ptr + (row + s0 + offs_s) * H + h, mask=s_ok, other=float("-inf"))
        m = tl.maximum(m, tl.max(lse, 0))
    m = tl.where(m == float("-inf"), 0.0, m)  # kv_len 0: no split ran, the output is zeros
    # pass 2: the weighted sum of the partials
    den = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for s0 in range(0, used, BLOCK_S):
        s_ok = (s0 + offs_s) < used
        slot = (row + s0 + offs_s) * H + h
        w = tl.exp2(tl.load(part_lse_ptr + slot, mask=s_ok, other=float("-inf")) - m)
        o = tl.load(part_o_ptr + slot[:, None] * R + offs_r[None, :], mask=s_ok[:, None] & r_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w[:, None] * o, 0)
        den += tl.sum(w, 0)
    out = acc / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + (b.to(tl.int64) * H + h) * R + offs_r, out.to(out_ptr.dtype.element_ty), mask=r_ok)


#: Merge programs the default merge tile aims for, per SM: enough to spread a small batch's partials over the
#: GPU without giving a large batch thousands of programs that each merge two partials.
MERGE_PROGRAMS_PER_SM = 4
#: Largest merge tile, in fp32 values ([splits per load, value columns]): 16 KiB of registers per program.
MERGE_TILE_VALUES = 4096


def merge_tile(batch: int, num_heads: int, kv_lora_rank: int, num_splits: int, sms: int) -> tuple[int, int]:
    """Default merge tile ``(block_r, block_s)``: value columns per program and splits per load.

    Columns are split over programs only as far as ``batch x heads`` programs fall short of
    :data:`MERGE_PROGRAMS_PER_SM` per SM (at least 32 columns each), and a load covers every split (at most
    :data:`MERGE_TILE_VALUES` values). Measured on an H200 (benchmarks/RESULTS.md, the small-batch sweep):
    at batch 1 one program per (row, head) over 132 splits held decode at 0.79 TB/s at 32k context where 32
    columns x 64 splits per program gave 1.14; at batch 32-64 and short contexts (2-4 splits) the
    column-split tile lost up to 40% against one program per (row, head)."""
    r_pow2 = triton.next_power_of_2(kv_lora_rank)
    chunks = triton.next_power_of_2(max(1, triton.cdiv(MERGE_PROGRAMS_PER_SM * sms, max(1, batch * num_heads))))
    block_r = max(min(32, r_pow2), r_pow2 // chunks)
    block_s = max(1, min(triton.next_power_of_2(num_splits), MERGE_TILE_VALUES // block_r))
    return block_r, block_s


# ---------------------------------------------------------------------------------------------- launcher
def _device_sms(device: torch.device) -> int:
    return device_sms(device, INTERPRETER_SMS)


def mla_decode_num_splits(batch: int, max_pages: int, num_heads: int, page_size: int, device: torch.device,
                          *, block_n: int = 64, block_h: int = MAX_BLOCK_H, blocks_per_sm: int = BLOCKS_PER_SM) -> int:
    """Split count of the stage-1 grid: the largest that keeps ``batch x splits x head groups`` within one
    wave of resident blocks (``blocks_per_sm x SMs``), at least 1, at most one split per ``block_n`` tile
    of a full row (``max_pages x page_size`` tokens). Depends on static sizes only (never on ``kv_len``)."""
    sms = _device_sms(device)
    groups = triton.cdiv(num_heads, block_h)
    tiles = triton.cdiv(max_pages * page_size, block_n)
    return max(1, min(tiles, (blocks_per_sm * sms) // max(1, batch * groups)))


# ---------------------------------------------------------------------------------------------- portable tiles
#: Bytes a compile adds beside the tiles :func:`portable_smem_bytes` counts (barriers, alignment): the sm_90
#: compiles of both split kernels came within 128 bytes of the counted tiles or under them
#: (tests/ops/test_mla_decode_smem.py).
SMEM_SLACK = 1024


def portable_smem_bytes(g: MLAGeometry, q_dtype: torch.dtype, block_h: int, block_n: int, num_stages: int) -> int:
    """Upper estimate of the shared memory (bytes per program) of the portable split kernel for this geometry,
    query dtype and tile: what Triton keeps there, counted from the tile sizes at the kernel's padded widths
    (latent ``W_R`` = next power of two of R, per 128-value scale tile for fp8 rows; rope ``W_Dr`` = next
    power of two of Dr, at least 16; ``W = W_R + W_Dr``) in the products' dtype (``dot``: the KV dtype's size
    for dense rows, 4 for fp8 rows with fp32 queries, else 2):

    * the loads in flight: ``num_stages - 1`` tiles of ``block_n`` rows as the kernel loads them (dense: ``W``
      elements; fp8: ``W_R`` codes, 4 bytes per scale, ``2 W_Dr`` rope bytes); a dense kernel's products read
      their operands from that buffer, so it counts at least one tile;
    * the operands Triton stages for the products: the queries ``[block_h, W]`` and the probabilities
      ``[block_h, block_n]``; for fp8 rows also the converted codes, every tile's ``[block_n, W]`` for fp32
      queries (fp32 FMA products keep each converted tile until the value product) and one 128-column
      ``[block_n, 128]`` tile for 16-bit ones (tensor-core products convert one scale tile at a time);
    * :data:`SMEM_SLACK`.

    Checked against fifteen sm_90 compiles (Triton 3.9, 16 or 32 heads, 32 or 64 tokens, 1-3 stages, R 512, Dr
    64; Triton 3.6 on the H200 gave the same 255,104 bytes for the one config both ran): 896-1,024 bytes above
    them for dense rows, 9-17 KiB above for fp8 rows with fp32 queries and 35-73 KiB above with 16-bit ones
    (Triton's allocator shares those operand copies more than counted here).
    """
    w_r, w_dr = max(16, triton.next_power_of_2(g.kv_lora_rank)), max(16, triton.next_power_of_2(g.qk_rope_head_dim))
    if g.quantized:
        tile_c = min(FP8_TILE, w_r)
        w_r = g.row_format.num_scales * tile_c
        dot = 4 if q_dtype == torch.float32 else 2
        staged = (num_stages - 1) * block_n * (w_r + 4 * g.row_format.num_scales + 2 * w_dr)
        converted = block_n * (w_r + w_dr) * dot if dot == 4 else block_n * tile_c * dot
    else:
        dot = g.kv_dtype.itemsize
        staged = max(num_stages - 1, 1) * block_n * (w_r + w_dr) * dot
        converted = 0
    return staged + converted + block_h * (w_r + w_dr) * dot + block_h * block_n * dot + SMEM_SLACK


def portable_tiles(g: MLAGeometry, q_dtype: torch.dtype, block_h: int, smem_limit: int | None, *,
                   block_n: int | None = None, num_stages: int | None = None) -> tuple[int, int]:
    """``(block_n, num_stages)`` of the portable split kernel: those given, else the measured defaults (64 and 2
    when the page size is a multiple of 64, else 32 and 3; a given ``block_n`` other than 64 gets 3 stages),
    then, while :func:`portable_smem_bytes` exceeds ``smem_limit`` (bytes per block; None: no limit, the
    interpreter), one stage fewer down to 1 (a default ``num_stages`` only), then half the tokens per tile down
    to 16 (a default ``block_n`` only) with the stages started again. Returns the smallest tried when nothing
    fits (Triton then raises its OutOfResources with the numbers). Only static sizes: no recompile as a
    context grows.

    An H200 (232,448 bytes) changes one default: fp8 rows with fp32 queries at page sizes that are multiples of
    64 run 64 tokens x 1 stage (estimated 230,400; compiled 213,120) instead of 64 x 2 (compiled 255,104)."""
    bn_default = block_n is None
    ns_default = num_stages is None
    bn = block_n if block_n is not None else 64 if g.page_size % 64 == 0 else 32
    while True:
        ns = num_stages if not ns_default else 2 if g.page_size % 64 == 0 and bn == 64 else 3
        while True:
            if smem_limit is None or portable_smem_bytes(g, q_dtype, block_h, bn, ns) <= smem_limit:
                return bn, ns
            if not ns_default or ns == 1:
                break
            ns -= 1
        if not bn_default or bn == 16:
            return bn, ns
        bn //= 2


def device_smem_limit(device: torch.device) -> int | None:
    """Shared memory one block may opt into on ``device`` (bytes; 232,448 on an H100/H200), None for the
    interpreter (CPU tensors)."""
    if device.type != "cuda":
        return None
    return _smem_optin(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _smem_optin(device_index: int) -> int | None:
    n = getattr(torch.cuda.get_device_properties(device_index), "shared_memory_per_block_optin", None)
    if n:
        return int(n)
    try:  # the number Triton itself checks a launch against
        return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - no way to ask: keep the defaults
        return None


def fp8_hw_conversion(device: torch.device, kv_dtype: torch.dtype) -> bool:
    """Whether the fp8 split kernel converts ``kv_dtype``'s codes with Triton's fp8 type (``tl.float8e4nv``:
    one ``cvt`` per pair of codes on the GPU) rather than the integer decoder :func:`.fp8.fp8_decode`: for
    e4m3fn on the interpreter (CPU tensors) and on GPUs with fp8 conversions (compute capability 8.9 and
    up). e4m3fnuz always takes the integer decoder: Triton has no e4m3fnuz conversion on sm_90. Both are
    exact (every e4m3 value is a bf16 and an fp32 value)."""
    if kv_dtype != torch.float8_e4m3fn:
        return False
    if device.type != "cuda":
        return True
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _check(op: str, q_nope, q_rope, arena, v2p, page_table, kv_len, g: MLAGeometry) -> None:
    check_tensor(op, "q_nope", q_nope, dtype=COMPUTE_DTYPES, dim=3)
    B, H = q_nope.shape[:2]
    check_tensor(op, "q_nope", q_nope, shape=(B, H, g.kv_lora_rank))
    check_tensor(op, "q_rope", q_rope, dtype=q_nope.dtype, shape=(B, H, g.qk_rope_head_dim))
    check_tensor(op, "page_table", page_table, dtype=torch.int32, dim=2)
    check_tensor(op, "page_table", page_table, shape=(B, None))
    check_tensor(op, "kv_len", kv_len, dtype=torch.int32, shape=(B,))
    check_mla_geometry(op, arena, v2p, g)
    check_same_device(op, q_nope=q_nope, q_rope=q_rope, arena=arena, v2p=v2p, page_table=page_table, kv_len=kv_len)


def mla_decode_triton(
    q_nope: torch.Tensor, q_rope: torch.Tensor, arena: torch.Tensor, v2p: torch.Tensor, page_table: torch.Tensor,
    kv_len: torch.Tensor, sm_scale: float, *geometry, num_splits: int | None = None, block_n: int | None = None,
    block_h: int | None = None, num_warps: int = 4, num_stages: int | None = None,
    partial_dtype: torch.dtype | None = None, kernel: str | None = None, wgmma_stages: int = WGMMA_STAGES,
    wgmma_early_refill: bool = WGMMA_EARLY_REFILL, wgmma_fp8_f16: bool = FP8_F16_VALUES,
    merge_block_r: int | None = None, merge_block_s: int | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`mla_decode` (checks, then one split kernel and, if split, one merge kernel).

    Args: as :func:`mla_decode` (``geometry``: its six geometry values, :class:`~.geometry.MLAGeometry`),
    plus keyword-only tuning knobs for tests and benchmarks:
        num_splits: splits per row (default :func:`mla_decode_num_splits`, from static sizes only).
        block_n, num_stages: tokens per tile (a power of two >= 16) and pipeline depth; default 64 and 2
            when the page size is a multiple of 64 (a tile is one page run), else 32 and 3 (per-token page
            lookups), the fastest measured on an H200 at page sizes 64 and 1, fitted to the device's shared
            memory by :func:`portable_tiles` (fp8 rows with fp32 queries: 64 tokens, 1 stage on an H200);
        block_h: heads per program (power of two >= 16, default ``min(32, next_pow2(H))``);
        num_warps: Triton launch option;
        partial_dtype: dtype of the per-split normalised partial outputs in the scratch buffer (fp32, bf16
            or fp16; default fp32: bf16 partials measured 2-3% faster on an H200 in the third session's sweeps but slower in
            an earlier run, and add a rounding). The log-sum-exps are always fp32.
        kernel: stage-1 form, one of :data:`KERNELS` (default: the ``UNIMEM_MLA_DECODE_KERNEL``
            environment variable, :func:`unimem_compile.env.mla_decode_kernel`, else "auto"). "auto" takes
            the Hopper TMA + wgmma kernel where :func:`~.mla_decode_hopper.wgmma_supported` says it applies
            (sm_90, bf16/fp16 or e4m3fn/e4m3fnuz rows, page size a multiple of 64, R 512, Dr 64; for fp8
            rows while :data:`FP8_AUTO_WGMMA`, True) and the portable Triton kernel elsewhere; "wgmma" raises
            ValueError where it does not apply. The wgmma kernel ignores ``block_n``,
            ``num_warps`` and ``num_stages`` (64-token tiles, one warpgroup, a ``wgmma_stages``-deep TMA ring) and its
            default split count assumes one resident program per SM.
        wgmma_stages, wgmma_early_refill: the wgmma kernel's KV ring depth (>= 1; exactly 2 for fp8 rows) and
            refill order (see :func:`~.mla_decode_hopper.mla_decode_stage1_wgmma`); ignored by the portable
            kernel.
        wgmma_fp8_f16: the Hopper fp8 kernel's f16 dequantisation chain (``f16_values`` of
            :func:`~.mla_decode_hopper.mla_decode_stage1_wgmma_fp8`; default False until a GPU run times it;
            not bit for bit the bf16 chain); ignored elsewhere.
        merge_block_r, merge_block_s: the merge's value columns per program and splits per load (powers of
            two; default :func:`merge_tile`).

    An fp8 ``kv_dtype`` (scaled rows, :class:`~unimem_compile.pool.specs.MLARowFormat`) runs, with
    ``kernel="wgmma"`` or "auto" where it applies (:data:`FP8_AUTO_WGMMA`), the Hopper fp8 kernel
    (:func:`~.mla_decode_hopper.mla_decode_stage1_wgmma_fp8`: the rows dequantised once to the bf16 values
    :func:`mla_decode_reference` reads, beside the bf16 Hopper kernel's products; its knobs as for bf16 rows,
    ``wgmma_stages`` 2 only, ``wgmma_early_refill`` ignored; 0.65-0.76x the bf16 kernel's speed on an H200:
    fp8 KV holds 1.76x the tokens, it does not decode faster), and otherwise the portable form's fp8 split
    kernel (0.32-0.46x bf16; the knobs apply as to the portable kernel): it reads
    each row's fp8 codes, fp32 scales and bf16 rope (656 bytes at R 512, Dr 64, not 1152), converts the
    codes exactly to the dot dtype (bf16 for 16-bit queries, fp32 for fp32 ones; :func:`fp8_hw_conversion`
    says how) and applies each 128-value tile's scale after the dot it factors out of (per (head, token)
    to the scores, per token to the probabilities before the value dot), so no value is rounded: the
    result is the attention over the exact ``code x scale`` values, which differs from
    :func:`mla_decode_reference` (it reads the bf16-rounded values ``mla_gather`` returns) by that rounding.
    Latents wider than ``128 x FP8_MAX_SCALE_TILES`` run the reference on the device.

    Returns:
        ``[B, H, R]`` contiguous, q's dtype, a fresh tensor. Scratch (``[B, splits, H, R]`` partials) is
        allocated with ``torch.empty`` per call (caching allocator; CUDA-graph safe).

    Raises:
        TypeError / GeometryError / ValueError: wrong dtypes, shapes, geometry or devices; a tuning knob
        out of its range (ValueError with the value); under ``UNIMEM_DEBUG=1`` also GeometryError for a
        ``kv_len`` outside the table or a page inside ``kv_len`` that is not live (costs a device sync).
    """
    op = "mla_decode"
    g = MLAGeometry(*geometry)
    _check(op, q_nope, q_rope, arena, v2p, page_table, kv_len, g)
    layer, layer_num, page_size, kv_lora_rank, qk_rope_head_dim, kv_dtype = g.args()
    if env.debug():
        check_live_page_table(op, v2p, page_table, kv_len, page_size)
    B, H, R = q_nope.shape
    P = page_table.shape[1]
    check_knob(op, "num_warps", num_warps, power_of_two=True)
    for name, value in (("num_splits", num_splits), ("num_stages", num_stages)):
        if value is not None:
            check_knob(op, name, value)
    if block_h is not None:
        check_knob(op, "block_h", block_h, low=16, power_of_two=True)
    check_knob(op, "wgmma_stages", wgmma_stages)
    for name, value in (("merge_block_r", merge_block_r), ("merge_block_s", merge_block_s)):
        if value is not None:
            check_knob(op, name, value, power_of_two=True)
    if not isinstance(wgmma_early_refill, bool):
        raise ValueError(f"{op}: wgmma_early_refill must be True or False, got {wgmma_early_refill!r}")
    if not isinstance(wgmma_fp8_f16, bool):
        raise ValueError(f"{op}: wgmma_fp8_f16 must be True or False, got {wgmma_fp8_f16!r}")
    if partial_dtype is not None and partial_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{op}: partial_dtype must be torch.float32, torch.bfloat16 or torch.float16, got "
                         f"{partial_dtype}")
    kernel = kernel or env.mla_decode_kernel() or "auto"
    if kernel not in KERNELS:
        raise ValueError(f"{op}: kernel must be one of {KERNELS}, got {kernel!r}")
    fits_wgmma = wgmma_supported(q_nope.device, kv_dtype, page_size, kv_lora_rank, qk_rope_head_dim)
    if kernel == "wgmma" and not fits_wgmma:
        raise ValueError(f"{op}: the wgmma kernel needs an sm_90 GPU, bf16/fp16/e4m3fn/e4m3fnuz KV, page_size % 64 "
                         f"== 0, kv_lora_rank 512 and qk_rope_head_dim 64; got device {q_nope.device}, "
                         f"{kv_dtype}, page_size {page_size}, kv_lora_rank {kv_lora_rank}, "
                         f"qk_rope_head_dim {qk_rope_head_dim}")
    if fits_wgmma and arena.data_ptr() % 16:  # TMA needs a 16-byte aligned base (a view into a bigger buffer)
        if kernel == "wgmma":
            raise ValueError(f"{op}: the wgmma kernel needs a 16-byte aligned arena (TMA); its data starts at "
                             f"address {arena.data_ptr():#x}")
        fits_wgmma = False
    use_wgmma = fits_wgmma and (kernel == "wgmma" or (kernel == "auto" and (FP8_AUTO_WGMMA or not g.quantized)))
    if g.quantized and g.row_format.num_scales > FP8_MAX_SCALE_TILES:
        # the fp8 kernel holds one accumulator per scale tile; no model we serve has a wider latent
        return mla_decode_reference(q_nope, q_rope, arena, v2p, page_table, kv_len, sm_scale, *g.args())
    if block_n is not None:
        check_knob(op, "block_n", block_n, low=16, power_of_two=True)
    block_h = block_h or min(MAX_BLOCK_H, max(16, triton.next_power_of_2(H)))
    if use_wgmma:
        if block_h not in (16, 32):
            raise ValueError(f"{op}: the wgmma kernel takes block_h 16 or 32, got {block_h}")
        block_n = WGMMA_BLOCK_N
    else:
        block_n, num_stages = portable_tiles(g, q_nope.dtype, block_h, device_smem_limit(q_nope.device),
                                             block_n=block_n, num_stages=num_stages)
    splits = num_splits if num_splits is not None else mla_decode_num_splits(
        B, P, H, page_size, q_nope.device, block_n=block_n, block_h=block_h,
        blocks_per_sm=1 if use_wgmma else BLOCKS_PER_SM)
    out = torch.empty((B, H, R), dtype=q_nope.dtype, device=q_nope.device)
    if B == 0 or H == 0:
        return out
    if q_nope.stride(-1) != 1:
        q_nope = q_nope.contiguous()
    if q_rope.stride(-1) != 1:
        q_rope = q_rope.contiguous()
    page_table = page_table.contiguous()
    kv_len = kv_len.contiguous()
    n_rows = arena.numel() // g.row_bytes
    rows = arena[: n_rows * g.row_bytes]  # the arena's whole rows, uint8
    if splits > 1:
        part_o = torch.empty((B, splits, H, R), dtype=partial_dtype or torch.float32, device=q_nope.device)
        part_lse = torch.empty((B, splits, H), dtype=torch.float32, device=q_nope.device)
    else:
        part_o = part_lse = out  # unused by the kernel when there is one split
    if use_wgmma:
        try:
            if g.quantized:
                mla_decode_stage1_wgmma_fp8(q_nope, q_rope, rows.view(n_rows, g.row_bytes), g.row_format, v2p,
                                            page_table, kv_len, part_o, part_lse, out, sm_scale * _LOG2E,
                                            P * page_size, layer * page_size, page_size, layer_num, splits, block_h,
                                            hw_fp8=fp8_hw_conversion(q_nope.device, kv_dtype), stages=wgmma_stages,
                                            f16_values=wgmma_fp8_f16)
            else:
                mla_decode_stage1_wgmma(q_nope, q_rope, rows.view(kv_dtype).view(n_rows, g.row_width), v2p,
                                        page_table, kv_len, part_o, part_lse, out, sm_scale * _LOG2E, P * page_size,
                                        layer * page_size, page_size, layer_num, splits, block_h,
                                        stages=wgmma_stages, early_refill=wgmma_early_refill)
        except triton.compiler.errors.CompilationError as e:
            # Gluon is an experimental API: a Triton whose Gluon no longer compiles this kernel costs speed,
            # not the call. "auto" falls back for the rest of the process (one warning); "wgmma" raises.
            if kernel == "wgmma":
                raise
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            disable_wgmma(f"{type(e).__name__}: {getattr(e, 'error_message', None) or (lines[-1] if lines else '')}",
                          fp8=g.quantized)
            return mla_decode_triton(q_nope, q_rope, arena, v2p, page_table, kv_len, sm_scale, *geometry,
                                     num_splits=num_splits,
                                     block_n=None, block_h=block_h, num_warps=num_warps, num_stages=num_stages,
                                     partial_dtype=partial_dtype, kernel="portable", merge_block_r=merge_block_r,
                                     merge_block_s=merge_block_s)
    else:
        _launch_portable(q_nope, q_rope, rows, v2p, page_table, kv_len, part_o, part_lse, out, sm_scale, P, g, splits,
                         block_h, block_n, num_warps, num_stages)
    if splits > 1:
        auto_r, auto_s = merge_tile(B, H, R, splits, _device_sms(q_nope.device))
        block_r, block_s = merge_block_r or auto_r, merge_block_s or auto_s
        _mla_decode_merge_kernel[(B, H, triton.cdiv(R, block_r))](
            part_o, part_lse, kv_len, out, P * page_size, H, splits,
            R=R, BLOCK_R=block_r, BLOCK_S=block_s, BLOCK_N=block_n, num_warps=4,
        )
    return out


def _launch_portable(q_nope, q_rope, rows, v2p, page_table, kv_len, part_o, part_lse, out, sm_scale, P,
                     g: MLAGeometry, splits, block_h, block_n, num_warps, num_stages) -> None:
    # the portable split kernel over the arena's whole rows `rows` (uint8, from byte 0): the bf16 kernel on
    # them as kv_dtype elements; for an fp8 kv_dtype the fp8 kernel on them as codes, scales and rope
    B, H, R = q_nope.shape
    layer, layer_num, page_size, _, qk_rope_head_dim, kv_dtype = g.args()
    grid = (triton.cdiv(H, block_h), B, splits)
    tables = (v2p, page_table, kv_len, part_o, part_lse, out, sm_scale * _LOG2E, v2p.numel(), P * page_size,
              layer * page_size, H, splits, q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1),
              page_table.stride(0))
    sizes = dict(R=R, DR=qk_rope_head_dim, PS=page_size, L=layer_num, BLOCK_H=block_h, BLOCK_N=block_n,
                 BLOCK_DR=max(16, triton.next_power_of_2(qk_rope_head_dim)), SPLIT=splits > 1,
                 PAGE_TILE=page_size % block_n == 0, num_warps=num_warps, num_stages=num_stages)
    if not g.quantized:
        _mla_decode_split_kernel[grid](
            q_nope, q_rope, rows.view(kv_dtype), *tables, R_HALF=max(32, triton.next_power_of_2(R)) // 2,
            DOT_PRECISION="ieee" if kv_dtype == torch.float32 else "tf32", **sizes,
        )
        return
    fmt = g.row_format
    fp32 = q_nope.dtype == torch.float32
    _mla_decode_split_fp8_kernel[grid](
        q_nope, q_rope, rows, rows.view(torch.float32), rows.view(torch.bfloat16), *tables,
        ROW_BYTES=fmt.row_bytes, SCALE_OFFSET=fmt.scale_offset, ROPE_OFFSET=fmt.rope_offset, SCALE_TILE=FP8_TILE,
        TILE_C=min(FP8_TILE, max(16, triton.next_power_of_2(R))), NT=fmt.num_scales,
        HW_FP8=fp8_hw_conversion(q_nope.device, kv_dtype), FNUZ=fp8.FNUZ[kv_dtype],
        DOT_TY=tl.float32 if fp32 else tl.bfloat16, DOT_PRECISION="ieee" if fp32 else "tf32", **sizes,
    )


# ---------------------------------------------------------------------------------------------- declaration
@torch.library.custom_op("unimem::mla_decode", mutates_args=())
def mla_decode(
    q_nope: torch.Tensor, q_rope: torch.Tensor, arena: torch.Tensor, v2p: torch.Tensor, page_table: torch.Tensor,
    kv_len: torch.Tensor, sm_scale: float, layer: int, layer_num: int, page_size: int, kv_lora_rank: int,
    qk_rope_head_dim: int, kv_dtype: torch.dtype,
) -> torch.Tensor:
    """Decode attention of one absorbed query per row over that row's paged latent KV.

    Args:
        q_nope: ``[B, H, R]`` bf16/fp16/fp32, the no-rope query already multiplied by W_UK (last dim
            contiguous; other strides free).
        q_rope: ``[B, H, Dr]``, q_nope's dtype, the rotary part of the query.
        arena: uint8 ``[memory_budget]``, read only.
        v2p: int64 ``[num_pages]``, virtual -> physical page (-1 = tombstone).
        page_table: int32 ``[B, P]`` virtual pages of each row.
        kv_len: int32 ``[B]`` tokens per row (0 allowed; at most ``P * page_size``).
        sm_scale: softmax scale applied to ``q_nope . kv[:R] + q_rope . kv[R:]``.
        layer, layer_num, page_size, kv_lora_rank, qk_rope_head_dim, kv_dtype: the MLA geometry (R = kv_lora_rank,
            Dr = qk_rope_head_dim); kv_dtype bf16, fp16, fp32, or e4m3fn / e4m3fnuz (scaled fp8 rows: the
            reference, which CPU tensors run, reads the bf16 values ``mla_gather`` returns; CUDA tensors run
            the fp8 split kernel over the exact ``code x scale`` values, or the Hopper fp8 kernel over the
            bf16 values, see :func:`mla_decode_triton`).

    Returns:
        ``[B, H, R]`` contiguous in q's dtype: ``softmax(scores) @ kv[:, :R]`` per row and head, zeros for
        rows with ``kv_len == 0``. Pages past ``kv_len`` are never read. A tombstoned page inside
        ``kv_len`` is a caller bug: its tokens read as zero rows (``UNIMEM_DEBUG=1`` raises instead).

    Raises:
        TypeError / GeometryError / ValueError: see :func:`mla_decode_triton`.
    """
    g = MLAGeometry(layer, layer_num, page_size, kv_lora_rank, qk_rope_head_dim, kv_dtype)
    _check("mla_decode", q_nope, q_rope, arena, v2p, page_table, kv_len, g)
    if env.debug():
        check_live_page_table("mla_decode", v2p, page_table, kv_len, page_size)
    return mla_decode_reference(q_nope, q_rope, arena, v2p, page_table, kv_len, sm_scale, *g.args())


@mla_decode.register_kernel("cuda")
def _(q_nope, q_rope, arena, v2p, page_table, kv_len, sm_scale, *geometry):
    return mla_decode_triton(q_nope, q_rope, arena, v2p, page_table, kv_len, sm_scale, *geometry)


@mla_decode.register_fake
def _(q_nope, q_rope, arena, v2p, page_table, kv_len, sm_scale, *geometry):
    check_same_device("mla_decode", q_nope=q_nope, q_rope=q_rope, arena=arena, v2p=v2p, page_table=page_table,
                      kv_len=kv_len)
    return q_nope.new_empty(q_nope.shape)

