"""Exception types of unimem-compile (docs/design.md section 5).

Every error carries the numbers that explain it (asked vs available bytes, the bad shape and the expected
one). An operation that raises leaves the pool (arena bytes and tables) exactly as it was.
"""

from __future__ import annotations

__all__ = ["UnimemError", "PoolExhausted", "InvalidFree", "GeometryError", "UnsupportedModel", "RankMismatch",
           "CapturedInputMoved"]


class UnimemError(Exception):
    """Base class of every error raised by unimem-compile."""


class PoolExhausted(UnimemError):
    """An allocation does not fit into the arena; nothing was changed.

    Attributes:
        requested: bytes the allocation asked for (whole pages or whole slots).
        available: the free gap between the two sides, in bytes (it may end in a tail smaller than one
            page or slot, which no allocation can use: the message says how many whole units fit).
        side: ``"kv"`` (pages) or ``"state"`` (slots): the side that asked.
        reclaimable: ``{"kv": bytes, "state": bytes}``: how many bytes compacting each side would add to
            the free gap (holes left by freed pages / slots).
    """

    def __init__(self, message: str, *, requested: int, available: int, side: str, reclaimable: dict[str, int]):
        super().__init__(message)
        self.requested = int(requested)
        self.available = int(available)
        self.side = side
        self.reclaimable = dict(reclaimable)

    def __reduce__(self):  # keyword-only fields: pickling (multiprocessing) must pass them back by name
        return _rebuild_pool_exhausted, (str(self), self.requested, self.available, self.side, self.reclaimable)


def _rebuild_pool_exhausted(message: str, requested: int, available: int, side: str,
                            reclaimable: dict[str, int]) -> PoolExhausted:
    return PoolExhausted(message, requested=requested, available=available, side=side, reclaimable=reclaimable)


class InvalidFree(UnimemError):
    """A free of the sink, of an id that was never allocated, or of an id freed already."""


class GeometryError(UnimemError, ValueError):
    """Geometry that cannot be laid out: a bad field in a spec, a budget too small, a missing tail pad."""


class UnsupportedModel(UnimemError):
    """A model family unimem-compile has no adapter for, or a config it cannot map onto the pool."""


class RankMismatch(UnimemError):
    """The ranks of a tensor-parallel launch disagree, so none of them goes on: different models, weights,
    options or pool budgets at ``compile(tensor_parallel=True)``, different inputs to a ``generate()`` call,
    different page tables (checked under ``UNIMEM_DEBUG=1``), another rank that failed a check this one
    passed, or ranks that did not meet within ``UNIMEM_TP_TIMEOUT`` seconds. Every rank raises it (the rank
    that failed raises its own error), so no rank is left waiting in a collective."""


class CapturedInputMoved(UnimemError):
    """A tensor a captured decode step reads no longer has the storage it had at capture (the decode
    runner checks before it replays, ``unimem_compile.runner.captured``); nothing was replayed.

    Attributes:
        name: the tensor, as the runner names it (``"bucket 4 buffers.page_table"``, ``"parameter lm_head.weight"``).
        captured: ``(data_ptr, shape, stride, dtype)`` at capture.
        now: the same for the tensor there now, or None when it is no tensor any more.
    """

    def __init__(self, message: str, *, name: str, captured: tuple, now: tuple | None):
        super().__init__(message)
        self.name = name
        self.captured = captured
        self.now = now

    def __reduce__(self):  # keyword-only fields, as PoolExhausted
        return _rebuild_captured_input_moved, (str(self), self.name, self.captured, self.now)


def _rebuild_captured_input_moved(message: str, name: str, captured: tuple, now: tuple | None) -> CapturedInputMoved:
    return CapturedInputMoved(message, name=name, captured=captured, now=now)
