"""``unimem-compile inspect``: one MLA layer's decode (or prefill) graph before and after the rewrites.

:func:`capture` runs a built-in tiny model through ``unimem_compile.compile`` and a short ``generate()``
with a pass manager that keeps a copy of every graph; :func:`format_layer` prints the nodes of one
attention module in a normalised form that does not depend on Dynamo's node names, file paths or how
many layers came before (the form the expecttest tests pin)::

    %3 = linear(%2, kv_b_proj.weight, None)  # f32[2, 1, 32, 256]

Internal values are numbered ``%0, %1, ...`` in graph order; parameters and cache tensors are named by
their path relative to the attention module (``kv_b_proj.weight``, ``cache_pool_arena``); other inputs
from outside the module are ``in0, in1, ...``; floats print with 6 significant digits.
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
import re

import torch
from torch.fx import Graph, Node

from unimem_compile.passes.common import site_name, value
from unimem_compile.passes.manager import GraphRecord

__all__ = ["Capture", "capture", "attention_prefixes", "format_layer", "main", "add_arguments"]

#: Built-in models ``inspect`` accepts.
INSPECT_MODELS = ("kimi-linear-tiny", "deepseek-v3-tiny")

_DTYPES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.bool: "b8",
}


@dataclasses.dataclass
class Capture:
    """What :func:`capture` returns.

    Attributes:
        model: the compiled model (``model.unimem`` holds the pool and the pass manager).
        records: one :class:`~unimem_compile.passes.GraphRecord` per graph compiled, in order
            (prefill first, then decode).
        tokens: the generated token ids ``[B, prompt + new_tokens]``.
    """

    model: torch.nn.Module
    records: list[GraphRecord]
    tokens: torch.Tensor

    @property
    def decode(self) -> GraphRecord:
        """The record of the decode graph (the last one compiled).

        Raises:
            ValueError: no decode graph was compiled (``new_tokens=1`` generates from the prefill alone).
        """
        from unimem_compile.passes.manager import is_decode_graph

        if not self.records or not is_decode_graph(self.records[-1].after):
            raise ValueError(f"no decode graph was compiled ({len(self.records)} graph(s) recorded, none with one "
                             "token per row): capture with new_tokens >= 2")
        return self.records[-1]

    @property
    def prefill(self) -> GraphRecord:
        """The record of the first prefill graph compiled (more than one token per row)."""
        from unimem_compile.passes.manager import is_decode_graph

        return next(r for r in self.records if not is_decode_graph(r.after))


def capture(model_name: str, *, passes: bool | list[str] = True, backend: str = "eager",
            attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32, batch: int = 2,
            prompt: int = 6, new_tokens: int = 3, seed: int = 0, model: torch.nn.Module | None = None) -> Capture:
    """Compile a built-in model (or ``model``) with unimem, generate greedily, keep every graph.

    Args:
        model_name: a preset of :mod:`unimem_compile.hf.models` (ignored when ``model`` is given).
        passes, backend: as :func:`unimem_compile.compile`.
        attn_implementation: "sdpa" or "eager" (transformers' attention spelling).
        dtype, seed: of the random model.
        batch, prompt, new_tokens: the generate() call; row 0 is left-padded by 2 tokens.

    Returns:
        a :class:`Capture`.
    """
    import unimem_compile
    from unimem_compile.hf.models import build_model

    if model is None:
        model = build_model(model_name, dtype=dtype, seed=seed, attn_implementation=attn_implementation)
    unimem_compile.compile(model, max_batch_size=batch, max_seq_len=prompt + new_tokens, page_size=8,
                           passes=passes, backend=backend)
    model.unimem.passes.keep_graphs = True
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, prompt), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    return Capture(model, list(model.unimem.passes.records), tokens)


def attention_prefixes(graph: Graph) -> list[str]:
    """Module paths of the MLA attention modules of ``graph`` (where each ``mla_kv_write`` or its fused
    form is called), in graph order."""
    writes = (torch.ops.unimem.mla_kv_write, torch.ops.unimem.mla_kv_write_rmsnorm)
    found = [site_name(n) for n in graph.nodes if n.op == "call_function" and n.target in writes]
    return list(dict.fromkeys(found))


def _in_module(node: Node, prefix: str) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    path = site_name(node)
    return path == prefix or path.startswith(prefix + ".")


def _placeholder_name(node: Node, prefix: str) -> str:
    """A parameter of module ``prefix`` by its relative dotted path (``kv_b_proj.weight``), whatever
    Dynamo prepends to placeholder names (``L_self_modules_...``, ``L_fn_self_modules_...``); a keyword
    input by its name after ``kwargs_``."""
    name = str(node.target).rstrip("_")
    owner = prefix.replace(".", "_modules_") + "_modules_"
    if owner in name:
        return re.sub(r"_(?:modules|parameters|buffers)_", ".", name[name.index(owner) + len(owner):])
    if "kwargs_" in name:
        return name[name.index("kwargs_") + len("kwargs_"):]
    return re.sub(r"^[Ll]_", "", name)


def _shape(node: Node) -> str:
    v = value(node)
    if isinstance(v, torch.Tensor):
        return f"{_DTYPES.get(v.dtype, str(v.dtype))}[{', '.join(str(s) for s in v.shape)}]"
    if isinstance(v, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in v):
        return "(" + ", ".join(f"{_DTYPES.get(t.dtype, t.dtype)}[{', '.join(map(str, t.shape))}]" for t in v) + ")"
    return ""


def _target(node: Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverloadPacket):
        return str(t._qualified_op_name).replace("::", ".")
    if isinstance(t, torch._ops.OpOverload):
        return str(t.overloadpacket._qualified_op_name).replace("::", ".")
    return getattr(t, "__name__", str(t))


def format_layer(graph: Graph, prefix: str) -> str:
    """The nodes of module ``prefix`` (and its submodules) in ``graph``, one per line, normalised (see the
    module docstring). Raises ValueError if the module has no node in the graph."""
    nodes = [n for n in graph.nodes if _in_module(n, prefix)]
    if not nodes:
        raise ValueError(f"no node of module {prefix!r} in this graph")
    names: dict[Node, str] = {}
    outside: dict[Node, str] = {}

    def fmt(arg) -> str:
        if isinstance(arg, Node):
            if arg in names:
                return names[arg]
            if arg.op == "placeholder":
                return _placeholder_name(arg, prefix)
            return outside.setdefault(arg, f"in{len(outside)}")
        if isinstance(arg, slice):
            parts = ["" if x is None else fmt(x) for x in (arg.start, arg.stop)]
            return ":".join(parts) + ("" if arg.step is None else f":{fmt(arg.step)}")
        if arg is Ellipsis:
            return "..."
        if isinstance(arg, float):
            return f"{arg:.6g}"
        if isinstance(arg, tuple):
            return "(" + ", ".join(fmt(a) for a in arg) + ("," if len(arg) == 1 else "") + ")"
        if isinstance(arg, list):
            return "[" + ", ".join(fmt(a) for a in arg) + "]"
        return str(arg)

    lines = []
    for n in nodes:
        args = [fmt(a) for a in n.args] + [f"{k}={fmt(v)}" for k, v in n.kwargs.items()]
        if n.target is operator.getitem:
            index = n.args[1]
            inner = ", ".join(fmt(i) for i in index) if isinstance(index, tuple) else fmt(index)
            call = f"{args[0]}[{inner}]"
        elif n.op == "call_method":
            call = f"{args[0]}.{n.target}({', '.join(args[1:])})"
        else:
            call = f"{_target(n)}({', '.join(args)})"
        names[n] = f"%{len(names)}"
        shape = _shape(n)
        lines.append(f"{names[n]} = {call}" + (f"  # {shape}" if shape else ""))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``unimem-compile inspect``."""
    parser.add_argument("--model", default="kimi-linear-tiny", choices=INSPECT_MODELS,
                        help="a built-in model with random weights (default kimi-linear-tiny)")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"),
                        help="transformers' attention implementation (default sdpa)")
    parser.add_argument("--graph", default="decode", choices=("decode", "prefill"),
                        help="the graph to print: decode (mla_absorb) or prefill (mla_prefill; its query length "
                             "is symbolic)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """``unimem-compile inspect``: print the first MLA layer's decode (or prefill) graph before and after, and
    the counts."""
    result = capture(args.model, attn_implementation=args.attn)
    kind = getattr(args, "graph", "decode")
    record = result.decode if kind == "decode" else result.prefill
    prefix = attention_prefixes(record.before)[0]
    print(f"# {args.model} ({args.attn}): {kind} graph of {prefix}, before the rewrites")
    print(format_layer(record.before, prefix))
    print("\n# after the rewrites")
    print(format_layer(record.after, prefix))
    print(f"\n# replacements in this {kind} graph: "
          + ", ".join(f"{name} {n}" for name, n in record.counts.items()))
    print("# replacements in every graph of this model (prefill + decode): "
          + ", ".join(f"{name} {n}" for name, n in result.model.unimem.rewrites.items()))
    return 0
