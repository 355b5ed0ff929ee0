"""Compile the portable mla_decode split kernel for sm_90a on a machine WITHOUT a GPU and report what the
compiler made of it: shared memory, registers and spills (the bundled ptxas), the MMA instruction, the
number of cp.async copies, and the shared buffers the software pipeliner allocated per KV operand
(``!ttg.memdesc<Nx...>``: N = 1 means one buffer, i.e. no overlap of a tile's load with the previous
tile's math). This is how the fifth session found why no Triton knob moved the kernel (RESULTS.md,
"How the Hopper form came about").

The JIT's specialisation is reproduced by hand (16-byte divisibility of pointers and of the sizes that are
multiples of 16 at the Kimi-Linear geometry); without it the copies are not vectorised and no cp.async is
emitted, which is not what runs on the GPU. For numbers that match the device, run it with the device's
Triton (3.6): ``python3.11 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 torch==2.13.0
transformers==5.24.0 && /tmp/t36/bin/pip install --no-deps -e .``.

usage: python benchmarks/experiments/aot_compile_mla_decode.py [--configs 64x2x4,32x3x4] [--ttgir-dir DIR]
       (a config is BLOCK_N x num_stages x num_warps)
"""
import argparse
import collections
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from unimem_compile.ops import mla_decode as md  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
POINTERS = {"q_nope_ptr": "*bf16", "q_rope_ptr": "*bf16", "kv_ptr": "*bf16", "v2p_ptr": "*i64",
            "page_table_ptr": "*i32", "kv_len_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
            "out_ptr": "*bf16"}
MULTIPLES_OF_16 = {"max_tokens", "layer_rows", "H", "stride_qn_b", "stride_qn_h", "stride_qr_b", "stride_qr_h",
                   "stride_pt_b"}


def compile_split_kernel(block_n: int, stages: int, warps: int):
    kern = md._mla_decode_split_kernel
    consts = dict(R=512, DR=64, PS=64, L=7, BLOCK_H=32, BLOCK_N=block_n, R_HALF=256, BLOCK_DR=64, SPLIT=True,
                  PAGE_TILE=True, DOT_PRECISION="tf32")
    sig = {n: "constexpr" if n in consts else POINTERS.get(n, "fp32" if n == "qk_scale" else "i32")
           for n in kern.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names)
             if n in POINTERS or n in MULTIPLES_OF_16}
    src = ASTSource(kern, sig, constexprs={(kern.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def report(k) -> dict:
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    info = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                          capture_output=True, text=True).stderr
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    rings = collections.Counter(re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x(\d+)x(\d+)x", ttgir))
    return {"shared_bytes": k.metadata.shared, "registers": int(regs.group(1)) if regs else info[-300:],
            "spill_store_bytes": int(spills.group(1)) if spills else None,
            "mma": "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "none",
            "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
            "kv_buffers": {f"{r}x{c}": int(n) for (n, r, c), _ in rings.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="64x2x4,64x3x4,32x3x4,32x4x4")
    ap.add_argument("--ttgir-dir", default=None, help="also write each config's TTGIR here")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, target sm_90a")
    for cfg in args.configs.split(","):
        block_n, stages, warps = map(int, cfg.split("x"))
        k = compile_split_kernel(block_n, stages, warps)
        print(f"BLOCK_N {block_n} stages {stages} warps {warps}: {report(k)}")
        if args.ttgir_dir:
            os.makedirs(args.ttgir_dir, exist_ok=True)
            with open(os.path.join(args.ttgir_dir, f"split_{cfg}.ttgir"), "w") as f:
                f.write(k.asm["ttgir"])


if __name__ == "__main__":
    main()
