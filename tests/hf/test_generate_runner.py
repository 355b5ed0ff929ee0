"""generate() through the decode runner (fp32, CPU: the compiled step without graph capture) against stock
transformers: greedy tokens identical for both families with ragged left padding, EOS lists hit mid-run,
min_new_tokens, repetition penalty, a batch between buckets, K = 1 and K > 1, and a continued conversation;
sampled calls repeat under torch.manual_seed and a row's tokens do not depend on its batch mates; a graph of
one bucket serves two interleaved conversations of different row counts; a finished row stops allocating;
the fallback to transformers' loop is taken, and said, for what the runner does not fuse."""

import logging
import math

import pytest
import torch

import unimem_compile
from unimem_compile.errors import GeometryError
from unimem_compile.hf.generate_checks import _cache_kwarg
from unimem_compile.hf.models import build_model

from ..prompts import left_padded

FAMILIES = ["kimi-linear-tiny", "deepseek-v3-tiny"]
PAGE = 8
MAX_SEQ = 96


_pairs: dict = {}


def compiled_pair(family):
    """(stock model, unimem-compiled model with the same weights), aot_eager; buckets 1, 2, 4, 6. Built once
    per family in this module (the steps compiled for one test serve the next)."""
    if family not in _pairs:
        stock = build_model(family)
        model = build_model(family)
        unimem_compile.compile(model, max_batch_size=6, max_seq_len=MAX_SEQ, page_size=PAGE, backend="aot_eager")
        assert model.unimem.runner.buckets == (1, 2, 4, 6)
        _pairs[family] = stock, model
    return _pairs[family]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    """Both families, for the token-identity tests."""
    return compiled_pair(request.param)


@pytest.fixture(scope="module")
def deepseek():
    """One family for the tests of the runner's own behaviour (the cheaper model: no linear-attention layers)."""
    return compiled_pair("deepseek-v3-tiny")


_stock_runs: dict = {}


def stock_generate(stock, ids, mask, **kw):
    """Stock generate(), computed once per model and arguments in this module (the tests compare several
    runner settings with the same stock output)."""
    key = (id(stock), ids.numpy().tobytes(), None if mask is None else mask.numpy().tobytes(), repr(sorted(kw.items())))
    if key not in _stock_runs:
        _stock_runs[key] = generate(stock, ids, mask, **kw)
    return _stock_runs[key]


def generate(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **kw)


def eos_mid_run(stock, ids, mask, steps, **kw):
    """Two tokens the model generates mid-run in different rows (under the settings ``kw``): as EOS ids they
    end those rows early."""
    free = stock_generate(stock, ids, mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          **kw)[:, ids.shape[1]:]
    return [int(free[0, 3]), int(free[-1, 5])]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_tokens_equal_stock_with_eos_lists_min_new_tokens_and_a_penalty(pair, k):
    stock, model = pair
    ids, mask = left_padded([11, 4, 9], torch.Generator().manual_seed(1), 1024)  # 3 rows: bucket 4, one padded
    eos = eos_mid_run(stock, ids, mask, 14, repetition_penalty=1.3)
    kw = dict(max_new_tokens=14, do_sample=False, eos_token_id=eos, pad_token_id=0, repetition_penalty=1.3)
    model.unimem.steps_ahead = k
    try:
        for extra in ({}, {"min_new_tokens": 6}):
            want = stock_generate(stock, ids, mask, **kw, **extra)
            got = generate(model, ids, mask, **kw, **extra)
            assert torch.equal(got, want), extra
            new = want[:, ids.shape[1]:]
            if not extra:  # a row ended while another ran (min_new_tokens 6 may hold every EOS back)
                assert bool(torch.isin(new[:, :-1], torch.tensor(eos)).any())
    finally:
        model.unimem.steps_ahead = 8
    steps = {(s["bucket"], s["sampling"]) for s in model.unimem.runner_stats()["steps"]}
    assert (4, False) in steps
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def test_a_continued_conversation_equals_stock_after_a_row_ended_early(pair):
    """A cache the caller passes keeps stock's contents: a row that hit EOS keeps taking pad tokens while the
    other runs, so the next turn (the returned sequences, pads included, plus new tokens) equals stock's
    continuation over its DynamicCache."""
    from transformers import DynamicCache

    stock, model = pair
    key = _cache_kwarg(stock)
    ids, _ = left_padded([10, 10], torch.Generator().manual_seed(2), 1024)
    eos = eos_mid_run(stock, ids, None, 8)
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0)
    extra = torch.randint(3, 1024, (2, 4), generator=torch.Generator().manual_seed(3))
    dynamic, cache = DynamicCache(config=stock.config), model.unimem.new_cache(2)
    try:
        want1 = generate(stock, ids, None, **kw, **{key: dynamic})
        got1 = generate(model, ids, None, **kw, **{key: cache})
        assert torch.equal(got1, want1)
        assert bool((want1[:, ids.shape[1]:-1] == 0).any())  # a row was padded after its EOS
        turn2 = torch.cat([want1, extra], 1)
        ones = torch.ones_like(turn2)  # the pads after an EOS are tokens of the conversation now
        want2 = generate(stock, turn2, ones, max_new_tokens=3, do_sample=False, **{key: dynamic})
        got2 = generate(model, turn2, ones, max_new_tokens=3, do_sample=False, **{key: cache})
        assert torch.equal(got2, want2)
        assert int(cache.get_seq_length()) == want2.shape[1] - 1
        held = model.unimem.stats()["kv_pages_used"]
        assert held == 2 * math.ceil((want2.shape[1] - 1) / PAGE)  # no pages reserved ahead are kept
    finally:
        cache.release()
    assert model.unimem.stats()["kv_pages_used"] == 0


def test_two_conversations_of_different_row_counts_share_a_bucket_and_each_continue_like_stock(pair):
    from transformers import DynamicCache

    stock, model = pair
    key = _cache_kwarg(stock)
    g = torch.Generator().manual_seed(4)
    convs = []
    for rows, length in ((3, 7), (4, 5)):  # both run bucket 4's step
        ids = torch.randint(3, 1024, (rows, length), generator=g)
        convs.append([ids, DynamicCache(config=stock.config), model.unimem.new_cache(rows)])
    try:
        for turn in range(2):
            for conv in convs:
                ids, dynamic, cache = conv
                want = generate(stock, ids, None, max_new_tokens=4, do_sample=False, **{key: dynamic})
                got = generate(model, ids, None, max_new_tokens=4, do_sample=False, **{key: cache})
                assert torch.equal(got, want), (turn, ids.shape[0])
                conv[0] = torch.cat([want, torch.randint(3, 1024, (ids.shape[0], 3), generator=g)], 1)
    finally:
        for conv in convs:
            conv[2].release()
    assert model.unimem.stats()["kv_pages_used"] == 0


class Recorder:
    """A streamer that records the tokens it gets and, at every put and at the end, the pool's pages in use."""

    def __init__(self, model):
        self.model, self.tokens, self.pages, self.ended = model, [], [], None

    def put(self, value):
        self.tokens.append(value.clone())
        self.pages.append(self.model.unimem.stats()["kv_pages_used"])

    def end(self):
        self.ended = self.model.unimem.stats()["kv_pages_used"]


def test_a_finished_row_stops_allocating_and_gives_back_its_reserved_pages(deepseek):
    """Row 0 ends at its 2nd token, row 1 runs 40 tokens (page 8, K 8). Stock keeps writing row 0's pad
    tokens (its pages grow with row 1's); through the runner row 0 holds exactly ceil(length / 8) pages once
    the host has read that it finished, and at the end each row holds what its tokens need."""
    stock, model = deepseek
    ids = torch.randint(3, 1024, (2, 12), generator=torch.Generator().manual_seed(5))
    free = generate(stock, ids, None, max_new_tokens=40, min_new_tokens=40, do_sample=False)[:, 12:]
    eos = int(free[0, 1])
    assert eos not in free[1].tolist()
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0)
    want = generate(stock, ids, None, **kw)
    recorder = Recorder(model)
    got = generate(model, ids, None, streamer=recorder, **kw)
    assert torch.equal(got, want)
    count0 = int((want[0, 12:] == eos).nonzero()[0]) + 1
    n0, n1 = 12 + count0 - 1, 12 + 40 - 1  # each row stored its prompt and every token it made but its last
    assert count0 <= 2 and recorder.ended == math.ceil(n0 / PAGE) + math.ceil(n1 / PAGE)  # stock keeps 2 x 7
    # the tokens streamed are the generated ones, one put per step after the prompt's
    assert torch.equal(torch.stack(recorder.tokens[1:], 1), want[:, 12:])
    # the host reads that row 0 finished before it streams a token: from then on row 0 holds its pages only,
    # and row 1 holds pages at most two blocks of K = 8 steps past the tokens streamed
    for i, pages in enumerate(recorder.pages[1:], start=1):
        assert pages <= math.ceil(n0 / PAGE) + math.ceil(min(12 + i + 16, n1) / PAGE), i
    assert model.unimem.stats()["kv_pages_used"] == 0


def test_sampled_tokens_repeat_under_manual_seed_and_do_not_depend_on_batch_mates(deepseek):
    """Two prompts x num_return_sequences=2 (4 rows: prompt a twice, then prompt b twice)."""
    _, model = deepseek
    g = torch.Generator().manual_seed(6)
    a, b, c = (torch.randint(3, 1024, (1, 9), generator=g) for _ in range(3))
    kw = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=8, min_new_tokens=8,
              num_return_sequences=2)

    def run(ids, seed):
        torch.manual_seed(seed)
        return generate(model, ids, None, **kw)

    first = run(torch.cat([a, b]), 11)
    assert first.shape == (4, 17) and torch.equal(first[0, :9], first[1, :9])
    assert not torch.equal(first[0], first[1])  # two samples of one prompt: two seeds
    assert torch.equal(run(torch.cat([a, b]), 11), first)
    assert torch.equal(run(torch.cat([a, c]), 11)[:2], first[:2])  # rows 0-1 draw the same seeds, whoever follows
    assert not torch.equal(run(torch.cat([a, b]), 12), first)


def test_a_user_logits_processor_runs_transformers_loop_and_says_so(deepseek, caplog):
    from transformers import LogitsProcessor

    from unimem_compile.runner import generate as runner_generate

    class NoToken7(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 7] = -float("inf")
            return scores

    stock, model = deepseek
    ids, mask = left_padded([6, 8], torch.Generator().manual_seed(7), 1024)
    runner_generate._said.clear()
    with caplog.at_level(logging.INFO, logger="unimem_compile.runner.generate"):
        for _ in range(2):
            got = generate(model, ids, mask, max_new_tokens=5, do_sample=False, logits_processor=[NoToken7()])
        said = [r.getMessage() for r in caplog.records if "decode runner" in r.getMessage()]
        out = generate(model, ids, mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                       output_scores=True)
    assert torch.equal(got, generate(stock, ids, mask, max_new_tokens=5, do_sample=False,
                                     logits_processor=[NoToken7()]))
    assert len(said) == 1 and "NoToken7" in said[0] and "logits_processor" in said[0]
    assert len(out.scores) == 3  # transformers' loop recorded them
    assert any("output_scores=True" in r.getMessage() for r in caplog.records)


def test_return_dict_in_generate_gives_transformers_output_and_the_cache(deepseek):
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    stock, model = deepseek
    ids, mask = left_padded([5, 7], torch.Generator().manual_seed(8), 1024)
    out = generate(model, ids, mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out, GenerateDecoderOnlyOutput) and out.scores is None
    assert torch.equal(out.sequences, generate(stock, ids, mask, max_new_tokens=4, do_sample=False))
    cache = getattr(out, "cache", None) or out.past_key_values
    assert type(cache).__name__ == "UnifiedCache" and cache.released  # the call's own cache, given back


def test_capture_up_front_and_the_runner_knobs_are_checked():
    model = unimem_compile.compile(build_model("deepseek-v3-tiny"), max_batch_size=3, max_seq_len=32,
                                   page_size=PAGE, backend="aot_eager")
    handle = model.unimem
    assert handle.runner.buckets == (1, 2, 3) and handle.steps_ahead == 8
    with pytest.raises(GeometryError, match=r"5 rows is not a bucket of this model; its buckets are \[1, 2, 3\]"):
        handle.capture([5])
    with pytest.raises(GeometryError, match="steps_ahead must be >= 1, got 0"):
        handle.steps_ahead = 0
    stats = handle.capture([2])
    assert stats["captures"] is False  # a CPU model: the step is compiled, never captured
    (step,) = stats["steps"]
    assert (step["bucket"], step["sampling"], step["captured"], step["steps"]) == (2, False, False, 0)
    assert step["compile_s"] > 0 and stats["state_bytes"] > 0
    graphs = handle.passes.graphs
    ids = torch.randint(3, 1024, (2, 5), generator=torch.Generator().manual_seed(9))
    with handle.timed_decode() as timing:
        generate(model, ids, None, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert handle.passes.graphs == graphs + 1  # the prefill only: the step was built
    assert timing.decode_steps == 5 and timing.decode_seconds() > 0
    assert handle.runner_stats()["steps"][0]["steps"] == 5


def test_captured_steps_run_grouped_mm_experts_as_batched_mm_for_non_bf16_weights(deepseek):
    """transformers' grouped_mm experts fall back to a loop over ``offs.tolist()`` for weights that are not
    bf16 (CUDA graph capture refuses the device-to-host copy): a capturing runner swaps such layers to
    batched_mm for its step only; a bf16 model keeps grouped_mm."""
    _, model = deepseek
    runner = model.unimem.runner
    configs = list({id(m.config): m.config for m in model.modules() if hasattr(m, "is_concatenated")}.values())
    assert configs  # deepseek-v3-tiny has MoE layers
    saved = [c._experts_implementation_internal for c in configs]
    try:
        for c in configs:
            c._experts_implementation_internal = "grouped_mm"
        runner.capture_graphs, runner._expert_configs = True, None
        with runner._capturable_experts():
            assert [c._experts_implementation_internal for c in configs] == ["batched_mm"] * len(configs)
        assert [c._experts_implementation_internal for c in configs] == ["grouped_mm"] * len(configs)
        bf16 = build_model("deepseek-v3-tiny").to(torch.bfloat16)
        unimem_compile.compile(bf16, max_batch_size=2, max_seq_len=32, page_size=PAGE, backend="aot_eager")
        bf16_configs = [m.config for m in bf16.modules() if hasattr(m, "is_concatenated")]
        for c in bf16_configs:
            c._experts_implementation_internal = "grouped_mm"
        bf16.unimem.runner.capture_graphs = True
        with bf16.unimem.runner._capturable_experts():
            assert {c._experts_implementation_internal for c in bf16_configs} == {"grouped_mm"}
    finally:
        runner.capture_graphs, runner._expert_configs = False, None
        for c, value in zip(configs, saved):
            c._experts_implementation_internal = value


def test_a_new_cache_of_the_same_batch_size_does_not_hide_a_passed_cache_tables(deepseek):
    """Caches of one batch size share the step buffers; creating one clears the tables there. The cache whose
    tables were resident must upload them again on its next step (its second turn reads its history)."""
    from transformers import DynamicCache

    stock, model = deepseek
    key = _cache_kwarg(stock)
    ids = torch.randint(3, 1024, (2, 9), generator=torch.Generator().manual_seed(11))
    extra = torch.randint(3, 1024, (2, 3), generator=torch.Generator().manual_seed(12))
    dynamic, cache = DynamicCache(config=stock.config), model.unimem.new_cache(2)
    other = None
    try:
        want1 = generate(stock, ids, None, max_new_tokens=4, do_sample=False, **{key: dynamic})
        got1 = generate(model, ids, None, max_new_tokens=4, do_sample=False, **{key: cache})
        assert torch.equal(got1, want1)
        other = model.unimem.new_cache(2)  # never used: only created
        turn2 = torch.cat([want1, extra], 1)
        want2 = generate(stock, turn2, None, max_new_tokens=4, do_sample=False, **{key: dynamic})
        got2 = generate(model, turn2, None, max_new_tokens=4, do_sample=False, **{key: cache})
        assert torch.equal(got2, want2)
    finally:
        cache.release()
        if other is not None:
            other.release()
    assert model.unimem.stats()["kv_pages_used"] == 0
