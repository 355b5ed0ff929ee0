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

The math (KDA, arXiv 2510.26692) is in :mod:`unimem_compile.ops.kda`, and so are the search functions:
the plain math is matched as the op's own references, traced (:class:`~.pattern.Pattern`, which generates
the spellings: ``x[..., None]`` or ``x.unsqueeze(-1)``, ``exp`` before or after adding the axis, a function
or a method, operands in either order):

- :data:`STEP` = :func:`~unimem_compile.ops.kda.kda_state_step` (decay, delta, update; one token's
  ``[B, H, *]`` values), matched backward from the state the ``state_scatter`` writes back;
- :data:`OUTPUT` = :func:`~unimem_compile.ops.kda.kda_step_output` (``(S * q[..., None]).sum(-2)``), from
  the other reader of that state;
- :data:`L2NORM` = :func:`~unimem_compile.ops.kda.l2norm_reference` (``x / sqrt(sum(x * x, -1) + 1e-6)``,
  transformers' and flash-linear-attention's spelling), optional on q and k, but on both or neither.

What stays hand-written, because a search function cannot say it: which ``state_scatter`` is the
write-back (the later scatter of the same slots and offset whose value is one STEP of the gathered state:
a question about slots, bytes and graph order); that each per-token input is token 0 of a ``[B, 1, ...]``
tensor (``x[:, 0]``, ``x[:, -1]``, ``x.select(1, 0)``: equal only because that axis has size 1); the
optional pieces around the math (no-op casts, exact fp32 upcasts, a constant scale on q); the store of the
output into token 0 of a zero buffer (an in-place ``setitem`` whose readers must all come after it); and
that no other op touches the same slot bytes in between (:func:`~.state_common.first_conflict`).

Matching uses structure and the fake values' shapes and dtypes, never node names or positions; a
candidate that differs anywhere is left alone and the reason is logged. Refused: a recurrence over more
than one token (prefill), a state read or written elsewhere, a write-back to other slots or another
offset, another op touching the same slot bytes between the read and the write-back, an L2 norm with
another epsilon or on only one of q and k, a scaled k.
"""

from __future__ import annotations

import inspect
import numbers

import torch
from torch.fx import Graph, Node

from unimem_compile import ops  # noqa: F401  (registers torch.ops.unimem.*)
from unimem_compile.ops.common import COMPUTE_DTYPES
from unimem_compile.ops.kda import kda_state_step, kda_step_output, l2norm_reference

from . import pattern, state_common
from .common import (
    Refused,
    Rewrite,
    check_closed,
    erase_matched,
    insert_call,
    is_op,
    op_arguments,
    op_name,
    tensor_value,
)
from .pattern import Pattern
from .state_common import first_conflict, state_access, strip_noops, strip_upcast, token0

__all__ = ["KDAStateInplace"]

#: The search functions are the op's own references (``unimem_compile.ops.kda``), traced; the matcher
#: generates the spellings Dynamo may record for them (passes/pattern.py).
STEP = Pattern(kda_state_step, name="KDA step")
OUTPUT = Pattern(kda_step_output, name="KDA output")
L2NORM = Pattern(l2norm_reference, name="L2 norm")


def _operands(node, name: str) -> tuple | None:
    """The two operands of a binary ``name`` node (``a * b``, ``torch.mul(a, b)``, ``a.mul(b)``), else None."""
    if op_name(node) != name or len(node.args) != 2 or node.kwargs:
        return None
    return node.args


def _sole_user(node: Node, name: str) -> Node:
    users = list(node.users)
    if len(users) != 1 or op_name(users[0]) != name:
        raise Refused(f"{op_name(node)} feeds {[op_name(u) for u in users]}, expected one {name}")
    return users[0]


def _l2normalized(node) -> tuple[Node, list[Node]] | None:
    """``(x, nodes)`` when ``node`` is :data:`L2NORM` of ``x``, else None."""
    try:
        found = L2NORM.match(node)
    except Refused:
        return None
    return found.bindings["x"], found.nodes


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


def _step_written_back(access, gather: Node, s0: Node) -> tuple[Node, list[Node], pattern.PatternMatch]:
    """The ``state_scatter`` that writes one :data:`STEP` of the gathered state ``s0`` back to the section
    ``access`` reads, with the value-preserving copies between the step and it, and the step's match.

    Candidates are the later scatters of the same slots and offset, in graph order (another write of the
    same bytes may come first: :func:`first_conflict` then names it)."""
    writes = [u for u in access.arena.users if is_op(u, torch.ops.unimem.state_scatter) and u > gather]
    writes = [w for w in writes if (a := state_access(w)) is not None and a.same_slots(access)
              and a.offset == access.offset]
    if not writes:
        raise Refused("the new state is not written back by state_scatter to the same slots and offset")
    reason = None
    for scatter in writes:
        copies = []
        s2 = strip_noops(op_arguments(scatter)["value"], skipped=copies)
        try:
            step = STEP.match(s2)
        except Refused as why:
            reason = reason or str(why)
            continue
        if step.bindings["state"] is s0:
            return scatter, copies, step
        reason = ("the state written back is not one step from the gathered state (a recurrence over more "
                  "than a single token)")
    raise Refused(reason)


class KDAStateInplace(Rewrite):
    """The ``kda_state_inplace`` rewrite (docs/passes.md); sites are ``[B, H, K, V]`` fp32 state gathers."""

    name = "kda_state_inplace"
    # the state-op helpers and the pattern matcher it matches with, and its search functions
    extra_sources = (state_common.__file__, pattern.__file__, inspect.getsourcefile(kda_state_step))

    def sites(self, graph: Graph) -> list[Node]:
        return [n for n in graph.nodes if is_op(n, torch.ops.unimem.state_gather) and tensor_value(n) is not None
                and tensor_value(n).dim() == 4 and tensor_value(n).dtype == torch.float32]

    def match(self, graph: Graph, gather: Node) -> dict:
        access = state_access(gather)
        if access is None:
            raise Refused("slot offset or pitch is not a constant")
        batch, heads, dk, dv = tensor_value(gather).shape
        state = [gather]  # nodes carrying the state: all must go
        s0 = strip_noops(gather, forward=True, skipped=state)
        if len(s0.users) != 1 or op_name(next(iter(s0.users))) != "mul":
            raise Refused(f"the gathered state feeds {[op_name(u) for u in s0.users]}, not one decay multiply "
                          "(not a one-token recurrent step)")

        # the new state: STEP of s0, written back (through value-preserving copies) to the same section
        scatter, copies, step = _step_written_back(access, gather, s0)
        s2 = step.nodes[-1]
        state += step.downstream_of("state") + copies[::-1] + [scatter]
        inputs = [n for n in step.nodes if n not in state]  # the k / v / g / beta side: erased if unused
        g = token0(step.bindings["g"])
        if g is None:
            raise Refused("the state is not decayed by exp(g) of the single token")
        inputs.append(step.bindings["g"])
        g = strip_noops(g, skipped=inputs)
        k_tok, v_tok, beta_tok = (step.bindings[name] for name in ("k", "v", "beta"))

        # the output OUTPUT(s2, q), the other reader of the new state
        last = op_arguments(scatter)["value"]
        others = [u for u in s2.users if u is not (copies[-1] if copies else scatter)]
        if len(others) != 1 or op_name(others[0]) != "mul":
            raise Refused(f"the new state feeds {[op_name(u) for u in s2.users]}, expected one mul and its "
                          "write-back")
        out = _sole_user(others[0], "sum")
        output = OUTPUT.match(out)
        if output.bindings["state"] is not s2:
            raise Refused("the output is not read from the state written back")
        state += output.downstream_of("state")
        q_tok = output.bindings["q"]
        inputs += [n for n in output.nodes if n not in state]

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
        state += [store, buffer]

        # the q / k / v / g / beta inputs, from before their fp32 upcasts (the op upcasts itself)
        q, scale, q_norm, q_nodes = _query_side(token0(q_tok))
        k, k_scale, k_norm, k_nodes = _query_side(token0(k_tok))
        v_src, beta_src = token0(v_tok), token0(beta_tok)
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
