"""Op ``unimem::mla_gather``: paged latent rows of one MLA layer -> a dense ``[B, max_len, R + Dr]`` history.

The history is in the geometry's compute dtype: ``kv_dtype``, or bf16 for fp8 rows, which are dequantised
on the way (:mod:`.fp8`: ``bf16(fp32(code) * scale)`` per latent value, the bf16 rope as stored).

Token ``i < kv_len[b]`` of row ``b`` lives at virtual page ``page_table[b, i // ps]``, offset ``i % ps``; it
goes to position ``out_offset[b] + i`` of the result; every other position is zero. This is the history
layout transformers' attention expects from a cache (like its StaticCache: history position ``j`` is
logical position ``j``, left pads included, so ``out_offset[b]`` is the number of left pads of row ``b``).
The cache splits the result into ``kv_nope [B, 1, T, R]`` and ``k_rot [B, 1, T, Dr]`` views.

Reference: :func:`mla_gather_reference` (plain torch through ``unimem_compile.pool.translate``), also the
default implementation (CPU tensors run it); CUDA tensors run the Triton kernel via :func:`mla_gather_triton`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from unimem_compile import env
from unimem_compile.errors import GeometryError

from unimem_compile.pool.specs import FP8_TILE

from . import fp8
from .common import (arena_rows, check_kernel_device, check_live_page_table, check_mla_geometry, check_same_device,
                     check_tensor, latent_rows, typed_rows)
from .geometry import MLAGeometry

# The op object is reached as ``torch.ops.unimem.mla_gather`` or ``unimem_compile.ops.mla_gather.mla_gather``:
# exporting it by name would shadow this module in the package namespace (``ops.mla_gather`` would become
# the op and ``from unimem_compile.ops import mla_gather`` would stop giving the module).
__all__ = ["mla_gather_triton", "mla_gather_reference"]


def _check(op, arena, v2p, page_table, kv_len, out_offset, max_len, g: MLAGeometry) -> None:
    check_mla_geometry(op, arena, v2p, g)
    check_tensor(op, "page_table", page_table, dtype=torch.int32, dim=2)
    b = page_table.shape[0]
    check_tensor(op, "kv_len", kv_len, dtype=torch.int32, shape=(b,))
    check_tensor(op, "out_offset", out_offset, dtype=torch.int32, shape=(b,))
    if max_len < 0:
        raise ValueError(f"{op}: max_len must be >= 0, got {max_len}")
    check_same_device(op, arena=arena, v2p=v2p, page_table=page_table, kv_len=kv_len, out_offset=out_offset)
    if env.debug():
        _check_rows(op, v2p, page_table, kv_len, out_offset, max_len, g.page_size)


def _check_rows(op, v2p, page_table, kv_len, out_offset, max_len, page_size) -> None:
    """(UNIMEM_DEBUG) every row's history fits ``[0, max_len)`` and its needed pages are live."""
    n, off = kv_len.long().cpu(), out_offset.long().cpu()
    bad = ((n < 0) | (off < 0) | (off + n > max_len)).nonzero().reshape(-1)[:8].tolist()
    if bad:
        detail = ", ".join(f"row {b}: out_offset {int(off[b])} + kv_len {int(n[b])}" for b in bad)
        raise GeometryError(f"{op}: histories do not fit in max_len {max_len}: {detail}")
    p = page_table.shape[1]
    need = (n + page_size - 1) // page_size
    bad = (need > p).nonzero().reshape(-1)[:8].tolist()
    if bad:
        detail = ", ".join(f"row {b}: kv_len {int(n[b])} needs {int(need[b])} pages" for b in bad)
        raise GeometryError(f"{op}: page_table has {p} columns: {detail}")
    pages = page_table.long().cpu()
    used = torch.arange(p)[None, :] < need[:, None]
    holes = (used & (pages < 0)).nonzero()[:8].tolist()
    if holes:
        detail = ", ".join(f"row {b} page {k}" for b, k in holes)
        raise GeometryError(f"{op}: page_table entries are -1 inside kv_len: {detail}")
    check_live_page_table(op, v2p, page_table, kv_len, page_size)


def mla_gather_reference(arena, v2p, page_table, kv_len, out_offset, max_len, *geometry) -> torch.Tensor:
    """Plain-torch :func:`mla_gather` (arguments and result as there, ``geometry`` the six values of
    :class:`~.geometry.MLAGeometry`; no checks)."""
    g = MLAGeometry(*geometry)
    page_size, out_dtype = g.page_size, g.compute_dtype
    b, p = page_table.shape
    if p == 0:  # no page columns: every position is empty (the gather below cannot index an empty dim)
        return torch.zeros(b, max_len, g.row_width, dtype=out_dtype, device=arena.device)
    i = torch.arange(max_len, device=arena.device)[None, :] - out_offset.long()[:, None]
    have = (i >= 0) & (i < kv_len.long()[:, None])
    i = torch.where(have, i, 0)
    col = i // page_size
    have = have & (col < p)
    vpage = page_table.long().gather(1, torch.where(have, col, 0))
    loc = torch.where(have & (vpage >= 0), vpage * page_size + i % page_size, -1)
    rows, live = latent_rows(v2p, loc, g.layer, g.layer_num, page_size)
    out = arena_rows(arena, g)[rows]
    if g.quantized:
        out = fp8.dequantize_rows(out, g.row_format)
    return torch.where(live[..., None], out, torch.zeros((), dtype=out_dtype, device=arena.device)).contiguous()


@triton.jit
def _history_rows(v2p_ptr, pt_ptr, kv_len_ptr, off_ptr, num_pages, max_len, P, pt_stride_b, pt_stride_p, len_stride,
                  off_stride, layer, layer_num, page_size, BLOCK_N: tl.constexpr):
    # Program (n, b)'s output positions j = n*BLOCK_N + [0, BLOCK_N) of row b, as flat output rows b*max_len + j,
    # and the arena row each reads: in_out = j < max_len (the positions to store); live = the position holds
    # token i = j - out_offset[b] < kv_len[b] on a live page, whose arena row is `row` (meaningless where not
    # live: every load through it is masked by live). Both gather kernels translate positions this way.
    b = tl.program_id(1).to(tl.int64)
    j = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_out = j < max_len
    n = tl.load(kv_len_ptr + b * len_stride).to(tl.int64)
    i = j - tl.load(off_ptr + b * off_stride).to(tl.int64)
    live = in_out & (i >= 0) & (i < n)
    i = tl.where(live, i, 0)
    col = i // page_size
    live = live & (col < P)
    vpage = tl.load(pt_ptr + b * pt_stride_b + col * pt_stride_p, mask=live, other=-1).to(tl.int64)
    live = live & (vpage >= 0) & (vpage < num_pages)
    ppage = tl.load(v2p_ptr + vpage, mask=live, other=0)  # masked before indexing the table
    live = live & (ppage > 0)  # tombstones and the sink read as zeros
    row = (ppage * layer_num + layer) * page_size + (i - col * page_size)
    return b * max_len + j, in_out, live, row


@triton.jit
def _mla_gather_kernel(
    out_ptr,  # [B, max_len, R + DR] contiguous
    src_ptr,  # the arena as kv_dtype elements (a typed view of the uint8 arena, from byte 0)
    v2p_ptr, pt_ptr, kv_len_ptr, off_ptr,
    num_pages, max_len, P, pt_stride_b, pt_stride_p, len_stride, off_stride, layer, layer_num, page_size,
    R: tl.constexpr, DR: tl.constexpr, R_P2: tl.constexpr, DR_P2: tl.constexpr,
    BLOCK_N: tl.constexpr, VEC: tl.constexpr,
):
    # Tiling: program (n, b) owns OUTPUT positions [n*BLOCK_N, (n+1)*BLOCK_N) of row b, whole rows, as a
    # [BLOCK_N, R_P2] and a [BLOCK_N, DR_P2] tile. Iterating over output positions writes every position
    # exactly once (zeros included), so the result needs no separate fill and nothing past max_len is touched.
    out_row, in_out, live, row = _history_rows(v2p_ptr, pt_ptr, kv_len_ptr, off_ptr, num_pages, max_len, P,
                                               pt_stride_b, pt_stride_p, len_stride, off_stride, layer, layer_num,
                                               page_size, BLOCK_N)
    src = tl.multiple_of(row * (R + DR), VEC)  # rows are 16-byte aligned
    dst = out_row * (R + DR)

    cols = tl.arange(0, R_P2)
    x = tl.load(src_ptr + src[:, None] + cols[None, :], mask=live[:, None] & (cols < R)[None, :], other=0.0)
    tl.store(out_ptr + dst[:, None] + cols[None, :], x, mask=in_out[:, None] & (cols < R)[None, :])
    rcols = tl.arange(0, DR_P2)
    r = tl.load(src_ptr + src[:, None] + R + rcols[None, :], mask=live[:, None] & (rcols < DR)[None, :], other=0.0)
    tl.store(out_ptr + dst[:, None] + R + rcols[None, :], r, mask=in_out[:, None] & (rcols < DR)[None, :])


@triton.jit
def _mla_gather_fp8_kernel(
    out_ptr,  # [B, max_len, R + DR] bf16, contiguous
    code_ptr, scale_ptr, rope_ptr,  # the arena as uint8, fp32 and bf16 elements, each from byte 0
    v2p_ptr, pt_ptr, kv_len_ptr, off_ptr,
    num_pages, max_len, P, pt_stride_b, pt_stride_p, len_stride, off_stride, layer, layer_num, page_size,
    R: tl.constexpr, DR: tl.constexpr, R_P2: tl.constexpr, DR_P2: tl.constexpr, TILE: tl.constexpr,
    ROW_BYTES: tl.constexpr, SCALE_OFFSET: tl.constexpr, ROPE_OFFSET: tl.constexpr, ROPE_VEC: tl.constexpr,
    FNUZ: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # _mla_gather_kernel's tiling over output positions, on scaled fp8 rows (MLARowFormat): the codes'
    # [BLOCK_N, R_P2] tile decoded to fp32 and seen as [BLOCK_N, R_P2 / TILE, TILE] against the row's
    # scales, the product rounded once to bf16. Dead positions load code 0 and scale 0: they store zeros.
    out_row, in_out, live, row = _history_rows(v2p_ptr, pt_ptr, kv_len_ptr, off_ptr, num_pages, max_len, P,
                                               pt_stride_b, pt_stride_p, len_stride, off_stride, layer, layer_num,
                                               page_size, BLOCK_N)
    base = tl.multiple_of(row * ROW_BYTES, 16)  # rows are padded to 16 bytes
    dst = out_row * (R + DR)

    cols = tl.arange(0, R_P2)
    codes = tl.load(code_ptr + base[:, None] + cols[None, :], mask=live[:, None] & (cols < R)[None, :], other=0)
    NT: tl.constexpr = R_P2 // TILE
    tiles = tl.arange(0, NT)
    scale = tl.load(scale_ptr + (base + SCALE_OFFSET)[:, None] // 4 + tiles[None, :],
                    mask=live[:, None] & (tiles * TILE < R)[None, :], other=0.0)
    x = tl.reshape(fp8.fp8_decode(codes, FNUZ), [BLOCK_N, NT, TILE]) * scale[:, :, None]
    x = fp8.to_bf16_rne(tl.reshape(x, [BLOCK_N, R_P2]))
    tl.store(out_ptr + dst[:, None] + cols[None, :], x, mask=in_out[:, None] & (cols < R)[None, :])
    rcols = tl.arange(0, DR_P2)
    src = tl.multiple_of((base + ROPE_OFFSET) // 2, ROPE_VEC)
    r = tl.load(rope_ptr + src[:, None] + rcols[None, :], mask=live[:, None] & (rcols < DR)[None, :], other=0.0)
    tl.store(out_ptr + dst[:, None] + R + rcols[None, :], r, mask=in_out[:, None] & (rcols < DR)[None, :])


def mla_gather_triton(
    arena: torch.Tensor, v2p: torch.Tensor, page_table: torch.Tensor, kv_len: torch.Tensor,
    out_offset: torch.Tensor, max_len: int, *geometry, block_n: int | None = None,
) -> torch.Tensor:
    """Gather one layer's latent history with one Triton launch (the CUDA kernel of ``unimem::mla_gather``).

    Args:
        arena: uint8 ``[memory_budget]`` (read only).
        v2p: int64 ``[num_pages]``.
        page_table: int32 ``[B, P]`` of virtual pages (-1 = none), any strides.
        kv_len: int32 ``[B]``, tokens stored per row.
        out_offset: int32 ``[B]``, position of each row's first token (its number of left pads).
        max_len: positions per row of the result.
        *geometry: the six values of :class:`~.geometry.MLAGeometry`, the geometry G.
        block_n: output positions per program (a power of two); default 16 (fewer when a kv_nope row
            exceeds 1 KiB, e.g. 8 for fp32 at R = 512).

    Returns:
        a new contiguous tensor ``[B, max_len, R + Dr]`` in the compute dtype (``kv_dtype``; bf16 for an fp8
        ``kv_dtype``, whose rows are dequantised: ``bf16(fp32(code) * scale)``, bit for bit
        :func:`.fp8.dequantize_rows`) that aliases nothing: token ``i`` of row ``b`` at position
        ``out_offset[b] + i``; zeros at every other position and for tokens whose page is -1, tombstoned
        or the sink. Positions >= ``max_len`` are dropped.

    Raises:
        TypeError / GeometryError / ValueError as :func:`unimem_compile.ops.mla_write.mla_kv_write_triton`;
        under ``UNIMEM_DEBUG=1`` a GeometryError for a history that does not fit ``[0, max_len)``, a
        kv_len needing more than P pages, a -1 page inside kv_len or a page that is not live.
    """
    op = "mla_gather"
    g = MLAGeometry(*geometry)
    _check(op, arena, v2p, page_table, kv_len, out_offset, max_len, g)
    check_kernel_device(op, arena.device)
    layer, layer_num, page_size, kv_lora_rank, qk_rope_head_dim, kv_dtype = g.args()
    d = g.row_width
    b = page_table.shape[0]
    out = torch.empty((b, max_len, d), dtype=g.compute_dtype, device=arena.device)
    if out.numel() == 0:
        return out
    itemsize = out.element_size()
    r_p2 = triton.next_power_of_2(kv_lora_rank)
    # ~16 KiB of kv_nope per program (bf16, R = 512: 16 positions) and 4 warps: eight 16-byte vectors in
    # flight per thread
    bn = min(16, max(1, 16384 // (r_p2 * itemsize))) if block_n is None else block_n
    if bn <= 0 or bn & (bn - 1):
        raise ValueError(f"{op}: block_n must be a power of two, got {bn}")
    tables = (v2p, page_table, kv_len, out_offset, v2p.numel(), max_len, page_table.shape[1], page_table.stride(0),
              page_table.stride(1), kv_len.stride(0), out_offset.stride(0), layer, layer_num, page_size)
    sizes = dict(R=kv_lora_rank, DR=qk_rope_head_dim, R_P2=r_p2, DR_P2=triton.next_power_of_2(qk_rope_head_dim),
                 BLOCK_N=bn, num_warps=4)
    grid = (triton.cdiv(max_len, bn), b)
    if g.quantized:
        fmt = g.row_format
        rows = arena[: arena.numel() // g.row_bytes * g.row_bytes]
        _mla_gather_fp8_kernel[grid](
            out, rows, rows.view(torch.float32), rows.view(torch.bfloat16), *tables,
            TILE=min(FP8_TILE, r_p2), ROW_BYTES=fmt.row_bytes, SCALE_OFFSET=fmt.scale_offset,
            ROPE_OFFSET=fmt.rope_offset, ROPE_VEC=math.gcd(fmt.rope_offset // 2, 8), FNUZ=fp8.FNUZ[kv_dtype],
            **sizes,
        )
        return out
    _mla_gather_kernel[grid](out, typed_rows(arena, kv_dtype, d), *tables, VEC=16 // itemsize, **sizes)
    return out


@torch.library.custom_op("unimem::mla_gather", mutates_args=())
def mla_gather(
    arena: torch.Tensor, v2p: torch.Tensor, page_table: torch.Tensor, kv_len: torch.Tensor, out_offset: torch.Tensor,
    max_len: int, layer: int, layer_num: int, page_size: int, kv_lora_rank: int, qk_rope_head_dim: int,
    kv_dtype: torch.dtype,
) -> torch.Tensor:
    """Layer ``layer``'s history ``[B, max_len, R + Dr]`` in the compute dtype (``kv_dtype``, bf16 for fp8
    rows, dequantised): token ``i < kv_len[b]`` of row ``b``
    (virtual page ``page_table[b, i // ps]``) at position ``out_offset[b] + i``, zeros elsewhere. See
    :func:`mla_gather_triton` for every argument and the errors. The default implementation is the
    plain-torch reference; CUDA tensors run the Triton kernel."""
    g = MLAGeometry(layer, layer_num, page_size, kv_lora_rank, qk_rope_head_dim, kv_dtype)
    _check("mla_gather", arena, v2p, page_table, kv_len, out_offset, max_len, g)
    return mla_gather_reference(arena, v2p, page_table, kv_len, out_offset, max_len, *g.args())


@mla_gather.register_kernel("cuda")
def _(arena, v2p, page_table, kv_len, out_offset, max_len, *geometry):
    return mla_gather_triton(arena, v2p, page_table, kv_len, out_offset, max_len, *geometry)


@mla_gather.register_fake
def _(arena, v2p, page_table, kv_len, out_offset, max_len, *geometry):
    check_same_device("mla_gather", arena=arena, v2p=v2p, page_table=page_table, kv_len=kv_len, out_offset=out_offset)
    g = MLAGeometry(*geometry)
    return arena.new_empty((page_table.shape[0], max_len, g.row_width), dtype=g.compute_dtype)
