"""passes/pattern.py: a search function traced once matches the spellings Dynamo records for it, binds its
arguments, and refuses what computes something else with the operation that differs (the RMSNorm of
``mla_write_fusion``; the KDA step and L2 norm of ``kda_state_inplace``)."""

from __future__ import annotations

import pytest
import torch

from transformers.models.kimi_linear.modeling_kimi_linear import l2norm as hf_l2norm

from unimem_compile.ops.kda import kda_state_step
from unimem_compile.ops.mla_write import rmsnorm_reference
from unimem_compile.passes.common import Refused, op_name
from unimem_compile.passes.kda_state_inplace import L2NORM, STEP
from unimem_compile.passes.mla_write_fusion import RMSNORM
from unimem_compile.passes.pattern import Pattern


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


# ---------------------------------------------------------------------------- the KDA step and the L2 norm
def _hf_step(state, k, v, g, beta):
    """transformers' ``recurrent_kimi_delta_attention`` loop body: indexing for the axes, exp after it."""
    state = state * g[..., None].exp()
    delta = (v - (state * k[..., None]).sum(dim=-2)) * beta[..., None]
    return state + k.unsqueeze(-1) * delta.unsqueeze(-2)


def _functions_and_swapped_operands(state, k, v, g, beta):
    state = torch.unsqueeze(torch.exp(g), 3) * state
    delta = torch.mul(beta[:, :, None], torch.sub(v, torch.sum(torch.mul(k[:, :, :, None], state), 2)))
    return torch.add(delta[..., None, :] * torch.unsqueeze(k, -1), state)


# one token of the gated delta rule, spelled as transformers, our reference and plain torch functions write it
STEP_SPELLINGS = {
    "the_reference": kda_state_step,
    "transformers": _hf_step,
    "functions_and_swapped_operands": _functions_and_swapped_operands,
}


def _step_inputs(gen, h=2, d=8):
    b = 3
    return (torch.randn(b, h, d, d, generator=gen), torch.randn(b, h, d, generator=gen),
            torch.randn(b, h, d, generator=gen), -torch.rand(b, h, d, generator=gen), torch.rand(b, h, generator=gen))


@pytest.mark.parametrize("spelling", list(STEP_SPELLINGS))
def test_every_spelling_of_the_kda_step_binds_the_state_and_the_token_inputs(spelling, gen):
    inputs = _step_inputs(gen)
    graph = _dynamo_graph(STEP_SPELLINGS[spelling], *inputs)
    found = STEP.match(_anchor(graph))
    placeholders = {n.name: n for n in graph.find_nodes(op="placeholder")}  # Dynamo's l_<argument>_
    assert all(found.bindings[a] is placeholders[f"l_{a}_"] for a in ("state", "k", "v", "g", "beta"))
    calls = [n for n in graph.nodes if n.op in ("call_function", "call_method")]
    assert sorted(map(str, found.nodes)) == sorted(map(str, calls)) and found.nodes[-1] is _anchor(graph)
    # the decay's exp and the axes added to k, g and beta do not depend on the state; the other 8 do
    downstream = found.downstream_of("state")
    assert sorted(op_name(n) for n in downstream if op_name(n) != "getitem") == \
        ["add", "mul", "mul", "mul", "mul", "sub", "sum"] + ["unsqueeze"] * (spelling != "functions_and_swapped_operands")
    rest = [op_name(n) for n in found.nodes if n not in downstream]
    assert len(downstream) == 8 and len(rest) == 5 and rest.count("exp") == 1
    assert set(rest) - {"exp"} <= {"unsqueeze", "getitem"}


def _step_with(state, k, v, g, beta, *, decay_axis=-1, outer_axis=-2, reduce=-2, gate=torch.exp):
    """The KDA step with one thing changed (the defaults are the step itself; K == V keeps every variant's
    shapes valid)."""
    state = state * gate(g).unsqueeze(decay_axis)
    delta = (v - (state * k.unsqueeze(-1)).sum(reduce)) * beta.unsqueeze(-1)
    return state + k.unsqueeze(-1) * delta.unsqueeze(outer_axis)


NOT_A_KDA_STEP = {
    "decay_on_the_value_axis": ({"decay_axis": -2}, "adds an axis at -2, the search function at -1"),
    "outer_product_transposed": ({"outer_axis": -1}, "adds an axis at -1, the search function at -2"),
    "read_over_the_value_axis": ({"reduce": -1}, "reduces over dim -1, the search function over -2"),
    "sigmoid_gate": ({"gate": torch.sigmoid}, "expected exp(...)"),
}


@pytest.mark.parametrize("case", list(NOT_A_KDA_STEP))
def test_what_is_not_the_kda_step_is_refused_with_the_operation_that_differs(case, gen):
    changed, reason = NOT_A_KDA_STEP[case]
    graph = _dynamo_graph(lambda *a: _step_with(*a, **changed), *_step_inputs(gen))
    with pytest.raises(Refused, match="^KDA step: ") as info:
        STEP.match(_anchor(graph))
    assert reason in str(info.value)


@pytest.mark.parametrize("axis", [-1, 2])
def test_an_unsqueeze_in_the_graph_matches_the_search_functions_exp_of_an_unsqueeze(axis, gen):
    """The other direction of the commuting rule: the search function adds the axis before the exp."""
    exp_of_axis = Pattern(lambda g: torch.exp(g.unsqueeze(-1)), name="decay")
    g = torch.randn(2, 3, 4, generator=gen)
    graph = _dynamo_graph(lambda g: g.exp().unsqueeze(axis), g)
    if axis == -1:
        found = exp_of_axis.match(_anchor(graph))
        assert found.bindings["g"] is graph.find_nodes(op="placeholder")[0] and len(found.nodes) == 2
    else:
        with pytest.raises(Refused, match="adds an axis at 2, the search function at -1"):
            exp_of_axis.match(_anchor(graph))


def test_the_l2_norm_of_transformers_matches_and_another_epsilon_is_refused(gen):
    x = torch.randn(2, 1, 3, 8, generator=gen)
    graph = _dynamo_graph(lambda x: hf_l2norm(x, dim=-1, eps=1e-6), x)
    assert L2NORM.match(_anchor(graph)).bindings["x"] is graph.find_nodes(op="placeholder")[0]
    graph = _dynamo_graph(lambda x: hf_l2norm(x, dim=-1, eps=1e-5), x)
    with pytest.raises(Refused, match="expected the constant 1e-06, found 1e-05"):
        L2NORM.match(_anchor(graph))
