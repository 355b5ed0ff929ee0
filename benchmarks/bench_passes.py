"""Decode step time of a compiled model with and without the MLA rewrites (mla_write_fusion + mla_absorb),
side by side in one run.

Model: the ``kimi-linear-48b-4l`` preset (the real Kimi-Linear-48B-A3B per-layer geometry, 3 KDA + 1 MLA
layers, 8-expert MoE) in bf16 with random weights. For each (prompt, batch) the model is compiled twice
with Inductor (CUDA graphs on by default), ``max_seq_len = prompt + 16`` as a user would size it: once
with every rewrite, once with the MLA ones off (``passes`` = the state rewrites only, so the difference
is the MLA rewrites alone; ``--baseline none`` turns every rewrite off instead). The pool holds
``prompt`` tokens per row on pages and a state per row, all random (never zeros); the timed call is one
decode forward (one new token per row, ``model(**inputs)`` as generate() calls it), so only the decode
graph is compiled. Times are ``triton.testing.do_bench`` medians.

Achieved bandwidth counts the bytes a decode step must move at the least (every weight once, all
experts; each row's latent rows of the context; each row's state read and written;
``unimem_compile.demo.decode_step_bytes``) over the step time, beside the HBM read ceiling measured in
the same run. Without the rewrites every step gathers all ``max_seq_len`` positions and expands them
through ``kv_b_proj``, so its time grows with ``batch x max_seq_len x heads x (dn + dv)``.

Runtime: two compiles of the decode graph per (prompt, batch), four pairs in the default grid, largest
first; ``--deadline-s`` skips the rows that would not finish in time (listed under "skipped" in the
JSON, which is rewritten after every row); ``--quick`` runs batch 32 at prompt 4096 only.

usage: python benchmarks/bench_passes.py [--out results.json] [--quick] [--deadline-s 180]
                                         [--batch 8 32] [--prompt 512 4096] [--baseline state-only|none]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import inspect
import json
import math
import platform
import time
from pathlib import Path

import torch

import unimem_compile
from unimem_compile.demo import decode_step_bytes
from unimem_compile.hf.models import build_model

NEW = 16
MLA_REWRITES = ("mla_write_fusion", "mla_absorb")


def _read_ceiling_tbs() -> float:
    """The HBM read ceiling of benchmarks/bench_mla_decode.py (one definition of the measurement)."""
    spec = importlib.util.spec_from_file_location("bench_mla_decode", Path(__file__).with_name("bench_mla_decode.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.read_ceiling_tbs()


def _fill_random(pool, seed: int) -> None:
    """Random bf16 bit patterns (|x| ~ 0.1, finite also when read as fp32 states) everywhere but the sink."""
    g = torch.Generator(device=pool.arena.device).manual_seed(seed)
    start = math.ceil(pool.layout.sink_floor / 2)
    typed = pool.arena[: pool.arena.numel() // 2 * 2].view(torch.bfloat16)
    chunk = 1 << 27
    for i in range(start, typed.numel(), chunk):
        part = typed[i: i + chunk]
        part.copy_(torch.randn(part.shape, generator=g, device=part.device) * 0.1)


def decode_inputs(model, batch: int, prompt: int, seed: int = 0) -> dict:
    """The keyword arguments of one decode forward with ``prompt`` tokens per row already in the pool (the
    cache is prepared as generate() prepares it; the prompt itself is never run)."""
    cache = model.unimem.new_cache(batch)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt + 1), generator=g).to(model.device)
    mask = torch.ones_like(ids)
    cache.prepare_step(ids[:, :prompt], mask[:, :prompt])  # the prompt's pages and the rows' slots
    _fill_random(model.unimem.pool, seed)
    # the wrapped prepare_inputs_for_generation prepares the decode step (one new page slot per row)
    # transformers 5.24 names the cache argument `cache` (5.17: `past_key_values`)
    key = "cache" if "cache" in inspect.signature(type(model).prepare_inputs_for_generation).parameters \
        else "past_key_values"
    return model.prepare_inputs_for_generation(ids, next_sequence_length=1, attention_mask=mask, use_cache=True,
                                               **{key: cache})


def run_step(model, inputs: dict):
    """One decode forward of the prepared step. Timing re-runs the same step (same locations, states
    updated in place): each run re-arms the cache's prepared flag, which a plain forward would refuse."""
    cache = inputs.get("past_key_values", inputs.get("cache"))
    cache.prepared = True
    return model(**inputs)


def _time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=200)
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3 * 1e3


def measure(name: str, batch: int, prompt: int, passes, device: torch.device, backend: str, cudagraphs: bool) -> dict:
    model = build_model(name, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
    unimem_compile.compile(model, max_batch_size=batch, max_seq_len=prompt + NEW, page_size=64, backend=backend,
                           passes=passes, cudagraphs=cudagraphs and device.type == "cuda")
    inputs = decode_inputs(model, batch, prompt)
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = run_step(model, inputs).logits
        if device.type == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        if not logits.isfinite().all():
            raise RuntimeError(f"non-finite logits at batch {batch}, prompt {prompt}, passes {passes}")
        ms = _time_ms(lambda: run_step(model, inputs), device)
    step_bytes = decode_step_bytes(model, model.unimem.adapter, batch, prompt + 1)
    result = {
        "batch": batch, "prompt": prompt, "max_seq_len": prompt + NEW,
        "passes": sorted(model.unimem.passes.enabled), "rewrites": dict(model.unimem.rewrites),
        "step_ms": ms, "tokens_per_s": batch / ms * 1e3, "step_bytes": step_bytes,
        "achieved_gbs": step_bytes / ms / 1e6, "compile_s": compile_s,
    }
    del model, inputs, logits
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="kimi-linear-48b-4l")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--prompt", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--quick", action="store_true", help="batch 32 at prompt 4096 only")
    parser.add_argument("--baseline", choices=["state-only", "none"], default="state-only",
                        help="the comparison run: the state rewrites only (default) or no rewrite at all")
    parser.add_argument("--no-cudagraphs", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu runs a smoke test of this script (use a tiny model)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="skip the rows that would end after this many seconds (0: run them all)")
    parser.add_argument("--out", help="write the results as JSON here (rewritten after every row)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    batches, prompts = ([32], [4096]) if args.quick else (args.batch, args.prompt)
    baseline = False if args.baseline == "none" else ["kda_state_inplace", "conv_state_inplace"]
    cudagraphs = not args.no_cudagraphs and device.type == "cuda"
    ceiling = _read_ceiling_tbs() if device.type == "cuda" else None
    result = {
        "benchmark": "bench_passes", "model": args.model, "dtype": "bf16" if device.type == "cuda" else "fp32",
        "backend": args.backend, "cudagraphs": cudagraphs, "baseline": args.baseline, "new_tokens_headroom": NEW,
        "read_ceiling_tbs": ceiling, "rows": [], "skipped": [],
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
    }
    header = (f"{'prompt':>6} {'batch':>5} | {'no MLA rewrites':>15} | {'MLA rewrites':>12} | {'speedup':>7} | "
              f"{'tok/s':>8} | {'GB/s':>6} {'of read':>7}")
    print(header)
    print("-" * len(header))
    # the most telling configuration first; a row whose expected duration (the longest so far) would
    # overrun --deadline-s is skipped and listed, and the JSON is rewritten after every row
    grid = sorted(((p, b) for p in prompts for b in batches), key=lambda pb: (-pb[0] * pb[1], -pb[1]))
    started, longest = time.perf_counter(), 0.0
    for prompt, batch in grid:
        if args.deadline_s and time.perf_counter() - started + longest > args.deadline_s:
            result["skipped"].append({"prompt": prompt, "batch": batch})
            print(f"{prompt:>6} {batch:>5} | skipped (deadline)")
            continue
        t0 = time.perf_counter()
        off = measure(args.model, batch, prompt, baseline, device, args.backend, cudagraphs)
        on = measure(args.model, batch, prompt, True, device, args.backend, cudagraphs)
        longest = max(longest, time.perf_counter() - t0)
        if any(on["rewrites"][n] == 0 for n in MLA_REWRITES) or any(off["rewrites"][n] for n in MLA_REWRITES):
            raise RuntimeError(f"unexpected rewrite counts: with {on['rewrites']}, without {off['rewrites']}")
        share = f"{on['achieved_gbs'] / (ceiling * 1e3):7.1%}" if ceiling else f"{'-':>7}"
        print(f"{prompt:>6} {batch:>5} | {off['step_ms']:>12.3f} ms | {on['step_ms']:>9.3f} ms | "
              f"{off['step_ms'] / on['step_ms']:>6.2f}x | {on['tokens_per_s']:>8.0f} | "
              f"{on['achieved_gbs']:>6.0f} {share}", flush=True)
        result["rows"].append({"prompt": prompt, "batch": batch, "without": off, "with": on,
                               "speedup": off["step_ms"] / on["step_ms"]})
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
    if ceiling:
        print(f"HBM read ceiling measured in this run: {ceiling:.2f} TB/s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
