"""CUDA graphs of flash-linear-attention's ``chunk_kda`` per chunk-length bucket: a prefill's KDA without fla's
host cost.

Why: a serving prefill forward of up to a few thousand tokens is host-bound (2026-12-02, ``kimi-linear-48b-8l``
on one H200: 5.5 ms of kernels in a ~25-30 ms forward at 1,024 tokens), and fla's ``chunk_kda`` is the largest
host item in it: ~20 Triton launches through Python per KDA layer (``ChunkKDAFunction`` 13.8 ms over 6 layers
under the profiler; ~0.9-1.2 ms of host per call at any length, 2026-12-03). A replay costs one graph launch
plus the copies in and out: ~0.1 ms of host.

How: a call of ``T`` tokens and ``B`` rows runs the graph of the smallest bucket ``Tb >= T`` in
:data:`BUCKETS` captured for its shapes and dtypes (captured at first use: two eager runs outside the capture
let fla autotune, then one capture into a memory pool shared by every graph of the device). The inputs are
copied into the graph's static buffers and the tail ``[T, Tb)`` holds zeros: a token with ``k = 0``,
``beta = 0`` and log-decay ``g = 0`` leaves the state as it found it (``S * exp(0) + k * beta * (...) = S``
in the update :mod:`unimem_compile.ops.kda` states), and causality keeps the real tokens' outputs from
seeing the tail, so outputs ``[:T]`` and the final state are those of the ``T`` tokens alone
(``tests/ops/test_kda_graphs.py`` checks it on the reference, ``tests/gpu/test_state_gpu.py`` against eager
fla). The outputs are copied out of the graph's buffers (fresh tensors, never aliases of them).

Eager fla instead (the caller's path) when: graphs are off (``UNIMEM_KDA_GRAPHS=0``), the tensors are not on
CUDA, the current stream is capturing (a decode runner's graph records fla's kernels itself), autograd
records (an input requires grad), ``B * Tb`` exceeds :data:`MAX_GRAPH_TOKENS`, a new graph would take the
static buffers past :data:`MAX_GRAPH_BYTES`, or the shape's capture raised once (logged; e.g. out of memory).
The token limit is about memory, not speed: at 4,096 tokens fla's host cost (~1.2 ms) still exceeds its
kernels (~0.6 ms), but a graph's buffers grow with rows x bucket.

Memory: outside the arena, on the device of the inputs; per graph its static inputs and output
(``B * Tb * H * (3 K + 2 V + 1)`` elements of the input dtypes: q, k, g, v, beta and o) and two fp32 states
``[B, H, K, V]``, and, shared by all graphs of a device, fla's workspace of the largest capture.
:meth:`ChunkKDAGraphs.nbytes` reports the static buffers; :meth:`ChunkKDAGraphs.clear` frees everything.

Streams: the lock orders the host side only; a graph's buffers are written and read on the caller's current
stream, so calls for one device must come from one stream at a time (every caller in the library uses its
thread's current stream, and generate() and the serving engine hold the model's generate lock).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from unimem_compile import env

__all__ = ["BUCKETS", "MAX_GRAPH_BYTES", "MAX_GRAPH_TOKENS", "ChunkKDAGraphs", "GRAPHS", "bucket_for"]

logger = logging.getLogger(__name__)

#: chunk lengths (tokens) a graph is captured for: multiples of fla's 64-token chunk, so the padding adds whole
#: chunks only; a call of T tokens runs the smallest bucket >= T
BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)
#: the most tokens (rows x bucket) one graph covers; a larger call runs fla eagerly
MAX_GRAPH_TOKENS = 4096
#: the most bytes of static buffers all graphs of the process hold (:meth:`ChunkKDAGraphs.nbytes`); a shape whose
#: graph would pass it runs fla eagerly. 1 GiB holds every one-row bucket at the Kimi-Linear geometry (~0.4 GiB)
#: and a few more for small batches; without it, generate() calls of every batch size and chunk length could
#: capture 127 (rows, bucket) graphs, ~25 GB at that geometry
MAX_GRAPH_BYTES = 1 << 30


def bucket_for(batch: int, tokens: int) -> int | None:
    """The bucket (tokens) a call of ``batch`` rows of ``tokens`` tokens replays, or None (eager: no tokens,
    longer than every bucket, or ``batch * bucket > MAX_GRAPH_TOKENS``)."""
    if batch < 1 or tokens < 1:
        return None
    for b in BUCKETS:
        if b >= tokens:
            return b if batch * b <= MAX_GRAPH_TOKENS else None
    return None


def _entry_bytes(batch: int, tb: int, xs, state: torch.Tensor) -> int:
    """Static bytes of one graph: the inputs at ``tb`` tokens, the initial and final states, the output o
    (``[B, tb, H, V]`` in q's dtype)."""
    per_token = sum(math.prod(x.shape[2:]) * x.element_size() for x in xs)
    v = xs[2]
    o = math.prod(v.shape[2:]) * xs[0].element_size()
    return batch * tb * (per_token + o) + 2 * state.numel() * state.element_size()


@dataclass
class _Entry:
    graph: object  # torch.cuda.CUDAGraph, or None when built with capture=False
    inputs: tuple  # static q, k, v, g, beta [B, Tb, ...]
    state: torch.Tensor  # static initial state [B, H, K, V] fp32
    outputs: tuple  # (o [B, Tb, H, V], final [B, H, K, V]) the graph writes
    run: Callable  # what was captured (replayed eagerly when graph is None)
    filled: int = 0  # tokens of the inputs the last call wrote (the rest is zeros)


class ChunkKDAGraphs:
    """Captured ``chunk_kda`` calls keyed by (device, rows, bucket, heads, dims, dtypes, scale, l2norm).

    Args:
        capture: False keeps the static buffers and the padding but runs the chunk function eagerly on them
            instead of capturing it (CPU tests of the buffer handling; never faster).

    Counters: ``captures`` (graphs built), ``replays`` (calls served by a graph)."""

    def __init__(self, *, capture: bool = True):
        self.capture = capture
        self._entries: dict[tuple, _Entry] = {}
        self._failed: dict[tuple, str] = {}  # keys whose capture raised -> the error (they run eagerly)
        self._pools: dict[int, object] = {}
        self._lock = threading.Lock()
        self.captures = 0
        self.replays = 0

    # ------------------------------------------------------------------ public
    def eligible(self, q: torch.Tensor, *tensors: torch.Tensor) -> int | None:
        """The bucket this call would replay, or None when it runs eagerly (see the module docstring)."""
        if self.capture:
            if not env.kda_graphs() or not q.is_cuda or torch.cuda.is_current_stream_capturing():
                return None
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, *tensors)):
            return None
        return bucket_for(q.shape[0], q.shape[1])

    def __call__(self, chunk: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, state: torch.Tensor, scale: float, use_qk_l2norm: bool):
        """``chunk(q, k, v, g, beta, scale=, initial_state=, output_final_state=True, use_qk_l2norm_in_kernel=)``
        through a graph: returns ``(o [B, T, H, V], final [B, H, K, V])`` as fresh tensors in the dtypes
        ``chunk`` returns, or None when the call is not eligible (the caller runs ``chunk`` itself).

        Shapes as fla's: q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, state fp32
        ``[B, H, K, V]`` (not modified). A capture that raises (e.g. out of device memory) is logged once and
        its key runs eagerly from then on (None); the error of a replay propagates."""
        tb = self.eligible(q, k, v, g, beta, state)
        if tb is None:
            return None
        t = q.shape[1]
        key = (q.device.type, q.device.index, q.shape[0], tb, tuple(q.shape[2:]), tuple(v.shape[2:]),
               tuple(x.dtype for x in (q, k, v, g, beta, state)), float(scale), bool(use_qk_l2norm), chunk)
        with self._lock:
            if key in self._failed:
                return None
            entry = self._entries.get(key)
            if entry is None:
                need = _entry_bytes(q.shape[0], tb, (q, k, v, g, beta), state)
                if self._nbytes() + need > MAX_GRAPH_BYTES:
                    return None
                try:
                    entry = self._build(chunk, (q, k, v, g, beta), state, tb, float(scale), bool(use_qk_l2norm))
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: this shape runs eagerly from now on
                    self._failed[key] = f"{type(e).__name__}: {e}"
                    logger.warning("kda_graphs: capturing chunk_kda for %d rows x %d tokens failed (%s); those calls "
                                   "run fla eagerly", q.shape[0], tb, self._failed[key])
                    return None
                self._entries[key] = entry
            for buf, x in zip(entry.inputs, (q, k, v, g, beta)):
                buf[:, :t].copy_(x)
                if entry.filled > t:
                    buf[:, t:entry.filled].zero_()
            entry.filled = t
            entry.state.copy_(state)
            if entry.graph is not None:
                entry.graph.replay()
            else:
                for out, new in zip(entry.outputs, entry.run()):
                    out.copy_(new)
            o, final = entry.outputs
            self.replays += 1
            return o[:, :t].clone(), final.clone()

    def nbytes(self) -> int:
        """Bytes of every graph's static inputs, state and outputs (fla's shared workspace not counted)."""
        with self._lock:
            return self._nbytes()

    def _nbytes(self) -> int:
        total = 0
        for e in self._entries.values():
            for x in (*e.inputs, e.state, *e.outputs):
                total += x.numel() * x.element_size()
        return total

    def clear(self) -> None:
        """Drop every graph and its buffers (the next eligible call captures again)."""
        with self._lock:
            self._entries.clear()
            self._failed.clear()
            self._pools.clear()

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ capture
    def _build(self, chunk, xs, state, tb: int, scale: float, l2norm: bool) -> _Entry:
        # normal tensors whatever the caller's mode: buffers made under inference_mode would refuse the copies of
        # a later call outside it
        with torch.inference_mode(False), torch.no_grad():
            return self._build_buffers(chunk, xs, state, tb, scale, l2norm)

    def _build_buffers(self, chunk, xs, state, tb: int, scale: float, l2norm: bool) -> _Entry:
        b = xs[0].shape[0]
        inputs = tuple(torch.zeros((b, tb, *x.shape[2:]), dtype=x.dtype, device=x.device) for x in xs)
        st = torch.zeros(state.shape, dtype=state.dtype, device=state.device)

        def run():
            return chunk(*inputs, scale=scale, initial_state=st, output_final_state=True,
                         use_qk_l2norm_in_kernel=l2norm)

        if not self.capture:  # static outputs as a graph has them: run() writes into them (see __call__)
            return _Entry(None, inputs, st, tuple(t.clone() for t in run()), run)
        dev = xs[0].device
        with torch.cuda.device(dev):
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # autotuning and fla's lazy set-up happen here, not in the capture
                for _ in range(2):
                    run()
            pool = self._pools.get(dev.index)
            if pool is None:
                pool = self._pools[dev.index] = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # captured on `side`, a stream of the inputs' device (torch's default capture stream is one per
            # process, on the device it was first made for)
            with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                o, final = run()
            torch.cuda.current_stream(dev).wait_stream(side)
        self.captures += 1
        return _Entry(graph, inputs, st, (o, final), run)


#: the process's graphs (every ``unimem::kda_chunk`` / ``unimem::kda_prefill`` CUDA call goes through it)
GRAPHS = ChunkKDAGraphs()
