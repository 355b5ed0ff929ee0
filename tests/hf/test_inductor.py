"""One Inductor (C++ codegen on the CPU) compile per model family: tokens identical to stock generate,
two graphs (prefill, decode), a second generate compiles nothing, nor does a chunked prefill; the prefill
code attends on the pages (``mla_prefill``) and neither gathers a ``max_seq_len`` history nor reads
transformers' ``[B, 1, T, max_seq_len]`` mask. The other tests use aot_eager."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import unimem_compile
from unimem_compile.hf.models import build_model

from .generate_models import greedy, prompts


@pytest.mark.parametrize("family", ["kimi-linear-tiny", "deepseek-v3-tiny"])
def test_inductor_generate_matches_stock_and_compiles_two_graphs_chunked_or_not(family):
    stock = build_model(family)
    model = build_model(family)
    unimem_compile.compile(model, max_batch_size=2, max_seq_len=96, page_size=16, backend="inductor")
    ids, mask = prompts([24, 17], seed=21)
    want = greedy(stock, ids, mask, 20)
    # the code is only generated on a compile-cache miss
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        got, codes = run_and_get_code(greedy, model, ids, mask, 20)
    assert torch.equal(got, want)
    assert model.unimem.passes.graphs == 2
    (prefill,) = [c for c in codes if "mla_prefill" in c]
    start = prefill.index("def call(")
    prefill = prefill[start:prefill.index("\ndef ", start)]  # what runs (not the benchmark harness after it)
    layers = len(model.unimem.adapter.mla_layers)
    assert prefill.count("torch.ops.unimem.mla_prefill.default(") == layers
    assert "mla_gather" not in prefill
    assert not re.search(r"\(2, 1, \w+, 96\)", prefill)  # the [B, 1, T, max_seq_len] mask: an unread input
    assert not re.search(r"\(2, 96, \d+\)", prefill)  # a [B, max_seq_len, R + Dr] history
    assert torch.equal(greedy(model, ids, mask, 20), want)
    assert torch.equal(greedy(model, ids, mask, 20, prefill_chunk_size=10), want)  # 10 + 10 + 4: the same graph
    assert model.unimem.passes.graphs == 2
    stats = model.unimem.stats()
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0 and stats["kv_pages_peak"] > 0
