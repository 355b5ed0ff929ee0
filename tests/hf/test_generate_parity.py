"""Compiled generate() on the unified pool against stock transformers generate (fp32, CPU): the tokens.

Greedy tokens must be identical for both model families, with and without left padding, for prompts
shorter than the conv kernel and longer than a page and a KDA chunk; sampling from a seed, EOS,
num_return_sequences, generation configs and a call without input_ids behave as stock; decode must never
recompile; pages and slots must all be back in the pool after each call.
"""

import pytest
import torch

import unimem_compile
from unimem_compile.errors import GeometryError, UnsupportedModel
from unimem_compile.hf.models import build_model

from .generate_models import greedy, prompts, sampled


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


def test_force_eager_runs_the_same_cache_path():
    stock = build_model("kimi-linear-tiny")
    model = build_model("kimi-linear-tiny")
    unimem_compile.compile(model, max_batch_size=2, max_seq_len=64, page_size=4, backend="aot_eager")
    ids, mask = prompts([9, 6], seed=2)
    with torch.compiler.set_stance("force_eager"):
        got = greedy(model, ids, mask, 6)
    assert torch.equal(got, greedy(stock, ids, mask, 6))
    assert model.unimem.passes.graphs == 0


def test_num_return_sequences_samples_like_stock(pair):
    stock, model, _ = pair
    ids, mask = prompts([10, 7], seed=13)
    want, got = sampled(stock, model, ids, mask, 5, top_k=20, num_return_sequences=2, max_new_tokens=6)
    assert got.shape[0] == 4 and torch.equal(got, want)
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def test_no_input_ids_generates_from_bos_like_stock(small):
    stock = build_model("kimi-linear-tiny")  # the same seeded weights as `small`
    with torch.no_grad():
        want = stock.generate(max_new_tokens=4, do_sample=False)
        got = small.generate(max_new_tokens=4, do_sample=False)
    assert want.shape == (1, 5) and int(want[0, 0]) == small.generation_config.bos_token_id
    assert torch.equal(got, want)
    with pytest.raises(UnsupportedModel, match="inputs_embeds are not supported"):
        small.generate(inputs_embeds=torch.randn(1, 3, small.config.hidden_size), max_new_tokens=2)


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


def test_a_generation_config_does_not_trigger_transformers_mixed_arguments_warning(small, monkeypatch):
    from transformers import GenerationConfig
    from transformers.generation import utils as gen_utils

    said = []
    monkeypatch.setattr(gen_utils.logger, "warning_once", lambda msg, *a, **k: said.append(str(msg)))
    ids, mask = prompts([5, 5], seed=12)
    with torch.no_grad():
        small.generate(ids, attention_mask=mask, generation_config=GenerationConfig(max_new_tokens=2))
    assert not [m for m in said if "together with generation-related" in m], said
