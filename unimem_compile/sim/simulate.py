"""A scheduler-level serving simulation on the real pool code: how many requests fit in one byte budget.

Nothing here touches model weights or arena bytes: every pool is a real
:class:`~unimem_compile.pool.unified.UnifiedPool` whose arena lives on the ``meta`` device (shapes only, no
storage), so allocation, hole reuse, compaction and ``PoolExhausted`` are exactly the library's, for a
40 GiB budget on a laptop.

Three memory systems share one budget and one scheduler:

* :class:`UnifiedSystem`: the product. One arena; KV pages from the top end, state slots from the bottom;
  the pool compacts when an allocation fits only after closing holes.
* :class:`StaticSplitSystem`: two pools of fixed sizes, one for KV pages and one for state slots (what
  engines with a separate Mamba/linear-state cache do); memory idle in one pool cannot serve the other.
* :class:`PaddedHybridSystem`: one pool with one page size for every layer, attention blocks padded to the
  per-layer state size (the vLLM v1 hybrid allocator model of :func:`~unimem_compile.pool.padded_group_bytes`).

The policy is the serving engine's own FCFS scheduler (:class:`unimem_compile.engine.Scheduler`, one policy
in the code base): :func:`simulate` drives it tick by tick. Every tick each running request decodes
``tokens_per_tick`` tokens (its pages grow as it crosses page boundaries; a request that cannot grow preempts
the most recently admitted one, which goes back to the front of the queue to be recomputed with the tokens
it had), finished requests free their memory, then waiting requests are admitted in arrival order while
the memory system has room for the request's prompt, one state and a growth reserve (waived while nothing
runs); the first one that does not fit blocks the queue (no overtaking). A tick is a scheduler step, not a
time: prefill and decode cost are not modelled; capacity is. The engine differs only in what a step is (a
block of decode steps of the real model, and chunked prefill of the admitted prompts).

Traces (:func:`stationary_trace`, :func:`phased_trace`) are seeded and documented in their docstrings.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from ..engine.memory import PoolMemory
from ..engine.scheduler import Scheduler
from ..errors import GeometryError, PoolExhausted
from ..pool.layout import ArenaLayout, KVSpec
from ..pool.sizing import padded_block_geometry
from ..pool.specs import LinearStateSpec, MLASpec
from ..pool.unified import UnifiedPool

__all__ = [
    "Request",
    "stationary_trace",
    "phased_trace",
    "TRACES",
    "UnifiedSystem",
    "StaticSplitSystem",
    "PaddedHybridSystem",
    "padded_block_geometry",
    "SimResult",
    "simulate",
]

GIB = 1 << 30


# ---------------------------------------------------------------------------------------------- traces
@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a trace: arrives at tick ``arrival`` with ``prompt`` tokens and generates ``output``
    tokens (no early stop). ``kind`` is ``"chat"`` or ``"long"``."""

    rid: int
    arrival: int
    prompt: int
    output: int
    kind: str


def _chat(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    # chat: prompts lognormal around 1k tokens (system prompt + a few turns), answers around 256 tokens
    prompt = np.clip(rng.lognormal(math.log(1024), 0.7, n), 32, 8192).astype(np.int64)
    output = np.clip(rng.lognormal(math.log(256), 0.6, n), 16, 2048).astype(np.int64)
    return prompt, output


def _long(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    # long context: documents / repositories, log-uniform 32k-192k tokens; answers around 512 tokens
    prompt = np.exp(rng.uniform(math.log(32 * 1024), math.log(192 * 1024), n)).astype(np.int64)
    output = np.clip(rng.lognormal(math.log(512), 0.5, n), 64, 2048).astype(np.int64)
    return prompt, output


def _assemble(arrivals: np.ndarray, kinds: np.ndarray, rng: np.random.Generator) -> list[Request]:
    order = np.argsort(arrivals, kind="stable")
    arrivals, kinds = arrivals[order], kinds[order]
    prompt = np.zeros(len(kinds), dtype=np.int64)
    output = np.zeros(len(kinds), dtype=np.int64)
    for kind, draw in (("chat", _chat), ("long", _long)):
        sel = kinds == kind
        prompt[sel], output[sel] = draw(rng, int(sel.sum()))
    return [Request(i, int(a), int(p), int(o), str(k)) for i, (a, p, o, k) in
            enumerate(zip(arrivals, prompt, output, kinds))]


def stationary_trace(seed: int = 0, ticks: int = 240, rate: float = 60.0, long_fraction: float = 0.02) -> list[Request]:
    """A fixed mix of chat and long-context requests arriving at a constant rate.

    Arrivals: Poisson, ``rate`` requests per tick for ``ticks`` ticks; each request is long-context with
    probability ``long_fraction``, chat otherwise. Chat: prompt lognormal (median 1024 tokens, sigma 0.7,
    clipped to [32, 8192]), output lognormal (median 256, sigma 0.6, clipped to [16, 2048]). Long context:
    prompt log-uniform in [32k, 192k] tokens, output lognormal (median 512, sigma 0.5, clipped to [64, 2048]).
    The default rate overloads a 40 GiB Kimi-Linear-48B pool (a queue builds), which is where capacity
    decides throughput.

    Returns:
        requests sorted by arrival tick, ``rid`` = position.
    """
    rng = np.random.default_rng(seed)
    counts = rng.poisson(rate, ticks)
    arrivals = np.repeat(np.arange(ticks), counts)
    kinds = np.where(rng.random(len(arrivals)) < long_fraction, "long", "chat")
    return _assemble(arrivals, kinds, rng)


def phased_trace(seed: int = 0, chat_ticks: int = 60, chat_rate: float = 70.0, n_long: int = 40,
                 long_ticks: int = 10, gap_ticks: int = 40) -> list[Request]:
    """Three phases: a burst of short chat, then a few long-context requests, then chat again.

    Phase 1: chat arrivals, Poisson ``chat_rate`` per tick over ticks ``[0, chat_ticks)``. Phase 2:
    ``n_long`` long-context requests spread uniformly over ``long_ticks`` ticks starting ``gap_ticks``
    after phase 1 ends. Phase 3: chat again as phase 1, starting when phase 2 ends. Lengths are drawn as in
    :func:`stationary_trace`.

    Returns:
        requests sorted by arrival tick, ``rid`` = position.
    """
    rng = np.random.default_rng(seed)
    phase1 = np.repeat(np.arange(chat_ticks), rng.poisson(chat_rate, chat_ticks))
    long_start = chat_ticks + gap_ticks
    phase2 = rng.integers(long_start, long_start + long_ticks, n_long)
    start3 = long_start + long_ticks
    phase3 = start3 + np.repeat(np.arange(chat_ticks), rng.poisson(chat_rate, chat_ticks))
    arrivals = np.concatenate([phase1, phase2, phase3])
    kinds = np.array(["chat"] * len(phase1) + ["long"] * n_long + ["chat"] * len(phase3))
    return _assemble(arrivals, kinds, rng)


#: trace name -> factory(seed) with the benchmark's parameters
TRACES = {"stationary": stationary_trace, "phased": phased_trace}


# ---------------------------------------------------------------------------------------------- memory systems
def _pool(layout: ArenaLayout) -> UnifiedPool:
    # the meta device gives the real pool (tables, allocator, compaction) without arena storage
    return UnifiedPool(layout, "meta", poison=False)


def _check_hybrid(kv, state, who: str) -> None:
    """The simulator compares how systems share one budget between KV pages and state slots: it needs both."""
    if kv is None or state is None:
        missing = "a KV spec" if kv is None else "a state spec"
        raise GeometryError(f"{who} needs both a KV spec and a state spec (a hybrid model); got no {missing}: for a "
                            "model with one kind of cache every memory system is the same single pool")


class UnifiedSystem(PoolMemory):
    """Every request's pages and its state slot in one :class:`UnifiedPool` of ``budget`` bytes on the
    ``meta`` device: the engine's :class:`~unimem_compile.engine.PoolMemory` without arena storage.

    Args:
        kv, state: the model's sub-pool specs (both required).
        budget: arena bytes.
        page_size: tokens per page.
    """

    def __init__(self, kv: KVSpec, state: LinearStateSpec, budget: int, page_size: int = 64):
        _check_hybrid(kv, state, "UnifiedSystem")
        super().__init__(_pool(ArenaLayout(int(budget), page_size, kv, state)), name="unified", check_owner=False)


class StaticSplitSystem:
    """Two pools of fixed sizes: ``kv_fraction`` of the budget holds KV pages, the rest state slots.

    Args:
        kv, state: the model's sub-pool specs.
        budget: bytes of both pools together.
        kv_fraction: share of ``budget`` given to the KV pool, in (0, 1).
        page_size: tokens per page.

    Raises:
        GeometryError: ``kv_fraction`` outside (0, 1), or a pool too small for one page / one slot (the
            message names the pool and its share).
    """

    def __init__(self, kv: KVSpec, state: LinearStateSpec, budget: int, kv_fraction: float, page_size: int = 64):
        _check_hybrid(kv, state, "StaticSplitSystem")
        self.page_size = page_size
        self.budget = int(budget)
        self.kv_fraction = float(kv_fraction)
        if not 0 < self.kv_fraction < 1:
            raise GeometryError(f"kv_fraction must be in (0, 1), got {kv_fraction}")
        kv_budget = int(round(self.budget * kv_fraction))
        try:
            self.kv_layout = ArenaLayout(kv_budget, page_size, kv, None)
            self.state_layout = ArenaLayout(self.budget - kv_budget, page_size, None, state)
        except GeometryError as e:
            raise GeometryError(f"static split {self.kv_fraction:g} of {self.budget} bytes: KV pool {kv_budget} "
                                f"bytes, state pool {self.budget - kv_budget} bytes: {e}") from None
        self.kv_pool, self.state_pool = _pool(self.kv_layout), _pool(self.state_layout)
        self.name = f"static {100 * self.kv_fraction:.3g}/{100 * (1 - self.kv_fraction):.3g}"
        self._pages: dict[int, list[int]] = {}
        self._slots: dict[int, list[int]] = {}

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.kv_layout.page_size)

    def reserve_pages(self, fraction: float) -> int:
        return math.ceil(fraction * self.kv_layout.memory_budget / self.kv_layout.page_bytes)

    def can_ever_hold(self, tokens: int) -> bool:
        return self.kv_layout.fits(self.pages_for(tokens), 0) and self.state_layout.fits(0, 1)

    def can_admit(self, tokens: int, reserve_fraction: float) -> bool:
        pages = self.kv_pool.allocator.pages_used + self.pages_for(tokens) + self.reserve_pages(reserve_fraction)
        return self.kv_layout.fits(pages, 0) and self.state_layout.fits(0, self.state_pool.allocator.slots_used + 1)

    def admit(self, rid: int, tokens: int) -> None:
        slots = self.state_pool.alloc_slots(1)
        try:
            pages = self.kv_pool.alloc_pages(self.pages_for(tokens))
        except PoolExhausted:
            self.state_pool.free_slots(slots)
            raise
        self._pages[rid], self._slots[rid] = pages, slots

    def grow(self, rid: int, tokens: int) -> None:
        missing = self.pages_for(tokens) - len(self._pages[rid])
        if missing > 0:
            self._pages[rid] += self.kv_pool.alloc_pages(missing)

    def release(self, rid: int) -> None:
        self.kv_pool.free_pages(self._pages.pop(rid))
        self.state_pool.free_slots(self._slots.pop(rid))

    def kv_bytes(self) -> int:
        return self.kv_pool.allocator.pages_used * self.kv_layout.page_bytes

    def state_bytes(self) -> int:
        return self.state_pool.allocator.slots_used * self.state_layout.slot_bytes

    def free_bytes(self) -> int:
        k, s = self.kv_layout, self.state_layout
        return (k.usable - k.sink_floor - self.kv_bytes()) + (s.usable - s.sink_floor - self.state_bytes())

    def reserved_bytes(self) -> int:
        """Each pool's sink and tail pad (the two pools' budgets add up to ``budget``)."""
        return self.budget - (self.kv_layout.usable - self.kv_layout.sink_floor) - (
            self.state_layout.usable - self.state_layout.sink_floor)

    def reserve_bytes(self, fraction: float) -> int:
        return self.reserve_pages(fraction) * self.kv_layout.page_bytes

    def pools(self) -> list[UnifiedPool]:
        return [self.kv_pool, self.state_pool]

    def stats(self) -> dict:
        return {"kv_fraction": self.kv_fraction}


class PaddedHybridSystem:
    """One pool of equal pages (the per-layer state size): a request takes ``attn_layers`` pages per
    ``block_tokens`` tokens plus ``linear_layers`` pages for its states (see :func:`padded_block_geometry`).

    The pool is a real :class:`UnifiedPool` with a one-layer KV spec whose page of ``block_tokens`` rows is
    exactly that page size.
    """

    name = "padded hybrid"

    def __init__(self, kv: MLASpec, state: LinearStateSpec, budget: int, kernel_block: int = 16):
        _check_hybrid(kv, state, "PaddedHybridSystem")
        self.geo = padded_block_geometry(kv, state, kernel_block)
        self.budget = int(budget)
        page_spec = MLASpec(1, kv.kv_lora_rank, kv.qk_rope_head_dim, kv.dtype)
        self.layout = ArenaLayout(self.budget, self.geo["block_tokens"], page_spec, None)
        assert self.layout.page_bytes == self.geo["page_bytes"]
        self.pool = _pool(self.layout)
        self._attn: dict[int, list[int]] = {}
        self._linear: dict[int, list[int]] = {}

    def attn_pages_for(self, tokens: int) -> int:
        return self.geo["attn_layers"] * -(-tokens // self.geo["block_tokens"])

    def pages_for(self, tokens: int) -> int:
        """Pages of one request of ``tokens`` tokens: attention blocks plus one page per linear layer."""
        return self.attn_pages_for(tokens) + self.geo["linear_layers"]

    def reserve_pages(self, fraction: float) -> int:
        return math.ceil(fraction * self.budget / self.layout.page_bytes)

    def can_ever_hold(self, tokens: int) -> bool:
        return self.layout.fits(self.pages_for(tokens), 0)

    def can_admit(self, tokens: int, reserve_fraction: float) -> bool:
        pages = self.pool.allocator.pages_used + self.pages_for(tokens) + self.reserve_pages(reserve_fraction)
        return self.layout.fits(pages, 0)

    def admit(self, rid: int, tokens: int) -> None:
        pages = self.pool.alloc_pages(self.pages_for(tokens))
        n_linear = self.geo["linear_layers"]
        self._linear[rid], self._attn[rid] = pages[:n_linear], pages[n_linear:]

    def grow(self, rid: int, tokens: int) -> None:
        missing = self.attn_pages_for(tokens) - len(self._attn[rid])
        if missing > 0:
            self._attn[rid] += self.pool.alloc_pages(missing)

    def release(self, rid: int) -> None:
        self.pool.free_pages(self._attn.pop(rid) + self._linear.pop(rid))

    def kv_bytes(self) -> int:
        return sum(map(len, self._attn.values())) * self.layout.page_bytes

    def state_bytes(self) -> int:
        return len(self._linear) * self.geo["linear_layers"] * self.layout.page_bytes

    def free_bytes(self) -> int:
        lay = self.layout
        return lay.usable - lay.sink_floor - self.pool.allocator.pages_used * lay.page_bytes

    def reserved_bytes(self) -> int:
        """The sink and the tail pad: ``budget - usable + sink_floor``."""
        return self.budget - self.layout.usable + self.layout.sink_floor

    def reserve_bytes(self, fraction: float) -> int:
        return self.reserve_pages(fraction) * self.layout.page_bytes

    def pools(self) -> list[UnifiedPool]:
        return [self.pool]

    def stats(self) -> dict:
        return dict(self.geo)


# ---------------------------------------------------------------------------------------------- scheduler
@dataclasses.dataclass
class SimResult:
    """What :func:`simulate` measured for one memory system on one trace.

    Concurrency: ``peak_concurrent`` and ``mean_concurrent`` (running requests, i.e. holding memory, per
    tick from tick 0 to the last completion), ``mean_concurrent_loaded`` (the mean over the
    ``loaded_ticks`` ticks that ended with requests waiting: what the memory sustains under pressure,
    independent of how much work the trace offered at quiet times; None when no tick had requests
    waiting: the system was never under pressure, so there is nothing to compare).

    Counters: ``refused`` (distinct requests that found no room at admission at least once; they waited),
    ``refusal_events`` (ticks on which the head of the queue found no room), ``refused_with_room``
    (refusal events while the free bytes of the whole budget could hold the request, its reserve and one
    page + one slot of alignment slack), ``retracted`` (running requests evicted so another could grow),
    ``retracted_with_room`` (growth failures while the free bytes could hold the growth plus the slack),
    ``rejected`` (requests larger than the whole memory system, dropped before the run starts; they do not
    extend it).

    ``mean_allocated_fraction`` / ``mean_useful_fraction``: the per-tick means of bytes allocated (pages +
    slots, padding included) and of bytes the running requests need, over the budget;
    ``mean_useful_fraction_loaded``: the latter over the loaded ticks only (how close the system runs to
    the budget while requests wait: 1.0 is the most any memory system could hold under this scheduler,
    with no padding, fragmentation or reserve; None without loaded ticks). ``tokens_per_tick``:
    decode tokens generated per tick over the run. ``mean_wait_ticks``: arrival to first admission.

    ``timeline`` holds one entry per tick: ``running``, ``waiting``, ``kv_bytes``, ``state_bytes``, ``useful_bytes``
    (tokens x token bytes + raw state bytes of the running requests), and for the unified system the
    region edges of :meth:`UnifiedSystem.occupancy`.
    """

    system: str
    ticks: int
    peak_concurrent: int
    mean_concurrent: float
    mean_concurrent_loaded: float | None
    loaded_ticks: int
    refused: int
    refusal_events: int
    refused_with_room: int
    retracted: int
    retracted_with_room: int
    rejected: int
    finished: int
    mean_allocated_fraction: float
    mean_useful_fraction: float
    mean_useful_fraction_loaded: float | None
    tokens_per_tick: float
    mean_wait_ticks: float
    extra: dict
    timeline: dict[str, list[int]] = dataclasses.field(repr=False)

    def summary(self) -> dict:
        """Every field except the timeline (JSON-ready)."""
        out = dataclasses.asdict(self)
        del out["timeline"]
        return out


@dataclasses.dataclass(eq=False)
class _Live:
    req: Request
    generated: int = 0  # tokens generated so far (kept across a retraction: recompute, not restart)
    admitted_at: int = -1

    @property
    def tokens(self) -> int:
        return self.req.prompt + self.generated

    @property
    def rid(self) -> int:
        return self.req.rid


def _check_trace(trace: list[Request]) -> None:
    seen: set[int] = set()
    last = 0
    for i, r in enumerate(trace):
        for name in ("rid", "arrival", "prompt", "output"):
            value = getattr(r, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"trace[{i}].{name} must be a non-negative int, got {value!r}")
        if r.rid in seen:
            raise ValueError(f"trace[{i}] repeats rid {r.rid}: every request needs its own rid")
        seen.add(r.rid)
        if r.arrival < last:
            raise ValueError(f"the trace must be sorted by arrival: trace[{i}] arrives at tick {r.arrival}, "
                             f"after trace[{i - 1}] at tick {last}")
        last = r.arrival


def simulate(system, trace: list[Request], kv: KVSpec, state: LinearStateSpec, *, tokens_per_tick: int = 16,
             reserve_fraction: float = 0.01, page_size: int | None = None, check_invariants: bool = False,
             max_ticks: int = 100_000) -> SimResult:
    """Run ``trace`` through the FCFS continuous-batching scheduler on ``system`` (see the module docstring).

    Args:
        system: a :class:`UnifiedSystem`, :class:`StaticSplitSystem` or :class:`PaddedHybridSystem` (fresh:
            ``simulate`` leaves it empty again when every request has finished).
        trace: the requests (sorted by arrival).
        kv, state: specs for the useful-bytes figure (tokens x ``kv.token_bytes`` + ``state.raw_bytes``).
        tokens_per_tick: decode tokens each running request generates per tick.
        reserve_fraction: admission keeps this fraction of the growing pool free for running requests
            (in ``[0, 1)``; waived while no request runs).
        page_size: page granularity of the request size in the ``refused_with_room`` test; None (default):
            the system's page size (the padded system: 64). A unified or static system refuses a page size
            other than its own (the test would then count rounding, not stranded memory).
        check_invariants: run every pool allocator's ``check_invariants`` after every tick (slow; tests).
        max_ticks: a guard against a scheduler that stops making progress: RuntimeError after this many
            consecutive ticks without a first admission (a re-admission after a retraction does not count),
            a finished request or a decoded token. Ticks with nothing
            running or waiting are skipped to the next arrival (recorded as idle ticks, not stepped).

    Returns:
        the :class:`SimResult`. Requests no system state could ever hold (``can_ever_hold``) are counted as
        ``rejected`` up front and do not extend the run.

    Raises:
        ValueError: ``reserve_fraction`` outside ``[0, 1)``, ``tokens_per_tick`` < 1, a request whose rid,
            arrival, prompt or output is not a non-negative int, a repeated rid, a trace not sorted by
            arrival, or a ``page_size`` that differs from the unified / static system's.
        RuntimeError: no progress for ``max_ticks`` ticks.
    """
    if not 0 <= reserve_fraction < 1:
        raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction}")
    if isinstance(tokens_per_tick, bool) or not isinstance(tokens_per_tick, (int, np.integer)) or tokens_per_tick < 1:
        raise ValueError(f"tokens_per_tick must be a positive int, got {tokens_per_tick!r}")
    tokens_per_tick = int(tokens_per_tick)  # numpy ints too
    own = getattr(system, "page_size", None)
    if page_size is None:
        page_size = own if own is not None else 64
    elif own is not None and page_size != own:
        raise ValueError(f"page_size={page_size} differs from the {system.name} system's page size {own}: the "
                         "'could the free memory hold it' test must round requests as the system does")
    _check_trace(trace)
    counters = collections.Counter()
    held = [r for r in trace if system.can_ever_hold(r.prompt + r.output)]
    counters["rejected"] = len(trace) - len(held)
    arrivals = collections.deque(held)
    scheduler = Scheduler(system, reserve_fraction=reserve_fraction)
    waiting, running = scheduler.waiting, scheduler.running  # the scheduler's queue and admission order
    page_slot_slack = _slack_bytes(system)
    refused_ids: set[int] = set()
    waits: list[int] = []
    timeline: dict[str, list[int]] = collections.defaultdict(list)
    generated_total = 0
    t = 0
    stalled = 0  # consecutive ticks without an admission, a finish or a decoded token
    while arrivals or waiting or running:
        if not waiting and not running and arrivals[0].arrival > t:
            # nothing to do until the next arrival: record the idle ticks at once
            gap = arrivals[0].arrival - t
            idle = {"running": 0, "waiting": 0, "kv_bytes": system.kv_bytes(), "state_bytes": system.state_bytes(),
                    "useful_bytes": 0}
            if isinstance(system, UnifiedSystem):
                idle.update(system.occupancy())
            for k, v in idle.items():
                timeline[k].extend([v] * gap)
            t += gap
        if stalled >= max_ticks:
            raise RuntimeError(f"simulation of {system.name} made no progress in {max_ticks} ticks "
                               f"({len(waiting)} waiting, {len(running)} running, tick {t})")
        progress = generated_total + counters["finished"] + len(waits)
        while arrivals and arrivals[0].arrival <= t:
            waiting.append(_Live(arrivals.popleft()))

        # decode: oldest first; a request that cannot grow preempts the newest ones (possibly itself)
        def exhausted(e: PoolExhausted) -> None:  # before the scheduler frees the victim
            counters["retracted"] += 1
            if system.free_bytes() - page_slot_slack >= e.requested:
                counters["retracted_with_room"] += 1

        i = 0
        while i < len(running):
            live = running[i]
            step = min(tokens_per_tick, live.req.output - live.generated)
            scheduler.grow(live, live.tokens + step, on_exhausted=exhausted)
            if i < len(running) and running[i] is live:
                live.generated += step
                generated_total += step
                i += 1

        # finish
        for live in [x for x in running if x.generated >= x.req.output]:
            scheduler.finish(live)
            counters["finished"] += 1

        # admit in arrival order; the first that does not fit blocks the rest
        admitted, blocked = scheduler.admit()
        for live in admitted:
            if live.admitted_at < 0:
                waits.append(t - live.req.arrival)
            live.admitted_at = t
        if blocked is not None:
            counters["refusal_events"] += 1
            refused_ids.add(blocked.req.rid)
            need = _min_request_bytes(kv, state, blocked.tokens, page_size) + system.reserve_bytes(scheduler.reserve())
            if system.free_bytes() - page_slot_slack >= need:
                counters["refused_with_room"] += 1

        timeline["running"].append(len(running))
        timeline["waiting"].append(len(waiting))
        timeline["kv_bytes"].append(system.kv_bytes())
        timeline["state_bytes"].append(system.state_bytes())
        tokens = sum(x.tokens for x in running)
        timeline["useful_bytes"].append(tokens * kv.token_bytes + len(running) * state.raw_bytes)
        if isinstance(system, UnifiedSystem):
            for k, v in system.occupancy().items():
                timeline[k].append(v)
        if check_invariants:
            for pool in system.pools():
                pool.allocator.check_invariants()
        # progress: a decoded token, a finish or a first admission (a re-admission after a retraction is not)
        stalled = 0 if generated_total + counters["finished"] + len(waits) != progress else stalled + 1
        t += 1

    budget = system.budget
    run = np.asarray(timeline["running"], dtype=np.float64)
    loaded = np.asarray(timeline["waiting"]) > 0
    allocated = (np.asarray(timeline["kv_bytes"], dtype=np.float64) + np.asarray(timeline["state_bytes"]))
    useful = np.asarray(timeline["useful_bytes"], dtype=np.float64)
    return SimResult(
        system=system.name,
        ticks=t,
        peak_concurrent=int(run.max()) if t else 0,
        mean_concurrent=float(run.mean()) if t else 0.0,
        mean_concurrent_loaded=float(run[loaded].mean()) if loaded.any() else None,
        loaded_ticks=int(loaded.sum()),
        refused=len(refused_ids),
        refusal_events=counters["refusal_events"],
        refused_with_room=counters["refused_with_room"],
        retracted=counters["retracted"],
        retracted_with_room=counters["retracted_with_room"],
        rejected=counters["rejected"],
        finished=counters["finished"],
        mean_allocated_fraction=float(allocated.mean() / budget) if t else 0.0,
        mean_useful_fraction=float(useful.mean() / budget) if t else 0.0,
        mean_useful_fraction_loaded=float(useful[loaded].mean() / budget) if loaded.any() else None,
        tokens_per_tick=generated_total / t if t else 0.0,
        mean_wait_ticks=float(np.mean(waits)) if waits else 0.0,
        extra=system.stats(),
        timeline=dict(timeline),
    )


def _slack_bytes(system) -> int:
    """Alignment slack of the 'could the free memory hold it' test: one page and one slot of the system."""
    return sum(p.layout.page_bytes + p.layout.slot_bytes for p in system.pools())


def _min_request_bytes(kv: KVSpec, state: LinearStateSpec, tokens: int, page_size: int) -> int:
    """Bytes a request of ``tokens`` tokens needs at the least: whole ``page_size``-token pages of every KV
    layer and one state slot (what one shared pool allocates for it)."""
    return -(-tokens // page_size) * kv.page_bytes(page_size) + state.slot_bytes
