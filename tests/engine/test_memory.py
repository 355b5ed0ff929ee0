"""The engine's memory systems and scheduler without a model: pools on the meta device (real allocator and
tables, no arena storage)."""

import pytest
import torch

from unimem_compile.engine import PoolMemory, QuotaMemory, Scheduler
from unimem_compile.errors import InvalidFree, PoolExhausted
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, UnifiedPool

PS = 16
KV = MLASpec(2, 32, 16, torch.float32)
STATE = LinearStateSpec.kda(2, 2, 8, 4, torch.float32)


def pool(pages=12, slots=4):
    return UnifiedPool(ArenaLayout.for_capacity(KV, STATE, PS, pages, slots), "meta", poison=False)


class Req:
    def __init__(self, rid, tokens):
        self.rid, self.tokens = rid, tokens


def test_a_stale_id_freed_after_reuse_is_caught_with_check_owner():
    memory = PoolMemory(pool(), check_owner=True)
    memory.admit("a", 40)  # 3 pages, 1 slot
    stale_pages, stale_slot = list(memory.pages["a"]), memory.slots["a"]
    memory.release("a")
    memory.admit("b", 40)
    assert set(memory.pages["b"]) & set(stale_pages) and memory.slots["b"] == stale_slot  # ids handed on
    with pytest.raises(InvalidFree, match=rf"request 'a' frees page \d+, which request 'b' holds"):
        memory.free("a", stale_pages, [])
    with pytest.raises(InvalidFree, match=rf"frees slot {stale_slot}, which request 'b' holds"):
        memory.free("a", [], [stale_slot])
    assert memory.pool.allocator.pages_used == 3 and memory.pool.allocator.slots_used == 1  # nothing freed
    memory.release("b")
    assert memory.pool.allocator.pages_used == 0 and memory.pool.allocator.slots_used == 0


def test_without_check_owner_a_stale_free_frees_the_new_owners_memory():
    memory = PoolMemory(pool(), check_owner=False)
    memory.admit("a", 16)
    stale = list(memory.pages["a"])
    memory.release("a")
    memory.admit("b", 16)
    memory.free("a", stale, [])  # the hazard the debug check exists for
    assert memory.pool.allocator.pages_used == 0


def test_quota_memory_caps_each_side():
    p = pool(pages=12, slots=4)
    lay = p.layout
    room = lay.usable - lay.sink_floor
    memory = QuotaMemory(p, 3.5 * lay.page_bytes / room)
    assert memory.kv_cap_pages == 3
    assert memory.can_admit(48, 0.0) and not memory.can_admit(49, 0.0)
    memory.admit("a", 32)
    with pytest.raises(PoolExhausted, match="the kv share of the static split .* holds 3 pages: 2 in use, 2 more"):
        memory.grow("a", 64)
    assert memory.pages["a"] and len(memory.pages["a"]) == 2
    memory.release("a")


def test_scheduler_fcfs_blocks_and_preempts_the_newest():
    memory = PoolMemory(pool(pages=6, slots=4))
    s = Scheduler(memory, reserve_fraction=0.0)
    a, b, c = Req("a", 32), Req("b", 32), Req("c", 16)
    for r in (a, b, c):
        s.enqueue(r)
    admitted, blocked = s.admit()
    assert [r.rid for r in admitted] == ["a", "b", "c"] and blocked is None
    victims = s.grow(a, 80)  # a needs 5 pages: c (newest) and then b go back to the queue front
    assert [v.rid for v, _ in victims] == ["c", "b"]
    assert [r.rid for r in s.waiting] == ["b", "c"] and s.running == [a]
    admitted, blocked = s.admit()
    assert admitted == [] and blocked is b  # FCFS: c would fit but does not overtake b
    victims = s.grow(a, 200)
    assert [v.rid for v, _ in victims] == ["a"] and s.running == []  # the grower itself is the newest
    s.finish(b)
    assert [r.rid for r in s.waiting] == ["a", "c"]
    assert memory.pool.allocator.pages_used == 0
