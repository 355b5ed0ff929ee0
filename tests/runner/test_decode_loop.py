"""The runner's step as generate()'s decoding method (through transformers' custom_generate hook, eager)
gives stock generate()'s greedy tokens exactly, with a tiny random Llama: left-padded ragged batches, EOS
lists hit mid-run by some rows, min_new_tokens, repetition penalty, length rules; sampled calls repeat
under torch.manual_seed."""

import pytest
import torch

from ..prompts import left_padded
from .hf_reference import VOCAB, runner_generate, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def eos_from_a_run(model, ids, mask, steps=12):
    """Two tokens the model generates mid-run for some rows (so they end early when made EOS ids)."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    new = out[:, ids.shape[1]:]
    return [int(new[0, 4]), int(new[-1, 6])]


CASES = {
    "plain": dict(max_new_tokens=10),
    "penalty_and_min_new": dict(max_new_tokens=12, repetition_penalty=1.4, min_new_tokens=5),
    "strong_reward_penalty": dict(max_new_tokens=8, repetition_penalty=0.6),
    "max_length_counts_the_prompt": dict(max_length=20, min_length=13),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_stock_generate(model, gen, case):
    ids, mask = left_padded([5, 11, 8], gen, VOCAB)
    eos = eos_from_a_run(model, ids, mask)
    kwargs = dict(do_sample=False, eos_token_id=eos, **CASES[case])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, **kwargs)
    got = runner_generate(model, ids, mask, **kwargs)
    assert torch.equal(got, want)
    if case == "plain":  # a row ends while another one runs on: the finished row is padded
        new = want[:, ids.shape[1]:]
        assert bool(torch.isin(new[:, :-1], torch.tensor(eos)).any())


def test_sampled_calls_repeat_under_manual_seed(model, gen):
    ids, mask = left_padded([6, 9], gen, VOCAB)
    kwargs = dict(do_sample=True, temperature=0.9, top_p=0.95, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(42)
    a = runner_generate(model, ids, mask, **kwargs)
    torch.manual_seed(42)
    b = runner_generate(model, ids, mask, **kwargs)
    torch.manual_seed(43)
    c = runner_generate(model, ids, mask, **kwargs)
    assert torch.equal(a, b) and not torch.equal(a, c)
