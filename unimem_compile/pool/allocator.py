"""The multi-ended allocator: bookkeeping of both sides of the arena, no bytes moved here.

KV pages grow DOWN from the top of the arena, state slots grow UP from the sink; each side has a
watermark (the page / slot of its region nearest the middle) and keeps the ids it freed inside its region
as holes. The free gap is the span between the two regions; the sides are kept apart by comparing byte
frontiers (slot region end <= page region start), never by comparing ids.

Requests hold VIRTUAL ids, which never change while allocated. ``v2p`` / ``p2v`` (pages) and
``s_v2p`` / ``s_p2v`` (slots) translate; a freed or never-allocated virtual id maps to -1 (a tombstone),
and virtual page 0 / slot 0 are reserved and map to physical 0 (the sink) forever.

Compaction (:meth:`MultiEndedAllocator.plan_compaction`) moves live pages up into the holes above them and
live slots down into the holes below them, so the free gap stays one span in the middle; it returns the
physical moves for :class:`~unimem_compile.pool.unified.UnifiedPool` to copy, and never moves an id in the
caller's in-flight set. Every method that raises leaves the allocator exactly as it was.

The design follows the two-sided stack / "multi-ended" heap idea (two stacks growing toward each other in
one array, Knuth TAOCP vol. 1, 2.2.2) with per-side free lists for holes.
"""

from __future__ import annotations

import dataclasses
import heapq
import operator
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ..errors import GeometryError, InvalidFree, PoolExhausted
from .layout import ArenaLayout

__all__ = ["MultiEndedAllocator", "Move"]


@dataclasses.dataclass(frozen=True)
class Move:
    """One compaction copy: the whole page envelope / slot at physical ``src`` goes to physical ``dst``."""

    side: str  # "kv" | "state"
    src: int
    dst: int
    virtual: int


class _Side:
    """One side's tables and free lists. ``grows_down``: KV pages (region ``[watermark, end)``);
    otherwise state slots (region ``[begin, watermark)``)."""

    def __init__(self, name: str, n: int, begin: int, unit_bytes: int, grows_down: bool):
        self.name = name
        self.n = n  # physical and virtual ids: [0, n)
        self.begin = begin  # lowest allocatable physical id
        self.unit_bytes = unit_bytes
        self.grows_down = grows_down
        self.v2p = np.full(max(n, 1), -1, dtype=np.int64)
        self.p2v = np.full(max(n, 1), -1, dtype=np.int64)
        self.v2p[0] = 0  # virtual 0 -> the sink, forever
        self.p2v[0] = 0
        self.watermark = n if grows_down else begin
        self.holes: list[int] = []  # heap; for KV stores -p so the highest hole comes first
        self.hole_set: set[int] = set()
        self.free_virtual = list(range(1, n))  # heap of free virtual ids, lowest first
        self.freed = np.zeros(max(n, 1), dtype=bool)  # freed at least once and not re-allocated
        self.live = 0

    # region edges in bytes (used to keep the two sides apart)
    def region_edge_bytes(self, usable: int, sink_floor: int) -> int:
        if self.grows_down:
            return self.watermark * self.unit_bytes if self.watermark < self.n else usable
        return self.watermark * self.unit_bytes if self.watermark > self.begin else sink_floor

    def pop_hole(self) -> int:
        # entries of ids that shrink() gave back to the gap stay in the heap until popped: skip them
        while True:
            h = heapq.heappop(self.holes)
            p = -h if self.grows_down else h
            if p in self.hole_set:
                self.hole_set.discard(p)
                return p

    def push_hole(self, p: int) -> None:
        heapq.heappush(self.holes, -p if self.grows_down else p)
        self.hole_set.add(p)

    def shrink(self, rebuild: bool = False) -> None:
        """Give the holes adjacent to the watermark back to the gap. The heap is rebuilt from ``hole_set``
        when ``rebuild`` (a caller changed ``hole_set`` directly) or when stale entries outnumber the holes;
        otherwise a free costs O(log holes), not O(holes)."""
        if self.grows_down:
            while self.watermark < self.n and self.watermark in self.hole_set:
                self.hole_set.discard(self.watermark)
                self.watermark += 1
        else:
            while self.watermark > self.begin and self.watermark - 1 in self.hole_set:
                self.hole_set.discard(self.watermark - 1)
                self.watermark -= 1
        if rebuild or len(self.holes) > 2 * len(self.hole_set) + 64:
            sign = -1 if self.grows_down else 1
            self.holes = [sign * p for p in self.hole_set]
            heapq.heapify(self.holes)

    def live_physical(self) -> list[int]:
        lo, hi = (self.watermark, self.n) if self.grows_down else (self.begin, self.watermark)
        return [p for p in range(lo, hi) if p not in self.hole_set]


def as_int(value, what: str) -> int:
    """``value`` as an int id or count (Python or numpy int, 0-d integer tensor); floats, strings and bools
    are refused rather than truncated.

    Raises:
        TypeError: naming ``what`` and the value."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


class MultiEndedAllocator:
    """Allocator of KV pages (top end, growing down) and state slots (bottom end, growing up) in one arena.

    Args:
        layout: the arena geometry.

    Tables (int64, CPU, shared with :attr:`v2p` etc. without copies): ``v2p`` / ``p2v`` have
    ``layout.num_pages`` entries, ``s_v2p`` / ``s_p2v`` ``layout.num_slots`` (at least 1 each).

    Raises (from the methods):
        PoolExhausted: an allocation does not fit in holes + free gap; nothing is allocated.
        InvalidFree: freeing id 0 (the sink), an id out of range, never allocated, or already freed.
    """

    def __init__(self, layout: ArenaLayout):
        self.layout = layout
        self.kv = _Side("kv", layout.num_pages, layout.first_page, layout.page_bytes, grows_down=True)
        self.state = _Side("state", layout.num_slots, layout.first_slot, layout.slot_bytes, grows_down=False)
        #: bumped by every change of a table; lets device copies of the tables know they are stale
        self.version = 0

    # ------------------------------------------------------------------ tables
    @property
    def v2p(self) -> torch.Tensor:
        """int64 ``[num_pages]`` virtual page -> physical page (-1: tombstone). Shares memory."""
        return torch.from_numpy(self.kv.v2p)

    @property
    def p2v(self) -> torch.Tensor:
        """int64 ``[num_pages]`` physical page -> virtual page (-1: free)."""
        return torch.from_numpy(self.kv.p2v)

    @property
    def s_v2p(self) -> torch.Tensor:
        """int64 ``[num_slots]`` virtual slot -> physical slot (-1: tombstone)."""
        return torch.from_numpy(self.state.v2p)

    @property
    def s_p2v(self) -> torch.Tensor:
        """int64 ``[num_slots]`` physical slot -> virtual slot (-1: free)."""
        return torch.from_numpy(self.state.p2v)

    # ------------------------------------------------------------------ accounting
    @property
    def kv_watermark(self) -> int:
        """Lowest physical page of the KV region (``num_pages`` when empty)."""
        return self.kv.watermark

    @property
    def state_watermark(self) -> int:
        """One past the highest physical slot of the state region (``first_slot`` when empty)."""
        return self.state.watermark

    def _gap_edges(self) -> tuple[int, int]:
        lo = self.state.region_edge_bytes(self.layout.usable, self.layout.sink_floor)
        hi = self.kv.region_edge_bytes(self.layout.usable, self.layout.sink_floor)
        return lo, hi

    @property
    def free_gap_bytes(self) -> int:
        """Bytes between the end of the slot region and the start of the page region."""
        lo, hi = self._gap_edges()
        return max(0, hi - lo)

    def hole_bytes(self, side: str) -> int:
        """Bytes of freed ids inside ``side``'s region: what compacting that side adds to the gap."""
        s = self._side(side)
        return len(s.hole_set) * s.unit_bytes

    @property
    def pages_used(self) -> int:
        return self.kv.live

    @property
    def slots_used(self) -> int:
        return self.state.live

    _as_int = staticmethod(as_int)

    def _require(self, s: _Side, side: str) -> None:
        if not s.unit_bytes:
            kind = ("KV pages (the model has no MLA layers)" if side == "kv"
                    else "state slots (the model has no linear-attention layers)")
            raise GeometryError(f"this pool has no {side} side: its layout holds no {kind}")

    def _side(self, side: str) -> _Side:
        if side == "kv":
            return self.kv
        if side == "state":
            return self.state
        raise ValueError(f"side must be 'kv' or 'state', got {side!r}")

    def _gap_capacity(self, side: _Side) -> int:
        """How many new ids of ``side`` fit into the free gap."""
        lo, hi = self._gap_edges()
        if not side.unit_bytes:
            return 0
        if side.grows_down:
            lowest = max(-(-lo // side.unit_bytes), side.begin)  # lowest page starting at/after lo
            return max(0, side.watermark - lowest)
        highest = min(hi // side.unit_bytes, side.n)  # one past the highest slot ending at/before hi
        return max(0, highest - side.watermark)

    def _count(self, side: str, n) -> int:
        """``n`` as a non-negative int count of ``side`` ids (TypeError / ValueError otherwise)."""
        n = self._as_int(n, f"the number of {side} ids to allocate")
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of {side} ids ({n})")
        return n

    def can_alloc(self, side: str, n: int) -> bool:
        """Whether ``n`` ids of ``side`` fit now without compaction.

        Raises:
            TypeError / ValueError: ``n`` not an integer / negative."""
        s = self._side(side)
        return self._count(side, n) <= len(s.hole_set) + self._gap_capacity(s)

    def can_alloc_after_compaction(self, side: str, n: int) -> bool:
        """Whether ``n`` ids of ``side`` would fit once both sides are compacted (nothing in flight).

        Raises:
            TypeError / ValueError: ``n`` not an integer / negative."""
        s = self._side(side)
        n = self._count(side, n)
        other = self.state if s is self.kv else self.kv
        if s.unit_bytes == 0:
            return n == 0
        n_other = other.live
        n_self = s.live + n
        if s is self.kv:
            return self.layout.fits(n_self, n_other) and n_self <= s.n - s.begin
        return self.layout.fits(n_other, n_self)

    # ------------------------------------------------------------------ alloc / free
    def alloc(self, side: str, n: int) -> list[int]:
        """Allocate ``n`` ids of ``side`` ("kv" pages or "state" slots); all or nothing.

        Holes inside the region are reused first (the highest page / the lowest slot), then the watermark
        moves into the free gap.

        Returns:
            the new VIRTUAL ids (never 0), lowest free virtual ids first.

        Raises:
            PoolExhausted: fewer than ``n`` ids fit in holes + gap; ``requested`` is ``n`` units in bytes,
                ``available`` the free gap, ``reclaimable`` what compacting each side would add.
            ValueError: ``n`` negative.
        """
        s = self._side(side)
        n = self._count(side, n)
        if n == 0:
            return []
        self._require(s, side)
        holes, gap = len(s.hole_set), self._gap_capacity(s)
        if n > holes + gap or n > len(s.free_virtual):
            unit = "page" if s.grows_down else "slot"
            raise PoolExhausted(
                f"{side} side: asked for {n} {unit}s ({n * s.unit_bytes} bytes) but only {holes} freed {unit}s "
                f"and {gap} {unit}s of free gap ({self.free_gap_bytes} bytes) fit; compaction could add "
                f"{self.hole_bytes('kv')} bytes (kv) + {self.hole_bytes('state')} bytes (state) to the gap",
                requested=n * s.unit_bytes,
                available=self.free_gap_bytes,
                side=side,
                reclaimable={"kv": self.hole_bytes("kv"), "state": self.hole_bytes("state")},
            )
        out = []
        for _ in range(n):
            if s.hole_set:
                p = s.pop_hole()
            elif s.grows_down:
                s.watermark -= 1
                p = s.watermark
            else:
                p = s.watermark
                s.watermark += 1
            v = heapq.heappop(s.free_virtual)
            s.v2p[v] = p
            s.p2v[p] = v
            s.freed[v] = False
            out.append(v)
        s.live += n
        self.version += 1
        return out

    def _validate_free(self, s: _Side, ids: Sequence[int]) -> None:
        seen: set[int] = set()
        what = "page" if s.grows_down else "slot"
        for v in ids:
            v = int(v)
            if v == 0:
                raise InvalidFree(f"cannot free virtual {what} 0: it is the reserved sink")
            if not 0 < v < s.n:
                raise InvalidFree(f"virtual {what} {v} is out of range [1, {s.n})")
            if v in seen:
                raise InvalidFree(f"virtual {what} {v} appears twice in one free (double free)")
            seen.add(v)
            if s.v2p[v] < 0:
                if s.freed[v]:
                    raise InvalidFree(f"virtual {what} {v} was already freed (double free)")
                raise InvalidFree(f"virtual {what} {v} was never allocated")

    def free(self, side: str, ids: Iterable[int]) -> list[int]:
        """Free virtual ``ids`` of ``side``; validated first, so a bad id frees nothing.

        Each freed virtual id becomes a tombstone (``v2p[id] = -1``); its physical id becomes a hole, or
        goes back to the gap when it sits at the watermark.

        Returns:
            the physical ids that were freed, in the order of ``ids``.

        Raises:
            InvalidFree: the sink (0), an id out of range, never allocated, already freed, or repeated.
        """
        s = self._side(side)
        if isinstance(ids, (int, str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"virtual {side} ids to free must be an iterable of ints, got {type(ids).__name__} "
                            f"{ids!r}")
        ids = [self._as_int(v, f"a virtual {side} id") for v in ids]
        if ids:
            self._require(s, side)
        self._validate_free(s, ids)
        freed = []
        for v in ids:
            p = int(s.v2p[v])
            s.v2p[v] = -1
            s.p2v[p] = -1
            s.freed[v] = True
            heapq.heappush(s.free_virtual, v)
            s.push_hole(p)
            freed.append(p)
        s.live -= len(ids)
        s.shrink()
        self.version += 1
        return freed

    def is_live(self, side: str, virtual_id: int) -> bool:
        """Whether ``virtual_id`` is currently allocated on ``side`` (0 is never live)."""
        s = self._side(side)
        return 0 < virtual_id < s.n and s.v2p[virtual_id] >= 0

    def live_virtual(self, side: str) -> list[int]:
        """Every allocated virtual id of ``side``, ascending."""
        s = self._side(side)
        return [int(v) for v in np.nonzero(s.v2p[1:s.n] >= 0)[0] + 1] if s.n > 1 else []

    # ------------------------------------------------------------------ compaction
    def check_pins(self, side: str, in_flight: Iterable[int]) -> set[int]:
        """Validate in-flight PHYSICAL ids of ``side`` (see :meth:`plan_compaction`); changes nothing.

        Raises:
            TypeError: a non-integer id (or ``in_flight`` not iterable).
            GeometryError: an id out of range.
        """
        s = self._side(side)
        if isinstance(in_flight, (int, str, bytes)) or not hasattr(in_flight, "__iter__"):
            raise TypeError(f"in-flight physical {side} ids must be an iterable of ints, got "
                            f"{type(in_flight).__name__} {in_flight!r}")
        pinned = {self._as_int(p, f"an in-flight physical {side} id") for p in in_flight}
        bad = sorted(p for p in pinned if not 0 <= p < len(s.p2v))
        if bad:
            raise GeometryError(f"in-flight physical {side} id {bad[0]} is out of range [0, {len(s.p2v)})")
        return pinned

    def plan_compaction(self, side: str, in_flight: Iterable[int] = ()) -> list[Move]:
        """Close the holes of ``side`` by moving live ids toward that side's own end, and update the tables.

        KV: the lowest live page moves into the highest hole while one lies above it; states: the highest
        live slot moves into the lowest hole below it. Ids listed in ``in_flight`` (PHYSICAL ids) never
        move. The caller must copy each returned move's bytes (src -> dst; sources and destinations are
        disjoint, so any order is safe) before anything reads through the new tables.

        Returns:
            the moves, in the order they were planned.
        """
        s = self._side(side)
        pinned = self.check_pins(side, in_flight)
        movable = [p for p in s.live_physical() if p not in pinned]
        # KV: sources lowest first, destinations highest first; states: the mirror image
        if s.grows_down:
            sources = sorted(movable)
            dests = sorted(s.hole_set, reverse=True)
            better = lambda src, dst: dst > src  # noqa: E731
        else:
            sources = sorted(movable, reverse=True)
            dests = sorted(s.hole_set)
            better = lambda src, dst: dst < src  # noqa: E731
        moves = []
        for src, dst in zip(sources, dests):
            if not better(src, dst):
                break
            v = int(s.p2v[src])
            s.v2p[v] = dst
            s.p2v[dst] = v
            s.p2v[src] = -1
            s.hole_set.discard(dst)
            s.hole_set.add(src)
            moves.append(Move(side, src, dst, v))
        s.shrink(rebuild=True)
        if moves:
            self.version += 1
        return moves

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Assert every structural invariant; raises AssertionError naming the first one broken."""
        lay = self.layout
        for s in (self.kv, self.state):
            if s.n == 0:
                continue
            assert s.v2p[0] == 0 and s.p2v[0] == 0, f"{s.name}: virtual 0 must map to physical 0"
            live_v = np.nonzero(s.v2p[1:s.n] >= 0)[0] + 1
            assert len(live_v) == s.live, f"{s.name}: live count {s.live} != {len(live_v)} mapped ids"
            phys = s.v2p[live_v]
            assert len(set(phys.tolist())) == len(phys), f"{s.name}: two virtual ids share a physical id"
            assert np.array_equal(s.p2v[phys], live_v), f"{s.name}: p2v is not the inverse of v2p"
            free_v = set(s.free_virtual)
            assert free_v.isdisjoint(live_v.tolist()), f"{s.name}: a live virtual id is on the free list"
            assert len(free_v) + len(live_v) == s.n - 1, f"{s.name}: free + live virtual ids do not cover 1..n-1"
            region = set(range(s.watermark, s.n)) if s.grows_down else set(range(s.begin, s.watermark))
            assert set(phys.tolist()) | s.hole_set == region, f"{s.name}: live + holes != region"
            assert not (set(phys.tolist()) & s.hole_set), f"{s.name}: a live id is also a hole"
            assert all(p >= s.begin for p in phys.tolist()), f"{s.name}: a live id lies in the sink"
            mapped_p = np.nonzero(s.p2v[1:s.n] >= 0)[0] + 1
            assert set(mapped_p.tolist()) == set(phys.tolist()), f"{s.name}: p2v maps a free physical id"
        lo, hi = self._gap_edges()
        assert lo <= hi, f"the sides overlap: slot region ends at byte {lo}, page region starts at {hi}"
        assert lo >= lay.sink_floor or self.state.watermark == self.state.begin
        if self.kv.watermark < self.kv.n:
            assert self.kv.watermark * lay.page_bytes >= lay.sink_floor, "a page overlaps the sink"
