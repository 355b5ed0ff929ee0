"""Batch-1 decode: where does the step time go, (c) unimem vs (b) static, prompt 512 vs 4096.

Per config: warm up, a timed generate (StepClock), then torch.profiler over a 33-token and a 1-token
generate: the difference is 32 decode steps. Prints GPU kernel time per decode step (total and top kernels)
and wall time per step, and a cProfile of the host side (top by tottime) over one 33-token generate.

GPU machine, from the repository root: ``source benchmarks/device_env.sh; python3 -P
benchmarks/experiments/profile_decode_b1.py`` (writes ``$OUT/b1prof.log``; about 2 minutes)."""
import collections
import cProfile
import io
import os
import pstats
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_generate as bg
import torch
from torch.profiler import ProfilerActivity, profile

import unimem_compile
from unimem_compile.hf.models import build_model

dev = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
NEW = 33

def kernels(model, ids, kw, new):
    k = dict(kw, max_new_tokens=new, min_new_tokens=new)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.no_grad():
            model.generate(ids, **k)
        torch.cuda.synchronize()
    tot = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name[:90]] += e.device_time_total
    return tot

def run(system, batch, prompt, log):
    bg._free(dev)
    model = build_model("kimi-linear-48b-4l", dtype=torch.bfloat16, device=dev, seed=0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=gen).to(dev)
    kw = {"attention_mask": torch.ones_like(ids), "max_new_tokens": NEW, "min_new_tokens": NEW, "do_sample": False}
    if system == "static":
        kw["cache_implementation"] = "static"
    else:
        unimem_compile.compile(model, max_batch_size=batch, max_seq_len=prompt + 64, memory_budget=None,
                               backend="inductor", cudagraphs=True, passes=True)
    with torch.no_grad():
        model.generate(ids, **kw)
        model.generate(ids, **kw)
        model.generate(ids, **dict(kw, max_new_tokens=1, min_new_tokens=1))
    torch.cuda.synchronize()
    best = None
    for _ in range(3):
        _, _, dec, steps = bg.timed_generate(model, ids, kw, dev)
        best = min(best or 1e9, dec / steps)
    full = kernels(model, ids, kw, NEW)
    one = kernels(model, ids, kw, 1)
    diff = {k: (full[k] - one.get(k, 0)) / (NEW - 1) for k in full}
    gpu = sum(diff.values())
    name = f"{system}_b{batch}_p{prompt}"
    log.write(f"## {name}: wall decode {best*1e3:.3f} ms/step; GPU kernel time {gpu/1e3:.3f} ms/step\n")
    for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:18]:
        log.write(f"   {v:9.1f} us  {k}\n")
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    with torch.no_grad():
        model.generate(ids, **kw)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    log.write(s.getvalue()[:6000] + "\n")
    log.flush()
    print(f"{name}: {best*1e3:.3f} ms/step wall, {gpu/1e3:.3f} ms/step GPU", flush=True)
    del model
    bg._free(dev)

with open(f"{OUT}/b1prof.log", "w") as log:
    log.write(f"{torch.cuda.get_device_name()} torch {torch.__version__}\n")
    for system, b, p in [("unimem", 1, 512), ("unimem", 1, 4096), ("static", 1, 512), ("static", 1, 4096)]:
        try:
            run(system, b, p, log)
        except Exception:  # noqa: BLE001 - one failed configuration must not lose the others
            traceback.print_exc()
