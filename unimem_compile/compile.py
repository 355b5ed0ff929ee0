"""``unimem_compile.compile``: give a Hugging Face model a unified pool and a compiled forward.

    model = unimem_compile.compile(model, max_batch_size=8, max_seq_len=1024)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    print(model.unimem.stats())

The entry point only: :func:`compile` checks the options (:class:`~unimem_compile.options.CompileOptions`),
sizes and builds the pool, compiles the forward with the pass manager's backend, and installs the runtime
on the model instance (:func:`unimem_compile.hf.runtime.install`: the wrapped ``forward``,
``prepare_inputs_for_generation`` and ``generate``, and ``model.unimem``). What runs at generate() time
lives in ``unimem_compile/hf/``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection

import torch

from .errors import GeometryError, UnsupportedModel
from .hf.adapters import ModelAdapter, adapter_for
from .hf.masks import with_real_masks
from .hf.runtime import UnimemHandle, install
from .ops.common import HOST_PLANNED
from .options import CompileOptions
from .pool import ArenaLayout, UnifiedPool
from .runner.decode import DecodeRunner

__all__ = ["compile"]

# models compiled in this process: numbers each one's forward entry (see _own_entry)
_COMPILED: list[str] = []


def _free_device_bytes(device: torch.device) -> int:
    """Bytes an allocation on ``device`` can get: the driver's free memory plus, on CUDA, what PyTorch's
    caching allocator holds reserved but unused (it serves new tensors from that first)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise GeometryError("cannot tell the free memory of this machine: give memory_budget in bytes")


def _free_bytes_if_known(device: torch.device) -> int | None:
    """:func:`_free_device_bytes`, or None when the machine does not say (the allocation then decides)."""
    try:
        return _free_device_bytes(device)
    except (GeometryError, OSError, RuntimeError):
        return None


def _layout(adapter: ModelAdapter, options: CompileOptions, device: torch.device) -> ArenaLayout:
    """The arena layout for ``options.memory_budget`` (already checked for its form) on ``device``.

    Raises:
        GeometryError: the default or int budget is more than ``device`` has free; the budget cannot hold
            one request of ``max_seq_len`` tokens and its state (the message gives the minimum)."""
    kv, state = adapter.kv_spec, adapter.state_spec
    page_size, max_batch_size, max_seq_len = options.page_size, options.max_batch_size, options.max_seq_len
    row_pages = math.ceil(max_seq_len / page_size) if kv is not None else 0
    one_row = ArenaLayout.for_capacity(kv, state, page_size, row_pages, 1 if state is not None else 0)
    memory_budget = options.memory_budget
    if memory_budget is None:
        layout = ArenaLayout.for_capacity(
            kv, state, page_size, row_pages * max_batch_size, max_batch_size if state is not None else 0
        )
        free = _free_bytes_if_known(device)
        if free is not None and layout.memory_budget > free:  # fail here with the numbers, not as an OOM later
            raise GeometryError(
                f"the arena for max_batch_size={max_batch_size} full rows of max_seq_len={max_seq_len} tokens "
                f"needs {layout.memory_budget} bytes ({layout.memory_budget / 2**30:.2f} GiB) but {device} has "
                f"{free} bytes ({free / 2**30:.2f} GiB) free; lower max_seq_len / max_batch_size or give "
                f"memory_budget (bytes, or a fraction of free memory)")
        return layout
    if isinstance(memory_budget, float):
        budget = int(_free_device_bytes(device) * memory_budget)
    else:
        budget = memory_budget
        free = _free_bytes_if_known(device)
        if free is not None and budget > free:
            raise GeometryError(f"memory_budget of {budget} bytes ({budget / 2**30:.2f} GiB) is more than {device} "
                                f"has free: {free} bytes ({free / 2**30:.2f} GiB)")
    if budget < one_row.memory_budget:
        raise GeometryError(
            f"memory_budget of {budget} bytes cannot hold one request of max_seq_len={max_seq_len} tokens "
            f"and its state: the minimum is {one_row.memory_budget} bytes"
        )
    return ArenaLayout(budget, page_size, kv, state)


def full_rows(layout: ArenaLayout, adapter: ModelAdapter, max_seq_len: int, most: int) -> int:
    """Rows of ``max_seq_len`` tokens, each with its state slot, that ``layout`` holds at once, counted up to
    ``most`` (the pages of a row: ``ceil(max_seq_len / page_size)``)."""
    row_pages = math.ceil(max_seq_len / layout.page_size) if adapter.kv_spec is not None else 0
    row_slots = 1 if adapter.state_spec is not None else 0
    rows = 0
    while rows < most and layout.fits((rows + 1) * row_pages, (rows + 1) * row_slots):
        rows += 1
    return rows


def _warn_past_positions(model, options: CompileOptions) -> None:
    """Warns (UserWarning) when ``max_seq_len`` exceeds the model config's ``max_position_embeddings``: the
    arena and the graphs serve such lengths, but positions past the config's are outside what the model was
    built for (stock transformers does not refuse them either). Silent when the config has no such field."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and options.max_seq_len > limit:
        warnings.warn(f"max_seq_len={options.max_seq_len} tokens exceeds the model config's "
                      f"max_position_embeddings={limit}: rows may grow to positions the model was not built for",
                      UserWarning, stacklevel=3)


def _warn_if_short(layout: ArenaLayout, adapter: ModelAdapter, options: CompileOptions) -> int:
    """:func:`full_rows` of ``layout``; warns (UserWarning) when it is fewer than ``max_batch_size``: a call
    whose rows all grow to ``max_seq_len`` would then raise PoolExhausted part way."""
    rows = full_rows(layout, adapter, options.max_seq_len, options.max_batch_size)
    if rows < options.max_batch_size:
        held = f"{rows} full row{'' if rows == 1 else 's'}"
        warnings.warn(f"memory_budget of {layout.memory_budget} bytes holds {held} of "
                      f"max_seq_len={options.max_seq_len} tokens and their states, fewer than "
                      f"max_batch_size={options.max_batch_size}: a generate() of more rows raises PoolExhausted "
                      "once they outgrow it (memory_budget=None sizes the arena for max_batch_size full rows)",
                      UserWarning, stacklevel=3)
    return rows


def _build_pool(adapter: ModelAdapter, options: CompileOptions, device: torch.device, tp=None) -> UnifiedPool:
    """The model's pool, its arena and tables marked as static addresses for Dynamo (they never move). Under
    tensor parallelism every rank agrees on one budget (the smallest, when a fraction of free memory
    resolves differently), so all ranks have the same pages and slots."""
    if tp is None:
        layout = _layout(adapter, options, device)
    else:
        layout = tp.agree_budget(lambda: _layout(adapter, options, device),
                                 lambda budget: ArenaLayout(budget, options.page_size, adapter.kv_spec, adapter.state_spec))
    with torch.inference_mode(False):  # compile() under inference_mode: the pool is written outside it too
        pool = UnifiedPool(layout, device)
    for tensor in (pool.arena, pool.v2p, pool.p2v, pool.s_v2p, pool.s_p2v):
        torch._dynamo.mark_static_address(tensor)
    return pool


def _model_device(model) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise UnsupportedModel(f"the model's parameters are spread over {sorted(map(str, devices))}; "
                               "unimem_compile needs the whole model on one device")
    return devices.pop()


def _check_device_options(options: CompileOptions, device: torch.device) -> None:
    """The options that depend on the model's device: ``cudagraphs=True`` off CUDA warns (Inductor ignores
    it), ``deferred_stop_check=True`` off CUDA raises ValueError."""
    if options.cudagraphs and device.type != "cuda":
        warnings.warn(f"cudagraphs=True has no effect on a model on {device} (Inductor's CUDA graphs are for CUDA "
                      "models); compiling without them", UserWarning, stacklevel=3)
    if options.deferred_stop_check and device.type != "cuda":
        raise ValueError(f"deferred_stop_check=True needs a CUDA model (transformers' DeferredStopCheck waits on "
                         f"device events); the model is on {device}")


def _connect_tensor_parallel():
    from .tp.group import TensorParallel  # torch.distributed is imported only by tensor-parallel launches

    return TensorParallel.connect()


def _own_entry(fn, tag: int | str):
    """A trampoline calling ``fn`` with a code object of its own. Dynamo keeps its compiled-graph cache and
    recompile count per top-level code object, and every transformers model's ``forward`` is the same
    decorator ``wrapper`` code: without this, all compiled models of a process would share one cache
    (checking each other's guards on every call) and one recompile budget.

    A call that runs without Dynamo (``torch.compiler.set_stance("force_eager")``, Dynamo disabled,
    ``suppress_errors`` after a failed compile) gets transformers' attention masks in place of a stand-in
    (``hf/masks.py``): no rewrite replaced their readers. Under Dynamo ``is_compiling()`` is a constant and the
    branch is not traced."""

    def entry(*args, **kwargs):
        if not torch.compiler.is_compiling():
            kwargs = with_real_masks(kwargs)
        return fn(*args, **kwargs)

    entry.__code__ = entry.__code__.replace(co_name=f"unimem_forward_{tag}")
    entry.__name__ = entry.__qualname__ = entry.__code__.co_name
    return entry


def compile(  # noqa: A001 - the public name of docs/design.md section 5
    model,
    *,
    max_batch_size: int,
    max_seq_len: int,
    memory_budget: int | float | None = None,
    page_size: int = 64,
    kv_dtype: torch.dtype | None = None,
    passes: bool | Collection[str] = True,
    backend: str = "inductor",
    cudagraphs: bool | None = None,
    deferred_stop_check: bool | None = None,
    tensor_parallel: bool = False,
):
    """Give ``model`` a unified memory pool and a compiled forward; returns the same model object.

    Args:
        model: a Hugging Face ``KimiLinearForCausalLM``, ``DeepseekV3ForCausalLM`` or
            ``DeepseekV2ForCausalLM`` on one device.
        max_batch_size: most rows one ``generate()`` call may have.
        max_seq_len: most tokens a row may reach: prompt (pads included) + new tokens.
        memory_budget: arena bytes (int); a fraction in (0, 1] of the device's free memory (float); or
            None: ``max_batch_size`` full rows of ``max_seq_len`` tokens with their states, the sink and
            the tail pad. GeometryError if the int or the default is more than the device has free (free
            memory includes what PyTorch's caching allocator holds unused).
        page_size: tokens per KV page.
        kv_dtype: dtype of the cached latent rows (None: the model's dtype); a name ("bfloat16", "bf16")
            works too. ``"fp8_e4m3"`` (``torch.float8_e4m3fn``) or ``torch.float8_e4m3fnuz``: scaled fp8 rows
            (656 bytes per token and MLA layer at 512 + 64 instead of 1152; docs/design.md section 3.3),
            quantised by the write op, read back as bf16.
        passes: True runs every rewrite, False none, or a collection of rewrite names
            (``mla_write_fusion``, ``mla_absorb``, ``kda_state_inplace``, ``conv_state_inplace``).
        backend: the inner ``torch.compile`` backend ("inductor", "aot_eager", "eager", ...).
        cudagraphs: CUDA graphs for decode (never ``torch.compile``'s ``mode=``). None (default): on for
            CUDA models, off elsewhere. On, the decode runner captures each decode step (forward, logits
            processing, sampling, bookkeeping) in one ``torch.cuda.CUDAGraph`` per batch-size bucket and
            replays it; a call that runs transformers' own decode loop uses Inductor's CUDA graphs for its
            decode graph. Prefill graphs are never CUDA-graphed (each prompt length would record its own).
            True on a non-CUDA model only warns; off, the runner calls its compiled step without capture.
        deferred_stop_check: let transformers' generate() read its stop flag one step late
            (``DeferredStopCheck``, which transformers enables on ``mps`` only) when generate() creates the
            cache, so the host prepares and launches step n + 1 while the GPU runs step n instead of waiting
            for the GPU every step. An EOS stop then costs one extra decode step, whose token transformers
            drops (the returned tokens are identical). None (default): on for CUDA generate() calls of at
            least :data:`~unimem_compile.hf.runtime.DEFERRED_STOP_MIN_ROWS` rows (measured on an H200:
            +10-28% decode tokens/s at batch 32, -5-8% at batch 1, where the host alone bounds the step;
            benchmarks/RESULTS.md); True: every
            CUDA call; False: never. Never used for a cache the caller passes (it cannot roll a step back).
            True on a CPU model raises ValueError.
        tensor_parallel: shard the model over torch.distributed's default process group, whose world size is
            the tensor-parallel degree (docs/design.md section 9): every rank (one process each, e.g. under
            ``torchrun``) builds or loads the same model and calls ``compile`` with the same options; the
            model's parameters are replaced IN PLACE by this rank's shard (MLA and KDA heads, MLP / expert
            widths, the vocabulary of ``lm_head``), its config then describes the shard, and the pool holds
            this rank's KDA heads' states (the latent rows whole). The ranks check that they agree (model,
            weights, options, budget) and all raise RankMismatch if not; generate() then runs on every rank
            with the same inputs.

    Returns:
        ``model``, with ``model.unimem`` (:class:`~unimem_compile.hf.runtime.UnimemHandle`).

    Raises:
        UnsupportedModel: an unsupported family (the message lists the supported ones), parameters on more
            than one device, or a model compiled already.
        GeometryError: bad sizes, or a memory_budget too small for one request (the message gives the
            minimum).
        ValueError / TypeError: ``passes`` names an unknown rewrite / is none of the accepted forms (a
            mapping included); ``backend`` is not a registered backend name; ``cudagraphs`` or
            ``deferred_stop_check`` is not a bool or None; ``deferred_stop_check=True`` on
            a CPU model (``cudagraphs=True`` there only warns: Inductor ignores it);
            ``kv_dtype`` is neither a torch dtype nor the name of one.
        OSError: ``UNIMEM_DUMP_GRAPHS`` names a folder that cannot be created or written.
        RankMismatch: (tensor parallel) another rank failed its checks, the ranks' models, weights, options
            or versions differ, or the ranks did not meet within ``UNIMEM_TP_TIMEOUT`` seconds. With
            ``tensor_parallel=True`` UnsupportedModel also means no initialised default process group, an
            NCCL group for a model off CUDA or a parameter the plan has no rule for, and GeometryError a
            world size that does not divide the heads or an intermediate size; every rank raises.
    """
    from unimem_compile.passes import make_pass_manager
    from unimem_compile.passes.manager import check_dump_dir

    # a tensor-parallel launch connects first (a collective): every check below is then agreed by all ranks
    tp = _connect_tensor_parallel() if tensor_parallel is True else None

    def check() -> CompileOptions:
        if hasattr(model, "unimem"):
            raise UnsupportedModel(f"{type(model).__name__} was compiled by unimem_compile already")
        if getattr(model, "_unimem_sharded", False):
            raise UnsupportedModel(f"this {type(model).__name__} holds one rank's tensor-parallel shard from a "
                                   "compile() that failed after sharding it; build or load the model again")
        check_dump_dir()  # a bad UNIMEM_DUMP_GRAPHS fails here, not inside the first generate()'s compile
        # options are checked before anything is built: a model compiled once cannot be compiled again
        options = CompileOptions(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                 memory_budget=memory_budget, page_size=page_size, kv_dtype=kv_dtype, passes=passes,
                                 backend=backend, cudagraphs=cudagraphs, deferred_stop_check=deferred_stop_check,
                                 tensor_parallel=tensor_parallel)
        adapter_for(model, options.kv_dtype)  # the family and the dtype, before a shard changes anything
        device = _model_device(model)
        _check_device_options(options, device)
        if tp is not None:
            tp.check_device(device)
            tp.plan_for(model)
        return options

    options = check() if tp is None else tp.check_launch(model, check)
    if tp is not None:
        tp.shard(model)  # in place: the config now describes this rank's heads, so the adapter sizes its states
    adapter = adapter_for(model, options.kv_dtype)
    device = _model_device(model)
    manager = make_pass_manager(options.passes)
    pool = _build_pool(adapter, options, device, tp)
    handle = UnimemHandle(model, adapter, pool, options.max_batch_size, options.max_seq_len, manager,
                          deferred_stop_check=options.deferred_stop_check)
    handle.tensor_parallel = tp
    handle.full_rows = _warn_if_short(pool.layout, adapter, options)
    _warn_past_positions(model, options)
    tag = len(_COMPILED)
    cudagraphs = options.cudagraphs_for(device)
    compiled = torch.compile(_own_entry(model.forward, tag), backend=manager.backend(options.backend, cudagraphs),
                             fullgraph=True)
    # the forward of UNIMEM_PREFILL_GRAPHS' steps: static shapes, Inductor's CUDA graphs partitioned around the
    # host-planned ops; a code object of its own (its own Dynamo cache and recompile count); compiles on first use
    prefill_graphed = None
    # (off CUDA Inductor ignores the CUDA graphs: static graphs; a torch without the cudagraph_unsafe tag would
    # capture mla_prefill's host plan: no such forward there)
    if cudagraphs and options.backend == "inductor" and HOST_PLANNED:
        prefill_graphed = torch.compile(_own_entry(model.forward, f"{tag}_prefill_graphs"), fullgraph=True,
                                        dynamic=False, backend=manager.backend(options.backend, True,
                                                                               prefill_graphs=True))
    # the runner traces the forward inside its own step and captures the step itself: its backend must not add
    # Inductor's CUDA graphs (a graph cannot be captured inside another capture)
    handle.runner = DecodeRunner(model, handle, model.forward, manager.backend(options.backend, False),
                                 capture=cudagraphs, tag=tag)
    _COMPILED.append(type(model).__name__)
    install(model, handle, compiled, prefill_graphed)
    from .engine.api import install as install_engine  # on use: the engine layer sits above compile's imports

    install_engine(model)
    return model
