"""Tensor-parallel generate(): one process per rank, each holding its shard of the model and its own pool.

    torchrun --nproc-per-node 2 examples/generate_tp.py --device cpu --json     # gloo, tiny model, fp32
    torchrun --nproc-per-node 2 examples/generate_tp.py --device cuda          # NCCL, one GPU per rank

Every rank builds the same model (same seed: same weights) and calls
``unimem_compile.compile(model, ..., tensor_parallel=True)``, which cuts the MLA and KDA heads, the MLP /
expert widths and the lm_head's vocabulary over the ranks; every rank then runs ``generate()`` on the same
prompts. For the check, every rank also runs the same prompts through one unsharded compiled model (one
process's result on the same weights): ``tokens_match`` says whether every rank's greedy tokens equal it.

Rank 0 prints one JSON line with ``--json`` (docs/design.md section 8): ``world_size``, ``tokens_match``,
``pool_bytes_per_rank`` (each rank's arena: the full latent rows, 1/N of the KDA states),
``pool_bytes_one_process`` (the unsharded model's arena for the same batch and lengths), ``tokens_per_s``
(warm decode tokens per second of the tensor-parallel generate, compile excluded), and a few more.
"""

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import unimem_compile
from unimem_compile.demo import StepClock
from unimem_compile.hf.models import MODEL_PRESETS, build_model


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
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds the default process group's collectives wait for a missing rank (default 120)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the one-process run (tokens_match and pool_bytes_one_process are then null)")
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


def compiled(args, device, dtype, backend, tensor_parallel):
    model = build_model(args.model, dtype=dtype, device=device, seed=args.seed)
    return unimem_compile.compile(model, max_batch_size=args.batch, max_seq_len=args.prompt + args.new_tokens,
                                  page_size=args.page_size, backend=backend, cudagraphs=device.type == "cuda",
                                  tensor_parallel=tensor_parallel)


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

        model = compiled(args, device, dtype, backend, tensor_parallel=True)
        gen = torch.Generator().manual_seed(args.seed + 1)  # the same prompts on every rank
        ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), generator=gen).to(device)
        mask = torch.ones_like(ids)
        timed_generate(model, ids, mask, args.new_tokens, device)  # warm-up: compiles the graphs
        out, decode_s, steps = timed_generate(model, ids, mask, args.new_tokens, device)
        tokens = out[:, args.prompt:].tolist()

        reference = reference_tokens_per_s = pool_one = None
        if not args.no_reference:
            ref_model = compiled(args, device, dtype, backend, tensor_parallel=False)
            timed_generate(ref_model, ids, mask, args.new_tokens, device)
            ref_out, ref_s, ref_steps = timed_generate(ref_model, ids, mask, args.new_tokens, device)
            reference = ref_out[:, args.prompt:].tolist()
            reference_tokens_per_s = args.batch * ref_steps / ref_s
            pool_one = ref_model.unimem.pool.layout.memory_budget

        every_rank = [None] * world
        dist.all_gather_object(every_rank, tokens)
        result = {
            "world_size": world,
            "tokens_match": None if reference is None else all(t == reference for t in every_rank),
            "pool_bytes_per_rank": model.unimem.pool.layout.memory_budget,
            "pool_bytes_one_process": pool_one,
            "tokens_per_s": args.batch * steps / decode_s,
            "reference_tokens_per_s": reference_tokens_per_s,
            "ranks_agree": all(t == every_rank[0] for t in every_rank),
            "model": args.model, "device": device.type, "dtype": args.dtype, "backend": backend,
            "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new_tokens,
            "rewrites": model.unimem.rewrites,
        }
        if rank == 0:
            if args.json:
                print(json.dumps(result), flush=True)
            else:
                print(f"{world} ranks, {args.model} ({args.dtype}, {backend}): greedy tokens "
                      f"{'match' if result['tokens_match'] else 'DIFFER from'} one process's; "
                      f"arena {result['pool_bytes_per_rank']:,} bytes per rank"
                      + (f" vs {pool_one:,} in one process" if pool_one else "")
                      + f"; {result['tokens_per_s']:.1f} decode tokens/s; first row {tokens[0]}")
        return 0 if result["tokens_match"] is not False else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
