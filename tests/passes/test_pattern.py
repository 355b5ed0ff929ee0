"""passes/pattern.py: a search function traced once matches the spellings Dynamo records for it, binds its
arguments, and refuses what computes something else with the operation that differs."""

from __future__ import annotations

import pytest
import torch

from unimem_compile.ops.mla_write import rmsnorm_reference
from unimem_compile.passes.common import Refused
from unimem_compile.passes.mla_write_fusion import RMSNORM


def _dynamo_graph(fn, *inputs) -> torch.fx.Graph:
    """The graph Dynamo hands a backend for ``fn(*inputs)``."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return graphs[0]


def _anchor(graph: torch.fx.Graph) -> torch.fx.Node:
    return graph.find_nodes(op="output")[0].args[0][0]


def _methods_and_swapped_operands(x, w):
    x32 = x.float()
    return (x32 * (1e-6 + x32.pow(2).mean(dim=-1, keepdim=True)).rsqrt()).to(x.dtype) * w


def _a_square_by_multiplication(x, w):
    x32 = x.to(torch.float32)
    return w * (x32 * torch.rsqrt(torch.mean(x32 * x32, [-1], True) + 1e-5)).to(x.dtype)


def _torch_functions(x, w):
    x32 = x.to(torch.float32)
    return torch.mul(w, torch.mul(x32, torch.rsqrt(torch.add(torch.pow(x32, 2).mean(2, keepdim=True), 1e-6)))
                     .to(x.dtype))


# the same RMSNorm as transformers' DeepseekV3RMSNorm, spelled the ways a model's code might write it
SPELLINGS = {
    "the_reference": lambda x, w: rmsnorm_reference(x, w, 1e-6),
    "methods_and_swapped_operands": _methods_and_swapped_operands,
    "a_square_by_multiplication": _a_square_by_multiplication,
    "torch_functions": _torch_functions,
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_every_spelling_of_the_rmsnorm_binds_its_input_weight_and_eps(spelling, gen):
    x = torch.randn(2, 3, 16, generator=gen)
    w = torch.rand(16, generator=gen) + 0.5
    graph = _dynamo_graph(SPELLINGS[spelling], x, w)
    found = RMSNORM.match(_anchor(graph))
    placeholders = {n.meta["example_value"].shape: n for n in graph.find_nodes(op="placeholder")}
    assert found.bindings["x"] is placeholders[x.shape] and found.bindings["weight"] is placeholders[w.shape]
    assert found.bindings["eps"] == (1e-5 if spelling == "a_square_by_multiplication" else 1e-6)
    assert found.nodes[-1] is _anchor(graph)
    # every matched node is one of the norm's operations: none of the graph's placeholders or its output
    assert {n.op for n in found.nodes} <= {"call_function", "call_method"}
    assert len(found.nodes) == len([n for n in graph.nodes if n.op in ("call_function", "call_method")])


def _norm(x, w, *, square=2, dim=-1, keepdim=True, stats=torch.float32, eps=1e-6, back=None):
    """An RMSNorm-like function with one thing changed (the defaults are the RMSNorm itself)."""
    x32 = x.to(stats)
    mean = x32.pow(square).mean(dim, keepdim=keepdim)
    if not keepdim:
        mean = mean[..., None]
    return w * (x32 * torch.rsqrt(mean + (eps(w) if callable(eps) else eps))).to(back or x.dtype)


NOT_AN_RMSNORM = {
    "mean_without_keepdim": ({"keepdim": False}, "RMSNorm: expected mean(...)"),
    "mean_over_another_dim": ({"dim": 1}, "reduces over dim 1, the search function over -1"),
    "statistics_in_fp16": ({"stats": torch.float16}, "a conversion to torch.float16, where the search function "
                                                     "converts to torch.float32"),
    "cube_instead_of_square": ({"square": 3}, "expected the constant 2, found 3"),
    "eps_a_tensor": ({"eps": lambda w: w[:1]}, "RMSNorm: eps is "),
    "cast_back_to_another_dtype": ({"back": torch.float16}, "converts to x.dtype (torch.float32)"),
}


@pytest.mark.parametrize("case", list(NOT_AN_RMSNORM))
def test_what_is_not_the_rmsnorm_is_refused_with_the_operation_that_differs(case, gen):
    changed, reason = NOT_AN_RMSNORM[case]
    x = torch.randn(2, 16, 16, generator=gen)
    w = torch.rand(16, generator=gen) + 0.5
    graph = _dynamo_graph(lambda x, w: _norm(x, w, **changed), x, w)
    with pytest.raises(Refused, match="^RMSNorm: ") as info:
        RMSNORM.match(_anchor(graph))
    assert reason in str(info.value)
