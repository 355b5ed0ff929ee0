"""``UNIMEM_PREFILL_GRAPHS`` on CUDA: prefill chunks of a listed length replay Inductor's CUDA graphs (partitioned
around ``mla_prefill`` / ``kda_chunk`` and transformers' MoE fallback) and give the same greedy tokens and, within
fp32 rounding, the same logits at every generated position as the symbolic, ungraphed prefill of the same model
(fp32, TF32 off), for the tiny Kimi-Linear (MLA + KDA, fla when installed) and the tiny DeepSeek-V3 (MLA only).
Three graphed calls per case, each with other prompt tokens and with its rows on other pages and state slots than
the call before (the test holds a few more pages and a slot between calls: the allocator would otherwise hand
out the same ids again), so a graph that kept a recorded call's ids or values would show; the first call warms
up and records, the later ones replay and record nothing new.

Needs CUDA (``bash benchmarks/gpu_session.sh prefill_graphs_gpu``)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import unimem_compile  # noqa: E402
from unimem_compile import env  # noqa: E402
from unimem_compile.hf.models import build_model  # noqa: E402

from ..prompts import left_padded  # noqa: E402

pytestmark = pytest.mark.gpu

CHUNK = 64


@pytest.fixture(scope="module", params=["kimi-linear-tiny", "deepseek-v3-tiny"])
def model(request):
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    m = build_model(request.param).cuda()
    unimem_compile.compile(m, max_batch_size=2, max_seq_len=640, page_size=16)
    yield m
    torch.backends.cuda.matmul.allow_tf32 = saved


def _run(model, ids, mask, monkeypatch, graphed: bool):
    if graphed:
        monkeypatch.setenv(env.PREFILL_GRAPHS, str(CHUNK))
    else:
        monkeypatch.delenv(env.PREFILL_GRAPHS, raising=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, prefill_chunk_size=CHUNK,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits, 1)


def _recorded_nodes(manager) -> int:
    """CUDA-graph nodes the trees recorded (every root and child, recursively)."""
    count, todo = 0, [n for nodes in manager.roots.values() for n in nodes]
    while todo:
        node = todo.pop()
        count += 1
        todo.extend(n for nodes in node.children.values() for n in nodes)
    return count


@pytest.mark.parametrize("lengths", [[300], [300, 170]])
def test_graphed_prefill_chunks_equal_the_dynamic_prefill(model, monkeypatch, lengths):
    from torch._dynamo.utils import counters

    pool = model.unimem.pool
    full_chunks = max(lengths) // CHUNK  # 4 chunks of 64 tokens, then a last one of 44 (not listed)
    skips = counters["inductor"]["cudagraph_skips"]
    held_pages, held_slots, nodes = [], [], []
    try:
        for call in range(3):  # the first call warms up and records, the later ones replay
            ids, mask = left_padded(lengths, torch.Generator().manual_seed(sum(lengths) + call))
            ids, mask = ids.cuda(), mask.cuda()
            want_seq, want_logits = _run(model, ids, mask, monkeypatch, graphed=False)
            before = model.unimem.prefill_graph_steps
            got_seq, got_logits = _run(model, ids, mask, monkeypatch, graphed=True)
            assert model.unimem.prefill_graph_steps - before == full_chunks
            assert torch.equal(got_seq, want_seq), f"call {call}"
            torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
            manager = torch._inductor.cudagraph_trees.get_manager(ids.device.index, create_if_none_exists=False)
            nodes.append(_recorded_nodes(manager) if manager is not None else 0)
            held_pages += pool.alloc_pages(3)  # the next call's rows land on other pages and slots
            held_slots += pool.alloc_slots(1)
    finally:
        pool.free_pages(held_pages)
        pool.free_slots(held_slots)
    # Inductor CUDA-graphed them (it skips with a reason: TORCH_LOGS=cudagraphs prints it)
    assert counters["inductor"]["cudagraph_skips"] == skips, dict(counters["inductor"])
    assert nodes[0] > 0 and nodes[2] == nodes[1], nodes  # recorded by the second call at the latest, then replayed
