"""What every rewrite shares: the :class:`Rewrite` base class and helpers that match Dynamo-level nodes.

The graphs rewritten here are the ones Dynamo hands to a backend (docs/design.md section 7): torch functions
and Tensor methods, one node per call, SDPA as one node, parameters as placeholders, and the unimem op
calls as unambiguous anchors. Every node carries ``meta["example_value"]`` (a fake tensor) and
``meta["nn_module_stack"]``. Rewrites match on structure and on those shapes, never on node names or
order, and erase only the nodes they matched (``eliminate_dead_code`` would also delete in-place writes
such as a cache's ``index_copy_``, which look side-effect free to it).

A rewrite is a :class:`Rewrite`: it lists its candidate sites (one anchor node each), matches each one
completely before touching the graph, and either replaces it or refuses with a reason. The refusals of
one graph are logged as ONE line on the ``unimem_compile.passes`` logger.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import operator
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, GraphModule, Node

__all__ = [
    "log",
    "Refused",
    "describe",
    "Rewrite",
    "source_hash",
    "value",
    "dims",
    "is_function",
    "is_method",
    "is_op",
    "argument",
    "op_schema",
    "op_arguments",
    "only_user",
    "last_dim_slice",
    "split_item",
    "cast_of",
    "strip",
    "VIEW_METHODS",
    "CAST_METHODS",
    "site_name",
    "copy_graph",
    "topological_order",
    "insert_call",
    "erase_matched",
    "check_closed",
    "op_name",
    "tensor_value",
]

log = logging.getLogger("unimem_compile.passes")

#: Tensor methods that only reinterpret a tensor's shape (the values stay where they are).
VIEW_METHODS = ("view", "reshape", "unsqueeze", "squeeze", "flatten", "contiguous")
#: Tensor methods that may change a tensor's dtype and nothing else.
CAST_METHODS = ("to", "type", "float", "half", "bfloat16")


class Refused(Exception):
    """A candidate site does not match; ``str(exc)`` says why in a few words."""


def source_hash(*paths: str | Path, extra: str = "") -> str:
    """SHA-256 of the files' bytes followed by ``extra`` (settings), hex."""
    h = hashlib.sha256()
    for path in paths:
        h.update(Path(path).read_bytes())
    h.update(extra.encode())
    return h.hexdigest()


class Rewrite(CustomGraphPass):
    """One graph rewrite: match every candidate site, replace the ones that match, count them.

    Subclasses set ``name`` and implement :meth:`sites` (anchor nodes), :meth:`match` (raise
    :class:`Refused` or return whatever :meth:`replace` needs; must not modify the graph) and
    :meth:`replace`. :meth:`settings` lists anything besides the source code that changes the result.

    An instance is also an Inductor ``CustomGraphPass`` for ``torch._inductor.config.pre_grad_custom_pass``:
    calling it with a ``torch.fx.Graph`` (or a ``GraphModule``) rewrites it in place; :meth:`uuid` hashes
    this module, the subclass's module and :meth:`settings` for Inductor's compile cache.

    Attributes:
        name: the FROZEN rewrite name (docs/design.md section 5).
        count: replacements made by the last call; ``refusals``: the reasons of the last call.
    """

    name: str = ""
    #: source files besides this module and the subclass's own that decide what the rewrite matches or
    #: emits (shared matchers): part of :meth:`uuid`
    extra_sources: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.count = 0
        self.refusals: list[str] = []

    # ---- what a subclass provides
    def sites(self, graph: Graph) -> Iterable[Node]:
        raise NotImplementedError

    def match(self, graph: Graph, site: Node) -> Any:
        raise NotImplementedError

    def replace(self, graph: Graph, match: Any) -> None:
        raise NotImplementedError

    def settings(self) -> dict:
        """Options that change what the rewrite produces (part of :meth:`uuid`)."""
        return {}

    # ---- the driver
    def __call__(self, graph: Graph | GraphModule) -> int:  # type: ignore[override]
        """Rewrite ``graph`` in place; returns the number of replacements (the caller recompiles a
        GraphModule). Sites that do not match are left untouched and reported in one log line."""
        g = graph.graph if isinstance(graph, GraphModule) else graph
        self.count, self.refusals = 0, []
        for site in list(self.sites(g)):
            try:
                found = self.match(g, site)
            except Refused as why:
                self.refusals.append(f"{site_name(site)}: {why}")
                continue
            self.replace(g, found)
            self.count += 1
        if self.refusals:
            log.info("%s: %d of %d site(s) left unchanged: %s", self.name, len(self.refusals),
                     len(self.refusals) + self.count, "; ".join(self.refusals))
        return self.count

    def uuid(self) -> str:
        """Hash of the rewrite's source (its module, this one and :attr:`extra_sources`) and :meth:`settings`."""
        module = inspect.getmodule(type(self))
        files = [__file__] + ([module.__file__] if module is not None and module.__file__ else [])
        files += list(self.extra_sources)
        return source_hash(*dict.fromkeys(files), extra=f"{self.name}:{sorted(self.settings().items())!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# ------------------------------------------------------------------------------------------ node queries
def value(node: Any) -> Any:
    """The fake value Dynamo recorded for ``node`` (a FakeTensor, a tuple of them, None), else None."""
    if not isinstance(node, Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def dims(node: Any) -> tuple[int | None, ...] | None:
    """``node``'s tensor sizes, a symbolic size as None (never compared, so no guard is added); None if
    ``node`` is not a tensor."""
    v = value(node)
    if not isinstance(v, torch.Tensor):
        return None
    return tuple(s if isinstance(s, int) else None for s in v.shape)


def _target_matches(target: Any, candidates: Sequence[Any]) -> bool:
    for c in candidates:
        if target is c:
            return True
        if isinstance(target, torch._ops.OpOverload) and target.overloadpacket is c:
            return True
    return False


def is_function(node: Any, *targets: Any) -> bool:
    """``node`` calls one of ``targets`` (an op packet also matches its overloads)."""
    return isinstance(node, Node) and node.op == "call_function" and _target_matches(node.target, targets)


def is_method(node: Any, *names: str) -> bool:
    """``node`` calls a Tensor method named one of ``names``."""
    return isinstance(node, Node) and node.op == "call_method" and node.target in names


def is_op(node: Any, op: Any) -> bool:
    """``node`` calls the custom op ``op`` (``torch.ops.unimem.x``, any overload)."""
    return is_function(node, op)


_MISSING = object()


def argument(node: Node, index: int, name: str, default: Any = _MISSING) -> Any:
    """Argument ``index`` (positional, ``self`` of a method included) or keyword ``name`` of ``node``."""
    if len(node.args) > index:
        return node.args[index]
    if name in node.kwargs:
        return node.kwargs[name]
    if default is _MISSING:
        raise Refused(f"{describe(node)} has no argument {name!r}")
    return default


def op_schema(node: Any) -> torch.FunctionSchema | None:
    """The schema of the torch op ``node`` calls (an OpOverload, or a packet's default overload), else None."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    return target._schema if isinstance(target, torch._ops.OpOverload) else None


def op_arguments(node: Node) -> dict[str, Any]:
    """The arguments of an op node bound to its schema by name, whether the call passed them by position or
    by keyword; an argument the call leaves out is its schema default (None when it has none).

    Raises:
        Refused: ``node`` does not call a torch op.
    """
    schema = op_schema(node)
    if schema is None:
        raise Refused(f"{describe(node)} is not a call of a torch op")
    return {a.name: argument(node, i, a.name, a.default_value if a.has_default_value() else None)
            for i, a in enumerate(schema.arguments)}


def only_user(node: Node) -> Node | None:
    """The single user of ``node``, or None when it has none or several."""
    return next(iter(node.users)) if len(node.users) == 1 else None


def describe(node: Any) -> str:
    """A short, name-free description of a node for log lines: its call and its shape."""
    if not isinstance(node, Node):
        return repr(node)
    if node.op == "call_method":
        what = f".{node.target}()"
    elif node.op == "call_function":
        what = f"{getattr(node.target, '__name__', node.target)}()"
    else:
        what = node.op
    shape = dims(node)
    return what if shape is None else f"{what} {list(shape)}"


def strip(node: Any, methods: Sequence[str], functions: Sequence[Any] = ()) -> tuple[Any, list[Node]]:
    """Walk from ``node`` back through calls of ``methods`` / ``functions`` (first argument = the tensor);
    returns the first other node and the nodes walked through, outermost first."""
    walked = []
    while is_method(node, *methods) or is_function(node, *functions):
        walked.append(node)
        node = node.args[0]
    return node, walked


def cast_of(node: Any) -> tuple[Node, torch.dtype] | None:
    """If ``node`` only converts a tensor's dtype (``x.to(dtype)``, ``x.type(dtype)``, ``x.float()``, ...),
    returns ``(x, dtype)``; otherwise None."""
    if not isinstance(node, Node) or node.op != "call_method" or node.target not in CAST_METHODS:
        return None
    fixed = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
    if node.target in fixed:
        return (node.args[0], fixed[node.target]) if len(node.args) == 1 and not node.kwargs else None
    rest = dict(node.kwargs)
    dtype = node.args[1] if len(node.args) == 2 else rest.pop("dtype", None)
    if len(node.args) > 2 or rest or not isinstance(dtype, torch.dtype):
        return None
    return node.args[0], dtype


def _normalise_slice(s: slice, size: int | None) -> tuple[int, int] | None:
    if s.step not in (None, 1) or size is None:
        return None
    start, stop, _ = s.indices(size)
    return start, stop


def last_dim_slice(node: Any) -> tuple[Node, int, int] | None:
    """If ``node`` is ``base[..., a:b]`` (other index entries being ``:``, ``None`` or ``...``; step 1),
    returns ``(base, a, b)`` with ``a, b`` resolved against the base's last size; otherwise None."""
    if not is_function(node, operator.getitem):
        return None
    base, index = node.args
    base_dims = dims(base)
    if base_dims is None:
        return None
    index = index if isinstance(index, tuple) else (index,)
    if not index or not isinstance(index[-1], slice):
        return None
    for entry in index[:-1]:
        if not (entry is None or entry is Ellipsis or entry == slice(None)):
            return None
    consumed = sum(1 for e in index if isinstance(e, slice))
    if Ellipsis not in index and consumed != len(base_dims):
        return None
    bounds = _normalise_slice(index[-1], base_dims[-1])
    return None if bounds is None else (base, *bounds)


_SPLITS = (torch.split, torch.functional.split, torch.Tensor.split)


def split_item(node: Any) -> tuple[Node, int, list[int], Node] | None:
    """If ``node`` is item ``i`` of ``split(x, sizes, dim=-1)``, returns ``(split_node, i, sizes, x)``."""
    if not is_function(node, operator.getitem):
        return None
    split, i = node.args
    if not (is_function(split, *_SPLITS) or is_method(split, "split")):
        return None
    x = split.args[0]
    sizes = argument(split, 1, "split_size_or_sections", None)
    if sizes is None:
        sizes = split.kwargs.get("split_size")
    dim = argument(split, 2, "dim", 0)
    rank = len(dims(x) or ())
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) for s in sizes):
        return None
    if not isinstance(dim, int) or dim not in (-1, rank - 1):
        return None
    return split, int(i), list(sizes), x


def site_name(node: Node) -> str:
    """The innermost module path of ``node`` (``model.layers.1.self_attn``), for reports and grouping."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return describe(node)
    path = list(stack.values())[-1][0]
    # relative to the compiled module: drop Dynamo's source of the root (L['self'], L['fn'].__self__, ...)
    return re.sub(r"^L\['[^']*'\](?:\.__self__)?\.?", "", path)


# ------------------------------------------------------------------------------------------ graph edits
def copy_graph(graph: Graph) -> Graph:
    """A node-for-node copy of ``graph`` (meta dicts copied shallowly: fake values are shared)."""
    copy = Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


def topological_order(graph: Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _fake_result(target: Any, op: str, args: tuple, kwargs: dict) -> Any:
    fake_args = torch.fx.node.map_arg(args, value)
    fake_kwargs = torch.fx.node.map_arg(kwargs, value)
    tensors = [v for v in torch.utils._pytree.tree_leaves((fake_args, fake_kwargs)) if isinstance(v, torch.Tensor)]
    # the inputs' own mode: inside a backend the tracing context may already hold a newer one
    modes = [torch._subclasses.fake_tensor.maybe_get_fake_mode(t) for t in tensors]
    fake_mode = next((m for m in modes if m is not None), None)
    if fake_mode is None:
        return None
    with fake_mode:
        if op == "call_method":
            return getattr(fake_args[0], target)(*fake_args[1:], **fake_kwargs)
        return target(*fake_args, **fake_kwargs)


def insert_call(graph: Graph, target: Any, args: tuple, kwargs: dict | None = None, *, like: Node,
                method: bool = False) -> Node:
    """A new ``call_function`` (or, with ``method``, ``call_method``) node at the graph's current
    insertion point, carrying ``like``'s module stack and stack trace (so reports and per-layer prints
    group it with the code it replaces) and a fake ``example_value`` computed from its inputs'."""
    kwargs = kwargs or {}
    op = "call_method" if method else "call_function"
    node = graph.create_node(op, target, args, kwargs)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    result = _fake_result(target, op, args, kwargs)
    if result is not None:
        node.meta["example_value"] = result
    return node


def check_closed(nodes: Iterable[Node], exits: Iterable[Node] = ()) -> None:
    """Raise :class:`Refused` if a node of ``nodes`` (other than ``exits``, whose uses get replaced) is
    used outside ``nodes``: erasing them would then change what the rest of the graph computes."""
    inside = set(nodes)
    exits = set(exits)
    for n in inside - exits:
        for u in n.users:
            if u not in inside:
                raise Refused(f"{describe(n)} is also used by {describe(u)} outside the matched pattern")


def erase_matched(graph: Graph, nodes: Iterable[Node], optional: Iterable[Node] = ()) -> None:
    """Erase the matched ``nodes`` (all of which must end up unused) and those of ``optional`` that end up
    unused, users before producers. Nothing else is touched."""
    required = set(nodes)
    order = topological_order(graph)
    for n in sorted(required | set(optional), key=order.__getitem__, reverse=True):
        if n.op in ("placeholder", "output"):
            continue
        if n.users:
            if n in required:
                raise AssertionError(f"matched node {n.format_node()} still has users {list(n.users)}")
            continue
        graph.erase_node(n)


_OPERATOR_NAMES = {
    operator.mul: "mul", operator.add: "add", operator.sub: "sub", operator.truediv: "div",
    operator.getitem: "getitem", operator.setitem: "setitem", operator.neg: "neg",
}


def op_name(node: Any) -> str | None:
    """A short name of what ``node`` computes, the same for a function and a method: ``"mul"`` for
    ``a * b`` / ``torch.mul`` / ``a.mul(b)``, ``"exp"``, ``"to"``, ``"unimem.state_gather"``; None for
    placeholders, outputs and modules."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return None
    target = node.target
    if target in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[target]
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.replace("::", ".")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    return getattr(target, "__name__", None)


def tensor_value(node: Any) -> torch.Tensor | None:
    """:func:`value` when it is a tensor, else None."""
    v = value(node)
    return v if isinstance(v, torch.Tensor) else None
