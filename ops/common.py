"""What every op family shares: launcher input checks, UNIMEM_DEBUG id checks, views of the arena, the MLA
row translation, and how ops are declared.

The helpers more than one op module uses live here, never in one op's module (so no op module imports a
sibling for a helper): the checks, the typed views of the uint8 arena (:func:`typed_arena` for the state
ops, :func:`typed_rows` / :func:`arena_rows` for MLA rows) and :func:`latent_rows` (virtual token
locations -> arena rows, the reference translation every MLA op's pure-torch path uses).

How an op is declared (every module in this package follows it):

* ``torch.library.custom_op("unimem::<name>", mutates_args=...)`` whose default implementation is the
  pure-torch reference (so CPU tensors, and any device without a kernel, run the reference);
* ``<op>.register_kernel("cuda", <launcher>)``: CUDA tensors run the Triton kernel through its launcher;
* ``<op>.register_fake``: shapes/strides identical to the real results (Inductor asserts this); it also
  checks that the tensors share one device, because a call mixing a ``meta`` tensor with real ones
  dispatches to the fake impl and would otherwise return uninitialised memory without an error;
* the launcher ``<name>_triton`` is public and also runs CPU tensors under ``TRITON_INTERPRET=1`` (how the
  tests exercise kernels without a GPU). ``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is
  defined, i.e. at import: set it before importing ``unimem_compile``.

* a state op (one that reads or writes sections of state slots) declares its :class:`SlotFootprint` with
  :func:`declare_slot_footprint` next to its declaration: which argument is the section's offset inside a
  slot and how many bytes the section has, so the graph passes can tell which calls touch which bytes
  without knowing each op.

A mutating op returns None and never aliases an input in its result (AOT functionalises it and Inductor
re-inplaces it). Launchers check dtype, device, rank and trailing sizes always, and ids against the live
set when ``UNIMEM_DEBUG=1`` (costs a device sync; read through :func:`unimem_compile.env.debug`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from unimem_compile import env
from unimem_compile.errors import GeometryError
from unimem_compile.pool import translate as ref
from unimem_compile.pool.specs import COMPUTE_DTYPES, KERNEL_KV_DTYPES

from .geometry import MLAGeometry

#: ``torch.library.custom_op`` tags of an op whose launcher plans its kernel launches on the host from the
#: values it is given (``mla_prefill``: pieces and splits from the row lengths; ``kda_chunk`` /
#: ``kda_prefill``: a replay of their own captured graph per chunk bucket): ``torch.Tag.cudagraph_unsafe``,
#: so that Inductor's CUDA graphs (``UNIMEM_PREFILL_GRAPHS``) partition the graph around them and run them
#: eagerly between the captured parts instead of baking one call's plan into a graph. Empty on a torch
#: without that tag (such ops then stay inside a capture: do not CUDA-graph prefills there).
HOST_PLANNED: tuple = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()

__all__ = [
    "HOST_PLANNED",
    "COMPUTE_DTYPES",
    "KERNEL_KV_DTYPES",
    "FLOAT_INPUT_DTYPES",
    "SLOT_ARGUMENTS",
    "SlotFootprint",
    "SLOT_FOOTPRINTS",
    "declare_slot_footprint",
    "check_tensor",
    "check_same_device",
    "check_mla_geometry",
    "check_slot_geometry",
    "check_knob",
    "device_sms",
    "check_live_locations",
    "check_live_page_table",
    "check_live_slots",
    "check_slot_ids",
    "check_kernel_device",
    "typed_arena",
    "typed_rows",
    "arena_rows",
    "latent_rows",
]

#: The float inputs the linear-attention ops take: :data:`COMPUTE_DTYPES`, widest first in their messages.
FLOAT_INPUT_DTYPES = COMPUTE_DTYPES[::-1]

#: The arguments through which every state op addresses slots, by schema name: the arena, the virtual ->
#: physical slot table, the lanes' virtual slots and the slot pitch in bytes.
SLOT_ARGUMENTS = ("arena", "s_v2p", "slot_ids", "slot_bytes")


@dataclasses.dataclass(frozen=True)
class SlotFootprint:
    """The bytes of each lane's state slot that one call of a state op reads or writes.

    The section is ``[arguments[offset], arguments[offset] + nbytes(arguments))`` of every slot the call's
    :data:`SLOT_ARGUMENTS` address.

    Attributes:
        offset: the schema name of the argument holding the section's byte offset inside a slot.
        nbytes: the section's size in bytes from the call's arguments bound by schema name, where a tensor
            argument is a tensor (a fake one inside a graph) or None when its value is unknown; returns
            None when it cannot tell (callers then assume the worst).
    """

    offset: str
    nbytes: Callable[[Mapping[str, Any]], int | None]


#: ``"unimem::<op>"`` -> the op's :class:`SlotFootprint`, for every state op (filled as the op modules load).
SLOT_FOOTPRINTS: dict[str, SlotFootprint] = {}


def declare_slot_footprint(qualified_name: str, offset: str, nbytes: Callable[[Mapping[str, Any]], int | None]) -> None:
    """Declare the state op ``qualified_name`` (``"unimem::state_gather"``) and its :class:`SlotFootprint`."""
    SLOT_FOOTPRINTS[qualified_name] = SlotFootprint(offset, nbytes)


def check_tensor(
    op: str,
    name: str,
    t: torch.Tensor,
    *,
    dtype: torch.dtype | Iterable[torch.dtype] | None = None,
    dim: int | None = None,
    shape: tuple[int | None, ...] | None = None,
    contiguous: bool = False,
) -> None:
    """Raise a specific error if ``t`` is not what ``op`` needs.

    ``shape`` entries of None match any size. Raises TypeError for a wrong type or dtype and
    GeometryError (a ValueError) for a wrong rank, size or layout; messages name the op, the argument and
    both the expected and actual values.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            raise TypeError(f"{op}: {name} must be {' or '.join(map(str, allowed))}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise GeometryError(f"{op}: {name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(e is not None and e != a for e, a in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            raise GeometryError(f"{op}: {name} must have shape {want}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise GeometryError(f"{op}: {name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")


def check_same_device(op: str, **tensors: torch.Tensor | None) -> torch.device:
    """All given tensors on one device; returns it. ValueError naming the odd one out otherwise."""
    device = None
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first} is on {device}")
    assert device is not None
    return device


def check_mla_geometry(op: str, arena: torch.Tensor, v2p: torch.Tensor, geometry: MLAGeometry) -> None:
    """Check the MLA geometry tail G (:class:`~.geometry.MLAGeometry`) against the arena and the page table size.

    Rows are ``geometry.row_bytes`` bytes (``(R + Dr) * itemsize``, or the padded scaled row of an fp8
    ``kv_dtype``, :class:`~unimem_compile.pool.specs.MLARowFormat`).

    Raises GeometryError if a size is not positive, ``layer`` is outside ``[0, layer_num)``, a row is
    not a multiple of 16 bytes, ``len(v2p)`` page envelopes plus the dense-view tail pad do not fit in
    the arena (the message gives the bytes needed) or the arena holds a different number of pages of this
    geometry than ``len(v2p)`` (a page size, layer count or dtype that disagrees with the pool), the arena
    starts at a byte of its storage that is not a multiple of the kv_dtype's size (4 for fp8 rows: their
    scales are read as fp32), or the arena or v2p is not contiguous (kernels index both from their base
    pointer); TypeError for a kv_dtype the kernels cannot read (not in ``KERNEL_KV_DTYPES``, e.g. e5m2).
    """
    check_tensor(op, "arena", arena, dtype=torch.uint8, dim=1, contiguous=True)
    check_tensor(op, "v2p", v2p, dtype=torch.int64, dim=1, contiguous=True)
    layer, layer_num, page_size, kv_lora_rank, qk_rope_head_dim, kv_dtype = geometry.args()
    if kv_dtype not in KERNEL_KV_DTYPES:
        raise TypeError(f"{op}: kv_dtype must be one of {KERNEL_KV_DTYPES}, got {kv_dtype}")
    for name, value in (("layer_num", layer_num), ("page_size", page_size), ("kv_lora_rank", kv_lora_rank),
                        ("qk_rope_head_dim", qk_rope_head_dim)):
        if value <= 0:
            raise GeometryError(f"{op}: {name} must be positive, got {value}")
    if not 0 <= layer < layer_num:
        raise GeometryError(f"{op}: layer {layer} is outside [0, {layer_num})")
    # the ops view the arena as kv_dtype elements; fp8 rows also as fp32 scales and bf16 rope values
    isz = 4 if geometry.quantized else torch.empty((), dtype=kv_dtype).element_size()
    if arena.storage_offset() % isz:
        raise GeometryError(f"{op}: the arena starts at byte {arena.storage_offset()} of its storage, not a "
                            f"multiple of {isz} bytes ({kv_dtype}): it cannot be read as {kv_dtype} rows")
    row = geometry.row_bytes
    if row % 16:
        raise GeometryError(f"{op}: a row of {kv_lora_rank + qk_rope_head_dim} x {isz} bytes is not a multiple of 16")
    page_bytes = page_size * layer_num * row
    need = v2p.numel() * page_bytes + (layer_num - 1) * page_size * row
    if arena.numel() < need:
        raise GeometryError(
            f"{op}: {v2p.numel()} pages of {page_bytes} bytes plus the tail pad need {need} "
            f"arena bytes, the arena has {arena.numel()}"
        )
    # a pool's arena holds exactly len(v2p) pages plus a one-page tail pad (docs/design.md section 3): a smaller
    # page (half the page size, fewer layers, a narrower dtype) still fits, but every row lands elsewhere
    holds = arena.numel() // page_bytes - 1
    if holds != v2p.numel():
        raise GeometryError(
            f"{op}: an arena of {arena.numel()} bytes holds {holds} pages of {page_bytes} bytes (page_size "
            f"{page_size}, layer_num {layer_num}, kv_lora_rank {kv_lora_rank}, qk_rope_head_dim {qk_rope_head_dim}, "
            f"{kv_dtype}) plus the tail pad, but v2p has {v2p.numel()} entries: the geometry disagrees with the pool"
        )


def overlaps_arena(x: torch.Tensor, arena: torch.Tensor) -> bool:
    """Whether the bytes ``x`` reads may overlap the arena's (the same device and overlapping address ranges:
    a view of the arena, or another tensor over the same memory, e.g. from DLPack). Conservative: the
    whole span from ``x``'s first to last element counts."""
    if x.device != arena.device or x.numel() == 0 or arena.numel() == 0:
        return False
    start = x.data_ptr()
    end = start + (sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1) * x.element_size()
    a_start = arena.data_ptr()
    a_end = a_start + arena.numel() * arena.element_size()
    return start < a_end and a_start < end


def check_slot_geometry(op: str, arena: torch.Tensor, s_v2p: torch.Tensor, byte_offset: int, nbytes: int,
                        slot_bytes: int, align: int = 16) -> None:
    """Check a state section ``[byte_offset, byte_offset + nbytes)`` of a slot of pitch ``slot_bytes``.

    Raises GeometryError when the arena does not start 16-byte aligned in its storage, the pitch is not
    positive or not 16-byte aligned, the section is misaligned
    or does not lie inside the slot, ``len(s_v2p)`` slots do not fit in the arena, or the arena or s_v2p
    is not contiguous (kernels index both from their base pointer).
    """
    check_tensor(op, "arena", arena, dtype=torch.uint8, dim=1, contiguous=True)
    check_tensor(op, "s_v2p", s_v2p, dtype=torch.int64, dim=1, contiguous=True)
    if arena.storage_offset() % align:
        raise GeometryError(f"{op}: the arena must start {align}-byte aligned; it is a view starting at byte "
                            f"{arena.storage_offset()} of its storage")
    if slot_bytes <= 0 or slot_bytes % align:
        raise GeometryError(f"{op}: slot_bytes must be a positive multiple of {align}, got {slot_bytes}")
    if byte_offset < 0 or byte_offset % align:
        raise GeometryError(f"{op}: byte_offset must be a non-negative multiple of {align}, got {byte_offset}")
    if byte_offset + nbytes > slot_bytes:
        raise GeometryError(
            f"{op}: the section [{byte_offset}, {byte_offset + nbytes}) does not fit in a slot of {slot_bytes} bytes"
        )
    if s_v2p.numel() * slot_bytes > arena.numel():
        raise GeometryError(
            f"{op}: {s_v2p.numel()} slots of {slot_bytes} bytes need {s_v2p.numel() * slot_bytes} arena bytes, "
            f"the arena has {arena.numel()}"
        )


def check_knob(op: str, name: str, value, *, low: int = 1, power_of_two: bool = False) -> None:
    """A launcher's tuning knob (tiles, warps, stages, splits) is an int ``>= low``, and a power of two when
    ``power_of_two``. Raises ValueError naming the knob and the value given (a bool or float is refused)."""
    if (isinstance(value, bool) or not isinstance(value, int) or value < low
            or (power_of_two and value & (value - 1))):
        kind = f"a power of two >= {low}" if power_of_two else f"an int >= {low}"
        raise ValueError(f"{op}: {name} must be {kind}, got {value!r}")


def check_live_locations(op: str, v2p: torch.Tensor, virt: torch.Tensor, page_size: int) -> None:
    """(UNIMEM_DEBUG) every location >= 0 must be on a live virtual page (>= 1, mapped, in range).

    Raises GeometryError listing up to 8 offending lanes with their location and page.
    """
    flat = virt.reshape(-1).to(torch.int64)
    lanes = torch.nonzero(flat >= 0).reshape(-1)
    if lanes.numel() == 0:
        return
    vpage = flat[lanes] // page_size
    in_range = vpage < v2p.numel()
    ppage = torch.full_like(vpage, -1)
    ppage[in_range] = v2p[vpage[in_range]]
    bad = (~in_range) | (vpage == 0) | (ppage <= 0)
    if bool(bad.any()):
        idx = lanes[bad][:8].tolist()
        detail = ", ".join(f"lane {i}: location {int(flat[i])} (virtual page {int(flat[i]) // page_size})" for i in idx)
        raise GeometryError(f"{op}: {int(bad.sum())} locations are not on live pages: {detail}")


def check_live_page_table(op: str, v2p: torch.Tensor, page_table: torch.Tensor, kv_len: torch.Tensor,
                          page_size: int) -> None:
    """(UNIMEM_DEBUG) ``0 <= kv_len[b] <= P * page_size`` and every page-table column holding a token below
    ``kv_len[b]`` names a live virtual page (>= 1, in range, mapped).

    Raises GeometryError naming the first bad ``kv_len``, or up to 8 offending (row, page-table column)
    pairs with their virtual page ids.
    """
    P = page_table.shape[1]
    lens = kv_len.to(torch.int64)
    bad_len = torch.nonzero((lens < 0) | (lens > P * page_size)).reshape(-1)
    if bad_len.numel():
        b = int(bad_len[0])
        raise GeometryError(f"{op}: kv_len[{b}] = {int(lens[b])} is outside [0, {P} pages x {page_size} tokens]")
    used = torch.arange(P, device=page_table.device)[None, :] < (lens[:, None] + page_size - 1) // page_size
    vpage = page_table.to(torch.int64)
    in_range = (vpage >= 1) & (vpage < v2p.numel())
    ppage = torch.where(in_range, v2p[vpage.clamp(0, v2p.numel() - 1)], -1)
    bad = torch.nonzero(used & (ppage <= 0))
    if bad.numel():
        detail = ", ".join(f"row {int(b)} page slot {int(j)}: virtual page {int(page_table[b, j])}"
                           for b, j in bad[:8].tolist())
        raise GeometryError(f"{op}: {bad.shape[0]} pages inside kv_len are not live: {detail}")


def check_live_slots(op: str, s_v2p: torch.Tensor, slot_ids: torch.Tensor) -> None:
    """(UNIMEM_DEBUG) every slot id >= 0 must be a live virtual slot (>= 1, mapped, in range)."""
    flat = slot_ids.reshape(-1).to(torch.int64)
    lanes = torch.nonzero(flat >= 0).reshape(-1)
    if lanes.numel() == 0:
        return
    ids = flat[lanes]
    in_range = ids < s_v2p.numel()
    phys = torch.full_like(ids, -1)
    phys[in_range] = s_v2p[ids[in_range]]
    bad = (~in_range) | (ids == 0) | (phys <= 0)
    if bool(bad.any()):
        idx = lanes[bad][:8].tolist()
        raise GeometryError(
            f"{op}: {int(bad.sum())} slot ids are not live: " + ", ".join(f"lane {i}: slot {int(flat[i])}" for i in idx)
        )


def check_slot_ids(op: str, s_v2p: torch.Tensor, slot_ids: torch.Tensor, batch: int | None = None) -> None:
    """``slot_ids`` must be int64 ``[B]`` (``B = batch`` when given; ValueError otherwise). Under
    ``UNIMEM_DEBUG=1`` also every id >= 0 must be live (GeometryError listing the offenders) and the live ids
    distinct (ValueError listing the repeated ids)."""
    check_tensor(op, "slot_ids", slot_ids, dtype=torch.int64, dim=1)
    if batch is not None and slot_ids.shape[0] != batch:
        raise ValueError(f"{op}: slot_ids has {slot_ids.shape[0]} lanes but the inputs have batch {batch}")
    if env.debug():
        check_live_slots(op, s_v2p, slot_ids)
        live = slot_ids[slot_ids >= 0]
        uniq, counts = torch.unique(live, return_counts=True)
        if bool((counts > 1).any()):
            dup = uniq[counts > 1][:8].tolist()
            raise ValueError(f"{op}: slot ids {dup} appear in more than one lane; lanes writing one slot race")


def check_kernel_device(op: str, device: torch.device) -> None:
    """A Triton launcher runs CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``; ValueError naming the
    device otherwise."""
    if device.type != "cuda" and not env.triton_interpret():
        raise ValueError(f"{op}: the Triton launcher needs CUDA tensors or TRITON_INTERPRET=1, got {device}")


# ---------------------------------------------------------------------------- views of the arena
def typed_arena(arena: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The uint8 arena seen as ``dtype`` elements (a view at the same address; a trailing partial element is
    left out). Kernels take this view, so every offset is in elements and its 16-byte alignment is visible
    to Triton's vectorisation."""
    isz = torch.empty((), dtype=dtype).element_size()
    return arena[: arena.numel() // isz * isz].view(dtype)


def typed_rows(arena: torch.Tensor, kv_dtype: torch.dtype, row_width: int) -> torch.Tensor:
    """The arena as ``[n_rows, row_width]`` rows of ``kv_dtype`` counted from byte 0 (a view, no copy;
    trailing bytes that do not fill a row are left out)."""
    row_bytes = row_width * torch.empty((), dtype=kv_dtype).element_size()
    n = arena.numel() // row_bytes
    return arena[: n * row_bytes].view(kv_dtype).view(n, row_width)


def arena_rows(arena: torch.Tensor, g: MLAGeometry) -> torch.Tensor:
    """The arena as the geometry's rows counted from byte 0 (a view): ``[n_rows, R + Dr]`` of ``kv_dtype``,
    or ``[n_rows, row_bytes]`` uint8 for fp8 rows."""
    if not g.quantized:
        return typed_rows(arena, g.kv_dtype, g.row_width)
    n = arena.numel() // g.row_bytes
    return arena[: n * g.row_bytes].view(n, g.row_bytes)


def latent_rows(v2p: torch.Tensor, loc: torch.Tensor, layer: int, layer_num: int, page_size: int):
    """Arena row ids of virtual token locations in one MLA layer, with the lanes that hold a row.

    Args:
        v2p: int64 ``[num_pages]``.
        loc: int64, any shape: virtual token locations (< 0 = none).

    Returns:
        ``(rows, live)``: int64 and bool of ``loc``'s shape; ``rows`` is
        ``translate_kv_loc_dense(v2p, loc, ps, L) + layer * ps`` where ``live`` and 0 elsewhere. ``live``
        is False for negative locations, virtual pages past ``v2p`` and physical pages <= 0 (tombstones and
        the sink: a location on virtual page 0 maps into the sink and must be masked, not just one whose
        dense id is 0).
    """
    in_table = torch.div(loc, page_size, rounding_mode="floor") < v2p.numel()
    loc = torch.where(in_table, loc, -1)
    phys = ref.translate_kv_loc(v2p, loc, page_size)
    live = phys >= page_size  # physical page >= 1
    dense = ref.translate_kv_loc_dense(v2p, loc, page_size, layer_num) + layer * page_size
    return torch.where(live, dense, 0), live


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device, interpreter_sms: int) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (``multi_processor_count``, cached per device index; the
    current device when ``device.index`` is None); ``interpreter_sms`` for any other device, so that CPU and
    interpreter runs take the same grid rules as a GPU of that many SMs (each kernel module names its own count)."""
    if device.type != "cuda":
        return interpreter_sms
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
