"""Chunked prefill (``generate(prefill_chunk_size=...)``) through the ``mla_prefill`` rewrite, against stock
transformers (fp32, CPU, ``aot_eager``).

Greedy tokens must equal stock transformers' unchunked generate for prompts prefilled in one, two and many
chunks (a one-token last chunk included), ragged left-padded rows whose pads outlast a chunk, histories that
end mid-page and unpadded rows (transformers' mask-free causal first chunk); a continued conversation must
equal stock's continuation; teacher-forced logits of every real position must be close to a stock forward
over the whole sequence. Every prefill graph is rewritten (one ``mla_prefill`` per MLA layer, no gather of
``max_seq_len`` positions left), one graph serves every chunk length, and the op's pieces follow the tokens
present, bounded by its workspace (16 tokens here, so every prefill merges several pieces).

Compiles dominate the cost: every test uses batches of 3 rows (a new batch size is a new graph) and the
unpadded case (two more graphs) runs for DeepSeek-V3 only.
"""

import logging
import math
import re

import numpy as np
import pytest
import torch

import unimem_compile
from unimem_compile import env
from unimem_compile.errors import GeometryError, UnsupportedModel
from unimem_compile.hf.cache import UnifiedCache
from unimem_compile.hf.generate_checks import _cache_kwarg
from unimem_compile.hf.models import build_model
from unimem_compile.passes.manager import is_decode_graph

from ..prompts import chunked_logits, generate_positions, left_padded

FAMILIES = {"kimi-linear-tiny": 2, "deepseek-v3-tiny": 3}  # family -> MLA layers
MAX_SEQ, PAGE, NEW, WORKSPACE = 96, 16, 6, 16
# fp32 teacher-forced logits: chunking changes only the summation order (the pieces' log-sum-exp merge,
# the KDA chunk boundaries); measured max |diff| about 2e-6 on logits of magnitude ~1
LOGIT_TOL = 1e-4


# aot_eager that keeps every ATen graph it runs: what the inner backend really executes after AOT autograd
AOT_GRAPHS: list[torch.fx.GraphModule] = []


@torch._dynamo.register_backend(name="unimem_test_aot_eager_recording")
def _aot_eager_recording(gm, example_inputs, **kwargs):
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    def record(graph, inputs):
        AOT_GRAPHS.append(graph)
        return boxed_nop(graph, inputs)

    return aot_eager(gm, example_inputs, fw_compiler=record, **kwargs)


def greedy(model, ids, mask, new=NEW, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              **kw)


def prompts(lengths, seed):
    return left_padded(lengths, torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request):
    """(stock model, unimem-compiled model with the same weights, MLA layer count); graphs are kept."""
    torch._dynamo.reset()
    AOT_GRAPHS.clear()
    stock, model = build_model(request.param), build_model(request.param)
    unimem_compile.compile(model, max_batch_size=3, max_seq_len=MAX_SEQ, page_size=PAGE,
                           backend="unimem_test_aot_eager_recording")
    model.unimem.passes.keep_graphs = True
    (rewrite,) = [r for r in model.unimem.passes.rewrites if r.name == "mla_prefill"]
    rewrite.workspace_tokens = WORKSPACE  # before the first compile: it is a constant of the graphs
    return stock, model, FAMILIES[request.param]


# lengths 37 / 21 end mid-page (page 16); row 1's 16 pads outlast 6-token chunks; 37 = 6 * 6 + 1 ends in a
# one-token chunk (the decode graph)
CASES = {
    "one_chunk": ([37, 21, 30], 64),
    "two_chunks": ([37, 21, 30], 20),
    "many_chunks_pads_outlasting_a_chunk": ([37, 21, 30], 6),
    "unpadded_two_chunks": ([29, 29, 29], 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_stock_generate(pair, case):
    stock, model, layers = pair
    if case.startswith("unpadded") and layers != FAMILIES["deepseek-v3-tiny"]:
        pytest.skip("two more graphs per family; the attention path is the same in both (sdpa_attention.py)")
    lengths, chunk = CASES[case]
    ids, mask = prompts(lengths, seed=len(case))
    want = greedy(stock, ids, mask)
    got = greedy(model, ids, mask, prefill_chunk_size=chunk)
    assert torch.equal(got, want)
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def test_every_prefill_graph_is_rewritten_and_decode_graphs_absorbed(pair):
    _, model, layers = pair
    ids, mask = prompts([23, 30, 4], seed=3)
    greedy(model, ids, mask, prefill_chunk_size=9)  # compiles nothing new after the tests above
    records = model.unimem.passes.records
    assert records
    for r in records:
        decode = is_decode_graph(r.before)
        assert (r.counts["mla_prefill"], r.counts["mla_absorb"]) == ((0, layers) if decode else (layers, 0))
        ops = [str(n.target) for n in r.after.nodes if n.op == "call_function"]
        assert "unimem.mla_gather" not in ops  # no history of max_seq_len positions is gathered any more


def test_what_runs_gathers_no_max_seq_len_history_and_reads_no_mask(pair):
    """In the ATen graphs AOT autograd hands the inner compiler: no ``mla_gather`` at all, one ``mla_prefill``
    per MLA layer in each prefill graph, and transformers' 4-D boolean masks (``[B, 1, T, max_seq_len]``) are
    inputs that nothing reads."""
    _, model, layers = pair
    ids, mask = prompts([23, 30, 4], seed=3)
    greedy(model, ids, mask, prefill_chunk_size=9)
    assert AOT_GRAPHS
    prefills = masked = 0
    for graph in AOT_GRAPHS:
        targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
        assert not any("mla_gather" in t for t in targets)
        prefills += targets.count("unimem.mla_prefill.default") == layers
        masks = [n for n in graph.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
                 and n.meta["val"].dim() == 4 and n.meta["val"].dtype == torch.bool]
        assert all(not n.users for n in masks)  # (a first chunk without padding has no mask at all)
        masked += bool(masks)
    assert prefills >= 1 and masked >= 1


def test_one_graph_serves_every_chunk_length_and_prompt_length(pair):
    _, model, _ = pair
    ids, mask = prompts([40, 27, 33], seed=5)
    greedy(model, ids, mask, prefill_chunk_size=16)  # compiles the padded prefill and the decode graph if new
    graphs = model.unimem.passes.graphs
    frames = dict(torch._dynamo.utils.counters["frames"])
    for lengths, chunk in (([55, 12, 30], 30), ([9, 44, 20], None), ([21, 20, 3], 2)):
        ids, mask = prompts(lengths, seed=len(lengths) + lengths[0])
        greedy(model, ids, mask, new=2, prefill_chunk_size=chunk)
    assert model.unimem.passes.graphs == graphs
    assert dict(torch._dynamo.utils.counters["frames"]) == frames


def test_teacher_forced_logits_match_a_stock_forward_over_the_whole_sequence(pair):
    stock, model, _ = pair
    chunk = 12  # 34 = 12 + 12 + 10: no one-token chunk (a graph of its own with every position's logits)
    ids, mask = prompts([34, 19, 28], seed=chunk)
    with torch.no_grad():
        want = stock(ids, attention_mask=mask, position_ids=generate_positions(mask)).logits
    got = chunked_logits(model, ids, mask, chunk)
    real = mask.bool()
    assert got.shape == want.shape
    torch.testing.assert_close(got[real], want[real], atol=LOGIT_TOL, rtol=0)


def test_a_continued_conversation_in_chunks_equals_stock(pair):
    from transformers import DynamicCache

    stock, model, _ = pair
    key = _cache_kwarg(stock)
    ids, mask = prompts([14, 9, 12], seed=21)
    extra = torch.randint(3, 1024, (3, 13), generator=torch.Generator().manual_seed(22))

    def turns(m, cache, **kw):
        first = m.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, **{key: cache})
        grown = torch.cat([mask, torch.ones(3, first.shape[1] - ids.shape[1] + extra.shape[1], dtype=mask.dtype)], 1)
        second = m.generate(torch.cat([first, extra], 1), attention_mask=grown, max_new_tokens=4, do_sample=False,
                            **{key: cache}, **kw)
        return first, second

    with torch.no_grad():
        want = turns(stock, DynamicCache(config=stock.config))
        cache = model.unimem.new_cache(3)
        try:
            got = turns(model, cache, prefill_chunk_size=5)
        finally:
            cache.release()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_prefill_pieces_follow_the_tokens_present_and_the_workspace(pair, monkeypatch):
    """Every MLA layer's prefill runs in ceil(stored / 16) pieces of the rows' stored tokens (never of
    max_seq_len positions), the workspace the fixture set."""
    from unimem_compile.ops import mla_prefill as mp

    stock, model, layers = pair
    plans = []
    plan = mp.mla_prefill_plan

    def recording_plan(kv_len_host, max_tokens, workspace_tokens):
        result = plan(kv_len_host, max_tokens, workspace_tokens)
        plans.append((result, max_tokens, workspace_tokens))
        return result

    monkeypatch.setattr(mp, "mla_prefill_plan", recording_plan)
    ids, mask = prompts([45, 30, 12], seed=8)
    got = greedy(model, ids, mask, new=2, prefill_chunk_size=20)
    assert torch.equal(got, greedy(stock, ids, mask, new=2))
    # three chunks of 20, 20 and 5 positions; rows stored after each (15 and 33 pads)
    stored = [[20, 5, 0], [40, 25, 7], [45, 30, 12]]
    assert [p[0][0] for p in plans] == [n for n in stored for _ in range(layers)]
    for (lengths, total, pieces), max_tokens, workspace in plans:
        assert workspace == WORKSPACE and max_tokens == math.ceil(MAX_SEQ / PAGE) * PAGE
        assert total == sum(lengths) and pieces == math.ceil(total / WORKSPACE)
    assert max(p[0][2] for p in plans) == 6  # 87 stored tokens: 6 pieces, not ceil(3 * 96 / 16) = 18


def test_a_numpy_or_tensor_integer_chunk_size_chunks_as_its_int(pair):
    """prefill_chunk_size=np.int64(n) (from a config computed with numpy, say) used to be refused ("must be an
    int"); transformers itself fails on it in torch.split. Given as a keyword, in a passed generation_config
    or in the model's, it is handed on as the int n: the same tokens, the same chunks (as many prefill
    forwards), as with n."""
    from transformers import GenerationConfig

    stock, model, _ = pair
    ids, mask = prompts([37, 21, 30], seed=31)
    want = greedy(stock, ids, mask)
    calls = []  # the query length of every forward that transformers' loop calls (the prefill chunks)
    hook = model.register_forward_pre_hook(
        lambda _, args, kw: calls.append((kw["input_ids"] if "input_ids" in kw else args[0]).shape[1]),
        with_kwargs=True)
    try:
        assert torch.equal(greedy(model, ids, mask, prefill_chunk_size=20), want)
        chunks = list(calls)
        assert chunks[:2] == [20, 17]
        for kw in ({"prefill_chunk_size": np.int64(20)}, {"prefill_chunk_size": torch.tensor(20)},
                   {"generation_config": GenerationConfig(prefill_chunk_size=np.int32(20), max_new_tokens=NEW,
                                                          min_new_tokens=NEW, do_sample=False)}):
            calls.clear()
            assert torch.equal(greedy(model, ids, mask, **kw), want), kw
            assert calls == chunks, kw
        saved = model.generation_config.prefill_chunk_size
        model.generation_config.prefill_chunk_size = np.int64(20)
        try:
            calls.clear()
            assert torch.equal(greedy(model, ids, mask), want)
            assert calls == chunks
        finally:
            model.generation_config.prefill_chunk_size = saved
    finally:
        hook.remove()
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def test_chunk_sizes_and_continuations_transformers_cannot_chunk_are_refused(pair, monkeypatch):
    from unimem_compile.hf import generate_checks

    _, model, _ = pair
    ids, mask = prompts([8, 6, 7], seed=30)
    for bad in (0, -3, 2.5, 4.0, True, np.int64(0), "4"):
        with pytest.raises(ValueError, match=re.escape(f"prefill_chunk_size must be an int >= 1, got {bad!r}")):
            greedy(model, ids, mask, prefill_chunk_size=bad)
    empty = mask.clone()
    empty[1] = 0
    with pytest.raises(GeometryError, match=r"row 1 of the batch consists of padding only \(8 pads\)"):
        greedy(model, ids, empty, prefill_chunk_size=3)
    cache = model.unimem.new_cache(3)
    try:
        first = greedy(model, ids, mask, new=2, **{_cache_kwarg(model): cache})
        monkeypatch.setattr(generate_checks, "_transformers_version", lambda: (5, 20))
        with pytest.raises(UnsupportedModel, match=r"needs transformers >= 5.21.*feed the 9 cached tokens again"):
            greedy(model, first, torch.ones_like(first), new=2, prefill_chunk_size=4, **{_cache_kwarg(model): cache})
        assert not cache.released
    finally:
        cache.release()
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def _recording_sdpa_masks(monkeypatch) -> list:
    """Record the shape of every attention mask transformers' SDPA mask function builds outside a compiled
    graph (what ``prepare_inputs_for_generation`` does for a compileable cache); returns the list."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    built = []
    sdpa = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

    def recording(*args, **kwargs):
        mask = sdpa(*args, **kwargs)
        if not torch.compiler.is_compiling() and isinstance(mask, torch.Tensor):
            built.append(tuple(mask.shape))
        return mask

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa", recording)
    return built


def test_a_chunked_padded_generate_builds_no_eager_attention_mask(pair, monkeypatch):
    """transformers builds the ``[B, 1, T, max_seq_len]`` mask of every prefill chunk eagerly (the cache is
    compileable); the rewritten graphs never read it, so generate() hands them a stand-in of the same shape
    (hf/masks.py): no 4-D mask is built outside a graph, the tokens are stock's and no graph is added."""
    stock, model, _ = pair
    built = _recording_sdpa_masks(monkeypatch)
    ids, mask = prompts([37, 21, 30], seed=41)
    want = greedy(stock, ids, mask)
    assert (3, 1, 37, 37) in built  # the recorder sees stock's masks
    built.clear()
    # 8 chunks, the last of 2 tokens (a one-token chunk is a decode step: transformers' [B, 1, 1, M] mask);
    # row 1's 16 pads outlast 3 chunks
    assert torch.equal(greedy(model, ids, mask, prefill_chunk_size=5), want)
    graphs = model.unimem.passes.graphs
    assert torch.equal(greedy(model, ids, mask, prefill_chunk_size=16), want)
    assert built == []  # decode steps: the decode runner builds its mask inside its graph
    assert model.unimem.passes.graphs == graphs and not model.unimem.passes.reads_attention_mask
    # UNIMEM_STAND_IN_MASKS=0: transformers' own masks again, per chunk (the same graphs, the same tokens)
    with env.overridden(env.STAND_IN_MASKS, "0"):
        assert torch.equal(greedy(model, ids, mask, prefill_chunk_size=16), want)
    assert built == [(3, 1, 16, MAX_SEQ), (3, 1, 16, MAX_SEQ), (3, 1, 5, MAX_SEQ)]  # 37 = 16 + 16 + 5
    assert model.unimem.passes.graphs == graphs


def test_a_prefill_graph_that_reads_the_mask_gets_transformers_mask(monkeypatch, caplog):
    """A ``kv_b_proj`` with a bias is refused by the MLA rewrites, so the prefill graph reads its attention
    mask: compiled for a stand-in, it raises before the inner compile, the step runs again with transformers'
    mask, and from then on every prefill step gets transformers' masks. The tokens are stock's."""

    def biased(model):
        gen = torch.Generator().manual_seed(7)
        for name, module in model.named_modules():
            if name.endswith("kv_b_proj"):
                module.bias = torch.nn.Parameter(0.1 * torch.randn(module.out_features, generator=gen))
        return model

    stock, model = biased(build_model("kimi-linear-tiny")), biased(build_model("kimi-linear-tiny"))
    unimem_compile.compile(model, max_batch_size=3, max_seq_len=MAX_SEQ, page_size=PAGE, backend="aot_eager")
    built = _recording_sdpa_masks(monkeypatch)
    ids, mask = prompts([30, 17, 25], seed=43)
    want = greedy(stock, ids, mask)
    chunks = [(3, 1, 8, MAX_SEQ)] * 3 + [(3, 1, 6, MAX_SEQ)]  # 30 = 8 + 8 + 8 + 6
    for _ in range(2):
        built.clear()
        with caplog.at_level(logging.INFO, logger="unimem_compile.compile"):
            assert torch.equal(greedy(model, ids, mask, prefill_chunk_size=8), want)
        assert built == chunks  # the first chunk's after its stand-in was read, then transformers' own
    assert model.unimem.rewrites["mla_prefill"] == 0 and model.unimem.passes.reads_attention_mask
    said = [r.getMessage() for r in caplog.records if "reads its attention mask" in r.getMessage()]
    assert len(said) == 1 and "KimiLinearForCausalLM" in said[0]


def test_every_chunk_reads_its_pads_from_the_call_masks_host_copy(pair, monkeypatch):
    """generate() remembers the call's mask (``UnifiedCache.remember_mask``): every chunk's mask is a slice of
    it, so each chunk's pads come from its host copy instead of a read-back (a GPU wait per chunk on CUDA). The
    tokens are stock's; with ``UNIMEM_ASYNC_UPLOADS=0`` every chunk reads its mask back, with the same tokens."""
    stock, model, _ = pair
    ids, mask = prompts([29, 12, 20], seed=47)
    want = greedy(stock, ids, mask)
    served = []  # per checked step: whether its host mask was a slice of the remembered copy
    host_mask = UnifiedCache._host_mask

    def recording(cache, attention_mask):
        got = host_mask(cache, attention_mask)
        known = cache._known_mask
        served.append(known is not None and got.data_ptr() == known[1].data_ptr())
        assert torch.equal(got, attention_mask)
        return got

    remember = UnifiedCache.remember_mask

    def remember_a_copy(cache, device_mask, host=None):  # on the CPU a read-back aliases the mask: copy it
        return remember(cache, device_mask, None if device_mask is None else device_mask.clone())

    monkeypatch.setattr(UnifiedCache, "_host_mask", recording)
    monkeypatch.setattr(UnifiedCache, "remember_mask", remember_a_copy)
    assert torch.equal(greedy(model, ids, mask, prefill_chunk_size=8), want)
    assert served == [True] * 4  # 29 = 8 + 8 + 8 + 5: each chunk once; decode steps read no mask
    served.clear()
    with env.overridden(env.ASYNC_UPLOADS, "0"):
        assert torch.equal(greedy(model, ids, mask, prefill_chunk_size=8), want)
    assert served == [False] * 4


def test_a_mask_is_served_from_the_host_copy_only_when_it_is_a_slice_of_the_remembered_one(pair):
    _, model, _ = pair
    cache = model.unimem.new_cache(2)
    gen = torch.Generator().manual_seed(53)
    mask = torch.randint(0, 2, (2, 12), generator=gen)
    host = mask.clone()
    try:
        cache.remember_mask(mask, host)
        for got in (cache._host_mask(mask), cache._host_mask(mask[:, :5])):
            assert got.data_ptr() == host.data_ptr() and torch.equal(got, mask[:, :got.shape[1]])
        others = (mask.clone(), mask[:, 1:], mask[:1], mask.to(torch.int32), torch.cat([mask, mask], 1)[:, :12],
                  mask.t().contiguous().t(), mask.as_strided((2, 6), (6, 1)))
        for other in others:  # a copy, an offset view, fewer rows, another dtype, other strides: read back
            got = cache._host_mask(other)
            assert got.data_ptr() != host.data_ptr() and torch.equal(got, other)
        cache.remember_mask(None)
        assert cache._host_mask(mask).data_ptr() != host.data_ptr()
        with pytest.raises(GeometryError, match=r"host copy has shape \[2, 11\], the mask \[2, 12\]"):
            cache.remember_mask(mask, host[:, :11])
        with pytest.raises(GeometryError, match=r"2-D \[B, L\] mask, got shape \[24\]"):
            cache.remember_mask(mask.reshape(-1))
    finally:
        cache.release()


def test_an_all_ones_chunk_mask_is_not_read_back_for_the_linear_attention_layers(pair, monkeypatch):
    """transformers' ``create_recurrent_attention_mask`` returns None for an all-ones mask, which it finds by
    reading the mask back (a GPU wait per chunk); with a stand-in step the cache's host copy decides instead and
    hands it None. A padded batch still gets transformers' trailing slice. Tokens are stock's either way."""
    import transformers.masking_utils as masking_utils

    stock, model, _ = pair
    if "linear_attention" not in set(getattr(model.config, "layer_types", None) or ()):
        pytest.skip("no linear-attention layers")
    seen = []
    original = masking_utils.create_recurrent_attention_mask

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append((kwargs.get("attention_mask") is None, None if out is None else tuple(out.shape)))
        return out

    monkeypatch.setattr(masking_utils, "create_recurrent_attention_mask", recording)
    ids = torch.randint(3, 1000, (1, 24), generator=torch.Generator().manual_seed(59))
    ones = torch.ones_like(ids)
    assert torch.equal(greedy(model, ids, ones, prefill_chunk_size=8), greedy(stock, ids, ones))
    ours = [s for s in seen if s[0]]
    assert ours == [(True, None), (True, None)]  # chunks 2 and 3 (chunk 1 has no history: transformers' masks)
    seen.clear()
    ids, mask = prompts([24, 13], seed=61)
    assert torch.equal(greedy(model, ids, mask, prefill_chunk_size=8), greedy(stock, ids, mask))
    assert (False, (2, 8)) in seen and not any(s[0] for s in seen)


def test_mla_prefill_plans_from_the_host_lengths_the_step_publishes(pair, monkeypatch):
    """Each chunk's forward publishes its page tables' host lengths (ops/step_context.py): every mla_prefill
    call plans from them (on a GPU, reading kv_len back would wait for the GPU per MLA layer and chunk), and
    they equal kv_len. ``UNIMEM_ASYNC_UPLOADS=0`` publishes nothing: the op reads kv_len itself."""
    from unimem_compile.ops import mla_prefill as op

    stock, model, mla_layers = pair
    ids, mask = prompts([26, 11, 19], seed=67)
    want = greedy(stock, ids, mask)
    plans = []
    plan = op.mla_prefill_plan

    def recording(kv_len_host, *args):
        plans.append(kv_len_host.clone())
        return plan(kv_len_host, *args)

    published = []
    host_copy = op.host_copy

    def recording_lookup(kv_len):
        got = host_copy(kv_len)
        published.append(got is not None and torch.equal(got, kv_len))
        return got

    monkeypatch.setattr(op, "mla_prefill_plan", recording)
    monkeypatch.setattr(op, "host_copy", recording_lookup)
    assert torch.equal(greedy(model, ids, mask, prefill_chunk_size=8), want)
    assert len(published) == len(plans) == 4 * mla_layers and all(published)  # 26 = 8 + 8 + 8 + 2: 4 chunks
    published.clear()
    with env.overridden(env.ASYNC_UPLOADS, "0"):
        assert torch.equal(greedy(model, ids, mask, prefill_chunk_size=8), want)
    assert len(published) == 4 * mla_layers and not any(published)
