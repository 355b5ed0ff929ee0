"""The fp8 write, gather and decode kernels compiled for sm_90 on the CPU machine (CI has no GPU): both e4m3
formats build (Triton has no e4m3fnuz type on sm_90; the write and gather kernels encode and decode the bits
with integer ops, so no fp8 conversion instruction appears), and the quantiser's divisions are IEEE
(``div.rn.f32``), as the plain-torch reference's are, so kernel and reference bytes agree on the GPU too. The
decode split kernel converts e4m3fn codes with the hardware's fp8 conversion and decodes e4m3fnuz with
integer ops, and its products are tensor-core MMAs in both.

Triton's ahead-of-time entry (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``) needs no driver. It runs
in a child process without ``TRITON_INTERPRET`` (the test session sets it, and under it the kernels are
interpreter functions): the session's one launch of such compiles (tests/sm90_compiles.py)."""

import pytest

from .. import sm90_compiles

_CHILD = r'''
import json, re, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from unimem_compile.ops import mla_decode, mla_gather, mla_write

def build(kern, types, consts, **options):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kern.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names) if sig[n].startswith("*")}
    src = ASTSource(kern, sig, constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options or dict(num_warps=2))
    ptx = k.asm["ptx"]
    return {"div_rn": len(re.findall(r"div\.rn\.f32", ptx)), "div_approx": len(re.findall(r"div\.(full|approx)", ptx)),
            "fp8_cvt": len(re.findall(r"cvt\.[a-z0-9.]*e4m3", ptx)), "mma": len(re.findall(r"mma\.sync|wgmma\.mma_async", ptx)),
            "shared": k.metadata.shared}

row = dict(R=512, DR=64, R_P2=512, DR_P2=64, TILE=128, ROW_BYTES=656, SCALE_OFFSET=512, ROPE_OFFSET=528, ROPE_VEC=8)
write = dict(code_ptr="*u8", scale_ptr="*fp32", rope_out_ptr="*bf16", v2p_ptr="*i64", loc_ptr="*i64", nope_ptr="*bf16",
             rope_ptr="*bf16", weight_ptr="*bf16", eps="fp32")
gather = dict(out_ptr="*bf16", code_ptr="*u8", scale_ptr="*fp32", rope_ptr="*bf16", v2p_ptr="*i64", pt_ptr="*i32",
              kv_len_ptr="*i32", off_ptr="*i32")
out = {}
for fnuz in (False, True):
    for norm in (False, True):
        # the plain write takes fp32 inputs (an fp32 model: its rope is rounded to bf16 in the kernel)
        ty = tl.bfloat16 if norm else tl.float32
        types = dict(write, **({} if norm else dict(nope_ptr="*fp32", rope_ptr="*fp32", weight_ptr="*fp32")))
        out[f"write fnuz={fnuz} norm={norm}"] = build(mla_write._mla_kv_write_fp8_kernel, types, dict(
            row, FP8_MAX=240.0 if fnuz else 448.0, FNUZ=fnuz, BLOCK_T=1, NORM=norm, IN_DTYPE=ty, PROD_DTYPE=ty))
    out[f"gather fnuz={fnuz}"] = build(mla_gather._mla_gather_fp8_kernel, gather, dict(row, FNUZ=fnuz, BLOCK_N=16))
# the bf16 write kernel shares its row translation and norm helpers with the fp8 one
bf16 = dict(out_ptr="*bf16", v2p_ptr="*i64", loc_ptr="*i64", nope_ptr="*bf16", rope_ptr="*bf16", weight_ptr="*bf16",
            eps="fp32")
out["write bf16"] = build(mla_write._mla_kv_write_kernel, bf16, dict(R=512, DR=64, R_P2=512, DR_P2=64, BLOCK_T=1,
                          VEC=8, NORM=True, IN_DTYPE=tl.bfloat16, PROD_DTYPE=tl.bfloat16))
# the decode split kernel on fp8 rows at Kimi-Linear's geometry (bf16 queries), e4m3fn through the fp8
# conversion, e4m3fnuz through the integer decoder; and a two-tile latent, unsplit, a page per token
decode = dict(q_nope_ptr="*bf16", q_rope_ptr="*bf16", code_ptr="*u8", scale_ptr="*fp32", rope_ptr="*bf16",
              v2p_ptr="*i64", page_table_ptr="*i32", kv_len_ptr="*i32", part_o_ptr="*fp32", part_lse_ptr="*fp32",
              out_ptr="*bf16", qk_scale="fp32")
kimi = dict(R=512, DR=64, PS=64, L=7, ROW_BYTES=656, SCALE_OFFSET=512, ROPE_OFFSET=528, BLOCK_H=32, BLOCK_N=64,
            SCALE_TILE=128, TILE_C=128, NT=4, BLOCK_DR=64, SPLIT=True, PAGE_TILE=True, DOT_TY=tl.bfloat16,
            DOT_PRECISION="tf32")
dec = {}
for fnuz in (False, True):
    dec[f"decode fnuz={fnuz}"] = build(mla_decode._mla_decode_split_fp8_kernel, decode,
                                       dict(kimi, HW_FP8=not fnuz, FNUZ=fnuz), num_warps=4, num_stages=2)
dec["decode R=256"] = build(mla_decode._mla_decode_split_fp8_kernel, decode, dict(
    kimi, R=256, ROW_BYTES=400, SCALE_OFFSET=256, ROPE_OFFSET=264, NT=2, PS=1, BLOCK_N=32, SPLIT=False,
    PAGE_TILE=False, HW_FP8=True, FNUZ=False), num_warps=4, num_stages=3)
print("RESULT " + json.dumps({"write_gather": out, "decode": dec}), flush=True)
'''


sm90_compiles.register("fp8_compile", _CHILD)


@pytest.fixture(scope="module")
def compiled():
    out = sm90_compiles.results("fp8_compile")
    assert out, "the compile script printed no RESULT line"
    return out[0]


def test_both_formats_build_for_sm90_without_fp8_conversion_instructions(compiled):
    compiled = compiled["write_gather"]
    assert len(compiled) == 7  # 4 fp8 writes, 2 fp8 gathers, the bf16 write
    for name, k in compiled.items():
        assert k["fp8_cvt"] == 0, name


def test_the_decode_kernel_converts_e4m3fn_in_hardware_and_e4m3fnuz_with_integer_ops(compiled):
    dec = compiled["decode"]
    # e4m3fn: cvt.rn.f16x2.e4m3x2 (then f16 -> bf16); e4m3fnuz: none (sm_90 has no such conversion)
    assert dec["decode fnuz=False"]["fp8_cvt"] > 0 and dec["decode R=256"]["fp8_cvt"] > 0
    assert dec["decode fnuz=True"]["fp8_cvt"] == 0
    for name, k in dec.items():
        assert k["mma"] > 0, name  # the score and value products stay on the tensor cores


def test_the_quantiser_divides_in_ieee_arithmetic(compiled):
    compiled = compiled["write_gather"]
    for fnuz in (False, True):
        plain = compiled[f"write fnuz={fnuz} norm=False"]
        assert plain["div_rn"] > 0 and plain["div_approx"] == 0
        # the fused norm's mean of squares keeps its approximate division (transformers' own is a
        # different sum order anyway, docs in ops/mla_write.py); the quantiser's stay IEEE
        fused = compiled[f"write fnuz={fnuz} norm=True"]
        assert fused["div_rn"] == plain["div_rn"] and fused["div_approx"] == 1
