"""Logits processing, sampling and the append step of one decode step, on the device, for a batch of rows
with different settings.

Everything here is plain torch with static shapes: no ``.item()``, no ``nonzero``, no boolean indexing, no
branch on a tensor's value. One call can therefore be captured in a ``torch.cuda.CUDAGraph`` and compiled by
``torch.compile(fullgraph=True)``; ``sampling`` is the only Python-level switch (one graph per value).

Semantics are transformers' (5.x, ``generation/logits_process.py`` and ``GenerationMixin._sample``), row by
row, in the order ``_get_logits_processor`` builds them for ``num_beams=1`` (``min_tokens_to_keep = 1``,
filter value ``-inf``), on the float32 logits:

1. ``RepetitionPenaltyLogitsProcessor``: a present token's score ``s`` becomes ``s * p`` if ``s < 0`` else
   ``s / p``.
2. ``MinLengthLogitsProcessor`` / ``MinNewTokensLengthLogitsProcessor``: EOS ids score ``-inf`` while the
   row has generated fewer than ``min_new`` tokens.
   Greedy rows stop here and take the argmax (first index on ties), as transformers applies no warper
   when ``do_sample=False``.
3. ``TemperatureLogitsWarper``: ``s / T``.
4. ``TopKLogitsWarper``: scores below the k-th largest become ``-inf`` (ties at the threshold are kept).
5. ``TopPLogitsWarper``: sort ascending, cumulative softmax; sorted positions whose cumulative probability
   is ``<= 1 - top_p`` become ``-inf``, except the largest.
6. ``MinPLogitsWarper``: tokens whose probability is below ``min_p`` times the largest become ``-inf``.
   Sampled rows draw from ``softmax`` of the result.

A setting that is off is an exact no-op (``x / 1``, ``k = V``, top-p masked off, ``min_p = 0``), so the
values equal transformers' for each row's own processor list, bitwise in eager mode on the CPU (tests/runner).
Two details keep them bitwise on CUDA too: transformers divides by a Python float, which CUDA computes as a
multiplication by the float32 reciprocal (ATen's ``div_true_kernel_cuda``), so on CUDA the step multiplies
by ``inv_temperature`` / ``inv_penalty``; and ``top_p_cut`` holds ``float32(1 - top_p)`` computed in
float64, as torch compares a float32 tensor with the Python float ``1 - top_p``. One sort serves top-k and
top-p: masking the sorted scores below the top-k threshold yields exactly the tensor transformers' top-p
sorts (the masked prefix is all ``-inf``, the rest in the same order). The sort is stable; transformers'
(``stable=False``) may order exactly tied scores differently, which shows only when top-p cuts through a
group of ties (the CPU sort orders ties by index, so the CPU tests with bf16-rounded logits pass bitwise).

Cost with ``sampling=True``: one stable sort of ``[n, V]`` float32 and one Philox block per two vocabulary
ids per row, per step; ``sampling=False`` does neither.

Sampling is the Gumbel-max trick with counter-based noise (:mod:`.rng`): ``argmax(scores + G)`` with
``G[r, v] = gumbel(seed[r], count[r], v)``, in float64. A row's token depends only on its scores, its seed
and its token index, not on the batch; the draws follow the same distribution as stock's
``torch.multinomial(softmax(scores))`` but are not stock's draws.
"""

from __future__ import annotations

import torch

from .rng import gumbel
from .rows import Rows

__all__ = ["process_logits", "sample", "append_tokens", "decode_step"]

_NEG_INF = float("-inf")


def _check_logits(logits: torch.Tensor, rows: Rows) -> None:
    n, vocab = rows.presence.shape
    if logits.dim() != 2 or tuple(logits.shape) != (n, vocab):
        raise ValueError(f"logits have shape {list(logits.shape)}, expected [{n}, {vocab}] (rows, vocab)")


def process_logits(logits: torch.Tensor, rows: Rows, *, sampling: bool = True) -> torch.Tensor:
    """Each row's processed scores, as transformers' logits processors (and, for rows with
    ``do_sample``, its warpers) would produce them for that row alone (module docstring).

    Args:
        logits: ``[n, V]``, any floating dtype (the last position's logits; not modified).
        rows: the step's rows (:meth:`RowState.view`), read only.
        sampling: False skips the warpers for every row (no sort): exact only when no row samples
            (:meth:`RowState.any_sampling` says so from the host).

    Returns:
        float32 ``[n, V]``, a new tensor.

    Raises:
        ValueError: ``logits`` not ``[n, V]`` (raised while tracing, so a compiled step never checks).
    """
    _check_logits(logits, rows)
    n, vocab = logits.shape
    scores = logits.to(torch.float32)  # transformers: outputs.logits[:, -1].to(dtype=torch.float32)
    on_cuda = scores.device.type == "cuda"

    penalty = rows.penalty[:, None]
    shrunk = scores * rows.inv_penalty[:, None] if on_cuda else scores / penalty
    scores = torch.where(rows.presence, torch.where(scores < 0, scores * penalty, shrunk), scores)

    # EOS ids of rows under min_new; -1 (none) and ids >= V go to a spare column that is dropped
    suppress = (rows.count < rows.min_new)[:, None] & (rows.eos >= 0) & (rows.eos < vocab)
    eos_cols = torch.where(suppress, rows.eos, vocab)
    eos_mask = torch.zeros(n, vocab + 1, dtype=torch.bool, device=scores.device).scatter_(1, eos_cols, True)
    scores = torch.where(eos_mask[:, :vocab], _NEG_INF, scores)
    if not sampling:
        return scores

    warped = scores * rows.inv_temperature[:, None] if on_cuda else scores / rows.temperature[:, None]

    sorted_scores, order = torch.sort(warped, dim=-1, stable=True)  # ascending, as TopPLogitsWarper
    k = torch.where(rows.top_k > 0, rows.top_k, vocab).to(torch.int64)  # 0 = off: k = V keeps everything
    threshold = sorted_scores.gather(1, (vocab - k)[:, None])  # the k-th largest score
    warped = warped.masked_fill(warped < threshold, _NEG_INF)
    sorted_scores = sorted_scores.masked_fill(sorted_scores < threshold, _NEG_INF)

    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    cut = rows.top_p_cut[:, None]
    keep_last = torch.arange(vocab, device=scores.device)[None, :] == vocab - 1
    drop_sorted = (cumulative <= cut) & (cut > 0) & ~keep_last
    warped = warped.masked_fill(drop_sorted.scatter(1, order, drop_sorted), _NEG_INF)

    # transformers also re-keeps the most probable token; it is never dropped when min_p <= 1
    probs = warped.softmax(dim=-1)
    warped = warped.masked_fill(probs < rows.min_p[:, None] * probs.amax(dim=-1, keepdim=True), _NEG_INF)

    return torch.where(rows.do_sample[:, None], warped, scores)


def sample(scores: torch.Tensor, rows: Rows, *, sampling: bool = True) -> torch.Tensor:
    """The next token of each row: a draw from ``softmax(scores)`` where ``do_sample``, else the argmax.

    Args:
        scores: float32 ``[n, V]`` (:func:`process_logits`'s output).
        rows: the step's rows, read only (the draw uses ``seed`` and ``count`` as token index).
        sampling: False takes the argmax for every row (no random numbers).

    Returns:
        int64 ``[n]`` (finished rows included: :func:`append_tokens` replaces theirs by the pad token).
    """
    if not sampling:
        return scores.argmax(dim=-1)
    n, vocab = scores.shape
    noise = gumbel(rows.seed, rows.count, vocab).masked_fill(~rows.do_sample[:, None], 0.0)
    # float64 is exact for float32 scores, so a greedy row's argmax (first index on ties) is unchanged
    return (scores.to(torch.float64) + noise).argmax(dim=-1)


def append_tokens(tokens: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Append each unfinished row's token and update its bookkeeping, in place.

    For each row that was not finished: ``out[r, count[r]] = token``, ``presence[r, token] = True``,
    ``count[r] += 1``, and the row finishes if the token is one of its EOS ids or ``count`` reached
    ``max_new`` (transformers' ``EosTokenCriteria`` and ``MaxLengthCriteria``; ``min_new`` acts through
    the EOS suppression of :func:`process_logits`). A finished row is never un-finished; it emits its pad
    token and changes nothing else (transformers writes pad tokens for finished rows).

    Args:
        tokens: int64 ``[n]`` (:func:`sample`'s output).
        rows: the step's rows; ``count``, ``presence``, ``finished``, ``out`` and ``last_token`` are
            updated in place.

    Returns:
        ``rows.last_token`` (int64 ``[n]``): the appended tokens, pad for finished rows: the next step's
        input ids.
    """
    vocab = rows.presence.shape[1]
    live = ~rows.finished
    tokens = torch.where(live, tokens, rows.pad)

    # one index per row, so writing back the gathered value for finished rows is a deterministic no-op
    pos = rows.count.to(torch.int64).clamp(max=rows.out.shape[1] - 1)[:, None]
    rows.out.scatter_(1, pos, torch.where(live[:, None], tokens[:, None], rows.out.gather(1, pos)))
    col = tokens.clamp(max=vocab - 1)[:, None]  # a pad id may lie outside the lm_head's vocabulary
    rows.presence.scatter_(1, col, rows.presence.gather(1, col) | live[:, None])

    count = rows.count + live.to(torch.int32)
    rows.count.copy_(count)
    hit_eos = (tokens[:, None] == rows.eos).any(dim=-1)
    rows.finished.copy_(rows.finished | (hit_eos | (count >= rows.max_new)))
    rows.last_token.copy_(tokens)
    return rows.last_token


def decode_step(logits: torch.Tensor, rows: Rows, *, sampling: bool = True) -> torch.Tensor:
    """:func:`process_logits`, :func:`sample` and :func:`append_tokens` in one call (one step's tail).

    Args:
        logits: ``[n, V]`` logits of each row's last position (not modified).
        rows: :meth:`RowState.view` of the step's bucket (updated in place, see :func:`append_tokens`).
        sampling: False for a batch where no row samples (:meth:`RowState.any_sampling`).

    Returns:
        ``rows.last_token``: int64 ``[n]``, the next step's input ids (pad for finished rows).
    """
    return append_tokens(sample(process_logits(logits, rows, sampling=sampling), rows, sampling=sampling), rows)
