"""Hypothesis state machine: random alloc / free / compact / write / read on both sides of one arena.

Invariants after every step: v2p and p2v are inverse on live ids, the sides never overlap each other or
the sink, free and live virtual ids are disjoint and cover the id range, v2p[0] == 0, the sink bytes are
zero, and every value written is read back unchanged at its virtual id, whatever compaction moved.
"""

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from unimem_compile.errors import PoolExhausted
from unimem_compile.pool import ArenaLayout, LinearStateSpec, MLASpec, UnifiedPool

D = 48


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.g = torch.Generator().manual_seed(0)
        self.pool = None

    @rule(ps=st.sampled_from([1, 4, 16]), n_pages=st.integers(4, 24), n_slots=st.integers(2, 8),
          seed=st.integers(0, 2**16))
    @precondition(lambda self: self.pool is None)
    def create(self, ps, n_pages, n_slots, seed):
        kv = MLASpec(2, 32, 16, torch.float32)
        state = LinearStateSpec.kda(2, 2, 4, 3, torch.float32)
        # budget for a mix, so that either side can run into the other
        self.pool = UnifiedPool(ArenaLayout.for_capacity(kv, state, ps, n_pages, n_slots), poison=True)
        self.g.manual_seed(seed)
        self.rows = {}  # (layer, virtual location) -> row
        self.states = {}  # virtual slot -> recurrent state of layer 1

    def _live_pages(self):
        return self.pool.allocator.live_virtual("kv")

    def _live_slots(self):
        return self.pool.allocator.live_virtual("state")

    @rule(n=st.integers(1, 6))
    @precondition(lambda self: self.pool is not None)
    def alloc_pages(self, n):
        try:
            self.pool.alloc_pages(n)
        except PoolExhausted as e:
            assert e.side == "kv" and e.requested == n * self.pool.layout.page_bytes

    @rule(n=st.integers(1, 3))
    @precondition(lambda self: self.pool is not None)
    def alloc_slots(self, n):
        try:
            for s in self.pool.alloc_slots(n):
                self.states[s] = torch.zeros(2, 4, 4)  # allocation zero-fills
        except PoolExhausted as e:
            assert e.side == "state"

    @rule(data=st.data())
    @precondition(lambda self: self.pool is not None and self._live_pages())
    def free_pages(self, data):
        live = self._live_pages()
        victims = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        self.pool.free_pages(victims)
        ps = self.pool.layout.page_size
        self.rows = {k: v for k, v in self.rows.items() if k[1] // ps not in victims}

    @rule(data=st.data())
    @precondition(lambda self: self.pool is not None and self._live_slots())
    def free_slots(self, data):
        live = self._live_slots()
        victims = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        self.pool.free_slots(victims)
        for v in victims:
            del self.states[v]

    @rule(side=st.sampled_from(["kv", "state", "both"]), data=st.data())
    @precondition(lambda self: self.pool is not None)
    def compact(self, side, data):
        pages = self.pool.physical_pages(self._live_pages())
        slots = self.pool.physical_slots(self._live_slots()).tolist() if self._live_slots() else []
        pin_pages = data.draw(st.lists(st.sampled_from(pages), unique=True, max_size=2)) if pages else []
        pin_slots = data.draw(st.lists(st.sampled_from(slots), unique=True, max_size=2)) if slots else []
        pinned = {"kv": pin_pages, "state": pin_slots}
        moves = self.pool.compact(side, pinned if side == "both" else pinned[side])
        for m in moves:
            assert m.src not in pinned[m.side]

    @rule(data=st.data(), layer=st.integers(0, 1))
    @precondition(lambda self: self.pool is not None and self._live_pages())
    def write_rows(self, data, layer):
        ps = self.pool.layout.page_size
        pages = data.draw(st.lists(st.sampled_from(self._live_pages()), min_size=1, max_size=4))
        locs = torch.tensor([p * ps + data.draw(st.integers(0, ps - 1)) for p in pages] + [-1])
        rows = torch.randn(len(locs), D, generator=self.g)
        self.pool.write_kv(layer, locs, rows)
        for t, r in zip(locs.tolist(), rows):
            if t >= 0:
                self.rows[(layer, t)] = r

    @rule(data=st.data())
    @precondition(lambda self: self.pool is not None and self._live_slots())
    def write_state(self, data):
        s = data.draw(st.sampled_from(self._live_slots()))
        value = torch.randn(2, 4, 4, generator=self.g)
        _, rec = self.pool.state_views(1)
        rec[int(self.pool.physical_slots([s])[0])] = value
        self.states[s] = value

    @invariant()
    def structure_holds(self):
        if self.pool is None:
            return
        self.pool.allocator.check_invariants()
        assert int(self.pool.v2p[0]) == 0
        assert int(self.pool.arena[: self.pool.layout.sink_floor].count_nonzero()) == 0

    @invariant()
    def every_written_value_reads_back(self):
        if self.pool is None:
            return
        for (layer, t), row in self.rows.items():
            assert torch.equal(self.pool.read_kv(layer, torch.tensor([t]))[0], row)
        _, rec = self.pool.state_views(1)
        for s, value in self.states.items():
            assert torch.equal(rec[int(self.pool.physical_slots([s])[0])], value)


ArenaMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestArena = ArenaMachine.TestCase
