"""kda_state_inplace / conv_state_inplace on small Dynamo graphs built from transformers' own Kimi-Linear
decode functions between the cache's state_gather and state_scatter: what the rewrite matches, that the
rewritten graph computes the same outputs and leaves the same bytes in the arena as the original, and that
graphs it must not touch are left exactly as they were (and stay correct), with one log line saying why."""

import importlib
import inspect
import logging

import pytest
import torch

from unimem_compile.passes.conv_state_inplace import ConvStateInplace
from unimem_compile.passes.kda_state_inplace import KDAStateInplace
from unimem_compile.pool import ArenaLayout, LinearStateSpec, UnifiedPool, state_views

H, K, CONV_K = 2, 8, 4
C = 3 * H * K
B = 4

_hf = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
hf_conv_update = inspect.unwrap(_hf.causal_conv1d_update)
hf_recurrent = inspect.unwrap(_hf.recurrent_kimi_delta_attention)
gather, scatter = torch.ops.unimem.state_gather, torch.ops.unimem.state_scatter


@pytest.fixture
def pool(gen, request):
    """Two KDA layers' states with random values in every live slot; lanes mix live slots in a shuffled
    order with a masked lane (-1)."""
    dtype = getattr(request, "param", torch.float32)
    spec = LinearStateSpec.kda(2, H, K, CONV_K, dtype)
    p = UnifiedPool(ArenaLayout.for_capacity(None, spec, 16, 0, 6))
    ids = p.alloc_slots(3)
    for layer in range(2):
        for view in state_views(p.arena, p.layout, layer):
            live = view[p.layout.first_slot:]
            live.copy_(torch.randn(live.shape, generator=gen).to(view.dtype))
    p.lanes = torch.tensor([ids[2], -1, ids[0], ids[1]])
    return p


def _compile_with(rewrite, fn, *args):
    """Run ``fn(*args)`` through Dynamo with ``rewrite`` applied to the captured graph; returns the outputs
    and what happened to the graph."""
    seen = {}

    def backend(gm, example_inputs):
        seen["before"] = gm.code
        seen["count"] = rewrite(gm)
        gm.recompile()
        seen["after"] = gm.code
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, seen


def _conv_step(pool, layer=0, write_layer=None, peek=False, activation="silu"):
    spec, pitch = pool.layout.state, pool.layout.slot_bytes
    off, back = spec.conv_offset(layer), spec.conv_offset(layer if write_layer is None else write_layer)
    dtype = spec.layers[layer].conv.dtype

    def step(x, arena, s_v2p, slot_ids, weight, bias):
        # what the cache and transformers do in a decode step: gather a copy, update it in place, write it back
        state = gather(arena, s_v2p, slot_ids, off, pitch, [C, CONV_K], dtype)
        out = hf_conv_update(x, state, weight, bias, activation)
        scatter(arena, s_v2p, slot_ids, state, back, pitch)
        return (out, state * 2) if peek else out

    return step


def _kda_step(pool, layer=0, use_l2norm=True, intruder=None):
    spec, pitch = pool.layout.state, pool.layout.slot_bytes
    off = spec.recurrent_offset(layer)

    def step(q, k, v, g, beta, arena, s_v2p, slot_ids):
        state = gather(arena, s_v2p, slot_ids, off, pitch, [H, K, K], torch.float32)
        if intruder is not None:  # another write to the same bytes between the read and the write-back
            scatter(arena, s_v2p, slot_ids, intruder, off, pitch)
        o, final = hf_recurrent(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                use_qk_l2norm_in_kernel=use_l2norm)
        scatter(arena, s_v2p, slot_ids, final.to(torch.float32).contiguous(), off, pitch)
        return o

    return step


def _conv_inputs(gen, dtype, bias):
    x = torch.randn(B, 1, C, generator=gen).to(dtype).transpose(1, 2)  # [B, C, 1] as transformers builds it
    w = torch.randn(C, CONV_K, generator=gen).to(dtype)
    b = torch.randn(C, generator=gen).to(dtype) if bias else None
    return x, w, b


def _kda_inputs(gen, dtype, tokens=1):
    q, k = (torch.randn(B, tokens, H, K, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(B, tokens, H, K, generator=gen).to(dtype)
    g = -torch.rand(B, tokens, H, K, generator=gen) * 2  # fp32 log-decay, as the forget gate gives it
    beta = torch.rand(B, tokens, H, generator=gen).to(dtype)
    return q, k, v, g, beta


def _assert_same(got, want, dtype):
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)


# ---------------------------------------------------------------------------- conv_state_inplace
@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16], indirect=True, ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias,activation", [(False, "silu"), (True, None)])
def test_conv_step_becomes_one_inplace_op_with_the_same_outputs_and_slot_bytes(pool, gen, bias, activation):
    dtype = pool.layout.state.layers[0].conv.dtype
    x, w, b = _conv_inputs(gen, dtype, bias)
    step = _conv_step(pool, activation=activation)
    arena0 = pool.arena.clone()
    want = step(x, arena0, pool.s_v2p, pool.lanes, w, b)
    got, seen = _compile_with(ConvStateInplace(), step, x, pool.arena, pool.s_v2p, pool.lanes, w, b)
    assert seen["count"] == 1
    assert "causal_conv1d_update" in seen["after"]
    for gone in ("state_gather", "state_scatter", "copy_", "conv1d(", "functional.silu"):
        assert gone not in seen["after"], gone
    _assert_same(got, want, dtype)
    # the shifted state is a copy of input columns: byte-exact, and the masked lane wrote nothing
    assert torch.equal(pool.arena, arena0)


def test_conv_step_whose_state_is_read_again_is_left_unchanged_and_correct(pool, gen, caplog):
    x, w, b = _conv_inputs(gen, torch.float32, False)
    step = _conv_step(pool, peek=True)
    arena0 = pool.arena.clone()
    want = step(x, arena0, pool.s_v2p, pool.lanes, w, b)
    with caplog.at_level(logging.INFO, logger="unimem_compile.passes"):
        got, seen = _compile_with(ConvStateInplace(), step, x, pool.arena, pool.s_v2p, pool.lanes, w, b)
    assert seen["count"] == 0 and seen["after"] == seen["before"]
    _assert_same(got, want, torch.float32)
    assert torch.equal(pool.arena, arena0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("conv_state_inplace")]
    assert len(lines) == 1 and "'mul'" in lines[0]  # the extra reader is named


def test_conv_state_written_back_elsewhere_is_left_unchanged_and_correct(pool, gen, caplog):
    x, w, b = _conv_inputs(gen, torch.float32, True)
    step = _conv_step(pool, write_layer=1)
    arena0 = pool.arena.clone()
    want = step(x, arena0, pool.s_v2p, pool.lanes, w, b)
    with caplog.at_level(logging.INFO, logger="unimem_compile.passes"):
        got, seen = _compile_with(ConvStateInplace(), step, x, pool.arena, pool.s_v2p, pool.lanes, w, b)
    assert seen["count"] == 0 and seen["after"] == seen["before"]
    _assert_same(got, want, torch.float32)
    assert torch.equal(pool.arena, arena0)
    assert any("another offset" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------- kda_state_inplace
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("use_l2norm", [True, False])
def test_kda_step_becomes_one_inplace_op_with_the_same_output_and_state(pool, gen, dtype, use_l2norm):
    inputs = _kda_inputs(gen, dtype)
    step = _kda_step(pool, layer=1, use_l2norm=use_l2norm)
    arena0 = pool.arena.clone()
    want = step(*inputs, arena0, pool.s_v2p, pool.lanes)
    got, seen = _compile_with(KDAStateInplace(), step, *inputs, pool.arena, pool.s_v2p, pool.lanes)
    assert seen["count"] == 1
    assert "kda_decode.default(" in seen["after"] and f", {use_l2norm})" in seen["after"]
    for gone in ("state_gather", "state_scatter", "zeros", "exp"):
        assert gone not in seen["after"], gone
    _assert_same(got, want, dtype)
    _, rec = state_views(pool.arena, pool.layout, 1)
    _, rec0 = state_views(arena0, pool.layout, 1)
    torch.testing.assert_close(rec, rec0, atol=1e-5, rtol=1e-5)
    # only the recurrent section of layer 1 may differ, and only in live slots
    differs = (pool.arena != arena0).nonzero().flatten()
    pitch, off = pool.layout.slot_bytes, pool.layout.state.recurrent_offset(1)
    live = {int(pool.s_v2p[s]) for s in pool.lanes.tolist() if s >= 0}
    assert all((i // pitch) in live and off <= i % pitch < off + H * K * K * 4 for i in differs.tolist())


def test_two_token_recurrence_is_left_unchanged_and_correct(pool, gen, caplog):
    inputs = _kda_inputs(gen, torch.float32, tokens=2)
    step = _kda_step(pool)
    arena0 = pool.arena.clone()
    want = step(*inputs, arena0, pool.s_v2p, pool.lanes)
    with caplog.at_level(logging.INFO, logger="unimem_compile.passes"):
        got, seen = _compile_with(KDAStateInplace(), step, *inputs, pool.arena, pool.s_v2p, pool.lanes)
    assert seen["count"] == 0 and seen["after"] == seen["before"]
    _assert_same(got, want, torch.float32)
    assert torch.equal(pool.arena, arena0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kda_state_inplace")]
    assert len(lines) == 1 and "1 of 1 site(s) left unchanged" in lines[0] and "single token" in lines[0]


def test_kda_step_with_another_write_to_its_state_in_between_is_left_unchanged(pool, gen, caplog):
    inputs = _kda_inputs(gen, torch.float32)
    step = _kda_step(pool, intruder=torch.randn(B, H, K, K, generator=gen))
    arena0 = pool.arena.clone()
    want = step(*inputs, arena0, pool.s_v2p, pool.lanes)
    with caplog.at_level(logging.INFO, logger="unimem_compile.passes"):
        got, seen = _compile_with(KDAStateInplace(), step, *inputs, pool.arena, pool.s_v2p, pool.lanes)
    assert seen["count"] == 0 and seen["after"] == seen["before"]
    _assert_same(got, want, torch.float32)
    assert torch.equal(pool.arena, arena0)
    assert any("touches the same state bytes in between" in r.getMessage() for r in caplog.records)
