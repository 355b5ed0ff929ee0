"""Bandwidth of the MLA write path on a GPU at the Kimi-Linear MLA geometry (7 layers, 512 + 64, bf16).

Measures, in one run:
* the device-to-device copy bandwidth (``Tensor.copy_``; bytes read + written / median time) for 1 GiB
  (the ceiling) and for the same byte count as each case (the launch-bound small-size reference);
* ``mla_kv_write`` and ``mla_kv_write_rmsnorm`` for T = 64 (decode: one token per request, each on its own
  page), 512 and 4096 tokens (prefill: consecutive tokens over scattered pages), inputs sliced from one
  ``[T, 576]`` projection as transformers hands them; bytes = latents read + rows written + the int64
  locations and page-table entries read (+ the norm weight);
* ``mla_gather`` for B = 32 rows of a 4096-token context into ``[32, 4096, 576]``; bytes = rows read +
  result written + page-table and ``v2p`` entries read;
* the plain-torch reference of each op (translate + index_put / gather, and for the fused norm transformers'
  RMSNorm then the write kernel), for context;
* the CUDA kernels one call of each op launches (torch.profiler): 1 means the virtual -> dense
  translation, the norm and the gather's zero fill add no launch.

Times are ``triton.testing.do_bench`` medians (it flushes L2 between runs). Inputs are random normals.

``--kv-dtype fp8_e4m3`` (or ``fp8_e4m3fnuz``) runs the same cases on scaled fp8 rows (656 bytes per token
and layer, quantised in the write kernel, dequantised to bf16 by the gather: ops/fp8.py); the bytes count
the fp8 rows. ``--out`` names a JSON file, or a folder: then ``mla_write_<date>[_fp8|_fp8_fnuz].json`` in it.

usage: source benchmarks/device_env.sh && python benchmarks/bench_mla_write.py --out mla_write.json
           [--kv-dtype bf16|fp8_e4m3|fp8_e4m3fnuz]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "0")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from unimem_compile.ops import fp8  # noqa: E402
from unimem_compile.ops.common import typed_rows  # noqa: E402
from unimem_compile.options import kv_dtype_of  # noqa: E402
from unimem_compile.pool import MLASpec, UnifiedPool  # noqa: E402
from unimem_compile.profiling import cuda_kernels  # noqa: E402

mw = importlib.import_module("unimem_compile.ops.mla_write")
mg = importlib.import_module("unimem_compile.ops.mla_gather")

L, R, DR = 7, 512, 64
D = R + DR
BF16 = torch.bfloat16
ISZ = 2  # bytes per input / gathered value (bf16)


def row_bytes(kv: torch.dtype) -> int:
    """Bytes of one row of ``kv`` rows (1152 for bf16, 656 for fp8)."""
    return MLASpec(L, R, DR, kv).entry_bytes


def bench(fn) -> float:
    """Median seconds of ``fn``."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3


def copy_bandwidth(nbytes: int) -> float:
    """Bytes read + written per second of a device-to-device copy of ``nbytes`` bytes."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / bench(lambda: dst.copy_(src))




def make_pool(page_size: int, n_pages: int, gen: torch.Generator, kv: torch.dtype) -> tuple[UnifiedPool, list[int]]:
    """A KV-only pool of ``kv`` rows with ``n_pages`` allocated pages in shuffled order, every row filled with
    random values (fp8 rows quantised from random normals; the sink stays zero)."""
    spec = MLASpec(L, R, DR, kv)
    pool = UnifiedPool.for_capacity(spec, None, page_size, n_pages, 0, device="cuda")
    pages = pool.alloc_pages(n_pages)
    order = torch.randperm(n_pages, generator=gen).tolist()
    nbytes = spec.entry_bytes
    first = -(-pool.layout.sink_floor // nbytes)
    if spec.scaled_rows:
        rows = pool.arena[: pool.arena.numel() // nbytes * nbytes].view(-1, nbytes)
        for i in range(first, rows.shape[0], 2**18):
            n = min(2**18, rows.shape[0] - i)
            rows[i: i + n] = fp8.quantize_rows(torch.randn(n, R, device="cuda"), torch.randn(n, DR, device="cuda"),
                                               spec.row_format)
    else:
        rows = typed_rows(pool.arena, BF16, D)
        rows[first:] = torch.randn(rows.shape[0] - first, D, device="cuda", dtype=BF16)
    return pool, [pages[i] for i in order]


def write_cases(page_size: int, gen: torch.Generator, copy_peak: float, kv: torch.dtype) -> list[dict]:
    out = []
    for t in (64, 512, 4096):
        decode = t == 64
        n_pages = t if decode else -(-t // page_size)
        pool, pages = make_pool(page_size, n_pages, gen, kv)
        ptab = torch.tensor(pages)
        if decode:  # one token per request, at a random offset of its own page
            loc = ptab * page_size + torch.randint(0, page_size, (t,), generator=gen)
        else:
            i = torch.arange(t)
            loc = ptab[i // page_size] * page_size + i % page_size
        loc = loc.cuda()
        proj = torch.randn(t, D, device="cuda").to(BF16)  # kv_a_proj_with_mqa output
        nope, rope = proj[:, :R], proj[:, R:]
        weight = (torch.rand(R, device="cuda") + 0.5).to(BF16)
        moved = t * D * ISZ + t * row_bytes(kv) + 2 * t * 8
        same_size_copy = copy_bandwidth(t * D * ISZ)
        args = (pool.arena, pool.v2p, loc)
        geo = (3, L, page_size, R, DR, kv)

        def hf_norm(x):
            return mw.rmsnorm_reference(x, weight, 1e-6)

        calls = {
            "mla_kv_write": (lambda: torch.ops.unimem.mla_kv_write(*args, nope, rope, *geo),
                             lambda: mw.mla_kv_write_reference(*args, nope, rope, *geo), moved),
            "mla_kv_write_rmsnorm": (
                lambda: torch.ops.unimem.mla_kv_write_rmsnorm(*args, nope, rope, weight, 1e-6, *geo),
                lambda: torch.ops.unimem.mla_kv_write(*args, hf_norm(nope), rope, *geo), moved + R * ISZ),
        }
        for name, (fn, baseline, nbytes) in calls.items():
            s = bench(fn)
            out.append({
                "op": name, "tokens": t, "kind": "decode" if decode else "prefill", "page_size": page_size,
                "bytes": nbytes, "median_us": s * 1e6, "gbs": nbytes / s / 1e9,
                "fraction_of_copy_peak": nbytes / s / copy_peak,
                "fraction_of_same_size_copy": nbytes / s / same_size_copy,
                "same_size_copy_gbs": same_size_copy / 1e9,
                "baseline": "plain-torch reference" if name == "mla_kv_write" else "transformers RMSNorm + mla_kv_write",
                "baseline_us": bench(baseline) * 1e6,
            })
        del pool
        torch.cuda.empty_cache()
    return out


def gather_case(page_size: int, gen: torch.Generator, copy_peak: float, kv: torch.dtype, batch=32,
                context=4096) -> tuple[dict, list[str]]:
    per_row = -(-context // page_size)
    pool, pages = make_pool(page_size, batch * per_row, gen, kv)
    table = torch.tensor(pages, dtype=torch.int32).view(batch, per_row).cuda()
    kv_len = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    off = torch.zeros(batch, dtype=torch.int32, device="cuda")
    args = (pool.arena, pool.v2p, table, kv_len, off, context, 3, L, page_size, R, DR, kv)
    nbytes = batch * context * (row_bytes(kv) + D * ISZ) + batch * per_row * 4 + batch * context * 8
    s = bench(lambda: torch.ops.unimem.mla_gather(*args))
    same_size_copy = copy_bandwidth(batch * context * D * ISZ)
    row = {
        "op": "mla_gather", "batch": batch, "context": context, "page_size": page_size, "bytes": nbytes,
        "median_us": s * 1e6, "gbs": nbytes / s / 1e9, "fraction_of_copy_peak": nbytes / s / copy_peak,
        "fraction_of_same_size_copy": nbytes / s / same_size_copy, "same_size_copy_gbs": same_size_copy / 1e9,
        "baseline": "plain-torch reference", "baseline_us": bench(lambda: mg.mla_gather_reference(*args)) * 1e6,
    }
    launches = cuda_kernels(lambda: torch.ops.unimem.mla_gather(*args))
    del pool
    torch.cuda.empty_cache()
    return row, launches


def launch_counts(page_size: int, gen: torch.Generator, kv: torch.dtype) -> dict[str, list[str]]:
    pool, pages = make_pool(page_size, 8, gen, kv)
    i = torch.arange(4 * page_size)
    loc = (torch.tensor(pages)[i // page_size] * page_size + i % page_size).cuda()
    proj = torch.randn(loc.numel(), D, device="cuda").to(BF16)
    weight = (torch.rand(R, device="cuda") + 0.5).to(BF16)
    geo = (0, L, page_size, R, DR, kv)
    return {
        "mla_kv_write": cuda_kernels(lambda: torch.ops.unimem.mla_kv_write(
            pool.arena, pool.v2p, loc, proj[:, :R], proj[:, R:], *geo)),
        "mla_kv_write_rmsnorm": cuda_kernels(lambda: torch.ops.unimem.mla_kv_write_rmsnorm(
            pool.arena, pool.v2p, loc, proj[:, :R], proj[:, R:], weight, 1e-6, *geo)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write (or a folder: the name of record)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8_e4m3", "fp8_e4m3fn", "fp8_e4m3fnuz"],
                    help="the rows' dtype (default bf16)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla_write.py needs a CUDA device")
    kv = kv_dtype_of(a.kv_dtype)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    peak = copy_bandwidth(1 << 30)
    rows = write_cases(a.page_size, gen, peak, kv)
    g_row, g_launch = gather_case(a.page_size, gen, peak, kv)
    rows.append(g_row)
    launches = launch_counts(a.page_size, gen, kv)
    launches["mla_gather"] = g_launch

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"page_size {a.page_size}  copy peak {peak / 1e9:.0f} GB/s (1 GiB, read + write)")
    print(f"{'op':22} {'size':>14} {'bytes':>12} {'us':>9} {'GB/s':>8} {'/peak':>6} {'/copy':>6} {'torch us':>9}")
    for r in rows:
        size = f"T={r['tokens']}" if "tokens" in r else f"B={r['batch']}x{r['context']}"
        print(f"{r['op']:22} {size:>14} {r['bytes']:>12} {r['median_us']:>9.2f} {r['gbs']:>8.0f} "
              f"{r['fraction_of_copy_peak']:>6.2f} {r['fraction_of_same_size_copy']:>6.2f} {r['baseline_us']:>9.2f}")
    for name, ks in launches.items():
        print(f"CUDA kernels per {name} call: {len(ks)} {ks}")
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "geometry": {"layer_num": L, "kv_lora_rank": R, "qk_rope_head_dim": DR,
                     "dtype": str(kv).replace("torch.", ""), "row_bytes": row_bytes(kv), "page_size": a.page_size},
        "copy_peak_gbs": peak / 1e9, "timing": "triton.testing.do_bench median, L2 flushed",
        "rows": rows, "kernels_per_call": {k: len(v) for k, v in launches.items()},
        "kernel_names": launches,
    }
    out = a.out
    if os.path.isdir(out):
        suffix = {torch.float8_e4m3fn: "_fp8", torch.float8_e4m3fnuz: "_fp8_fnuz"}.get(kv, "")
        out = os.path.join(out, f"mla_write_{datetime.date.today().isoformat()}{suffix}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
