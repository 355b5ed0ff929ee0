"""Rewrite ``mla_absorb``: MLA decode on the latent pages with absorbed weights (docs/passes.md).

Before: one query token per row; the cache gathers the whole latent history and transformers' MLA
(``KimiLinearAttention``, ``DeepseekV3Attention``, ``DeepseekV2Attention``) expands it through
``kv_b_proj`` every step::

    full = torch.ops.unimem.mla_gather(arena, v2p, page_table, kv_len, out_offset, T, *G).to(dtype)  # G: MLAGeometry
    latent, k_rot = full[:, None, :, :R], full[:, None, :, R:]            # [B, 1, T, R], [B, 1, T, Dr]
    kv = F.linear(latent, W).view(B, T, H, dn + dv).transpose(1, 2)         # W = kv_b_proj.weight
    k_nope, v = kv.split([dn, dv], -1)
    k = kv.new_empty(B, H, T, dn + Dr); k[..., :dn].copy_(k_nope); k[..., dn:].copy_(k_rot.expand(...))
    o = attention(q, k, v, mask, scale)                                     # [B, H, 1, dv]

where ``attention`` is ``F.scaled_dot_product_attention`` or transformers' eager chain ``matmul -> *scale
-> +mask -> softmax -> cast -> dropout(p=0) -> matmul`` (the chain is matched by
:func:`~.mla_expansion.match_expansion`, which ``mla_prefill`` shares). After (W_UK, W_UV are views of the same
parameter: nothing is copied or baked into the graph, so a reloaded weight is never stale)::

    w = W.view(H, dn + dv, R); w_uk, w_uv = w[:, :dn], w[:, dn:]
    q_lat = torch.bmm(q_nope.squeeze(2).transpose(0, 1), w_uk).transpose(0, 1)     # [B, H, R]
    o_lat = torch.ops.unimem.mla_decode(q_lat, q_rope.squeeze(2), arena, v2p, page_table, kv_len, scale, *G)
    o = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).unsqueeze(2)

This is exact: ``q_nope . (W_UK c) = (q_nope W_UK) . c`` and ``sum_t p_t W_UV c_t = W_UV sum_t p_t c_t``
(the DeepSeek-V2 paper's absorption, section 2.1.2). For DeepSeek RoPE is already applied to q_rope and
to the cached k_rot before the write; Kimi-Linear has none. The attention mask is replaced by the cache's
``kv_len``: the gathered history holds a row's ``kv_len`` tokens after its left pads and zeros elsewhere,
and the mask of a unimem cache admits exactly those tokens (left padding + causal, one query token).

Refused (one log line, graph unchanged): prefill (query length > 1: the absorbed form is slower there;
``mla_prefill`` rewrites those graphs);
``is_causal=True``; dropout with p > 0 in training; attention weights used elsewhere
(``output_attentions``); a ``kv_b_proj`` that is not a plain bias-free ``F.linear`` (biased, quantised,
LoRA); expanded keys or values used outside the attention; shapes that do not fit together.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Graph, Node

from unimem_compile import ops  # noqa: F401  (registers torch.ops.unimem.*)

from .common import Refused, Rewrite, argument, describe, dims, erase_matched, insert_call, is_function, is_op
from . import mla_expansion
from .mla_expansion import Expansion, match_expansion

__all__ = ["MLAAbsorb"]


@dataclasses.dataclass
class _Site:
    expansion: Expansion
    q_nope: Node | tuple[Node, slice]
    q_rope: Node | tuple[Node, slice]
    optional: list[Node]  # the query's own assembly, erased when the rewrite leaves it unused


def _query_parts(q: Node, nope: int, rope: int) -> tuple[Node | tuple[Node, slice], Node | tuple[Node, slice],
                                                          list[Node]]:
    """``(q_nope, q_rope, nodes that become unused)``: the inputs of ``cat([q_nope, q_rope], -1)`` when
    the query is built that way (DeepSeek), else slices of the query still to be inserted (Kimi)."""
    if is_function(q, torch.cat):
        parts = argument(q, 0, "tensors")
        if (len(parts) == 2 and argument(q, 1, "dim", 0) in (-1, 3)
                and (dims(parts[0]) or (None,))[-1] == nope and (dims(parts[1]) or (None,))[-1] == rope):
            return parts[0], parts[1], [q]
    return (q, slice(None, nope)), (q, slice(nope, None)), []


def _decode_only(query_length: object) -> None:
    if not isinstance(query_length, int):
        raise Refused("prefill (symbolic query length)")
    if query_length != 1:
        raise Refused(f"prefill (query length {query_length} > 1)")


def _match(gather: Node) -> _Site:
    ex = match_expansion(gather, _decode_only)
    att = ex.att
    if att.is_causal:
        raise Refused("is_causal=True")
    if att.mask is not None:
        m_dims = dims(att.mask)
        if m_dims is None or len(m_dims) != 4 or m_dims[-1] != ex.max_len or m_dims[2] not in (1, None):
            raise Refused(f"the attention mask {describe(att.mask)} is not [B, 1, 1, {ex.max_len}]")
    q_nope, q_rope, q_nodes = _query_parts(att.q, ex.nope, ex.rope)
    return _Site(ex, q_nope, q_rope, q_nodes)


class MLAAbsorb(Rewrite):
    """``mla_absorb``: see the module docstring. Sites: every ``mla_gather`` call."""

    name = "mla_absorb"
    extra_sources = (mla_expansion.__file__,)  # the chain it matches

    def sites(self, graph: Graph):
        return [n for n in graph.nodes if is_op(n, torch.ops.unimem.mla_gather)]

    def match(self, graph: Graph, gather: Node) -> _Site:
        return _match(gather)

    def replace(self, graph: Graph, site: _Site) -> None:
        ex = site.expansion
        att = ex.att
        arena, v2p, page_table, kv_len = (ex.arguments[name] for name in ("arena", "v2p", "page_table", "kv_len"))
        like = att.out

        def call(target, *args, method=False):
            return insert_call(graph, target, args, like=like, method=method)

        def part(spec):
            if isinstance(spec, Node):
                return spec
            base, cols = spec
            return call(operator.getitem, base, (Ellipsis, cols))

        with graph.inserting_before(att.out):
            w = call("view", ex.weight, ex.heads, ex.nope + ex.v_dim, ex.rank, method=True)
            w_uk = call(operator.getitem, w, (slice(None), slice(None, ex.nope)))
            w_uv = call(operator.getitem, w, (slice(None), slice(ex.nope, None)))
            q_nope, q_rope = part(site.q_nope), part(site.q_rope)
            # heads as the bmm batch: the per-head weights are read once, never broadcast over rows
            q_heads = call("transpose", call("squeeze", q_nope, 2, method=True), 0, 1, method=True)
            q_lat = call("transpose", call(torch.bmm, q_heads, w_uk), 0, 1, method=True)
            q_rot = call("squeeze", q_rope, 2, method=True)
            o_lat = call(torch.ops.unimem.mla_decode, q_lat, q_rot, arena, v2p, page_table, kv_len, att.scale,
                         *ex.geometry.args())
            o_heads = call(torch.bmm, call("transpose", o_lat, 0, 1, method=True),
                           call("transpose", w_uv, 1, 2, method=True))
            out = call("unsqueeze", call("transpose", o_heads, 0, 1, method=True), 2, method=True)
        att.out.replace_all_uses_with(out)
        erase_matched(graph, ex.matched, optional=site.optional)
