"""Compaction never moves a page or slot that the step in flight writes: the hazard planted in generate().

In the middle of a decode step of the tiny Kimi-Linear model (after its first three layers ran: KDA
states and MLA rows of this step are already written), another request allocates from the same pool, with
the step's physical pages and slots listed as in flight, in a pool arranged so that the allocation fits only
after compacting the other side and an unpinned compaction WOULD move the step's ids. The test checks:

* the allocation compacted (other requests' pages / slots moved) but no id of the step moved;
* the bytes the step wrote so far are unchanged at the same physical addresses (what a kernel still in
  flight, or a graph holding its addresses, relies on), and every moved byte of the other request is
  readable at its virtual id;
* the generation finishes with logits identical to an undisturbed run, and once everything is released
  the pool is empty and every free byte is poison again.
"""

from __future__ import annotations

import copy

import pytest
import torch

import unimem_compile
from unimem_compile.demo import teacher_forced_logits
from unimem_compile.hf.models import build_model
from unimem_compile.pool import ArenaLayout

PS, PROMPT, NEW = 4, 6, 6
HAZARD_AT = PROMPT + 2  # the decode step that writes token 8 of each row


class Hazard:
    """The forward pre-hook of the second MLA layer that plants the hazard once, at decode step HAZARD_AT.

    ``others`` holds the other request's ids: ``"above"`` pages (kv) or ``"below"`` slots (state) allocated
    before the generation, and the ``"pages"`` / ``"slots"`` it allocates during the step.
    """

    def __init__(self, pool, side: str, others: dict, gen: torch.Generator):
        self.pool, self.side, self.others, self.gen = pool, side, others, gen
        self.fired = False

    def __call__(self, module, args, kwargs):
        cache = kwargs["cache"]
        if self.fired or cache.logical_len != HAZARD_AT + 1:
            return
        self.fired = True
        pool, a = self.pool, self.pool.allocator
        pages_v = [p for row in cache.page_tables.rows for p in row]
        slots_v = list(cache.slots)
        pages_p, slots_p = pool.physical_pages(pages_v), pool.physical_slots(slots_v).tolist()
        loc = cache.write_loc.reshape(-1)
        written_rows = pool.read_kv(0, loc)  # MLA layer 0 already wrote this step's rows
        addresses = pool.dense_rows(loc)
        slot_bytes = [pool._slot_rows()[p].clone() for p in slots_p]  # both KDA layers updated the states

        if self.side == "kv":
            # other pages fill the gap below the step's pages; the pages above them are freed: a slot now
            # fits only if compaction moves pages up into those holes
            self.add("pages", pool.alloc_pages(a._gap_capacity(a.kv)))
            pool.free_pages(self.others.pop("above"))
            other_side, allocate = "state", pool.alloc_slots
        else:
            # one other slot above the step's slots, three holes below them, the gap filled with pages: a
            # page fits only if compaction moves slots down into those holes
            self.add("slots", pool.alloc_slots(1))
            pool.free_slots(self.others.pop("below"))
            self.add("pages", pool.alloc_pages(a._gap_capacity(a.kv)))
            other_side, allocate = "kv", pool.alloc_pages
        assert not a.can_alloc(other_side, 1) and a.can_alloc_after_compaction(other_side, 1)
        unpinned = copy.deepcopy(a).plan_compaction(self.side)
        assert {m.virtual for m in unpinned} & set(pages_v if self.side == "kv" else slots_v), \
            "the hazard is not real: an unpinned compaction would not move the step's ids"
        others = self.contents()

        compactions = pool.compactions
        self.add("slots" if self.side == "kv" else "pages", allocate(1, pages_p, slots_p))

        assert pool.compactions == compactions + 1
        assert pool.physical_pages(pages_v) == pages_p and pool.physical_slots(slots_v).tolist() == slots_p
        assert torch.equal(pool.dense_rows(loc), addresses) and torch.equal(pool.read_kv(0, loc), written_rows)
        assert all(torch.equal(pool._slot_rows()[p], b) for p, b in zip(slots_p, slot_bytes))
        assert {k: {v: b for v, b in d.items() if v in others[k]} for k, d in self.contents().items()} == others

    def add(self, kind: str, ids: list[int]) -> None:
        """Record the other request's new ids and give them random bytes (layer-0 rows / whole slots)."""
        self.others[kind] += ids
        pool = self.pool
        for v in ids:
            if kind == "pages":
                rows = torch.randn(PS, pool.layout.kv_cache_dim, generator=self.gen)
                pool.write_kv(0, torch.arange(v * PS, (v + 1) * PS), rows)
            else:
                p = int(pool.physical_slots([v])[0])
                pool._slot_rows()[p] = torch.randint(0, 255, (pool.layout.slot_bytes,), dtype=torch.uint8,
                                                     generator=self.gen)

    def contents(self) -> dict:
        """The other request's page rows and slot bytes by virtual id (as bytes, for ==)."""
        pool = self.pool
        pages = {v: pool.read_kv(0, torch.arange(v * PS, (v + 1) * PS)).numpy().tobytes()
                 for v in self.others["pages"]}
        slots = {v: pool._slot_rows()[int(pool.physical_slots([v])[0])].numpy().tobytes()
                 for v in self.others["slots"]}
        return {"pages": pages, "slots": slots}


@pytest.mark.parametrize("side", ["kv", "state"])
def test_an_allocation_during_a_step_never_moves_the_step_and_its_rows_survive(side, monkeypatch, poison_audit):
    monkeypatch.setenv("UNIMEM_DEBUG", "1")
    gen = torch.Generator().manual_seed(3)
    model = build_model("kimi-linear-tiny")
    adapter = unimem_compile.hf.adapters.adapter_for(model)
    rows_pages = 2 * -(-(PROMPT + NEW) // PS)
    # kv: 60 pages to free above the step's pages and a gap of about 30 pages; state: 6 slots, a few pages
    capacity = (60 + rows_pages + 30, 3) if side == "kv" else (rows_pages + 2, 6)
    budget = ArenaLayout.for_capacity(adapter.kv_spec, adapter.state_spec, PS, *capacity).memory_budget
    unimem_compile.compile(model, max_batch_size=2, max_seq_len=PROMPT + NEW, page_size=PS, memory_budget=budget,
                           backend="eager")
    pool = model.unimem.pool
    ids = torch.randint(3, 1024, (2, PROMPT), generator=gen)
    continuation = torch.randint(3, 1024, (2, NEW), generator=gen)
    with torch.compiler.set_stance("force_eager"):
        want = teacher_forced_logits(model, ids, None, continuation)
        # the other request's ids from before the generation lie above its pages / below its slots
        others = {"pages": [], "slots": []}
        if side == "kv":
            others["above"] = pool.alloc_pages(60)
        else:
            others["below"] = pool.alloc_slots(3)
        hazard = Hazard(pool, side, others, gen)
        handle = model.model.layers[3].register_forward_pre_hook(hazard, with_kwargs=True)
        try:
            got = teacher_forced_logits(model, ids, None, continuation)
        finally:
            handle.remove()
    assert hazard.fired
    assert torch.equal(got, want)
    pool.free_pages(others["pages"])
    pool.free_slots(others["slots"])
    assert pool.allocator.pages_used == 0 and pool.allocator.slots_used == 0
    pool.allocator.check_invariants()
    assert poison_audit(pool)
