"""Ops ``unimem::mla_kv_write`` and ``unimem::mla_kv_write_rmsnorm``: the fused MLA latent KV write.

One launch per call writes ``T`` tokens' latent rows ``[kv_nope | k_rope]`` (``D = R + Dr`` values of
``kv_dtype``, or for an fp8 ``kv_dtype`` the scaled row of :class:`~unimem_compile.pool.specs.MLARowFormat`,
quantised in the kernel: :mod:`.fp8`) of one MLA layer into the uint8 arena. The virtual -> dense
translation of docs/design.md section 3 happens inside the kernel (no index tensor is materialised)::

    row = v2p[t // ps] * ps * L + layer * ps + t % ps        (rows of row_bytes bytes from byte 0)

A lane writes nothing when its location is < 0, its virtual page lies past ``v2p``, is tombstoned
(``v2p = -1``), or maps to a physical page <= 0 (the sink). The ``_rmsnorm`` variant applies the model's
``kv_a_layernorm`` to ``kv_nope`` on the way, computed exactly as transformers' ``DeepseekV3RMSNorm`` /
``KimiLinearRMSNorm`` compute it (:func:`rmsnorm_reference`).

References: :func:`mla_kv_write_reference` (plain torch, through ``unimem_compile.pool.translate``), also
the default implementation of the ops (CPU tensors run it). CUDA tensors run the Triton kernel through the
checking launchers :func:`mla_kv_write_triton` / :func:`mla_kv_write_rmsnorm_triton`.
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
from .common import (
    COMPUTE_DTYPES,
    arena_rows,
    check_kernel_device,
    check_live_locations,
    check_mla_geometry,
    check_same_device,
    check_tensor,
    latent_rows,
    overlaps_arena,
    typed_rows,
)
from .geometry import MLAGeometry

__all__ = [
    "mla_kv_write",
    "mla_kv_write_rmsnorm",
    "mla_kv_write_triton",
    "mla_kv_write_rmsnorm_triton",
    "mla_kv_write_reference",
    "rmsnorm_reference",
]

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _check_write(op, arena, v2p, virt_loc, kv_nope, k_rope, norm_weight, eps, g: MLAGeometry) -> None:
    check_mla_geometry(op, arena, v2p, g)
    kv_lora_rank, qk_rope_head_dim = g.kv_lora_rank, g.qk_rope_head_dim
    check_tensor(op, "virt_loc", virt_loc, dtype=torch.int64, dim=1)
    t = virt_loc.shape[0]
    nope_name = "kv_nope" if norm_weight is None else "kv_nope_unnormed"
    check_tensor(op, nope_name, kv_nope, dtype=COMPUTE_DTYPES, shape=(t, kv_lora_rank))
    check_tensor(op, "k_rope", k_rope, dtype=COMPUTE_DTYPES, shape=(t, qk_rope_head_dim))
    for name, x in ((nope_name, kv_nope), ("k_rope", k_rope)):
        if x.shape[1] > 1 and x.stride(1) != 1:
            raise GeometryError(f"{op}: {name} must have a last-dimension stride of 1, got strides {x.stride()}")
    if norm_weight is not None:
        check_tensor(op, "norm_weight", norm_weight, dtype=COMPUTE_DTYPES, shape=(kv_lora_rank,), contiguous=True)
        if not eps >= 0.0:
            raise ValueError(f"{op}: eps must be a non-negative float, got {eps}")
    check_same_device(op, arena=arena, v2p=v2p, virt_loc=virt_loc, **{nope_name: kv_nope}, k_rope=k_rope,
                      norm_weight=norm_weight)
    if env.debug():
        check_live_locations(op, v2p, virt_loc, g.page_size)


# ---------------------------------------------------------------------------- references
def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``DeepseekV3RMSNorm`` / ``KimiLinearRMSNorm`` forward, operation for operation.

    ``x32 = x.float(); y = (x32 * rsqrt(mean(x32 ** 2, -1) + eps)).to(x.dtype); return weight * y``: the
    result has dtype ``promote_types(weight.dtype, x.dtype)`` (for bf16 weight and input: an fp32
    multiply rounded once to bf16).
    """
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def mla_kv_write_reference(arena, v2p, virt_loc, kv_nope, k_rope, *geometry) -> None:
    """Plain-torch :func:`mla_kv_write` (arguments as there, ``geometry`` the six values of
    :class:`~.geometry.MLAGeometry`; no checks). Duplicate live locations in one call leave one of their
    rows, unspecified which (as in the kernel). fp8 rows are quantised by :func:`.fp8.quantize_rows`."""
    g = MLAGeometry(*geometry)
    rows, live = latent_rows(v2p, virt_loc, g.layer, g.layer_num, g.page_size)
    if g.quantized:
        values = fp8.quantize_rows(kv_nope[live], k_rope[live], g.row_format)
        arena_rows(arena, g)[rows[live]] = values
        return
    values = torch.cat([kv_nope.to(g.kv_dtype), k_rope.to(g.kv_dtype)], dim=-1)
    typed_rows(arena, g.kv_dtype, g.row_width)[rows[live]] = values[live]


# ---------------------------------------------------------------------------- kernels
@triton.jit
def _destination_rows(v2p_ptr, loc_ptr, t, T, num_pages, layer, layer_num, page_size):
    # Each token's destination row, translated per lane (no index tensor exists outside the kernel), and
    # whether the lane writes at all.
    loc = tl.load(loc_ptr + t, mask=t < T, other=-1)
    live = loc >= 0
    safe = tl.where(live, loc, 0)  # negative ids are the sink BEFORE any division
    vpage = safe // page_size
    live = live & (vpage < num_pages)
    ppage = tl.load(v2p_ptr + vpage, mask=live, other=0)  # masked before indexing the table
    live = live & (ppage > 0)  # tombstone (-1) or the sink (0): write nothing
    return live, (ppage * layer_num + layer) * page_size + (safe - vpage * page_size)


@triton.jit
def _latent_tile(nope_ptr, weight_ptr, t, live, nope_stride, eps, R: tl.constexpr, R_P2: tl.constexpr,
                 NORM: tl.constexpr, IN_DTYPE: tl.constexpr, PROD_DTYPE: tl.constexpr):
    # The [BLOCK_T, R_P2] tile of latents to store (zeros past R and in dead lanes), normalised if NORM.
    cols = tl.arange(0, R_P2)
    m = live[:, None] & (cols < R)[None, :]
    x = tl.load(nope_ptr + t[:, None] * nope_stride + cols[None, :], mask=m, other=0.0)
    if NORM:
        # transformers' RMSNorm: fp32 statistics, the normalised value rounded to the input dtype, then
        # weight * value in the promoted dtype (one fp32 multiply and one rounding for bf16)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=1) / R
        y = (xf * tl.rsqrt(var + eps)[:, None]).to(IN_DTYPE).to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=cols < R, other=0.0).to(tl.float32)
        x = (y * w[None, :]).to(PROD_DTYPE)
    return x, m


# T (tokens in the call) only bounds the lanes: specialising it (Triton does for ints equal to 1 or divisible by
# 16) would compile up to three variants per block size as prefill chunk lengths vary, inside a serving run
@triton.jit(do_not_specialize=["T"])
def _mla_kv_write_kernel(
    out_ptr,  # the arena as kv_dtype elements (a typed view of the uint8 arena, from byte 0)
    v2p_ptr, loc_ptr, nope_ptr, rope_ptr, weight_ptr,
    T, num_pages, layer, layer_num, page_size,
    nope_stride, rope_stride, eps,
    R: tl.constexpr, DR: tl.constexpr, R_P2: tl.constexpr, DR_P2: tl.constexpr,
    BLOCK_T: tl.constexpr, VEC: tl.constexpr,
    NORM: tl.constexpr, IN_DTYPE: tl.constexpr, PROD_DTYPE: tl.constexpr,
):
    # Tiling: program i owns tokens [i*BLOCK_T, (i+1)*BLOCK_T) and their WHOLE rows, as two tiles:
    # [BLOCK_T, R_P2] of kv_nope (the RMSNorm reduces along it) and [BLOCK_T, DR_P2] of k_rope.
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live, row = _destination_rows(v2p_ptr, loc_ptr, t, T, num_pages, layer, layer_num, page_size)
    # rows are D * itemsize bytes, a multiple of 16: every row starts 16-byte aligned
    dst = tl.multiple_of(row * (R + DR), VEC)

    x, m = _latent_tile(nope_ptr, weight_ptr, t, live, nope_stride, eps, R, R_P2, NORM, IN_DTYPE, PROD_DTYPE)
    cols = tl.arange(0, R_P2)
    tl.store(out_ptr + dst[:, None] + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=m)

    rcols = tl.arange(0, DR_P2)
    rm = live[:, None] & (rcols < DR)[None, :]
    r = tl.load(rope_ptr + t[:, None] * rope_stride + rcols[None, :], mask=rm, other=0.0)
    tl.store(out_ptr + dst[:, None] + R + rcols[None, :], r.to(out_ptr.dtype.element_ty), mask=rm)


@triton.jit(do_not_specialize=["T"])  # as _mla_kv_write_kernel
def _mla_kv_write_fp8_kernel(
    code_ptr, scale_ptr, rope_out_ptr,  # the arena as uint8, fp32 and bf16 elements, each from byte 0
    v2p_ptr, loc_ptr, nope_ptr, rope_ptr, weight_ptr,
    T, num_pages, layer, layer_num, page_size,
    nope_stride, rope_stride, eps,
    R: tl.constexpr, DR: tl.constexpr, R_P2: tl.constexpr, DR_P2: tl.constexpr, TILE: tl.constexpr,
    ROW_BYTES: tl.constexpr, SCALE_OFFSET: tl.constexpr, ROPE_OFFSET: tl.constexpr, ROPE_VEC: tl.constexpr,
    FP8_MAX: tl.constexpr, FNUZ: tl.constexpr,
    BLOCK_T: tl.constexpr, NORM: tl.constexpr, IN_DTYPE: tl.constexpr, PROD_DTYPE: tl.constexpr,
):
    # The scaled fp8 row of MLARowFormat (ops/fp8.py): the same tiling as _mla_kv_write_kernel, the
    # [BLOCK_T, R_P2] latent tile seen as [BLOCK_T, R_P2 / TILE, TILE] for the per-tile scales (TILE = 128,
    # or R_P2 when that is smaller: one tile). Values past R are zeros, so they never raise a tile's max;
    # their codes and the scales of tiles past ceil(R / 128) are masked at the store.
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live, row = _destination_rows(v2p_ptr, loc_ptr, t, T, num_pages, layer, layer_num, page_size)
    base = tl.multiple_of(row * ROW_BYTES, 16)  # rows are padded to 16 bytes

    x, m = _latent_tile(nope_ptr, weight_ptr, t, live, nope_stride, eps, R, R_P2, NORM, IN_DTYPE, PROD_DTYPE)
    NT: tl.constexpr = R_P2 // TILE
    xt = tl.reshape(x.to(tl.float32), [BLOCK_T, NT, TILE])
    scale = tl.math.div_rn(tl.reduce(tl.abs(xt), 2, fp8.fp8_nanmax), FP8_MAX)  # IEEE division, as torch's
    s3 = scale[:, :, None]
    # a tile of zeros (or a NaN scale): codes 0; a zero scale reads them back as zeros
    q = tl.where(s3 > 0, tl.math.div_rn(xt, tl.where(s3 > 0, s3, 1.0)), 0.0)
    codes = tl.reshape(fp8.fp8_encode(q, FNUZ), [BLOCK_T, R_P2])
    cols = tl.arange(0, R_P2)
    tl.store(code_ptr + base[:, None] + cols[None, :], codes.to(tl.uint8), mask=m)
    tiles = tl.arange(0, NT)
    tl.store(scale_ptr + (base + SCALE_OFFSET)[:, None] // 4 + tiles[None, :], scale,
             mask=live[:, None] & (tiles * TILE < R)[None, :])

    rcols = tl.arange(0, DR_P2)
    rm = live[:, None] & (rcols < DR)[None, :]
    r = tl.load(rope_ptr + t[:, None] * rope_stride + rcols[None, :], mask=rm, other=0.0)
    if r.dtype != tl.bfloat16:
        r = fp8.to_bf16_rne(r.to(tl.float32))
    rdst = tl.multiple_of((base + ROPE_OFFSET) // 2, ROPE_VEC)
    tl.store(rope_out_ptr + rdst[:, None] + rcols[None, :], r, mask=rm)


def _block_t(t: int) -> int:
    # one token per program below T = 512 (decode: as many programs as tokens), then 2, 4 and from
    # T = 2048 on 8 tokens (~9 KiB of bf16 per program at R + Dr = 576): always >= 256 programs in flight
    return 1 << min(3, max(0, (t // 256).bit_length() - 1))


def _launch(op, arena, v2p, virt_loc, kv_nope, k_rope, norm_weight, eps, g: MLAGeometry, block_t):
    _check_write(op, arena, v2p, virt_loc, kv_nope, k_rope, norm_weight, eps, g)
    check_kernel_device(op, arena.device)
    t = virt_loc.shape[0]
    if t == 0:
        return
    bt = _block_t(t) if block_t is None else block_t
    if bt <= 0 or bt & (bt - 1):
        raise ValueError(f"{op}: block_t must be a power of two, got {bt}")
    # An input read from the arena itself (rows copied between pages): each program reads its source rows
    # while other programs store, so a source overlapping a written row would race. Such inputs are copied
    # first, which gives the reference's semantics (every input read before anything is stored).
    kv_nope, k_rope, norm_weight = (
        x.clone() if x is not None and overlaps_arena(x, arena) else x for x in (kv_nope, k_rope, norm_weight))
    layer, layer_num, page_size, kv_lora_rank, qk_rope_head_dim, kv_dtype = g.args()
    r_p2 = triton.next_power_of_2(kv_lora_rank)
    norm = norm_weight is not None
    prod = torch.promote_types(norm_weight.dtype, kv_nope.dtype) if norm else kv_nope.dtype
    common = dict(R=kv_lora_rank, DR=qk_rope_head_dim, R_P2=r_p2, DR_P2=triton.next_power_of_2(qk_rope_head_dim),
                  BLOCK_T=bt, NORM=norm, IN_DTYPE=TL_DTYPES[kv_nope.dtype], PROD_DTYPE=TL_DTYPES[prod])
    args = (v2p, virt_loc.contiguous(), kv_nope, k_rope, norm_weight if norm else kv_nope,
            t, v2p.numel(), layer, layer_num, page_size, kv_nope.stride(0), k_rope.stride(0), float(eps))
    if g.quantized:
        fmt = g.row_format
        rows = arena[: arena.numel() // g.row_bytes * g.row_bytes]
        # ~16 bytes of input per thread per row segment, as below (the codes are 1 byte, the inputs not)
        warps = max(1, min(4, bt * r_p2 * kv_nope.element_size() // 512))
        _mla_kv_write_fp8_kernel[(triton.cdiv(t, bt),)](
            rows, rows.view(torch.float32), rows.view(torch.bfloat16), *args,
            TILE=min(FP8_TILE, r_p2), ROW_BYTES=fmt.row_bytes, SCALE_OFFSET=fmt.scale_offset,
            ROPE_OFFSET=fmt.rope_offset, ROPE_VEC=math.gcd(fmt.rope_offset // 2, 8), FP8_MAX=fmt.fp8_max,
            FNUZ=fp8.FNUZ[kv_dtype], **common, num_warps=warps,
        )
        return
    itemsize = kv_dtype.itemsize
    # ~16 bytes per thread per row segment: bf16 R=512 and one token -> 2 warps, 8 tokens -> 4 warps
    warps = max(1, min(4, bt * r_p2 * itemsize // 512))
    _mla_kv_write_kernel[(triton.cdiv(t, bt),)](
        typed_rows(arena, kv_dtype, g.row_width), *args, VEC=16 // itemsize, **common, num_warps=warps,
    )


def mla_kv_write_triton(
    arena: torch.Tensor, v2p: torch.Tensor, virt_loc: torch.Tensor, kv_nope: torch.Tensor, k_rope: torch.Tensor,
    *geometry, block_t: int | None = None,
) -> None:
    """Write latent rows into the arena with one Triton launch (the CUDA kernel of ``unimem::mla_kv_write``).

    Args:
        arena: uint8 ``[memory_budget]``, written in place (only the rows of live lanes; nothing else).
        v2p: int64 ``[num_pages]``, virtual page -> physical page (-1 = tombstone).
        virt_loc: int64 ``[T]``, virtual token locations ``virtual_page * page_size + offset``; < 0 = none.
        kv_nope: ``[T, R]`` bf16/fp16/fp32, last-dimension stride 1, any row stride (a slice of a wider
            tensor is read in place, never copied).
        k_rope: ``[T, Dr]``, same rules; its dtype may differ from ``kv_nope``'s.
        *geometry: the six values of :class:`~.geometry.MLAGeometry` (layer, layer_num, page_size,
            kv_lora_rank, qk_rope_head_dim, kv_dtype: the geometry G of docs/design.md section 4); values are
            cast to ``kv_dtype`` at the store (round to nearest even). An fp8 ``kv_dtype`` (e4m3fn or
            e4m3fnuz) writes scaled rows (:class:`~unimem_compile.pool.specs.MLARowFormat`): each 128-value
            tile of a latent row gets ``scale = max |x| / finfo(kv_dtype).max`` from the values written (0
            for a tile of zeros) and codes ``fp8(x / scale)``; the rope is rounded to bf16. Bit for bit
            the bytes of :func:`mla_kv_write_reference` (:func:`.fp8.quantize_rows`).
        block_t: tokens per program (a power of two); default chosen from T.

    Lanes write nothing when the location is < 0, past the table, tombstoned or on a physical page <= 0.
    Two live lanes with the same location: one of them wins, unspecified which. ``kv_nope`` / ``k_rope``
    may be views of ``arena`` itself (rows copied between locations): such inputs are copied before the
    launch, so the result is as if every input were read before anything is stored (the reference's
    semantics), whatever the rows overlap.

    Raises:
        TypeError: a wrong dtype. GeometryError: wrong ranks/sizes/strides or a geometry that does not fit
        the arena; under ``UNIMEM_DEBUG=1`` also for a location >= 0 that is not on a live page.
        ValueError: tensors on different devices, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _launch("mla_kv_write", arena, v2p, virt_loc, kv_nope, k_rope, None, 0.0, MLAGeometry(*geometry), block_t)


def mla_kv_write_rmsnorm_triton(
    arena: torch.Tensor, v2p: torch.Tensor, virt_loc: torch.Tensor, kv_nope_unnormed: torch.Tensor,
    k_rope: torch.Tensor, norm_weight: torch.Tensor, eps: float, *geometry, block_t: int | None = None,
) -> None:
    """:func:`mla_kv_write_triton` of ``rmsnorm_reference(kv_nope_unnormed, norm_weight, eps)``, in one launch.

    ``norm_weight``: ``[R]`` bf16/fp16/fp32, contiguous; ``eps`` >= 0. The norm follows transformers
    (see :func:`rmsnorm_reference`): fp32 mean of squares, rsqrt, rounding to the input dtype, multiply by
    the weight in ``promote_types(weight, input)``, then the cast to ``kv_dtype``. It can differ from the
    eager module in the last bit of the fp32 statistics (sum order), rarely visible after rounding.
    Errors as :func:`mla_kv_write_triton`, plus ValueError for a negative eps.
    """
    _launch("mla_kv_write_rmsnorm", arena, v2p, virt_loc, kv_nope_unnormed, k_rope, norm_weight, eps,
            MLAGeometry(*geometry), block_t)


# ---------------------------------------------------------------------------- declarations
@torch.library.custom_op("unimem::mla_kv_write", mutates_args=("arena",))
def mla_kv_write(
    arena: torch.Tensor, v2p: torch.Tensor, virt_loc: torch.Tensor, kv_nope: torch.Tensor, k_rope: torch.Tensor,
    layer: int, layer_num: int, page_size: int, kv_lora_rank: int, qk_rope_head_dim: int, kv_dtype: torch.dtype,
) -> None:
    """Write ``[kv_nope | k_rope]`` (``[T, R]``, ``[T, Dr]``) of layer ``layer`` at virtual locations
    ``virt_loc`` (int64 ``[T]``) into the uint8 ``arena``, cast to ``kv_dtype``. See
    :func:`mla_kv_write_triton` for every argument, the masking rules and the errors. The default
    implementation is the plain-torch reference; CUDA tensors run the Triton kernel."""
    g = MLAGeometry(layer, layer_num, page_size, kv_lora_rank, qk_rope_head_dim, kv_dtype)
    _check_write("mla_kv_write", arena, v2p, virt_loc, kv_nope, k_rope, None, 0.0, g)
    mla_kv_write_reference(arena, v2p, virt_loc, kv_nope, k_rope, *g.args())


@mla_kv_write.register_kernel("cuda")
def _(arena, v2p, virt_loc, kv_nope, k_rope, *geometry):
    mla_kv_write_triton(arena, v2p, virt_loc, kv_nope, k_rope, *geometry)


@mla_kv_write.register_fake
def _(arena, v2p, virt_loc, kv_nope, k_rope, *geometry):
    check_same_device("mla_kv_write", arena=arena, v2p=v2p, virt_loc=virt_loc, kv_nope=kv_nope, k_rope=k_rope)
    return None


@torch.library.custom_op("unimem::mla_kv_write_rmsnorm", mutates_args=("arena",))
def mla_kv_write_rmsnorm(
    arena: torch.Tensor, v2p: torch.Tensor, virt_loc: torch.Tensor, kv_nope_unnormed: torch.Tensor,
    k_rope: torch.Tensor, norm_weight: torch.Tensor, eps: float, layer: int, layer_num: int, page_size: int,
    kv_lora_rank: int, qk_rope_head_dim: int, kv_dtype: torch.dtype,
) -> None:
    """:func:`mla_kv_write` of ``rmsnorm_reference(kv_nope_unnormed, norm_weight, eps)`` (the model's
    ``kv_a_layernorm``), fused into the write. See :func:`mla_kv_write_rmsnorm_triton`."""
    g = MLAGeometry(layer, layer_num, page_size, kv_lora_rank, qk_rope_head_dim, kv_dtype)
    _check_write("mla_kv_write_rmsnorm", arena, v2p, virt_loc, kv_nope_unnormed, k_rope, norm_weight, eps, g)
    mla_kv_write_reference(arena, v2p, virt_loc, rmsnorm_reference(kv_nope_unnormed, norm_weight, eps), k_rope,
                           *g.args())


@mla_kv_write_rmsnorm.register_kernel("cuda")
def _(arena, v2p, virt_loc, kv_nope_unnormed, k_rope, norm_weight, eps, *geometry):
    mla_kv_write_rmsnorm_triton(arena, v2p, virt_loc, kv_nope_unnormed, k_rope, norm_weight, eps, *geometry)


@mla_kv_write_rmsnorm.register_fake
def _(arena, v2p, virt_loc, kv_nope_unnormed, k_rope, norm_weight, eps, *geometry):
    check_same_device("mla_kv_write_rmsnorm", arena=arena, v2p=v2p, virt_loc=virt_loc,
                      kv_nope_unnormed=kv_nope_unnormed, k_rope=k_rope, norm_weight=norm_weight)
    return None
