"""The decode runner on CUDA (``cudagraphs`` on by default): each decode step is one replay of a captured
graph (the compiled forward, logits processing, sampling, the append step); tokens equal stock
transformers' in fp32 (TF32 off) for both families, with a padded bucket, EOS lists hit mid-run,
min_new_tokens and a repetition penalty, K = 8 and K = 2; the host loop between replays never
synchronises; steps captured up front serve later calls; sampled calls repeat under torch.manual_seed; a
call that falls back to transformers' loop (Inductor's CUDA graphs) and runner calls mix; the bf16
real-geometry model runs through it.

Run: ``python -m pytest -q tests/gpu/test_runner_gpu.py`` on a CUDA machine (``bash benchmarks/gpu_session.sh
gpu_tests``).
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import unimem_compile  # noqa: E402
from unimem_compile.hf.models import build_model  # noqa: E402
from unimem_compile.runner import decode as runner_decode  # noqa: E402

from ..prompts import left_padded  # noqa: E402

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


_pairs: dict = {}


def _pair(family):
    """(stock, compiled) with the same weights, built once per family in this module (Inductor, cudagraphs at
    its default: on). Buckets 1, 2, 4, 6; the tests use bucket 4 (3 rows, one padded) and 1, so that few steps
    are compiled."""
    if family not in _pairs:
        stock = build_model(family).cuda()
        model = build_model(family).cuda()
        unimem_compile.compile(model, max_batch_size=6, max_seq_len=96, page_size=16)
        _pairs[family] = stock, model
    return _pairs[family]


@pytest.fixture(scope="module", params=["kimi-linear-tiny", "deepseek-v3-tiny"])
def pair(request):
    return _pair(request.param)


@pytest.fixture(scope="module")
def kimi():
    return _pair("kimi-linear-tiny")


def _prompts(lengths, seed):
    ids, mask = left_padded(lengths, torch.Generator().manual_seed(seed))
    return ids.to(CUDA), mask.to(CUDA)


def _generate(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **kw)


def _eos_mid_run(stock, ids, mask, steps):
    free = _generate(stock, ids, mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)[:, ids.shape[1]:]
    return [int(free[0, 3]), int(free[-1, 6])]


def _captured(model):
    return {(s["bucket"], s["sampling"]): s for s in model.unimem.runner_stats()["steps"]}


@pytest.mark.parametrize("k", [8, 2])
def test_captured_steps_give_stock_tokens_in_fp32(pair, k):
    stock, model = pair
    model.unimem.steps_ahead = k
    try:
        for lengths, seed in (([19, 7, 12], 1), ([15], 2)):  # buckets 4 (one padded row) and 1
            ids, mask = _prompts(lengths, seed)
            eos = _eos_mid_run(stock, ids, mask, 20)
            kw = dict(max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=0, repetition_penalty=1.2)
            for extra in ({}, {"min_new_tokens": 9}):
                want = _generate(stock, ids, mask, **kw, **extra)
                for _ in range(2):  # the second call replays the graph captured by the first
                    assert torch.equal(_generate(model, ids, mask, **kw, **extra), want), (lengths, extra)
    finally:
        model.unimem.steps_ahead = 8
    steps = _captured(model)
    for bucket in (4, 1):
        s = steps[(bucket, False)]
        assert s["captured"] and s["error"] is None and s["capture_s"] > 0 and s["steps"] > 0, s
    assert model.unimem.runner_stats()["graph_bytes"] > 0
    assert model.unimem.stats()["kv_pages_used"] == 0 and model.unimem.stats()["state_slots_used"] == 0


def test_the_host_loop_between_replays_never_synchronises(kimi, monkeypatch):
    """From the first page reservation to the last readback (replays, uploads of the page table, the
    asynchronous copies of the flags, pages given back by a finished row) nothing synchronises the stream:
    ``set_sync_debug_mode("error")`` raises on any synchronising call."""
    stock, model = kimi
    ids, mask = _prompts([21, 9, 14], 3)
    eos = _eos_mid_run(stock, ids, mask, 40)
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0)
    want = _generate(stock, ids, mask, **kw)
    _generate(model, ids, mask, **kw)  # builds the step (its warm-up synchronises)
    reserve, finish = runner_decode._Call.reserve, runner_decode._Call.finish

    def strict_reserve(self, n):
        torch.cuda.set_sync_debug_mode("error")
        return reserve(self, n)

    def relaxed_finish(self):
        torch.cuda.set_sync_debug_mode(0)
        return finish(self)

    monkeypatch.setattr(runner_decode._Call, "reserve", strict_reserve)
    monkeypatch.setattr(runner_decode._Call, "finish", relaxed_finish)
    model.unimem.steps_ahead = 4
    try:
        got = _generate(model, ids, mask, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        model.unimem.steps_ahead = 8
    assert torch.equal(got, want)


def test_steps_captured_up_front_serve_later_calls_and_sampling_repeats(kimi):
    stock, model = kimi
    stats = model.unimem.capture([4], sampling=(False, True))
    assert stats["captures"] and all(s["captured"] for s in stats["steps"] if s["bucket"] == 4)
    ids, mask = _prompts([8, 13, 11], 4)
    graphs = model.unimem.passes.graphs
    with model.unimem.timed_decode() as timing:
        got = _generate(model, ids, mask, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert torch.equal(got, _generate(stock, ids, mask, max_new_tokens=10, min_new_tokens=10, do_sample=False))
    assert model.unimem.passes.graphs <= graphs + 1  # at most this prompt's prefill graph
    assert timing.decode_steps == 9 and timing.decode_seconds() > 0
    kw = dict(do_sample=True, temperature=0.9, top_k=30, top_p=0.95, max_new_tokens=12, min_new_tokens=12)
    torch.manual_seed(7)
    a = _generate(model, ids, mask, **kw)
    torch.manual_seed(7)
    b = _generate(model, ids, mask, **kw)
    assert torch.equal(a, b) and a.shape == (3, ids.shape[1] + 12)
    assert _captured(model)[(4, True)]["steps"] >= 22


def test_a_fallback_call_and_runner_calls_mix(kimi):
    from transformers import LogitsProcessor

    class Ban5(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 5] = -float("inf")
            return scores

    stock, model = kimi
    ids, mask = _prompts([10, 6, 14], 5)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    for processors in ([], [Ban5()], []):
        want = _generate(stock, ids, mask, logits_processor=processors, **kw)
        assert torch.equal(_generate(model, ids, mask, logits_processor=processors, **kw), want)


def test_the_bf16_real_geometry_model_decodes_through_captured_steps():
    model = build_model("kimi-linear-48b-4l", dtype=torch.bfloat16, device=CUDA)
    unimem_compile.compile(model, max_batch_size=4, max_seq_len=80, page_size=64)
    ids = torch.randint(3, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(6)).to(CUDA)
    out = _generate(model, ids, torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert out.shape == (3, 56) and bool(((out >= 0) & (out < model.config.vocab_size)).all())
    step = _captured(model)[(4, False)]
    assert step["captured"] and step["graph_bytes"] > 0 and step["steps"] == 15
    assert model.unimem.rewrites["mla_absorb"] >= 1 and model.unimem.rewrites["kda_state_inplace"] >= 3
    assert model.unimem.stats()["kv_pages_used"] == 0
