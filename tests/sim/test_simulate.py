"""The capacity simulator: real pools on the meta device, a deterministic FCFS scheduler, no leaks."""

import random

import numpy as np
import pytest

from unimem_compile.errors import GeometryError
from unimem_compile.pool import ArenaLayout, MultiEndedAllocator, geometry, padded_group_bytes
from unimem_compile.sim.simulate import (
    GIB,
    PaddedHybridSystem,
    Request,
    StaticSplitSystem,
    UnifiedSystem,
    phased_trace,
    simulate,
    stationary_trace,
)

KV, STATE = geometry("kimi-linear-48b")
BUDGET = 3 * GIB


def _small_phased(seed):
    return phased_trace(seed, chat_ticks=6, chat_rate=10.0, n_long=3, long_ticks=2, gap_ticks=3)


def _small_stationary(seed):
    return stationary_trace(seed, ticks=12, rate=8.0, long_fraction=0.05)


SYSTEMS = {
    "unified": lambda: UnifiedSystem(KV, STATE, BUDGET),
    "static": lambda: StaticSplitSystem(KV, STATE, BUDGET, 0.5),
    "padded": lambda: PaddedHybridSystem(KV, STATE, BUDGET),
}


def test_traces_are_deterministic_for_a_seed_and_differ_across_seeds():
    for make in (_small_phased, _small_stationary):
        a, b, c = make(3), make(3), make(4)
        assert a == b and a != c
        assert [r.arrival for r in a] == sorted(r.arrival for r in a)
        assert [r.rid for r in a] == list(range(len(a)))
        assert all(r.prompt > 0 and r.output > 0 for r in a)
    phased = _small_phased(3)
    longs = [r for r in phased if r.kind == "long"]
    chats = [r for r in phased if r.kind == "chat"]
    assert len(longs) == 3 and all(r.prompt >= 32 * 1024 for r in longs)
    # phase order: every long request arrives after the first chat burst and before the second ends
    assert min(r.arrival for r in longs) >= 6 and max(r.arrival for r in longs) < 6 + 3 + 2
    assert any(r.arrival < 6 for r in chats) and any(r.arrival >= 11 for r in chats)


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_a_trace_leaves_no_page_or_slot_behind_and_invariants_hold_every_tick(name):
    system = SYSTEMS[name]()
    trace = _small_phased(0)
    r = simulate(system, trace, KV, STATE, check_invariants=True)
    assert r.finished + r.rejected == len(trace) and r.finished > 0
    for pool in system.pools():
        a = pool.allocator
        assert a.pages_used == 0 and a.slots_used == 0
        for side in (a.kv, a.state):
            assert (side.v2p[1:side.n] == -1).all() and (side.p2v[1:side.n] == -1).all()
        a.check_invariants()
    assert system.kv_bytes() == 0 and system.state_bytes() == 0
    # idle, all is free but each pool's sink and tail pad, which reserved_bytes() reports
    lays = [pool.layout for pool in system.pools()]
    assert system.reserved_bytes() == sum(lay.memory_budget - lay.usable + lay.sink_floor for lay in lays) > 0
    assert system.free_bytes() + system.reserved_bytes() == system.budget == sum(lay.memory_budget for lay in lays)
    # memory use per tick: allocation covers what the running requests need, within the budget
    useful = np.asarray(r.timeline["useful_bytes"])
    allocated = np.asarray(r.timeline["kv_bytes"]) + np.asarray(r.timeline["state_bytes"])
    assert (useful <= allocated).all() and (allocated <= BUDGET).all()
    assert r.peak_concurrent == max(r.timeline["running"]) > 0
    # the under-load means are over exactly the ticks that ended with requests waiting
    loaded = np.asarray(r.timeline["waiting"]) > 0
    assert r.loaded_ticks == int(loaded.sum()) > 0
    assert r.mean_useful_fraction_loaded == pytest.approx(useful[loaded].sum() / loaded.sum() / BUDGET, rel=1e-12)
    assert r.mean_concurrent_loaded == pytest.approx(np.asarray(r.timeline["running"])[loaded].mean(), rel=1e-12)


def test_a_simulation_is_deterministic():
    trace = _small_stationary(1)
    a = simulate(UnifiedSystem(KV, STATE, BUDGET), trace, KV, STATE)
    b = simulate(UnifiedSystem(KV, STATE, BUDGET), trace, KV, STATE)
    assert a.summary() == b.summary() and a.timeline == b.timeline


def test_the_unified_pool_never_refuses_while_free_memory_could_hold_the_request():
    trace = _small_phased(2)
    unified = simulate(UnifiedSystem(KV, STATE, BUDGET), trace, KV, STATE, check_invariants=True)
    assert unified.refused > 0  # the trace does overload the pool
    assert unified.refused_with_room == 0 and unified.retracted_with_room == 0
    assert unified.extra["compactions"] > 0  # room came from closing holes, not only from the gap
    static = simulate(StaticSplitSystem(KV, STATE, BUDGET, 0.5), trace, KV, STATE)
    assert static.refused_with_room > 0  # one pool full while the other idles: the stranded memory


def test_a_request_too_large_for_a_static_kv_pool_is_rejected_not_stuck():
    trace = _small_phased(0)
    biggest = max(r.prompt + r.output for r in trace)
    system = StaticSplitSystem(KV, STATE, BUDGET, 0.2)
    assert not system.can_ever_hold(biggest)
    r = simulate(system, trace, KV, STATE)
    too_big = sum(not system.can_ever_hold(q.prompt + q.output) for q in trace)
    assert r.rejected == too_big > 0 and r.finished == len(trace) - too_big


def test_padded_system_allocates_exactly_the_padded_group_bytes():
    system = PaddedHybridSystem(KV, STATE, BUDGET)
    rng = random.Random(7)
    for tokens in [1, 1919, 1920, 1921] + [rng.randrange(1, 300_000) for _ in range(40)]:
        assert system.pages_for(tokens) * system.layout.page_bytes == padded_group_bytes(KV, STATE, tokens)


def test_hole_reuse_order_matches_a_reference_under_heavy_churn():
    # many more holes than the allocator's lazy heap keeps before rebuilding: pages must still come back
    # highest hole first and slots lowest hole first, exactly as a sorted-set reference says
    layout = ArenaLayout.for_capacity(KV, STATE, 64, 600, 40)
    alloc = MultiEndedAllocator(layout)
    rng = random.Random(11)
    live = {"kv": [], "state": []}
    most_holes = most_stale = 0
    for _ in range(400):
        side = "kv" if rng.random() < 0.8 else "state"
        s = alloc.kv if side == "kv" else alloc.state
        if live[side] and rng.random() < 0.45:
            victims = rng.sample(live[side], rng.randint(1, min(25, len(live[side]))))
            alloc.free(side, victims)
            live[side] = [v for v in live[side] if v not in victims]
        else:
            n = rng.randint(1, 12 if side == "kv" else 2)
            holes = sorted(s.hole_set, reverse=side == "kv")
            if not alloc.can_alloc(side, n):
                continue
            expected_from_holes = holes[:n]
            ids = alloc.alloc(side, n)
            got = [int(s.v2p[v]) for v in ids]
            assert got[:len(expected_from_holes)] == expected_from_holes
            live[side] += ids
        alloc.check_invariants()
        most_holes = max(most_holes, len(alloc.kv.hole_set))
        most_stale = max(most_stale, len(alloc.kv.holes) - len(alloc.kv.hole_set))
    assert most_holes > 64 and most_stale > 0  # the churn did reach the lazy-heap regime


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_a_request_the_empty_system_holds_only_without_the_reserve_is_served_not_stuck(name):
    # the growth reserve is waived while nothing runs: a request that fills the empty system (but not the
    # system minus its reserve) used to block the FCFS queue for ever
    from unimem_compile.sim.simulate import Request

    system = SYSTEMS[name]()
    big = 1
    while system.can_ever_hold(big * 2):
        big *= 2
    while system.can_ever_hold(big + 64):  # the largest request (in 64-token steps) the system holds
        big += 64
    prompt = big - 16
    assert not system.can_admit(prompt, 0.3)  # the reserve would never let it in
    trace = [Request(0, 0, prompt, 16, "long"), Request(1, 0, 100, 16, "chat")]
    r = simulate(system, trace, KV, STATE, reserve_fraction=0.3, max_ticks=50)
    assert r.finished == 2 and r.rejected == 0


@pytest.mark.parametrize("bad", [-0.5, 1.0, 1.5])
def test_a_reserve_outside_zero_one_is_refused(bad):
    with pytest.raises(ValueError, match=f"reserve_fraction must be in \\[0, 1\\), got {bad}"):
        simulate(SYSTEMS["unified"](), _small_phased(0), KV, STATE, reserve_fraction=bad)


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5, -0.2])
def test_a_static_split_outside_zero_one_is_refused_by_name(bad):
    from unimem_compile.errors import GeometryError

    with pytest.raises(GeometryError, match=f"kv_fraction must be in \\(0, 1\\), got {bad}"):
        StaticSplitSystem(KV, STATE, BUDGET, bad)
    with pytest.raises(GeometryError, match=f"static split 0.0001 of {BUDGET} bytes: KV pool {round(BUDGET * 1e-4)} "
                                            f"bytes, state pool {BUDGET - round(BUDGET * 1e-4)} bytes: "):
        StaticSplitSystem(KV, STATE, BUDGET, 0.0001)


def test_custom_traces_are_checked_and_late_rejections_do_not_stretch_the_run():
    """Found by a fresh session evaluating its own workload: each case used to give a silent wrong figure
    or a bare KeyError / AttributeError."""
    system = lambda: UnifiedSystem(KV, STATE, BUDGET)  # noqa: E731
    for trace, message in (
        ([Request(7, 0, 100, 32, "c"), Request(7, 0, 100, 64, "c")], "repeats rid 7"),
        ([Request(0, 5, 100, 16, "c"), Request(1, 0, 100, 16, "c")], "sorted by arrival: trace\\[1\\] arrives at tick 0"),
        ([Request(0, 0, 100, -3, "c")], "trace\\[0\\].output must be a non-negative int, got -3"),
        ([Request(0, 0, 100.5, 3, "c")], "trace\\[0\\].prompt must be a non-negative int, got 100.5"),
    ):
        with pytest.raises(ValueError, match=message):
            simulate(system(), trace, KV, STATE)
    # a request no system state could hold is rejected up front: the run ends with the last completion
    huge = BUDGET // KV.token_bytes * 2
    r = simulate(system(), [Request(0, 0, 100, 16, "c"), Request(1, 1000, huge, 1, "c")], KV, STATE)
    assert (r.ticks, r.finished, r.rejected, r.mean_concurrent) == (2, 1, 1, 0.5)  # not 1001 ticks
    # a far-future arrival: idle ticks are recorded at once, and max_ticks counts ticks without progress
    r = simulate(system(), [Request(0, 0, 100, 16, "c"), Request(1, 150_000, 100, 32, "c")], KV, STATE,
                 max_ticks=50)
    assert r.ticks == 150_003 and r.finished == 2 and len(r.timeline["running"]) == r.ticks
    assert sum(r.timeline["running"]) == 3 and r.mean_concurrent_loaded is None  # never a queue
    assert r.timeline["kv_bytes"][1:150_000] == [0] * 149_999
    # numpy ints are ints
    assert simulate(system(), [Request(0, 0, 100, 16, "c")], KV, STATE, tokens_per_tick=np.int64(8)).ticks == 3


def test_the_simulator_needs_both_sides_and_the_systems_page_size():
    for make in (lambda kv, st: UnifiedSystem(kv, st, BUDGET), lambda kv, st: StaticSplitSystem(kv, st, BUDGET, 0.5),
                 lambda kv, st: PaddedHybridSystem(kv, st, BUDGET)):
        with pytest.raises(GeometryError, match="needs both a KV spec and a state spec"):
            make(KV, None)
        with pytest.raises(GeometryError, match="needs both a KV spec and a state spec"):
            make(None, STATE)
    with pytest.raises(ValueError, match="page_size=64 differs from the unified system's page size 16"):
        simulate(UnifiedSystem(KV, STATE, BUDGET, page_size=16), _small_phased(0), KV, STATE, page_size=64)
    for bad in (0, -16, 2.5):
        with pytest.raises(GeometryError, match="kernel_block must be a positive number of tokens"):
            PaddedHybridSystem(KV, STATE, BUDGET, kernel_block=bad)
        with pytest.raises(GeometryError, match="kernel_block must be a positive number of tokens"):
            padded_group_bytes(KV, STATE, 100, kernel_block=bad)
