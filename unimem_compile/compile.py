"""``unimem_compile.compile``: give a Hugging Face model a unified pool and a compiled forward.

    model = unimem_compile.compile(model, max_batch_size=8, max_seq_len=1024)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    print(model.unimem.stats())

What it does to the model instance (the class is untouched):

* ``model.forward`` becomes ``torch.compile(forward, backend=<the pass manager's wrapper backend>,
  fullgraph=True)``, run with the family's kernel functions swapped for unimem-backed ones;
* ``model.prepare_inputs_for_generation`` first prepares the step eagerly (allocation, locations) — it
  runs before every forward and before transformers builds the attention mask;
* ``model.generate`` creates a :class:`~unimem_compile.hf.cache.UnifiedCache` for the batch, passes it
  with ``disable_compile=True`` (transformers must not compile ``__call__`` behind our back), lets
  transformers read the stop flag one step late on it (CUDA, 8+ rows; ``deferred_stop_check``), and frees its
  pages and slots when generation returns;
* ``model.unimem`` is the :class:`UnimemHandle`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import operator
import threading
import warnings
from collections.abc import Collection

import torch

from .errors import GeometryError, UnsupportedModel
from .hf.adapters import ModelAdapter, adapter_for
from .hf.cache import StepBuffers, UnifiedCache, return_rows
from .pool import ArenaLayout, UnifiedPool

__all__ = ["compile", "UnimemHandle", "DEFERRED_STOP_MIN_ROWS"]

#: Rows from which ``deferred_stop_check=None`` defers the stop check (measured on an H200 with the
#: Kimi-Linear-48B 4-layer model, prompt 512: batch 1 -5-8%, batch 8 +3%, batch 32 +10-28% decode tokens/s).
DEFERRED_STOP_MIN_ROWS = 8


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
    """

    def __init__(self, model, adapter: ModelAdapter, pool: UnifiedPool, max_batch_size: int, max_seq_len: int,
                 passes):
        self.adapter = adapter
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.passes = passes
        self.max_pages_per_row = math.ceil(max_seq_len / pool.layout.page_size)
        self._deferred_stop_check: bool | None = None
        self._buffers: dict[int, StepBuffers] = {}
        self._orphans: list = []  # (page tables, slots, step buffers) of caches collected unreleased
        self._model_name = type(model).__name__
        #: held by every generate() call and by whatever returns a cache's rows (release, reset, creating a
        #: cache, reclaiming dropped ones): calls from several threads run one after the other (they share
        #: the step buffers of a batch size and the adapter's patched module globals)
        self.generate_lock = threading.RLock()

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

    def reclaim_orphans(self) -> int:
        """Return the pages, slots and step buffers of caches that were garbage-collected without
        ``release()`` (creating a cache does this first); returns how many such caches were reclaimed."""
        count = 0
        with self.generate_lock:  # returning rows empties step buffers a running generate() may share
            while self._orphans:
                return_rows(self.pool, *self._orphans.pop())
                count += 1
        return count

    def new_cache(self, batch_size: int | None = None) -> UnifiedCache:
        """A fresh :class:`UnifiedCache` of ``batch_size`` rows (default ``max_batch_size``)."""
        return UnifiedCache(self, self.max_batch_size if batch_size is None else batch_size)

    def stats(self) -> dict:
        """The ``pool`` statistics of DESIGN.md section 5 (bytes, pages, slots), plus the free gap."""
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

    def __repr__(self) -> str:
        return f"UnimemHandle({self._model_name}, {self.pool!r}, rewrites={self.rewrites})"


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


def _layout(adapter: ModelAdapter, memory_budget, page_size: int, max_batch_size: int, max_seq_len: int,
            device: torch.device) -> ArenaLayout:
    kv, state = adapter.kv_spec, adapter.state_spec
    row_pages = math.ceil(max_seq_len / page_size) if kv is not None else 0
    one_row = ArenaLayout.for_capacity(kv, state, page_size, row_pages, 1 if state is not None else 0)
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
    if not isinstance(memory_budget, (bool, int, float)) and hasattr(memory_budget, "__index__"):
        memory_budget = operator.index(memory_budget)  # numpy and other integer types: bytes
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)):
        raise GeometryError(f"memory_budget must be bytes (int), a fraction in (0, 1] (float) or None, "
                            f"got {memory_budget!r}")
    if isinstance(memory_budget, float):
        if not 0 < memory_budget <= 1:
            raise GeometryError(f"a float memory_budget is a fraction of free memory in (0, 1], got {memory_budget}")
        budget = int(_free_device_bytes(device) * memory_budget)
    else:
        budget = memory_budget
        if budget <= 0:
            raise GeometryError(f"memory_budget must be a positive number of bytes, got {budget}")
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


#: the short dtype names the demo CLI and the README use, for compile(kv_dtype=...)
_SHORT_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

#: Graphs one compiled model may accumulate (prefill lengths and batch sizes before Dynamo marks them
#: dynamic, with and without a padding mask); torch's default of 8 is counted per code object.
RECOMPILE_LIMIT = 32
_COMPILED: list[str] = []


def _own_entry(fn, tag: int):
    """A trampoline calling ``fn`` with a code object of its own. Dynamo keeps its compiled-graph cache and
    recompile count per top-level code object, and every transformers model's ``forward`` is the same
    decorator ``wrapper`` code: without this, all compiled models of a process would share one cache
    (checking each other's guards on every call) and one recompile budget."""

    def entry(*args, **kwargs):
        return fn(*args, **kwargs)

    entry.__code__ = entry.__code__.replace(co_name=f"unimem_forward_{tag}")
    entry.__name__ = entry.__qualname__ = entry.__code__.co_name
    return entry


def _cache_kwarg(model) -> str:
    params = inspect.signature(type(model).prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def _given_generation_config(args, kwargs):
    """The generation_config a generate() call passes, as a keyword or as its second positional argument
    (``generate(inputs, generation_config, ...)``); None when it passes none."""
    from transformers import GenerationConfig

    if kwargs.get("generation_config") is not None:
        return kwargs["generation_config"]
    if len(args) > 1 and isinstance(args[1], GenerationConfig):
        return args[1]
    return None


@functools.cache
def _default_generation_config():
    from transformers import GenerationConfig

    return GenerationConfig()


def _generation_setting(model, kwargs, name: str, default, config=None):
    """A generate() setting as transformers resolves it, field by field: the call's keyword, else the
    generation_config it passes (``config``) where that sets the field (differs from transformers'
    default), else the model's generation_config, else ``default``."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    config = config or kwargs.get("generation_config")
    model_config = getattr(model, "generation_config", None)
    if config is not None:
        value = getattr(config, name, None)
        if value is not None and (model_config is None or value != getattr(_default_generation_config(), name, None)):
            return value
    value = getattr(model_config, name, None)
    return default if value is None else value


#: forward() outputs that transformers collects through hooks installed under a lock, which Dynamo cannot
#: trace with fullgraph=True: refused by name instead of failing inside the trace.
_UNSUPPORTED_OUTPUTS = ("output_hidden_states", "output_attentions")


def _check_outputs(model, settings: dict) -> None:
    for name in _UNSUPPORTED_OUTPUTS:
        value = settings.get(name)
        if value is None:
            value = getattr(model.config, name, False)
        if value:
            raise UnsupportedModel(f"{name}=True is not supported by a model compiled by unimem_compile (the "
                                   "compiled forward returns logits and the cache only); run the stock model "
                                   "for hidden states or attention maps")


def _requires_grad(model) -> bool:
    return any(p.requires_grad for p in model.parameters())


@functools.cache
def _backend_names() -> tuple[str, ...]:
    return tuple(torch._dynamo.list_backends(exclude_tags=()))


def _default_max_length() -> int:
    """transformers' ``max_length`` when neither the call nor a config sets one (20 in 5.17-5.24)."""
    try:
        from transformers.generation.utils import GenerationMixin

        return int(GenerationMixin._get_default_generation_params()["max_length"])
    except Exception:  # noqa: BLE001 - another transformers layout: its documented default
        return 20


def _max_total_length(model, kwargs, prompt_len: int, config) -> int:
    """Tokens a row reaches in this generate() call (prompt with pads + new tokens), resolved as transformers'
    ``_prepare_generated_length`` does: ``max_new_tokens`` wins; else a ``max_length`` set by the call or a
    config; else the default ``max_length`` (20) as NEW tokens, capped by ``max_position_embeddings``."""
    new = _generation_setting(model, kwargs, "max_new_tokens", None, config)
    if new is not None:
        return prompt_len + int(new)
    length = _generation_setting(model, kwargs, "max_length", None, config)
    if length is not None:
        return int(length)
    total = prompt_len + _default_max_length()
    cap = getattr(model.config, "max_position_embeddings", None)
    return min(total, int(cap)) if cap else total


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


def compile(  # noqa: A001 - the public name of DESIGN.md section 5
    model,
    *,
    max_batch_size: int,
    max_seq_len: int,
    memory_budget: int | float | None = None,
    page_size: int = 64,
    kv_dtype: torch.dtype | None = None,
    passes: bool | Collection[str] = True,
    backend: str = "inductor",
    cudagraphs: bool = False,
    deferred_stop_check: bool | None = None,
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
            works too.
        passes: True runs every rewrite, False none, or a collection of rewrite names
            (``mla_write_fusion``, ``mla_absorb``, ``kda_state_inplace``, ``conv_state_inplace``).
        backend: the inner ``torch.compile`` backend ("inductor", "aot_eager", "eager", ...).
        cudagraphs: Inductor's ``triton.cudagraphs`` for decode graphs (one token per row; CUDA only; never
            ``torch.compile``'s ``mode=``). Prefill graphs are compiled without CUDA graphs.
        deferred_stop_check: let transformers' generate() read its stop flag one step late
            (``DeferredStopCheck``, which transformers enables on ``mps`` only) when generate() creates the
            cache, so the host prepares and launches step n + 1 while the GPU runs step n instead of waiting
            for the GPU every step. An EOS stop then costs one extra decode step, whose token transformers
            drops (the returned tokens are identical). None (default): on for CUDA generate() calls of at
            least :data:`DEFERRED_STOP_MIN_ROWS` rows (measured on an H200: +10-28% decode tokens/s at batch
            32, -5-8% at batch 1, where the host alone bounds the step; benchmarks/RESULTS.md); True: every
            CUDA call; False: never. Never used for a cache the caller passes (it cannot roll a step back).
            True on a CPU model raises ValueError.

    Returns:
        ``model``, with ``model.unimem`` (:class:`UnimemHandle`).

    Raises:
        UnsupportedModel: an unsupported family (the message lists the supported ones), parameters on more
            than one device, or a model compiled already.
        GeometryError: bad sizes, or a memory_budget too small for one request (the message gives the
            minimum).
        ValueError / TypeError: ``passes`` names an unknown rewrite / is none of the accepted forms (a
            mapping included); ``backend`` is not a registered backend name; ``cudagraphs`` or
            ``deferred_stop_check`` is not a bool (None too for the latter); ``deferred_stop_check=True`` on
            a CPU model (``cudagraphs=True`` there only warns: Inductor ignores it);
            ``kv_dtype`` is neither a torch dtype nor the name of one.
        OSError: ``UNIMEM_DUMP_GRAPHS`` names a folder that cannot be created or written.
    """
    from unimem_compile.passes import make_pass_manager
    from unimem_compile.passes.manager import check_dump_dir

    if hasattr(model, "unimem"):
        raise UnsupportedModel(f"{type(model).__name__} was compiled by unimem_compile already")
    check_dump_dir()  # a bad UNIMEM_DUMP_GRAPHS fails here, not inside the first generate()'s compile
    # options are checked before anything is built: a model compiled once cannot be compiled again
    if not isinstance(backend, str) or backend not in _backend_names():
        raise ValueError(f"backend must be the name of a registered torch.compile backend, got {backend!r}; "
                         f"registered: {', '.join(_backend_names())}")
    for name, value, allowed in (("cudagraphs", cudagraphs, (False, True)),
                                 ("deferred_stop_check", deferred_stop_check, (None, False, True))):
        if not any(value is a for a in allowed):
            raise TypeError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    if isinstance(kv_dtype, str):  # "bfloat16" / "torch.bfloat16", as transformers' dtype= accepts; "bf16"
        name = _SHORT_DTYPE_NAMES.get(kv_dtype, kv_dtype.removeprefix("torch."))
        if not isinstance(getattr(torch, name, None), torch.dtype):
            raise TypeError(f"kv_dtype {kv_dtype!r} does not name a torch dtype (e.g. 'bfloat16', 'bf16', "
                            "'float16', 'fp16', 'float32', 'fp32')")
        kv_dtype = getattr(torch, name)
    elif kv_dtype is not None and not isinstance(kv_dtype, torch.dtype):
        raise TypeError(f"kv_dtype must be a torch.dtype, a dtype name or None, got {kv_dtype!r}")
    for name, value in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len), ("page_size", page_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise GeometryError(f"{name} must be a positive int, got {value!r}")
    adapter = adapter_for(model, kv_dtype)
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise UnsupportedModel(f"the model's parameters are spread over {sorted(map(str, devices))}; "
                               "unimem_compile needs the whole model on one device")
    device = devices.pop()
    if cudagraphs and device.type != "cuda":
        warnings.warn(f"cudagraphs=True has no effect on a model on {device} (Inductor's CUDA graphs are for CUDA "
                      "models); compiling without them", UserWarning, stacklevel=2)
    if deferred_stop_check and device.type != "cuda":
        raise ValueError(f"deferred_stop_check=True needs a CUDA model (transformers' DeferredStopCheck waits on "
                         f"device events); the model is on {device}")
    manager = make_pass_manager(passes)
    layout = _layout(adapter, memory_budget, page_size, max_batch_size, max_seq_len, device)
    with torch.inference_mode(False):  # compile() under inference_mode: the pool is written outside it too
        pool = UnifiedPool(layout, device)
    torch._dynamo.mark_static_address(pool.arena)
    for table in (pool.v2p, pool.p2v, pool.s_v2p, pool.s_p2v):
        torch._dynamo.mark_static_address(table)
    handle = UnimemHandle(model, adapter, pool, max_batch_size, max_seq_len, manager)
    handle.model_dtype = next(model.parameters()).dtype
    handle.deferred_stop_check = deferred_stop_check

    # a config asking for hidden states / attentions by default is checked on every forward; otherwise only
    # a forward whose keywords ask for them (two dict lookups on the decode path)
    config_outputs = any(getattr(model.config, name, False) for name in _UNSUPPORTED_OUTPUTS)
    compiled = torch.compile(_own_entry(model.forward, len(_COMPILED)), backend=manager.backend(backend, cudagraphs),
                             fullgraph=True)
    _COMPILED.append(type(model).__name__)

    @functools.wraps(model.forward)
    def forward(*args, **kwargs):
        if kwargs.get("output_hidden_states") or kwargs.get("output_attentions") or config_outputs:
            _check_outputs(model, kwargs)
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
        with adapter.patched(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(*args, **kwargs)

    original_prepare = model.prepare_inputs_for_generation

    def check_own(cache: UnifiedCache) -> None:
        # another model's cache carries that model's pool, specs and layer map: its rows would be written
        # with this model's geometry into the other arena
        if cache.handle is not handle:
            raise UnsupportedModel(f"this UnifiedCache belongs to another compiled model ({cache.handle!r}); "
                                   f"create caches for this one with model.unimem.new_cache()")

    @functools.wraps(original_prepare)
    def prepare_inputs_for_generation(input_ids, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, UnifiedCache):
            check_own(cache)
            if input_ids.device != pool.device:
                raise UnsupportedModel(f"input_ids are on {input_ids.device} but the pool is on {pool.device}")
            cache.prepare_step(input_ids, kwargs.get("attention_mask"))
        return original_prepare(input_ids, *args, **kwargs)

    original_generate = model.generate
    cache_key = _cache_kwarg(model)

    @functools.wraps(original_generate)
    def generate(*args, **kwargs):
        with handle.generate_lock:
            return _generate(*args, **kwargs)

    def _generate(*args, **kwargs):
        # `is None`, not `or`: an empty transformers Cache is falsy (its length is 0)
        given, other = kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
        if given is not None and other is not None and given is not other:
            raise ValueError("generate() was given two different caches (cache= and past_key_values=); pass one")
        given = other if given is None else given
        if given is not None and not isinstance(given, UnifiedCache):
            raise UnsupportedModel(f"a model compiled by unimem_compile generates with a UnifiedCache, "
                                   f"got {type(given).__name__}")
        if given is not None:
            check_own(given)
        input_ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if input_ids is None:
            raise UnsupportedModel("unimem_compile's generate() needs input_ids (inputs_embeds are not supported)")
        if input_ids.device != pool.device:
            raise UnsupportedModel(f"input_ids are on {input_ids.device} but the model and its pool are on "
                                   f"{pool.device}")
        batch, prompt = int(input_ids.shape[0]), int(input_ids.shape[1])
        config = _given_generation_config(args, kwargs)
        setting = functools.partial(_generation_setting, model, kwargs, config=config)
        _check_outputs(model, {name: setting(name, None) for name in _UNSUPPORTED_OUTPUTS})
        beams = int(setting("num_beams", 1))
        if beams > 1:
            raise UnsupportedModel(f"beam search (num_beams={beams}) is not supported by a model compiled by "
                                   "unimem_compile; use greedy decoding or sampling")
        assisted = {"assistant_model": kwargs.get("assistant_model"),
                    "prompt_lookup_num_tokens": setting("prompt_lookup_num_tokens", None),
                    "assistant_early_exit": setting("assistant_early_exit", None),
                    "use_mtp": setting("use_mtp", None) or None}
        asked = [f"{name}={value!r}" if name != "assistant_model" else name
                 for name, value in assisted.items() if value is not None]
        if asked:
            raise UnsupportedModel(f"assisted / speculative decoding ({', '.join(asked)}) is not supported by a model "
                                   "compiled by unimem_compile: it crops rejected draft tokens off the cache, which "
                                   "a UnifiedCache cannot undo; use greedy decoding or sampling")
        chunk = setting("prefill_chunk_size", None)
        if chunk is not None:
            raise UnsupportedModel(f"prefill_chunk_size={chunk} is not supported by a model compiled by "
                                   "unimem_compile: each step must bring the whole sequence so far (the cache lays "
                                   "the step out from it); leave prefill_chunk_size unset")
        if setting("use_cache", True) is False:
            raise UnsupportedModel("use_cache=False is not supported: a model compiled by unimem_compile always "
                                   "decodes from its UnifiedCache")
        sequences = int(setting("num_return_sequences", 1))
        rows = batch * sequences  # generate() repeats each prompt num_return_sequences times before prefill
        if rows > max_batch_size:
            detail = f" x num_return_sequences={sequences} = {rows} rows" if sequences > 1 else " rows"
            raise GeometryError(f"batch of {batch}{detail} is larger than max_batch_size={max_batch_size}")
        if given is not None and given.num_rows != rows:
            raise GeometryError(f"the UnifiedCache passed holds {given.num_rows} rows, this generate() call needs "
                                f"{rows} (batch {batch} x num_return_sequences {sequences})")
        total = _max_total_length(model, kwargs, prompt, config)
        if total > max_seq_len:
            raise GeometryError(f"prompt ({prompt} tokens, pads included) + new tokens = {total} tokens is longer "
                                f"than max_seq_len={max_seq_len}")
        dtype_now = next(model.parameters()).dtype
        if dtype_now != handle.model_dtype:
            raise UnsupportedModel(f"the model's parameters are {dtype_now} now but were {handle.model_dtype} when "
                                   "unimem_compile.compile() built its pool and graphs; compile a fresh model "
                                   "object in the dtype you want (or cast it back)")
        cache = given if given is not None else handle.new_cache(rows)
        pad = setting("pad_token_id", None) if kwargs.get("attention_mask") is None else None
        cache.mask_hint = (f"no attention_mask was passed, so generate() inferred one from pad_token_id={pad}; "
                           "pass attention_mask explicitly") if pad is not None else None
        cache.call_start = True  # the first step of this call checks the whole mask
        before = cache.fingerprint() if given is not None else None
        cache.defer_stop_check = given is None and handle.defers_stop_check(rows)
        kwargs[cache_key] = cache
        # transformers must not compile __call__ behind our back; set on the caller's generation_config when
        # there is one (a keyword beside a generation_config makes transformers warn about deprecated usage)
        if config is None:
            kwargs.setdefault("disable_compile", True)
        elif not getattr(config, "disable_compile", False):
            config = copy.deepcopy(config)
            config.disable_compile = True
            if kwargs.get("generation_config") is not None:
                kwargs["generation_config"] = config
            else:
                args = (args[0], config, *args[2:])
        try:
            out = original_generate(*args, **kwargs)
        except BaseException as e:
            # a step that failed half way leaves page tables and states that no longer match the cached
            # tokens: a cache the caller passed is released (not silently continued from), unless the call
            # failed before any step changed it (e.g. transformers refusing an argument); ours always is
            if given is not None and given.fingerprint() != before:
                given.release(reason=f"generate() raised {type(e).__name__} while using it")
            raise
        finally:
            if given is None:
                cache.release()
        if given is not None:
            given.finish_generate()
        return out

    model.forward = forward
    model.prepare_inputs_for_generation = prepare_inputs_for_generation
    model.generate = generate
    model.unimem = handle
    return model
