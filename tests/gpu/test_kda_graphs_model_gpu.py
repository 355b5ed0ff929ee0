"""ops/kda_graphs at the model level: generate() of the tiny Kimi-Linear (fp32, TF32 off) with fla's chunk_kda
replayed from its graphs gives the same greedy tokens and the same logits at every generated position as with fla run
eagerly (``UNIMEM_KDA_GRAPHS=0``), for a left-padded batch prefilled in chunks (so rows of 2, chunks shorter
than their bucket, and a later chunk starting from a stored state) and for one long row.

Needs CUDA and flash-linear-attention (``bash benchmarks/gpu_session.sh kda_graphs_gpu``)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import unimem_compile  # noqa: E402
from unimem_compile.hf.models import build_model  # noqa: E402
from unimem_compile.ops import kda  # noqa: E402
from unimem_compile.ops.kda_graphs import GRAPHS  # noqa: E402

from ..prompts import left_padded  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(kda.fla_chunk_kda() is None, reason="flash-linear-attention is not installed")]


@pytest.fixture(scope="module")
def model():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    m = build_model("kimi-linear-tiny").cuda()
    unimem_compile.compile(m, max_batch_size=2, max_seq_len=640, page_size=16)
    yield m
    torch.backends.cuda.matmul.allow_tf32 = saved


def _run(model, ids, mask, chunk, monkeypatch, graphs: bool):
    monkeypatch.setenv("UNIMEM_KDA_GRAPHS", "1" if graphs else "0")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, prefill_chunk_size=chunk,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("lengths,chunk", [([300, 170], 128), ([600], 512)])
def test_graphed_prefill_equals_eager_fla(model, monkeypatch, lengths, chunk):
    ids, mask = left_padded(lengths, torch.Generator().manual_seed(sum(lengths)))
    ids, mask = ids.cuda(), mask.cuda()
    before = GRAPHS.replays
    want_seq, want_logits = _run(model, ids, mask, chunk, monkeypatch, graphs=False)
    assert GRAPHS.replays == before  # switched off: nothing replayed
    got_seq, got_logits = _run(model, ids, mask, chunk, monkeypatch, graphs=True)
    assert GRAPHS.replays > before  # the graphs served the prefill chunks
    assert torch.equal(got_seq, want_seq)
    # the same fla kernels on the same values, the graph's chunk list padded with zero tokens: fp32 rounding only
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
