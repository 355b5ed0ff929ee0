"""Per-row page tables: which virtual pages hold each row's tokens, and how many tokens it has.

A row (one request in a batch) owns a list of virtual pages; token ``i`` of the row lives at virtual
location ``pages[i // ps] * ps + i % ps``. The table kernels read is ``int32 [max_batch_size,
max_pages_per_row]`` of virtual page ids (-1 = none) plus ``kv_len int32 [max_batch_size]``; both have a
host copy that is edited and a device copy refreshed in place by :meth:`PageTables.sync`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import GeometryError
from .allocator import as_int
from .staging import StagedUpload
from .unified import UnifiedPool

__all__ = ["PageTables"]


class PageTables:
    """Page tables of ``max_batch_size`` rows over one pool.

    Args:
        pool: the pool pages come from.
        max_batch_size: rows (B).
        max_pages_per_row: columns (P); a row holds at most ``P * page_size`` tokens.
        out: optional ``(page_table int32 [B, P], kv_len int32 [B])`` device tensors to keep the tables in
            (reset to empty here); by default the tables are allocated on the pool's device.

    Attributes:
        page_table: int32 ``[B, P]`` on the pool's device (-1 = no page).
        kv_len: int32 ``[B]`` on the pool's device: tokens stored per row.
    """

    def __init__(
        self,
        pool: UnifiedPool,
        max_batch_size: int,
        max_pages_per_row: int,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        max_batch_size = as_int(max_batch_size, "max_batch_size")
        max_pages_per_row = as_int(max_pages_per_row, "max_pages_per_row")
        if max_batch_size <= 0 or max_pages_per_row <= 0:
            raise GeometryError(
                f"max_batch_size ({max_batch_size}) and max_pages_per_row ({max_pages_per_row}) must be positive"
            )
        self.pool = pool
        self.page_size = pool.layout.page_size
        self.max_batch_size = max_batch_size
        self.max_pages_per_row = max_pages_per_row
        self._host_table = torch.full((max_batch_size, max_pages_per_row), -1, dtype=torch.int32)
        self._host_len = torch.zeros(max_batch_size, dtype=torch.int32)
        if out is not None:
            # caller-owned device tensors (kept at stable addresses across page tables, for CUDA graphs)
            table, length = out
            if table.shape != (max_batch_size, max_pages_per_row) or table.dtype != torch.int32:
                raise GeometryError(f"out page_table must be int32 [{max_batch_size}, {max_pages_per_row}], "
                                    f"got {table.dtype} {list(table.shape)}")
            if length.shape != (max_batch_size,) or length.dtype != torch.int32:
                raise GeometryError(f"out kv_len must be int32 [{max_batch_size}], got {length.dtype} {list(length.shape)}")
            self.page_table, self.kv_len = table, length
            table.fill_(-1)  # the empty tables, set on the device: no upload, no wait
            length.zero_()
        elif pool.device.type == "cpu":
            self.page_table, self.kv_len = self._host_table, self._host_len
        else:
            self.page_table = torch.full_like(self._host_table, -1, device=pool.device)
            self.kv_len = torch.zeros_like(self._host_len, device=pool.device)
        # device copies are refreshed without a stream synchronisation (pool/staging.py)
        self._upload_table = StagedUpload(self.page_table)
        self._upload_len = StagedUpload(self.kv_len)
        self.rows: list[list[int]] = [[] for _ in range(max_batch_size)]
        self.lengths = [0] * max_batch_size

    @property
    def host_lengths(self) -> torch.Tensor:
        """The host copy of ``kv_len`` (int32 ``[max_batch_size]``, what the last :meth:`sync` uploaded once
        the tables are synced). The tables' own tensor: read it, never write it."""
        return self._host_len

    @property
    def max_row_tokens(self) -> int:
        return self.max_pages_per_row * self.page_size

    def _check_row(self, row: int) -> int:
        row = as_int(row, "a row")
        if not 0 <= row < self.max_batch_size:
            raise GeometryError(f"row {row} is out of range [0, {self.max_batch_size})")
        return row

    def _row_targets(self, op: str, rows, tokens, what: str, plural: str) -> tuple[list[int], list[int]]:
        """``rows`` and their token targets as ints, checked: as many targets as rows, no row twice, every
        row in range, no target above ``max_row_tokens`` (GeometryError naming ``op`` and the numbers)."""
        rows = [as_int(r, "a row") for r in rows]
        tokens = [as_int(n, what) for n in tokens]
        if len(rows) != len(tokens):
            raise GeometryError(f"{op}() got {len(rows)} rows but {len(tokens)} {plural}")
        if len(set(rows)) != len(rows):
            row = next(r for i, r in enumerate(rows) if r in rows[:i])
            raise GeometryError(f"row {row} is listed twice in one {op}()")
        for row, n in zip(rows, tokens):
            self._check_row(row)
            if n > self.max_row_tokens:
                raise GeometryError(
                    f"row {row} would hold {n} tokens, more than max_pages_per_row={self.max_pages_per_row} x "
                    f"page_size={self.page_size} = {self.max_row_tokens}"
                )
        return rows, tokens

    def pages_needed(self, rows: Sequence[int], new_lengths: Sequence[int]) -> int:
        """Pages to allocate so that each ``rows[i]`` can hold ``new_lengths[i]`` tokens."""
        need = 0
        for row, n in zip(rows, new_lengths):
            need += max(0, -(-n // self.page_size) - len(self.rows[row]))
        return need

    def grow(self, rows: Sequence[int], new_lengths: Sequence[int], in_flight_pages: Sequence[int] = (),
             in_flight_slots: Sequence[int] = ()) -> None:
        """Make each ``rows[i]`` hold ``new_lengths[i]`` tokens, allocating pages; all rows or none.

        ``kv_len`` is set to the new lengths (tokens written this step count as stored: the step writes
        them before attention reads them). ``in_flight_pages`` / ``in_flight_slots``: PHYSICAL ids that a
        compaction made room for these pages must not move (a page allocation may compact either side).

        Raises:
            GeometryError: a row out of range or listed twice, ``rows`` and ``new_lengths`` of different
                lengths, a length below the row's current one, or above ``max_pages_per_row * page_size``.
            PoolExhausted: the pages do not fit; no row changed.
        """
        rows, new_lengths = self._row_targets("grow", rows, new_lengths, "a new row length", "new lengths")
        for row, n in zip(rows, new_lengths):
            if n < self.lengths[row]:
                raise GeometryError(f"row {row} holds {self.lengths[row]} tokens; cannot shrink it to {n}")
        self._add_pages(rows, new_lengths, in_flight_pages, in_flight_slots)
        for row, n in zip(rows, new_lengths):
            self.lengths[row] = n
        if rows:
            self._host_len[torch.tensor(rows, dtype=torch.int64)] = torch.tensor(new_lengths, dtype=torch.int32)
        self.sync()

    def reserve(self, rows: Sequence[int], capacities: Sequence[int], in_flight_pages: Sequence[int] = (),
                in_flight_slots: Sequence[int] = ()) -> int:
        """Allocate pages so that each ``rows[i]`` can hold ``capacities[i]`` tokens, without changing the
        stored lengths (``lengths`` and ``kv_len``); all rows or none. Returns the pages allocated.

        For a writer that advances the lengths on the device (the decode runner, which computes each
        step's write location from ``kv_len`` and the device page table) and allocates several steps ahead.
        A capacity the row's pages already hold allocates nothing (capacities never shrink a row).

        Raises:
            GeometryError: a row out of range or listed twice, ``rows`` and ``capacities`` of different
                lengths, a capacity above ``max_pages_per_row * page_size``.
            PoolExhausted: the pages do not fit; no row changed.
        """
        rows, capacities = self._row_targets("reserve", rows, capacities, "a row capacity", "capacities")
        fresh = self._add_pages(rows, capacities, in_flight_pages, in_flight_slots)
        if fresh:
            self.sync()
        return fresh

    def set_length(self, row: int, length: int) -> int:
        """Set ``row``'s stored length to ``length`` tokens (what a device-side writer reports it wrote) and
        free its pages beyond the ``ceil(length / page_size)`` that hold them; returns the pages freed.

        Raises:
            GeometryError: a row out of range, or a length below 0 or above what the row's pages hold.
        """
        row = self._check_row(row)
        length = as_int(length, "a row length")
        pages = self.rows[row]
        if not 0 <= length <= len(pages) * self.page_size:
            raise GeometryError(f"row {row}: a length of {length} tokens does not fit its {len(pages)} pages of "
                                f"{self.page_size} tokens")
        keep = -(-length // self.page_size)
        extra = pages[keep:]
        if extra:
            self.pool.free_pages(extra)
            del pages[keep:]
            self._host_table[row, keep:] = -1
        self.lengths[row] = length
        self._host_len[row] = length
        self.sync()
        return len(extra)

    @property
    def host_table(self) -> torch.Tensor:
        """The host copy of the page table, int32 ``[B, P]`` (-1 = no page); read it, never write it."""
        return self._host_table

    def _add_pages(self, rows: list[int], capacities: list[int], in_flight_pages, in_flight_slots) -> int:
        """Allocate the pages ``rows`` need to hold ``capacities`` tokens (all or none) and append them to
        the rows and the host table; returns how many were allocated."""
        need = self.pages_needed(rows, capacities)
        fresh = self.pool.alloc_pages(need, in_flight_pages, in_flight_slots) if need else []
        it = iter(fresh)
        for row, n in zip(rows, capacities):
            pages = self.rows[row]
            while len(pages) * self.page_size < n:
                p = next(it)
                self._host_table[row, len(pages)] = p
                pages.append(p)
        return len(fresh)

    def locations(self, row: int, start: int, count: int) -> torch.Tensor:
        """Virtual token locations (int64 ``[count]``, host) of tokens ``start .. start+count-1`` of ``row``.

        Raises:
            GeometryError: a token beyond the row's allocated pages.
        """
        row = self._check_row(row)
        start, count = as_int(start, "start"), as_int(count, "count")
        if count < 0:
            raise GeometryError(f"row {row}: count must be >= 0, got {count}")
        pages = self.rows[row]
        if start < 0 or start + count > len(pages) * self.page_size:
            raise GeometryError(
                f"row {row}: tokens [{start}, {start + count}) lie outside its {len(pages)} pages of {self.page_size}"
            )
        idx = torch.arange(start, start + count, dtype=torch.int64)
        table = torch.tensor(pages, dtype=torch.int64) if pages else torch.zeros(0, dtype=torch.int64)
        return table[idx // self.page_size] * self.page_size + idx % self.page_size

    def token_locations(self, positions: torch.Tensor) -> torch.Tensor:
        """Virtual location (int64 ``[B]``, host) of token ``positions[b]`` of row ``b`` for every row
        ``b < len(positions)``, in one vectorised step (a decode step's write locations).

        Args:
            positions: int64 ``[B]`` host tensor, ``B <= max_batch_size``.

        Raises:
            GeometryError: a position outside its row's allocated pages (the first such row is named).
        """
        if not isinstance(positions, torch.Tensor) or positions.dim() != 1 or positions.shape[0] > self.max_batch_size:
            shape = list(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise GeometryError(f"positions must be [B <= {self.max_batch_size}], got {shape}")
        if positions.is_floating_point() or positions.dtype == torch.bool:
            raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
        rows = positions.shape[0]
        pages = torch.tensor([len(self.rows[b]) for b in range(rows)], dtype=torch.int64)
        bad = torch.nonzero((positions < 0) | (positions >= pages * self.page_size)).reshape(-1)
        if bad.numel():
            b = int(bad[0])
            raise GeometryError(f"row {b}: token {int(positions[b])} lies outside its {int(pages[b])} pages of "
                                f"{self.page_size}")
        page = self._host_table[torch.arange(rows), positions // self.page_size].to(torch.int64)
        return page * self.page_size + positions % self.page_size

    def release(self, row: int) -> None:
        """Free every page of ``row`` and empty it."""
        row = self._check_row(row)
        if self.rows[row]:
            self.pool.free_pages(self.rows[row])
        self.rows[row] = []
        self.lengths[row] = 0
        self._host_table[row] = -1
        self._host_len[row] = 0
        self.sync()

    def release_all(self) -> None:
        """Free every row's pages."""
        pages = [p for r in self.rows for p in r]
        if pages:
            self.pool.free_pages(pages)
        self.rows = [[] for _ in range(self.max_batch_size)]
        self.lengths = [0] * self.max_batch_size
        self._host_table.fill_(-1)
        self._host_len.zero_()
        self.sync()

    def sync(self) -> None:
        """Refresh the device copies in place, in stream order and without making the host wait for the
        GPU (a no-op on the CPU, where they are the host tensors)."""
        if self.page_table is not self._host_table:
            self._upload_table(self._host_table)
            self._upload_len(self._host_len)

