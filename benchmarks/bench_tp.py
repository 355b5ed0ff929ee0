"""Tensor parallel against one GPU: decode speed, memory per GPU and arena capacity per GPU (issue 25).

The same script runs as one process (TP 1: plain ``unimem_compile.compile``) or under torchrun (TP N:
``compile(..., tensor_parallel=True)`` over NCCL, one GPU per rank); the TP N run reads the TP 1 record and
adds the ratios:

    python3 -P benchmarks/bench_tp.py --out $OUT/json/tp1.json
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python3 -P -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_tp.py \\
        --out $OUT/json/tp2.json --baseline $OUT/json/tp1.json
    (benchmarks/gpu_session.sh bench_tp runs both; CPU check of the whole path:
     python benchmarks/bench_tp.py --smoke --out /tmp/tp1.json and the same under torchrun with gloo)

Model: ``kimi-linear-48b-8l`` (the real Kimi-Linear-48B per-layer geometry, (KDA, KDA, KDA, MLA) x 2, an
8-expert MoE), bf16, random weights from one seed on every rank. Configurations: batch 1 and 32, prompt 512
and 4096, 64 new tokens, greedy, no early stop. Per configuration, on a fresh model: compile (Inductor, CUDA
graphs for decode, ``memory_budget=None``: the batch's full rows and states), one untimed warm-up
generate(), then ``--repeats`` timed ones, each step timestamped by a logits processor (CUDA events):
decode tokens/s = batch x (new - 1) / (first to last step), best run. Per GPU (gathered from every rank):
peak memory (``torch.cuda.max_memory_allocated`` over the timed runs), weight bytes, arena bytes, and the
arena's concurrent-request capacity: how many requests of the configuration's length (and of 4k / 32k /
128k tokens) an arena of 90% of the memory left free beside the weights and the compiled graphs would hold
(computed with the pool's own layout math, not allocated). Every rank's tokens are compared (they must
agree); with ``--baseline`` the fraction of new tokens equal to TP 1's is recorded (bf16: a near-tie may
flip a token, so a sanity figure, not a parity test).

The record (``--out``) is rewritten after every configuration, so a run stopped by a time limit keeps what
it measured; configurations already in it are skipped (``--deadline-s`` stops before one that would not
fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from unimem_compile.demo import StepClock

#: most important first
CONFIGS = [(32, 512), (32, 4096), (1, 512), (1, 4096)]
SMOKE_CONFIGS = [(2, 24), (1, 16)]
#: seconds one configuration is assumed to take before one has run (Inductor compile of the prefill and
#: decode graphs of the 8-layer model plus the runs; no measurement yet: a guess with headroom)
PRIOR_S = {"cuda": 150.0, "cpu": 60.0}
CAPACITY_TOKENS = (4096, 32768, 131072)


@dataclasses.dataclass(frozen=True)
class Rank:
    rank: int
    world: int
    device: torch.device

    @property
    def parallel(self) -> bool:
        return self.world > 1


def setup(smoke: bool) -> Rank:
    """One process (no torchrun) or one rank of a torchrun launch (NCCL on CUDA, gloo with --smoke)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if smoke:
        device = torch.device("cpu")
    else:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if world > 1:
        dist.init_process_group("gloo" if smoke else "nccl", timeout=datetime.timedelta(seconds=600))
        return Rank(dist.get_rank(), dist.get_world_size(), device)
    return Rank(0, 1, device)


def gather(rank: Rank, value):
    """``value`` of every rank, in rank order (a one-item list in one process)."""
    if not rank.parallel:
        return [value]
    out = [None] * rank.world
    dist.all_gather_object(out, value)
    return out


def free(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()
        gc.collect()
        torch.cuda.empty_cache()


def timed_generate(model, ids, new: int, device: torch.device):
    clock = StepClock(device)
    clock.mark()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, logits_processor=[clock])
    return out, clock.elapsed(0, 1), clock.elapsed(1, len(clock.marks) - 1), len(clock.marks) - 2


def capacity(model, device: torch.device, tokens: list[int]) -> dict:
    """Requests of each length an arena of 90% of the memory free now plus the model's own arena would hold
    (the pool's layout math; nothing is allocated). CPU: the model's own arena only."""
    from unimem_compile.pool import ArenaLayout, max_requests

    layout = model.unimem.pool.layout
    budget = layout.memory_budget
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        budget = int(0.9 * (free_bytes + cached + layout.memory_budget))
    arena = ArenaLayout(budget, layout.page_size, layout.kv, layout.state)
    return {"arena_bytes": budget, **{str(t): max_requests(arena, t) for t in tokens}}


def run_config(batch: int, prompt: int, args, rank: Rank) -> dict:
    import unimem_compile
    from unimem_compile.hf.models import build_model

    free(rank.device)
    cuda = rank.device.type == "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = build_model(args.model, dtype=dtype, device=rank.device, seed=args.seed)
    new = args.new_tokens
    unimem_compile.compile(model, max_batch_size=batch, max_seq_len=prompt + new, memory_budget=None,
                           backend=args.backend, cudagraphs=cuda, tensor_parallel=rank.parallel)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=gen).to(rank.device)
    t0 = time.perf_counter()
    timed_generate(model, ids, new, rank.device)  # warm-up: compiles, records CUDA graphs
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize(rank.device)
        torch.cuda.reset_peak_memory_stats(rank.device)
    runs = [timed_generate(model, ids, new, rank.device) for _ in range(args.repeats)]
    out, steps = runs[-1][0], runs[-1][3]
    decode = min(r[2] for r in runs)
    per_gpu = gather(rank, {
        "peak_memory_bytes": torch.cuda.max_memory_allocated(rank.device) if cuda else None,
        "weight_bytes": weight_bytes,
        "pool_bytes": model.unimem.pool.layout.memory_budget,
        "slot_bytes": model.unimem.pool.layout.slot_bytes,
        "capacity": capacity(model, rank.device, sorted({prompt + new, *CAPACITY_TOKENS})),
        "tokens": out[:, prompt:].tolist(),
    })
    tokens = per_gpu[0]["tokens"]
    record = {
        "config": {"model": args.model, "batch": batch, "prompt": prompt, "new_tokens": new},
        "tp": rank.world,
        "decode_tokens_per_s": batch * steps / decode if decode > 0 else None,
        "ms_per_step": decode * 1e3 / steps if steps else None,
        "prefill_ms": min(r[1] for r in runs) * 1e3,
        "warmup_s": warmup_s,
        "runs": [{"prefill_ms": r[1] * 1e3, "decode_ms": r[2] * 1e3} for r in runs],
        "ranks_agree": all(g["tokens"] == tokens for g in per_gpu),
        "per_gpu": [{k: v for k, v in g.items() if k != "tokens"} for g in per_gpu],
        "rewrites": model.unimem.rewrites,
        "tokens": tokens,
    }
    del model, runs, out
    free(rank.device)
    return record


def add_ratios(record: dict, baseline: dict | None) -> None:
    """TP N over TP 1 for the same configuration: decode tokens/s, peak memory and capacity per GPU, and the
    fraction of new tokens equal to TP 1's."""
    if not baseline:
        return
    gpu, base_gpu = record["per_gpu"][0], baseline["per_gpu"][0]
    ratios = {}
    if record.get("decode_tokens_per_s") and baseline.get("decode_tokens_per_s"):
        ratios["decode_tokens_per_s"] = record["decode_tokens_per_s"] / baseline["decode_tokens_per_s"]
    peak = max((g["peak_memory_bytes"] or 0) for g in record["per_gpu"])
    if peak and base_gpu["peak_memory_bytes"]:
        ratios["peak_memory_per_gpu"] = peak / base_gpu["peak_memory_bytes"]
    for key, value in gpu["capacity"].items():
        if key != "arena_bytes" and base_gpu["capacity"].get(key):
            ratios[f"capacity_{key}_tokens_per_gpu"] = value / base_gpu["capacity"][key]
    record["ratios_vs_tp1"] = ratios
    new, base = record["tokens"], baseline["tokens"]
    same = sum(a == b for r, q in zip(new, base) for a, b in zip(r, q))
    record["new_tokens_equal_to_tp1"] = same / max(1, sum(len(r) for r in new))


def environment(rank: Rank) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "world_size": rank.world,
           "device": str(rank.device.type),
           "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    if rank.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(rank.device)
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON record (resumed: configurations in it are skipped)")
    p.add_argument("--baseline", default=None, help="the TP 1 record: adds ratios_vs_tp1 per configuration")
    p.add_argument("--model", default=None, help="default kimi-linear-48b-8l (kimi-linear-tiny with --smoke)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (4 with --smoke)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backend", default=None, help="inner backend (default inductor; aot_eager with --smoke)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline-s", type=float, default=None, help="stop before a configuration that would end past this")
    p.add_argument("--smoke", action="store_true", help="CPU (gloo under torchrun), tiny model, small sizes")
    args = p.parse_args(argv)
    args.model = args.model or ("kimi-linear-tiny" if args.smoke else "kimi-linear-48b-8l")
    args.new_tokens = args.new_tokens or (4 if args.smoke else 64)
    args.backend = args.backend or ("aot_eager" if args.smoke else "inductor")
    if not args.smoke and not torch.cuda.is_available():
        print("bench_tp: CUDA is not available (use --smoke for the CPU check)", file=sys.stderr)
        return 2
    rank = setup(args.smoke)
    start = time.perf_counter()
    try:
        record = {}
        if os.path.exists(args.out):
            with open(args.out) as f:
                record = json.load(f)
        baseline = {}
        if args.baseline:
            with open(args.baseline) as f:
                baseline = json.load(f).get("configs", {})
        record.update({"environment": environment(rank), "command": " ".join(sys.argv)})
        record.setdefault("configs", {})
        slowest = PRIOR_S[rank.device.type]
        for batch, prompt in SMOKE_CONFIGS if args.smoke else CONFIGS:
            name = f"{args.model}_b{batch}_p{prompt}"
            if name in record["configs"]:
                continue
            if args.deadline_s is not None and time.perf_counter() - start + slowest > args.deadline_s:
                if rank.rank == 0:
                    print(f"bench_tp: deadline: {name} would not finish in time; stopping", flush=True)
                break
            t0 = time.perf_counter()
            try:
                result = run_config(batch, prompt, args, rank)
                add_ratios(result, baseline.get(name))
            except Exception as e:  # noqa: BLE001 - recorded; the next configuration still runs
                if rank.parallel:  # the other ranks may be inside a collective: stop the launch (torchrun ends it)
                    raise
                result = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
                free(rank.device)
            result["wall_s"] = time.perf_counter() - t0
            slowest = max(slowest, result["wall_s"])
            record["configs"][name] = result
            if rank.rank == 0:
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out + ".tmp", "w") as f:
                    json.dump(record, f, indent=1)
                os.replace(args.out + ".tmp", args.out)
                summary = {k: result.get(k) for k in ("decode_tokens_per_s", "ms_per_step", "ranks_agree",
                                                      "ratios_vs_tp1", "error")}
                print(f"bench_tp TP {rank.world} {name}: {json.dumps(summary)}", flush=True)
    finally:
        if rank.parallel:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
