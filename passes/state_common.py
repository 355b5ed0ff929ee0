"""What the state rewrites (``kda_state_inplace``, ``conv_state_inplace``) share, beside :mod:`.common`.

The parts of their matches that are not plain math: the shape-dependent views (:func:`unsqueezed`,
:func:`token0`), the optional casts around the math (:func:`strip_noops`, :func:`strip_upcast`), and the
unimem state ops described by the bytes of each slot they touch (their declared footprints,
:data:`unimem_compile.ops.common.SLOT_FOOTPRINTS`): :class:`StateAccess`, :func:`first_conflict`. The
plain math of the KDA step is a search function (passes/kda_state_inplace.py, :mod:`.pattern`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from unimem_compile.ops.common import COMPUTE_DTYPES, SLOT_ARGUMENTS, SLOT_FOOTPRINTS

from .common import argument, cast_of, describe, only_user, op_arguments, op_name, op_schema, tensor_value

__all__ = [
    "unsqueezed",
    "token0",
    "is_noop_cast",
    "strip_noops",
    "strip_upcast",
    "StateAccess",
    "state_access",
    "first_conflict",
]

def unsqueezed(node: Any, dim: int) -> Node | None:
    """The tensor ``node`` adds a size-1 axis to at ``dim`` (negative: counted from the end), or None.

    Recognises ``x.unsqueeze(d)`` / ``torch.unsqueeze(x, d)`` and indexing ``x[..., None]`` (dim -1) /
    ``x[..., None, :]`` (dim -2).
    """
    out = tensor_value(node)
    if out is None:
        return None
    name = op_name(node)
    if name == "unsqueeze":
        d = argument(node, 1, "dim", None)
        return node.args[0] if isinstance(d, int) and d % out.dim() == dim % out.dim() else None
    if name == "getitem" and isinstance(node.args[1], tuple) and node.args[1] and node.args[1][0] is Ellipsis:
        tail = node.args[1][1:]
        if dim < 0 and len(tail) == -dim and tail[0] is None and all(t == slice(None) for t in tail[1:]):
            return node.args[0]
    return None


def token0(node: Any) -> Node | None:
    """``x`` when ``node`` takes the only token of ``x [B, 1, ...]`` (``x[:, 0]``, ``x.select(1, 0)``), else
    None."""
    name = op_name(node)
    src = node.args[0] if name in ("getitem", "select") and node.args else None
    v = tensor_value(src)
    if v is None or v.dim() < 2 or v.shape[1] != 1:
        return None
    if name == "getitem":
        idx = node.args[1]
        ok = isinstance(idx, tuple) and len(idx) == 2 and idx[0] == slice(None) and idx[1] in (0, -1)
        return src if ok else None
    return src if argument(node, 1, "dim", None) == 1 and argument(node, 2, "index", None) in (0, -1) else None


def is_noop_cast(node: Any) -> bool:
    """``node`` returns its input's value unchanged: ``.to``/``.float()``/``.type_as`` to the same dtype,
    shape and device, ``.contiguous()``, ``.clone()``."""
    if op_name(node) not in ("to", "float", "contiguous", "clone", "type_as") or not node.args:
        return False
    src, out = tensor_value(node.args[0]), tensor_value(node)
    return (src is not None and out is not None and src.dtype == out.dtype and src.shape == out.shape
            and src.device == out.device)


def strip_noops(node: Any, *, forward: bool = False, skipped: list | None = None) -> Any:
    """Skip :func:`is_noop_cast` nodes: backward (default) from a node to its source, or ``forward`` down
    a chain of single users. Returns the node reached; appends the nodes passed over to ``skipped``."""
    seen = [] if skipped is None else skipped
    if forward:
        while only_user(node) is not None and is_noop_cast(only_user(node)):
            node = only_user(node)
            seen.append(node)
        return node
    while is_noop_cast(node):
        seen.append(node)
        node = node.args[0]
    return node


def strip_upcast(node: Any, skipped: list | None = None) -> Any:
    """Skip value-preserving copies and at most one exact conversion to fp32 (from fp16/bf16/fp32);
    returns the source reached and appends the nodes passed over to ``skipped``."""
    node = strip_noops(node, skipped=skipped)
    cast = cast_of(node)
    if cast is not None and cast[1] == torch.float32:
        src = tensor_value(cast[0])
        if src is not None and src.dtype in COMPUTE_DTYPES:
            if skipped is not None:
                skipped.append(node)
            return strip_noops(cast[0], skipped=skipped)
    return node


class StateAccess:
    """How a unimem state op node addresses the arena, and which bytes of each slot it touches (the op's
    declared :class:`~unimem_compile.ops.common.SlotFootprint`).

    Attributes:
        node: the op's node. arena, s_v2p, slot_ids: its argument nodes.
        offset: byte offset of the section inside a slot (int). slot_bytes: the slot pitch (int).
        nbytes: the section's size in bytes from the fake shapes (None if unknown).
    """

    def __init__(self, node: Node):
        footprint = SLOT_FOOTPRINTS[op_schema(node).name]
        bound = op_arguments(node)
        self.node = node
        self.arena, self.s_v2p, self.slot_ids, self.slot_bytes = (bound[name] for name in SLOT_ARGUMENTS)
        self.offset = bound[footprint.offset]
        self.nbytes = footprint.nbytes({k: tensor_value(v) if isinstance(v, Node) else v for k, v in bound.items()})

    def same_slots(self, other: StateAccess) -> bool:
        """Both address the same slots of the same arena (same argument nodes and pitch)."""
        return (self.arena is other.arena and self.s_v2p is other.s_v2p and self.slot_ids is other.slot_ids
                and self.slot_bytes == other.slot_bytes)

    def overlaps(self, other: StateAccess) -> bool:
        """The two byte ranges inside a slot intersect (an unknown size counts as overlapping)."""
        if not all(isinstance(x, int) for x in (self.offset, other.offset, self.nbytes, other.nbytes)):
            return True
        return self.offset < other.offset + other.nbytes and other.offset < self.offset + self.nbytes


def state_access(node: Any) -> StateAccess | None:
    """The :class:`StateAccess` of a unimem state op node whose offset and pitch are constants, else None."""
    schema = op_schema(node)
    if schema is None or schema.name not in SLOT_FOOTPRINTS:
        return None
    access = StateAccess(node)
    if not isinstance(access.offset, int) or not isinstance(access.slot_bytes, int):
        return None
    return access


def first_conflict(section: StateAccess, start: Node, end: Node, matched: set[Node]) -> str | None:
    """Why moving ``section``'s read and write-back anywhere between ``start`` and ``end`` would be unsafe.

    Every node strictly between the two (graph order) that is not in ``matched`` and takes the arena must
    be a unimem state op on the same slots whose bytes do not overlap ``section``'s. Returns None when that
    holds, else a short reason.
    """
    node = start.next
    while node is not end and node.op != "output":
        if node not in matched and section.arena in node.all_input_nodes:
            other = state_access(node)
            if other is None or not other.same_slots(section):
                return f"{describe(node)} uses the arena between the state's read and its write-back"
            if other.overlaps(section):
                return f"{describe(node)} touches the same state bytes in between"
        node = node.next
    return None
