"""The Hopper (Gluon) mla_decode kernels (bf16 rows and scaled fp8 rows) compiled for sm_90 on the CPU machine:
CI has no GPU and Gluon no interpreter, so this is what catches a Triton whose Gluon no longer builds a kernel,
or a change that loses its shape (numerics and speed are checked on the GPU: tests/gpu/test_mla_decode_gpu.py,
tests/gpu/test_mla_decode_fp8_gpu.py). Registers and stack bytes come from the cubin Triton built
(``cuobjdump -res-usage``), the instruction counts from its PTX and SASS.

Triton's ahead-of-time entry (``triton.compile`` on a Gluon source for ``GPUTarget("cuda", 90, 32)``) needs
no driver. It runs in a child process (the session's one launch of such compiles: tests/sm90_compiles.py): the
test session sets ``TRITON_INTERPRET=1`` for the portable kernels, and under it Triton's own reduction helpers
are interpreter functions Gluon cannot compile."""

import json

import pytest

from unimem_compile.ops import mla_decode_hopper as hop

from .. import sm90_compiles

if hop.gluon is None:
    pytest.skip("this Triton has no Gluon", allow_module_level=True)

_CHILD = r'''
import json, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from unimem_compile.ops import mla_decode_hopper as hop

def sm90_compile(kern, types, consts):
    # the JIT's specialisation: constexprs by value, every pointer 16-byte aligned, other arguments i32
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kern.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names) if sig[n].startswith("*")}
    src = GluonASTSource(kern, sig, constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=consts["num_warps"]))

def compile_variant(**overrides):
    kern = hop._mla_decode_wgmma_kernel
    kv = torch.empty(256, 576, dtype=torch.bfloat16)  # a stand-in arena view: only its type and layout matter
    types = dict(kv_desc=mangle_type(hop.kv_descriptor(kv)), q_nope_ptr="*bf16", q_rope_ptr="*bf16",
                 v2p_ptr="*i64", page_table_ptr="*i32", kv_len_ptr="*i32", part_o_ptr="*fp32",
                 part_lse_ptr="*fp32", out_ptr="*bf16", qk_scale="fp32")
    consts = dict(R=512, PS=64, L=7, BLOCK_H=32, SPLIT=True, STAGES=2, EARLY_REFILL=True, num_warps=4)
    consts.update(overrides)
    k = sm90_compile(kern, types, consts)
    ptx = k.asm["ptx"]
    return {"tma": ptx.count("cp.async.bulk.tensor"), "wgmma": ptx.count("wgmma.mma_async"),
            "mma_sync": ptx.count("mma.sync"), "shared": k.metadata.shared,
            "waits": sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)})}

def main_loop(sass):
    # the tile loop's instructions on a full tile: the widest backward branch before the first EXIT, less the
    # blocks a forward branch inside it skips by more than 512 instructions (the partial-tile paths)
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    first_exit = min(a for a, t in ins if re.search(r"\bEXIT\b", t))
    lo, hi = max(((int(m.group(1), 16), a) for a, t in ins if a < first_exit
                  for m in [re.search(r"\bBRA (0x[0-9a-f]+)", t)] if m and int(m.group(1), 16) < a),
                 key=lambda r: r[1] - r[0])
    body = [(a, t) for a, t in ins if lo <= a <= hi]
    skips = [(a, int(m.group(1), 16)) for a, t in body for m in [re.search(r"BRA (0x[0-9a-f]+)", t)]
             if m and a < int(m.group(1), 16) <= hi and int(m.group(1), 16) - a > 512 * 16]
    ops = [re.sub(r"^@!?U?P[T0-9]+\s+", "", t).split()[0] for a, t in body if not any(s < a < e for s, e in skips)]
    return {"instructions": len(ops), "sel": sum(o == "SEL" for o in ops), "prmt": sum(o == "PRMT" for o in ops),
            "ldl": sum(o.startswith("LDL") for o in ops), "f2fp": sum(o.startswith("F2FP") for o in ops),
            "hgmma": sum(o.startswith("HGMMA") for o in ops), "lop3": sum(o.startswith("LOP3") for o in ops),
            "shf": sum(o.startswith(("SHF", "SHL", "IMAD.SHL")) for o in ops),
            "hmul2": sum(o.startswith(("HMUL2", "HFMA2")) for o in ops),
            "hadd2_f32": sum(o.startswith("HADD2.F32") for o in ops), "fmul": sum(o.startswith("FMUL") for o in ops),
            "lds": sum(o.startswith("LDS") for o in ops), "sts": sum(o.startswith("STS") for o in ops)}

def compile_fp8_variant(**overrides):
    import os, subprocess, tempfile
    from unimem_compile.pool.specs import MLARowFormat
    kern = hop._mla_decode_wgmma_fp8_kernel
    fmt = MLARowFormat(512, 64, torch.float8_e4m3fn)  # the descriptors' types are the same for e4m3fnuz rows
    descs = hop.fp8_row_descriptors(torch.empty(256, fmt.row_bytes, dtype=torch.uint8), fmt)
    types = dict(code_desc=mangle_type(descs[0]), rope_desc=mangle_type(descs[1]), scale_desc=mangle_type(descs[2]),
                 q_nope_ptr="*bf16", q_rope_ptr="*bf16", v2p_ptr="*i64", page_table_ptr="*i32", kv_len_ptr="*i32",
                 part_o_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", qk_scale="fp32")
    consts = dict(R=512, PS=64, L=7, BLOCK_H=32, SPLIT=True, STAGES=2, ROPE_COL=fmt.rope_offset // 2,
                  SCALE_COL=fmt.scale_offset // 4, SCALE_TILE=128, HW_FP8=True, FNUZ=False, F16_VALUES=False,
                  F16_POW2=256.0, num_warps=4)
    consts.update(overrides)
    k = sm90_compile(kern, types, consts)
    ptx = k.asm["ptx"]
    out = {"tma": ptx.count("cp.async.bulk.tensor"), "wgmma": ptx.count("wgmma.mma_async"),
           "mma_sync": ptx.count("mma.sync"), "cvt_e4m3": ptx.count("e4m3x2"), "shared": k.metadata.shared,
           "waits": sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)})}
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    out["registers"] = int(re.search(r"REG:(\d+)", res).group(1))
    out["stack"] = int(re.search(r"STACK:(\d+)", res).group(1))
    out["hgmma"] = len(re.findall(r"\bHGMMA\.", sass))
    out["utmaldg"] = len(re.findall(r"\bUTMALDG\b", sass))
    out["loop"] = main_loop(sass)
    return out

variants = json.loads(sys.argv[1])
print("RESULT " + json.dumps({name: (compile_fp8_variant if name.startswith("fp8") else compile_variant)(**kw)
                              for name, kw in variants.items()}), flush=True)
'''


_VARIANTS = {"default": {}, "late_refill": {"EARLY_REFILL": False}, "h16": {"BLOCK_H": 16, "SPLIT": False},
             # the fp8 kernel: e4m3fn through the hardware conversion at 32 heads, e4m3fnuz through the integer
             # decoder at 16 (each compile costs CI ~6 s: two cover both formats and both head blockings)
             "fp8_e4m3fn": {}, "fp8_e4m3fnuz_h16": {"HW_FP8": False, "FNUZ": True, "BLOCK_H": 16, "SPLIT": False},
             # the f16 chain (f16_values=True), once: 32 heads (its integer path is the same for both formats)
             "fp8_f16": {"F16_VALUES": True}}
sm90_compiles.register("mla_decode_hopper", _CHILD, [json.dumps(_VARIANTS)])


@pytest.fixture(scope="module")
def compiled():
    out = sm90_compiles.results("mla_decode_hopper")
    assert out, "the compile script printed no RESULT line"
    return out[0]


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


def test_the_fp8_kernel_compiles_to_tma_loads_and_wgmma_from_shared_memory_at_both_head_blockings(compiled):
    for name in ("fp8_e4m3fn", "fp8_e4m3fnuz_h16"):
        k = compiled[name]
        # 10 boxes per tile (8 of codes, the rope, the scales): 2 tiles in the prologue + 1 per refill
        assert k["tma"] == 30 and k["utmaldg"] == 30, (name, k)
        assert k["wgmma"] == 68 and k["hgmma"] == 68, (name, k)  # the bf16 kernel's products, from shared memory
        assert k["loop"]["hgmma"] == 68, (name, k)
        assert k["mma_sync"] == 0, (name, k)
        # value products 0-3 retired one at a time (their buffers take the next tile's chunks 4-7), then all
        assert k["waits"] == [0, 4, 5, 6, 7], (name, k)
        assert k["registers"] <= 255, (name, k)
    # e4m3fn converts with cvt.rn.f16x2.e4m3x2 (one per pair of codes); e4m3fnuz has no such type on sm_90
    assert compiled["fp8_e4m3fn"]["cvt_e4m3"] > 0 and compiled["fp8_e4m3fnuz_h16"]["cvt_e4m3"] == 0
    # ring 2 x 41 KiB + 12 bf16 chunk buffers (96 KiB) + 36 KiB queries + 4 KiB probabilities, under 227 KiB
    assert 218 * 1024 <= compiled["fp8_e4m3fn"]["shared"] <= 227 * 1024
    assert compiled["fp8_e4m3fnuz_h16"]["shared"] < 200 * 1024  # 18 KiB of queries, 2 of probabilities
    k = compiled["fp8_e4m3fn"]["loop"]
    # a full tile converts with no per-value select (a partial tile's rows past the end are zeroed in shared
    # memory first): 128 unpacks + 128 packs + 8 for P; 1,985 instructions per tile on Triton 3.9 (1,969 on 3.6,
    # the H200's), where the schedule it replaced had 2,442 (2,567) and the bf16 kernel has 1,041
    assert k["sel"] <= 8 and k["prmt"] <= 8 and k["f2fp"] == 264, k
    assert k["instructions"] <= 2100, k
    # at 32 heads the 8 value accumulators take 128 registers: a few loop-invariant wgmma descriptors spill
    # (104 bytes on Triton 3.9, 48 on 3.6; the replaced schedule spilled 136 / 520); 16 heads spill nothing
    assert compiled["fp8_e4m3fn"]["stack"] <= 112 and k["ldl"] <= 20
    assert compiled["fp8_e4m3fnuz_h16"]["stack"] == 0


def test_the_f16_chain_replaces_the_conversions_with_integer_ops_and_changes_nothing_else(compiled):
    k, bf16 = compiled["fp8_f16"], compiled["fp8_e4m3fn"]
    # the same copies, products, waits and shared memory (f16 buffers are bf16's size; the rope's score product
    # stays bf16)
    for key in ("tma", "utmaldg", "wgmma", "hgmma", "mma_sync", "waits", "shared"):
        assert k[key] == bf16[key], (key, k[key], bf16[key])
    assert k["cvt_e4m3"] == 0  # no fp8 conversion: the codes' bits are moved with integer ops
    loop, was = k["loop"], bf16["loop"]
    # per tile and thread (256 values): F2FP 264 -> 24 (the P packs and the scales), no HADD2.F32; per pair of
    # values one PRMT, one LOP3, one shift and one HMUL2 (Triton 3.9: 1,921 instructions against 1,985)
    assert loop["f2fp"] <= 32 and was["f2fp"] == 264, (loop, was)
    assert loop["hadd2_f32"] == 0 and was["hadd2_f32"] == 256, (loop, was)
    assert loop["hmul2"] == 128 and loop["prmt"] <= 136 and loop["lop3"] <= 136, loop
    assert loop["instructions"] <= was["instructions"], (loop, was)
    assert k["stack"] <= bf16["stack"] + 8 and loop["ldl"] <= was["ldl"] + 2, (k, bf16)
