"""Random left-padded prompts and chunked-prefill logits shared by the generate() tests (CPU and GPU)."""

import torch


def left_padded(lengths, gen: torch.Generator, vocab: int = 1024):
    """Prompts of the given lengths, token ids in ``[3, vocab)`` drawn from ``gen``, left-padded with id 0
    to the longest: ``(ids, mask)``, both int64 ``[len(lengths), max(lengths)]`` on the CPU."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[i, width - n:] = 1
    return ids, mask


def generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """The position ids transformers' generate gives left-padded rows: the mask's cumulative sum - 1, pads 0."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def chunked_logits(model, ids: torch.Tensor, mask: torch.Tensor, chunk: int) -> torch.Tensor:
    """Logits ``[B, T, vocab]`` of every position of ``ids [B, T]`` from a model compiled by unimem_compile, the
    sequence fed chunk by chunk as transformers' chunked prefill feeds it (each chunk's ids, the mask up to
    the chunk's end, its positions) through the model's own step preparation, on a fresh cache."""
    from unimem_compile.hf.generate_checks import _cache_kwarg

    cache = model.unimem.new_cache(ids.shape[0])
    cache.chunked_prefill_end = ids.shape[1]  # what generate() sets: a row's pads may outlast a chunk
    pos = generate_positions(mask)
    out = []
    try:
        with torch.no_grad():
            for start in range(0, ids.shape[1], chunk):
                end = min(ids.shape[1], start + chunk)
                inputs = model.prepare_inputs_for_generation(ids[:, start:end], attention_mask=mask[:, :end],
                                                             position_ids=pos[:, start:end], use_cache=True,
                                                             **{_cache_kwarg(model): cache})
                out.append(model(**inputs).logits)
    finally:
        cache.release()
    return torch.cat(out, 1)
