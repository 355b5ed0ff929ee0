"""causal_conv1d_update on arena slots: the op (pure-torch reference) and the Triton kernel (interpreter)
against transformers' Kimi-Linear causal_conv1d_update / causal_conv1d_fn, on slots scattered in an arena
whose pitch is not the conv section's size."""

import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as hf

from unimem_compile.errors import GeometryError
from unimem_compile.ops import conv as cv
from unimem_compile.pool import LinearStateSpec, state_views

from .slot_pools import physical_slot, scattered_slot_pool

H, D, CONV_K = 2, 8, 4
C = 3 * H * D  # q|k|v channels, as in Kimi-Linear
LAYER = 1

KERNELS = {"op": torch.ops.unimem.causal_conv1d_update, "triton": cv.causal_conv1d_update_triton}
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _pool(dtype, gen):
    """Scattered live slots with random conv states; returns (pool, spec, live virtual ids, a tombstone)."""
    spec = LinearStateSpec.kda(2, H, D, CONV_K, dtype)
    pool, ids, dead = scattered_slot_pool(spec, gen, 7, slice(1, 4, 2), 1)
    return pool, spec, ids, dead


def _conv_view(arena, pool):
    return state_views(arena, pool.layout, LAYER)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("use_bias,activation", [(True, "silu"), (False, None), (True, "swish")])
@pytest.mark.parametrize("impl", ["op", "triton"])
def test_update_matches_transformers_and_changes_only_live_conv_sections(impl, dtype, use_bias, activation, gen):
    pool, spec, ids, dead = _pool(dtype, gen)
    lanes = torch.tensor([ids[2], -1, ids[0], dead, ids[4], 0, ids[1]])
    x = torch.randn(lanes.numel(), C, generator=gen).to(dtype)
    weight = torch.randn(C, CONV_K, generator=gen).to(dtype)
    bias = torch.randn(C, generator=gen).to(dtype) if use_bias else None

    expected = pool.arena.clone()
    exp_view = _conv_view(expected, pool)
    want_out = []
    for b, s in enumerate(lanes.tolist()):
        p = physical_slot(pool, s)
        state = (exp_view[p].clone() if p > 0 else torch.zeros(C, CONV_K, dtype=dtype))[None]
        want_out.append(hf.causal_conv1d_update(x[b][None, :, None], state, weight, bias, activation)[0, :, 0])
        if p > 0:
            exp_view[p] = state[0]
    arena = pool.arena.clone()
    out = KERNELS[impl](x, arena, pool.s_v2p, lanes, spec.conv_offset(LAYER), spec.slot_bytes, weight, bias, activation)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, torch.stack(want_out), **TOL[dtype])
    # new state = old columns 1..K-1 then x: copies, so bit-exact; nothing else in the arena moves
    assert torch.equal(arena, expected)


@pytest.mark.parametrize("impl", ["op", "triton"])
def test_decode_steps_after_a_prompt_equal_the_causal_conv_of_the_whole_sequence(impl, gen):
    dtype = torch.float32
    pool, spec, ids, _ = _pool(dtype, gen)
    lanes = torch.tensor([ids[3], ids[0], ids[2]])
    prompt, steps = 6, 3
    seq = torch.randn(lanes.numel(), C, prompt + steps, generator=gen)
    weight = torch.randn(C, CONV_K, generator=gen)
    bias = torch.randn(C, generator=gen)
    arena = pool.arena.clone()
    view = _conv_view(arena, pool)
    for b, s in enumerate(lanes.tolist()):
        view[physical_slot(pool, s)] = seq[b, :, prompt - CONV_K:prompt]  # the last K raw prompt columns, as HF caches them
    outs = [KERNELS[impl](seq[:, :, t].contiguous(), arena, pool.s_v2p, lanes, spec.conv_offset(LAYER), spec.slot_bytes,
                          weight, bias, "silu") for t in range(prompt, prompt + steps)]
    want = hf.causal_conv1d_fn(seq, weight, bias, "silu")[:, :, prompt:]
    torch.testing.assert_close(torch.stack(outs, -1), want, **TOL[dtype])
    for b, s in enumerate(lanes.tolist()):
        assert torch.equal(view[physical_slot(pool, s)], seq[b, :, -CONV_K:])


def test_kernel_reads_a_strided_column_slice_of_a_wider_projection(gen):
    pool, spec, ids, _ = _pool(torch.float32, gen)
    lanes = torch.tensor(ids[:3])
    wide = torch.randn(3, C + 24, generator=gen)
    x = wide[:, 8:8 + C]
    assert not x.is_contiguous()
    weight = torch.randn(C, CONV_K, generator=gen)
    a_ref, a_tri = pool.arena.clone(), pool.arena.clone()
    want = torch.ops.unimem.causal_conv1d_update(x.contiguous(), a_ref, pool.s_v2p, lanes, spec.conv_offset(LAYER),
                                                 spec.slot_bytes, weight, None, "silu")
    got = cv.causal_conv1d_update_triton(x, a_tri, pool.s_v2p, lanes, spec.conv_offset(LAYER), spec.slot_bytes, weight,
                                         None, "silu")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(a_tri, a_ref)


@pytest.mark.parametrize("impl", ["op", "triton"])
def test_bad_inputs_raise_errors_with_the_numbers(impl, gen):
    pool, spec, ids, _ = _pool(torch.float16, gen)
    fn = KERNELS[impl]
    lanes = torch.tensor(ids[:2])
    x = torch.randn(2, C, generator=gen).half()
    w = torch.randn(C, CONV_K, generator=gen).half()
    off, sb = spec.conv_offset(LAYER), spec.slot_bytes
    with pytest.raises(ValueError, match=rf"weight must be \[C={C}, kernel\], got \[{C - 1}, {CONV_K}\]"):
        fn(x, pool.arena, pool.s_v2p, lanes, off, sb, w[1:], None, "silu")
    with pytest.raises(ValueError, match="activation must be one of .* got 'gelu'"):
        fn(x, pool.arena, pool.s_v2p, lanes, off, sb, w, None, "gelu")
    with pytest.raises(GeometryError, match=rf"bias must have shape \[{C}\], got \[{C + 1}\]"):
        fn(x, pool.arena, pool.s_v2p, lanes, off, sb, w, torch.zeros(C + 1, dtype=torch.half), None)
    with pytest.raises(ValueError, match="slot_ids has 1 lanes but the inputs have batch 2"):
        fn(x, pool.arena, pool.s_v2p, lanes[:1], off, sb, w, None, None)
    with pytest.raises(GeometryError, match=rf"\[{sb - 16}, {sb - 16 + C * CONV_K * 2}\) does not fit in a slot of {sb}"):
        fn(x, pool.arena, pool.s_v2p, lanes, sb - 16, sb, w, None, None)
    with pytest.raises(TypeError, match="x must be torch.float32 or torch.float16 or torch.bfloat16, got torch.int64"):
        fn(x.long(), pool.arena, pool.s_v2p, lanes, off, sb, w, None, None)


def test_opcheck_passes(gen):
    pool, spec, ids, dead = _pool(torch.float16, gen)
    lanes = torch.tensor([ids[1], -1, dead, ids[0]])
    x = torch.randn(4, C, generator=gen).half()
    w = torch.randn(C, CONV_K, generator=gen).half()
    b = torch.randn(C, generator=gen).half()
    torch.library.opcheck(torch.ops.unimem.causal_conv1d_update.default,
                          (x, pool.arena.clone(), pool.s_v2p, lanes, spec.conv_offset(LAYER), spec.slot_bytes, w, b, "silu"))
