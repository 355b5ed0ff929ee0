"""The memory-system interface the scheduler admits, grows and frees requests through, and its
implementations over one :class:`~unimem_compile.pool.unified.UnifiedPool`.

The scheduler (:mod:`.scheduler`) never touches pages or slots itself: it asks a memory system. Two
families implement the interface (:class:`MemorySystem`):

* :class:`PoolMemory`: every request's KV pages and its state slot in one unified pool (KV pages from the
  top, slots from the bottom; the pool compacts when an allocation fits only after closing holes). Over a
  model's real pool this is the engine's memory; over a pool on the ``meta`` device (no arena storage) it is
  the capacity simulator's unified system (``unimem_compile.sim.UnifiedSystem``).
* :class:`QuotaMemory`: the same pool with a fixed split of the budget, ``kv_fraction`` for KV pages and the
  rest for state slots: what an engine with two separate pools can hold (memory idle on one side never
  serves the other). The engine runs it on the model's one arena, so a benchmark compares splits with the
  same kernels and the same process.

The simulator's other systems (two real pools, a padded hybrid pool) implement the same interface.

Ownership: page and slot ids carry no owner (a freed id is handed to the next allocation), so the memory
system records which request holds each id and is the only place a request's memory is freed
(:meth:`PoolMemory.release`). Under ``UNIMEM_DEBUG=1`` every free checks that the ids belong to the request
that frees them and raises :class:`~unimem_compile.errors.InvalidFree` otherwise (a stale id freed after it
was handed to another request would free the new owner's memory).
"""

from __future__ import annotations

import math
from typing import Protocol

from .. import env
from ..errors import GeometryError, InvalidFree, PoolExhausted
from ..pool.unified import UnifiedPool

__all__ = ["MemorySystem", "PoolMemory", "QuotaMemory"]


class MemorySystem(Protocol):
    """What the scheduler needs from memory. ``tokens`` are a request's stored tokens; ``rid`` any hashable
    request id. Every method that allocates raises ``PoolExhausted`` with nothing allocated.

    Attributes:
        name: a label for reports. budget: bytes of the whole system.
    """

    name: str
    budget: int

    def pages_for(self, tokens: int) -> int:
        """KV pages (of this system's page size) holding ``tokens`` tokens."""

    def can_ever_hold(self, tokens: int) -> bool:
        """Whether an otherwise empty system holds one request of ``tokens`` tokens and its state."""

    def can_admit(self, tokens: int, reserve_fraction: float) -> bool:
        """Whether a request of ``tokens`` tokens and one state fit now, leaving ``reserve_fraction`` of the
        growing side free for the running requests' growth."""

    def admit(self, rid, tokens: int) -> None:
        """Allocate ``tokens`` tokens of pages and one state for ``rid``."""

    def grow(self, rid, tokens: int) -> None:
        """Make ``rid`` hold ``tokens`` tokens (never shrinks)."""

    def release(self, rid) -> None:
        """Free every page and the state of ``rid``."""

    def kv_bytes(self) -> int: ...

    def state_bytes(self) -> int: ...

    def free_bytes(self) -> int:
        """Bytes no live page or state holds (fixed overheads excluded)."""

    def reserved_bytes(self) -> int:
        """The fixed overheads no request can ever hold (a constant): ``budget == kv_bytes() +
        state_bytes() + free_bytes() + reserved_bytes()`` at every moment."""

    def reserve_bytes(self, fraction: float) -> int: ...

    def pools(self) -> list[UnifiedPool]: ...

    def stats(self) -> dict: ...


class PoolMemory:
    """Requests' KV pages and state slots in one :class:`UnifiedPool` (see the module docstring).

    Args:
        pool: the pool (a model's ``model.unimem.pool``, or a pool on the ``meta`` device for simulation).
        name: the label of reports (default ``"unified"``).
        check_owner: check on every free that the ids belong to the freeing request (default:
            ``UNIMEM_DEBUG=1``).

    A model with KV layers only (DeepSeek) takes no slot; one with linear-attention layers only takes no page.

    Attributes:
        pages: ``{rid: [virtual page ids]}`` in token order (a request's page ``i`` holds its tokens
            ``[i * page_size, (i + 1) * page_size)``). slots: ``{rid: virtual slot id}``.
    """

    def __init__(self, pool: UnifiedPool, *, name: str = "unified", check_owner: bool | None = None):
        self.pool = pool
        self.layout = pool.layout
        self.name = name
        self.budget = int(pool.layout.memory_budget)
        self.page_size = pool.layout.page_size
        self.has_kv = pool.layout.kv is not None
        self.has_state = pool.layout.state is not None
        self.check_owner = env.debug() if check_owner is None else bool(check_owner)
        self.pages: dict = {}
        self.slots: dict = {}
        self._owner: dict[tuple[str, int], object] = {}  # (side, virtual id) -> rid, when check_owner

    # ------------------------------------------------------------------ sizes
    def pages_for(self, tokens: int) -> int:
        return -(-int(tokens) // self.page_size) if self.has_kv else 0

    def _slots_for(self) -> int:
        return 1 if self.has_state else 0

    def reserve_pages(self, fraction: float) -> int:
        """Pages kept free at admission for the running requests' growth: ``fraction`` of the arena."""
        if not self.has_kv:
            return 0
        return math.ceil(fraction * self.budget / self.layout.page_bytes)

    def _fits(self, pages: int, slots: int) -> bool:
        return self.layout.fits(pages, slots)

    def can_ever_hold(self, tokens: int) -> bool:
        return self._fits(self.pages_for(tokens), self._slots_for())

    def can_admit(self, tokens: int, reserve_fraction: float) -> bool:
        a = self.pool.allocator
        return self._fits(a.pages_used + self.pages_for(tokens) + self.reserve_pages(reserve_fraction),
                          a.slots_used + self._slots_for())

    # ------------------------------------------------------------------ allocation
    def _alloc_pages(self, n: int) -> list[int]:
        return self.pool.alloc_pages(n) if n > 0 else []

    def _alloc_slot(self) -> list[int]:
        return self.pool.alloc_slots(1) if self.has_state else []

    def admit(self, rid, tokens: int) -> None:
        """Allocate ``tokens`` tokens of pages and one state slot for ``rid``.

        Raises:
            GeometryError: ``rid`` holds memory already.
            PoolExhausted: they do not fit; nothing allocated."""
        if rid in self.pages or rid in self.slots:
            raise GeometryError(f"request {rid!r} holds memory already: admit it once, release it first")
        slots = self._alloc_slot()
        try:
            pages = self._alloc_pages(self.pages_for(tokens))
        except PoolExhausted:
            if slots:
                self.pool.free_slots(slots)
            raise
        self.pages[rid] = pages
        if slots:
            self.slots[rid] = slots[0]
        self._own(rid, pages, slots)

    def grow(self, rid, tokens: int) -> None:
        """Make ``rid`` hold ``tokens`` tokens; PoolExhausted with nothing allocated."""
        missing = self.pages_for(tokens) - len(self.pages[rid])
        if missing > 0:
            fresh = self._alloc_pages(missing)
            self.pages[rid] += fresh
            self._own(rid, fresh, ())

    def release(self, rid) -> None:
        """Free every page and the slot of ``rid`` (a request that holds nothing: no-op)."""
        pages = self.pages.pop(rid, [])
        slot = self.slots.pop(rid, None)
        self.free(rid, pages, [] if slot is None else [slot])

    def free(self, rid, pages, slots) -> None:
        """Free ``pages`` and ``slots`` (virtual ids) on behalf of ``rid``. With ``check_owner`` every id must
        be held by ``rid``: :class:`InvalidFree` names the id and its holder, with nothing freed.

        This is the only free of a request's memory: :meth:`release` calls it."""
        pages, slots = list(pages), list(slots)
        if self.check_owner:
            for side, ids in (("kv", pages), ("state", slots)):
                for i in ids:
                    holder = self._owner.get((side, i), _NOBODY)
                    if holder != rid:
                        what = "page" if side == "kv" else "slot"
                        who = "no request" if holder is _NOBODY else f"request {holder!r}"
                        raise InvalidFree(f"request {rid!r} frees {what} {i}, which {who} holds (an id kept "
                                          f"after its request released it, then handed to another)")
            for side, ids in (("kv", pages), ("state", slots)):
                for i in ids:
                    del self._owner[(side, i)]
        if pages:
            self.pool.free_pages(pages)
        if slots:
            self.pool.free_slots(slots)

    def _own(self, rid, pages, slots) -> None:
        if self.check_owner:
            for p in pages:
                self._owner[("kv", p)] = rid
            for s in slots:
                self._owner[("state", s)] = rid

    # ------------------------------------------------------------------ accounting
    def kv_bytes(self) -> int:
        return self.pool.allocator.pages_used * self.layout.page_bytes

    def state_bytes(self) -> int:
        return self.pool.allocator.slots_used * self.layout.slot_bytes

    def free_bytes(self) -> int:
        """Bytes of the arena no live page or slot holds (sink and tail pad excluded)."""
        lay = self.layout
        return lay.usable - lay.sink_floor - self.kv_bytes() - self.state_bytes()

    def reserved_bytes(self) -> int:
        """The sink ``[0, sink_floor)`` and the tail pad (pool/layout.py): ``budget - usable + sink_floor``."""
        lay = self.layout
        return self.budget - lay.usable + lay.sink_floor

    def reserve_bytes(self, fraction: float) -> int:
        return self.reserve_pages(fraction) * self.layout.page_bytes

    def occupancy(self) -> dict[str, int]:
        """Region edges in bytes from the arena start: ``state_end`` (slots below), ``kv_start`` (pages
        above), and the live / hole bytes of each region."""
        a, lay = self.pool.allocator, self.layout
        return {
            "state_end": a.state_watermark * lay.slot_bytes if a.state_watermark > lay.first_slot else lay.sink_floor,
            "kv_start": a.kv_watermark * lay.page_bytes if a.kv_watermark < lay.num_pages else lay.usable,
            "state_live": self.state_bytes(),
            "kv_live": self.kv_bytes(),
            "state_holes": a.hole_bytes("state"),
            "kv_holes": a.hole_bytes("kv"),
        }

    def pools(self) -> list[UnifiedPool]:
        return [self.pool]

    def stats(self) -> dict:
        s = self.pool.stats()
        return {"compactions": s.compactions, "bytes_moved": s.bytes_moved}


_NOBODY = object()


class QuotaMemory(PoolMemory):
    """:class:`PoolMemory` with the budget split in advance: KV pages may use ``kv_fraction`` of the usable
    bytes (sink and tail pad excluded), state slots the rest (a static two-pool engine on one arena).

    Args:
        pool: the pool.
        kv_fraction: the KV pages' share, in (0, 1).

    Raises:
        GeometryError: ``kv_fraction`` outside (0, 1), or a share too small for one page / one slot.

    Attributes:
        kv_cap_pages, state_cap_slots: the most pages / slots each share holds.
    """

    def __init__(self, pool: UnifiedPool, kv_fraction: float, *, check_owner: bool | None = None):
        self.kv_fraction = float(kv_fraction)
        if not 0 < self.kv_fraction < 1:
            raise GeometryError(f"kv_fraction must be in (0, 1), got {kv_fraction}")
        super().__init__(pool, name=f"static {100 * self.kv_fraction:.3g}/{100 * (1 - self.kv_fraction):.3g}",
                         check_owner=check_owner)
        lay = pool.layout
        room = lay.usable - lay.sink_floor
        self.kv_cap_pages = int(room * self.kv_fraction) // lay.page_bytes if self.has_kv else 0
        self.state_cap_slots = int(room * (1 - self.kv_fraction)) // lay.slot_bytes if self.has_state else 0
        if (self.has_kv and self.kv_cap_pages < 1) or (self.has_state and self.state_cap_slots < 1):
            raise GeometryError(f"static split {self.kv_fraction:g} of {room} usable bytes holds "
                                f"{self.kv_cap_pages} pages of {lay.page_bytes} bytes and {self.state_cap_slots} "
                                f"slots of {lay.slot_bytes} bytes: each side needs at least one")

    def reserve_pages(self, fraction: float) -> int:
        if not self.has_kv:
            return 0
        return math.ceil(fraction * self.kv_cap_pages)

    def _fits(self, pages: int, slots: int) -> bool:
        return (pages <= self.kv_cap_pages and slots <= self.state_cap_slots
                and super()._fits(pages, slots))

    def _exhausted(self, side: str, n: int, used: int, cap: int, unit: int) -> PoolExhausted:
        what = "pages" if side == "kv" else "slots"
        return PoolExhausted(f"the {side} share of the static split {self.kv_fraction:g} holds {cap} {what}: "
                             f"{used} in use, {n} more asked", requested=n * unit,
                             available=max(0, cap - used) * unit, side=side, reclaimable={"kv": 0, "state": 0})

    def _alloc_pages(self, n: int) -> list[int]:
        used = self.pool.allocator.pages_used
        if n > 0 and used + n > self.kv_cap_pages:
            raise self._exhausted("kv", n, used, self.kv_cap_pages, self.layout.page_bytes)
        return super()._alloc_pages(n)

    def _alloc_slot(self) -> list[int]:
        used = self.pool.allocator.slots_used
        if self.has_state and used + 1 > self.state_cap_slots:
            raise self._exhausted("state", 1, used, self.state_cap_slots, self.layout.slot_bytes)
        return super()._alloc_slot()

    def free_bytes(self) -> int:
        lay = self.layout
        return ((self.kv_cap_pages - self.pool.allocator.pages_used) * lay.page_bytes
                + (self.state_cap_slots - self.pool.allocator.slots_used) * lay.slot_bytes)

    def reserved_bytes(self) -> int:
        """The sink, the tail pad, and what each share leaves below one page / one slot: ``budget -
        kv_cap_pages * page_bytes - state_cap_slots * slot_bytes``."""
        lay = self.layout
        return self.budget - self.kv_cap_pages * lay.page_bytes - self.state_cap_slots * lay.slot_bytes
