"""generate() from several threads (one lock per model) and under torch.inference_mode() and outside it."""

import pytest
import torch

import unimem_compile
from unimem_compile.hf.models import build_model

from .generate_models import greedy, prompts


# the hybrid family only: the lock, the step buffers and the patched globals are the same code for both families
# (the deepseek run cost CI ~19 s of compiles for its new shapes)
@pytest.mark.parametrize("pair", ["kimi-linear-tiny"], indirect=True)
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
    tensors, and every later call outside it failed.

    The calls inside inference mode run the compiled graphs (the only test that compiles under it); the
    calls outside run eagerly (``force_eager``: the same cache path and decode runner, writing the same
    tensors in place, tests/hf/test_generate_parity.py), because Dynamo guards on the grad mode and would
    compile every graph a second time for them (4 graphs instead of 2); compiled calls outside inference
    mode are what every other test makes. Each tensor is made inside and then written outside: the pool,
    batch size 2's step buffers and a cache (one batch size: the next test covers step buffers of any size
    made inside inference mode)."""
    stock = build_model("kimi-linear-tiny")
    ids, mask = prompts([10, 7], seed=32)
    want = greedy(stock, ids, mask, 4)
    with torch.inference_mode():
        model = unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=2, max_seq_len=32,
                                       page_size=8, backend="aot_eager")
        assert torch.equal(greedy(model, ids, mask, 4), want)
        cache = model.unimem.new_cache(2)
    assert model.unimem.passes.graphs == 2  # prefill and decode step at batch size 2
    with torch.compiler.set_stance("force_eager"):
        assert torch.equal(greedy(model, ids, mask, 4), want)
        assert torch.equal(greedy(model, ids, mask, 4, past_key_values=cache), want)
        cache.release()
    assert model.unimem.passes.graphs == 2  # outside: eager (force_eager compiles nothing)
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def test_step_buffers_first_made_inside_inference_mode_are_written_outside_it():
    # transformers' own decode loop reads the handle's step buffers (the runner has its own, so the test above
    # does not reach them); an inference tensor would refuse the in-place writes of every later call
    model = unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=2, max_seq_len=32,
                                   page_size=8, backend="aot_eager")  # nothing is traced before a call
    with torch.inference_mode():
        buffers = model.unimem.step_buffers(2)
    tensors = {name: getattr(buffers, name) for name in ("page_table", "kv_len", "out_offset", "slot_ids",
                                                         "decode_loc")}
    assert {name: t.is_inference() for name, t in tensors.items()} == dict.fromkeys(tensors, False)
    values = torch.randint(0, 7, tensors["kv_len"].shape, generator=torch.Generator().manual_seed(5),
                           dtype=tensors["kv_len"].dtype)
    tensors["kv_len"].copy_(values)  # outside inference mode: an inference tensor raises here
    assert torch.equal(model.unimem.step_buffers(2).kv_len, values)


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
