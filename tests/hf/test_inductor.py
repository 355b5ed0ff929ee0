"""One Inductor (C++ codegen on the CPU) compile per model family (tests/inductor_runs.py, shared with the
Inductor tests of tests/passes): tokens identical to stock generate, two graphs (prefill, decode), a second
generate compiles nothing, nor does a chunked prefill; the prefill code attends on the pages (``mla_prefill``)
and neither gathers a ``max_seq_len`` history nor reads transformers' ``[B, 1, T, max_seq_len]`` mask. The
other tests use aot_eager."""

import re

import pytest
import torch

from ..inductor_runs import MAX_BATCH, MAX_SEQ, inductor_run


@pytest.mark.parametrize("family", ["kimi-linear-tiny", "deepseek-v3-tiny"])
def test_inductor_generate_matches_stock_and_compiles_two_graphs_chunked_or_not(family):
    run = inductor_run(family)
    assert torch.equal(run.got, run.want)
    assert run.graphs_first == 2
    (prefill,) = [c for c in run.codes if "mla_prefill" in c]
    start = prefill.index("def call(")
    prefill = prefill[start:prefill.index("\ndef ", start)]  # what runs (not the benchmark harness after it)
    layers = len(run.model.unimem.adapter.mla_layers)
    assert prefill.count("torch.ops.unimem.mla_prefill.default(") == layers
    assert "mla_gather" not in prefill
    # the [B, 1, T, max_seq_len] mask: an unread input
    assert not re.search(rf"\({MAX_BATCH}, 1, \w+, {MAX_SEQ}\)", prefill)
    assert not re.search(rf"\({MAX_BATCH}, {MAX_SEQ}, \d+\)", prefill)  # a [B, max_seq_len, R + Dr] history
    assert torch.equal(run.again, run.want)
    assert torch.equal(run.chunked, run.want)  # 10 + 10 + 4: the same graph
    assert run.graphs_last == 2
    stats = run.stats
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0 and stats["kv_pages_peak"] > 0
