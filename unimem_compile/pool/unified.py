"""UnifiedPool: the arena tensor, its tables on the device, views, and compaction that moves bytes.

:class:`UnifiedPool` owns one uint8 arena of exactly ``layout.memory_budget`` bytes on a device, a
:class:`~unimem_compile.pool.allocator.MultiEndedAllocator` for the bookkeeping, and device copies of its
tables (``v2p``, ``p2v``, ``s_v2p``, ``s_p2v``; int64) that are refreshed in place after every change,
so compiled graphs and CUDA graphs that captured them see the new values at the same addresses.

The only pool tensor a compiled graph should take is :attr:`UnifiedPool.arena`; the dense and state views
below are for Python code and tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch

from .. import env
from ..errors import GeometryError, PoolExhausted
from .allocator import Move, MultiEndedAllocator, as_int
from .layout import ArenaLayout
from .specs import dtype_itemsize
from .staging import StagedUpload, upload
from .translate import translate_kv_loc_dense, translate_slot

__all__ = ["UnifiedPool", "PoolStats", "kv_dense_views", "state_views", "structural_overhead", "POISON_BYTE"]

#: Byte a poisoned (free) page or slot is filled with: 0xFF.. is NaN in fp32, fp16 and bf16.
POISON_BYTE = 0xFF


def _typed(arena: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The arena reinterpreted as ``dtype`` elements (a view; trailing bytes that do not fill an element
    are left out)."""
    itemsize = dtype_itemsize(dtype)
    n = arena.numel() // itemsize * itemsize
    return arena[:n].view(dtype)


def kv_dense_views(arena: torch.Tensor, layout: ArenaLayout) -> list[torch.Tensor]:
    """Per-layer dense views of the KV rows: for layer ``l`` a ``[num_pages * L * ps, 1, W]`` tensor of the
    store dtype whose row ``r`` is arena row ``r + l * ps`` (``torch.as_strided``; the views overlap). ``W``
    is ``kv.row_elements``: D values, or for fp8 MLA rows the ``row_bytes`` bytes of the scaled row (uint8).

    Row ``translate_kv_loc_dense(v2p, t, ps, L)`` of view ``l`` is token ``t``'s row in layer ``l``.

    Args:
        arena: uint8 ``[memory_budget]``.
        layout: its geometry (needs a KV spec).

    Raises:
        GeometryError: no KV spec, or the arena lacks the tail pad the last view runs into (the message
            gives the bytes needed).
    """
    if layout.kv is None:
        raise GeometryError("this layout has no KV sub-pool")
    if arena.dtype != torch.uint8 or arena.dim() != 1:
        raise GeometryError(f"the arena must be a 1-D uint8 tensor, got {arena.dtype} {tuple(arena.shape)}")
    need = layout.dense_view_bytes
    if arena.numel() < need:
        raise GeometryError(
            f"the arena has {arena.numel()} bytes but the per-layer dense views need {need} bytes "
            f"({layout.num_pages} pages of {layout.page_bytes} bytes + a tail pad of "
            f"{need - layout.num_pages * layout.page_bytes} bytes)"
        )
    typed = _typed(arena, layout.kv.store_dtype)
    d, ps, L = layout.kv.row_elements, layout.page_size, layout.layer_num
    rows = layout.num_pages * L * ps
    return [typed.as_strided((rows, 1, d), (d, d, 1), l * ps * d) for l in range(L)]


def state_views(arena: torch.Tensor, layout: ArenaLayout, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of linear-attention layer ``layer``'s conv and recurrent sections for every PHYSICAL slot.

    Returns:
        ``(conv, recurrent)``: ``[num_slots, *conv.shape]`` in the conv dtype and
        ``[num_slots, *recurrent.shape]`` in the recurrent dtype; slot ``s`` starts at byte
        ``s * slot_bytes`` (the pitch), so index them with physical slot ids.

    Raises:
        GeometryError: no state spec, or ``layer`` out of range.
    """
    spec = layout.state
    if spec is None:
        raise GeometryError("this layout has no state sub-pool")
    layer = as_int(layer, "a state layer")
    if not 0 <= layer < spec.layer_num:
        raise GeometryError(f"state layer {layer} is out of range [0, {spec.layer_num})")
    out = []
    for section, offset in (
        (spec.layers[layer].conv, spec.conv_offset(layer)),
        (spec.layers[layer].recurrent, spec.recurrent_offset(layer)),
    ):
        isz = dtype_itemsize(section.dtype)
        shape = (layout.num_slots, *section.shape)
        stride = [1] * len(section.shape)
        for i in range(len(section.shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * section.shape[i + 1]
        out.append(_typed(arena, section.dtype).as_strided(shape, (layout.slot_bytes // isz, *stride), offset // isz))
    return out[0], out[1]


@dataclasses.dataclass
class PoolStats:
    """Counters of one pool; ``as_dict`` gives the "pool" keys of docs/design.md section 5."""

    total_bytes: int
    kv_pages_used: int
    state_slots_used: int
    kv_pages_peak: int
    state_slots_peak: int
    page_bytes: int
    slot_bytes: int
    free_gap_bytes: int
    kv_hole_bytes: int
    state_hole_bytes: int
    overhead_fraction: float
    compactions: int
    bytes_moved: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _int_ids(ids, what: str) -> torch.Tensor:
    """``ids`` (a tensor, sequence or int) as a flat int64 tensor; floating or bool values are refused
    rather than truncated (TypeError naming ``what``)."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"{what} must be an integer, got a {ids.dtype} tensor")
        return ids.reshape(-1).to(torch.int64)
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        ids = [ids]
    return torch.tensor([as_int(v, what) for v in ids], dtype=torch.int64)


class UnifiedPool:
    """One arena shared by KV pages and state slots, on one device.

    Args:
        layout: the geometry (see :class:`ArenaLayout`).
        device: where the arena and the device tables live.
        poison: fill free pages and slots (never the sink) with 0xFF bytes, NaN in every float dtype, so a
            kernel that reads an unwritten or freed row yields NaN. Defaults to ``UNIMEM_DEBUG=1``.

    Attributes:
        arena: uint8 ``[memory_budget]``; bytes ``[0, sink_floor)`` are zero and never written.
        v2p, p2v, s_v2p, s_p2v: int64 device tables, updated in place.
        allocator: the bookkeeping (CPU).

    Raises:
        PoolExhausted, InvalidFree: from the allocation methods, with nothing changed.
    """

    def __init__(self, layout: ArenaLayout, device: torch.device | str = "cpu", *, poison: bool | None = None):
        self.layout = layout
        self.device = torch.device(device)
        self.poison = env.debug() if poison is None else poison
        self.allocator = MultiEndedAllocator(layout)
        self.arena = torch.zeros(layout.memory_budget, dtype=torch.uint8, device=self.device)
        if self.poison:
            self.arena[layout.sink_floor:].fill_(POISON_BYTE)
        if self.device.type == "cpu":
            # the allocator's numpy tables are the tables: nothing to copy
            self.v2p, self.p2v = self.allocator.v2p, self.allocator.p2v
            self.s_v2p, self.s_p2v = self.allocator.s_v2p, self.allocator.s_p2v
        else:
            self.v2p = self.allocator.v2p.to(self.device)
            self.p2v = self.allocator.p2v.to(self.device)
            self.s_v2p = self.allocator.s_v2p.to(self.device)
            self.s_p2v = self.allocator.s_p2v.to(self.device)
            # refreshed in stream order without making the host wait for the GPU (pool/staging.py)
            self._uploads = [StagedUpload(t) for t in (self.v2p, self.p2v, self.s_v2p, self.s_p2v)]
        self._synced_version = self.allocator.version
        self._kv_views: list[torch.Tensor] | None = None
        self._pages_peak = 0
        self._slots_peak = 0
        self.compactions = 0
        self.bytes_moved = 0

    @classmethod
    def for_capacity(cls, kv, state, page_size: int, n_pages: int, n_slots: int, device="cpu", **kw) -> UnifiedPool:
        """The smallest pool holding ``n_pages`` pages and ``n_slots`` slots at once."""
        return cls(ArenaLayout.for_capacity(kv, state, page_size, n_pages, n_slots), device, **kw)

    # ------------------------------------------------------------------ tables
    def sync_tables(self) -> None:
        """Copy changed host tables into the device tables, in place (a no-op on the CPU)."""
        if self.device.type == "cpu" or self._synced_version == self.allocator.version:
            return
        for staged, host in zip(self._uploads, (self.allocator.v2p, self.allocator.p2v, self.allocator.s_v2p,
                                                self.allocator.s_p2v)):
            staged(host)
        self._synced_version = self.allocator.version

    # ------------------------------------------------------------------ pages
    def alloc_pages(self, n: int, in_flight_pages: Iterable[int] = (), in_flight_slots: Iterable[int] = ()) -> list[int]:
        """Allocate ``n`` KV pages; returns their virtual ids. Page contents are undefined until written.

        If they do not fit but would after compaction, the pool compacts first (never moving the PHYSICAL
        ids listed as in flight).

        Raises:
            PoolExhausted: they do not fit even after compaction; nothing changed (except a compaction,
                which preserves every live byte at its virtual id).
        """
        return self._alloc("kv", n, in_flight_pages, in_flight_slots)

    def free_pages(self, virtual_pages: Iterable[int]) -> None:
        """Free virtual pages (they become tombstones). Raises InvalidFree (TypeError for a non-integer id)
        with nothing freed."""
        self._free("kv", virtual_pages)

    # ------------------------------------------------------------------ slots
    def alloc_slots(self, n: int, in_flight_pages: Iterable[int] = (), in_flight_slots: Iterable[int] = ()) -> list[int]:
        """Allocate ``n`` state slots, zero-filled (a zero state is "no history"); returns virtual ids.

        Raises:
            PoolExhausted: as :meth:`alloc_pages`.
        """
        ids = self._alloc("state", n, in_flight_pages, in_flight_slots)
        if ids:
            phys = upload(torch.tensor([int(self.allocator.state.v2p[v]) for v in ids]), self.device)  # no stream sync
            self._slot_rows().index_fill_(0, phys, 0)
        return ids

    def free_slots(self, virtual_slots: Iterable[int]) -> None:
        """Free virtual slots (they become tombstones). Raises InvalidFree with nothing freed."""
        self._free("state", virtual_slots)

    def _free(self, side: str, virtual_ids: Iterable[int]) -> None:
        phys = self.allocator.free(side, virtual_ids)  # validates everything first: raises with nothing freed
        if self.poison and phys:
            rows = self._page_rows() if side == "kv" else self._slot_rows()
            rows.index_fill_(0, upload(torch.tensor(phys), self.device), POISON_BYTE)
        self.sync_tables()

    def _alloc(self, side: str, n: int, in_flight_pages: Iterable[int], in_flight_slots: Iterable[int]) -> list[int]:
        alloc = self.allocator
        # everything is validated before a compaction may move bytes: a bad argument changes nothing
        pinned = {"kv": in_flight_pages, "state": in_flight_slots}
        for s in ("kv", "state"):
            pinned[s] = sorted(alloc.check_pins(s, pinned[s]))
        compacted = False
        if not alloc.can_alloc(side, n) and alloc.can_alloc_after_compaction(side, n):
            other = "state" if side == "kv" else "kv"
            self.compact(other, pinned[other])
            if not alloc.can_alloc(side, n):
                self.compact(side, pinned[side])
            compacted = True
        try:
            ids = alloc.alloc(side, n)
        except PoolExhausted as e:
            if not compacted:
                raise
            # it would have fitted after compaction, but in-flight ids could not move: say so
            raise PoolExhausted(
                f"{e} (compacted already: {len(pinned['kv'])} in-flight pages and {len(pinned['state'])} "
                "in-flight slots stay where they are and keep those holes from the gap)",
                requested=e.requested, available=e.available, side=e.side, reclaimable=e.reclaimable,
            ) from None
        self._pages_peak = max(self._pages_peak, alloc.pages_used)
        self._slots_peak = max(self._slots_peak, alloc.slots_used)
        self.sync_tables()
        return ids

    # ------------------------------------------------------------------ compaction
    def compact(self, side: str = "both", in_flight: Iterable[int] = ()) -> list[Move]:
        """Move live pages up / live slots down into holes, copying whole envelopes / slots.

        Args:
            side: "kv", "state" or "both".
            in_flight: PHYSICAL ids that must not move (pages for "kv", slots for "state"; for "both" give
                ``{"kv": [...], "state": [...]}``; a flat list with "both" is refused).

        Raises:
            GeometryError: a flat ``in_flight`` list with "both", unknown keys, or an id out of range.
            TypeError: a non-integer id.

        Returns:
            the moves made. Every live byte stays readable at its virtual id.
        """
        if side not in ("kv", "state", "both"):
            raise ValueError(f"side must be 'kv', 'state' or 'both', got {side!r}")
        sides = ("kv", "state") if side == "both" else (side,)
        if isinstance(in_flight, dict):
            unknown = sorted(set(in_flight) - {"kv", "state"})
            if unknown:
                raise GeometryError(f"in_flight keys must be 'kv' and/or 'state', got {unknown}")
            pinned = in_flight
        else:
            in_flight = list(in_flight)
            if side == "both" and in_flight:
                raise GeometryError("compact('both') takes in_flight as {'kv': [physical pages], 'state': "
                                    f"[physical slots]}}, got a flat list of {len(in_flight)} ids")
            pinned = {side: in_flight}
        # every side's pins are validated before the first side moves anything
        pinned = {s: self.allocator.check_pins(s, pinned.get(s, ())) for s in sides}
        moves: list[Move] = []
        for s in sides:
            planned = self.allocator.plan_compaction(s, pinned[s])
            if planned:
                rows = self._page_rows() if s == "kv" else self._slot_rows()
                src = upload(torch.tensor([m.src for m in planned]), self.device)
                dst = upload(torch.tensor([m.dst for m in planned]), self.device)
                rows[dst] = rows[src]  # advanced indexing gathers first: sources and dests never alias
                if self.poison:
                    rows.index_fill_(0, src, POISON_BYTE)
                self.bytes_moved += 2 * len(planned) * rows.shape[1]
            moves += planned
        if moves:
            self.compactions += 1
        self.sync_tables()
        return moves

    # ------------------------------------------------------------------ byte views
    def _page_rows(self) -> torch.Tensor:
        pb = self.layout.page_bytes
        return self.arena[: self.layout.num_pages * pb].view(self.layout.num_pages, pb)

    def _slot_rows(self) -> torch.Tensor:
        sb = self.layout.slot_bytes
        return self.arena[: self.layout.num_slots * sb].view(self.layout.num_slots, sb)

    def kv_views(self) -> list[torch.Tensor]:
        """Per-layer dense KV views (see :func:`kv_dense_views`)."""
        if self._kv_views is None:
            self._kv_views = kv_dense_views(self.arena, self.layout)
        return self._kv_views

    def state_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv, recurrent)`` views of linear layer ``layer`` indexed by PHYSICAL slot (see
        :func:`state_views`)."""
        return state_views(self.arena, self.layout, layer)

    # ------------------------------------------------------------------ Python read / write of rows
    def dense_rows(self, virt_loc: torch.Tensor) -> torch.Tensor:
        """Dense row ids of virtual token locations (0 = sink for -1 and tombstones).

        Raises:
            TypeError: non-integer locations."""
        lay = self.layout
        loc = _int_ids(virt_loc, "a virtual token location").to(self.device)
        return translate_kv_loc_dense(self.v2p, loc, lay.page_size, lay.layer_num)

    def write_kv(self, layer: int, virt_loc: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` for tokens ``virt_loc [T]`` of ``layer``: ``[T, D]`` of the KV dtype (an fp8 one
        may be given as uint8), or for fp8 MLA rows ``[T, row_bytes]`` uint8 scaled rows as the ops lay them
        out (the pool moves bytes; quantising is the write op's job). Lanes whose location is < 0 or on a
        tombstoned page write nothing.

        Raises:
            GeometryError: bad layer or shapes. TypeError: ``rows`` not a tensor or not of the KV dtype.
        """
        lay = self.layout
        if lay.kv is None or not 0 <= layer < lay.layer_num:
            raise GeometryError(f"KV layer {layer} is out of range [0, {lay.layer_num})")
        virt_loc = _int_ids(virt_loc, "a virtual token location")
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows must be a tensor, got {type(rows).__name__}")
        width = lay.kv.row_elements
        if rows.dim() != 2 or rows.shape != (virt_loc.numel(), width):
            raise GeometryError(f"rows must be [{virt_loc.numel()}, {width}], got {tuple(rows.shape)}")
        store = lay.kv.store_dtype
        scaled = lay.kv.scaled_rows  # a scaled fp8 row holds bytes of several formats: uint8 only
        if not (rows.dtype == store or rows.dtype == lay.kv.dtype and not scaled):
            want = store if scaled else lay.kv.dtype
            raise TypeError(f"rows must be {want}, got {rows.dtype}")
        loc = virt_loc.reshape(-1).to(self.device, torch.int64)
        dense = self.dense_rows(loc)
        # the sink is never written: not by -1 lanes, tombstones, nor a location on virtual page 0 (whose
        # dense id can be > 0 at an offset > 0 while its physical page is the sink)
        vpage = torch.where(loc >= 0, loc, 0) // lay.page_size
        keep = (loc >= 0) & (self.v2p[vpage.clamp(max=lay.num_pages - 1)] > 0) & (vpage < lay.num_pages)
        view = self.kv_views()[layer][:, 0]
        view[dense[keep]] = rows.to(self.device).view(store)[keep]

    def read_kv(self, layer: int, virt_loc: torch.Tensor) -> torch.Tensor:
        """Rows of ``layer`` for virtual locations ``[T]`` (zeros for the sink): ``[T, D]`` in the KV dtype,
        or for fp8 MLA rows ``[T, row_bytes]`` uint8 scaled rows (``unimem_compile.ops.fp8`` dequantises them)."""
        lay = self.layout
        if lay.kv is None or not 0 <= layer < lay.layer_num:
            raise GeometryError(f"KV layer {layer} is out of range [0, {lay.layer_num})")
        rows = self.kv_views()[layer][:, 0][self.dense_rows(_int_ids(virt_loc, "a virtual token location"))]
        if lay.kv.store_dtype == lay.kv.dtype or lay.kv.scaled_rows:
            return rows
        return rows.view(lay.kv.dtype)

    def physical_slots(self, virtual_slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Physical slot ids of virtual ones (0 for -1 and tombstones).

        Raises:
            TypeError: non-integer ids."""
        return translate_slot(self.s_v2p, _int_ids(virtual_slots, "a virtual slot id").to(self.device))

    def physical_pages(self, virtual_pages: Iterable[int]) -> list[int]:
        """Physical page ids of virtual ones (-1 for a negative id, the "no page" marker, and for tombstones).

        Raises:
            TypeError: a non-integer id.
            GeometryError: an id past the page table (>= ``layout.num_pages``)."""
        v2p = self.allocator.kv.v2p
        out = []
        for v in virtual_pages:
            v = as_int(v, "a virtual page id")
            if v >= len(v2p):
                raise GeometryError(f"virtual page {v} is out of range [0, {len(v2p)})")
            out.append(int(v2p[v]) if v >= 0 else -1)
        return out

    # ------------------------------------------------------------------ stats
    def stats(self) -> PoolStats:
        a, lay = self.allocator, self.layout
        return PoolStats(
            total_bytes=lay.memory_budget,
            kv_pages_used=a.pages_used,
            state_slots_used=a.slots_used,
            kv_pages_peak=self._pages_peak,
            state_slots_peak=self._slots_peak,
            page_bytes=lay.page_bytes,
            slot_bytes=lay.slot_bytes,
            free_gap_bytes=a.free_gap_bytes,
            kv_hole_bytes=a.hole_bytes("kv"),
            state_hole_bytes=a.hole_bytes("state"),
            overhead_fraction=structural_overhead(lay) / lay.memory_budget,
            compactions=self.compactions,
            bytes_moved=self.bytes_moved,
        )

    def reset_peaks(self) -> None:
        self._pages_peak = self.allocator.pages_used
        self._slots_peak = self.allocator.slots_used

    def __repr__(self) -> str:
        lay = self.layout
        return (
            f"UnifiedPool({lay.memory_budget} bytes on {self.device}, page_size={lay.page_size}, "
            f"{self.allocator.pages_used}/{lay.num_pages} pages of {lay.page_bytes} B, "
            f"{self.allocator.slots_used}/{lay.num_slots} slots of {lay.slot_bytes} B; each maximum assumes the "
            f"other side empty)"
        )


def structural_overhead(layout: ArenaLayout) -> int:
    """Bytes of the arena no token or state can ever use: the sink, the tail pad, the bytes past the last
    whole page, and (an upper bound) the alignment padding of every slot if states filled the arena."""
    page_tail = layout.usable - layout.num_pages * layout.page_bytes if layout.page_bytes else 0
    slot_pad = 0
    if layout.state is not None:
        slot_pad = layout.max_state_slots * (layout.slot_bytes - layout.state.raw_bytes)
    return layout.sink_floor + layout.tail_pad + page_tail + slot_pad

