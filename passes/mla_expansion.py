"""The expanded MLA attention both MLA attention rewrites start from (``mla_absorb`` for decode graphs,
``mla_prefill`` for prefill graphs): matched once, here, for both.

In every graph the cache gathers one MLA layer's latent history and transformers' MLA
(``KimiLinearAttention``, ``DeepseekV3Attention``, ``DeepseekV2Attention``) expands it through ``kv_b_proj``
before attending::

    full = torch.ops.unimem.mla_gather(arena, v2p, page_table, kv_len, out_offset, M, *G).to(dtype)  # G: MLAGeometry
    latent, k_rot = full[:, None, :, :R], full[:, None, :, R:]            # [B, 1, M, R], [B, 1, M, Dr]
    kv = F.linear(latent, W).view(B, M, H, dn + dv).transpose(1, 2)         # W = kv_b_proj.weight
    k_nope, v = kv.split([dn, dv], -1)
    k = kv.new_empty(B, H, M, dn + Dr); k[..., :dn].copy_(k_nope); k[..., dn:].copy_(k_rot.expand(...))
    o = attention(q, k, v, mask, scale)                                     # q [B, H, T, dn + Dr] -> [B, H, T, dv]

(``M`` = the gather's ``max_len``, the cache's ``max_seq_len``; ``T`` = the query length.) ``attention`` is
``F.scaled_dot_product_attention`` or transformers' eager chain ``matmul -> *scale -> +mask -> softmax ->
cast -> dropout(p=0) -> matmul`` (a table of optional steps, :data:`ATTENTION_FORMS`). The key may also be
``cat([k_nope, k_rot], -1)``. A first prefill without padding has no mask: transformers then slices keys
and values to the first ``T`` positions and asks SDPA for ``is_causal=True``
(``transformers.integrations.sdpa_attention``); the slices are part of the match (:attr:`Expansion.prefix`).

:func:`match_expansion` walks that chain from the gather and returns an :class:`Expansion`, or raises
:class:`~.common.Refused` with the reason. What only one rewrite accepts (the query length, causal
flags, the mask's shape) is checked by that rewrite on the result.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.fx import Node

from unimem_compile import ops  # noqa: F401  (registers torch.ops.unimem.*)
from unimem_compile.ops.common import COMPUTE_DTYPES
from unimem_compile.ops.geometry import MLAGeometry

from .common import (
    Refused,
    argument,
    cast_of,
    check_closed,
    describe,
    dims,
    is_function,
    is_method,
    last_dim_slice,
    only_user,
    op_arguments,
    split_item,
    strip,
    value,
)

__all__ = ["Attention", "ATTENTION_FORMS", "Expansion", "match_expansion", "same_size", "query_length_text"]

_SDPA = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_LINEAR = (torch._C._nn.linear, F.linear)
_MATMUL = (torch.matmul, operator.matmul, torch.bmm)
_MULS = (operator.mul, torch.mul)
_DIVS = (operator.truediv, torch.div)
_ADDS = (operator.add, torch.add)


@dataclasses.dataclass
class Attention:
    """One attention computation, normalised over its spellings."""

    out: Node  # the node whose value is the attention output [B, H, T, dv]
    q: Node
    k: Node
    v: Node
    mask: Node | None
    scale: float
    dropout: float
    is_causal: bool
    nodes: list[Node]  # the attention's own nodes, erased by the rewrite


# ---------------------------------------------------------------------------------------- attention forms
def _sdpa(node: Node) -> Attention | None:
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
    is_causal = argument(node, 5, "is_causal", False)
    if not isinstance(is_causal, bool):
        raise Refused("the SDPA is_causal flag is not a constant")
    return Attention(
        out=node, q=q, k=k, v=v, mask=argument(node, 3, "attn_mask", None), scale=float(scale),
        dropout=float(argument(node, 4, "dropout_p", 0.0)), is_causal=is_causal, nodes=[node],
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


def _eager(node: Node) -> Attention | None:
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
    return Attention(out=node, q=q, k=k_t.args[0], v=v, mask=found["mask"], scale=found["scale"],
                     dropout=found["dropout"], is_causal=False, nodes=chain)


#: Attention spellings, tried in order on the node that consumes the expanded values.
ATTENTION_FORMS = (_sdpa, _eager)


def _attention_at(node: Node) -> Attention | None:
    for form in ATTENTION_FORMS:
        att = form(node)
        if att is not None:
            return att
    return None


# ---------------------------------------------------------------------------------------- sizes
def same_size(a: object, b: object) -> bool:
    """Two sizes from fake values are the same: equal ints, or SymInts with one symbolic expression. Only
    the expressions are compared (``int(sym)`` or ``sym == n`` would add a guard and specialise the graph)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return False


def query_length_text(size: object) -> str:
    """A query length for a log line: the int, or ``"symbolic"``."""
    return str(size) if isinstance(size, int) else "symbolic"


def _prefix_slice(node: Node) -> tuple[Node, object] | None:
    """``(x, n)`` when ``node`` is ``x[:, :, :n, :]`` / ``x[:, :, :n]`` (the first ``n`` positions of a
    ``[B, H, M, d]`` tensor, as transformers' SDPA path slices a static cache's keys; ``n`` an int or the
    SymInt of a symbolic stop), else None."""
    if not is_function(node, operator.getitem):
        return None
    base, index = node.args
    index = index if isinstance(index, tuple) else (index,)
    if len(dims(base) or ()) != 4 or len(index) not in (3, 4):
        return None
    whole = slice(None)
    if index[0] != whole or index[1] != whole or index[3:] not in ((), (whole,)):
        return None
    s = index[2]
    if not isinstance(s, slice) or s.start not in (None, 0) or s.step not in (None, 1) or s.stop is None:
        return None
    stop = value(s.stop) if isinstance(s.stop, Node) else s.stop
    return (base, stop) if isinstance(stop, (int, torch.SymInt)) else None


# ---------------------------------------------------------------------------------------- the match
@dataclasses.dataclass
class Expansion:
    """One MLA layer's gathered, expanded attention, as :func:`match_expansion` found it.

    Attributes:
        gather: the ``mla_gather`` node; ``arguments``: its arguments by schema name; ``geometry``: its
            :class:`MLAGeometry`; ``max_len``: its ``max_len`` (M, the expanded history's length).
        weight: the ``kv_b_proj`` weight node ``[H * (dn + dv), R]``.
        heads, nope, v_dim, rank, rope: H, dn, dv, R, Dr.
        att: the attention; ``att.q`` is ``[B, H, T, dn + Dr]``.
        query_length: ``att.q``'s size T (an int or a SymInt; compare with :func:`same_size`).
        prefix: the slice nodes that cut keys and values to their first ``prefix_length`` positions
            (transformers' causal SDPA on an empty cache), ``[]`` when there are none.
        prefix_length: the slices' stop (an int or a SymInt), None without slices.
        matched: every node of the chain from the gather to the attention output (erased by a rewrite).
    """

    gather: Node
    arguments: dict
    geometry: MLAGeometry
    max_len: int
    weight: Node
    heads: int
    nope: int
    v_dim: int
    rank: int
    rope: int
    att: Attention
    query_length: object
    prefix: list[Node]
    prefix_length: object
    matched: list[Node]


def _key_sources(k: Node, readers: list[Node], nope: int, rope: int) -> tuple[Node, Node, list[Node]]:
    """The tensors the key is assembled from (``k_nope``, ``k_rot``) and the assembly's nodes; ``readers``
    are the attention's nodes that read the key (besides the assembly's own copies).

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
        if user in readers:
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


def _find_attention(v: Node, accept_query: Callable[[object], None]) -> tuple[Attention, list[Node]]:
    """The attention reading the expanded values ``v``, directly or through a prefix slice; returns it and
    the slice of ``v`` (``[]`` when none). ``accept_query`` is called with the query length of an attention
    found further down a chain this function cannot match, so that the log names the reason that matters
    (e.g. "prefill") rather than the first node it did not expect."""
    consumer = only_user(v)
    if consumer is None:
        raise Refused("the expanded values have several users")
    att = _attention_at(consumer)
    if att is not None:
        return att, []
    sliced = _prefix_slice(consumer)
    if sliced is not None and sliced[0] is v and only_user(consumer) is not None:
        att = _attention_at(only_user(consumer))
        if att is not None:
            return att, [consumer]
    node = consumer
    for _ in range(3):
        if len(node.users) != 1:
            break
        node = next(iter(node.users))
        try:
            att = _attention_at(node)
        except Refused:
            att = None
        if att is not None and len(dims(att.q) or ()) == 4:
            accept_query(value(att.q).shape[2])
    raise Refused(f"the expanded values feed {describe(consumer)}, not SDPA or an eager attention")


def match_expansion(gather: Node, accept_query: Callable[[object], None]) -> Expansion:
    """Match the chain of the module docstring from ``gather`` (an ``mla_gather`` node) to the attention.

    ``accept_query(T)`` raises :class:`Refused` when the calling rewrite does not handle query length ``T``
    (an int or a SymInt); it runs as soon as the query is known, before the checks that follow it.

    Checked here: the gather read only by the latent / rope slices (after an optional cast); a bias-free
    ``F.linear`` of the latent by a ``[H * (dn + dv), R]`` weight; the view / transpose / split into
    ``k_nope`` and ``v``; the key assembled from this history's ``k_nope`` and ``k_rot``; a query
    ``[B, H, T, dn + Dr]``; dropout 0; query, weight and values of one dtype in ``COMPUTE_DTYPES``; no
    node of the chain used outside it. Not checked (each rewrite's own): the query length, ``is_causal``,
    the mask and the prefix slices.

    Raises:
        Refused: with the first reason the chain does not match.
    """
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

    # .view(B, M, H, dn + dv).transpose(1, 2).split([dn, dv], -1)
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

    att, v_prefix = _find_attention(v, accept_query)
    if att.v is not (v_prefix[0] if v_prefix else v):
        raise Refused("the attention's values are not the expanded history")
    k_sliced = _prefix_slice(att.k) if len(att.k.users) == 1 else None
    k_prefix = [att.k] if k_sliced is not None else []
    if bool(k_prefix) != bool(v_prefix):
        raise Refused("only one of the keys and the values is sliced to a prefix of the history")
    prefix_length = None
    if v_prefix:
        k_stop, v_stop = k_sliced[1], _prefix_slice(v_prefix[0])[1]
        if not same_size(k_stop, v_stop):
            raise Refused("the keys and the values are sliced to different prefixes of the history")
        prefix_length = v_stop
    k = k_sliced[0] if k_prefix else att.k

    k_nope_src, k_rot_src, key_nodes = _key_sources(k, att.nodes + k_prefix, nope, rope)
    k_rot, expands = strip(k_rot_src, ("expand",))
    if k_nope_src is not k_nope or k_rot is not k_rot_full:
        raise Refused("the key is not assembled from this history's k_nope and k_rot")

    q_dims = dims(att.q)
    if q_dims is None or len(q_dims) != 4 or q_dims[1] != heads or q_dims[3] != nope + rope:
        raise Refused(f"the query {describe(att.q)} is not [B, {heads}, Q, {nope} + {rope}]")
    query_length = value(att.q).shape[2]
    accept_query(query_length)
    if att.dropout > 0:
        raise Refused(f"attention dropout p={att.dropout}")
    q_dtype = value(att.q).dtype
    for name, node in (("kv_b_proj weight", weight), ("expanded values", v)):
        if value(node).dtype != q_dtype:
            raise Refused(f"the {name} are {value(node).dtype}, the query {q_dtype}")
    if q_dtype not in COMPUTE_DTYPES:
        raise Refused(f"the query is {q_dtype}; the MLA kernels take {COMPUTE_DTYPES}")

    prefix = k_prefix + v_prefix
    matched = [*att.nodes, *prefix, *key_nodes, *expands, split, k_nope, v, transpose, view, linear, latent,
               k_rot_full, gather] + ([full] if full is not gather else [])
    check_closed(matched, exits=[att.out])
    return Expansion(gather, arguments, geometry, max_len, weight, heads, nope, v_dim, rank, rope, att,
                     query_length, prefix, prefix_length, matched)
