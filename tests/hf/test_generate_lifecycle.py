"""Caches across generate() calls: conversations continued from a passed cache, release and reset, caches
dropped without release (collected, in a reference cycle), a failed call's cache, the deferred stop check,
and a pool too small for the rows (the compile warning, PoolExhausted with the numbers)."""

import warnings

import pytest
import torch

import unimem_compile
from unimem_compile.errors import GeometryError, UnsupportedModel
from unimem_compile.hf.models import build_model

from .generate_models import greedy, prompts


def test_deferred_stop_check_is_off_on_the_cpu_and_refused_when_asked_for(small):
    # transformers' DeferredStopCheck waits on device events, which the CPU has none of (the CUDA
    # behaviour is tested in tests/gpu/test_generate_gpu.py)
    assert small.unimem.deferred_stop_check is None  # automatic: never on the CPU
    assert not small.unimem.defers_stop_check(64)
    with pytest.raises(ValueError, match="deferred_stop_check needs a CUDA model.*pool is on cpu"):
        small.unimem.deferred_stop_check = True
    with pytest.raises(TypeError, match="must be True, False or None, got 1"):
        small.unimem.deferred_stop_check = 1
    assert small.unimem.deferred_stop_check is None
    with pytest.raises(ValueError, match="deferred_stop_check=True needs a CUDA model.*model is on cpu"):
        unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=1, max_seq_len=16,
                               deferred_stop_check=True)


def test_the_deferred_stop_hook_leaves_other_caches_to_transformers(small):
    from transformers import DynamicCache
    from transformers.generation.utils import DeferredStopCheck

    from unimem_compile.hf.runtime import _install_deferred_stop_hook

    assert _install_deferred_stop_hook()  # idempotent: installed once per process
    assert getattr(DeferredStopCheck.is_supported, "_unimem_hook", False)
    cuda, mps = torch.device("cuda"), torch.device("mps")
    # transformers' own rule for every cache but ours: mps only, never for an assistant
    assert DeferredStopCheck.is_supported(cuda, DynamicCache(), False, is_assistant=False) is False
    assert DeferredStopCheck.is_supported(mps, None, False, is_assistant=False) is True
    cache = small.unimem.new_cache(1)
    try:
        assert DeferredStopCheck.is_supported(cuda, cache, True, is_assistant=False) is False
        cache.defer_stop_check = True  # what generate() sets on the caches it creates for a CUDA model
        assert DeferredStopCheck.is_supported(cuda, cache, True, is_assistant=False) is True
        assert DeferredStopCheck.is_supported(cuda, cache, True, is_assistant=True) is False
        cache.activate_past_recording()
        cache.crop(0)
        cache.crop(-1)
        assert cache.undone_steps == 1
    finally:
        cache.release()


def test_a_cache_the_caller_passes_never_rolls_back(small):
    cache = small.unimem.new_cache(1)
    try:
        assert cache.defer_stop_check is False
        cache.crop(0)  # a no-op on every cache
        with pytest.raises(NotImplementedError, match="cannot record past states"):
            cache.activate_past_recording()
        with pytest.raises(NotImplementedError, match=r"crop\(-1\) is not supported"):
            cache.crop(-1)
    finally:
        cache.release()


def test_generate_continues_from_a_cache_it_was_given(pair):
    """A second generate() given the same UnifiedCache and the returned sequences (plus a few new prompt
    tokens) continues from the cached tokens exactly as stock transformers does with a DynamicCache, and
    equals a fresh run over the whole sequence."""
    from transformers import DynamicCache

    from unimem_compile.hf.generate_checks import _cache_kwarg

    stock, model, _ = pair
    key = _cache_kwarg(stock)  # "cache" in recent transformers, "past_key_values" in older ones
    ids, _ = prompts([12, 12], seed=21)
    extra = torch.randint(3, 1024, (2, 5), generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        dynamic = DynamicCache(config=stock.config)
        first = stock.generate(ids, max_new_tokens=6, do_sample=False, **{key: dynamic})
        want = stock.generate(torch.cat([first, extra], 1), max_new_tokens=4, do_sample=False, **{key: dynamic})
        fresh = stock.generate(torch.cat([first, extra], 1), max_new_tokens=4, do_sample=False)
        cache = model.unimem.new_cache(2)
        got_first = model.generate(ids, max_new_tokens=6, do_sample=False, **{key: cache})
        assert torch.equal(got_first, first)
        assert int(cache.get_seq_length()) == first.shape[1] - 1  # every token but the last one generated
        got = model.generate(torch.cat([got_first, extra], 1), max_new_tokens=4, do_sample=False, **{key: cache})
    assert torch.equal(want, fresh) and torch.equal(got, want)
    assert model.unimem.stats()["kv_pages_used"] > 0  # the caller's cache keeps its pages until released
    cache.release()
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def test_interleaved_conversations_of_one_row_count_each_continue_like_stock(pair):
    """Two live caches of 2 rows (sharing the model's step buffers) take turns, with a cache-less generate()
    of 2 rows and the release of a third cache in between: every turn equals stock transformers'
    continuation, so a cache whose tables are not in the buffers uploads them before its step."""
    from transformers import DynamicCache

    from unimem_compile.hf.generate_checks import _cache_kwarg

    stock, model, _ = pair
    key = _cache_kwarg(stock)
    g = torch.Generator().manual_seed(31)
    conversations = [prompts([10, 10], seed=32)[0], prompts([14, 14], seed=33)[0]]
    dynamic = [DynamicCache(config=stock.config) for _ in conversations]
    caches = [model.unimem.new_cache(2) for _ in conversations]
    stray = model.unimem.new_cache(2)
    try:
        with torch.no_grad():
            stray.prepare_step(torch.randint(3, 1024, (2, 9), generator=g), None)
            for turn in range(3):
                for c in range(2):
                    if turn:
                        extra = torch.randint(3, 1024, (2, 3), generator=g)
                        conversations[c] = torch.cat([conversations[c], extra], 1)
                    want = stock.generate(conversations[c], max_new_tokens=4, do_sample=False, **{key: dynamic[c]})
                    got = model.generate(conversations[c], max_new_tokens=4, do_sample=False, **{key: caches[c]})
                    assert torch.equal(got, want), (turn, c)
                    conversations[c] = got
                    if turn == 1 and c == 0:  # a cache-less call of the same row count in between
                        ids, mask = prompts([8, 6], seed=34)
                        assert torch.equal(greedy(model, ids, mask, 3), greedy(stock, ids, mask, 3))
                    if turn == 1 and c == 1:  # and the release of a cache that is not resident
                        stray.release()
    finally:
        for cache in caches + [stray]:
            cache.release()
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def test_a_released_cache_can_be_reset_and_used_beside_a_live_one(small):
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(4))
    first = small.unimem.new_cache(1)
    first.prepare_step(ids, None)
    first.release()
    second = small.unimem.new_cache(1)
    second.prepare_step(ids, None)
    table = second.page_tables._host_table.clone()
    first.reset()
    assert not first.released
    first.prepare_step(torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(5)), None)
    assert first.buffers is second.buffers and first.page_tables.rows[0] != second.page_tables.rows[0]
    second.prepare_step(torch.cat([ids, ids[:, :1]], 1), None)  # second's tables go back into the buffers
    assert torch.equal(second.buffers.page_table.cpu(), second.page_tables._host_table)
    assert second.page_tables._host_table[0, : table.shape[1]].tolist() == table[0].tolist()
    for cache in (first, second):
        cache.release()
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


def test_a_cache_collected_without_release_gives_its_memory_back_to_the_next_cache(small):
    import gc

    handle = small.unimem
    cache = handle.new_cache(2)
    cache.prepare_step(torch.randint(3, 100, (2, 20), generator=torch.Generator().manual_seed(6)), None)
    assert handle.stats()["kv_pages_used"] > 0 and handle.stats()["state_slots_used"] == 2
    del cache
    gc.collect()  # the cache object is gone; its pages and slots are queued, not yet freed
    again = handle.new_cache(2)  # reclaims the collected cache's pages and slot first
    try:
        assert handle.stats()["kv_pages_used"] == 0 and handle.stats()["state_slots_used"] == 0
        assert handle.reclaim_orphans() == 0
    finally:
        again.release()
    handle.pool.allocator.check_invariants()


def test_a_failed_generate_releases_the_cache_it_was_given(small):
    """A step that fails half way leaves tables that no longer match the cached tokens: the caller's cache is
    released (its memory returned) and a later use says why, instead of continuing from corrupt state."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Boom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[1] >= 9:
                raise RuntimeError("stop here")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids, mask = prompts([6, 6], seed=4)
    cache = small.unimem.new_cache(2)
    with pytest.raises(RuntimeError, match="stop here"), torch.no_grad():
        small.generate(ids, attention_mask=mask, max_new_tokens=6, past_key_values=cache,
                       stopping_criteria=StoppingCriteriaList([Boom()]))
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0
    with pytest.raises(UnsupportedModel, match=r"released \(generate\(\) raised RuntimeError while using it\)"):
        small.generate(ids, attention_mask=mask, max_new_tokens=2, past_key_values=cache)


def test_a_caller_cache_survives_a_call_refused_before_any_step(small):
    from transformers import DynamicCache

    from unimem_compile.hf.generate_checks import _cache_kwarg

    stock = build_model("kimi-linear-tiny")
    key = _cache_kwarg(stock)
    ids, _ = prompts([9, 9], seed=41)
    extra = torch.randint(3, 1024, (2, 3), generator=torch.Generator().manual_seed(42))
    cache, dynamic = small.unimem.new_cache(2), DynamicCache(config=stock.config)
    try:
        with torch.no_grad():
            with pytest.raises(ValueError, match="max_new_tokens"):  # transformers refuses it up front
                small.generate(ids, max_new_tokens=0, do_sample=False, **{key: cache})
            assert not cache.released
            first = small.generate(ids, max_new_tokens=4, do_sample=False, **{key: cache})
            assert torch.equal(first, stock.generate(ids, max_new_tokens=4, do_sample=False, **{key: dynamic}))
            with pytest.raises(ValueError, match="not_a_kwarg"):  # a typo, mid-conversation
                small.generate(torch.cat([first, extra], 1), max_new_tokens=3, not_a_kwarg=1, **{key: cache})
            assert not cache.released
            got = small.generate(torch.cat([first, extra], 1), max_new_tokens=3, do_sample=False, **{key: cache})
            want = stock.generate(torch.cat([first, extra], 1), max_new_tokens=3, do_sample=False,
                                  **{key: dynamic})
        assert torch.equal(got, want)
    finally:
        cache.release()
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


@pytest.mark.parametrize("drop", ["collected", "in_a_cycle"])
def test_a_live_cache_growing_into_a_full_pool_gets_the_memory_of_a_dropped_one(small, drop):
    # "in_a_cycle": a cache in a reference cycle outlives its last name until the cycle collector runs (here:
    # never, gc is off); an allocation that finds the pool full collects garbage once and retries (it used to
    # raise PoolExhausted)
    import gc

    from unimem_compile.hf.generate_checks import _cache_kwarg

    key = _cache_kwarg(small)
    pool = small.unimem.pool
    ids = torch.randint(3, 1000, (1, 30), generator=torch.Generator().manual_seed(43))
    live, dropped = small.unimem.new_cache(1), small.unimem.new_cache(1)
    filler = []
    was_enabled = gc.isenabled()
    if drop == "in_a_cycle":
        gc.disable()
    try:
        with torch.no_grad():
            first = small.generate(ids[:, :6], max_new_tokens=2, do_sample=False, **{key: live})  # 1 page
            small.generate(ids[:, :26], max_new_tokens=2, do_sample=False, **{key: dropped})  # 4 pages
            while pool.allocator.can_alloc("kv", 1):  # fill the rest of the arena
                filler += pool.alloc_pages(1)
            if drop == "in_a_cycle":
                dropped.cycle = dropped
            del dropped
            if drop == "collected":
                gc.collect()
            else:
                assert small.unimem.reclaim_orphans() == 0  # unreachable, not collected
            # the live row needs 2 more pages: only the dropped cache's pages can give them; the dropped cache
            # shared the live one's step buffers, which returning its rows empties in the middle of the step
            more = torch.cat([first, ids[:, :12]], 1)
            got = small.generate(more, max_new_tokens=6, do_sample=False, **{key: live})
        assert not live.released and small.unimem.reclaim_orphans() == 0
        with torch.no_grad():
            want = build_model("kimi-linear-tiny").generate(more, max_new_tokens=6, do_sample=False)
        assert torch.equal(got, want)
    finally:
        if was_enabled:
            gc.enable()
        live.release()
        pool.free_pages(filler)
    assert small.unimem.stats()["kv_pages_used"] == 0 and small.unimem.stats()["state_slots_used"] == 0


def test_the_inferred_mask_hint_does_not_outlive_its_call(small):
    cache = small.unimem.new_cache(2)
    ids, _ = prompts([6, 6], seed=44)
    right = torch.ones_like(ids)
    right[1, 4:] = 0  # right padding, passed explicitly
    try:
        with pytest.raises(GeometryError, match="inferred one from pad_token_id"):
            small.generate(ids.masked_fill(right == 0, 0), max_new_tokens=2, pad_token_id=0, cache=cache)
        cache.reset()
        with pytest.raises(GeometryError, match="only left padding is supported") as e:
            small.generate(ids, attention_mask=right, max_new_tokens=2, pad_token_id=0, cache=cache)
        assert "inferred" not in str(e.value)
    finally:
        cache.release()


def test_a_budget_short_of_max_batch_size_full_rows_warns_with_the_rows_it_holds():
    from unimem_compile.pool import ArenaLayout

    model = build_model("kimi-linear-tiny")
    adapter = unimem_compile.hf.adapters.adapter_for(model)
    budget = ArenaLayout.for_capacity(adapter.kv_spec, adapter.state_spec, 16, 2 * 4, 2).memory_budget  # 2 rows
    with pytest.warns(UserWarning, match=f"memory_budget of {budget} bytes holds 2 full rows of max_seq_len=64 "
                                         "tokens and their states, fewer than max_batch_size=4"):
        unimem_compile.compile(model, max_batch_size=4, max_seq_len=64, page_size=16, memory_budget=budget,
                               backend="aot_eager")
    assert model.unimem.full_rows == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a budget of max_batch_size full rows says nothing
        other = unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=2, max_seq_len=64,
                                       page_size=16, memory_budget=budget, backend="aot_eager")
    assert other.unimem.full_rows == 2


# phase -> (rows' prompt lengths, (pages, slots) the budget is sized for, new tokens, the allocations the
# cache makes up to the failing one: (side, count)); page size 16, max_seq_len 64
EXHAUSTION = {
    # three rows' slots do not fit next to one full row's pages: the prefill fails on the state side
    "prefill_slots": ([40, 40, 40], (4, 1), 4, [("state", 3)]),
    # two rows' prefill (two pages, two slots) fits; crossing the first page boundary needs two more pages
    "decode_pages": ([10, 10], (3, 2), 10, [("state", 2), ("kv", 2), ("kv", 2)]),
}


@pytest.mark.parametrize("phase", list(EXHAUSTION))
def test_pool_exhaustion_surfaces_as_pool_exhausted_with_the_numbers_and_leaks_nothing(phase):
    from unimem_compile.errors import PoolExhausted
    from unimem_compile.pool import ArenaLayout, UnifiedPool

    lengths, (pages, slots), new_tokens, replay = EXHAUSTION[phase]
    model = build_model("kimi-linear-tiny")
    adapter = unimem_compile.hf.adapters.adapter_for(model)
    budget = ArenaLayout.for_capacity(adapter.kv_spec, adapter.state_spec, 16, pages, slots).memory_budget
    unimem_compile.compile(model, max_batch_size=4, max_seq_len=64, page_size=16, memory_budget=budget,
                           backend="aot_eager")
    layout = model.unimem.pool.layout
    assert not layout.fits(pages + 1, slots) and not layout.fits(pages, slots + 1)
    ids, mask = prompts(lengths, seed=4)
    with torch.compiler.set_stance("force_eager"), pytest.raises(PoolExhausted) as info:
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens)
    # the same allocations replayed on a fresh pool of the same layout fail with the same numbers
    twin = UnifiedPool(layout)
    *fitting, (side, n) = replay
    for s, k in fitting:
        (twin.alloc_pages if s == "kv" else twin.alloc_slots)(k)
    with pytest.raises(PoolExhausted) as want:
        (twin.alloc_pages if side == "kv" else twin.alloc_slots)(n)
    got, want = info.value, want.value
    unit = layout.page_bytes if side == "kv" else layout.slot_bytes
    assert (got.side, got.requested, got.available, got.reclaimable) == (side, n * unit, want.available,
                                                                         want.reclaimable)
    assert got.requested > got.available and str(got).startswith(f"{want}; the arena of {layout.memory_budget} bytes")
    assert "give unimem_compile.compile() a larger memory_budget" in str(got)
    held = {side: sum(k for s, k in fitting if s == side) for side in ("kv", "state")}
    assert f"{held['kv']} KV pages and {held['state']} state slots were in use when it ran out" in str(got)
    assert f"({n * unit} bytes)" in str(got) and f"({want.available} bytes)" in str(got)
    stats = model.unimem.stats()
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0
    model.unimem.pool.allocator.check_invariants()
