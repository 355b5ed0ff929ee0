"""``UNIMEM_PREFILL_GRAPHS`` on CUDA: prefill chunks of a listed length replay Inductor's CUDA graphs (partitioned
around ``mla_prefill`` / ``kda_chunk``) and give the same greedy tokens and, within fp32 rounding, the same logits
at every generated position as the dynamic, ungraphed prefill of the same model (fp32, TF32 off), for the tiny
Kimi-Linear (MLA + KDA, fla when installed) and the tiny DeepSeek-V3 (MLA only), over several calls (record, then
replays; a later call's rows sit on other pages and slots than the recording's).

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


@pytest.mark.parametrize("lengths", [[300], [300, 170]])
def test_graphed_prefill_chunks_equal_the_dynamic_prefill(model, monkeypatch, lengths):
    from torch._dynamo.utils import counters

    ids, mask = left_padded(lengths, torch.Generator().manual_seed(sum(lengths)))
    ids, mask = ids.cuda(), mask.cuda()
    full_chunks = ids.shape[1] // CHUNK  # 4 chunks of 64 tokens, then a last one of 44 (not listed)
    want_seq, want_logits = _run(model, ids, mask, monkeypatch, graphed=False)
    skips = counters["inductor"]["cudagraph_skips"]
    for call in range(3):  # the first call warms up and records, the later ones replay
        before = model.unimem.prefill_graph_steps
        got_seq, got_logits = _run(model, ids, mask, monkeypatch, graphed=True)
        assert model.unimem.prefill_graph_steps - before == full_chunks
        assert torch.equal(got_seq, want_seq), f"call {call}"
        torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    # Inductor CUDA-graphed them (it skips with a reason: TORCH_LOGS=cudagraphs prints it)
    assert counters["inductor"]["cudagraph_skips"] == skips, dict(counters["inductor"])
    manager = torch._inductor.cudagraph_trees.get_manager(ids.device.index, create_if_none_exists=False)
    assert manager is not None and any(manager.roots.values())  # something was recorded
