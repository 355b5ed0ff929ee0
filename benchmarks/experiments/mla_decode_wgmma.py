"""Issue 4: the Hopper stage-1 kernel (ops/mla_decode_hopper.py: TMA page loads + token-major wgmma, Gluon)
against the portable Triton kernel, same run, same inputs. Correctness on ragged rows first (both forms
against the fp32 reference), then CUDA-graph timings (PERF.md method, bench_mla_decode.bench_graph) at
the issue's points and a split-count sweep of the wgmma form.

usage (GPU, repo root, after `source benchmarks/device_env.sh`):
    python3 -P benchmarks/experiments/mla_decode_wgmma.py [--reps 2] [--quick]   (JSON -> $OUT/wgmma.json)
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402
import triton  # noqa: E402

from bench_mla_decode import H, Setup, bench_graph, effective_bytes, md, read_ceiling_tbs  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=2)
ap.add_argument("--quick", action="store_true")
ap.add_argument("--splits", default="1,2,3,4,6,8", help="split counts of the wgmma sweep at 64x4k and 32x4k")
args = ap.parse_args()
OUT = os.environ.get("OUT", "/tmp")
t_start = time.time()
res = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
       "triton": triton.__version__, "ceiling": read_ceiling_tbs(), "checks": [], "points": {}, "splits": {}}
print("ceiling", res["ceiling"], flush=True)
shapes = [(64, 4096), (128, 4096), (64, 16384), (32, 4096), (256, 4096), (1, 32768), (8, 4096), (64, 1024),
          (128, 16384), (32, 32768)]
if args.quick:
    shapes = shapes[:5]
setup = Setup(max(b * c for b, c in shapes))
sm = 192 ** -0.5

# correctness: ragged rows incl. 0, 1, 63, 64, 65 tokens and a partial last tile
qn, qr, pt, kl = setup.inputs(8, 4096)
kl.copy_(torch.tensor([1, 100, 2049, 4096, 0, 63, 64, 65], dtype=torch.int32))
a = setup.args(qn, qr, pt, kl, sm)
want = md.mla_decode_reference(*a).float()
for kernel in ("portable", "wgmma"):
    for sp in (None, 1, 2, 5, 8):
        got = md.mla_decode_triton(*a, kernel=kernel, num_splits=sp).float()
        err = float((got - want).abs().max())
        res["checks"].append({"kernel": kernel, "splits": sp, "max_abs_err": err, "finite": bool(got.isfinite().all())})
        print("check", kernel, sp, err, flush=True)

for b, c in shapes:
    qn, qr, pt, kl = setup.inputs(b, c)
    a = setup.args(qn, qr, pt, kl, sm)
    eb = effective_bytes(b, c)
    row = {"portable": [], "wgmma": [], "wgmma_bf16p": []}
    for _ in range(args.reps):
        row["portable"].append(round(eb / bench_graph(lambda: md.mla_decode_triton(*a, kernel="portable")) / 1e9, 4))
        row["wgmma"].append(round(eb / bench_graph(lambda: md.mla_decode_triton(*a, kernel="wgmma")) / 1e9, 4))
        row["wgmma_bf16p"].append(round(eb / bench_graph(
            lambda: md.mla_decode_triton(*a, kernel="wgmma", partial_dtype=torch.bfloat16)) / 1e9, 4))
    row["wgmma_default_splits"] = md.mla_decode_num_splits(b, pt.shape[1], H, 64, qn.device, blocks_per_sm=1)
    res["points"][f"{b}x{c}"] = row
    print(f"{b}x{c}", row, f"{time.time() - t_start:.0f}s", flush=True)

for b, c in ((64, 4096), (32, 4096), (128, 4096)):
    qn, qr, pt, kl = setup.inputs(b, c)
    a = setup.args(qn, qr, pt, kl, sm)
    eb = effective_bytes(b, c)
    row = {}
    for sp in map(int, args.splits.split(",")):
        row[sp] = round(eb / bench_graph(lambda: md.mla_decode_triton(*a, kernel="wgmma", num_splits=sp)) / 1e9, 4)
    res["splits"][f"{b}x{c}"] = row
    print("splits", f"{b}x{c}", row, flush=True)
res["elapsed_s"] = time.time() - t_start
json.dump(res, open(f"{OUT}/wgmma.json", "w"), indent=1)

# ring depth 1 (112.5 KiB: two programs per SM) against 2 (184 KiB: one per SM), with split counts for both
if os.environ.get("STAGES_SWEEP"):
    res["stages"] = {}
    for b, c in ((64, 4096), (32, 4096), (128, 4096), (64, 16384), (256, 4096)):
        qn, qr, pt, kl = setup.inputs(b, c)
        a = setup.args(qn, qr, pt, kl, sm)
        eb = effective_bytes(b, c)
        row = {}
        for stages in (1, 2):
            if stages == 1:
                got = md.mla_decode_triton(*a, kernel="wgmma", wgmma_stages=1).float()
                row["err_1"] = float((got - md.mla_decode_reference(*a).float()).abs().max())
            for bps in (1, 2, 3):
                sp = md.mla_decode_num_splits(b, pt.shape[1], H, 64, qn.device, blocks_per_sm=bps)
                row[f"st{stages}_sp{sp}"] = round(eb / bench_graph(
                    lambda: md.mla_decode_triton(*a, kernel="wgmma", num_splits=sp, wgmma_stages=stages)) / 1e9, 4)
        res["stages"][f"{b}x{c}"] = row
        print("stages", f"{b}x{c}", row, flush=True)
    json.dump(res, open(f"{OUT}/wgmma.json", "w"), indent=1)

# chunk-by-chunk refill of a ring buffer as the value products release it, against refilling after all
# of them (mla_decode_triton's wgmma_early_refill), alternating the two forms per repeat
if os.environ.get("EARLY_SWEEP"):
    res["early_refill"] = {"checks": [], "points": {}}
    qn, qr, pt, kl = setup.inputs(8, 4096)
    kl.copy_(torch.tensor([1, 100, 2049, 4096, 0, 63, 64, 65], dtype=torch.int32))
    a = setup.args(qn, qr, pt, kl, sm)
    want = md.mla_decode_reference(*a).float()
    for sp in (None, 1, 2, 5):
        got = md.mla_decode_triton(*a, kernel="wgmma", num_splits=sp, wgmma_early_refill=True).float()
        res["early_refill"]["checks"].append({"splits": sp, "max_abs_err": float((got - want).abs().max()),
                                              "finite": bool(got.isfinite().all())})
    print("early checks", res["early_refill"]["checks"], flush=True)
    pts = [(64, 4096), (128, 4096), (64, 16384), (32, 4096), (256, 4096), (1, 32768), (8, 4096), (32, 32768)]
    for b, c in pts:
        qn, qr, pt, kl = setup.inputs(b, c)
        a = setup.args(qn, qr, pt, kl, sm)
        eb = effective_bytes(b, c)
        row = {"late": [], "early": []}
        for _ in range(3):
            for name, flag in (("late", False), ("early", True)):
                row[name].append(round(eb / bench_graph(
                    lambda: md.mla_decode_triton(*a, kernel="wgmma", wgmma_early_refill=flag)) / 1e9, 4))
        res["early_refill"]["points"][f"{b}x{c}"] = row
        print("early", f"{b}x{c}", row, flush=True)
    json.dump(res, open(f"{OUT}/wgmma.json", "w"), indent=1)
