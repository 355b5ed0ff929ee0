"""generate() on CUDA through transformers' own decode loop (``model.unimem.use_runner = False``: the path a
call takes when the decode runner does not fuse one of its settings) with transformers' stop flag read one
step late (``deferred_stop_check``, on by default for CUDA calls of 8+ rows): the host prepares step n + 1
while the GPU runs step n. Tokens must equal stock transformers' (fp32, TF32 off); an EOS stop costs exactly
one extra decode step, a length stop none; a cache the caller passes is never deferred; nothing leaks. Tiny
Kimi-Linear, decode graphs under Inductor with CUDA graphs (the run-ahead reuses the graphs' static inputs).
The decode runner on CUDA: tests/gpu/test_runner_gpu.py."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import unimem_compile  # noqa: E402
from unimem_compile.hf.models import build_model  # noqa: E402

from ..prompts import left_padded  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pair():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    stock = build_model("kimi-linear-tiny").cuda()
    model = build_model("kimi-linear-tiny").cuda()
    unimem_compile.compile(model, max_batch_size=4, max_seq_len=96, page_size=16, cudagraphs=True)
    model.unimem.use_runner = False  # these tests count transformers' forwards and its deferred stop
    yield stock, model
    torch.backends.cuda.matmul.allow_tf32 = saved


class CountForwards:
    """Counts the compiled model's forward calls (prefill + decode steps) while installed."""

    def __init__(self, model):
        self.model, self.calls, self.inner = model, 0, model.forward

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self.inner(*args, **kwargs)
        self.model.forward = counted
        return self

    def __exit__(self, *exc):
        self.model.forward = self.inner


def _prompts(lengths, seed):
    ids, mask = left_padded(lengths, torch.Generator().manual_seed(seed))
    return ids.cuda(), mask.cuda()


def test_automatic_setting_defers_from_the_row_threshold(pair):
    handle = pair[1].unimem
    assert handle.deferred_stop_check is None
    assert not handle.defers_stop_check(unimem_compile.DEFERRED_STOP_MIN_ROWS - 1)
    assert handle.defers_stop_check(unimem_compile.DEFERRED_STOP_MIN_ROWS)


def test_eos_stop_returns_stock_tokens_with_one_extra_step_and_length_stop_none(pair):
    stock, model = pair
    ids, mask = _prompts([15, 11, 19], seed=5)
    with torch.no_grad():
        free = stock.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        eos = [int(free[b, ids.shape[1] + 2]) for b in range(3)]  # every row stops by its third new token
        kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)
        want = stock.generate(ids, **kw)
        assert want.shape[1] < ids.shape[1] + 10
        calls = {}
        try:
            # None: automatic, off for 3 rows (below DEFERRED_STOP_MIN_ROWS)
            for setting in (False, True, None):
                model.unimem.deferred_stop_check = setting
                for _ in range(2):  # the second call replays recorded graphs
                    with CountForwards(model) as count:
                        got = model.generate(ids, **kw)
                    assert torch.equal(got, want), setting
                calls[setting] = count.calls
                with CountForwards(model) as count:
                    got = model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                                         do_sample=False)
                assert count.calls == 12
                assert torch.equal(got, stock.generate(ids, attention_mask=mask, max_new_tokens=12,
                                                       min_new_tokens=12, do_sample=False))
        finally:
            model.unimem.deferred_stop_check = None
    assert calls[True] == calls[False] + 1 and calls[None] == calls[False]
    stats = model.unimem.stats()
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0


def test_a_cache_the_caller_passes_is_not_deferred_and_continues(pair):
    stock, model = pair
    ids, mask = _prompts([9, 14], seed=8)
    with torch.no_grad():
        want = stock.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        cache = model.unimem.new_cache(2)
        model.unimem.deferred_stop_check = True
        try:
            got = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                 past_key_values=cache)
            assert cache.defer_stop_check is False and cache.undone_steps == 0
        finally:
            cache.release()
            model.unimem.deferred_stop_check = None
    assert torch.equal(got, want)
