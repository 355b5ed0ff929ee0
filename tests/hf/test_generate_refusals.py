"""What compile() and generate() refuse, and how: a specific error with the numbers in it, raised before
anything is allocated, leaving the model compilable and a passed cache untouched."""

import re

import pytest
import torch

import unimem_compile
from unimem_compile.errors import GeometryError, UnsupportedModel
from unimem_compile.hf.models import build_model

from .generate_models import greedy, prompts


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
    from unimem_compile.options import SHORT_DTYPE_NAMES

    with pytest.raises(TypeError) as info:
        unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=1, max_seq_len=16, kv_dtype="fp8")
    message = str(info.value)
    assert message.startswith("kv_dtype 'fp8' does not name a torch dtype (fp8 is spelled 'fp8_e4m3'); ")
    assert f"or one of {', '.join(repr(n) for n in SHORT_DTYPE_NAMES)}" in message


def test_float_input_ids_get_a_plain_dtype_error_and_allocate_nothing(small):
    ids, mask = prompts([5, 5], seed=1)
    with pytest.raises(TypeError, match=r"input_ids must hold integer token ids \(torch.long or torch.int\), got "
                                        r"torch.float32"):
        small.generate(ids.float(), attention_mask=mask, max_new_tokens=2)
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


def test_a_token_id_outside_the_vocabulary_is_refused_by_position_and_allocates_nothing(small):
    # stock transformers raises a bare IndexError from the embedding on the CPU and a device-side assert (a
    # poisoned CUDA context) on a GPU; the check runs before any page or slot is taken
    vocab = small.get_input_embeddings().num_embeddings
    ids, mask = prompts([4, 6], seed=7)
    for bad, shown in ((vocab, f"input_ids holds token id {vocab} at [row 1, position 3], outside the vocabulary "
                               f"[0, {vocab}) of the model's input embedding"),
                       (-1, "input_ids holds token id -1 at [row 1, position 3], outside the vocabulary")):
        wrong = ids.clone()
        wrong[1, 3] = bad
        with pytest.raises(ValueError, match=re.escape(shown)):
            small.generate(wrong, attention_mask=mask, max_new_tokens=2, do_sample=False)
        assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0
    ids[1, 3] = vocab - 1  # the largest id is in the vocabulary
    assert small.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False).shape == (2, 8)


def test_a_float_length_is_refused_before_anything_is_allocated(small):
    # stock transformers generates 3 tokens for max_new_tokens=2.5 (it stops at cur_len >= prompt + 2.5); the
    # up-front max_seq_len check and the runner used to truncate it to 2, and transformers' own loop ran 3:
    # a 30-token prompt with 2.5 passed the check against max_seq_len=32 and came back 33 tokens long
    ids, mask = prompts([30], seed=4)
    for kw, shown in ((dict(max_new_tokens=2.5), "max_new_tokens must be an int (a number of tokens), "
                                                 "got float 2.5"),
                      (dict(max_length=32.5), "max_length must be an int (a number of tokens), "
                                             "got float 32.5"),
                      (dict(max_new_tokens=True), "max_new_tokens must be an int (a number of tokens), "
                                                  "got bool True")):
        with pytest.raises(TypeError, match=re.escape(shown)):
            small.generate(ids, attention_mask=mask, do_sample=False, **kw)
        assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0
    assert small.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2).shape == (1, 32)


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


def test_cache_dtypes_the_ops_cannot_compute_in_are_refused_at_compile():
    # "fp8_e5m2" names a real format: it used to get the spelling hint "fp8 is spelled 'fp8_e4m3'"
    for kv_dtype, dtype in ((torch.float8_e5m2, torch.float8_e5m2), (torch.int8, torch.int8),
                            ("fp8_e5m2", torch.float8_e5m2), ("fp8_e5m2fnuz", torch.float8_e5m2fnuz),
                            ("float8_e5m2", torch.float8_e5m2)):
        with pytest.raises(GeometryError, match=f"kv_dtype {dtype} is not supported.*bfloat16, float16, float32, "
                                                "float8_e4m3fn, float8_e4m3fnuz"):
            unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=1, max_seq_len=16,
                                   kv_dtype=kv_dtype, backend="aot_eager")


def test_a_numpy_integer_budget_is_bytes():
    import numpy as np

    model = unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=1, max_seq_len=16,
                                   memory_budget=np.int64(4 << 20), page_size=8, backend="aot_eager")
    assert model.unimem.stats()["total_bytes"] == 4 << 20


def test_a_model_cast_after_compile_is_refused_with_both_dtypes(small):
    ids, mask = prompts([5, 3], seed=13)
    # the round trip through bf16 rounds the weights: restore them exactly, as other modules' tests share `small`
    # (the parity tests compare it with a fresh stock model; CI once ran them after this one, and they differed)
    saved = {name: t.detach().clone() for name, t in small.state_dict().items()}
    small.to(torch.bfloat16)
    try:
        with pytest.raises(UnsupportedModel, match=r"parameters are torch.bfloat16 now but were torch.float32"):
            small.generate(ids, attention_mask=mask, max_new_tokens=2)
    finally:
        small.to(torch.float32)
        small.load_state_dict(saved)
    assert all(torch.equal(t, saved[name]) for name, t in small.state_dict().items())
    assert small.unimem.stats()["kv_pages_used"] == 0


def test_a_padding_error_from_an_inferred_mask_says_so(small):
    ids, _ = prompts([6, 6], seed=14)
    ids[0, 3] = 0  # the pad token id, inside row 0's prompt
    with pytest.raises(GeometryError, match=r"pad at position 3.*inferred one from pad_token_id=0; pass attention_mask"):
        small.generate(ids, max_new_tokens=2, pad_token_id=0)
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


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
