"""Hopper (sm_90) form of ``unimem::mla_decode`` stage 1: TMA page loads + wgmma, written in Gluon.

Why a second kernel: the portable Triton kernel (:mod:`.mla_decode`) reaches 2.8-3.4 TB/s on an H200 and
no Triton-level knob moves it further (benchmarks/RESULTS.md, issue 4). Its compiled form shows why:
with 32 heads the score product ``[32 heads, D] x [D, 64 tokens]`` is too short in M for wgmma, so Triton
uses mma.sync, re-loads every KV tile from shared memory into registers for each of its two products
(``local_load`` to the mma.sync operand layout), and at ``num_stages=2`` gives each tile ONE shared buffer
(the next tile's copy
starts only after the current tile's second product), so a program never overlaps its loads with its
math; two programs per SM hide each other's waits, not their own.

This kernel turns the products around so they fit wgmma without padding (token-major, as FlashMLA
does for its score tile):

    S^T [64 tokens, Hb]  = sum_c K_c [64 tokens, 64] @ Q_c^T [64, Hb]       (9 chunks of 64 columns)
    O^T_c [64, Hb]      += V_c^T [64 columns, 64 tokens] @ P^T [64 tokens, Hb]   (c < R / 64)

Both operands of both products stay in shared memory (wgmma reads them there; nothing is copied into
registers), the per-head softmax statistics live along wgmma's N axis in both products, and the KV tiles
arrive by TMA (one ``[64 rows, 64 columns]`` box per chunk, 128-byte swizzled, 9 boxes per 64-token page
run) into a ring of ``STAGES`` buffers with one mbarrier each, so tile ``j + 1`` is in flight while tile
``j`` is multiplied; buffer ``j`` is refilled with tile ``j + 2`` chunk by chunk as its products release it
(the rope chunk once the score product is done, value chunk ``c`` once the ``c``-th value product is:
wgmma groups retire in order), which measured 3.6-5.5% faster than refilling after the last product at
batch >= 32 on an H200 (benchmarks/RESULTS.md).

Scaled fp8 rows (e4m3fn / e4m3fnuz, 656 bytes at R 512, Dr 64) have a form of their own,
:func:`mla_decode_stage1_wgmma_fp8`: the same products, softmax and epilogue (shared helpers), on bf16 values
dequantised into shared memory from the codes, rope and scales TMA brings, the dequantisation running beside
the products (its docstring says how and why). It is slower than this bf16 kernel (0.65-0.76x on an H200):
fp8 KV is a capacity feature today.

Scope (:func:`wgmma_supported`): an sm_90 GPU, bf16/fp16 or e4m3 KV, ``page_size % 64 == 0`` (a 64-token tile is
one contiguous run of one page), ``kv_lora_rank == 512`` (eight value accumulators, written out) and
``qk_rope_head_dim == 64``: the geometry of Kimi-Linear and DeepSeek-V2/V3. Everything
else, and the CPU interpreter, uses the portable kernel. The merge (stage 2) is the portable kernel's.

Tokens of the last tile past ``end`` are still loaded (TMA moves whole boxes) from the same page; their
scores are masked to ``-inf`` and their value rows are zeroed in shared memory before the second product
(a row of stale or NaN bytes times a zero probability would still be NaN).
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton

from unimem_compile.pool.specs import FP8_KV_DTYPES, FP8_TILE, MLARowFormat

from . import fp8

try:  # Gluon ships with Triton >= 3.5; its API is experimental, so any import problem means "not here"
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # the TMA load was renamed after Triton 3.6 (async_copy_global_to_shared -> async_load, same arguments);
    # the old name raises at compile time in 3.9
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except Exception:  # noqa: BLE001 - an older/newer Triton without this API: the portable kernel serves
    gluon = None

__all__ = ["wgmma_supported", "mla_decode_stage1_wgmma", "mla_decode_stage1_wgmma_fp8", "fp8_row_descriptors",
           "disable_wgmma", "WGMMA_BLOCK_N", "WGMMA_STAGES", "WGMMA_EARLY_REFILL", "FP8_F16_VALUES"]

#: Tokens per tile (one TMA box of rows; wgmma M).
WGMMA_BLOCK_N = 64
#: Columns per shared-memory chunk: 128 bytes of bf16, the widest 128-byte-swizzled TMA box.
_CHUNK = 64
#: Default KV ring depth (``stages=``): 2 x 72 KiB tiles + 36 KiB of queries + 4 KiB of probabilities = 184 KiB
#: (one CTA per SM).
WGMMA_STAGES = 2
#: Default of ``early_refill=``: refill a ring buffer chunk by chunk as the value products release it (else
#: after all of them).
WGMMA_EARLY_REFILL = True
#: Default of the fp8 kernel's ``f16_values=`` (:func:`mla_decode_stage1_wgmma_fp8`): False, the bf16 chain, until
#: a GPU run has timed the f16 one (``bench_mla_decode.py --fp8-f16-ab``).
FP8_F16_VALUES = False


#: Why the wgmma kernel was turned off in this process (None: it is not): set by :func:`disable_wgmma`.
WGMMA_DISABLED: str | None = None
#: The same for the fp8 form (:func:`mla_decode_stage1_wgmma_fp8`), which fails or compiles on its own.
WGMMA_FP8_DISABLED: str | None = None


def disable_wgmma(reason: str, *, fp8: bool = False) -> None:
    """Stop using the wgmma kernel (``fp8``: its fp8 form) in this process (``mla_decode`` calls it when this
    Triton's Gluon fails to compile the kernel); warns once with ``reason``."""
    global WGMMA_DISABLED, WGMMA_FP8_DISABLED
    if (WGMMA_FP8_DISABLED if fp8 else WGMMA_DISABLED) is None:
        warnings.warn(f"unimem mla_decode: the Hopper (Gluon) {'fp8 ' if fp8 else ''}kernel does not compile with "
                      f"triton {triton.__version__} ({reason}); using the portable Triton kernel from now on",
                      RuntimeWarning, stacklevel=3)
    if fp8:
        WGMMA_FP8_DISABLED = reason
    else:
        WGMMA_DISABLED = reason


def wgmma_supported(device: torch.device, kv_dtype: torch.dtype, page_size: int, kv_lora_rank: int,
                    qk_rope_head_dim: int) -> bool:
    """True when :func:`mla_decode_stage1_wgmma` (bf16/fp16 KV) or :func:`mla_decode_stage1_wgmma_fp8`
    (e4m3fn / e4m3fnuz rows) can serve this geometry on ``device`` (see module doc) and it has not been turned
    off in this process (:data:`WGMMA_DISABLED`, :data:`WGMMA_FP8_DISABLED`)."""
    quantized = kv_dtype in FP8_KV_DTYPES
    if (gluon is None or (WGMMA_FP8_DISABLED if quantized else WGMMA_DISABLED) is not None or device.type != "cuda"
            or not _is_sm90(device.index)):
        return False
    return ((quantized or kv_dtype in (torch.bfloat16, torch.float16)) and page_size % WGMMA_BLOCK_N == 0
            and kv_lora_rank == 8 * _CHUNK and qk_rope_head_dim == _CHUNK)


@functools.cache
def _is_sm90(index: int | None) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(index) == (9, 0)


if gluon is not None:

    @gluon.jit
    def _tile_row0(pt_row_ptr, v2p_ptr, t0, end, num_pages, layer_rows, PS: gl.constexpr, L: gl.constexpr):
        # arena row of token t0 (a tile's first token; the tile is one run of one page); t0 >= end -> row 0
        live = t0 < end
        vpage = gl.load(pt_row_ptr + t0 // PS, mask=live, other=-1).to(gl.int64)
        ok = live & (vpage >= 0) & (vpage < num_pages)
        ppage = gl.load(v2p_ptr + gl.where(ok, vpage, 0), mask=ok, other=0)
        ppage = gl.maximum(ppage, 0)  # tombstone / bad entry -> page 0, the all-zero sink
        return (ppage * (PS * L) + layer_rows + t0 % PS).to(gl.int32)

    @gluon.jit
    def _retire_then_refill(acc, outstanding: gl.constexpr, c: gl.constexpr, kv_desc, row, bar, kv_smem, base, pred,
                            CHUNK: gl.constexpr):
        # wait until value product c (and those before it) retired, then load chunk c of the next tile into the
        # shared buffer that product read
        acc = warpgroup_mma_wait(num_outstanding=outstanding, deps=(acc,))
        _tma_load(kv_desc, [row, c * CHUNK], bar, kv_smem.index(base + c), pred=pred)
        return acc

    @gluon.jit
    def _issue_tile(kv_desc, kv_smem, bars, pt_row_ptr, v2p_ptr, t0, num_pages, layer_rows, stage,
                    PS: gl.constexpr, L: gl.constexpr, NCH: gl.constexpr, CHUNK: gl.constexpr):
        # page lookup of tokens [t0, t0 + 64) (one page run) and the 9 TMA boxes of that run into `stage`
        row0 = _tile_row0(pt_row_ptr, v2p_ptr, t0, t0 + 1, num_pages, layer_rows, PS, L)
        bar = bars.index(stage)
        mbarrier.expect(bar, NCH * kv_desc.block_type.nbytes)
        for c in gl.static_range(NCH):
            _tma_load(kv_desc, [row0, c * CHUNK], bar, kv_smem.index(stage * NCH + c))

    @gluon.jit
    def _split_range(kv_len_ptr, b, s, num_splits, max_tokens, BLOCK_N: gl.constexpr):
        # tokens [start, end) of split s of row b and its tile count: the portable kernel's _split_bounds
        n = gl.minimum(gl.maximum(gl.load(kv_len_ptr + b), 0), max_tokens)
        split_len = gl.cdiv(gl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
        start = s * split_len
        end = gl.maximum(gl.minimum(start + split_len, n), start)
        return start, end, gl.cdiv(end - start, BLOCK_N)

    @gluon.jit
    def _stage_queries(q_smem, qr_smem, q_nope_ptr, q_rope_ptr, g, b, H, stride_qn_b, stride_qn_h, stride_qr_b,
                       stride_qr_h, ld: gl.constexpr, BLOCK_H: gl.constexpr, NC: gl.constexpr, CHUNK: gl.constexpr):
        # queries -> shared memory in the buffers' dtypes, 8 chunks of [BLOCK_H, 64] into q_smem and the rope
        # chunk into qr_smem; padded heads are zero (finite scores, never stored)
        offs_h = g * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld))
        offs_c = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, ld))
        h_ok = (offs_h < H)[:, None]
        qn_row = q_nope_ptr + b.to(gl.int64) * stride_qn_b + offs_h[:, None] * stride_qn_h
        for c in gl.static_range(NC):
            q_smem.index(c).store(gl.load(qn_row + c * CHUNK + offs_c[None, :], mask=h_ok, other=0.0).to(q_smem.dtype))
        qr_row = q_rope_ptr + b.to(gl.int64) * stride_qr_b + offs_h[:, None] * stride_qr_h
        qr_smem.store(gl.load(qr_row + offs_c[None, :], mask=h_ok, other=0.0).to(qr_smem.dtype))
        fence_async_shared()

    @gluon.jit
    def _softmax_to_shared(sacc, t_ok, qk_scale, m_i, l_i, p_smem):
        # one tile of the online softmax over the raw scores S^T [64 tokens, heads] (tokens not t_ok excluded;
        # base 2: qk_scale carries log2(e)); the probabilities go to p_smem for the value product. Returns the
        # factor [1, heads] that rescales what was accumulated before, and the new running max and sum.
        scores = gl.where(t_ok[:, None], sacc * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(scores, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(scores - m_new[None, :])
        l_i = l_i * alpha + gl.sum(p, axis=0)
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        return alpha[None, :], m_new, l_i

    @gluon.jit
    def _value_products(kv_smem, base, p_smem, a2, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7):
        # O^T += V^T P^T for the eight 64-column value chunks of one tile (buffers base .. base + 7 of
        # kv_smem), each accumulator rescaled by the online softmax's a2 first; issued async, in chunk order
        # (the callers retire them in that order: wgmma groups complete in order)
        acc0 = warpgroup_mma(kv_smem.index(base + 0).permute((1, 0)), p_smem, acc0 * a2, is_async=True)
        acc1 = warpgroup_mma(kv_smem.index(base + 1).permute((1, 0)), p_smem, acc1 * a2, is_async=True)
        acc2 = warpgroup_mma(kv_smem.index(base + 2).permute((1, 0)), p_smem, acc2 * a2, is_async=True)
        acc3 = warpgroup_mma(kv_smem.index(base + 3).permute((1, 0)), p_smem, acc3 * a2, is_async=True)
        acc4 = warpgroup_mma(kv_smem.index(base + 4).permute((1, 0)), p_smem, acc4 * a2, is_async=True)
        acc5 = warpgroup_mma(kv_smem.index(base + 5).permute((1, 0)), p_smem, acc5 * a2, is_async=True)
        acc6 = warpgroup_mma(kv_smem.index(base + 6).permute((1, 0)), p_smem, acc6 * a2, is_async=True)
        acc7 = warpgroup_mma(kv_smem.index(base + 7).permute((1, 0)), p_smem, acc7 * a2, is_async=True)
        return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7

    @gluon.jit
    def _epilogue(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, m_i, l_i, part_o_ptr, part_lse_ptr, out_ptr, g, b,
                  s, start, end, H, num_splits, R: gl.constexpr, BLOCK_H: gl.constexpr, SPLIT: gl.constexpr,
                  head_l: gl.constexpr, num_warps: gl.constexpr, CHUNK: gl.constexpr):
        # O^T chunks / l -> [heads, R] rows (value columns contiguous): the split's partial and its base-2
        # log-sum-exp, or (one split) the output
        l_safe = gl.where(l_i > 0, l_i, 1.0)  # kv_len 0: no tile ran, the output is zeros
        inv = (1.0 / l_safe)[None, :]
        st_l: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, num_warps], [0, 1])  # [64 cols, heads], cols fastest
        offs_r = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, st_l))
        offs_hs = g * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, st_l))
        hs_ok = (offs_hs < H)[None, :]
        if SPLIT:
            if start < end:  # an unused split stores nothing: the merge reads only the splits holding tokens
                slot = (b.to(gl.int64) * num_splits + s) * H + offs_hs
                dst = part_o_ptr + slot[None, :] * R + offs_r[:, None]
                _store_chunks(dst, hs_ok, inv, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, st_l,
                              part_o_ptr.dtype.element_ty, CHUNK)
                offs_hl = g * BLOCK_H + gl.arange(0, BLOCK_H, layout=head_l)
                slot_l = (b.to(gl.int64) * num_splits + s) * H + offs_hl
                gl.store(part_lse_ptr + slot_l, m_i + gl.log2(l_safe), mask=offs_hl < H)
        else:
            dst = out_ptr + (b.to(gl.int64) * H + offs_hs[None, :]) * R + offs_r[:, None]
            _store_chunks(dst, hs_ok, inv, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, st_l,
                          out_ptr.dtype.element_ty, CHUNK)

    @gluon.jit
    def _mla_decode_wgmma_kernel(
        kv_desc, q_nope_ptr, q_rope_ptr, v2p_ptr, page_table_ptr, kv_len_ptr, part_o_ptr, part_lse_ptr, out_ptr,
        qk_scale, num_pages, max_tokens, layer_rows, H, num_splits,
        stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h, stride_pt_b,
        R: gl.constexpr, PS: gl.constexpr, L: gl.constexpr, BLOCK_H: gl.constexpr, SPLIT: gl.constexpr,
        STAGES: gl.constexpr, EARLY_REFILL: gl.constexpr, num_warps: gl.constexpr,
    ):
        BLOCK_N: gl.constexpr = 64
        CHUNK: gl.constexpr = 64
        NC: gl.constexpr = R // CHUNK  # value chunks
        NCH: gl.constexpr = NC + 1  # + the rope chunk
        g = gl.program_id(0)
        b = gl.program_id(1)
        s = gl.program_id(2)
        kv_ty: gl.constexpr = kv_desc.dtype

        start, end, num_tiles = _split_range(kv_len_ptr, b, s, num_splits, max_tokens, BLOCK_N)

        # layouts: wgmma accumulators [64, BLOCK_H] (tokens or value columns along M, heads along N)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        head_l: gl.constexpr = gl.SliceLayout(0, mma)
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])  # [rows, 64 cols] loads
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, CHUNK], kv_ty)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], kv_ty)

        kv_smem = gl.allocate_shared_memory(kv_ty, [STAGES * NCH, BLOCK_N, CHUNK], kv_desc.layout)
        q_smem = gl.allocate_shared_memory(kv_ty, [NCH, BLOCK_H, CHUNK], q_sl)
        p_smem = gl.allocate_shared_memory(kv_ty, [BLOCK_N, BLOCK_H], p_sl)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        pt_row_ptr = page_table_ptr + b.to(gl.int64) * stride_pt_b
        # the first STAGES tiles go out before the queries are staged
        for i in gl.static_range(STAGES):
            if i < num_tiles:
                _issue_tile(kv_desc, kv_smem, bars, pt_row_ptr, v2p_ptr, start + i * BLOCK_N, num_pages,
                            layer_rows, i, PS, L, NCH, CHUNK)

        _stage_queries(q_smem, q_smem.index(NC), q_nope_ptr, q_rope_ptr, g, b, H, stride_qn_b, stride_qn_h, stride_qr_b,
                       stride_qr_h, ld, BLOCK_H, NC, CHUNK)

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=head_l)
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=head_l)
        zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=mma)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = zero, zero, zero, zero, zero, zero, zero, zero
        gl.static_assert(NC == 8, "the value accumulators are written out for kv_lora_rank 512")
        offs_t = gl.arange(0, BLOCK_N, layout=row_l)
        offs_tl = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        for j in range(num_tiles):
            st = j % STAGES
            t0 = start + j * BLOCK_N
            if EARLY_REFILL:  # the next refill's two dependent table loads go out before this tile's wait
                row_next = _tile_row0(pt_row_ptr, v2p_ptr, t0 + STAGES * BLOCK_N, end, num_pages, layer_rows, PS, L)
            mbarrier.wait(bars.index(st), (j // STAGES) & 1)
            base = st * NCH
            if end - t0 < BLOCK_N:
                # last, partial tile: zero the value rows of tokens >= end (their bytes may be anything)
                keep = (t0 + offs_tl < end)[:, None]
                for c in gl.static_range(NC):
                    chunk = kv_smem.index(base + c)
                    chunk.store(gl.where(keep, chunk.load(ld), 0.0))
                fence_async_shared()
            sacc = warpgroup_mma(kv_smem.index(base), q_smem.index(0).permute((1, 0)), zero, use_acc=False,
                                 is_async=True)
            for c in gl.static_range(1, NCH):
                sacc = warpgroup_mma(kv_smem.index(base + c), q_smem.index(c).permute((1, 0)), sacc,
                                     is_async=True)
            sacc = warpgroup_mma_wait(num_outstanding=0, deps=(sacc,))
            a2, m_i, l_i = _softmax_to_shared(sacc, t0 + offs_t < end, qk_scale, m_i, l_i, p_smem)
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _value_products(
                kv_smem, base, p_smem, a2, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7)
            if EARLY_REFILL:
                # refill buffer `st` with tile j + STAGES chunk by chunk as the products release it: the rope
                # chunk now (only the score product read it), value chunk c once the c-th product is done
                # (wgmma groups complete in order)
                has_next = j + STAGES < num_tiles  # (a runtime `if` cannot hold the accumulator waits)
                bar = bars.index(st)
                mbarrier.expect(bar, NCH * kv_desc.block_type.nbytes, pred=has_next)
                _tma_load(kv_desc, [row_next, NC * CHUNK], bar, kv_smem.index(base + NC), pred=has_next)
                acc0 = _retire_then_refill(acc0, 7, 0, kv_desc, row_next, bar, kv_smem, base, has_next, CHUNK)
                acc1 = _retire_then_refill(acc1, 6, 1, kv_desc, row_next, bar, kv_smem, base, has_next, CHUNK)
                acc2 = _retire_then_refill(acc2, 5, 2, kv_desc, row_next, bar, kv_smem, base, has_next, CHUNK)
                acc3 = _retire_then_refill(acc3, 4, 3, kv_desc, row_next, bar, kv_smem, base, has_next, CHUNK)
                acc4 = _retire_then_refill(acc4, 3, 4, kv_desc, row_next, bar, kv_smem, base, has_next, CHUNK)
                acc5 = _retire_then_refill(acc5, 2, 5, kv_desc, row_next, bar, kv_smem, base, has_next, CHUNK)
                acc6 = _retire_then_refill(acc6, 1, 6, kv_desc, row_next, bar, kv_smem, base, has_next, CHUNK)
                acc7 = _retire_then_refill(acc7, 0, 7, kv_desc, row_next, bar, kv_smem, base, has_next, CHUNK)
            else:
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = warpgroup_mma_wait(
                    num_outstanding=0, deps=(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7))
                # buffer `st` is free again: refill it with tile j + STAGES
                if j + STAGES < num_tiles:
                    _issue_tile(kv_desc, kv_smem, bars, pt_row_ptr, v2p_ptr, t0 + STAGES * BLOCK_N, num_pages,
                                layer_rows, st, PS, L, NCH, CHUNK)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        _epilogue(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, m_i, l_i, part_o_ptr, part_lse_ptr, out_ptr, g, b,
                  s, start, end, H, num_splits, R, BLOCK_H, SPLIT, head_l, num_warps, CHUNK)

    @gluon.jit
    def _issue_fp8_tile(code_desc, rope_desc, scale_desc, code_smem, rope_smem, scale_smem, bar, row0, stage, pred,
                        NC: gl.constexpr, CHUNK: gl.constexpr, ROPE_COL: gl.constexpr, SCALE_COL: gl.constexpr):
        # the TMA boxes of one 64-token page run of fp8 rows into ring stage `stage`, on one barrier: NC boxes
        # of [64 rows, 64 codes], the [64, 64] bf16 rope box and the [64, 4] fp32 scale box
        mbarrier.expect(bar, NC * code_desc.block_type.nbytes + rope_desc.block_type.nbytes
                        + scale_desc.block_type.nbytes, pred=pred)
        for c in gl.static_range(NC):
            _tma_load(code_desc, [row0, c * CHUNK], bar, code_smem.index(stage * NC + c), pred=pred)
        _tma_load(rope_desc, [row0, ROPE_COL], bar, rope_smem.index(stage), pred=pred)
        _tma_load(scale_desc, [row0, SCALE_COL], bar, scale_smem.index(stage), pred=pred)

    @gluon.jit
    def _f16_values(codes, scale16):
        # fp8.fp8_f16_bits(codes) * scale16 on packed registers, 4 codes (one 32-bit register of the shared-memory
        # load) at a time: two byte permutes spread them into 16-bit lanes, then per pair of lanes one AND, one
        # ADD and one shift give ((b & 0x80) << 8) | ((b & 0x7F) << 7) = (b + (b & 0x80)) << 7 (no carry leaves a
        # lane: at most 383 << 7 < 2^16), and one f16x2 multiply by the scales. Written out because Triton 3.9
        # unpacks a 16-bit shift to one per value (with a permute in and one out): 2,544 instructions per tile
        # that way, 1,921 this way, 1,985 for the bf16 chain (tests/ops/test_mla_decode_hopper_compile.py)
        return gl.inline_asm_elementwise(
            asm="""{
            .reg .b32 lo, hi, t;
            prmt.b32 lo, $2, 0, 0x4140;
            prmt.b32 hi, $2, 0, 0x4342;
            and.b32 t, lo, 0x00800080;
            add.u32 lo, lo, t;
            shl.b32 lo, lo, 7;
            and.b32 t, hi, 0x00800080;
            add.u32 hi, hi, t;
            shl.b32 hi, hi, 7;
            mul.rn.f16x2 $0, lo, $3;
            mul.rn.f16x2 $1, hi, $4;
            }""",
            constraints="=r,=r,r,r,r", args=[codes, scale16], dtype=gl.float16, is_pure=True, pack=4)

    @gluon.jit
    def _dequantize_chunk(c: gl.constexpr, code_smem, scale_smem, dst, stage, cv: gl.constexpr, NC: gl.constexpr,
                          CHUNK: gl.constexpr, SCALE_TILE: gl.constexpr, HW_FP8: gl.constexpr, FNUZ: gl.constexpr,
                          F16_VALUES: gl.constexpr, F16_POW2: gl.constexpr):
        # value chunk c [64 rows, 64] (layout cv) of the tile in ring stage `stage` -> the chunk buffer `dst`, with
        # no per-value select: a partial tile's codes and scales past the end were zeroed beforehand (code 0 times
        # scale 0 is +0). bf16 values: bf16(fp32(code) * scale), what fp8.dequantize_rows gives. F16_VALUES: the
        # code's bits moved into an f16 (integer ops only, its value times 2^-k) times the f16 scale times 2^k,
        # one f16 product, what fp8.dequantize_f16 gives
        codes = code_smem.index(stage * NC + c).load(cv)
        scale = scale_smem.index(stage).slice(c * CHUNK // SCALE_TILE, 1, dim=1).load(cv)  # [64 rows, 1]
        if F16_VALUES:
            scale16 = gl.full(codes.shape, 0.0, gl.float16, cv) + (scale * F16_POW2).to(gl.float16)
            dst.store(_f16_values(codes, scale16))
        else:
            if HW_FP8:
                values = codes.to(gl.float8e4nv, bitcast=True).to(gl.float32)
            else:
                values = fp8.fp8_decode(codes, FNUZ)
            dst.store((values * scale).to(dst.dtype))

    @gluon.jit
    def _zero_rows_past_end(code_smem, scale_smem, stage, t0, end, cv: gl.constexpr, sv: gl.constexpr,
                            NC: gl.constexpr, BLOCK_N: gl.constexpr):
        # a partial tile (tokens [t0, t0 + 64) with end inside): its codes and scales of rows >= end become 0 in
        # shared memory (their bytes may be NaN codes or NaN scales), so dequantising them gives +0
        keep = (t0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, cv)) < end)[:, None]
        for c in gl.static_range(NC):
            chunk = code_smem.index(stage * NC + c)
            chunk.store(gl.where(keep, chunk.load(cv), 0))
        keep_s = (t0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sv)) < end)[:, None]
        scales = scale_smem.index(stage)
        scales.store(gl.where(keep_s, scales.load(sv), 0.0))

    @gluon.jit
    def _mla_decode_wgmma_fp8_kernel(
        code_desc, rope_desc, scale_desc, q_nope_ptr, q_rope_ptr, v2p_ptr, page_table_ptr, kv_len_ptr, part_o_ptr,
        part_lse_ptr, out_ptr,
        qk_scale, num_pages, max_tokens, layer_rows, H, num_splits,
        stride_qn_b, stride_qn_h, stride_qr_b, stride_qr_h, stride_pt_b,
        R: gl.constexpr, PS: gl.constexpr, L: gl.constexpr, BLOCK_H: gl.constexpr, SPLIT: gl.constexpr,
        STAGES: gl.constexpr, ROPE_COL: gl.constexpr, SCALE_COL: gl.constexpr, SCALE_TILE: gl.constexpr,
        HW_FP8: gl.constexpr, FNUZ: gl.constexpr, F16_VALUES: gl.constexpr, F16_POW2: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        # _mla_decode_wgmma_kernel on scaled fp8 rows (mla_decode_stage1_wgmma_fp8 says why this way): the ring
        # holds the rows' codes, rope and scales as TMA brought them; the bf16 values live in a ring of 12 chunk
        # buffers (1.5 tiles), tile j's chunk c in buffer (8 j + c) % 12, so the next tile's chunks 0-3 are
        # dequantised into the 4 free buffers while this tile's score product runs, and its chunks 4-7 into
        # this tile's chunk 0-3 buffers as value products 0-3 retire
        BLOCK_N: gl.constexpr = 64
        CHUNK: gl.constexpr = 64
        NC: gl.constexpr = R // CHUNK
        HALF: gl.constexpr = NC // 2
        gl.static_assert(NC == 8, "the value accumulators are written out for kv_lora_rank 512")
        # the next tile's codes are waited for before this tile's stage is refilled: one stage would deadlock
        gl.static_assert(STAGES == 2, "the fp8 kernel needs a 2-deep ring (3 do not fit in shared memory)")
        g = gl.program_id(0)
        b = gl.program_id(1)
        s = gl.program_id(2)
        kv_ty: gl.constexpr = rope_desc.dtype
        start, end, num_tiles = _split_range(kv_len_ptr, b, s, num_splits, max_tokens, BLOCK_N)

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        head_l: gl.constexpr = gl.SliceLayout(0, mma)
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])  # [rows, 64 cols]
        sv: gl.constexpr = gl.BlockedLayout([1, NC * CHUNK // SCALE_TILE], [32, 1], [num_warps, 1], [1, 0])
        # the products' dtype: bf16 (the rope's, as stored), or f16 for the values, queries and probabilities
        # with F16_VALUES (the rope's score product stays bf16: wgmma accumulates both into one fp32 tile)
        val_ty: gl.constexpr = gl.float16 if F16_VALUES else kv_ty
        kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, CHUNK], val_ty)
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, CHUNK], val_ty)
        qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, CHUNK], kv_ty)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], val_ty)

        code_smem = gl.allocate_shared_memory(code_desc.dtype, [STAGES * NC, BLOCK_N, CHUNK], code_desc.layout)
        rope_smem = gl.allocate_shared_memory(kv_ty, [STAGES, BLOCK_N, CHUNK], rope_desc.layout)
        scale_smem = gl.allocate_shared_memory(scale_desc.dtype, [STAGES, BLOCK_N, NC * CHUNK // SCALE_TILE],
                                               scale_desc.layout)
        kv_smem = gl.allocate_shared_memory(val_ty, [3 * HALF, BLOCK_N, CHUNK], kv_sl)  # 3 groups of 4 chunks
        q_smem = gl.allocate_shared_memory(val_ty, [NC, BLOCK_H, CHUNK], q_sl)
        qr_smem = gl.allocate_shared_memory(kv_ty, [BLOCK_H, CHUNK], qr_sl)
        p_smem = gl.allocate_shared_memory(val_ty, [BLOCK_N, BLOCK_H], p_sl)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        pt_row_ptr = page_table_ptr + b.to(gl.int64) * stride_pt_b
        for i in gl.static_range(STAGES):
            row0 = _tile_row0(pt_row_ptr, v2p_ptr, start + i * BLOCK_N, end, num_pages, layer_rows, PS, L)
            _issue_fp8_tile(code_desc, rope_desc, scale_desc, code_smem, rope_smem, scale_smem, bars.index(i), row0,
                            i, i < num_tiles, NC, CHUNK, ROPE_COL, SCALE_COL)
        _stage_queries(q_smem, qr_smem, q_nope_ptr, q_rope_ptr, g, b, H, stride_qn_b, stride_qn_h, stride_qr_b,
                       stride_qr_h, ld, BLOCK_H, NC, CHUNK)

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=head_l)
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=head_l)
        zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=mma)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = zero, zero, zero, zero, zero, zero, zero, zero
        offs_t = gl.arange(0, BLOCK_N, layout=row_l)
        # tile 0's values: chunks 0-3 in group 0, 4-7 in group 1
        mbarrier.wait(bars.index(0), 0, pred=num_tiles > 0)
        if end - start < BLOCK_N:
            _zero_rows_past_end(code_smem, scale_smem, 0, start, end, ld, sv, NC, BLOCK_N)
        for c in gl.static_range(NC):
            _dequantize_chunk(c, code_smem, scale_smem, kv_smem.index(c), 0, ld, NC, CHUNK, SCALE_TILE, HW_FP8,
                                   FNUZ, F16_VALUES, F16_POW2)
        fence_async_shared()
        for j in range(num_tiles):
            st = j % STAGES
            t0 = start + j * BLOCK_N
            lo = (2 * j) % 3 * HALF  # tile j: chunks 0-3 in buffers lo.., 4-7 in hi..; the free group is nx..
            hi = (2 * j + 1) % 3 * HALF
            nx = (2 * j + 2) % 3 * HALF
            row_next = _tile_row0(pt_row_ptr, v2p_ptr, t0 + STAGES * BLOCK_N, end, num_pages, layer_rows, PS, L)
            sacc = warpgroup_mma(kv_smem.index(lo), q_smem.index(0).permute((1, 0)), zero, use_acc=False,
                                 is_async=True)
            for c in gl.static_range(1, HALF):
                sacc = warpgroup_mma(kv_smem.index(lo + c), q_smem.index(c).permute((1, 0)), sacc, is_async=True)
            for c in gl.static_range(HALF, NC):
                sacc = warpgroup_mma(kv_smem.index(hi + c - HALF), q_smem.index(c).permute((1, 0)), sacc,
                                     is_async=True)
            sacc = warpgroup_mma(rope_smem.index(st), qr_smem.permute((1, 0)), sacc, is_async=True)
            # while the score product runs: tile j + 1's codes (zeroed past the end if partial) and its chunks
            # 0-3 into the free group. After the last tile the wait is skipped and the stale values never read
            nst = (j + 1) % STAGES
            mbarrier.wait(bars.index(nst), ((j + 1) // STAGES) & 1, pred=j + 1 < num_tiles)
            if (j + 1 < num_tiles) & (end - t0 < 2 * BLOCK_N):
                _zero_rows_past_end(code_smem, scale_smem, nst, t0 + BLOCK_N, end, ld, sv, NC, BLOCK_N)
            for c in gl.static_range(HALF):
                _dequantize_chunk(c, code_smem, scale_smem, kv_smem.index(nx + c), nst, ld, NC, CHUNK,
                                       SCALE_TILE, HW_FP8, FNUZ, F16_VALUES, F16_POW2)
            sacc = warpgroup_mma_wait(num_outstanding=0, deps=(sacc,))
            a2, m_i, l_i = _softmax_to_shared(sacc, t0 + offs_t < end, qk_scale, m_i, l_i, p_smem)
            acc0 = warpgroup_mma(kv_smem.index(lo + 0).permute((1, 0)), p_smem, acc0 * a2, is_async=True)
            acc1 = warpgroup_mma(kv_smem.index(lo + 1).permute((1, 0)), p_smem, acc1 * a2, is_async=True)
            acc2 = warpgroup_mma(kv_smem.index(lo + 2).permute((1, 0)), p_smem, acc2 * a2, is_async=True)
            acc3 = warpgroup_mma(kv_smem.index(lo + 3).permute((1, 0)), p_smem, acc3 * a2, is_async=True)
            acc4 = warpgroup_mma(kv_smem.index(hi + 0).permute((1, 0)), p_smem, acc4 * a2, is_async=True)
            acc5 = warpgroup_mma(kv_smem.index(hi + 1).permute((1, 0)), p_smem, acc5 * a2, is_async=True)
            acc6 = warpgroup_mma(kv_smem.index(hi + 2).permute((1, 0)), p_smem, acc6 * a2, is_async=True)
            acc7 = warpgroup_mma(kv_smem.index(hi + 3).permute((1, 0)), p_smem, acc7 * a2, is_async=True)
            # stage `st` is read (its values dequantised last iteration, its rope by the score product): refill it
            # with tile j + STAGES now, behind the value products (the copies' barriers cost the tensor cores
            # nothing here; before the softmax they would delay its products)
            _issue_fp8_tile(code_desc, rope_desc, scale_desc, code_smem, rope_smem, scale_smem, bars.index(st),
                            row_next, st, j + STAGES < num_tiles, NC, CHUNK, ROPE_COL, SCALE_COL)
            # tile j + 1's chunks 4-7 into this tile's chunk 0-3 buffers, each once the value product that read
            # it retired (groups retire in order), while products 4-7 still run
            acc0 = warpgroup_mma_wait(num_outstanding=7, deps=(acc0,))
            _dequantize_chunk(HALF + 0, code_smem, scale_smem, kv_smem.index(lo + 0), nst, ld, NC, CHUNK,
                                   SCALE_TILE, HW_FP8, FNUZ, F16_VALUES, F16_POW2)
            acc1 = warpgroup_mma_wait(num_outstanding=6, deps=(acc1,))
            _dequantize_chunk(HALF + 1, code_smem, scale_smem, kv_smem.index(lo + 1), nst, ld, NC, CHUNK,
                                   SCALE_TILE, HW_FP8, FNUZ, F16_VALUES, F16_POW2)
            acc2 = warpgroup_mma_wait(num_outstanding=5, deps=(acc2,))
            _dequantize_chunk(HALF + 2, code_smem, scale_smem, kv_smem.index(lo + 2), nst, ld, NC, CHUNK,
                                   SCALE_TILE, HW_FP8, FNUZ, F16_VALUES, F16_POW2)
            acc3 = warpgroup_mma_wait(num_outstanding=4, deps=(acc3,))
            _dequantize_chunk(HALF + 3, code_smem, scale_smem, kv_smem.index(lo + 3), nst, ld, NC, CHUNK,
                                   SCALE_TILE, HW_FP8, FNUZ, F16_VALUES, F16_POW2)
            # products 4-7 ran beside those four chunks; they must retire before the next softmax rewrites P
            acc4, acc5, acc6, acc7 = warpgroup_mma_wait(num_outstanding=0, deps=(acc4, acc5, acc6, acc7))
            fence_async_shared()
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        _epilogue(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, m_i, l_i, part_o_ptr, part_lse_ptr, out_ptr, g, b,
                  s, start, end, H, num_splits, R, BLOCK_H, SPLIT, head_l, num_warps, CHUNK)

    @gluon.jit
    def _store_chunks(dst, ok, inv, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, st_l: gl.constexpr,
                      out_ty: gl.constexpr, CHUNK: gl.constexpr):
        gl.store(dst + 0 * CHUNK, gl.convert_layout((acc0 * inv).to(out_ty), st_l), mask=ok)
        gl.store(dst + 1 * CHUNK, gl.convert_layout((acc1 * inv).to(out_ty), st_l), mask=ok)
        gl.store(dst + 2 * CHUNK, gl.convert_layout((acc2 * inv).to(out_ty), st_l), mask=ok)
        gl.store(dst + 3 * CHUNK, gl.convert_layout((acc3 * inv).to(out_ty), st_l), mask=ok)
        gl.store(dst + 4 * CHUNK, gl.convert_layout((acc4 * inv).to(out_ty), st_l), mask=ok)
        gl.store(dst + 5 * CHUNK, gl.convert_layout((acc5 * inv).to(out_ty), st_l), mask=ok)
        gl.store(dst + 6 * CHUNK, gl.convert_layout((acc6 * inv).to(out_ty), st_l), mask=ok)
        gl.store(dst + 7 * CHUNK, gl.convert_layout((acc7 * inv).to(out_ty), st_l), mask=ok)


def kv_descriptor(kv: torch.Tensor) -> "TensorDescriptor":
    """TMA descriptor of the arena's latent rows: ``kv`` is ``[rows, R + Dr]`` (bf16/fp16, contiguous);
    boxes are ``[64 rows, 64 columns]``, 128-byte swizzled. Rows past the end read as zeros."""
    layout = gl.NVMMASharedLayout.get_default_for([WGMMA_BLOCK_N, _CHUNK],
                                                  gl.bfloat16 if kv.dtype == torch.bfloat16 else gl.float16)
    return TensorDescriptor(kv, list(kv.shape), list(kv.stride()), [WGMMA_BLOCK_N, _CHUNK], layout)


def mla_decode_stage1_wgmma(q_nope, q_rope, kv2d, v2p, page_table, kv_len, part_o, part_lse, out, qk_scale: float,
                            max_tokens: int, layer_rows: int, page_size: int, layer_num: int, splits: int,
                            block_h: int, *, stages: int = WGMMA_STAGES,
                            early_refill: bool = WGMMA_EARLY_REFILL) -> None:
    """Launch stage 1 on grid ``(cdiv(H, block_h), B, splits)``; the caller (``mla_decode_triton``) has checked
    everything and chosen the split count.

    Args:
        q_nope, q_rope: ``[B, H, 512]`` / ``[B, H, 64]`` queries (bf16/fp16/fp32, last dim contiguous;
            rounded to the KV dtype for the products).
        kv2d: the arena viewed as ``[rows, 576]`` bf16/fp16 rows (16-byte aligned base, contiguous).
        v2p: int64 ``[num_pages]``; page_table: int32 ``[B, P]``; kv_len: int32 ``[B]``.
        part_o, part_lse: ``[B, splits, H, 512]`` (fp32/bf16/fp16) normalised partial outputs and fp32
            ``[B, splits, H]`` base-2 log-sum-exps, written when ``splits > 1`` (unused splits write nothing).
        out: ``[B, H, 512]`` in q's dtype, written when ``splits == 1``.
        qk_scale: softmax scale times log2(e) (the kernel works in base 2).
        max_tokens: ``P * page_size``; layer_rows: ``layer * page_size``; page_size, layer_num: the geometry.
        splits: splits per row; block_h: heads per program (16 or 32: wgmma N).
        stages: KV ring depth (tiles in flight; 1 fits two programs per SM in shared memory).
        early_refill: refill a ring buffer chunk by chunk as the products release it (measured 3.6-5.5%
            faster at batch >= 32 on an H200), else once after the last value product.
    """
    B, H, R = q_nope.shape
    _mla_decode_wgmma_kernel[(triton.cdiv(H, block_h), B, splits)](
        kv_descriptor(kv2d), q_nope, q_rope, v2p, page_table, kv_len, part_o, part_lse, out,
        qk_scale, v2p.numel(), max_tokens, layer_rows, H, splits,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), page_table.stride(0),
        R=R, PS=page_size, L=layer_num, BLOCK_H=block_h, SPLIT=splits > 1, STAGES=stages,
        EARLY_REFILL=early_refill, num_warps=4,
    )


def fp8_row_descriptors(rows: torch.Tensor, fmt: MLARowFormat) -> tuple:
    """TMA descriptors of the arena's scaled fp8 rows, for :func:`mla_decode_stage1_wgmma_fp8`.

    ``rows`` is uint8 ``[n_rows, fmt.row_bytes]``, contiguous, 16-byte aligned (the arena's whole rows from
    byte 0). Three views of the same bytes, each a ``[n_rows, row_bytes / itemsize]`` tensor with a row stride
    of ``row_bytes`` (656 = 41 x 16 bytes at R 512, Dr 64: TMA's global strides must be multiples of 16):

    * the codes, uint8, boxes of ``[64 rows, 64 codes]`` (64 bytes inner, 64-byte swizzled) at column
      ``64 c``;
    * the rope, bf16, ``[64, 64]`` boxes (128 bytes, 128-byte swizzled) at column ``rope_offset / 2``;
    * the scales, fp32, ``[64, num_scales]`` boxes (16 bytes at R 512: TMA's smallest box width, unswizzled) at
      column ``scale_offset / 4``.

    Rows past ``n_rows`` read as zeros (TMA's out-of-bounds fill).

    Returns:
        ``(codes, rope, scales)`` descriptors.

    Raises:
        ValueError: ``rows`` is not such a tensor (the values in the message), or ``fmt`` is not an fp8 row
            of R 512 and Dr 64 (the kernel's scope).
    """
    if not fmt.quantized or fmt.kv_lora_rank != 8 * _CHUNK or fmt.qk_rope_head_dim != _CHUNK:
        raise ValueError(f"fp8_row_descriptors: the fp8 wgmma kernel reads fp8 rows of kv_lora_rank {8 * _CHUNK} and "
                         f"qk_rope_head_dim {_CHUNK}; got {fmt}")
    rb = fmt.row_bytes
    if (rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != rb or not rows.is_contiguous()
            or rows.data_ptr() % 16):
        raise ValueError(f"fp8_row_descriptors: rows must be contiguous uint8 [n_rows, {rb}] at a 16-byte aligned "
                         f"address; got {rows.dtype} {tuple(rows.shape)} strides {tuple(rows.stride())} at "
                         f"{rows.data_ptr():#x}")
    if rb % 16 or fmt.scale_offset % 4 or fmt.rope_offset % 2 or 4 * fmt.num_scales % 16:
        raise ValueError(f"fp8_row_descriptors: TMA needs a row of a multiple of 16 bytes and a scale box of a "
                         f"multiple of 16 bytes; got row_bytes {rb}, {fmt.num_scales} scales at byte "
                         f"{fmt.scale_offset}, rope at byte {fmt.rope_offset}")
    n = rows.shape[0]
    box = [WGMMA_BLOCK_N, _CHUNK]

    def view(dtype: torch.dtype, gl_dtype, block: list[int]) -> "TensorDescriptor":
        size = rows.element_size() * rb // torch.empty((), dtype=dtype).element_size()
        layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
        return TensorDescriptor(rows.view(dtype), [n, size], [size, 1], block, layout)

    return (view(torch.uint8, gl.uint8, box), view(torch.bfloat16, gl.bfloat16, box),
            view(torch.float32, gl.float32, [WGMMA_BLOCK_N, fmt.num_scales]))


def mla_decode_stage1_wgmma_fp8(q_nope, q_rope, rows, fmt: MLARowFormat, v2p, page_table, kv_len, part_o, part_lse, out,
                                qk_scale: float, max_tokens: int, layer_rows: int, page_size: int, layer_num: int,
                                splits: int, block_h: int, *, hw_fp8: bool, stages: int = WGMMA_STAGES,
                                f16_values: bool = FP8_F16_VALUES) -> None:
    """Stage 1 on scaled fp8 rows (:class:`~unimem_compile.pool.specs.MLARowFormat`), grid ``(cdiv(H, block_h), B,
    splits)``: :func:`mla_decode_stage1_wgmma`'s products, softmax and outputs over the values
    ``bf16(fp32(code) * scale)``, the values :func:`.fp8.dequantize_rows` returns, so the result is the bf16
    kernel's on the dequantised rows, bit for bit.

    Why dequantise into shared memory (a bf16 tile the products read, the values rounded once) rather than
    converting the codes unscaled and applying the scales to the scores and probabilities (as the portable
    fp8 kernel does): the scales factor out per 128 columns, so the score product would need one partial
    accumulator per scale tile (4 x ``[64, block_h]`` fp32 beside the 8 value accumulators, or a wait and a
    rescale per tile), and the value product one scaled copy of P per scale tile; scaling while converting
    costs one multiply per value, keeps both products the bf16 kernel's, and makes the result equal to
    :func:`~unimem_compile.ops.mla_decode.mla_decode_reference`'s values (what ``mla_gather`` returns).

    Per 64-token tile: TMA brings 8 boxes of codes, the rope box and the scale box (41,984 bytes, one
    mbarrier) into a 2-deep ring. The dequantised bf16 values live in a ring of 12 chunk buffers (96 KiB,
    1.5 tiles: tile j's chunk c in buffer ``(8 j + c) % 12``), so the dequantisation runs beside the tensor
    cores: while tile j's score product runs, tile j + 1's chunks 0-3 are dequantised into the 4 free buffers;
    after tile j's value products are issued, its chunks 4-7 go into tile j's chunk 0-3 buffers as value
    products 0-3 retire (wgmma groups retire in order), beside products 4-7. A partial tile's codes and scales
    past the end are zeroed once in shared memory (``fp32(0) * 0 = +0``; their bytes may be NaN), so full tiles
    convert with no select; their scores are masked to ``-inf``. The ring refill (10 TMA copies) goes out
    behind the value products. Shared memory at block_h 32: 2 x 41 KiB ring + 96 KiB values + 36 KiB queries
    + 4 KiB probabilities = 218 KiB (one program per SM; one ring stage would wait for the tile it has not yet
    asked for, three do not fit).

    Measured (H200, Triton 3.6.0, benchmarks/results/mla_decode_2026-12-02_fp8_wgmma_ab.json): 0.65-0.76x the
    bf16 Hopper kernel (82.9 us against 62.8 at batch 32, context 4k; 962.7 against 632.6 at batch 128,
    context 16k), 54-73 TFLOP/s on L2-resident rows; 1.57-1.62x the schedule it replaced (which dequantised
    each tile between the previous tile's value products and its own score product, with a select per value
    and 520 bytes of spilled descriptors; outputs equal bit for bit at every point), and about 2x the portable
    fp8 kernel. Slower than bf16 rows: what is left per tile is the conversion chain (docs/ops.md, "fp8 MLA
    rows").

    ``f16_values=True`` (off by default until a GPU run times it) swaps that chain for a cheaper one with the
    same products in f16: a code's bits become an f16's with integer ops only (:func:`.fp8.fp8_f16_bits`:
    ``((b & 0x80) << 8) | ((b & 0x7F) << 7)``, exactly the e4m3fn value times 2^-8, e4m3fnuz's times 2^-7,
    subnormals included, so one path serves both formats and ``hw_fp8`` is ignored), multiplied by the
    tile's scale times 2^k rounded to f16, one f16 product per value (the values :func:`.fp8.dequantize_f16`
    returns); the queries and probabilities go to f16 for the latent products (f16 has 3 more mantissa bits
    than bf16), the rope's score product stays bf16 (its own queries buffer; both accumulate into the one
    fp32 score tile). The result is then no longer the bf16 kernel's bit for bit: it is attention over values
    within ``2^-10`` of the exact ``code x scale`` (bf16's: ``2^-8``). Range caveat: a dequantised latent or an
    absorbed query above f16's 65504 overflows to inf (bf16 holds up to 3.4e38), and tiles whose largest magnitude is below ~1.1e-4
    keep fewer bits of their scale (an f16 subnormal); probabilities below 2^-24 of the running maximum flush
    to zero.

    Args:
        q_nope, q_rope: ``[B, H, 512]`` / ``[B, H, 64]`` queries (bf16/fp16/fp32, last dim contiguous; rounded
            to bf16 for the products).
        rows: uint8 ``[n_rows, fmt.row_bytes]``, the arena's whole rows (see :func:`fp8_row_descriptors`).
        fmt: the row format (an fp8 KV dtype, R 512, Dr 64).
        hw_fp8: convert codes with the GPU's e4m3 conversion (e4m3fn only); else the integer decoder
            :func:`.fp8.fp8_decode` (e4m3fnuz: Triton has no e4m3fnuz type on sm_90). Both are exact.
        stages: ring depth; must be 2 (the keyword is ``mla_decode_triton``'s ``wgmma_stages``, which the bf16
            kernel takes from 1 up).
        f16_values: the f16 chain above (default :data:`FP8_F16_VALUES`, False).
        The rest: as :func:`mla_decode_stage1_wgmma`.

    Raises:
        ValueError: from :func:`fp8_row_descriptors`; ``stages`` other than 2; ``f16_values`` not a bool.
    """
    if stages != 2:
        raise ValueError(f"mla_decode_stage1_wgmma_fp8: the fp8 kernel needs stages == 2 (1 would deadlock, 3 do not "
                         f"fit in shared memory), got {stages}")
    if not isinstance(f16_values, bool):
        raise ValueError(f"mla_decode_stage1_wgmma_fp8: f16_values must be True or False, got {f16_values!r}")
    codes, rope, scales = fp8_row_descriptors(rows, fmt)
    B, H, R = q_nope.shape
    _mla_decode_wgmma_fp8_kernel[(triton.cdiv(H, block_h), B, splits)](
        codes, rope, scales, q_nope, q_rope, v2p, page_table, kv_len, part_o, part_lse, out,
        qk_scale, v2p.numel(), max_tokens, layer_rows, H, splits,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), page_table.stride(0),
        R=R, PS=page_size, L=layer_num, BLOCK_H=block_h, SPLIT=splits > 1, STAGES=stages,
        ROPE_COL=fmt.rope_offset // 2, SCALE_COL=fmt.scale_offset // 4, SCALE_TILE=FP8_TILE,
        HW_FP8=hw_fp8, FNUZ=fp8.FNUZ[fmt.dtype], F16_VALUES=f16_values,
        F16_POW2=float(2 ** fp8.F16_BITS_EXPONENT[fmt.dtype]), num_warps=4,
    )
