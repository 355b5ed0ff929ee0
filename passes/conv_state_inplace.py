"""Rewrite ``conv_state_inplace``: a gathered short-convolution decode step -> ``unimem::causal_conv1d_update``.

In a decode step the cache hands transformers a copy of each KDA layer's conv state, transformers' torch
``causal_conv1d_update`` shifts the new column in (``copy_`` into that copy), convolves and applies SiLU,
and the cache writes the copy back at the end of the layer::

    state = unimem.state_gather(arena, s_v2p, slot_ids, off, pitch, [C, K], dtype)     # [B, C, K]
    new = cat([state, x], -1).to(w.dtype)                                               # x [B, C, 1]
    state.copy_(new[:, :, -K:])
    y = silu(conv1d(new, w.unsqueeze(1), bias, padding=0, groups=C)[:, :, -1:]).to(x.dtype)
    ...
    unimem.state_scatter(arena, s_v2p, slot_ids, state, off, pitch)

becomes one op that reads the slot, writes the shifted state back in place and returns the output::

    y = unimem.causal_conv1d_update(x.squeeze(-1), arena, s_v2p, slot_ids, off, pitch, w, bias, "silu").unsqueeze(-1)

The gather, the in-place ``copy_`` and the write-back disappear. Matching uses structure and the fake
values' shapes and dtypes, never node names or positions; a candidate that differs anywhere is left
alone (the graph stays correct) and the reason is logged.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from torch.fx import Graph, GraphModule, Node

from . import _state_match as m

__all__ = ["ConvStateInplace"]

log = logging.getLogger("unimem_compile.passes")

_FULL = slice(None, None, None)


def _last_columns(node: Node, src: Node, length: int, count: int) -> bool:
    """``node`` is ``src[:, :, s]`` (or ``src[..., s]``) and ``s`` keeps the last ``count`` of ``length`` columns."""
    if m.op_name(node) != "getitem" or node.args[0] is not src or not isinstance(node.args[1], tuple):
        return False
    idx = node.args[1]
    if idx[:-1] not in ((_FULL, _FULL), (Ellipsis,)) or not isinstance(idx[-1], slice):
        return False
    return list(range(length))[idx[-1]] == list(range(length - count, length))


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


class ConvStateInplace:
    """The ``conv_state_inplace`` rewrite (DESIGN.md section 7).

    ``rewrite(gm)`` (a Dynamo-level ``GraphModule`` or its ``Graph``) replaces every matching conv decode
    step in place and returns how many it replaced; the graph is recompiled when it changed.
    """

    name = "conv_state_inplace"

    def __call__(self, gm: GraphModule | Graph) -> int:
        graph = gm.graph if isinstance(gm, GraphModule) else gm
        candidates = [n for n in graph.nodes if m.op_name(n) == "unimem.state_gather"
                      and m.value(n) is not None and m.value(n).dim() == 3]
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
            detail = "; ".join(reasons) if reasons else "no [B, C, K] state_gather in the graph"
            log.info("%s: %d of %d conv states rewritten (%s)", self.name, done, len(candidates), detail)
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
        state = m.value(gather)
        if access is None:
            raise m.NoMatch("slot offset or pitch is not a constant")
        batch, channels, width = state.shape
        cats = [u for u in gather.users if m.op_name(u) == "cat"]
        copies = [u for u in gather.users if m.op_name(u) == "copy_" and u.args[0] is gather]
        scatters = [u for u in gather.users if m.op_name(u) == "unimem.state_scatter"]
        if len(cats) != 1 or len(copies) != 1 or len(scatters) != 1 or len(gather.users) != 3:
            raise m.NoMatch(f"the gathered state's users are {sorted(str(m.op_name(u)) for u in gather.users)}, "
                            "not one cat, one in-place copy_ and one state_scatter")
        cat, copy, scatter = cats[0], copies[0], scatters[0]

        tensors, dim = m.call_arg(cat, 0, "tensors"), m.call_arg(cat, 1, "dim", 0)
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or tensors[0] is not gather or dim not in (-1, 2):
            raise m.NoMatch("the state is not concatenated in front of one new column on the last axis")
        x = tensors[1]
        xv = m.value(x)
        if xv is None or tuple(xv.shape) != (batch, channels, 1) or xv.dtype != state.dtype:
            raise m.NoMatch(f"the new column is not [{batch}, {channels}, 1] {state.dtype}")

        new = cat
        cast = _only_user(cat)
        if cast is not None and m.op_name(cast) in ("to", "float"):
            new = cast
        slices = [u for u in new.users if m.op_name(u) == "getitem"]
        convs = [u for u in new.users if m.op_name(u) == "conv1d"]
        if len(slices) != 1 or len(convs) != 1 or len(new.users) != 2:
            raise m.NoMatch("the concatenated columns are not read by exactly one slice and one conv1d")
        keep, conv = slices[0], convs[0]
        if not _last_columns(keep, new, width + 1, width) or copy.args[1] is not keep or copy.users:
            raise m.NoMatch("the state is not overwritten with the last K concatenated columns")
        if not (gather < cat < copy < scatter):
            raise m.NoMatch("the read, shift and write-back of the state are out of order")

        weight3, bias = m.call_arg(conv, 1, "weight"), m.call_arg(conv, 2, "bias")
        wv = m.value(weight3)
        settings = [m.call_arg(conv, i, n, d) for i, n, d in ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1))]
        if (conv.args[0] is not new or wv is None or tuple(wv.shape) != (channels, 1, width)
                or m.call_arg(conv, 6, "groups", 1) != channels
                or any(s not in (v, [v], (v,)) for s, v in zip(settings, (1, 0, 1)))):
            raise m.NoMatch("the conv1d is not depthwise over [C, 1, K] with stride 1, padding 0, dilation 1")
        if m.value(new).dtype != wv.dtype or (bias is not None and m.value(bias) is None):
            raise m.NoMatch("the columns are not cast to the weight's dtype before the conv")

        last = _only_user(conv)
        if last is None or not _last_columns(last, conv, 2, 1):
            raise m.NoMatch("the conv output is not cut to its last column")
        matched = {gather, cat, new, keep, copy, conv, last, scatter}
        result, activation = last, None
        act = _only_user(last)
        if act is not None and m.op_name(act) == "silu" and not m.call_arg(act, 1, "inplace", False):
            result, activation = act, "silu"
            matched.add(act)
        final = _only_user(result)
        if final is not None and m.op_name(final) in ("to", "float") and m.value(final) is not None:
            result = final
            matched.add(final)
        if m.value(result).dtype != state.dtype:
            raise m.NoMatch(f"the output is {m.value(result).dtype}, not the input's {state.dtype}")

        written = m.state_access(scatter)
        if (written is None or not written.same_slots(access) or written.offset != access.offset
                or m.call_arg(scatter, 3, "value") is not gather):
            raise m.NoMatch("the write-back goes to other slots or another offset")
        leak = m.users_within(matched - {result}, matched)
        if leak is not None:
            raise m.NoMatch(f"{leak.name} ({m.op_name(leak)}) is also read outside the conv step")
        end = scatter if result < scatter else result
        conflict = m.first_conflict(access, gather, end, matched)
        if conflict is not None:
            raise m.NoMatch(conflict)

        weight2 = None
        if m.unsqueezed(weight3, 1) is not None:
            weight2 = m.unsqueezed(weight3, 1)
            if len(weight3.users) == 1:
                matched.add(weight3)
        return dict(access=access, x=x, weight3=weight3, weight2=weight2, bias=bias, activation=activation,
                    result=result, matched=matched)

    # ------------------------------------------------------------------ replacement
    @staticmethod
    def _replace(graph: Graph, match: dict) -> None:
        result, access = match["result"], match["access"]
        x2 = m.insert_call(graph, result, torch.squeeze, (match["x"], -1), like=result)
        weight = match["weight2"]
        if weight is None:
            weight = m.insert_call(graph, result, torch.squeeze, (match["weight3"], 1), like=result)
        out = m.insert_call(
            graph, result, torch.ops.unimem.causal_conv1d_update.default,
            (x2, access.arena, access.s_v2p, access.slot_ids, access.offset, access.slot_bytes, weight,
             match["bias"], match["activation"]),
            like=result,
        )
        out3 = m.insert_call(graph, result, torch.unsqueeze, (out, -1), like=result)
        result.replace_all_uses_with(out3)
        m.erase_matched(graph, match["matched"])
