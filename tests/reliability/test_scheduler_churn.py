"""Scheduler-level churn: thousands of overlapping requests, compaction included, nothing leaked.

Two schedulers drive the real allocator:

* the capacity simulator's FCFS continuous-batching scheduler (``unimem_compile.sim.simulate``) on the
  Kimi-Linear-48B geometry: thousands of requests through a 3 GiB unified pool, allocator invariants
  checked after every tick. Its arenas live on the meta device: allocation and compaction only.
* a small loop here that moves real bytes (FCFS admission, one token per running request per tick, the
  youngest request preempted and requeued when the pool is exhausted) over a pool sized for a few
  requests, so allocations fail, wait, preempt and compact both sides all the time. Half of the running
  requests are "the step in flight" at every allocation: their pages and slots are passed as in flight
  and must never move. Every token's latent row and every request's state are written through the unimem
  ops (their references, with ``UNIMEM_DEBUG=1`` so every id is checked against the live set) and read
  back when the request finishes; at the end nothing leaks and every free byte is still poison.
"""

import collections
import random

import torch

from unimem_compile.errors import PoolExhausted
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, PageTables, UnifiedPool, geometry
from unimem_compile.sim.simulate import GIB, UnifiedSystem, simulate, stationary_trace

KV = MLASpec(1, 16, 16, torch.float32)  # one layer of 32 fp32 values per token: 512-byte pages of 4 tokens
STATE = LinearStateSpec.kda(1, 2, 8, 4, torch.float32)  # 1280-byte slots (2.5 pages)
PS, D = 4, 32
REC_SHAPE = list(STATE.layers[0].recurrent.shape)
MAX_RUNNING = 6
MAX_TOKENS = 40  # prompt + output of one request: 10 pages
REQUESTS = 2000


def _row_values(rid: int, first: int, count: int) -> torch.Tensor:
    """Token ``first .. first + count - 1`` of request ``rid``: exact small integers in fp32."""
    i = torch.arange(first, first + count, dtype=torch.float32)[:, None]
    return rid * 4096.0 + i * 32.0 + torch.arange(D, dtype=torch.float32)[None, :]


def _state_values(rid: int, steps: int) -> torch.Tensor:
    return (rid * 256.0 + steps + torch.arange(128, dtype=torch.float32)).reshape(REC_SHAPE)


class Loop:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        # room for about four requests at full length: the queue always waits on memory
        self.pool = UnifiedPool(ArenaLayout.for_capacity(KV, STATE, PS, 4 * MAX_TOKENS // PS, 3), poison=True)
        self.tables = PageTables(self.pool, MAX_RUNNING, MAX_TOKENS // PS)
        self.free_rows = list(range(MAX_RUNNING))
        self.running: dict[int, dict] = {}  # rid -> {row, slot, prompt, output, done, order}
        self.order = 0
        self.stats = collections.Counter()
        self.pending: list[tuple[int, int, int]] = []  # this tick's token writes: (rid, first token, count)

    # ---- what the step in flight holds
    def in_flight(self) -> tuple[list[int], list[int], dict]:
        """Physical pages and slots of a random half of the running requests, and their virtual ids."""
        rids = [r for r in self.running if self.rng.random() < 0.5]
        vpages = [p for r in rids for p in self.tables.rows[self.running[r]["row"]]]
        vslots = [self.running[r]["slot"] for r in rids]
        pages = self.pool.physical_pages(vpages)
        slots = self.pool.physical_slots(vslots).tolist()
        return pages, slots, {"pages": (vpages, pages), "slots": (vslots, slots)}

    def assert_not_moved(self, pinned: dict) -> None:
        vpages, pages = pinned["pages"]
        vslots, slots = pinned["slots"]
        assert self.pool.physical_pages(vpages) == pages, "a page of the step in flight moved"
        assert self.pool.physical_slots(vslots).tolist() == slots, "a slot of the step in flight moved"

    # ---- writes and reads through the ops
    def flush(self) -> None:
        """One mla_kv_write for every token this tick produced, one state_scatter for every running state."""
        if self.pending:
            loc = torch.cat([self.tables.locations(self.running[r]["row"], a, n) for r, a, n in self.pending])
            rows = torch.cat([_row_values(r, a, n) for r, a, n in self.pending])
            torch.ops.unimem.mla_kv_write(self.pool.arena, self.pool.v2p, loc, rows[:, :16], rows[:, 16:], 0, 1, PS,
                                          16, 16, torch.float32)
            self.pending = []
        if self.running:
            slots = torch.tensor([req["slot"] for req in self.running.values()])
            value = torch.stack([_state_values(r, req["done"]) for r, req in self.running.items()])
            torch.ops.unimem.state_scatter(self.pool.arena, self.pool.s_v2p, slots, value,
                                           STATE.recurrent_offset(0), STATE.slot_bytes)

    def verify(self, rid: int) -> None:
        req = self.running[rid]
        row, n = req["row"], req["prompt"] + req["done"]
        hist = torch.ops.unimem.mla_gather(self.pool.arena, self.pool.v2p, self.tables.page_table[row:row + 1],
                                           self.tables.kv_len[row:row + 1], torch.zeros(1, dtype=torch.int32), n,
                                           0, 1, PS, 16, 16, torch.float32)
        assert torch.equal(hist[0], _row_values(rid, 0, n)), f"request {rid}: KV rows changed"
        state = torch.ops.unimem.state_gather(self.pool.arena, self.pool.s_v2p, torch.tensor([req["slot"]]),
                                              STATE.recurrent_offset(0), STATE.slot_bytes, REC_SHAPE, torch.float32)
        assert torch.equal(state[0], _state_values(rid, req["done"])), f"request {rid}: state changed"

    # ---- scheduling
    def release(self, rid: int) -> None:
        req = self.running.pop(rid)
        self.pending = [w for w in self.pending if w[0] != rid]
        self.tables.release(req["row"])
        self.pool.free_slots([req["slot"]])
        self.free_rows.append(req["row"])

    def admit(self, queue: collections.deque) -> None:
        while queue and self.free_rows:
            rid, prompt, output = queue[0]
            pages, slots, pinned = self.in_flight()
            try:
                (slot,) = self.pool.alloc_slots(1, pages, slots)
            except PoolExhausted:
                self.stats["admission_waits"] += 1
                return
            row = self.free_rows.pop()
            try:
                self.tables.grow([row], [prompt], pages, slots)
            except PoolExhausted:
                self.pool.free_slots([slot])
                self.free_rows.append(row)
                self.stats["admission_waits"] += 1
                return
            self.assert_not_moved(pinned)
            queue.popleft()
            self.order += 1
            self.running[rid] = dict(row=row, slot=slot, prompt=prompt, output=output, done=0, order=self.order)
            self.pending.append((rid, 0, prompt))

    def decode(self, queue: collections.deque) -> None:
        while self.running:
            rids = list(self.running)
            pages, slots, pinned = self.in_flight()
            lengths = [self.running[r]["prompt"] + self.running[r]["done"] + 1 for r in rids]
            try:
                self.tables.grow([self.running[r]["row"] for r in rids], lengths, pages, slots)
                break
            except PoolExhausted:
                # recompute-style preemption of the youngest request (vLLM's policy); it restarts later
                youngest = max(self.running, key=lambda r: self.running[r]["order"])
                req = self.running[youngest]
                queue.appendleft((youngest, req["prompt"], req["output"]))
                self.release(youngest)
                self.stats["preemptions"] += 1
        else:
            return
        self.assert_not_moved(pinned)
        self.pending += [(r, self.running[r]["prompt"] + self.running[r]["done"], 1) for r in rids]
        for r in rids:
            self.running[r]["done"] += 1

    def finish(self) -> None:
        """Read back and release every request that produced all its tokens (after this tick's writes)."""
        for r in [r for r, req in self.running.items() if req["done"] == req["output"]]:
            self.verify(r)
            self.release(r)
            self.stats["finished"] += 1


def test_thousands_of_overlapping_requests_leak_nothing_and_keep_every_byte(monkeypatch, poison_audit):
    monkeypatch.setenv("UNIMEM_DEBUG", "1")
    loop = Loop(seed=0)
    rng = random.Random(1)
    arrivals = []
    for rid in range(REQUESTS):
        prompt = rng.randint(1, 3 * MAX_TOKENS // 4)
        arrivals.append((rid, prompt, rng.randint(1, MAX_TOKENS - prompt)))
    queue: collections.deque = collections.deque()
    ticks = 0
    while arrivals or queue or loop.running:
        for _ in range(rng.choice([0, 0, 1, 2])):
            if arrivals:
                queue.append(arrivals.pop(0))
        loop.admit(queue)
        loop.decode(queue)
        loop.flush()
        loop.finish()
        ticks += 1
        if ticks % 500 == 0:
            loop.pool.allocator.check_invariants()
    pool, a = loop.pool, loop.pool.allocator
    assert loop.stats["finished"] == REQUESTS
    assert a.pages_used == 0 and a.slots_used == 0
    assert a.kv_watermark == pool.layout.num_pages and a.state_watermark == pool.layout.first_slot
    a.check_invariants()
    assert poison_audit(pool), "the sink or a byte outside every live page / slot was written"
    # the churn exercised what it is about
    print(f"{ticks} ticks, {pool.compactions} compactions, {pool.bytes_moved} bytes moved, {dict(loop.stats)}")
    assert pool.compactions > 50 and loop.stats["preemptions"] > 50 and loop.stats["admission_waits"] > 50


def test_the_capacity_simulators_scheduler_leaks_nothing_over_thousands_of_requests():
    kv, state = geometry("kimi-linear-48b")
    trace = stationary_trace(1, ticks=60, rate=40.0, long_fraction=0.02)
    system = UnifiedSystem(kv, state, 3 * GIB)
    result = simulate(system, trace, kv, state, check_invariants=True)
    assert len(trace) >= 2000 and result.finished + result.rejected == len(trace) and result.finished > 2000
    assert system.stats()["compactions"] > 50
    a, lay = system.pool.allocator, system.layout
    assert a.pages_used == 0 and a.slots_used == 0
    assert a.kv_watermark == lay.num_pages and a.state_watermark == lay.first_slot
    assert a.hole_bytes("kv") == 0 and a.hole_bytes("state") == 0
