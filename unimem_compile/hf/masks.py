"""The attention masks generate() hands the compiled forward: a stand-in where no rewritten graph reads the mask.

transformers' ``prepare_inputs_for_generation`` builds the 4-D attention mask eagerly, outside the compiled
graph, before every forward on a cache whose ``is_compileable`` is True (``UnifiedCache``), through
``self.create_masks_for_generate`` when the model has one, else ``masking_utils.create_masks_for_generate``.
For a prefill step that is a ``[B, 1, T, max_seq_len]`` boolean tensor built by index arithmetic (reported
on an H200, 4-layer Kimi-Linear, one 32k prompt in 4k chunks: ~15 ms of host time, ``aten::index`` among it,
and 10-25 ms of GPU kernels over the 8 chunks, of ~175 ms for the whole generate()). After the
``mla_prefill`` rewrite nothing in the graph reads it: the op takes ``kv_len`` instead (causal by stored
index, the left pads never stored), so the mask is a graph input without users.

:func:`install` gives the model an instance attribute ``create_masks_for_generate`` (transformers 5.17 and
5.24 both look it up on the model, with the same keywords except the cache's: ``past_key_values`` /
``cache``). For a prefill step (query length >= 2) over a ``UnifiedCache`` that holds history or left pads,
on SDPA, with ``mla_prefill`` enabled, it returns what transformers would, except that the full-attention
mask is a STAND-IN: ``torch.empty`` of the same shape, dtype and layout, never written (no kernel; the
allocator's memory of one mask, freed after the step). The graph is therefore the very graph the real mask
compiles (no new graph, no recompile). Everything else is transformers' own: the linear-attention layers'
2-D padding mask (``create_recurrent_attention_mask``, which the KDA layers multiply their inputs by), every
decode step (a ``[B, 1, 1, max_seq_len]`` mask; ``mla_absorb`` replaces it in the decode graph), a first
step without padding (transformers' mask-free causal form), other attention implementations, layer types
other than full and linear attention, and mask-function overlays.

Why that is safe, and what happens where it is not:

* :func:`~unimem_compile.passes.manager.mark_stand_in` registers the stand-in. The pass manager's backend
  checks every prefill graph it compiles after the rewrites: one that still reads a registered stand-in (a
  rewrite refused an attention site: a biased or quantised ``kv_b_proj``, another attention form) raises
  :class:`~unimem_compile.passes.manager.StandInRead` before the inner compile, and one that reads a real
  4-D mask sets ``PassManager.reads_attention_mask``. Either turns stand-ins off for the model; after the
  raise the forward wrapper builds transformers' masks for the step and runs it again (nothing ran yet), so
  the tokens stay stock's. Every graph that can run a step was checked when it was compiled (decode graphs
  never get a stand-in).
* A forward that runs without Dynamo (``torch.compiler.set_stance("force_eager")`` or
  ``"eager_on_recompile"``, Dynamo disabled, ``suppress_errors`` after a failed compile) runs no rewrite:
  the compiled forward's entry (``compile._own_entry``) swaps transformers' masks in when
  ``torch.compiler.is_compiling()`` is False. (A recompile limit reached is an error under ``fullgraph=True``,
  not an eager run.)
* The cache's own pad check (``UnifiedCache.prepare_step``) reads the 2-D mask before any of this runs, and
  the decode runner builds its mask inside its graph: neither changes.
"""

from __future__ import annotations

import functools
import logging

import torch

from .. import env
from ..passes.manager import mark_stand_in
from .cache import UnifiedCache

__all__ = ["install", "stand_in_enabled", "stand_in_of", "stand_in_read", "with_real_masks"]

log = logging.getLogger("unimem_compile.compile")

#: the layer types whose masks the stand-in path knows: full attention (the stand-in) and linear attention
#: (transformers' own 2-D padding mask)
_LAYER_TYPES = frozenset({"full_attention", "linear_attention"})


def stand_in_enabled(handle) -> bool:
    """Whether prefill steps of ``handle``'s model may get a stand-in full-attention mask: ``mla_prefill`` is
    enabled, no prefill graph compiled so far read a 4-D attention mask (nor a stand-in) after the rewrites,
    and ``UNIMEM_STAND_IN_MASKS`` is not ``0`` (read per step)."""
    manager = handle.passes
    return env.stand_in_masks() and "mla_prefill" in manager.enabled and not manager.reads_attention_mask


def _transformers_masks(*args, **kwargs):
    """transformers' ``create_masks_for_generate``, looked up when called (what ``prepare_inputs_for_generation``
    calls on a model without a ``create_masks_for_generate`` of its own)."""
    from transformers.generation import utils

    return utils.create_masks_for_generate(*args, **kwargs)


def install(model, handle) -> None:
    """Give ``model`` (an instance) the ``create_masks_for_generate`` described in the module docstring;
    nothing when its class defines its own (that model's masks are left to it)."""
    if getattr(type(model), "create_masks_for_generate", None) is not None:
        return
    model.create_masks_for_generate = functools.partial(_create_masks_for_generate, handle)


def _create_masks_for_generate(handle, *args, **kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, UnifiedCache):
        return _transformers_masks(*args, **kwargs)
    cache.stand_in_masks = None
    masks = None if args else _stand_in_masks(handle, cache, kwargs)
    if masks is None:
        return _transformers_masks(*args, **kwargs)
    # what builds transformers' masks instead, should no checked graph run this step (with_real_masks); it is
    # handed the cache again rather than holding it (the cache holds this)
    key = "cache" if "cache" in kwargs else "past_key_values"
    rest = {k: v for k, v in kwargs.items() if k != key}
    cache.stand_in_masks = lambda c: _transformers_masks(**rest, **{key: c})
    return masks


def _stand_in_masks(handle, cache: UnifiedCache, kwargs: dict):
    """transformers' masks for this step with a stand-in full-attention mask, or None where transformers'
    own are kept (see the module docstring)."""
    embeds = kwargs.get("inputs_embeds", kwargs.get("input_embeds"))
    mask = kwargs.get("attention_mask")
    config = kwargs.get("config")
    if (config is None or not isinstance(embeds, torch.Tensor) or embeds.dim() != 3 or embeds.shape[1] < 2
            or (mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2))
            or any(kwargs.get(k) is not None for k in ("or_mask_function", "and_mask_function", "block_sequence_ids"))
            or not stand_in_enabled(handle)):
        return None
    config = config.get_text_config()
    if config._attn_implementation != "sdpa" or not getattr(config, "is_causal", True):
        return None
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types:
        if not layer_types <= _LAYER_TYPES or "full_attention" not in layer_types:
            return None
    elif any(getattr(config, name, None) is not None for name in ("sliding_window", "attention_chunk_size")):
        return None
    # an empty cache without padding: transformers' SDPA mask is None (its mask-free causal form), built for free
    if int(cache.seq_length) == 0 and not bool(cache.left_pads.any()):
        return None
    batch, tokens = int(embeds.shape[0]), int(embeds.shape[1])
    stand_in = torch.empty((batch, 1, tokens, cache.max_seq_len), dtype=torch.bool, device=embeds.device)
    mark_stand_in(stand_in)
    if not layer_types:
        return stand_in
    masks = {"full_attention": stand_in}
    if "linear_attention" in layer_types:
        from transformers.masking_utils import create_recurrent_attention_mask

        cache_key = "cache" if "cache" in kwargs else "past_key_values"  # transformers 5.24 / 5.17
        # transformers returns None for an all-ones mask, which it finds by reading the mask back (a wait for
        # the GPU each chunk); prepare_step checked the same mask on the host: all ones, and None it is
        host = cache.step_host_mask(mask) if isinstance(mask, torch.Tensor) else None
        recurrent = None if host is not None and bool((host == 1).all()) else mask
        masks["linear_attention"] = create_recurrent_attention_mask(
            config=config, inputs_embeds=embeds, attention_mask=recurrent, position_ids=kwargs.get("position_ids"),
            **{cache_key: cache})
    return masks


def stand_in_read(handle) -> None:
    """A graph compiled for a step with a stand-in read it (the forward wrapper builds transformers' mask and
    runs the step again): say so once."""
    log.info("a prefill graph of %s reads its attention mask after the rewrites (a rewrite refused an attention "
             "site; docs/passes.md): generate() builds transformers' 4-D mask for every prefill step from now on",
             handle._model_name)


def stand_in_of(cache):
    """What builds transformers' masks for the current step of ``cache`` when its full-attention mask is a
    stand-in; None otherwise (any other cache, a real mask)."""
    return getattr(cache, "stand_in_masks", None) if isinstance(cache, UnifiedCache) else None


def with_real_masks(kwargs: dict) -> dict:
    """A forward's keyword arguments with transformers' masks in place of a stand-in (``kwargs`` itself when
    its mask is real); the cache forgets the stand-in. Called by the forward wrapper after a
    :class:`~unimem_compile.passes.manager.StandInRead`, and by the compiled forward's entry when it runs
    without Dynamo (``torch.compiler.set_stance("force_eager")``, Dynamo disabled, ``suppress_errors`` after a
    failed compile): then no rewrite replaced the mask's readers."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    build = stand_in_of(cache)
    if build is None:
        return kwargs
    cache.stand_in_masks = None
    masks = build(cache)
    if isinstance(masks, dict):  # contiguous, as transformers 5.24's prepare_inputs_for_generation hands them
        masks = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in masks.items()}
    elif isinstance(masks, torch.Tensor):
        masks = masks.contiguous()
    return {**kwargs, "attention_mask": masks}
