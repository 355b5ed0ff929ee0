"""The MLA rewrites on CUDA: rewritten graphs run the Triton kernels (mla_kv_write_rmsnorm, mla_decode)
under Inductor, with the same results as without the rewrites.

- fp32, tiny Kimi-Linear and DeepSeek-V3: greedy tokens identical to the same model compiled without the
  passes (TF32 off everywhere); the Triton launchers are counted, so the rewritten graph provably runs
  them on every step.
- bf16, the Kimi-Linear-48B geometry: teacher-forced logits (both models made to pick the same tokens)
  within ``BF16_ATOL + BF16_RTOL * |logit|``: 2e-2 absolute plus one bf16 ulp (2^-7) of the logit. The
  absorbed form sums in another order (notes/passes.md: about 1.5 bf16 ulp on logits; measured on the CPU
  at this geometry: 0.016 with logits up to 4.6). The model uses dense MLPs: with top-k MoE routing a
  1-ulp difference can pick another expert for one token and move its logits by ~0.4 (measured on the CPU
  with the tiny DeepSeek-V3), which says nothing about attention.

Four Inductor compiles in all (plus two aot_eager ones).
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import unimem_compile  # noqa: E402
from unimem_compile.demo import teacher_forced_logits  # noqa: E402
from unimem_compile.hf.models import model_config  # noqa: E402
from unimem_compile.ops import mla_decode as md  # noqa: E402
from unimem_compile.ops import mla_write as mw  # noqa: E402

pytestmark = pytest.mark.gpu
BF16_ATOL, BF16_RTOL = 2e-2, 2.0**-7
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
    unimem_compile.compile(model, max_batch_size=3, max_seq_len=40 + new, page_size=16, backend=backend,
                           passes=passes)
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
    ids, mask = _prompts(model.config.vocab_size)
    continuation = _greedy(plain, ids, mask, new)[:, ids.shape[1]:]
    want = teacher_forced_logits(plain, ids, mask, continuation)
    got = teacher_forced_logits(model, ids, mask, continuation)
    assert model.unimem.rewrites["mla_absorb"] == MLA_LAYERS[name]
    assert got.isfinite().all()
    excess = (got - want).abs() - (BF16_ATOL + BF16_RTOL * want.abs())
    worst = excess.flatten().argmax()
    assert excess.max() <= 0, (f"logit {want.flatten()[worst]:.4f} off by {(got - want).abs().flatten()[worst]:.4f}; "
                               f"max |diff| {(got - want).abs().max():.4f}")
