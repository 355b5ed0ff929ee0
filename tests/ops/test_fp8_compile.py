"""The fp8 write and gather kernels compiled for sm_90 on the CPU machine (CI has no GPU): both e4m3 formats
build (Triton has no e4m3fnuz type on sm_90; the kernels encode and decode the bits with integer ops, so no
fp8 conversion instruction appears), and the quantiser's divisions are IEEE (``div.rn.f32``), as the
plain-torch reference's are, so kernel and reference bytes agree on the GPU too.

Triton's ahead-of-time entry (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``) needs no driver. It runs
in a child process without ``TRITON_INTERPRET`` (the test session sets it, and under it the kernels are
interpreter functions), as tests/ops/test_mla_decode_hopper_compile.py does."""

import json
import os
import subprocess
import sys

import pytest

_CHILD = r'''
import json, re, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from unimem_compile.ops import mla_gather, mla_write

def build(kern, types, consts):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kern.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names) if sig[n].startswith("*")}
    src = ASTSource(kern, sig, constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=2)).asm["ptx"]
    return {"div_rn": len(re.findall(r"div\.rn\.f32", ptx)), "div_approx": len(re.findall(r"div\.(full|approx)", ptx)),
            "fp8_cvt": len(re.findall(r"cvt\.[a-z0-9.]*e4m3", ptx))}

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
print("RESULT " + json.dumps(out), flush=True)
'''


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))  # a real compile, not a cache hit
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"compile failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(lines[0][len("RESULT "):])


def test_both_formats_build_for_sm90_without_fp8_conversion_instructions(compiled):
    assert len(compiled) == 7  # 4 fp8 writes, 2 fp8 gathers, the bf16 write
    for name, k in compiled.items():
        assert k["fp8_cvt"] == 0, name


def test_the_quantiser_divides_in_ieee_arithmetic(compiled):
    for fnuz in (False, True):
        plain = compiled[f"write fnuz={fnuz} norm=False"]
        assert plain["div_rn"] > 0 and plain["div_approx"] == 0
        # the fused norm's mean of squares keeps its approximate division (transformers' own is a
        # different sum order anyway, docs in ops/mla_write.py); the quantiser's stay IEEE
        fused = compiled[f"write fnuz={fnuz} norm=True"]
        assert fused["div_rn"] == plain["div_rn"] and fused["div_approx"] == 1
