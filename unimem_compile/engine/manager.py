"""The request manager: transformers' continuous-batching API over the :class:`~.engine.Engine`.

``model.init_continuous_batching(generation_config=None, ...)`` returns a
:class:`ContinuousBatchingManager`; ``model.generate_batch(inputs, ...)`` runs one to completion. The names,
arguments and defaults are transformers' (``transformers.generation.continuous_batching``, 5.24); what
differs is listed in docs/engine.md.

Thread model: the engine runs on ONE background thread (:meth:`ContinuousBatchingManager.start`), which
takes the model's generate lock for each engine step, so ``model.generate()`` from another thread runs
between two steps, never inside one. Every public method is thread-safe: :meth:`add_request` validates the
request in the caller's thread (errors raise there, nothing is queued) and hands it to the loop through a
lock-guarded inbox; cancellations likewise; results come back through one condition-guarded outbox that
:meth:`get_result`, :meth:`request_id_iter` and iteration read with timeouts (an asyncio server calls them
through ``loop.run_in_executor``, or polls with ``timeout=0``). Without :meth:`start` the manager can be
stepped by hand (:meth:`step`), which is how the tests drive it.
"""

from __future__ import annotations

import collections
import copy
import logging
import numbers
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from ..errors import GeometryError, UnimemError
from ..pool.allocator import as_int
from ..runner.rng import draw_seeds
from ..runner.rows import GenerationSettingError, RowSettings
from .engine import (DEFAULT_MAX_PREFILL_ROWS, DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_RESERVE_FRACTION, Engine,
                     EngineRequest, Phase)

__all__ = ["ContinuousBatchingManager", "GenerationOutput", "QueueFull", "RequestStatus", "REQUEST_SETTINGS"]

logger = logging.getLogger(__name__)

try:  # transformers' own result type and statuses where the installed version has them
    from transformers.generation.continuous_batching import GenerationOutput, RequestStatus
except ImportError:  # pragma: no cover - transformers without continuous batching
    import dataclasses as _dc
    import enum as _enum

    class RequestStatus(_enum.IntEnum):
        """transformers' request statuses."""

        PENDING = 0
        PREFILLING = 1
        DECODING = 2
        FINISHED = 3
        FAILED = 4

    @_dc.dataclass
    class GenerationOutput:
        """transformers' result fields."""

        request_id: str
        prompt_ids: list[int] = _dc.field(default_factory=list)
        generated_tokens: list[int] = _dc.field(default_factory=list)
        logprobs: list[float] = _dc.field(default_factory=list)
        error: str | None = None
        status: RequestStatus = RequestStatus.PENDING
        created_time: float = _dc.field(default_factory=time.perf_counter)
        lifespan: tuple[float, float] = (-1, -1)
        timestamps: list[float] | None = None

        def is_finished(self) -> bool:
            return self.status >= RequestStatus.FINISHED


#: per-request keywords of :meth:`ContinuousBatchingManager.add_request` besides transformers' own: the
#: generation settings the decode runner applies per row, a seed, and host-matched stop token sequences
REQUEST_SETTINGS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "min_new_tokens",
                    "pad_token_id", "seed", "stop_sequences")

_PHASE_STATUS = {Phase.WAITING: RequestStatus.PENDING, Phase.PREFILL: RequestStatus.PREFILLING,
                 Phase.DECODE: RequestStatus.DECODING}


class QueueFull(UnimemError, RuntimeError):
    """``add_request`` while ``max_queue`` requests wait already: the request was not queued (retry later)."""


class ContinuousBatchingManager:
    """Continuous batching of requests on a compiled model (transformers' manager API; module docstring).

    Args:
        model: the model compiled by ``unimem_compile.compile``.
        generation_config: the requests' base settings (default ``model.generation_config``); the model's
            generation config fills what it leaves unset, then transformers' global defaults, as
            ``generate()`` does.
        max_prefill_tokens: prompt tokens prefilled per engine step (the per-step token budget).
        max_prefill_rows: requests one prefill forward packs at most (short whole prompts; ``Engine``).
        reserve_fraction: share of the arena kept free at admission for running requests' growth.
        max_queue: waiting requests beyond which :meth:`add_request` raises :class:`QueueFull` (None: no limit).
        memory: the engine's memory system (default: the unified pool; ``QuotaMemory`` for a static split).

    Raises:
        ValueError: ``max_queue`` that is neither None nor an int >= 1; ``max_prefill_tokens`` /
            ``max_prefill_rows`` / ``reserve_fraction`` out of range (the engine's and the scheduler's checks).
    """

    def __init__(self, model, generation_config=None, *, max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
                 reserve_fraction: float = DEFAULT_RESERVE_FRACTION, max_queue: int | None = None, memory=None,
                 max_prefill_rows: int = DEFAULT_MAX_PREFILL_ROWS):
        # 0 or less would refuse every request with a QueueFull that says "retry later"
        if max_queue is not None and (isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1):
            raise ValueError(f"max_queue must be None (no limit) or an int >= 1, got {max_queue!r}")
        self.model = model
        self.generation_config = model.generation_config if generation_config is None else generation_config
        self.engine = Engine(model, memory=memory, max_prefill_tokens=max_prefill_tokens,
                             reserve_fraction=reserve_fraction, max_prefill_rows=max_prefill_rows)
        self.max_queue = max_queue
        self.vocab_size = int(model.get_output_embeddings().out_features)
        self._lock = threading.Lock()
        self._inbox: list[EngineRequest] = []
        self._cancels: list[EngineRequest] = []
        self._live: dict[str, EngineRequest] = {}  # request id -> its request, from add until its final result
        self._outbox: collections.deque = collections.deque()
        self._results = threading.Condition()
        self._known: dict[str, bool] = {}  # request id -> streaming, until its final result is taken
        self._next_id = 0  # the n of the next automatic id ``req_<n>``, taken only by an accepted request
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = False
        self._hard_stop = False
        self._started_at: float | None = None
        self._streaming: dict[str, bool] = {}
        self._timestamps: dict[str, bool] = {}
        self._sent: dict[str, int] = {}  # streaming request id -> tokens in its last output
        self._resolved = None  # _resolved_config's cache: (base, model config, their fields x2, resolved)

    # ------------------------------------------------------------------ control
    def is_running(self) -> bool:
        """Whether the background loop thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the background loop (a warning and nothing else when it runs already).

        Raises:
            RuntimeError: the manager was stopped (a stopped manager is not restarted: create another)."""
        if self._stopped or self._stopping:  # stop(block=False) leaves _stopped unset while its loop drains
            raise RuntimeError("this manager was stopped; create a new one with model.init_continuous_batching()")
        if self.is_running():
            logger.warning("the continuous batching manager runs already")
            return
        inference = torch.is_inference_mode_enabled()
        self._started_at = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, args=(inference,), name="unimem-engine", daemon=True)
        self._thread.start()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """Stop accepting requests; the loop finishes every accepted request (``hard_stop``: cancels them) and
        exits. ``block``: wait for that, at most ``timeout`` seconds (None: no limit).

        Raises:
            NotImplementedError: ``keep_for_next_session=True`` (a stopped manager is not reused)."""
        if keep_for_next_session:
            raise NotImplementedError("keep_for_next_session=True: a stopped unimem manager is not kept; create a new "
                                      "one with model.init_continuous_batching()")
        with self._lock:
            self._stopping = True
            self._hard_stop = self._hard_stop or bool(hard_stop)
        self._wake.set()
        if self._thread is None:
            self._stopped = True
            return
        if block:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the continuous batching loop did not stop within %s s", timeout)
                return
        if not self._thread.is_alive():
            self._stopped = True

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> ContinuousBatchingManager:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """``stop(block=True)``: every accepted request runs to its end. Left by an exception (a user's streaming
        loop raising, Ctrl-C), ``hard_stop=True``: what is still queued or running is cancelled, its memory
        freed, instead of the exception waiting behind every request's last token."""
        self.stop(block=True, hard_stop=exc_type is not None)

    # ------------------------------------------------------------------ requests
    def add_request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False,
                    eos_token_id: int | list[int] | None = None, **kwargs) -> str:
        """Queue one request; returns its id.

        Args:
            input_ids: the prompt (a list of ints, or a 1-D integer tensor), at least one token, each in
                ``[0, vocab_size)``.
            request_id: its id (default ``req_<n>``, ``n`` counting the accepted requests that took an
                automatic id: a refused request takes none, and an id a caller chose is skipped); a non-empty
                str, not in use (queued, running, or its final result not taken yet).
            max_new_tokens: default: the generation config's (then generate()'s default of 20).
            streaming: every engine step that adds tokens also yields a result (cumulative tokens,
                status DECODING), the last one FINISHED.
            record_timestamps: the result's ``timestamps`` gets each token's time (``perf_counter``; the
                tokens of one decode block share a time).
            eos_token_id: an id or a non-empty list of ids, each in ``[0, vocab_size)`` (default: the
                generation config's).
            **kwargs: per-request settings, :data:`REQUEST_SETTINGS` only: ``do_sample``, ``temperature``,
                ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``min_new_tokens``, ``pad_token_id``,
                ``seed`` (int; default: drawn from torch's default generator), ``stop_sequences`` (a list of
                token-id lists: the request ends after generating one of them, the sequence included).

        Raises:
            RuntimeError: after :meth:`stop`. QueueFull: ``max_queue`` requests wait.
            ValueError: an empty prompt, a token id outside the vocabulary, ``max_new_tokens <= 0``, an empty
                request id or one in use, an ``eos_token_id`` that is an empty list or holds an id outside the
                vocabulary, a ``pad_token_id`` (the request's or the generation config's) outside the vocabulary,
                an unknown keyword (named), a setting out of range.
            GeometryError: prompt + ``max_new_tokens`` above ``max_seq_len``, or more than the arena could
                ever hold for one request (the sizes are in the message).
            UnsupportedGenerationSetting: a setting the decode runner does not apply (named).
        """
        with self._lock:
            if self._stopping or self._stopped:
                raise RuntimeError("add_request after stop(): the manager accepts no new requests")
        req = self._build(input_ids, request_id, max_new_tokens, bool(streaming), eos_token_id, kwargs)
        with self._lock:
            if self._stopping:
                raise RuntimeError("add_request after stop(): the manager accepts no new requests")
            if request_id is not None and req.rid in self._known:
                raise ValueError(f"request id {req.rid!r} is in use (queued, running, or its result not taken yet)")
            if self.max_queue is not None and len(self._inbox) + self.engine.waiting() >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests wait already (max_queue={self.max_queue}); retry later")
            if request_id is None:
                req.rid = self._take_id()
            self._known[req.rid] = bool(streaming)
            self._streaming[req.rid] = bool(streaming)
            self._timestamps[req.rid] = bool(record_timestamps)
            self._live[req.rid] = req
            self._inbox.append(req)
        self._wake.set()
        return req.rid

    def add_requests(self, inputs: Sequence, max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, eos_token_id: int | list[int] | None = None,
                     **kwargs) -> list[str]:
        """:meth:`add_request` for each prompt of ``inputs`` (ids ``req_<n>``, in order), every one with the same
        ``max_new_tokens``, ``eos_token_id`` and settings (``seed`` and ``stop_sequences`` included); returns the
        ids. All prompts are validated before any is queued; the errors are :meth:`add_request`'s."""
        built = []
        prompts = _prompt_list(inputs, "add_requests")
        for i, ids in enumerate(prompts):
            try:
                built.append(self._build(ids, None, max_new_tokens, bool(streaming), eos_token_id, kwargs,
                                         "add_requests"))
            except Exception as e:  # say which prompt; nothing was queued
                where = f"add_requests: prompt {i} of {len(prompts)}"
                if type(e) in (ValueError, GeometryError):  # message-only constructors
                    raise type(e)(f"{where}: {e}") from e
                e.add_note(where)
                raise
        with self._lock:
            if self._stopping or self._stopped:
                raise RuntimeError("add_requests after stop(): the manager accepts no new requests")
            if self.max_queue is not None and len(self._inbox) + self.engine.waiting() + len(built) > self.max_queue:
                raise QueueFull(f"{len(built)} more requests would exceed max_queue={self.max_queue}")
            for req in built:
                req.rid = self._take_id()
                self._known[req.rid] = bool(streaming)
                self._streaming[req.rid] = bool(streaming)
                self._timestamps[req.rid] = bool(record_timestamps)
                self._live[req.rid] = req
            self._inbox.extend(built)
        self._wake.set()
        return [r.rid for r in built]

    def _take_id(self) -> str:
        """The next automatic id (caller holds ``_lock``): ``req_<n>``, past any id a caller chose."""
        while f"req_{self._next_id}" in self._known:
            self._next_id += 1
        self._next_id += 1
        return f"req_{self._next_id - 1}"

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request: its memory is freed at the next step boundary and its result (status FAILED,
        ``error="cancelled"``, the tokens generated until then) is delivered. Unknown or finished ids: no-op,
        now and later (a request added afterwards under the same id is not cancelled).

        Raises:
            TypeError: ``request_id`` is not a str (no request has such an id)."""
        if not isinstance(request_id, str):
            raise TypeError(f"cancel_request: request_id must be a str (an id add_request returned), got "
                            f"{type(request_id).__name__} {request_id!r}")
        with self._lock:
            req = self._live.get(request_id)
            if req is None:
                return
            self._cancels.append(req)
        self._wake.set()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next result (any request's, or ``request_id``'s), waiting at most ``timeout`` seconds (None:
        until one comes, or the loop ends); None when none came (at once when the loop does not run). A
        final result is returned once.

        Raises:
            KeyError: ``request_id`` was never added, or its final result was taken already."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._results:
            if request_id is not None and request_id not in self._known:
                raise KeyError(f"no request {request_id!r}: never added, or its final result was taken already")
            while True:
                for i, out in enumerate(self._outbox):
                    if request_id is None or out.request_id == request_id:
                        del self._outbox[i]
                        if out.is_finished():  # the id is free for a new request from now on
                            self._known.pop(out.request_id, None)
                        return out
                if not self.is_running():  # nobody will produce one (a manager stepped by hand: step() first)
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._results.wait(0.1 if left is None else min(left, 0.1))

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Results as they come, until the loop stopped and every result was taken."""
        while True:
            out = self.get_result(timeout=0.1)
            if out is not None:
                yield out
            elif not self.is_running() and not self._outbox:
                return

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """``request_id``'s results (one per step that adds tokens for a streaming request; else the final
        one) until its final result. ``timeout``: seconds to wait for each (None: no limit); TimeoutError
        when it passes."""
        while True:
            out = self.get_result(request_id, timeout=timeout)
            if out is None:
                if timeout is not None:
                    raise TimeoutError(f"no result of request {request_id!r} within {timeout} s")
                return
            yield out
            if out.is_finished():
                return

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict:
        """A snapshot for a server: ``running``, ``waiting`` (requests), ``kv_bytes``, ``state_bytes``,
        ``free_bytes``, ``reserved_bytes`` (the memory's fixed overheads: sink, tail pad), ``budget_bytes``
        (arena; exactly the sum of the four before it), ``generated_tokens``, ``tokens_per_s`` (since start),
        ``preemptions``, ``finished``, ``failed``, ``cancelled``, ``steps``, ``decode_steps``, ``peak_rows`` and
        the engine's other counters (:class:`~.engine.Engine`: ``refusals``, ``refused_with_room``,
        ``row_waits``, the prefill and decode times)."""
        e = self.engine
        m = e.memory
        with self._lock:
            inbox = len(self._inbox)
        # free from the same two readings as kv and state (the engine may allocate between calls), so the
        # four sides add up to the budget in every snapshot
        kv, state, reserved = m.kv_bytes(), m.state_bytes(), m.reserved_bytes()
        out = {"running": e.running(), "waiting": e.waiting() + inbox, "kv_bytes": kv, "state_bytes": state,
               "free_bytes": m.budget - reserved - kv - state, "reserved_bytes": reserved, "budget_bytes": m.budget}
        out.update(e.counters)
        elapsed = time.perf_counter() - self._started_at if self._started_at is not None else 0.0
        out["tokens_per_s"] = e.counters["generated_tokens"] / elapsed if elapsed > 0 else 0.0
        return out

    # ------------------------------------------------------------------ the loop
    def step(self) -> bool:
        """Run one engine step on the calling thread (a manager that was not started); returns whether
        there is work left.

        Raises:
            RuntimeError: the background loop runs."""
        if self.is_running():
            raise RuntimeError("step() on a started manager: its background loop steps it")
        return self._one_step()

    def _one_step(self) -> bool:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            if self._hard_stop:
                cancels += list(self.engine._requests.values()) + inbox
        for req in inbox:
            self.engine.add(req)
        for req in cancels:
            self.engine.cancel(req)
        if not self.engine.has_work:
            return False
        try:
            touched = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the engine's bookkeeping failed: fail what it holds, go on
            logger.exception("engine step raised")
            touched = self._fail_all(e)
        self._publish(touched)
        return self.engine.has_work

    def _fail_all(self, error: BaseException) -> list[EngineRequest]:
        failed = []
        for req in list(self.engine._requests.values()):
            try:
                self.engine._end(req, error=f"{type(error).__name__}: {error}")
            except Exception:  # noqa: BLE001 - the bookkeeping is broken: report the request anyway
                req.finished, req.error = True, f"{type(error).__name__}: {error}"
            failed.append(req)
        return failed

    def _publish(self, touched: list[EngineRequest]) -> None:
        outs = []
        for req in touched:
            if not req.finished:  # a streaming request's output when it has new tokens
                if not self._streaming.get(req.rid, False) or len(req.generated) <= self._sent.get(req.rid, 0):
                    continue
                self._sent[req.rid] = len(req.generated)
            else:
                self._sent.pop(req.rid, None)
            outs.append(self._output(req))
        if not outs:
            return
        with self._lock:  # a final result frees its id: a cancel of it from now on is a no-op
            for out in outs:
                if out.is_finished():
                    self._live.pop(out.request_id, None)
        with self._results:
            for out in outs:
                if out.is_finished():
                    self._streaming.pop(out.request_id, None)
                    self._timestamps.pop(out.request_id, None)
                self._outbox.append(out)
            self._results.notify_all()

    def _output(self, req: EngineRequest) -> GenerationOutput:
        if req.finished:
            status = RequestStatus.FAILED if req.error is not None else RequestStatus.FINISHED
        else:
            status = _PHASE_STATUS[req.phase]
        start = req.first_token_at if req.first_token_at is not None else -1
        end = req.finished_at if req.finished_at is not None else -1
        out = GenerationOutput(request_id=req.rid, prompt_ids=list(req.prompt), generated_tokens=list(req.generated),
                               error=req.error, status=status, created_time=req.arrival, lifespan=(start, end))
        if self._timestamps.get(req.rid):
            out.timestamps = list(req.token_times)
        return out

    def _loop(self, inference: bool) -> None:
        with torch.inference_mode(inference):
            while True:
                more = self._one_step()
                with self._lock:
                    done = self._stopping and not more and not self._inbox and not self._cancels
                if done:
                    break
                if not more:
                    self._wake.wait(0.05)
                    self._wake.clear()
        with self._results:
            self._results.notify_all()

    # ------------------------------------------------------------------ validation
    def _build(self, input_ids, request_id, max_new_tokens, streaming, eos_token_id, kwargs,
               where: str = "add_request") -> EngineRequest:
        # a copy: add_requests hands every prompt the same settings, and seed / stop_sequences are popped here
        kwargs = dict(kwargs)
        unknown = sorted(set(kwargs) - set(REQUEST_SETTINGS))
        if kwargs.get("num_return_sequences") not in (None, 1):  # the same advice as from a generation config
            raise ValueError(f"num_return_sequences={kwargs['num_return_sequences']}: the unimem engine returns one "
                             "sequence per request (add the prompt that many times)")
        if unknown:
            raise ValueError(f"{where} does not take {', '.join(map(repr, unknown))}: the unimem engine applies "
                             f"per request only {', '.join(REQUEST_SETTINGS)} (docs/engine.md)")
        prompt = _token_list(input_ids, "input_ids")
        if not prompt:
            raise ValueError("input_ids is empty: a request needs at least one prompt token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids holds token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        # an automatic id is taken only once the request is accepted (add_request), so messages name none
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        if request_id == "":  # it was queued under "" and its result delivered under that falsy id
            raise ValueError("request_id is an empty string: give a non-empty str, or None for an automatic id "
                             "req_<n>")
        label = "the request" if request_id is None else f"request {request_id!r}"
        if max_new_tokens is not None:  # numpy and 0-d tensor ints too, as generate() takes them
            try:
                count = as_int(max_new_tokens, "max_new_tokens")
            except TypeError:  # a bool, a float, ...
                count = 0
            if count <= 0:
                raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
            max_new_tokens = count
        stops = kwargs.pop("stop_sequences", None) or ()
        stop_sequences = tuple(tuple(_token_list(s, "a stop sequence")) for s in stops)
        if any(not s for s in stop_sequences):
            raise ValueError("stop_sequences holds an empty sequence")
        seed = kwargs.pop("seed", None)
        if eos_token_id is not None:
            eos_token_id = _eos_ids(eos_token_id, self.vocab_size)
        settings = self._settings(prompt, max_new_tokens, eos_token_id, kwargs, seed)
        handle = self.model.unimem
        total = len(prompt) + settings.max_new_tokens
        if total > handle.max_seq_len:
            raise GeometryError(f"{label}: a prompt of {len(prompt)} tokens + max_new_tokens="
                                f"{settings.max_new_tokens} is {total} tokens, more than max_seq_len="
                                f"{handle.max_seq_len}")
        memory = self.engine.memory
        if not memory.can_ever_hold(total):
            raise GeometryError(f"{label} of {total} tokens ({memory.pages_for(total)} pages of "
                                f"{memory.page_size} tokens and one state) never fits this arena of "
                                f"{memory.budget} bytes ({memory.name})")
        return EngineRequest(rid=request_id or "", prompt=prompt, settings=settings, stop_sequences=stop_sequences)

    def _settings(self, prompt, max_new_tokens, eos_token_id, overrides: dict, seed) -> RowSettings:
        """The request's RowSettings as generate() would derive them from the manager's config and these
        overrides (the model's generation config fills what is unset; 20 new tokens by default)."""
        model = self.model
        base = self.generation_config
        overrides = dict(overrides)
        if max_new_tokens is not None:
            overrides["max_new_tokens"] = max_new_tokens
        if eos_token_id is not None:
            overrides["eos_token_id"] = eos_token_id
        default_max_length = (base.max_length is None and getattr(model.generation_config, "max_length", None) is None)
        # a shallow copy of generate()'s resolution of the two configs, made once (update() rebinds fields,
        # it never mutates a shared value): resolving them per request cost ~250 us on the caller's thread
        config = copy.copy(self._resolved_config())
        unused = config.update(**overrides)  # after the defaults: the request's settings win
        if unused:
            raise ValueError(f"add_request does not take {sorted(unused)}")
        if config.num_return_sequences not in (None, 1):
            raise ValueError(f"num_return_sequences={config.num_return_sequences}: the unimem engine returns one "
                             "sequence per request (add the prompt that many times)")
        if config.max_new_tokens is None and default_max_length:
            limit = config.max_length + len(prompt)
            max_pos = getattr(model.config, "max_position_embeddings", None)
            if max_pos is not None:
                limit = min(limit, max_pos)
            if limit - len(prompt) < 1:
                raise GeometryError(f"a prompt of {len(prompt)} tokens leaves no token to generate within "
                                    f"max_position_embeddings={max_pos}")
            config.max_new_tokens = limit - len(prompt)
        if config.do_sample and seed is None:
            seed = draw_seeds(1)[0]
        settings = RowSettings.from_generation_config(config, len(prompt), seed=0 if seed is None else seed)
        if settings.pad_token_id >= self.vocab_size:  # a finished row feeds its pad to the embedding while
            # others in its decode block still run: an IndexError there would fail every row of the block
            raise ValueError(f"pad_token_id={settings.pad_token_id} is outside the vocabulary [0, {self.vocab_size}): "
                             "a row that finishes inside a decode block feeds it to the model's embedding")
        max_eos = self.engine.runner.state.max_eos
        if len(settings.eos_token_ids) > max_eos:
            raise GenerationSettingError(f"eos_token_id has {len(settings.eos_token_ids)} ids; a decode row holds "
                                         f"at most {max_eos}", setting="eos_token_id", value=settings.eos_token_ids)
        return settings


    def _resolved_config(self):
        """``model._prepare_generation_config(generation_config)``: the manager's config filled from the model's
        and transformers' defaults, as generate() resolves it. Resolved again whenever either config object
        was replaced or one of its fields changed since (a snapshot of their fields, compared by value), so a
        config edited between two requests applies to the second, as it did when every request resolved it.
        Callers copy it before changing it."""
        base, model_config = self.generation_config, self.model.generation_config
        cached = self._resolved
        if (cached is not None and cached[0] is base and cached[1] is model_config
                and _same_fields(base, cached[2]) and _same_fields(model_config, cached[3])):
            return cached[4]
        resolved, _ = self.model._prepare_generation_config(base)  # deep-copies base before filling it in
        self._resolved = (base, model_config, copy.deepcopy(vars(base)), copy.deepcopy(vars(model_config)),
                          resolved)
        return resolved


def _same_fields(config, snapshot: dict) -> bool:
    """Whether ``config``'s fields equal ``snapshot`` (a deep copy of them); False when they cannot be
    compared (a tensor-valued field), so the config is resolved again rather than trusted."""
    try:
        return bool(vars(config) == snapshot)
    except Exception:  # noqa: BLE001 - e.g. "Boolean value of Tensor with more than one value is ambiguous"
        return False


def _prompt_list(inputs, where: str) -> list:
    """``inputs`` of ``add_requests`` / ``generate_batch`` as a list of prompts; ValueError naming what was
    passed instead (a padded 2-D batch, one flat prompt, text), which would otherwise fail obscurely or
    per token."""
    if isinstance(inputs, torch.Tensor) and inputs.dim() != 1:
        raise ValueError(f"{where} takes a list of prompts (each a list of token ids or a 1-D tensor), got a "
                         f"tensor of shape {list(inputs.shape)}; for a padded batch pass each row without its pads: "
                         "[row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]")
    if isinstance(inputs, (str, bytes)):
        raise ValueError(f"{where} takes token ids, not text: encode the prompts with the tokenizer first")
    if not hasattr(inputs, "__iter__"):
        raise ValueError(f"{where} takes a list of prompts, got {type(inputs).__name__}")
    inputs = list(inputs)  # a 1-D tensor or array: a list of 0-d ones, one prompt's token ids
    if inputs and (isinstance(inputs[0], numbers.Integral) or getattr(inputs[0], "ndim", None) == 0):
        raise ValueError(f"{where} takes a list of prompts, got one list of {len(inputs)} token ids: wrap a "
                         "single prompt as [prompt]")
    return inputs


def _eos_ids(value, vocab_size: int) -> int | list[int]:
    """A request's ``eos_token_id`` checked: one id (an int, a numpy int, a 0-d integer tensor) or a non-empty
    list / 1-D tensor of ids, each in ``[0, vocab_size)``; returned as an int or a list of ints.

    Raises:
        ValueError: an empty list (it would silently drop the generation config's EOS ids, which None keeps),
            an id outside the vocabulary (the model can never generate it, so it would never end the request),
            anything but integers."""
    if not isinstance(value, (bool, list, tuple, torch.Tensor)) and hasattr(value, "__index__") or (
            isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point()):
        ids, single = [as_int(value, "eos_token_id")], True
    else:
        ids, single = _token_list(value, "eos_token_id"), False
    if not ids:
        raise ValueError("eos_token_id is an empty list: give at least one id, or None for the generation config's")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"eos_token_id holds {bad}, outside the vocabulary [0, {vocab_size}): the model never "
                         "generates it")
    return ids[0] if single else ids


def _token_list(values, what: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.is_floating_point():
            raise ValueError(f"{what} must be a 1-D integer tensor, got {values.dtype} {list(values.shape)}")
        return [int(v) for v in values.tolist()]
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{what} must be a list of token ids, got {type(values).__name__}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) and not (hasattr(v, "__index__")):
            raise ValueError(f"{what} must hold ints, got {type(v).__name__} {v!r}")
        out.append(int(v))
    return out
