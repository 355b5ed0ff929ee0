"""Continuous batching on CUDA with the runner's captured whole-step graphs (``cudagraphs`` on): rows join and
leave between replays (different buckets, rows moved into holes), preemption with recompute, a streaming
request on the background thread, for both families, in fp32 (TF32 off) against stock transformers; the
graphs replay (captured, no error) and nothing leaks.

Run: ``python -m pytest -q tests/gpu/test_engine_gpu.py`` on a CUDA machine (``bash benchmarks/gpu_session.sh
gpu_tests``).
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import unimem_compile  # noqa: E402
from unimem_compile.engine import QuotaMemory, RequestStatus  # noqa: E402
from unimem_compile.hf.models import build_model  # noqa: E402

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module", params=["kimi-linear-tiny", "deepseek-v3-tiny"])
def pair(request):
    stock = build_model(request.param).cuda()
    model = build_model(request.param).cuda()
    unimem_compile.compile(model, max_batch_size=4, max_seq_len=96, page_size=16)
    return stock, model


def _prompts(lengths, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _stock(stock, prompt, new):
    with torch.no_grad():
        out = stock.generate(torch.tensor([prompt], device=CUDA), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_rows_join_and_leave_captured_steps(pair):
    stock, model = pair
    ps = _prompts([5, 37, 20, 9, 30, 14, 44], seed=1, vocab=model.config.vocab_size)
    news = [12, 20, 7, 16, 9, 20, 5]
    out = model.generate_batch(ps, max_new_tokens=20, max_prefill_tokens=24)
    with model.init_continuous_batching(max_prefill_tokens=24) as manager:  # per-request lengths, on the thread
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(ps, news)]
        results = {rid: list(manager.request_id_iter(rid, timeout=300))[-1] for rid in ids}
    for i, p in enumerate(ps):
        assert out[f"req_{i}"].generated_tokens == _stock(stock, p, 20), i
        assert results[ids[i]].generated_tokens == _stock(stock, p, news[i]), i
    steps = [s for s in model.unimem.runner_stats()["steps"] if s["steps"]]
    assert steps and all(s["captured"] and s["error"] is None for s in steps), steps
    assert len({s["bucket"] for s in steps}) > 1  # the batch changed buckets as rows came and went
    s = model.unimem.stats()
    assert (s["kv_pages_used"], s["state_slots_used"]) == (0, 0)


def test_packed_prefills_on_cuda(pair):
    """Short prompts packed into one left-padded prefill forward (up to the model's 4 rows; Engine._prefill):
    stock's tokens, some forwards padded."""
    stock, model = pair
    ps = _prompts([5, 12, 7, 9, 3, 11, 30, 16], seed=3, vocab=model.config.vocab_size)
    manager = model.init_continuous_batching(max_prefill_tokens=48)
    ids = [manager.add_request(p, max_new_tokens=10) for p in ps]
    while manager.step():
        pass
    results = {}
    while (r := manager.get_result(timeout=0)) is not None:
        results[r.request_id] = r
    c = manager.engine.counters
    assert c["packed_forwards"] > 0 and c["packed_rows"] >= 2 * c["packed_forwards"] and c["prefill_pads"] > 0
    for rid, p in zip(ids, ps):
        assert results[rid].status == RequestStatus.FINISHED
        assert results[rid].generated_tokens == _stock(stock, p, 10), rid
    s = model.unimem.stats()
    assert (s["kv_pages_used"], s["state_slots_used"]) == (0, 0)


def test_preemption_on_cuda(pair):
    stock, model = pair
    ps = _prompts([30, 26, 20, 34], seed=2, vocab=model.config.vocab_size)
    lay = model.unimem.pool.layout
    memory = QuotaMemory(model.unimem.pool, 6.5 * lay.page_bytes / (lay.usable - lay.sink_floor))
    manager = model.init_continuous_batching(memory=memory, max_prefill_tokens=40)
    ids = [manager.add_request(p, max_new_tokens=24) for p in ps]
    while manager.step():
        pass
    results = {}
    while (r := manager.get_result(timeout=0)) is not None:
        results[r.request_id] = r
    assert manager.engine.counters["preemptions"] > 0
    for rid, p in zip(ids, ps):
        assert results[rid].status == RequestStatus.FINISHED
        assert results[rid].generated_tokens == _stock(stock, p, 24), rid
