"""fp8 KV end to end on the CPU: the tiny models compiled with ``kv_dtype="fp8_e4m3"`` or e4m3fnuz, their
teacher-forced logits over 64 positions (4 left-padded rows x 16 steps) against the same weights with fp32 KV (stock
transformers, fp32), held to the bounds ``unimem_compile.demo.fp8_tolerance`` derives from a bf16-KV run of
the same weights.

The derivation (docs in ``fp8_tolerance``): to first order the logits respond linearly to the cached rows'
rounding errors, whose distribution is the same for every float format up to its unit roundoff u; e4m3's
u = 2^-4 is 16 times bf16's 2^-8, so the fp8 run's |logit errors| (mean, median position, max) are 16
times the bf16-KV run's and its KL divergences 256 times; each bound gets a factor 2 (4 for the KL) for
the sampling noise (a position's error sums thousands of rounding errors, so its ratio is nearly the mean;
measured 15-18x and 224-227x). First order needs a smooth network: top-k expert routing is not (a
router whose margin is below the perturbation picks another expert, an O(1) change that then lives on in
the cache; a bf16-sized perturbation rarely shows one in 64 positions, an fp8-sized one does, so no ratio
of the two runs holds), so the models run with their MoE MLPs dense (``build_model(dense_mlp=True)``: the
same MLA, KDA and cache geometry, which is what fp8 KV touches). The MoE presets' figures are the demo's
(``unimem-compile demo --kv-dtype fp8_e4m3``), under its own sanity bound. A store read as another dtype
(e4m3fnuz as e4m3fn doubles every latent; a misread scale or rope) moves the logits by about their own
spread (0.3 here): two orders of magnitude past these bounds."""

import copy

import pytest
import torch

import unimem_compile
from unimem_compile.demo import compare_logits, fp8_tolerance, teacher_forced_logits
from unimem_compile.hf.models import build_model

from ..prompts import left_padded

NEW, PROMPT, PAGE = 16, 16, 16
LENGTHS = [PROMPT, PROMPT - 5, PROMPT - 2, PROMPT - 7]  # 4 rows x 16 teacher-forced steps = 64 positions
#: the fp8 format each tiny model runs (one each for CI time; the op tests cover both formats bit for bit,
#: and tests/hf/test_demo.py runs kimi-linear-tiny with e4m3fn)
FORMATS = {"kimi-linear-tiny": ("fp8_e4m3fnuz",), "deepseek-v3-tiny": ("fp8_e4m3",)}
DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e4m3fnuz": torch.float8_e4m3fnuz}


@pytest.fixture(scope="module", params=list(FORMATS))
def runs(request):
    """Teacher-forced logits ``[4, 16, vocab]`` of the stock model (the fp32-KV reference) and of compiled
    copies with bf16 and fp8 KV, forced onto the stock model's greedy tokens; and the compiled models."""
    name = request.param
    stock = build_model(name, dense_mlp=True)
    ids, mask = left_padded(LENGTHS, torch.Generator().manual_seed(22))
    with torch.no_grad():
        greedy = stock.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    forced = greedy[:, PROMPT:]
    logits = {"fp32": teacher_forced_logits(stock, ids, mask, forced)}
    models = {}
    for kv_dtype in ("bf16",) + FORMATS[name]:
        model = copy.deepcopy(stock)
        unimem_compile.compile(model, max_batch_size=len(LENGTHS), max_seq_len=PROMPT + NEW, page_size=PAGE,
                               backend="aot_eager", kv_dtype=kv_dtype)
        logits[kv_dtype] = teacher_forced_logits(model, ids, mask, forced)
        models[kv_dtype] = model
    return name, logits, models


def test_fp8_kv_logits_stay_within_the_bounds_derived_from_bf16_kv(runs):
    name, logits, _ = runs
    scale = compare_logits(logits["bf16"], logits["fp32"])
    for kv_dtype in FORMATS[name]:
        got = compare_logits(logits[kv_dtype], logits["fp32"])
        bound = fp8_tolerance(DTYPES[kv_dtype], torch.bfloat16, scale)
        print(f"\n{name} (dense MLPs) {kv_dtype} vs fp32 KV over {got['positions']} positions: "
              + ", ".join(f"{k} {got[k]:.3g} (bound {bound[k]:.3g}, bf16 KV {scale[k]:.3g})"
                          for k in bound if k != "ratio")
              + f", top-1 agreement {got['top1_agreement']:.3f} (bf16 KV {scale['top1_agreement']:.3f})")
        assert got["positions"] == len(LENGTHS) * NEW == 64
        for key in ("mean_abs", "max_abs", "median_position", "kl_mean", "kl_median"):
            assert got[key] <= bound[key], key
        # the rows were quantised (an fp8 run that silently kept bf16 rows would sit at the bf16-KV error)
        assert got["median_position"] > 4 * scale["median_position"]


def test_the_pool_holds_scaled_fp8_rows(runs):
    name, _, models = runs
    for kv_dtype in FORMATS[name]:
        unimem = models[kv_dtype].unimem
        spec = unimem.adapter.kv_spec
        assert spec.dtype == DTYPES[kv_dtype] and spec.scaled_rows
        assert spec.entry_bytes == 112  # 64 codes + 1 fp32 scale + 16 bf16 rope values = 100, padded to 16
        assert unimem.stats()["page_bytes"] == PAGE * spec.layer_num * 112
        assert unimem.rewrites["mla_absorb"] > 0 and unimem.rewrites["mla_write_fusion"] > 0
        # every MLA layer's ops are told the store format the pool holds (the P1 bug: reading it as another)
        layers = [layer for layer in unimem.new_cache(1).layers if hasattr(layer, "geometry")]
        assert len(layers) == spec.layer_num
        assert all(layer.geometry.kv_dtype == spec.dtype and layer.geometry.row_bytes == 112 for layer in layers)
