"""mla_write_fusion and mla_absorb on the Dynamo graphs of tiny Kimi-Linear and DeepSeek-V3 models.

The expensive part is compiling and running the models, so each family is compiled once per inner
backend (module-scoped fixtures) and every test reads from those runs; graphs that must not match are
made by editing copies of the recorded graphs. Dynamo is reset before each capture so shapes stay
static whatever compiled before (automatic dynamic shapes are remembered per code object).
"""

from __future__ import annotations

import logging
import operator

import pytest
import torch
from expecttest import assert_expected_inline

from unimem_compile.inspect_graphs import attention_prefixes, capture, format_layer
from unimem_compile.passes import MLAAbsorb, MLAPrefill, MLAWriteFusion, make_pass_manager
from unimem_compile.passes.common import copy_graph, is_function

from ..inductor_runs import inductor_run, warm_run

PROMPT, NEW = 6, 8
PASS_LOG = "unimem_compile.passes"


def _capture(name, passes, **kw):
    torch._dynamo.reset()
    return capture(name, passes=passes, backend="aot_eager", prompt=PROMPT, new_tokens=NEW, **kw)


@pytest.fixture(scope="module")
def kimi():
    return _capture("kimi-linear-tiny", True)


@pytest.fixture(scope="module")
def kimi_plain():
    return _capture("kimi-linear-tiny", False)


@pytest.fixture(scope="module")
def deepseek():
    return _capture("deepseek-v3-tiny", True)


@pytest.fixture(scope="module")
def deepseek_plain():
    return _capture("deepseek-v3-tiny", False)


def _layer(graph):
    return format_layer(graph, attention_prefixes(graph)[0])


def _code(graph) -> str:
    return graph.python_code("self").src


def _stock_tokens(model, seed=0):
    """Greedy tokens of stock transformers (no unimem, no compile) for capture()'s prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (2, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)


# ---------------------------------------------------------------------------------------------- graphs
def test_kimi_linear_decode_layer_before_and_after(kimi):
    assert_expected_inline(_layer(kimi.decode.before), """\
%0 = linear(in0, q_proj.weight, None)  # f32[2, 1, 192]
%1 = %0.view((2, 1, -1, 48))  # f32[2, 1, 4, 48]
%2 = %1.transpose(1, 2)  # f32[2, 4, 1, 48]
%3 = linear(in0, kv_a_proj_with_mqa.weight, None)  # f32[2, 1, 80]
%4 = split(%3, [64, 16], dim=-1)  # (f32[2, 1, 64], f32[2, 1, 16])
%5 = %4[0]  # f32[2, 1, 64]
%6 = %4[1]  # f32[2, 1, 16]
%7 = %5.to(torch.float32)  # f32[2, 1, 64]
%8 = %7.pow(2)  # f32[2, 1, 64]
%9 = %8.mean(-1, keepdim=True)  # f32[2, 1, 1]
%10 = add(%9, 1e-06)  # f32[2, 1, 1]
%11 = rsqrt(%10)  # f32[2, 1, 1]
%12 = mul(%7, %11)  # f32[2, 1, 64]
%13 = %12.to(torch.float32)  # f32[2, 1, 64]
%14 = mul(kv_a_layernorm.weight, %13)  # f32[2, 1, 64]
%15 = %14.view(2, 1, 1, 64)  # f32[2, 1, 1, 64]
%16 = %6.view(2, 1, 1, 16)  # f32[2, 1, 1, 16]
%17 = cache_write_loc.reshape(-1)  # i64[2]
%18 = %15.reshape(2, 64)  # f32[2, 64]
%19 = %16.reshape(2, 16)  # f32[2, 16]
%20 = unimem.mla_kv_write(cache_pool_arena, cache_pool_v2p, %17, %18, %19, 0, 2, 8, 64, 16, torch.float32)
%21 = unimem.mla_gather(cache_pool_arena, cache_pool_v2p, cache_buffers_page_table, cache_buffers_kv_len, cache_buffers_out_offset, 14, 0, 2, 8, 64, 16, torch.float32)  # f32[2, 14, 80]
%22 = %21.to(torch.float32)  # f32[2, 14, 80]
%23 = %22[:, None, :, :64]  # f32[2, 1, 14, 64]
%24 = %22[:, None, :, 64:]  # f32[2, 1, 14, 16]
%25 = linear(%23, kv_b_proj.weight, None)  # f32[2, 1, 14, 256]
%26 = %25.view((2, 14, -1, 64))  # f32[2, 14, 4, 64]
%27 = %26.transpose(1, 2)  # f32[2, 4, 14, 64]
%28 = split(%27, [32, 32], dim=-1)  # (f32[2, 4, 14, 32], f32[2, 4, 14, 32])
%29 = %28[0]  # f32[2, 4, 14, 32]
%30 = %28[1]  # f32[2, 4, 14, 32]
%31 = %24.expand(-1, 4, -1, -1)  # f32[2, 4, 14, 16]
%32 = %27.new_empty(2, 4, 14, 48)  # f32[2, 4, 14, 48]
%33 = %32[..., :32]  # f32[2, 4, 14, 32]
%34 = %33.copy_(%29)  # f32[2, 4, 14, 32]
%35 = %32[..., 32:]  # f32[2, 4, 14, 16]
%36 = %35.copy_(%31)  # f32[2, 4, 14, 16]
%37 = scaled_dot_product_attention(%2, %32, %30, attn_mask=in1, dropout_p=0, scale=0.144338, is_causal=False)  # f32[2, 4, 1, 32]
%38 = %37.reshape(2, -1, 1, 32)  # f32[2, 4, 1, 32]
%39 = %38.transpose(1, 2)  # f32[2, 1, 4, 32]
%40 = %39.contiguous()  # f32[2, 1, 4, 32]
%41 = %40.reshape(2, 1, -1)  # f32[2, 1, 128]
%42 = %41.contiguous()  # f32[2, 1, 128]
%43 = linear(%42, o_proj.weight, None)  # f32[2, 1, 256]""")
    assert_expected_inline(_layer(kimi.decode.after), """\
%0 = linear(in0, q_proj.weight, None)  # f32[2, 1, 192]
%1 = %0.view((2, 1, -1, 48))  # f32[2, 1, 4, 48]
%2 = %1.transpose(1, 2)  # f32[2, 4, 1, 48]
%3 = linear(in0, kv_a_proj_with_mqa.weight, None)  # f32[2, 1, 80]
%4 = split(%3, [64, 16], dim=-1)  # (f32[2, 1, 64], f32[2, 1, 16])
%5 = %4[0]  # f32[2, 1, 64]
%6 = %4[1]  # f32[2, 1, 16]
%7 = %6.view(2, 1, 1, 16)  # f32[2, 1, 1, 16]
%8 = cache_write_loc.reshape(-1)  # i64[2]
%9 = %7.reshape(2, 16)  # f32[2, 16]
%10 = %5.reshape(-1, 64)  # f32[2, 64]
%11 = unimem.mla_kv_write_rmsnorm(cache_pool_arena, cache_pool_v2p, %8, %10, %9, kv_a_layernorm.weight, 1e-06, 0, 2, 8, 64, 16, torch.float32)
%12 = kv_b_proj.weight.view(4, 64, 64)  # f32[4, 64, 64]
%13 = %12[:, :32]  # f32[4, 32, 64]
%14 = %12[:, 32:]  # f32[4, 32, 64]
%15 = %2[..., :32]  # f32[2, 4, 1, 32]
%16 = %2[..., 32:]  # f32[2, 4, 1, 16]
%17 = %15.squeeze(2)  # f32[2, 4, 32]
%18 = %17.transpose(0, 1)  # f32[4, 2, 32]
%19 = bmm(%18, %13)  # f32[4, 2, 64]
%20 = %19.transpose(0, 1)  # f32[2, 4, 64]
%21 = %16.squeeze(2)  # f32[2, 4, 16]
%22 = unimem.mla_decode(%20, %21, cache_pool_arena, cache_pool_v2p, cache_buffers_page_table, cache_buffers_kv_len, 0.144338, 0, 2, 8, 64, 16, torch.float32)  # f32[2, 4, 64]
%23 = %22.transpose(0, 1)  # f32[4, 2, 64]
%24 = %14.transpose(1, 2)  # f32[4, 64, 32]
%25 = bmm(%23, %24)  # f32[4, 2, 32]
%26 = %25.transpose(0, 1)  # f32[2, 4, 32]
%27 = %26.unsqueeze(2)  # f32[2, 4, 1, 32]
%28 = %27.reshape(2, -1, 1, 32)  # f32[2, 4, 1, 32]
%29 = %28.transpose(1, 2)  # f32[2, 1, 4, 32]
%30 = %29.contiguous()  # f32[2, 1, 4, 32]
%31 = %30.reshape(2, 1, -1)  # f32[2, 1, 128]
%32 = %31.contiguous()  # f32[2, 1, 128]
%33 = linear(%32, o_proj.weight, None)  # f32[2, 1, 256]""")


def test_deepseek_v3_decode_layer_before_and_after(deepseek):
    assert_expected_inline(_layer(deepseek.decode.before), """\
%0 = linear(in0, q_a_proj.weight, None)  # f32[2, 1, 96]
%1 = %0.to(torch.float32)  # f32[2, 1, 96]
%2 = %1.pow(2)  # f32[2, 1, 96]
%3 = %2.mean(-1, keepdim=True)  # f32[2, 1, 1]
%4 = add(%3, 1e-06)  # f32[2, 1, 1]
%5 = rsqrt(%4)  # f32[2, 1, 1]
%6 = mul(%1, %5)  # f32[2, 1, 96]
%7 = %6.to(torch.float32)  # f32[2, 1, 96]
%8 = mul(q_a_layernorm.weight, %7)  # f32[2, 1, 96]
%9 = linear(%8, q_b_proj.weight, None)  # f32[2, 1, 192]
%10 = %9.view((2, 1, -1, 48))  # f32[2, 1, 4, 48]
%11 = %10.transpose(1, 2)  # f32[2, 4, 1, 48]
%12 = split(%11, [32, 16], dim=-1)  # (f32[2, 4, 1, 32], f32[2, 4, 1, 16])
%13 = %12[0]  # f32[2, 4, 1, 32]
%14 = %12[1]  # f32[2, 4, 1, 16]
%15 = linear(in0, kv_a_proj_with_mqa.weight, None)  # f32[2, 1, 80]
%16 = split(%15, [64, 16], dim=-1)  # (f32[2, 1, 64], f32[2, 1, 16])
%17 = %16[0]  # f32[2, 1, 64]
%18 = %16[1]  # f32[2, 1, 16]
%19 = %17.to(torch.float32)  # f32[2, 1, 64]
%20 = %19.pow(2)  # f32[2, 1, 64]
%21 = %20.mean(-1, keepdim=True)  # f32[2, 1, 1]
%22 = add(%21, 1e-06)  # f32[2, 1, 1]
%23 = rsqrt(%22)  # f32[2, 1, 1]
%24 = mul(%19, %23)  # f32[2, 1, 64]
%25 = %24.to(torch.float32)  # f32[2, 1, 64]
%26 = mul(kv_a_layernorm.weight, %25)  # f32[2, 1, 64]
%27 = %26.view(2, 1, 1, 64)  # f32[2, 1, 1, 64]
%28 = %18.view(2, 1, 1, 16)  # f32[2, 1, 1, 16]
%29 = in1[..., :8]  # f32[2, 1, 8]
%30 = %29.unsqueeze(1)  # f32[2, 1, 1, 8]
%31 = in2[..., :8]  # f32[2, 1, 8]
%32 = %31.unsqueeze(1)  # f32[2, 1, 1, 8]
%33 = %14[..., 0::2]  # f32[2, 4, 1, 8]
%34 = %14[..., 1::2]  # f32[2, 4, 1, 8]
%35 = %28[..., 0::2]  # f32[2, 1, 1, 8]
%36 = %28[..., 1::2]  # f32[2, 1, 1, 8]
%37 = mul(%33, %30)  # f32[2, 4, 1, 8]
%38 = mul(%34, %32)  # f32[2, 4, 1, 8]
%39 = sub(%37, %38)  # f32[2, 4, 1, 8]
%40 = mul(%34, %30)  # f32[2, 4, 1, 8]
%41 = mul(%33, %32)  # f32[2, 4, 1, 8]
%42 = add(%40, %41)  # f32[2, 4, 1, 8]
%43 = cat([%39, %42], dim=-1)  # f32[2, 4, 1, 16]
%44 = mul(%35, %30)  # f32[2, 1, 1, 8]
%45 = mul(%36, %32)  # f32[2, 1, 1, 8]
%46 = sub(%44, %45)  # f32[2, 1, 1, 8]
%47 = mul(%36, %30)  # f32[2, 1, 1, 8]
%48 = mul(%35, %32)  # f32[2, 1, 1, 8]
%49 = add(%47, %48)  # f32[2, 1, 1, 8]
%50 = cat([%46, %49], dim=-1)  # f32[2, 1, 1, 16]
%51 = cache_write_loc.reshape(-1)  # i64[2]
%52 = %27.reshape(2, 64)  # f32[2, 64]
%53 = %50.reshape(2, 16)  # f32[2, 16]
%54 = unimem.mla_kv_write(cache_pool_arena, cache_pool_v2p, %51, %52, %53, 0, 3, 8, 64, 16, torch.float32)
%55 = unimem.mla_gather(cache_pool_arena, cache_pool_v2p, cache_buffers_page_table, cache_buffers_kv_len, cache_buffers_out_offset, 14, 0, 3, 8, 64, 16, torch.float32)  # f32[2, 14, 80]
%56 = %55.to(torch.float32)  # f32[2, 14, 80]
%57 = %56[:, None, :, :64]  # f32[2, 1, 14, 64]
%58 = %56[:, None, :, 64:]  # f32[2, 1, 14, 16]
%59 = cat((%13, %43), dim=-1)  # f32[2, 4, 1, 48]
%60 = linear(%57, kv_b_proj.weight, None)  # f32[2, 1, 14, 256]
%61 = %60.view((2, 14, -1, 64))  # f32[2, 14, 4, 64]
%62 = %61.transpose(1, 2)  # f32[2, 4, 14, 64]
%63 = split(%62, [32, 32], dim=-1)  # (f32[2, 4, 14, 32], f32[2, 4, 14, 32])
%64 = %63[0]  # f32[2, 4, 14, 32]
%65 = %63[1]  # f32[2, 4, 14, 32]
%66 = %58.expand(-1, 4, -1, -1)  # f32[2, 4, 14, 16]
%67 = %62.new_empty(2, 4, 14, 48)  # f32[2, 4, 14, 48]
%68 = %67[..., :32]  # f32[2, 4, 14, 32]
%69 = %68.copy_(%64)  # f32[2, 4, 14, 32]
%70 = %67[..., 32:]  # f32[2, 4, 14, 16]
%71 = %70.copy_(%66)  # f32[2, 4, 14, 16]
%72 = scaled_dot_product_attention(%59, %67, %65, attn_mask=in3, dropout_p=0, scale=0.144338, is_causal=False)  # f32[2, 4, 1, 32]
%73 = %72.reshape(2, -1, 1, 32)  # f32[2, 4, 1, 32]
%74 = %73.transpose(1, 2)  # f32[2, 1, 4, 32]
%75 = %74.contiguous()  # f32[2, 1, 4, 32]
%76 = %75.reshape(2, 1, -1)  # f32[2, 1, 128]
%77 = %76.contiguous()  # f32[2, 1, 128]
%78 = linear(%77, o_proj.weight, None)  # f32[2, 1, 256]""")
    assert_expected_inline(_layer(deepseek.decode.after), """\
%0 = linear(in0, q_a_proj.weight, None)  # f32[2, 1, 96]
%1 = %0.to(torch.float32)  # f32[2, 1, 96]
%2 = %1.pow(2)  # f32[2, 1, 96]
%3 = %2.mean(-1, keepdim=True)  # f32[2, 1, 1]
%4 = add(%3, 1e-06)  # f32[2, 1, 1]
%5 = rsqrt(%4)  # f32[2, 1, 1]
%6 = mul(%1, %5)  # f32[2, 1, 96]
%7 = %6.to(torch.float32)  # f32[2, 1, 96]
%8 = mul(q_a_layernorm.weight, %7)  # f32[2, 1, 96]
%9 = linear(%8, q_b_proj.weight, None)  # f32[2, 1, 192]
%10 = %9.view((2, 1, -1, 48))  # f32[2, 1, 4, 48]
%11 = %10.transpose(1, 2)  # f32[2, 4, 1, 48]
%12 = split(%11, [32, 16], dim=-1)  # (f32[2, 4, 1, 32], f32[2, 4, 1, 16])
%13 = %12[0]  # f32[2, 4, 1, 32]
%14 = %12[1]  # f32[2, 4, 1, 16]
%15 = linear(in0, kv_a_proj_with_mqa.weight, None)  # f32[2, 1, 80]
%16 = split(%15, [64, 16], dim=-1)  # (f32[2, 1, 64], f32[2, 1, 16])
%17 = %16[0]  # f32[2, 1, 64]
%18 = %16[1]  # f32[2, 1, 16]
%19 = %18.view(2, 1, 1, 16)  # f32[2, 1, 1, 16]
%20 = in1[..., :8]  # f32[2, 1, 8]
%21 = %20.unsqueeze(1)  # f32[2, 1, 1, 8]
%22 = in2[..., :8]  # f32[2, 1, 8]
%23 = %22.unsqueeze(1)  # f32[2, 1, 1, 8]
%24 = %14[..., 0::2]  # f32[2, 4, 1, 8]
%25 = %14[..., 1::2]  # f32[2, 4, 1, 8]
%26 = %19[..., 0::2]  # f32[2, 1, 1, 8]
%27 = %19[..., 1::2]  # f32[2, 1, 1, 8]
%28 = mul(%24, %21)  # f32[2, 4, 1, 8]
%29 = mul(%25, %23)  # f32[2, 4, 1, 8]
%30 = sub(%28, %29)  # f32[2, 4, 1, 8]
%31 = mul(%25, %21)  # f32[2, 4, 1, 8]
%32 = mul(%24, %23)  # f32[2, 4, 1, 8]
%33 = add(%31, %32)  # f32[2, 4, 1, 8]
%34 = cat([%30, %33], dim=-1)  # f32[2, 4, 1, 16]
%35 = mul(%26, %21)  # f32[2, 1, 1, 8]
%36 = mul(%27, %23)  # f32[2, 1, 1, 8]
%37 = sub(%35, %36)  # f32[2, 1, 1, 8]
%38 = mul(%27, %21)  # f32[2, 1, 1, 8]
%39 = mul(%26, %23)  # f32[2, 1, 1, 8]
%40 = add(%38, %39)  # f32[2, 1, 1, 8]
%41 = cat([%37, %40], dim=-1)  # f32[2, 1, 1, 16]
%42 = cache_write_loc.reshape(-1)  # i64[2]
%43 = %41.reshape(2, 16)  # f32[2, 16]
%44 = %17.reshape(-1, 64)  # f32[2, 64]
%45 = unimem.mla_kv_write_rmsnorm(cache_pool_arena, cache_pool_v2p, %42, %44, %43, kv_a_layernorm.weight, 1e-06, 0, 3, 8, 64, 16, torch.float32)
%46 = kv_b_proj.weight.view(4, 64, 64)  # f32[4, 64, 64]
%47 = %46[:, :32]  # f32[4, 32, 64]
%48 = %46[:, 32:]  # f32[4, 32, 64]
%49 = %13.squeeze(2)  # f32[2, 4, 32]
%50 = %49.transpose(0, 1)  # f32[4, 2, 32]
%51 = bmm(%50, %47)  # f32[4, 2, 64]
%52 = %51.transpose(0, 1)  # f32[2, 4, 64]
%53 = %34.squeeze(2)  # f32[2, 4, 16]
%54 = unimem.mla_decode(%52, %53, cache_pool_arena, cache_pool_v2p, cache_buffers_page_table, cache_buffers_kv_len, 0.144338, 0, 3, 8, 64, 16, torch.float32)  # f32[2, 4, 64]
%55 = %54.transpose(0, 1)  # f32[4, 2, 64]
%56 = %48.transpose(1, 2)  # f32[4, 64, 32]
%57 = bmm(%55, %56)  # f32[4, 2, 32]
%58 = %57.transpose(0, 1)  # f32[2, 4, 32]
%59 = %58.unsqueeze(2)  # f32[2, 4, 1, 32]
%60 = %59.reshape(2, -1, 1, 32)  # f32[2, 4, 1, 32]
%61 = %60.transpose(1, 2)  # f32[2, 1, 4, 32]
%62 = %61.contiguous()  # f32[2, 1, 4, 32]
%63 = %62.reshape(2, 1, -1)  # f32[2, 1, 128]
%64 = %63.contiguous()  # f32[2, 1, 128]
%65 = linear(%64, o_proj.weight, None)  # f32[2, 1, 256]""")


def test_kimi_linear_prefill_layer_after(kimi):
    """The prefill graph's attention is one mla_prefill on the pages (its query length is symbolic: one
    prefill graph serves every length)."""
    assert_expected_inline(_layer(kimi.records[0].after), """\
%0 = linear(in0, q_proj.weight, None)  # f32[2, s27, 192]
%1 = %0.view((2, s27, -1, 48))  # f32[2, s27, 4, 48]
%2 = %1.transpose(1, 2)  # f32[2, 4, s27, 48]
%3 = linear(in0, kv_a_proj_with_mqa.weight, None)  # f32[2, s27, 80]
%4 = split(%3, [64, 16], dim=-1)  # (f32[2, s27, 64], f32[2, s27, 16])
%5 = %4[0]  # f32[2, s27, 64]
%6 = %4[1]  # f32[2, s27, 16]
%7 = %6.view(2, 1, s27, 16)  # f32[2, 1, s27, 16]
%8 = cache_write_loc.reshape(-1)  # i64[2*s8]
%9 = mul(2, s27)
%10 = %7.reshape(%9, 16)  # f32[2*s27, 16]
%11 = %5.reshape(-1, 64)  # f32[2*s27, 64]
%12 = unimem.mla_kv_write_rmsnorm(cache_pool_arena, cache_pool_v2p, %8, %11, %10, kv_a_layernorm.weight, 1e-06, 0, 2, 8, 64, 16, torch.float32)
%13 = unimem.mla_prefill(%2, cache_pool_arena, cache_pool_v2p, cache_buffers_page_table, cache_buffers_kv_len, None, kv_b_proj.weight, 0.144338, 8192, 0, 2, 8, 64, 16, torch.float32)  # f32[2, 4, s27, 32]
%14 = %13.reshape(2, -1, s27, 32)  # f32[2, 4, s27, 32]
%15 = %14.transpose(1, 2)  # f32[2, s27, 4, 32]
%16 = %15.contiguous()  # f32[2, s27, 4, 32]
%17 = %16.reshape(2, s27, -1)  # f32[2, s27, 128]
%18 = %17.contiguous()  # f32[2, s27, 128]
%19 = linear(%18, o_proj.weight, None)  # f32[2, s27, 256]""")


# ---------------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("family", ["kimi", "deepseek"])
def test_greedy_tokens_identical_with_and_without_passes(family, request):
    on, off = request.getfixturevalue(family), request.getfixturevalue(family + "_plain")
    assert torch.equal(on.tokens, off.tokens)
    assert on.tokens.shape[1] == PROMPT + NEW


MLA_NAMES = ("mla_write_fusion", "mla_absorb", "mla_prefill")


def _mla(counts):
    return {name: counts[name] for name in MLA_NAMES}


@pytest.mark.parametrize("family, layers", [("kimi", 2), ("deepseek", 3)])
def test_counts_are_one_fusion_per_layer_and_graph_and_one_attention_rewrite_per_layer(family, layers, request):
    on, off = request.getfixturevalue(family), request.getfixturevalue(family + "_plain")
    assert [_mla(r.counts) for r in on.records] == [
        {"mla_write_fusion": layers, "mla_absorb": 0, "mla_prefill": layers},  # prefill
        {"mla_write_fusion": layers, "mla_absorb": layers, "mla_prefill": 0},  # decode
    ]
    assert _mla(on.model.unimem.rewrites) == {"mla_write_fusion": 2 * layers, "mla_absorb": layers,
                                              "mla_prefill": layers}
    assert set(off.model.unimem.rewrites.values()) == {0}


def test_passes_touch_only_the_model_they_were_compiled_for(kimi, kimi_plain):
    def ops(graph):
        return {str(n.target) for n in graph.nodes if n.op == "call_function" and "unimem" in str(n.target)}

    assert "unimem.mla_decode" in ops(kimi.decode.after)
    assert {"unimem.mla_gather", "unimem.mla_kv_write"} <= ops(kimi_plain.decode.after)
    assert "unimem.mla_decode" not in ops(kimi_plain.decode.after)


def test_eager_attention_form_of_deepseek_is_absorbed_with_stock_tokens_unless_weights_are_returned():
    from unimem_compile.hf.models import build_model

    torch._dynamo.reset()
    result = capture("deepseek-v3-tiny", backend="aot_eager", attn_implementation="eager", prompt=PROMPT,
                     new_tokens=NEW)
    assert _mla(result.decode.counts) == {"mla_write_fusion": 3, "mla_absorb": 3, "mla_prefill": 0}
    assert _mla(result.prefill.counts) == {"mla_write_fusion": 3, "mla_absorb": 0, "mla_prefill": 3}  # eager, too
    stock = build_model("deepseek-v3-tiny", attn_implementation="eager")
    assert torch.equal(result.tokens, _stock_tokens(stock))

    # the same graph with the attention weights also returned (output_attentions) is left alone
    graph = copy_graph(result.decode.before)
    softmaxes = [n for n in graph.nodes if is_function(n, torch.nn.functional.softmax)]
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ((*output.args[0], *softmaxes),)
    before = _code(graph)
    assert MLAAbsorb()(graph) == 0 and _code(graph) == before


def test_deepseek_v2_without_q_lora_is_absorbed_with_stock_tokens():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    config._attn_implementation = "sdpa"

    def model():
        torch.manual_seed(0)
        return DeepseekV2ForCausalLM(config).eval()

    torch._dynamo.reset()
    result = capture("", model=model(), backend="aot_eager", prompt=PROMPT, new_tokens=NEW)
    assert _mla(result.decode.counts) == {"mla_write_fusion": 2, "mla_absorb": 2, "mla_prefill": 0}
    assert _mla(result.prefill.counts) == {"mla_write_fusion": 2, "mla_absorb": 0, "mla_prefill": 2}
    assert torch.equal(result.tokens, _stock_tokens(model()))


def test_absorption_holds_when_dynamo_makes_the_batch_symbolic():
    """A second batch size makes Dynamo recompile with a symbolic batch: still matched, still exact."""
    import unimem_compile
    from unimem_compile.hf.models import build_model

    stock, model = build_model("deepseek-v3-tiny"), build_model("deepseek-v3-tiny")
    torch._dynamo.reset()
    unimem_compile.compile(model, max_batch_size=3, max_seq_len=PROMPT + 4, page_size=8, backend="eager")
    model.unimem.use_runner = False  # the compiled forward's decode graphs; the runner's steps are static per bucket
    model.unimem.passes.keep_graphs = True
    for batch in (2, 3):
        ids = torch.randint(3, 1000, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, stock.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False))
    decode = model.unimem.passes.records[-1]
    values = [n.meta.get("example_value") for n in decode.after.nodes if n.op == "placeholder"]
    assert any(isinstance(v, torch.SymInt) for v in values)  # the batch is a graph input now
    assert _mla(decode.counts) == {"mla_write_fusion": 3, "mla_absorb": 3, "mla_prefill": 0}


# ---------------------------------------------------------------------------------------------- refusals
def _linears_of_latent(graph):
    gathers = [n for n in graph.nodes if is_function(n, torch.ops.unimem.mla_gather)]
    return [next(iter(s.users)) for g in gathers for s in next(iter(g.users)).users
            if is_function(next(iter(s.users)), torch._C._nn.linear)]


def _biased_kv_b_proj(graph):
    first = next(iter(graph.nodes))
    with graph.inserting_before(first):
        bias = graph.placeholder("kv_b_proj_bias")
    for linear in _linears_of_latent(graph):
        linear.args = (*linear.args[:2], bias)


def _int8_linear(x, weight):
    """Stands in for a quantised kv_b_proj kernel."""
    return torch.nn.functional.linear(x, weight)


def _quantised_kv_b_proj(graph):
    for linear in _linears_of_latent(graph):
        linear.target = _int8_linear
        linear.args = linear.args[:2]


def _sdpa_nodes(graph):
    return [n for n in graph.nodes if is_function(n, torch._C._nn.scaled_dot_product_attention)]


def _set_kwarg(name, val):
    def edit(graph):
        for n in _sdpa_nodes(graph):
            n.update_kwarg(name, val)
    return edit


def _extra_use_of_normed_latent(graph):
    for write in [n for n in graph.nodes if is_function(n, torch.ops.unimem.mla_kv_write)]:
        normed = write.args[3].args[0].args[0]  # reshape <- view <- weight * y
        with graph.inserting_after(normed):
            graph.call_function(torch.neg, (normed,))


@pytest.mark.parametrize("edit, rewrite, reason", [
    (_set_kwarg("is_causal", True), MLAAbsorb, "is_causal=True"),
    (_set_kwarg("dropout_p", 0.1), MLAAbsorb, "attention dropout p=0.1"),
    (_biased_kv_b_proj, MLAAbsorb, "kv_b_proj has a bias"),
    (_quantised_kv_b_proj, MLAAbsorb, "kv_b_proj is not a plain F.linear"),
    (_extra_use_of_normed_latent, MLAWriteFusion, "outside the matched pattern"),
], ids=["is_causal", "dropout", "biased_kv_b_proj", "quantised_kv_b_proj", "normed_latent_used_elsewhere"])
def test_non_matching_decode_graph_is_unchanged_with_one_log_line(deepseek, edit, rewrite, reason, caplog):
    graph = copy_graph(deepseek.decode.before)
    edit(graph)
    before = _code(graph)
    with caplog.at_level(logging.INFO, logger=PASS_LOG):
        count = rewrite()(graph)
    (line,) = [r.getMessage() for r in caplog.records if r.name == PASS_LOG]
    assert count == 0 and _code(graph) == before
    assert line.count(reason) == 3  # every layer named, in one line


def _narrower_mask(graph):
    from unimem_compile.passes.common import insert_call

    for n in _sdpa_nodes(graph):
        mask = n.kwargs["attn_mask"]
        with graph.inserting_before(n):
            narrow = insert_call(graph, operator.getitem, (mask, (slice(None),) * 3 + (slice(None, 13),)), like=n)
        n.update_kwarg("attn_mask", narrow)


def _causal_without_mask(graph):
    for n in _sdpa_nodes(graph):
        n.update_kwarg("attn_mask", None)
        n.update_kwarg("is_causal", True)


@pytest.mark.parametrize("edit, reason", [
    (_set_kwarg("dropout_p", 0.1), "attention dropout p=0.1"),
    (_set_kwarg("is_causal", True), "is_causal=True with a mask"),
    (_causal_without_mask, "is_causal=True over all of the 14-position history for symbolic queries"),
    (_narrower_mask, "the attention mask getitem() [2, 1, None, 13] is not [B, 1, symbolic, 14]"),
    (_biased_kv_b_proj, "kv_b_proj has a bias"),
    (_quantised_kv_b_proj, "kv_b_proj is not a plain F.linear"),
], ids=["dropout", "is_causal_with_mask", "is_causal_over_the_whole_history", "narrower_mask", "biased_kv_b_proj",
        "quantised_kv_b_proj"])
def test_non_matching_prefill_graph_is_unchanged_with_one_log_line(deepseek, edit, reason, caplog):
    graph = copy_graph(deepseek.records[0].before)
    edit(graph)
    before = _code(graph)
    with caplog.at_level(logging.INFO, logger=PASS_LOG):
        count = MLAPrefill()(graph)
    (line,) = [r.getMessage() for r in caplog.records if r.name == PASS_LOG]
    assert count == 0 and _code(graph) == before
    assert line.startswith("mla_prefill: 3 of 3 site(s) left unchanged") and line.count(reason) == 3, line


def test_decode_graphs_are_left_to_mla_absorb_and_the_prefill_graph_is_rewritten(deepseek, caplog):
    with caplog.at_level(logging.INFO, logger=PASS_LOG):
        assert MLAPrefill()(copy_graph(deepseek.decode.before)) == 0
    (line,) = [r.getMessage() for r in caplog.records if r.name == PASS_LOG]
    assert line.count("decode (query length 1: mla_absorb's)") == 3
    prefill = copy_graph(deepseek.records[0].before)
    assert MLAPrefill()(prefill) == 3
    ops = [str(n.target) for n in prefill.nodes if n.op == "call_function"]
    assert ops.count("unimem.mla_prefill") == 3 and "unimem.mla_gather" not in ops
    assert not _sdpa_nodes(prefill)
    with pytest.raises(ValueError, match="workspace_tokens must be an int >= 1, got 0"):
        MLAPrefill(workspace_tokens=0)


def test_prefill_is_not_absorbed_and_says_so(kimi, caplog):
    prefill = copy_graph(kimi.records[0].before)
    before = _code(prefill)
    with caplog.at_level(logging.INFO, logger=PASS_LOG):
        assert MLAAbsorb()(prefill) == 0
    assert _code(prefill) == before
    (line,) = [r.getMessage() for r in caplog.records if r.name == PASS_LOG]
    # prefill graphs have a symbolic query length (one graph for every length: hf/step_inputs.py)
    assert "prefill (symbolic query length)" in line and "model.layers.1.self_attn" in line


def test_unpadded_prefill_is_refused_as_prefill_not_as_a_slice(caplog):
    # without left pads transformers slices the expanded history to the prompt before a causal SDPA; the
    # log must still give the reason that matters (prefill), not the slice it met first
    import unimem_compile
    from unimem_compile.hf.models import build_model

    torch._dynamo.reset()
    model = build_model("kimi-linear-tiny", dtype=torch.float32, seed=0)
    unimem_compile.compile(model, max_batch_size=1, max_seq_len=PROMPT + 1, page_size=8, backend="aot_eager",
                           passes=["mla_absorb"])
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    with caplog.at_level(logging.INFO, logger=PASS_LOG):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
    lines = [r.getMessage() for r in caplog.records if r.name == PASS_LOG]
    assert lines and "model.layers.1.self_attn: prefill (symbolic query length)" in lines[0], lines
    assert "getitem" not in lines[0]


def test_rewriting_a_recorded_graph_again_reproduces_the_recorded_result(deepseek):
    graph = copy_graph(deepseek.decode.before)
    counts = make_pass_manager(True)(graph)
    assert counts == deepseek.decode.counts
    assert _layer(graph) == _layer(deepseek.decode.after)


def test_dump_folder_gets_each_graph_before_and_after(deepseek, tmp_path, monkeypatch):
    monkeypatch.setenv("UNIMEM_DUMP_GRAPHS", str(tmp_path / "graphs"))
    make_pass_manager(True)(copy_graph(deepseek.decode.before))
    (before,) = (tmp_path / "graphs").glob("graph*_before.py")
    (after,) = (tmp_path / "graphs").glob("graph*_after.py")
    assert "unimem.mla_gather" in before.read_text() and "mla_decode" not in before.read_text()
    assert after.read_text().startswith("# mla_write_fusion: 3\n# mla_absorb: 3\n# kda_state_inplace: 0\n")
    assert "unimem.mla_decode" in after.read_text() and "mla_gather" not in after.read_text()


def test_dump_without_rewrites_says_so_and_a_bad_dump_folder_names_the_variable(deepseek, tmp_path, monkeypatch):
    monkeypatch.setenv("UNIMEM_DUMP_GRAPHS", str(tmp_path / "plain"))
    make_pass_manager(False)(copy_graph(deepseek.decode.before))
    (after,) = (tmp_path / "plain").glob("graph*_after.py")
    assert after.read_text().startswith("# no rewrites enabled\n")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for bad in (blocker, blocker / "sub"):
        monkeypatch.setenv("UNIMEM_DUMP_GRAPHS", str(bad))
        with pytest.raises(OSError, match=f"UNIMEM_DUMP_GRAPHS='{bad}': cannot write graph dumps there"):
            make_pass_manager(True)(copy_graph(deepseek.decode.before))
        import unimem_compile
        from unimem_compile.hf.models import build_model

        model = build_model("deepseek-v3-tiny")
        with pytest.raises(OSError, match="UNIMEM_DUMP_GRAPHS="):  # at compile(), not at the first generate()
            unimem_compile.compile(model, max_batch_size=1, max_seq_len=16, backend="aot_eager")
        assert not hasattr(model, "unimem")


def test_capture_decode_refuses_when_no_decode_graph_was_compiled():
    one = capture("deepseek-v3-tiny", passes=["mla_absorb"], backend="aot_eager", prompt=PROMPT, new_tokens=1)
    assert len(one.records) == 1
    with pytest.raises(ValueError, match="no decode graph was compiled"):
        one.decode  # noqa: B018 - the property raises


# ---------------------------------------------------------------------------------------------- Inductor
@pytest.mark.slow
@pytest.mark.parametrize("name, family", [("kimi-linear-tiny", "kimi"), ("deepseek-v3-tiny", "deepseek")])
def test_inductor_counts_and_tokens_hold_on_a_warm_compile_cache(name, family, request):
    """Compiled twice with Inductor (tests/inductor_runs.py: the suite's one Inductor compile of the family,
    then again from its cache after a Dynamo reset): the same counts as with aot_eager and the same tokens,
    because the rewrites run before any cache lookup."""
    reference = request.getfixturevalue(family)
    cold, warm = inductor_run(name), warm_run(name)
    assert warm.hits >= 2, f"the second compile did not come from the cache: {warm.counters}"
    for rewrites, counts in ((cold.rewrites_first, cold.counts), (warm.rewrites, warm.counts)):
        assert rewrites == reference.model.unimem.rewrites
        assert counts == [r.counts for r in reference.records]
    assert torch.equal(warm.tokens, cold.got) and torch.equal(cold.got, cold.want)


def test_decode_graphs_are_told_apart_from_prefill_graphs(kimi, deepseek):
    from unimem_compile.passes.manager import is_decode_graph

    for captured in (kimi, deepseek):
        assert [is_decode_graph(r.before) for r in captured.records] == [False, True]
        assert [is_decode_graph(r.after) for r in captured.records] == [False, True]
