"""Tensor-parallel generate(): one process per rank, each holding its shard of the model and its own pool.

    torchrun --nproc-per-node 2 examples/generate_tp.py --device cpu --json     # gloo, tiny model, fp32
    torchrun --nproc-per-node 2 examples/generate_tp.py --device cuda          # NCCL, one GPU per rank

Every rank builds the same model (same seed: same weights) and calls
``unimem_compile.compile(model, ..., tensor_parallel=True)``, which cuts the MLA and KDA heads, the MLP /
expert widths and the lm_head's vocabulary over the ranks; every rank then runs ``generate()`` on the same
prompts. For the check, every rank also generates from the same prompts with stock transformers on an
unsharded copy of the same weights (one process's result, no compile): ``tokens_match`` says whether every
rank's greedy tokens equal it (fp32: exactly; in bf16 a near-tie may flip a token).

Rank 0 prints one JSON line with ``--json`` (docs/design.md section 8): ``world_size``, ``tokens_match``,
``pool_bytes_per_rank`` (each rank's arena: the full latent rows, 1/N of the KDA states),
``pool_bytes_one_process`` (the arena ``compile()`` sizes for the unsharded model with the same options,
computed without allocating it), ``tokens_per_s`` (warm decode tokens per second of the tensor-parallel
generate, compile excluded), and a few more.
"""

import argparse
import datetime
import json
import os
import sys

import math

import torch
import torch.distributed as dist

import unimem_compile
from unimem_compile.demo import StepClock
from unimem_compile.hf.adapters import adapter_for
from unimem_compile.hf.models import MODEL_PRESETS, build_model
from unimem_compile.pool import ArenaLayout


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--model", default="kimi-linear-tiny", choices=sorted(MODEL_PRESETS))
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="fp32 (default: greedy tokens compare exactly) or bf16")
    p.add_argument("--backend", default=None, help="inner torch.compile backend (default: aot_eager on cpu, "
                                                   "inductor on cuda)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt", type=int, default=24, help="prompt tokens per row")
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds the default process group's collectives wait for a late rank (default 600: "
                        "ranks compile their graphs at different speeds before the first collective)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the one-process stock transformers run (tokens_match is then null)")
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON line")
    return p.parse_args()


def timed_generate(model, ids, mask, new_tokens, device):
    """Greedy generate(): (output ids, seconds of its decode steps, decode steps), timed per step."""
    clock = StepClock(device)
    clock.mark()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, logits_processor=[clock])
    steps = len(clock.marks) - 2  # the start mark and the prefill step
    return out, clock.elapsed(1, len(clock.marks) - 1), steps


def one_process_arena_bytes(model, args) -> int:
    """The arena ``compile(memory_budget=None)`` builds for the unsharded ``model``: ``--batch`` full rows of
    prompt + new tokens and their states, the sink and the tail pad (docs/design.md section 5)."""
    adapter = adapter_for(model)
    rows, pages = args.batch, math.ceil((args.prompt + args.new_tokens) / args.page_size)
    return ArenaLayout.for_capacity(adapter.kv_spec, adapter.state_spec, args.page_size, pages * rows,
                                   rows if adapter.state_spec is not None else 0).memory_budget


def main() -> int:
    args = parse_args()
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        backend = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")

        model = build_model(args.model, dtype=dtype, device=device, seed=args.seed)
        pool_one = one_process_arena_bytes(model, args)  # before compile() cuts the model
        model = unimem_compile.compile(model, max_batch_size=args.batch, max_seq_len=args.prompt + args.new_tokens,
                                       page_size=args.page_size, backend=backend, cudagraphs=device.type == "cuda",
                                       tensor_parallel=True)
        gen = torch.Generator().manual_seed(args.seed + 1)  # the same prompts on every rank
        ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), generator=gen).to(device)
        mask = torch.ones_like(ids)
        timed_generate(model, ids, mask, args.new_tokens, device)  # warm-up: compiles the graphs
        out, decode_s, steps = timed_generate(model, ids, mask, args.new_tokens, device)
        tokens = out[:, args.prompt:].tolist()
        expected = None
        if not args.no_reference:  # stock transformers, one process, the same weights
            reference = build_model(args.model, dtype=dtype, device=device, seed=args.seed)
            expected = timed_generate(reference, ids, mask, args.new_tokens, device)[0][:, args.prompt:].tolist()
            del reference

        every_rank = [None] * world
        dist.all_gather_object(every_rank, tokens)
        result = {
            "world_size": world,
            "tokens_match": None if expected is None else all(t == expected for t in every_rank),
            "pool_bytes_per_rank": model.unimem.pool.layout.memory_budget,
            "pool_bytes_one_process": pool_one,
            "tokens_per_s": args.batch * steps / decode_s,
            "ranks_agree": all(t == every_rank[0] for t in every_rank),
            "model": args.model, "device": device.type, "dtype": args.dtype, "backend": backend,
            "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new_tokens,
            "rewrites": model.unimem.rewrites,
        }
        if rank == 0:
            if args.json:
                print(json.dumps(result), flush=True)
            else:
                verdict = {True: "match", False: "DIFFER from", None: "were not compared with"}[result["tokens_match"]]
                print(f"{world} ranks, {args.model} ({args.dtype}, {backend}): greedy tokens {verdict} "
                      f"one process's; arena {result['pool_bytes_per_rank']:,} bytes per rank vs {pool_one:,} in one "
                      f"process; {result['tokens_per_s']:.1f} decode tokens/s; first row {tokens[0]}")
        return 0 if result["tokens_match"] is not False else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
