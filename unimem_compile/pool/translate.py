"""Id translation in plain torch: virtual token locations -> physical or dense (kernel) rows.

The one place the formulas of docs/design.md section 3 live; the custom ops in ``unimem_compile.ops`` use
these as their references and the Triton kernels compute the same expression inline.

* physical token: ``v2p[t // ps] * ps + t % ps``
* dense token:    ``v2p[t // ps] * (ps * kernel_page_multiplier) + t % ps``; the row of MLA layer ``l``
  is ``dense + l * ps`` (``kernel_page_multiplier = L`` for MLA).
* an id ``t < 0`` is the sink BEFORE any division (floor division would turn ``t = -1`` into page -1,
  which wraps to the last page), and a virtual page whose ``v2p`` entry is -1 (a tombstone: freed or
  never allocated) is the sink too: both translate to 0.
"""

from __future__ import annotations

import torch

__all__ = ["translate_kv_loc", "translate_kv_loc_dense", "translate_slot"]


def _check(v2p: torch.Tensor, virt: torch.Tensor, out: torch.Tensor | None) -> None:
    if v2p.dtype != torch.int64 or virt.dtype != torch.int64:
        raise TypeError(f"v2p and virt must be int64, got {v2p.dtype} and {virt.dtype}")
    if v2p.dim() != 1:
        raise ValueError(f"v2p must be 1-D, got shape {tuple(v2p.shape)}")
    if v2p.device != virt.device:
        raise ValueError(f"v2p is on {v2p.device} but virt is on {virt.device}")
    if out is not None:
        if out.dtype != torch.int64 or out.shape != virt.shape or out.device != virt.device:
            raise ValueError(
                f"out must be int64 of shape {tuple(virt.shape)} on {virt.device}, "
                f"got {out.dtype} {tuple(out.shape)} on {out.device}"
            )


def translate_kv_loc_dense(
    v2p: torch.Tensor,
    virt: torch.Tensor,
    page_size: int,
    kernel_page_multiplier: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Translate virtual token locations to dense row ids.

    Args:
        v2p: int64 ``[num_pages]``, virtual page -> physical page (-1 = tombstone).
        virt: int64, any shape: virtual token locations ``virtual_page * page_size + offset``; < 0 = none.
        page_size: tokens per page.
        kernel_page_multiplier: rows per token slot of a page envelope (L for MLA; 1 gives physical ids).
        out: optional int64 tensor of ``virt``'s shape to write into. It may be ``virt`` itself: the
            result is computed in full before it is written, and ``out`` keeps its address.

    Returns:
        int64 of ``virt``'s shape (``out`` when given): dense ids, 0 (the sink) for negative ids and
        tombstoned pages.

    Raises:
        TypeError / ValueError: wrong dtypes, ranks or devices. Ids past the table are an IndexError
        from the lookup (checked, never wrapped).
    """
    _check(v2p, virt, out)
    valid = virt >= 0
    safe = torch.where(valid, virt, 0)
    vpage = torch.div(safe, page_size, rounding_mode="floor")
    if vpage.numel() and int(vpage.max()) >= v2p.numel():
        raise IndexError(f"virtual page {int(vpage.max())} is out of range for v2p of {v2p.numel()} pages")
    ppage = v2p[vpage]
    valid = valid & (ppage >= 0)
    dense = ppage * (page_size * kernel_page_multiplier) + (safe - vpage * page_size)
    result = torch.where(valid, dense, 0)
    if out is None:
        return result
    out.copy_(result)
    return out


def translate_kv_loc(
    v2p: torch.Tensor, virt: torch.Tensor, page_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Translate virtual token locations to physical token ids ``v2p[t // ps] * ps + t % ps``.

    Same contract as :func:`translate_kv_loc_dense` with ``kernel_page_multiplier = 1``.
    """
    return translate_kv_loc_dense(v2p, virt, page_size, 1, out)


def translate_slot(s_v2p: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """Virtual slot ids -> physical slot ids; negative ids and tombstones (-1 in ``s_v2p``) give 0.

    Args:
        s_v2p: int64 ``[num_slots]``.
        slot_ids: int64, any shape.

    Returns:
        int64 of ``slot_ids``' shape.
    """
    _check(s_v2p, slot_ids, None)
    valid = slot_ids >= 0
    safe = torch.where(valid, slot_ids, 0)
    if safe.numel() and int(safe.max()) >= s_v2p.numel():
        raise IndexError(f"slot id {int(safe.max())} is out of range for s_v2p of {s_v2p.numel()} slots")
    phys = s_v2p[safe]
    return torch.where(valid & (phys >= 0), phys, 0)
