"""The decode runner: every decode step of a generate() call is one replay of a captured step.

After the prefill (transformers' own, through the model's compiled forward), :class:`DecodeRunner` runs
the decode steps of a batch itself. One step is one function, compiled once per batch-size bucket (Dynamo
+ the model's pass manager + the inner backend, never Inductor's own CUDA graphs) and, on CUDA with
``cudagraphs`` on, captured in ONE ``torch.cuda.CUDAGraph`` per (bucket, sampling on / off):

1. each row's write location and position from its ``kv_len`` and the device page table
   (``page_table[b, kv_len // ps] * ps + kv_len % ps``; -1 for a row that writes nothing, whose state slot
   is -1 for the step too), ``kv_len += 1`` for the rows that write;
2. the model's forward for one token per row (the rewritten graph: latent write, ``mla_decode``, in-place
   KDA and conv state updates), over the bucket's own step buffers;
3. logits processing, sampling, appending the token and the per-row finished flags
   (:func:`~.sampling.decode_step`);
4. the cache's logical length ``seq_length += 1`` while any row is live.

Nothing in a step reads the device from the host. The host allocates pages for the next ``steps_ahead``
(K, default :data:`DEFAULT_STEPS_AHEAD`) steps of every row that may still write, replays K steps, enqueues
one asynchronous copy of the finished flags, token counts and lengths into pinned memory with an event,
replays the next K steps, and only then waits for the first copy: the GPU always has a block of steps
queued while the host reads. A row that finished gives back the pages it reserved and will not use; the
steps queued after every row finished write nothing (the host stops after at most K of them).

Everything a captured graph reads sits at a fixed address: the arena and the pool's tables, the
:class:`~.rows.RowState` (settings, bookkeeping, tokens), and per bucket a
:class:`~unimem_compile.hf.runtime.StepBuffers` that only the runner's graphs use, with a
:class:`~unimem_compile.hf.cache.UnifiedCache` over it (the "graph cache" the forward is traced with). A
call copies its cache's tables into the bucket's buffers before its first step (padded rows: no pages,
slot -1, kv_len 0: the kernels read zeros and write nothing), so a graph never reads another call's tables.

Before a call (and before each block the serving engine replays) the runner checks that every tensor a
captured graph reads still has the storage it had at capture (:mod:`.captured`): a replaced one raises
:class:`~unimem_compile.errors.CapturedInputMoved` naming it instead of a replay into memory the step no
longer owns. Each capture allocates its own cuBLAS workspace in the runner's graph pool
(:func:`_own_blas_workspace` says why: the process-wide one was freed under other models' graphs).

Without graph capture (a CPU model, ``cudagraphs=False``, or ``UNIMEM_DEBUG=1``, whose id checks
synchronise) the same compiled step is called once per step; the schedule is the same.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import logging
import contextlib
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence

import torch

from .. import env
from ..errors import GeometryError, PoolExhausted
from ..pool.allocator import as_int
from ..pool.staging import StagedUpload
from .buckets import bucket_for, bucket_sizes
from .captured import CapturedInputs
from .rows import Rows, RowSettings, RowState
from .sampling import decode_step

__all__ = ["DEFAULT_STEPS_AHEAD", "DecodeRunner", "DecodeTiming", "StepGraphStats"]

logger = logging.getLogger(__name__)

DEFAULT_STEPS_AHEAD = 8
"""K: decode steps the host allocates for and replays between two reads of the finished flags. Larger K
hides more host time behind the GPU and reads the device less often; a call whose rows all finish early
runs up to K steps that write nothing (at batch 32 on an H200 about 1 ms each), and a row keeps up to one
page it will not use until the host reads that it finished."""

#: warm-up calls of a step before its capture (the first one compiles; CUDA wants work on a side stream
#: before a capture so lazily initialised libraries allocate outside it)
_WARMUP_CALLS = 2


@dataclasses.dataclass
class StepGraphStats:
    """The cost of one (bucket, sampling) step of a :class:`DecodeRunner`.

    Attributes:
        bucket: rows the step runs (its batch-size bucket).
        sampling: whether it samples (False: argmax only, no sort and no random numbers).
        captured: whether it replays a ``torch.cuda.CUDAGraph`` (False: the compiled step runs each time).
        compile_s: seconds of the warm-up calls (Dynamo, the passes, the inner backend, autotuning).
        capture_s: seconds of the capture (0.0 when not captured).
        graph_bytes: bytes the capture added to the graphs' shared memory pool (``memory_reserved``
            before and after; buckets captured later reuse freed pool memory, so the sum over buckets is
            the pool's size).
        steps: steps run with it since it was built.
        error: why a capture failed (the step then runs uncaptured), else None.
    """

    bucket: int
    sampling: bool
    captured: bool = False
    compile_s: float = 0.0
    capture_s: float = 0.0
    graph_bytes: int = 0
    steps: int = 0
    error: str | None = None


class DecodeTiming:
    """The decode runner's clock: marks at the end of a generate() call's prefill and after each block of
    replayed steps (CUDA events on the current stream, so nothing synchronises; ``perf_counter`` on the
    CPU), of the last call the runner decoded while it was set. Read it after the call.

    Attributes:
        marks: ``(decode steps run so far, mark)``; the first is the end of the prefill (0 steps).
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list[tuple[int, object]] = []

    def begin(self) -> None:
        """A call's prefill ended: forget an earlier call's marks and mark now (0 steps)."""
        self.marks.clear()
        self.mark(0)

    def mark(self, steps: int) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((steps, event))
        else:
            self.marks.append((steps, time.perf_counter()))

    def _seconds(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) * 1e-3
        return b - a

    @property
    def decode_steps(self) -> int:
        """Decode steps between the end of the prefill and the last mark."""
        return self.marks[-1][0] - self.marks[0][0] if self.marks else 0

    def decode_seconds(self) -> float:
        """Seconds from the end of the prefill to the end of the last block (synchronises on CUDA).

        Raises:
            ValueError: fewer than two marks (the call ran no decode step through the runner)."""
        if len(self.marks) < 2:
            raise ValueError(f"the decode runner recorded {len(self.marks)} mark(s): no decode step ran through it")
        return self._seconds(self.marks[0][1], self.marks[-1][1])

    def seconds_since(self, start) -> float:
        """Seconds from ``start`` (a CUDA event recorded before the call, or a ``perf_counter`` reading) to
        the end of the prefill (synchronises on CUDA)."""
        return self._seconds(start, self.marks[0][1])


@dataclasses.dataclass
class _Bucket:
    """One bucket's fixed-address inputs: step buffers only the runner's graphs read, a cache over them,
    which rows keep writing after they finish, and the logical length."""

    size: int
    buffers: object  # StepBuffers
    cache: object  # UnifiedCache over `buffers`
    pads_after_finish: torch.Tensor  # bool [size]
    slots: torch.Tensor  # int64 [size]: the call's slots; a step hands the ops -1 for rows that write nothing
    input_ids: torch.Tensor  # int64 [size, 1]: the step's input tokens (a copy of the rows' last tokens)
    uploads: dict[str, StagedUpload]
    graphs: dict[bool, object] = dataclasses.field(default_factory=dict)  # sampling -> CUDAGraph or None
    stats: dict[bool, StepGraphStats] = dataclasses.field(default_factory=dict)
    #: sampling -> what its captured graph reads (for graphs only: an uncaptured step re-reads its inputs)
    inputs: dict[bool, CapturedInputs] = dataclasses.field(default_factory=dict)


class _Readback:
    """A ring of two host copies of the rows' finished flags, token counts, lengths and recent tokens, each
    filled by non-blocking copies and guarded by an event (pinned memory on CUDA)."""

    def __init__(self, rows: int, width: int, device: torch.device):
        self.cuda = device.type == "cuda"
        pin = self.cuda
        self.slots = [
            {
                "finished": torch.zeros(rows, dtype=torch.bool, pin_memory=pin),
                "count": torch.zeros(rows, dtype=torch.int32, pin_memory=pin),
                "kv_len": torch.zeros(rows, dtype=torch.int32, pin_memory=pin),
                "tokens": torch.zeros(rows, width, dtype=torch.int64, pin_memory=pin),
                "event": torch.cuda.Event() if self.cuda else None,
            }
            for _ in range(2)
        ]
        self._next = 0

    def enqueue(self, finished, count, kv_len, tokens) -> dict:
        slot = self.slots[self._next]
        self._next ^= 1
        n = finished.shape[0]
        slot["finished"][:n].copy_(finished, non_blocking=self.cuda)
        slot["count"][:n].copy_(count, non_blocking=self.cuda)
        slot["kv_len"][:n].copy_(kv_len, non_blocking=self.cuda)
        if tokens is not None:
            slot["tokens"][:n, :tokens.shape[1]].copy_(tokens, non_blocking=self.cuda)
        if self.cuda:
            slot["event"].record()
        return slot

    @staticmethod
    def wait(slot: dict) -> None:
        if slot["event"] is not None:
            slot["event"].synchronize()


class DecodeRunner:
    """Decode steps of a compiled model as replays of captured (or compiled) step functions.

    Args:
        model: the compiled model (its ``unimem`` handle is ``handle``).
        handle: the model's :class:`~unimem_compile.hf.runtime.UnimemHandle`.
        forward: the model's forward before ``compile()`` wrapped it (traced inside the step).
        backend: the ``torch.compile`` backend for the step (the pass manager's wrapper, without Inductor's
            CUDA graphs).
        capture: capture each step in a ``torch.cuda.CUDAGraph`` (``cudagraphs`` on a CUDA model).
        tag: distinguishes this model's step code object from other models' (Dynamo keeps one graph cache
            per code object).

    Host methods must run under the model's generate lock (generate() holds it; :meth:`capture` takes it).
    """

    def __init__(self, model, handle, forward, backend, *, capture: bool, tag: int):
        self.handle = handle
        self.device = handle.pool.device
        self.capture_graphs = bool(capture) and self.device.type == "cuda"
        self._model = weakref.ref(model)
        self._forward = forward
        self._backend = backend
        self._tag = tag
        self._steps_ahead = DEFAULT_STEPS_AHEAD
        self._buckets: dict[int, _Bucket] = {}
        self._state: RowState | None = None
        self._compiled = None
        self._pool = None
        self._expert_configs: list | None = None  # configs _capturable_experts swaps (found on first use)
        #: a :class:`DecodeTiming` that the next calls record into (set by ``model.unimem.timed_decode()``)
        self.timing: DecodeTiming | None = None
        #: the object whose requests occupy rows of :attr:`state` between its own calls (the serving engine),
        #: or None. Anything else that rewrites the state (a generate() call, :meth:`capture`) first calls
        #: its ``evicted()``, which saves its rows; it puts them back before its next step.
        self.tenant = None

    # ------------------------------------------------------------------------------------------ knobs
    @property
    def steps_ahead(self) -> int:
        """K (:data:`DEFAULT_STEPS_AHEAD`): steps allocated for and replayed between two reads of the
        finished flags; settable (an int >= 1; GeometryError otherwise, TypeError for a non-integer)."""
        return self._steps_ahead

    @steps_ahead.setter
    def steps_ahead(self, k: int) -> None:
        k = as_int(k, "steps_ahead")
        if k < 1:
            raise GeometryError(f"steps_ahead must be >= 1, got {k}")
        self._steps_ahead = k

    @property
    def buckets(self) -> tuple[int, ...]:
        """The batch-size buckets of this model (:func:`~.buckets.bucket_sizes` of ``max_batch_size``)."""
        return bucket_sizes(self.handle.max_batch_size)

    def stats(self) -> dict:
        """Every step built so far and the memory the runner holds:
        ``{"steps": [StepGraphStats as dict, ...], "graph_bytes": int, "state_bytes": int,
        "captures": bool, "steps_ahead": int}`` (``state_bytes``: the row state and the buckets' buffers)."""
        steps = [dataclasses.asdict(s) for b in sorted(self._buckets) for s in self._buckets[b].stats.values()]
        tensors = list(self._state.view(self._state.max_rows)) if self._state is not None else []
        for bucket in self._buckets.values():
            buf = bucket.buffers
            tensors += [buf.page_table, buf.kv_len, buf.out_offset, buf.slot_ids, buf.decode_loc,
                        bucket.pads_after_finish, bucket.slots, bucket.input_ids, bucket.cache.seq_length]
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        return {"steps": steps, "graph_bytes": sum(s["graph_bytes"] for s in steps), "state_bytes": state_bytes,
                "captures": self.capture_graphs, "steps_ahead": self._steps_ahead}

    # ------------------------------------------------------------------------------------------ build
    @property
    def state(self) -> RowState:
        """The rows' settings and bookkeeping (one :class:`~.rows.RowState` of ``max_batch_size`` rows)."""
        if self._state is None:
            model = self._model()
            vocab = model.get_output_embeddings().out_features
            with torch.inference_mode(False):  # written in place by later calls outside inference mode
                self._state = RowState(self.handle.max_batch_size, vocab, self.handle.max_seq_len, self.device)
        return self._state

    def _bucket(self, size: int) -> _Bucket:
        if size not in self._buckets:
            # imported on use: the runner's core (rows, sampling, buckets) imports without transformers
            from ..hf.cache import UnifiedCache
            from ..hf.runtime import StepBuffers

            with torch.inference_mode(False):
                buffers = StepBuffers.allocate(size, self.handle.max_pages_per_row, self.device)
                cache = UnifiedCache(self.handle, size, buffers=buffers)
                cache._orphan_watch.detach()  # holds no pages or slots: nothing to reclaim
                cache.seq_length = torch.zeros((), dtype=torch.int64, device=self.device)
                pads = torch.zeros(size, dtype=torch.bool, device=self.device)
                slots = torch.full((size,), -1, dtype=torch.int64, device=self.device)
                input_ids = torch.zeros(size, 1, dtype=torch.int64, device=self.device)
            uploads = {name: StagedUpload(t) for name, t in (
                ("page_table", buffers.page_table), ("kv_len", buffers.kv_len), ("out_offset", buffers.out_offset),
                ("slots", slots), ("pads_after_finish", pads))}
            self._buckets[size] = _Bucket(size, buffers, cache, pads, slots, input_ids, uploads)
        return self._buckets[size]

    def _step(self):
        """The compiled step function (built once; Dynamo compiles one graph per bucket and sampling flag)."""
        if self._compiled is None:
            self._compiled = torch.compile(self._step_function(), backend=self._backend, fullgraph=True,
                                           dynamic=False)
        return self._compiled

    def _step_function(self):
        forward = self._forward
        page_size = self.handle.pool.layout.page_size
        max_pages = self.handle.max_pages_per_row
        max_seq_len = self.handle.max_seq_len
        # transformers 5.24 names the forward's cache argument `cache`, 5.17 `past_key_values`
        cache_kwarg = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"

        # keyword arguments, as the compiled forward gets them: the graph's inputs then have the forward graph's
        # names (``kwargs_cache_...``, ``kwargs_input_ids``), which the pass manager and graph dumps read
        def step(**kwargs):
            cache, rows, sampling = kwargs["cache"], kwargs["rows"], kwargs["sampling"]
            # the token appended last is this step's input; a placeholder named input_ids of length 1 is how
            # the pass manager tells a decode graph (passes.manager.is_decode_graph)
            input_ids = kwargs["input_ids"]
            input_ids.copy_(rows.last_token[:, None])
            buffers = cache.buffers
            kv_len = buffers.kv_len
            live = ~rows.finished
            any_live = live.any()
            # a finished row writes nothing, except in a cache the caller passed, where it keeps taking its
            # pad token while any row of the batch runs (what stock generate() stores)
            writes = live | (kwargs["pads_after_finish"] & any_live)
            # a row that writes nothing must not update its state either: slot -1 reads zeros, writes nothing
            buffers.slot_ids.copy_(torch.where(writes, kwargs["slots"], -1))
            column = torch.div(kv_len, page_size, rounding_mode="floor").clamp(max=max_pages - 1).to(torch.int64)
            page = buffers.page_table.gather(1, column[:, None])[:, 0].to(torch.int64)
            offset = (kv_len % page_size).to(torch.int64)
            location = torch.where(writes & (page >= 0), page * page_size + offset, -1)
            cache.write_loc.copy_(location[:, None])  # the bucket's decode_loc
            position = kv_len.to(torch.int64)[:, None]  # tokens stored before this one (pads excluded)
            buffers.kv_len.copy_(kv_len + writes.to(torch.int32))
            # "left pads, then ones" over max_seq_len positions: the causal mask hides positions past the step
            mask = torch.arange(max_seq_len, device=kv_len.device)[None, :] >= buffers.out_offset[:, None]
            out = forward(input_ids=input_ids, attention_mask=mask, position_ids=position,
                          use_cache=True, logits_to_keep=1, return_dict=True, **{cache_kwarg: cache})
            decode_step(out.logits[:, -1], rows, sampling=sampling)
            cache.seq_length.add_(any_live.to(torch.int64))

        step.__code__ = step.__code__.replace(co_name=f"unimem_decode_step_{self._tag}")
        step.__name__ = step.__qualname__ = step.__code__.co_name
        return step

    def _call_step(self, bucket: _Bucket, sampling: bool) -> None:
        from ..hf.runtime import RECOMPILE_LIMIT

        limit = max(RECOMPILE_LIMIT, 2 * len(self.buckets) + 4)  # one graph per (bucket, sampling)
        with self.handle.adapter.patched(), torch._dynamo.config.patch(recompile_limit=limit), torch.no_grad(), \
                self._capturable_experts():
            self._step()(cache=bucket.cache, pads_after_finish=bucket.pads_after_finish, slots=bucket.slots,
                         input_ids=bucket.input_ids, rows=self.state.view(bucket.size), sampling=sampling)

    @contextlib.contextmanager
    def _capturable_experts(self):
        """Mixture-of-experts layers whose experts transformers would run through its ``grouped_mm`` fallback
        run ``batched_mm`` inside a captured step.

        transformers' ``grouped_mm`` experts call ``torch._grouped_mm`` under torch.compile only for bf16
        weights; any other dtype goes to ``transformers::grouped_mm_fallback``, which loops over
        ``offs.tolist()`` (a device-to-host copy: CUDA graph capture refuses it, and it would synchronise
        every step). ``batched_mm`` computes the same per-token expert projections with ``bmm`` and never
        reads the device, so steps of fp32 / fp16 MoE models can be captured. The setting is swapped only
        while the runner's step runs (Dynamo guards on it, so the step's graphs always see ``batched_mm``);
        transformers' own loop keeps the model's setting. bf16 models and uncaptured steps are unchanged.
        """
        configs = self._fallback_expert_configs() if self.capture_graphs else []
        saved = [c._experts_implementation_internal for c in configs]
        for c in configs:
            c._experts_implementation_internal = "batched_mm"
        try:
            yield
        finally:
            for c, value in zip(configs, saved):
                c._experts_implementation_internal = value

    def _fallback_expert_configs(self) -> list:
        if self._expert_configs is None:
            found = {}
            model = self._model()
            for module in model.modules() if model is not None else ():
                config = getattr(module, "config", None)
                # transformers' experts decorator (integrations/moe.py) gives the module these attributes
                if (config is None or not hasattr(module, "is_concatenated")
                        or getattr(config, "_experts_implementation_internal", None) != "grouped_mm"):
                    continue
                weights = [p for p in module.parameters(recurse=False)]
                if weights and all(p.dtype != torch.bfloat16 for p in weights):
                    found[id(config)] = config
            self._expert_configs = list(found.values())
        return self._expert_configs

    def _make_inert(self, bucket: _Bucket) -> None:
        """Every row of the state cleared and the bucket's tables empty: a step then writes nothing (the
        warm-up and capture calls run on real buffers)."""
        self.state.clear_rows(0, self.state.max_rows)
        buf = bucket.buffers
        buf.page_table.fill_(-1)
        buf.kv_len.zero_()
        buf.out_offset.zero_()
        buf.slot_ids.fill_(-1)
        buf.decode_loc.fill_(-1)
        bucket.slots.fill_(-1)
        bucket.pads_after_finish.zero_()
        bucket.cache.seq_length.zero_()

    def _ensure(self, size: int, sampling: bool) -> _Bucket:
        """The bucket of ``size`` rows with its step for ``sampling`` compiled (and captured), built now if
        needed; the row state is left cleared when it builds."""
        bucket = self._bucket(size)
        if sampling in bucket.stats:
            return bucket
        stats = StepGraphStats(bucket=size, sampling=sampling)
        self._make_inert(bucket)
        start = time.perf_counter()
        if self.capture_graphs:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(_WARMUP_CALLS):
                    self._call_step(bucket, sampling)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
        else:
            self._call_step(bucket, sampling)  # compiles; on inert rows it writes nothing
        stats.compile_s = time.perf_counter() - start
        graph = None
        if self.capture_graphs and not env.debug():
            graph, stats.error = self._capture(bucket, sampling, stats)
        elif self.capture_graphs:
            stats.error = f"{env.DEBUG}=1: the launchers' id checks synchronise, so steps run uncaptured"
        stats.captured = graph is not None
        if graph is not None:
            bucket.inputs[sampling] = self.captured_inputs(bucket, sampling)
        bucket.graphs[sampling] = graph
        bucket.stats[sampling] = stats
        return bucket

    def captured_inputs(self, bucket: _Bucket, sampling: bool) -> CapturedInputs:
        """Every tensor the step of ``bucket`` reads that the runner knows of, as it is now (recorded right
        after a capture; :meth:`check_captured` compares with it before replays): the bucket's step buffers
        as its graph cache sees them and as its uploads write them, its pads / slots / input ids, the graph
        cache's ``seq_length`` and write locations, the row state's tensors, the pool's arena and tables, and
        every parameter and buffer of the model (read through their modules, so a replaced one is seen)."""
        b = f"bucket {bucket.size}"
        entries: list = []
        for field in ("page_table", "kv_len", "out_offset", "slot_ids", "decode_loc"):
            entries.append((f"{b} cache.buffers.{field}", lambda f=field: getattr(bucket.cache.buffers, f)))
            entries.append((f"{b} buffers.{field}", lambda f=field: getattr(bucket.buffers, f)))
        for name, upload in bucket.uploads.items():
            entries.append((f"{b} upload {name!r} destination", lambda u=upload: u.dst))
        for field in ("pads_after_finish", "slots", "input_ids"):
            entries.append((f"{b} {field}", lambda f=field: getattr(bucket, f)))
        entries.append((f"{b} cache.seq_length", lambda: bucket.cache.seq_length))
        entries.append((f"{b} cache.write_loc", lambda: bucket.cache.write_loc))
        state = self.state
        for field in Rows._fields:
            entries.append((f"row state {field}", lambda f=field: getattr(state, f)))
        pool = self.handle.pool
        for field in ("arena", "v2p", "p2v", "s_v2p", "s_p2v"):
            entries.append((f"pool.{field}", lambda f=field: getattr(pool, f)))
        model = self._model()
        for prefix, module in model.named_modules() if model is not None else ():
            for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
                for key, value in table.items():
                    if value is not None:
                        name = f"{kind} {prefix + '.' if prefix else ''}{key}"
                        entries.append((name, (table, key)))
        return CapturedInputs(f"the captured decode step of bucket {bucket.size} (sampling={sampling})", entries)

    @staticmethod
    def check_captured(bucket: _Bucket, sampling: bool) -> None:
        """Before replaying the graph of ``bucket`` for ``sampling``: every tensor it reads still has its
        capture-time storage (:meth:`~.captured.CapturedInputs.check`; a no-op for a step without a graph).

        Raises:
            CapturedInputMoved: one of them was replaced, resized or released; nothing was replayed."""
        inputs = bucket.inputs.get(sampling)
        if inputs is not None:
            inputs.check()

    def _capture(self, bucket: _Bucket, sampling: bool, stats: StepGraphStats):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # torch.cuda.graph empties the allocator's cache when it starts: empty it first, so that the reserved
        # bytes before and after differ by the pool's growth only (the eager cuBLAS workspaces this drops are
        # freed by that empty_cache too)
        torch.cuda.synchronize(self.device)
        _clear_blas_workspaces()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        try:
            with _own_blas_workspace(), torch.cuda.graph(graph, pool=self._pool):
                self._call_step(bucket, sampling)
        except Exception as e:  # noqa: BLE001 - the step still runs, uncaptured; the stats say why
            logger.warning("decode runner: capturing the step of bucket %d (sampling=%s) failed, it runs "
                           "uncaptured: %s: %s", bucket.size, sampling, type(e).__name__, e)
            return None, f"{type(e).__name__}: {str(e)[:500]}"
        torch.cuda.synchronize(self.device)
        stats.capture_s = time.perf_counter() - start
        stats.graph_bytes = torch.cuda.memory_reserved(self.device) - reserved
        return graph, None

    def capture(self, buckets: Iterable[int] | None = None, sampling: Sequence[bool] = (False,)) -> dict:
        """Build (compile, and on CUDA with ``cudagraphs`` capture) the steps of ``buckets`` (default: all
        of :attr:`buckets`) for each ``sampling`` flag now, instead of on their first use; returns
        :meth:`stats`.

        Raises:
            GeometryError: a size that is not one of :attr:`buckets`.
        """
        sizes = self.buckets if buckets is None else tuple(as_int(b, "a bucket") for b in buckets)
        for size in sizes:
            if size not in self.buckets:
                raise GeometryError(f"{size} rows is not a bucket of this model; its buckets are {list(self.buckets)}")
        with self.handle.generate_lock:
            self.evict_tenant()
            for size in sorted(sizes, reverse=True):  # largest first: smaller graphs reuse its pool memory
                for flag in sampling:
                    self._ensure(size, bool(flag))
        return self.stats()

    def new_timing(self) -> DecodeTiming:
        """A fresh :class:`DecodeTiming` on this model's device."""
        return DecodeTiming(self.device)

    @staticmethod
    def fallback(reason: str) -> None:
        """Say once (INFO) that a generate() call runs transformers' own loop, and why."""
        from .generate import fallback

        fallback(reason)

    def decoding_method(self, *, passed: bool, streamer=None, synced_gpus=None):
        """The ``custom_generate`` callable of one generate() call (:class:`~.generate.RunnerDecoding`)."""
        from .generate import RunnerDecoding

        return RunnerDecoding(self, passed=passed, streamer=streamer, synced_gpus=synced_gpus)

    # ------------------------------------------------------------------------------------------ run
    def run(self, cache, input_ids: torch.Tensor, settings: Sequence[RowSettings], prefill_logits: torch.Tensor, *,
            penalty_ignore=None, pads_after_finish: bool = False, streamer=None,
            timing: DecodeTiming | None = None) -> torch.Tensor:
        """Generate every row's tokens after the prefill.

        Args:
            cache: the call's :class:`~unimem_compile.hf.cache.UnifiedCache` (its prefill done: every row
                holds its prompt).
            input_ids: int64 ``[R, L]``, the rows as generate() sees them (left pads and cached tokens
                included): the repetition penalty's history.
            settings: one :class:`~.rows.RowSettings` per row (``R``; their seeds drawn already).
            prefill_logits: ``[R, V]``, the prefill's logits at each row's last position (token 0 comes
                from them).
            penalty_ignore: leading tokens of each row the repetition penalty skips (None, an int, or an
                int64 ``[R]`` tensor; see :class:`~.settings.PreparedSettings`).
            pads_after_finish: a finished row keeps storing its pad token while any row runs (stock
                generate()'s cache contents; for a cache the caller passed), instead of stopping.
            streamer: an object with ``put(tokens)``: gets each step's int64 ``[R]`` tokens (pad for
                finished rows), K steps at a time.
            timing: a :class:`DecodeTiming` whose first mark (end of the prefill) is recorded already.

        Returns:
            int64 ``[R, N]`` on the device: each row's generated tokens, pad after it finished; ``N`` is the
            longest row's count.

        Pages follow the rows: reserved K steps ahead while a row may write, cut to what it holds once it
        finished (a cache of the call's own), and at the end ``ceil(length / page_size)`` per row.

        Raises:
            GeometryError: ``settings``, ``input_ids``, ``prefill_logits`` and the cache disagree on the rows.
            PoolExhausted: the pool cannot hold one more step of the rows that write (after collecting
                dropped caches).
            CapturedInputMoved: a tensor the bucket's captured graph reads was replaced since its capture
                (checked before the call writes the row state or the bucket's tables).
        """
        self.evict_tenant()
        rows = len(settings)
        if input_ids.shape[0] != rows or prefill_logits.shape[0] != rows or cache.num_rows != rows:
            raise GeometryError(f"{rows} row settings for input_ids {list(input_ids.shape)}, logits "
                                f"{list(prefill_logits.shape)} and a cache of {cache.num_rows} rows")
        sampling = any(s.do_sample for s in settings)
        budget = max(s.max_new_tokens for s in settings) - 1  # decode steps the longest row can take
        state = self.state
        if budget == 0:  # one token, from the prefill: no step to build or run
            state.clear_rows(0, state.max_rows)
            state.set_rows(0, settings, input_ids, _penalty_mask(input_ids, penalty_ignore))
            view = state.view(rows)
            decode_step(prefill_logits, view, sampling=sampling)
            if streamer is not None:
                streamer.put(view.out[:, 0].cpu())
            return view.out[:, :1]
        bucket = self._ensure(bucket_for(rows, self.handle.max_batch_size), sampling)
        self.check_captured(bucket, sampling)  # before this call writes anything
        state.clear_rows(0, state.max_rows)
        state.set_rows(0, settings, input_ids, _penalty_mask(input_ids, penalty_ignore))
        self._upload_call(bucket, cache, rows, pads_after_finish)
        view = state.view(rows)
        decode_step(prefill_logits, view, sampling=sampling)  # token 0

        call = _Call(self, bucket, cache, rows, pads_after_finish, streamer)
        graph, stats = bucket.graphs[sampling], bucket.stats[sampling]
        pending = deque()
        while call.done < budget and not call.all_done:
            n = call.reserve(min(self._steps_ahead, budget - call.done))
            for _ in range(n):
                if graph is not None:
                    graph.replay()
                else:
                    self._call_step(bucket, sampling)
            stats.steps += n
            pending.append(call.enqueue_readback())
            if timing is not None:
                timing.mark(call.done)
            # wait for the previous block's copy while this block runs (the CPU ran it already)
            if len(pending) > 1 or self.device.type != "cuda":
                call.process(pending.popleft())
        while pending:  # copies still in flight: their tokens for the streamer
            call.process(pending.popleft())
        return call.finish()

    # ------------------------------------------------------------------ rows that join and leave (the engine)
    def evict_tenant(self) -> None:
        """Tell the :attr:`tenant` (if any) that the row state is about to be rewritten, and forget it."""
        tenant, self.tenant = self.tenant, None
        if tenant is not None:
            tenant.evicted()

    def step_bucket(self, rows: int, sampling: bool, *, keep_rows: int = 0) -> _Bucket:
        """The bucket serving ``rows`` rows with its step for ``sampling`` built (compiled, and captured on
        CUDA with ``cudagraphs``). Building a step runs it on inert rows, which clears the row state: rows
        ``[0, keep_rows)`` (requests in flight) are saved before and put back after, device values and host
        settings alike. For a caller that runs its own blocks of steps (the serving engine); hold the
        generate lock.

        Raises:
            GeometryError: ``rows`` outside ``[1, max_batch_size]``."""
        if not 1 <= rows <= self.handle.max_batch_size:
            raise GeometryError(f"{rows} rows is outside [1, max_batch_size={self.handle.max_batch_size}]")
        size = bucket_for(rows, self.handle.max_batch_size)
        bucket = self._bucket(size)
        if sampling in bucket.stats:
            return bucket
        state = self.state
        saved = {name: getattr(state, name)[:keep_rows].clone() for name in Rows._fields} if keep_rows else None
        settings = list(state._settings[:keep_rows])
        bucket = self._ensure(size, sampling)
        if saved is not None:
            for name, values in saved.items():
                getattr(state, name)[:keep_rows].copy_(values)
            state._settings[:keep_rows] = settings
        return bucket

    def load_rows(self, bucket: _Bucket, page_table: torch.Tensor, kv_len: torch.Tensor, slots: torch.Tensor,
                  left_pads: torch.Tensor, logical_len: int) -> None:
        """Put ``r`` rows' tables into ``bucket``'s buffers (rows past ``r``: no page, slot -1, nothing stored),
        stream-ordered: int32 ``page_table [r, max_pages_per_row]`` (virtual pages, -1 = none), int32
        ``kv_len [r]`` (tokens stored), int64 ``slots [r]`` (virtual slot, -1 = none), int32 ``left_pads [r]``
        (where each row's first token sits in the gathered sequence) and ``logical_len``, the position of
        the next step's query (every live row's ``left_pads + kv_len``). Host tensors."""
        rows, size = int(kv_len.shape[0]), bucket.size
        if rows > size or page_table.shape != (rows, self.handle.max_pages_per_row):
            raise GeometryError(f"{rows} rows with a page table of {list(page_table.shape)} for a bucket of {size} "
                                f"rows and {self.handle.max_pages_per_row} pages per row")

        def padded(values, fill, dtype):
            out = torch.full((size, *values.shape[1:]), fill, dtype=dtype)
            out[:rows] = values
            return out

        up = bucket.uploads
        up["page_table"](padded(page_table, -1, torch.int32))
        up["kv_len"](padded(kv_len, 0, torch.int32))
        up["slots"](padded(slots, -1, torch.int64))
        up["out_offset"](padded(left_pads, 0, torch.int32))
        up["pads_after_finish"](torch.zeros(size, dtype=torch.bool))
        bucket.buffers.decode_loc.fill_(-1)
        bucket.cache.seq_length.fill_(int(logical_len))

    def replay(self, bucket: _Bucket, sampling: bool, steps: int) -> None:
        """Run ``steps`` decode steps of ``bucket`` (graph replays, or the compiled step uncaptured); the
        caller reserved the pages they write (hold the generate lock).

        Raises:
            CapturedInputMoved: a tensor the captured graph reads was replaced since its capture (checked once
                per call, before the first replay)."""
        graph, stats = bucket.graphs[sampling], bucket.stats[sampling]
        self.check_captured(bucket, sampling)
        for _ in range(steps):
            if graph is not None:
                graph.replay()
            else:
                self._call_step(bucket, sampling)
        stats.steps += steps

    def _upload_call(self, bucket: _Bucket, cache, rows: int, pads_after_finish: bool) -> None:
        """The call's cache into the bucket's buffers: rows ``[0, rows)`` its tables, slots and left pads,
        the rest padding (no page, slot -1)."""
        size = bucket.size
        lengths = torch.zeros(size, dtype=torch.int32)
        slots = torch.full((size,), -1, dtype=torch.int64)
        pads = torch.zeros(size, dtype=torch.int32)
        keep = torch.zeros(size, dtype=torch.bool)
        if cache.page_tables is not None:
            lengths[:rows] = torch.tensor(cache.page_tables.lengths[:rows], dtype=torch.int32)
        if cache.slots:
            slots[:rows] = torch.tensor(cache.slots, dtype=torch.int64)
        pads[:rows] = cache.left_pads
        keep[:rows] = pads_after_finish
        up = bucket.uploads
        up["kv_len"](lengths)
        up["slots"](slots)
        up["out_offset"](pads)
        up["pads_after_finish"](keep)
        self._upload_table(bucket, cache.page_tables, rows)
        bucket.buffers.decode_loc.fill_(-1)
        bucket.cache.seq_length.fill_(cache.logical_len)

    def _upload_table(self, bucket: _Bucket, pt, rows: int) -> None:
        table = torch.full((bucket.size, self.handle.max_pages_per_row), -1, dtype=torch.int32)
        if pt is not None:
            table[:rows] = pt.host_table[:rows]
        bucket.uploads["page_table"](table)


def _clear_blas_workspaces() -> None:
    """Drop PyTorch's cached cuBLAS / cuBLASLt workspaces of every (handle, stream) of this thread (the next
    GEMM on a stream allocates a fresh one from the caching allocator)."""
    torch._C._cuda_clearCublasWorkspaces()


@contextlib.contextmanager
def _own_blas_workspace():
    """Around a CUDA graph capture: the cuBLAS workspace the captured GEMMs use is allocated inside this
    capture, so it lives in the capture's private memory pool, and no workspace cached for later work points
    into that pool.

    Why: PyTorch keeps one cuBLAS (and one cuBLASLt) workspace per (handle, stream), allocated by the first
    GEMM on that stream and reused by every later one (``aten/src/ATen/cuda/CublasHandlePool.cpp``).
    ``torch.cuda.graph`` without ``stream=`` captures on ONE stream per process
    (``torch.cuda.graph.default_capture_stream``), so every decode runner of every model captures on the
    same stream: the first capture of the process allocates the workspace inside its own graph pool and
    every later capture, of any model, bakes that raw address into its GEMM kernels. The cache entry is
    dropped when any graph captured on the stream is destroyed (``CUDAGraph::reset`` calls
    ``clearCublasWorkspacesForStream``, pytorch/pytorch#175276, in torch 2.11) and whenever Inductor's CUDA
    graph trees warm up or record (``torch._inductor.cudagraph_trees.clear_cublas_manager``). The block then
    goes back to the pool of the FIRST capture; once that model is gone, its pool is freeable and the next
    ``torch.cuda.empty_cache()`` (every capture and every cudagraph-tree recording calls one) unmaps it, and
    the next replay of another model's captured step faults inside a cuBLAS kernel: "an illegal memory
    access was encountered" (pytorch/pytorch#193402 describes the same sharing). Clearing the cache before
    the capture makes its first GEMM allocate a workspace in this capture's pool, which stays mapped while
    any graph of that pool exists; clearing it after keeps later captures and eager work on that stream from
    inheriting a pointer into this pool. Inductor's CUDA graph trees do the same around their recordings.

    Cost: one more workspace allocation per capture (a few MiB of the graph pool) and one for the next eager
    GEMM of each stream; nothing per replay.
    """
    _clear_blas_workspaces()
    try:
        yield
    finally:
        _clear_blas_workspaces()


def _penalty_mask(input_ids: torch.Tensor, ignore) -> torch.Tensor | None:
    """``[R, L]`` bool: the tokens the repetition penalty sees (positions at or after each row's ``ignore``),
    or None (all of them)."""
    if ignore is None:
        return None
    rows, width = input_ids.shape
    if isinstance(ignore, torch.Tensor):
        ignore = ignore.to(input_ids.device)[:, None]
    return (torch.arange(width, device=input_ids.device)[None, :] >= ignore).expand(rows, width)


class _Call:
    """The host's bookkeeping of one call's decode steps: what it knows of each row (its length when last
    read, whether it finished), the steps queued, the pages reserved ahead, the tokens streamed."""

    def __init__(self, runner: DecodeRunner, bucket: _Bucket, cache, rows: int, pads_after_finish: bool, streamer):
        self.runner, self.bucket, self.cache, self.rows = runner, bucket, cache, rows
        self.pads_after_finish = pads_after_finish
        self.streamer = streamer
        self.pt = cache.page_tables
        self.view = runner.state.view(rows)
        self.known_len = list(self.pt.lengths[:rows]) if self.pt is not None else [0] * rows
        self.known_at = 0  # decode steps queued when known_len was read
        self.finished = [False] * rows  # known finished
        self.all_done = False
        self.done = 0  # decode steps queued
        self.streamed = 0  # tokens per row handed to the streamer (or queued for it)
        self.table_stale = False  # a finished row gave pages back since the device table was uploaded
        self.readback = _Readback(rows, runner.steps_ahead + 1, runner.device)

    def reserve(self, n: int) -> int:
        """Pages for ``n`` more steps of every row that may write; fewer steps (halving, down to one) when
        the pool is too full for ``n``. Uploads the device page table when it changed. Returns the steps
        that fit and counts them as queued.

        Raises:
            PoolExhausted: not even one more step fits, after collecting dropped caches."""
        if self.pt is not None:
            writers = [b for b in range(self.rows) if self.pads_after_finish or not self.finished[b]]
            ahead = self.done - self.known_at  # steps queued since the lengths were read: each may write a token
            while True:
                try:
                    fresh = self.pt.reserve(writers, [self.known_len[b] + ahead + n for b in writers])
                    break
                except PoolExhausted:
                    gc.collect()  # a cache dropped inside a reference cycle holds its rows until the collector runs
                    if self.runner.handle.reclaim_orphans():
                        continue
                    if n == 1:
                        raise
                    n = max(1, n // 2)
            if fresh or self.table_stale:
                self.runner._upload_table(self.bucket, self.pt, self.rows)
                self.table_stale = False
        self.done += n
        return n

    def enqueue_readback(self) -> tuple:
        """Queue the copy of the rows' flags, counts, lengths (and the tokens not streamed yet) after the
        steps queued so far; returns ``(steps, first token column, slot)`` for :meth:`process`."""
        v = self.view
        tokens = v.out[:, self.streamed:self.done + 1] if self.streamer is not None else None
        slot = self.readback.enqueue(v.finished, v.count, self.bucket.buffers.kv_len[:self.rows], tokens)
        first = self.streamed
        if self.streamer is not None:
            self.streamed = self.done + 1
        return self.done, first, slot

    def process(self, pending: tuple) -> None:
        """Take in one readback (the state after ``at`` steps): the rows' lengths, the rows that finished
        (a cache of the call's own gives their unused pages back), the tokens for the streamer."""
        at, first, slot = pending
        _Readback.wait(slot)
        rows = self.rows
        finished = slot["finished"][:rows].tolist()
        lengths = slot["kv_len"][:rows].tolist()
        self.known_len[:] = lengths
        self.known_at = at
        for b in range(rows):
            if finished[b] and not self.finished[b]:
                self.finished[b] = True
                if self.pt is not None and not self.pads_after_finish and self.pt.set_length(b, lengths[b]):
                    self.table_stale = True
        self.all_done = all(finished)
        if self.streamer is not None:
            last = at + 1 if not self.all_done else min(at + 1, int(slot["count"][:rows].max()))
            for j in range(first, last):
                self.streamer.put(slot["tokens"][:rows, j - first].clone())

    def finish(self) -> torch.Tensor:
        """After the last step: every row's exact length and pages, the cache's logical length; returns the
        rows' tokens ``[R, N]``."""
        if self.runner.device.type == "cuda":
            torch.cuda.current_stream(self.runner.device).synchronize()
        rows = self.rows
        count = self.view.count.cpu()
        lengths = self.bucket.buffers.kv_len[:rows].cpu().tolist()
        if self.pt is not None:
            for b in range(rows):
                self.pt.set_length(b, lengths[b])
        self.cache.adopt_device_steps(int(self.bucket.cache.seq_length))
        return self.view.out[:, :max(1, int(count.max()))]
