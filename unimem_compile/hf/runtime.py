"""The runtime of a compiled model: its :class:`UnimemHandle` and the wrappers ``compile()`` installs.

``unimem_compile.compile`` builds the pool and the compiled forward, then calls :func:`install`, which
patches the model INSTANCE (the class is untouched):

* ``model.forward`` runs the compiled forward (refusing a forward with a :class:`UnifiedCache` whose step was
  not prepared, and autograd on linear-attention models), with the family's kernel functions swapped for
  unimem-backed ones;
* ``model.prepare_inputs_for_generation`` first prepares the step eagerly (allocation, locations): it runs
  before every forward and before transformers builds the attention mask;
* ``model.create_masks_for_generate`` (which transformers' ``prepare_inputs_for_generation`` calls) hands a
  prefill step a stand-in for the full-attention mask no rewritten graph reads (:mod:`.masks`); should a
  graph compiled for the step read it, the forward wrapper builds transformers' mask and runs the step again;
* ``model.generate`` checks the call (:func:`~.generate_checks.check_generate_call`), runs transformers'
  generate on the call's cache with ``disable_compile=True`` (transformers must not compile ``__call__``
  behind our back) and the decode runner as its ``custom_generate`` (``handle.runner``, which
  ``compile()`` attaches and this module calls without importing: the runner layer sits above this one;
  it decodes the call or hands it back to transformers' ``_sample``), lets transformers read the stop flag
  one step late on a cache it creates when its own loop runs (CUDA, 8+ rows; ``deferred_stop_check``),
  and frees that cache's pages and slots when generation returns;
* ``model.unimem`` is the :class:`UnimemHandle`: the pool, the step buffers every cache of a batch size
  shares, the queue of caches collected without ``release()``, and the lock that serialises generate()
  calls and everything that returns rows.

Caches (:mod:`.cache`) call back into the handle (:meth:`UnimemHandle.step_buffers`,
:meth:`~UnimemHandle.queue_orphan`, :meth:`~UnimemHandle.reclaim_orphans`, :meth:`~UnimemHandle.return_rows`)
and never import this module: the dependency runs one way, runtime -> cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import threading
import weakref

import torch

from .. import env
from ..errors import PoolExhausted, UnsupportedModel
from ..ops import step_context
from ..passes.manager import StandInRead
from ..pool import PageTables, UnifiedPool
from ..pool.staging import StagedUpload
from . import masks
from .adapters import ModelAdapter
from .cache import UnifiedCache
from .generate_checks import UNSUPPORTED_OUTPUTS, GenerateCall, check_generate_call, check_outputs
from .step_inputs import prepare_step_inputs

__all__ = ["UnimemHandle", "StepBuffers", "DEFERRED_STOP_MIN_ROWS", "RECOMPILE_LIMIT", "install"]

#: Rows from which ``deferred_stop_check=None`` defers the stop check (measured on an H200 with the
#: Kimi-Linear-48B 4-layer model, prompt 512: batch 1 -5-8%, batch 8 +3%, batch 32 +10-28% decode tokens/s).
DEFERRED_STOP_MIN_ROWS = 8

logger = logging.getLogger(__name__)

# what Dynamo raises past its recompile limit with fullgraph=True (nothing to catch on a torch without it)
_RECOMPILE_LIMIT_HIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())

#: Graphs one compiled model may accumulate (prefill lengths and batch sizes before Dynamo marks them
#: dynamic, with and without a padding mask); torch's default of 8 is counted per code object.
RECOMPILE_LIMIT = 32


@dataclasses.dataclass
class StepBuffers:
    """Step metadata of one batch size, at addresses that stay fixed across steps and caches.

    Attributes:
        page_table: int32 ``[B, P]`` virtual pages per row (-1 = none).
        kv_len: int32 ``[B]`` tokens stored per row, this step's included.
        out_offset: int32 ``[B]`` left pads per row (where ``mla_gather`` puts a row's first token).
        slot_ids: int64 ``[B]`` virtual state slot per row.
        decode_loc: int64 ``[B, 1]`` virtual location of each row's token in a one-token step.
        resident: weak reference to the cache whose tables the buffers hold now (None: nobody's). Several
            live caches of one batch size share the buffers: a cache that is not resident uploads its
            whole tables before its step (:meth:`UnifiedCache.prepare_step`).
        upload_decode_loc, upload_slot_ids, upload_out_offset: refresh ``decode_loc``, ``slot_ids``,
            ``out_offset`` from the host without a stream synchronisation (:class:`StagedUpload`).
    """

    page_table: torch.Tensor
    kv_len: torch.Tensor
    out_offset: torch.Tensor
    slot_ids: torch.Tensor
    decode_loc: torch.Tensor
    resident: weakref.ref | None = None
    upload_decode_loc: StagedUpload = dataclasses.field(init=False)
    upload_slot_ids: StagedUpload = dataclasses.field(init=False)
    upload_out_offset: StagedUpload = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.upload_decode_loc = StagedUpload(self.decode_loc)
        self.upload_slot_ids = StagedUpload(self.slot_ids)
        self.upload_out_offset = StagedUpload(self.out_offset)

    @classmethod
    def allocate(cls, batch_size: int, max_pages_per_row: int, device: torch.device) -> StepBuffers:
        buffers = cls(
            page_table=torch.full((batch_size, max_pages_per_row), -1, dtype=torch.int32, device=device),
            kv_len=torch.zeros(batch_size, dtype=torch.int32, device=device),
            out_offset=torch.zeros(batch_size, dtype=torch.int32, device=device),
            slot_ids=torch.full((batch_size,), -1, dtype=torch.int64, device=device),
            decode_loc=torch.full((batch_size, 1), -1, dtype=torch.int64, device=device),
        )
        for t in (buffers.page_table, buffers.kv_len, buffers.out_offset, buffers.slot_ids, buffers.decode_loc):
            torch._dynamo.mark_static_address(t)
        return buffers


class UnimemHandle:
    """What ``unimem_compile.compile`` attaches to a model as ``model.unimem``.

    Attributes:
        pool: the :class:`~unimem_compile.pool.UnifiedPool` every generate() of this model draws from.
        adapter: how the model's layers map onto the pool.
        max_batch_size, max_seq_len: the limits given to ``compile``.
        passes: the :class:`~unimem_compile.passes.PassManager` applied to this model's graphs.
        model_dtype: the parameters' dtype at compile time (generate() refuses a model cast since).
        deferred_stop_check: when generate() lets transformers read its stop flag one step late on the
            caches it creates (None: automatic; see ``compile``).
        generate_lock: held by every generate() call and by whatever returns a cache's rows (release,
            reset, creating a cache, reclaiming dropped ones): calls from several threads run one after the
            other (they share the step buffers of a batch size and the adapter's patched module globals).
        tensor_parallel: this rank's :class:`~unimem_compile.tp.group.TensorParallel` (``compile(...,
            tensor_parallel=True)``), or None: every generate() call is then agreed with the other ranks
            first, and under ``UNIMEM_DEBUG=1`` every step's page tables.
    """

    tensor_parallel = None

    def __init__(self, model, adapter: ModelAdapter, pool: UnifiedPool, max_batch_size: int, max_seq_len: int,
                 passes, deferred_stop_check: bool | None = None):
        self.adapter = adapter
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.passes = passes
        self.max_pages_per_row = math.ceil(max_seq_len / pool.layout.page_size)
        self.model_dtype = next(model.parameters()).dtype
        self._deferred_stop_check: bool | None = None
        self._buffers: dict[int, StepBuffers] = {}
        self._orphans: list = []  # (page tables, slots, step buffers) of caches collected unreleased
        self._model_name = type(model).__name__
        self.generate_lock = threading.RLock()
        self.deferred_stop_check = deferred_stop_check
        #: the decode runner (``unimem_compile.runner.DecodeRunner``) that ``compile()`` attaches; None: every
        #: generate() runs transformers' own decode loop
        self.runner = None
        #: False: every generate() runs transformers' own decode loop even where the runner could decode it
        #: (an A/B switch; generate() says so once at INFO level)
        self.use_runner = True
        #: rows of ``max_seq_len`` tokens, each with its state, that the arena holds at once (at most
        #: ``max_batch_size``; ``compile()`` sets it and warns when it is fewer)
        self.full_rows = max_batch_size
        #: prefill steps that ran the static forward of ``UNIMEM_PREFILL_GRAPHS`` (a count of steps routed there;
        #: whether Inductor CUDA-graphed their graph, ``TORCH_LOGS=cudagraphs`` says; 0 when the variable is
        #: unset, without ``cudagraphs``, with another backend than Inductor or under ``UNIMEM_DEBUG=1``)
        self.prefill_graph_steps = 0
        #: True once that forward reached Dynamo's recompile limit: prefill steps then all run the symbolic one
        self.prefill_graphs_exhausted = False

    @property
    def deferred_stop_check(self) -> bool | None:
        """The ``deferred_stop_check`` setting (see ``compile``): None (automatic: CUDA generate() calls of at
        least :data:`DEFERRED_STOP_MIN_ROWS` rows), True (every CUDA generate()), False (never); settable.

        Raises:
            ValueError: set True on a model whose pool is not on a CUDA device."""
        return self._deferred_stop_check

    @deferred_stop_check.setter
    def deferred_stop_check(self, setting: bool | None) -> None:
        if setting is not None and not isinstance(setting, bool):
            raise TypeError(f"deferred_stop_check must be True, False or None, got {setting!r}")
        if setting and self.pool.device.type != "cuda":
            raise ValueError(f"deferred_stop_check needs a CUDA model (transformers' DeferredStopCheck waits on "
                             f"device events); this model's pool is on {self.pool.device}")
        self._deferred_stop_check = setting

    def defers_stop_check(self, rows: int) -> bool:
        """Whether a generate() of ``rows`` rows on a cache it creates reads the stop flag one step late."""
        setting = self._deferred_stop_check
        if self.pool.device.type != "cuda" or setting is False:
            return False
        if setting is None and rows < DEFERRED_STOP_MIN_ROWS:
            return False
        return _install_deferred_stop_hook()

    @property
    def rewrites(self) -> dict[str, int]:
        """``{rewrite name: replacements}`` summed over every graph compiled for this model."""
        return dict(self.passes.counts)

    def step_buffers(self, batch_size: int) -> StepBuffers:
        """The step metadata tensors of ``batch_size`` rows (created once, then reused by every cache)."""
        if batch_size not in self._buffers:
            # created on first use, possibly inside torch.inference_mode(): the buffers outlive the call and
            # are written in place by later calls outside it, so they must not be inference tensors
            with torch.inference_mode(False):
                self._buffers[batch_size] = StepBuffers.allocate(batch_size, self.max_pages_per_row,
                                                                 self.pool.device)
        return self._buffers[batch_size]

    def return_rows(self, page_tables: PageTables | None, slots: list[int], buffers: StepBuffers) -> None:
        """Give a cache's pages and state slots back to the pool (``slots`` is emptied in place) and mark the
        shared step ``buffers`` as holding nobody's tables (the next cache to step uploads its own). Takes
        the generate lock: returning rows empties step buffers a generate() running in another thread may
        share, between its prepare_step and its forward."""
        with self.generate_lock:
            if page_tables is not None:
                page_tables.release_all()  # uploads the emptied table into the shared buffers
            if slots:
                self.pool.free_slots(slots)
                slots.clear()
            buffers.slot_ids.fill_(-1)
            buffers.resident = None

    def queue_orphan(self, page_tables: PageTables | None, slots: list[int], buffers: StepBuffers) -> None:
        """Queue the rows of a cache garbage-collected without ``release()`` (its finaliser calls this).
        Only queued: a finaliser may run in the middle of any pool operation, so it must not touch the
        pool; :meth:`reclaim_orphans` returns them."""
        self._orphans.append((page_tables, slots, buffers))

    def reclaim_orphans(self) -> int:
        """Return the pages, slots and step buffers of caches that were garbage-collected without
        ``release()`` (creating a cache and every step do this first); returns how many such caches were
        reclaimed."""
        if not self._orphans:  # the common case, without taking the lock
            return 0
        count = 0
        with self.generate_lock:
            while self._orphans:
                self.return_rows(*self._orphans.pop())
                count += 1
        return count

    def check_own(self, cache: UnifiedCache) -> None:
        """Refuse another model's cache: it carries that model's pool, specs and layer map, so its rows would
        be written with this model's geometry into the other arena.

        Raises:
            UnsupportedModel: ``cache`` belongs to another compiled model."""
        if cache.handle is not self:
            raise UnsupportedModel(f"this UnifiedCache belongs to another compiled model ({cache.handle!r}); "
                                   f"create caches for this one with model.unimem.new_cache()")

    def budget_advice(self) -> str:
        """What a PoolExhausted raised inside generate() adds: how many full rows the arena holds and what to
        change."""
        budget = self.pool.layout.memory_budget
        used = self.pool.stats()
        rows = f"{self.full_rows} full row{'' if self.full_rows == 1 else 's'}"
        return (f"the arena of {budget} bytes holds {rows} of max_seq_len={self.max_seq_len} "
                f"tokens and their states (max_batch_size={self.max_batch_size}); {used.kv_pages_used} KV pages "
                f"and {used.state_slots_used} state slots were in use when it ran out, this call's included, and "
                "caches kept alive (a past_key_values you hold, model.unimem.new_cache()) keep theirs until "
                "cache.release(): release them, give unimem_compile.compile() a larger memory_budget (None sizes "
                "the arena for max_batch_size full rows), or lower max_seq_len or the rows per call")

    def new_cache(self, batch_size: int | None = None) -> UnifiedCache:
        """A fresh :class:`UnifiedCache` of ``batch_size`` rows (default ``max_batch_size``)."""
        return UnifiedCache(self, self.max_batch_size if batch_size is None else batch_size)

    def stats(self) -> dict:
        """The ``pool`` statistics of docs/design.md section 5 (bytes, pages, slots), plus the free gap."""
        s = self.pool.stats()
        return {
            "total_bytes": s.total_bytes,
            "kv_pages_peak": s.kv_pages_peak,
            "state_slots_peak": s.state_slots_peak,
            "kv_pages_used": s.kv_pages_used,
            "state_slots_used": s.state_slots_used,
            "overhead_fraction": s.overhead_fraction,
            "page_bytes": s.page_bytes,
            "slot_bytes": s.slot_bytes,
            "free_gap_bytes": s.free_gap_bytes,
        }

    # ------------------------------------------------------------------------------ the decode runner
    def _need_runner(self):
        if self.runner is None:
            raise UnsupportedModel("this model has no decode runner (unimem_compile.compile attaches one)")
        return self.runner

    @property
    def steps_ahead(self) -> int:
        """K: decode steps the runner allocates pages for and replays between two reads of the finished flags
        (default 8; settable to an int >= 1). Raises UnsupportedModel without a runner."""
        return self._need_runner().steps_ahead

    @steps_ahead.setter
    def steps_ahead(self, k: int) -> None:
        self._need_runner().steps_ahead = k

    def capture(self, buckets=None, sampling=(False,)) -> dict:
        """Build the decode runner's steps now instead of on first use: for each batch-size bucket in
        ``buckets`` (default: all) and each ``sampling`` flag (False: greedy calls, True: calls with a sampled
        row), compile the step and, on a CUDA model with ``cudagraphs``, capture it. Returns
        :meth:`runner_stats`.

        Raises:
            GeometryError: a bucket that is not one of this model's; UnsupportedModel: no runner."""
        return self._need_runner().capture(buckets, sampling)

    def runner_stats(self) -> dict:
        """The decode runner's steps built so far (per bucket and sampling flag: compile and capture
        seconds, bytes the graphs hold, steps run) and the memory it holds (``DecodeRunner.stats``)."""
        return self._need_runner().stats()

    @contextlib.contextmanager
    def timed_decode(self):
        """``with model.unimem.timed_decode() as timing: model.generate(...)``: the runner records a
        :class:`~unimem_compile.runner.DecodeTiming` (events at the end of the prefill and after every block
        of steps; nothing synchronises) of the calls inside; read it afterwards
        (``timing.decode_seconds()``, ``timing.decode_steps``). A call that runs transformers' own loop
        records nothing."""
        runner = self._need_runner()
        timing = runner.timing = runner.new_timing()
        try:
            yield timing
        finally:
            runner.timing = None

    def __repr__(self) -> str:
        return f"UnimemHandle({self._model_name}, {self.pool!r}, rewrites={self.rewrites})"


def _install_deferred_stop_hook() -> bool:
    """Let transformers' ``DeferredStopCheck.is_supported`` say yes for a :class:`UnifiedCache` whose
    ``defer_stop_check`` is set (every other call goes to transformers' own rule, unchanged). Installed once
    per process; False when this transformers has no ``DeferredStopCheck`` (no deferral then)."""
    try:
        from transformers.generation import utils as gen_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    check = getattr(gen_utils, "DeferredStopCheck", None)
    if check is None or not hasattr(check, "is_supported"):
        return False
    original = check.is_supported
    if getattr(original, "_unimem_hook", False):
        return True
    signature = inspect.signature(original)

    def is_supported(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        cache = bound.arguments.get("cache")
        if isinstance(cache, UnifiedCache) and cache.defer_stop_check:
            return not bound.arguments.get("is_assistant", False)
        return original(*args, **kwargs)

    is_supported._unimem_hook = True
    check.is_supported = staticmethod(is_supported)
    return True


# ------------------------------------------------------------------------------------------ the wrappers
def install(model, handle: UnimemHandle, compiled_forward, prefill_graphed=None) -> None:
    """Patch ``model``'s ``forward``, ``prepare_inputs_for_generation`` and ``generate`` to run on ``handle``
    (see the module docstring) and attach it as ``model.unimem``. ``compiled_forward`` is the
    ``torch.compile``'d forward of this model; ``prefill_graphed`` (or None) the one with static shapes and
    Inductor's CUDA graphs that prefill steps of an ``UNIMEM_PREFILL_GRAPHS`` length run instead."""
    model.forward = _forward(model, handle, compiled_forward, prefill_graphed)
    model.prepare_inputs_for_generation = _prepare_inputs_for_generation(model, handle)
    masks.install(model, handle)
    model.generate = _generate(model, handle)
    model.unimem = handle


def _requires_grad(model) -> bool:
    return any(p.requires_grad for p in model.parameters())


def _graphed_prefill(kwargs: dict, cache) -> bool:
    """Whether this forward is a prefill step of one of ``UNIMEM_PREFILL_GRAPHS``' lengths (tokens per row)
    on a UnifiedCache. Never under ``UNIMEM_DEBUG=1``: the launchers' id checks read the device back, which a
    capture cannot hold (the decode runner does not capture then either). Raises ValueError for a malformed
    variable (``env.prefill_graph_lengths``)."""
    ids = kwargs.get("input_ids")
    if not isinstance(cache, UnifiedCache) or not isinstance(ids, torch.Tensor) or ids.dim() != 2 \
            or ids.shape[1] < 2 or env.debug():
        return False
    return int(ids.shape[1]) in env.prefill_graph_lengths()


def _own_outputs(out):
    """A graphed step's output with its tensors copied out of the CUDA-graph trees' pool: the trees reuse that
    memory at the next replay (reading an older step's logits would then raise), and a caller may keep
    each chunk's logits (a ``ModelOutput``'s tensor fields; anything else is returned as it is)."""
    if hasattr(out, "items"):
        for name, value in list(out.items()):
            if isinstance(value, torch.Tensor):
                out[name] = value.clone()
    return out


def _graphed_run(handle: UnimemHandle, prefill_graphed, compiled, cache):
    """The graphed forward of one step, its outputs copied out (:func:`_own_outputs`). Past Dynamo's
    recompile limit (each batch size, padded or not, first chunk or later, is a static graph of its own)
    the step runs the symbolic forward instead, and so do all later ones of this model, with one warning:
    the limit is hit while compiling, before anything ran, so nothing of the step is lost."""

    def run(*args, **inputs):
        try:
            out = prefill_graphed(*args, **inputs)
        except _RECOMPILE_LIMIT_HIT:
            handle.prefill_graphs_exhausted = True
            logger.warning("UNIMEM_PREFILL_GRAPHS: the CUDA-graphed prefill forward reached Dynamo's recompile "
                           "limit of %d graphs; this model's prefill steps run the symbolic forward from now on",
                           RECOMPILE_LIMIT)
            return compiled(*args, **prepare_step_inputs(inputs, cache))
        handle.prefill_graph_steps += 1
        return _own_outputs(out)

    return run


def _forward(model, handle: UnimemHandle, compiled, prefill_graphed=None):
    adapter = handle.adapter
    # a config asking for hidden states / attentions by default is checked on every forward; otherwise only
    # a forward whose keywords ask for them (two dict lookups on the decode path)
    config_outputs = any(getattr(model.config, name, False) for name in UNSUPPORTED_OUTPUTS)

    @functools.wraps(model.forward)
    def forward(*args, **kwargs):
        if kwargs.get("output_hidden_states") or kwargs.get("output_attentions") or config_outputs:
            check_outputs(model, kwargs)
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if isinstance(cache, UnifiedCache):
            if not cache.prepared:
                raise UnsupportedModel("a forward with a UnifiedCache must follow cache.prepare_step(input_ids, "
                                       "attention_mask) for its tokens (generate() does this before every step); "
                                       "call generate(), or prepare the step first")
            cache.prepared = False
        if torch.is_grad_enabled() and adapter.state_spec is not None and _requires_grad(model):
            raise UnsupportedModel(
                "unimem_compile runs inference only: its linear-attention ops have no backward; call the model "
                "under torch.no_grad() or torch.inference_mode() (generate() does)"
            )
        graphed = prefill_graphed is not None and not handle.prefill_graphs_exhausted \
            and _graphed_prefill(kwargs, cache)
        run = _graphed_run(handle, prefill_graphed, compiled, cache) if graphed else compiled
        # one graph per query-length bucket; a graphed prefill's graph is static in its length
        inputs = prepare_step_inputs(kwargs, cache, dynamic=not graphed)
        # the step's stored lengths, which prepare_step uploaded: ops that plan on the host (mla_prefill) read
        # them instead of reading kv_len back, which would wait for the GPU (ops/step_context.py)
        tables = cache.page_tables if isinstance(cache, UnifiedCache) else None
        published = [(tables.kv_len, tables.host_lengths)] if tables is not None and env.async_uploads() else []
        try:
            with adapter.patched(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), \
                    step_context.host_copies(published):
                try:
                    return run(*args, **inputs)
                except torch._dynamo.exc.BackendCompilerFailed as e:
                    # a graph compiled for this step reads its stand-in mask (a rewrite refused an attention
                    # site): nothing ran, and the pass manager turned stand-ins off for this model
                    if masks.stand_in_of(cache) is None or not isinstance(e.inner_exception, StandInRead):
                        raise
                masks.stand_in_read(handle)
                inputs = prepare_step_inputs(masks.with_real_masks(kwargs), cache, dynamic=not graphed)
                return run(*args, **inputs)
        finally:
            if isinstance(cache, UnifiedCache):
                cache.stand_in_masks = None

    return forward


def _prepare_inputs_for_generation(model, handle: UnimemHandle):
    original = model.prepare_inputs_for_generation
    pool = handle.pool

    @functools.wraps(original)
    def prepare_inputs_for_generation(input_ids, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, UnifiedCache):
            handle.check_own(cache)
            if input_ids.device != pool.device:
                raise UnsupportedModel(f"input_ids are on {input_ids.device} but the pool is on {pool.device}")
            prepare = functools.partial(cache.prepare_step, input_ids, kwargs.get("attention_mask"))
            if handle.tensor_parallel is not None and env.debug():
                handle.tensor_parallel.agree_step(prepare, pool, cache)
            else:
                prepare()
        return original(input_ids, *args, **kwargs)

    return prepare_inputs_for_generation


def _generate(model, handle: UnimemHandle):
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        with handle.generate_lock:
            check = functools.partial(check_generate_call, handle, model, args, kwargs)
            tp = handle.tensor_parallel
            return _run(original, check() if tp is None else tp.agree_generate(check, args, kwargs, handle.pool.device))

    return generate


def _call_arguments(args: tuple, kwargs: dict) -> dict:
    """A generate() call's arguments by name (transformers' ``GenerationMixin.generate`` signature)."""
    from transformers.generation.utils import GenerationMixin

    try:
        return inspect.signature(GenerationMixin.generate).bind_partial(None, *args, **kwargs).arguments
    except TypeError:  # transformers refuses the call itself, with its own message
        return dict(kwargs)


def _with_decode_runner(handle: UnimemHandle, call: GenerateCall) -> dict:
    """The keywords to call transformers' generate with: the call's, plus the decode runner as its decoding
    method (``custom_generate``) unless the call brings its own or the runner is off. The runner decides
    from what transformers prepares whether it decodes the call (see ``unimem_compile.runner.generate``)."""
    runner = handle.runner
    if runner is None:
        return call.kwargs
    bound = _call_arguments(call.args, call.kwargs)
    if bound.get("custom_generate") is not None:
        runner.fallback("the call brings its own custom_generate")
        return call.kwargs
    if not handle.use_runner:
        runner.fallback("model.unimem.use_runner is False")
        return call.kwargs
    # decoding modes transformers moved to Hub repos: with a custom_generate given it would skip them, and the
    # runner's fallback is _sample; without one, transformers does what it always does with them
    for name, active in (("penalty_alpha", lambda v: v is not None and v > 0),
                         ("dola_layers", lambda v: v is not None)):
        if active(call.setting(name)):
            runner.fallback(f"{name}={call.setting(name)!r} (a decoding mode of its own)")
            return call.kwargs
    method = runner.decoding_method(passed=call.passed, streamer=bound.get("streamer"),
                                    synced_gpus=bound.get("synced_gpus"))
    return {**call.kwargs, "custom_generate": method}


def _run(original_generate, call: GenerateCall):
    """Run transformers' generate for a checked call on its cache; release a cache it created when it returns.

    A step that failed half way leaves page tables and states that no longer match the cached tokens: a
    cache the caller passed is then released (not silently continued from), unless the call failed before
    any step changed it (e.g. transformers refusing an argument)."""
    cache = call.cache
    cache.mask_hint = (f"no attention_mask was passed, so generate() inferred one from "
                       f"pad_token_id={call.inferred_pad_token_id}; pass attention_mask explicitly"
                       if call.inferred_pad_token_id is not None else None)
    cache.call_start = True  # the first step of this call checks the whole mask
    cache.chunked_prefill_end = call.prompt_len if call.setting("prefill_chunk_size") is not None else None
    before = cache.fingerprint() if call.passed else None
    cache.defer_stop_check = not call.passed and cache.handle.defers_stop_check(call.rows)
    kwargs = _with_decode_runner(cache.handle, call)
    mask = call.kwargs.get("attention_mask")
    try:
        if (cache.chunked_prefill_end is not None and isinstance(mask, torch.Tensor) and mask.dim() == 2
                and env.async_uploads()):
            # transformers passes each chunk mask[:, :end]: its pads are read on the host from one copy, taken
            # here, instead of a read-back (a wait for the GPU on CUDA) per chunk
            cache.remember_mask(mask)
        out = original_generate(*call.args, **kwargs)
    except BaseException as e:
        if call.passed and cache.fingerprint() != before:
            cache.release(reason=f"generate() raised {type(e).__name__} while using it")
        if isinstance(e, PoolExhausted):
            e.args = (f"{e}; {cache.handle.budget_advice()}",)  # the same error, its fields and traceback
        raise
    finally:
        cache.remember_mask(None)
        if not call.passed:
            cache.release()
    if call.passed:
        cache.finish_generate()
    return out
