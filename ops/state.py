"""Ops ``unimem::state_gather`` and ``unimem::state_scatter``: one section of every addressed state slot.

A state slot holds, per linear-attention layer, a conv section and a recurrent section (docs/design.md
section 3). A *section* is ``shape`` elements of ``dtype`` at byte ``byte_offset`` inside the slot; virtual
slot ``s`` lives at physical slot ``s_v2p[s]``, i.e. at arena byte ``s_v2p[s] * slot_bytes + byte_offset``.
The pitch ``slot_bytes`` is the laid-out slot size, not the section size: every address is computed from
it in int64.

Masked lanes: a slot id < 0, past the table, tombstoned (``s_v2p[s] = -1``) or translating to the sink
(physical slot <= 0) reads zeros and writes nothing. Live slot ids in one call must be distinct (two lanes
writing one slot race); ``UNIMEM_DEBUG=1`` checks that and the live set.

The pure-torch references here (:func:`gather_sections`, :func:`scatter_sections`) are also the building
blocks of the conv and KDA references, which gather a state, update it and scatter it back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .common import (check_same_device, check_slot_geometry, check_slot_ids, check_tensor, declare_slot_footprint,
                     typed_arena)

__all__ = [
    "state_gather",
    "state_scatter",
    "state_gather_triton",
    "state_scatter_triton",
    "gather_sections",
    "scatter_sections",
    "live_lanes",
]


def _section_bytes(op: str, shape: Sequence[int], dtype: torch.dtype) -> int:
    if len(shape) == 0 or any(int(d) <= 0 for d in shape):
        raise ValueError(f"{op}: shape must be non-empty with positive sizes, got {list(shape)}")
    return math.prod(int(d) for d in shape) * torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------- pure-torch references
def live_lanes(s_v2p: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """Physical slot of each lane, 0 for masked lanes (id < 0, past the table, tombstone, or the sink).

    Args:
        s_v2p: int64 ``[num_slots]``. slot_ids: int64 ``[B]``.

    Returns:
        int64 ``[B]``; a lane is live iff its entry is > 0.
    """
    inside = (slot_ids >= 0) & (slot_ids < s_v2p.numel())
    phys = s_v2p[torch.where(inside, slot_ids, 0)]
    return torch.where(inside & (phys > 0), phys, 0)


def _section_view(arena: torch.Tensor, num_slots: int, byte_offset: int, slot_bytes: int,
                  shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``[num_slots, *shape]`` view of ``dtype`` over the arena; row ``p`` is physical slot ``p``'s section."""
    isz = torch.empty((), dtype=dtype).element_size()
    typed = typed_arena(arena, dtype)
    inner = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        inner[i] = inner[i + 1] * int(shape[i + 1])
    # as_strided's offset counts from the start of the storage: an arena that is a view into a larger
    # buffer starts typed.storage_offset() elements in
    return typed.as_strided((num_slots, *map(int, shape)), (slot_bytes // isz, *inner),
                            typed.storage_offset() + byte_offset // isz)


def gather_sections(arena: torch.Tensor, s_v2p: torch.Tensor, slot_ids: torch.Tensor, byte_offset: int,
                    slot_bytes: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Reference of :func:`state_gather`: a fresh contiguous ``dtype [B, *shape]``, zeros for masked lanes."""
    phys = live_lanes(s_v2p, slot_ids)
    view = _section_view(arena, s_v2p.numel(), byte_offset, slot_bytes, shape, dtype)
    out = view[phys]  # advanced indexing copies
    out[phys <= 0] = 0
    return out


def scatter_sections(arena: torch.Tensor, s_v2p: torch.Tensor, slot_ids: torch.Tensor, value: torch.Tensor,
                     byte_offset: int, slot_bytes: int) -> None:
    """Reference of :func:`state_scatter`: writes ``value[b]`` into lane b's section for live lanes only."""
    phys = live_lanes(s_v2p, slot_ids)
    keep = phys > 0
    view = _section_view(arena, s_v2p.numel(), byte_offset, slot_bytes, value.shape[1:], value.dtype)
    view[phys[keep]] = value[keep]


# ---------------------------------------------------------------------------- Triton kernel
@triton.jit
def _section_copy_kernel(words_ptr, s_v2p_ptr, slot_ptr, buf_ptr, num_slots, slot_words, offset_words, n_words,
                         ALIGN_WORDS: tl.constexpr, BLOCK: tl.constexpr, SCATTER: tl.constexpr):
    # program (lane, block) copies BLOCK words of one lane's section; the section is moved as 4/2/1-byte
    # words whatever its dtype, so the copy is bit-exact (and bf16 never meets interpreter arithmetic)
    lane = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < n_words
    sid = tl.load(slot_ptr + lane)
    ok = (sid >= 0) & (sid < num_slots)
    phys = tl.load(s_v2p_ptr + tl.where(ok, sid, 0), mask=ok, other=-1)  # masked before indexing the table
    ok = ok & (phys > 0)
    # a masked lane's row is cut to zero words (the interpreter mis-types `vector & scalar` bool masks)
    live = offs < tl.where(ok, n_words, 0)
    base = tl.multiple_of(tl.where(ok, phys, 0) * slot_words + offset_words, ALIGN_WORDS)
    buf = buf_ptr + lane * n_words + offs
    if SCATTER:
        val = tl.load(buf, mask=live)
        tl.store(words_ptr + base + offs, val, mask=live)
    else:
        val = tl.load(words_ptr + base + offs, mask=live, other=0)
        tl.store(buf, val, mask=in_row)


_WORD_DTYPES = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _word_bytes(nbytes: int) -> int:
    return 4 if nbytes % 4 == 0 else 2 if nbytes % 2 == 0 else 1


def _launch_copy(arena, s_v2p, slot_ids, words: torch.Tensor, byte_offset: int, slot_bytes: int, scatter: bool):
    b, n_words = words.shape
    if b == 0:
        return
    wb = words.element_size()
    block = min(4096, triton.next_power_of_2(n_words))
    grid = (b, triton.cdiv(n_words, block))
    # the kernel reads slot_ids[lane] from its base pointer: a strided id tensor is copied first
    _section_copy_kernel[grid](typed_arena(arena, words.dtype), s_v2p, slot_ids.contiguous(), words, s_v2p.numel(),
                               slot_bytes // wb, byte_offset // wb, n_words,
                               ALIGN_WORDS=16 // wb, BLOCK=block, SCATTER=scatter)


def _check_gather(op, arena, s_v2p, slot_ids, byte_offset, slot_bytes, shape, dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{op}: dtype must be a torch.dtype, got {dtype!r}")
    nbytes = _section_bytes(op, shape, dtype)
    check_slot_geometry(op, arena, s_v2p, byte_offset, nbytes, slot_bytes)
    check_same_device(op, arena=arena, s_v2p=s_v2p, slot_ids=slot_ids)
    check_slot_ids(op, s_v2p, slot_ids)
    return nbytes


def _check_scatter(op, arena, s_v2p, slot_ids, value, byte_offset, slot_bytes) -> int:
    check_tensor(op, "value", value)
    if value.dim() < 2:
        raise ValueError(f"{op}: value must be [B, *shape] with a non-empty shape, got {list(value.shape)}")
    nbytes = _section_bytes(op, value.shape[1:], value.dtype)
    check_slot_geometry(op, arena, s_v2p, byte_offset, nbytes, slot_bytes)
    check_same_device(op, arena=arena, s_v2p=s_v2p, slot_ids=slot_ids, value=value)
    check_slot_ids(op, s_v2p, slot_ids, value.shape[0])
    return nbytes


def state_gather_triton(arena: torch.Tensor, s_v2p: torch.Tensor, slot_ids: torch.Tensor, byte_offset: int,
                        slot_bytes: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Triton launcher of :func:`state_gather` (one program per lane and 4096-word block)."""
    nbytes = _check_gather("state_gather", arena, s_v2p, slot_ids, byte_offset, slot_bytes, shape, dtype)
    wb = _word_bytes(nbytes)
    out = torch.empty((slot_ids.shape[0], *map(int, shape)), dtype=dtype, device=arena.device)
    words = out.view(out.shape[0], math.prod(out.shape[1:])).view(torch.uint8).view(_WORD_DTYPES[wb])
    _launch_copy(arena, s_v2p, slot_ids, words, byte_offset, slot_bytes, scatter=False)
    return out


def state_scatter_triton(arena: torch.Tensor, s_v2p: torch.Tensor, slot_ids: torch.Tensor, value: torch.Tensor,
                         byte_offset: int, slot_bytes: int) -> None:
    """Triton launcher of :func:`state_scatter` (one program per lane and 4096-word block)."""
    nbytes = _check_scatter("state_scatter", arena, s_v2p, slot_ids, value, byte_offset, slot_bytes)
    wb = _word_bytes(nbytes)
    flat = value.contiguous().view(value.shape[0], math.prod(value.shape[1:]))
    words = flat.view(torch.uint8).view(_WORD_DTYPES[wb])
    _launch_copy(arena, s_v2p, slot_ids, words, byte_offset, slot_bytes, scatter=True)


# ---------------------------------------------------------------------------- declarations
@torch.library.custom_op("unimem::state_gather", mutates_args=())
def state_gather(arena: torch.Tensor, s_v2p: torch.Tensor, slot_ids: torch.Tensor, byte_offset: int,
                 slot_bytes: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Read one state section of every lane's slot.

    Args:
        arena: uint8 ``[memory_budget]``.
        s_v2p: int64 ``[num_slots]``, virtual slot -> physical slot (-1 = tombstone).
        slot_ids: int64 ``[B]`` virtual slot ids; < 0 = no slot.
        byte_offset: where the section starts inside a slot, in bytes (a multiple of 16).
        slot_bytes: the slot pitch in bytes (a multiple of 16; ``LinearStateSpec.slot_bytes``).
        shape, dtype: the section's element shape and dtype.

    Returns:
        a fresh contiguous ``dtype [B, *shape]``: lane b's section (physical slot ``s_v2p[slot_ids[b]]`` at
        arena byte ``phys * slot_bytes + byte_offset``), zeros for masked lanes.

    Raises:
        TypeError / GeometryError (a ValueError): wrong dtypes or ranks, a section that is misaligned or
        does not fit in the slot, or ``len(s_v2p)`` slots that do not fit in the arena; ValueError for an
        empty shape or, under ``UNIMEM_DEBUG=1``, dead or repeated slot ids.
    """
    _check_gather("state_gather", arena, s_v2p, slot_ids, byte_offset, slot_bytes, shape, dtype)
    return gather_sections(arena, s_v2p, slot_ids, byte_offset, slot_bytes, shape, dtype).contiguous()


@state_gather.register_kernel("cuda")
def _(arena, s_v2p, slot_ids, byte_offset, slot_bytes, shape, dtype):
    return state_gather_triton(arena, s_v2p, slot_ids, byte_offset, slot_bytes, shape, dtype)


@state_gather.register_fake
def _(arena, s_v2p, slot_ids, byte_offset, slot_bytes, shape, dtype):
    check_same_device("state_gather", arena=arena, s_v2p=s_v2p, slot_ids=slot_ids)
    return arena.new_empty((slot_ids.shape[0], *shape), dtype=dtype)


declare_slot_footprint("unimem::state_gather", offset="byte_offset",
                       nbytes=lambda a: math.prod(a["shape"]) * a["dtype"].itemsize)


@torch.library.custom_op("unimem::state_scatter", mutates_args=("arena",))
def state_scatter(arena: torch.Tensor, s_v2p: torch.Tensor, slot_ids: torch.Tensor, value: torch.Tensor,
                  byte_offset: int, slot_bytes: int) -> None:
    """Write ``value [B, *shape]`` (its dtype is the section's) into one section of every live lane's slot.

    Addressing and masking as :func:`state_gather`; masked lanes write nothing, and no arena byte outside
    the addressed sections changes. Raises as :func:`state_gather` (plus a batch mismatch between
    ``value`` and ``slot_ids``).
    """
    _check_scatter("state_scatter", arena, s_v2p, slot_ids, value, byte_offset, slot_bytes)
    scatter_sections(arena, s_v2p, slot_ids, value, byte_offset, slot_bytes)


@state_scatter.register_kernel("cuda")
def _(arena, s_v2p, slot_ids, value, byte_offset, slot_bytes):
    state_scatter_triton(arena, s_v2p, slot_ids, value, byte_offset, slot_bytes)


@state_scatter.register_fake
def _(arena, s_v2p, slot_ids, value, byte_offset, slot_bytes):
    check_same_device("state_scatter", arena=arena, s_v2p=s_v2p, slot_ids=slot_ids, value=value)
    return None


def _scattered_bytes(a) -> int | None:
    value = a["value"]  # [B, *section shape]
    return None if value is None else math.prod(value.shape[1:]) * value.element_size()


declare_slot_footprint("unimem::state_scatter", offset="byte_offset", nbytes=_scattered_bytes)
