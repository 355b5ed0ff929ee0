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
alone (the graph stays correct) and the reason is logged. Refused: the gathered state has another reader
or writer, the write-back goes elsewhere, another op touches the same slot bytes between the read and
the write-back, the conv is not the depthwise valid one over exactly the K + 1 columns.

Why this one stays a hand matcher (unlike ``mla_write_fusion`` and ``kda_state_inplace``, whose plain
math is a search function of :mod:`.pattern`): almost nothing here is arithmetic that a traced function
pins down. The window shift is an in-place ``state.copy_(new[:, :, -K:])`` on a side branch of the
output's computation, and whether a slice keeps "the last K of the K + 1 columns" depends on the shapes
(transformers writes ``-state_len:``, Dynamo records the literal; ``[..., 1:]`` is the same window); the
conv is right only as the depthwise one (``groups`` equal to the channel count, weight ``[C, 1, K]``,
stride / padding / dilation each spelled as an int or a one-element list); the concatenation takes a list;
the activation and the final cast are optional. A search function would need Pattern support for list
arguments, in-place anchors, shape-dependent slices and optional operations, plus one search function per
activation, and the shape checks would remain beside it: more code for the same coverage. The matcher
below checks each of these on the fake values directly.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from unimem_compile import ops  # noqa: F401  (registers torch.ops.unimem.*)

from . import state_common
from .common import (
    Refused,
    Rewrite,
    argument,
    check_closed,
    erase_matched,
    insert_call,
    is_op,
    only_user,
    op_arguments,
    op_name,
    tensor_value,
)
from .state_common import first_conflict, state_access, unsqueezed

__all__ = ["ConvStateInplace"]


def _last_columns(node: Node, src: Node, length: int, count: int) -> bool:
    """``node`` is ``src[:, :, s]`` (or ``src[..., s]``) and ``s`` keeps the last ``count`` of ``length`` columns."""
    if op_name(node) != "getitem" or node.args[0] is not src or not isinstance(node.args[1], tuple):
        return False
    idx = node.args[1]
    full = slice(None)
    if idx[:-1] not in ((full, full), (Ellipsis,)) or not isinstance(idx[-1], slice):
        return False
    return list(range(length))[idx[-1]] == list(range(length - count, length))


class ConvStateInplace(Rewrite):
    """The ``conv_state_inplace`` rewrite (docs/passes.md); sites are ``[B, C, K]`` state gathers."""

    name = "conv_state_inplace"
    extra_sources = (state_common.__file__,)  # the state-op helpers it matches with

    def sites(self, graph: Graph) -> list[Node]:
        return [n for n in graph.nodes if is_op(n, torch.ops.unimem.state_gather)
                and tensor_value(n) is not None and tensor_value(n).dim() == 3]

    def match(self, graph: Graph, gather: Node) -> dict:
        access = state_access(gather)
        state = tensor_value(gather)
        if access is None:
            raise Refused("slot offset or pitch is not a constant")
        batch, channels, width = state.shape
        cats = [u for u in gather.users if op_name(u) == "cat"]
        copies = [u for u in gather.users if op_name(u) == "copy_" and u.args[0] is gather]
        scatters = [u for u in gather.users if is_op(u, torch.ops.unimem.state_scatter)]
        if len(cats) != 1 or len(copies) != 1 or len(scatters) != 1 or len(gather.users) != 3:
            raise Refused(f"the gathered state is read by {sorted(str(op_name(u)) for u in gather.users)}; the "
                          "rewrite needs exactly one cat, one in-place copy_ and one state_scatter (a decode "
                          "step's conv update; prefill graphs differ)")
        cat, copy, scatter = cats[0], copies[0], scatters[0]

        tensors, dim = argument(cat, 0, "tensors"), argument(cat, 1, "dim", 0)
        if (not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or tensors[0] is not gather
                or dim not in (-1, 2)):
            raise Refused("the state is not concatenated in front of one new column on the last axis")
        x = tensors[1]
        xv = tensor_value(x)
        if xv is None or tuple(xv.shape) != (batch, channels, 1) or xv.dtype != state.dtype:
            raise Refused(f"the new column is not [{batch}, {channels}, 1] {state.dtype}")

        new = cat
        if op_name(only_user(cat)) in ("to", "float"):
            new = only_user(cat)
        slices = [u for u in new.users if op_name(u) == "getitem"]
        convs = [u for u in new.users if op_name(u) == "conv1d"]
        if len(slices) != 1 or len(convs) != 1 or len(new.users) != 2:
            raise Refused("the concatenated columns are not read by exactly one slice and one conv1d")
        keep, conv = slices[0], convs[0]
        if not _last_columns(keep, new, width + 1, width) or copy.args[1] is not keep or copy.users:
            raise Refused("the state is not overwritten with the last K concatenated columns")
        if not (gather < cat < copy < scatter):
            raise Refused("the read, shift and write-back of the state are out of order")

        weight3, bias = argument(conv, 1, "weight"), argument(conv, 2, "bias", None)
        wv = tensor_value(weight3)
        settings = [argument(conv, i, n, d) for i, n, d in ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1))]
        if (conv.args[0] is not new or wv is None or tuple(wv.shape) != (channels, 1, width)
                or argument(conv, 6, "groups", 1) != channels
                or any(s not in (v, [v], (v,)) for s, v in zip(settings, (1, 0, 1)))):
            raise Refused("the conv1d is not depthwise over [C, 1, K] with stride 1, padding 0, dilation 1")
        if tensor_value(new).dtype != wv.dtype or (bias is not None and tensor_value(bias) is None):
            raise Refused("the columns are not cast to the weight's dtype before the conv")

        last = only_user(conv)
        if last is None or not _last_columns(last, conv, 2, 1):
            raise Refused("the conv output is not cut to its last column")
        matched = {gather, cat, new, keep, copy, conv, last, scatter}
        result, activation = last, None
        act = only_user(last)
        if op_name(act) == "silu" and not argument(act, 1, "inplace", False):
            result, activation = act, "silu"
            matched.add(act)
        final = only_user(result)
        if op_name(final) in ("to", "float") and tensor_value(final) is not None:
            result = final
            matched.add(final)
        if tensor_value(result).dtype != state.dtype:
            raise Refused(f"the output is {tensor_value(result).dtype}, not the input's {state.dtype}")

        written = state_access(scatter)
        if (written is None or not written.same_slots(access) or written.offset != access.offset
                or op_arguments(scatter)["value"] is not gather):
            raise Refused("the write-back goes to other slots or another offset")
        check_closed(matched, exits=[result])
        conflict = first_conflict(access, gather, scatter if result < scatter else result, matched)
        if conflict is not None:
            raise Refused(conflict)

        weight2 = unsqueezed(weight3, 1)
        optional = [weight3] if weight2 is not None else []
        return dict(access=access, x=x, weight3=weight3, weight2=weight2, bias=bias, activation=activation,
                    result=result, matched=matched, optional=optional)

    def replace(self, graph: Graph, match: dict) -> None:
        result, access = match["result"], match["access"]
        with graph.inserting_before(result):
            x2 = insert_call(graph, torch.squeeze, (match["x"], -1), like=result)
            weight = match["weight2"]
            if weight is None:
                weight = insert_call(graph, torch.squeeze, (match["weight3"], 1), like=result)
            out = insert_call(
                graph, torch.ops.unimem.causal_conv1d_update.default,
                (x2, access.arena, access.s_v2p, access.slot_ids, access.offset, access.slot_bytes, weight,
                 match["bias"], match["activation"]),
                like=result,
            )
            out3 = insert_call(graph, torch.unsqueeze, (out, -1), like=result)
        result.replace_all_uses_with(out3)
        erase_matched(graph, match["matched"], match["optional"])
