"""The fused logits processing equals transformers' own processors and warpers, row by row, with rows of
different settings in one batch: the same kept sets and the same values. Tolerance: none. On the CPU in
eager mode every value is bitwise equal (the fused code does transformers' float32 operations in its
order); compiled steps are compared in test_sampling.py."""

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from unimem_compile.runner import RowSettings, RowState, append_tokens, process_logits, sample

from ..prompts import left_padded
from .hf_reference import VOCAB, prepared, tiny_llama


def assert_same_scores(got, want):
    """Bitwise: the same -inf (removed) set and the same float32 value everywhere else."""
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "kept sets differ"
    assert torch.equal(got, want), f"max |diff| {float((got - want)[torch.isfinite(want)].abs().max())}"


def state_with(settings, ids, mask=None, vocab=None):
    state = RowState(len(settings), vocab or VOCAB, 32, "cpu")
    state.set_rows(0, settings, ids, mask)
    return state


# one row per setting, each against transformers' class for it alone (greedy rows get no warper)
WARPER_ROWS = [
    (RowSettings(do_sample=True, temperature=0.37), [TemperatureLogitsWarper(0.37)]),
    (RowSettings(do_sample=True, temperature=1.9), [TemperatureLogitsWarper(1.9)]),
    (RowSettings(do_sample=True, top_k=1), [TopKLogitsWarper(1)]),
    (RowSettings(do_sample=True, top_k=17), [TopKLogitsWarper(17)]),
    (RowSettings(do_sample=True, top_k=10_000), [TopKLogitsWarper(10_000)]),
    (RowSettings(do_sample=True, top_p=0.9), [TopPLogitsWarper(0.9)]),
    (RowSettings(do_sample=True, top_p=0.3), [TopPLogitsWarper(0.3)]),
    (RowSettings(do_sample=True, top_p=0.0), [TopPLogitsWarper(0.0)]),
    (RowSettings(do_sample=True, min_p=0.05), [MinPLogitsWarper(0.05)]),
    (RowSettings(do_sample=True, min_p=0.6), [MinPLogitsWarper(0.6)]),
    (RowSettings(do_sample=True, min_p=1.0), [MinPLogitsWarper(1.0)]),  # keeps exactly the top token
    (RowSettings(do_sample=True), []),
    (RowSettings(do_sample=False, temperature=0.5, top_k=3, top_p=0.5), []),  # greedy: warpers off
    (RowSettings(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, min_p=0.02),
     [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8), MinPLogitsWarper(0.02)]),
]


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_each_warper_matches_transformers_in_a_mixed_batch(gen, scale):
    settings = [s for s, _ in WARPER_ROWS]
    ids = torch.randint(0, VOCAB, (len(settings), 7), generator=gen)
    logits = torch.randn(len(settings), VOCAB, generator=gen) * scale
    before = logits.clone()
    got = process_logits(logits, state_with(settings, ids).view(len(settings)))
    assert torch.equal(logits, before)  # the input is not modified
    for i, (_, warpers) in enumerate(WARPER_ROWS):
        assert_same_scores(got[i], LogitsProcessorList(warpers)(ids[i:i + 1], logits[i:i + 1].clone())[0])


def test_warpers_keep_ties_like_transformers(gen):
    """bf16-rounded logits (many exact ties, as a bf16 model's logits have): top-k keeps every tie at the
    threshold; top-p and min-p cut through tie groups the way transformers' sort does."""
    settings = [RowSettings(do_sample=True, top_k=k, top_p=p, min_p=m)
                for k, p, m in [(5, 1.0, 0.0), (12, 1.0, 0.0), (0, 0.5, 0.0), (0, 0.93, 0.0), (0, 1.0, 0.3),
                                (9, 0.7, 0.1)]]
    ids = torch.randint(0, VOCAB, (len(settings), 4), generator=gen)
    logits = (torch.randn(len(settings), VOCAB, generator=gen) * 2).to(torch.bfloat16).float()
    got = process_logits(logits, state_with(settings, ids).view(len(settings)))
    for i, s in enumerate(settings):
        warpers = LogitsProcessorList()
        if s.top_k:
            warpers.append(TopKLogitsWarper(s.top_k))
        if s.top_p < 1.0:
            warpers.append(TopPLogitsWarper(s.top_p))
        if s.min_p:
            warpers.append(MinPLogitsWarper(s.min_p))
        want = warpers(ids[i:i + 1], logits[i:i + 1].clone())[0]
        assert_same_scores(got[i], want)
    assert int((~torch.isneginf(got[0])).sum()) >= 5  # ties at the 5th value are kept


def test_repetition_penalty_and_min_new_tokens_match_transformers(gen):
    eos = [2, 5, 11]
    settings = [RowSettings(repetition_penalty=p, min_new_tokens=m, eos_token_ids=eos, max_new_tokens=20)
                for p, m in [(1.3, 0), (0.7, 4), (1.0, 4), (2.5, 1)]]
    ids, mask = left_padded([6, 9, 3, 9], gen, VOCAB)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    state = state_with(settings, ids, mask)
    ignore = (mask != 0).int().argmax(dim=1)
    for step in range(3):  # after each step the penalty covers the generated tokens too
        got = process_logits(logits, state.view(4))
        for i, s in enumerate(settings):
            procs = LogitsProcessorList([MinNewTokensLengthLogitsProcessor(ids.shape[1] - step, s.min_new_tokens, eos)])
            if s.repetition_penalty != 1.0:
                procs.insert(0, RepetitionPenaltyLogitsProcessor(s.repetition_penalty, prompt_ignore_length=ignore))
            assert_same_scores(got[i], procs(ids, logits.clone())[i])
        new = torch.randint(12, VOCAB, (4,), generator=gen)  # no EOS: no row finishes
        append_tokens(new, state.view(4))
        ids = torch.cat([ids, new[:, None]], dim=1)
        logits = torch.randn(4, VOCAB, generator=gen) * 3


CONFIGS = {
    "greedy": dict(do_sample=False),
    "greedy_penalty_min_new": dict(do_sample=False, repetition_penalty=1.4, min_new_tokens=2, eos_token_id=[2, 7]),
    "sample_defaults_top_k_50": dict(do_sample=True),
    "sample_no_top_k": dict(do_sample=True, top_k=0, temperature=0.6),
    "sample_top_p_min_p": dict(do_sample=True, top_k=0, top_p=0.85, min_p=0.03, repetition_penalty=1.2),
    "sample_everything": dict(do_sample=True, temperature=1.3, top_k=30, top_p=0.9, min_p=0.01,
                              repetition_penalty=0.8, min_new_tokens=3, eos_token_id=[2, 3, 4]),
    "sample_min_length": dict(do_sample=True, top_k=8, min_length=14),
}


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def test_generation_configs_match_transformers_composition_row_by_row(model, gen):
    """Each row of one batch under its own GenerationConfig; the reference is the processor list
    generate() builds for that config over the same batch (its order, defaults and prompt handling)."""
    ids, mask = left_padded([5, 9, 7, 9, 2, 8, 6], gen, VOCAB)
    logits = torch.randn(ids.shape[0], VOCAB, generator=gen) * 3
    names = list(CONFIGS)
    settings, want = [], []
    for i, name in enumerate(names):
        ref = prepared(model, ids, mask, max_new_tokens=10, **CONFIGS[name])
        settings.append(RowSettings.from_generation_config(ref["config"], ids.shape[1], seed=i))
        want.append(ref["processors"](ids, logits.clone())[i])
        # the same settings come from the user's own GenerationConfig (defaults filled as generate() does)
        raw = GenerationConfig(**{"max_new_tokens": 10, "eos_token_id": 2, **CONFIGS[name]})
        assert RowSettings.from_generation_config(raw, ids.shape[1], seed=i) == settings[-1]
    state = state_with(settings, ids, mask)
    got = process_logits(logits, state.view(len(names)))
    for i in range(len(names)):
        assert_same_scores(got[i], want[i])
    greedy = [i for i, n in enumerate(names) if not CONFIGS[n]["do_sample"]]
    tokens = sample(got, state.view(len(names)))
    for i in greedy:  # greedy = argmax of transformers' processed scores
        assert int(tokens[i]) == int(want[i].argmax())
    for i in range(len(names)):  # a sampled token is one transformers' processors keep
        assert torch.isfinite(want[i][tokens[i]])


@pytest.mark.parametrize("top_p", [0.6, 0.8])
def test_top_p_cut_is_rounded_as_transformers_compares_it(top_p):
    """Five equal logits: cumulative probabilities 0.2, 0.4, ... land exactly on float32(1 - top_p), which
    transformers removes; float32(1) - float32(top_p) lies just below and would keep one token more."""
    logits = torch.zeros(1, 5)
    state = state_with([RowSettings(do_sample=True, top_p=top_p)], torch.tensor([[0]]), vocab=5)
    want = TopPLogitsWarper(top_p)(None, logits.clone())
    assert int(torch.isneginf(want).sum()) == round((1 - top_p) * 5)
    assert_same_scores(process_logits(logits, state.view(1))[0], want[0])
