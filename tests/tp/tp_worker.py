"""One rank of the 2-rank tensor-parallel checks (tests/tp/test_ranks.py runs it under torchrun, gloo, CPU).

    python -m torch.distributed.run --nproc-per-node 2 tests/tp/tp_worker.py OUT_DIR

Each rank runs every scenario below in order and writes ``OUT_DIR/rank<r>.json``: ``{scenario: {"error":
"<Type>: <message>" or None, ...what it measured}}``; the test reads both files and checks them. The
scenarios that must fail are run on purpose; the last one leaves the ranks' group counters out of step,
which is why it is last.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

# the test sets TRITON_INTERPRET / HF_HUB_OFFLINE in the environment before torchrun starts this file
import unimem_compile
from unimem_compile.demo import teacher_forced_logits
from unimem_compile.hf.models import build_model, model_config

# three rows of room, calls of two rows: the divergence scenarios take one more slot on rank 1 only
MAX_BATCH, PROMPT, NEW, PAGE = 3, 20, 10, 8


def compiled(model, tensor_parallel=True, **kwargs):
    options = {"max_batch_size": MAX_BATCH, "max_seq_len": PROMPT + NEW, "page_size": PAGE, "backend": "aot_eager",
               **kwargs}
    return unimem_compile.compile(model, tensor_parallel=tensor_parallel, **options)


def prompts(vocab: int):
    """The same two prompts on every rank; row 1 left-padded by 6."""
    ids = torch.randint(3, vocab, (2, PROMPT), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0
    return ids, mask


def greedy(model, ids, mask, new=NEW):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[:, ids.shape[1]:]


def good_run(name: str, rank: int, model) -> dict:
    """Greedy tokens and teacher-forced logits of the 2-rank ``model`` against one process running stock
    transformers on the same weights; sampling with rank-specific seeds; a generate() under UNIMEM_DEBUG=1
    (every step's preparation and page tables are agreed)."""
    reference = build_model(name)
    ids, mask = prompts(model.config.vocab_size)
    ref_tokens = greedy(reference, ids, mask)
    tokens = greedy(model, ids, mask)
    ref_logits = teacher_forced_logits(reference, ids, mask, ref_tokens)
    logits = teacher_forced_logits(model, ids, mask, ref_tokens)
    torch.manual_seed(1000 + rank)  # a different seed per rank: generate() must give every rank rank 0's
    with torch.no_grad():
        sampled = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, temperature=1.5,
                                 top_k=0)[:, PROMPT:]
    os.environ["UNIMEM_DEBUG"] = "1"
    try:
        debug_tokens = greedy(model, ids, mask, new=3)
    finally:
        del os.environ["UNIMEM_DEBUG"]
    layout = model.unimem.pool.layout
    return {"tokens": tokens.tolist(), "reference": ref_tokens.tolist(), "debug_tokens": debug_tokens.tolist(),
            "max_abs_logit_diff": float((logits - ref_logits).abs().max()),
            "max_abs_logit": float(ref_logits.abs().max()), "sampled": sampled.tolist(),
            "pool_bytes": layout.memory_budget, "slot_bytes": layout.slot_bytes, "page_bytes": layout.page_bytes,
            "rewrites": model.unimem.rewrites,
            "local_config": model.unimem.tensor_parallel.plan.summary()["local_config"]}


def count_collectives(folder: str) -> dict:
    """Per rewritten graph of ``folder`` (UNIMEM_DUMP_GRAPHS), how many all-reduces and all-gathers it calls."""
    counts = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith("_after.py"):
            with open(os.path.join(folder, name)) as f:
                code = "\n".join(line for line in f if not line.lstrip().startswith("#"))  # not the source notes
            counts[name] = {"all_reduce": code.count("_c10d_functional.all_reduce("),
                            "all_gather": code.count("_c10d_functional.all_gather_into_tensor("),
                            "wait": code.count("_c10d_functional.wait_tensor(")}
    return {"graphs": counts}


def diverged_tables(rank: int, model) -> dict:
    """UNIMEM_DEBUG=1 and rank 1 holding one extra state slot: its tables differ, every rank must raise."""
    ids, mask = prompts(model.config.vocab_size)
    extra = model.unimem.pool.alloc_slots(1) if rank == 1 else []
    os.environ["UNIMEM_DEBUG"] = "1"
    try:
        greedy(model, ids, mask, new=2)
    finally:
        del os.environ["UNIMEM_DEBUG"]
        if extra:
            model.unimem.pool.free_slots(extra)


def different_inputs(rank: int, model) -> None:
    ids, mask = prompts(model.config.vocab_size)
    greedy(model, ids + rank, mask, new=2)


def full_pool_on_rank1(rank: int, model) -> None:
    """UNIMEM_DEBUG=1 and rank 1's pool too full for the step: every rank must raise, none wait."""
    ids, mask = prompts(model.config.vocab_size)
    pool = model.unimem.pool
    held = pool.alloc_slots(pool.layout.max_state_slots - 1) if rank == 1 else []
    os.environ["UNIMEM_DEBUG"] = "1"
    try:
        greedy(model, ids, mask, new=2)
    finally:
        del os.environ["UNIMEM_DEBUG"]
        if held:
            pool.free_slots(held)


def failing_call_on_rank1(rank: int, model) -> None:
    ids, mask = prompts(model.config.vocab_size)
    greedy(model, ids, mask, new=NEW + 5 if rank == 1 else 2)  # past max_seq_len on rank 1 only


def variant(name: str, **overrides):
    from transformers import AutoModelForCausalLM

    config = model_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def main() -> int:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict = {}

    def run(scenario: str, fn) -> None:
        start = time.perf_counter()
        try:
            value = fn()
            entry = {"error": None, **(value or {})}
        except Exception as e:  # noqa: BLE001 - the test checks which scenarios fail, and how
            entry = {"error": f"{type(e).__name__}: {e}"}
        entry["seconds"] = time.perf_counter() - start
        results[scenario] = entry

    models = {name: compiled(build_model(name)) for name in ("kimi-linear-tiny", "deepseek-v3-tiny")}
    run("good:kimi-linear-tiny", lambda: good_run("kimi-linear-tiny", rank, models["kimi-linear-tiny"]))
    graphs = os.path.join(out_dir, f"graphs{rank}")
    os.environ["UNIMEM_DUMP_GRAPHS"] = graphs  # the DeepSeek graphs, to count the collectives inside them
    try:
        run("good:deepseek-v3-tiny", lambda: good_run("deepseek-v3-tiny", rank, models["deepseek-v3-tiny"]))
    finally:
        del os.environ["UNIMEM_DUMP_GRAPHS"]
    run("collectives_in_graphs", lambda: count_collectives(graphs))
    model = models["kimi-linear-tiny"]
    run("diverged_tables", lambda: diverged_tables(rank, model))
    run("full_pool_on_rank1", lambda: full_pool_on_rank1(rank, model))
    run("different_inputs", lambda: different_inputs(rank, model))
    run("failing_call_on_rank1", lambda: failing_call_on_rank1(rank, model))
    run("after_refusals", lambda: {"tokens": greedy(model, *prompts(model.config.vocab_size), new=2).tolist()})

    run("mla_heads_3", lambda: compiled(variant("kimi-linear-tiny", num_attention_heads=3, num_key_value_heads=3)))
    run("kda_heads_3", lambda: compiled(variant("kimi-linear-tiny", linear_num_heads=3)))
    run("expert_width_65", lambda: compiled(variant("deepseek-v3-tiny", moe_intermediate_size=65)))
    run("different_weights", lambda: compiled(build_model("deepseek-v3-tiny", seed=rank)))
    run("different_budget", lambda: compiled(build_model("deepseek-v3-tiny"), memory_budget=(1 + rank) << 20))
    run("different_models", lambda: compiled(build_model(("kimi-linear-tiny", "deepseek-v3-tiny")[rank])))
    run("bad_option_on_rank1", lambda: compiled(build_model("deepseek-v3-tiny"), page_size=0 if rank else PAGE))
    # last: rank 1 never calls compile(), rank 0 must give up after UNIMEM_TP_TIMEOUT seconds
    os.environ["UNIMEM_TP_TIMEOUT"] = "4"
    run("rank1_absent", lambda: compiled(build_model("deepseek-v3-tiny")) if rank == 0 else None)

    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
