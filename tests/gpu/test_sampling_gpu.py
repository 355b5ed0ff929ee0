"""The runner's fused sampling step on CUDA: bitwise equal to transformers' processors run on CUDA (which
divide by the float32 reciprocal), captured in a torch.cuda.CUDAGraph (eager and Inductor-compiled) and
replayed with rows joining between replays, equal to eager steps, with no host synchronisation; the Philox
noise equals the CPU's bit for bit; greedy generate() through the step equals stock generate() on CUDA.

Run: ``python -m pytest -q tests/gpu/test_sampling_gpu.py`` on a CUDA machine (no Triton kernels of ours:
TRITON_INTERPRET does not matter; Inductor's own kernels compile for the GPU).
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor  # noqa: E402

from unimem_compile.runner import RowSettings, RowState, decode_step, process_logits  # noqa: E402
from unimem_compile.runner.rng import uniforms  # noqa: E402

from ..prompts import left_padded  # noqa: E402
from ..runner.hf_reference import VOCAB, runner_generate, tiny_llama  # noqa: E402
from ..runner.test_processors import WARPER_ROWS, assert_same_scores  # noqa: E402

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def mixed(seed0=0):
    return [
        RowSettings(do_sample=True, temperature=0.9, top_k=12, top_p=0.9, repetition_penalty=1.2,
                    min_new_tokens=2, max_new_tokens=24, eos_token_ids=(2, 3), pad_token_id=0, seed=seed0 + 1),
        RowSettings(do_sample=False, repetition_penalty=1.5, max_new_tokens=20, eos_token_ids=(2,), pad_token_id=2),
        RowSettings(do_sample=True, min_p=0.05, temperature=0.7, max_new_tokens=24, eos_token_ids=(4,),
                    pad_token_id=1, seed=seed0 + 2),
        RowSettings(do_sample=True, top_k=3, temperature=1.7, max_new_tokens=24, seed=seed0 + 3),
    ]


def logits_stream(steps, rows, gen):
    bias = torch.zeros(VOCAB)
    bias[2:5] = 2.5  # EOS-heavy: rows finish mid-run
    return [(torch.randn(rows, VOCAB, generator=gen) * 2 + bias).to(CUDA) for _ in range(steps)]


def new_state(settings, ids, rows=None):
    state = RowState(rows or len(settings), VOCAB, 32, CUDA)
    state.set_rows(0, settings, ids.to(CUDA))
    return state


def assert_same_state(a, b):
    for name in ("out", "count", "finished", "presence", "last_token"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_processors_are_bitwise_transformers_on_cuda(gen):
    settings = [s for s, _ in WARPER_ROWS] + [RowSettings(repetition_penalty=p, max_new_tokens=8) for p in (1.3, 0.7)]
    ids = torch.randint(0, VOCAB, (len(settings), 7), generator=gen).to(CUDA)
    logits = (torch.randn(len(settings), VOCAB, generator=gen) * 3).to(CUDA)
    got = process_logits(logits, new_state(settings, ids).view(len(settings)))
    for i, (_, warpers) in enumerate(WARPER_ROWS):
        assert_same_scores(got[i], LogitsProcessorList(warpers)(ids[i:i + 1], logits[i:i + 1].clone())[0])
    for j, p in enumerate((1.3, 0.7)):
        i = len(WARPER_ROWS) + j
        want = RepetitionPenaltyLogitsProcessor(p)(ids[i:i + 1], logits[i:i + 1].clone())[0]
        assert_same_scores(got[i], want)


@pytest.mark.parametrize("compiled", [False, True])
def test_captured_step_replays_like_eager_with_rows_joining(gen, compiled):
    """4 rows, rows 2-3 empty at capture; 6 replays, then two requests join rows 2 and 3 and 10 more
    replays run: the state equals the same sequence of eager steps, and nothing synchronises."""
    torch._dynamo.reset()
    first = mixed()[:2]
    later = mixed(seed0=50)[2:]
    ids = torch.randint(5, VOCAB, (4, 6), generator=gen)
    logits = logits_stream(16, 4, gen)
    step = torch.compile(decode_step, fullgraph=True) if compiled else decode_step

    eager = new_state(first, ids[:2], rows=4)
    for k, lg in enumerate(logits):
        if k == 6:
            eager.set_rows(2, later, ids[2:].to(CUDA))
        decode_step(lg, eager.view(4))

    scratch = new_state(first, ids[:2], rows=4)  # warm-up (and compilation) must not touch the real state
    static_logits = logits[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static_logits, scratch.view(4))
    torch.cuda.current_stream().wait_stream(side)

    state = new_state(first, ids[:2], rows=4)
    rows = state.view(4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static_logits, rows)
    later_ids = ids[2:].to(CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k, lg in enumerate(logits):
            if k == 6:
                state.set_rows(2, later, later_ids)
            static_logits.copy_(lg)
            graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert_same_state(state, eager)
    assert int(state.count[2:].min()) > 0  # the rows that joined generated tokens


def test_eager_step_never_synchronises(gen):
    state = new_state(mixed(), torch.randint(5, VOCAB, (4, 6), generator=gen))
    logits = logits_stream(4, 4, gen)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for lg in logits:
            decode_step(lg, state.view(4))
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_philox_noise_is_the_same_bits_on_cuda(gen):
    seeds = torch.randint(-(2**63), 2**63 - 1, (5,), generator=gen)
    index = torch.randint(0, 2**31 - 1, (5,), generator=gen, dtype=torch.int64).to(torch.int32)
    cpu = uniforms(seeds, index, 1001)
    assert torch.equal(uniforms(seeds.to(CUDA), index.to(CUDA), 1001).cpu(), cpu)
    compiled = torch.compile(uniforms, fullgraph=True)
    assert torch.equal(compiled(seeds.to(CUDA), index.to(CUDA), 1001).cpu(), cpu)


def test_greedy_generate_through_the_step_equals_stock_on_cuda(gen):
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model = tiny_llama().to(CUDA)
        ids, mask = left_padded([5, 11, 8], gen, VOCAB)
        ids, mask = ids.to(CUDA), mask.to(CUDA)
        for kwargs in [dict(max_new_tokens=12, repetition_penalty=1.4, min_new_tokens=4, eos_token_id=[2, 7]),
                       dict(max_new_tokens=10, repetition_penalty=0.6)]:
            with torch.no_grad():
                want = model.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
            assert torch.equal(runner_generate(model, ids, mask, do_sample=False, **kwargs), want)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
