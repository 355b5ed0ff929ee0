"""Decode step time of Kimi-Linear at its real per-layer geometry with and without the state rewrites
(``kda_state_inplace`` + ``conv_state_inplace``), side by side in one run.

Setup: ``kimi-linear-48b-4l`` (hidden 2304; 3 KDA layers of 32 heads x 128 x 128 fp32 states with a conv
over 12288 channels, 1 MLA layer; random weights, bf16) compiled by ``unimem_compile.compile`` with the
Inductor backend, once with ``passes=False`` ("without") and once with the two state rewrites only
("with"; the MLA rewrites stay off in both, so the difference is the state path alone). Per batch size:
random prompts of ``--prompt`` tokens (no padding), greedy ``generate`` of ``--steps`` tokens. The
prefill runs eagerly (``torch.compiler.set_stance("force_eager")``; it is the same in both
configurations and not measured), so only decode graphs are compiled, one static graph per batch size.

Measured: every decode forward is timed with a device synchronisation before and after (wall time of the
forward alone, generate's own per-step work excluded); the first ``--warmup`` decode steps (compile,
CUDA-graph recording) are dropped and the median of the rest is reported, with tokens/s = batch / step.
Ceiling (PERF.md): the device copy bandwidth measured in the same run (1 GiB, read + write); "state floor"
is the time the KDA state traffic of one step needs at that bandwidth (per KDA layer: the fp32 recurrent
state read + written, the bf16 conv state read + written, for every row).

usage: python benchmarks/bench_state_passes.py --out results.json [--batches 8 32] [--cudagraphs]
(on the GPU machine: ``source benchmarks/device_env.sh`` first; keep TRITON_INTERPRET unset or 0.
``--device cpu --model kimi-linear-tiny --prompt 16 --steps 6 --batches 2`` is a quick dry run on a CPU.)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import unimem_compile
from unimem_compile.hf.models import build_model

MINE = ("kda_state_inplace", "conv_state_inplace")


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy of 1 GiB, counting read + write, in bytes/s (None off CUDA)."""
    if device.type != "cuda":
        return None
    from triton.testing import do_bench

    n = 1 << 30
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * n / (ms * 1e-3)


def state_bytes_per_step(model, batch: int) -> int:
    """KDA state bytes one decode step must move: recurrent (fp32) and conv (model dtype) states, read and
    written, for every row and KDA layer."""
    spec = model.unimem.adapter.state_spec
    total = 0
    for layer in spec.layers:
        rec = 4
        for s in layer.recurrent.shape:
            rec *= s
        conv = torch.empty((), dtype=layer.conv.dtype).element_size()
        for s in layer.conv.shape:
            conv *= s
        total += 2 * batch * (rec + conv)
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_config(name: str, passes, args, device: torch.device) -> list[dict]:
    """Compile one model with ``passes`` and time its decode steps at every batch size."""
    torch._dynamo.reset()
    model = build_model(args.model, dtype=torch.bfloat16, device=device)
    unimem_compile.compile(model, max_batch_size=max(args.batches), max_seq_len=args.prompt + args.steps + 1,
                           page_size=64, backend="inductor", passes=passes, cudagraphs=args.cudagraphs)
    model.unimem.use_runner = False  # it times the forward of each step of transformers' own loop
    inner = model.forward
    steps: list[float] = []

    def timed_forward(*a, **kw):
        prefill = kw["input_ids"].shape[1] > 1
        _sync(device)
        start = time.perf_counter()
        if prefill:
            with torch.compiler.set_stance("force_eager"):
                out = inner(*a, **kw)
        else:
            out = inner(*a, **kw)
        _sync(device)
        if not prefill:
            steps.append(time.perf_counter() - start)
        return out

    model.forward = timed_forward
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batches:
        ids = torch.randint(3, vocab, (batch, args.prompt), generator=gen).to(device)
        steps.clear()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.steps + 1,
                           min_new_tokens=args.steps + 1, do_sample=False)
        kept = steps[args.warmup:]
        step = statistics.median(kept)
        rows.append({
            "config": name, "batch": batch, "decode_steps_timed": len(kept), "step_ms": step * 1e3,
            "step_ms_min": min(kept) * 1e3, "step_ms_max": max(kept) * 1e3, "first_decode_s": steps[0],
            "tokens_per_s": batch / step, "state_bytes_per_step": state_bytes_per_step(model, batch),
        })
        print(f"  {name:8s} batch {batch:3d}: {step * 1e3:8.3f} ms/step ({batch / step:9.1f} tok/s), "
              f"first decode step {steps[0]:.1f} s", flush=True)
    for r in rows:
        r["rewrites"] = dict(model.unimem.rewrites)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--model", default="kimi-linear-48b-4l")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per batch size (warm-up included)")
    ap.add_argument("--warmup", type=int, default=3, help="decode steps dropped (compile, CUDA-graph recording)")
    ap.add_argument("--cudagraphs", action="store_true", help="Inductor's triton.cudagraphs for the decode graphs")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error("--steps must be larger than --warmup")
    device = torch.device(args.device)
    import transformers

    ceiling = copy_bandwidth(device)
    rows = []
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # one static decode graph per batch size
        for name, passes in (("without", False), ("with", MINE)):
            rows += run_config(name, passes, args, device)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}  torch {torch.__version__}  "
          f"transformers {transformers.__version__}  model {args.model} bf16  prompt {args.prompt}  "
          f"cudagraphs {args.cudagraphs}")
    if ceiling:
        print(f"copy bandwidth (read + write, 1 GiB): {ceiling / 1e12:.2f} TB/s")
    print(f"{'batch':>5s} {'without ms':>11s} {'with ms':>9s} {'speedup':>8s} {'with tok/s':>11s} "
          f"{'state MB':>9s} {'state floor ms':>15s}")
    summary = []
    for batch in args.batches:
        off = next(r for r in rows if r["config"] == "without" and r["batch"] == batch)
        on = next(r for r in rows if r["config"] == "with" and r["batch"] == batch)
        floor = on["state_bytes_per_step"] / ceiling * 1e3 if ceiling else None
        summary.append({"batch": batch, "speedup": off["step_ms"] / on["step_ms"], "state_floor_ms": floor})
        print(f"{batch:5d} {off['step_ms']:11.3f} {on['step_ms']:9.3f} {off['step_ms'] / on['step_ms']:8.2f} "
              f"{on['tokens_per_s']:11.1f} {on['state_bytes_per_step'] / 1e6:9.1f} "
              f"{'-' if floor is None else f'{floor:.3f}':>15s}")
    result = {
        "device": name,
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "model": args.model, "dtype": "bfloat16", "prompt": args.prompt, "steps": args.steps, "warmup": args.warmup,
        "cudagraphs": args.cudagraphs, "copy_bytes_per_s": ceiling, "rows": rows, "summary": summary,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
