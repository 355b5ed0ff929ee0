"""kda_state_inplace / conv_state_inplace on CUDA: the rewritten decode graphs run the Triton slot kernels.

- tiny Kimi-Linear, fp32, Inductor: greedy tokens identical with and without the rewrites; two
  replacements of each per decode graph; in the generated decode code every state update is
  ``kda_decode`` / ``causal_conv1d_update`` on the arena input, no state gather or scatter is left, and no
  buffer the size of the arena is allocated or copied;
- Kimi-Linear-48B per-layer geometry (``kimi-linear-48b-4l``: 3 KDA layers of 32 heads x 128 x 128,
  conv over 12288 channels), bf16, aot_eager: the decode logits with the rewrites match those without
  (the rewrite only changes fp32 summation order and where bf16 rounding happens).

Kernels must compile, not run in the interpreter: skipped when TRITON_INTERPRET=1.
"""

import os
import re

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1 would run the kernels in the interpreter"),
]

import unimem_compile  # noqa: E402
from unimem_compile.hf.models import build_model  # noqa: E402

from ..generated_code import arena_arg, op_calls

DEV = "cuda"
MINE = ("kda_state_inplace", "conv_state_inplace")


def _prompt(batch, length, seed, vocab=1024):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, : length // 3] = 0  # left padding on one row
    return ids.to(DEV), mask.to(DEV)


def _greedy(model, ids, mask, new, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)


@pytest.fixture(scope="module")
def tiny():
    from torch._inductor.utils import run_and_get_code

    ids, mask = _prompt(2, 9, seed=3)
    runs = {}
    for name, passes in (("on", MINE), ("off", False)):
        model = build_model("kimi-linear-tiny", dtype=torch.float32, device=DEV)
        unimem_compile.compile(model, max_batch_size=2, max_seq_len=24, page_size=8, backend="inductor",
                               passes=passes)
        # the code is only generated on a compile-cache miss
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            out, codes = run_and_get_code(_greedy, model, ids, mask, 8)
        runs[name] = (model, out, codes)
    return runs


def test_tiny_fp32_tokens_identical_with_and_without_the_rewrites(tiny):
    assert torch.equal(tiny["on"][1], tiny["off"][1])


def test_decode_code_updates_states_in_place_with_the_slot_kernels(tiny):
    model, _, codes = tiny["on"]
    assert model.unimem.rewrites["kda_state_inplace"] == 2 and model.unimem.rewrites["conv_state_inplace"] == 2
    numel = model.unimem.pool.arena.numel()
    decode = [c for c in codes if "kda_decode" in c]
    assert len(decode) == 1
    code = decode[0]
    arena = arena_arg(code, numel)
    assert "state_gather" not in code and "state_scatter" not in code
    for op, position in (("kda_decode", 5), ("causal_conv1d_update", 1)):
        calls = op_calls(code, op)
        assert len(calls) == 2 and all(c[position] == arena for c in calls), (op, calls)
    sized = [line for line in code.splitlines() if f"({numel}, )" in line and "assert_size_stride(" not in line
             and "rand_strided(" not in line]
    assert sized == []
    assert not re.search(rf"\.copy_\({arena}\b|clone\({arena}\b", code)


def test_kimi_linear_geometry_bf16_decode_logits_match_without_the_rewrites():
    ids, mask = _prompt(4, 40, seed=5, vocab=32000)
    logits = {}
    for name, passes in (("on", MINE), ("off", False)):
        model = build_model("kimi-linear-48b-4l", dtype=torch.bfloat16, device=DEV)
        unimem_compile.compile(model, max_batch_size=4, max_seq_len=48, page_size=16, backend="aot_eager",
                               passes=passes)
        out = _greedy(model, ids, mask, 3, output_logits=True, return_dict_in_generate=True)
        logits[name] = (out.sequences, [x.float() for x in out.logits])
        if name == "on":
            assert model.unimem.rewrites["kda_state_inplace"] == 3
            assert model.unimem.rewrites["conv_state_inplace"] == 3
        del model
        torch.cuda.empty_cache()
    (seq_on, on), (seq_off, off) = logits["on"], logits["off"]
    prompt = ids.shape[1]
    compared = 0
    for i in range(len(on)):  # step i sees the same inputs in both runs while tokens 0..i-1 agree
        if not torch.equal(seq_on[:, :prompt + i], seq_off[:, :prompt + i]):
            break
        scale = max(off[i].abs().max().item(), 1.0)
        torch.testing.assert_close(on[i], off[i], atol=2e-2 * scale, rtol=0)
        compared += 1
    assert compared >= 2  # the prefill and at least the first decode step
