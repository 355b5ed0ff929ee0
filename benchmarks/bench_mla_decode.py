"""Paged MLA decode: effective bandwidth of unimem::mla_decode against the measured HBM read ceiling, and
side by side with plain-torch absorbed attention and the transformers way, in one run.

Bytes are counted as FlashMLA's benchmark counts them: sum of context lengths x 576 x 2 (the latent
rows of one layer) + batch x heads x (576 + 512) x 2 (queries in, outputs out). Geometry: Kimi-Linear MLA
(32 heads, kv_lora_rank 512, rope 64, 7 layers in a page envelope), page size 64, bf16; every row holds
the full context on pages scattered at random over the arena. Times are `triton.testing.do_bench`
medians (L2 flushed between runs) of a CUDA-graph replay of the call, i.e. GPU time without the Python
launch cost (how a compiled model with cudagraphs runs it); the eager time per call (launcher and
dispatch included, what an uncaptured model pays) is reported beside it.

The stage-1 kernel is the op's default for the device (on an sm_90 GPU the Hopper TMA + wgmma kernel of
ops/mla_decode_hopper.py, else the portable Triton kernel); ``--kernel portable`` times the portable one
there (it sets UNIMEM_MLA_DECODE_KERNEL for the run). The JSON records which one ran, and the CUDA kernels
one call launches.

``--kv-dtype fp8_e4m3`` (or ``fp8_e4m3fnuz``) times the same grid on scaled fp8 rows (656 bytes per token:
ops/fp8.py; the op's fp8 kernel for ``--kernel``: auto and wgmma are the Hopper fp8 kernel on an H200
(``mla_decode.FP8_AUTO_WGMMA``), ``--kernel portable`` the portable fp8 split kernel), the bytes counted with
the fp8 row, and at every point the bf16 op (the same ``--kernel`` choice: auto and wgmma are the Hopper bf16
kernel on an H200) on a bf16 arena of the same geometry, timed the same way in the same run: ``bf16_ms`` and ``speedup_vs_bf16`` (bf16 time / fp8 time = the tokens/s ratio). ``fp8_targets``
checks issue 22's: at batch >= 64 and context >= 16k at least 1.6x (floor 1.25x), elsewhere at least 1x.
With ``--quick`` the fp8 grid is :data:`FP8_QUICK_POINTS` (the issue's points and two short ones);
``--fp8-sweep-only`` times instead, at batch 64, context 16k, the fp8 kernel under each of :data:`FP8_SWEEP`'s
tile settings (``sweep_b64_c16384``; the defaults were chosen without a GPU measurement).

``--l2-ceiling`` measures the kernel's compute ceiling instead: contexts whose latent rows (16384 tokens,
18.9 MB in bf16, 10.7 MB in fp8) stay in the H200's 50 MB L2, timed back to back without flushing
(``graph_ms_hot``), and the achieved TFLOP/s, counting ``2 * H * (R + Dr) + 2 * H * R`` FLOPs per (row,
token): the bf16 kernel's by default, the fp8 kernel's (dequantising included) with ``--kv-dtype``
(issue 22: 1.6x the bf16 speed at 4 TB/s needs about 400 TFLOP/s while dequantising).

``--fp8-wgmma-ab`` times the fp8 kernels against each other instead (:data:`FP8_AB_FORMS`: the Hopper fp8
kernel, ``kernel="wgmma"``, and the portable fp8 split kernel), in one run: at :data:`FP8_QUICK_POINTS` each
and the bf16 Hopper kernel (CUDA-graph replay, L2 flushed; ``speedup_vs_bf16`` and issue 22's ``fp8_targets``
per kernel; ``max_abs_diff_vs_wgmma``: the portable kernel attends over the unrounded ``code x scale``
values, the Hopper one over their bf16 roundings, so they differ by that), then each on the L2-resident rows
(TFLOP/s). (Its first run, 2026-12-02, timed the Hopper fp8 kernel's two schedules instead: the one kept,
1.57-1.62x the other; results/mla_decode_2026-12-02_fp8_wgmma_ab.json.)

``--fp8-f16-ab`` is the same A/B for the Hopper fp8 kernel's two dequantisation chains (:data:`FP8_F16_AB_FORMS`:
the default bf16 chain and ``wgmma_fp8_f16=True``, the f16 one, off by default until this run times it;
``max_abs_diff_vs_wgmma`` is the f16 chain's rounding difference, not zero).

``--out`` names a JSON file, or a folder: then ``mla_decode_<date>[_fp8|_fp8_fnuz|_l2|_l2_fp8].json`` in
it, the names of record (docs/design.md section 8); an fp8 run with ``--kernel wgmma`` or ``portable`` adds
the kernel's name (``mla_decode_<date>_fp8_wgmma.json``, ``_l2_fp8_wgmma``), so it sits beside the auto run.

usage: python benchmarks/bench_mla_decode.py [--out results.json|folder] [--quick] [--kernel auto|portable|wgmma]
           [--kv-dtype bf16|fp8_e4m3|fp8_e4m3fnuz] [--l2-ceiling] [--fp8-sweep-only] [--fp8-wgmma-ab] [--fp8-f16-ab]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import time

import torch
import triton
import triton.language as tl

from unimem_compile import env
from unimem_compile.ops import fp8
from unimem_compile.ops import mla_decode as md
from unimem_compile.ops import mla_decode_hopper
from unimem_compile.options import kv_dtype_of
from unimem_compile.profiling import cuda_kernels
from unimem_compile.pool.specs import MLARowFormat

H, R, DR, L, LAYER = 32, 512, 64, 7, 3
D = R + DR
DN = DV = 128  # Kimi-Linear qk_nope_head_dim / v_head_dim (the transformers way expands into these)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # grid-stride read of n int32 words; the per-program sum is stored so the loads cannot be dropped
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + pid, tl.sum(acc))


def read_ceiling_tbs(gib: float = 4.0) -> float:
    """HBM read bandwidth (TB/s) of a Triton grid-stride read over ``gib`` GiB of random words."""
    n = int(gib * 2**30) // 4
    x = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * 8
    out = torch.empty(grid, dtype=torch.int32, device="cuda")
    ms = triton.testing.do_bench(lambda: _read_kernel[(grid,)](x, out, n, BLOCK=4096, num_warps=8), warmup=50,
                                 rep=300)
    del x
    return n * 4 / ms / 1e9


class SameSizeRead:
    """A plain grid-stride read of a given number of bytes, timed exactly as the decode kernel is (CUDA-graph
    replay under do_bench's L2 flush): what those bytes cost under the measurement's own conditions. do_bench
    flushes L2 by zero-filling 256 MB, so the next kernel first writes back up to 50 MB of dirty lines, a
    fixed cost that dominates small points (fourth session, benchmarks/RESULTS.md)."""

    def __init__(self, max_bytes: int):
        self.words = torch.randint(-(2**31), 2**31 - 1, (max_bytes // 4 + 1,), dtype=torch.int32, device="cuda")
        self.grid = torch.cuda.get_device_properties(0).multi_processor_count * 8
        self.out = torch.empty(self.grid, dtype=torch.int32, device="cuda")

    def tbs(self, nbytes: int) -> float:
        n = nbytes // 4
        ms = bench_graph(lambda: _read_kernel[(self.grid,)](self.words, self.out, n, BLOCK=4096, num_warps=8))
        return n * 4 / ms / 1e9


def effective_bytes(batch: int, context: int, row_bytes: int = D * 2) -> int:
    return batch * context * row_bytes + batch * H * (D + R) * 2


def flops_per_token() -> int:
    """FLOPs of one (row, token): scores ``2 * H * (R + Dr)`` plus the value sum ``2 * H * R``."""
    return 2 * H * (R + DR) + 2 * H * R


class Setup:
    """An arena holding ``max_tokens`` tokens of a 7-layer page envelope, random rows (bf16 normals, or fp8
    rows quantised from normals; never zeros), and a random permutation of physical pages behind the
    virtual ones (page 0 is the sink)."""

    def __init__(self, max_tokens: int, page_size: int = 64, seed: int = 0, kv_dtype: torch.dtype = torch.bfloat16):
        self.ps, self.kv_dtype = page_size, kv_dtype
        self.fmt = MLARowFormat(R, DR, kv_dtype)
        n_pages = max_tokens // page_size + 1
        page_bytes = page_size * L * self.fmt.row_bytes
        self.arena = torch.zeros((n_pages + 1) * page_bytes, dtype=torch.uint8, device="cuda")  # + tail pad
        g = torch.Generator(device="cuda").manual_seed(seed)
        if self.fmt.quantized:
            rows = self.arena.view(-1, self.fmt.row_bytes)
            chunk = 2**18
            for i in range(page_size * L, rows.shape[0], chunk):  # the sink page stays zero
                n = min(chunk, rows.shape[0] - i)
                rows[i: i + n] = fp8.quantize_rows(torch.randn(n, R, device="cuda", generator=g),
                                                   torch.randn(n, DR, device="cuda", generator=g), self.fmt)
        else:
            typed = self.arena.view(torch.bfloat16)
            chunk = 2**28
            for i in range(page_bytes // 2, typed.numel(), chunk):  # the sink page stays zero
                typed[i: i + chunk].normal_(generator=g)
        self.v2p = torch.full((n_pages,), -1, dtype=torch.int64, device="cuda")
        self.v2p[1:] = torch.randperm(n_pages - 1, device="cuda", generator=g) + 1
        self.g = g

    def inputs(self, batch: int, context: int):
        pages = context // self.ps
        page_table = (torch.arange(batch * pages, device="cuda", dtype=torch.int32) + 1).view(batch, pages)
        kv_len = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q_nope = torch.randn(batch, H, R, device="cuda", generator=self.g).to(torch.bfloat16)
        q_rope = torch.randn(batch, H, DR, device="cuda", generator=self.g).to(torch.bfloat16)
        return q_nope, q_rope, page_table, kv_len

    def args(self, q_nope, q_rope, page_table, kv_len, sm_scale):
        return (q_nope, q_rope, self.arena, self.v2p, page_table, kv_len, sm_scale, LAYER, L, self.ps, R, DR,
                self.kv_dtype)

    def gather(self, page_table, context):
        """Dense ``[B, context, D]`` bf16 latent rows of LAYER (all rows are full in this benchmark; fp8
        rows dequantised)."""
        ps = self.ps
        t = torch.arange(context, device="cuda")
        rows = self.v2p[page_table.long()[:, t // ps]] * (ps * L) + LAYER * ps + t % ps
        if self.fmt.quantized:
            return fp8.dequantize_rows(self.arena.view(-1, self.fmt.row_bytes)[rows], self.fmt)
        return self.arena.view(torch.bfloat16).view(-1, D)[rows]


def torch_absorbed(setup: Setup, q_nope, q_rope, page_table, context, sm_scale):
    """Plain torch, absorbed form: gather the latent rows, bf16 matmuls, fp32 softmax."""
    kv = setup.gather(page_table, context)
    q = torch.cat([q_nope, q_rope], -1)
    scores = torch.matmul(q, kv.transpose(1, 2)).float() * sm_scale
    probs = torch.softmax(scores, -1).to(kv.dtype)
    return torch.matmul(probs, kv[..., :R])


def transformers_way(setup: Setup, q_full, w_kv_b, page_table, context):
    """What transformers' Kimi-Linear MLA does at decode: expand the latent cache through kv_b_proj into
    per-head K = [k_nope | k_rot] and V, then SDPA with scale (dn + dr)^-0.5."""
    kv = setup.gather(page_table, context)
    B, n, _ = kv.shape
    kv_nope = torch.nn.functional.linear(kv[..., :R], w_kv_b).view(B, n, H, DN + DV).transpose(1, 2)
    k_nope, v = kv_nope.split([DN, DV], -1)
    key = torch.cat([k_nope, kv[:, None, :, R:].expand(B, H, n, DR)], -1)
    return torch.nn.functional.scaled_dot_product_attention(q_full, key, v, scale=(DN + DR) ** -0.5)


def bench(fn) -> float:
    """Median ms of ``fn`` called eagerly (launch cost included when it exceeds the GPU time)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def bench_graph(fn) -> float:
    """Median ms of a CUDA-graph replay of ``fn`` (GPU time; L2 flushed before each replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100)
    del graph
    return ms


def cpu_us_per_call(fn, n: int = 200) -> float:
    """Host time per call, enqueue only (no sync inside the loop)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def kernel_name(choice: str, kv_dtype: torch.dtype = torch.bfloat16) -> str:
    """The stage-1 form the op runs here for the benchmark's geometry."""
    if choice != "auto":
        return choice
    fits = md.wgmma_supported(torch.device("cuda"), kv_dtype, 64, R, DR)
    if kv_dtype != torch.bfloat16 and not md.FP8_AUTO_WGMMA:
        fits = False  # auto keeps fp8 rows on the portable kernel while the switch is off
    return "wgmma" if fits else "portable"


def hot_ms(fn, calls: int = 20, replays: int = 10) -> float:
    """Median ms per call of ``calls`` back-to-back calls of ``fn`` in one CUDA graph, L2 NOT flushed:
    after the first call the data ``fn`` reads sits in L2 if it fits."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[len(times) // 2]


#: (batch, context) of the L2-resident points: 16384 tokens of one layer's bf16 rows, 18.9 MB (the H200 has
#: 50 MB of L2 in two halves; a line may be held in both)
L2_POINTS = [(16, 1024), (32, 512), (64, 256), (128, 128)]


def l2_ceiling(kernel: str, kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    """The kernel on L2-resident rows of ``kv_dtype``: ms per call and achieved TFLOP/s per point."""
    setup = Setup(max(b * c for b, c in L2_POINTS), kv_dtype=kv_dtype)
    row_bytes = setup.fmt.row_bytes
    sm_scale = (DN + DR) ** -0.5
    out = {"kernel": kernel, "kv_dtype": str(kv_dtype).replace("torch.", ""), "flops_per_token": flops_per_token(),
           "timing": "graph of 20 back-to-back calls, median of 10 replays, L2 not flushed", "points": []}
    name = "fp8" if setup.fmt.quantized else "bf16"
    print(f"L2-resident {name} decode ({kernel}): {'batch':>5} {'context':>7} {'us':>8} {'TFLOP/s':>8} {'TB/s':>6}")
    for batch, context in L2_POINTS:
        a = setup.args(*setup.inputs(batch, context), sm_scale)
        ms = hot_ms(lambda: torch.ops.unimem.mla_decode(*a))
        tflops = batch * context * flops_per_token() / ms / 1e9
        tbs = effective_bytes(batch, context, row_bytes) / ms / 1e9
        out["points"].append({"batch": batch, "context": context, "graph_ms_hot": ms, "tflops": tflops,
                              "tbs_from_l2": tbs, "kv_bytes": batch * context * row_bytes})
        print(f"{'':>36} {batch:>5} {context:>7} {ms * 1e3:>8.1f} {tflops:>8.1f} {tbs:>6.2f}")
    out["max_tflops"] = max(p["tflops"] for p in out["points"])
    return out


#: the fp8 grid of ``--quick``: issue 22's points (batch >= 64, context >= 16k) and two short ones
FP8_QUICK_POINTS = [(32, 4096), (64, 4096), (64, 16384), (128, 16384), (64, 32768)]
#: the fp8 kernel's launch settings ``--fp8-sweep`` times: (block_n, block_h, num_warps, num_stages)
FP8_SWEEP = [(bn, bh, w, None) for bn in (32, 64) for bh in (16, 32) for w in (4, 8)]
#: issue 22's fp8 decode speed targets against bf16, at batch >= 64 and context >= 16k
FP8_TARGET, FP8_FLOOR = 1.6, 1.25


def sweep_fp8(setup: Setup, sm_scale: float, batch: int = 64, context: int = 16384) -> list[dict]:
    """The fp8 kernel at one point under each :data:`FP8_SWEEP` setting (CUDA-graph replay, L2 flushed)."""
    a = setup.args(*setup.inputs(batch, context), sm_scale)
    out = []
    for block_n, block_h, warps, stages in FP8_SWEEP:
        knobs = dict(block_n=block_n, block_h=block_h, num_warps=warps, num_stages=stages, kernel="portable")
        try:
            ms = bench_graph(lambda: md.mla_decode_triton(*a, **knobs))
        except Exception as e:  # noqa: BLE001 - a setting that does not compile (shared memory) is a result
            out.append({**knobs, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        out.append({**knobs, "ms": ms, "tbs": effective_bytes(batch, context, setup.fmt.row_bytes) / ms / 1e9})
        print(f"fp8 sweep b{batch} c{context}: {knobs} {ms * 1e3:.1f} us")
    return out


def fp8_targets(points: list[dict]) -> dict:
    """Issue 22's check of an fp8 run's ``speedup_vs_bf16``: the smallest at batch >= 64, context >= 16384
    against :data:`FP8_TARGET` and :data:`FP8_FLOOR`, and the smallest elsewhere against 1 (at least the
    bf16 kernel's speed at every other shape). None where the grid has no such point."""
    big = [p["speedup_vs_bf16"] for p in points if p["batch"] >= 64 and p["context"] >= 16384]
    rest = [p["speedup_vs_bf16"] for p in points if not (p["batch"] >= 64 and p["context"] >= 16384)]
    out = {"target": FP8_TARGET, "floor": FP8_FLOOR, "issue_points": len(big),
           "issue_points_min_speedup": min(big) if big else None,
           "other_points_min_speedup": min(rest) if rest else None}
    out["meets_target"] = bool(big) and min(big) >= FP8_TARGET
    out["meets_floor"] = bool(big) and min(big) >= FP8_FLOOR
    out["others_at_least_bf16"] = all(r >= 1.0 for r in rest)
    return out


#: ``--fp8-wgmma-ab``'s forms: name -> ``mla_decode_triton`` keywords, on e4m3fn rows beside the bf16 Hopper kernel
FP8_AB_FORMS = {"wgmma": {"kernel": "wgmma"}, "portable": {"kernel": "portable"}}
#: ``--fp8-f16-ab``'s: the Hopper fp8 kernel's bf16 dequantisation chain (the default) and its f16 one
FP8_F16_AB_FORMS = {"wgmma": {"kernel": "wgmma"}, "wgmma_f16": {"kernel": "wgmma", "wgmma_fp8_f16": True}}


def fp8_ab(forms=FP8_AB_FORMS, points=FP8_QUICK_POINTS) -> dict:
    """Each of ``forms`` (name -> ``mla_decode_triton`` keywords) on e4m3fn rows and the bf16 Hopper kernel at
    ``points`` (CUDA-graph replay, L2 flushed; ``speedup_vs_bf16``, issue 22's ``fp8_targets`` per form), each
    form's largest difference from the first form's output (``max_abs_diff_vs_<first>``; 0.0: equal bit for
    bit), then each form on L2-resident rows (TFLOP/s)."""
    sm_scale = (DN + DR) ** -0.5
    names = list(forms)
    most = max(b * c for b, c in points)
    setup, base = Setup(most, kv_dtype=torch.float8_e4m3fn), Setup(most, seed=1)
    out = {"forms": forms, "points": [], "l2_points": []}
    print(f"fp8 forms {names} beside the bf16 wgmma kernel (us, speed vs bf16):")
    for batch, context in points:
        a = setup.args(*setup.inputs(batch, context), sm_scale)
        b_args = base.args(*base.inputs(batch, context), sm_scale)
        bf16_ms = bench_graph(functools.partial(md.mla_decode_triton, *b_args, kernel="wgmma"))
        point = {"batch": batch, "context": context, "bf16_ms": bf16_ms}
        outputs = {}
        for name in names:
            fn = functools.partial(md.mla_decode_triton, *a, **forms[name])
            outputs[name] = fn().float()
            ms = bench_graph(fn)
            point[name] = {"ms": ms, "tbs": effective_bytes(batch, context, setup.fmt.row_bytes) / ms / 1e9,
                           "speedup_vs_bf16": bf16_ms / ms}
        first = outputs[names[0]]
        point[f"max_abs_diff_vs_{names[0]}"] = {n: float((o - first).abs().max()) for n, o in outputs.items()}
        out["points"].append(point)
        print(f"  b{batch} c{context}: bf16 {bf16_ms * 1e3:.1f}  " + "  ".join(
            f"{n} {point[n]['ms'] * 1e3:.1f} ({point[n]['speedup_vs_bf16']:.2f}x)" for n in names)
            + f"  max |diff| vs {names[0]} {point[f'max_abs_diff_vs_{names[0]}']}")
    out["fp8_targets"] = {n: fp8_targets([{"batch": p["batch"], "context": p["context"],
                                           "speedup_vs_bf16": p[n]["speedup_vs_bf16"]} for p in out["points"]])
                          for n in names}
    print("fp8 targets:", json.dumps(out["fp8_targets"]))
    del setup, base
    l2 = Setup(max(b * c for b, c in L2_POINTS), kv_dtype=torch.float8_e4m3fn)
    for batch, context in L2_POINTS:
        a = l2.args(*l2.inputs(batch, context), sm_scale)
        point = {"batch": batch, "context": context}
        for name in names:
            ms = hot_ms(functools.partial(md.mla_decode_triton, *a, **forms[name]))
            point[name] = {"graph_ms_hot": ms, "tflops": batch * context * flops_per_token() / ms / 1e9}
        out["l2_points"].append(point)
        print(f"  L2-resident b{batch} c{context}: " + "  ".join(
            f"{n} {point[n]['graph_ms_hot'] * 1e3:.1f} us {point[n]['tflops']:.1f} TFLOP/s" for n in names))
    return out


def out_path(out: str, kv_dtype: torch.dtype, l2: bool, kernel: str = "auto") -> str:
    """``out`` itself, or for a folder the file name of record ``mla_decode_<date>[suffix].json`` (an fp8 run
    of a kernel chosen by name: ``_<kernel>`` after the fp8 suffix)."""
    if not os.path.isdir(out):
        return out
    fp8_suffix = {torch.float8_e4m3fn: "_fp8", torch.float8_e4m3fnuz: "_fp8_fnuz"}.get(kv_dtype, "")
    if fp8_suffix and kernel != "auto":
        fp8_suffix += f"_{kernel}"
    suffix = ("_l2" + fp8_suffix) if l2 else fp8_suffix
    return os.path.join(out, f"mla_decode_{datetime.date.today().isoformat()}{suffix}.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here (a file, or a folder: the name of record)")
    ap.add_argument("--quick", action="store_true", help="a few points only")
    ap.add_argument("--max-tokens", type=int, default=8 * 2**20,
                    help="skip points with more tokens in total (8M tokens: a 67 GB arena of 7-layer pages)")
    ap.add_argument("--kernel", choices=md.KERNELS, default="auto", help="stage-1 form (default: the op's)")
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8_e4m3", "fp8_e4m3fn", "fp8_e4m3fnuz"],
                    help="the rows' dtype (default bf16)")
    ap.add_argument("--fp8-sweep-only", action="store_true",
                    help="with an fp8 --kv-dtype: only time the fp8 kernel's tile settings at batch 64, context 16k")
    ap.add_argument("--l2-ceiling", action="store_true",
                    help="only the compute-ceiling probe: the kernel on L2-resident rows (bf16, or --kv-dtype's), "
                         "in TFLOP/s")
    ap.add_argument("--fp8-f16-ab", action="store_true",
                    help="only the Hopper fp8 kernel's bf16 and f16 dequantisation chains side by side with the bf16 "
                         "Hopper kernel at the --quick fp8 points, and on L2-resident rows")
    ap.add_argument("--fp8-wgmma-ab", action="store_true",
                    help="only the Hopper fp8 kernel and the portable fp8 kernel side by side with the bf16 Hopper "
                         "kernel at the --quick fp8 points, and on L2-resident rows")
    args = ap.parse_args()
    os.environ[env.MLA_DECODE_KERNEL] = args.kernel
    kv_dtype = kv_dtype_of(args.kv_dtype)
    if args.fp8_wgmma_ab or args.fp8_f16_ab:
        key, forms = ("fp8_f16_ab", FP8_F16_AB_FORMS) if args.fp8_f16_ab else ("fp8_wgmma_ab", FP8_AB_FORMS)
        result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "triton": triton.__version__, key: fp8_ab(forms)}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return
    if args.l2_ceiling:
        result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "triton": triton.__version__,
                  "l2_ceiling": l2_ceiling(kernel_name(args.kernel, kv_dtype), kv_dtype)}
        if args.out:
            with open(out_path(args.out, kv_dtype, True, args.kernel), "w") as f:
                json.dump(result, f, indent=1)
        return
    kernel = kernel_name(args.kernel, kv_dtype)
    fp8_run = kv_dtype != torch.bfloat16
    if args.fp8_sweep_only:
        if not fp8_run:
            raise SystemExit("bench_mla_decode: --fp8-sweep-only needs an fp8 --kv-dtype")
        sweep = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "triton": triton.__version__,
                 "kv_dtype": str(kv_dtype).replace("torch.", ""),
                 "sweep_b64_c16384": sweep_fp8(Setup(64 * 16384, kv_dtype=kv_dtype), (DN + DR) ** -0.5)}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(sweep, f, indent=1)
        return
    batches = [1, 8, 32, 64, 128, 256] if not args.quick else [32, 64]
    contexts = [1024, 4096, 16384, 32768, 65536, 131072] if not args.quick else [4096]
    points = [(b, c) for b in batches for c in contexts if b * c <= args.max_tokens]
    if fp8_run and args.quick:
        points = [p for p in FP8_QUICK_POINTS if p[0] * p[1] <= args.max_tokens]

    ceiling = read_ceiling_tbs()
    setup = Setup(max(b * c for b, c in points), kv_dtype=kv_dtype)
    # fp8 runs time the bf16 op beside it at every point (the ratio is of one run)
    base = Setup(max(b * c for b, c in points), seed=1) if fp8_run else None
    row_bytes = setup.fmt.row_bytes
    sm_scale = (DN + DR) ** -0.5
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "conditions": f"{args.kv_dtype} rows ({row_bytes} bytes), {H} heads, R {R} + Dr {DR}, {L}-layer page "
                      f"envelope, page size {setup.ps}, full rows on randomly permuted pages, do_bench median "
                      "(L2 flushed)",
        "kv_dtype": str(kv_dtype).replace("torch.", ""),
        "row_bytes": row_bytes,
        "kernel": kernel,
        "defaults": ({"block_n": 64, "num_warps": 4, "stages": mla_decode_hopper.WGMMA_STAGES, "blocks_per_sm": 1}
                     if kernel == "wgmma" else
                     {"block_n": 64, "num_warps": 4, "num_stages": 2, "blocks_per_sm": md.BLOCKS_PER_SM}),
        "read_ceiling_tbs": ceiling,
        "points": [],
    }
    if fp8_run:
        result["bf16_kernel"] = kernel_name(args.kernel, torch.bfloat16)
    print(f"HBM read ceiling: {ceiling:.2f} TB/s; stage-1 kernel: {result['kernel']}")
    same_size = SameSizeRead(max(effective_bytes(b, c, row_bytes) for b, c in points))
    print(f"{'batch':>5} {'context':>7} {'splits':>6} {'us':>8} {'TB/s':>6} {'of read':>7} {'eager us':>8} "
          f"{'same-size read TB/s':>19}")
    for batch, context in points:
        q_nope, q_rope, page_table, kv_len = setup.inputs(batch, context)
        a = setup.args(q_nope, q_rope, page_table, kv_len, sm_scale)
        ms = bench_graph(lambda: torch.ops.unimem.mla_decode(*a))
        eager_ms = bench(lambda: torch.ops.unimem.mla_decode(*a))
        tbs = effective_bytes(batch, context, row_bytes) / ms / 1e9
        splits = md.mla_decode_num_splits(batch, page_table.shape[1], H, setup.ps, q_nope.device,
                                          blocks_per_sm=result["defaults"]["blocks_per_sm"])
        read_tbs = same_size.tbs(effective_bytes(batch, context, row_bytes))
        point = {"batch": batch, "context": context, "num_splits": splits, "ms": ms, "tbs": tbs,
                 "fraction_of_read": tbs / ceiling, "eager_ms": eager_ms,
                 "same_size_read_tbs": read_tbs, "fraction_of_same_size_read": tbs / read_tbs,
                 "tflops": batch * context * flops_per_token() / ms / 1e9}
        line = (f"{batch:>5} {context:>7} {splits:>6} {ms * 1e3:>8.1f} {tbs:>6.2f} {tbs / ceiling:>7.2f} "
                f"{eager_ms * 1e3:>8.1f} {read_tbs:>19.2f}")
        if base is not None:
            b_args = base.args(*base.inputs(batch, context), sm_scale)
            point["bf16_ms"] = bench_graph(lambda: torch.ops.unimem.mla_decode(*b_args))
            point["bf16_tbs"] = effective_bytes(batch, context) / point["bf16_ms"] / 1e9
            point["speedup_vs_bf16"] = point["bf16_ms"] / ms
            line += f"   bf16 {point['bf16_ms'] * 1e3:.1f} us, fp8 {point['speedup_vs_bf16']:.2f}x"
        result["points"].append(point)
        print(line)
    if base is not None:
        result["fp8_targets"] = fp8_targets(result["points"])
        print("fp8 targets:", json.dumps(result["fp8_targets"]))
        del base

    del same_size
    result["host_us_per_call"] = {
        "op": cpu_us_per_call(lambda: torch.ops.unimem.mla_decode(*a)),
        "launcher": cpu_us_per_call(lambda: md.mla_decode_triton(*a)),
    }
    print("host time per call (us):", {k: round(v, 1) for k, v in result["host_us_per_call"].items()})

    # side by side at batch 32, context 4k
    batch, context = 32, 4096
    q_nope, q_rope, page_table, kv_len = setup.inputs(batch, context)
    a = setup.args(q_nope, q_rope, page_table, kv_len, sm_scale)
    q_full = torch.randn(batch, H, 1, DN + DR, device="cuda", generator=setup.g).to(torch.bfloat16)
    w_kv_b = (torch.randn(H * (DN + DV), R, device="cuda", generator=setup.g) / math.sqrt(R)).to(torch.bfloat16)
    nbytes = effective_bytes(batch, context, row_bytes)
    result["kernels_per_call"] = cuda_kernels(lambda: torch.ops.unimem.mla_decode(*a))
    print(f"CUDA kernels of one call at batch 32, context 4k: {result['kernels_per_call']}")
    ours = torch.ops.unimem.mla_decode(*a).float()
    theirs = torch_absorbed(setup, q_nope, q_rope, page_table, context, sm_scale).float()
    result["max_abs_diff_vs_torch_absorbed"] = float((ours - theirs).abs().max())
    print(f"max |unimem - torch absorbed| at batch 32, context 4k: {result['max_abs_diff_vs_torch_absorbed']:.2e}")
    side = {}
    for name, fn in (
        ("unimem_mla_decode", lambda: torch.ops.unimem.mla_decode(*a)),
        ("torch_absorbed", lambda: torch_absorbed(setup, q_nope, q_rope, page_table, context, sm_scale)),
        ("transformers_expand_sdpa", lambda: transformers_way(setup, q_full, w_kv_b, page_table, context)),
    ):
        ms = bench_graph(fn)
        side[name] = {"ms": ms, "tbs": nbytes / ms / 1e9, "eager_ms": bench(fn)}
    for name, v in side.items():
        v["speedup_of_unimem"] = v["ms"] / side["unimem_mla_decode"]["ms"]
        print(f"batch 32, context 4k: {name:<26} {v['ms'] * 1e3:>9.1f} us {v['tbs']:>6.3f} TB/s "
              f"(eager {v['eager_ms'] * 1e3:.1f} us; unimem is {v['speedup_of_unimem']:.1f}x faster)")
    result["side_by_side_b32_c4096"] = side

    if args.out:
        with open(out_path(args.out, kv_dtype, False, args.kernel), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
