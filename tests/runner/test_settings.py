"""Row settings read from what transformers' generate() builds for its decoding method: for every call the
runner fuses they equal the settings derived from the prepared GenerationConfig (two independent routes to
the same numbers), a user's processor that replaces transformers' own counts with its own settings, and
everything else is refused by name. A tiny random Llama (tests/runner/hf_reference.py) gives the real processors."""

import pytest
import torch
from transformers import (
    LogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from unimem_compile.runner import RowSettings, UnsupportedGenerationSetting, settings_from_generate

from ..prompts import left_padded
from .hf_reference import VOCAB, prepared, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


FUSED = {
    "greedy": dict(max_new_tokens=7),
    "greedy_penalty_min_new": dict(max_new_tokens=9, repetition_penalty=1.3, min_new_tokens=4, eos_token_id=[2, 5]),
    "min_length_counts_the_prompt": dict(max_length=20, min_length=15),
    "sampling_defaults": dict(do_sample=True, max_new_tokens=6),
    "sampling_all_warpers": dict(do_sample=True, temperature=0.7, top_k=12, top_p=0.85, min_p=0.05,
                                 repetition_penalty=0.8, max_new_tokens=5, pad_token_id=0),
}


@pytest.mark.parametrize("case", list(FUSED))
def test_settings_equal_the_prepared_configs(model, gen, case):
    ids, mask = left_padded([5, 9, 7], gen, VOCAB)
    got = prepared(model, ids, mask, **FUSED[case])
    read = settings_from_generate(got["processors"], got["criteria"], got["config"], ids.shape[1])
    want = RowSettings.from_generation_config(got["config"], ids.shape[1], seed=0)
    assert read.settings == want
    if "repetition_penalty" in FUSED[case]:  # transformers 5.24 skips each row's left pads
        assert torch.equal(read.penalty_ignore, (mask != 0).int().argmax(dim=1))
    else:
        assert read.penalty_ignore is None


def test_a_user_processor_of_a_known_type_counts_with_its_settings(model, gen):
    ids, mask = left_padded([4, 6], gen, VOCAB)
    # transformers puts the caller's processor in the place of its own of that type
    got = prepared(model, ids, mask, repetition_penalty=1.2, max_new_tokens=4,
                   logits_processor=[RepetitionPenaltyLogitsProcessor(1.7)])
    read = settings_from_generate(got["processors"], got["criteria"], got["config"], ids.shape[1])
    assert read.settings.repetition_penalty == 1.7 and read.penalty_ignore is None  # it penalises the pads too
    # ... but appends a warper before its own warpers: top-k, temperature, top-k is no order the step fuses
    got = prepared(model, ids, mask, do_sample=True, top_k=30, temperature=0.9, max_new_tokens=4,
                   logits_processor=[TopKLogitsWarper(7)])
    with pytest.raises(UnsupportedGenerationSetting, match="out of transformers' order"):
        settings_from_generate(got["processors"], got["criteria"], got["config"], ids.shape[1])


class Ban(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores


class Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("kwargs, setting, text", [
    (dict(logits_processor=[Ban()]), "logits_processor", "'Ban'"),
    (dict(stopping_criteria=[Never()]), "stopping_criteria", "'Never'"),
    (dict(logits_processor=[TemperatureLogitsWarper(0.5)]), "logits_processor", "warper on a greedy call"),
    (dict(max_time=10.0), "max_time", "10.0"),
    (dict(do_sample=True, typical_p=0.5), "typical_p", "0.5"),
    (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size", "2"),
])
def test_what_the_runner_does_not_fuse_is_refused_by_name(model, gen, kwargs, setting, text):
    ids, mask = left_padded([4, 6], gen, VOCAB)
    got = prepared(model, ids, mask, max_new_tokens=4, **kwargs)
    with pytest.raises(UnsupportedGenerationSetting, match=text) as e:
        settings_from_generate(got["processors"], got["criteria"], got["config"], ids.shape[1])
    assert e.value.setting == setting


def test_processors_out_of_order_or_disagreeing_eos_ids_are_refused(model, gen):
    ids, mask = left_padded([4, 6], gen, VOCAB)
    got = prepared(model, ids, mask, do_sample=True, top_k=5, temperature=0.5, max_new_tokens=4, min_new_tokens=2,
                   eos_token_id=[2, 3])
    processors, criteria, config = got["processors"], got["criteria"], got["config"]
    names = [type(p).__name__ for p in processors]
    assert names == ["MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "TemperatureLogitsWarper",
                     "TopKLogitsWarper"]
    with pytest.raises(UnsupportedGenerationSetting, match="out of transformers' order"):
        settings_from_generate(list(reversed(processors)), criteria, config, ids.shape[1])
    processors[0].eos_token_id = torch.tensor([2])
    with pytest.raises(UnsupportedGenerationSetting, match="different EOS ids") as e:
        settings_from_generate(processors, criteria, config, ids.shape[1])
    assert e.value.setting == "eos_token_id"
