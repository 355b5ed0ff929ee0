"""The serving engine: requests of any length join and leave one decode batch on a compiled model.

One :meth:`Engine.step` (under the model's generate lock, so a ``generate()`` call never runs between its
parts):

1. cancellations: a cancelled request's memory is freed now, wherever it is (queue, prefill, decode);
2. decode: every decoding row takes ``n`` more steps (``n = min(K, the longest row's remaining tokens,
   max_seq_len - the batch's logical length)``, ``K = model.unimem.steps_ahead``). First each row's pages
   grow to hold ``min(n, its remaining tokens)`` more tokens, oldest request first; a request that cannot
   grow preempts the newest running request (:class:`~.scheduler.Scheduler`). Then the rows' tables go into
   the runner's bucket (:meth:`~unimem_compile.runner.DecodeRunner.load_rows`) and ``n`` whole-step graphs run
   (:meth:`~unimem_compile.runner.DecodeRunner.replay`); one synchronisation reads every row's tokens,
   counts, lengths and finished flags. Host-side stop sequences are matched then. Finished rows leave: memory
   freed, row cleared, the last row moved into the hole so the live rows stay ``[0, r)``;
3. admission: FCFS while the memory system holds the request's prompt (and its generated tokens, after a
   preemption), one state slot and the growth reserve, and a decode row is free;
4. prefill: admitted requests' prompts in chunks, oldest first, at most ``max_prefill_tokens`` tokens per
   step in total (each chunk one forward of the compiled model over a one-row cache on the request's own
   pages, :meth:`~unimem_compile.hf.cache.UnifiedCache.over_rows`); a request whose prompt is complete takes
   its first token from the last chunk's logits and joins the decode rows. Packing: consecutive requests
   (in that order) whose whole prefill is still ahead and fits the step share ONE forward, up to
   ``max_prefill_rows`` of them, left-padded to the longest (:meth:`~unimem_compile.hf.cache.UnifiedCache.
   over_packed_rows`, a left-padded first step as in ``generate()``), while rows x the longest prompt stays
   within what is left of the budget (pads count: they are computed). A forward's host cost hardly depends
   on its tokens up to a few thousand (H200, 4-layer real geometry: one row of 1,024 tokens 14.5-22 ms, four
   in one forward 20.3 ms; benchmarks/RESULTS.md, 2026-12-03), so short prompts reach their first token
   several times sooner under load. A packed forward that raises fails every request in it.

Rows of different lengths share one step through left pads: every live row's tokens end at the batch's
logical length ``L`` (``left_pads = L - kv_len``), which is the step's query position; pads are masked as in
a left-padded ``generate()`` batch. ``L`` is recomputed (the pads shrink) before every block.

Preemption and recompute: a preempted request keeps its generated tokens; when re-admitted its prompt and
those tokens are prefilled again and decoding resumes where it stopped (the row's token count, EOS and
length checks, repetition-penalty history and sampling counter continue), so its tokens are the ones it
would have produced without the preemption.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time

import torch

from ..errors import GeometryError, UnsupportedModel
from ..pool.staging import upload
from ..runner.rows import Rows, RowSettings
from ..runner.sampling import decode_step
from .memory import PoolMemory
from .scheduler import Scheduler, plan_prefill

__all__ = ["DEFAULT_MAX_PREFILL_ROWS", "DEFAULT_MAX_PREFILL_TOKENS", "DEFAULT_RESERVE_FRACTION", "Engine",
           "EngineRequest", "Phase"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_PREFILL_TOKENS = 2048
"""Prompt tokens one engine step prefills at most, over every prefilling request (a request's chunk ends
there and continues next step). Larger: a long prompt reaches its first token in fewer steps, but every
step's decode rows wait longer for their next block (TPOT); smaller: the opposite."""

DEFAULT_MAX_PREFILL_ROWS = 8
"""Requests one prefill forward packs at most (each a whole prompt that fits the step's budget; module
docstring). 1: every chunk is a forward of its own. Each number of rows above 1 is another input shape for
the compiled prefill graph (Dynamo makes the batch dimension dynamic at its second size) and for the KDA
chunk graphs (``ops/kda_graphs``: one per rows x bucket)."""

DEFAULT_RESERVE_FRACTION = 0.01
"""Share of the arena kept free at admission for the running requests' growth (waived while nothing runs)."""


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclasses.dataclass(eq=False)
class EngineRequest:
    """One request inside the engine.

    Attributes:
        rid: its id. prompt: its token ids. settings: its :class:`~unimem_compile.runner.RowSettings`.
        stop_sequences: token sequences that end it when generated (host-matched; the sequence is kept).
        generated: tokens generated so far (kept across preemptions).
        phase: where it is. error: why it failed (None: it did not). cancelled: cancel_request was called.
        preemptions: times it was preempted. arrival, first_token_at, finished_at: ``perf_counter`` times.
        token_times: ``perf_counter`` time of each generated token (one per block: tokens of a block share it).
    """

    rid: str
    prompt: list[int]
    settings: RowSettings
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    generated: list[int] = dataclasses.field(default_factory=list)
    phase: Phase = Phase.WAITING
    error: str | None = None
    cancelled: bool = False
    finished: bool = False
    preemptions: int = 0
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    # prefill / decode bookkeeping
    prefill_ids: list[int] | None = None  # prompt + generated when (re)admitted
    prefilled: int = 0  # tokens of prefill_ids stored
    cache: object = None  # the one-row cache of the prefill
    kv_len: int = 0  # tokens stored while decoding

    @property
    def tokens(self) -> int:
        """Tokens the request must hold when (re)admitted: its prompt and what it generated."""
        return len(self.prompt) + len(self.generated)

    @property
    def remaining(self) -> int:
        return self.settings.max_new_tokens - len(self.generated)


class Engine:
    """Continuous batching of :class:`EngineRequest` on a model compiled by unimem_compile.

    Args:
        model: the compiled model (``model.unimem`` with its decode runner).
        memory: the memory system (default: :class:`~.memory.PoolMemory` over the model's pool;
            :class:`~.memory.QuotaMemory` for a static split).
        max_prefill_tokens: prompt tokens prefilled per step (:data:`DEFAULT_MAX_PREFILL_TOKENS`).
        reserve_fraction: the admission reserve (:data:`DEFAULT_RESERVE_FRACTION`).
        max_prefill_rows: requests one prefill forward packs at most (:data:`DEFAULT_MAX_PREFILL_ROWS`; the
            model's ``max_batch_size`` bounds it too).

    Every method runs on one thread (the manager's loop); :meth:`step` takes the generate lock.

    Raises:
        UnsupportedModel: a model without the decode runner, or compiled with ``tensor_parallel=True``.
        GeometryError: a memory system over another pool. ValueError: ``max_prefill_tokens`` or
            ``max_prefill_rows`` < 1.

    Attributes:
        scheduler: the :class:`~.scheduler.Scheduler`. rows: the decoding requests, row ``i`` = ``rows[i]``.
        counters: ``steps``, ``step_s`` (seconds inside :meth:`step`, all of its parts), ``decode_steps``,
            ``decode_row_steps`` (rows x steps), ``decode_s`` (seconds in decode blocks, readback included),
            ``prefill_tokens``, ``prefill_chunks`` (model forwards of prefill), ``packed_forwards`` (of those, the
            forwards that packed several requests), ``packed_rows`` (requests prefilled in them), ``prefill_pads``
            (pad tokens those forwards computed), ``prefill_s`` (seconds of prefill
            chunks: only a chunk that ends a prompt synchronises, so the others' time is their launch),
            ``generated_tokens``, ``preemptions``, ``refusals`` (steps whose queue head found no room),
            ``refused_with_room`` (of those, the ones while the whole arena's free bytes could hold the request),
            ``row_waits`` (steps whose queue head waited for a decode row: every row taken, memory not asked),
            ``finished``, ``failed``, ``cancelled``, ``peak_rows`` (most rows in one decode block).
    """

    def __init__(self, model, *, memory=None, max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
                 reserve_fraction: float = DEFAULT_RESERVE_FRACTION, max_prefill_rows: int = DEFAULT_MAX_PREFILL_ROWS):
        handle = getattr(model, "unimem", None)
        if handle is None or handle.runner is None:
            raise UnsupportedModel("the engine needs a model compiled by unimem_compile.compile (with its decode "
                                   "runner)")
        if handle.tensor_parallel is not None:
            raise UnsupportedModel("continuous batching under tensor parallelism is not supported yet (every rank "
                                   "would have to agree on each step's admissions: docs/design.md 9.5)")
        if isinstance(max_prefill_tokens, bool) or not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be an int >= 1, got {max_prefill_tokens!r}")
        self.model = model
        self.handle = handle
        self.runner = handle.runner
        self.device = handle.pool.device
        self.memory = PoolMemory(handle.pool) if memory is None else memory
        if self.memory.pools()[0] is not handle.pool:
            raise GeometryError("the engine's memory system must allocate from the model's own pool")
        if isinstance(max_prefill_rows, bool) or not isinstance(max_prefill_rows, int) or max_prefill_rows < 1:
            raise ValueError(f"max_prefill_rows must be an int >= 1, got {max_prefill_rows!r}")
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_rows = min(max_prefill_rows, handle.max_batch_size)
        self.scheduler = Scheduler(self.memory, reserve_fraction=reserve_fraction, max_running=handle.max_batch_size)
        self.rows: list[EngineRequest] = []
        self.page_size = handle.pool.layout.page_size
        self.max_pages = handle.max_pages_per_row
        from ..hf.generate_checks import _cache_kwarg

        self._cache_kwarg = _cache_kwarg(model)
        self.counters = dict(steps=0, step_s=0.0, decode_steps=0, decode_row_steps=0, decode_s=0.0,
                             prefill_tokens=0, prefill_chunks=0, packed_forwards=0, packed_rows=0, prefill_pads=0,
                             prefill_s=0.0, generated_tokens=0, preemptions=0,
                             refusals=0, refused_with_room=0, row_waits=0, finished=0, failed=0, cancelled=0,
                             peak_rows=0)
        self._cancel: list[EngineRequest] = []  # bound to the request objects, not their ids (ids are reused)
        self._requests: dict[str, EngineRequest] = {}
        self._saved = None  # this engine's rows of the runner's state while someone else used it

    # ------------------------------------------------------------------ requests in and out
    def add(self, request: EngineRequest) -> None:
        """Queue ``request`` (validated by the caller: see the manager)."""
        self._requests[request.rid] = request
        self.scheduler.enqueue(request)

    def cancel(self, request: EngineRequest | str) -> None:
        """Cancel a request at the next step boundary: an :class:`EngineRequest` this engine was given, or the
        id of one it holds now (an unknown or finished one: nothing happens). The cancel is bound to that
        request: one that takes the same id later is not touched (a stale cancel used to fail it)."""
        if isinstance(request, str):
            request = self._requests.get(request)
            if request is None:
                return
        if not request.finished:
            self._cancel.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._cancel)

    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    def running(self) -> int:
        return len(self.scheduler.running)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[EngineRequest]:
        """Run one engine step (see the module docstring); returns the requests that got new tokens or
        ended in it (each once). Never raises for a request's failure: the request ends with ``error``."""
        touched: dict[str, EngineRequest] = {}
        with self.handle.generate_lock, torch.no_grad():
            self.counters["steps"] += 1
            started = time.perf_counter()
            self._occupy()
            for req in self._take_cancellations():
                touched[req.rid] = req
            for req in self._decode():
                touched[req.rid] = req
            self._admit()
            for req in self._prefill():
                touched[req.rid] = req
            self.counters["step_s"] += time.perf_counter() - started
        return list(touched.values())

    # ------------------------------------------------------------------ the runner's row state
    def _occupy(self) -> None:
        """Make this engine the tenant of the runner's row state, putting its rows back if a generate()
        call (or another engine) rewrote the state since this engine's last step."""
        runner = self.runner
        if runner.tenant is self:
            return
        runner.evict_tenant()
        state = runner.state
        saved, self._saved = self._saved, None
        if saved is not None:
            values, settings = saved
            n = len(settings)
            for name, t in values.items():
                getattr(state, name)[:n].copy_(t)
            state._settings[:n] = settings
            state.clear_rows(n, state.max_rows)
        else:
            state.clear_rows(len(self.rows), state.max_rows)
        runner.tenant = self

    def evicted(self) -> None:
        """The runner is about to rewrite its row state (called by ``DecodeRunner.evict_tenant``): save this
        engine's rows until its next step."""
        state = self.runner.state
        n = len(self.rows)
        self._saved = ({name: getattr(state, name)[:n].clone() for name in Rows._fields},
                       list(state._settings[:n])) if n else None

    def _admit(self) -> None:
        """FCFS admission; a head that finds no room counts as a refusal, and as a refusal with room when
        the arena's free bytes could hold its pages, its state, the reserve and one page + one slot of slack
        (the memory was there, but on the other side of a static split). A head stopped by the row limit
        (``max_running``, the runner's rows) counts as a row wait instead: what bound admission, memory or
        rows, is then readable from the counters."""
        _, blocked = self.scheduler.admit()
        if blocked is None:
            if self.scheduler.waiting:  # admission stopped with requests left: the running limit
                self.counters["row_waits"] += 1
            return
        self.counters["refusals"] += 1
        m = self.memory
        lay = self.handle.pool.layout
        need = m.pages_for(blocked.tokens) * lay.page_bytes + lay.slot_bytes + m.reserve_bytes(self.scheduler.reserve())
        free = lay.usable - lay.sink_floor - m.kv_bytes() - m.state_bytes()  # of the whole arena, split or not
        if free - (lay.page_bytes + lay.slot_bytes) >= need:
            self.counters["refused_with_room"] += 1

    def _end(self, req: EngineRequest, *, error: str | None = None) -> None:
        """``req`` leaves: memory freed, its row cleared and filled with the last row."""
        if req.phase == Phase.DECODE:
            self._drop_row(req)
        req.cache = None
        self.scheduler.finish(req)
        req.phase = Phase.DONE
        req.finished = True
        req.finished_at = time.perf_counter()
        if error is not None:
            req.error = error
            self.counters["cancelled" if req.cancelled else "failed"] += 1
        else:
            self.counters["finished"] += 1
        self._requests.pop(req.rid, None)

    def _drop_row(self, req: EngineRequest) -> None:
        state = self.runner.state
        i = next(k for k, r in enumerate(self.rows) if r is req)
        last = len(self.rows) - 1
        if i != last:
            state.move_row(last, i)  # clears the last row
            self.rows[i] = self.rows[last]
        else:
            state.clear_row(i)
        self.rows.pop()

    def _take_cancellations(self) -> list[EngineRequest]:
        pending, self._cancel = self._cancel, []  # taken first: a failure below cannot leave them to jam every step
        out = []
        for req in pending:  # in the order cancelled; a request cancelled twice ends once
            if self._requests.get(req.rid) is req and not req.finished:
                req.cancelled = True
                self._end(req, error="cancelled")
                out.append(req)
        return out

    def _preempted(self, victims) -> None:
        for victim, _ in victims:
            self.counters["preemptions"] += 1
            victim.preemptions += 1
            if victim.phase == Phase.DECODE:
                self._drop_row(victim)
            victim.cache = None
            victim.phase = Phase.WAITING
            victim.prefill_ids = None
            victim.prefilled = 0

    # ------------------------------------------------------------------ decode
    def _decode(self) -> list[EngineRequest]:
        if not self.rows:
            return []
        max_seq = self.handle.max_seq_len
        steps = min(self.runner.steps_ahead, max(r.remaining for r in self.rows),
                    max_seq - max(r.kv_len for r in self.rows))
        # growth, oldest first (the scheduler's admission order); a victim leaves the rows. A row stores one
        # token per step until its length ends it, then nothing (location -1): it grows by what it has left
        for req in [r for r in self.scheduler.running if r.phase == Phase.DECODE]:
            if req.phase != Phase.DECODE:  # preempted by an older request's growth already
                continue
            self._preempted(self.scheduler.grow(req, req.kv_len + min(steps, req.remaining)))
        if not self.rows:
            return []
        rows = list(self.rows)
        n = len(rows)
        self.counters["peak_rows"] = max(self.counters["peak_rows"], n)
        steps = min(steps, max(r.remaining for r in rows), max_seq - max(r.kv_len for r in rows))
        sampling = any(r.settings.do_sample for r in rows)
        try:
            bucket = self.runner.step_bucket(n, sampling, keep_rows=n)
            start = time.perf_counter()
            self._load(bucket, rows)
            self.runner.replay(bucket, sampling, steps)
            state = self.runner.state
            count = state.count[:n].cpu()
            finished = state.finished[:n].cpu().tolist()
            kv_len = bucket.buffers.kv_len[:n].cpu().tolist()
            first = min(len(r.generated) for r in rows)  # the block's tokens only, not each row's history
            out = state.out[:n, first:int(count.max())].cpu().tolist()
        except Exception as e:  # noqa: BLE001 - the rows of this block fail; the queue goes on
            logger.exception("engine: a decode block of %d rows raised", n)
            for req in rows:
                self._end(req, error=f"{type(e).__name__}: {e}")
            return rows
        now = time.perf_counter()
        self.counters["decode_steps"] += steps
        self.counters["decode_row_steps"] += steps * n
        self.counters["decode_s"] += now - start  # the block and its readback (a synchronisation)
        count = count.tolist()
        for b, req in enumerate(rows):
            before = len(req.generated)
            new = out[b][before - first:count[b] - first]
            keep = self._stop_hit(req, new)
            done = finished[b] or keep is not None
            if keep is not None:
                new = new[:keep]
            req.generated += new
            req.token_times += [now] * len(new)
            req.kv_len = kv_len[b]
            self.counters["generated_tokens"] += len(new)
            if done:
                self._end(req)
        return rows

    @staticmethod
    def _stop_hit(req: EngineRequest, new: list[int]) -> int | None:
        """How many tokens of ``new`` (``req``'s next tokens) to keep when they complete one of its stop
        sequences (through the first completed one, the sequence included); None when none completes."""
        if not req.stop_sequences or not new:
            return None
        seq = req.generated + new
        base = len(req.generated)
        for end in range(base + 1, len(seq) + 1):
            for stop in req.stop_sequences:
                if end >= len(stop) and tuple(seq[end - len(stop):end]) == stop:
                    return end - base
        return None

    def _load(self, bucket, rows: list[EngineRequest]) -> None:
        n = len(rows)
        table = torch.full((n, self.max_pages), -1, dtype=torch.int32)
        slots = torch.full((n,), -1, dtype=torch.int64)
        kv = torch.tensor([r.kv_len for r in rows], dtype=torch.int32)
        for b, req in enumerate(rows):
            pages = self.memory.pages.get(req.rid, [])[:self.max_pages]
            if pages:
                table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            slot = self.memory.slots.get(req.rid)
            if slot is not None:
                slots[b] = slot
        logical = int(kv.max())
        self.runner.load_rows(bucket, table, kv, slots, logical - kv, logical)

    # ------------------------------------------------------------------ prefill
    def _prefill(self) -> list[EngineRequest]:
        """Run this step's prefill forwards (:func:`~.scheduler.plan_prefill` over the running requests still
        prefilling, oldest first); returns the requests they touched. A forward that raises fails its
        requests; the others go on."""
        pending = [r for r in self.scheduler.running if r.phase in (Phase.WAITING, Phase.PREFILL)]
        progress = [(r.prefilled if r.phase == Phase.PREFILL else 0, r.tokens if r.phase == Phase.WAITING
                     else len(r.prefill_ids)) for r in pending]
        touched = []
        for forward in plan_prefill(progress, self.max_prefill_tokens, self.max_prefill_rows):
            group = [pending[i] for i in forward.requests]
            for req in group:
                self._start_prefill(req)
            start = time.perf_counter()
            if forward.packed:
                try:
                    self._prefill_packed(group, forward.tokens)
                    self.counters["prefill_s"] += time.perf_counter() - start
                except Exception as e:  # noqa: BLE001 - this forward's requests fail; the others go on
                    logger.exception("engine: the packed prefill of requests %r raised", [r.rid for r in group])
                    for r in group:
                        if not r.finished:
                            self._end(r, error=f"{type(e).__name__}: {e}")
                touched += group
                continue
            req = group[0]
            try:
                logits = self._prefill_chunk(req, forward.tokens)
                if logits is not None:
                    self._join(req, logits)  # reads the first token: the chunk's time is complete
                self.counters["prefill_s"] += time.perf_counter() - start
            except Exception as e:  # noqa: BLE001 - this request fails; the others go on
                logger.exception("engine: the prefill of request %r raised", req.rid)
                self._end(req, error=f"{type(e).__name__}: {e}")
            touched.append(req)
        return touched

    @staticmethod
    def _start_prefill(req: EngineRequest) -> None:
        if req.phase == Phase.WAITING:  # admitted in this step (or an earlier one whose budget ran out)
            req.phase = Phase.PREFILL
            req.prefill_ids = req.prompt + req.generated
            req.prefilled = 0

    def _prefill_packed(self, group: list[EngineRequest], width: int) -> None:
        """Prefill every request of ``group`` (each with its whole prefill ahead, at most ``width`` tokens) in one
        forward of ``len(group)`` left-padded rows, each on its own pages and slot; each then joins the decode
        rows with the first token of its row's logits."""
        from ..hf.cache import UnifiedCache

        n = len(group)
        ids = torch.zeros((n, width), dtype=torch.int64)  # pads: token 0, masked
        mask = torch.zeros((n, width), dtype=torch.int64)
        for b, req in enumerate(group):
            length = len(req.prefill_ids)
            ids[b, width - length:] = torch.tensor(req.prefill_ids, dtype=torch.int64)
            mask[b, width - length:] = 1
        rows = [(self.memory.pages.get(r.rid, []), self.memory.slots.get(r.rid)) for r in group]
        cache = UnifiedCache.over_packed_rows(self.handle, rows)
        # each row's own positions, 0 at its first token (pads 0), as generate() builds them for a left-padded
        # batch: prepare_inputs_for_generation passes on what it is given, and without them a RoPE model would
        # store a row with k pads at positions k.. while its decode steps query at kv_len (pads excluded)
        position = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        device_mask = upload(mask, self.device)
        cache.remember_mask(device_mask, mask)  # its pads are checked from `mask`, not read back from the GPU
        inputs = self.model.prepare_inputs_for_generation(upload(ids, self.device), **{self._cache_kwarg: cache},
                                                          use_cache=True, attention_mask=device_mask,
                                                          position_ids=upload(position, self.device))
        inputs["logits_to_keep"] = 1
        out = self.model(**inputs, return_dict=True)
        real = sum(len(r.prefill_ids) for r in group)
        self.counters["prefill_tokens"] += real
        self.counters["prefill_chunks"] += 1
        self.counters["packed_forwards"] += 1
        self.counters["packed_rows"] += n
        self.counters["prefill_pads"] += n * width - real
        logits = out.logits[:, -1]
        for b, req in enumerate(group):
            req.prefilled = len(req.prefill_ids)
            self._join(req, logits[b:b + 1])

    def _prefill_chunk(self, req: EngineRequest, chunk: int):
        """Store the next ``chunk`` tokens of ``req``'s prefill; returns the logits after the last prompt
        token (float ``[1, V]``) when the prefill is complete, else None."""
        if req.cache is None:
            from ..hf.cache import UnifiedCache

            req.cache = UnifiedCache.over_rows(self.handle, self.memory.pages.get(req.rid, []), req.prefilled,
                                               self.memory.slots.get(req.rid), len(req.prefill_ids))
        start = req.prefilled
        ids = upload(torch.tensor([req.prefill_ids[start:start + chunk]], dtype=torch.int64), self.device)
        inputs = self.model.prepare_inputs_for_generation(ids, **{self._cache_kwarg: req.cache}, use_cache=True,
                                                          attention_mask=None)
        inputs["logits_to_keep"] = 1
        out = self.model(**inputs, return_dict=True)
        req.prefilled += chunk
        self.counters["prefill_tokens"] += chunk
        self.counters["prefill_chunks"] += 1
        if req.prefilled < len(req.prefill_ids):
            return None
        return out.logits[:, -1]

    def _join(self, req: EngineRequest, logits: torch.Tensor) -> None:
        """``req``'s prefill is complete: put it into the next free row, take its next token from
        ``logits``; it decodes from the next step on (or ends here)."""
        req.cache = None
        state = self.runner.state
        row = len(self.rows)
        state.set_rows(row, [req.settings], [req.prefill_ids])
        resumed = len(req.generated)
        if resumed:  # after a preemption: the count (EOS / length checks, sampling counter) continues
            state.count[row] = resumed
        view = Rows(*(getattr(state, name)[row:row + 1] for name in Rows._fields))
        decode_step(logits, view, sampling=req.settings.do_sample)
        token, finished = int(view.last_token[0]), bool(view.finished[0])
        now = time.perf_counter()
        if req.first_token_at is None:
            req.first_token_at = now
        self.rows.append(req)
        req.phase = Phase.DECODE
        req.kv_len = len(req.prefill_ids)
        done = finished or self._stop_hit(req, [token]) is not None
        req.generated.append(token)
        req.token_times.append(now)
        self.counters["generated_tokens"] += 1
        if done:
            self._end(req)
