"""The state rewrites under Inductor, on the suite's one Inductor compile of tiny Kimi-Linear
(tests/inductor_runs.py, shared with tests/hf/test_inductor.py; every pass on): in the generated code every
state write is the in-place op on the arena the graph was given, nothing copies the whole arena, and no state
gather or scatter is left in the decode graph; greedy fp32 tokens equal stock transformers'."""

import re

import pytest
import torch

from ..generated_code import arena_arg, op_calls
from ..inductor_runs import inductor_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run():
    run = inductor_run("kimi-linear-tiny")
    return run.model, run.want, run.got, run.codes, run.rewrites_first


def test_inductor_tokens_equal_stock_transformers(run):
    _, stock, out, _, _ = run
    assert torch.equal(out, stock)


def test_decode_code_updates_every_state_in_place_on_the_arena_input(run):
    model, _, _, codes, rewrites = run
    assert rewrites["kda_state_inplace"] == 2 and rewrites["conv_state_inplace"] == 2
    numel = model.unimem.pool.arena.numel()
    decode = [c for c in codes if "kda_decode" in c]
    assert len(decode) == 1 and len(codes) == 2
    code = decode[0]
    arena = arena_arg(code, numel)
    assert "state_gather" not in code and "state_scatter" not in code
    for op in ("kda_decode", "causal_conv1d_update"):
        calls = op_calls(code, op)
        assert len(calls) == 2, (op, calls)
        position = 5 if op == "kda_decode" else 1  # the arena argument of each op
        assert all(c[position] == arena for c in calls), calls


def _arena_copies(code: str, numel: int) -> list[str]:
    """Lines that allocate, loop over or copy a buffer the size of the whole arena (input checks aside)."""
    arena = arena_arg(code, numel)
    return [line for line in code.splitlines()
            if (f"({numel}, )" in line or f"{numel}L" in line)
            and not line.strip().startswith(("assert_size_stride(", f"{arena} = rand_strided("))
            or re.search(rf"\.copy_\({arena}\b|clone\({arena}\b", line)]


def test_decode_code_never_copies_the_arena(run):
    model, _, _, codes, _ = run
    numel = model.unimem.pool.arena.numel()
    code = next(c for c in codes if "kda_decode" in c)
    assert _arena_copies(code, numel) == []


def test_prefill_code_never_copies_the_arena(run):
    model, _, _, codes, _ = run
    numel = model.unimem.pool.arena.numel()
    code = next(c for c in codes if "kda_decode" not in c)
    assert _arena_copies(code, numel) == []


def test_prefill_hands_kda_chunk_dense_q_k_v_buffers_of_their_own_size(run):
    """q, k, v are views of the conv output; handed to the op as they are, Inductor kept their traced
    strides and gave each one a buffer the size of the whole conv output (3x the bytes, +6 GiB at batch
    32 x 4096 tokens on the 48B geometry). Each must be a dense [B, T, H, K] buffer."""
    model, _, _, codes, _ = run
    (prefill,) = [c for c in codes if "kda_chunk" in c]
    calls = op_calls(prefill, "kda_chunk")
    assert len(calls) == 2
    kda = model.model.layers[model.unimem.adapter.linear_layers[0]].self_attn
    heads, dim = kda.num_heads, kda.head_dim
    for call in calls:
        for name in call[:3]:  # q, k, v
            # a fresh buffer, or one reused under a new size and stride
            (alloc,) = re.findall(rf"\b{name} = (?:empty_strided_cpu\(|reinterpret_tensor\(\w+, )\((.*?)\), \((.*?)\)",
                                  prefill)
            # the token count is symbolic (one prefill graph for every length: hf/step_inputs.py)
            size, stride = (part.split(", ") for part in alloc)
            batch, tokens = size[:2]
            assert size == [batch, tokens, str(heads), str(dim)]
            assert stride == [f"{heads * dim}*{tokens}", str(heads * dim), str(dim), "1"]
