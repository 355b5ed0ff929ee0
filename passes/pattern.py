"""A rewrite's search function, written as plain torch and matched on the Dynamo-level graphs the passes see.

``Pattern(fn)`` traces ``fn`` once with ``torch.fx.symbolic_trace``; :meth:`Pattern.match` then matches that
graph backward from one node of a Dynamo graph (the anchor, the search function's output) and returns what
the search function's arguments are bound to there. The spellings Dynamo records for one computation are
generated from each traced node instead of being listed by hand (the weakness of Inductor's
``fuse_attention.py``, whose eighteen pattern pairs differ in spelling only):

- a torch function and the Tensor method of the same name are one operation (``torch.rsqrt(t)`` and
  ``t.rsqrt()``; ``a * b``, ``torch.mul(a, b)`` and ``a.mul(b)``): nodes are compared by
  :func:`~.common.op_name`;
- ``add`` and ``mul`` take their two operands in either order;
- ``t.pow(2)`` is also ``t * t`` and ``t ** 2``;
- arguments are compared by name, positional or keyword, with their defaults (:data:`ARGUMENT_NAMES` names
  the ones patterns use); a ``dim`` of ``-1`` is also ``rank - 1``, ``[-1]`` or ``(-1,)``;
- a dtype conversion is any spelling :func:`~.common.cast_of` knows (``.to(dtype)``, ``.float()``, ...); a
  conversion to ``x.dtype`` in the search function (``getattr(x, "dtype")`` once traced) matches a
  conversion to the dtype the tensor bound to ``x`` has;
- ``x.unsqueeze(d)`` is also indexing that adds that one axis (``x[..., None]`` for ``d = -1``,
  ``x[..., None, :]`` for ``-2``, ``x[:, None]`` for ``1``), its ``d`` counted in the result's rank;
- an elementwise unary operation and an unsqueeze commute: ``x.exp().unsqueeze(-1)`` is also
  ``x[..., None].exp()`` (and the other way round).

The matcher never changes the graph; a rewrite checks the matched nodes' users (``check_closed``) and
replaces them as before (:class:`~.common.Rewrite`), so its counts and refusal log lines stay what they were.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.fx import Node

from .common import Refused, cast_of, describe, dims, op_name

__all__ = ["Pattern", "PatternMatch", "ARGUMENT_NAMES"]

#: The argument names, in positional order, of the operations search functions use (the first is the tensor
#: a method is called on), and the defaults a call may leave out.
ARGUMENT_NAMES: dict[str, tuple[str, ...]] = {
    "mean": ("input", "dim", "keepdim"),
    "sum": ("input", "dim", "keepdim"),
    "pow": ("input", "exponent"),
    "rsqrt": ("input",),
    "sqrt": ("input",),
    "exp": ("input",),
    "neg": ("input",),
    "add": ("input", "other"),
    "sub": ("input", "other"),
    "mul": ("input", "other"),
    "div": ("input", "other"),
    "unsqueeze": ("input", "dim"),
}
_DEFAULTS = {"keepdim": False}
_COMMUTATIVE = {"add", "mul"}
#: elementwise operations of one tensor: they commute with adding an axis
_UNARY = {"exp", "neg", "sqrt", "rsqrt"}


@dataclasses.dataclass
class PatternMatch:
    """One match of a :class:`Pattern`.

    Attributes:
        bindings: ``{argument name of the search function: the node, or the constant, bound to it}``.
        nodes: the graph's nodes matched to the search function's operations, inputs first, the anchor last.
    """

    bindings: dict[str, Any]
    nodes: list[Node]

    def downstream_of(self, name: str) -> list[Node]:
        """The matched nodes that depend on the search function's argument ``name`` (in :attr:`nodes`'
        order); the others compute on the other arguments alone."""
        reached = {self.bindings[name]}
        for node in self.nodes:
            if any(n in reached for n in node.all_input_nodes):
                reached.add(node)
        return [n for n in self.nodes if n in reached and n is not self.bindings[name]]


class _Mismatch(Exception):
    """One way of matching failed (the matcher may try another operand order)."""


class Pattern:
    """A search function, traced once, and its matcher.

    Args:
        fn: the search function: plain torch on its tensor arguments, returning one tensor.
        constants: names of ``fn``'s arguments that stand for Python numbers in the graph (an ``eps``), not
            for nodes.
        name: what a refusal calls the pattern (default ``fn.__name__``).

    Raises:
        TypeError: ``fn`` does not trace to a graph of one output.
    """

    def __init__(self, fn: Callable, *, constants: Collection[str] = (), name: str | None = None):
        self.fn = fn
        self.name = name or fn.__name__
        self.constants = frozenset(constants)
        self.graph = torch.fx.symbolic_trace(fn).graph
        outputs = self.graph.find_nodes(op="output")
        if len(outputs) != 1 or not isinstance(outputs[0].args[0], Node):
            raise TypeError(f"the search function {self.name} must return one tensor")
        self.output: Node = outputs[0].args[0]

    def match(self, anchor: Node) -> PatternMatch:
        """Match the search function with its output at ``anchor``.

        Returns:
            the :class:`PatternMatch`.

        Raises:
            Refused: the graph computes something else there (the reason names the first operation of the
                search function that found no counterpart, and what the graph has instead).
        """
        state = _State()
        try:
            self._node(self.output, anchor, state)
            for placeholder, dtype_holder in state.dtype_checks:
                bound = state.bindings.get(placeholder)
                have = getattr(_value(bound), "dtype", None)
                if have != dtype_holder:
                    raise _Mismatch(f"a conversion to {dtype_holder} where the search function converts to "
                                    f"{placeholder}.dtype ({have})")
        except _Mismatch as why:
            raise Refused(f"{self.name}: {state.deepest or why}") from None
        return PatternMatch(dict(state.bindings), list(dict.fromkeys(state.nodes)))

    # ------------------------------------------------------------------------------ matching, node by node
    def _node(self, p: Node, t: Any, state: _State) -> None:
        if p.op == "placeholder":
            return self._bind(p, t, state)
        if p in state.mapped:
            if state.mapped[p] is not t:
                state.fail(f"the search function's {p.name} is used twice on one value, the graph has two "
                           f"({describe(state.mapped[p])} and {describe(t)})")
            return
        state.entered.append(p)
        if not isinstance(t, Node):
            state.fail(f"expected {_what(p)}, found the constant {t!r}")
        name = op_name(p)
        if name == "to":
            self._cast(p, t, state)
        elif name == "unsqueeze":
            self._unsqueeze(p, t, state)
        elif name in _UNARY and op_name(_argument(p, "input")) == "unsqueeze" and _unsqueeze_of(t) is not None:
            # the search function's op(x.unsqueeze(d)) at the graph's op(x).unsqueeze(d)
            inner, source = _argument(p, "input"), _unsqueeze_of(t)[0]
            if op_name(source) != name:
                state.fail(f"expected {_what(p)}, found {describe(t)}")
            self._node_value(_argument(inner, "input"), source.args[0], state)
            self._check_unsqueeze_dim(inner, t, state)
            state.nodes.append(source)
        elif name == "pow" and _argument(p, "exponent") == 2 and op_name(t) == "mul":
            if len(t.args) != 2 or t.args[0] is not t.args[1] or t.kwargs:
                state.fail(f"expected {_what(p)}, found {describe(t)}")
            self._node_value(_argument(p, "input"), t.args[0], state)
        elif op_name(t) != name:
            state.fail(f"expected {_what(p)}, found {describe(t)}")
        else:
            self._arguments(p, t, name, state)
        state.mapped[p] = t
        state.nodes.append(t)

    def _bind(self, p: Node, t: Any, state: _State) -> None:
        if p.target in self.constants:
            if isinstance(t, bool) or not isinstance(t, (int, float)):
                state.fail(f"{p.target} is {describe(t) if isinstance(t, Node) else repr(t)}, not a constant")
        elif not isinstance(t, Node):
            state.fail(f"{p.target} is the constant {t!r}, not a tensor")
        if p.target in state.bindings and state.bindings[p.target] is not t:
            state.fail(f"{p.target} is two different values ({describe(state.bindings[p.target])} and "
                       f"{describe(t)})")
        state.bindings[p.target] = t

    def _node_value(self, p: Any, t: Any, state: _State) -> None:
        """Match a pattern argument: a node of the search function, or a constant equal to ``t``."""
        if isinstance(p, Node):
            self._node(p, t, state)
        elif p != t:
            state.fail(f"expected the constant {p!r}, found {describe(t) if isinstance(t, Node) else repr(t)}")

    def _cast(self, p: Node, t: Node, state: _State) -> None:
        found = cast_of(t)
        if found is None:
            state.fail(f"expected {_what(p)}, found {describe(t)}")
        source, dtype = found
        wanted = p.args[1] if len(p.args) > 1 else p.kwargs.get("dtype")
        if isinstance(wanted, Node) and wanted.op == "call_function" and wanted.target is getattr \
                and wanted.args[1] == "dtype" and wanted.args[0].op == "placeholder":
            state.dtype_checks.append((wanted.args[0].target, dtype))
        elif wanted != dtype:
            state.fail(f"a conversion to {dtype}, where the search function converts to {wanted}")
        self._node(p.args[0], source, state)

    def _unsqueeze(self, p: Node, t: Node, state: _State) -> None:
        found = _unsqueeze_of(t)
        source = _argument(p, "input")
        if found is None and op_name(source) in _UNARY and op_name(t) == op_name(source) \
                and _unsqueeze_of(t.args[0]) is not None:
            # the search function's op(x).unsqueeze(d) at the graph's op(x.unsqueeze(d))
            self._node_value(_argument(source, "input"), _unsqueeze_of(t.args[0])[0], state)
            self._check_unsqueeze_dim(p, t.args[0], state)
            state.nodes.append(t.args[0])
            return
        if found is None:
            state.fail(f"expected {_what(p)}, found {describe(t)}")
        # the operand first, then the axis (as a reduction's dim): the deepest reason is the one reported
        self._node_value(source, found[0], state)
        self._check_unsqueeze_dim(p, t, state)

    @staticmethod
    def _check_unsqueeze_dim(p: Node, t: Node, state: _State) -> None:
        """``t`` (an unsqueeze spelling) adds its axis where the search function's unsqueeze ``p`` does."""
        rank = len(dims(t) or ())
        wanted, have = _dims(_argument(p, "dim"), rank), _dims(_unsqueeze_of(t)[1], rank)
        if not rank or wanted != have:
            state.fail(f"{describe(t)} adds an axis at {_unsqueeze_of(t)[1]}, the search function at "
                       f"{_argument(p, 'dim')!r}")

    def _arguments(self, p: Node, t: Node, name: str, state: _State) -> None:
        names = ARGUMENT_NAMES.get(name)
        if names is None:  # an operation without a name table: positional arguments as traced
            if len(p.args) != len(t.args) or set(p.kwargs) != set(t.kwargs):
                state.fail(f"expected {_what(p)}, found {describe(t)}")
            for pa, ta in [*zip(p.args, t.args), *((p.kwargs[k], t.kwargs[k]) for k in p.kwargs)]:
                self._node_value(pa, ta, state)
            return
        if len(t.args) > len(names) or set(t.kwargs) - set(names):
            state.fail(f"expected {_what(p)}, found {describe(t)} with more arguments")
        wanted = {n: _argument(p, n) for n in names}
        have = {n: _argument(t, n) for n in names}
        source = have["input"]
        rank = len(dims(source) or ()) if isinstance(source, Node) else 0
        orders = [("input", "other"), ("other", "input")] if name in _COMMUTATIVE else [("input", "other")]
        for i, (first, second) in enumerate(orders):
            saved = state.save()
            try:
                for n in names:
                    target = have[{"input": first, "other": second}.get(n, n)]
                    if n == "dim":
                        if _dims(wanted[n], rank) != _dims(target, rank):
                            state.fail(f"{describe(t)} reduces over dim {target!r}, the search function over "
                                       f"{wanted[n]!r}")
                    else:
                        self._node_value(wanted[n], target, state)
                return
            except _Mismatch:
                if i == len(orders) - 1:
                    raise
                state.restore(saved)


class _State:
    """What one :meth:`Pattern.match` has bound so far (saved and restored around an operand order)."""

    def __init__(self) -> None:
        self.bindings: dict[str, Any] = {}
        self.mapped: dict[Node, Node] = {}
        self.nodes: list[Node] = []
        self.entered: list[Node] = []  # the search function's operations entered on the current path
        self.dtype_checks: list[tuple[str, torch.dtype]] = []
        self.deepest: str | None = None
        self._depth_of_deepest = -1

    def fail(self, why: str):
        # the reason that got furthest into the search function is the one worth reporting
        if len(self.entered) > self._depth_of_deepest:  # ties: the search function's own operand order
            self.deepest, self._depth_of_deepest = why, len(self.entered)
        raise _Mismatch(why)

    def save(self) -> tuple:
        return dict(self.bindings), dict(self.mapped), list(self.nodes), list(self.entered), list(self.dtype_checks)

    def restore(self, saved: tuple) -> None:
        bindings, mapped, nodes, entered, checks = saved
        self.bindings, self.mapped = dict(bindings), dict(mapped)
        self.nodes, self.entered, self.dtype_checks = list(nodes), list(entered), list(checks)


def _value(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else node


def _argument(node: Node, name: str) -> Any:
    """The argument ``name`` of ``node`` (its position from :data:`ARGUMENT_NAMES`), its default, or None."""
    names = ARGUMENT_NAMES[op_name(node)]
    index = names.index(name)
    if name in node.kwargs:
        return node.kwargs[name]
    if index < len(node.args):
        return node.args[index]
    return _DEFAULTS.get(name)


def _unsqueeze_of(t: Any) -> tuple[Any, int] | None:
    """``(x, d)`` when ``t`` adds one size-1 axis to ``x`` at ``d`` of the result and changes nothing else:
    ``x.unsqueeze(d)``, ``torch.unsqueeze(x, d)``, or indexing with one ``None`` among ``:`` and at most one
    ``...``; else None."""
    name = op_name(t)
    if name == "unsqueeze":
        d = _argument(t, "dim")
        return (_argument(t, "input"), d) if isinstance(d, int) else None
    if name != "getitem" or len(t.args) != 2:
        return None
    index = t.args[1] if isinstance(t.args[1], tuple) else (t.args[1],)
    full = slice(None)
    if sum(e is None for e in index) != 1 or sum(e is Ellipsis for e in index) > 1 \
            or not all(e is None or e is Ellipsis or e == full for e in index):
        return None
    at = index.index(None)
    if Ellipsis in index and index.index(Ellipsis) < at:
        return t.args[0], at - len(index)  # counted from the end: the entries after the None are trailing axes
    return t.args[0], at


def _dims(dim: Any, rank: int) -> frozenset | None:
    """The dims a reduction runs over, made non-negative with the rank of the graph's input (None: all)."""
    if dim is None:
        return None
    items = dim if isinstance(dim, (list, tuple)) else (dim,)
    return frozenset(d % rank if isinstance(d, int) and rank else d for d in items)


def _what(p: Node) -> str:
    """A search-function node in words: ``rsqrt(...)`` for its operation, with its name in the function."""
    name = op_name(p) or p.op
    if p.op == "call_function" and p.target in (operator.mul, operator.add):
        name = {operator.mul: "a product", operator.add: "a sum"}[p.target]
    elif name == "to":
        name = "a dtype conversion"
    else:
        name = f"{name}(...)"
    return f"{name} (the search function's {p.name})"
