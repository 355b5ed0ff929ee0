"""Continuous batching on the unified pool against stock transformers (fp32, CPU, ``aot_eager``).

One compiled Kimi-Linear tiny model (MLA + KDA layers) serves every test, built under ``UNIMEM_DEBUG=1``:
its pool poisons free pages and slots (NaN bytes: a read of memory a request does not hold shows up in
its tokens), the launchers check every id against the live set, and the engine's memory checks the owner
of every id it frees. Every request's greedy tokens must equal stock ``generate()`` on that prompt alone
with the same settings, whatever else runs beside it: staggered arrivals, different lengths, EOS mid-run,
cancellations, preemption with recompute (a static split of the arena with room for a few pages), a hypothesis
state machine over the manager. Compiles dominate the cost: every test shares the model's graphs (a
one-row prefill graph, the runner's steps of 1 and 2 rows).
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from transformers import GenerationConfig

import unimem_compile
from unimem_compile.engine import QueueFull, QuotaMemory, RequestStatus
from unimem_compile.errors import GeometryError
from unimem_compile.hf.models import build_model
from unimem_compile.runner.rows import UnsupportedGenerationSetting

MAX_SEQ, PAGE, BATCH = 96, 16, 2  # two rows: buckets 1 and 2, few compiles


@pytest.fixture(scope="module")
def pair():
    """(stock model, compiled model with the same weights); the compiled one under UNIMEM_DEBUG=1."""
    saved = os.environ.get("UNIMEM_DEBUG")
    os.environ["UNIMEM_DEBUG"] = "1"
    torch._dynamo.reset()
    stock, model = build_model("kimi-linear-tiny"), build_model("kimi-linear-tiny")
    unimem_compile.compile(model, max_batch_size=BATCH, max_seq_len=MAX_SEQ, page_size=PAGE, backend="aot_eager")
    assert model.unimem.pool.poison
    yield stock, model
    if saved is None:
        os.environ.pop("UNIMEM_DEBUG", None)
    else:
        os.environ["UNIMEM_DEBUG"] = saved


def prompts(lengths, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


_STOCK: dict = {}  # (stock model, prompt, EOS) -> (max_new_tokens asked, stock's new tokens)


def reference(stock, prompt, max_new, eos=None) -> list[int]:
    """Stock greedy generate() of ``prompt`` alone: ``max_new`` tokens, or fewer up to its EOS. Stock runs once
    per (prompt, EOS) and again only when more tokens are asked for than it ran (a shorter greedy run is a
    prefix of a longer one; a run that ended at an EOS is complete)."""
    key = (stock, tuple(prompt), eos)
    asked, tokens = _STOCK.get(key, (0, []))
    if asked < max_new and len(tokens) == asked:
        kwargs = {} if eos is None else {"eos_token_id": eos}
        with torch.no_grad():
            out = stock.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, **kwargs)
        asked, tokens = max_new, out[0, len(prompt):].tolist()
        _STOCK[key] = asked, tokens
    return tokens[:max_new]


def assert_idle(model, manager=None):
    """No page or slot held, no request left in the engine."""
    s = model.unimem.stats()
    assert (s["kv_pages_used"], s["state_slots_used"]) == (0, 0)
    if manager is not None:
        e = manager.engine
        assert not e.scheduler.waiting and not e.scheduler.running and not e.rows
        assert e.memory.pages == {} and e.memory.slots == {}


def quota(model, pages: int) -> QuotaMemory:
    """A static split of the model's arena whose KV share holds ``pages`` pages (and many slots)."""
    lay = model.unimem.pool.layout
    room = lay.usable - lay.sink_floor
    memory = QuotaMemory(model.unimem.pool, (pages + 0.5) * lay.page_bytes / room)
    assert memory.kv_cap_pages == pages and memory.state_cap_slots >= BATCH
    return memory


def drain(manager) -> dict:
    """Step an unstarted manager until it is idle; returns its final results by id."""
    while manager.step():
        pass
    results = {}
    while (out := manager.get_result(timeout=0)) is not None:
        if out.is_finished():
            assert out.request_id not in results, "a final result delivered twice"
            results[out.request_id] = out
    return results


# ------------------------------------------------------------------------------------------ generate_batch
def test_generate_batch_matches_stock_and_shares_steps(pair):
    stock, model = pair
    vocab = model.config.vocab_size
    batch = prompts([5, 37, 20, 9, 30, 14], seed=1, vocab=vocab)  # more prompts than rows: rows are reused
    model.unimem.pool.reset_peaks()
    out = model.generate_batch(batch, max_new_tokens=10, max_prefill_tokens=24)
    assert list(out) == [f"req_{i}" for i in range(len(batch))]
    for i, (rid, res) in enumerate(out.items()):
        assert res.status == RequestStatus.FINISHED and res.is_finished() and res.error is None
        assert res.prompt_ids == batch[i]
        assert res.generated_tokens == reference(stock, batch[i], 10), rid
    assert model.unimem.stats()["state_slots_peak"] > 1  # rows really ran side by side
    assert_idle(model)


def test_generate_batch_defaults_follow_the_generation_config(pair):
    """No max_new_tokens: generate()'s 20 new tokens; the model's EOS id ends a request as in generate()."""
    stock, model = pair
    batch = prompts([11, 6], seed=2, vocab=model.config.vocab_size)
    out = model.generate_batch(batch)
    for i, res in enumerate(out.values()):
        with torch.no_grad():
            ref = stock.generate(torch.tensor([batch[i]]), do_sample=False)[0, len(batch[i]):].tolist()
        assert res.generated_tokens == ref
        assert len(ref) == 20 or ref[-1] == model.generation_config.eos_token_id
    assert_idle(model)


# ------------------------------------------------------------------------------------------ the manager
def test_staggered_arrivals_eos_cancel_on_the_thread(pair):
    stock, model = pair
    vocab = model.config.vocab_size
    ps = prompts([7, 33, 18, 25, 12], seed=3, vocab=vocab)
    # EOS mid-run: the 4th token stock generates for prompt 1 becomes its EOS id
    eos = reference(stock, ps[1], 16)[3]
    with model.init_continuous_batching(max_prefill_tokens=16) as manager:
        a = manager.add_request(ps[0], max_new_tokens=16)
        b = manager.add_request(ps[1], request_id="eos", max_new_tokens=16, eos_token_id=eos, streaming=True)
        first = next(manager.request_id_iter(b, timeout=120))  # b runs before the others arrive
        assert first.status in (RequestStatus.DECODING, RequestStatus.FINISHED)
        c = manager.add_request(ps[2], max_new_tokens=12)
        d = manager.add_request(ps[3], max_new_tokens=40)
        manager.cancel_request(d)
        e = manager.add_request(ps[4], max_new_tokens=8)
        results = {}
        for rid in (a, b, c, d, e):
            outs = list(manager.request_id_iter(rid, timeout=120))
            results[rid] = outs[-1]
            if rid == b:  # streaming: cumulative, never shrinking, the last one final
                seqs = [first.generated_tokens] + [o.generated_tokens for o in outs]
                assert all(x == y[:len(x)] for x, y in zip(seqs, seqs[1:]))
                assert [o.is_finished() for o in outs].count(True) == 1
    assert results[a].generated_tokens == reference(stock, ps[0], 16)
    assert results[b].generated_tokens == reference(stock, ps[1], 16, eos)
    assert results[b].generated_tokens[-1] == eos and len(results[b].generated_tokens) <= 4
    assert results[c].generated_tokens == reference(stock, ps[2], 12)
    assert results[e].generated_tokens == reference(stock, ps[4], 8)
    cancelled = results[d]
    assert cancelled.status == RequestStatus.FAILED and cancelled.error == "cancelled"
    assert cancelled.generated_tokens == reference(stock, ps[3], 40)[:len(cancelled.generated_tokens)]
    assert not manager.is_running()
    assert_idle(model, manager)


def test_preemption_recomputes_to_the_same_tokens(pair):
    """A KV share of 6 pages (96 tokens) for two rows of requests that grow to 3-4 pages each: the newest is
    preempted while older ones grow, recomputed later from its prompt and tokens, and ends with stock's."""
    stock, model = pair
    ps = prompts([30, 26, 20, 34], seed=4, vocab=model.config.vocab_size)
    manager = model.init_continuous_batching(memory=quota(model, 6), max_prefill_tokens=40)
    ids = [manager.add_request(p, max_new_tokens=20) for p in ps]
    model.unimem.pool.reset_peaks()
    results = drain(manager)
    assert manager.engine.counters["preemptions"] > 0
    assert manager.engine.counters["peak_rows"] > 1
    for rid, p in zip(ids, ps):
        assert results[rid].status == RequestStatus.FINISHED
        assert results[rid].generated_tokens == reference(stock, p, 20), rid
    assert_idle(model, manager)


def test_a_row_grows_only_by_the_tokens_it_has_left(pair):
    """A block runs as many steps as the longest row needs, but a row that ends sooner stores no token past
    its end (location -1), so it must not take pages for them: a request with one token left beside a long
    one fits a 3-page share exactly (1 + 2 pages) and nothing is preempted. Growing every row by the block's
    steps took a second page for the short one and preempted the long one."""
    stock, model = pair
    short, long_ = prompts([10, 10], seed=14, vocab=model.config.vocab_size)
    manager = model.init_continuous_batching(memory=quota(model, 3))
    a = manager.add_request(short, max_new_tokens=2)
    b = manager.add_request(long_, max_new_tokens=12)
    results = drain(manager)
    assert manager.engine.counters["preemptions"] == 0
    assert manager.engine.counters["peak_rows"] == 2
    c = manager.engine.counters  # both prompts packed into one forward, nothing preempted: exact counts
    assert (c["prefill_chunks"], c["prefill_tokens"], c["packed_forwards"], c["prefill_pads"]) == (1, 20, 1, 0)
    assert c["step_s"] >= c["decode_s"] + c["prefill_s"] > 0
    assert results[a].generated_tokens == reference(stock, short, 2)
    assert results[b].generated_tokens == reference(stock, long_, 12)
    assert_idle(model, manager)


def test_counters_tell_row_bound_from_memory_bound_admission(pair):
    """Three requests for two rows and memory to spare: the third waits for a row (row_waits > 0), never for
    memory (no refusal). Two requests whose pages exceed a one-page KV share, rows free: the second is refused
    for memory on every step until the first leaves (refusals > 0), never counted as a row wait."""
    stock, model = pair
    ps = prompts([7, 11, 9], seed=21, vocab=model.config.vocab_size)
    manager = model.init_continuous_batching()
    ids = [manager.add_request(p, max_new_tokens=4) for p in ps]
    results = drain(manager)
    c = manager.engine.counters
    assert c["row_waits"] >= 1 and c["refusals"] == 0 and c["row_waits"] <= c["steps"]
    for rid, p in zip(ids, ps):
        assert results[rid].generated_tokens == reference(stock, p, 4)
    assert_idle(model, manager)

    manager = model.init_continuous_batching(memory=quota(model, 1))
    ids = [manager.add_request(p, max_new_tokens=4) for p in ps[:2]]  # 7 + 4 and 11 + 4 tokens: a page each
    results = drain(manager)
    c = manager.engine.counters
    assert c["refusals"] >= 1 and c["row_waits"] == 0 and c["preemptions"] == 0
    for rid, p in zip(ids, ps):
        assert results[rid].generated_tokens == reference(stock, p, 4)
    assert_idle(model, manager)


def test_sampled_rows_beside_greedy_rows(pair):
    """Per-request settings in one step: a sampled request with a seed draws the same tokens beside either
    greedy neighbour, in either row (its noise depends on its seed and token index only); the greedy ones,
    one with a repetition penalty, stay stock's."""
    stock, model = pair
    ps = prompts([9, 21, 15], seed=5, vocab=model.config.vocab_size)
    sampled = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    manager = model.init_continuous_batching()
    s1 = manager.add_request(ps[0], max_new_tokens=8, **sampled)
    g1 = manager.add_request(ps[1], max_new_tokens=12)
    first = drain(manager)
    g2 = manager.add_request(ps[2], max_new_tokens=12, repetition_penalty=1.3)
    s2 = manager.add_request(ps[0], max_new_tokens=8, **sampled)
    second = drain(manager)
    assert first[s1].generated_tokens == second[s2].generated_tokens
    assert first[s1].generated_tokens != reference(stock, ps[0], 8)  # it did sample
    assert first[g1].generated_tokens == reference(stock, ps[1], 12)
    with torch.no_grad():
        ref = stock.generate(torch.tensor([ps[2]]), max_new_tokens=12, do_sample=False, repetition_penalty=1.3)
    assert second[g2].generated_tokens == ref[0, len(ps[2]):].tolist()
    assert_idle(model, manager)


def test_stop_sequences_end_a_request(pair):
    stock, model = pair
    (p,) = prompts([13], seed=6, vocab=model.config.vocab_size)
    ref = reference(stock, p, 16)
    stop = ref[4:6]
    out = model.generate_batch([p], max_new_tokens=16, stop_sequences=[[vocab_outside := 1, 1], stop])
    got = out["req_0"].generated_tokens
    end = next(i + 2 for i in range(len(ref) - 1) if ref[i:i + 2] == stop)
    assert vocab_outside == 1 and got == ref[:end]
    assert_idle(model)


def test_generate_batch_gives_every_prompt_the_seed_stop_sequences_and_eos(pair):
    """The settings of generate_batch / add_requests apply to every prompt: a seed (the same prompt twice
    draws the same tokens), stop sequences and an EOS id (the third prompt's, from its stock reference, end
    it where stock would). The settings dict used to be consumed by the first prompt."""
    stock, model = pair
    ps = prompts([8, 13, 10], seed=11, vocab=model.config.vocab_size)
    out = model.generate_batch([ps[0], ps[1], ps[0]], max_new_tokens=8, do_sample=True, temperature=1.0, seed=77)
    a, b, c = (out[f"req_{i}"].generated_tokens for i in range(3))
    assert len(a) == len(c) == 8 and a == c and b != a
    ref1, ref2 = reference(stock, ps[1], 12), reference(stock, ps[2], 12)
    stop = ref2[3:5]  # in the last prompt's reply only
    assert all(ref1[i:i + 2] != stop for i in range(11))
    out = model.generate_batch([ps[1], ps[2]], max_new_tokens=12, stop_sequences=[stop])
    assert out["req_0"].generated_tokens == ref1 and out["req_1"].generated_tokens == ref2[:5]
    eos = ref2[6]
    out = model.generate_batch([ps[2], ps[2]], max_new_tokens=12, eos_token_id=eos)
    assert [o.generated_tokens for o in out.values()] == [reference(stock, ps[2], 12, eos)] * 2
    assert len(out["req_1"].generated_tokens) <= 7
    assert_idle(model)


def test_a_finished_request_id_is_in_use_until_its_result_is_taken(pair):
    stock, model = pair
    (p,) = prompts([9], seed=12, vocab=model.config.vocab_size)
    manager = model.init_continuous_batching()
    manager.add_request(p, request_id="mine", max_new_tokens=3, record_timestamps=True)
    while manager.step():
        pass
    with pytest.raises(ValueError, match="'mine' is in use"):  # used to queue a second "mine"
        manager.add_request(p, request_id="mine", max_new_tokens=3)
    assert manager.get_result("mine", timeout=0).generated_tokens == reference(stock, p, 3)
    assert manager._timestamps == {}  # a finished request leaves nothing behind in the manager
    assert manager.add_request(p, request_id="mine", max_new_tokens=2) == "mine"
    assert drain(manager)["mine"].generated_tokens == reference(stock, p, 2)
    with pytest.raises(KeyError):
        manager.get_result("mine", timeout=0)
    assert_idle(model, manager)


def test_an_exception_inside_the_with_block_cancels_what_runs(pair):
    """Leaving the manager's context by an exception (a streaming loop raising, Ctrl-C) cancels the requests
    in flight instead of waiting for their last tokens; a normal exit still lets them finish."""
    stock, model = pair
    ps = prompts([6, 11, 7], seed=13, vocab=model.config.vocab_size)
    with pytest.raises(KeyboardInterrupt):
        with model.init_continuous_batching() as manager:
            rid = manager.add_request(ps[0], max_new_tokens=80, streaming=True)
            others = [manager.add_request(p, max_new_tokens=80) for p in ps[1:]]
            for partial in manager.request_id_iter(rid, timeout=120):
                if partial.generated_tokens:
                    raise KeyboardInterrupt
    assert not manager.is_running()
    results = {}
    while (out := manager.get_result(timeout=0)) is not None:
        results[out.request_id] = out
    assert set(results) == {rid, *others}
    for r, p in zip((rid, *others), ps):
        got = results[r].generated_tokens
        assert results[r].status == RequestStatus.FAILED and results[r].error == "cancelled"
        assert not got or got == reference(stock, p, len(got))
    assert min(len(r.generated_tokens) for r in results.values()) < 80
    assert_idle(model, manager)
    with pytest.raises(RuntimeError, match="was stopped"):
        manager.start()
    lazy = model.init_continuous_batching()
    lazy.start()
    lazy.stop(block=False)
    lazy.join(60)
    with pytest.raises(RuntimeError, match="was stopped"):  # used to start a loop that accepted nothing
        lazy.start()


def test_a_cancel_is_bound_to_the_request_it_named_not_to_its_id(pair):
    """A cancel of a finished request (its result taken, so its id is free) or of an id never added is a no-op,
    now and later: a request added afterwards under that id runs to its end (it used to come back FAILED,
    "cancelled", with no tokens: the engine applied pending cancels by id after queueing the new request). A
    queued request cancelled before any step ends cancelled with nothing generated; a non-str id is a
    TypeError and cannot jam the engine (two of them in one step made every later step raise)."""
    stock, model = pair
    p, q = prompts([6, 9], seed=31, vocab=model.config.vocab_size)
    manager = model.init_continuous_batching()
    manager.add_request(p, request_id="chat-1", max_new_tokens=3)
    drain(manager)
    manager.cancel_request("chat-1")  # finished and taken
    manager.cancel_request("fresh")  # never added
    manager.add_request(p, request_id="chat-1", max_new_tokens=3)
    manager.add_request(q, request_id="fresh", max_new_tokens=3)
    doomed = manager.add_request(q, max_new_tokens=3)
    manager.cancel_request(doomed)  # queued, not stepped yet
    for bad in (None, 123):
        with pytest.raises(TypeError, match=rf"request_id must be a str .*got {type(bad).__name__} {bad!r}"):
            manager.cancel_request(bad)
    results = drain(manager)
    assert results["chat-1"].error is None and results["chat-1"].generated_tokens == reference(stock, p, 3)
    assert results["fresh"].error is None and results["fresh"].generated_tokens == reference(stock, q, 3)
    assert results[doomed].error == "cancelled" and results[doomed].generated_tokens == []
    assert manager.engine.counters["cancelled"] == 1 and not manager.engine.has_work
    assert_idle(model, manager)


# ------------------------------------------------------------------------------------------ bad input
def test_bad_requests_raise_and_the_others_go_on(pair):
    stock, model = pair
    vocab = model.config.vocab_size
    (p,) = prompts([10], seed=7, vocab=vocab)
    manager = model.init_continuous_batching()
    good = manager.add_request(p, request_id="good", max_new_tokens=np.int64(6))  # as generate() takes it
    with pytest.raises(ValueError, match="empty"):
        manager.add_request([])
    with pytest.raises(ValueError, match=rf"token id {vocab}, outside the vocabulary \[0, {vocab}\)"):
        manager.add_request(p + [vocab])
    with pytest.raises(ValueError, match="token id -1"):
        manager.add_request([-1, 5])
    for bad in (0, -3, 2.0, True, np.int64(0)):
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
            manager.add_request(p, max_new_tokens=bad)
    with pytest.raises(ValueError, match="'good' is in use"):
        manager.add_request(p, request_id="good")
    with pytest.raises(GeometryError,
                       match=rf"90 tokens \+ max_new_tokens=10 is 100 tokens, more than max_seq_len={MAX_SEQ}"):
        manager.add_request(list(range(3, 93)), max_new_tokens=10)
    with pytest.raises(ValueError, match="does not take 'num_beams'"):
        manager.add_request(p, num_beams=2)
    with pytest.raises(ValueError, match="does not take 'typical_p'"):
        manager.add_request(p, do_sample=True, typical_p=0.5)
    # none of the refused requests took an automatic id; a caller's id in the sequence's way is skipped
    late = manager.add_request(p, request_id="req_1", max_new_tokens=6)
    assert [manager.add_request(p, max_new_tokens=6) for _ in range(2)] == ["req_0", "req_2"]
    for rid in (late, "req_0", "req_2"):
        manager.cancel_request(rid)
    forks = model.init_continuous_batching(generation_config=GenerationConfig(do_sample=True, num_return_sequences=2))
    with pytest.raises(ValueError, match="num_return_sequences=2"):
        forks.add_request(p)
    with pytest.raises(ValueError, match=re.escape("num_return_sequences=3: the unimem engine returns one sequence "
                                                   "per request (add the prompt that many times)")):
        manager.add_request(p, num_return_sequences=3)  # a keyword used to get only "does not take"
    beams = model.init_continuous_batching(generation_config=GenerationConfig(num_beams=2))
    with pytest.raises(UnsupportedGenerationSetting, match="num_beams=2"):
        beams.add_request(p)
    with pytest.raises(KeyError, match="no request 'nope'"):
        manager.get_result("nope", timeout=0)
    small = model.init_continuous_batching(memory=quota(model, 2))
    with pytest.raises(GeometryError, match=r"of 60 tokens \(4 pages of 16 tokens and one state\) never fits"):
        small.add_request(list(range(3, 43)), max_new_tokens=20)
    for bad in (0, -1, 2.5, True):  # 0 or less used to be taken, and then every add_request raised QueueFull
        with pytest.raises(ValueError, match=re.escape(f"max_queue must be None (no limit) or an int >= 1, "
                                                       f"got {bad!r}")):
            model.init_continuous_batching(max_queue=bad)
    full = model.init_continuous_batching(max_queue=1)
    full.add_request(p, max_new_tokens=2)
    with pytest.raises(QueueFull, match="1 requests wait already"):
        full.add_request(p, max_new_tokens=2)
    with pytest.raises(QueueFull):
        full.add_requests([p], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"^add_requests: prompt 1 of 3: input_ids is empty"):  # which one
        small.add_requests([p, [], p], max_new_tokens=2)
    assert small.metrics()["waiting"] == 0  # nothing queued
    assert full.metrics()["waiting"] == 1
    full.stop(hard_stop=True)  # the queued request is cancelled, not run
    (only,) = drain(full).values()
    assert only.request_id == "req_0"
    assert only.status == RequestStatus.FAILED and only.error == "cancelled" and only.generated_tokens == []
    assert small.add_requests([list(range(3, 13))] * 2, max_new_tokens=2) == ["req_0", "req_1"]  # after a refusal
    small.stop(hard_stop=True)
    drain(small)
    lay = model.unimem.pool.layout
    m = manager.metrics()
    assert (m["waiting"], m["running"], m["budget_bytes"]) == (4, 0, lay.memory_budget)
    results = drain(manager)
    assert results[good].generated_tokens == reference(stock, p, 6)
    assert {results[r].error for r in (late, "req_0", "req_2")} == {"cancelled"}
    m = manager.metrics()
    assert m["finished"] == 1 and m["generated_tokens"] == 6 and m["kv_bytes"] == m["state_bytes"] == 0
    # the sink and the tail pad are reported, so the four sides are the arena to the byte
    assert m["reserved_bytes"] == lay.memory_budget - lay.usable + lay.sink_floor > 0
    assert m["kv_bytes"] + m["state_bytes"] + m["free_bytes"] + m["reserved_bytes"] == lay.memory_budget
    q = small.metrics()
    assert q["reserved_bytes"] == lay.memory_budget - (small.engine.memory.kv_cap_pages * lay.page_bytes
                                                       + small.engine.memory.state_cap_slots * lay.slot_bytes)
    assert q["free_bytes"] == small.engine.memory.free_bytes()
    manager.stop()
    with pytest.raises(RuntimeError, match="after stop"):
        manager.add_request(p)
    with pytest.raises(KeyError):
        manager.get_result(good, timeout=0)  # taken already
    assert_idle(model, manager)


def test_bad_eos_ids_and_an_empty_request_id_are_refused_and_the_others_go_on(pair):
    """An EOS id outside the vocabulary can never be generated (the request silently ran to max_new_tokens),
    an empty list silently dropped the generation config's EOS ids, and request_id="" was queued under that
    falsy id; each raises now, naming the argument and the numbers, with nothing queued."""
    stock, model = pair
    vocab = model.config.vocab_size
    p, q = prompts([9, 12], seed=15, vocab=vocab)
    ref_q = reference(stock, q, 8)
    manager = model.init_continuous_batching()
    good = manager.add_request(p, max_new_tokens=5)
    for bad, shown in ((vocab, f"eos_token_id holds {vocab}, outside the vocabulary [0, {vocab})"),
                       ([7, vocab + 40], f"eos_token_id holds {vocab + 40}, outside the vocabulary [0, {vocab})"),
                       (-1, f"eos_token_id holds -1, outside the vocabulary [0, {vocab})"),
                       (torch.tensor([3, -2]), f"eos_token_id holds -2, outside the vocabulary [0, {vocab})"),
                       ([], "eos_token_id is an empty list: give at least one id, or None for the generation "
                            "config's"),
                       (torch.tensor([], dtype=torch.long), "eos_token_id is an empty list"),
                       (2.0, "eos_token_id must be a list of token ids, got float"),
                       ([3, 4.5], "eos_token_id must hold ints, got float 4.5")):
        with pytest.raises(ValueError, match=re.escape(shown)):
            manager.add_request(q, max_new_tokens=8, eos_token_id=bad)
        with pytest.raises(ValueError, match=re.escape(shown)):
            manager.add_requests([q], max_new_tokens=8, eos_token_id=bad)
    with pytest.raises(ValueError, match=re.escape('request_id is an empty string: give a non-empty str, or None '
                                                   'for an automatic id req_<n>')):
        manager.add_request(q, request_id="", max_new_tokens=8)
    assert manager.metrics()["waiting"] == 1 and "" not in manager._known
    # the largest id is in the vocabulary; numpy and 0-d tensor ids are ids, as generate() takes them
    eos = ref_q[3]
    ids = [manager.add_request(q, max_new_tokens=8, eos_token_id=e)
           for e in (np.int64(eos), torch.tensor(eos), [vocab - 1, eos], (eos,))]
    results = drain(manager)
    assert results[good].generated_tokens == reference(stock, p, 5)
    for rid in ids:
        assert results[rid].generated_tokens == reference(stock, q, 8, eos), rid
        assert results[rid].generated_tokens[-1] == eos
    assert_idle(model, manager)


def test_a_pad_id_outside_the_vocabulary_is_refused_so_no_neighbour_fails(pair):
    """A row that finishes inside a decode block feeds its pad to the embedding while its neighbours run: a
    pad_token_id past the vocabulary raised IndexError there and failed every row of the block (the
    neighbour included). add_request refuses it now, the request's or the generation config's, with the
    numbers; the neighbour runs to stock's tokens."""
    stock, model = pair
    vocab = model.config.vocab_size
    p, q = prompts([6, 11], seed=23, vocab=vocab)
    manager = model.init_continuous_batching()
    shown = f"pad_token_id={vocab + 5} is outside the vocabulary [0, {vocab})"
    with pytest.raises(ValueError, match=re.escape(shown)):
        manager.add_request(p, max_new_tokens=2, pad_token_id=vocab + 5)
    with pytest.raises(ValueError, match=re.escape(shown)):
        manager.add_requests([p], max_new_tokens=2, pad_token_id=vocab + 5)
    config = GenerationConfig(pad_token_id=vocab, eos_token_id=None)
    with pytest.raises(ValueError, match=re.escape(f"pad_token_id={vocab} is outside the vocabulary")):
        model.init_continuous_batching(config).add_request(p, max_new_tokens=2)
    assert manager.metrics()["waiting"] == 0
    # the largest id in the vocabulary is a pad: the short row ends inside the long row's block
    short = manager.add_request(p, max_new_tokens=2, pad_token_id=vocab - 1)
    long = manager.add_request(q, max_new_tokens=12)
    results = drain(manager)
    assert results[short].generated_tokens == reference(stock, p, 2)
    assert results[long].error is None and results[long].generated_tokens == reference(stock, q, 12)
    assert_idle(model, manager)


def test_a_config_edited_between_requests_applies_to_the_next_and_overrides_never_leak(pair, monkeypatch):
    """add_request resolves the generation config once and copies it per request (a deep copy and
    transformers' resolution per request cost ~300 us on a server's event-loop thread); an edit of the
    manager's or the model's config, in place or by replacing it, still applies to the next request, and one
    request's settings never reach another's."""
    _, model = pair
    (p,) = prompts([6], seed=16, vocab=model.config.vocab_size)
    mine = GenerationConfig(max_new_tokens=7, eos_token_id=[5, 6])
    manager = model.init_continuous_batching(generation_config=mine)
    resolutions = []
    resolve = model._prepare_generation_config
    monkeypatch.setattr(model, "_prepare_generation_config", lambda *a, **k: resolutions.append(1) or resolve(*a, **k))

    def queued(**kwargs):
        manager.add_request(p, **kwargs)
        return manager._inbox[-1].settings

    first = queued()
    assert (first.max_new_tokens, first.eos_token_ids, first.pad_token_id, first.do_sample) == (7, (5, 6), 0, False)
    sampled = queued(do_sample=True, temperature=0.5, top_k=9, max_new_tokens=3, eos_token_id=11, seed=2)
    assert (sampled.do_sample, sampled.temperature, sampled.top_k, sampled.max_new_tokens) == (True, 0.5, 9, 3)
    assert sampled.eos_token_ids == (11,)
    again = queued()
    assert again == first and mine.do_sample is None and mine.eos_token_id == [5, 6]  # the caller's, untouched
    assert len(resolutions) == 1  # three requests, one resolution
    mine.max_new_tokens = 4  # a field rebound
    assert queued().max_new_tokens == 4
    mine.eos_token_id.append(9)  # a list field changed in place
    assert queued().eos_token_ids == (5, 6, 9)
    saved_model_config = model.generation_config
    try:
        model.generation_config = GenerationConfig(pad_token_id=3, eos_token_id=2)  # the model's, replaced
        assert queued().pad_token_id == 3
        model.generation_config.pad_token_id = 4  # ... and edited in place
        assert queued().pad_token_id == 4
    finally:
        model.generation_config = saved_model_config
    assert queued().pad_token_id == 0
    manager.generation_config = GenerationConfig(max_new_tokens=2)  # the manager's, replaced
    assert queued().max_new_tokens == 2
    manager.stop(hard_stop=True)
    assert {r.error for r in drain(manager).values()} == {"cancelled"}
    assert_idle(model, manager)


def test_generate_batch_refuses_what_is_not_a_list_of_prompts(pair):
    """A tokenizer's 2-D batch used to raise torch's "Boolean value of Tensor ... is ambiguous", one flat
    prompt "input_ids must be a list of token ids, got int" (it is one); each now says what to pass."""
    _, model = pair
    batch = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with pytest.raises(ValueError, match=re.escape("generate_batch takes a list of prompts (each a list of token ids "
                                                   "or a 1-D tensor), got a tensor of shape [2, 3]")):
        model.generate_batch(batch, max_new_tokens=2)
    with pytest.raises(ValueError, match="got one list of 3 token ids: wrap a single prompt as"):
        model.generate_batch([5, 6, 7], max_new_tokens=2)
    with pytest.raises(ValueError, match="not text: encode the prompts"):
        model.generate_batch("hello", max_new_tokens=2)
    manager = model.init_continuous_batching()
    with pytest.raises(ValueError, match="add_requests takes a list of prompts, got one list of 2 token ids"):
        manager.add_requests(torch.tensor([5, 6]), max_new_tokens=2)
    assert manager.add_requests(list(batch), max_new_tokens=2) == ["req_0", "req_1"]  # 1-D rows are prompts
    assert [len(r.generated_tokens) for r in drain(manager).values()] == [2, 2]
    assert_idle(model, manager)


def test_a_request_whose_step_raises_fails_alone(pair, monkeypatch):
    stock, model = pair
    ps = prompts([12, 8, 16], seed=8, vocab=model.config.vocab_size)
    manager = model.init_continuous_batching(max_prefill_rows=1)  # a forward per request (packing: the next test)
    engine = manager.engine
    original = engine._prefill_chunk

    def flaky(req, chunk):
        if req.rid == "bad":
            raise RuntimeError("planted failure")
        return original(req, chunk)

    monkeypatch.setattr(engine, "_prefill_chunk", flaky)
    ids = [manager.add_request(ps[0], max_new_tokens=6),
           manager.add_request(ps[1], request_id="bad", max_new_tokens=6),
           manager.add_request(ps[2], max_new_tokens=6)]
    results = drain(manager)
    assert results["bad"].status == RequestStatus.FAILED and "planted failure" in results["bad"].error
    for rid, p in ((ids[0], ps[0]), (ids[2], ps[2])):
        assert results[rid].status == RequestStatus.FINISHED
        assert results[rid].generated_tokens == reference(stock, p, 6)
    assert engine.counters["failed"] == 1
    assert_idle(model, manager)


def test_short_prompts_share_one_prefill_forward(pair):
    """Whole prompts that fit what is left of the step's budget share one left-padded forward (up to
    max_prefill_rows of them, here the model's 2 rows): stock's tokens, the pads counted; max_prefill_rows=1
    gives every prompt a forward of its own, with the same tokens."""
    stock, model = pair
    lengths = [5, 12, 7, 9, 3, 11]
    batch = prompts(lengths, seed=17, vocab=model.config.vocab_size)
    refs = [reference(stock, p, 6) for p in batch]
    assert all(len(r) == 6 for r in refs)  # no EOS: the pairs below finish together, so they are admitted in pairs
    for rows in (8, 1):
        manager = model.init_continuous_batching(max_prefill_tokens=40, max_prefill_rows=rows)
        ids = manager.add_requests(batch, max_new_tokens=6)
        results = drain(manager)
        for i, rid in enumerate(ids):
            assert results[rid].status == RequestStatus.FINISHED and results[rid].generated_tokens == refs[i], rid
        c = manager.engine.counters
        assert c["prefill_tokens"] == sum(lengths)
        if rows == 8:  # pairs (5, 12), (7, 9), (3, 11): each padded to its longer prompt
            assert (c["prefill_chunks"], c["packed_forwards"], c["packed_rows"]) == (3, 3, 6)
            assert c["prefill_pads"] == (12 - 5) + (9 - 7) + (11 - 3)
        else:
            assert (c["prefill_chunks"], c["packed_forwards"], c["packed_rows"], c["prefill_pads"]) == (6, 0, 0, 0)
        assert_idle(model, manager)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="max_prefill_rows must be an int >= 1"):
            model.init_continuous_batching(max_prefill_rows=bad)


def test_packed_prefill_of_a_rope_model_stores_each_row_at_its_own_positions():
    """deepseek-v3-tiny (MLA with RoPE, no linear-attention layers: rows without state slots): a packed, left-padded
    prefill stores every row's latent KV as the same prompts prefilled one per forward do (each row's positions
    start at its first token, not at its pads), and the tokens are stock's. Without the packed forward's own
    position ids a row with k pads was stored rotated k positions on (found by review, 2026-12-03: the first token
    was right, later ones drifted at near-ties), which token comparisons alone catch only by luck."""
    torch._dynamo.reset()
    stock, model = build_model("deepseek-v3-tiny"), build_model("deepseek-v3-tiny")
    unimem_compile.compile(model, max_batch_size=4, max_seq_len=MAX_SEQ, page_size=PAGE, backend="aot_eager")
    ps = prompts([5, 3, 6, 2], seed=5, vocab=model.config.vocab_size)
    pool = model.unimem.pool
    stored, forwards = {}, {}
    for rows in (1, 8):
        manager = model.init_continuous_batching(max_prefill_tokens=64, max_prefill_rows=rows)
        ids = manager.add_requests(ps, max_new_tokens=9)
        manager.step()  # admission and prefill of all four
        for rid, p in zip(ids, ps):
            pages = manager.engine.memory.pages[rid]
            loc = torch.tensor([pages[t // PAGE] * PAGE + t % PAGE for t in range(len(p))])
            stored[rows, rid] = torch.stack([pool.read_kv(layer, loc).float()
                                             for layer in range(pool.layout.layer_num)])
        results = drain(manager)
        forwards[rows] = manager.engine.counters["packed_forwards"]
        for rid, p in zip(ids, ps):
            assert results[rid].generated_tokens == reference(stock, p, 9), (rows, rid)
        assert_idle(model, manager)
    assert forwards == {1: 0, 8: 1}
    for rid in ids:  # fp32 on the CPU: the same values up to the rounding of a batched matmul
        torch.testing.assert_close(stored[8, rid], stored[1, rid], rtol=0, atol=1e-5)


def test_a_packed_cache_refuses_rows_it_cannot_serve_and_stores_nothing(pair):
    """UnifiedCache.over_packed_rows: no rows, or slots for some rows only, are refused; a row whose pages
    cannot hold its prompt fails the step before anything is stored (the owner allocates, never the cache),
    and the error names that row."""
    from unimem_compile.engine import PoolMemory
    from unimem_compile.hf.cache import UnifiedCache

    _, model = pair
    handle = model.unimem
    with pytest.raises(GeometryError, match="at least one row"):
        UnifiedCache.over_packed_rows(handle, [])
    memory = PoolMemory(handle.pool)
    memory.admit("a", 20)  # 2 pages of 16
    memory.admit("b", 5)  # 1 page: too few for 20 tokens
    try:
        with pytest.raises(GeometryError, match="needs a state slot or none"):
            UnifiedCache.over_packed_rows(handle, [(memory.pages["a"], memory.slots["a"]), (memory.pages["b"], None)])
        cache = UnifiedCache.over_packed_rows(handle, [(memory.pages[r], memory.slots[r]) for r in "ab"])
        ids = torch.randint(3, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(5))
        before = handle.pool.arena.clone()
        with pytest.raises(GeometryError, match="borrowed row 1 holds 1 pages of 16 tokens, the step needs 20"):
            cache.prepare_step(ids, torch.ones(2, 20, dtype=torch.int64))
        assert torch.equal(handle.pool.arena, before)
        assert memory.pages["a"] and len(memory.pages["b"]) == 1  # the owner's lists untouched
    finally:
        memory.release("a")
        memory.release("b")
    assert_idle(model)


def test_a_packed_prefill_that_raises_fails_its_requests_and_the_others_go_on(pair, monkeypatch):
    stock, model = pair
    ps = prompts([12, 8, 16], seed=9, vocab=model.config.vocab_size)
    manager = model.init_continuous_batching(max_prefill_tokens=30)  # 12 + 8 pack (24), 16 comes later
    engine = manager.engine
    original = engine._prefill_packed

    def flaky(group, width):
        if any(r.rid == "bad" for r in group):
            raise RuntimeError("planted failure")
        return original(group, width)

    monkeypatch.setattr(engine, "_prefill_packed", flaky)
    first = manager.add_request(ps[0], max_new_tokens=6)
    manager.add_request(ps[1], request_id="bad", max_new_tokens=6)
    last = manager.add_request(ps[2], max_new_tokens=6)
    results = drain(manager)
    for rid in (first, "bad"):
        assert results[rid].status == RequestStatus.FAILED and "planted failure" in results[rid].error
    assert results[last].status == RequestStatus.FINISHED
    assert results[last].generated_tokens == reference(stock, ps[2], 6)
    assert engine.counters["failed"] == 2
    assert_idle(model, manager)


def test_generate_between_two_engine_steps(pair):
    """generate() between two engine steps (the generate lock orders them): it rewrites the runner's row
    state, the engine puts its rows back, and both give stock's tokens."""
    stock, model = pair
    ps = prompts([14, 19, 11], seed=9, vocab=model.config.vocab_size)
    manager = model.init_continuous_batching()
    ids = [manager.add_request(p, max_new_tokens=10) for p in ps[:2]]
    manager.step()
    manager.step()
    assert manager.engine.rows  # decoding
    with torch.no_grad():
        got = model.generate(torch.tensor([ps[2]]), max_new_tokens=10, do_sample=False)
    assert got[0, len(ps[2]):].tolist() == reference(stock, ps[2], 10)
    results = drain(manager)
    for rid, p in zip(ids, ps):
        assert results[rid].generated_tokens == reference(stock, p, 10)
    assert_idle(model, manager)


# ------------------------------------------------------------------------------------------ state machine
class ManagerMachine(RuleBasedStateMachine):
    """add / cancel / step / stop at random on an unstarted manager over a 5-page KV share (preemption)."""

    stock = model = None
    pool_prompts: list[list[int]] = []
    served = preempted = 0  # over every example: the machine really ran requests, and preempted some

    def __init__(self):
        super().__init__()
        self.manager = self.model.init_continuous_batching(memory=quota(self.model, 5), max_prefill_tokens=20)
        self.added: dict[str, tuple[int, int]] = {}  # rid -> (prompt index, max_new)
        self.results: dict[str, object] = {}
        self.cancelled: set[str] = set()
        self.stopped = False

    def _collect(self):
        while (out := self.manager.get_result(timeout=0)) is not None:
            if out.is_finished():
                assert out.request_id not in self.results, "a request finished twice"
                self.results[out.request_id] = out

    @initialize(first=st.lists(st.tuples(st.integers(0, 3), st.integers(12, 20)), min_size=3, max_size=3))
    def start_with_requests(self, first):
        # hypothesis tries short programs first: three requests that outgrow the share make every one count
        for prompt, max_new in first:
            self.add(prompt, max_new)

    @rule(prompt=st.integers(0, 3), max_new=st.integers(1, 16))
    def add(self, prompt, max_new):
        if self.stopped:
            with pytest.raises(RuntimeError):
                self.manager.add_request(self.pool_prompts[prompt])
            return
        rid = self.manager.add_request(self.pool_prompts[prompt], max_new_tokens=max_new)
        self.added[rid] = (prompt, max_new)

    @rule(data=st.data())
    def cancel(self, data):
        if self.added:
            rid = data.draw(st.sampled_from(sorted(self.added)))
            self.manager.cancel_request(rid)
            self.cancelled.add(rid)

    @rule(n=st.integers(1, 3))
    def step(self, n):
        for _ in range(n):
            self.manager.step()
        self._collect()

    @rule()
    def stop(self):
        self.manager.stop()
        self.stopped = True

    @invariant()
    def memory_matches_the_running_requests(self):
        e = self.manager.engine
        running = {r.rid for r in e.scheduler.running}
        assert set(e.memory.pages) == running and set(e.memory.slots) == running
        alloc = e.memory.pool.allocator
        assert alloc.pages_used == sum(map(len, e.memory.pages.values()))
        assert alloc.slots_used == len(running)
        assert len(e.rows) <= BATCH

    def teardown(self):
        while self.manager.step():
            pass
        self._collect()
        assert set(self.results) == set(self.added), "a request was lost"
        ManagerMachine.served += len(self.results)
        ManagerMachine.preempted += self.manager.engine.counters["preemptions"]
        for rid, (prompt, max_new) in self.added.items():
            out = self.results[rid]
            ref = reference(self.stock, self.pool_prompts[prompt], max_new)
            if out.status == RequestStatus.FAILED:
                assert rid in self.cancelled and out.error == "cancelled"
                assert out.generated_tokens == ref[:len(out.generated_tokens)]
            else:
                assert out.status == RequestStatus.FINISHED
                assert out.generated_tokens == ref, rid
        assert_idle(self.model, self.manager)


def test_manager_state_machine(pair):
    ManagerMachine.stock, ManagerMachine.model = pair
    ManagerMachine.pool_prompts = prompts([9, 30, 22, 40], seed=10, vocab=pair[1].config.vocab_size)
    for p in ManagerMachine.pool_prompts:  # the longest a request of the machine asks for: one stock run each
        reference(pair[0], p, 20)
    ManagerMachine.TestCase.settings = settings(max_examples=2, stateful_step_count=6, derandomize=True, deadline=None,
                                                suppress_health_check=list(HealthCheck))
    ManagerMachine.TestCase().runTest()
    assert ManagerMachine.served > 0 and ManagerMachine.preempted > 0
