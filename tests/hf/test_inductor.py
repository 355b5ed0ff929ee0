"""One Inductor (C++ codegen on the CPU) compile per model family: tokens identical to stock generate,
two graphs (prefill, decode), a second generate compiles nothing. The other tests use aot_eager."""

import pytest
import torch

import unimem_compile
from unimem_compile.hf.models import build_model

from .test_generate import greedy, prompts


@pytest.mark.parametrize("family", ["kimi-linear-tiny", "deepseek-v3-tiny"])
def test_inductor_generate_matches_stock_and_compiles_two_graphs(family):
    stock = build_model(family)
    model = build_model(family)
    unimem_compile.compile(model, max_batch_size=2, max_seq_len=96, page_size=16, backend="inductor")
    ids, mask = prompts([24, 17], seed=21)
    want = greedy(stock, ids, mask, 20)
    assert torch.equal(greedy(model, ids, mask, 20), want)
    assert model.unimem.passes.graphs == 2
    assert torch.equal(greedy(model, ids, mask, 20), want)
    assert model.unimem.passes.graphs == 2
    stats = model.unimem.stats()
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0 and stats["kv_pages_peak"] > 0
