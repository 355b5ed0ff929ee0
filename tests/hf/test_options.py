"""CompileOptions checks and normalises every option without a model: names become dtypes and the
rewrite set, and a bad value raises the same error compile() documents."""

import dataclasses

import numpy as np
import pytest
import torch

from unimem_compile import CompileOptions
from unimem_compile.errors import GeometryError
from unimem_compile.passes import REWRITE_NAMES


def test_options_are_normalised_once():
    o = CompileOptions(max_batch_size=3, max_seq_len=40, kv_dtype="bf16", passes="mla_absorb",
                       memory_budget=np.int64(5 << 20))
    assert (o.kv_dtype, o.passes, o.memory_budget) == (torch.bfloat16, frozenset({"mla_absorb"}), 5 << 20)
    assert type(o.memory_budget) is int
    assert CompileOptions(max_batch_size=1, max_seq_len=8).passes == frozenset(REWRITE_NAMES)
    assert CompileOptions(max_batch_size=1, max_seq_len=8, passes=False, kv_dtype="torch.float16").passes == frozenset()
    for name, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e4m3fn", torch.float8_e4m3fn),
                        ("fp8_e4m3fnuz", torch.float8_e4m3fnuz), ("float8_e4m3fnuz", torch.float8_e4m3fnuz)):
        assert CompileOptions(max_batch_size=1, max_seq_len=8, kv_dtype=name).kv_dtype == dtype
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.page_size = 16


def test_cudagraphs_none_follows_the_device_and_a_bool_is_kept():
    auto = CompileOptions(max_batch_size=1, max_seq_len=8, cudagraphs=None)
    assert auto.cudagraphs_for(torch.device("cuda", 0)) and not auto.cudagraphs_for(torch.device("cpu"))
    assert CompileOptions(max_batch_size=1, max_seq_len=8, cudagraphs=True).cudagraphs_for(torch.device("cpu"))
    default = CompileOptions(max_batch_size=1, max_seq_len=8)  # the default is None: on for CUDA models
    assert default.cudagraphs is None and default.cudagraphs_for(torch.device("cuda", 0))
    assert not CompileOptions(max_batch_size=1, max_seq_len=8, cudagraphs=False).cudagraphs_for(torch.device("cuda", 0))


@pytest.mark.parametrize("kw, exc, message", [
    (dict(max_batch_size=0), GeometryError, "max_batch_size must be a positive int, got 0"),
    (dict(page_size=True), GeometryError, "page_size must be a positive int, got True"),
    (dict(memory_budget=1.5), GeometryError, r"a float memory_budget is a fraction of free memory in \(0, 1\], got 1.5"),
    (dict(memory_budget="1G"), GeometryError, "memory_budget must be bytes"),
    (dict(memory_budget=-5), GeometryError, "memory_budget must be a positive number of bytes, got -5"),
    (dict(passes=["mla_absorbb"]), ValueError, r"unknown rewrite\(s\) \['mla_absorbb'\]"),
    (dict(passes=None), TypeError, "must be True, False, a rewrite name or a collection of names, got None"),
    (dict(cudagraphs=1), TypeError, "cudagraphs must be one of False, True, got 1"),
    (dict(kv_dtype=torch.float32.itemsize), TypeError, "kv_dtype must be a torch.dtype, a dtype name or None, got 4"),
])
def test_a_bad_option_raises_the_error_compile_documents(kw, exc, message):
    with pytest.raises(exc, match=message):
        CompileOptions(**({"max_batch_size": 2, "max_seq_len": 16} | kw))


def test_max_seq_len_past_the_configs_positions_warns_with_both_numbers():
    import warnings

    import unimem_compile
    from unimem_compile.hf.models import build_model

    limit = build_model("deepseek-v3-tiny").config.max_position_embeddings
    with pytest.warns(UserWarning, match=rf"max_seq_len={limit + 64} tokens exceeds the model config's "
                                         rf"max_position_embeddings={limit}"):
        unimem_compile.compile(build_model("deepseek-v3-tiny"), max_batch_size=1, max_seq_len=limit + 64,
                               page_size=64, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # at the limit: nothing to say
        unimem_compile.compile(build_model("deepseek-v3-tiny"), max_batch_size=1, max_seq_len=limit, page_size=64,
                               backend="aot_eager")
