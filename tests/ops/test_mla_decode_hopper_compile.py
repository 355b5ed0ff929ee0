"""The Hopper (Gluon) mla_decode kernel compiled for sm_90 on the CPU machine: CI has no GPU and Gluon no
interpreter, so this is what catches a Triton whose Gluon no longer builds the kernel, or a change that
loses its shape (its numerics and speed are checked on the GPU: tests/gpu/test_mla_decode_gpu.py).

Triton's ahead-of-time entry (``triton.compile`` on a Gluon source for ``GPUTarget("cuda", 90, 32)``) needs
no driver. It runs in a child process: the test session sets ``TRITON_INTERPRET=1`` for the portable
kernels, and under it Triton's own reduction helpers are interpreter functions Gluon cannot compile."""

import json
import os
import subprocess
import sys

import pytest

from unimem_compile.ops import mla_decode_hopper as hop

if hop.gluon is None:
    pytest.skip("this Triton has no Gluon", allow_module_level=True)

_CHILD = r'''
import json, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from unimem_compile.ops import mla_decode_hopper as hop

def compile_variant(**overrides):
    kern = hop._mla_decode_wgmma_kernel
    kv = torch.empty(256, 576, dtype=torch.bfloat16)  # a stand-in arena view: only its type and layout matter
    types = dict(kv_desc=mangle_type(hop.kv_descriptor(kv)), q_nope_ptr="*bf16", q_rope_ptr="*bf16",
                 v2p_ptr="*i64", page_table_ptr="*i32", kv_len_ptr="*i32", part_o_ptr="*fp32",
                 part_lse_ptr="*fp32", out_ptr="*bf16", qk_scale="fp32")
    consts = dict(R=512, PS=64, L=7, BLOCK_H=32, SPLIT=True, STAGES=2, EARLY_REFILL=True, num_warps=4)
    consts.update(overrides)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kern.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names) if sig[n].startswith("*")}
    src = GluonASTSource(kern, sig, constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()},
                         attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = k.asm["ptx"]
    return {"tma": ptx.count("cp.async.bulk.tensor"), "wgmma": ptx.count("wgmma.mma_async"),
            "mma_sync": ptx.count("mma.sync"), "shared": k.metadata.shared,
            "waits": sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)})}

variants = json.loads(sys.argv[1])
print("RESULT " + json.dumps({name: compile_variant(**kw) for name, kw in variants.items()}), flush=True)
'''


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    variants = {"default": {}, "late_refill": {"EARLY_REFILL": False}, "h16": {"BLOCK_H": 16, "SPLIT": False}}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))  # a real compile, not a cache hit
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(variants)], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"compile failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(lines[0][len("RESULT "):])


def test_the_kernel_compiles_to_tma_loads_and_wgmma_with_its_ring_in_shared_memory(compiled):
    k = compiled["default"]
    assert k["tma"] == 27  # 9 boxes of 64 x 64 per tile: 2 tiles in the prologue + 1 per refill
    assert k["wgmma"] == 68  # scores: 9 chunks x 4 k-steps of 16; values: 8 chunks x 4 k-steps (64 tokens)
    assert k["mma_sync"] == 0  # nothing fell back to the register-operand MMA
    assert k["waits"] == list(range(8))  # the chunk-wise refill retires the value products one group at a time
    # 2 x 72 KiB tiles + 36 KiB queries + 4 KiB probabilities (+ barriers; the epilogue scratch reuses them)
    assert 184 * 1024 <= k["shared"] <= 188 * 1024


def test_the_refill_after_all_products_and_sixteen_head_groups_compile_too(compiled):
    assert compiled["late_refill"]["waits"] == [0] and compiled["late_refill"]["tma"] == 27
    assert compiled["h16"]["wgmma"] == 68 and compiled["h16"]["shared"] < 184 * 1024
