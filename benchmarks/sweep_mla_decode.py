"""Tuning sweep of the paged MLA decode kernel: correctness of every variant first, then CUDA-graph timings
of heads per program, BLOCK_N, warps, stages and split counts at several batch x context points, with
each compiled variant's registers and shared memory; then the partial-output dtype and the per-token
page lookup (page size 1). Geometry and byte counting as in bench_mla_decode.py.

usage: python benchmarks/sweep_mla_decode.py --out sweep.json [--budget-s 240]
       python benchmarks/sweep_mla_decode.py --small-batch --out small.json   (split count x partial dtype x
           merge tile of the default stage-1 kernel at batch 1-64, contexts 1k-128k; the merge tile
           ``--merge 512x1`` is the one-program-per-(row, head) loop the merge was before)

The token-major form of the kernel (``--layouts heads,tokens``) was measured with this script at commit
8f210b6 and removed afterwards (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_mla_decode, also under python -P
from bench_mla_decode import H, Setup, bench_graph, effective_bytes, md, read_ceiling_tbs  # noqa: E402


def _cache_entries():
    """Compiled split kernels, by id (best effort: Triton's cache layout is internal)."""
    try:
        out = {}
        for caches in md._mla_decode_split_kernel.device_caches.values():
            for k in caches[0].values():
                out[id(k)] = k
        return out
    except Exception:  # noqa: BLE001 - diagnostics only
        return {}


def _resources(kernel, num_warps):
    """Registers, spills, shared memory, resident blocks per SM and the MMA instructions of a compiled kernel."""
    try:
        regs, smem = kernel.n_regs, kernel.metadata.shared
        by_regs = 65536 // max(1, regs * 32 * num_warps)
        by_smem = 232448 // max(1, smem + 1024)
        ptx = kernel.asm.get("ptx", "")
        return {"n_regs": regs, "n_spills": kernel.n_spills, "shared": smem, "resident": min(by_regs, by_smem, 32),
                "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync")}
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop timing new configs after this long")
    ap.add_argument("--shapes", default="32x4096,64x4096,128x4096,256x4096,64x16384,128x16384")
    ap.add_argument("--block-h", default="32")
    ap.add_argument("--block-n", default="64,32")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--bps", default="1,2,3,4", help="blocks per SM assumed by the split count")
    ap.add_argument("--small-batch", action="store_true", help="the small-batch sweep (see the module doc)")
    ap.add_argument("--merge", default="64x32,128x16,32x64,512x1", help="merge tiles RxS for --small-batch")
    ap.add_argument("--splits", default="0,16,33,66,132,264", help="split counts for --small-batch (0: default)")
    args = ap.parse_args()
    if args.small_batch:
        return small_batch_sweep(args)
    t_start = time.time()
    res = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "torch": torch.__version__, "triton": triton.__version__, "timing": "CUDA-graph replay, do_bench median",
           "correctness": [], "configs": [], "extra": {}}

    def dump():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    res["read_ceiling_tbs"] = ceiling = read_ceiling_tbs()
    print(f"read ceiling {ceiling:.2f} TB/s", flush=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    setup = Setup(max(b * c for b, c in shapes))
    sm_scale = 192 ** -0.5
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    variants = [(bh, bn, w, st) for bh in ints(args.block_h) for bn in ints(args.block_n)
                for w in ints(args.warps) for st in ints(args.stages)]

    # correctness first: ragged rows (1 token, a partial page, full pages) against the fp32 reference
    qn, qr, pt, kl = setup.inputs(4, 4096)
    kl.copy_(torch.tensor([1, 100, 2049, 4096], dtype=torch.int32))
    a = setup.args(qn, qr, pt, kl, sm_scale)
    want = md.mla_decode_reference(*a).float()
    bad = set()
    compiled = {}  # variant -> resources of its split kernel (compiled here, in the correctness pass)
    for bh, bn, w, st in variants:
        before = _cache_entries()
        for splits in (1, 5):
            cfg = dict(block_h=bh, block_n=bn, num_warps=w, num_stages=st, num_splits=splits)
            try:
                got = md.mla_decode_triton(*a, **cfg).float()
                err = float((got - want).abs().max())
                ok = err < 2e-2 and bool(got.isfinite().all())
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                err, ok = repr(e)[:300], False
            res["correctness"].append({**cfg, "max_abs_err": err, "ok": ok})
            if not ok:
                bad.add((bh, bn, w, st))
                print("FAILED", cfg, err, flush=True)
        new = [k for i, k in _cache_entries().items() if i not in before]
        compiled[(bh, bn, w, st)] = _resources(new[-1], w) if new else {}
    dump()
    print(f"correctness done ({len(bad)} bad variants) at {time.time() - t_start:.0f} s", flush=True)

    for bh, bn, w, st in variants:
        if (bh, bn, w, st) in bad:
            continue
        if time.time() - t_start > args.budget_s:
            print("budget exhausted", flush=True)
            break
        entry = {"block_h": bh, "block_n": bn, "num_warps": w, "num_stages": st, "points": []}
        for batch, context in shapes:
            qn, qr, pt, kl = setup.inputs(batch, context)
            a = setup.args(qn, qr, pt, kl, sm_scale)
            seen = set()
            for bps in ints(args.bps):
                splits = md.mla_decode_num_splits(batch, pt.shape[1], H, setup.ps, qn.device, block_n=bn,
                                                  block_h=bh, blocks_per_sm=bps)
                if splits in seen:
                    continue
                seen.add(splits)
                ms = bench_graph(lambda: md.mla_decode_triton(*a, block_h=bh, block_n=bn, num_warps=w,
                                                              num_stages=st, num_splits=splits))
                tbs = effective_bytes(batch, context) / ms / 1e9
                entry["points"].append({"batch": batch, "context": context, "bps": bps, "splits": splits,
                                        "us": ms * 1e3, "tbs": tbs})
        entry["kernel"] = compiled.get((bh, bn, w, st), {})
        res["configs"].append(entry)
        best = {}
        for p in entry["points"]:
            key = (p["batch"], p["context"])
            if p["tbs"] > best.get(key, (0, 0))[0]:
                best[key] = (p["tbs"], p["splits"])
        print(f"bh={bh} bn={bn} w={w} st={st} {entry['kernel']} "
              + " ".join(f"{b}x{c}:{v:.2f}/{s}" for (b, c), (v, s) in best.items()), flush=True)
        dump()

    summary = {}
    for entry in res["configs"]:
        for p in entry["points"]:
            key = f"{p['batch']}x{p['context']}"
            if key not in summary or p["tbs"] > summary[key]["tbs"]:
                summary[key] = {**{k: entry[k] for k in ("block_h", "block_n", "num_warps", "num_stages")},
                                "splits": p["splits"], "bps": p["bps"], "tbs": p["tbs"]}
    res["best"] = summary
    for k, v in summary.items():
        print("best", k, v, flush=True)
    dump()

    # the partial-output dtype at the defaults, and the per-token page lookup (page size 1)
    for batch, context in ((32, 4096), (64, 4096)):
        qn, qr, pt, kl = setup.inputs(batch, context)
        a = setup.args(qn, qr, pt, kl, sm_scale)
        for pdt in (torch.float32, torch.bfloat16):
            ms = bench_graph(lambda: md.mla_decode_triton(*a, partial_dtype=pdt))
            res["extra"][f"partial_{pdt}_{batch}x{context}"] = effective_bytes(batch, context) / ms / 1e9
    del setup
    torch.cuda.empty_cache()
    small = Setup(64 * 4096, page_size=1)
    qn, qr, pt, kl = small.inputs(64, 4096)
    a = small.args(qn, qr, pt, kl, sm_scale)
    for bn, w, st in ((64, 4, 2), (64, 4, 3), (32, 4, 2), (32, 4, 3), (16, 4, 2), (16, 4, 3)):
        try:
            ms = bench_graph(lambda: md.mla_decode_triton(*a, block_n=bn, num_warps=w, num_stages=st))
            res["extra"][f"ps1_bn{bn}_w{w}_st{st}"] = effective_bytes(64, 4096) / ms / 1e9
        except Exception as e:  # noqa: BLE001
            res["extra"][f"ps1_bn{bn}_w{w}_st{st}"] = repr(e)[:200]
    print("extra", res["extra"], flush=True)
    res["elapsed_s"] = time.time() - t_start
    dump()


def small_batch_sweep(args) -> None:
    """Split count, partial dtype and merge tile of the default stage-1 kernel where the batch is small."""
    t_start = time.time()
    res = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count, "torch": torch.__version__,
           "triton": triton.__version__, "timing": "CUDA-graph replay, do_bench median", "points": []}
    res["read_ceiling_tbs"] = read_ceiling_tbs()
    shapes = [(b, c) for b in (1, 8, 32, 64) for c in (1024, 4096, 16384, 32768, 65536, 131072)
              if b * c <= 4 * 2**20]
    setup = Setup(max(b * c for b, c in shapes))
    sm_scale = 192 ** -0.5
    merges = [tuple(int(v) for v in m.split("x")) for m in args.merge.split(",")]
    split_list = [int(v) for v in args.splits.split(",")]

    def dump():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    # correctness of every merge tile at a many-split ragged point, against the fp32 reference
    qn, qr, pt, kl = setup.inputs(4, 32768)
    kl.copy_(torch.tensor([1, 100, 20000, 32768], dtype=torch.int32))
    a = setup.args(qn, qr, pt, kl, sm_scale)
    want = md.mla_decode_reference(*a).float()
    for mr, ms_ in merges:
        for splits in (7, 132):
            got = md.mla_decode_triton(*a, num_splits=splits, merge_block_r=mr, merge_block_s=ms_).float()
            res.setdefault("correctness", []).append({"merge": f"{mr}x{ms_}", "splits": splits,
                                                      "max_abs_err": float((got - want).abs().max())})
    print("correctness", res["correctness"], flush=True)
    for batch, context in shapes:
        if time.time() - t_start > args.budget_s:
            print("budget exhausted", flush=True)
            break
        qn, qr, pt, kl = setup.inputs(batch, context)
        a = setup.args(qn, qr, pt, kl, sm_scale)
        tiles = context // 64
        line = []
        for splits in split_list:
            if splits > tiles:
                continue
            for pdt in (torch.float32, torch.bfloat16):
                for mr, ms_ in (merges if splits == 0 and pdt == torch.float32 else merges[:1]):
                    kw = {"partial_dtype": pdt, "merge_block_r": mr, "merge_block_s": ms_}
                    if splits:
                        kw["num_splits"] = splits
                    t = bench_graph(lambda: md.mla_decode_triton(*a, **kw))
                    tbs = effective_bytes(batch, context) / t / 1e9
                    res["points"].append({"batch": batch, "context": context, "splits": splits,
                                          "partial": str(pdt), "merge": f"{mr}x{ms_}", "us": t * 1e3,
                                          "tbs": tbs})
                    line.append(f"{splits}/{str(pdt)[-4:]}/{mr}x{ms_}:{tbs:.2f}")
        print(f"{batch}x{context}", " ".join(line), flush=True)
        dump()
    res["elapsed_s"] = time.time() - t_start
    dump()


if __name__ == "__main__":
    main()
