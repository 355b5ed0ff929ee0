"""Churn through generate(): about two hundred calls with random batch sizes, prompt lengths and output
lengths against one pool of the tiny Kimi-Linear model (MLA + KDA layers).

After every call the pool is empty, its invariants hold and every byte past the sink is poison again (no
page or slot leaked, nothing was written outside a live page or slot). Every request's teacher-forced
logits in its (left-padded) batch equal the same request generated alone within TOLERANCE (fp32). The
pool runs with ``UNIMEM_DEBUG=1``: free memory is poisoned, so a read of an unwritten or freed row would
turn logits into NaN, and every op checks its ids against the live set.

``torch.compiler.set_stance("force_eager")`` runs the compiled forward eagerly: the cache, the ops and the
pool do exactly what they do under compilation (allocation happens eagerly either way), without paying
for a graph per prompt length.
"""

import random

import torch

import unimem_compile
from unimem_compile.demo import teacher_forced_logits
from unimem_compile.hf.models import build_model

from ..prompts import left_padded

#: max |logit(batched) - logit(alone)|: fp32 sums in a different order (padding changes the shapes);
#: observed about 2e-6 on logits of order 1
TOLERANCE = 1e-4
BATCHES = 56  # with the requests run alone: about 200 generate() calls
MAX_PROMPT, MAX_NEW = 20, 12


def _left_padded(lengths, gen):
    ids, mask = left_padded(lengths, gen)
    return ids, (None if bool(mask.all()) else mask)


def _assert_pool_empty_and_clean(pool, poison_audit):
    a, lay = pool.allocator, pool.layout
    assert a.pages_used == 0 and a.slots_used == 0, (a.pages_used, a.slots_used)
    assert a.kv_watermark == lay.num_pages and a.state_watermark == lay.first_slot
    a.check_invariants()
    assert poison_audit(pool), "the sink or a byte outside every live page / slot was written"


def test_generate_churn_leaks_nothing_and_each_request_in_a_batch_matches_it_alone(monkeypatch, poison_audit):
    monkeypatch.setenv("UNIMEM_DEBUG", "1")
    model = unimem_compile.compile(build_model("kimi-linear-tiny"), max_batch_size=4,
                                   max_seq_len=MAX_PROMPT + MAX_NEW, page_size=4, backend="eager")
    pool = model.unimem.pool
    assert pool.poison
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    calls, worst = 0, 0.0
    with torch.compiler.set_stance("force_eager"):
        for _ in range(BATCHES):
            lengths = [rng.randint(1, MAX_PROMPT) for _ in range(rng.randint(1, 4))]
            new = rng.randint(1, MAX_NEW)
            ids, mask = _left_padded(lengths, gen)
            continuation = torch.randint(3, 1024, (len(lengths), new), generator=gen)
            batched = teacher_forced_logits(model, ids, mask, continuation)
            calls += 1
            _assert_pool_empty_and_clean(pool, poison_audit)
            assert bool(batched.isfinite().all())
            for i, n in enumerate(lengths):
                alone = teacher_forced_logits(model, ids[i:i + 1, ids.shape[1] - n:], None, continuation[i:i + 1])
                calls += 1
                _assert_pool_empty_and_clean(pool, poison_audit)
                worst = max(worst, float((batched[i] - alone[0]).abs().max()))
                torch.testing.assert_close(batched[i], alone[0], atol=TOLERANCE, rtol=0)
    assert calls >= 190
    assert pool.stats().kv_pages_peak > 4 * (MAX_PROMPT // 4)  # batches of long rows were in the pool together
    print(f"{calls} generate() calls, max |logit diff| {worst:.2e}")
