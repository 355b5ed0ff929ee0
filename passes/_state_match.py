"""Matching helpers shared by the two state rewrites (``kda_state_inplace``, ``conv_state_inplace``).

They read Dynamo-level FX graphs: torch functions, tensor methods and ``operator`` calls, each node's
fake value in ``meta["example_value"]``. A helper either returns what it recognised or None; none of them
changes the graph except :func:`insert_call` and :func:`erase_matched`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch.fx import Graph, Node

__all__ = [
    "NoMatch", "StateAccess", "op_name", "value", "call_arg", "state_access", "first_conflict",
    "is_noop_cast", "strip_noops", "strip_upcast", "unsqueezed", "token0", "users_within", "insert_call", "erase_matched",
]

_OPERATORS = {
    operator.mul: "mul", operator.add: "add", operator.sub: "sub", operator.truediv: "div",
    operator.getitem: "getitem", operator.setitem: "setitem", operator.neg: "neg",
}

#: positional parameter names of the functions and methods whose arguments are read by name
_SIGNATURES = {
    "conv1d": ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    "to": ("self", "dtype"),
    "sum": ("self", "dim", "keepdim"),
    "unsqueeze": ("self", "dim"),
    "select": ("self", "dim", "index"),
    "cat": ("tensors", "dim"),
    "silu": ("input", "inplace"),
}


class NoMatch(Exception):
    """A candidate does not have the expected structure; the message says where it differs."""


def op_name(node: Node) -> str | None:
    """A short name of what ``node`` computes: ``"mul"``, ``"exp"``, ``"to"``, ``"unimem.state_gather"``...

    Functions and methods share names (``torch.exp(x)`` and ``x.exp()`` are both ``"exp"``) so a pattern
    matches whichever spelling the model's code used. None for placeholders, outputs and modules.
    """
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return None
    target = node.target
    if target in _OPERATORS:
        return _OPERATORS[target]
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = target._schema.name if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name
        return name.replace("::", ".")
    return getattr(target, "__name__", None)


def value(node) -> torch.Tensor | None:
    """The fake tensor Dynamo recorded for ``node`` (None if it is not a node or has no tensor value)."""
    if not isinstance(node, Node):
        return None
    v = node.meta.get("example_value", node.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def call_arg(node: Node, index: int, name: str, default=None):
    """Argument ``index`` (positional, counting ``self`` for methods) or keyword ``name`` of ``node``."""
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def _named(node: Node, name: str, default=None):
    params = _SIGNATURES[op_name(node)]
    return call_arg(node, params.index(name), name, default)


_STATE_OPS = {
    "unimem.state_gather": ("arena", "s_v2p", "slot_ids", "byte_offset", "slot_bytes"),
    "unimem.state_scatter": ("arena", "s_v2p", "slot_ids", "byte_offset", "slot_bytes"),
    "unimem.causal_conv1d_update": ("arena", "s_v2p", "slot_ids", "conv_offset", "slot_bytes"),
    "unimem.kda_decode": ("arena", "s_v2p", "slot_ids", "state_offset", "slot_bytes"),
}


class StateAccess:
    """A state op's view of the arena: which tensors address it and which bytes of each slot it touches.

    Attributes:
        node: the op's node. arena, s_v2p, slot_ids: its argument nodes.
        offset: byte offset of the section inside a slot. slot_bytes: the slot pitch.
        nbytes: the section's size in bytes (from the fake shapes). writes: whether it writes the section.
    """

    def __init__(self, node: Node):
        name = op_name(node)
        schema = node.target._schema if isinstance(node.target, torch._ops.OpOverload) else node.target.default._schema
        params = [a.name for a in schema.arguments]
        bound = {p: call_arg(node, i, p) for i, p in enumerate(params)}
        arena, s_v2p, slot_ids, offset, pitch = (bound[p] for p in _STATE_OPS[name])
        self.node, self.arena, self.s_v2p, self.slot_ids = node, arena, s_v2p, slot_ids
        self.offset, self.slot_bytes = offset, pitch
        self.writes = name != "unimem.state_gather"
        self.nbytes = self._nbytes(name, bound)

    @staticmethod
    def _nbytes(name: str, bound: dict) -> int | None:
        if name == "unimem.state_gather":
            numel = 1
            for s in bound["shape"]:
                numel *= s
            return numel * torch.empty((), dtype=bound["dtype"]).element_size()
        if name == "unimem.state_scatter":
            v = value(bound["value"])
            return None if v is None else v[0].numel() * v.element_size()
        if name == "unimem.causal_conv1d_update":
            x, w = value(bound["x"]), value(bound["weight"])
            return None if x is None or w is None else x.shape[1] * w.shape[1] * x.element_size()
        q, v = value(bound["q"]), value(bound["v"])
        return None if q is None or v is None else q.shape[1] * q.shape[2] * v.shape[2] * 4

    def same_slots(self, other: StateAccess) -> bool:
        """Both address the same slots of the same arena (same argument nodes and pitch)."""
        return (self.arena is other.arena and self.s_v2p is other.s_v2p and self.slot_ids is other.slot_ids
                and self.slot_bytes == other.slot_bytes)

    def overlaps(self, other: StateAccess) -> bool:
        """The two byte ranges inside a slot intersect (unknown sizes count as overlapping)."""
        if not all(isinstance(x, int) for x in (self.offset, other.offset, self.nbytes, other.nbytes)):
            return True
        return self.offset < other.offset + other.nbytes and other.offset < self.offset + self.nbytes


def state_access(node: Node) -> StateAccess | None:
    """The :class:`StateAccess` of a unimem state op node with integer offsets, else None."""
    if op_name(node) not in _STATE_OPS:
        return None
    access = StateAccess(node)
    if not isinstance(access.offset, int) or not isinstance(access.slot_bytes, int):
        return None
    return access


def first_conflict(section: StateAccess, start: Node, end: Node, matched: set[Node]) -> str | None:
    """Why moving ``section``'s read and write anywhere between ``start`` and ``end`` would be unsafe.

    Every node strictly between the two (graph order) that is not part of the match and takes the arena
    must be a unimem state op on the same slots whose bytes do not overlap ``section``'s. Returns None when
    that holds, else a short reason naming the node.
    """
    node = start.next
    while node is not end and node.op != "output":
        if node not in matched and section.arena in node.all_input_nodes:
            other = state_access(node)
            if other is None or not other.same_slots(section):
                return f"{node.name} ({op_name(node)}) uses the arena between the state's read and write-back"
            if other.overlaps(section):
                return f"{node.name} ({op_name(node)}) touches the same state bytes in between"
        node = node.next
    return None


def is_noop_cast(node) -> bool:
    """``node`` returns its input's value unchanged: ``.to``/``.float()`` to the same dtype, shape and
    device, ``.contiguous()``, ``.clone()``."""
    if not isinstance(node, Node) or op_name(node) not in ("to", "float", "contiguous", "clone", "type_as"):
        return False
    src, out = value(node.args[0]) if node.args else None, value(node)
    return (src is not None and out is not None and src.dtype == out.dtype and src.shape == out.shape
            and src.device == out.device)


def strip_noops(node, *, forward: bool = False, skipped: list | None = None):
    """Skip casts and copies that do not change the value (:func:`is_noop_cast`).

    Backward (default): from a node to its source. ``forward=True``: from a node down its chain of single
    users. Returns the node reached; the nodes passed over are appended to ``skipped`` if given.
    """
    seen = [] if skipped is None else skipped
    if forward:
        while len(node.users) == 1 and is_noop_cast(next(iter(node.users))):
            node = next(iter(node.users))
            seen.append(node)
        return node
    while is_noop_cast(node):
        seen.append(node)
        node = node.args[0]
    return node


def strip_upcast(node, skipped: list | None = None):
    """Skip value-preserving copies and at most one exact conversion to fp32 (from fp16/bf16/fp32).

    Returns the source reached; the nodes passed over are appended to ``skipped`` if given.
    """
    node = strip_noops(node, skipped=skipped)
    if isinstance(node, Node) and op_name(node) in ("to", "float") and node.args:
        src, out = value(node.args[0]), value(node)
        if (src is not None and out is not None and out.dtype == torch.float32 and src.shape == out.shape
                and src.dtype in (torch.float16, torch.bfloat16, torch.float32) and src.device == out.device):
            if skipped is not None:
                skipped.append(node)
            return strip_noops(node.args[0], skipped=skipped)
    return node


def unsqueezed(node, dim: int):
    """The tensor ``node`` adds a size-1 axis to at ``dim`` (negative: from the end), or None.

    Recognises ``x.unsqueeze(d)`` / ``torch.unsqueeze(x, d)`` and indexing ``x[..., None]`` (dim -1) /
    ``x[..., None, :]`` (dim -2).
    """
    out = value(node)
    if out is None:
        return None
    name = op_name(node)
    if name == "unsqueeze":
        d = _named(node, "dim")
        return node.args[0] if isinstance(d, int) and d % out.dim() == dim % out.dim() else None
    if name == "getitem" and isinstance(node.args[1], tuple) and node.args[1] and node.args[1][0] is Ellipsis:
        tail = node.args[1][1:]
        full = slice(None, None, None)
        if dim < 0 and len(tail) == -dim and tail[0] is None and all(t == full for t in tail[1:]):
            return node.args[0]
    return None


def token0(node):
    """``x`` when ``node`` takes token 0 of ``x [B, 1, ...]`` (``x[:, 0]``, ``x.select(1, 0)``), else None."""
    name = op_name(node)
    src = node.args[0] if name in ("getitem", "select") and node.args else None
    v = value(src)
    if v is None or v.dim() < 2 or v.shape[1] != 1:
        return None
    if name == "getitem":
        idx = node.args[1]
        ok = isinstance(idx, tuple) and len(idx) == 2 and idx[0] == slice(None, None, None) and idx[1] in (0, -1)
        return src if ok else None
    return src if _named(node, "dim") == 1 and _named(node, "index") in (0, -1) else None


def users_within(nodes: Iterable[Node], allowed: set[Node]) -> Node | None:
    """The first node of ``nodes`` with a user outside ``allowed`` (None when all stay inside)."""
    for n in nodes:
        if any(u not in allowed for u in n.users):
            return n
    return None


def _fake_mode(args):
    """The fake mode of the arguments' recorded values (the one Dynamo traced the graph with)."""
    modes = []
    torch.fx.node.map_arg(args, lambda a: modes.append(getattr(value(a), "fake_mode", None)))
    return next((mode for mode in modes if mode is not None), None)


def insert_call(graph: Graph, before: Node, target, args: tuple, like: Node | None = None) -> Node:
    """Insert ``target(*args)`` before ``before``, with its fake value computed like Dynamo records it.

    ``like`` lends its ``stack_trace`` and ``nn_module_stack`` so dumps and reports still name the layer.
    """
    with graph.inserting_before(before):
        node = graph.call_function(target, args)
    fake_args = torch.fx.node.map_arg(args, lambda a: value(a))
    mode = _fake_mode(args)
    if mode is not None:
        with mode:
            node.meta["example_value"] = target(*fake_args)
    if like is not None:
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    return node


def erase_matched(graph: Graph, matched: set[Node]) -> None:
    """Erase the matched nodes that nothing uses any more, last first (never dead-code elimination)."""
    for node in reversed(list(graph.nodes)):
        if node in matched and not node.users:
            graph.erase_node(node)
