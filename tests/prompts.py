"""Random left-padded prompts shared by the generate() tests."""

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
