"""Compiled generate() on the unified pool against stock transformers generate (fp32, CPU).

Greedy tokens must be identical for both model families, with and without left padding, for prompts
shorter than the conv kernel and longer than a page and a KDA chunk; decode must never recompile; pages
and slots must all be back in the pool after each call.
"""

import pytest
import torch

import unimem_compile
from unimem_compile.errors import GeometryError, UnsupportedModel
from unimem_compile.hf.models import build_model

FAMILIES = ["kimi-linear-tiny", "deepseek-v3-tiny"]
MAX_SEQ = 160
PAGE = 16


def prompts(lengths, seed, vocab=1024):
    """Left-padded random prompts of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def greedy(model, ids, mask, new_tokens, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, **kw)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    """(stock model, unimem-compiled model with the same weights, family name), aot_eager inner backend."""
    stock = build_model(request.param)
    model = build_model(request.param)
    unimem_compile.compile(model, max_batch_size=4, max_seq_len=MAX_SEQ, page_size=PAGE, backend="aot_eager")
    return stock, model, request.param


CASES = {
    "ragged_left_padding": [20, 13, 17],
    "equal_lengths_no_padding": [18, 18],
    "shorter_than_the_conv_kernel": [2, 3],
    "longer_than_a_page_and_a_kda_chunk": [70, 81],
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_stock_generate(pair, case):
    stock, model, _ = pair
    ids, mask = prompts(CASES[case], seed=len(case))
    if bool(mask.all()):
        mask = None
    want = greedy(stock, ids, mask, 12)
    got = greedy(model, ids, mask, 12)
    assert torch.equal(got, want)
    stats = model.unimem.stats()
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0


def test_decode_compiles_once_and_a_second_generate_compiles_nothing(pair):
    stock, model, family = pair
    ids, mask = prompts([30, 22], seed=7)
    greedy(model, ids, mask, 4)  # this prompt length's prefill graph (and the decode graph) exist now
    graphs = model.unimem.passes.graphs
    # 24 new tokens cross two 16-token page boundaries: the decode graph must not recompile
    got = greedy(model, ids, mask, 24)
    assert model.unimem.passes.graphs == graphs
    assert torch.equal(got, greedy(stock, ids, mask, 24))
    again = greedy(model, ids, mask, 24)  # a new cache object, the same shapes, freed pages reused
    assert model.unimem.passes.graphs == graphs and torch.equal(again, got)
    assert model.unimem.stats()["kv_pages_used"] == 0


def test_pages_of_a_finished_generate_are_reused(pair):
    _, model, _ = pair
    ids, mask = prompts([40, 40], seed=3)
    greedy(model, ids, mask, 8)
    s1 = model.unimem.stats()
    greedy(model, ids, mask, 8)
    s2 = model.unimem.stats()
    assert s1["kv_pages_used"] == s2["kv_pages_used"] == 0
    # the same batch needs the same pages again: the peak does not grow
    assert s2["kv_pages_peak"] == s1["kv_pages_peak"]
    assert model.unimem.pool.allocator.free_gap_bytes == s2["free_gap_bytes"]
    model.unimem.pool.allocator.check_invariants()


def test_sampling_with_a_seed_matches_stock(pair):
    stock, model, _ = pair
    ids, mask = prompts([12, 9], seed=11)
    kw = dict(do_sample=True, top_k=50, temperature=0.9, max_new_tokens=10)
    torch.manual_seed(123)
    with torch.no_grad():
        want = stock.generate(ids, attention_mask=mask, **kw)
    torch.manual_seed(123)
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(got, want)


def test_eos_stops_rows_like_stock(pair):
    stock, model, _ = pair
    ids, mask = prompts([15, 11, 19], seed=5)
    free_run = greedy(stock, ids, mask, 10)
    eos = int(free_run[1, ids.shape[1] + 2])  # row 1 will emit this token third
    with torch.no_grad():
        want = stock.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos,
                              pad_token_id=0)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos,
                             pad_token_id=0)
    assert torch.equal(got, want)
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def test_force_eager_runs_the_same_cache_path():
    stock = build_model("kimi-linear-tiny")
    model = build_model("kimi-linear-tiny")
    unimem_compile.compile(model, max_batch_size=2, max_seq_len=64, page_size=4, backend="aot_eager")
    ids, mask = prompts([9, 6], seed=2)
    with torch.compiler.set_stance("force_eager"):
        got = greedy(model, ids, mask, 6)
    assert torch.equal(got, greedy(stock, ids, mask, 6))
    assert model.unimem.passes.graphs == 0


# ---------------------------------------------------------------------------------------------- errors
@pytest.fixture(scope="module")
def small():
    model = build_model("kimi-linear-tiny")
    return unimem_compile.compile(model, max_batch_size=2, max_seq_len=32, page_size=8, backend="aot_eager")


def test_batch_larger_than_max_batch_size_is_refused(small):
    ids, mask = prompts([5, 5, 5], seed=1)
    with pytest.raises(GeometryError, match="batch of 3 rows is larger than max_batch_size=2"):
        small.generate(ids, attention_mask=mask, max_new_tokens=2)
    assert small.unimem.stats()["kv_pages_used"] == 0


def test_prompt_plus_new_tokens_longer_than_max_seq_len_is_refused(small):
    ids, mask = prompts([20, 12], seed=1)
    with pytest.raises(GeometryError, match=r"prompt \(20 tokens, pads included\) \+ new tokens = 33 tokens is "
                                            r"longer than max_seq_len=32"):
        small.generate(ids, attention_mask=mask, max_new_tokens=13)
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


def test_input_on_another_device_is_refused(small):
    ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
    with pytest.raises(UnsupportedModel, match="input_ids are on meta but the model and its pool are on cpu"):
        small.generate(ids, max_new_tokens=2)


def test_budget_too_small_for_one_request_states_the_minimum():
    from unimem_compile.pool import ArenaLayout

    model = build_model("kimi-linear-tiny")
    adapter = unimem_compile.hf.adapters.adapter_for(model)
    minimum = ArenaLayout.for_capacity(adapter.kv_spec, adapter.state_spec, 16, 4, 1).memory_budget
    with pytest.raises(GeometryError, match=f"cannot hold one request of max_seq_len=64 tokens and its state: "
                                            f"the minimum is {minimum} bytes"):
        unimem_compile.compile(model, max_batch_size=2, max_seq_len=64, page_size=16, memory_budget=minimum - 1)
    assert not hasattr(model, "unimem")
    unimem_compile.compile(model, max_batch_size=2, max_seq_len=64, page_size=16, memory_budget=minimum,
                           backend="aot_eager")
    assert model.unimem.pool.layout.memory_budget == minimum


# phase -> (rows' prompt lengths, (pages, slots) the budget is sized for, new tokens, the allocations the
# cache makes up to the failing one: (side, count)); page size 16, max_seq_len 64
EXHAUSTION = {
    # three rows' slots do not fit next to one full row's pages: the prefill fails on the state side
    "prefill_slots": ([40, 40, 40], (4, 1), 4, [("state", 3)]),
    # two rows' prefill (two pages, two slots) fits; crossing the first page boundary needs two more pages
    "decode_pages": ([10, 10], (3, 2), 10, [("state", 2), ("kv", 2), ("kv", 2)]),
}


@pytest.mark.parametrize("phase", list(EXHAUSTION))
def test_pool_exhaustion_surfaces_as_pool_exhausted_with_the_numbers_and_leaks_nothing(phase):
    from unimem_compile.errors import PoolExhausted
    from unimem_compile.pool import ArenaLayout, UnifiedPool

    lengths, (pages, slots), new_tokens, replay = EXHAUSTION[phase]
    model = build_model("kimi-linear-tiny")
    adapter = unimem_compile.hf.adapters.adapter_for(model)
    budget = ArenaLayout.for_capacity(adapter.kv_spec, adapter.state_spec, 16, pages, slots).memory_budget
    unimem_compile.compile(model, max_batch_size=4, max_seq_len=64, page_size=16, memory_budget=budget,
                           backend="aot_eager")
    layout = model.unimem.pool.layout
    assert not layout.fits(pages + 1, slots) and not layout.fits(pages, slots + 1)
    ids, mask = prompts(lengths, seed=4)
    with torch.compiler.set_stance("force_eager"), pytest.raises(PoolExhausted) as info:
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens)
    # the same allocations replayed on a fresh pool of the same layout fail with the same numbers
    twin = UnifiedPool(layout)
    *fitting, (side, n) = replay
    for s, k in fitting:
        (twin.alloc_pages if s == "kv" else twin.alloc_slots)(k)
    with pytest.raises(PoolExhausted) as want:
        (twin.alloc_pages if side == "kv" else twin.alloc_slots)(n)
    got, want = info.value, want.value
    unit = layout.page_bytes if side == "kv" else layout.slot_bytes
    assert (got.side, got.requested, got.available, got.reclaimable) == (side, n * unit, want.available,
                                                                         want.reclaimable)
    assert got.requested > got.available and str(got) == str(want)
    assert f"({n * unit} bytes)" in str(got) and f"({want.available} bytes)" in str(got)
    stats = model.unimem.stats()
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0
    model.unimem.pool.allocator.check_invariants()


def test_unsupported_family_lists_the_supported_ones():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(UnsupportedModel, match=r"LlamaForCausalLM \(model_type='llama'\) is not supported; supported: "
                                               r"KimiLinearForCausalLM.*DeepseekV3ForCausalLM.*DeepseekV2ForCausalLM"):
        unimem_compile.compile(model, max_batch_size=1, max_seq_len=16)


def test_right_padding_is_refused_with_nothing_leaked(small):
    ids, mask = prompts([6, 6], seed=9)
    mask[1, -2:] = 0  # right padding
    with pytest.raises(GeometryError, match="only left padding is supported"):
        small.generate(ids, attention_mask=mask, max_new_tokens=2)
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0
