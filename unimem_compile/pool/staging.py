"""Host -> device copies of small per-step tables that never make the host wait for the GPU.

``device_tensor.copy_(cpu_tensor)`` from ordinary (pageable) host memory synchronises the stream: the host
stops until every queued kernel has run. Done a few times per decode step (page table, ``kv_len``, the
step's write locations), that serialises the host's Python work with the GPU's and costs the whole
run-ahead that CUDA graphs exist for (measured on an H200, batch 32: ~8 stream synchronisations per step
and 1-2 ms of host time exposed per step; benchmarks/RESULTS.md).

:class:`StagedUpload` copies the source into a page-locked (pinned) staging buffer and enqueues an
asynchronous copy from it on the current stream. A ring of ``depth`` staging buffers, each guarded by a
CUDA event recorded after its copy, keeps a buffer from being overwritten before the copy that reads it
has run: the host waits only if it is ``depth`` uploads ahead of the GPU. Stream order keeps the device
tensor from changing under the kernels of an earlier step (they were enqueued before the copy).

:func:`upload` is the same for a tensor of any shape that the step reads once (a prefill chunk's write
locations, token ids): a fresh device tensor, copied from a pinned copy of the source that torch's caching host
allocator keeps until the copy has run (it records an event on the stream with each non-blocking copy from its
memory, and hands the block out again only after that event).
"""

from __future__ import annotations

import torch

from .. import env

__all__ = ["StagedUpload", "upload"]


class StagedUpload:
    """Asynchronous uploads into one fixed device tensor ``dst``.

    Args:
        dst: the device tensor updated in place (its address never changes: CUDA graphs may read it).
        depth: staging buffers in the ring (uploads that may be in flight at once).

    On a CPU ``dst`` an upload is a plain ``copy_``. Each upload is enqueued on the stream current at the
    call; every reader of ``dst`` must run on that stream (the default stream in generate()).
    """

    #: uploads (of every instance, process-wide) that found their staging buffer still in use and waited for
    #: the GPU; ``torch.cuda.set_sync_debug_mode`` does not see these event waits (benchmarks/sync_audit.py)
    waits = 0

    def __init__(self, dst: torch.Tensor, depth: int = 2):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.dst = dst
        self.cuda = dst.device.type == "cuda"
        self._next = 0
        if self.cuda:
            self._stage = [torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True) for _ in range(depth)]
            self._done: list[torch.cuda.Event | None] = [None] * depth

    def __call__(self, src: torch.Tensor) -> None:
        """Make ``dst`` equal ``src`` (a host tensor of ``dst``'s shape and dtype) in stream order."""
        if not self.cuda:
            self.dst.copy_(src)
            return
        i = self._next
        self._next = (i + 1) % len(self._stage)
        done = self._done[i]
        if done is not None:
            if not done.query():  # the copy that last read this staging buffer has not run: wait for it
                StagedUpload.waits += 1
                done.synchronize()
        else:
            done = self._done[i] = torch.cuda.Event()
        self._stage[i].copy_(src)
        self.dst.copy_(self._stage[i], non_blocking=True)
        done.record(torch.cuda.current_stream(self.dst.device))


def upload(src: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A new tensor on ``device`` equal to the host tensor ``src``, enqueued without a stream synchronisation.

    On a CUDA ``device`` the copy reads a page-locked copy of ``src`` on the current stream (the caller may
    change or free ``src`` at once: the pinned copy is its own, and torch keeps it until the copy has run);
    readers of the result must run on that stream. ``UNIMEM_ASYNC_UPLOADS=0`` makes it the blocking
    ``src.to(device)`` (which waits for every kernel queued on the stream), for A/B runs. On another device it
    is ``src.to(device)`` (a copy on a CPU device only when ``src`` is not already there: it may alias ``src``).
    """
    device = torch.device(device)
    if device.type != "cuda" or src.device.type != "cpu" or not env.async_uploads():
        return src.to(device)
    # pin_memory() returns an already pinned tensor itself: copy it, or a change to src would race the copy
    pinned = torch.empty_like(src, pin_memory=True).copy_(src) if src.is_pinned() else src.pin_memory()
    return pinned.to(device, non_blocking=True)
