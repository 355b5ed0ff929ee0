"""Per-row settings from a GenerationConfig (transformers' defaults and length rules), the settings the
runner refuses by name, and the host API of RowState: rows join, leave and move, and a refused call
changes nothing."""

import pickle

import pytest
import torch
from transformers import GenerationConfig

from unimem_compile.errors import GeometryError
from unimem_compile.runner import (
    GenerationSettingError,
    Rows,
    RowSettings,
    RowState,
    UnsupportedGenerationSetting,
    append_tokens,
    unsupported_settings,
)
from unimem_compile.runner.rows import _DEFAULTS

from ..prompts import left_padded
from .hf_reference import VOCAB, prepared, tiny_llama


def snapshot(state):
    return {name: getattr(state, name).clone() for name in Rows._fields}, list(state._settings)


def assert_unchanged(state, before):
    tensors, settings = before
    for name, t in tensors.items():
        assert torch.equal(getattr(state, name), t), name
    assert state._settings == settings


def test_defaults_are_transformers_global_defaults():
    defaults = GenerationConfig._get_default_generation_params()
    assert {k: defaults[k] for k in _DEFAULTS} == _DEFAULTS


def test_settings_from_a_bare_config_take_generate_defaults():
    torch.manual_seed(7)
    s = RowSettings.from_generation_config(GenerationConfig(do_sample=True, eos_token_id=2), prompt_len=9)
    assert (s.top_k, s.temperature, s.top_p, s.min_p, s.max_new_tokens, s.pad_token_id) == (50, 1.0, 1.0, 0.0, 20, 2)
    torch.manual_seed(7)
    assert s.seed == torch.randint(-(2**63), 2**63 - 1, (1,)).item()  # drawn from torch's default generator
    state = torch.get_rng_state()
    g = RowSettings.from_generation_config(GenerationConfig(temperature=0.0, top_k=3), prompt_len=9)
    assert torch.equal(torch.get_rng_state(), state)  # greedy rows draw nothing
    assert (g.do_sample, g.temperature, g.top_k, g.seed, g.pad_token_id, g.eos_token_ids) == (False, 1.0, 0, 0, 0, ())


def test_length_rules_follow_prepare_generated_length():
    make = RowSettings.from_generation_config
    assert make(GenerationConfig(max_new_tokens=5, max_length=100), 30).max_new_tokens == 5
    assert make(GenerationConfig(max_length=40), 30).max_new_tokens == 10
    assert make(GenerationConfig(min_length=34, eos_token_id=2), 30).min_new_tokens == 4
    assert make(GenerationConfig(min_length=10, eos_token_id=2), 30).min_new_tokens == 0
    assert make(GenerationConfig(min_new_tokens=3, min_length=50, eos_token_id=2), 30).min_new_tokens == 3
    s = make(GenerationConfig(eos_token_id=[7, 8], pad_token_id=0), 3)
    assert s.eos_token_ids == (7, 8) and s.pad_token_id == 0
    assert make(GenerationConfig(eos_token_id=torch.tensor([4, 9])), 3).eos_token_ids == (4, 9)
    with pytest.raises(GenerationSettingError, match="max_length=30 leaves no token.*30 tokens") as e:
        make(GenerationConfig(max_length=30), 30)
    assert e.value.setting == "max_length"


def test_prepared_configs_of_supported_calls_have_no_unsupported_setting(gen):
    model = tiny_llama()
    ids, mask = left_padded([4, 6], gen, VOCAB)
    for kwargs in [dict(), dict(do_sample=True, top_p=0.9, min_p=0.1), dict(repetition_penalty=1.2, min_new_tokens=2)]:
        config = prepared(model, ids, mask, max_new_tokens=4, **kwargs)["config"]
        assert unsupported_settings(config) == []
        RowSettings.from_generation_config(config, ids.shape[1], seed=1)


def test_sampling_only_warpers_do_not_matter_when_greedy():
    assert unsupported_settings(GenerationConfig(typical_p=0.5, epsilon_cutoff=0.1, top_h=0.4)) == []
    assert unsupported_settings(GenerationConfig(do_sample=True, typical_p=0.5, top_h=0.4)) == ["top_h", "typical_p"]


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_beams=2), "num_beams"),
    (dict(do_sample=True, typical_p=0.9), "typical_p"),
    (dict(no_repeat_ngram_size=3), "no_repeat_ngram_size"),
    (dict(stop_strings=["\n"]), "stop_strings"),
    (dict(renormalize_logits=True), "renormalize_logits"),
    (dict(suppress_tokens=[4]), "suppress_tokens"),
    (dict(do_sample=True, epsilon_cutoff=0.01), "epsilon_cutoff"),
])
def test_unsupported_settings_are_refused_by_name(kwargs, name):
    config = GenerationConfig(**kwargs)
    assert unsupported_settings(config) == [name]
    with pytest.raises(UnsupportedGenerationSetting, match=name) as e:
        RowSettings.from_generation_config(config, 4)
    assert e.value.setting == name
    again = pickle.loads(pickle.dumps(e.value))
    assert (type(again), again.setting, str(again)) == (UnsupportedGenerationSetting, name, str(e.value))


@pytest.mark.parametrize("kwargs, name, text", [
    (dict(do_sample=True, temperature=0.0), "temperature", "0.0"),
    (dict(top_k=-1), "top_k", "-1"),
    (dict(top_p=1.5), "top_p", "1.5"),
    (dict(min_p=-0.1), "min_p", "-0.1"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "0.0"),
    (dict(max_new_tokens=0), "max_new_tokens", "0"),
    (dict(eos_token_ids=(3, -1)), "eos_token_ids", "-1"),
    (dict(pad_token_id=-1), "pad_token_id", "-1"),
    (dict(top_k=2.5), "top_k", "2.5"),
])
def test_bad_values_are_refused_with_the_value(kwargs, name, text):
    with pytest.raises(GenerationSettingError, match=text) as e:
        RowSettings(**kwargs)
    assert e.value.setting == name


def test_set_rows_writes_settings_presence_and_a_pad_row(gen):
    state = RowState(4, VOCAB, 8, "cpu", max_eos=3)
    ids, mask = left_padded([3, 5], gen, VOCAB)
    ids[0, 0] = 17  # a token in the left padding: not penalised (transformers' prompt_ignore_length)
    ids[1, 1] = VOCAB + 5  # an id outside the lm_head: dropped, as transformers' clamp drops it
    a = RowSettings(do_sample=True, temperature=0.5, top_k=9, top_p=0.8, repetition_penalty=1.25,
                    min_new_tokens=2, max_new_tokens=6, eos_token_ids=(2, 4), pad_token_id=1, seed=-5)
    b = RowSettings(max_new_tokens=8, eos_token_ids=(3,), pad_token_id=0)
    state.set_rows(1, [a, b], ids, mask)
    assert state.settings(1) == a and state.settings(2) == b and state.settings(0) is None
    assert state.temperature[1] == 0.5 and state.inv_temperature[1] == 2.0 and state.top_k[1] == 9
    assert state.penalty[1] == 1.25 and state.inv_penalty[1] == 0.8 and state.seed[1] == -5
    assert state.eos[1].tolist() == [2, 4, -1] and state.eos[2].tolist() == [3, -1, -1]
    assert state.min_new[1] == 2 and state.max_new[2] == 8 and state.pad[1] == 1
    assert not state.finished[1] and not state.finished[2] and state.finished[0] and state.finished[3]
    assert state.out[1].tolist() == [1] * 8 and state.count[1:3].tolist() == [0, 0]
    for r, row in ((1, 0), (2, 1)):
        expected = {int(t) for t in ids[row][mask[row] != 0] if t < VOCAB}
        assert set(state.presence[r].nonzero().flatten().tolist()) == expected
    assert not state.presence[0].any()
    assert state.any_sampling(2) and not state.any_sampling(1)
    state.set_row(0, b, torch.tensor([5, 6, 5]))  # 1-D, no mask: every token
    assert set(state.presence[0].nonzero().flatten().tolist()) == {5, 6}


def test_clear_and_move_rows(gen):
    state = RowState(3, VOCAB, 8, "cpu")
    a = RowSettings(do_sample=True, top_k=4, max_new_tokens=8, eos_token_ids=(2,), seed=11)
    state.set_row(0, a, [9, 10, 11])
    append_tokens(torch.tensor([12, 0, 0]), state.view(3))
    moved = {name: getattr(state, name)[0].clone() for name in Rows._fields}
    state.move_row(0, 2)
    for name, t in moved.items():
        assert torch.equal(getattr(state, name)[2], t), name
    assert state.settings(2) == a and state.settings(0) is None and state.finished[0]
    assert state.generated(2) == [12]
    state.clear_row(2)
    fresh = RowState(3, VOCAB, 8, "cpu")
    for name in Rows._fields:
        assert torch.equal(getattr(state, name), getattr(fresh, name)), name


def test_refused_calls_change_nothing(gen):
    state = RowState(2, VOCAB, 8, "cpu", max_eos=2)
    state.set_row(0, RowSettings(max_new_tokens=4, eos_token_ids=(2,)), [5, 6])
    before = snapshot(state)
    with pytest.raises(GenerationSettingError, match=r"eos_token_id has 3 ids \[2, 3, 4\].*at most 2") as e:
        state.set_row(1, RowSettings(max_new_tokens=4, eos_token_ids=(2, 3, 4)), [1])
    assert e.value.setting == "eos_token_id"
    with pytest.raises(GenerationSettingError, match="max_new_tokens=9 exceeds.*8 tokens"):
        state.set_row(1, RowSettings(max_new_tokens=9), [1])
    with pytest.raises(IndexError, match=r"rows \[1, 3\).*2 rows"):
        state.set_rows(1, [RowSettings(max_new_tokens=4)] * 2, [[1], [2]])
    with pytest.raises(GenerationSettingError, match="negative values.*-3"):
        state.set_row(1, RowSettings(max_new_tokens=4), [4, -3])
    with pytest.raises(GenerationSettingError, match=r"attention_mask has shape \[1, 2\], expected \[1, 3\]"):
        state.set_row(1, RowSettings(max_new_tokens=4), [4, 5, 6], [1, 1])
    with pytest.raises(TypeError, match="RowSettings"):
        state.set_rows(0, [GenerationConfig()], [[1]])
    with pytest.raises(IndexError, match="row 2 is outside the 2 rows"):
        state.clear_row(2)
    with pytest.raises(IndexError, match="3 rows does not fit.*2 rows"):
        state.view(3)
    assert_unchanged(state, before)
    with pytest.raises(GeometryError, match="vocab_size=0"):
        RowState(2, 0, 8, "cpu")


def test_set_row_from_config_derives_the_settings_from_the_prompt():
    state = RowState(2, VOCAB, 16, "cpu")
    config = GenerationConfig(do_sample=True, top_p=0.5, max_length=12, min_length=9, eos_token_id=[2, 3])
    s = state.set_row_from_config(1, config, torch.tensor([0, 0, 7, 8, 9]), torch.tensor([0, 0, 1, 1, 1]), seed=3)
    assert (s.max_new_tokens, s.min_new_tokens, s.top_k, s.top_p, s.seed) == (7, 4, 50, 0.5, 3)
    assert state.settings(1) == s and state.max_new[1] == 7 and state.top_k[1] == 50
    assert set(state.presence[1].nonzero().flatten().tolist()) == {7, 8, 9}
