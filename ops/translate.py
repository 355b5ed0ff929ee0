"""Ops ``unimem::translate_kv_loc(_out)`` and ``unimem::translate_kv_loc_dense(_out)``.

Virtual token locations -> physical / dense row ids (formulas in ``unimem_compile.pool.translate``, which
is the reference). Negative ids, ids on pages past the table and tombstoned pages give 0, the sink (the
host reference alone raises IndexError for ids past the table). The ``_out`` forms write into a
given int64 tensor, which may be the input itself, and keep its address (for CUDA graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unimem_compile import env
from unimem_compile.pool import translate as ref

from .common import check_live_locations, check_same_device, check_tensor

__all__ = [
    "translate_kv_loc",
    "translate_kv_loc_out",
    "translate_kv_loc_dense",
    "translate_kv_loc_dense_out",
    "translate_kv_loc_dense_triton",
]


@triton.jit
def _translate_kernel(v2p_ptr, virt_ptr, out_ptr, n, num_pages, page_size, multiplier, BLOCK: tl.constexpr):
    # one program translates BLOCK consecutive locations; each lane reads its own virt[i] before writing
    # out[i], so out may alias virt
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_n = offs < n
    virt = tl.load(virt_ptr + offs, mask=in_n, other=-1)
    valid = virt >= 0
    safe = tl.where(valid, virt, 0)  # negative ids are the sink BEFORE any division
    vpage = safe // page_size
    valid = valid & (vpage < num_pages)
    ppage = tl.load(v2p_ptr + vpage, mask=in_n & valid, other=-1)  # masked before indexing the table
    valid = valid & (ppage >= 0)
    dense = ppage * (page_size * multiplier) + (safe - vpage * page_size)
    tl.store(out_ptr + offs, tl.where(valid, dense, 0), mask=in_n)


def _check(op: str, v2p: torch.Tensor, virt: torch.Tensor, page_size: int, multiplier: int, out) -> None:
    check_tensor(op, "v2p", v2p, dtype=torch.int64, dim=1, contiguous=True)
    check_tensor(op, "virt", virt, dtype=torch.int64)
    if out is not None:
        check_tensor(op, "out", out, dtype=torch.int64, shape=tuple(virt.shape))
    check_same_device(op, v2p=v2p, virt=virt, out=out)
    if page_size <= 0 or multiplier <= 0:
        raise ValueError(f"{op}: page_size ({page_size}) and kernel_page_multiplier ({multiplier}) must be positive")
    if env.debug():
        check_live_locations(op, v2p, virt, page_size)


def translate_kv_loc_dense_triton(
    v2p: torch.Tensor, virt: torch.Tensor, page_size: int, kernel_page_multiplier: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launcher of the translation (one launch, 1024 lanes per program).

    Args and result as :func:`unimem_compile.pool.translate.translate_kv_loc_dense`: ``v2p`` int64
    ``[num_pages]``, ``virt`` int64 of any shape (non-contiguous inputs are copied), ``out`` int64 of
    ``virt``'s shape, may be ``virt``. Locations past the table are treated as the sink by the kernel and
    reported as a GeometryError under ``UNIMEM_DEBUG=1``.
    """
    op = "translate_kv_loc_dense"
    _check(op, v2p, virt, page_size, kernel_page_multiplier, out)
    src = virt.contiguous()
    dst = out if out is not None and out.is_contiguous() else torch.empty_like(src)
    n = src.numel()
    if n:
        block = 1024
        _translate_kernel[(triton.cdiv(n, block),)](
            v2p, src, dst, n, v2p.numel(), page_size, kernel_page_multiplier, BLOCK=block
        )
    if out is not None and dst is not out:
        out.copy_(dst)
        return out
    return dst


# ---------------------------------------------------------------------------- declarations
def _past_table_to_none(v2p: torch.Tensor, virt: torch.Tensor, page_size: int) -> torch.Tensor:
    """``virt`` with locations on pages past ``v2p`` replaced by -1, so the plain-torch path gives them the
    sink (0) as the Triton kernel does, instead of the host reference's IndexError. A new tensor only when
    one is past the table (``virt`` may also be the ``_out`` target)."""
    past = virt >= v2p.numel() * page_size
    return torch.where(past, -1, virt) if bool(past.any()) else virt


@torch.library.custom_op("unimem::translate_kv_loc_dense", mutates_args=())
def translate_kv_loc_dense(v2p: torch.Tensor, virt: torch.Tensor, page_size: int, kernel_page_multiplier: int) -> torch.Tensor:
    """Dense row ids ``v2p[t // ps] * (ps * kernel_page_multiplier) + t % ps`` (int64, ``virt``'s shape,
    contiguous); 0 for negative ids, ids past the table and tombstoned pages (a GeometryError for ids >= 0
    that are not on live pages under ``UNIMEM_DEBUG=1``, as in the launcher). See
    ``unimem_compile.pool.translate``."""
    _check("translate_kv_loc_dense", v2p, virt, page_size, kernel_page_multiplier, None)
    return ref.translate_kv_loc_dense(v2p, _past_table_to_none(v2p, virt, page_size), page_size,
                                     kernel_page_multiplier).contiguous()


@translate_kv_loc_dense.register_kernel("cuda")
def _(v2p, virt, page_size, kernel_page_multiplier):
    return translate_kv_loc_dense_triton(v2p, virt, page_size, kernel_page_multiplier)


@translate_kv_loc_dense.register_fake
def _(v2p, virt, page_size, kernel_page_multiplier):
    check_same_device("translate_kv_loc_dense", v2p=v2p, virt=virt)
    return virt.new_empty(virt.shape)


@torch.library.custom_op("unimem::translate_kv_loc_dense_out", mutates_args=("out",))
def translate_kv_loc_dense_out(
    v2p: torch.Tensor, virt: torch.Tensor, page_size: int, kernel_page_multiplier: int, out: torch.Tensor
) -> None:
    """:func:`translate_kv_loc_dense` written into ``out`` (int64, ``virt``'s shape; may be ``virt``)."""
    _check("translate_kv_loc_dense_out", v2p, virt, page_size, kernel_page_multiplier, out)
    ref.translate_kv_loc_dense(v2p, _past_table_to_none(v2p, virt, page_size), page_size, kernel_page_multiplier,
                               out=out)


@translate_kv_loc_dense_out.register_kernel("cuda")
def _(v2p, virt, page_size, kernel_page_multiplier, out):
    translate_kv_loc_dense_triton(v2p, virt, page_size, kernel_page_multiplier, out=out)


@translate_kv_loc_dense_out.register_fake
def _(v2p, virt, page_size, kernel_page_multiplier, out):
    check_same_device("translate_kv_loc_dense_out", v2p=v2p, virt=virt, out=out)
    return None


@torch.library.custom_op("unimem::translate_kv_loc", mutates_args=())
def translate_kv_loc(v2p: torch.Tensor, virt: torch.Tensor, page_size: int) -> torch.Tensor:
    """Physical token ids ``v2p[t // ps] * ps + t % ps`` (int64, ``virt``'s shape); 0 for the sink."""
    _check("translate_kv_loc", v2p, virt, page_size, 1, None)
    return ref.translate_kv_loc(v2p, _past_table_to_none(v2p, virt, page_size), page_size).contiguous()


@translate_kv_loc.register_kernel("cuda")
def _(v2p, virt, page_size):
    return translate_kv_loc_dense_triton(v2p, virt, page_size, 1)


@translate_kv_loc.register_fake
def _(v2p, virt, page_size):
    check_same_device("translate_kv_loc", v2p=v2p, virt=virt)
    return virt.new_empty(virt.shape)


@torch.library.custom_op("unimem::translate_kv_loc_out", mutates_args=("out",))
def translate_kv_loc_out(v2p: torch.Tensor, virt: torch.Tensor, page_size: int, out: torch.Tensor) -> None:
    """:func:`translate_kv_loc` written into ``out`` (may be ``virt``)."""
    _check("translate_kv_loc_out", v2p, virt, page_size, 1, out)
    ref.translate_kv_loc(v2p, _past_table_to_none(v2p, virt, page_size), page_size, out=out)


@translate_kv_loc_out.register_kernel("cuda")
def _(v2p, virt, page_size, out):
    translate_kv_loc_dense_triton(v2p, virt, page_size, 1, out=out)


@translate_kv_loc_out.register_fake
def _(v2p, virt, page_size, out):
    check_same_device("translate_kv_loc_out", v2p=v2p, virt=virt, out=out)
    return None
