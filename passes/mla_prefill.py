"""Rewrite ``mla_prefill``: MLA prefill attention on the latent pages, its cost following the tokens present
(docs/passes.md).

Before: a chunk of ``T > 1`` new tokens per row (or a symbolic ``T``); the cache gathers the row's latent
history over ``M = max_seq_len`` positions and transformers' MLA expands all of them through ``kv_b_proj``
before a dense attention shaped ``[T, M]`` (the chain of :mod:`~.mla_expansion`)::

    full = torch.ops.unimem.mla_gather(arena, v2p, page_table, kv_len, out_offset, M, *G).to(dtype)
    ... kv = F.linear(full[..., :R], W) ... k = [k_nope | k_rot]; v ...        # [B, H, M, dn + Dr], [B, H, M, dv]
    o = attention(q, k, v, mask [B, 1, T, M], scale)                          # [B, H, T, dv]

After (one node; ``W`` is the ``kv_b_proj`` parameter itself, read by the op, never copied)::

    o = torch.ops.unimem.mla_prefill(q, arena, v2p, page_table, kv_len, None, W, scale, workspace_tokens, *G)

which gathers and expands only the rows' stored tokens, in pieces of at most ``workspace_tokens`` packed
tokens (:mod:`unimem_compile.ops.mla_prefill`). It is exact up to summation order: the same expansion in the
query's dtype, fp32 scores, softmax merged across pieces by log-sum-exp. The mask is replaced by
``kv_len``: a unimem cache stores a row's tokens after its left pads, and transformers' mask for it admits,
for query ``t`` (logical position ``seq_len + t``), exactly the stored tokens up to that position, i.e.
stored indices ``<= kv_len - T + t`` (what the op computes; a left pad's query gets zeros, where the mask
admits no key). The gathered history, its expansion and the dense scores disappear from the graph; the
mask stays a graph input that nothing reads.

Accepted attention forms: SDPA with the ``[B, 1, T, M]`` mask (``is_causal=False``), transformers' eager
chain with that mask, and transformers' first-prefill form without a mask: keys and values sliced to their
first ``T`` positions and ``is_causal=True``. transformers emits that form only when the cache is empty and
the chunk has no padding (``masking_utils._ignore_causal_mask_sdpa`` with ``q_offset == 0``; the slices
come from ``integrations/sdpa_attention.py``), and there, too, query ``t`` sees stored tokens ``0..t``.

How the op learns its piece count: ``kv_len_host`` is None in the graph (a host copy as a graph input would
need ``mla_gather``'s frozen schema to carry it), and the op takes the copy of ``kv_len``'s lengths that the
forward running the step publishes beside the graph (``unimem_compile.ops.step_context``); only where none is
published does it read ``kv_len`` back (one device synchronisation per MLA layer and prefill step on a GPU;
free on the CPU). docs/passes.md gives the measurements.

Refused (one log line, graph unchanged): decode graphs (query length 1: ``mla_absorb``'s); dropout with
p > 0; ``is_causal=True`` in any other form (upper-left causal alignment over a longer history); a mask that
is not ``[B, 1, T, M]``; a ``kv_b_proj`` that is not a plain bias-free ``F.linear`` (biased, quantised,
LoRA); attention weights or expanded keys / values used elsewhere; shapes or dtypes that do not fit.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from unimem_compile import ops  # noqa: F401  (registers torch.ops.unimem.*)
from unimem_compile.ops.mla_prefill import WORKSPACE_TOKENS

from .common import Refused, Rewrite, describe, dims, erase_matched, insert_call, is_op, value
from . import mla_expansion
from .mla_expansion import Expansion, match_expansion, query_length_text, same_size

__all__ = ["MLAPrefill"]


def _prefill_only(query_length: object) -> None:
    if isinstance(query_length, int) and query_length == 1:
        raise Refused("decode (query length 1: mla_absorb's)")


def _check_mask_and_causality(ex: Expansion) -> None:
    att, T, M = ex.att, ex.query_length, ex.max_len
    if att.is_causal:
        if att.mask is not None:
            raise Refused("is_causal=True with a mask")
        causal_prefix = same_size(ex.prefix_length, T) if ex.prefix else same_size(M, T)
        if not causal_prefix:
            raise Refused(f"is_causal=True over {'a prefix' if ex.prefix else 'all'} of the {M}-position history "
                          f"for {query_length_text(T)} queries (upper-left causal alignment)")
        return
    if ex.prefix:
        raise Refused("keys and values sliced to a prefix of the history without is_causal")
    if att.mask is None:
        raise Refused("no attention mask and is_causal=False (every query would see the whole history)")
    mask = value(att.mask)
    m_dims = dims(att.mask)
    if (m_dims is None or len(m_dims) != 4 or m_dims[1] != 1 or m_dims[3] != M
            or not same_size(mask.shape[2], T)):
        raise Refused(f"the attention mask {describe(att.mask)} is not [B, 1, {query_length_text(T)}, {M}]")


class MLAPrefill(Rewrite):
    """``mla_prefill``: see the module docstring. Sites: every ``mla_gather`` call.

    Args:
        workspace_tokens: the op's piece size in packed history tokens (>= 1; part of :meth:`settings`, so
            of the compile-cache key): bounds its memory, ``workspace_tokens x (R + Dr + H * (dn + dv))``
            elements of the query's dtype, whatever the history's length.

    Raises:
        ValueError: a ``workspace_tokens`` that is not an int >= 1.
    """

    name = "mla_prefill"
    extra_sources = (mla_expansion.__file__,)  # the chain it matches

    def __init__(self, workspace_tokens: int = WORKSPACE_TOKENS):
        super().__init__()
        if isinstance(workspace_tokens, bool) or not isinstance(workspace_tokens, int) or workspace_tokens < 1:
            raise ValueError(f"workspace_tokens must be an int >= 1, got {workspace_tokens!r}")
        self.workspace_tokens = workspace_tokens

    def settings(self) -> dict:
        return {"workspace_tokens": self.workspace_tokens}

    def sites(self, graph: Graph):
        return [n for n in graph.nodes if is_op(n, torch.ops.unimem.mla_gather)]

    def match(self, graph: Graph, gather: Node) -> Expansion:
        ex = match_expansion(gather, _prefill_only)
        _check_mask_and_causality(ex)
        return ex

    def replace(self, graph: Graph, ex: Expansion) -> None:
        att = ex.att
        arena, v2p, page_table, kv_len = (ex.arguments[name] for name in ("arena", "v2p", "page_table", "kv_len"))
        with graph.inserting_before(att.out):
            out = insert_call(graph, torch.ops.unimem.mla_prefill,
                              (att.q, arena, v2p, page_table, kv_len, None, ex.weight, att.scale,
                               self.workspace_tokens, *ex.geometry.args()), like=att.out)
        att.out.replace_all_uses_with(out)
        erase_matched(graph, ex.matched)
