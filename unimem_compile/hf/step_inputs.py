"""What a step's inputs look like to Dynamo: one compiled graph per bucket of query lengths.

A forward's query length ``T`` (tokens per row in this step) picks its graph from :data:`QUERY_LENGTH_BUCKETS`:

* ``T = 1``: the decode graph (a decode step, or a one-token chunk or continuation);
* ``2 <= T <= max_seq_len``: ONE prefill graph with a symbolic ``T``: every prompt length, every chunk of a
  chunked prefill (``prefill_chunk_size``), its shorter last chunk and every multi-token continuation.

(Graphs are also per batch size, until Dynamo makes the batch symbolic, and per presence of padding:
transformers hands the linear-attention layers a padding mask or None, a Python-level difference.) One
symbolic prefill graph costs nothing per step: the length-dependent work in it is matmuls, whose kernels are
chosen at run time, and unimem's ops, which pick their launch configuration from the sizes they get
(``mla_prefill``'s tiles, ``kda_chunk``'s chunk count); more buckets would only add compiles.

:func:`prepare_step_inputs`, called on every compiled forward's keyword arguments, does two things:

1. marks ``T`` dynamic on every input that carries it (``input_ids``, ``position_ids``, the attention
   masks, the cache's write locations) when ``T >= 2``, so even the first prefill compiles the symbolic
   graph instead of one specialised to its length (Dynamo would otherwise specialise the first length and
   recompile at the second);
2. gives ``position_ids`` and the masks a fresh contiguous layout when they are views (transformers' chunked
   prefill passes ``position_ids[..., start:end]`` of the whole prompt: its strides and storage offset
   change with the prompt length and the chunk, and Dynamo guards on both). The values are unchanged.
"""

from __future__ import annotations

import torch

__all__ = ["QUERY_LENGTH_BUCKETS", "prepare_step_inputs"]

#: Query-length buckets ``(first, last)``, inclusive; None = up to ``max_seq_len``. One graph each.
QUERY_LENGTH_BUCKETS = ((1, 1), (2, None))

# the query-length dimension of each input, by rank (masks: [B, T] padding, [B, 1, T, kv] attention)
_MASK_QUERY_DIM = {2: 1, 4: 2}


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it has exactly the contiguous strides from offset 0, else a contiguous copy (same
    values). Exactly: ``is_contiguous()`` ignores the stride of a size-1 dimension, but Dynamo guards on it, so
    the first chunk's ``position_ids[:, :T]`` of a one-row prompt (stride ``[prompt_len, 1]``) would
    otherwise specialise a static graph to the prompt length."""
    if t.storage_offset() == 0 and tuple(t.stride()) == _contiguous_strides(t.shape):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _mark(t: torch.Tensor, dim: int, length: int) -> None:
    if t.dim() > dim and t.shape[dim] == length:
        torch._dynamo.maybe_mark_dynamic(t, dim)


def prepare_step_inputs(kwargs: dict, cache: object = None, dynamic: bool = True) -> dict:
    """The forward's keyword arguments with stable layouts and, for ``T >= 2``, a dynamic query length.

    Args:
        kwargs: the compiled forward's keyword arguments (``input_ids [B, T]``, optional ``position_ids
            [..., T]``, ``attention_mask``: a tensor or a dict of them per layer type, or None).
        cache: the step's ``UnifiedCache`` (its ``write_loc [B, T]`` is marked too), or None.
        dynamic: False marks nothing (the static graphs of ``UNIMEM_PREFILL_GRAPHS``' lengths).

    Returns:
        a new dict: the same arguments, ``position_ids`` and mask tensors replaced by contiguous copies
        where they were views; ``kwargs`` itself is not modified. Tensors are only marked, never resized.
    """
    out = dict(kwargs)
    ids = out.get("input_ids")
    length = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 0
    dynamic = dynamic and length >= 2
    if isinstance(out.get("position_ids"), torch.Tensor):
        out["position_ids"] = _fresh(out["position_ids"])
        if dynamic:
            _mark(out["position_ids"], out["position_ids"].dim() - 1, length)
    masks = out.get("attention_mask")
    if isinstance(masks, dict):
        masks = out["attention_mask"] = {k: _fresh(v) if isinstance(v, torch.Tensor) else v for k, v in masks.items()}
        mask_tensors = [v for v in masks.values() if isinstance(v, torch.Tensor)]
    elif isinstance(masks, torch.Tensor):
        out["attention_mask"] = _fresh(masks)
        mask_tensors = [out["attention_mask"]]
    else:
        mask_tensors = []
    if dynamic:
        torch._dynamo.maybe_mark_dynamic(ids, 1)
        for m in mask_tensors:
            if m.dim() in _MASK_QUERY_DIM:
                _mark(m, _MASK_QUERY_DIM[m.dim()], length)
        loc = getattr(cache, "write_loc", None)
        if isinstance(loc, torch.Tensor):
            _mark(loc, 1, length)
    return out
