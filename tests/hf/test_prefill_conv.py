"""``UNIMEM_PREFILL_CONV=shifted``: Kimi-Linear's prefill short convolution as K shifted multiply-adds
(``hf.kda_kernels.causal_conv1d_shifted``) against transformers' ``F.conv1d`` form, op level and through generate().
"""

import inspect
import os

import pytest
import torch

import unimem_compile
from unimem_compile import env
from unimem_compile.hf.kda_kernels import causal_conv1d_shifted
from unimem_compile.hf.models import build_model

from .generate_models import MAX_SEQ, PAGE, greedy, prompts


def _stock_conv():
    from transformers.models.kimi_linear import modeling_kimi_linear

    return inspect.unwrap(modeling_kimi_linear.causal_conv1d_fn)


@pytest.mark.parametrize("k_size, bias, activation", [(4, True, "silu"), (4, False, None), (2, True, "swish"),
                                                      (1, False, "silu")])
def test_shifted_conv_equals_the_depthwise_convolution(k_size, bias, activation):
    gen = torch.Generator().manual_seed(31 + k_size)
    channels, length = 24, 37
    x = torch.randn(3, length, channels, generator=gen).transpose(1, 2)  # [B, C, L] as a strided view
    weight = torch.randn(channels, k_size, generator=gen)
    b = torch.randn(channels, generator=gen) if bias else None
    want = _stock_conv()(x, weight, b, activation)
    got = causal_conv1d_shifted(x, weight, b, activation)
    assert got.shape == want.shape == (3, channels, length) and got.dtype == want.dtype
    # fp32, K products summed in another order than the convolution kernel's: rounding only
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # causal: the first output column sees only x[..., 0]
    only_first = weight[:, -1] * x[:, :, 0] + (b if b is not None else 0)
    if activation is not None:
        only_first = torch.nn.functional.silu(only_first)
    torch.testing.assert_close(got[:, :, 0], only_first, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shifted_conv_in_16_bits_is_as_close_to_the_exact_convolution_as_the_original(dtype):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 16, 50, generator=gen).to(dtype)
    weight = torch.randn(16, 4, generator=gen).to(dtype)
    bias = torch.randn(16, generator=gen).to(dtype)
    got = causal_conv1d_shifted(x, weight, bias, "silu")
    exact = _stock_conv()(x.double(), weight.double(), bias.double(), "silu")
    original = _stock_conv()(x, weight, bias, "silu")
    assert got.dtype == original.dtype == dtype
    err, err_original = (got.double() - exact).abs().max(), (original.double() - exact).abs().max()
    # fp32 products and sum, one rounding to the 16-bit dtype: within one ulp of |exact| (2^-8 bf16, 2^-11 fp16
    # relative), and no worse than the original's own rounding (which rounds before and after the SiLU)
    ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
    assert err <= ulp * exact.abs().max() and err <= err_original * 1.01, (float(err), float(err_original))


def test_the_prefill_conv_setting_is_checked(monkeypatch):
    monkeypatch.setenv(env.PREFILL_CONV, "fast")
    with pytest.raises(ValueError, match=r"UNIMEM_PREFILL_CONV must be 'conv' or 'shifted', got 'fast'"):
        env.prefill_conv()
    monkeypatch.setenv(env.PREFILL_CONV, "")
    assert env.prefill_conv() == "conv"


def test_generate_with_the_shifted_conv_equals_stock_and_its_graph_has_no_convolution(monkeypatch, tmp_path):
    stock = build_model("kimi-linear-tiny")
    model = build_model("kimi-linear-tiny")
    dump = tmp_path / "graphs"
    monkeypatch.setenv(env.DUMP_GRAPHS, str(dump))
    monkeypatch.setenv(env.PREFILL_CONV, "shifted")
    unimem_compile.compile(model, max_batch_size=3, max_seq_len=MAX_SEQ, page_size=PAGE, backend="aot_eager")
    ids, mask = prompts([45, 30, 12], seed=5)
    want = greedy(stock, ids, mask, 6)
    assert torch.equal(greedy(model, ids, mask, 6), want)
    assert torch.equal(greedy(model, ids, mask, 6, prefill_chunk_size=16), want)  # later chunks from the state
    rewritten = [p for p in dump.rglob("*") if p.is_file() and "after" in p.name]
    prefill = [p.read_text() for p in rewritten if "input_ids" in p.read_text() and "kda_chunk" in p.read_text()]
    # transformers' form traces to torch.conv1d(x, weight, bias, padding=3, groups=C) in the prefill graph
    assert prefill and all("torch.conv1d(" not in text for text in prefill), sorted(os.listdir(dump))
