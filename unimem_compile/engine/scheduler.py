"""The FCFS continuous-batching policy: admission, growth and preemption over a memory system.

One policy, used by the serving engine (:mod:`.engine`, over the model's real pool) and by the capacity
simulator (``unimem_compile.sim``, over simulated memory systems). It never looks at model weights, tokens
or time: a request is an entry with an id (``rid``) and the tokens it must hold when (re)admitted
(``tokens``); the memory system (:class:`~.memory.MemorySystem`) allocates.

* :meth:`Scheduler.admit`: waiting requests in arrival order while the memory system holds the request's
  ``tokens``, one state and a growth reserve (``reserve_fraction`` of the growing side; waived while nothing
  runs: it protects running requests' growth, and a request the empty system holds must not wait for ever),
  and while fewer than ``max_running`` requests run. The first one that does not fit blocks the queue (no
  overtaking).
* :meth:`Scheduler.grow`: a running request needs more tokens; when the memory system cannot hold them the
  most recently admitted running request is preempted (its memory freed, back to the FRONT of the queue, to
  be recomputed later from what it holds then), then the growth is retried; the growing request may be
  that newest one itself.
* :meth:`Scheduler.finish`: a request leaves (finished, cancelled or failed): its memory is freed at once.

The caller owns the order of the three within a step (the engine: grow, decode, finish, admit, prefill; the
simulator: grow, finish, admit).

:func:`plan_prefill` is the step's prefill plan (which requests share a forward, how many tokens each
forward runs), a pure function of the requests' progress and the step's token budget: the engine runs it,
and ``benchmarks/bench_serving`` replays it to know which prefill shapes a trace reaches.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ..errors import PoolExhausted

__all__ = ["PrefillForward", "Scheduler", "plan_prefill"]


class Scheduler:
    """FCFS admission with newest-first preemption (see the module docstring).

    Args:
        memory: the memory system (:class:`~.memory.MemorySystem`).
        reserve_fraction: share of the growing side kept free at admission while requests run, in ``[0, 1)``.
        max_running: the most requests running at once (the engine: the decode runner's rows); None: no
            limit but memory.

    Attributes:
        waiting: the queue (a deque of entries; the head is admitted first).
        running: running entries in admission order (the last one is preempted first).

    Raises:
        ValueError: ``reserve_fraction`` outside ``[0, 1)`` or ``max_running`` < 1.
    """

    def __init__(self, memory, *, reserve_fraction: float = 0.01, max_running: int | None = None):
        if not 0 <= reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction}")
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running must be >= 1 or None, got {max_running}")
        self.memory = memory
        self.reserve_fraction = float(reserve_fraction)
        self.max_running = max_running
        self.waiting: collections.deque = collections.deque()
        self.running: list = []

    def enqueue(self, entry) -> None:
        """Append ``entry`` to the queue (arrival order)."""
        self.waiting.append(entry)

    def reserve(self) -> float:
        """The reserve fraction admission applies now (0 while nothing runs)."""
        return self.reserve_fraction if self.running else 0.0

    def admit(self) -> tuple[list, object | None]:
        """Admit waiting entries in order; returns ``(admitted, blocked)``: the entries admitted (now at the
        end of :attr:`running`, memory allocated for their ``tokens``) and the head that found no room
        (None: the queue is empty, or the running limit stopped admission)."""
        admitted = []
        while self.waiting:
            if self.max_running is not None and len(self.running) >= self.max_running:
                return admitted, None
            head = self.waiting[0]
            if not self.memory.can_admit(head.tokens, self.reserve()):
                return admitted, head
            self.memory.admit(head.rid, head.tokens)
            self.waiting.popleft()
            self.running.append(head)
            admitted.append(head)
        return admitted, None

    def grow(self, entry, tokens: int, on_exhausted=None) -> list[tuple[object, PoolExhausted]]:
        """Make running ``entry`` hold ``tokens`` tokens, preempting the newest running entries while the
        memory system cannot (each victim is freed and put back at the front of the queue). Returns the
        ``(victim, the PoolExhausted that evicted it)`` pairs in eviction order; ``entry`` itself is the
        last victim when it was preempted (it then did not grow). ``on_exhausted(error)``: called on each
        failed growth before its victim is freed (the simulator's counters read the memory then)."""
        victims = []
        while True:
            try:
                self.memory.grow(entry.rid, tokens)
                return victims
            except PoolExhausted as e:
                if on_exhausted is not None:
                    on_exhausted(e)
                victim = self.running.pop()
                self.memory.release(victim.rid)
                self.waiting.appendleft(victim)
                victims.append((victim, e))
                if victim is entry:
                    return victims

    def finish(self, entry) -> None:
        """``entry`` leaves: freed now, out of :attr:`running` (or of the queue, where it waited)."""
        for i, e in enumerate(self.running):  # by identity: entries may compare equal by value
            if e is entry:
                del self.running[i]
                self.memory.release(entry.rid)
                return
        for i, e in enumerate(self.waiting):
            if e is entry:
                del self.waiting[i]
                return

    def finish_all(self, entries: Iterable) -> None:
        for entry in list(entries):
            self.finish(entry)


class PrefillForward(NamedTuple):
    """One forward of a step's prefill (:func:`plan_prefill`).

    Attributes:
        requests: indices into the ``progress`` list the plan was made from, oldest first: one request, or
            several (a pack) each with its whole prefill ahead.
        tokens: the forward's query length: a chunk of the one request's prefill, or a pack's width (its
            longest prefill; the others are left-padded to it).
        start: tokens of the one request stored before the chunk (0 for a pack).
    """

    requests: tuple[int, ...]
    tokens: int
    start: int = 0

    @property
    def packed(self) -> bool:
        return len(self.requests) > 1


def plan_prefill(progress: Sequence[tuple[int, int]], budget: int, max_rows: int = 1) -> list[PrefillForward]:
    """The prefill forwards of one step, in order.

    Args:
        progress: per request still prefilling, oldest first: ``(stored, total)`` tokens of its prefill
            (``0 <= stored < total``).
        budget: tokens the step may prefill (pads of a pack count: they are computed).
        max_rows: the most requests one forward packs (1: one request per forward).

    Each request in turn takes what is left of the budget, up to the rest of its prefill. A request whose
    whole prefill is ahead and fits what is left leads a pack: the requests after it that are also at their
    first token join while ``rows x the longest prefill`` fits what is left and rows <= ``max_rows``; a
    request mid-prefill ends the pack (nobody overtakes it). Requests the budget does not reach wait for the
    next step.

    Raises:
        ValueError: a budget or ``max_rows`` below 1, or a ``(stored, total)`` outside ``0 <= stored < total``.
    """
    if budget < 1 or max_rows < 1:
        raise ValueError(f"budget and max_rows must be >= 1, got {budget} and {max_rows}")
    for i, (stored, total) in enumerate(progress):
        if not 0 <= stored < total:
            raise ValueError(f"request {i} has stored {stored} of {total} prefill tokens; need 0 <= stored < total")
    forwards: list[PrefillForward] = []
    left, i = budget, 0
    while i < len(progress) and left > 0:
        stored, total = progress[i]
        group, width = [i], total - stored
        i += 1
        if stored == 0 and width <= left:  # a whole prefill: the next ones may join its forward
            while i < len(progress) and len(group) < max_rows and progress[i][0] == 0:
                wider = max(width, progress[i][1])
                if wider * (len(group) + 1) > left:
                    break
                group.append(i)
                width = wider
                i += 1
        if len(group) > 1:
            forwards.append(PrefillForward(tuple(group), width))
            left -= width * len(group)
            continue
        chunk = min(left, width)
        forwards.append(PrefillForward((group[0],), chunk, stored))
        left -= chunk
    return forwards
