"""Rewrite ``kda_state_inplace``: a gathered KDA decode step -> ``unimem::kda_decode`` in place.

In a decode step the cache gathers each KDA layer's fp32 recurrent state, transformers' torch
``recurrent_kimi_delta_attention`` runs one step of the gated delta rule on it, and the cache scatters the
final state back::

    S = unimem.state_gather(arena, s_v2p, slot_ids, off, pitch, [H, K, V], fp32).to(v)  # [B, H, K, V]
    q, k = l2norm(q.float()), l2norm(k.float()); q = q * scale                          # [B, 1, H, K]
    S = S * g[:, 0][..., None].exp()
    delta = (v[:, 0] - (S * k[:, 0][..., None]).sum(-2)) * beta[:, 0][..., None]
    S = S + k[:, 0].unsqueeze(-1) * delta.unsqueeze(-2)
    o = zeros(B, 1, H, V); o[:, 0] = (S * q[:, 0].unsqueeze(-1)).sum(-2)
    unimem.state_scatter(arena, s_v2p, slot_ids, S.contiguous(), off, pitch)

becomes one op that reads the state once and leaves the new state in the slot::

    o = unimem.kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], arena, s_v2p, slot_ids, off, pitch,
                          scale, use_qk_l2norm=True).unsqueeze(1)

The math (KDA, arXiv 2510.26692) is in :mod:`unimem_compile.ops.kda`. The L2 norm is recognised in its
transformers / flash-linear-attention spelling ``x / sqrt(sum(x * x, -1) + 1e-6)``; it must be applied to
both q and k or to neither. Matching uses structure and the fake values' shapes and dtypes, never node
names or positions; a candidate that differs anywhere is left alone and the reason is logged. Refused: a
recurrence over more than one token (prefill), a state read or written elsewhere, a write-back to other
slots or another offset, another op touching the same slot bytes between the read and the write-back,
an L2 norm with another epsilon or on only one of q and k, a scaled k.
"""

from __future__ import annotations

import numbers

import torch
from torch.fx import Graph, Node

from unimem_compile import ops  # noqa: F401  (registers torch.ops.unimem.*)
from unimem_compile.ops.common import COMPUTE_DTYPES

from . import state_common
from .common import (
    Refused,
    Rewrite,
    argument,
    check_closed,
    erase_matched,
    insert_call,
    is_op,
    op_arguments,
    op_name,
    tensor_value,
)
from .state_common import first_conflict, is_noop_cast, state_access, strip_noops, strip_upcast, token0, unsqueezed

__all__ = ["KDAStateInplace"]

#: the epsilon of ``unimem::kda_decode``'s L2 norm (and of transformers' and fla's)
L2NORM_EPS = 1e-6


def _operands(node, name: str) -> tuple | None:
    """The two operands of a binary ``name`` node (``a * b``, ``torch.mul(a, b)``, ``a.mul(b)``), else None."""
    if op_name(node) != name or len(node.args) != 2 or node.kwargs:
        return None
    return node.args


def _other(node, name: str, known) -> object:
    """The operand of the commutative binary ``name`` node that is not ``known`` (Refused otherwise)."""
    ops_ = _operands(node, name)
    if ops_ is None or known not in ops_:
        raise Refused(f"{op_name(node)} where {name} of the state was expected")
    return ops_[1] if ops_[0] is known else ops_[0]


def _sole_user(node: Node, name: str) -> Node:
    users = list(node.users)
    if len(users) != 1 or op_name(users[0]) != name:
        raise Refused(f"{op_name(node)} feeds {[op_name(u) for u in users]}, expected one {name}")
    return users[0]


def _reduces_axis(node: Node, axis: int) -> bool:
    """``node`` sums over axis ``axis`` (negative) without keeping it."""
    if op_name(node) != "sum":
        return False
    dim = argument(node, 1, "dim", None)
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    ndim = tensor_value(node.args[0]).dim()
    return (len(dims) == 1 and isinstance(dims[0], int) and dims[0] % ndim == axis % ndim
            and not argument(node, 2, "keepdim", False))


def _l2normalized(node) -> tuple[Node, list[Node]] | None:
    """``(x, nodes)`` when ``node`` is ``x / sqrt(sum(x * x, -1, keepdim=True) + 1e-6)``, else None."""
    ops_ = _operands(node, "div")
    if ops_ is None:
        return None
    x, root = ops_
    if op_name(root) != "sqrt":
        return None
    add = root.args[0]
    terms = _operands(add, "add")
    if terms is None:
        return None
    total, eps = terms if isinstance(terms[0], Node) else terms[::-1]
    if not isinstance(eps, numbers.Real) or abs(eps - L2NORM_EPS) > 1e-12 or op_name(total) != "sum":
        return None
    square = total.args[0]
    if argument(total, 1, "dim", None) not in (-1, [-1], (-1,)) or not argument(total, 2, "keepdim", False):
        return None
    if _operands(square, "mul") != (x, x):
        return None
    return x, [node, root, add, total, square]


def _query_side(node) -> tuple[Node | None, float, bool, list[Node]]:
    """Undo the scale (optional), ``l2norm`` (optional) and the fp32 upcast of a [B, 1, H, K] q or k.

    Returns ``(source, scale, normalised, nodes undone)``; ``source`` is None when ``node`` is None.
    """
    if node is None:
        return None, 1.0, False, []
    nodes, scale = [], 1.0
    ops_ = _operands(node, "mul")
    if ops_ is not None:
        consts = [i for i, o in enumerate(ops_) if isinstance(o, numbers.Real) and not isinstance(o, bool)]
        if len(consts) == 1:
            nodes.append(node)
            scale = float(ops_[consts[0]])
            node = ops_[1 - consts[0]]
    normed = _l2normalized(node)
    if normed is not None:
        node, more = normed
        nodes += more
    return strip_upcast(node, nodes), scale, normed is not None, nodes


class KDAStateInplace(Rewrite):
    """The ``kda_state_inplace`` rewrite (docs/passes.md); sites are ``[B, H, K, V]`` fp32 state gathers."""

    name = "kda_state_inplace"
    extra_sources = (state_common.__file__,)  # the state-op helpers it matches with

    def sites(self, graph: Graph) -> list[Node]:
        return [n for n in graph.nodes if is_op(n, torch.ops.unimem.state_gather) and tensor_value(n) is not None
                and tensor_value(n).dim() == 4 and tensor_value(n).dtype == torch.float32]

    def match(self, graph: Graph, gather: Node) -> dict:
        access = state_access(gather)
        if access is None:
            raise Refused("slot offset or pitch is not a constant")
        batch, heads, dk, dv = tensor_value(gather).shape
        state = [gather]  # nodes carrying the state: all must go
        inputs = []  # nodes on the q / k / v / g / beta side: erased only if nothing else reads them

        # decay: S1 = S0 * exp(g[:, 0][..., None])
        s0 = strip_noops(gather, forward=True, skipped=state)
        if len(s0.users) != 1 or op_name(next(iter(s0.users))) != "mul":
            raise Refused(f"the gathered state feeds {[op_name(u) for u in s0.users]}, not one decay multiply "
                          "(not a one-token recurrent step)")
        s1 = next(iter(s0.users))
        decay = _other(s1, "mul", s0)
        if op_name(decay) == "exp":
            g_tok = unsqueezed(decay.args[0], -1)
            inputs += [decay, decay.args[0]]
        else:
            inner = unsqueezed(decay, -1)
            g_tok = inner.args[0] if op_name(inner) == "exp" else None
            inputs += [decay, inner]
        g = token0(g_tok) if g_tok is not None else None
        if g is None:
            raise Refused("the state is not decayed by exp(g) of the single token")
        inputs.append(g_tok)
        g = strip_noops(g, skipped=inputs)
        state.append(s1)

        # delta = (v - (S1 * k[..., None]).sum(-2)) * beta[..., None]
        users = list(s1.users)
        adds = [u for u in users if op_name(u) == "add"]
        muls = [u for u in users if op_name(u) == "mul"]
        if len(users) != 2 or len(adds) != 1 or len(muls) != 1:
            raise Refused(f"the decayed state feeds {[op_name(u) for u in users]}, expected one mul and one add")
        read, s2 = muls[0], adds[0]
        k_unsq = _other(read, "mul", s1)
        k_tok = unsqueezed(k_unsq, -1)
        kv_mem = _sole_user(read, "sum")
        if k_tok is None or not _reduces_axis(kv_mem, -2):
            raise Refused("the state is not read as (S * k[..., None]).sum(-2)")
        sub = _sole_user(kv_mem, "sub")
        if sub.args[1] is not kv_mem:
            raise Refused("the delta is not v - k^T S")
        v_tok = sub.args[0]
        delta = _sole_user(sub, "mul")
        beta_unsq = _other(delta, "mul", sub)
        beta_tok = unsqueezed(beta_unsq, -1)
        inputs += [k_unsq, beta_unsq]
        state += [read, kv_mem, sub, delta]

        # S2 = S1 + k[..., None] * delta[..., None, :]
        delta_unsq = next(iter(delta.users), None)
        if len(delta.users) != 1 or unsqueezed(delta_unsq, -2) is not delta:
            raise Refused("the delta is not unsqueezed for the outer product")
        outer = _sole_user(delta_unsq, "mul")
        k_unsq2 = _other(outer, "mul", delta_unsq)
        if unsqueezed(k_unsq2, -1) is not k_tok or _other(s2, "add", s1) is not outer:
            raise Refused("the state update is not S + k delta^T with the same k")
        inputs.append(k_unsq2)
        state += [delta_unsq, outer, s2]

        # the output (S2 * q[..., None]).sum(-2), and S2 written back
        users = list(s2.users)
        muls = [u for u in users if op_name(u) == "mul"]
        if len(users) != 2 or len(muls) != 1:
            raise Refused(f"the new state feeds {[op_name(u) for u in users]}, expected one mul and its write-back")
        read_q = muls[0]
        last, scatter = s2, next(u for u in users if u is not read_q)
        while is_noop_cast(scatter) and len(scatter.users) == 1:
            state.append(scatter)
            last, scatter = scatter, next(iter(scatter.users))
        if not is_op(scatter, torch.ops.unimem.state_scatter) or op_arguments(scatter)["value"] is not last:
            raise Refused("the new state is not written back by state_scatter")
        written = state_access(scatter)
        if written is None or not written.same_slots(access) or written.offset != access.offset:
            raise Refused("the write-back goes to other slots or another offset")
        state += [scatter, read_q]
        q_unsq = _other(read_q, "mul", s2)
        q_tok = unsqueezed(q_unsq, -1)
        out = _sole_user(read_q, "sum")
        if q_tok is None or not _reduces_axis(out, -2):
            raise Refused("the output is not (S * q[..., None]).sum(-2)")
        inputs.append(q_unsq)

        # ... stored into token 0 of a zero [B, 1, H, V] buffer that is read only afterwards
        store = _sole_user(out, "setitem")
        buffer, index = store.args[0], store.args[1]
        bv = tensor_value(buffer)
        if (store.args[2] is not out or index not in ((slice(None), 0), (slice(None), -1))
                or op_name(buffer) not in ("zeros", "new_zeros") or bv is None
                or tuple(bv.shape) != (batch, 1, heads, dv)):
            raise Refused("the output is not stored into token 0 of a zero [B, 1, H, V] buffer")
        readers = [u for u in buffer.users if u is not store]
        if not readers or any(r < store or str(op_name(r)).endswith("_") or op_name(r) == "setitem" for r in readers):
            raise Refused("the output buffer is written again or read before the output is stored")
        state += [out, store, buffer]

        # the q / k / v / g / beta inputs, from before their fp32 upcasts (the op upcasts itself)
        q, scale, q_norm, q_nodes = _query_side(token0(q_tok) if q_tok is not None else None)
        k, k_scale, k_norm, k_nodes = _query_side(token0(k_tok))
        v_src = token0(v_tok)
        beta_src = token0(beta_tok) if beta_tok is not None else None
        if q is None or k is None or v_src is None or beta_src is None:
            raise Refused("q, k, v or beta is not the single token of a [B, 1, ...] tensor")
        if q_norm != k_norm or k_scale != 1.0:
            raise Refused("q and k are not L2-normalised alike, or k is scaled")
        v, beta = strip_upcast(v_src, inputs), strip_upcast(beta_src, inputs)
        inputs += [q_tok, k_tok, v_tok, beta_tok] + q_nodes + k_nodes
        expected = {"q": (q, (batch, 1, heads, dk)), "k": (k, (batch, 1, heads, dk)), "v": (v, (batch, 1, heads, dv)),
                    "g": (g, (batch, 1, heads, dk)), "beta": (beta, (batch, 1, heads))}
        for label, (node, shape) in expected.items():
            val = tensor_value(node)
            if val is None or tuple(val.shape) != shape or val.dtype not in COMPUTE_DTYPES:
                raise Refused(f"{label} is not a float [{', '.join(map(str, shape))}] tensor")
        if tensor_value(g).dtype != torch.float32 or tensor_value(last).dtype != torch.float32:
            raise Refused("g or the written-back state is not fp32")

        check_closed(state, exits=[buffer])
        conflict = first_conflict(access, gather, max(scatter, min(readers)), set(state) | set(inputs))
        if conflict is not None:
            raise Refused(conflict)
        return dict(access=access, q=q, k=k, v=v, g=g, beta=beta, scale=scale, l2norm=q_norm, buffer=buffer,
                    readers=readers, state=state, inputs=[n for n in inputs if isinstance(n, Node)])

    def replace(self, graph: Graph, match: dict) -> None:
        access, buffer, readers = match["access"], match["buffer"], match["readers"]
        where = min(readers)
        buffer_dtype = tensor_value(buffer).dtype
        with graph.inserting_before(where):
            token = {name: insert_call(graph, torch.select, (match[name], 1, 0), like=where)
                     for name in ("q", "k", "v", "g", "beta")}
            out = insert_call(
                graph, torch.ops.unimem.kda_decode.default,
                (token["q"], token["k"], token["v"], token["g"], token["beta"], access.arena, access.s_v2p,
                 access.slot_ids, access.offset, access.slot_bytes, match["scale"], match["l2norm"]),
                like=where,
            )
            out4 = insert_call(graph, torch.unsqueeze, (out, 1), like=where)
            # the op returns q's dtype: a reader that casts the fp32 buffer to it reads the op's output as is
            as_buffer = out4
            if tensor_value(out4).dtype != buffer_dtype:
                as_buffer = insert_call(graph, "to", (out4, buffer_dtype), like=where, method=True)
        casts = []
        for reader in readers:
            rv = tensor_value(reader)
            if op_name(reader) in ("to", "float") and rv is not None and rv.dtype == tensor_value(out4).dtype:
                reader.replace_all_uses_with(out4)
                casts.append(reader)
            else:
                reader.replace_input_with(buffer, as_buffer)
        erase_matched(graph, match["state"] + casts, match["inputs"] + [as_buffer])
