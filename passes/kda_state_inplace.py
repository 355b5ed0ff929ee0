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
names or positions; a candidate that differs anywhere is left alone and the reason is logged.
"""

from __future__ import annotations

import hashlib
import logging
import numbers
from pathlib import Path

import torch
from torch.fx import Graph, GraphModule, Node

from . import _state_match as m

__all__ = ["KDAStateInplace"]

log = logging.getLogger("unimem_compile.passes")

#: the epsilon of ``unimem::kda_decode``'s L2 norm (and of transformers' and fla's)
L2NORM_EPS = 1e-6


def _operands(node: Node, name: str) -> tuple | None:
    """The two operands of a binary ``name`` node (``a * b``, ``torch.mul(a, b)``, ``a.mul(b)``), else None."""
    if m.op_name(node) != name or len(node.args) != 2 or node.kwargs:
        return None
    return node.args


def _other(node: Node, name: str, known) -> object:
    """The operand of the commutative binary ``name`` node that is not ``known`` (NoMatch otherwise)."""
    ops = _operands(node, name)
    if ops is None or known not in ops:
        raise m.NoMatch(f"{node.name} is {m.op_name(node)}, expected {name} with {getattr(known, 'name', known)}")
    return ops[1] if ops[0] is known else ops[0]


def _sole_user(node: Node, name: str) -> Node:
    users = list(node.users)
    if len(users) != 1 or m.op_name(users[0]) != name:
        raise m.NoMatch(f"{node.name} feeds {[m.op_name(u) for u in users]}, expected one {name}")
    return users[0]


def _reduces_axis(node: Node, axis: int) -> bool:
    """``node`` sums over axis ``axis`` (negative) without keeping it."""
    if m.op_name(node) != "sum":
        return False
    dim = m.call_arg(node, 1, "dim")
    ndim = m.value(node.args[0]).dim()
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return (len(dims) == 1 and isinstance(dims[0], int) and dims[0] % ndim == axis % ndim
            and not m.call_arg(node, 2, "keepdim", False))


def _l2normalized(node) -> tuple[Node, list[Node]] | None:
    """``(x, nodes)`` when ``node`` is ``x / sqrt(sum(x * x, -1, keepdim=True) + 1e-6)``, else None."""
    ops = _operands(node, "div") if isinstance(node, Node) else None
    if ops is None:
        return None
    x, root = ops
    if m.op_name(root) != "sqrt":
        return None
    add = root.args[0]
    terms = _operands(add, "add")
    if terms is None:
        return None
    total, eps = terms if isinstance(terms[0], Node) else terms[::-1]
    if not isinstance(eps, numbers.Real) or abs(eps - L2NORM_EPS) > 1e-12 or m.op_name(total) != "sum":
        return None
    dim = m.call_arg(total, 1, "dim")
    square = total.args[0]
    if dim not in (-1, [-1], (-1,)) or not m.call_arg(total, 2, "keepdim", False):
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
    ops = _operands(node, "mul")
    if ops is not None:
        consts = [i for i, o in enumerate(ops) if isinstance(o, numbers.Real) and not isinstance(o, bool)]
        if len(consts) == 1:
            nodes.append(node)
            scale = float(ops[consts[0]])
            node = ops[1 - consts[0]]
    normed = _l2normalized(node)
    if normed is not None:
        node, more = normed
        nodes += more
    return m.strip_upcast(node, nodes), scale, normed is not None, nodes


class KDAStateInplace:
    """The ``kda_state_inplace`` rewrite (DESIGN.md section 7).

    ``rewrite(gm)`` (a Dynamo-level ``GraphModule`` or its ``Graph``) replaces every matching KDA decode
    step in place and returns how many it replaced; the graph is recompiled when it changed.
    """

    name = "kda_state_inplace"

    def __call__(self, gm: GraphModule | Graph) -> int:
        graph = gm.graph if isinstance(gm, GraphModule) else gm
        candidates = [n for n in graph.nodes if m.op_name(n) == "unimem.state_gather"
                      and m.value(n) is not None and m.value(n).dim() == 4 and m.value(n).dtype == torch.float32]
        done, reasons = 0, []
        for gather in candidates:
            try:
                match = self._match(gather)
            except m.NoMatch as why:
                reasons.append(f"{gather.name}: {why}")
                continue
            self._replace(graph, match)
            done += 1
        if reasons or not candidates:
            detail = "; ".join(reasons) if reasons else "no [B, H, K, V] fp32 state_gather in the graph"
            log.info("%s: %d of %d recurrent states rewritten (%s)", self.name, done, len(candidates), detail)
        if done and isinstance(gm, GraphModule):
            gm.recompile()
        return done

    def uuid(self) -> str:
        """Hash of this module's and the matcher's sources (Inductor's ``CustomGraphPass`` cache key)."""
        here = Path(__file__).parent
        return hashlib.sha256(b"".join((here / f).read_bytes() for f in (Path(__file__).name, "_state_match.py"))).hexdigest()

    # ------------------------------------------------------------------ matching
    @staticmethod
    def _match(gather: Node) -> dict:
        access = m.state_access(gather)
        if access is None:
            raise m.NoMatch("slot offset or pitch is not a constant")
        batch, heads, dk, dv = m.value(gather).shape
        state_nodes = [gather]
        inputs = []  # nodes on the q/k/v/g/beta side: erased only if nothing else reads them

        # decay: S1 = S0 * exp(g[:, 0][..., None])
        s0 = m.strip_noops(gather, forward=True)
        node = gather
        while node is not s0:
            node = next(iter(node.users))
            state_nodes.append(node)
        if len(s0.users) != 1 or m.op_name(next(iter(s0.users))) != "mul":
            raise m.NoMatch(f"the gathered state feeds {[m.op_name(u) for u in s0.users]}, not one decay "
                            "multiply (not a one-token recurrent step)")
        s1 = next(iter(s0.users))
        decay = _other(s1, "mul", s0)
        if m.op_name(decay) == "exp":
            g_tok = m.unsqueezed(decay.args[0], -1)
            inputs += [decay, decay.args[0]]
        else:
            inner = m.unsqueezed(decay, -1)
            g_tok = inner.args[0] if inner is not None and m.op_name(inner) == "exp" else None
            inputs += [decay, inner]
        g = m.token0(g_tok) if g_tok is not None else None
        if g is None:
            raise m.NoMatch("the state is not decayed by exp(g) of the single token")
        inputs.append(g_tok)
        g = m.strip_noops(g, skipped=inputs)
        state_nodes.append(s1)

        # delta: (v - (S1 * k[..., None]).sum(-2)) * beta[..., None]
        users = list(s1.users)
        adds = [u for u in users if m.op_name(u) == "add"]
        muls = [u for u in users if m.op_name(u) == "mul"]
        if len(users) != 2 or len(adds) != 1 or len(muls) != 1:
            raise m.NoMatch(f"the decayed state feeds {[m.op_name(u) for u in users]}, expected one mul and one add")
        read, s2 = muls[0], adds[0]
        k_unsq = _other(read, "mul", s1)
        k_tok = m.unsqueezed(k_unsq, -1)
        kv_mem = _sole_user(read, "sum")
        if k_tok is None or not _reduces_axis(kv_mem, -2):
            raise m.NoMatch("the state is not read as (S * k[..., None]).sum(-2)")
        sub = _sole_user(kv_mem, "sub")
        if sub.args[1] is not kv_mem:
            raise m.NoMatch("the delta is not v - k^T S")
        v_tok = sub.args[0]
        delta = _sole_user(sub, "mul")
        beta_tok = m.unsqueezed(_other(delta, "mul", sub), -1)
        inputs += [k_unsq, delta.args[0] if delta.args[1] is sub else delta.args[1]]
        state_nodes += [read, kv_mem, sub, delta]

        # S2 = S1 + k[..., None] * delta[..., None, :]
        delta_unsq = next(iter(delta.users), None)
        if len(delta.users) != 1 or m.unsqueezed(delta_unsq, -2) is not delta:
            raise m.NoMatch("the delta is not unsqueezed for the outer product")
        outer = _sole_user(delta_unsq, "mul")
        k_unsq2 = _other(outer, "mul", delta_unsq)
        if m.unsqueezed(k_unsq2, -1) is not k_tok or _other(s2, "add", s1) is not outer:
            raise m.NoMatch("the state update is not S + k delta^T with the same k")
        inputs.append(k_unsq2)
        state_nodes += [delta_unsq, outer, s2]

        # output (S2 * q[..., None]).sum(-2) into token 0 of a zero [B, 1, H, V]; S2 written back
        users = list(s2.users)
        muls = [u for u in users if m.op_name(u) == "mul"]
        if len(users) != 2 or len(muls) != 1:
            raise m.NoMatch(f"the new state feeds {[m.op_name(u) for u in users]}, expected one mul and its write-back")
        read_q = muls[0]
        last, scatter = s2, next(u for u in users if u is not read_q)
        while m.is_noop_cast(scatter) and len(scatter.users) == 1:
            state_nodes.append(scatter)
            last, scatter = scatter, next(iter(scatter.users))
        if m.op_name(scatter) != "unimem.state_scatter" or m.call_arg(scatter, 3, "value") is not last:
            raise m.NoMatch("the new state is not written back by state_scatter")
        state_nodes += [scatter, read_q]
        q_unsq = _other(read_q, "mul", s2)
        q_tok = m.unsqueezed(q_unsq, -1)
        out = _sole_user(read_q, "sum")
        if q_tok is None or not _reduces_axis(out, -2):
            raise m.NoMatch("the output is not (S * q[..., None]).sum(-2)")
        inputs.append(q_unsq)
        store = _sole_user(out, "setitem")
        buffer, index = store.args[0], store.args[1]
        bv = m.value(buffer)
        if (store.args[2] is not out or index not in ((slice(None), 0), (slice(None), -1))
                or m.op_name(buffer) not in ("zeros", "new_zeros") or bv is None
                or tuple(bv.shape) != (batch, 1, heads, dv)):
            raise m.NoMatch("the output is not stored into token 0 of a zero [B, 1, H, V] buffer")
        readers = [u for u in buffer.users if u is not store]
        if not readers or any(r < store or str(m.op_name(r)).endswith("_") or m.op_name(r) == "setitem"
                              for r in readers):
            raise m.NoMatch("the output buffer is written again or read before the output is stored")
        state_nodes += [out, store, buffer]

        # the q / k / v / g / beta inputs, back to before their fp32 casts
        q, scale, q_norm, q_nodes = _query_side(m.token0(q_tok) if q_tok is not None else None)
        k_src = m.token0(k_tok)
        k, k_scale, k_norm, k_nodes = _query_side(k_src)
        v_src, beta_src = m.token0(v_tok), m.token0(beta_tok) if beta_tok is not None else None
        if q is None or k_src is None or v_src is None or beta_src is None:
            raise m.NoMatch("q, k, v or beta is not the single token of a [B, 1, ...] tensor")
        if q_norm != k_norm or k_scale != 1.0:
            raise m.NoMatch("q and k are not normalised alike, or k is scaled")
        v, beta = m.strip_upcast(v_src, inputs), m.strip_upcast(beta_src, inputs)
        inputs += [q_tok, k_tok, v_tok, beta_tok] + q_nodes + k_nodes
        shapes = {"q": (q, (batch, 1, heads, dk)), "k": (k, (batch, 1, heads, dk)), "v": (v, (batch, 1, heads, dv)),
                  "g": (g, (batch, 1, heads, dk)), "beta": (beta, (batch, 1, heads))}
        for label, (node, shape) in shapes.items():
            val = m.value(node)
            if val is None or tuple(val.shape) != shape or val.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise m.NoMatch(f"{label} is not a float [{', '.join(map(str, shape))}] tensor")
        if m.value(g).dtype != torch.float32:
            raise m.NoMatch("g is not fp32")

        written = m.state_access(scatter)
        if written is None or not written.same_slots(access) or written.offset != access.offset:
            raise m.NoMatch("the write-back goes to other slots or another offset")
        if m.value(last).dtype != torch.float32:
            raise m.NoMatch("the written-back state is not fp32")
        matched = set(state_nodes) | {n for n in inputs if isinstance(n, Node)}
        leak = m.users_within(state_nodes, matched | set(readers))
        if leak is not None:
            raise m.NoMatch(f"{leak.name} ({m.op_name(leak)}) is also read outside the KDA step")
        first_reader = min(readers)
        end = scatter if first_reader < scatter else first_reader
        conflict = m.first_conflict(access, gather, end, matched)
        if conflict is not None:
            raise m.NoMatch(conflict)
        return dict(access=access, q=q, k=k, v=v, g=g, beta=beta, scale=scale, l2norm=q_norm, buffer=buffer,
                    readers=readers, matched=matched)

    # ------------------------------------------------------------------ replacement
    @staticmethod
    def _replace(graph: Graph, match: dict) -> None:
        access, buffer, readers = match["access"], match["buffer"], match["readers"]
        where = min(readers)
        token = {name: m.insert_call(graph, where, torch.select, (match[name], 1, 0), like=where)
                 for name in ("q", "k", "v", "g", "beta")}
        out = m.insert_call(
            graph, where, torch.ops.unimem.kda_decode.default,
            (token["q"], token["k"], token["v"], token["g"], token["beta"], access.arena, access.s_v2p,
             access.slot_ids, access.offset, access.slot_bytes, match["scale"], match["l2norm"]),
            like=where,
        )
        out4 = m.insert_call(graph, where, torch.unsqueeze, (out, 1), like=where)
        as_buffer = out4
        matched = match["matched"]
        for reader in readers:
            rv, ov = m.value(reader), m.value(out4)
            if (m.op_name(reader) in ("to", "float") and rv is not None and rv.dtype == ov.dtype
                    and rv.shape == ov.shape):
                reader.replace_all_uses_with(out4)
                matched.add(reader)
                continue
            if as_buffer is out4 and ov.dtype != m.value(buffer).dtype:
                as_buffer = m.insert_call(graph, where, torch.Tensor.to, (out4, m.value(buffer).dtype), like=where)
            reader.replace_input_with(buffer, as_buffer)
        m.erase_matched(graph, matched)

