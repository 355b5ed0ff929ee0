"""The narrow interface the HTTP layer needs from a batching engine, and its implementation over the
continuous-batching manager (``model.init_continuous_batching()``, docs/design.md section 8).

The HTTP layer sees only :class:`EngineClient`: submit a request with a callback, cancel it, read metrics,
close. Updates arrive on the engine's thread; the HTTP layer hands them to its event loop itself. Keeping
the interface this small lets the HTTP layer be tested against a fake engine, and keeps every detail of the
manager (its result queue, its status values, how it refuses) in :class:`ManagerEngine`.
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

from ..engine.manager import QueueFull as EngineQueueFull

log = logging.getLogger("unimem_compile.serve")

__all__ = [
    "Sampling",
    "Update",
    "EngineMetrics",
    "EngineClient",
    "QueueFull",
    "RequestRefused",
    "ManagerEngine",
]


@dataclass(frozen=True)
class Sampling:
    """One request's generation settings.

    Attributes:
        max_new_tokens: most tokens generated (>= 1).
        temperature: None: the model's generation config decides (its ``do_sample`` / ``temperature``);
            0: greedy; > 0: sampled at that temperature.
        top_p: nucleus mass in (0, 1], None: the generation config's.
        seed: the request's sampling seed, None: the engine's stream.
        min_new_tokens: EOS is ignored before this many tokens (None: the generation config's).
    """

    max_new_tokens: int
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    min_new_tokens: Optional[int] = None


@dataclass(frozen=True)
class Update:
    """A request's progress. ``generated_tokens`` is every token generated so far (not a delta), as the
    manager's streamed ``GenerationOutput`` carries it. ``status``: ``"running"``, ``"finished"``,
    ``"failed"`` (``error`` says why)."""

    request_id: str
    generated_tokens: Sequence[int]
    status: str = "running"
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.status != "running"


@dataclass
class EngineMetrics:
    """A snapshot for ``/metrics``. Bytes are arena bytes: ``kv_bytes + state_bytes + free_bytes +
    reserved_bytes == total_bytes`` (``reserved_bytes``: what no request can ever hold, the arena's sink
    page and tail pad); ``tokens_per_s`` is the output rate over the last seconds (the engine's own figure
    where it has one)."""

    running: int = 0
    waiting: int = 0
    kv_bytes: int = 0
    state_bytes: int = 0
    free_bytes: int = 0
    reserved_bytes: int = 0
    total_bytes: int = 0
    tokens_per_s: float = 0.0
    preemptions: int = 0
    extra: dict = field(default_factory=dict)


class QueueFull(Exception):
    """The engine holds as many requests as it may; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class RequestRefused(ValueError):
    """The engine refused the request for good (a prompt that can never fit, a bad id); the message has the
    numbers, ``param`` the request field at fault."""

    def __init__(self, message: str, param: Optional[str] = "prompt"):
        super().__init__(message)
        self.param = param


class EngineClient(Protocol):
    """What the HTTP layer calls. Thread-safe: ``submit`` and ``cancel`` come from the event loop's thread
    while the engine runs on its own.

    Attributes:
        max_seq_len: most tokens (prompt + generated) one request may hold.
        max_queue: optional; the most requests that wait for admission at a time (a request of more
            completions than that is refused with 400 before any is submitted).
    """

    max_seq_len: int

    def submit(self, prompt_ids: list[int], sampling: Sampling, on_update: Callable[[Update], None]) -> str:
        """Queue a request; ``on_update`` is called (on the engine's thread) with each :class:`Update`, the
        last one finished. Raises :class:`QueueFull` or :class:`RequestRefused`, leaving nothing queued."""

    def cancel(self, request_id: str) -> None:
        """Drop a request (no-op once it finished); its memory is freed at the engine's next step. No update
        follows."""

    def metrics(self) -> EngineMetrics: ...

    def close(self, timeout: Optional[float] = None) -> None:
        """Cancel what is still queued or running and stop the engine."""


def _status_name(status) -> str:
    """transformers' ``RequestStatus`` (an IntEnum: PENDING 0, PREFILLING 1, DECODING 2, FINISHED 3, FAILED
    4) or an engine's own status, as one of "running" / "finished" / "failed"."""
    name = getattr(status, "name", str(status)).lower()
    if name in ("finished", "failed"):
        return name
    if "cancel" in name or "abort" in name or "error" in name or "fail" in name:
        return "failed"
    return "running"


class ManagerEngine:
    """:class:`EngineClient` over a continuous-batching manager (``model.init_continuous_batching()``).

    Requests are added with ``streaming=True``; one dispatcher thread reads the manager's results
    (``get_result(timeout=...)``, any request, then every result already waiting: a step's results are
    handed over together) and calls the callback registered for each request id, so a server holds one
    thread for every open request, not one each. A callback that raises is logged; the others still run.

    Args:
        manager: the manager, started or not (``start()`` is called here if it is not running).
        max_seq_len: the compiled model's ``max_seq_len``.
        poll_s: the dispatcher's ``get_result`` timeout (seconds): how late it notices :meth:`close`.
    """

    def __init__(self, manager, max_seq_len: int, *, poll_s: float = 0.05):
        self.manager = manager
        self.max_seq_len = max_seq_len
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._handlers: dict[str, Callable[[Update], None]] = {}
        self._closing = threading.Event()
        if not manager.is_running():
            manager.start()
        self._thread = threading.Thread(target=self._dispatch, name="unimem-serve-dispatch", daemon=True)
        self._thread.start()

    @property
    def max_queue(self) -> int | None:
        """The most requests that wait for admission at a time (the manager's ``max_queue``; None: no limit)."""
        return self.manager.max_queue

    def submit(self, prompt_ids: list[int], sampling: Sampling, on_update: Callable[[Update], None]) -> str:
        if self._closing.is_set():
            raise QueueFull("the server is shutting down", retry_after=math.inf)
        rid = f"req-{uuid.uuid4().hex}"
        kwargs = {}
        if sampling.temperature is not None:
            kwargs["do_sample"] = sampling.temperature > 0
            if sampling.temperature > 0:
                kwargs["temperature"] = sampling.temperature
        if sampling.top_p is not None:
            kwargs["top_p"] = sampling.top_p
        if sampling.seed is not None:
            kwargs["seed"] = sampling.seed
        if sampling.min_new_tokens is not None:
            kwargs["min_new_tokens"] = sampling.min_new_tokens
        with self._lock:
            self._handlers[rid] = on_update
        try:
            self.manager.add_request(list(prompt_ids), request_id=rid, max_new_tokens=sampling.max_new_tokens,
                                     streaming=True, **kwargs)
        except BaseException as e:
            with self._lock:
                self._handlers.pop(rid, None)
            if isinstance(e, EngineQueueFull):
                raise QueueFull(str(e), retry_after=1.0) from e
            if isinstance(e, RuntimeError):  # add_request after stop(): the server is going down
                raise QueueFull(str(e), retry_after=math.inf) from e
            if isinstance(e, ValueError):  # GeometryError and the settings' errors are ValueErrors
                raise RequestRefused(str(e)) from e
            raise
        return rid

    def cancel(self, request_id: str) -> None:
        with self._lock:
            live = self._handlers.pop(request_id, None) is not None
        if live:
            self.manager.cancel_request(request_id)

    def outstanding(self) -> int:
        """Requests submitted and neither finished nor cancelled."""
        with self._lock:
            return len(self._handlers)

    def _dispatch(self) -> None:
        get = self.manager.get_result
        while not self._closing.is_set():
            out = get(timeout=self._poll_s)
            if out is None:
                if not self.manager.is_running():  # get_result returns at once then: do not spin
                    self._closing.wait(self._poll_s)
                continue
            # every result of the step at once, so the HTTP layer gets them in one batch (one wake-up of its
            # loop): this thread runs only when a step published, not once per request
            outs = [out]
            while (out := get(timeout=0)) is not None:
                outs.append(out)
            calls = []
            with self._lock:
                for out in outs:
                    # the manager's output is a fresh list each time: no copy
                    update = Update(out.request_id, out.generated_tokens, _status_name(out.status),
                                    getattr(out, "error", None))
                    handler = (self._handlers.pop if update.finished else self._handlers.get)(out.request_id, None)
                    if handler is not None:
                        calls.append((handler, update))
            for handler, update in calls:
                try:
                    handler(update)
                except Exception:  # noqa: BLE001 - one request's callback must not stop every other's updates
                    log.exception("the update callback of %s raised", update.request_id)

    def metrics(self) -> EngineMetrics:
        raw = self.manager.metrics()
        return EngineMetrics(
            running=raw["running"], waiting=raw["waiting"], kv_bytes=raw["kv_bytes"],
            state_bytes=raw["state_bytes"], free_bytes=raw["free_bytes"], reserved_bytes=raw["reserved_bytes"],
            total_bytes=raw["budget_bytes"],
            tokens_per_s=raw["tokens_per_s"], preemptions=raw["preemptions"],
            extra={"outstanding": self.outstanding(), **{k: raw[k] for k in ("finished", "failed", "cancelled")
                                                          if k in raw}},
        )

    def close(self, timeout: Optional[float] = None) -> None:
        self._closing.set()
        with self._lock:
            rids, self._handlers = list(self._handlers), {}
        for rid in rids:
            self.manager.cancel_request(rid)
        self._thread.join(timeout)
        self.manager.stop(block=True, timeout=timeout, hard_stop=True)
