"""The arena layout: every byte offset of docs/design.md section 3, computed without allocating anything.

One uint8 arena of exactly ``memory_budget`` bytes holds both sub-pools. Both sides index from byte 0:

* KV page ``p`` occupies ``[p * page_bytes, (p + 1) * page_bytes)``; pages grow DOWN from
  ``num_pages - 1``. A page envelope is page-major: ``[L0 x ps rows | L1 x ps rows | ...]``, so token slot
  ``s`` of page ``p`` in layer ``l`` is row ``p*ps*L + l*ps + s`` counted in rows of ``entry_bytes`` from
  byte 0 (D values of the KV dtype, or a scaled fp8 row: ``MLARowFormat``).
* State slot ``s`` occupies ``[s * slot_bytes, (s + 1) * slot_bytes)``; slots grow UP from the first slot.
* The sink ``[0, sink_floor)`` with ``sink_floor = round_up(max(page_bytes, slot_bytes), 16)`` is zeroed at
  creation and never written; physical page 0 and slot 0 lie inside it.
* The tail pad (``page_bytes`` bytes) past the last page lets the per-layer dense views, which start
  ``l * ps`` rows into the arena, run ``(L-1) * ps`` rows past page ``num_pages - 1``.

``num_pages = usable // page_bytes`` and ``num_slots = usable // slot_bytes`` with
``usable = memory_budget - tail_pad``: either side may in principle take the whole usable arena, which is
the point of a shared pool.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

from ..errors import GeometryError
from .specs import ALIGN, LinearStateSpec, MHASpec, MLASpec, round_up

__all__ = ["ArenaLayout", "KVSpec"]

KVSpec = MLASpec | MHASpec


@dataclasses.dataclass(frozen=True)
class ArenaLayout:
    """Geometry of one arena. Pure integer math; construct it for any budget without allocating.

    Args:
        memory_budget: arena size in bytes, sink and tail pad included.
        page_size: tokens per KV page (ps).
        kv: the KV sub-pool spec, or None for a model without attention layers.
        state: the state sub-pool spec, or None for a model without linear-attention layers.

    Raises:
        GeometryError: no spec at all, a non-positive page size or budget, or a budget that cannot hold
            the sink, the tail pad and at least one page of each side that exists (the message gives the
            minimum budget).
    """

    memory_budget: int
    page_size: int
    kv: KVSpec | None
    state: LinearStateSpec | None

    def __post_init__(self) -> None:
        if self.kv is None and self.state is None:
            raise GeometryError("ArenaLayout needs a KV spec, a state spec, or both")
        for name in ("page_size", "memory_budget"):  # numpy and other integer types become Python ints
            value = getattr(self, name)
            if not isinstance(value, (bool, int)) and hasattr(value, "__index__"):
                object.__setattr__(self, name, operator.index(value))
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size <= 0:
            raise GeometryError(f"page_size must be a positive int, got {self.page_size!r}")
        if isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, int) or self.memory_budget <= 0:
            raise GeometryError(f"memory_budget must be a positive int of bytes, got {self.memory_budget!r}")
        minimum = self.minimum_budget(self.kv, self.state, self.page_size)
        if self.memory_budget < minimum:
            raise GeometryError(
                f"memory_budget={self.memory_budget} bytes is below the minimum {minimum} bytes "
                f"(sink {self.sink_floor} + tail pad {self.tail_pad} + one page of {self.page_bytes} bytes "
                f"+ one slot of {self.slot_bytes} bytes, aligned)"
            )

    # -- sizes --------------------------------------------------------------------------------------
    @functools.cached_property
    def page_bytes(self) -> int:
        """Bytes of one KV page envelope (0 without a KV spec)."""
        return 0 if self.kv is None else self.kv.page_bytes(self.page_size)

    @functools.cached_property
    def slot_bytes(self) -> int:
        """The state slot pitch in bytes (0 without a state spec)."""
        return 0 if self.state is None else self.state.slot_bytes

    @property
    def tail_pad(self) -> int:
        """Bytes reserved past the last page for the per-layer dense views: one page."""
        return self.page_bytes

    @property
    def usable(self) -> int:
        """Bytes both sides can index: ``memory_budget - tail_pad``."""
        return self.memory_budget - self.tail_pad

    @functools.cached_property
    def sink_floor(self) -> int:
        """End of the sink: ``round_up(max(page_bytes, slot_bytes), 16)``."""
        return round_up(max(self.page_bytes, self.slot_bytes), ALIGN)

    @property
    def num_pages(self) -> int:
        """Physical (and virtual) page ids: ``usable // page_bytes``."""
        return self.usable // self.page_bytes if self.page_bytes else 0

    @property
    def num_slots(self) -> int:
        """Physical (and virtual) slot ids: ``usable // slot_bytes``."""
        return self.usable // self.slot_bytes if self.slot_bytes else 0

    @property
    def first_page(self) -> int:
        """Lowest allocatable physical page: ``ceil(sink_floor / page_bytes)``."""
        return -(-self.sink_floor // self.page_bytes) if self.page_bytes else 0

    @property
    def first_slot(self) -> int:
        """Lowest allocatable physical slot: ``ceil(sink_floor / slot_bytes)``."""
        return -(-self.sink_floor // self.slot_bytes) if self.slot_bytes else 0

    @property
    def layer_num(self) -> int:
        """L, the number of KV layers sharing a page envelope (0 without a KV spec)."""
        return 0 if self.kv is None else self.kv.layer_num

    @property
    def kv_cache_dim(self) -> int:
        """D, elements per KV row."""
        return 0 if self.kv is None else self.kv.kv_cache_dim

    @property
    def max_kv_tokens(self) -> int:
        """Tokens that fit when the KV side takes every allocatable page."""
        return max(0, self.num_pages - self.first_page) * self.page_size if self.page_bytes else 0

    @property
    def max_state_slots(self) -> int:
        """Slots that fit when the state side takes every allocatable slot."""
        return max(0, self.num_slots - self.first_slot) if self.slot_bytes else 0

    # -- offsets ------------------------------------------------------------------------------------
    def page_offset(self, page: int) -> int:
        """Byte offset of physical page ``page``."""
        return page * self.page_bytes

    def slot_offset(self, slot: int) -> int:
        """Byte offset of physical slot ``slot``."""
        return slot * self.slot_bytes

    def kv_row_offset(self, page: int, layer: int, token_in_page: int) -> int:
        """Byte offset of the row of token ``token_in_page`` of physical ``page`` in KV layer ``layer``:
        row ``page*ps*L + layer*ps + token_in_page`` counted in ``entry_bytes`` rows from byte 0."""
        assert self.kv is not None
        row = (page * self.layer_num + layer) * self.page_size + token_in_page
        return row * self.kv.entry_bytes

    @property
    def dense_view_bytes(self) -> int:
        """Bytes the per-layer dense views need: ``num_pages * page_bytes`` plus ``(L-1) * ps`` rows."""
        if self.kv is None:
            return 0
        return self.num_pages * self.page_bytes + (self.layer_num - 1) * self.page_size * self.kv.entry_bytes

    # -- capacity -----------------------------------------------------------------------------------
    def fits(self, n_pages: int, n_slots: int) -> bool:
        """Whether ``n_pages`` pages and ``n_slots`` slots fit at the same time, packed at their ends."""
        if n_pages and not self.page_bytes or n_slots and not self.slot_bytes:
            return False
        page_bottom = self.num_pages - n_pages
        slot_top = self.first_slot + n_slots
        if n_pages and page_bottom < self.first_page:
            return False
        if n_slots and slot_top > self.num_slots:
            return False
        top = slot_top * self.slot_bytes if n_slots else self.sink_floor
        bottom = page_bottom * self.page_bytes if n_pages else self.usable
        return top <= bottom

    @staticmethod
    def minimum_budget(kv: KVSpec | None, state: LinearStateSpec | None, page_size: int) -> int:
        """Smallest budget holding the sink, the tail pad, one page (if ``kv``) and one slot (if ``state``)."""
        page_bytes = 0 if kv is None else kv.page_bytes(page_size)
        slot_bytes = 0 if state is None else state.slot_bytes
        return budget_for(kv, state, page_size, n_pages=1 if kv else 0, n_slots=1 if state else 0,
                          page_bytes=page_bytes, slot_bytes=slot_bytes)

    @classmethod
    def for_capacity(
        cls, kv: KVSpec | None, state: LinearStateSpec | None, page_size: int, n_pages: int, n_slots: int
    ) -> ArenaLayout:
        """The smallest layout in which ``n_pages`` pages and ``n_slots`` slots fit together. A side that
        has a spec gets at least one page / slot (a layout holds at least one of each kind it serves), so
        ``n_pages=0`` with a KV spec sizes for one page.

        Raises:
            GeometryError: a negative count, or a count > 0 for a side without a spec (pages without
            ``kv``, slots without ``state``)."""
        if n_pages < 0 or n_slots < 0:
            raise GeometryError(f"n_pages ({n_pages}) and n_slots ({n_slots}) must be >= 0")
        if kv is None and n_pages:
            raise GeometryError(f"n_pages={n_pages} but the layout has no KV spec (pages hold attention KV)")
        if state is None and n_slots:
            raise GeometryError(f"n_slots={n_slots} but the layout has no state spec (slots hold linear-attention "
                                f"states)")
        page_bytes = 0 if kv is None else kv.page_bytes(page_size)
        slot_bytes = 0 if state is None else state.slot_bytes
        budget = budget_for(kv, state, page_size, max(n_pages, 1 if kv else 0), max(n_slots, 1 if state else 0),
                            page_bytes=page_bytes, slot_bytes=slot_bytes)
        return cls(budget, page_size, kv, state)


def budget_for(
    kv: KVSpec | None,
    state: LinearStateSpec | None,
    page_size: int,
    n_pages: int,
    n_slots: int,
    *,
    page_bytes: int,
    slot_bytes: int,
) -> int:
    """Smallest ``memory_budget`` whose layout fits ``n_pages`` pages and ``n_slots`` slots at once.

    The answer is exact: the slot region ends at ``(first_slot + n_slots) * slot_bytes``; the lowest page
    must start at or above it on a page boundary, and ``n_pages`` pages plus the tail pad follow.
    """
    sink_floor = round_up(max(page_bytes, slot_bytes), ALIGN)
    top = sink_floor
    if n_slots:
        first_slot = -(-sink_floor // slot_bytes)
        top = (first_slot + n_slots) * slot_bytes
    if not n_pages:
        return top + page_bytes  # no pages: tail pad only (0 without a KV spec)
    first_page = -(-sink_floor // page_bytes)
    bottom_page = max(first_page, -(-top // page_bytes))
    return (bottom_page + n_pages) * page_bytes + page_bytes
