"""The checks of one ``generate()`` call on a compiled model, and the settings it resolves on the way.

:func:`check_generate_call` is the whole of it: everything a call asks for that a compiled model cannot do
is refused by name before anything is allocated or computed, and what the call asks for is resolved the
way transformers resolves it (the call's keywords, then the generation_config it passes, then the
model's). The :class:`GenerateCall` it returns carries the call's rows, its cache and those settings, for
whatever runs the call (``hf/runtime.py`` hands it to transformers' generate).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING, Any

import torch

from ..errors import GeometryError, UnsupportedModel
from ..pool.allocator import as_int
from .cache import UnifiedCache

if TYPE_CHECKING:
    from .runtime import UnimemHandle

__all__ = ["GenerateCall", "check_generate_call", "check_outputs", "UNSUPPORTED_OUTPUTS"]

#: forward() outputs that transformers collects through hooks installed under a lock, which Dynamo cannot
#: trace with fullgraph=True: refused by name instead of failing inside the trace.
UNSUPPORTED_OUTPUTS = ("output_hidden_states", "output_attentions")


@dataclasses.dataclass
class GenerateCall:
    """One checked generate() call.

    Attributes:
        batch: prompts in the call (``input_ids.shape[0]``).
        prompt_len: tokens per prompt, pads included (``input_ids.shape[1]``).
        num_return_sequences: sequences per prompt (generate() repeats each prompt that often).
        rows: cache rows the call needs, ``batch * num_return_sequences``.
        total_len: tokens a row reaches in the call (prompt with pads + new tokens), at most ``max_seq_len``.
        cache: the :class:`UnifiedCache` the call runs on: the caller's, or a new one of ``rows`` rows.
        passed: whether the caller passed ``cache`` (else it is the call's own, to release when it returns).
        inferred_pad_token_id: the pad_token_id transformers infers the attention mask from when the call
            passes none (None: the call passes a mask, or sets no pad token).
        config: the generation_config the call passes (a copy with ``disable_compile`` set), or None.
        args, kwargs: what to call transformers' generate with: the call's own, the cache under the model's
            cache keyword, ``disable_compile=True`` (transformers must not compile ``__call__`` itself).
    """

    batch: int
    prompt_len: int
    num_return_sequences: int
    rows: int
    total_len: int
    cache: UnifiedCache
    passed: bool
    inferred_pad_token_id: Any
    config: Any
    args: tuple
    kwargs: dict
    model: Any = dataclasses.field(repr=False)

    def setting(self, name: str, default=None):
        """The generation setting ``name`` as transformers resolves it for this call (see
        :func:`generation_setting`), ``default`` when neither the call nor a config sets it."""
        return generation_setting(self.model, self.kwargs, name, default, self.config)


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


def generation_setting(model, kwargs, name: str, default, config=None):
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


def check_outputs(model, settings: dict) -> None:
    """Refuse hidden states and attention maps (:data:`UNSUPPORTED_OUTPUTS`) asked for by ``settings`` (a
    call's keywords or resolved settings; None defers to the model's config).

    Raises:
        UnsupportedModel: naming the output asked for."""
    for name in UNSUPPORTED_OUTPUTS:
        value = settings.get(name)
        if value is None:
            value = getattr(model.config, name, False)
        if value:
            raise UnsupportedModel(f"{name}=True is not supported by a model compiled by unimem_compile (the "
                                   "compiled forward returns logits and the cache only); run the stock model "
                                   "for hidden states or attention maps")


def _default_max_length() -> int:
    """transformers' ``max_length`` when neither the call nor a config sets one (20 in 5.17-5.24)."""
    try:
        from transformers.generation.utils import GenerationMixin

        return int(GenerationMixin._get_default_generation_params()["max_length"])
    except Exception:  # noqa: BLE001 - another transformers layout: its documented default
        return 20


def _token_count(value, name: str) -> int:
    """``value`` of the length setting ``name`` as an int. A float is refused: stock transformers takes one
    without complaint and stops at its ceiling (``cur_len >= max_length``), which the up-front
    ``max_seq_len`` check and the decode runner would count one token short.

    Raises:
        TypeError: ``value`` is a bool or not an integer (Python, numpy or 0-d integer tensor)."""
    try:
        return as_int(value, name)
    except TypeError:
        raise TypeError(f"{name} must be an int (a number of tokens), got {type(value).__name__} {value!r}") from None


def _max_total_length(model, kwargs, prompt_len: int, config) -> int:
    """Tokens a row reaches in this generate() call (prompt with pads + new tokens), resolved as transformers'
    ``_prepare_generated_length`` does: ``max_new_tokens`` wins; else a ``max_length`` set by the call or a
    config; else the default ``max_length`` (20) as NEW tokens, capped by ``max_position_embeddings``."""
    new = generation_setting(model, kwargs, "max_new_tokens", None, config)
    if new is not None:
        return prompt_len + _token_count(new, "max_new_tokens")
    length = generation_setting(model, kwargs, "max_length", None, config)
    if length is not None:
        return _token_count(length, "max_length")
    total = prompt_len + _default_max_length()
    cap = getattr(model.config, "max_position_embeddings", None)
    return min(total, int(cap)) if cap else total


def _cache_kwarg(model) -> str:
    """The keyword this model's ``prepare_inputs_for_generation`` takes its cache by (transformers renamed
    ``past_key_values`` to ``cache``)."""
    return _cache_kwarg_of(type(model))


@functools.cache
def _cache_kwarg_of(model_class) -> str:
    params = inspect.signature(model_class.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


#: The first transformers whose chunked prefill continues from a cache that already holds tokens (5.17-5.20
#: split the whole input_ids and restart at position 0, feeding the cached tokens again).
CHUNKED_CONTINUATION_FROM = (5, 21)


def _transformers_version() -> tuple[int, ...]:
    import transformers
    from packaging.version import Version  # a dependency of transformers

    return Version(transformers.__version__).release[:2]


def _check_prefill_chunks(chunk, cache: UnifiedCache | None, mask) -> int:
    """A ``prefill_chunk_size`` this model can run, returned as a Python int: a positive integer (a Python or
    numpy int, a 0-d integer tensor; not a bool, not a float); on transformers before 5.21 not on a cache
    that holds tokens; no prompt row of padding only (the cache cannot tell it from a row whose pads run
    into a later chunk, so it is checked here, on the whole mask: one host read of it)."""
    try:
        size = as_int(chunk, "prefill_chunk_size")
    except TypeError:  # a bool, a float, a string
        size = 0
    if size < 1:
        raise ValueError(f"prefill_chunk_size must be an int >= 1, got {chunk!r}")
    if cache is not None and cache.logical_len and _transformers_version() < CHUNKED_CONTINUATION_FROM:
        import transformers

        raise UnsupportedModel(f"prefill_chunk_size with a cache that holds tokens needs transformers >= 5.21: "
                               f"transformers {transformers.__version__} restarts a chunked prefill at position "
                               f"0 and would feed the {cache.logical_len} cached tokens again; continue without "
                               "prefill_chunk_size")
    if mask is not None:
        empty = torch.nonzero(~mask.bool().any(-1)).reshape(-1).tolist()
        if empty:
            raise GeometryError(f"row {empty[0]} of the batch consists of padding only ({mask.shape[1]} pads)")
    return size


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"{type(value).__name__}"


def _bos_prompt(bos_token_id, kwargs: dict, device: torch.device) -> torch.Tensor:
    """The prompt stock transformers generates from when a call passes no ``input_ids``: one BOS token per
    row, ``[batch, 1]`` int64, the batch taken from the first tensor among the call's keywords (an
    ``attention_mask``, say), else 1.

    Raises:
        ValueError: the call and the model's generation_config set no ``bos_token_id``."""
    if bos_token_id is None:
        raise ValueError("generate() without input_ids starts from the BOS token, but neither the call nor "
                         "model.generation_config sets bos_token_id; pass input_ids")
    if isinstance(bos_token_id, (list, tuple)):
        bos_token_id = bos_token_id[0]
    batch = next((int(v.shape[0]) for v in kwargs.values() if isinstance(v, torch.Tensor) and v.dim() > 0), 1)
    return torch.full((batch, 1), int(bos_token_id), dtype=torch.long, device=device)


def _with_input_ids(input_ids: torch.Tensor, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's ``args`` / ``kwargs`` with ``input_ids`` as its first argument (the ``input_ids`` / ``inputs``
    keywords, None here, dropped)."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("input_ids", "inputs")}
    return (input_ids, *args[1:]), kwargs


def _check_token_ids(model, input_ids):
    """Refuse a token id outside ``[0, vocab_size)`` of the model's input embedding before the prefill.

    Stock transformers fails inside the embedding lookup (a bare ``IndexError: index out of range in self``
    on the CPU; on CUDA a device-side assert that leaves the CUDA context unusable). Checked on every position,
    padding included (the embedding looks up those too). One device sync per generate() call.

    Raises:
        ValueError: naming the first offending id, its [row, position] and the vocabulary size.
    """
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # not a transformers model with an input embedding
        return
    vocab = getattr(embedding, "num_embeddings", None)
    if not isinstance(vocab, int):
        return
    outside = (input_ids < 0) | (input_ids >= vocab)
    if bool(outside.any()):
        row, position = (int(i) for i in outside.nonzero()[0])
        raise ValueError(f"input_ids holds token id {int(input_ids[row, position])} at [row {row}, position "
                         f"{position}], outside the vocabulary [0, {vocab}) of the model's input embedding")


def check_generate_call(handle: UnimemHandle, model, args: tuple, kwargs: dict) -> GenerateCall:
    """Check a generate() call on ``model`` (compiled, with ``handle``) and resolve what it asks for.

    The checks run in this order and the first that fails raises; only when all pass is a new cache
    created for a call that passes none (so a refused call allocates nothing and changes no cache).

    Args:
        handle: the model's :class:`~.runtime.UnimemHandle`.
        model: the compiled model.
        args, kwargs: the call's arguments as generate() received them (``kwargs`` is not modified).

    Returns:
        the :class:`GenerateCall`.

    Raises:
        ValueError: two different caches (``cache=`` and ``past_key_values=``).
        UnsupportedModel: a cache that is not a :class:`UnifiedCache` or belongs to another model;
            ``inputs_embeds``; ``input_ids`` on another device; a ``cache_implementation``; hidden states or
            attention maps asked for; beam search; assisted / speculative decoding; ``use_cache=False``; a
            model whose parameters were cast since ``compile()``; ``prefill_chunk_size`` on a cache that
            holds tokens with transformers < 5.21.
        TypeError: ``input_ids`` that are not integers (a float tensor, say); a ``max_new_tokens`` or
            ``max_length`` that is not an int (``2.5``, say).
        ValueError: ``input_ids`` that are not a 2-D tensor; no ``input_ids`` and no ``bos_token_id`` (a call
            without ``input_ids`` starts from the BOS token, as stock transformers does); a token id outside
            the input embedding's ``[0, vocab_size)``; a ``prefill_chunk_size`` that is not an integer >= 1
            (a numpy or 0-d tensor integer is taken, and handed to transformers as a Python int).
        GeometryError: ``input_ids`` without tokens; more rows than ``max_batch_size``; a passed cache of
            another row count; a prompt + new tokens longer than ``max_seq_len``; with
            ``prefill_chunk_size``, a prompt row of padding only.
    """
    kwargs = dict(kwargs)
    # `is None`, not `or`: an empty transformers Cache is falsy (its length is 0)
    given, other = kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
    if given is not None and other is not None and given is not other:
        raise ValueError("generate() was given two different caches (cache= and past_key_values=); pass one")
    given = other if given is None else given
    if given is not None and not isinstance(given, UnifiedCache):
        raise UnsupportedModel(f"a model compiled by unimem_compile generates with a UnifiedCache, "
                               f"got {type(given).__name__}")
    if given is not None:
        handle.check_own(given)
    input_ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    config = _given_generation_config(args, kwargs)
    setting = functools.partial(generation_setting, model, kwargs, config=config)
    if input_ids is None:
        if kwargs.get("inputs_embeds") is not None:
            raise UnsupportedModel("inputs_embeds are not supported by a model compiled by unimem_compile: "
                                   "pass input_ids")
        input_ids = _bos_prompt(setting("bos_token_id", None), kwargs, handle.pool.device)
        args, kwargs = _with_input_ids(input_ids, args, kwargs)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D [batch, tokens] tensor of token ids, got "
                         f"{_describe(input_ids)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids (torch.long or torch.int), got {input_ids.dtype}")
    if input_ids.device != handle.pool.device:
        raise UnsupportedModel(f"input_ids are on {input_ids.device} but the model and its pool are on "
                               f"{handle.pool.device}")
    batch, prompt = int(input_ids.shape[0]), int(input_ids.shape[1])
    if prompt == 0:
        if given is not None and given.logical_len:
            raise GeometryError(f"input_ids has no tokens and the cache passed holds {given.logical_len}: pass the "
                                "whole sequence so far (the cached tokens, then the new ones)")
        raise GeometryError(f"input_ids has no tokens (shape {list(input_ids.shape)}): generate() needs at least "
                            "one prompt token per row (call it without input_ids to start from the BOS token)")
    _check_token_ids(model, input_ids)
    implementation = setting("cache_implementation", None)
    if implementation is not None:
        raise UnsupportedModel(f"cache_implementation={implementation!r} is not supported: a model compiled by "
                               "unimem_compile always generates on its own UnifiedCache (paged, preallocated in "
                               "the model's pool, what a static cache gives); leave cache_implementation unset"
                               + ("" if kwargs.get("cache_implementation") is not None or config is not None
                                  else " (model.generation_config sets it)"))
    check_outputs(model, {name: setting(name, None) for name in UNSUPPORTED_OUTPUTS})
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
    chunk_size = None  # set when the call's value must reach transformers as a Python int
    if chunk is not None:
        size = _check_prefill_chunks(chunk, given, kwargs.get("attention_mask"))
        if type(chunk) is not int:  # transformers hands it to torch.split, which takes a Python int only
            chunk_size = size
    if setting("use_cache", True) is False:
        raise UnsupportedModel("use_cache=False is not supported: a model compiled by unimem_compile always "
                               "decodes from its UnifiedCache")
    sequences = int(setting("num_return_sequences", 1))
    rows = batch * sequences  # generate() repeats each prompt num_return_sequences times before prefill
    if rows > handle.max_batch_size:
        detail = f" x num_return_sequences={sequences} = {rows} rows" if sequences > 1 else " rows"
        raise GeometryError(f"batch of {batch}{detail} is larger than max_batch_size={handle.max_batch_size}")
    if given is not None and given.num_rows != rows:
        raise GeometryError(f"the UnifiedCache passed holds {given.num_rows} rows, this generate() call needs "
                            f"{rows} (batch {batch} x num_return_sequences {sequences})")
    total = _max_total_length(model, kwargs, prompt, config)
    if total > handle.max_seq_len:
        raise GeometryError(f"prompt ({prompt} tokens, pads included) + new tokens = {total} tokens is longer "
                            f"than max_seq_len={handle.max_seq_len}")
    dtype_now = next(model.parameters()).dtype
    if dtype_now != handle.model_dtype:
        raise UnsupportedModel(f"the model's parameters are {dtype_now} now but were {handle.model_dtype} when "
                               "unimem_compile.compile() built its pool and graphs; compile a fresh model "
                               "object in the dtype you want (or cast it back)")
    pad = setting("pad_token_id", None) if kwargs.get("attention_mask") is None else None
    # an integral prefill_chunk_size goes where it came from as an int: the call's keyword, else the config it
    # passes (a copy), else a keyword over the model's config
    chunk_in_config = chunk_size is not None and kwargs.get("prefill_chunk_size") is None and config is not None
    if chunk_size is not None and not chunk_in_config:
        kwargs["prefill_chunk_size"] = chunk_size
    # transformers must not compile __call__ behind our back; set on the caller's generation_config when
    # there is one (a keyword beside a generation_config makes transformers warn about deprecated usage)
    if config is None:
        kwargs.setdefault("disable_compile", True)
    elif not getattr(config, "disable_compile", False) or chunk_in_config:
        config = copy.deepcopy(config)
        config.disable_compile = True
        if chunk_in_config:
            config.prefill_chunk_size = chunk_size
        if kwargs.get("generation_config") is not None:
            kwargs["generation_config"] = config
        else:
            args = (args[0], config, *args[2:])
    cache = given if given is not None else handle.new_cache(rows)
    kwargs[_cache_kwarg(model)] = cache
    return GenerateCall(batch=batch, prompt_len=prompt, num_return_sequences=sequences, rows=rows, total_len=total,
                        cache=cache, passed=given is not None, inferred_pad_token_id=pad, config=config,
                        args=tuple(args), kwargs=kwargs, model=model)
