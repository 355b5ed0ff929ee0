"""Host copies of a step's device tables, for ops that plan their launches on the host.

``mla_prefill`` splits a call's history into workspace pieces, which it plans from each row's stored length:
a host number. The graph carries only the device ``kv_len`` (the cache reaches the graph through
``mla_gather``, whose schema is frozen, docs/passes.md), and reading it back waits for every kernel queued
before the op: one host <-> GPU synchronisation per MLA layer and prefill chunk, which keeps the host from
running ahead of the GPU (benchmarks/sync_audit.py lists them).

The cache knows those lengths on the host: it computed them before uploading them in stream order. So the
forward that runs a prepared step publishes them here, for the duration of that forward and on its thread
(the way serving engines pass per-step attention metadata beside the graph), and the op looks its ``kv_len``
up by address. The lookup is exact or nothing: the same data pointer, device, element count and dtype as a
tensor registered for the current forward, and contiguous (a view with other strides reads other elements),
else None and the op reads the device tensor back as before.
Under ``UNIMEM_DEBUG=1`` ``mla_prefill`` checks the copy it got against the device tensor (one sync).

A registered copy must equal what the device tensor holds when the op's kernels run: register only tables
uploaded before the forward and not changed on the device during it (true of a prepared step's ``kv_len``;
the decode runner, which advances ``kv_len`` inside its graphs, registers nothing).
"""

from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["host_copy", "host_copies"]

_local = threading.local()


@contextlib.contextmanager
def host_copies(pairs: list[tuple[torch.Tensor, torch.Tensor]]):
    """Inside the ``with`` (on this thread), :func:`host_copy` of each pair's device tensor is its host tensor.

    Args:
        pairs: ``(device tensor, host tensor)``, both contiguous, with equal dtype and element count
            (ValueError otherwise); the host tensors are not copied: the caller must not change them inside the
            ``with``.

    Nests: an inner ``with`` sees the outer's pairs and its own (its own win for the same address).
    """
    table = dict(getattr(_local, "table", None) or {})
    for dev, host in pairs:
        if (dev.dtype != host.dtype or dev.numel() != host.numel() or host.device.type != "cpu"
                or not dev.is_contiguous() or not host.is_contiguous()):
            raise ValueError(f"a host copy must be a contiguous CPU tensor of the contiguous device tensor's dtype "
                             f"and size: device {dev.dtype} x {dev.numel()}, host {host.dtype} x {host.numel()} on "
                             f"{host.device}")
        table[(dev.device, dev.data_ptr())] = (dev.numel(), dev.dtype, host)
    previous = getattr(_local, "table", None)
    _local.table = table
    try:
        yield
    finally:
        _local.table = previous


def host_copy(t: torch.Tensor) -> torch.Tensor | None:
    """The host copy registered (:func:`host_copies`) for a tensor at ``t``'s address with ``t``'s device,
    dtype and element count, reshaped to ``t``'s shape; None when there is none."""
    table = getattr(_local, "table", None)
    if not table:
        return None
    entry = table.get((t.device, t.data_ptr()))
    if entry is None or entry[0] != t.numel() or entry[1] != t.dtype or not t.is_contiguous():
        return None
    return entry[2].reshape(t.shape)
