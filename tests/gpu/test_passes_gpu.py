"""The MLA rewrites on CUDA: rewritten graphs run the Triton kernels (mla_kv_write_rmsnorm, mla_decode)
under Inductor, with the same results as without the rewrites.

- fp32, tiny Kimi-Linear and DeepSeek-V3: greedy tokens identical to the same model compiled without the
  passes (TF32 off everywhere); the Triton launchers are counted, so the rewritten graph provably runs
  them on every step.
- bf16, the Kimi-Linear-48B geometry: teacher-forced logits (every model made to pick the same tokens)
  measured against the fp32 truth (the stock transformers model with the same weights in fp32, eager): the
  rewritten model is no further from it than the same model compiled without the rewrites, within
  ``BF16_MEAN_SLACK`` on the mean and ``BF16_MAX_SLACK`` on the largest error. A direct bound between the
  two bf16 models does not work: bf16 noise alone separates them by up to 0.04-0.07 (measured on an H200
  at this geometry: stock bf16 eager vs our compiled model without rewrites 0.041; with vs without
  rewrites 0.045 (aot_eager) / 0.067 (Inductor); each of them vs fp32: 0.093-0.098 max, 0.0144-0.0145 mean,
  logits up to 4.6). A wrong attention (a dropped page, a bad scale) moves the mean error by far more than
  10%. The model uses dense MLPs: with top-k MoE routing a 1-ulp difference can pick another expert for one
  token and move its logits by ~0.4 (measured on the CPU with the tiny DeepSeek-V3), which says nothing
  about attention.

- bf16 prefill, the same geometry: prompts of up to 300 tokens (one row's pads outlasting a chunk) prefilled
  in 128-token chunks through the ``mla_prefill`` rewrite (the op's Triton kernels, counted) against the same
  prefill through the unrewritten graph (every chunk gathering and expanding ``max_seq_len`` positions):
  the logits of every real prompt position, measured against the fp32 truth (a stock forward over the
  whole prompt), within the same slack.

Six Inductor compiles in all (plus two aot_eager ones).
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import unimem_compile  # noqa: E402
from unimem_compile.demo import teacher_forced_logits  # noqa: E402
from unimem_compile.hf.models import model_config  # noqa: E402
from unimem_compile.ops import mla_decode as md  # noqa: E402
from unimem_compile.ops import mla_prefill as mp  # noqa: E402
from unimem_compile.ops import mla_write as mw  # noqa: E402
from unimem_compile.passes import REWRITE_NAMES  # noqa: E402

from ..prompts import chunked_logits, generate_positions  # noqa: E402

pytestmark = pytest.mark.gpu
BF16_MEAN_SLACK, BF16_MAX_SLACK = 1.10, 1.25
MLA_LAYERS = {"kimi-linear-tiny": 2, "deepseek-v3-tiny": 3, "kimi-linear-48b-4l": 1}


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _model(name, dtype, dense=False):
    from transformers import AutoModelForCausalLM

    config = model_config(name)
    config._attn_implementation = "sdpa"
    if dense and config.model_type == "kimi_linear":
        config.mlp_layer_types = ["dense"] * config.num_hidden_layers
    elif dense:
        config.first_k_dense_replace = config.num_hidden_layers
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _prompts(vocab, batch=3, prompt=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, prompt), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # one left-padded row
    mask[1, :1] = 0
    return ids.cuda(), mask.cuda()


class _Launches:
    """Counts calls of the Triton launchers the rewritten graphs must reach."""

    def __init__(self, monkeypatch):
        self.calls = {"mla_decode": 0, "mla_kv_write_rmsnorm": 0}
        for module, name in ((md, "mla_decode_triton"), (mw, "mla_kv_write_rmsnorm_triton")):
            original = getattr(module, name)

            def counted(*args, _original=original, _key=name.removesuffix("_triton"), **kwargs):
                self.calls[_key] += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)


def _compiled(name, dtype, passes, backend, new, dense=False):
    model = _model(name, dtype, dense)
    # transformers' own decode loop without CUDA graphs: the launch counts below are one per layer and step
    # (the decode runner's captured steps launch from Python only while they are built: test_runner_gpu.py)
    unimem_compile.compile(model, max_batch_size=3, max_seq_len=40 + new, page_size=16, backend=backend,
                           passes=passes, cudagraphs=False)
    model.unimem.use_runner = False
    return model


def _greedy(model, ids, mask, new):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)


@pytest.mark.parametrize("name", ["kimi-linear-tiny", "deepseek-v3-tiny"])
def test_fp32_greedy_tokens_identical_with_and_without_passes_on_the_triton_kernels(name, monkeypatch):
    new = 12
    launches = _Launches(monkeypatch)
    plain = _compiled(name, torch.float32, False, "aot_eager", new)
    model = _compiled(name, torch.float32, True, "inductor", new)
    ids, mask = _prompts(model.config.vocab_size)
    want = _greedy(plain, ids, mask, new)
    assert launches.calls == {"mla_decode": 0, "mla_kv_write_rmsnorm": 0}
    got = _greedy(model, ids, mask, new)
    layers = MLA_LAYERS[name]
    assert model.unimem.rewrites["mla_absorb"] == layers
    assert model.unimem.rewrites["mla_write_fusion"] == 2 * layers
    assert launches.calls["mla_decode"] == layers * (new - 1)  # every decode step, every MLA layer
    assert launches.calls["mla_kv_write_rmsnorm"] == layers * new
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["kimi-linear-48b-4l"])  # the real MLA geometry: 32 heads, 512 + 64
def test_bf16_teacher_forced_logits_match_without_passes(name):
    new = 10
    plain = _compiled(name, torch.bfloat16, False, "inductor", new, dense=True)
    model = _compiled(name, torch.bfloat16, True, "inductor", new, dense=True)
    truth = _model(name, torch.float32, dense=True)  # stock transformers, the same weights in fp32, eager
    weights = plain.state_dict()
    truth.load_state_dict({k: weights[k].float() for k in truth.state_dict()})
    ids, mask = _prompts(model.config.vocab_size)
    continuation = _greedy(plain, ids, mask, new)[:, ids.shape[1]:]
    exact = teacher_forced_logits(truth, ids, mask, continuation)
    want = teacher_forced_logits(plain, ids, mask, continuation)
    got = teacher_forced_logits(model, ids, mask, continuation)
    assert model.unimem.rewrites["mla_absorb"] == MLA_LAYERS[name]
    assert got.isfinite().all()
    err_got, err_want = (got - exact).abs(), (want - exact).abs()
    detail = (f"vs fp32: with rewrites mean {err_got.mean():.5f} max {err_got.max():.4f}, without mean "
              f"{err_want.mean():.5f} max {err_want.max():.4f}; with vs without max {(got - want).abs().max():.4f}")
    assert err_got.mean() <= BF16_MEAN_SLACK * err_want.mean(), detail
    assert err_got.max() <= BF16_MAX_SLACK * err_want.max(), detail


@pytest.mark.parametrize("name", ["kimi-linear-48b-4l"])
def test_bf16_chunked_prefill_through_the_rewrite_matches_the_unrewritten_graph(name, monkeypatch):
    calls = []
    original = mp.mla_prefill_triton
    monkeypatch.setattr(mp, "mla_prefill_triton", lambda *a, **kw: calls.append(a[0].shape) or original(*a, **kw))
    chunk, prompt = 128, 300
    models = {}
    for passes in ([n for n in REWRITE_NAMES if n != "mla_prefill"], True):
        model = _model(name, torch.bfloat16, dense=True)
        unimem_compile.compile(model, max_batch_size=3, max_seq_len=1024, page_size=64, backend="inductor",
                               passes=passes)
        models["rewritten" if passes is True else "plain"] = model
    truth = _model(name, torch.float32, dense=True)
    weights = models["plain"].state_dict()
    truth.load_state_dict({k: weights[k].float() for k in truth.state_dict()})
    ids, mask = _prompts(truth.config.vocab_size, prompt=prompt, seed=3)
    mask[2, :170] = 0  # pads outlasting a chunk: its first chunk holds no token
    real = mask.bool()
    with torch.no_grad():
        exact = truth(ids, attention_mask=mask, position_ids=generate_positions(mask)).logits.float()[real]
    want = chunked_logits(models["plain"], ids, mask, chunk).float()[real]
    assert calls == []
    got = chunked_logits(models["rewritten"], ids, mask, chunk).float()[real]
    assert models["rewritten"].unimem.rewrites["mla_prefill"] >= MLA_LAYERS[name]
    assert models["plain"].unimem.rewrites["mla_prefill"] == 0
    assert [c[2] for c in calls] == [128, 128, 44]  # one call per chunk of the one MLA layer
    assert got.isfinite().all()
    err_got, err_want = (got - exact).abs(), (want - exact).abs()
    detail = (f"vs fp32: with mla_prefill mean {err_got.mean():.5f} max {err_got.max():.4f}, without mean "
              f"{err_want.mean():.5f} max {err_want.max():.4f}; with vs without max {(got - want).abs().max():.4f}")
    assert err_got.mean() <= BF16_MEAN_SLACK * err_want.mean(), detail
    assert err_got.max() <= BF16_MAX_SLACK * err_want.max(), detail
