"""Compiled generate() on the unified pool against stock transformers generate (fp32, CPU).

Greedy tokens must be identical for both model families, with and without left padding, for prompts
shorter than the conv kernel and longer than a page and a KDA chunk; decode must never recompile; pages
and slots must all be back in the pool after each call.
"""

import warnings

import pytest
import torch

import unimem_compile
from unimem_compile.errors import GeometryError, UnsupportedModel
from unimem_compile.hf.models import build_model

from ..prompts import left_padded

FAMILIES = ["kimi-linear-tiny", "deepseek-v3-tiny"]
MAX_SEQ = 160
PAGE = 16


def prompts(lengths, seed, vocab=1024):
    """Left-padded random prompts of the given lengths, from a generator seeded with ``seed``."""
    return left_padded(lengths, torch.Generator().manual_seed(seed), vocab)


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


def sampled(stock, model, ids, mask, seed, **kw):
    """(stock tokens, compiled-model tokens) of one sampled generate() each, from the same torch seed. The
    compiled model runs transformers' own decode loop (``use_runner = False``): the decode runner's draws
    follow the same distribution but are not stock's (tests/hf/test_generate_runner.py)."""
    out = []
    model.unimem.use_runner = False
    try:
        for m in (stock, model):
            torch.manual_seed(seed)
            with torch.no_grad():
                out.append(m.generate(ids, attention_mask=mask, do_sample=True, **kw))
    finally:
        model.unimem.use_runner = True
    return out


def test_sampling_with_a_seed_matches_stock(pair):
    stock, model, _ = pair
    ids, mask = prompts([12, 9], seed=11)
    want, got = sampled(stock, model, ids, mask, 123, top_k=50, temperature=0.9, max_new_tokens=10)
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


def test_deferred_stop_check_is_off_on_the_cpu_and_refused_when_asked_for(small):
    # transformers' DeferredStopCheck waits on device events, which the CPU has none of (the CUDA
    # behaviour is tested in tests/gpu/test_generate_gpu.py)
    assert small.unimem.deferred_stop_check is None  # automatic: never on the CPU
    assert not small.unimem.defers_stop_check(64)
    with pytest.raises(ValueError, match="deferred_stop_check needs a CUDA model.*pool is on cpu"):
        small.unimem.deferred_stop_check = True
    with pytest.raises(TypeError, match="must be True, False or None, got 1"):
        small.unimem.deferred_stop_check = 1
    assert small.unimem.deferred_stop_check is None
    with pytest.raises(ValueError, match="deferred_stop_check=True needs a CUDA model.*model is on cpu"):
        unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=1, max_seq_len=16,
                               deferred_stop_check=True)


def test_the_deferred_stop_hook_leaves_other_caches_to_transformers(small):
    from transformers import DynamicCache
    from transformers.generation.utils import DeferredStopCheck

    from unimem_compile.hf.runtime import _install_deferred_stop_hook

    assert _install_deferred_stop_hook()  # idempotent: installed once per process
    assert getattr(DeferredStopCheck.is_supported, "_unimem_hook", False)
    cuda, mps = torch.device("cuda"), torch.device("mps")
    # transformers' own rule for every cache but ours: mps only, never for an assistant
    assert DeferredStopCheck.is_supported(cuda, DynamicCache(), False, is_assistant=False) is False
    assert DeferredStopCheck.is_supported(mps, None, False, is_assistant=False) is True
    cache = small.unimem.new_cache(1)
    try:
        assert DeferredStopCheck.is_supported(cuda, cache, True, is_assistant=False) is False
        cache.defer_stop_check = True  # what generate() sets on the caches it creates for a CUDA model
        assert DeferredStopCheck.is_supported(cuda, cache, True, is_assistant=False) is True
        assert DeferredStopCheck.is_supported(cuda, cache, True, is_assistant=True) is False
        cache.activate_past_recording()
        cache.crop(0)
        cache.crop(-1)
        assert cache.undone_steps == 1
    finally:
        cache.release()


def test_a_cache_the_caller_passes_never_rolls_back(small):
    cache = small.unimem.new_cache(1)
    try:
        assert cache.defer_stop_check is False
        cache.crop(0)  # a no-op on every cache
        with pytest.raises(NotImplementedError, match="cannot record past states"):
            cache.activate_past_recording()
        with pytest.raises(NotImplementedError, match=r"crop\(-1\) is not supported"):
            cache.crop(-1)
    finally:
        cache.release()


def test_force_eager_runs_the_same_cache_path():
    stock = build_model("kimi-linear-tiny")
    model = build_model("kimi-linear-tiny")
    unimem_compile.compile(model, max_batch_size=2, max_seq_len=64, page_size=4, backend="aot_eager")
    ids, mask = prompts([9, 6], seed=2)
    with torch.compiler.set_stance("force_eager"):
        got = greedy(model, ids, mask, 6)
    assert torch.equal(got, greedy(stock, ids, mask, 6))
    assert model.unimem.passes.graphs == 0


def test_generate_continues_from_a_cache_it_was_given(pair):
    """A second generate() given the same UnifiedCache and the returned sequences (plus a few new prompt
    tokens) continues from the cached tokens exactly as stock transformers does with a DynamicCache, and
    equals a fresh run over the whole sequence."""
    from transformers import DynamicCache

    from unimem_compile.hf.generate_checks import _cache_kwarg

    stock, model, _ = pair
    key = _cache_kwarg(stock)  # "cache" in recent transformers, "past_key_values" in older ones
    ids, _ = prompts([12, 12], seed=21)
    extra = torch.randint(3, 1024, (2, 5), generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        dynamic = DynamicCache(config=stock.config)
        first = stock.generate(ids, max_new_tokens=6, do_sample=False, **{key: dynamic})
        want = stock.generate(torch.cat([first, extra], 1), max_new_tokens=4, do_sample=False, **{key: dynamic})
        fresh = stock.generate(torch.cat([first, extra], 1), max_new_tokens=4, do_sample=False)
        cache = model.unimem.new_cache(2)
        got_first = model.generate(ids, max_new_tokens=6, do_sample=False, **{key: cache})
        assert torch.equal(got_first, first)
        assert int(cache.get_seq_length()) == first.shape[1] - 1  # every token but the last one generated
        got = model.generate(torch.cat([got_first, extra], 1), max_new_tokens=4, do_sample=False, **{key: cache})
    assert torch.equal(want, fresh) and torch.equal(got, want)
    assert model.unimem.stats()["kv_pages_used"] > 0  # the caller's cache keeps its pages until released
    cache.release()
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def test_num_return_sequences_samples_like_stock(pair):
    stock, model, _ = pair
    ids, mask = prompts([10, 7], seed=13)
    want, got = sampled(stock, model, ids, mask, 5, top_k=20, num_return_sequences=2, max_new_tokens=6)
    assert got.shape[0] == 4 and torch.equal(got, want)
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


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


def test_transformers_default_of_20_new_tokens_is_checked_up_front_and_a_passed_cache_survives(small):
    # no max_new_tokens / max_length anywhere: transformers generates 20 new tokens; 15 + 20 > 32 must be
    # refused before any step (it used to fail mid-generation and release the caller's cache)
    assert small.generation_config.max_length is None and small.generation_config.max_new_tokens is None
    cache = small.unimem.new_cache(1)
    ids, mask = prompts([6], seed=3)
    out = small.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)
    held = small.unimem.stats()["kv_pages_used"]
    turn2 = torch.cat([out, torch.randint(3, small.config.vocab_size, (1, 7), generator=torch.Generator()
                                          .manual_seed(5))], 1)  # 15 tokens
    with pytest.raises(GeometryError, match=r"prompt \(15 tokens, pads included\) \+ new tokens = 35 tokens is "
                                            r"longer than max_seq_len=32"):
        small.generate(turn2, attention_mask=torch.ones_like(turn2), past_key_values=cache, do_sample=False)
    assert small.unimem.stats()["kv_pages_used"] == held  # nothing released, nothing written
    got = small.generate(turn2, attention_mask=torch.ones_like(turn2), past_key_values=cache, max_new_tokens=2,
                         do_sample=False)
    assert got.shape[1] == 17
    cache.release()
    assert small.unimem.stats()["kv_pages_used"] == 0


def test_compile_options_are_checked_before_anything_is_built():
    model = build_model("kimi-linear-tiny")
    kw = dict(max_batch_size=1, max_seq_len=16)
    with pytest.raises(ValueError, match=r"backend must be the name of a registered torch.compile backend, got "
                                         r"'aot_eagre'; registered: .*aot_eager"):
        unimem_compile.compile(model, backend="aot_eagre", **kw)
    with pytest.raises(TypeError, match="cudagraphs must be one of False, True, got 'yes'"):
        unimem_compile.compile(model, cudagraphs="yes", **kw)
    with pytest.raises(TypeError, match="deferred_stop_check must be one of None, False, True, got 1"):
        unimem_compile.compile(model, deferred_stop_check=1, **kw)
    with pytest.raises(TypeError, match="not a mapping"):
        unimem_compile.compile(model, passes={"mla_absorb": False, "mla_write_fusion": False}, **kw)
    with pytest.raises(TypeError, match="kv_dtype 'bfloat17' does not name a torch dtype"):
        unimem_compile.compile(model, kv_dtype="bfloat17", **kw)
    with pytest.raises(GeometryError, match=r"the arena for max_batch_size=1 full rows of max_seq_len=10000000000 "
                                            r"tokens needs \d+ bytes .* free; lower max_seq_len"):
        unimem_compile.compile(model, max_batch_size=1, max_seq_len=10**10)
    assert not hasattr(model, "unimem")  # every refusal left the model compilable
    unimem_compile.compile(model, kv_dtype="float32", backend="aot_eager", **kw)  # a dtype name works
    assert model.unimem.adapter.kv_spec.dtype == torch.float32
    for short, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        other = unimem_compile.compile(build_model("kimi-linear-tiny"), kv_dtype=short, backend="aot_eager", **kw)
        assert other.unimem.adapter.kv_spec.dtype == dtype  # the demo CLI's names


def test_an_unknown_kv_dtype_name_lists_the_accepted_names():
    from unimem_compile.options import _SHORT_DTYPE_NAMES

    with pytest.raises(TypeError) as info:
        unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=1, max_seq_len=16, kv_dtype="fp8")
    message = str(info.value)
    assert message.startswith("kv_dtype 'fp8' does not name a torch dtype (fp8 ")
    assert f"or one of {', '.join(repr(n) for n in _SHORT_DTYPE_NAMES)}" in message
    if "fp8_e4m3" in _SHORT_DTYPE_NAMES:
        assert "(fp8 is spelled 'fp8_e4m3')" in message


def test_float_input_ids_get_a_plain_dtype_error_and_allocate_nothing(small):
    ids, mask = prompts([5, 5], seed=1)
    with pytest.raises(TypeError, match=r"input_ids must hold integer token ids \(torch.long or torch.int\), got "
                                        r"torch.float32"):
        small.generate(ids.float(), attention_mask=mask, max_new_tokens=2)
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


def test_no_input_ids_generates_from_bos_like_stock(small):
    stock = build_model("kimi-linear-tiny")  # the same seeded weights as `small`
    with torch.no_grad():
        want = stock.generate(max_new_tokens=4, do_sample=False)
        got = small.generate(max_new_tokens=4, do_sample=False)
    assert want.shape == (1, 5) and int(want[0, 0]) == small.generation_config.bos_token_id
    assert torch.equal(got, want)
    with pytest.raises(UnsupportedModel, match="inputs_embeds are not supported"):
        small.generate(inputs_embeds=torch.randn(1, 3, small.config.hidden_size), max_new_tokens=2)


def test_an_empty_prompt_is_refused_and_cache_advice_comes_only_with_a_cache(small):
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(GeometryError) as info:
        small.generate(empty, max_new_tokens=2)
    assert str(info.value).startswith("input_ids has no tokens (shape [1, 0])") and "cache" not in str(info.value)
    cache = small.unimem.new_cache(1)
    ids, mask = prompts([6], seed=2)
    small.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)
    with pytest.raises(GeometryError, match="input_ids has no tokens and the cache passed holds 7: pass the whole "
                                            "sequence so far"):
        small.generate(empty, past_key_values=cache, max_new_tokens=2)
    assert cache.logical_len == 7  # refused before any step: the cache is intact (the last token is not fed yet)
    cache.release()


def test_a_cache_implementation_is_refused_by_name(small):
    ids, mask = prompts([5], seed=1)
    with pytest.raises(UnsupportedModel) as info:
        small.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="static")
    assert str(info.value).startswith("cache_implementation='static' is not supported")
    assert "both" not in str(info.value)
    assert small.unimem.stats()["kv_pages_used"] == 0


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


def test_a_budget_short_of_max_batch_size_full_rows_warns_with_the_rows_it_holds():
    from unimem_compile.pool import ArenaLayout

    model = build_model("kimi-linear-tiny")
    adapter = unimem_compile.hf.adapters.adapter_for(model)
    budget = ArenaLayout.for_capacity(adapter.kv_spec, adapter.state_spec, 16, 2 * 4, 2).memory_budget  # 2 rows
    with pytest.warns(UserWarning, match=f"memory_budget of {budget} bytes holds 2 full rows of max_seq_len=64 "
                                         "tokens and their states, fewer than max_batch_size=4"):
        unimem_compile.compile(model, max_batch_size=4, max_seq_len=64, page_size=16, memory_budget=budget,
                               backend="aot_eager")
    assert model.unimem.full_rows == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a budget of max_batch_size full rows says nothing
        other = unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=2, max_seq_len=64,
                                       page_size=16, memory_budget=budget, backend="aot_eager")
    assert other.unimem.full_rows == 2


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
    assert got.requested > got.available and str(got).startswith(f"{want}; the arena of {layout.memory_budget} bytes")
    assert "give unimem_compile.compile() a larger memory_budget" in str(got)
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
    with pytest.raises(GeometryError, match="only left padding is supported: row 1 has a pad at position 4, after "
                                            "its first token at position 0"):
        small.generate(ids, attention_mask=mask, max_new_tokens=2)
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


def test_beam_search_and_use_cache_false_are_refused_by_name(small):
    ids, mask = prompts([5, 4], seed=3)
    with pytest.raises(UnsupportedModel, match=r"beam search \(num_beams=2\) is not supported"):
        small.generate(ids, attention_mask=mask, max_new_tokens=2, num_beams=2)
    with pytest.raises(UnsupportedModel, match="use_cache=False is not supported"):
        small.generate(ids, attention_mask=mask, max_new_tokens=2, use_cache=False)
    with pytest.raises(GeometryError, match=r"batch of 2 x num_return_sequences=2 = 4 rows is larger than "
                                            r"max_batch_size=2"):
        small.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True, num_return_sequences=2)
    cache = small.unimem.new_cache(1)
    with pytest.raises(GeometryError, match=r"the UnifiedCache passed holds 1 rows, this generate\(\) call needs 2"):
        small.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=cache)
    cache.release()
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


def test_assisted_decoding_is_refused_by_name(small):
    from transformers import DynamicCache

    ids, mask = prompts([5, 4], seed=3)
    for kw, message in (
        ({"prompt_lookup_num_tokens": 3}, r"assisted / speculative decoding \(prompt_lookup_num_tokens=3\)"),
        ({"assistant_model": build_model("kimi-linear-tiny")}, r"speculative decoding \(assistant_model\) is not"),
    ):
        with pytest.raises(UnsupportedModel, match=message):
            small.generate(ids, attention_mask=mask, max_new_tokens=2, **kw)
    # an empty transformers cache is falsy (length 0): it used to be dropped silently when passed as cache=
    for key in ("cache", "past_key_values"):
        with pytest.raises(UnsupportedModel, match="generates with a UnifiedCache, got DynamicCache"):
            small.generate(ids, attention_mask=mask, max_new_tokens=2, **{key: DynamicCache()})
    a, b = small.unimem.new_cache(2), small.unimem.new_cache(2)
    with pytest.raises(ValueError, match="two different caches"):
        small.generate(ids, attention_mask=mask, max_new_tokens=2, cache=a, past_key_values=b)
    a.release()
    b.release()
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0
    out = greedy(small, ids, mask, 2)  # still usable
    assert out.shape == (2, 7)


def test_a_continuation_given_only_the_new_tokens_is_refused_with_what_to_pass(small):
    ids, mask = prompts([6, 6], seed=8)
    cache = small.unimem.new_cache(2)
    try:
        with torch.no_grad():
            first = small.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, past_key_values=cache)
            new = torch.randint(3, 1000, (2, 4), generator=torch.Generator().manual_seed(9))
            with pytest.raises(GeometryError, match="input_ids has 4 tokens per row and the cache holds 8 already; "
                                                    "pass the whole sequence so far"):
                small.generate(new, max_new_tokens=2, do_sample=False, past_key_values=cache)
            assert not cache.released  # refused before any step touched it
            more = small.generate(torch.cat([first, new], 1), max_new_tokens=2, do_sample=False,
                                  past_key_values=cache)
        assert more.shape == (2, 15)
    finally:
        cache.release()


def test_a_failed_generate_releases_the_cache_it_was_given(small):
    """A step that fails half way leaves tables that no longer match the cached tokens: the caller's cache is
    released (its memory returned) and a later use says why, instead of continuing from corrupt state."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Boom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[1] >= 9:
                raise RuntimeError("stop here")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids, mask = prompts([6, 6], seed=4)
    cache = small.unimem.new_cache(2)
    with pytest.raises(RuntimeError, match="stop here"), torch.no_grad():
        small.generate(ids, attention_mask=mask, max_new_tokens=6, past_key_values=cache,
                       stopping_criteria=StoppingCriteriaList([Boom()]))
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0
    with pytest.raises(UnsupportedModel, match=r"released \(generate\(\) raised RuntimeError while using it\)"):
        small.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=cache)


def test_a_forward_with_gradients_on_is_refused_with_the_fix(small):
    ids, _ = prompts([4], seed=6)
    with pytest.raises(UnsupportedModel, match=r"inference only.*torch.no_grad\(\)"):
        small(ids)
    assert small.unimem.stats()["kv_pages_used"] == 0


def test_a_memory_budget_larger_than_free_memory_is_refused_with_the_numbers(monkeypatch):
    import importlib

    monkeypatch.setattr(importlib.import_module("unimem_compile.compile"), "_free_device_bytes", lambda device: 3 << 20)
    model = build_model("kimi-linear-tiny")
    with pytest.raises(GeometryError, match=r"memory_budget of 4194304 bytes \(0.00 GiB\) is more than cpu has free: "
                                            r"3145728 bytes"):
        unimem_compile.compile(model, max_batch_size=1, max_seq_len=16, memory_budget=4 << 20)
    assert not hasattr(model, "unimem")
    unimem_compile.compile(model, max_batch_size=1, max_seq_len=16, memory_budget=2 << 20, backend="aot_eager")
    assert model.unimem.pool.layout.memory_budget == 2 << 20


def test_a_negative_memory_budget_is_refused():
    model = build_model("kimi-linear-tiny")
    with pytest.raises(GeometryError, match="memory_budget must be a positive number of bytes, got -5"):
        unimem_compile.compile(model, max_batch_size=1, max_seq_len=16, memory_budget=-5)
    assert not hasattr(model, "unimem")


def test_a_row_of_padding_only_is_named(small):
    ids, mask = prompts([6, 6], seed=10)
    mask[0] = 0
    with pytest.raises(GeometryError, match=r"row 0 of the batch consists of padding only \(6 pads\)"):
        small.generate(ids, attention_mask=mask, max_new_tokens=2)
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


def test_interleaved_conversations_of_one_row_count_each_continue_like_stock(pair):
    """Two live caches of 2 rows (sharing the model's step buffers) take turns, with a cache-less generate()
    of 2 rows and the release of a third cache in between: every turn equals stock transformers'
    continuation, so a cache whose tables are not in the buffers uploads them before its step."""
    from transformers import DynamicCache

    from unimem_compile.hf.generate_checks import _cache_kwarg

    stock, model, _ = pair
    key = _cache_kwarg(stock)
    g = torch.Generator().manual_seed(31)
    conversations = [prompts([10, 10], seed=32)[0], prompts([14, 14], seed=33)[0]]
    dynamic = [DynamicCache(config=stock.config) for _ in conversations]
    caches = [model.unimem.new_cache(2) for _ in conversations]
    stray = model.unimem.new_cache(2)
    try:
        with torch.no_grad():
            stray.prepare_step(torch.randint(3, 1024, (2, 9), generator=g), None)
            for turn in range(3):
                for c in range(2):
                    if turn:
                        extra = torch.randint(3, 1024, (2, 3), generator=g)
                        conversations[c] = torch.cat([conversations[c], extra], 1)
                    want = stock.generate(conversations[c], max_new_tokens=4, do_sample=False, **{key: dynamic[c]})
                    got = model.generate(conversations[c], max_new_tokens=4, do_sample=False, **{key: caches[c]})
                    assert torch.equal(got, want), (turn, c)
                    conversations[c] = got
                    if turn == 1 and c == 0:  # a cache-less call of the same row count in between
                        ids, mask = prompts([8, 6], seed=34)
                        assert torch.equal(greedy(model, ids, mask, 3), greedy(stock, ids, mask, 3))
                    if turn == 1 and c == 1:  # and the release of a cache that is not resident
                        stray.release()
    finally:
        for cache in caches + [stray]:
            cache.release()
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def test_a_released_cache_can_be_reset_and_used_beside_a_live_one(small):
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(4))
    first = small.unimem.new_cache(1)
    first.prepare_step(ids, None)
    first.release()
    second = small.unimem.new_cache(1)
    second.prepare_step(ids, None)
    table = second.page_tables._host_table.clone()
    first.reset()
    assert not first.released
    first.prepare_step(torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(5)), None)
    assert first.buffers is second.buffers and first.page_tables.rows[0] != second.page_tables.rows[0]
    second.prepare_step(torch.cat([ids, ids[:, :1]], 1), None)  # second's tables go back into the buffers
    assert torch.equal(second.buffers.page_table.cpu(), second.page_tables._host_table)
    assert second.page_tables._host_table[0, : table.shape[1]].tolist() == table[0].tolist()
    for cache in (first, second):
        cache.release()
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


def test_a_cache_collected_without_release_gives_its_memory_back_to_the_next_cache(small):
    import gc

    handle = small.unimem
    cache = handle.new_cache(2)
    cache.prepare_step(torch.randint(3, 100, (2, 20), generator=torch.Generator().manual_seed(6)), None)
    assert handle.stats()["kv_pages_used"] > 0 and handle.stats()["state_slots_used"] == 2
    del cache
    gc.collect()  # the cache object is gone; its pages and slots are queued, not yet freed
    again = handle.new_cache(2)  # reclaims the collected cache's pages and slot first
    try:
        assert handle.stats()["kv_pages_used"] == 0 and handle.stats()["state_slots_used"] == 0
        assert handle.reclaim_orphans() == 0
    finally:
        again.release()
    handle.pool.allocator.check_invariants()


# ------------------------------------------------------------------ found by a new-user session
def test_hidden_states_and_attentions_are_refused_by_name_with_nothing_leaked(small):
    from transformers import GenerationConfig

    ids, mask = prompts([6, 4], seed=9)
    for kw in ({"output_hidden_states": True}, {"output_attentions": True},
               {"generation_config": GenerationConfig(max_new_tokens=3, output_hidden_states=True)}):
        with pytest.raises(UnsupportedModel, match="(output_hidden_states|output_attentions)=True is not supported"):
            small.generate(ids, attention_mask=mask, max_new_tokens=3, **kw)
    with pytest.raises(UnsupportedModel, match="output_attentions=True is not supported"), torch.no_grad():
        small(ids, attention_mask=mask, output_attentions=True)
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


def test_a_positional_generation_config_gets_the_same_checks_and_results(small):
    from transformers import GenerationConfig

    stock = build_model("kimi-linear-tiny")
    ids, mask = prompts([7, 5], seed=10)
    with pytest.raises(UnsupportedModel, match="beam search"):
        small.generate(ids, GenerationConfig(num_beams=2, max_new_tokens=3), attention_mask=mask)
    with pytest.raises(GeometryError, match="longer than max_seq_len=32"):
        small.generate(ids, GenerationConfig(max_new_tokens=40), attention_mask=mask)
    with pytest.raises(GeometryError, match="num_return_sequences=2 = 4 rows is larger than max_batch_size=2"):
        small.generate(ids, GenerationConfig(num_return_sequences=2, do_sample=True, max_new_tokens=3),
                       attention_mask=mask)
    config = GenerationConfig(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with torch.no_grad():
        want = stock.generate(ids, config, attention_mask=mask)
        got = small.generate(ids, config, attention_mask=mask)
    assert torch.equal(got, want)
    assert not config.disable_compile  # the caller's object is not modified
    assert small.unimem.stats()["kv_pages_used"] == 0


def test_a_generation_config_does_not_trigger_transformers_mixed_arguments_warning(small, monkeypatch):
    from transformers import GenerationConfig
    from transformers.generation import utils as gen_utils

    said = []
    monkeypatch.setattr(gen_utils.logger, "warning_once", lambda msg, *a, **k: said.append(str(msg)))
    ids, mask = prompts([5, 5], seed=12)
    with torch.no_grad():
        small.generate(ids, attention_mask=mask, generation_config=GenerationConfig(max_new_tokens=2))
    assert not [m for m in said if "together with generation-related" in m], said


def test_cache_dtypes_the_ops_cannot_compute_in_are_refused_at_compile():
    for dtype in (torch.float8_e4m3fn, torch.int8):
        with pytest.raises(GeometryError, match=f"kv_dtype {dtype} is not supported.*bfloat16, float16, float32"):
            unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=1, max_seq_len=16,
                                   kv_dtype=dtype, backend="aot_eager")


def test_a_numpy_integer_budget_is_bytes():
    import numpy as np

    model = unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=1, max_seq_len=16,
                                   memory_budget=np.int64(4 << 20), page_size=8, backend="aot_eager")
    assert model.unimem.stats()["total_bytes"] == 4 << 20


def test_a_model_cast_after_compile_is_refused_with_both_dtypes(small):
    ids, mask = prompts([5, 3], seed=13)
    small.to(torch.bfloat16)
    try:
        with pytest.raises(UnsupportedModel, match=r"parameters are torch.bfloat16 now but were torch.float32"):
            small.generate(ids, attention_mask=mask, max_new_tokens=2)
    finally:
        small.to(torch.float32)
    assert small.unimem.stats()["kv_pages_used"] == 0


def test_a_padding_error_from_an_inferred_mask_says_so(small):
    ids, _ = prompts([6, 6], seed=14)
    ids[0, 3] = 0  # the pad token id, inside row 0's prompt
    with pytest.raises(GeometryError, match=r"pad at position 3.*inferred one from pad_token_id=0; pass attention_mask"):
        small.generate(ids, max_new_tokens=2, pad_token_id=0)
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


def test_a_caller_cache_survives_a_call_refused_before_any_step(small):
    from transformers import DynamicCache

    from unimem_compile.hf.generate_checks import _cache_kwarg

    stock = build_model("kimi-linear-tiny")
    key = _cache_kwarg(stock)
    ids, _ = prompts([9, 9], seed=41)
    extra = torch.randint(3, 1024, (2, 3), generator=torch.Generator().manual_seed(42))
    cache, dynamic = small.unimem.new_cache(2), DynamicCache(config=stock.config)
    try:
        with torch.no_grad():
            with pytest.raises(ValueError, match="max_new_tokens"):  # transformers refuses it up front
                small.generate(ids, max_new_tokens=0, do_sample=False, **{key: cache})
            assert not cache.released
            first = small.generate(ids, max_new_tokens=4, do_sample=False, **{key: cache})
            assert torch.equal(first, stock.generate(ids, max_new_tokens=4, do_sample=False, **{key: dynamic}))
            with pytest.raises(ValueError, match="not_a_kwarg"):  # a typo, mid-conversation
                small.generate(torch.cat([first, extra], 1), max_new_tokens=3, not_a_kwarg=1, **{key: cache})
            assert not cache.released
            got = small.generate(torch.cat([first, extra], 1), max_new_tokens=3, do_sample=False, **{key: cache})
            want = stock.generate(torch.cat([first, extra], 1), max_new_tokens=3, do_sample=False,
                                  **{key: dynamic})
        assert torch.equal(got, want)
    finally:
        cache.release()
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


@pytest.mark.parametrize("drop", ["collected", "in_a_cycle"])
def test_a_live_cache_growing_into_a_full_pool_gets_the_memory_of_a_dropped_one(small, drop):
    # "in_a_cycle": a cache in a reference cycle outlives its last name until the cycle collector runs (here:
    # never, gc is off); an allocation that finds the pool full collects garbage once and retries (it used to
    # raise PoolExhausted)
    import gc

    from unimem_compile.hf.generate_checks import _cache_kwarg

    key = _cache_kwarg(small)
    pool = small.unimem.pool
    ids = torch.randint(3, 1000, (1, 30), generator=torch.Generator().manual_seed(43))
    live, dropped = small.unimem.new_cache(1), small.unimem.new_cache(1)
    filler = []
    was_enabled = gc.isenabled()
    if drop == "in_a_cycle":
        gc.disable()
    try:
        with torch.no_grad():
            first = small.generate(ids[:, :6], max_new_tokens=2, do_sample=False, **{key: live})  # 1 page
            small.generate(ids[:, :26], max_new_tokens=2, do_sample=False, **{key: dropped})  # 4 pages
            while pool.allocator.can_alloc("kv", 1):  # fill the rest of the arena
                filler += pool.alloc_pages(1)
            if drop == "in_a_cycle":
                dropped.cycle = dropped
            del dropped
            if drop == "collected":
                gc.collect()
            else:
                assert small.unimem.reclaim_orphans() == 0  # unreachable, not collected
            # the live row needs 2 more pages: only the dropped cache's pages can give them; the dropped cache
            # shared the live one's step buffers, which returning its rows empties in the middle of the step
            more = torch.cat([first, ids[:, :12]], 1)
            got = small.generate(more, max_new_tokens=6, do_sample=False, **{key: live})
        assert not live.released and small.unimem.reclaim_orphans() == 0
        with torch.no_grad():
            want = build_model("kimi-linear-tiny").generate(more, max_new_tokens=6, do_sample=False)
        assert torch.equal(got, want)
    finally:
        if was_enabled:
            gc.enable()
        live.release()
        pool.free_pages(filler)
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


def test_the_inferred_mask_hint_does_not_outlive_its_call(small):
    cache = small.unimem.new_cache(2)
    ids, _ = prompts([6, 6], seed=44)
    right = torch.ones_like(ids)
    right[1, 4:] = 0  # right padding, passed explicitly
    try:
        with pytest.raises(GeometryError, match="inferred one from pad_token_id"):
            small.generate(ids.masked_fill(right == 0, 0), max_new_tokens=2, pad_token_id=0, cache=cache)
        cache.reset()
        with pytest.raises(GeometryError, match="only left padding is supported") as e:
            small.generate(ids, attention_mask=right, max_new_tokens=2, pad_token_id=0, cache=cache)
        assert "inferred" not in str(e.value)
    finally:
        cache.release()


def test_a_passed_generation_config_falls_back_to_the_models_per_field(small):
    from transformers import GenerationConfig

    ids, mask = prompts([5, 4], seed=51)
    saved = small.generation_config.max_new_tokens
    small.generation_config.max_new_tokens = 40  # > max_seq_len 32 once the prompt is added
    try:
        # the passed config leaves max_new_tokens unset: transformers takes the model's 40, so do the checks
        with pytest.raises(GeometryError, match="longer than max_seq_len=32"):
            small.generate(ids, GenerationConfig(top_k=20), attention_mask=mask)
        with pytest.raises(GeometryError, match="longer than max_seq_len=32"):
            small.generate(ids, attention_mask=mask, generation_config=GenerationConfig(top_k=20))
    finally:
        small.generation_config.max_new_tokens = saved
    with torch.no_grad():  # a field the passed config does set wins over the model's
        out = small.generate(ids, GenerationConfig(max_new_tokens=3, min_new_tokens=3), attention_mask=mask)
    assert out.shape[1] == ids.shape[1] + 3


def test_a_continuation_whose_mask_hides_cached_or_new_tokens_is_refused(small):
    from unimem_compile.hf.generate_checks import _cache_kwarg

    key = _cache_kwarg(small)
    ids, mask = prompts([7, 5], seed=52)
    cache = small.unimem.new_cache(2)
    try:
        with torch.no_grad():
            first = small.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, **{key: cache})
            one = torch.randint(3, 1000, (2, 1), generator=torch.Generator().manual_seed(53))
            grown = torch.cat([mask, torch.ones(2, 3 + 1, dtype=mask.dtype)], 1)
            for col in (ids.shape[1] + 1, grown.shape[1] - 1):  # a cached token, then the one new token
                bad = grown.clone()
                bad[0, col] = 0
                with pytest.raises(GeometryError, match=f"row 0's mask is 0 at position {col}"):
                    small.generate(torch.cat([first, one], 1), attention_mask=bad, max_new_tokens=2, **{key: cache})
                assert not cache.released  # refused before any step changed it
            got = small.generate(torch.cat([first, one], 1), attention_mask=grown, max_new_tokens=2,
                                 do_sample=False, **{key: cache})
        assert got.shape[1] == first.shape[1] + 3
    finally:
        cache.release()


def test_a_direct_forward_with_an_unprepared_cache_is_refused(small):
    from unimem_compile.hf.generate_checks import _cache_kwarg

    key = _cache_kwarg(small)
    ids, _ = prompts([6], seed=54)
    cache = small.unimem.new_cache(1)
    try:
        with torch.no_grad():
            first = small.generate(ids, max_new_tokens=2, do_sample=False, **{key: cache})
            before = cache.fingerprint()
            with pytest.raises(UnsupportedModel, match="must follow cache.prepare_step"):
                small(first[:, -1:], past_key_values=cache)
            assert cache.fingerprint() == before
            cache.prepare_step(first, None)  # the documented manual step works
            logits = small(first[:, -1:], past_key_values=cache).logits
        assert logits.shape[:2] == (1, 1) and logits.isfinite().all()
    finally:
        cache.release()


def test_generate_from_two_threads_gives_each_call_its_own_correct_tokens(pair):
    """Calls of one compiled model share step buffers per batch size and patched module globals: concurrent
    generate() calls run one after the other (a lock per model) instead of mixing their steps."""
    import threading

    stock, model, _ = pair
    calls = {"a": prompts([20, 14], seed=30), "b": prompts([9, 9], seed=31)}
    want = {k: greedy(stock, ids, mask, 8) for k, (ids, mask) in calls.items()}
    got, errors = {}, []

    def run(key):
        try:
            got[key] = greedy(model, *calls[key], 8)
        except BaseException as e:  # reported below: an exception in a thread would otherwise be lost
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in calls for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in calls:
        assert torch.equal(got[k], want[k])
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def test_inference_mode_inside_and_outside_mix_freely():
    """Tensors created on first use (the pool at compile(), step buffers per batch size, a cache's tables)
    are written in place by later calls: made under torch.inference_mode() they used to be inference
    tensors, and every later call outside it failed."""
    stock = build_model("kimi-linear-tiny")
    ids, mask = prompts([10, 7], seed=32)
    want = greedy(stock, ids, mask, 4)
    with torch.inference_mode():
        model = unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=2, max_seq_len=32,
                                       page_size=8, backend="aot_eager")
        assert torch.equal(greedy(model, ids, mask, 4), want)
        cache = model.unimem.new_cache(2)
    assert torch.equal(greedy(model, ids, mask, 4), want)
    assert torch.equal(greedy(model, ids, mask, 4, past_key_values=cache), want)
    cache.release()
    with torch.inference_mode():
        assert torch.equal(greedy(model, ids[:1], mask[:1], 4), want[:1])
    assert torch.equal(greedy(model, ids[:1], mask[:1], 4), want[:1])
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def test_releasing_a_cache_in_another_thread_waits_for_a_running_generate(small):
    """Returning a cache's rows empties the step buffers its batch size shares: a release from another thread
    between a running generate()'s prepare_step and its forward used to feed that step empty page tables
    and slots (wrong tokens). Releases take the model's generate lock."""
    import threading

    ids, mask = prompts([9], seed=40)
    with torch.no_grad():
        want = build_model("kimi-linear-tiny").generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    a, b = small.unimem.new_cache(1), small.unimem.new_cache(1)  # the pool holds two rows
    greedy(small, ids, mask, 2, past_key_values=b)  # b holds pages and slots of the same batch size
    original, steps = a.prepare_step, []

    def prepare_then_release_b(*args, **kwargs):
        original(*args, **kwargs)
        steps.append(1)
        if len(steps) == 3:  # mid-generate: release b from another thread, give it a second to run
            t = threading.Thread(target=b.release)
            t.start()
            t.join(timeout=1.0)
            steps.append(t)

    a.prepare_step = prepare_then_release_b
    small.unimem.use_runner = False  # a step per prepare_step (the runner's version: test_generate_runner.py)
    try:
        with torch.no_grad():
            got = small.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, past_key_values=a)
    finally:
        small.unimem.use_runner = True
        a.release()
    releaser = next(x for x in steps if isinstance(x, threading.Thread))
    releaser.join()
    assert b.released and torch.equal(got, want)
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0
