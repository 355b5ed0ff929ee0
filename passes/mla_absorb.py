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
-> +mask -> softmax -> cast -> dropout(p=0) -> matmul``. After (W_UK, W_UV are views of the same
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

Refused (one log line, graph unchanged): prefill (query length > 1: the absorbed form is slower there);
``is_causal=True``; dropout with p > 0 in training; attention weights used elsewhere
(``output_attentions``); a ``kv_b_proj`` that is not a plain bias-free ``F.linear`` (biased, quantised,
LoRA); expanded keys or values used outside the attention; shapes that do not fit together.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from unimem_compile import ops  # noqa: F401  (registers torch.ops.unimem.*)
from unimem_compile.ops.common import COMPUTE_DTYPES
from unimem_compile.ops.geometry import MLAGeometry

from .common import (
    Refused,
    Rewrite,
    argument,
    cast_of,
    check_closed,
    describe,
    dims,
    erase_matched,
    insert_call,
    is_function,
    is_method,
    is_op,
    last_dim_slice,
    only_user,
    op_arguments,
    split_item,
    strip,
    value,
)

__all__ = ["MLAAbsorb"]

_SDPA = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_LINEAR = (torch._C._nn.linear, F.linear)
_MATMUL = (torch.matmul, operator.matmul, torch.bmm)
_MULS = (operator.mul, torch.mul)
_DIVS = (operator.truediv, torch.div)
_ADDS = (operator.add, torch.add)


@dataclasses.dataclass
class _Attention:
    """One attention computation, normalised over its spellings."""

    out: Node  # the node whose value is the attention output [B, H, Q, dv]
    q: Node
    k: Node
    v: Node
    mask: Node | None
    scale: float
    dropout: float
    is_causal: bool
    nodes: list[Node]  # the attention's own nodes, erased by the rewrite


# ---------------------------------------------------------------------------------------- attention forms
def _sdpa(node: Node) -> _Attention | None:
    if not is_function(node, *_SDPA):
        return None
    q, k, v = node.args[:3]
    scale = argument(node, 6, "scale", None)
    if scale is None:
        head = (dims(q) or (None,))[-1]
        if head is None:
            raise Refused("SDPA without a scale on a query of symbolic head size")
        scale = head ** -0.5
    if not isinstance(scale, (int, float)):
        raise Refused("the SDPA scale is not a constant")
    if argument(node, 7, "enable_gqa", False) and (dims(q) or (0, 0))[1] != (dims(k) or (0, 0))[1]:
        raise Refused("grouped-query SDPA (query and key head counts differ)")
    return _Attention(
        out=node, q=q, k=k, v=v, mask=argument(node, 3, "attn_mask", None), scale=float(scale),
        dropout=float(argument(node, 4, "dropout_p", 0.0)), is_causal=bool(argument(node, 5, "is_causal", False)),
        nodes=[node],
    )


# The eager chain between its two matmuls, walked from the second matmul's first input back to the scores.
# Each step recognises one spelling of one operation (returning its chain input and what it implies);
# optional steps may be absent. A new spelling is a new entry, not a new copy of the walk.
def _step_dropout(node: Node):
    if not (is_function(node, F.dropout, torch.dropout) or is_method(node, "dropout")):
        return None
    p = argument(node, 1, "p", 0.5)
    training = argument(node, 2, "training", True)
    if not isinstance(p, (int, float)) or not isinstance(training, bool):
        raise Refused("attention dropout with a non-constant p or training flag")
    return node.args[0], {"dropout": float(p) if training else 0.0}


def _step_cast(node: Node):
    cast = cast_of(node)
    return None if cast is None else (cast[0], {})


def _step_softmax(node: Node):
    if not (is_function(node, F.softmax, torch.softmax) or is_method(node, "softmax")):
        return None
    dim = argument(node, 1, "dim", None)
    if dim not in (-1, len(dims(node) or ()) - 1):
        raise Refused(f"softmax over dim {dim}, not the key dimension")
    return node.args[0], {}


def _scores_like(node: object) -> bool:
    return is_function(node, *_MULS, *_DIVS, *_MATMUL)


def _step_mask(node: Node):
    if not is_function(node, *_ADDS) or len(node.args) != 2:
        return None
    a, b = node.args
    scores, mask = (a, b) if _scores_like(a) else (b, a)
    return scores, {"mask": mask}


def _step_scale(node: Node):
    if not is_function(node, *_MULS, *_DIVS) or len(node.args) != 2:
        return None
    a, b = node.args
    const, scores = (b, a) if isinstance(b, (int, float)) else (a, b)
    if not isinstance(const, (int, float)) or not isinstance(scores, Node):
        raise Refused("the attention scores are scaled by a tensor, not a constant")
    if is_function(node, *_DIVS):
        if scores is not a:
            return None
        const = 1.0 / const
    return scores, {"scale": float(const)}


_EagerStep = tuple[str, Callable[[Node], tuple[Node, dict] | None], bool]
_EAGER_STEPS: tuple[_EagerStep, ...] = (
    ("dropout", _step_dropout, True),
    ("cast", _step_cast, True),
    ("softmax", _step_softmax, False),
    ("mask", _step_mask, True),
    ("scale", _step_scale, True),
)
_TRANSPOSE_LAST = ({2, 3}, {-2, -1}, {2, -1}, {-2, 3})


def _eager(node: Node) -> _Attention | None:
    if not is_function(node, *_MATMUL) or len(node.args) != 2:
        return None
    probs, v = node.args
    found: dict = {"scale": 1.0, "dropout": 0.0, "mask": None}
    chain = [node]
    current = probs
    for name, step, optional in _EAGER_STEPS:
        result = step(current) if isinstance(current, Node) else None
        if result is None:
            if optional:
                continue
            raise Refused(f"eager attention: expected {name}, found {describe(current)}")
        if len(current.users) != 1:
            raise Refused(f"the attention's {name} output is used elsewhere (output_attentions?)")
        chain.append(current)
        current, implied = result
        found.update(implied)
    if not is_function(current, *_MATMUL) or len(current.args) != 2 or len(current.users) != 1:
        raise Refused(f"eager attention: expected the q @ k^T scores, found {describe(current)}")
    q, k_t = current.args
    if not (is_method(k_t, "transpose") and set(k_t.args[1:3]) in _TRANSPOSE_LAST) or len(k_t.users) != 1:
        raise Refused("eager attention: the keys are not transposed over their last two dimensions")
    chain += [current, k_t]
    return _Attention(out=node, q=q, k=k_t.args[0], v=v, mask=found["mask"], scale=found["scale"],
                      dropout=found["dropout"], is_causal=False, nodes=chain)


#: Attention spellings, tried in order on the node that consumes the expanded values.
ATTENTION_FORMS = (_sdpa, _eager)


def _attention(consumer: Node) -> _Attention:
    for form in ATTENTION_FORMS:
        att = form(consumer)
        if att is not None:
            return att
    # a prefill without padding slices the history to the prompt before a causal SDPA: say "prefill", the
    # reason that matters, rather than the slice
    node = consumer
    for _ in range(3):
        if len(node.users) != 1:
            break
        node = next(iter(node.users))
        for form in ATTENTION_FORMS:
            try:
                att = form(node)
            except Refused:
                att = None
            q_dims = dims(att.q) if att is not None else None
            if q_dims is not None and len(q_dims) == 4 and q_dims[2] != 1:
                raise Refused("prefill (symbolic query length)" if q_dims[2] is None
                              else f"prefill (query length {q_dims[2]} > 1)")
    raise Refused(f"the expanded values feed {describe(consumer)}, not SDPA or an eager attention")


# ---------------------------------------------------------------------------------------- the match
@dataclasses.dataclass
class _Site:
    gather: Node
    arguments: dict  # the gather's arguments by schema name
    geometry: MLAGeometry
    weight: Node
    heads: int
    nope: int  # dn
    v_dim: int  # dv
    rank: int  # R
    rope: int  # Dr
    q_nope: Node | tuple[Node, slice]
    q_rope: Node | tuple[Node, slice]
    att: _Attention
    matched: list[Node]
    optional: list[Node]


def _key_sources(k: Node, att: _Attention, nope: int, rope: int) -> tuple[Node, Node, list[Node]]:
    """The tensors the key is assembled from (``k_nope``, ``k_rot``) and the assembly's nodes.

    Forms: ``k = x.new_empty(...); k[..., :dn].copy_(k_nope); k[..., dn:].copy_(k_rot)`` (transformers'
    ``expand_kv``), or ``torch.cat([k_nope, k_rot], -1)``."""
    if is_function(k, torch.cat):
        parts = argument(k, 0, "tensors")
        if len(parts) != 2 or argument(k, 1, "dim", 0) not in (-1, 3):
            raise Refused("the key is a concatenation of other than [k_nope, k_rot] on the last dimension")
        return parts[0], parts[1], [k]
    if not is_method(k, "new_empty"):
        raise Refused(f"the key comes from {describe(k)}, not an assembly of k_nope and k_rot")
    sources: dict[tuple[int, int], Node] = {}
    nodes = [k]
    for user in k.users:
        if user in att.nodes:
            continue
        sliced = last_dim_slice(user)
        copy = only_user(user)
        if sliced is None or sliced[0] is not k or not is_method(copy, "copy_") or copy.args[0] is not user:
            raise Refused(f"the assembled key is also used by {describe(user)}")
        sources[sliced[1:]] = copy.args[1]
        nodes += [user, copy]
    if set(sources) != {(0, nope), (nope, nope + rope)}:
        raise Refused(f"the key is assembled from column ranges {sorted(sources)}, not [0:{nope}] and "
                      f"[{nope}:{nope + rope}]")
    return sources[(0, nope)], sources[(nope, nope + rope)], nodes


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


def _match(gather: Node) -> _Site:
    arguments = op_arguments(gather)
    geometry = MLAGeometry.from_arguments(arguments)
    max_len, rank, rope = arguments["max_len"], geometry.kv_lora_rank, geometry.qk_rope_head_dim
    full = gather
    cast = only_user(gather)
    if cast is not None and cast_of(cast) is not None:
        full = cast
    slices = {}
    for user in full.users:
        sliced = last_dim_slice(user)
        if sliced is None:
            raise Refused(f"the gathered history is read by {describe(user)}, not by latent/rope slices")
        slices[sliced[1:]] = user
    latent, k_rot_full = slices.get((0, rank)), slices.get((rank, rank + rope))
    if latent is None or k_rot_full is None or len(slices) != 2:
        raise Refused(f"the gathered history is sliced into {sorted(slices)}, not [0:{rank}] and "
                      f"[{rank}:{rank + rope}]")

    # kv_b_proj: a plain, bias-free F.linear of the latent
    linear = only_user(latent)
    if not is_function(linear, *_LINEAR) or linear.args[0] is not latent:
        raise Refused(f"kv_b_proj is not a plain F.linear (the latent feeds {describe(linear)})")
    if argument(linear, 2, "bias", None) is not None:
        raise Refused("kv_b_proj has a bias")
    weight = linear.args[1]
    w_dims = dims(weight)
    if w_dims is None or len(w_dims) != 2 or w_dims[1] != rank or w_dims[0] is None:
        raise Refused(f"kv_b_proj's weight {describe(weight)} is not [H * (dn + dv), {rank}]")

    # .view(B, T, H, dn + dv).transpose(1, 2).split([dn, dv], -1)
    view = only_user(linear)
    v_dims = dims(view)
    if not is_method(view, "view", "reshape") or v_dims is None or len(v_dims) != 4 or v_dims[1] != max_len:
        raise Refused(f"kv_b_proj's output is reshaped by {describe(view)}, not into [B, T, H, dn + dv]")
    heads, head_dim = v_dims[2], v_dims[3]
    if heads is None or head_dim is None or heads * head_dim != w_dims[0]:
        raise Refused(f"kv_b_proj's output is viewed as {list(v_dims)}, not [B, T, H, dn + dv]")
    transpose = next(iter(view.users)) if len(view.users) == 1 else None
    if not is_method(transpose, "transpose") or set(transpose.args[1:3]) != {1, 2}:
        raise Refused("the expanded history is not transposed to [B, H, T, dn + dv]")
    items = {}
    for user in transpose.users:
        for item in user.users:
            found = split_item(item)
            if found is not None and found[0] is user:
                items[found[1]] = (item, found)
    if set(items) != {0, 1}:
        raise Refused("the expanded history is not split into k_nope and v")
    k_nope, (split, _, sizes, _) = items[0]
    v = items[1][0]
    if len(sizes) != 2 or sizes[0] + sizes[1] != head_dim:
        raise Refused(f"the expanded history is split into {sizes}, not [dn, dv]")
    nope, v_dim = sizes

    consumer = only_user(v)
    if consumer is None:
        raise Refused("the expanded values have several users")
    att = _attention(consumer)
    if att.v is not v:
        raise Refused("the attention's values are not the expanded history")

    k_nope_src, k_rot_src, key_nodes = _key_sources(att.k, att, nope, rope)
    k_rot, expands = strip(k_rot_src, ("expand",))
    if k_nope_src is not k_nope or k_rot is not k_rot_full:
        raise Refused("the key is not assembled from this history's k_nope and k_rot")

    q_dims = dims(att.q)
    if q_dims is None or len(q_dims) != 4 or q_dims[1] != heads or q_dims[3] != nope + rope:
        raise Refused(f"the query {describe(att.q)} is not [B, {heads}, Q, {nope} + {rope}]")
    if q_dims[2] != 1:
        raise Refused("prefill (symbolic query length)" if q_dims[2] is None else f"prefill (query length {q_dims[2]} > 1)")
    if att.is_causal:
        raise Refused("is_causal=True")
    if att.dropout > 0:
        raise Refused(f"attention dropout p={att.dropout}")
    if att.mask is not None:
        m_dims = dims(att.mask)
        if m_dims is None or len(m_dims) != 4 or m_dims[-1] != max_len or m_dims[2] not in (1, None):
            raise Refused(f"the attention mask {describe(att.mask)} is not [B, 1, 1, {max_len}]")
    q_dtype = value(att.q).dtype
    for name, node in (("kv_b_proj weight", weight), ("expanded values", v)):
        if value(node).dtype != q_dtype:
            raise Refused(f"the {name} are {value(node).dtype}, the query {q_dtype}")
    if q_dtype not in COMPUTE_DTYPES:
        raise Refused(f"the query is {q_dtype}; mla_decode takes {COMPUTE_DTYPES}")

    q_nope, q_rope, q_nodes = _query_parts(att.q, nope, rope)
    matched = [*att.nodes, *key_nodes, *expands, split, k_nope, v, transpose, view, linear, latent, k_rot_full,
               gather] + ([full] if full is not gather else [])
    check_closed(matched, exits=[att.out])
    return _Site(gather, arguments, geometry, weight, heads, nope, v_dim, rank, rope, q_nope, q_rope, att, matched,
                 q_nodes)


class MLAAbsorb(Rewrite):
    """``mla_absorb``: see the module docstring. Sites: every ``mla_gather`` call."""

    name = "mla_absorb"

    def sites(self, graph: Graph):
        return [n for n in graph.nodes if is_op(n, torch.ops.unimem.mla_gather)]

    def match(self, graph: Graph, gather: Node) -> _Site:
        return _match(gather)

    def replace(self, graph: Graph, site: _Site) -> None:
        att = site.att
        arena, v2p, page_table, kv_len = (site.arguments[name] for name in ("arena", "v2p", "page_table", "kv_len"))
        like = att.out

        def call(target, *args, method=False):
            return insert_call(graph, target, args, like=like, method=method)

        def part(spec):
            if isinstance(spec, Node):
                return spec
            base, cols = spec
            return call(operator.getitem, base, (Ellipsis, cols))

        with graph.inserting_before(att.out):
            w = call("view", site.weight, site.heads, site.nope + site.v_dim, site.rank, method=True)
            w_uk = call(operator.getitem, w, (slice(None), slice(None, site.nope)))
            w_uv = call(operator.getitem, w, (slice(None), slice(site.nope, None)))
            q_nope, q_rope = part(site.q_nope), part(site.q_rope)
            # heads as the bmm batch: the per-head weights are read once, never broadcast over rows
            q_heads = call("transpose", call("squeeze", q_nope, 2, method=True), 0, 1, method=True)
            q_lat = call("transpose", call(torch.bmm, q_heads, w_uk), 0, 1, method=True)
            q_rot = call("squeeze", q_rope, 2, method=True)
            o_lat = call(torch.ops.unimem.mla_decode, q_lat, q_rot, arena, v2p, page_table, kv_len, att.scale,
                         *site.geometry.args())
            o_heads = call(torch.bmm, call("transpose", o_lat, 0, 1, method=True),
                           call("transpose", w_uv, 1, 2, method=True))
            out = call("unsqueeze", call("transpose", o_heads, 0, 1, method=True), 2, method=True)
        att.out.replace_all_uses_with(out)
        erase_matched(graph, site.matched, optional=site.optional)
